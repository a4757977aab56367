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

extern "C" {

struct IntBoundary;  // int_step.cpp's, built by int_step.py

int int_boundary(const IntBoundary* b, int64_t T, int64_t D, float eps, float* hidden,
                 const float* attn, float* qkv, int num_threads);
int paged_attention_f32(const float* qkv, int64_t num_tokens, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, const float* cos,
                        const float* sin, float* k_cache, float* v_cache, const int64_t* slots,
                        const int32_t* tables, int64_t max_blocks, const int64_t* starts,
                        const int64_t* ctx, int64_t num_seqs, int64_t block_size,
                        int64_t max_query_len, float scale, float* q_out, float* out,
                        int num_threads);
int paged_attention_f16(const float* qkv, int64_t num_tokens, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, const float* cos,
                        const float* sin, _Float16* k_cache, _Float16* v_cache,
                        const int64_t* slots, const int32_t* tables, int64_t max_blocks,
                        const int64_t* starts, const int64_t* ctx, int64_t num_seqs,
                        int64_t block_size, int64_t max_query_len, float scale, float* q_out,
                        float* out, int num_threads);

// 0 on success; 1000 + i when boundary i refused, 2000 + i when layer i's attention did.
int int_step_layers(const IntBoundary* const* boundaries, int64_t num_layers, int64_t T,
                    int64_t D, float eps, float* hidden, float* attn, float* qkv,
                    int kv_float16, void* k_cache, void* v_cache, int64_t layer_stride,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    const float* cos, const float* sin, const int64_t* slots,
                    const int32_t* tables, int64_t max_blocks, const int64_t* starts,
                    const int64_t* ctx, int64_t num_seqs, int64_t block_size,
                    int64_t max_query_len, float scale, float* q_out, int num_threads) {
    for (int64_t i = 0; i <= num_layers; ++i) {
        if (int_boundary(boundaries[i], T, D, eps, hidden, i ? attn : nullptr, qkv,
                         num_threads) != 0)
            return 1000 + static_cast<int>(i);
        if (i == num_layers) break;
        int status;
        if (kv_float16) {
            _Float16* k = static_cast<_Float16*>(k_cache) + i * layer_stride;
            _Float16* v = static_cast<_Float16*>(v_cache) + i * layer_stride;
            status = paged_attention_f16(qkv, T, num_heads, num_kv_heads, head_dim, cos, sin, k,
                                         v, slots, tables, max_blocks, starts, ctx, num_seqs,
                                         block_size, max_query_len, scale, q_out, attn,
                                         num_threads);
        } else {
            float* k = static_cast<float*>(k_cache) + i * layer_stride;
            float* v = static_cast<float*>(v_cache) + i * layer_stride;
            status = paged_attention_f32(qkv, T, num_heads, num_kv_heads, head_dim, cos, sin, k,
                                         v, slots, tables, max_blocks, starts, ctx, num_seqs,
                                         block_size, max_query_len, scale, q_out, attn,
                                         num_threads);
        }
        if (status != 0) return 2000 + static_cast<int>(i);
    }
    return 0;
}

}  // extern "C"
