// The tile configuration of both AMX paths (amx_attention.cpp, amx_linear.cpp): palette 1,
// tiles 0-7 all 16 rows x 64 bytes (16 bf16 pairs, or 16 fp32). Loaded per thread before
// its tile work (each thread has its own tile state), released after it.
// RADIXLM_AMX: this build targets AMX-BF16 (the only condition either path tests).
// RADIXLM_TILES: the attention's tile path is built: on AMX tiles, or, for a CPU with
// AVX512-BF16 and no AMX (AMD Zen 4), its products on VDPBF16PS over the same packing.
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

// The tile operations by the names the attention uses
#define TILE_LOADD(i, p, stride) _tile_loadd(i, p, stride)
#define TILE_STORED(i, p, stride) _tile_stored(i, p, stride)
#define TILE_ZERO(i) _tile_zero(i)
#define TILE_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
#define TILE_RELEASE() _tile_release()

#elif defined(__AVX512BF16__)
// AVX512-BF16 without AMX (AMD Zen 4): the attention's products on VDPBF16PS directly, over
// the same packed tiles (amx_attention.cpp: scores_direct, values_direct)
#define RADIXLM_TILES 1
#include <immintrin.h>

#include <cstdint>
#endif

#if defined(__AVX512BF16__)
#include <cstring>

namespace radixlm_amx {

// Two bf16 of one row of A (a pair of its columns) broadcast to the 16 lanes: the A operand
// of VDPBF16PS, whose lane j then adds A's pair times B's pair j (the dot-product linear
// without AMX, the attention's products without AMX)
inline __m512bh bf16_pair(const uint16_t* a) {
  int32_t pair;
  std::memcpy(&pair, a, sizeof pair);
  return (__m512bh)_mm512_set1_epi32(pair);
}

}  // namespace radixlm_amx
#endif
