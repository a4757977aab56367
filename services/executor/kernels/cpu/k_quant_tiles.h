// The integer kernel's tiles for the K-quant and IQ4 formats kept at the file's bits (kind
// KQ, weights/k_quants.py): included by int_step.cpp inside its anonymous namespace, after
// Quantized and Inputs; written against int_lanes.h's vectors.
//
// Each format is a Spec: how a weight's code is stored (a plane of LOW bits and one of HIGH
// bits, put together as code = low | high << LOW), what the code means (code - OFFSET; the
// code itself, with a minimum subtracted per sub-block; or an entry of IQ4's codebook), and
// how its scales go (a float per SUPER weights times an integer per SUB weights, or the float
// alone where SUPER == SUB). Codes are eighths as Q8_0's tiles: an eighth e of a block of 32
// (inputs 4e .. 4e + 3 of the 8 columns, byte 4j + i is column j's input 4e + i) is a 32-byte
// vector; a plane of b bits holds b vectors a block, eighth e in vector e / (8 / b), at bits
// b * (e % (8 / b)). Per column group c, for an [n, k] matrix:
//   codes [n/8, k/32, LOW, 32], high_codes [n/8, k/32, HIGH, 32] (none where HIGH is 0);
//   scales [n/8, k/SUPER, 8] float32 (d); sub_scales [n/8, k/SUB, 8] int8 (Q2_K: uint8, the
//   scale in the low nibble and the minimum in the high one, as the file packs them);
//   mins [n/8, k/SUPER, 8] float32 (-dmin), sub_mins [n/8, k/SUB, 8] uint8 (Q5_K).
// w = d * sub_scale * value (+ -dmin * sub_min). The minimums meet the sum of the quantized
// inputs of their sub-block: d * sum(q) per 32 (Quantized::sum8), or per 16 from the integer
// half sums (Quantized::half8), so every integer sum stays exact, as for Q4's minimums.

// IQ4_NL's and IQ4_XS's 16 values (llama.cpp's kvalues_iq4nl).
constexpr int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};

template <int LOW_, int HIGH_, int SUB_, int SUPER_, int OFFSET_, bool MINS_, bool CODEBOOK_,
          bool NIBBLES_>
struct Spec {
    static constexpr int LOW = LOW_, HIGH = HIGH_, SUB = SUB_, SUPER = SUPER_, OFFSET = OFFSET_;
    static constexpr bool MINS = MINS_, CODEBOOK = CODEBOOK_, NIBBLES = NIBBLES_;
    static constexpr bool HAS_SUB = SUB_ != SUPER_;
    static constexpr int HALVES = 32 / SUB_;  // sub-blocks a block of 32
};
//                 LOW HIGH SUB SUPER OFFSET MINS  CODEBOOK NIBBLES
using Q6K = Spec<4, 2, 16, 256, 32, false, false, false>;
using Q3K = Spec<2, 1, 16, 256, 4, false, false, false>;
using Q5K = Spec<4, 1, 32, 256, 0, true, false, false>;
using Q2K = Spec<2, 0, 16, 256, 0, true, false, true>;
using IQ4NL = Spec<4, 0, 32, 32, 0, false, true, false>;
using IQ4XS = Spec<4, 0, 32, 256, 0, false, true, false>;

// IntMatrix::format; weights/k_quants.py FORMATS has the same ids.
enum Format : int32_t { Q6_K = 1, Q3_K = 2, Q5_K = 3, Q2_K = 4, IQ4_NL = 5, IQ4_XS = 6 };

// One column group's pointers into a KQ matrix, and the distances to the next group's.
template <class F>
struct KqGroup {
    const uint8_t *lo, *hi;
    const float *d, *neg_dmin;
    const uint8_t *ss, *sm;
    int64_t lo_stride, hi_stride, super_stride, sub_stride;

    KqGroup(const IntMatrix& w, int64_t c) {
        const int64_t G = w.k / GROUP, supers = w.k / F::SUPER, subs = w.k / F::SUB;
        lo_stride = G * F::LOW * 32;
        hi_stride = G * F::HIGH * 32;
        super_stride = supers * COLUMNS;
        sub_stride = subs * COLUMNS;
        lo = w.codes + c * lo_stride;
        hi = F::HIGH ? w.high_codes + c * hi_stride : nullptr;
        d = w.scales + c * super_stride;
        neg_dmin = F::MINS ? w.mins + c * super_stride : nullptr;
        ss = F::HAS_SUB ? w.sub_scales + c * sub_stride : nullptr;
        sm = F::MINS && !F::NIBBLES ? w.sub_mins + c * sub_stride : nullptr;
    }
};

// Block b's sum of quantized inputs over its sub-block h (the whole block where SUB is 32).
template <class F>
inline int32_t half_sum(const Quantized& x, int64_t b, int h) {
    return F::HALVES == 1 ? x.half8[2 * b] + x.half8[2 * b + 1] : x.half8[2 * b + h];
}

#if defined(__AVX2__)

// Eighth e's codes from a plane of BITS bits (one block's), `stride` bytes to the next group's.
template <class V, int BITS>
inline typename V::I plane_codes(const uint8_t* plane, int e, int64_t stride) {
    constexpr int PER = 8 / BITS;
    const typename V::I v = V::codes(plane + (e / PER) * 32, stride);
    return V::and_(V::srli16(v, BITS * (e % PER)), V::splat8(char((1 << BITS) - 1)));
}

// The columns' integer factors of a sub-block: the scale, or (`minimum`) the minimum.
template <class V, class F>
inline typename V::F sub_factors(const uint8_t* bytes, int64_t stride, bool minimum) {
    if constexpr (!F::MINS) return V::to_float(V::widen_s8(bytes, stride));  // signed
    typename V::I v = V::widen_u8(bytes, stride);
    if constexpr (F::NIBBLES) v = minimum ? V::srli32(v, 4) : V::and_(v, V::splat32(15));
    return V::to_float(v);
}

template <class V, int R, class F>
void kq_tile(const KqGroup<F>& w, int64_t G, const Inputs& in, int64_t row, float* y,
             int64_t ldy, bool accumulate) {
    using I = typename V::I;
    const Quantized& x = *in.x;
    const float* dx = x.d8.data() + row * G;
    typename V::F acc[R];
    for (int r = 0; r < R; ++r) acc[r] = V::zero_f();
    const I table = V::table(IQ4_VALUES);
    for (int64_t g = 0; g < G; ++g) {
        if (row == in.first) {  // as int_step.cpp's tiles
            prefetch_ahead<V::GROUPS>(w.lo, w.lo_stride, F::LOW * 32, g, G);
            if constexpr (F::HIGH > 0)
                prefetch_ahead<V::GROUPS>(w.hi, w.hi_stride, F::HIGH * 32, g, G);
            if constexpr (F::HAS_SUB)
                prefetch_ahead<V::GROUPS>(w.ss, w.sub_stride, F::HALVES * 8, g, G);
            if constexpr (F::MINS && !F::NIBBLES)
                prefetch_ahead<V::GROUPS>(w.sm, w.sub_stride, 8, g, G);
            constexpr int64_t factor_bytes = 32 * 32 / F::SUPER;  // 8 floats a SUPER weights
            prefetch_ahead<V::GROUPS>(w.d, w.super_stride * 4, factor_bytes, g, G);
            if constexpr (F::MINS)
                prefetch_ahead<V::GROUPS>(w.neg_dmin, w.super_stride * 4, factor_bytes, g, G);
        }
        I isum[F::HALVES][R];
        for (int h = 0; h < F::HALVES; ++h)
            for (int r = 0; r < R; ++r) isum[h][r] = V::zero();
        const int8_t* a = x.q8.data() + row * in.k + g * GROUP;
        // Unrolled: the planes' shifts become constants and isum[h] stays in registers (a
        // loop over e indexes them at run time: the sums then live in memory, 3x slower).
#pragma GCC unroll 8
        for (int e = 0; e < 8; ++e) {
            I code = plane_codes<V, F::LOW>(w.lo + g * F::LOW * 32, e, w.lo_stride);
            if constexpr (F::HIGH > 0)
                code = V::or_(code, V::slli16(plane_codes<V, F::HIGH>(w.hi + g * F::HIGH * 32, e,
                                                                      w.hi_stride),
                                              F::LOW));
            const int h = e * F::HALVES / 8;
            if constexpr (F::CODEBOOK) {  // signed values: |value| times x's sign-moved value
                const I c = V::lookup(table, code);
                const I magnitude = V::abs8(c);
                for (int r = 0; r < R; ++r) {
                    const I v = V::splat32(four_bytes(a + r * in.k + 4 * e));
                    isum[h][r] = V::dot_u8s8(isum[h][r], magnitude, V::signed_as(v, c));
                }
            } else {  // codes 0..63 as u8 (value + OFFSET: the offset's share comes off below)
                for (int r = 0; r < R; ++r)
                    isum[h][r] = V::dot_u8s8(isum[h][r], code,
                                             V::splat32(four_bytes(a + r * in.k + 4 * e)));
            }
        }
        if constexpr (F::OFFSET > 0)  // sum((code - OFFSET) x) = sum(code x) - OFFSET sum(x)
            for (int h = 0; h < F::HALVES; ++h)
                for (int r = 0; r < R; ++r)
                    isum[h][r] = V::sub32(isum[h][r], V::splat32(
                        F::OFFSET * half_sum<F>(x, (row + r) * G + g, h)));
        const int64_t super = g * GROUP / F::SUPER;
        const typename V::F d = V::factors(w.d + super * COLUMNS, w.super_stride);
        for (int h = 0; h < F::HALVES; ++h) {
            const int64_t sub = g * F::HALVES + h;
            const typename V::F scale =
                F::HAS_SUB
                    ? V::mul(d, sub_factors<V, F>(w.ss + sub * COLUMNS, w.sub_stride, false))
                    : d;
            for (int r = 0; r < R; ++r)
                acc[r] = V::fmadd(V::to_float(isum[h][r]), V::mul(scale, V::splat(dx[r * G + g])),
                                  acc[r]);
            if constexpr (F::MINS) {
                const uint8_t* m = F::NIBBLES ? w.ss : w.sm;
                const typename V::F mins =
                    V::mul(V::factors(w.neg_dmin + super * COLUMNS, w.super_stride),
                           sub_factors<V, F>(m + sub * COLUMNS, w.sub_stride, true));
                for (int r = 0; r < R; ++r) {
                    const float sum = F::HALVES == 1
                        ? x.sum8[(row + r) * G + g]
                        : dx[r * G + g] * float(half_sum<F>(x, (row + r) * G + g, h));
                    acc[r] = V::fmadd(mins, V::splat(sum), acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        float* out = y + (row + r) * ldy;
        V::store_out(out, accumulate ? V::add(V::load_out(out), acc[r]) : acc[r]);
    }
}

#else  // plain loops over the same layout (correct, not fast)

template <int BITS>
inline int plane_code(const uint8_t* plane, int e, int at) {
    constexpr int PER = 8 / BITS;
    return (plane[(e / PER) * 32 + at] >> (BITS * (e % PER))) & ((1 << BITS) - 1);
}

template <class F>
inline int32_t sub_factor(const uint8_t* byte, bool minimum) {
    if (!F::MINS) return int8_t(*byte);
    return F::NIBBLES ? (minimum ? *byte >> 4 : *byte & 15) : *byte;
}

template <class V, int R, class F>
void kq_tile(const KqGroup<F>& w, int64_t G, const Inputs& in, int64_t row, float* y,
             int64_t ldy, bool accumulate) {
    const Quantized& x = *in.x;
    for (int r = 0; r < R; ++r) {
        for (int j = 0; j < COLUMNS; ++j) {
            float sum = 0.f;
            for (int64_t g = 0; g < G; ++g) {
                int32_t dot[2] = {0, 0};
                for (int i = 0; i < GROUP; ++i) {
                    const int e = i / 4, at = 4 * j + i % 4;
                    int code = plane_code<F::LOW>(w.lo + g * F::LOW * 32, e, at);
                    if constexpr (F::HIGH > 0)
                        code |= plane_code<F::HIGH>(w.hi + g * F::HIGH * 32, e, at) << F::LOW;
                    const int value = F::CODEBOOK ? IQ4_VALUES[code] : code - F::OFFSET;
                    dot[e * F::HALVES / 8] += value * x.q8[(row + r) * in.k + g * GROUP + i];
                }
                const int64_t super = g * GROUP / F::SUPER, b = (row + r) * G + g;
                const float d = w.d[super * COLUMNS + j];
                for (int h = 0; h < F::HALVES; ++h) {
                    const int64_t sub = (g * F::HALVES + h) * COLUMNS + j;
                    const float scale =
                        F::HAS_SUB ? d * float(sub_factor<F>(w.ss + sub, false)) : d;
                    sum += float(dot[h]) * (scale * x.d8[b]);
                    if constexpr (F::MINS) {
                        const float min = w.neg_dmin[super * COLUMNS + j] *
                                          float(sub_factor<F>((F::NIBBLES ? w.ss : w.sm) + sub,
                                                              true));
                        sum += min * (F::HALVES == 1 ? x.sum8[b]
                                                     : x.d8[b] * float(half_sum<F>(x, b, h)));
                    }
                }
            }
            float& out = y[(row + r) * ldy + j];
            out = accumulate ? out + sum : sum;
        }
    }
}

#endif

// Every row of `in` against V::GROUPS column groups from group c on.
template <class V, class F>
void kq_column_groups(const IntMatrix& w, int64_t c, const Inputs& in, float* y, int64_t ldy,
                      bool accumulate) {
    const KqGroup<F> group(w, c);
    const int64_t G = w.k / GROUP;
    y += c * COLUMNS;
    int64_t row = in.first;
    for (; row + ROWS <= in.end; row += ROWS)
        kq_tile<V, ROWS, F>(group, G, in, row, y, ldy, accumulate);
    for (; row + 2 <= in.end; row += 2) kq_tile<V, 2, F>(group, G, in, row, y, ldy, accumulate);
    if (row < in.end) kq_tile<V, 1, F>(group, G, in, row, y, ldy, accumulate);
}

// Whether a KQ matrix has what its format needs.
inline bool kq_valid(const IntMatrix& w) {
    auto check = [&](auto spec) {
        using F = decltype(spec);
        return w.k % F::SUPER == 0 && (!F::HIGH || w.high_codes) && (!F::HAS_SUB || w.sub_scales)
               && (!F::MINS || (w.mins && (F::NIBBLES || w.sub_mins)));
    };
    switch (w.format) {
        case Q6_K: return check(Q6K{});
        case Q3_K: return check(Q3K{});
        case Q5_K: return check(Q5K{});
        case Q2_K: return check(Q2K{});
        case IQ4_NL: return check(IQ4NL{});
        case IQ4_XS: return check(IQ4XS{});
        default: return false;
    }
}

template <class V>
inline void kq_dispatch(const IntMatrix& w, int64_t c, const Inputs& in, float* y, int64_t ldy,
                        bool accumulate) {
    switch (w.format) {
        case Q6_K: return kq_column_groups<V, Q6K>(w, c, in, y, ldy, accumulate);
        case Q3_K: return kq_column_groups<V, Q3K>(w, c, in, y, ldy, accumulate);
        case Q5_K: return kq_column_groups<V, Q5K>(w, c, in, y, ldy, accumulate);
        case Q2_K: return kq_column_groups<V, Q2K>(w, c, in, y, ldy, accumulate);
        case IQ4_NL: return kq_column_groups<V, IQ4NL>(w, c, in, y, ldy, accumulate);
        case IQ4_XS: return kq_column_groups<V, IQ4XS>(w, c, in, y, ldy, accumulate);
        default: return;
    }
}
