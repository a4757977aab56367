// y[M, N] = x[M, K] @ W[N, K]^T in float32, W read straight from GGUF Q4_1 or Q8_0 blocks.
//
// Q4_1 stores 32 weights per block as a float16 scale d, a float16 minimum m and 16 bytes of
// 4-bit codes (low nibbles: inputs 0..15 of the block, high nibbles: inputs 16..31); a weight is
// d * code + m. The scales and minimums arrive here already widened to float32. d * code is
// exact in float32 (11 + 4 significant bits), so fma(d, code, m) equals the two-step
// d * code + m that gguf-py and HF transformers dequantize with: the weights are bit-identical
// to the dense float32 path, and only the summation order of the dot products differs (as it
// does between any two BLAS builds).
//
// Q8_0 (llama.cpp's usual format for the embedding / vocab head) stores 32 int8 codes and a
// float16 scale d per block; a weight is d * code, again exact in float32 (11 + 8 bits).
//
// Why: a decode step multiplies a few rows by every weight, so on the CPU it is bound by the
// weight bytes streamed from memory. Q4_1 is 5 bits per weight and Q8_0 8.5, against
// float32's 32.
//
// Structure: output rows are taken TILE_N at a time (threads split them). Each tile is
// dequantized once into a small float32 scratch (L1/L2-resident), then every TILE_M-row slice
// of x is multiplied against it with TILE_M x TILE_N vector accumulators held in registers.
// Built at run time by library.py with -O3 -march=native -fopenmp; the OpenMP runtime
// is the one torch already loaded (same soname), so there is one thread pool, not two.

#include <cstdint>
#include <new>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int GROUP = 32;
constexpr int TILE_N = 4;
constexpr int TILE_M = 4;

// Q4_1: codes [N, K / 2] bytes, low nibbles are inputs 0..15 of each group, high nibbles
// 16..31; mins: the per-group minimums.
struct Q4_1 {
    const uint8_t* codes;
    const float* scales;
    const float* mins;

#if defined(__AVX512F__)
    // Weights 0..15 (lo) and 16..31 (hi) of group g of row n.
    void group(int64_t K, int64_t n, int64_t g, __m512& lo, __m512& hi) const {
        const int64_t i = n * (K / GROUP) + g;
        const uint8_t* c = codes + n * (K / 2) + g * (GROUP / 2);
        const __m512i packed = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)c));
        const __m512 d = _mm512_set1_ps(scales[i]), m = _mm512_set1_ps(mins[i]);
        lo = _mm512_fmadd_ps(
            d, _mm512_cvtepi32_ps(_mm512_and_si512(packed, _mm512_set1_epi32(15))), m);
        hi = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(packed, 4)), m);
    }
#else
    float weight(int64_t K, int64_t n, int64_t k) const {
        const int64_t i = n * (K / GROUP) + k / GROUP, j = k % GROUP;
        const uint8_t c = codes[n * (K / 2) + (k / GROUP) * (GROUP / 2) + j % (GROUP / 2)];
        return scales[i] * float(j < GROUP / 2 ? c & 15 : c >> 4) + mins[i];
    }
#endif
};

// Q8_0: codes [N, K] int8.
struct Q8_0 {
    const int8_t* codes;
    const float* scales;

#if defined(__AVX512F__)
    void group(int64_t K, int64_t n, int64_t g, __m512& lo, __m512& hi) const {
        const int8_t* c = codes + n * K + g * GROUP;
        const __m512 d = _mm512_set1_ps(scales[n * (K / GROUP) + g]);
        lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                  _mm_loadu_si128((const __m128i*)c))));
        hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                  _mm_loadu_si128((const __m128i*)(c + 16)))));
    }
#else
    float weight(int64_t K, int64_t n, int64_t k) const {
        return scales[n * (K / GROUP) + k / GROUP] * float(codes[n * K + k]);
    }
#endif
};

// Rows [n0, n0 + rows) of W -> float32 [rows, K].
template <class Format>
void dequantize_rows(const Format& f, int64_t K, int64_t n0, int rows, float* out) {
    for (int r = 0; r < rows; ++r) {
        float* w = out + r * K;
#if defined(__AVX512F__)
        for (int64_t g = 0; g < K / GROUP; ++g) {
            __m512 lo, hi;
            f.group(K, n0 + r, g, lo, hi);
            _mm512_storeu_ps(w + g * GROUP, lo);
            _mm512_storeu_ps(w + g * GROUP + 16, hi);
        }
#else
        for (int64_t k = 0; k < K; ++k) w[k] = f.weight(K, n0 + r, k);
#endif
    }
}

#if defined(__AVX512F__)
// y[0, n0 : n0 + NR] for a single row of x: the weights are dequantized in registers and
// never stored. Each lane sums the same products in the same order as micro_tile's, so one
// row gives the same bits either way.
template <int NR, class Format>
void single_row_tile(const Format& f, const float* x, int64_t K, float* y, int64_t n0) {
    __m512 acc[NR];
    for (int j = 0; j < NR; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < K / GROUP; ++g) {
        const __m512 xlo = _mm512_loadu_ps(x + g * GROUP);
        const __m512 xhi = _mm512_loadu_ps(x + g * GROUP + 16);
        for (int j = 0; j < NR; ++j) {
            __m512 lo, hi;
            f.group(K, n0 + j, g, lo, hi);
            acc[j] = _mm512_fmadd_ps(xlo, lo, acc[j]);
            acc[j] = _mm512_fmadd_ps(xhi, hi, acc[j]);
        }
    }
    for (int j = 0; j < NR; ++j) y[n0 + j] = _mm512_reduce_add_ps(acc[j]);
}
#endif

// y[m0 : m0 + MR, n0 : n0 + NR] from x rows m0.. and the dequantized tile w [NR, K].
template <int MR, int NR>
void micro_tile(const float* x, int64_t K, const float* w, float* y, int64_t N, int64_t m0,
                int64_t n0) {
#if defined(__AVX512F__)
    __m512 acc[MR][NR];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m512 wv[NR];
        for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_ps(w + j * K + k);
        for (int i = 0; i < MR; ++i) {
            const __m512 xv = _mm512_loadu_ps(x + (m0 + i) * K + k);
            for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) y[(m0 + i) * N + n0 + j] = _mm512_reduce_add_ps(acc[i][j]);
#else
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) {
            float sum = 0.0f;
            for (int64_t k = 0; k < K; ++k) sum += x[(m0 + i) * K + k] * w[j * K + k];
            y[(m0 + i) * N + n0 + j] = sum;
        }
#endif
}

template <int NR>
void rows_tile(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N,
               int64_t n0) {
    int64_t m0 = 0;
    for (; m0 + TILE_M <= M; m0 += TILE_M) micro_tile<TILE_M, NR>(x, K, w, y, N, m0, n0);
    switch (M - m0) {
        case 3: micro_tile<3, NR>(x, K, w, y, N, m0, n0); break;
        case 2: micro_tile<2, NR>(x, K, w, y, N, m0, n0); break;
        case 1: micro_tile<1, NR>(x, K, w, y, N, m0, n0); break;
        default: break;
    }
}

template <class Format>
int matmul(const Format& format, const float* x, int64_t M, int64_t K, int64_t N, float* y,
           int num_threads) {
    if (K % GROUP != 0) return -1;
    const int64_t tiles = (N + TILE_N - 1) / TILE_N;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float* w = new (std::nothrow) float[TILE_N * K];
        if (w == nullptr) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            if (w == nullptr) continue;
            const int64_t n0 = t * TILE_N;
            const int rows = int(N - n0 < TILE_N ? N - n0 : TILE_N);
#if defined(__AVX512F__)
            if (M == 1) {  // one decode: nothing to reuse a dequantized tile for
                switch (rows) {
                    case 4: single_row_tile<4>(format, x, K, y, n0); break;
                    case 3: single_row_tile<3>(format, x, K, y, n0); break;
                    case 2: single_row_tile<2>(format, x, K, y, n0); break;
                    default: single_row_tile<1>(format, x, K, y, n0); break;
                }
                continue;
            }
#endif
            dequantize_rows(format, K, n0, rows, w);
            switch (rows) {
                case 4: rows_tile<4>(x, M, K, w, y, N, n0); break;
                case 3: rows_tile<3>(x, M, K, w, y, N, n0); break;
                case 2: rows_tile<2>(x, M, K, w, y, N, n0); break;
                default: rows_tile<1>(x, M, K, w, y, N, n0); break;
            }
        }
        delete[] w;
    }
    return failed ? -1 : 0;
}

template <class Format>
int dequantize(const Format& format, int64_t N, int64_t K, float* out, int num_threads) {
    if (K % GROUP != 0) return -1;
    const int64_t tiles = (N + TILE_N - 1) / TILE_N;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t n0 = t * TILE_N;
        dequantize_rows(format, K, n0, int(N - n0 < TILE_N ? N - n0 : TILE_N), out + n0 * K);
    }
    return 0;
}

}  // namespace

// Each matmul returns 0, or -1 when K is not a multiple of 32 or the scratch cannot be had.
// Each dequantize writes the float32 weight [N, K] as the matmul sees it (for tests), or
// returns -1 when K is not a multiple of 32.
extern "C" {

// 1 when built with AVX-512: the tiling and KERNEL_MAX_ROWS were tuned for it; the portable
// loops are correct but not faster than torch's BLAS, so the executor only uses an AVX-512 build.
int llmbus_cpu_has_avx512(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

int q4_1_matmul_f32(const float* x, int64_t M, int64_t K, const uint8_t* codes,
                    const float* scales, const float* mins, int64_t N, float* y,
                    int num_threads) {
    return matmul(Q4_1{codes, scales, mins}, x, M, K, N, y, num_threads);
}

int q4_1_dequantize_f32(const uint8_t* codes, const float* scales, const float* mins,
                        int64_t N, int64_t K, float* out, int num_threads) {
    return dequantize(Q4_1{codes, scales, mins}, N, K, out, num_threads);
}

int q8_0_matmul_f32(const float* x, int64_t M, int64_t K, const int8_t* codes,
                    const float* scales, int64_t N, float* y, int num_threads) {
    return matmul(Q8_0{codes, scales}, x, M, K, N, y, num_threads);
}

int q8_0_dequantize_f32(const int8_t* codes, const float* scales, int64_t N, int64_t K,
                        float* out, int num_threads) {
    return dequantize(Q8_0{codes, scales}, N, K, out, num_threads);
}

}  // extern "C"
