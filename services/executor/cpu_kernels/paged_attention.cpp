// One layer's attention step on the CPU, reading the paged KV cache in place:
//
//   1. RoPE (rotate_half layout) on every token's Q and K; K and V stored at the token's slot;
//   2. for each sequence with at most `max_query_len` queries, causal attention of its queries
//      over its cached context, straight from the cache blocks its block table names.
//
// Sequences with longer queries (prefill chunks) get only step 1; their roped Q is returned in
// `q_out` for a GEMM-based attention elsewhere (torch SDPA), which wins on long queries.
//
// Why: the torch path gathers every sequence's blocks into a padded copy each layer and pays
// ~10 small torch ops per layer; at 16 sequences sharing a 1,000-token prefix that copy is most
// of the step. Here a query head group reads each key once (the `group` query heads that share a
// KV head are done together) with an online softmax, so nothing is copied and the cache can be
// float16 (half the bytes) with float32 arithmetic.
//
// No intrinsics: loops are written for the compiler's vectorizer, and library.py builds this
// file for the CPU it runs on (-march=native) or for a named ISA level (LLMBUS_CPU_ISA), so the
// same source serves AVX2 and AVX-512 machines.
//
// Layouts (row-major):
//   qkv     [T, (H + 2 Hkv) * Dh] float32   Q heads, then K heads, then V heads
//   cos/sin [T, Dh] float32                 this token's rotary table row
//   cache   [num_blocks, block_size, Hkv, Dh] float32 or float16, K and V alike
//   slots   [T] int64                       block_id * block_size + offset of each token
//   tables  [B, max_blocks] int32           each sequence's block ids
//   starts  [B + 1] int64                   query offsets of each sequence in the token stream
//   ctx     [B] int64                       cached tokens of each sequence after this step
//   q_out   [T, H * Dh] float32, out        [T, H * Dh] float32 (rows of long sequences untouched)

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int MAX_HEAD_DIM = 256;
constexpr int MAX_GROUP = 16;
constexpr int MAX_BLOCK = 64;  // tokens per cache block

template <typename KV>
struct Cache {
    KV* k;
    KV* v;
    int64_t block_size, num_kv_heads, head_dim;
    const int32_t* tables;
    int64_t max_blocks;

    // Row of token `pos` of sequence `seq`, KV head `h`.
    int64_t row(int64_t seq, int64_t pos, int64_t h) const {
        const int64_t block = tables[seq * max_blocks + pos / block_size];
        return ((block * block_size + pos % block_size) * num_kv_heads + h) * head_dim;
    }
};

// dst[0:n] = float(src[0:n]). The vectorizer does not widen _Float16 on its own; F16C does 8
// at a time (AVX2 machines have it too), AVX-512F 16.
inline void widen(const float* src, int64_t n, float* dst) {
    for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}

inline void widen(const _Float16* src, int64_t n, float* dst) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(src + i))));
#endif
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
#endif
    for (; i < n; ++i) dst[i] = float(src[i]);
}

// x[0:Dh] <- x * cos + rotate_half(x) * sin, as HF's apply_rotary_pos_emb.
inline void rope(const float* x, const float* cos, const float* sin, int64_t dh, float* out) {
    const int64_t half = dh / 2;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
        out[i] = x[i] * cos[i] - x[i + half] * sin[i];
        out[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half];
    }
}

template <typename KV>
void rope_and_store(const float* qkv, int64_t t, int64_t num_heads, const Cache<KV>& c,
                    const float* cos, const float* sin, const int64_t* slots, float* q_out) {
    const int64_t dh = c.head_dim, hkv = c.num_kv_heads;
    const float* row = qkv + t * (num_heads + 2 * hkv) * dh;
    const float* cs = cos + t * dh;
    const float* sn = sin + t * dh;
    for (int64_t h = 0; h < num_heads; ++h) rope(row + h * dh, cs, sn, dh, q_out + (t * num_heads + h) * dh);
    float k[MAX_HEAD_DIM];
    for (int64_t h = 0; h < hkv; ++h) {
        const int64_t at = (slots[t] * hkv + h) * dh;
        rope(row + (num_heads + h) * dh, cs, sn, dh, k);
        const float* v = row + (num_heads + hkv + h) * dh;
#pragma omp simd
        for (int64_t i = 0; i < dh; ++i) {
            c.k[at + i] = KV(k[i]);
            c.v[at + i] = KV(v[i]);
        }
    }
}

// exp(x) for x <= 0 (softmax arguments), written so the vectorizer can take it: 2^n * p(r)
// with r in [-ln2/2, ln2/2] and a degree-6 polynomial, within 2 ulp of expf; below -87 it is 0.
inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = __builtin_roundf(x * 1.44269504f);
    const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.3888889e-3f;
    p = p * r + 8.3333333e-3f;
    p = p * r + 4.1666667e-2f;
    p = p * r + 1.6666667e-1f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const int32_t bits = (int32_t(n) + 127) << 23;
    float scale;
    __builtin_memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

// Attention of the `group` query heads [group, Dh] (scaled already) sharing KV head `h`, over
// positions [0, num_keys) of sequence `seq` -> out [group, Dh]. One cache block at a time:
// scores for its keys, one rescale of the running sums per block (online softmax), then P @ V.
template <typename KV>
void attend(const float* q, int64_t group, const Cache<KV>& c, int64_t seq, int64_t h,
            int64_t num_keys, float* out) {
    const int64_t dh = c.head_dim, bs = c.block_size, stride = c.num_kv_heads * dh;
    float m[MAX_GROUP], l[MAX_GROUP], acc[MAX_GROUP * MAX_HEAD_DIM];
    float scores[MAX_GROUP * MAX_BLOCK];
    for (int64_t g = 0; g < group; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.f;
        for (int64_t i = 0; i < dh; ++i) acc[g * dh + i] = 0.f;
    }
    for (int64_t first = 0; first < num_keys; first += bs) {
        const int64_t n = num_keys - first < bs ? num_keys - first : bs;
        const int64_t r = c.row(seq, first, h);  // rows of one block are `stride` apart
        const KV* kb = c.k + r;
        const KV* vb = c.v + r;
        for (int64_t j = 0; j < n; ++j) {
            float kf[MAX_HEAD_DIM];
            widen(kb + j * stride, dh, kf);
            for (int64_t g = 0; g < group; ++g) {
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int64_t i = 0; i < dh; ++i) s += q[g * dh + i] * kf[i];
                scores[g * MAX_BLOCK + j] = s;
            }
        }
        for (int64_t g = 0; g < group; ++g) {
            float* sg = scores + g * MAX_BLOCK;
            float top = m[g];
            for (int64_t j = 0; j < n; ++j) top = sg[j] > top ? sg[j] : top;
            const float shrink = exp_nonpositive(m[g] - top);  // 0 on the first block
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < n; ++j) {
                sg[j] = exp_nonpositive(sg[j] - top);
                sum += sg[j];
            }
            l[g] = l[g] * shrink + sum;
            m[g] = top;
            float* a = acc + g * dh;
#pragma omp simd
            for (int64_t i = 0; i < dh; ++i) a[i] *= shrink;
        }
        for (int64_t j = 0; j < n; ++j) {
            float vf[MAX_HEAD_DIM];
            widen(vb + j * stride, dh, vf);
            for (int64_t g = 0; g < group; ++g) {
                const float p = scores[g * MAX_BLOCK + j];
                float* a = acc + g * dh;
#pragma omp simd
                for (int64_t i = 0; i < dh; ++i) a[i] += p * vf[i];
            }
        }
    }
    for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < dh; ++i) out[g * dh + i] = acc[g * dh + i] / l[g];
}

template <typename KV>
int run(const float* qkv, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
        int64_t head_dim, const float* cos, const float* sin, KV* k_cache, KV* v_cache,
        const int64_t* slots, const int32_t* tables, int64_t max_blocks, const int64_t* starts,
        const int64_t* ctx, int64_t num_seqs, int64_t block_size, int64_t max_query_len,
        float scale, float* q_out, float* out, int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    if (head_dim > MAX_HEAD_DIM || head_dim % 2 || group > MAX_GROUP ||
        num_heads % num_kv_heads || block_size > MAX_BLOCK)
        return 1;
    const Cache<KV> c{k_cache, v_cache, block_size, num_kv_heads, head_dim, tables, max_blocks};
    // Work items of the attention: (token, KV head) of the sequences done here.
    std::vector<int64_t> items;
    for (int64_t b = 0; b < num_seqs; ++b)
        if (starts[b + 1] - starts[b] <= max_query_len)
            for (int64_t t = starts[b]; t < starts[b + 1]; ++t)
                for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back((t << 16) | h);
    std::vector<int64_t> seq_of(num_tokens);
    for (int64_t b = 0; b < num_seqs; ++b)
        for (int64_t t = starts[b]; t < starts[b + 1]; ++t) seq_of[t] = b;
    const int64_t num_items = int64_t(items.size());

#pragma omp parallel num_threads(num_threads)
    {
        // Every token's K/V is stored before any query reads the cache.
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tokens; ++t)
            rope_and_store(qkv, t, num_heads, c, cos, sin, slots, q_out);
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < num_items; ++w) {
            const int64_t t = items[w] >> 16, h = items[w] & 0xFFFF, b = seq_of[t];
            const int64_t pos = ctx[b] - (starts[b + 1] - t);  // this query's position
            float q[MAX_GROUP * MAX_HEAD_DIM];
            const float* qt = q_out + (t * num_heads + h * group) * head_dim;
            for (int64_t i = 0; i < group * head_dim; ++i) q[i] = qt[i] * scale;
            attend(q, group, c, b, h, pos + 1, out + (t * num_heads + h * group) * head_dim);
        }
    }
    return 0;
}

}  // namespace

extern "C" {

int paged_attention_f32(const float* qkv, int64_t num_tokens, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, const float* cos,
                        const float* sin, float* k_cache, float* v_cache, const int64_t* slots,
                        const int32_t* tables, int64_t max_blocks, const int64_t* starts,
                        const int64_t* ctx, int64_t num_seqs, int64_t block_size,
                        int64_t max_query_len, float scale, float* q_out, float* out,
                        int num_threads) {
    return run(qkv, num_tokens, num_heads, num_kv_heads, head_dim, cos, sin, k_cache, v_cache,
               slots, tables, max_blocks, starts, ctx, num_seqs, block_size, max_query_len,
               scale, q_out, out, num_threads);
}

int paged_attention_f16(const float* qkv, int64_t num_tokens, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, const float* cos,
                        const float* sin, _Float16* k_cache, _Float16* v_cache,
                        const int64_t* slots, const int32_t* tables, int64_t max_blocks,
                        const int64_t* starts, const int64_t* ctx, int64_t num_seqs,
                        int64_t block_size, int64_t max_query_len, float scale, float* q_out,
                        float* out, int num_threads) {
    return run(qkv, num_tokens, num_heads, num_kv_heads, head_dim, cos, sin, k_cache, v_cache,
               slots, tables, max_blocks, starts, ctx, num_seqs, block_size, max_query_len,
               scale, q_out, out, num_threads);
}

}  // extern "C"
