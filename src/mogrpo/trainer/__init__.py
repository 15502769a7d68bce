"""The training loops (GRPO, SFT warm-up) and a whole run's sequence (`run.py`).

The Python API's `train(config, ...)` is `mogrpo.api.train`, exported by the package root.
"""
