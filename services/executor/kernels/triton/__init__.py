"""Fused Triton kernels for the executor's CUDA path, each beside its torch reference.

Importing this package does not import triton: only the modules under it do, so the CPU path
(and every test that does not touch a kernel) runs without triton installed.

- `rmsnorm`: residual add + RMSNorm in one pass, and plain RMSNorm
- `rope_kv`: rotary embedding on Q and K, fused with the paged K/V cache write
- `paged_decode_attention`: one query token per sequence, split-K over the context + reduce
- `prefill_attention`: causal attention of prefill chunks over their cached prefix
- `swiglu`: silu(gate) * up straight from the fused gate/up projection
- `sampling`: temperature, top-k, top-p, min-p and the exponential race, one program per row
- `ops`: the model's Triton backend, built from the kernels above
"""
