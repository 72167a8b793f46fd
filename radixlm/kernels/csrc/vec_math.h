// Vector arithmetic of the CPU attention kernel (paged_attention.cpp): a vectorisable
// exp for non-positive arguments, the soft cap's tanh, and lane sums of 16-float vectors.
#pragma once

#include "kv_load.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

// exp(x) for x <= 0 (scores minus their running max), as a polynomial the compiler
// vectorises (the libm call it would otherwise make is scalar): x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by Cephes' degree-6 minimax polynomial, 2^n through the exponent
// bits. Relative error about 2e-7; x below -87 (exp < 2e-38) gives 2^-126, not 0.
inline float exp_neg(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

inline float hsum(v16 x) {  // halving tree: 4 vector adds, no scalar loop
  const v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// r[j] = hsum(a[j]) for 16 vectors at once: a transposing tree of lane shuffles and adds
// (45 vector ops for 16 sums, against 16 separate hsums' 128)
inline v16 reduce16(const v16* a) {
  v16 b[8], c[4], d[2];
  for (int p = 0; p < 8; ++p) {  // within 128-bit lanes: pairs of elements, two vectors
    const v16 x = a[2 * p], y = a[2 * p + 1];
    b[p] = __builtin_shufflevector(x, y, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28,
                                   13, 29) +
           __builtin_shufflevector(x, y, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30,
                                   15, 31);
  }
  for (int p = 0; p < 4; ++p) {  // whole 128-bit lanes, four vectors
    const v16 x = b[2 * p], y = b[2 * p + 1];
    c[p] = __builtin_shufflevector(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13,
                                   28, 29) +
           __builtin_shufflevector(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15,
                                   30, 31);
  }
  for (int p = 0; p < 2; ++p) {  // pairs of 128-bit lanes
    const v16 x = c[2 * p], y = c[2 * p + 1];
    d[p] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                                   27) +
           __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                   31);
  }
  return __builtin_shufflevector(d[0], d[1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25,
                                 26, 27) +
         __builtin_shufflevector(d[0], d[1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28,
                                 29, 30, 31);
}

// Soft-capping, s[0:n) -> cap * tanh(s / cap), vectorised like exp_neg: tanh|y| =
// (1 - e) / (1 + e) with e = exp(-2|y|), except below |y| = 0.25, where 1 - e cancels
// digits and tanh's odd series to y^9 is exact to 1e-8 relative.
inline void soft_cap(float* s, int64_t n, float cap) {
  const float inv = 1.f / cap;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float y = s[j] * inv, a = std::fabs(y), a2 = a * a;
    const float e = exp_neg(-2.f * a);
    const float big = (1.f - e) / (1.f + e);
    const float small =
        a * (1.f + a2 * (-1.f / 3 + a2 * (2.f / 15 + a2 * (-17.f / 315 + a2 * (62.f / 2835)))));
    s[j] = std::copysign(a < 0.25f ? small : big, y) * cap;
  }
}

// The max of s[lo, hi), a register's width at a time (GCC leaves a max reduction scalar: a
// serial chain of vmaxss that cost 8% of a decode step's attention). AVX2 takes 8 floats:
// without AVX-512 GCC lowers a 16-float compare and select lane by lane, through the stack
// (half of the packed path's softmax on Zen 3).
inline float block_max(const float* s, int64_t lo, int64_t hi) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  int64_t j = lo;
  float bm = -kInf;
#if defined(__AVX2__) && !defined(__AVX512F__)
  __m256 vm = _mm256_set1_ps(-kInf);
  for (; j + 8 <= hi; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + j));  // vm > x ? vm : x
  alignas(32) float lane[8];
  _mm256_store_ps(lane, vm);
  for (int i = 0; i < 8; ++i) bm = std::max(bm, lane[i]);
#else
  v16 vm = v16{} - kInf;
  for (; j + 16 <= hi; j += 16) {
    const v16 x = load16(s + j);
    vm = vm > x ? vm : x;
  }
  for (int i = 0; i < 16; ++i) bm = std::max(bm, vm[i]);
#endif
  for (; j < hi; ++j) bm = std::max(bm, s[j]);
  return bm;
}

// The online-softmax update of one row from its block scores s[0:nb), of which it sees
// [lo, hi): s becomes the probabilities; returns the factor the accumulator is scaled by.
inline float softmax_update(float* s, int64_t nb, int64_t lo, int64_t hi, float& m, float& l) {
  const float bm = block_max(s, lo, hi);
  const float new_m = std::max(m, bm);
  const float alpha = m == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m - new_m);
  // the keys outside [lo, hi) zeroed apart (a per-key test in the loop took 64-bit index
  // compares and blends: a third of the softmax on AVX2)
  std::fill(s, s + lo, 0.f);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = lo; j < hi; ++j) {
    s[j] = exp_neg(s[j] - new_m);
    sum += s[j];
  }
  std::fill(s + std::max(lo, hi), s + nb, 0.f);
  l = l * alpha + sum;
  m = new_m;
  return alpha;
}
