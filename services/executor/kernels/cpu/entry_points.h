// The C entry points that one kernel file calls in another (step_layers.cpp calls the integer
// kernel's boundaries and the attention), declared once; the defining files include this too,
// so the compiler checks that a declaration and its definition agree.
#pragma once

#include <cstdint>

extern "C" {

struct IntBoundary;  // int_step.cpp's, mirrored by int_step.py
struct LoraStep;  // lora_delta.cpp's, mirrored by lora/kernel_tables.py

// The projections an adapter may change, in lora_delta.cpp's table order.
enum LoraTarget : int { LORA_Q, LORA_K, LORA_V, LORA_O, LORA_GATE, LORA_UP, LORA_DOWN,
                        LORA_TARGETS };

int int_boundary(const IntBoundary* b, int64_t T, int64_t D, float eps, float* hidden,
                 const float* attn, float* qkv, int num_threads, const LoraStep* lora,
                 int64_t layer);
int lora_add(const LoraStep* lora, int64_t layer, int target, const float* x, int64_t k,
             int64_t T, float* y, int64_t ldy, int64_t col, int64_t n, int num_threads);
int paged_attention_f32(const float* qkv, int64_t num_tokens, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, const float* cos,
                        const float* sin, float* k_cache, float* v_cache, const int64_t* slots,
                        const int32_t* tables, int64_t max_blocks, const int64_t* starts,
                        const int64_t* ctx, int64_t num_seqs, int64_t block_size,
                        int64_t max_query_len, float scale, float* q_out, float* out,
                        int num_threads, int64_t window);
int paged_attention_f16(const float* qkv, int64_t num_tokens, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, const float* cos,
                        const float* sin, _Float16* k_cache, _Float16* v_cache,
                        const int64_t* slots, const int32_t* tables, int64_t max_blocks,
                        const int64_t* starts, const int64_t* ctx, int64_t num_seqs,
                        int64_t block_size, int64_t max_query_len, float scale, float* q_out,
                        float* out, int num_threads, int64_t window);

}  // extern "C"
