// Float sums in one fixed order on every build (int_step.cpp's norms, lora_delta.cpp's dot
// products).
#pragma once

#include <cstdint>

namespace {

// Float sums in one fixed order on every build: 16 running lanes (lane i takes inputs i,
// i + 16, ...), then a fixed tree. An `omp simd` reduction would sum in the order of the
// vector width the build has (8 lanes with AVX2, 16 with AVX-512), and a last-bit difference
// in a row's norm flips int8 roundings downstream: each build would then give its own logits.
// With the order fixed, every x86-64-v3 or newer build gives the same bits
// (tests/executor/kernels/cpu/test_int_step.py checks it); the plain-loop build has no FMA.
constexpr int LANES = 16;

float fixed_order_sum(const float* v, int64_t n, const float* w = nullptr) {
    float lanes[LANES] = {};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; ++j) lanes[j] += w ? v[i + j] * w[i + j] : v[i + j];
    for (int j = 0; i + j < n; ++j) lanes[j] += w ? v[i + j] * w[i + j] : v[i + j];
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
    return lanes[0];
}

// The end of fixed_order_dots from input i on (what is left of n, into the running lanes), and
// each row's tree; shared with vector versions that ran the lanes in registers.
template <int TOKENS, typename W>
void finish_dots(float (*lanes)[LANES], const W* w, const float* v, int64_t ldv, int64_t i,
                 int64_t n, float* out) {
    for (int j = 0; i + j < n; ++j)
        for (int t = 0; t < TOKENS; ++t)
            lanes[t][j] += static_cast<float>(w[i + j]) * v[t * ldv + i + j];
    for (int t = 0; t < TOKENS; ++t) {
        for (int width = LANES / 2; width > 0; width /= 2)
            for (int j = 0; j < width; ++j) lanes[t][j] += lanes[t][j + width];
        out[t] = lanes[t][0];
    }
}

// w . v[t] for the TOKENS rows v[t] = v + t * ldv, each in fixed_order_sum's order (so each the
// same bits as alone), w's values (bfloat16 ones too) widened to float exactly. Several rows at
// once: each loaded w serves all of them, and their sums are independent chains the core
// overlaps (one row's is a chain of dependent adds, latency-bound).
template <int TOKENS, typename W>
void fixed_order_dots(const W* w, const float* v, int64_t ldv, int64_t n, float* out) {
    float lanes[TOKENS][LANES] = {};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; ++j) {
            const float wj = static_cast<float>(w[i + j]);
            for (int t = 0; t < TOKENS; ++t) lanes[t][j] += wj * v[t * ldv + i + j];
        }
    finish_dots<TOKENS>(lanes, w, v, ldv, i, n, out);
}

}  // namespace
