"""Code for CUDA GPUs: the native engine's static decode step captured and replayed as CUDA
graphs (`graph_step.py`)."""
