// The tile configuration of both AMX paths (amx_attention.cpp, amx_linear.cpp): palette 1,
// tiles 0-7 all 16 rows x 64 bytes (16 bf16 pairs, or 16 fp32). Loaded per thread before
// its tile work (each thread has its own tile state), released after it.
// RADIXLM_AMX: this build targets AMX-BF16 (the only condition either path tests).
// RADIXLM_TILES: the attention's tile code is built: on AMX tiles, or, for a CPU with
// AVX512-BF16 and no AMX (AMD Zen 4), on the emulation below.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define RADIXLM_AMX 1
#define RADIXLM_TILES 1
#include <immintrin.h>

#include <cstdint>

namespace radixlm_amx {

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure_tiles() {
  TileConfig c;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = 16;
  }
  _tile_loadconfig(&c);
}

}  // namespace radixlm_amx

// The tile operations by the names the attention uses (the emulation's below)
#define TILE_LOADD(i, p, stride) _tile_loadd(i, p, stride)
#define TILE_STORED(i, p, stride) _tile_stored(i, p, stride)
#define TILE_ZERO(i) _tile_zero(i)
#define TILE_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
#define TILE_RELEASE() _tile_release()

#elif defined(__AVX512BF16__)
#define RADIXLM_TILES 1
#include <immintrin.h>

#include <cstdint>
#include <cstring>

// The tile operations the attention uses, on AVX512-BF16 vectors: eight 16 x 64-byte tiles
// per thread. A load only notes where its rows are (they are read by the product that uses
// the tile, the next operation in every use here: nothing writes them in between); a
// product's accumulator tile lives in memory (16 vectors, loaded and stored around the
// product). TDPBF16PS's sums: C[i][j] += A[i][2r] B[r][2j] + A[i][2r+1] B[r][2j+1] over
// the 16 pairs r, in float32, what VDPBF16PS adds per lane with A's pair broadcast.
namespace radixlm_amx {

struct Tiles {
  const uint8_t* rows[8] = {};  // a loaded tile's rows in place, or null: the tile is buf
  int64_t stride[8] = {};
  alignas(64) uint8_t buf[8][1024];
};

inline Tiles& tiles() {
  thread_local Tiles t;
  return t;
}

inline const uint8_t* tile_row(const Tiles& t, int i, int r) {
  return t.rows[i] != nullptr ? t.rows[i] + r * t.stride[i] : t.buf[i] + r * 64;
}

inline void configure_tiles() {}
inline void emu_release() {}

inline void emu_loadd(int i, const void* p, int64_t stride) {
  Tiles& t = tiles();
  t.rows[i] = static_cast<const uint8_t*>(p);
  t.stride[i] = stride;
}

inline void emu_zero(int i) {
  Tiles& t = tiles();
  t.rows[i] = nullptr;
  std::memset(t.buf[i], 0, sizeof t.buf[i]);
}

inline void emu_stored(int i, void* p, int64_t stride) {
  const Tiles& t = tiles();
  for (int r = 0; r < 16; ++r)
    std::memcpy(static_cast<uint8_t*>(p) + r * stride, tile_row(t, i, r), 64);
}

inline void emu_dpbf16ps(int c, int a, int b) {
  Tiles& t = tiles();
  if (t.rows[c] != nullptr) {  // an accumulator loaded from memory: into its buffer first
    for (int r = 0; r < 16; ++r) std::memcpy(t.buf[c] + r * 64, tile_row(t, c, r), 64);
    t.rows[c] = nullptr;
  }
  float* cp = reinterpret_cast<float*>(t.buf[c]);
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_load_ps(cp + i * 16);
  const uint8_t* a0 = tile_row(t, a, 0);
  const int64_t lda = t.rows[a] != nullptr ? t.stride[a] : 64;
  for (int r = 0; r < 16; ++r) {
    const __m512bh bv = (__m512bh)_mm512_loadu_si512(tile_row(t, b, r));
    for (int i = 0; i < 16; ++i) {
      int32_t pair;
      std::memcpy(&pair, a0 + i * lda + 4 * r, sizeof pair);
      acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(pair), bv);
    }
  }
  for (int i = 0; i < 16; ++i) _mm512_store_ps(cp + i * 16, acc[i]);
}

}  // namespace radixlm_amx

#define TILE_LOADD(i, p, stride) radixlm_amx::emu_loadd(i, p, stride)
#define TILE_STORED(i, p, stride) radixlm_amx::emu_stored(i, p, stride)
#define TILE_ZERO(i) radixlm_amx::emu_zero(i)
#define TILE_DPBF16PS(c, a, b) radixlm_amx::emu_dpbf16ps(c, a, b)
#define TILE_RELEASE() radixlm_amx::emu_release()
#endif
