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
// Eight-float vectors (GCC's vector extension) plus two AVX intrinsics (a lane-sum tree, F16C
// widening), with plain fallbacks; library.py builds this file for the CPU it runs on
// (-march=native) or for a named ISA level (LLMBUS_CPU_ISA), so the same source serves AVX2
// and AVX-512 machines.
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

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

constexpr int MAX_HEAD_DIM = 256;
constexpr int MAX_GROUP = 16;
constexpr int MAX_BLOCK = 64;  // tokens per cache block
constexpr int64_t MIN_WORK_PER_THREAD = 1 << 20;  // multiply-adds

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
    // round to nearest by the 1.5 * 2^23 trick: no libm call, so the loop vectorizes
    const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;
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

// Eight floats, one AVX register: GCC's vector extension, so the same code is AVX2 on an AVX2
// build and AVX-512VL on an AVX-512 one.
typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
    v8 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

inline v8 load8(const _Float16* p) {
#if defined(__F16C__)
    return (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
    v8 v;
    for (int i = 0; i < 8; ++i) v[i] = float(p[i]);
    return v;
#endif
}

// r[j] = the sum of a[j]'s eight lanes, for eight vectors at once (a transpose-and-add tree).
inline v8 lane_sums(const v8* a) {
#if defined(__AVX__)
    const __m256 t0 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]);
    const __m256 t1 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
    const __m256 t2 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]);
    const __m256 t3 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1);  // 128-bit halves: lanes 0-3 / 4-7 of a[0..3]
    const __m256 u1 = _mm256_hadd_ps(t2, t3);  // the same for a[4..7]
    return (v8)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                             _mm256_permute2f128_ps(u0, u1, 0x31));
#else
    v8 r;
    for (int j = 0; j < 8; ++j) {
        float sum = 0.f;
        for (int i = 0; i < 8; ++i) sum += a[j][i];
        r[j] = sum;
    }
    return r;
#endif
}

// Attention of the `group` query heads [group, Dh] (scaled already) sharing KV head `h`, over
// positions [0, num_keys) of sequence `seq` -> out [group, Dh]. One cache block at a time:
// scores of its keys eight at a time (each key row read once for all query heads), one rescale
// of the running sums per block (online softmax), then P @ V. Needs Dh % 8 == 0.
template <typename KV>
void attend(const float* q, int64_t group, const Cache<KV>& c, int64_t seq, int64_t h,
            int64_t num_keys, float* out) {
    constexpr int MAX_CHUNKS = MAX_HEAD_DIM / 8;
    const int64_t dh = c.head_dim, chunks = dh / 8, bs = c.block_size;
    const int64_t stride = c.num_kv_heads * dh;
    v8 qv[MAX_GROUP][MAX_CHUNKS], acc[MAX_GROUP][MAX_CHUNKS];
    float m[MAX_GROUP], l[MAX_GROUP];
    float s[MAX_GROUP][MAX_BLOCK + 8];
    for (int64_t g = 0; g < group; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.f;
        for (int64_t ch = 0; ch < chunks; ++ch) {
            qv[g][ch] = load8(q + g * dh + ch * 8);
            acc[g][ch] = v8{};
        }
    }
    for (int64_t first = 0; first < num_keys; first += bs) {
        const int64_t n = num_keys - first < bs ? num_keys - first : bs;
        const int64_t r = c.row(seq, first, h);  // rows of one block are `stride` apart
        const KV* kb = c.k + r;
        const KV* vb = c.v + r;
        if (h == 0 && first + bs < num_keys) {  // the next block, every head: 2 x 6 KB here
            const int64_t next = c.row(seq, first + bs, 0);
            const int64_t bytes = bs * stride * int64_t(sizeof(KV));
            for (int64_t at = 0; at < bytes; at += 64) {
                __builtin_prefetch((const char*)(c.k + next) + at);
                __builtin_prefetch((const char*)(c.v + next) + at);
            }
        }
        for (int64_t j0 = 0; j0 < n; j0 += 8) {
            v8 kf[8][MAX_CHUNKS];
            for (int64_t jj = 0; jj < 8; ++jj)
                for (int64_t ch = 0; ch < chunks; ++ch)
                    kf[jj][ch] = j0 + jj < n ? load8(kb + (j0 + jj) * stride + ch * 8) : v8{};
            for (int64_t g = 0; g < group; ++g) {
                v8 part[8];
                for (int64_t jj = 0; jj < 8; ++jj) {
                    v8 sum = qv[g][0] * kf[jj][0];
                    for (int64_t ch = 1; ch < chunks; ++ch) sum += qv[g][ch] * kf[jj][ch];
                    part[jj] = sum;
                }
                const v8 scores = lane_sums(part);
                __builtin_memcpy(&s[g][j0], &scores, sizeof scores);
            }
        }
        for (int64_t g = 0; g < group; ++g) {
            float* sg = s[g];
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
            for (int64_t ch = 0; ch < chunks; ++ch) acc[g][ch] *= shrink;
        }
        for (int64_t j = 0; j < n; ++j) {
            v8 vf[MAX_CHUNKS];
            for (int64_t ch = 0; ch < chunks; ++ch) vf[ch] = load8(vb + j * stride + ch * 8);
            for (int64_t g = 0; g < group; ++g) {
                const float p = s[g][j];
                for (int64_t ch = 0; ch < chunks; ++ch) acc[g][ch] += p * vf[ch];
            }
        }
    }
    for (int64_t g = 0; g < group; ++g) {
        const float inv = 1.f / l[g];
        for (int64_t ch = 0; ch < chunks; ++ch) {
            const v8 o = acc[g][ch] * inv;
            __builtin_memcpy(out + g * dh + ch * 8, &o, sizeof o);
        }
    }
}

template <typename KV>
int run(const float* qkv, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
        int64_t head_dim, const float* cos, const float* sin, KV* k_cache, KV* v_cache,
        const int64_t* slots, const int32_t* tables, int64_t max_blocks, const int64_t* starts,
        const int64_t* ctx, int64_t num_seqs, int64_t block_size, int64_t max_query_len,
        float scale, float* q_out, float* out, int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    if (head_dim > MAX_HEAD_DIM || head_dim % 8 || group > MAX_GROUP ||
        num_heads % num_kv_heads || block_size > MAX_BLOCK)
        return 1;
    const Cache<KV> c{k_cache, v_cache, block_size, num_kv_heads, head_dim, tables, max_blocks};
    // Work items of the attention: (token, KV head) of the sequences done here.
    // Token-major, and one thread takes a token's KV heads together (the schedule's chunk):
    // a cache block holds every head's rows, so its memory streams in once and the other
    // heads' rows come from L2. Decode is bound by this memory traffic, not by arithmetic.
    std::vector<int64_t> items;
    for (int64_t b = 0; b < num_seqs; ++b)
        if (starts[b + 1] - starts[b] <= max_query_len)
            for (int64_t t = starts[b]; t < starts[b + 1]; ++t)
                for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back((t << 16) | h);
    std::vector<int64_t> seq_of(num_tokens);
    for (int64_t b = 0; b < num_seqs; ++b)
        for (int64_t t = starts[b]; t < starts[b + 1]; ++t) seq_of[t] = b;
    const int64_t num_items = int64_t(items.size());
    // Waking a second thread costs tens of microseconds; a small step (one short decode) is
    // done sooner alone.
    int64_t work = num_tokens * num_heads * head_dim;
    for (int64_t w = 0; w < num_items; ++w) {
        const int64_t b = seq_of[items[w] >> 16];
        work += (ctx[b] - (starts[b + 1] - (items[w] >> 16)) + 1) * group * head_dim;
    }
    if (work < MIN_WORK_PER_THREAD) num_threads = 1;

#pragma omp parallel num_threads(num_threads)
    {
        // Every token's K/V is stored before any query reads the cache.
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tokens; ++t)
            rope_and_store(qkv, t, num_heads, c, cos, sin, slots, q_out);
#pragma omp for schedule(dynamic, num_kv_heads)
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
