"""Code for CPUs: the float32 products by CPU and shape (`linear.py`), MKL's packed product
called directly (`mkl_packed.py`), glibc's allocator settings (`malloc.py`, `host_memory.py`),
the native engine's compiled decode step (`decode_step.py`, `decode_step.cpp`) and LoRA's
layers fused and its dropout masks drawn fast (`lora_linear.py`, `lora_dropout.py`). Each
keeps its place with a measured gain, recorded beside it."""
