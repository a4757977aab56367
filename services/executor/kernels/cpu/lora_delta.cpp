// LoRA deltas inside the integer kernel's boundaries: y[t] += B_s (A_s x[t]) for each token t
// whose request runs adapter slot s, on the float32 activations the matmul just took (before
// they were quantized), so the base stays in the integer kernel and the adapter is float32.
//
// Why per token and not a matmul per adapter (S-LoRA's and Punica's segmented form, which a
// GPU wants): on a CPU the delta is a few thousand multiply-adds per projection per token
// (rank 16 on the default model's 576 -> 576 Q: 18 k, against 332 k for the base), so the
// work is small and every token's A and B stay in the core's cache; a loop over tokens with
// each token's own matrices needs no sorting, no gathering and no call per adapter, and a
// batch mixing eight adapters costs what one adapter's does.
//
// Layouts (lora/adapter_slots.py builds them): a [rank, k] and bt [rank, n] float32, row-major,
// bt already multiplied by the adapter's scaling. The dot products A x sum in the fixed order
// of fixed_order_sum.h, and each output adds its rank terms in order, so every x86-64-v3 or
// newer build gives the same bits.

#include <cstdint>

#include "entry_points.h"
#include "fixed_order_sum.h"

extern "C" {

// An adapter's matrices for one projection of one layer; a null `a`: the adapter leaves it.
struct LoraMatrix {
    const float* a;
    const float* bt;
    int64_t rank, k, n;
};

// A step's adapters: the slot of each token (-1: the base alone) and every slot's matrices,
// matrices[(slot * num_layers + layer) * LORA_TARGETS + target], targets q, k, v, o, gate, up,
// down.
struct LoraStep {
    const int32_t* token_slot;
    const LoraMatrix* matrices;
    int64_t num_layers, num_slots;
};

}  // extern "C"

namespace {

constexpr int64_t MAX_RANK = 256;  // adapter_slots.py refuses bigger ones

// y [T, ldy] at columns [col, col + n) += the delta of `target` in `layer` on x [T, k].
void add_delta(const LoraStep& lora, int64_t layer, int target, const float* x, int64_t k,
               int64_t T, float* y, int64_t ldy, int64_t col, int64_t n, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        const int32_t slot = lora.token_slot[t];
        if (slot < 0 || slot >= lora.num_slots) continue;
        const LoraMatrix& m =
            lora.matrices[(slot * lora.num_layers + layer) * LORA_TARGETS + target];
        if (m.a == nullptr) continue;
        float u[MAX_RANK];
        for (int64_t r = 0; r < m.rank; ++r) u[r] = fixed_order_sum(m.a + r * k, k, x + t * k);
        float* out = y + t * ldy + col;
        for (int64_t r = 0; r < m.rank; ++r) {
            const float* b = m.bt + r * n;
            const float ur = u[r];
#pragma omp simd
            for (int64_t j = 0; j < n; ++j) out[j] += ur * b[j];
        }
    }
}

}  // namespace

extern "C" {

// 0, or 1 when a matrix of the step does not match the projection it is applied to.
int lora_add(const LoraStep* lora, int64_t layer, int target, const float* x, int64_t k,
             int64_t T, float* y, int64_t ldy, int64_t col, int64_t n, int num_threads) {
    if (lora == nullptr) return 0;
    if (layer < 0 || layer >= lora->num_layers) return 1;
    for (int64_t s = 0; s < lora->num_slots; ++s) {
        const LoraMatrix& m = lora->matrices[(s * lora->num_layers + layer) * LORA_TARGETS +
                                             target];
        if (m.a != nullptr && (m.k != k || m.n != n || m.rank < 1 || m.rank > MAX_RANK))
            return 1;
    }
    add_delta(*lora, layer, target, x, k, T, y, ldy, col, n, num_threads);
    return 0;
}

}  // extern "C"
