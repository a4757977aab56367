"""C++ kernels for the executor's CPU path, where torch has no fast equivalent.

Each `*.cpp` here is plain C++ (no torch headers) with `extern "C"` entry points on raw
pointers; `library.py` compiles them together for this CPU on first use and loads the result
with ctypes. Every kernel has a torch reference in its tests.

- `paged_attention`: one layer's RoPE, KV write and attention (decodes, decodes sharing a
  cached prefix, prefill chunks) straight from the paged cache
- `dequantize`: GGUF Q4 / Q8_0 blocks widened to bfloat16 for big steps' GEMMs (AMX CPUs)
- `int_step`: the fast mode's matmuls (integer activations on the GGUF codes, tiled), norms
  and SwiGLU, on the attention's threads
- `quant_matmul`: float32 matmuls over GGUF Q4_1 / Q8_0 blocks, weights bit-identical to the
  dequantized ones (the torch backend on AVX-512)
"""
