// Floats below 2^-126 (denormals) as zero, for as long as a kernel runs on a thread.
//
// Why: on x86 an instruction that meets a denormal operand or result takes a microcode assist
// of ~100 cycles. They appear wherever a value ends up near exp(-87), where exp_nonpositive
// stops: the sigmoid of a gate below -87 times its up projection, a softmax weight far below
// its row's largest times a value. A Llama-3.2-1B-shaped file with random weights, whose gates
// reach |g| > 87 in most of their elements, spent half of a 256-token prompt on them (2 Sapphire
// Rapids cores: 96 ms a layer boundary against 56 ms when the same matmuls meet no denormals).
// Their share of any sum is below float32's precision next to a normal term, so flushing them
// changes no result beyond that precision; every build flushes, so the builds agree bit for bit.
//
// MXCSR is per thread: the guard goes at each entry point (the caller's thread) and at the top
// of each OpenMP parallel region (its workers), and restores what it found when it ends.
#pragma once

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>

class FlushDenormals {
public:
    FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | FTZ | DAZ); }
    ~FlushDenormals() { _mm_setcsr(saved_); }
    FlushDenormals(const FlushDenormals&) = delete;
    FlushDenormals& operator=(const FlushDenormals&) = delete;

private:
    static constexpr unsigned FTZ = 0x8000;  // results: flush to zero
    static constexpr unsigned DAZ = 0x0040;  // operands: denormals are zero
    unsigned saved_;
};
#else
class FlushDenormals {};  // other CPUs keep their default
#endif
