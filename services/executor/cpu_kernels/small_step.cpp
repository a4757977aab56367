// The dense work of a small step (a few tokens: one stream's decode, a handful of decodes) on
// the GGUF's codes, with int8 activations, on the same OpenMP threads as the attention kernel.
//
// Why: a one-token step streams every weight once, so it is bound by memory and wants every
// core. ONNX Runtime cannot give it two: its per-session pools must wake a sleeping thread for
// each of the ~31 graphs of a step (no faster than one thread, measured), and its spinning
// process-wide pool keeps spinning after a run and starves the attention between graphs. The
// OpenMP threads here spin only briefly between the step's parallel regions, which follow each
// other closely, and the attention kernel (paged_attention.cpp) runs on the same ones.
//
// The math is llama.cpp's and ONNX Runtime's fast path: activations quantized to int8 per block
// of 32 (x ~ d * q, d = max|x| / 127), integer dot products with the weight codes, one float
// scale per block. For Q4 weights (w = s * code + m) the minimums' share is m times the block's
// float sum of x. A 4-bit QKV projection may take float32 activations instead (`float_input`;
// the fast mode's perplexity wants it, see onnx_model.py).
//
// Layouts, [n, k] row-major, blocks of 32 along k (as dense_prefill.py's QuantPart holds them):
//   Q4 (Q4_1; Q4_0 in Q4_1 form): packed [n, k/2] uint8, input 2i in the low nibble of byte i
//      and 2i+1 in the high one; scales, mins [n, k/32] float32.
//   Q8_0: codes [n, k] int8, scales [n, k/32] float32; w = s * code.
// Activations and outputs are float32 [T, width] rows.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "exp_nonpositive.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t GROUP = 32;
constexpr int MAX_PARTS = 3;
constexpr int ROWS = 4;  // activation rows multiplied together (their accumulators in registers)
constexpr int64_t TILE = 16;  // output columns per work item

enum Kind : int32_t { NONE = 0, Q4 = 1, Q8 = 2 };

}  // namespace

extern "C" {

// One quantized matrix; mirrored by small_step.py's ctypes structures.
struct SmallMatrix {
    int32_t kind;
    int32_t float_input;  // Q4 only: multiply float32 activations, not int8 ones
    int64_t n, k;
    const uint8_t* codes;
    const float* scales;
    const float* mins;  // Q4 only
};

// A row-stack of up to three matrices sharing k (QKV, gate + up): outputs side by side.
struct SmallLinear {
    SmallMatrix parts[MAX_PARTS];
    int64_t num_parts;
};

// The work between two attentions (as onnx_graphs.layer_graphs cuts it): the previous layer's
// O projection and FFN (absent before the first layer), then the next layer's norm and QKV
// (absent after the last).
struct SmallBoundary {
    SmallLinear o, gate_up, down;
    const float* ffn_norm;
    SmallLinear qkv;
    const float* attn_norm;
};

}  // extern "C"

namespace {

// Rows of x quantized per block: q [T, k] int8, d and the float block sums [T, k/32].
struct Quantized {
    std::vector<int8_t> q;
    std::vector<float> d, sum;
};

void quantize(const float* x, int64_t T, int64_t k, Quantized& out) {
    const int64_t blocks = T * (k / GROUP);
    out.q.resize(T * k);
    out.d.resize(blocks);
    out.sum.resize(blocks);
    for (int64_t b = 0; b < blocks; ++b) {
        const float* v = x + b * GROUP;
        float amax = 0.f, sum = 0.f;
#pragma omp simd reduction(max : amax) reduction(+ : sum)
        for (int i = 0; i < GROUP; ++i) {
            amax = std::max(amax, std::fabs(v[i]));
            sum += v[i];
        }
        const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int8_t* q = out.q.data() + b * GROUP;
#pragma omp simd
        for (int i = 0; i < GROUP; ++i) q[i] = int8_t(std::nearbyint(v[i] * inv));
        out.d[b] = d;
        out.sum[b] = sum;
    }
}

// Block sums of float rows (the minimums' share of a float-input Q4 matmul).
void block_sums(const float* x, int64_t T, int64_t k, std::vector<float>& sums) {
    sums.resize(T * (k / GROUP));
    for (int64_t b = 0; b < int64_t(sums.size()); ++b) {
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int i = 0; i < GROUP; ++i) s += x[b * GROUP + i];
        sums[b] = s;
    }
}

struct Inputs {
    const Quantized* quantized;  // int8 matmuls
    const float* x;              // float-input matmuls, [T, k]
    const float* x_sums;         // their block sums [T, k/32]
};

#if defined(__AVX2__)

// The 32 codes of a Q4 block, in input order.
inline __m256i q4_codes(const uint8_t* block) {
    const __m128i bytes = _mm_loadu_si128((const __m128i*)block);
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i even = _mm_and_si128(bytes, mask);
    const __m128i odd = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    return _mm256_set_m128i(_mm_unpackhi_epi8(even, odd), _mm_unpacklo_epi8(even, odd));
}

// Eight int32 sums of four u8 x s8 products each.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else  // no overflow: |products| <= 128 * 127, two per int16
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline float lane_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// y[r, j] for output columns j in [j0, j1) and R activation rows from `row`.
template <int R>
void columns(const SmallMatrix& w, const Inputs& in, int64_t row, int64_t j0, int64_t j1,
             float* y, int64_t ldy, bool accumulate) {
    const int64_t G = w.k / GROUP;
    for (int64_t j = j0; j < j1; ++j) {
        __m256 acc[R];
        float mins[R];
        for (int r = 0; r < R; ++r) {
            acc[r] = _mm256_setzero_ps();
            mins[r] = 0.f;
        }
        const float* s = w.scales + j * G;
        if (w.kind == Q8) {
            const int8_t* codes = (const int8_t*)w.codes + j * w.k;
            for (int64_t g = 0; g < G; ++g) {
                const __m256i c = _mm256_loadu_si256((const __m256i*)(codes + g * GROUP));
                const __m256i magnitude = _mm256_sign_epi8(c, c);
                for (int r = 0; r < R; ++r) {
                    const int64_t b = (row + r) * G + g;
                    const __m256i q = _mm256_loadu_si256(
                        (const __m256i*)(in.quantized->q.data() + b * GROUP));
                    const __m256i p = dot_u8s8(magnitude, _mm256_sign_epi8(q, c));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),
                                             _mm256_set1_ps(s[g] * in.quantized->d[b]), acc[r]);
                }
            }
        } else if (!w.float_input) {
            const uint8_t* codes = w.codes + j * (w.k / 2);
            const float* m = w.mins + j * G;
            for (int64_t g = 0; g < G; ++g) {
                const __m256i c = q4_codes(codes + g * (GROUP / 2));
                for (int r = 0; r < R; ++r) {
                    const int64_t b = (row + r) * G + g;
                    const __m256i q = _mm256_loadu_si256(
                        (const __m256i*)(in.quantized->q.data() + b * GROUP));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(c, q)),
                                             _mm256_set1_ps(s[g] * in.quantized->d[b]), acc[r]);
                    mins[r] += m[g] * in.quantized->sum[b];
                }
            }
        } else {
            const uint8_t* codes = w.codes + j * (w.k / 2);
            const float* m = w.mins + j * G;
            for (int64_t g = 0; g < G; ++g) {
                const __m256i c = q4_codes(codes + g * (GROUP / 2));
                const __m128i lo = _mm256_castsi256_si128(c), hi = _mm256_extracti128_si256(c, 1);
                const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
                const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
                const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
                const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
                for (int r = 0; r < R; ++r) {
                    const float* x = in.x + (row + r) * w.k + g * GROUP;
                    __m256 part = _mm256_mul_ps(w0, _mm256_loadu_ps(x));
                    part = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), part);
                    part = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + 16), part);
                    part = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x + 24), part);
                    acc[r] = _mm256_fmadd_ps(part, _mm256_set1_ps(s[g]), acc[r]);
                    mins[r] += m[g] * in.x_sums[(row + r) * G + g];
                }
            }
        }
        for (int r = 0; r < R; ++r) {
            const float v = lane_sum(acc[r]) + mins[r];
            float& out = y[(row + r) * ldy + j];
            out = accumulate ? out + v : v;
        }
    }
}

#else  // no AVX2: plain loops (correct, not fast)

template <int R>
void columns(const SmallMatrix& w, const Inputs& in, int64_t row, int64_t j0, int64_t j1,
             float* y, int64_t ldy, bool accumulate) {
    const int64_t G = w.k / GROUP;
    for (int64_t j = j0; j < j1; ++j) {
        for (int r = 0; r < R; ++r) {
            float total = 0.f;
            for (int64_t g = 0; g < G; ++g) {
                const int64_t b = (row + r) * G + g;
                const float s = w.scales[j * G + g];
                if (w.kind == Q8) {
                    const int8_t* c = (const int8_t*)w.codes + j * w.k + g * GROUP;
                    int32_t dot = 0;
                    for (int i = 0; i < GROUP; ++i)
                        dot += int32_t(c[i]) * in.quantized->q[b * GROUP + i];
                    total += float(dot) * s * in.quantized->d[b];
                    continue;
                }
                const uint8_t* c = w.codes + j * (w.k / 2) + g * (GROUP / 2);
                const float m = w.mins[j * G + g];
                if (w.float_input) {
                    const float* x = in.x + (row + r) * w.k + g * GROUP;
                    float part = 0.f;
                    for (int i = 0; i < GROUP / 2; ++i)
                        part += float(c[i] & 15) * x[2 * i] + float(c[i] >> 4) * x[2 * i + 1];
                    total += part * s + m * in.x_sums[b];
                } else {
                    int32_t dot = 0;
                    for (int i = 0; i < GROUP / 2; ++i)
                        dot += (c[i] & 15) * in.quantized->q[b * GROUP + 2 * i] +
                               (c[i] >> 4) * in.quantized->q[b * GROUP + 2 * i + 1];
                    total += float(dot) * s * in.quantized->d[b] + m * in.quantized->sum[b];
                }
            }
            float& out = y[(row + r) * ldy + j];
            out = accumulate ? out + total : total;
        }
    }
}

#endif

void column_range(const SmallMatrix& w, const Inputs& in, int64_t T, int64_t j0, int64_t j1,
                  float* y, int64_t ldy, bool accumulate) {
    int64_t row = 0;
    for (; row + ROWS <= T; row += ROWS) columns<ROWS>(w, in, row, j0, j1, y, ldy, accumulate);
    switch (T - row) {
        case 3: columns<3>(w, in, row, j0, j1, y, ldy, accumulate); break;
        case 2: columns<2>(w, in, row, j0, j1, y, ldy, accumulate); break;
        case 1: columns<1>(w, in, row, j0, j1, y, ldy, accumulate); break;
        default: break;
    }
}

int64_t width(const SmallLinear& l) {
    int64_t n = 0;
    for (int64_t p = 0; p < l.num_parts; ++p) n += l.parts[p].n;
    return n;
}

bool valid(const SmallLinear& l) {
    if (l.num_parts < 1 || l.num_parts > MAX_PARTS) return false;
    for (int64_t p = 0; p < l.num_parts; ++p) {
        const SmallMatrix& w = l.parts[p];
        if ((w.kind != Q4 && w.kind != Q8) || w.k != l.parts[0].k || w.k % GROUP)
            return false;
    }
    return true;
}

struct Scratch {
    Quantized quantized;
    std::vector<float> sums, normed, gate_up, act;
};

// y [T, width(l)] (=, or += with `accumulate`) x [T, k] @ W^T.
void linear(const SmallLinear& l, const float* x, int64_t T, float* y, bool accumulate,
            Scratch& scratch, int num_threads) {
    const int64_t k = l.parts[0].k;
    bool any_int8 = false, any_float = false;
    for (int64_t p = 0; p < l.num_parts; ++p) {
        const bool float_input = l.parts[p].kind == Q4 && l.parts[p].float_input;
        any_float |= float_input;
        any_int8 |= !float_input;
    }
    if (any_int8) quantize(x, T, k, scratch.quantized);
    if (any_float) block_sums(x, T, k, scratch.sums);
    const Inputs in{&scratch.quantized, x, scratch.sums.data()};
    const int64_t ldy = width(l);
#pragma omp parallel num_threads(num_threads)
    {
        int64_t offset = 0;
        for (int64_t p = 0; p < l.num_parts; ++p) {
            const SmallMatrix& w = l.parts[p];
            const int64_t tiles = (w.n + TILE - 1) / TILE;
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < tiles; ++t)
                column_range(w, in, T, t * TILE, std::min(w.n, (t + 1) * TILE), y + offset, ldy,
                             accumulate);
            offset += w.n;
        }
    }
}

void rms_norm(const float* x, const float* weight, int64_t T, int64_t D, float eps, float* out) {
    for (int64_t t = 0; t < T; ++t) {
        const float* v = x + t * D;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < D; ++i) ss += v[i] * v[i];
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
int small_linear(const SmallLinear* l, const float* x, int64_t T, float* y, int accumulate,
                 int num_threads) {
    if (!valid(*l) || T < 1) return 1;
    linear(*l, x, T, y, accumulate != 0, scratch, num_threads);
    return 0;
}

// One boundary (see SmallBoundary) on T tokens: hidden [T, D] (the residual stream, updated in
// place), attn [T, H * Dh] (the previous layer's attention output; unused before the first
// layer), qkv [T, (H + 2 Hkv) * Dh] (the next layer's projection; unused after the last).
int small_boundary(const SmallBoundary* b, int64_t T, int64_t D, float eps, float* hidden,
                   const float* attn, float* qkv, int num_threads) {
    if (T < 1) return 1;
    scratch.normed.resize(T * D);
    if (b->o.num_parts) {
        if (!valid(b->o) || !valid(b->gate_up) || !valid(b->down) || width(b->o) != D ||
            width(b->gate_up) % 2 || width(b->down) != D ||
            b->down.parts[0].k * 2 != width(b->gate_up))
            return 2;
        const int64_t I = width(b->gate_up) / 2;
        linear(b->o, attn, T, hidden, true, scratch, num_threads);
        rms_norm(hidden, b->ffn_norm, T, D, eps, scratch.normed.data());
        scratch.gate_up.resize(T * 2 * I);
        scratch.act.resize(T * I);
        linear(b->gate_up, scratch.normed.data(), T, scratch.gate_up.data(), false, scratch,
               num_threads);
        swiglu(scratch.gate_up.data(), T, I, scratch.act.data());
        linear(b->down, scratch.act.data(), T, hidden, true, scratch, num_threads);
    }
    if (b->qkv.num_parts) {
        if (!valid(b->qkv) || b->qkv.parts[0].k != D) return 3;
        rms_norm(hidden, b->attn_norm, T, D, eps, scratch.normed.data());
        linear(b->qkv, scratch.normed.data(), T, qkv, false, scratch, num_threads);
    }
    return 0;
}

// logits [T, V] = rms_norm(hidden [T, D], norm) @ head^T.
int small_head(const SmallLinear* head, const float* norm, int64_t T, int64_t D, float eps,
               const float* hidden, float* logits, int num_threads) {
    if (!valid(*head) || head->parts[0].k != D || T < 1) return 1;
    scratch.normed.resize(T * D);
    rms_norm(hidden, norm, T, D, eps, scratch.normed.data());
    linear(*head, scratch.normed.data(), T, logits, false, scratch, num_threads);
    return 0;
}

}  // extern "C"
