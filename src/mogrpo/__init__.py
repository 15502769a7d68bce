"""mogrpo: multi-objective GRPO post-training for causal language models."""

__version__ = "0.1.0"
