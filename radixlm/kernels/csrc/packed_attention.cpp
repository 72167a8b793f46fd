// The packed float32 path (packed_attention.h). Per (task, KV head), block by block of 64
// keys:
//
//   1. pack: the block's K rows, widened to float32, transposed into K^T [d][64] (keys
//      past the block's end: zero);
//   2. for each tile of kTile rows that sees a key of the block:
//        S [kTile][64] = Q K^T: for each of d, the rows' element broadcast times the 64
//        keys' (4 vectors), added into 24 accumulators;
//        online softmax per row (scale, soft cap, window / causal bounds: softmax_update);
//        acc [kTile][d] = acc * alpha + P V, 4 vectors of d at a time, V's rows read in
//        place (widened as loaded).
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

#if defined(__AVX512F__)

bool packed_on() {
  static const bool on = [] {
    const char* v = std::getenv("RADIXLM_CPU_PACKED");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return on;
}

namespace {

constexpr int64_t kKeys = 64;  // keys per block: 4 vectors of scores per row
constexpr int64_t kTile = 6;   // rows per tile: 24 score vectors + 4 of K^T in registers
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
}

// S [kTile][kKeys] = the tile's rows q[0:kTile) times K^T, scaled.
inline void tile_scores(const float* const* q, const float* kt, int64_t d, float scale,
                        float (*s)[kKeys]) {
  v16 a[kTile][4] = {};
  for (int64_t c = 0; c < d; ++c) {
    v16 k[4];
    for (int x = 0; x < 4; ++x) k[x] = load16(kt + c * kKeys + 16 * x);
    for (int r = 0; r < kTile; ++r) {
      const float qc = q[r][c];
      for (int x = 0; x < 4; ++x) a[r][x] += qc * k[x];
    }
  }
  for (int r = 0; r < kTile; ++r)
    for (int x = 0; x < 4; ++x) {
      const v16 y = a[r][x] * scale;
      std::memcpy(s[r] + 16 * x, &y, sizeof y);
    }
}

// acc [kTile][d] = acc * alpha + P V over keys [j0, j1) of the block, NC vectors of d from
// column c0 (V rows in place at slots).
template <class KV, int NC>
void tile_values(const float (*p)[kKeys], const float* alpha, const typename KV::S* vh,
                 const int64_t* slots, int64_t j0, int64_t j1, int64_t stride, int64_t d,
                 int64_t c0, float* acc) {
  v16 o[kTile][NC];
  for (int r = 0; r < kTile; ++r)
    for (int c = 0; c < NC; ++c) o[r][c] = load16(acc + r * d + c0 + 16 * c) * alpha[r];
  for (int64_t j = j0; j < j1; ++j) {
    const typename KV::S* vp = vh + slots[j] * stride + c0;
    v16 v[NC];
    for (int c = 0; c < NC; ++c) v[c] = KV::load(vp + 16 * c);
    for (int r = 0; r < kTile; ++r)
      for (int c = 0; c < NC; ++c) o[r][c] += p[r][j] * v[c];
  }
  for (int r = 0; r < kTile; ++r)
    for (int c = 0; c < NC; ++c) std::memcpy(acc + r * d + c0 + 16 * c, &o[r][c], sizeof(v16));
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
  for (; c0 + 64 <= D; c0 += 64)
    tile_values<KV, 4>(s, alpha, vh, slots, j0, j1, stride, D, c0, acc);
  if (c0 < D) tile_values<KV, 2>(s, alpha, vh, slots, j0, j1, stride, D, c0, acc);  // 32 left
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

#else  // no AVX-512: paged_attention never calls packed_task

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
