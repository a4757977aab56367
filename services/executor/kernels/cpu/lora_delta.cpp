// LoRA deltas inside the integer kernel's boundaries: y[t] += B_s (A_s x[t]) for each token t
// whose request runs adapter slot s, on the float32 activations the matmul just took (before
// they were quantized), so the base stays in the integer kernel and the delta is float32.
//
// The work is small (rank 16 on the default model's 576 -> 576 Q: 18 k multiply-adds a token,
// against 332 k for the base) but the matrices are not: an adapter of rank 16 on all seven
// projections is 650 KB of float32 a layer. Taken token by token, a batch whose tokens run
// eight adapters in turn read each token's matrices from memory again (2 Xeon cores, 16
// streams over 8 such adapters: 0.64x the base's output tok/s). So the tokens come grouped by
// slot (the step's `order`), and each adapter's matrices are read once a step, as S-LoRA's
// and Punica's segmented matmuls read them: first U = X_s A_sᵀ, a row of A against each of the
// slot's tokens, then Y_s += U B_s, a block of B's columns against each of them.
//
// Layouts (lora/adapter_slots.py builds them): a [rank, k] and bt [rank, n] bfloat16, row-major,
// bt already multiplied by the adapter's scaling. Half the bytes of float32 halve what a step
// reads (8 adapters of rank 16 on every projection of the default model: 78 MB a step instead
// of 157), for a rounding of 2^-9 of each weight, inside the fast mode's int8 activations'
// (2^-8 of a block's largest). Bfloat16 and not float16: widening it is a shift, which every
// build vectorizes (float16's conversion, as GCC built it here, made a step with one adapter
// twice as slow as float32 matrices). The dot
// products A x sum in the fixed order of fixed_order_sum.h (float32), and each output adds its
// rank terms in order, so every x86-64-v3 or newer build gives the same bits.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "entry_points.h"
#include "fixed_order_sum.h"
#include "flush_denormals.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// A bfloat16 value: float32's upper half.
struct Bf16 {
    uint16_t bits;
    explicit operator float() const {
        const uint32_t wide = static_cast<uint32_t>(bits) << 16;
        float f;
        std::memcpy(&f, &wide, sizeof f);
        return f;
    }
};

extern "C" {

// An adapter's matrices for one projection of one layer; a null `a`: the adapter leaves it.
struct LoraMatrix {
    const Bf16* a;
    const Bf16* bt;
    int64_t rank, k, n;
};

// A step's adapters: its tokens grouped by slot (slot s's are order[offsets[s]] up to
// order[offsets[s + 1]]; the base's are in none) and every slot's matrices,
// matrices[(slot * num_layers + layer) * LORA_TARGETS + target], targets q, k, v, o, gate, up,
// down.
struct LoraStep {
    const int64_t* order;
    const int64_t* offsets;
    const LoraMatrix* matrices;
    int64_t num_layers, num_slots, num_tokens;
};

}  // extern "C"

namespace {

constexpr int64_t MAX_RANK = 256;  // adapter_slots.py refuses bigger ones

constexpr int64_t COLUMN_BLOCK = 64;  // B's columns a work item adds: 2 KB of a rank-16 B
constexpr int GROUP_TOKENS = 4;  // a slot's tokens a row of A is dotted with at once

// Sixteen float lanes (fixed_order_sum.h's LANES) as the build's vectors: one AVX-512
// register, or two AVX2 ones. Products are fused multiply-adds on both, so both builds give
// the same bits; a build without AVX2 takes the plain loops below.
#if defined(__AVX512F__)
struct Lanes {
    __m512 v;
};
inline Lanes zero() { return {_mm512_setzero_ps()}; }
inline Lanes load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* p, Lanes a) { _mm512_storeu_ps(p, a.v); }
inline Lanes splat(float x) { return {_mm512_set1_ps(x)}; }
inline Lanes fma(Lanes a, Lanes b, Lanes c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Lanes widen(const Bf16* w) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
#elif defined(__AVX2__)
struct Lanes {
    __m256 lo, hi;
};
inline Lanes zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Lanes load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, Lanes a) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
}
inline Lanes splat(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Lanes fma(Lanes a, Lanes b, Lanes c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline __m256 widen8(const Bf16* w) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline Lanes widen(const Bf16* w) { return {widen8(w), widen8(w + 8)}; }
#endif

// a . x[t] for TOKENS rows x[t] = x + t * ldx, in fixed_order_sum's order: 16 running lanes,
// then its tree; each loaded row of A serves every token.
template <int TOKENS>
void dots(const Bf16* a, const float* x, int64_t ldx, int64_t k, float* out) {
#if defined(__AVX2__)
    float lanes[TOKENS][LANES];
    Lanes acc[TOKENS];
    for (int t = 0; t < TOKENS; ++t) acc[t] = zero();
    int64_t i = 0;
    for (; i + LANES <= k; i += LANES) {
        const Lanes w = widen(a + i);
        for (int t = 0; t < TOKENS; ++t) acc[t] = fma(w, load(x + t * ldx + i), acc[t]);
    }
    for (int t = 0; t < TOKENS; ++t) store(lanes[t], acc[t]);
    finish_dots<TOKENS>(lanes, a, x, ldx, i, k, out);
#else
    fixed_order_dots<TOKENS>(a, x, ldx, k, out);
#endif
}

const LoraMatrix& matrix(const LoraStep& lora, int64_t slot, int64_t layer, int target) {
    return lora.matrices[(slot * lora.num_layers + layer) * LORA_TARGETS + target];
}

// The second product for up to GROUP_TOKENS tokens of one slot, columns [j0, j1): each of B's
// rows widened once for all of them; each output adds its rank terms in order.
void add_columns(const LoraMatrix& m, const float* u, const int64_t* tokens, int64_t count,
                 float* y, int64_t ldy, int64_t col, int64_t n, int64_t j0, int64_t j1) {
    int64_t j = j0;
#if defined(__AVX2__)
    for (; j + LANES <= j1; j += LANES) {  // sixteen columns at a time, in registers
        Lanes acc[GROUP_TOKENS];
        for (int64_t i = 0; i < count; ++i) acc[i] = load(y + tokens[i] * ldy + col + j);
        for (int64_t r = 0; r < m.rank; ++r) {
            const Lanes b = widen(m.bt + r * n + j);
            for (int64_t i = 0; i < count; ++i)
                acc[i] = fma(splat(u[tokens[i] * MAX_RANK + r]), b, acc[i]);
        }
        for (int64_t i = 0; i < count; ++i) store(y + tokens[i] * ldy + col + j, acc[i]);
    }
#endif
    for (int64_t i = 0; i < count && j < j1; ++i) {  // what is left, one output at a time
        float* out = y + tokens[i] * ldy + col;
        for (int64_t c = j; c < j1; ++c)
            for (int64_t r = 0; r < m.rank; ++r)
                out[c] += u[tokens[i] * MAX_RANK + r] * static_cast<float>(m.bt[r * n + c]);
    }
}

// y [T, ldy] at columns [col, col + n) += the delta of `target` in `layer` on x [T, k].
void add_delta(const LoraStep& lora, int64_t layer, int target, const float* x, int64_t k,
               float* y, int64_t ldy, int64_t col, int64_t n, int num_threads) {
    std::vector<std::pair<int64_t, int64_t>> rows;  // (slot, row of A): the first product's
    for (int64_t s = 0; s < lora.num_slots; ++s) {
        const LoraMatrix& m = matrix(lora, s, layer, target);
        if (m.a != nullptr && lora.offsets[s] < lora.offsets[s + 1])
            for (int64_t r = 0; r < m.rank; ++r) rows.emplace_back(s, r);
    }
    if (rows.empty()) return;
    std::vector<float> u(lora.num_tokens * MAX_RANK);  // u[t, r] = A_s[r] . x[t]
    std::vector<float> xs(lora.offsets[lora.num_slots] * k);  // x's rows in the step's order
    for (int64_t g = lora.offsets[0]; g < lora.offsets[lora.num_slots]; ++g)
        std::memcpy(&xs[g * k], x + lora.order[g] * k, k * sizeof(float));
    const int64_t blocks = (n + COLUMN_BLOCK - 1) / COLUMN_BLOCK;
    const FlushDenormals flush;
#pragma omp parallel num_threads(num_threads)
    {
        const FlushDenormals flush_worker;
#pragma omp for schedule(static)
        for (size_t i = 0; i < rows.size(); ++i) {
            const auto [s, r] = rows[i];
            const Bf16* a = matrix(lora, s, layer, target).a + r * k;
            int64_t g = lora.offsets[s];
            for (; g + GROUP_TOKENS <= lora.offsets[s + 1]; g += GROUP_TOKENS) {
                float products[GROUP_TOKENS];
                dots<GROUP_TOKENS>(a, xs.data() + g * k, k, k, products);
                for (int i = 0; i < GROUP_TOKENS; ++i)
                    u[lora.order[g + i] * MAX_RANK + r] = products[i];
            }
            for (; g < lora.offsets[s + 1]; ++g)
                dots<1>(a, xs.data() + g * k, k, k, &u[lora.order[g] * MAX_RANK + r]);
        }
#pragma omp for schedule(static)
        for (int64_t block = 0; block < blocks; ++block) {
            const int64_t j0 = block * COLUMN_BLOCK, j1 = std::min(n, j0 + COLUMN_BLOCK);
            for (int64_t s = 0; s < lora.num_slots; ++s) {
                const LoraMatrix& m = matrix(lora, s, layer, target);
                if (m.a == nullptr) continue;
                for (int64_t g = lora.offsets[s]; g < lora.offsets[s + 1]; g += GROUP_TOKENS)
                    add_columns(m, u.data(), lora.order + g,
                                std::min<int64_t>(GROUP_TOKENS, lora.offsets[s + 1] - g), y,
                                ldy, col, n, j0, j1);
            }
        }
    }
}

}  // namespace

extern "C" {

// 0, or 1 when a matrix of the step does not match the projection it is applied to.
int lora_add(const LoraStep* lora, int64_t layer, int target, const float* x, int64_t k,
             int64_t T, float* y, int64_t ldy, int64_t col, int64_t n, int num_threads) {
    if (lora == nullptr) return 0;
    if (layer < 0 || layer >= lora->num_layers || T != lora->num_tokens) return 1;
    for (int64_t s = 0; s < lora->num_slots; ++s) {
        const LoraMatrix& m = matrix(*lora, s, layer, target);
        if (m.a != nullptr && (m.k != k || m.n != n || m.rank < 1 || m.rank > MAX_RANK))
            return 1;
    }
    add_delta(*lora, layer, target, x, k, y, ldy, col, n, num_threads);
    return 0;
}

}  // extern "C"
