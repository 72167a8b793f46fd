// The packed float32 path (packed_attention.h). Per (task, KV head), block by block of 64
// keys:
//
//   1. pack: the block's K rows, widened to float32, transposed into K^T [d][64] (keys
//      past the block's end: zero);
//   2. for each tile of RT rows (3-6: the head's rows in tiles of at most 6, as even as
//      they divide; fewer than 3 padded to 3) that sees a key of the block:
//        S [RT][64] = Q K^T: for each of d, the rows' element broadcast times the keys'
//        (AVX-512: all 64, 4 vectors; AVX2: 16 at a time, 2 vectors, or 32 in tiles of 3);
//        online softmax per row (scale, soft cap, window / causal bounds: softmax_update);
//        acc [RT][d] = acc * alpha + P V, as many vectors of d at a time, V's rows read
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
// A tile has RT rows, 3 to 6: a decode step's group of 7 query heads per KV head (Qwen2.5's
// 14 / 2) as 3 + 4 rows, not 6 + 6 of which 5 padding (AMD Zen 3, 24 layers x 32 rows over
// 300 keys: 22.1 against 26.5 ms a step; groups of 4, 6 rows of which 2 padding before: 21.0
// against 26.6 over 12 layers).
// A register (vec, kW floats) and how many of them a tile keeps per pass: vecs<RT> of each
// row's scores (kW keys each) and of K^T, the same of each row's accumulator (kW of d each)
// and of V. AVX-512 (32 registers): 24 accumulators, the whole block (4 vectors) at once;
// AVX2 (16 registers): 12 accumulators, 2 or 4 vectors, a broadcast beside them.
#if defined(__AVX512F__)
using vec = v16;
constexpr int kW = 16, kAccumulators = 24;
template <class KV>
inline vec loadv(const typename KV::S* p) { return KV::load(p); }
#else
using vec = v8;
constexpr int kW = 8, kAccumulators = 12;
template <class KV>
inline vec loadv(const typename KV::S* p) { return KV::load8(p); }
#endif
// (4, 2 or 1: the scores' passes take whole groups of a block's vectors, the values' whole
// 16-float pieces of the head)
template <int RT>
constexpr int vecs() { return kAccumulators / RT >= 4 ? 4 : kAccumulators / RT >= 2 ? 2 : 1; }
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The rows of slots ahead[part * n / parts : (part + 1) * n / parts) of the head whose rows
// start at p, prefetched: one share of a block's rows.
template <class KV>
inline void prefetch_share(const typename KV::S* p, const int64_t* ahead, int64_t n,
                           int64_t part, int64_t parts, int64_t stride, int64_t d) {
  for (int64_t j = part * n / parts; j < (part + 1) * n / parts; ++j)
    prefetch_row<KV>(p + ahead[j] * stride, d);
}

// The block's keys slots[0:n) of one head as K^T [d][kKeys] (row c: element c of each key).
// The next block's K rows (slots ahead[0:n_ahead) of the head whose rows start at kn: this
// one's, or after its last block the next head's first) are prefetched meanwhile, a share
// per group of keys packed (scattered slots, which the hardware prefetcher cannot follow;
// the V rows, a share per tile: heads). All of them at once, ahead of the block's own
// loads, left a decode step's attention 7-11% slower on AMD Zen 3 (K/V from memory).
template <class KV>
void pack_keys(const typename KV::S* kh, const typename KV::S* kn, const int64_t* slots,
               int64_t n, int64_t stride, int64_t d, const int64_t* ahead, int64_t n_ahead,
               float* kt) {
#if defined(__AVX512F__)
  __m512i r[16], tr[16];
  for (int64_t q = 0; q < kKeys / 16; ++q) {  // 16 keys x 16 of d at a time
    prefetch_share<KV>(kn, ahead, n_ahead, q, kKeys / 16, stride, d);
    for (int64_t c = 0; c < d; c += 16) {
      for (int64_t j = 0; j < 16; ++j) {
        const v16 x = q * 16 + j < n ? KV::load(kh + slots[q * 16 + j] * stride + c) : v16{};
        std::memcpy(&r[j], &x, sizeof x);
      }
      transpose16(r, tr);
      for (int64_t p = 0; p < 16; ++p) _mm512_store_si512(kt + (c + p) * kKeys + q * 16, tr[p]);
    }
  }
#else
  __m256 r[8];
  for (int64_t q = 0; q < kKeys / 8; ++q) {  // 8 keys x 8 of d at a time
    prefetch_share<KV>(kn, ahead, n_ahead, q, kKeys / 8, stride, d);
    for (int64_t c = 0; c < d; c += 8) {
      // a vector cast, not a memcpy: GCC took the copy through the stack in 16- and 8-byte
      // pieces, and read them back as whole registers (store-forwarding stalls: the pack
      // was a third of a decode step's attention on Zen 3)
      for (int64_t j = 0; j < 8; ++j)
        r[j] = q * 8 + j < n ? (__m256)KV::load8(kh + slots[q * 8 + j] * stride + c)
                             : _mm256_setzero_ps();
      transpose8(r);
      for (int64_t p = 0; p < 8; ++p) _mm256_store_ps(kt + (c + p) * kKeys + q * 8, r[p]);
    }
  }
#endif
}

// S [RT][kKeys] = the tile's rows q[0:RT) times K^T, scaled.
template <int RT>
void tile_scores(const float* const* q, const float* kt, int64_t d, float scale,
                 float (*s)[kKeys]) {
  constexpr int kSV = vecs<RT>();
  for (int x0 = 0; x0 < kKeys / kW; x0 += kSV) {  // kSV vectors of keys per pass
    vec a[RT][kSV] = {};
    for (int64_t c = 0; c < d; ++c) {
      vec k[kSV];
      for (int x = 0; x < kSV; ++x) k[x] = loadv<F32>(kt + c * kKeys + kW * (x0 + x));
      for (int r = 0; r < RT; ++r) {
        const float qc = q[r][c];
        for (int x = 0; x < kSV; ++x) a[r][x] += qc * k[x];
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int x = 0; x < kSV; ++x) {
        const vec y = a[r][x] * scale;
        std::memcpy(s[r] + kW * (x0 + x), &y, sizeof y);
      }
  }
}

// acc [RT][d] = acc * alpha + P V over keys [j0, j1) of the block, NC vectors of d from
// column c0 (V rows in place at slots).
template <class KV, int RT, int NC>
void tile_values(const float (*p)[kKeys], const float* alpha, const typename KV::S* vh,
                 const int64_t* slots, int64_t j0, int64_t j1, int64_t stride, int64_t d,
                 int64_t c0, float* acc) {
  vec o[RT][NC];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < NC; ++c) o[r][c] = loadv<F32>(acc + r * d + c0 + kW * c) * alpha[r];
  for (int64_t j = j0; j < j1; ++j) {
    const typename KV::S* vp = vh + slots[j] * stride + c0;
    vec v[NC];
    for (int c = 0; c < NC; ++c) v[c] = loadv<KV>(vp + kW * c);
    for (int r = 0; r < RT; ++r)
      for (int c = 0; c < NC; ++c) o[r][c] += p[r][j] * v[c];
  }
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < NC; ++c) std::memcpy(acc + r * d + c0 + kW * c, &o[r][c], sizeof(vec));
}

// One tile over one block: rows r0 + [0, RT) of the head (states m, l, acc), the block
// starting at key b0 with n keys.
template <class KV, int DC, int RT>
void tile_block(const Task<KV>& t, const float* const* q, const float* kt,
                const typename KV::S* vh, const int64_t* slots, int64_t b0, int64_t n,
                int64_t r0, int64_t r_count, float* m, float* l, float* acc) {
  constexpr int64_t D = DC * 16;
  constexpr int kNC = vecs<RT>();
  alignas(64) float s[RT][kKeys];
  alignas(64) float alpha[RT];
  tile_scores<RT>(q, kt, D, t.scale, s);
  int64_t j0 = kKeys, j1 = 0;  // the keys some row of the tile sees
  for (int r = 0; r < RT; ++r) {
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
    tile_values<KV, RT, kNC>(s, alpha, vh, slots, j0, j1, stride, D, c0, acc);
  if constexpr (kW * kNC > 16)  // d = 64k + 32 leaves 32 (AVX-512), d = 32k + 16 16 (AVX2)
    if (c0 < D) tile_values<KV, RT, 2>(s, alpha, vh, slots, j0, j1, stride, D, c0, acc);
}

// A tile of rows [r0, r0 + rt) of the head, rt in [3, 6] picking the register tiling.
template <class KV, int DC>
void tile_any(int64_t rt, const Task<KV>& t, const float* const* q, const float* kt,
              const typename KV::S* vh, const int64_t* slots, int64_t b0, int64_t n,
              int64_t r0, int64_t r_count, float* m, float* l, float* acc) {
  switch (rt) {
    case 3: return tile_block<KV, DC, 3>(t, q, kt, vh, slots, b0, n, r0, r_count, m, l, acc);
    case 4: return tile_block<KV, DC, 4>(t, q, kt, vh, slots, b0, n, r0, r_count, m, l, acc);
    case 5: return tile_block<KV, DC, 5>(t, q, kt, vh, slots, b0, n, r0, r_count, m, l, acc);
    default: return tile_block<KV, DC, 6>(t, q, kt, vh, slots, b0, n, r0, r_count, m, l, acc);
  }
}

template <class KV, int DC>
void heads(const Task<KV>& t, int64_t h0, int64_t h1, float* o, float* lse) {
  constexpr int64_t D = DC * 16;
  const int64_t r_count = t.n_rows * t.grp;
  // tiles of at most 6 rows, as even as they divide (a decode step's group of 7 query heads
  // per KV head: 3 + 4, not 6 + 6 of which 5 padding), at least 3 (fewer rows: padded to 3)
  const int64_t tiles = (r_count + 5) / 6, padded = std::max<int64_t>(r_count, 3);
  const int64_t stride = t.hkv * D;
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
      // next: this head's next block, or after its last the next head's first (a decode
      // step's head has a few blocks: its first one waited on memory every time)
      const bool last = b0 + kKeys >= k1, next_head = last && h + 1 < h1;
      const int64_t* ahead = t.slots + (next_head ? k0 : b0 + kKeys);
      const int64_t n_ahead = next_head ? std::min(kKeys, k1 - k0)
                                        : std::clamp<int64_t>(k1 - b0 - kKeys, 0, kKeys);
      const int64_t step = next_head ? D : 0;
      pack_keys<KV>(kh, kh + step, t.slots + b0, n, stride, D, ahead, n_ahead, kt);
      for (int64_t tile = 0; tile < tiles; ++tile) {
        prefetch_share<KV>(vh + step, ahead, n_ahead, tile, tiles, stride, D);
        const int64_t r0 = tile * r_count / tiles, r1 = (tile + 1) * r_count / tiles;
        // rows' positions grow with r: the tile sees keys [lo(r0), hi(r1 - 1))
        if (t.hi(r1 - 1) <= b0 || t.lo(r0) >= b0 + n) continue;
        tile_any<KV, DC>(std::max<int64_t>(r1 - r0, 3), t, q + r0, kt, vh, t.slots + b0, b0, n,
                         r0, r_count, m + r0, l + r0, acc + r0 * D);
      }
    }
    for (int64_t r = 0; r < r_count; ++r)
      t.finish(t.head_of(h, r), m[r], l[r], acc + r * D, o, lse);
  }
}

}  // namespace

template <class KV, int DC>
void packed_task(const Task<KV>& t, int64_t h0, int64_t h1, float* o, float* lse) {
  if (t.n_rows * t.grp > 0) heads<KV, DC>(t, h0, h1, o, lse);
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
