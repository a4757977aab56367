// Every layer of one fast-mode step in one call: the L + 1 integer-kernel boundaries
// (int_step.cpp) with each layer's RoPE, KV write and attention (paged_attention.cpp) between
// them, in the order int_step.py's Python loop makes the same calls, so the result is the same
// bits. Why: that loop paid the interpreter and ctypes ~60 argument conversions a layer, about
// 25 us, which is most of a millisecond of a 30-layer decode step at one stream (a tenth of a
// ~6 ms step on 2 Zen 4 cores), time llama.cpp's C graph does not spend.
//
// For steps the attention kernel takes whole (every query within max_query_len) of models
// without QKV bias; anything else goes through the Python loop.
//
// Layouts as in the two kernels; the caches are [L, num_blocks, block_size, Hkv, Dh], layer i
// at i * layer_stride elements.

#include <cstdint>

#include "entry_points.h"

namespace {

// The layer loop on caches of one type; `attend` is that type's paged_attention_*.
template <typename Cache, typename Attend>
int run_layers(Attend attend, const IntBoundary* const* boundaries, int64_t num_layers,
               int64_t T, int64_t D, float eps, float* hidden, float* attn, float* qkv,
               Cache* k_cache, Cache* v_cache, int64_t layer_stride, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, const float* cos, const float* sin,
               const int64_t* slots, const int32_t* tables, int64_t max_blocks,
               const int64_t* starts, const int64_t* ctx, int64_t num_seqs, int64_t block_size,
               int64_t max_query_len, float scale, float* q_out, const LoraStep* lora,
               int num_threads) {
    for (int64_t i = 0; i <= num_layers; ++i) {
        if (int_boundary(boundaries[i], T, D, eps, hidden, i ? attn : nullptr, qkv,
                         num_threads, lora, i) != 0)
            return 1000 + static_cast<int>(i);
        if (i == num_layers) break;
        if (attend(qkv, T, num_heads, num_kv_heads, head_dim, cos, sin,
                   k_cache + i * layer_stride, v_cache + i * layer_stride, slots, tables,
                   max_blocks, starts, ctx, num_seqs, block_size, max_query_len, scale, q_out,
                   attn, num_threads, /*window=*/0) != 0)
            return 2000 + static_cast<int>(i);
    }
    return 0;
}

}  // namespace

extern "C" {

// 0 on success; 1000 + i when boundary i refused, 2000 + i when layer i's attention did.
int int_step_layers(const IntBoundary* const* boundaries, int64_t num_layers, int64_t T,
                    int64_t D, float eps, float* hidden, float* attn, float* qkv,
                    int kv_float16, void* k_cache, void* v_cache, int64_t layer_stride,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    const float* cos, const float* sin, const int64_t* slots,
                    const int32_t* tables, int64_t max_blocks, const int64_t* starts,
                    const int64_t* ctx, int64_t num_seqs, int64_t block_size,
                    int64_t max_query_len, float scale, float* q_out, const LoraStep* lora,
                    int num_threads) {
    if (kv_float16)
        return run_layers(paged_attention_f16, boundaries, num_layers, T, D, eps, hidden,
                          attn, qkv, static_cast<_Float16*>(k_cache),
                          static_cast<_Float16*>(v_cache), layer_stride, num_heads,
                          num_kv_heads, head_dim, cos, sin, slots, tables, max_blocks, starts,
                          ctx, num_seqs, block_size, max_query_len, scale, q_out, lora,
                          num_threads);
    return run_layers(paged_attention_f32, boundaries, num_layers, T, D, eps, hidden, attn,
                      qkv, static_cast<float*>(k_cache), static_cast<float*>(v_cache),
                      layer_stride, num_heads, num_kv_heads, head_dim, cos, sin, slots, tables,
                      max_blocks, starts, ctx, num_seqs, block_size, max_query_len, scale,
                      q_out, lora, num_threads);
}

}  // extern "C"
