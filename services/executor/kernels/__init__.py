"""Hand-written kernels: `cpu/` (C++ built on first use for the CPU it runs on) and `triton/`
(the CUDA path, each kernel beside its torch reference)."""
