// The dense work of a step on the GGUF's codes, with integer activations, on the same OpenMP
// threads as the attention kernel: every step of the fast mode, from one stream's decode to a
// batch of decodes or a prompt chunk.
//
// Why: a one-token step streams every weight once, so it is bound by memory and wants every
// core. ONNX Runtime cannot give it two: its per-session pools must wake a sleeping thread for
// each of the ~31 graphs of a step (no faster than one thread, measured), and its spinning
// process-wide pool keeps spinning after a run and starves the attention between graphs. The
// OpenMP threads here spin only briefly between the step's parallel regions, which follow each
// other closely, and the attention kernel (paged_attention.cpp) runs on the same ones. Steps of
// a few dozen tokens are bound by arithmetic instead; there the tiled layout below lets one
// vector instruction do 32 multiply-adds for 8 output columns at once, with no horizontal sums
// (2 Zen 4 cores, the default model's 30 layers at 16 tokens: 10-12 ms, ONNX Runtime's
// MatMulNBits ~30); AVX-512 builds take two column groups a vector (int_lanes.h: a 1B model's
// Q4_K matrices at 256 tokens on 2 Sapphire Rapids cores, 255 -> 370 GMAC/s), and Q4 steps of
// 16 tokens or more go through AMX tiles where the CPU has them (amx_tiles.h, 500 GMAC/s).
//
// The math is llama.cpp's and ONNX Runtime's fast path: activations quantized per block of 32
// (x ~ d * q; int8 with d = max|x| / 127, or int16 with d = max|x| / 32767 where a matrix wants
// `wide` activations), integer dot products with the weight codes, one float scale per block.
// For Q4 weights (w = s * code + m) the minimums' share is m times the block's sum of the
// quantized x, d * sum(q), as llama.cpp's q8_1 blocks carry it. (The sum of x itself would be
// exact, but then the activations' rounding error meets s * code, whose codes 0..15 sit far
// from zero, instead of w = s * code + m, centered: on the default model that doubled the
// error of every int8 matmul, 1 - cos(logits) 3.6e-5 against exact where d * sum(q) gives
// 1.1e-5, and perplexity +0.44% against +0.17%.) The integer sums are exact, so the result
// does not depend on the order of any float sum.
//
// Layouts (quant_parts.py builds them from the GGUF's blocks), for an [n, k] matrix, n a
// multiple of 8, blocks of 32 along k; "column group" c is output columns 8c .. 8c + 7:
//   Q4 (Q4_1; Q4_0 in Q4_1 form): codes [n/8, k/32, 4, 32] uint8: in quarter h of block g,
//      byte 4j + i holds column 8c + j's code of input 32g + 8h + i in its low nibble and of
//      input 32g + 8h + 4 + i in its high one; scales, mins [n/8, k/32, 8] float32.
//   Q4 with sub-scales (Q4_K kept factored, 0.59 bytes a weight instead of 0.75): scales,
//      mins [n/8, k/256, 8] float32 per super-block of 8 blocks; sub_scales, sub_mins
//      [n/8, k/32, 8] uint8; block g's scale is scales[g / 8] * sub_scales[g], one float32
//      product, the same that loading it in Q4_1 form computes (so the results are too).
//   Q8_0: codes [n/8, k/32, 8, 32] int8: in eighth e of block g, byte 4j + i is column
//      8c + j's code of input 32g + 4e + i; scales [n/8, k/32, 8] float32; w = s * code.
//   KQ (Q2_K, Q3_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS at the file's bits): see k_quant_tiles.h.
// So each 32-bit lane of a 32-byte load is one column's four consecutive codes: a dot-product
// instruction against four activations broadcast to every lane yields eight columns' sums.
// Activations and outputs are float32 [T, width] rows.

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "entry_points.h"
#include "exp_nonpositive.h"
#include "fixed_order_sum.h"
#include "flush_denormals.h"
#include "int_lanes.h"

namespace {

constexpr int64_t GROUP = 32;
constexpr int64_t COLUMNS = 8;  // output columns per column group (one 8-lane vector)
constexpr int MAX_PARTS = 3;
#if defined(__AVX512F__)
constexpr int ROWS = 8;  // activation rows per register tile: 2-3 vectors each of 32 registers
#else
constexpr int ROWS = 4;  // of 16
#endif

// Rows per panel: a panel's int8 activations (at most 256 x 1,536 bytes for the default model's
// down projection) stay in a core's L2 cache while every column group passes over them.
constexpr int64_t PANEL = 256;

enum Kind : int32_t { NONE = 0, Q4 = 1, Q8 = 2, KQ = 3 };

}  // namespace

extern "C" {

// One quantized matrix; mirrored by int_step.py's ctypes structures.
struct IntMatrix {
    int32_t kind;
    int32_t pad;
    int64_t wide_rows;  // Q4 only: steps of at most this many tokens take int16 activations
    int64_t n, k;
    const uint8_t* codes;
    const float* scales;
    const float* mins;  // Q4 only
    const uint8_t* sub_scales;  // Q4 with sub-scales and KQ only, else null
    const uint8_t* sub_mins;
    const uint8_t* high_codes;  // KQ only (k_quant_tiles.h), as its format and below
    int32_t format, pad2;
};

// A row-stack of up to three matrices sharing k (QKV, gate + up): outputs side by side.
struct IntLinear {
    IntMatrix parts[MAX_PARTS];
    int64_t num_parts;
};

// The work between two attentions (as onnx_graphs.layer_graphs cuts it): the previous layer's
// O projection and FFN (absent before the first layer), then the next layer's norm and QKV
// (absent after the last).
struct IntBoundary {
    IntLinear o, gate_up, down;
    const float* ffn_norm;
    IntLinear qkv;
    const float* attn_norm;
};

}  // extern "C"

namespace {

// Rows of x quantized per block: codes [T, k] (int8, or int16 with each four inputs stored as
// 0, 2, 1, 3 so that a 32-bit lane holds the pair one multiply-add instruction takes), the
// scales d and the blocks' sums of the quantized values, d * sum(q) [T, k/32].
struct Quantized {
    std::vector<int8_t> q8;
    std::vector<int16_t> q16;
    std::vector<float> d8, d16, sum8, sum16;
    std::vector<int32_t> half8;  // each int8 block's sum(q) over its two halves of 16
};

float block_amax(const float* v) {
    float amax = 0.f;
#pragma omp simd reduction(max : amax)
    for (int i = 0; i < GROUP; ++i) amax = std::max(amax, std::fabs(v[i]));
    return amax;
}

// One block of 32 inputs to int8 codes; returns its scale, d * sum(q) in `sum` and the sums of
// q over each half in `halves`.
float quantize_int8(const float* v, int8_t* q, float& sum, int32_t* halves) {
    const float amax = block_amax(v);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t first = 0, second = 0;
#pragma omp simd reduction(+ : first)
    for (int i = 0; i < GROUP / 2; ++i) {
        q[i] = int8_t(std::nearbyint(v[i] * inv));
        first += q[i];
    }
#pragma omp simd reduction(+ : second)
    for (int i = GROUP / 2; i < GROUP; ++i) {
        q[i] = int8_t(std::nearbyint(v[i] * inv));
        second += q[i];
    }
    halves[0] = first;
    halves[1] = second;
    sum = float(first + second) * (amax / 127.f);
    return amax / 127.f;
}

// One block of 32 inputs to int16 codes, each four in the order 0, 2, 1, 3; returns its scale,
// and d * sum(q) in `sum`.
float quantize_int16(const float* v, int16_t* q, float& sum) {
    const float amax = block_amax(v);
    const float inv = amax > 0.f ? 32767.f / amax : 0.f;
    int32_t total = 0;
    for (int i = 0; i < GROUP; i += 4) {
        q[i] = int16_t(std::nearbyint(v[i] * inv));
        q[i + 1] = int16_t(std::nearbyint(v[i + 2] * inv));
        q[i + 2] = int16_t(std::nearbyint(v[i + 1] * inv));
        q[i + 3] = int16_t(std::nearbyint(v[i + 3] * inv));
        total += q[i] + q[i + 1] + q[i + 2] + q[i + 3];
    }
    sum = float(total) * (amax / 32767.f);
    return amax / 32767.f;
}

// One call's inputs to every tile: the quantized rows (from `first` on: a panel of rows whose
// activations stay in the core's cache while every column group passes over them).
struct Inputs {
    const Quantized* x;
    int64_t k, first, end;
    bool amx = false;  // this thread's AMX tiles are configured (amx_tiles.h)
};

bool takes_wide(const IntMatrix& w, int64_t T) { return w.kind == Q4 && T <= w.wide_rows; }

// One column group's Q4 or Q8 matrix: its codes, scales and minimums, with their sub-scales (or
// null), and the distances to the next column group's (a Lanes16 tile takes two groups).
struct Group {
    const uint8_t* codes;
    const float *s, *m;
    const uint8_t *ss, *sm;
    int64_t code_stride, factor_stride, sub_stride;
};

#if defined(__AVX2__)

// Block g's scales (or mins) for the vector's columns: stored per block, or a super-block's
// times the block's uint8 sub-scale.
template <class V>
inline typename V::F block_factors(const float* f, const uint8_t* sub, int64_t g,
                                   const Group& w) {
    if (sub == nullptr) return V::factors(f + g * COLUMNS, w.factor_stride);
    return V::mul(V::factors(f + (g >> 3) * COLUMNS, w.factor_stride),
                  V::to_float(V::widen_u8(sub + g * COLUMNS, w.sub_stride)));
}

// Block g's integer sums of R rows (isum(r)) into the rows' float outputs: acc += sums x the
// block's scale x the row's d, then (MINS) the minimums' share. Every tile that computes Q4 or
// Q8 sums (the vector tiles, amx_tiles.h) ends a block here, so all give the same bits.
template <class V, int R, bool MINS, class Sums>
inline void scale_block(const Group& w, int64_t g, int64_t G, const float* d, const float* sums,
                        Sums isum, typename V::F* acc) {
    const typename V::F scale = block_factors<V>(w.s, w.ss, g, w);
    for (int r = 0; r < R; ++r)
        acc[r] = V::fmadd(V::to_float(isum(r)), V::mul(scale, V::splat(d[r * G + g])), acc[r]);
    if constexpr (MINS) {
        const typename V::F mins = block_factors<V>(w.m, w.sm, g, w);
        for (int r = 0; r < R; ++r) acc[r] = V::fmadd(mins, V::splat(sums[r * G + g]), acc[r]);
    }
}

// Blocks ahead that a tile prefetches. A decode step streams each weight once: without
// prefetches the loads of each tile's codes stalled on memory, and each new tile began its
// streams cold (2 Zen 4 cores, one token: the default model's matmuls 6.3 -> 5.0 ms, a 1B
// Q4_K_M file's 31.4 -> 25.5 ms, 27 GB/s of a 30 GB/s read bandwidth; docs/measurements/
// 2026-12-04-zen4-matmul-prefetch.md). 16, 32 and 64 blocks measured alike, 8 too few; into
// L1 instead of L2, 7-20% slower.
constexpr int64_t PREFETCH_BLOCKS = 32;

// Prefetch into L2 block g + PREFETCH_BLOCKS of each of a tile's column groups' streams
// (`per_block` bytes a block, `stride` bytes from one group's to the next's); past the last
// block, of the groups GROUPS further on, which a static schedule gives this thread next. A
// stream of fewer than 64 bytes a block takes one prefetch every 64 bytes (a line each).
template <int GROUPS>
inline void prefetch_ahead(const void* base, int64_t stride, int64_t per_block, int64_t g,
                           int64_t G) {
    int64_t b = g + PREFETCH_BLOCKS, first = 0;
    for (; b >= G; b -= G) first += GROUPS;
    if (per_block < 64 && (b * per_block) % 64 >= per_block) return;  // 64 bytes not passed
    for (int s = 0; s < GROUPS; ++s) {
        const char* p = static_cast<const char*>(base) + (first + s) * stride + b * per_block;
        for (int64_t at = 0; at < per_block; at += 64) _mm_prefetch(p + at, _MM_HINT_T1);
    }
}

// y[row + r, the vector's columns] for R rows, from the blocks of the column groups at w.
template <class V, int R, Kind KIND, bool WIDE>
void tile(const Group& w, int64_t G, const Inputs& in, int64_t row, float* y, int64_t ldy,
          bool accumulate) {
    using I = typename V::I;
    using F = typename V::F;
    const Quantized& x = *in.x;
    const float* d = (WIDE ? x.d16.data() : x.d8.data()) + row * G;
    const float* sums = (WIDE ? x.sum16.data() : x.sum8.data()) + row * G;
    F acc[R];
    for (int r = 0; r < R; ++r) acc[r] = V::zero_f();
    const I low4 = V::splat8(0x0F), low8 = V::splat32(0x00FF00FF);
    for (int64_t g = 0; g < G; ++g) {
        if (row == in.first) {  // later tiles of these columns find the weights in cache
            prefetch_ahead<V::GROUPS>(w.codes, w.code_stride, KIND == Q8 ? 256 : 128, g, G);
            const int64_t factor_bytes = w.ss == nullptr ? 32 : 4;  // 8 floats a block or super
            prefetch_ahead<V::GROUPS>(w.s, w.factor_stride * 4, factor_bytes, g, G);
            if (KIND == Q4)
                prefetch_ahead<V::GROUPS>(w.m, w.factor_stride * 4, factor_bytes, g, G);
            if (w.ss != nullptr) {
                prefetch_ahead<V::GROUPS>(w.ss, w.sub_stride, 8, g, G);
                prefetch_ahead<V::GROUPS>(w.sm, w.sub_stride, 8, g, G);
            }
        }
        I isum[R];
        for (int r = 0; r < R; ++r) isum[r] = V::zero();
#if !HAVE_VNNI
        I pairs[R];
        for (int r = 0; r < R; ++r) pairs[r] = V::zero();
#endif
        if (KIND == Q8) {
            const int8_t* a = x.q8.data() + row * in.k + g * GROUP;
            for (int e = 0; e < 8; ++e) {
                const I c = V::codes(w.codes + (g * 8 + e) * 32, w.code_stride);
                const I magnitude = V::abs8(c);
                for (int r = 0; r < R; ++r) {
                    const I v = V::splat32(four_bytes(a + r * in.k + 4 * e));
                    isum[r] = V::dot_u8s8(isum[r], magnitude, V::signed_as(v, c));
                }
            }
        } else {
            for (int h = 0; h < 4; ++h) {
                const I c = V::codes(w.codes + (g * 4 + h) * 32, w.code_stride);
                const I lo = V::and_(c, low4);
                const I hi = V::and_(V::srli16(c, 4), low4);
                if (WIDE) {  // codes as int16 pairs: inputs (0, 2) and (1, 3) of each four
                    const I lo02 = V::and_(lo, low8), lo13 = V::and_(V::srli32(lo, 8), low8);
                    const I hi02 = V::and_(hi, low8), hi13 = V::and_(V::srli32(hi, 8), low8);
                    const int16_t* a = x.q16.data() + row * in.k + g * GROUP + 8 * h;
                    for (int r = 0; r < R; ++r) {
                        const int16_t* v = a + r * in.k;
                        isum[r] = V::dot_s16(isum[r], lo02, V::splat32(four_bytes(v)));
                        isum[r] = V::dot_s16(isum[r], lo13, V::splat32(four_bytes(v + 2)));
                        isum[r] = V::dot_s16(isum[r], hi02, V::splat32(four_bytes(v + 4)));
                        isum[r] = V::dot_s16(isum[r], hi13, V::splat32(four_bytes(v + 6)));
                    }
                } else {
                    const int8_t* a = x.q8.data() + row * in.k + g * GROUP + 8 * h;
                    for (int r = 0; r < R; ++r) {
                        const int8_t* v = a + r * in.k;
#if HAVE_VNNI
                        isum[r] = V::dot_u8s8(isum[r], lo, V::splat32(four_bytes(v)));
                        isum[r] = V::dot_u8s8(isum[r], hi, V::splat32(four_bytes(v + 4)));
#else  // int16 sums across the block: |each| <= 2 * 15 * 127, eight of them fit
                        pairs[r] = V::add16(pairs[r],
                                            V::pairs_u8s8(lo, V::splat32(four_bytes(v))));
                        pairs[r] = V::add16(pairs[r],
                                            V::pairs_u8s8(hi, V::splat32(four_bytes(v + 4))));
#endif
                    }
                }
            }
#if !HAVE_VNNI
            if (!WIDE)
                for (int r = 0; r < R; ++r) isum[r] = V::ones16(pairs[r]);
#endif
        }
        scale_block<V, R, KIND == Q4>(w, g, G, d, sums, [&](int r) { return isum[r]; }, acc);
    }
    for (int r = 0; r < R; ++r) {
        float* out = y + (row + r) * ldy;
        V::store_out(out, accumulate ? V::add(V::load_out(out), acc[r]) : acc[r]);
    }
}

#else  // no AVX2: plain loops over the same layout (correct, not fast)

// Block g's scale (or min) of column j: stored per block, or a super-block's times a sub-scale.
inline float block_factor(const float* f, const uint8_t* sub, int64_t g, int j) {
    if (sub == nullptr) return f[g * COLUMNS + j];
    return f[(g >> 3) * COLUMNS + j] * float(sub[g * COLUMNS + j]);
}

template <class V, int R, Kind KIND, bool WIDE>
void tile(const Group& w, int64_t G, const Inputs& in, int64_t row, float* y, int64_t ldy,
          bool accumulate) {
    const Quantized& x = *in.x;
    for (int r = 0; r < R; ++r) {
        for (int j = 0; j < COLUMNS; ++j) {
            float total = 0.f;
            for (int64_t g = 0; g < G; ++g) {
                const int64_t b = (row + r) * G + g;
                int64_t dot = 0;
                for (int i = 0; i < GROUP; ++i) {
                    int code;
                    if (KIND == Q8) {
                        code = int8_t(w.codes[(g * 8 + i / 4) * 32 + 4 * j + i % 4]);
                    } else {
                        const uint8_t byte = w.codes[(g * 4 + i / 8) * 32 + 4 * j + i % 4];
                        code = (i % 8) < 4 ? (byte & 15) : (byte >> 4);
                    }
                    const int64_t at = (row + r) * in.k + g * GROUP;
                    // int16 rows keep each four in the order 0, 2, 1, 3
                    const int slot = (i & ~3) | ((i & 1) << 1) | ((i >> 1) & 1);
                    dot += int64_t(code) * (WIDE ? x.q16[at + slot] : x.q8[at + i]);
                }
                total += float(dot) * block_factor(w.s, w.ss, g, j) * (WIDE ? x.d16[b] : x.d8[b]);
                const float sum = WIDE ? x.sum16[b] : x.sum8[b];
                if (KIND == Q4) total += block_factor(w.m, w.sm, g, j) * sum;
            }
            float& out = y[(row + r) * ldy + j];
            out = accumulate ? out + total : total;
        }
    }
}

#endif

#include "amx_tiles.h"

// Every row of `in` against V::GROUPS column groups from group c on.
template <class V, Kind KIND, bool WIDE>
void column_groups(const IntMatrix& w, int64_t c, const Inputs& in, float* y, int64_t ldy,
                   bool accumulate) {
    const int64_t G = w.k / GROUP;
    const int64_t code_stride = G * (KIND == Q8 ? 256 : 128);
    const bool factored = KIND == Q4 && w.sub_scales != nullptr;
    const int64_t per_group = (factored ? G / 8 : G) * COLUMNS;  // scales of one column group
    const Group group{w.codes + c * code_stride, w.scales + c * per_group,
                      KIND == Q4 ? w.mins + c * per_group : nullptr,
                      factored ? w.sub_scales + c * G * COLUMNS : nullptr,
                      factored ? w.sub_mins + c * G * COLUMNS : nullptr,
                      code_stride, per_group, G * COLUMNS};
    y += c * COLUMNS;
    int64_t row = in.first;
#if HAVE_AMX
    if constexpr (std::is_same_v<V, Lanes16> && KIND == Q4 && !WIDE)
        row = amx_q4_rows(group, G, in, row, y, ldy, accumulate);
#endif
    for (; row + ROWS <= in.end; row += ROWS)
        tile<V, ROWS, KIND, WIDE>(group, G, in, row, y, ldy, accumulate);
    for (; row + 2 <= in.end; row += 2)
        tile<V, 2, KIND, WIDE>(group, G, in, row, y, ldy, accumulate);
    if (row < in.end) tile<V, 1, KIND, WIDE>(group, G, in, row, y, ldy, accumulate);
}

#include "k_quant_tiles.h"

int64_t width(const IntLinear& l) {
    int64_t n = 0;
    for (int64_t p = 0; p < l.num_parts; ++p) n += l.parts[p].n;
    return n;
}

bool valid(const IntLinear& l) {
    if (l.num_parts < 1 || l.num_parts > MAX_PARTS) return false;
    for (int64_t p = 0; p < l.num_parts; ++p) {
        const IntMatrix& w = l.parts[p];
        if ((w.kind != Q4 && w.kind != Q8 && w.kind != KQ) || w.k != l.parts[0].k ||
            w.k % GROUP || w.n % COLUMNS)
            return false;
        if (w.kind == KQ) {
            if (!kq_valid(w)) return false;
        } else if (w.sub_scales != nullptr && (w.kind != Q4 || w.sub_mins == nullptr ||
                                               w.k % (8 * GROUP))) {
            return false;
        }
    }
    return true;
}

constexpr int64_t WIDEST = WidestLanes::GROUPS;  // column groups a vector takes

// A matrix's column groups in runs of WIDEST (its last run may be shorter).
int64_t runs(const IntMatrix& w) { return (w.n / COLUMNS + WIDEST - 1) / WIDEST; }

// Every row of `in` against V::GROUPS column groups of w from group c on.
template <class V>
void multiply(const IntMatrix& w, int64_t c, const Inputs& in, float* y, int64_t ldy, int64_t T,
              bool accumulate) {
    if (w.kind == Q8)
        column_groups<V, Q8, false>(w, c, in, y, ldy, accumulate);
    else if (w.kind == KQ)
        kq_dispatch<V>(w, c, in, y, ldy, accumulate);
    else if (takes_wide(w, T))
        column_groups<V, Q4, true>(w, c, in, y, ldy, accumulate);
    else
        column_groups<V, Q4, false>(w, c, in, y, ldy, accumulate);
}

struct Scratch {
    Quantized quantized;
    std::vector<float> normed, gate_up, act;
};

// y [T, width(l)] (=, or += with `accumulate`) x [T, k] @ W^T: the rows quantized, then each
// panel of rows against every column group, both shared among the threads.
void linear(const IntLinear& l, const float* x, int64_t T, float* y, bool accumulate,
            Scratch& scratch, int num_threads) {
    const int64_t k = l.parts[0].k;
    bool any_int8 = false, any_wide = false;
    for (int64_t p = 0; p < l.num_parts; ++p) {
        const bool wide = takes_wide(l.parts[p], T);
        any_wide |= wide;
        any_int8 |= !wide;
    }
    Quantized& q = scratch.quantized;
    const int64_t blocks = T * (k / GROUP);
    if (any_int8) {
        q.q8.resize(T * k);
        q.d8.resize(blocks);
        q.sum8.resize(blocks);
        q.half8.resize(2 * blocks);
    }
    if (any_wide) {
        q.q16.resize(T * k);
        q.d16.resize(blocks);
        q.sum16.resize(blocks);
    }
    const int64_t ldy = width(l);
    int64_t items = 0;  // runs of up to WIDEST column groups of one part: the work items
    for (int64_t p = 0; p < l.num_parts; ++p) items += runs(l.parts[p]);
#pragma omp parallel num_threads(num_threads)
    {
        const FlushDenormals flush_worker;
        const AmxTiles tiles;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            const float* v = x + b * GROUP;
            if (any_int8)
                q.d8[b] = quantize_int8(v, q.q8.data() + b * GROUP, q.sum8[b], &q.half8[2 * b]);
            if (any_wide) q.d16[b] = quantize_int16(v, q.q16.data() + b * GROUP, q.sum16[b]);
        }
        for (int64_t first = 0; first < T; first += PANEL) {
            const Inputs in{&q, k, first, std::min(T, first + PANEL), tiles.on()};
#pragma omp for schedule(static)
            for (int64_t item = 0; item < items; ++item) {
                int64_t p = 0, run = item, offset = 0;
                while (run >= runs(l.parts[p])) {
                    run -= runs(l.parts[p]);
                    offset += l.parts[p].n;
                    ++p;
                }
                const IntMatrix& w = l.parts[p];
                const int64_t c = run * WIDEST;
                if (c + WIDEST <= w.n / COLUMNS)
                    multiply<WidestLanes>(w, c, in, y + offset, ldy, T, accumulate);
                else  // a part's last column group, alone
                    multiply<Lanes8>(w, c, in, y + offset, ldy, T, accumulate);
            }
        }
    }
}

void rms_norm(const float* x, const float* weight, int64_t T, int64_t D, float eps, float* out) {
    for (int64_t t = 0; t < T; ++t) {
        const float* v = x + t * D;
        const float ss = fixed_order_sum(v, D, v);
        const float scale = 1.f / std::sqrt(ss / float(D) + eps);
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) out[t * D + i] = v[i] * scale * weight[i];
    }
}

// act[t, i] = silu(gate) * up for gate_up [T, 2I] = (gate | up).
void swiglu(const float* gate_up, int64_t T, int64_t I, float* act) {
    for (int64_t t = 0; t < T; ++t) {
        const float* g = gate_up + t * 2 * I;
        const float* u = g + I;
#pragma omp simd
        for (int64_t i = 0; i < I; ++i) {
            const float e = exp_nonpositive(-std::fabs(g[i]));  // sigmoid without overflow
            const float sigmoid = g[i] >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
            act[t * I + i] = g[i] * sigmoid * u[i];
        }
    }
}

thread_local Scratch scratch;

}  // namespace

extern "C" {

// y [T, width] = x [T, k] @ W^T for the row-stack `l`; `accumulate` adds to y instead.
int int_linear(const IntLinear* l, const float* x, int64_t T, float* y, int accumulate,
                 int num_threads) {
    if (!valid(*l) || T < 1) return 1;
    const FlushDenormals flush;
    linear(*l, x, T, y, accumulate != 0, scratch, num_threads);
    return 0;
}

// One boundary (see IntBoundary) on T tokens: hidden [T, D] (the residual stream, updated in
// place), attn [T, H * Dh] (the previous layer's attention output; unused before the first
// layer), qkv [T, (H + 2 Hkv) * Dh] (the next layer's projection; unused after the last).
// `lora`: the step's adapters (lora_delta.cpp; null: none), `layer`: this boundary's index, so
// its O and FFN are layer - 1's and its QKV layer's.
int int_boundary(const IntBoundary* b, int64_t T, int64_t D, float eps, float* hidden,
                   const float* attn, float* qkv, int num_threads, const LoraStep* lora,
                   int64_t layer) {
    if (T < 1) return 1;
    const FlushDenormals flush;
    scratch.normed.resize(T * D);
    int refused = 0;  // a LoRA matrix that does not fit its projection
    if (b->o.num_parts) {
        if (!valid(b->o) || !valid(b->gate_up) || !valid(b->down) || width(b->o) != D ||
            width(b->gate_up) % 2 || width(b->down) != D ||
            b->down.parts[0].k * 2 != width(b->gate_up))
            return 2;
        const int64_t I = width(b->gate_up) / 2, HDh = b->o.parts[0].k;
        linear(b->o, attn, T, hidden, true, scratch, num_threads);
        refused |= lora_add(lora, layer - 1, LORA_O, attn, HDh, T, hidden, D, 0, D, num_threads);
        rms_norm(hidden, b->ffn_norm, T, D, eps, scratch.normed.data());
        scratch.gate_up.resize(T * 2 * I);
        scratch.act.resize(T * I);
        float* gate_up = scratch.gate_up.data();
        linear(b->gate_up, scratch.normed.data(), T, gate_up, false, scratch, num_threads);
        for (const auto& [target, col] : {std::pair{LORA_GATE, int64_t(0)}, {LORA_UP, I}})
            refused |= lora_add(lora, layer - 1, target, scratch.normed.data(), D, T, gate_up,
                                2 * I, col, I, num_threads);
        swiglu(gate_up, T, I, scratch.act.data());
        linear(b->down, scratch.act.data(), T, hidden, true, scratch, num_threads);
        refused |= lora_add(lora, layer - 1, LORA_DOWN, scratch.act.data(), I, T, hidden, D, 0,
                            D, num_threads);
    }
    if (b->qkv.num_parts) {
        if (!valid(b->qkv) || b->qkv.parts[0].k != D) return 3;
        rms_norm(hidden, b->attn_norm, T, D, eps, scratch.normed.data());
        linear(b->qkv, scratch.normed.data(), T, qkv, false, scratch, num_threads);
        const IntLinear& l = b->qkv;
        int64_t col = 0;
        for (int64_t p = 0; p < l.num_parts; ++p) {  // Q, K, V (quant_parts.py stacks them)
            refused |= lora_add(lora, layer, LORA_Q + int(p), scratch.normed.data(), D, T, qkv,
                                width(l), col, l.parts[p].n, num_threads);
            col += l.parts[p].n;
        }
    }
    return refused ? 4 : 0;
}

// logits [T, V] = rms_norm(hidden [T, D], norm) @ head^T.
int int_head(const IntLinear* head, const float* norm, int64_t T, int64_t D, float eps,
               const float* hidden, float* logits, int num_threads) {
    if (!valid(*head) || head->parts[0].k != D || T < 1) return 1;
    const FlushDenormals flush;
    scratch.normed.resize(T * D);
    rms_norm(hidden, norm, T, D, eps, scratch.normed.data());
    linear(*head, scratch.normed.data(), T, logits, false, scratch, num_threads);
    return 0;
}

}  // extern "C"
