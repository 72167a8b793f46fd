// The tile configuration of both AMX paths (amx_attention.cpp, amx_linear.cpp): palette 1,
// tiles 0-7 all 16 rows x 64 bytes (16 bf16 pairs, or 16 fp32). Loaded per thread before
// its tile work (each thread has its own tile state), released after it.
// RADIXLM_AMX: this build targets AMX-BF16 (the only condition either path tests).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define RADIXLM_AMX 1
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
#endif
