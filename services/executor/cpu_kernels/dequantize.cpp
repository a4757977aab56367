// GGUF block-quantized matrices to bfloat16, for big steps' GEMMs (dense_prefill.py).
//
// A prefill step of hundreds of tokens is a GEMM; on CPUs with bfloat16 in hardware
// (AVX-512-BF16, AMX) a bfloat16 GEMM runs it ~1.7x faster than ONNX Runtime's int8
// MatMulNBits. The weights stay quantized in memory; each layer's matrices are widened into
// one reusable buffer just before use, which costs far less than the GEMM it feeds.
//
// Layouts: [N, K] row-major, blocks of 32 along K.
//   Q4 (Q4_1, and Q4_0 in Q4_1 form): packed [N, K/2] uint8, input 2i in the low nibble of
//      byte i and input 2i+1 in the high one; scales, mins [N, K/32] float32;
//      w = scale * code + min.
//   Q8_0: codes [N, K] int8, scales [N, K/32] float32; w = scale * code.
// bfloat16 by round-to-nearest-even, as torch's float32 -> bfloat16 conversion.

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t GROUP = 32;

inline uint16_t to_bf16(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    u += 0x7FFF + ((u >> 16) & 1);
    return uint16_t(u >> 16);
}

}  // namespace

extern "C" {

int q4_dequantize_bf16(const uint8_t* packed, const float* scales, const float* mins, int64_t N,
                       int64_t K, uint16_t* out, int num_threads) {
    if (K % GROUP) return 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t* codes = packed + n * (K / 2);
        uint16_t* row = out + n * K;
        for (int64_t g = 0; g < K / GROUP; ++g) {
            const float d = scales[n * (K / GROUP) + g], m = mins[n * (K / GROUP) + g];
#pragma omp simd
            for (int64_t i = 0; i < GROUP / 2; ++i) {
                const uint8_t byte = codes[g * GROUP / 2 + i];
                row[g * GROUP + 2 * i] = to_bf16(d * float(byte & 0xF) + m);
                row[g * GROUP + 2 * i + 1] = to_bf16(d * float(byte >> 4) + m);
            }
        }
    }
    return 0;
}

int q8_0_dequantize_bf16(const int8_t* codes, const float* scales, int64_t N, int64_t K,
                         uint16_t* out, int num_threads) {
    if (K % GROUP) return 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t g = 0; g < K / GROUP; ++g) {
            const float d = scales[n * (K / GROUP) + g];
#pragma omp simd
            for (int64_t i = 0; i < GROUP; ++i)
                out[n * K + g * GROUP + i] = to_bf16(d * float(codes[n * K + g * GROUP + i]));
        }
    }
    return 0;
}

}  // extern "C"
