"""A model's config.json, read offline for the memory planner (no weights, no download)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from mogrpo.errors import ModelError

log = logging.getLogger(__name__)


def load_model_config(name_or_path: str, *, trust_remote_code: bool = False) -> Any:
    """The model's config (a transformers config, or the raw dict) from config.json; offline."""
    from transformers import AutoConfig

    path = Path(name_or_path).expanduser()
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8"))
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelError(f"{path} has no config.json; the memory planner needs the model's "
                         "config.json (pass the directory save_pretrained wrote)")
    from huggingface_hub.errors import StrictDataclassError

    try:
        return AutoConfig.from_pretrained(str(path) if path.is_dir() else name_or_path,
                                          local_files_only=True, trust_remote_code=trust_remote_code)
    except StrictDataclassError as err:  # a field of the wrong type, e.g. "2048" for an int
        from mogrpo.modeling.load import invalid_config_json

        raise ModelError(invalid_config_json(name_or_path, err)) from None
    except (OSError, ValueError) as err:
        if path.is_dir():  # a model_type this transformers does not know: the raw dict will do
            log.debug("AutoConfig failed (%s); reading %s/config.json directly", err, path)
            return json.loads((path / "config.json").read_text(encoding="utf-8"))
        raise ModelError(
            f"model {name_or_path!r} is not a local directory and not in the Hugging Face cache; "
            "the memory planner works offline and needs only its config.json: run "
            f"`huggingface-cli download {name_or_path} config.json` and pass that directory "
            "(or the config.json path) with --set model.name_or_path=PATH") from None
