// The integer kernel's vectors (int_step.cpp, k_quant_tiles.h): a tile is written once against
// a lane type V and computes V::GROUPS column groups of 8 output columns at once.
//
// Why two widths: in a prompt chunk the kernel is bound by its instructions, not by memory,
// and one 512-bit dot product does the work of two 256-bit ones while the broadcasts of the
// activations, the scale arithmetic and the loop stay one per vector (2 Sapphire Rapids cores,
// a 256-token chunk of a 1B model's Q4_K matrices: see int_step.cpp). The layout does not
// change: a 512-bit vector holds column group c in its low half and c + 1 in its high half,
// each loaded from its own place (`stride` bytes or floats apart), and the two halves do
// exactly the lane-wise arithmetic of two 256-bit vectors, so every build gives the same bits.
//
//   Lanes8: one column group in 256 bits (AVX2, FMA; VNNI where the build has it).
//   Lanes16: two in 512 bits (AVX-512 F, BW, DQ, VL; VNNI where the build has it).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define HAVE_VNNI 1
#else
#define HAVE_VNNI 0
#endif

inline int32_t four_bytes(const void* p) {
    int32_t v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

struct Lanes8 {
    static constexpr int GROUPS = 1;
    using I = __m256i;
    using F = __m256;

    static I zero() { return _mm256_setzero_si256(); }
    static F zero_f() { return _mm256_setzero_ps(); }
    // A column group's 32 bytes of codes (the next group's, `stride` bytes on, are not taken).
    static I codes(const uint8_t* p, int64_t) { return _mm256_loadu_si256((const __m256i*)p); }
    // A column group's 8 floats.
    static F factors(const float* p, int64_t) { return _mm256_loadu_ps(p); }
    // A column group's 8 bytes, widened to int32 (unsigned, or signed).
    static I widen_u8(const uint8_t* p, int64_t) {
        return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
    }
    static I widen_s8(const uint8_t* p, int64_t) {
        return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p));
    }
    static I splat32(int32_t v) { return _mm256_set1_epi32(v); }
    static I splat8(char v) { return _mm256_set1_epi8(v); }
    static F splat(float v) { return _mm256_set1_ps(v); }
    // A 16-byte table in every 128-bit lane.
    static I table(const void* p) {
        return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)p));
    }

    // acc + int32 sums of four u8 x s8 products each.
    static I dot_u8s8(I acc, I u, I s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
        return _mm256_dpbusd_avx_epi32(acc, u, s);
#else  // no overflow: |products| <= 128 * 127, two per int16
        return _mm256_add_epi32(acc, ones16(_mm256_maddubs_epi16(u, s)));
#endif
    }
    // acc + int32 sums of two s16 x s16 products each.
    static I dot_s16(I acc, I a, I b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
        return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
        return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
    }
    static I pairs_u8s8(I u, I s) { return _mm256_maddubs_epi16(u, s); }  // int16 pair sums
    static I ones16(I pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }
    static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
    static I add32(I a, I b) { return _mm256_add_epi32(a, b); }
    static I sub32(I a, I b) { return _mm256_sub_epi32(a, b); }
    static I and_(I a, I b) { return _mm256_and_si256(a, b); }
    static I or_(I a, I b) { return _mm256_or_si256(a, b); }
    static I srli16(I v, int n) { return _mm256_srli_epi16(v, n); }
    static I slli16(I v, int n) { return _mm256_slli_epi16(v, n); }
    static I srli32(I v, int n) { return _mm256_srli_epi32(v, n); }
    // |c| as unsigned bytes (-128 gives 128).
    static I abs8(I c) { return _mm256_sign_epi8(c, c); }
    // v with c's sign (the lanes where c is 0 are multiplied by |c| = 0 and do not matter).
    static I signed_as(I v, I c) { return _mm256_sign_epi8(v, c); }
    static I lookup(I table, I index) { return _mm256_shuffle_epi8(table, index); }

    static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
    static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    static F add(F a, F b) { return _mm256_add_ps(a, b); }
    // The outputs of this vector's columns, side by side in a row.
    static F load_out(const float* p) { return _mm256_loadu_ps(p); }
    static void store_out(float* p, F v) { _mm256_storeu_ps(p, v); }
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__)
#define HAVE_LANES16 1

struct Lanes16 {
    static constexpr int GROUPS = 2;
    using I = __m512i;
    using F = __m512;

    static I two(__m256i low, __m256i high) {
        return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
    }
    static I zero() { return _mm512_setzero_si512(); }
    static F zero_f() { return _mm512_setzero_ps(); }
    static I codes(const uint8_t* p, int64_t stride) {
        return two(_mm256_loadu_si256((const __m256i*)p),
                   _mm256_loadu_si256((const __m256i*)(p + stride)));
    }
    static F factors(const float* p, int64_t stride) {
        return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(p)),
                                  _mm256_loadu_ps(p + stride), 1);
    }
    static __m128i sixteen_bytes(const uint8_t* p, int64_t stride) {
        return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)p),
                                  _mm_loadl_epi64((const __m128i*)(p + stride)));
    }
    static I widen_u8(const uint8_t* p, int64_t stride) {
        return _mm512_cvtepu8_epi32(sixteen_bytes(p, stride));
    }
    static I widen_s8(const uint8_t* p, int64_t stride) {
        return _mm512_cvtepi8_epi32(sixteen_bytes(p, stride));
    }
    static I splat32(int32_t v) { return _mm512_set1_epi32(v); }
    static I splat8(char v) { return _mm512_set1_epi8(v); }
    static F splat(float v) { return _mm512_set1_ps(v); }
    static I table(const void* p) {
        return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)p));
    }

    static I dot_u8s8(I acc, I u, I s) {
#if defined(__AVX512VNNI__)
        return _mm512_dpbusd_epi32(acc, u, s);
#else
        return _mm512_add_epi32(acc, ones16(_mm512_maddubs_epi16(u, s)));
#endif
    }
    static I dot_s16(I acc, I a, I b) {
#if defined(__AVX512VNNI__)
        return _mm512_dpwssd_epi32(acc, a, b);
#else
        return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
    }
    static I pairs_u8s8(I u, I s) { return _mm512_maddubs_epi16(u, s); }
    static I ones16(I pairs) { return _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)); }
    static I add16(I a, I b) { return _mm512_add_epi16(a, b); }
    static I add32(I a, I b) { return _mm512_add_epi32(a, b); }
    static I sub32(I a, I b) { return _mm512_sub_epi32(a, b); }
    static I and_(I a, I b) { return _mm512_and_si512(a, b); }
    static I or_(I a, I b) { return _mm512_or_si512(a, b); }
    static I srli16(I v, int n) { return _mm512_srli_epi16(v, n); }
    static I slli16(I v, int n) { return _mm512_slli_epi16(v, n); }
    static I srli32(I v, int n) { return _mm512_srli_epi32(v, n); }
    static I abs8(I c) { return _mm512_abs_epi8(c); }
    static I signed_as(I v, I c) {  // no 512-bit vpsignb: negate where c < 0
        return _mm512_mask_sub_epi8(v, _mm512_movepi8_mask(c), _mm512_setzero_si512(), v);
    }
    static I lookup(I table, I index) { return _mm512_shuffle_epi8(table, index); }

    static F to_float(I v) { return _mm512_cvtepi32_ps(v); }
    static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    static F add(F a, F b) { return _mm512_add_ps(a, b); }
    static F load_out(const float* p) { return _mm512_loadu_ps(p); }
    static void store_out(float* p, F v) { _mm512_storeu_ps(p, v); }
};

using WidestLanes = Lanes16;
#else
using WidestLanes = Lanes8;
#endif

#else  // no AVX2: the tiles' plain loops take one column group at a time

struct PlainLanes {
    static constexpr int GROUPS = 1;
};
using WidestLanes = PlainLanes;
using Lanes8 = PlainLanes;

#endif
