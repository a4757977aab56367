// Steps of 16 tokens or more through a Q4 matrix on AMX (Intel Xeon, 4th generation on):
// included by int_step.cpp inside its anonymous namespace, after the vector tiles.
//
// Why: one tile instruction multiplies 16 rows of int8 activations by 16 columns' 4-bit codes
// over a block of 32 inputs, 8,192 multiply-adds, where 512-bit VNNI takes 128 instructions;
// vLLM's bfloat16 matmuls run on these units on such a CPU. The integer sums are the same exact
// numbers as the vector tiles', and the float arithmetic after them is theirs, the same
// function (int_step.cpp's scale_block: scale, then minimum, block by block), so the results
// are the same bits as every other build's. That float work, per block of 32 inputs because each block has its own scales, is
// now most of the time: on 2 Sapphire Rapids cores a 1B model's 8192 x 2048 Q4_K matrix at 256
// tokens went from 370 to 500 GMAC/s, its 256-token prompt from 911 to 814 ms, and 16 decodes
// of the default model from 25.1 to 23.0 ms a step.
//
// Tiles, a set for each of two blocks in flight (tmm0-2 and tmm3-5): C 16 rows x 16 int32
// sums; A 16 rows x the block's 32 int8 activations, read in place (rows `k` bytes apart);
// B 8 rows x 64 bytes, row r holding inputs 4r .. 4r + 3 of the 16 columns, 4 codes a column:
// the low or the high nibbles of quarter r / 2 of both column groups (int_step.cpp's layout),
// unpacked once per panel of rows.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(HAVE_LANES16)
#define HAVE_AMX 1

#include <sys/syscall.h>
#include <unistd.h>

constexpr int64_t AMX_ROWS = 16;
constexpr int64_t AMX_BLOCK_BYTES = 8 * 64;  // one block's B tile

// Whether this process may use the tiles: Linux grants their state on request, once.
inline bool amx_permitted() {
    constexpr long REQUEST_PERMISSION = 0x1023, TILE_DATA = 18;  // ARCH_REQ_XCOMP_PERM
    static const bool permitted = syscall(SYS_arch_prctl, REQUEST_PERMISSION, TILE_DATA) == 0;
    return permitted;
}

// The tiles' shapes, configured on this thread while it lives (one parallel region).
class AmxTiles {
public:
    AmxTiles() : on_(amx_permitted()) {
        if (!on_) return;
        alignas(64) unsigned char config[64] = {};
        config[0] = 1;  // palette 1
        for (int pair = 0; pair < 2; ++pair) {  // C, A, B: tiles 0-2 and 3-5
            shape(config, 3 * pair, AMX_ROWS, 64);
            shape(config, 3 * pair + 1, AMX_ROWS, GROUP);
            shape(config, 3 * pair + 2, GROUP / 4, 64);
        }
        _tile_loadconfig(config);
    }
    ~AmxTiles() {
        if (on_) _tile_release();
    }
    AmxTiles(const AmxTiles&) = delete;
    AmxTiles& operator=(const AmxTiles&) = delete;
    bool on() const { return on_; }

private:
    static void shape(unsigned char* config, int tile, int64_t rows, int64_t bytes) {
        config[16 + 2 * tile] = uint8_t(bytes);  // bytes a row, 16 bits little-endian
        config[17 + 2 * tile] = uint8_t(bytes >> 8);
        config[48 + tile] = uint8_t(rows);
    }
    bool on_;
};

// The B tiles of every block of the two column groups at w, into b [G, 8, 64].
inline void amx_unpack_q4(const Group& w, int64_t G, uint8_t* b) {
    using V = Lanes16;
    const V::I low4 = V::splat8(0x0F);
    for (int64_t g = 0; g < G; ++g)
        for (int h = 0; h < 4; ++h) {
            const V::I c = V::codes(w.codes + (g * 4 + h) * 32, w.code_stride);
            uint8_t* rows = b + g * AMX_BLOCK_BYTES + 2 * h * 64;
            _mm512_storeu_si512(rows, V::and_(c, low4));
            _mm512_storeu_si512(rows + 64, V::and_(V::srli16(c, 4), low4));
        }
}

// Row r's 16 int32 sums of a stored C tile.
inline __m512i row_sums(const int32_t* c, int r) { return _mm512_load_si512(c + 16 * r); }

// y[row .. row + 16, the two groups' 16 columns] from int8 activations and unpacked codes b.
// Two blocks at a time, each in tiles of its own (C: tmm0 and tmm3, A: 1 and 4, B: 2 and 5),
// so that one block's products run while the other's sums are stored.
inline void amx_q4_tile(const Group& w, const uint8_t* b, int64_t G, const Inputs& in,
                        int64_t row, float* y, int64_t ldy, bool accumulate) {
    using V = Lanes16;
    const Quantized& x = *in.x;
    const float* d = x.d8.data() + row * G;
    const float* sums = x.sum8.data() + row * G;
    const int8_t* a = x.q8.data() + row * in.k;
    alignas(64) int32_t c[2][AMX_ROWS * 16];
    V::F acc[AMX_ROWS];
    for (int r = 0; r < AMX_ROWS; ++r) acc[r] = V::zero_f();
    int64_t g = 0;
    for (; g + 2 <= G; g += 2) {
        _tile_zero(0);
        _tile_zero(3);
        _tile_loadd(1, a + g * GROUP, in.k);
        _tile_loadd(2, b + g * AMX_BLOCK_BYTES, 64);
        _tile_loadd(4, a + (g + 1) * GROUP, in.k);
        _tile_loadd(5, b + (g + 1) * AMX_BLOCK_BYTES, 64);
        _tile_dpbsud(0, 1, 2);  // signed activations times unsigned codes
        _tile_dpbsud(3, 4, 5);
        _tile_stored(0, c[0], 64);
        _tile_stored(3, c[1], 64);
        scale_block<V, AMX_ROWS, true>(w, g, G, d, sums, [&](int r) { return row_sums(c[0], r); },
                                       acc);
        scale_block<V, AMX_ROWS, true>(w, g + 1, G, d, sums,
                                       [&](int r) { return row_sums(c[1], r); }, acc);
    }
    if (g < G) {
        _tile_zero(0);
        _tile_loadd(1, a + g * GROUP, in.k);
        _tile_loadd(2, b + g * AMX_BLOCK_BYTES, 64);
        _tile_dpbsud(0, 1, 2);
        _tile_stored(0, c[0], 64);
        scale_block<V, AMX_ROWS, true>(w, g, G, d, sums, [&](int r) { return row_sums(c[0], r); },
                                       acc);
    }
    for (int r = 0; r < AMX_ROWS; ++r) {
        float* out = y + (row + r) * ldy;
        V::store_out(out, accumulate ? V::add(V::load_out(out), acc[r]) : acc[r]);
    }
}

// Rows [row, end) of `in` in tiles of 16 on AMX, for the two column groups at w; returns the
// first row it left to the vector tiles.
inline int64_t amx_q4_rows(const Group& w, int64_t G, const Inputs& in, int64_t row, float* y,
                           int64_t ldy, bool accumulate) {
    if (!in.amx || in.end - row < AMX_ROWS) return row;
    thread_local std::vector<uint8_t> codes;
    codes.resize(G * AMX_BLOCK_BYTES);
    amx_unpack_q4(w, G, codes.data());
    for (; row + AMX_ROWS <= in.end; row += AMX_ROWS)
        amx_q4_tile(w, codes.data(), G, in, row, y, ldy, accumulate);
    return row;
}

#else

class AmxTiles {  // no AMX in this build
public:
    bool on() const { return false; }
};

#endif
