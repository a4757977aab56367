// One layer's attention step on the CPU, reading the paged KV cache in place:
//
//   1. RoPE (rotate_half layout) on every token's Q and K; K and V stored at the token's slot;
//   2. causal attention of every query of the sequences with at most `max_query_len` queries
//      over its cached context, straight from the cache blocks its block table names:
//      - a decode (one query) reads each cache block once for all its heads (`attend`);
//      - a prefill chunk's queries are rows of a GEMM-shaped tile against each span of keys
//        (`attend_rows`);
//      - decodes whose tables share leading blocks (a cached prompt prefix) attend over those
//        together as rows of `attend_rows` (the prefix cut into key ranges, an item each), each
//        over the rest alone, and the softmax states merge (cascade attention);
//      - with a sliding `window` (Gemma 3's local layers), a query attends to its last `window`
//        positions only: the blocks before them are never read (a decode costs the window, not
//        the context), and the keys of the first block that fall before it score -inf.
//
// Sequences with longer queries get only step 1; their roped Q is returned in `q_out` for an
// attention elsewhere (torch SDPA).
//
// Why: the torch path gathers every sequence's blocks into a padded copy each layer and pays
// ~10 small torch ops per layer; at 16 sequences sharing a 1,000-token prefix that copy was most
// of the step. Here nothing is copied, and the cache can be float16 (half the bytes) with
// float32 arithmetic.
//
// Eight-float vectors (GCC's vector extension; sixteen in decodes on AVX-512 builds, with the
// same bits) plus a few AVX intrinsics (a lane-sum tree, an 8 x 8 transpose, F16C widening),
// with plain fallbacks; library.py builds this file for the CPU it runs on (-march=native) or
// for a named ISA level (LLMBUS_CPU_ISA), so the same source serves AVX2 and AVX-512 machines.
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
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "entry_points.h"
#include "exp_nonpositive.h"
#include "flush_denormals.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

using ::exp_nonpositive;  // the scalar one; the eight-lane one is below

constexpr int MAX_HEAD_DIM = 256;
constexpr int MAX_GROUP = 16;
constexpr int MAX_ITEM_HEADS = 64;  // query heads one work item attends for
constexpr int MAX_BLOCK = 64;  // tokens per cache block
constexpr int64_t SPAN = 32;  // keys per online-softmax step (whole cache blocks)
constexpr int64_t MAX_SPAN = SPAN > MAX_BLOCK ? SPAN : MAX_BLOCK;  // a block bigger than SPAN
constexpr int64_t CHUNK_SPAN = 64;  // keys per online-softmax step of a prefill chunk
constexpr int64_t SCORE_KEYS = 32;  // keys a row tile scores at once (registers)
constexpr int64_t MAX_CHUNK_ROWS = 48;  // query rows (token x head) of one rows work item
constexpr int64_t MIN_SHARED_KEYS = 64;  // shortest common prefix decodes attend over together
constexpr int64_t MAX_PREFIX_PARTS = 8;  // key ranges a shared prefix is cut into, at most
#if defined(__AVX512F__)
constexpr int ROW_TILE = 4;  // rows scored together: 4 x 4 sums + 4 keys fit 32 registers
#else
constexpr int ROW_TILE = 2;  // 16 registers
#endif
constexpr int64_t MIN_WORK_PER_THREAD = 1 << 17;  // multiply-adds

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

typedef int32_t v8i __attribute__((vector_size(32)));

// exp_nonpositive on eight lanes at once.
inline v8 exp_nonpositive(v8 x) {
    const v8 low = v8{} - 87.f;
    x = x < low ? low : x;
    const v8 n = (x * 1.44269504f + 12582912.f) - 12582912.f;
    const v8 r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    v8 p = r * 1.3888889e-3f + 8.3333333e-3f;
    p = p * r + 4.1666667e-2f;
    p = p * r + 1.6666667e-1f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
    return p * (v8)bits;
}

// Rows of an 8 x 8 tile become its columns.
inline void transpose8(v8* t) {
#if defined(__AVX__)
    __m256 a[8], b[8];
    for (int i = 0; i < 4; ++i) {
        a[2 * i] = _mm256_unpacklo_ps((__m256)t[2 * i], (__m256)t[2 * i + 1]);
        a[2 * i + 1] = _mm256_unpackhi_ps((__m256)t[2 * i], (__m256)t[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
        const int x = 4 * i;
        b[x] = _mm256_shuffle_ps(a[x], a[x + 2], 0x44);
        b[x + 1] = _mm256_shuffle_ps(a[x], a[x + 2], 0xEE);
        b[x + 2] = _mm256_shuffle_ps(a[x + 1], a[x + 3], 0x44);
        b[x + 3] = _mm256_shuffle_ps(a[x + 1], a[x + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {
        t[i] = (v8)_mm256_permute2f128_ps(b[i], b[i + 4], 0x20);
        t[i + 4] = (v8)_mm256_permute2f128_ps(b[i], b[i + 4], 0x31);
    }
#else
    v8 r[8];
    for (int i = 0; i < 8; ++i)
        for (int j = 0; j < 8; ++j) r[j][i] = t[i][j];
    for (int i = 0; i < 8; ++i) t[i] = r[i];
#endif
}

// One row of `dh` cache values as float32.
inline void widen_row(const float* row, int64_t dh, float* out) {
    __builtin_memcpy(out, row, dh * sizeof(float));
}

// Widen one row of `dh` float16 values into float32.
inline void widen_row(const _Float16* row, int64_t dh, float* out) {
    for (int64_t i = 0; i < dh; i += 8) {
        const v8 x = load8(row + i);
        __builtin_memcpy(out + i, &x, sizeof x);
    }
}

// One online-softmax step of one query row: scores s[0:n] (scaled) become probabilities
// relative to the new running max m, the running sum l takes them in; returns the factor by
// which the row's output so far must shrink. Needs room for s up to the next multiple of 8
// (those lanes are set to -inf).
inline float softmax_step(float* s, int64_t n, float& m, float& l) {
    for (int64_t j = n; j < ((n + 7) & ~7); ++j) s[j] = -INFINITY;
    v8 top8 = load8(s);
    for (int64_t j0 = 8; j0 < n; j0 += 8) {
        const v8 x = load8(s + j0);
        top8 = x > top8 ? x : top8;
    }
    float top = m;
    for (int i = 0; i < 8; ++i) top = top8[i] > top ? top8[i] : top;
    const float shrink = exp_nonpositive(m - top);  // 0 on the first step
    v8 sum8{};
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
        const v8 p = exp_nonpositive(load8(s + j0) - top);
        __builtin_memcpy(s + j0, &p, sizeof p);
        sum8 += p;
    }
    float sum = 0.f;
    for (int i = 0; i < 8; ++i) sum += sum8[i];
    l = l * shrink + sum;
    m = top;
    return shrink;
}

// acc [Dh] <- acc * shrink + p[0:n] @ V, V's rows at vrow[0:n]. One sum per 8 lanes, keys in
// order: the head's Dh / 8 sums are independent chains already (8 for Dh = 64), and pv2 must
// add in the same order, so that a row's output does not depend on whether the build pairs
// rows (AVX-512) or not (AVX2): every x86-64-v3+ build gives the same bits.
template <int CH>
inline void pv(const float* p, int64_t n, const float* const* vrow, int64_t chunks, float shrink,
               float* acc) {
    constexpr int NCH = CH ? CH : MAX_HEAD_DIM / 8;
    v8 a[NCH];
    for (int64_t ch = 0; ch < chunks; ++ch) a[ch] = load8(acc + ch * 8) * shrink;
    for (int64_t j = 0; j < n; ++j) {
        const float x = p[j];
        const float* v = vrow[j];
        for (int64_t ch = 0; ch < chunks; ++ch) a[ch] += x * load8(v + ch * 8);
    }
    for (int64_t ch = 0; ch < chunks; ++ch) __builtin_memcpy(acc + ch * 8, &a[ch], sizeof(v8));
}

// pv for two rows over the same keys [0, n): each V row is loaded once for both.
template <int CH>
inline void pv2(const float* p, const float* q, int64_t n, const float* const* vrow,
                int64_t chunks, float shrink_p, float shrink_q, float* acc_p, float* acc_q) {
    constexpr int NCH = CH ? CH : MAX_HEAD_DIM / 8;
    v8 a[NCH], b[NCH];
    for (int64_t ch = 0; ch < chunks; ++ch) {
        a[ch] = load8(acc_p + ch * 8) * shrink_p;
        b[ch] = load8(acc_q + ch * 8) * shrink_q;
    }
    for (int64_t j = 0; j < n; ++j) {
        const float x = p[j], y = q[j];
        for (int64_t ch = 0; ch < chunks; ++ch) {
            const v8 v = load8(vrow[j] + ch * 8);
            a[ch] += x * v;
            b[ch] += y * v;
        }
    }
    for (int64_t ch = 0; ch < chunks; ++ch) {
        __builtin_memcpy(acc_p + ch * 8, &a[ch], sizeof(v8));
        __builtin_memcpy(acc_q + ch * 8, &b[ch], sizeof(v8));
    }
}

// Loads one byte of every 64-byte line of rows `offset[0:n]` (`bytes` each) of K and V, in
// memory order: a loop of independent loads and nothing else keeps many misses in flight, so
// the arithmetic after it finds the span's rows in L1 or L2. The arithmetic reads a row head by
// head (two of a row's six lines, then the next two), and on that pattern alone it stalled on
// memory for half its time (16 decodes of 1,060 tokens, float16 cache, 2 Zen 4 cores: 1,020
// against 460 us with the same caches hot).
template <typename KV>
inline void load_rows(const Cache<KV>& c, const int64_t* offset, int64_t n, int64_t bytes) {
    for (int64_t j = 0; j < n; ++j)
        for (int64_t byte = 0; byte < bytes; byte += 64) {
            (void)*((const volatile char*)(c.k + offset[j]) + byte);
            (void)*((const volatile char*)(c.v + offset[j]) + byte);
        }
}

// The next span's rows `offset[0:n]` (`bytes` each, K and V), prefetched into L2 a few lines a
// call, the calls spread over this span's arithmetic. With load_rows first, medians of
// interleaved runs of the case above: 879 us without prefetches, 790 with the next span's in
// load_rows' loop (a burst, likely more misses than the core tracks), 608 spread. Prefetches
// without load_rows did not help (995).
template <typename KV>
struct NextRows {
    const Cache<KV>& c;
    const int64_t* offset;
    int64_t n, bytes, per_call, row = 0, byte = 0;

    // over `calls` calls
    NextRows(const Cache<KV>& c, const int64_t* offset, int64_t n, int64_t bytes, int64_t calls)
        : c(c), offset(offset), n(n), bytes(bytes),
          per_call((n * ((bytes + 63) / 64) + calls - 1) / std::max<int64_t>(calls, 1)) {}

    void some() {
        for (int64_t count = per_call; count > 0 && row < n; --count) {
            __builtin_prefetch((const char*)(c.k + offset[row]) + byte, 0, 2);
            __builtin_prefetch((const char*)(c.v + offset[row]) + byte, 0, 2);
            byte += 64;
            if (byte >= bytes) byte = 0, ++row;
        }
    }

    void rest() {  // those the calls left (fewer calls came than were counted)
        while (row < n) some();
    }
};

// Sixteen floats, one AVX-512 register. The decode kernel's vectors are these where the build
// has AVX-512 (half the instructions for the same arithmetic), eight floats elsewhere.
typedef float v16 __attribute__((vector_size(64)));
#if defined(__AVX512F__)
constexpr bool WIDE = true;
constexpr int ACC_REGISTERS = 24;  // P @ V's sums: 32 registers less the operands'
#else
constexpr bool WIDE = false;
constexpr int ACC_REGISTERS = 12;  // of 16
#endif
constexpr int TILE_HEADS = 4;  // query heads that share each K and V row load

// `V`'s lanes from `p`, widened where the cache is float16.
template <typename V, typename KV>
inline V load_as(const KV* p) {
    if constexpr (sizeof(V) == sizeof(v8)) {
        return load8(p);
    } else if constexpr (std::is_same<KV, float>::value) {
        V v;
        __builtin_memcpy(&v, p, sizeof v);
        return v;
    } else {
#if defined(__AVX512F__)
        return (V)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#else
        V v;
        for (int i = 0; i < 16; ++i) v[i] = float(p[i]);
        return v;
#endif
    }
}

// The sum of a 16-float vector's halves.
inline v8 halves_sum(v16 x) {
    v8 lo, hi;
    __builtin_memcpy(&lo, &x, sizeof lo);
    __builtin_memcpy(&hi, (const char*)&x + sizeof lo, sizeof hi);
    return lo + hi;
}

// s[g][0:n] <- the scores of GT query heads (rows of q, scaled) against the keys at krow[0:n]
// (krow padded to a multiple of 8), calling `ahead.some()` once a key. Each key's row is
// loaded (and widened) once for the GT heads. A score adds its products in one order whatever
// the vector width: lane i of the even 8-float chunks (0, 2, 4, ..) in one chain and of the
// odd ones in another, the two chains added, then the eight lanes in a tree (lane_sums). A
// 16-float vector holds an even chunk and the odd one after it, so its halves are the two
// chains: an AVX-512 build computes the AVX2 build's bits.
template <int CH, int GT, typename KV>
inline void score_tile(const float* q, int64_t dh, const KV* const* krow, int64_t n,
                       float (*s)[MAX_SPAN + 8], NextRows<KV>& ahead) {
    const int64_t chunks = CH ? CH : dh / 8;
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
        v8 part[GT][8];
        for (int jj = 0; jj < 8; ++jj) {
            ahead.some();
            const KV* k = krow[j0 + jj];
            if constexpr (WIDE && CH && CH % 2 == 0) {
                v16 a[GT];
                const v16 k0 = load_as<v16>(k);
                for (int g = 0; g < GT; ++g) a[g] = load_as<v16>(q + g * dh) * k0;
                for (int c = 1; c < CH / 2; ++c) {
                    const v16 kc = load_as<v16>(k + c * 16);
                    for (int g = 0; g < GT; ++g) a[g] += load_as<v16>(q + g * dh + c * 16) * kc;
                }
                for (int g = 0; g < GT; ++g) part[g][jj] = halves_sum(a[g]);
            } else {
                v8 even[GT], odd[GT];
                const v8 k0 = load8(k);
                for (int g = 0; g < GT; ++g) even[g] = load8(q + g * dh) * k0, odd[g] = v8{};
                for (int64_t ch = 1; ch < chunks; ++ch) {
                    const v8 kc = load8(k + ch * 8);
                    for (int g = 0; g < GT; ++g) {
                        const v8 x = load8(q + g * dh + ch * 8);
                        if (ch == 1) odd[g] = x * kc;
                        else if (ch % 2) odd[g] += x * kc;
                        else even[g] += x * kc;
                    }
                }
                for (int g = 0; g < GT; ++g) part[g][jj] = even[g] + odd[g];
            }
        }
        for (int g = 0; g < GT; ++g) {
            const v8 sums = lane_sums(part[g]);
            __builtin_memcpy(&s[g][j0], &sums, sizeof sums);
        }
    }
}

// acc[g] <- acc[g] * shrink[g] + p[g][0:n] @ V for GT heads (acc rows dh apart), V's rows at
// vrow[0:n], in vectors of type V (`VC` to a head, 0: dh / lanes at run time). Each row's
// vectors are loaded (and widened) once for the GT heads, whose sums stay in registers: a
// head size wider than ACC_REGISTERS allows goes in slices. Keys add in order in every lane,
// so neither the vector width nor the slicing changes a bit.
template <typename V, int VC, int GT, typename KV>
inline void pv_tile(const float (*p)[MAX_SPAN + 8], int64_t n, const KV* const* vrow,
                    const float* shrink, float* acc, int64_t dh) {
    constexpr int L = sizeof(V) / sizeof(float);
    constexpr int MOST = ACC_REGISTERS / GT > 0 ? ACC_REGISTERS / GT : 1;
    constexpr int SLICES = VC ? (VC + MOST - 1) / MOST : 1;
    constexpr int CT = VC ? (VC + SLICES - 1) / SLICES : MAX_HEAD_DIM / 8;  // vectors a slice
    const int64_t vc = VC ? VC : dh / L;
    for (int64_t c0 = 0; c0 < vc; c0 += CT) {
        const int64_t ct = vc - c0 < CT ? vc - c0 : CT;
        V a[GT][CT];
        for (int g = 0; g < GT; ++g)
            for (int64_t c = 0; c < ct; ++c)
                a[g][c] = load_as<V>(acc + g * dh + (c0 + c) * L) * shrink[g];
        for (int64_t j = 0; j < n; ++j) {
            const KV* v = vrow[j] + c0 * L;
            for (int64_t c = 0; c < ct; ++c) {
                const V x = load_as<V>(v + c * L);
                for (int g = 0; g < GT; ++g) a[g][c] += p[g][j] * x;
            }
        }
        for (int g = 0; g < GT; ++g)
            for (int64_t c = 0; c < ct; ++c)
                __builtin_memcpy(acc + g * dh + (c0 + c) * L, &a[g][c], sizeof(V));
    }
}

// One span of keys for GT query heads of one KV head: scores, the first `masked` of them -inf
// (before a window), each head's online-softmax step (m, l), P @ V into acc.
template <int CH, int GT, typename KV>
void span_tile(const float* q, int64_t dh, const KV* const* krow, const KV* const* vrow,
               int64_t n, int64_t masked, float* m, float* l, float* acc,
               NextRows<KV>& ahead) {
    alignas(32) float s[GT][MAX_SPAN + 8];
    score_tile<CH, GT>(q, dh, krow, n, s, ahead);
    float shrink[GT];
    for (int g = 0; g < GT; ++g) {
        for (int64_t j = 0; j < masked; ++j) s[g][j] = -INFINITY;
        shrink[g] = softmax_step(s[g], n, m[g], l[g]);
    }
    if constexpr (WIDE && CH && CH % 2 == 0)
        pv_tile<v16, CH / 2, GT>(s, n, vrow, shrink, acc, dh);
    else
        pv_tile<v8, CH, GT>(s, n, vrow, shrink, acc, dh);
}

// Attention of the query heads of KV heads [h0, h1) over positions [key_start, num_keys) of
// sequence `seq` (key_start: 0, or the end of a shared prefix, or the block of a window's
// first key, block-aligned; keys before `mask_before` score -inf): q and out are
// [(h1 - h0) * group, Dh] (query heads h0 * group onwards; q scaled already). With `state`,
// out is left unnormalized and state gets each head's (max, sum), for a merge; else out is the
// attention output.
//
// Bound by reading the cache, so each row is read from memory once: keys go SPAN at a time
// (whole cache blocks, read in one sweep first: load_rows, the next span's prefetched over
// this one's arithmetic: NextRows), and the query heads that share a KV head (GQA) take each
// K and V row from one load, TILE_HEADS at a time, widened from float16 in registers (a
// widened copy in a scratch cost a store and a load per value, and did not fit L1). `CH` = Dh / 8 where known at compile time (the
// common head sizes), so the inner loops keep to registers; 0 = runtime-sized.
template <int CH, typename KV>
void attend(const float* q, int64_t group, const Cache<KV>& c, int64_t seq, int64_t h0,
            int64_t h1, int64_t key_start, int64_t num_keys, float* out, float* state,
            int64_t mask_before) {
    const int64_t dh = c.head_dim, bs = c.block_size, stride = c.num_kv_heads * dh;
    const int64_t heads = (h1 - h0) * group;
    // whole blocks per span: as many as fit SPAN keys, or one bigger block
    const int64_t span_keys = bs > SPAN ? bs : SPAN - SPAN % bs;
    // a KV head's query heads in tiles as even as can be (group 5: 3 + 2)
    const int64_t tiles = (group + TILE_HEADS - 1) / TILE_HEADS;
    const int64_t tile_heads = (group + tiles - 1) / tiles;
    alignas(64) float acc[MAX_ITEM_HEADS * MAX_HEAD_DIM];
    float m[MAX_ITEM_HEADS], l[MAX_ITEM_HEADS];
    for (int64_t g = 0; g < heads; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.f;
        for (int64_t i = 0; i < dh; ++i) acc[g * dh + i] = 0.f;
    }
    const auto span = [&](int64_t gt, auto&&... args) {  // (by reference: `ahead` moves on)
        switch (gt) {
            case 1: return span_tile<CH, 1>(args...);
            case 2: return span_tile<CH, 2>(args...);
            case 3: return span_tile<CH, 3>(args...);
            default: return span_tile<CH, 4>(args...);
        }
    };
    // offsets of the rows of head h0: this span's, and the next's
    int64_t rows_now[MAX_SPAN], rows_next[MAX_SPAN];
    const auto span_rows = [&](int64_t first, int64_t* offset) {
        const int64_t n = std::max<int64_t>(0, std::min(span_keys, num_keys - first));
        for (int64_t b0 = 0; b0 < n; b0 += bs) {
            const int64_t r = c.row(seq, first + b0, h0), rows = std::min(bs, n - b0);
            for (int64_t j = 0; j < rows; ++j) offset[b0 + j] = r + j * stride;
        }
        return n;
    };
    const KV* krow[MAX_SPAN + 8];
    const KV* vrow[MAX_SPAN + 8];
    const int64_t row_bytes = (h1 - h0) * dh * int64_t(sizeof(KV));  // of heads [h0, h1)
    span_rows(key_start, rows_now);
    for (int64_t first = key_start; first < num_keys; first += span_keys) {
        const int64_t n = std::min(span_keys, num_keys - first);
        const int64_t n_next = span_rows(first + n, rows_next);
        load_rows(c, rows_now, n, row_bytes);
        NextRows<KV> ahead(c, rows_next, n_next, row_bytes, (h1 - h0) * tiles * ((n + 7) & ~7));
        const int64_t masked = std::clamp<int64_t>(mask_before - first, 0, n);
        for (int64_t h = h0; h < h1; ++h) {
            for (int64_t j = 0; j < n; ++j) {
                krow[j] = c.k + rows_now[j] + (h - h0) * dh;
                vrow[j] = c.v + rows_now[j] + (h - h0) * dh;
            }
            for (int64_t j = n; j < ((n + 7) & ~7); ++j) krow[j] = krow[0];  // padding lanes
            const int64_t end = (h - h0 + 1) * group;
            for (int64_t g = (h - h0) * group; g < end; g += tile_heads)
                span(std::min(tile_heads, end - g), q + g * dh, dh, krow, vrow, n, masked, m + g,
                     l + g, acc + g * dh, ahead);
        }
        std::copy(rows_next, rows_next + n_next, rows_now);
    }
    for (int64_t g = 0; g < heads; ++g) {
        const float inv = state ? 1.f : 1.f / l[g];  // a partial state stays unnormalized
        for (int64_t i = 0; i < dh; ++i) out[g * dh + i] = acc[g * dh + i] * inv;
        if (state) state[2 * g] = m[g], state[2 * g + 1] = l[g];
    }
}

// Attention of `rows` query rows [rows, Dh] (scaled), all for KV head `h`, over the keys of
// sequence `seq`'s blocks: row r sees keys [key_start, row_keys[r]), and row_keys ascends;
// with a `window`, keys [row_keys[r] - window, row_keys[r]) only. Leaves each
// row's online-softmax state: running max m, sum l and unnormalized output acc [rows, Dh].
// Two uses: a prefill chunk's tokens (row_keys grows by one per token: causal), and decodes of
// several sequences over a range of the prefix blocks they share (every row sees it whole).
// GEMM-shaped, as torch's SDPA would be, but over the paged cache in place: per span of
// CHUNK_SPAN keys, K is copied transposed (and widened) into an L1 scratch once for all rows,
// so a tile of ROW_TILE rows scores 32 keys at a time with broadcast multiply-adds and no lane
// sums; then each row's online softmax, and P @ V two rows per V load where registers allow.
// The next span's rows are prefetched over this one's tiles (NextRows): 16 decodes behind a
// 1,024-token prefix waited on V's loads without (483 -> 410 us a layer, Zen 4, interleaved).
template <int CH, typename KV>
void attend_rows(const float* q, int64_t rows, const int64_t* row_keys, const Cache<KV>& c,
                 int64_t seq, int64_t h, float* m, float* l, float* acc, int64_t window,
                 int64_t key_start) {
    const int64_t dh = c.head_dim, chunks = CH ? CH : dh / 8;
    const int64_t num_keys = row_keys[rows - 1];
    alignas(64) float kt[MAX_HEAD_DIM][CHUNK_SPAN];  // K transposed: kt[d][j]
    alignas(64) float vw[CHUNK_SPAN][MAX_HEAD_DIM];
    const float* vrow[CHUNK_SPAN];
    for (int64_t r = 0; r < rows; ++r) {
        m[r] = -INFINITY;
        l[r] = 0.f;
        for (int64_t i = 0; i < dh; ++i) acc[r * dh + i] = 0.f;
    }
    for (int64_t j = 0; j < CHUNK_SPAN; ++j) vrow[j] = vw[j];
    // each row's first key; keys before the first row's are skipped whole
    const auto row_lo = [&](int64_t r) {
        return window ? std::max<int64_t>(key_start, row_keys[r] - window) : key_start;
    };
    const int64_t tiles = (rows + ROW_TILE - 1) / ROW_TILE;
    // cache rows of this span's keys and the next's (which come into L2 during this span's
    // arithmetic)
    int64_t rows_now[CHUNK_SPAN], rows_next[CHUNK_SPAN];
    for (int64_t j = 0; j < std::min(CHUNK_SPAN, num_keys - row_lo(0)); ++j)
        rows_now[j] = c.row(seq, row_lo(0) + j, h);
    for (int64_t first = row_lo(0); first < num_keys; first += CHUNK_SPAN) {
        const int64_t n = std::min(CHUNK_SPAN, num_keys - first);
        const int64_t n_next = std::max<int64_t>(0, std::min(CHUNK_SPAN, num_keys - first - n));
        for (int64_t j = 0; j < n_next; ++j) rows_next[j] = c.row(seq, first + n + j, h);
        NextRows<KV> ahead(c, rows_next, n_next, dh * int64_t(sizeof(KV)),
                           tiles * ((n + SCORE_KEYS - 1) / SCORE_KEYS));
        for (int64_t j0 = 0; j0 < CHUNK_SPAN; j0 += 8) {  // eight keys at a time
            const KV* krows[8];
            for (int64_t j = j0; j < j0 + 8; ++j) {
                const int64_t r = rows_now[j < n ? j : 0];
                krows[j - j0] = c.k + r;
                if (j < n) widen_row(c.v + r, dh, vw[j]);
            }
            for (int64_t d = 0; d < dh; d += 8) {  // an 8 x 8 tile of K, transposed
                v8 tile[8];
                for (int i = 0; i < 8; ++i) tile[i] = j0 + i < n ? load8(krows[i] + d) : v8{};
                transpose8(tile);
                for (int i = 0; i < 8; ++i) __builtin_memcpy(&kt[d + i][j0], &tile[i], sizeof(v8));
            }
        }
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
            const int64_t tile = std::min<int64_t>(ROW_TILE, rows - r0);
            if (first >= row_keys[r0 + tile - 1]) continue;  // no row of the tile sees these
            alignas(32) float scores[ROW_TILE][CHUNK_SPAN + 8];
            for (int64_t j0 = 0; j0 < n; j0 += SCORE_KEYS) {  // the tile's scores, 32 keys a pass
                ahead.some();
                v8 sc[ROW_TILE][SCORE_KEYS / 8] = {};
                for (int64_t d = 0; d < dh; ++d) {
                    v8 k[SCORE_KEYS / 8];
                    for (int i = 0; i < SCORE_KEYS / 8; ++i) k[i] = load8(&kt[d][j0 + i * 8]);
                    for (int64_t t = 0; t < ROW_TILE; ++t) {
                        const float x = q[(r0 + (t < tile ? t : 0)) * dh + d];
                        for (int i = 0; i < SCORE_KEYS / 8; ++i) sc[t][i] += x * k[i];
                    }
                }
                for (int64_t t = 0; t < ROW_TILE; ++t)
                    __builtin_memcpy(&scores[t][j0], sc[t], sizeof sc[t]);
            }
            int64_t keys[ROW_TILE];  // each row's keys in this span (causal), 0: none
            float shrink[ROW_TILE];
            for (int64_t t = 0; t < tile; ++t) {
                const int64_t r = r0 + t, lo = row_lo(r) - first;
                keys[t] = std::max<int64_t>(0, std::min(n, row_keys[r] - first));
                if (lo >= keys[t]) keys[t] = 0;  // its window begins after this span's keys
                for (int64_t j = 0; j < lo && j < keys[t]; ++j) scores[t][j] = -INFINITY;
                if (keys[t]) shrink[t] = softmax_step(scores[t], keys[t], m[r], l[r]);
            }
            int64_t t = 0;
#if defined(__AVX512F__)  // two rows' sums and a V row fit 32 registers, not 16
            for (; t + 1 < tile; t += 2) {  // rows come in position order: keys[t] <= keys[t+1]
                const int64_t r = r0 + t, common = keys[t];
                if (common == 0 || keys[t + 1] < common) {  // t sees none yet, or t + 1 none
                    if (common)  // (a window can leave the later row none of this span)
                        pv<CH>(scores[t], common, vrow, chunks, shrink[t], acc + r * dh);
                    if (keys[t + 1])
                        pv<CH>(scores[t + 1], keys[t + 1], vrow, chunks, shrink[t + 1],
                               acc + (r + 1) * dh);
                    continue;
                }
                pv2<CH>(scores[t], scores[t + 1], common, vrow, chunks, shrink[t],
                        shrink[t + 1], acc + r * dh, acc + (r + 1) * dh);
                if (keys[t + 1] > common)
                    pv<CH>(scores[t + 1] + common, keys[t + 1] - common, vrow + common, chunks,
                           1.f, acc + (r + 1) * dh);
            }
#endif
            for (; t < tile; ++t)
                if (keys[t])
                    pv<CH>(scores[t], keys[t], vrow, chunks, shrink[t], acc + (r0 + t) * dh);
        }
        ahead.rest();
        std::copy(rows_next, rows_next + n_next, rows_now);
    }
}

// make(std::integral_constant<int, Dh / 8>) for the head sizes models use, so that the
// kernels get their register blocking at compile time; make(..., 0>) (runtime-sized) otherwise.
template <typename Make>
auto for_head_dim(int64_t head_dim, Make make) {
    switch (head_dim) {
        case 32: return make(std::integral_constant<int, 4>{});
        case 64: return make(std::integral_constant<int, 8>{});
        case 80: return make(std::integral_constant<int, 10>{});
        case 96: return make(std::integral_constant<int, 12>{});
        case 128: return make(std::integral_constant<int, 16>{});
        default: return make(std::integral_constant<int, 0>{});
    }
}

template <typename KV>
int run(const float* qkv, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
        int64_t head_dim, const float* cos, const float* sin, KV* k_cache, KV* v_cache,
        const int64_t* slots, const int32_t* tables, int64_t max_blocks, const int64_t* starts,
        const int64_t* ctx, int64_t num_seqs, int64_t block_size, int64_t max_query_len,
        float scale, float* q_out, float* out, int num_threads, int64_t window) {
    const int64_t group = num_heads / num_kv_heads;
    if (head_dim > MAX_HEAD_DIM || head_dim % 8 || group > MAX_GROUP ||
        num_heads % num_kv_heads || block_size > MAX_BLOCK)
        return 1;
    const Cache<KV> c{k_cache, v_cache, block_size, num_kv_heads, head_dim, tables, max_blocks};
    // Decodes that share leading cache blocks (a cached prompt prefix) attend over them
    // together, as rows of one GEMM-shaped item per KV head (`attend_rows`), and each over its
    // own remaining keys alone; the two softmax states merge at the end (cascade attention).
    std::vector<int64_t> decodes;  // sequence ids with one query
    for (int64_t b = 0; b < num_seqs; ++b)
        if (starts[b + 1] - starts[b] == 1) decodes.push_back(b);
    std::sort(decodes.begin(), decodes.end(), [&](int64_t a, int64_t b) {
        return std::lexicographical_compare(tables + a * max_blocks, tables + (a + 1) * max_blocks,
                                            tables + b * max_blocks, tables + (b + 1) * max_blocks);
    });
    std::vector<int64_t> prefix_keys(num_seqs, 0);  // keys a sequence's shared items cover
    std::vector<int64_t> prefix_parts(num_seqs, 0);  // and in how many key ranges
    // decodes[first, first + count) over prefix keys [lo, hi), the `part`-th range of theirs
    struct Shared { int64_t first, count, lo, hi, part; };
    std::vector<Shared> shared;
    const int64_t max_members = std::max<int64_t>(1, MAX_CHUNK_ROWS / group);
    int64_t num_parts = 0;
    // (a window starts each decode's keys at its own position: no prefix to share)
    for (size_t i = 0; i < decodes.size() && !window;) {
        // the longest run of sorted decodes whose tables agree on at least MIN_SHARED_KEYS
        const int32_t* lead = tables + decodes[i] * max_blocks;
        int64_t common = (ctx[decodes[i]] - 1) / block_size;  // whole blocks before its query
        size_t j = i + 1;
        for (; j < decodes.size(); ++j) {
            const int32_t* other = tables + decodes[j] * max_blocks;
            int64_t same = 0;
            const int64_t limit = std::min(common, (ctx[decodes[j]] - 1) / block_size);
            while (same < limit && other[same] == lead[same]) ++same;
            // a member that would cut the run's common prefix starts a run of its own: one
            // short overlap must not send every member's shared blocks back to decode alone
            if (same * block_size < MIN_SHARED_KEYS || (j > i + 1 && same < common)) break;
            common = same;
        }
        const int64_t run = int64_t(j - i);
        if (run >= 2) {
            // As many members an item as its rows hold (each span of K and V, transposed and
            // widened once, then serves them all), and the prefix cut into key ranges so that
            // every thread gets two items; the ranges' softmax states merge like the own part's.
            // (16 decodes behind 1,024 tokens, 3 KV heads, 2 threads, interleaved on Zen 4: in
            // groups of at most 6, the whole prefix an item, 524 us a layer; one group of 16 in
            // 2 ranges 486, in 3 ranges 505, in 4 ranges 519.)
            const int64_t groups = (run + max_members - 1) / max_members;
            const int64_t per_group = (run + groups - 1) / groups;
            const int64_t keys = common * block_size;
            const int64_t spans = (keys + CHUNK_SPAN - 1) / CHUNK_SPAN;
            const int64_t parts = std::clamp<int64_t>(
                (2 * num_threads + groups * num_kv_heads - 1) / (groups * num_kv_heads), 1,
                std::min(spans, MAX_PREFIX_PARTS));
            for (int64_t part = 0; part < parts; ++part) {
                const int64_t lo = spans * part / parts * CHUNK_SPAN;
                const int64_t hi = std::min(keys, spans * (part + 1) / parts * CHUNK_SPAN);
                for (int64_t at = 0; at < run; at += per_group)
                    shared.push_back({int64_t(i) + at, std::min(per_group, run - at), lo, hi,
                                      part});
            }
            for (size_t x = i; x < j; ++x) {
                prefix_keys[decodes[x]] = keys;
                prefix_parts[decodes[x]] = parts;
            }
            num_parts = std::max(num_parts, parts);
        }
        i = j;
    }
    std::vector<int64_t> decode_index(num_seqs, -1);  // a decode's row in the states below
    for (size_t x = 0; x < decodes.size(); ++x) decode_index[decodes[x]] = int64_t(x);

    // Work items: shared-prefix rows (one per member group, key range and KV head); prefill
    // chunks' tiles (sequence, KV head, up to MAX_CHUNK_ROWS rows), up to `max_query_len`
    // queries; and decodes (token, KV heads [h0, h1)). Decode is bound by memory traffic: a
    // cache block holds every head's rows, so an item that takes all of a token's heads reads
    // each block once, in one stream; with fewer tokens than two per thread, items take one
    // head each.
    const int64_t heads_per_item = int64_t(decodes.size()) >= 2 * num_threads
                                       ? std::min(num_kv_heads, MAX_ITEM_HEADS / group)
                                       : 1;
    const int64_t tile_tokens = max_members;
    enum Kind : int64_t { SHARED, CHUNK, DECODE };
    struct Item { Kind kind; int64_t a, h0, h1, tokens; };  // a: token, or index into shared
    std::vector<Item> items;
    int64_t work = num_tokens * num_heads * head_dim;  // multiply-adds, roughly
    for (int64_t x = 0; x < int64_t(shared.size()); ++x)
        for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({SHARED, x, h, h + 1, 0});
    for (int64_t b = 0; b < num_seqs; ++b) {
        const int64_t len = starts[b + 1] - starts[b];
        if (len > 1 && len <= max_query_len) {
            for (int64_t t = starts[b]; t < starts[b + 1]; t += tile_tokens)
                for (int64_t h = 0; h < num_kv_heads; ++h)
                    items.push_back({CHUNK, t, h, h + 1, std::min(tile_tokens, starts[b + 1] - t)});
            work += len * (window ? std::min(window + len, ctx[b]) : ctx[b]) * num_heads *
                    head_dim;
        }
    }
    for (int64_t b : decodes) {
        for (int64_t h = 0; h < num_kv_heads; h += heads_per_item)
            items.push_back({DECODE, starts[b], h, std::min(num_kv_heads, h + heads_per_item), 0});
        work += (window ? std::min(window, ctx[b]) : ctx[b]) * num_heads * head_dim;
    }
    std::vector<int64_t> seq_of(num_tokens);
    for (int64_t b = 0; b < num_seqs; ++b)
        for (int64_t t = starts[b]; t < starts[b + 1]; ++t) seq_of[t] = b;
    const int64_t num_items = int64_t(items.size());
    // The shared items' states [part, decode, head] (m, l) and unnormalized outputs; the
    // decodes' own parts go to `out` and `own_state` [decode, head] the same way, then merge.
    const int64_t stated = shared.empty() ? 0 : int64_t(decodes.size()) * num_heads;
    std::vector<float> shared_state(2 * num_parts * stated), own_state(2 * stated);
    std::vector<float> shared_out(num_parts * stated * head_dim);
    // A second thread costs its wake-up and a barrier: a small step (one short decode) is done
    // sooner alone. (At 1 << 20, one decode at 300 tokens ran alone: the step's attention took
    // 2.1 ms of a 1B model's 24 ms step, 1.3-1.5 ms on both threads; the default model's 1.5
    // against 0.9-1.0 of 5.5; at 100 tokens or fewer, one thread is as fast. Zen 4.)
    if (work < MIN_WORK_PER_THREAD) num_threads = 1;
    const auto attend_fn = for_head_dim(head_dim, [](auto ch) {
        return &attend<decltype(ch)::value, KV>;
    });
    const auto rows_fn = for_head_dim(head_dim, [](auto ch) {
        return &attend_rows<decltype(ch)::value, KV>;
    });

    const FlushDenormals flush;
#pragma omp parallel num_threads(num_threads)
    {
        const FlushDenormals flush_worker;
        // Every token's K/V is stored before any query reads the cache.
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tokens; ++t)
            rope_and_store(qkv, t, num_heads, c, cos, sin, slots, q_out);
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < num_items; ++w) {
            const Item& item = items[w];
            if (item.kind == DECODE) {
                const int64_t t = item.a, b = seq_of[t];
                const int64_t first = (t * num_heads + item.h0 * group) * head_dim;
                const int64_t size = (item.h1 - item.h0) * group * head_dim;
                float q[MAX_ITEM_HEADS * MAX_HEAD_DIM];
                for (int64_t i = 0; i < size; ++i) q[i] = q_out[first + i] * scale;
                float* state =
                    prefix_keys[b]
                        ? own_state.data() + 2 * (decode_index[b] * num_heads + item.h0 * group)
                        : nullptr;
                // a window's first key, and the start of its cache block (blocks are read
                // whole): the keys between score -inf
                const int64_t lo = window ? std::max<int64_t>(0, ctx[b] - window) : 0;
                const int64_t key_start = window ? lo - lo % block_size : prefix_keys[b];
                attend_fn(q, group, c, b, item.h0, item.h1, key_start, ctx[b], out + first,
                          state, lo);
                continue;
            }
            // rows (token, query head of KV head h): gathered, attended, scattered back
            const int64_t h = item.h0, size = group * head_dim;
            alignas(64) float q[MAX_CHUNK_ROWS * MAX_HEAD_DIM];
            alignas(64) float o[MAX_CHUNK_ROWS * MAX_HEAD_DIM];
            int64_t token[MAX_CHUNK_ROWS], row_keys[MAX_CHUNK_ROWS];
            float m[MAX_CHUNK_ROWS], l[MAX_CHUNK_ROWS];
            int64_t count, seq;
            if (item.kind == CHUNK) {  // consecutive tokens of one sequence, causal
                count = item.tokens, seq = seq_of[item.a];
                for (int64_t i = 0; i < count; ++i) token[i] = item.a + i;
            } else {  // decodes sharing a prefix: any member's table names its blocks
                const Shared& group_of = shared[item.a];
                count = group_of.count, seq = decodes[group_of.first];
                for (int64_t i = 0; i < count; ++i) token[i] = starts[decodes[group_of.first + i]];
            }
            for (int64_t i = 0; i < count; ++i) {
                const int64_t b = seq_of[token[i]];
                const int64_t keys = item.kind == CHUNK ? ctx[b] - (starts[b + 1] - token[i]) + 1
                                                        : shared[item.a].hi;
                const float* from = q_out + (token[i] * num_heads + h * group) * head_dim;
                for (int64_t g = 0; g < group; ++g) row_keys[i * group + g] = keys;
                for (int64_t x = 0; x < size; ++x) q[i * size + x] = from[x] * scale;
            }
            rows_fn(q, count * group, row_keys, c, seq, h, m, l, o,
                    item.kind == CHUNK ? window : 0, item.kind == CHUNK ? 0 : shared[item.a].lo);
            for (int64_t i = 0; i < count; ++i) {
                const int64_t at = item.kind == CHUNK
                                       ? token[i] * num_heads + h * group
                                       : (shared[item.a].part * int64_t(decodes.size()) +
                                          decode_index[seq_of[token[i]]]) * num_heads + h * group;
                for (int64_t g = 0; g < group; ++g) {
                    const int64_t r = i * group + g;
                    if (item.kind == CHUNK) {
                        const float inv = 1.f / l[r];
                        for (int64_t x = 0; x < head_dim; ++x)
                            out[(at + g) * head_dim + x] = o[r * head_dim + x] * inv;
                    } else {
                        shared_state[2 * (at + g)] = m[r];
                        shared_state[2 * (at + g) + 1] = l[r];
                        __builtin_memcpy(shared_out.data() + (at + g) * head_dim,
                                         o + r * head_dim, head_dim * sizeof(float));
                    }
                }
            }
        }
        // Merge each decode's own state with its prefix ranges': rescale all to their common
        // max, add in range order, then the own part, normalize.
#pragma omp for schedule(static)
        for (int64_t x = 0; x < int64_t(decodes.size()); ++x) {
            const int64_t b = decodes[x], parts = prefix_parts[b];
            if (!prefix_keys[b]) continue;
            for (int64_t head = 0; head < num_heads; ++head) {
                const int64_t own = x * num_heads + head;
                const auto at = [&](int64_t part) { return part * stated + own; };
                float top = own_state[2 * own];
                for (int64_t part = 0; part < parts; ++part)
                    top = std::max(top, shared_state[2 * at(part)]);
                float sum = 0.f, acc[MAX_HEAD_DIM] = {};
                for (int64_t part = 0; part < parts; ++part) {
                    const float a = exp_nonpositive(shared_state[2 * at(part)] - top);
                    const float* s = shared_out.data() + at(part) * head_dim;
                    sum += shared_state[2 * at(part) + 1] * a;
                    for (int64_t i = 0; i < head_dim; ++i) acc[i] += s[i] * a;
                }
                const float e = exp_nonpositive(own_state[2 * own] - top);
                const float inv = 1.f / (sum + own_state[2 * own + 1] * e);
                float* o = out + (starts[b] * num_heads + head) * head_dim;
                for (int64_t i = 0; i < head_dim; ++i) o[i] = (acc[i] + o[i] * e) * inv;
            }
        }
    }
    return 0;
}

}  // namespace

// library.py builds each entry point as its own object (LLMBUS_PAGED_ATTENTION_F32 / _F16),
// in parallel; without either define, this file gives both.
#if !defined(LLMBUS_PAGED_ATTENTION_F32) && !defined(LLMBUS_PAGED_ATTENTION_F16)
#define LLMBUS_PAGED_ATTENTION_F32
#define LLMBUS_PAGED_ATTENTION_F16
#endif

extern "C" {

#if defined(LLMBUS_PAGED_ATTENTION_F32)
int paged_attention_f32(const float* qkv, int64_t num_tokens, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, const float* cos,
                        const float* sin, float* k_cache, float* v_cache, const int64_t* slots,
                        const int32_t* tables, int64_t max_blocks, const int64_t* starts,
                        const int64_t* ctx, int64_t num_seqs, int64_t block_size,
                        int64_t max_query_len, float scale, float* q_out, float* out,
                        int num_threads, int64_t window) {
    return run(qkv, num_tokens, num_heads, num_kv_heads, head_dim, cos, sin, k_cache, v_cache,
               slots, tables, max_blocks, starts, ctx, num_seqs, block_size, max_query_len,
               scale, q_out, out, num_threads, window);
}
#endif

#if defined(LLMBUS_PAGED_ATTENTION_F16)
int paged_attention_f16(const float* qkv, int64_t num_tokens, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, const float* cos,
                        const float* sin, _Float16* k_cache, _Float16* v_cache,
                        const int64_t* slots, const int32_t* tables, int64_t max_blocks,
                        const int64_t* starts, const int64_t* ctx, int64_t num_seqs,
                        int64_t block_size, int64_t max_query_len, float scale, float* q_out,
                        float* out, int num_threads, int64_t window) {
    return run(qkv, num_tokens, num_heads, num_kv_heads, head_dim, cos, sin, k_cache, v_cache,
               slots, tables, max_blocks, starts, ctx, num_seqs, block_size, max_query_len,
               scale, q_out, out, num_threads, window);
}
#endif

}  // extern "C"
