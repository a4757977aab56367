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
constexpr int64_t TEAM = 8;  // decode queries that share reads of common blocks

template <typename KV>
struct Cache {
    KV* k;
    KV* v;
    int64_t block_size, num_kv_heads, head_dim;
    const int32_t* tables;
    int64_t max_blocks;

    // The physical block holding token `pos` of sequence `seq`.
    int64_t block(int64_t seq, int64_t pos) const {
        return tables[seq * max_blocks + pos / block_size];
    }

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

// One query of a team: a decode token's `group` query heads that share KV head `h`.
struct Query {
    int64_t seq, token, num_keys;  // its sequence, its row in the step, keys it attends to
};

// Decode attention of a team of queries (up to TEAM, all for KV head `h`) over their paged
// contexts -> out [T, H * Dh] rows of those tokens. Block index by block index: the queries
// whose block tables name the same physical block there (a shared prefix) score against one
// read of it, so a prefix shared by the team streams from memory once, not once per query.
// Within a block: scores eight keys at a time (a lane-sum tree), one online-softmax rescale,
// then P @ V. `q` [T, H * Dh] holds the roped queries; Dh % 8 == 0.
template <typename KV>
void attend_team(const Query* team, int64_t size, const float* q, int64_t num_heads,
                 int64_t group, const Cache<KV>& c, int64_t h, float scale, float* out) {
    constexpr int MAX_CHUNKS = MAX_HEAD_DIM / 8;
    const int64_t dh = c.head_dim, chunks = dh / 8, bs = c.block_size;
    const int64_t stride = c.num_kv_heads * dh;
    // Per query and query head: the scaled query, running max, sum and output accumulator.
    std::vector<v8> qv(size * group * chunks), acc(size * group * chunks);
    std::vector<float> m(size * group, -INFINITY), l(size * group, 0.f);
    std::vector<v8> kf(MAX_BLOCK * chunks), vf(MAX_BLOCK * chunks);
    float s[MAX_GROUP][MAX_BLOCK + 8];
    int64_t most_keys = 0;
    for (int64_t i = 0; i < size; ++i) {
        const float* qi = q + (team[i].token * num_heads + h * group) * dh;
        for (int64_t x = 0; x < group * chunks; ++x) {
            qv[i * group * chunks + x] = load8(qi + x * 8) * scale;
            acc[i * group * chunks + x] = v8{};
        }
        most_keys = team[i].num_keys > most_keys ? team[i].num_keys : most_keys;
    }
    for (int64_t first = 0; first < most_keys; first += bs) {
        bool done[TEAM] = {};
        for (int64_t i = 0; i < size; ++i) {
            if (done[i] || team[i].num_keys <= first) continue;
            // the team members that read this very block here, and the most keys any reads
            const int64_t block = c.block(team[i].seq, first);
            int64_t members[TEAM], num_members = 0, n = 0;
            for (int64_t j = i; j < size; ++j) {
                if (done[j] || team[j].num_keys <= first || c.block(team[j].seq, first) != block)
                    continue;
                done[j] = true;
                members[num_members++] = j;
                const int64_t nj = team[j].num_keys - first < bs ? team[j].num_keys - first : bs;
                n = nj > n ? nj : n;
            }
            const KV* kb = c.k + c.row(team[i].seq, first, h);  // rows are `stride` apart
            const KV* vb = c.v + c.row(team[i].seq, first, h);
            const int64_t padded = (n + 7) / 8 * 8;
            for (int64_t j = 0; j < padded; ++j)
                for (int64_t ch = 0; ch < chunks; ++ch) {
                    kf[j * chunks + ch] = j < n ? load8(kb + j * stride + ch * 8) : v8{};
                    vf[j * chunks + ch] = j < n ? load8(vb + j * stride + ch * 8) : v8{};
                }
            for (int64_t k = 0; k < num_members; ++k) {
                const int64_t at = members[k];
                const int64_t nk = team[at].num_keys - first < bs ? team[at].num_keys - first
                                                                   : bs;
                const v8* qa = &qv[at * group * chunks];
                for (int64_t j0 = 0; j0 < nk; j0 += 8)
                    for (int64_t g = 0; g < group; ++g) {
                        v8 part[8];
                        for (int64_t jj = 0; jj < 8; ++jj) {
                            const v8* kr = &kf[(j0 + jj) * chunks];
                            v8 sum = qa[g * chunks] * kr[0];
                            for (int64_t ch = 1; ch < chunks; ++ch)
                                sum += qa[g * chunks + ch] * kr[ch];
                            part[jj] = sum;
                        }
                        const v8 scores = lane_sums(part);
                        __builtin_memcpy(&s[g][j0], &scores, sizeof scores);
                    }
                for (int64_t g = 0; g < group; ++g) {
                    float* sg = s[g];
                    float& mg = m[at * group + g];
                    float top = mg;
                    for (int64_t j = 0; j < nk; ++j) top = sg[j] > top ? sg[j] : top;
                    const float shrink = exp_nonpositive(mg - top);  // 0 on the first block
                    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                    for (int64_t j = 0; j < nk; ++j) {
                        sg[j] = exp_nonpositive(sg[j] - top);
                        sum += sg[j];
                    }
                    l[at * group + g] = l[at * group + g] * shrink + sum;
                    mg = top;
                    v8* a = &acc[(at * group + g) * chunks];
                    for (int64_t ch = 0; ch < chunks; ++ch) a[ch] *= shrink;
                    for (int64_t j = 0; j < nk; ++j) {
                        const float p = sg[j];
                        const v8* vr = &vf[j * chunks];
                        for (int64_t ch = 0; ch < chunks; ++ch) a[ch] += p * vr[ch];
                    }
                }
            }
        }
    }
    for (int64_t i = 0; i < size; ++i)
        for (int64_t g = 0; g < group; ++g) {
            const float inv = 1.f / l[i * group + g];
            float* o = out + (team[i].token * num_heads + h * group + g) * dh;
            for (int64_t ch = 0; ch < chunks; ++ch) {
                const v8 y = acc[(i * group + g) * chunks + ch] * inv;
                __builtin_memcpy(o + ch * 8, &y, sizeof y);
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
    // Work items of the attention: a team of up to TEAM decode queries and one KV head. Teams
    // are consecutive sequences, so a batch sharing a prefix reads it once per team and head.
    std::vector<Query> queries;
    int64_t work = num_tokens * num_heads * head_dim;
    for (int64_t b = 0; b < num_seqs; ++b)
        if (starts[b + 1] - starts[b] <= max_query_len)
            for (int64_t t = starts[b]; t < starts[b + 1]; ++t) {
                const int64_t num_keys = ctx[b] - (starts[b + 1] - t) + 1;  // causal: up to t
                queries.push_back(Query{b, t, num_keys});
                work += num_keys * num_heads * head_dim;
            }
    const int64_t num_teams = (int64_t(queries.size()) + TEAM - 1) / TEAM;
    const int64_t num_items = num_teams * num_kv_heads;
    // Waking a second thread costs tens of microseconds; a small step (one short decode) is
    // done sooner alone.
    if (work < MIN_WORK_PER_THREAD) num_threads = 1;

#pragma omp parallel num_threads(num_threads)
    {
        // Every token's K/V is stored before any query reads the cache.
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tokens; ++t)
            rope_and_store(qkv, t, num_heads, c, cos, sin, slots, q_out);
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < num_items; ++w) {
            const int64_t first = (w / num_kv_heads) * TEAM, h = w % num_kv_heads;
            const int64_t size = int64_t(queries.size()) - first < TEAM
                                     ? int64_t(queries.size()) - first : TEAM;
            attend_team(&queries[first], size, q_out, num_heads, group, c, h, scale, out);
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
