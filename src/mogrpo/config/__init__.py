"""The run configuration: typed sections (`sections`, on the shared `base`; the rollout's in
`rollout`, a task's KL control in `kl`, health checks, curriculum, memory and precision in
modules of their own), layered sources and validation before any model loads (`load`).

Every name is importable from here (`from mogrpo.config import RunConfig, load_config`). The
modules are imported on first use of a name (PEP 562), so `import mogrpo.config` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "ENV_PREFIX", "AlgorithmConfig", "DataSource", "EvalConfig", "KLControlConfig", "LoggingConfig",
    "LoraConfig", "ModelConfig", "OutputConfig", "RewardConfig", "RolloutConfig", "RunConfig",
    "SFTConfig", "SandboxConfig", "Section", "Sourced", "TaskConfig", "TrainConfig", "VLLMConfig",
    "callable_spec", "check_unknown_keys",
    "derive_lengths", "describe", "env_overrides", "field_reference", "flatten", "load_config",
    "parse_set", "parse_value", "read_yaml", "to_yaml", "validate",
]

if TYPE_CHECKING:
    from mogrpo.config.base import Section
    from mogrpo.config.load import (
        ENV_PREFIX,
        Sourced,
        check_unknown_keys,
        describe,
        env_overrides,
        field_reference,
        flatten,
        load_config,
        parse_set,
        parse_value,
        read_yaml,
        to_yaml,
        validate,
    )
    from mogrpo.config.rollout import RolloutConfig, VLLMConfig, derive_lengths
    from mogrpo.config.sections import (
        AlgorithmConfig,
        DataSource,
        EvalConfig,
        KLControlConfig,
        LoggingConfig,
        LoraConfig,
        ModelConfig,
        OutputConfig,
        RewardConfig,
        RunConfig,
        SandboxConfig,
        SFTConfig,
        TaskConfig,
        TrainConfig,
        callable_spec,
    )


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'mogrpo.config' has no attribute {name!r}")
    for module in ("base", "sections", "rollout", "load"):  # where each name lives: see the imports above
        found = importlib.import_module(f"mogrpo.config.{module}")
        if name in vars(found):
            globals()[name] = value = vars(found)[name]  # later look-ups do not come here
            return value
    raise AttributeError(name)  # listed in __all__ but defined nowhere: a bug here
