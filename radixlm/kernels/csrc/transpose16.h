// A 16 x 16 transpose of 32-bit elements in AVX-512 registers (the packing of the
// attention's packed paths: amx_attention.cpp's K tiles, packed_attention.cpp's K^T).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

// r[0:16) -> their transpose, as 16 x 16 u32: out[c] lane j = r[j] lane c. Pairs of
// rows interleaved by 32 bits, then by 64, then 128-bit lanes gathered in two rounds.
inline void transpose16(const __m512i* r, __m512i* out) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + k], 128-bit lane L: column 4L + k of rows 4i..4i+3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88);
    const __m512i x1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xdd);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
    const __m512i y1 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xdd);
    out[k] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    out[4 + k] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    out[8 + k] = _mm512_shuffle_i32x4(x0, y0, 0xdd);
    out[12 + k] = _mm512_shuffle_i32x4(x1, y1, 0xdd);
  }
}
#endif
