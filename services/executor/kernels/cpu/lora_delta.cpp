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

const LoraMatrix& matrix(const LoraStep& lora, int64_t slot, int64_t layer, int target) {
    return lora.matrices[(slot * lora.num_layers + layer) * LORA_TARGETS + target];
}

// The second product for up to GROUP_TOKENS tokens of one slot, columns [j0, j1): each of B's
// rows widened once for all of them; each output adds its rank terms in order.
void add_columns(const LoraMatrix& m, const float* u, const int64_t* tokens, int64_t count,
                 float* y, int64_t ldy, int64_t col, int64_t n, int64_t j0, int64_t j1) {
    const int64_t width = j1 - j0;
    float acc[GROUP_TOKENS][COLUMN_BLOCK];
    for (int64_t i = 0; i < count; ++i)
        std::memcpy(acc[i], y + tokens[i] * ldy + col + j0, width * sizeof(float));
    for (int64_t r = 0; r < m.rank; ++r) {
        float b[COLUMN_BLOCK];
        for (int64_t j = 0; j < width; ++j) b[j] = static_cast<float>(m.bt[r * n + j0 + j]);
        for (int64_t i = 0; i < count; ++i) {
            const float ur = u[tokens[i] * MAX_RANK + r];
#pragma omp simd
            for (int64_t j = 0; j < width; ++j) acc[i][j] += ur * b[j];
        }
    }
    for (int64_t i = 0; i < count; ++i)
        std::memcpy(y + tokens[i] * ldy + col + j0, acc[i], width * sizeof(float));
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
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (size_t i = 0; i < rows.size(); ++i) {
            const auto [s, r] = rows[i];
            const Bf16* a = matrix(lora, s, layer, target).a + r * k;
            int64_t g = lora.offsets[s];
            for (; g + GROUP_TOKENS <= lora.offsets[s + 1]; g += GROUP_TOKENS) {
                float dots[GROUP_TOKENS];
                fixed_order_dots<GROUP_TOKENS>(a, xs.data() + g * k, k, k, dots);
                for (int i = 0; i < GROUP_TOKENS; ++i)
                    u[lora.order[g + i] * MAX_RANK + r] = dots[i];
            }
            for (; g < lora.offsets[s + 1]; ++g)
                fixed_order_dots<1>(a, xs.data() + g * k, k, k, &u[lora.order[g] * MAX_RANK + r]);
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
