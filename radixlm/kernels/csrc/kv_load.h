// Loading K/V rows of the pool as float32, whatever dtype the pool stores
// (paged_attention.cpp's vector and scalar paths).
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

// 16 floats: GCC's vector extension, so the inner loops are explicit vector code
typedef float v16 __attribute__((vector_size(64), aligned(4), may_alias));

inline v16 load16(const float* p) { return *reinterpret_cast<const v16*>(p); }

#if defined(__AVX2__) && !defined(__AVX512F__)
// 8 floats: one AVX2 register. GCC keeps a v16 in two only as a single value; arrays of
// them (a tile's accumulators) it spills to the stack, so AVX2 tiles are written in v8.
typedef float v8 __attribute__((vector_size(32), aligned(4), may_alias));
inline v8 load8(const float* p) { return *reinterpret_cast<const v8*>(p); }
inline v8 from_m256(__m256 x) {
  v8 r;
  std::memcpy(&r, &x, sizeof r);
  return r;
}
#endif

// How a pool dtype is read: 16 elements at a time as floats (vector path), or one. bf16 is
// the high half of a float, fp8 e5m2 the high byte of a float16; the conversions are x86
// instructions where the compiler targets them (GCC scalarises _Float16 vectors without
// AVX512-FP16), element by element otherwise.
inline float bf16_bits(uint16_t x) {
  const uint32_t w = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &w, sizeof f);
  return f;
}

inline float f16_bits(uint16_t x) {
  _Float16 h;
  std::memcpy(&h, &x, sizeof h);
  return static_cast<float>(h);
}

template <class T, class F>
inline v16 load_each(const T* p, F f) {
  v16 r;
  for (int i = 0; i < 16; ++i) r[i] = f(p[i]);
  return r;
}

#if defined(__AVX512F__)
inline v16 from_m512(__m512 x) {
  v16 r;
  std::memcpy(&r, &x, sizeof r);
  return r;
}
inline v16 f16x16(__m256i h) { return from_m512(_mm512_cvtph_ps(h)); }
#elif defined(__AVX2__) && defined(__F16C__)
inline v16 f16x16(__m256i h) {
  const __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  const __m256 hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  v16 r;
  std::memcpy(&r, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&r) + sizeof lo, &hi, sizeof hi);
  return r;
}
#endif

struct F32 {
  using S = float;
  static v16 load(const S* p) { return load16(p); }
  static float one(const S* p) { return *p; }
#if defined(__AVX2__) && !defined(__AVX512F__)
  static v8 load8(const S* p) { return ::load8(p); }
#endif
};
struct BF16 {
  using S = uint16_t;
  static v16 load(const S* p) {
#if defined(__AVX512F__)
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return from_m512(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
#elif defined(__AVX2__)
    const __m128i* h = reinterpret_cast<const __m128i*>(p);
    const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(h)), 16));
    const __m256 hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(h + 1)), 16));
    v16 r;
    std::memcpy(&r, &lo, sizeof lo);
    std::memcpy(reinterpret_cast<char*>(&r) + sizeof lo, &hi, sizeof hi);
    return r;
#else
    return load_each(p, bf16_bits);
#endif
  }
  static float one(const S* p) { return bf16_bits(*p); }
#if defined(__AVX2__) && !defined(__AVX512F__)
  static v8 load8(const S* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return from_m256(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
#endif
};
struct F16 {
  using S = uint16_t;
  static v16 load(const S* p) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
    return f16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
    return load_each(p, f16_bits);
#endif
  }
  static float one(const S* p) { return f16_bits(*p); }
#if defined(__AVX2__) && !defined(__AVX512F__) && defined(__F16C__)
  static v8 load8(const S* p) {
    return from_m256(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
#endif
};
struct E5M2 {
  using S = uint8_t;
  static float bits(uint8_t x) { return f16_bits(static_cast<uint16_t>(x << 8)); }
  static v16 load(const S* p) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return f16x16(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
#else
    return load_each(p, bits);
#endif
  }
  static float one(const S* p) { return bits(*p); }
#if defined(__AVX2__) && !defined(__AVX512F__) && defined(__F16C__)
  static v8 load8(const S* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return from_m256(_mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(b), 8)));
  }
#endif
};

typedef uint32_t u16v __attribute__((vector_size(64)));

#if defined(__AVX2__) && !defined(__AVX512F__)
// float32 -> bfloat16 of 8 lanes, as store_bf16 below (AVX2)
inline void store_bf16_8(uint16_t* p, v8 x) {
  const __m256 f = (__m256)x;
  const __m256i b = _mm256_castps_si256(f), one = _mm256_set1_epi32(1);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), one);
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
#endif

// float32 -> bfloat16, round to nearest even, NaN -> 0x7FC0 (torch's round_to_nearest_even)
inline void store_bf16(uint16_t* p, v16 x) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  store_bf16_8(p, __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7));
  store_bf16_8(p + 8, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15));
#else
  u16v b;
  std::memcpy(&b, &x, sizeof b);
  u16v r = (b + (((b >> 16) & 1u) + 0x7FFFu)) >> 16;
  const u16v nan = reinterpret_cast<u16v>(x != x);
  r = (r & ~nan) | (0x7FC0u & nan);
#if defined(__AVX512F__)
  __m512i w;
  std::memcpy(&w, &r, sizeof w);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(w));
#else
  for (int i = 0; i < 16; ++i) p[i] = static_cast<uint16_t>(r[i]);
#endif
#endif
}

// A pool row of d elements of KV's dtype into L2 (scattered slots: the hardware prefetcher
// cannot follow them)
template <class KV>
inline void prefetch_row(const typename KV::S* p, int64_t d) {
  for (int64_t i = 0; i < d; i += 64 / static_cast<int64_t>(sizeof(typename KV::S)))
    __builtin_prefetch(p + i, 0, 2);
}
