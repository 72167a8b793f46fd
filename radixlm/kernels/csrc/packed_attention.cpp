// The packed float32 path (packed_attention.h). Per (task, KV head), block by block of 64
// keys:
//
//   1. pack: the block's K rows, widened to float32, transposed into K^T [d][64] (keys
//      past the block's end: zero);
//   2. for each tile of kTile rows that sees a key of the block:
//        S [kTile][64] = Q K^T: for each of d, the rows' element broadcast times the
//        keys' (AVX-512: all 64, 4 vectors, into 24 accumulators; AVX2: 16 at a time, 2
//        vectors, into 12);
//        online softmax per row (scale, soft cap, window / causal bounds: softmax_update);
//        acc [kTile][d] = acc * alpha + P V, 64 of d at a time (AVX2: 16), V's rows read
//        in place (widened as loaded).
//
// Blocks outer, tiles inner: the block's K^T and V rows stay in cache for every tile; the
// rows' states (m, l, acc) live in scratch between blocks. The products are the FMA path's,
// summed in another order (a score's d terms in sequence rather than in 16 lanes).
#include "packed_attention.h"

#include "scratch.h"
#include "transpose16.h"
#include "vec_math.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))

bool packed_on() {
  static const bool on = [] {
    const char* v = std::getenv("RADIXLM_CPU_PACKED");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return on;
}

namespace {

constexpr int64_t kKeys = 64;  // keys per block
constexpr int64_t kTile = 6;   // rows per tile
// A register (vec, kW floats) and how many of them a tile keeps per pass: kSV of each row's
// scores (kW keys each) and of K^T, kNC of each row's accumulator (kW of d each) and of V.
// AVX-512 (32 registers): the whole block at once, 24 + 4; AVX2 (16 registers): 16 keys or
// 16 of d at a time, 12 + 2 and a broadcast.
#if defined(__AVX512F__)
using vec = v16;
constexpr int kW = 16, kSV = 4, kNC = 4;
inline vec loadv(const float* p) { return load16(p); }
template <class KV>
inline vec loadv(const typename KV::S* p) { return KV::load(p); }
#else
using vec = v8;
constexpr int kW = 8, kSV = 2, kNC = 2;
inline vec loadv(const float* p) { return load8(p); }
template <class KV>
inline vec loadv(const typename KV::S* p) { return KV::load8(p); }
#endif
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The block's keys slots[0:n) of one head as K^T [d][kKeys] (row c: element c of each key).
// The next block's K and V rows (slots ahead[0:n_ahead)) are prefetched meanwhile: scattered
// slots, which the hardware prefetcher cannot follow.
template <class KV>
void pack_keys(const typename KV::S* kh, const typename KV::S* vh, const int64_t* slots,
               int64_t n, int64_t stride, int64_t d, const int64_t* ahead, int64_t n_ahead,
               float* kt) {
  for (int64_t j = 0; j < n_ahead; ++j) {
    prefetch_row<KV>(kh + ahead[j] * stride, d);
    prefetch_row<KV>(vh + ahead[j] * stride, d);
  }
#if defined(__AVX512F__)
  __m512i r[16], tr[16];
  for (int64_t q = 0; q < kKeys / 16; ++q)  // 16 keys x 16 of d at a time
    for (int64_t c = 0; c < d; c += 16) {
      for (int64_t j = 0; j < 16; ++j) {
        const v16 x = q * 16 + j < n ? KV::load(kh + slots[q * 16 + j] * stride + c) : v16{};
        std::memcpy(&r[j], &x, sizeof x);
      }
      transpose16(r, tr);
      for (int64_t p = 0; p < 16; ++p) _mm512_store_si512(kt + (c + p) * kKeys + q * 16, tr[p]);
    }
#else
  __m256 r[8];
  for (int64_t q = 0; q < kKeys / 8; ++q)  // 8 keys x 8 of d at a time
    for (int64_t c = 0; c < d; c += 8) {
      for (int64_t j = 0; j < 8; ++j) {
        const v8 x = q * 8 + j < n ? KV::load8(kh + slots[q * 8 + j] * stride + c) : v8{};
        std::memcpy(&r[j], &x, sizeof x);
      }
      transpose8(r);
      for (int64_t p = 0; p < 8; ++p) _mm256_store_ps(kt + (c + p) * kKeys + q * 8, r[p]);
    }
#endif
}

// S [kTile][kKeys] = the tile's rows q[0:kTile) times K^T, scaled.
inline void tile_scores(const float* const* q, const float* kt, int64_t d, float scale,
                        float (*s)[kKeys]) {
  for (int x0 = 0; x0 < kKeys / kW; x0 += kSV) {  // kSV vectors of keys per pass
    vec a[kTile][kSV] = {};
    for (int64_t c = 0; c < d; ++c) {
      vec k[kSV];
      for (int x = 0; x < kSV; ++x) k[x] = loadv(kt + c * kKeys + kW * (x0 + x));
      for (int r = 0; r < kTile; ++r) {
        const float qc = q[r][c];
        for (int x = 0; x < kSV; ++x) a[r][x] += qc * k[x];
      }
    }
    for (int r = 0; r < kTile; ++r)
      for (int x = 0; x < kSV; ++x) {
        const vec y = a[r][x] * scale;
        std::memcpy(s[r] + kW * (x0 + x), &y, sizeof y);
      }
  }
}

// acc [kTile][d] = acc * alpha + P V over keys [j0, j1) of the block, NC vectors of d from
// column c0 (V rows in place at slots).
template <class KV, int NC>
void tile_values(const float (*p)[kKeys], const float* alpha, const typename KV::S* vh,
                 const int64_t* slots, int64_t j0, int64_t j1, int64_t stride, int64_t d,
                 int64_t c0, float* acc) {
  vec o[kTile][NC];
  for (int r = 0; r < kTile; ++r)
    for (int c = 0; c < NC; ++c) o[r][c] = loadv(acc + r * d + c0 + kW * c) * alpha[r];
  for (int64_t j = j0; j < j1; ++j) {
    const typename KV::S* vp = vh + slots[j] * stride + c0;
    vec v[NC];
    for (int c = 0; c < NC; ++c) v[c] = loadv<KV>(vp + kW * c);
    for (int r = 0; r < kTile; ++r)
      for (int c = 0; c < NC; ++c) o[r][c] += p[r][j] * v[c];
  }
  for (int r = 0; r < kTile; ++r)
    for (int c = 0; c < NC; ++c) std::memcpy(acc + r * d + c0 + kW * c, &o[r][c], sizeof(vec));
}

// One tile over one block: rows r0 + [0, kTile) of the head (states m, l, acc), the block
// starting at key b0 with n keys.
template <class KV, int DC>
void tile_block(const Task<KV>& t, const float* const* q, const float* kt,
                const typename KV::S* vh, const int64_t* slots, int64_t b0, int64_t n,
                int64_t r0, int64_t r_count, float* m, float* l, float* acc) {
  constexpr int64_t D = DC * 16;
  alignas(64) float s[kTile][kKeys];
  alignas(64) float alpha[kTile];
  tile_scores(q, kt, D, t.scale, s);
  int64_t j0 = kKeys, j1 = 0;  // the keys some row of the tile sees
  for (int r = 0; r < kTile; ++r) {
    const bool real = r0 + r < r_count;
    const int64_t lo = real ? std::clamp<int64_t>(t.lo(r0 + r) - b0, 0, n) : 0;
    const int64_t hi = real ? std::clamp<int64_t>(t.hi(r0 + r) - b0, 0, n) : 0;
    if (t.cap > 0.f) soft_cap(s[r], n, t.cap);
    alpha[r] = softmax_update(s[r], kKeys, lo, hi, m[r], l[r]);
    if (lo < hi) j0 = std::min(j0, lo), j1 = std::max(j1, hi);
  }
  const int64_t stride = t.hkv * D;
  int64_t c0 = 0;
  for (; c0 + kW * kNC <= D; c0 += kW * kNC)
    tile_values<KV, kNC>(s, alpha, vh, slots, j0, j1, stride, D, c0, acc);
  if constexpr (kW * kNC > 16)  // AVX-512: d = 64k + 32 leaves 32
    if (c0 < D) tile_values<KV, 2>(s, alpha, vh, slots, j0, j1, stride, D, c0, acc);
}

}  // namespace

template <class KV, int DC>
void packed_task(const Task<KV>& t, int64_t h0, int64_t h1, float* o, float* lse) {
  constexpr int64_t D = DC * 16;
  const int64_t r_count = t.n_rows * t.grp, tiles = (r_count + kTile - 1) / kTile;
  if (r_count == 0) return;
  const int64_t padded = tiles * kTile, stride = t.hkv * D;
  const int64_t k1 = std::min(t.n_keys, t.hi(r_count - 1));
  const int64_t k0 = t.grid_start(t.lo(0), kKeys), kend = t.grid_end(k1);
  float* kt = scratch<float, 4>(D * kKeys);
  float* state = scratch<float, 5>(padded * (D + 2));
  static const float zero_row[256] = {};
  const float** q = scratch<const float*, 6>(padded);  // each row's q (zeros past the rows)
  for (int64_t h = h0; h < h1; ++h) {
    float *m = state, *l = m + padded, *acc = l + padded;
    std::fill(m, m + padded, kNegInf);
    std::fill(l, l + padded, 0.f);
    std::fill(acc, acc + padded * D, 0.f);
    for (int64_t r = 0; r < padded; ++r) {
      q[r] = r < r_count ? t.q + t.head_of(h, r) * D : zero_row;
      if (r < r_count) t.start(t.head_of(h, r), m[r], l[r], acc + r * D);
    }
    const typename KV::S* kh = t.k + h * D;
    const typename KV::S* vh = t.v + h * D;
    for (int64_t b0 = k0; b0 < k1; b0 += kKeys) {
      const int64_t n = std::min(kKeys, kend - b0);
      const int64_t n_ahead = std::clamp<int64_t>(k1 - b0 - kKeys, 0, kKeys);
      pack_keys<KV>(kh, vh, t.slots + b0, n, stride, D, t.slots + b0 + kKeys, n_ahead, kt);
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const int64_t r0 = tile * kTile, last = std::min(r0 + kTile, r_count) - 1;
        // rows' positions grow with r: the tile sees keys [lo(r0), hi(last))
        if (t.hi(last) <= b0 || t.lo(r0) >= b0 + n) continue;
        tile_block<KV, DC>(t, q + r0, kt, vh, t.slots + b0, b0, n, r0, r_count, m + r0,
                           l + r0, acc + r0 * D);
      }
    }
    for (int64_t r = 0; r < r_count; ++r)
      t.finish(t.head_of(h, r), m[r], l[r], acc + r * D, o, lse);
  }
}

#else  // neither AVX-512 nor AVX2: paged_attention never calls packed_task

bool packed_on() { return false; }

template <class KV, int DC>
void packed_task(const Task<KV>&, int64_t, int64_t, float*, float*) {
  std::abort();
}

#endif

#define RADIXLM_PACKED(KV)                                                           \
  template void packed_task<KV, 2>(const Task<KV>&, int64_t, int64_t, float*, float*); \
  template void packed_task<KV, 4>(const Task<KV>&, int64_t, int64_t, float*, float*); \
  template void packed_task<KV, 6>(const Task<KV>&, int64_t, int64_t, float*, float*); \
  template void packed_task<KV, 8>(const Task<KV>&, int64_t, int64_t, float*, float*); \
  template void packed_task<KV, 16>(const Task<KV>&, int64_t, int64_t, float*, float*);
RADIXLM_PACKED(F32)
RADIXLM_PACKED(BF16)
RADIXLM_PACKED(F16)
RADIXLM_PACKED(E5M2)
