"""Make the integration helpers (user reward module, W&B file reader) importable."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
