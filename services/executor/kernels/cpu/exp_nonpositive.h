// exp(x) for x <= 0, shared by the kernels that need it (softmax, SiLU).
#pragma once

#include <cstdint>

// exp(x) for x <= 0 (softmax arguments), written so the vectorizer can take it: 2^n * p(r)
// with r in [-ln2/2, ln2/2] and a degree-6 polynomial, within 2 ulp of expf; below -87 it is
// exp(-87) ~ 1.6e-38, as good as 0 next to the block's largest term, 1.
static inline float exp_nonpositive(float x) {
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
