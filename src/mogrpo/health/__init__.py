"""Training health: the checks (`monitor`) and their settings (`config`, the `health` section)."""

from mogrpo.config.health import CheckConfig, HealthConfig
from mogrpo.health.monitor import Alert, HealthMonitor, HealthStop, StepContext

__all__ = ["Alert", "CheckConfig", "HealthConfig", "HealthMonitor", "HealthStop", "StepContext"]
