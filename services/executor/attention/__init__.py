"""Attention over the paged KV cache: the step's metadata, the torch reference, RoPE, and the
C++ kernel's wrapper (the Triton kernels live in kernels/triton/)."""
