// A 16 x 16 transpose of 32-bit elements in AVX-512 registers (the packing of the
// attention's packed paths: amx_attention.cpp's K tiles, packed_attention.cpp's K^T), and
// an 8 x 8 one in AVX2 registers (packed_attention.cpp's K^T without AVX-512).
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>

// r[0:8) -> their transpose in place: r[c] lane j = the old r[j] lane c. Pairs of rows
// interleaved by 32 bits, then by 64, then the 128-bit halves swapped across.
inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // u[4i + k], 128-bit half H: column 4H + k of rows 4i..4i+3
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
    r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
  }
}
#endif

#if defined(__AVX512F__)

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
