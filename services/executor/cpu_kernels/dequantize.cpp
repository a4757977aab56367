// GGUF block-quantized matrices to bfloat16, for big steps' GEMMs (dense_prefill.py).
//
// A prefill step of hundreds of tokens is a GEMM; on CPUs with bfloat16 in hardware
// (AVX-512-BF16, AMX) a bfloat16 GEMM runs it ~1.7x faster than ONNX Runtime's int8
// MatMulNBits. The weights stay quantized in memory; each layer's matrices are widened into
// one reusable buffer just before use, which costs far less than the GEMM it feeds.
//
// Layouts: the kernels' tiles (cpu_kernels/int_step.cpp, quant_parts.py): column group c
// holds output rows 8c .. 8c + 7 of an [N, K] matrix, blocks of 32 along K.
//   Q4 (Q4_1, and Q4_0 in Q4_1 form): codes [N/8, K/32, 4, 32] uint8; scales, mins
//      [N/8, K/32, 8] float32; w = scale * code + min.
//   Q8_0: codes [N/8, K/32, 8, 32] int8, scales [N/8, K/32, 8] float32; w = scale * code.
// bfloat16 by round-to-nearest-even, as torch's float32 -> bfloat16 conversion.

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t GROUP = 32;
constexpr int64_t COLUMNS = 8;

inline uint16_t to_bf16(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    u += 0x7FFF + ((u >> 16) & 1);
    return uint16_t(u >> 16);
}

}  // namespace

extern "C" {

int q4_dequantize_bf16(const uint8_t* codes, const float* scales, const float* mins, int64_t N,
                       int64_t K, uint16_t* out, int num_threads) {
    if (K % GROUP || N % COLUMNS) return 1;
    const int64_t G = K / GROUP;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t c = 0; c < N / COLUMNS; ++c) {
        for (int64_t g = 0; g < G; ++g) {
            const uint8_t* block = codes + (c * G + g) * 128;
            for (int64_t j = 0; j < COLUMNS; ++j) {
                const float d = scales[(c * G + g) * COLUMNS + j];
                const float m = mins[(c * G + g) * COLUMNS + j];
                uint16_t* row = out + (c * COLUMNS + j) * K + g * GROUP;
                for (int h = 0; h < 4; ++h)
                    for (int i = 0; i < 4; ++i) {
                        const uint8_t byte = block[h * 32 + 4 * j + i];
                        row[8 * h + i] = to_bf16(d * float(byte & 0xF) + m);
                        row[8 * h + 4 + i] = to_bf16(d * float(byte >> 4) + m);
                    }
            }
        }
    }
    return 0;
}

int q8_0_dequantize_bf16(const int8_t* codes, const float* scales, int64_t N, int64_t K,
                         uint16_t* out, int num_threads) {
    if (K % GROUP || N % COLUMNS) return 1;
    const int64_t G = K / GROUP;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t c = 0; c < N / COLUMNS; ++c) {
        for (int64_t g = 0; g < G; ++g) {
            const int8_t* block = codes + (c * G + g) * 256;
            for (int64_t j = 0; j < COLUMNS; ++j) {
                const float d = scales[(c * G + g) * COLUMNS + j];
                uint16_t* row = out + (c * COLUMNS + j) * K + g * GROUP;
                for (int e = 0; e < 8; ++e)
                    for (int i = 0; i < 4; ++i)
                        row[4 * e + i] = to_bf16(d * float(block[e * 32 + 4 * j + i]));
            }
        }
    }
    return 0;
}

}  // extern "C"
