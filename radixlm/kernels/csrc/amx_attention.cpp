// Attention on AMX-BF16 tiles: the path paged_attention takes for a bfloat16 q over a
// bfloat16 pool when a task has at least kAmxMinRows rows per head (extend chunks, shared
// prefix groups). Per (task, KV head):
//
//   1. pack: the head's rows of q into Q [R16, D] bf16 (R16: rows rounded up to 16, zeros
//      past R), and the keys it sees, in blocks of kKeys (64), into tiles: K as B of
//      S = Q K^T (tile (quarter, c): 16 pairs of d x 16 keys, each a u32 of two bf16: the
//      VNNI layout) and V as B of O = P V (tile (half, t): 16 pairs of keys x 16 of d),
//      each block when a tile first reaches it, the next block's rows fetched meanwhile;
//   2. for each tile of 16 rows, for each block its rows see:
//        S [16, 64] fp32 = Q K^T           (D / 32 tile products per 16 keys)
//        online softmax per row (scale, soft cap, window / causal bounds; running max m,
//        sum l), probabilities rounded to bf16 into P [16, 64]
//        acc [16, D] = acc * alpha + P V   (two tile products per 16 of d)
//   3. o = acc / l, lse = m + log l.
//
// Tiles (all 16 rows x 64 bytes): S phase 0/7 Q, 1/6 K, 2-5 S (16 keys each); P V phase
// 6-7 P (32 keys each), 1/5 V, 0/2/3/4 the products (16 of d each). Consecutive tile
// operations use other tiles where they can, so loads overlap products.
// Without AMX (AVX512-BF16 alone: AMD Zen 4) the same packing and steps, the two products
// on VDPBF16PS (scores_direct, values_direct), for tasks of at least kDirectMinRows rows
// per head and kDirectMinKeys keys.
// Differences from the FMA path: q and the probabilities are rounded to bf16 before their
// products (sums in fp32), as torch's bf16 attention rounds them; the tests bound the
// result against float64 over the rounded inputs.
#include "amx_attention.h"
#include "amx_tiles.h"
#include "scratch.h"
#include "transpose16.h"

#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>

#ifdef RADIXLM_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kKeys = 64;  // keys per block: two P tiles of 32 (64 bytes a row)
constexpr int64_t kRows = 16;  // rows per tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

}  // namespace

#ifdef RADIXLM_TILES

namespace {

#ifdef RADIXLM_AMX
using radixlm_amx::configure_tiles;
#endif

// A block's K (keys slots[0:n), n <= kKeys; the rest zero) as the B tiles of S = Q K^T:
// tile (quarter, c), 16 keys by 32 of d, row p column j = the u32 (K[key][c*32 + 2p],
// K[key][c*32 + 2p + 1]) of key quarter*16 + j: the keys' rows read as u32, transposed
// 16 x 16 at a time. The next quarter's rows are prefetched meanwhile (scattered slots).
void pack_k(const uint16_t* kh, const int64_t* slots, int64_t n, int64_t stride, int64_t d,
            uint32_t* out) {
  const int64_t chunks = d / 32;
  __m512i r[16], tr[16];
  for (int64_t q = 0; q * 16 < n; ++q) {
    for (int64_t j = q * 16 + 16; j < std::min(n, q * 16 + 32); ++j)
      for (int64_t c = 0; c < d; c += 32) __builtin_prefetch(kh + slots[j] * stride + c);
    for (int64_t c = 0; c < chunks; ++c) {
      for (int64_t j = 0; j < 16; ++j)
        r[j] = q * 16 + j < n ? _mm512_loadu_si512(kh + slots[q * 16 + j] * stride + c * 32)
                              : _mm512_setzero_si512();
      transpose16(r, tr);
      uint32_t* t = out + (q * chunks + c) * 256;
      for (int64_t p = 0; p < 16; ++p) _mm512_store_si512(t + p * 16, tr[p]);
    }
  }
  // quarters with no key at all: zero tiles
  const int64_t full = (n + 15) / 16;
  if (full < kKeys / 16)
    std::memset(out + full * chunks * 256, 0, (kKeys / 16 - full) * chunks * 256 * 4);
}

// A block's V as the B tiles of P V: tile (half, t), 32 keys by 16 of d, row p column i =
// the u32 (V[2p][t*16 + i], V[2p + 1][t*16 + i]) of the half's keys (keys past n: zero,
// so their zero probabilities multiply zeros, never a stale NaN).
void pack_v(const uint16_t* vh, const int64_t* slots, int64_t n, int64_t stride, int64_t d,
            uint32_t* out) {
  const __m512i zero = _mm512_setzero_si512();
  const int64_t cols = d / 16;
  for (int64_t pair = 0; pair < kKeys / 2; ++pair) {
    const uint16_t* a = 2 * pair < n ? vh + slots[2 * pair] * stride : nullptr;
    const uint16_t* b = 2 * pair + 1 < n ? vh + slots[2 * pair + 1] * stride : nullptr;
    uint32_t* row = out + (pair / 16) * cols * 256 + (pair % 16) * 16;
    for (int64_t t = 0; t < cols; ++t) {
      const __m512i lo = a ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                 reinterpret_cast<const __m256i*>(a + t * 16)))
                           : zero;
      const __m512i hi = b ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                                   reinterpret_cast<const __m256i*>(b + t * 16))),
                                               16)
                           : zero;
      _mm512_store_si512(row + t * 256, _mm512_or_si512(lo, hi));
    }
  }
}

// exp(x) for x <= 0, 16 lanes: exp_neg's reduction and polynomial (vec_math.h) in
// AVX-512, 2^n by scalef. Lanes below -87 give about 2^-126, not 0: callers mask them.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// The online-softmax step of a tile's rows over one block: s [16][kKeys] scores in,
// probabilities out as bf16 in p (zero where a row does not see the key: outside
// [lo[r], hi[r]), block-relative); m, l per row updated; alpha[r] the factor that row's
// accumulator is scaled by. Rows with lo >= hi (past the tile's last row, or seeing no key
// of the block) get zero probabilities and alpha 1 (0 while they have seen nothing).
void softmax_block(float (*s)[kKeys], const int64_t* lo, const int64_t* hi, float scale,
                   float cap, float* m, float* l, float* alpha, uint16_t (*p)[kKeys]) {
  constexpr int V = kKeys / 16;
  alignas(64) float delta[kRows], sum[kRows];
  for (int64_t r = 0; r < kRows; ++r) {
    if (cap > 0.f && lo[r] < hi[r]) {
      for (int64_t j = 0; j < kKeys; ++j) s[r][j] *= scale;
      soft_cap(s[r], kKeys, cap);
    }
    const float sc = cap > 0.f ? 1.f : scale;
    // the keys [lo, hi) as a bit mask
    const uint64_t bits = lo[r] >= hi[r] ? 0
        : (hi[r] >= 64 ? ~0ull : (1ull << hi[r]) - 1) & ~((1ull << lo[r]) - 1);
    __m512 x[V];
    __m512 mx = _mm512_set1_ps(kNegInf);
    for (int c = 0; c < V; ++c) {
      const __mmask16 k = static_cast<__mmask16>(bits >> (16 * c));
      x[c] = _mm512_mask_mul_ps(_mm512_set1_ps(kNegInf), k, _mm512_load_ps(s[r] + 16 * c),
                                _mm512_set1_ps(sc));
      mx = _mm512_max_ps(mx, x[c]);
    }
    const float nm = std::max(m[r], _mm512_reduce_max_ps(mx));
    if (nm == kNegInf) {  // nothing seen yet: the row stays empty
      std::memset(p[r], 0, sizeof p[r]);
      delta[r] = 0.f;
      sum[r] = 0.f;
      continue;
    }
    __m512 total = _mm512_setzero_ps();
    for (int c = 0; c < V; c += 2) {
      const __mmask16 k0 = static_cast<__mmask16>(bits >> (16 * c));
      const __mmask16 k1 = static_cast<__mmask16>(bits >> (16 * c + 16));
      const __m512 e0 = _mm512_maskz_mov_ps(k0, exp16(_mm512_sub_ps(x[c], _mm512_set1_ps(nm))));
      const __m512 e1 =
          _mm512_maskz_mov_ps(k1, exp16(_mm512_sub_ps(x[c + 1], _mm512_set1_ps(nm))));
      total = _mm512_add_ps(total, _mm512_add_ps(e0, e1));
      const __m512bh b = _mm512_cvtne2ps_pbh(e1, e0);
      _mm512_store_si512(p[r] + 16 * c, reinterpret_cast<const __m512i&>(b));
    }
    sum[r] = _mm512_reduce_add_ps(total);
    delta[r] = m[r] == kNegInf ? kNegInf : m[r] - nm;
    m[r] = nm;
  }
  const __m512 d = _mm512_load_ps(delta);
  const __m512 a = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(kNegInf),
                                                          _CMP_NEQ_OQ), exp16(d));
  _mm512_storeu_ps(alpha, a);
  _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), a, _mm512_load_ps(sum)));
}

#ifndef RADIXLM_AMX
// Without AMX (AVX512-BF16 alone: AMD Zen 4) the two products of a block run on VDPBF16PS
// directly, over the same packed tiles: emulating each tile op would load and store its
// accumulator around every 16 x 16 x 32 product and broadcast one pair of A per
// multiply; here 4 rows x 4 columns of 16 stay in registers for the whole product (half a
// load per VDPBF16PS). A tile's rows go in fours up to its last row, nr (the rows past it
// have zero probabilities and their results are not kept).

using radixlm_amx::bf16_pair;

// S [16][kKeys] = Q K^T over the block's packed K (pack_k's tiles: (quarter, chunk), 16
// pairs of d x 16 keys): rows [0, nr) rounded up to 4.
void scores_direct(const uint16_t* q, int64_t d, const uint32_t* kt, int64_t nr,
                   float (*s)[kKeys]) {
  const int64_t chunks = d / 32;
  for (int64_t r0 = 0; r0 < nr; r0 += 4) {
    __m512 acc[4][4];
    for (auto& row : acc)
      for (auto& x : row) x = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t p = 0; p < 16; ++p) {
        __m512bh k[4];
        for (int64_t j = 0; j < 4; ++j)
          k[j] = (__m512bh)_mm512_load_si512(kt + (j * chunks + c) * 256 + p * 16);
        for (int64_t r = 0; r < 4; ++r) {
          const __m512bh a = bf16_pair(q + (r0 + r) * d + c * 32 + 2 * p);
          for (int64_t j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, k[j]);
        }
      }
    for (int64_t r = 0; r < 4; ++r)
      for (int64_t j = 0; j < 4; ++j) _mm512_store_ps(s[r0 + r] + 16 * j, acc[r][j]);
  }
}

// acc [nr][d] = acc * alpha + P V for NC columns of 16 of d from c0, over the block's
// packed V (pack_v's tiles: [half][column][16 pairs of keys][16 of d]).
template <int NC>
void values_columns(const uint16_t (*p)[kKeys], const uint32_t* vt, int64_t cols, int64_t c0,
                    const float* alpha, float* acc, int64_t d, int64_t nr) {
  for (int64_t r0 = 0; r0 < nr; r0 += 4) {
    const int64_t rn = std::min<int64_t>(4, nr - r0);
    __m512 o[4][NC];
    for (int64_t r = 0; r < 4; ++r) {
      const __m512 ar = _mm512_set1_ps(alpha[r0 + r]);
      for (int64_t c = 0; c < NC; ++c)
        o[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + r) * d + (c0 + c) * 16), ar);
    }
    for (int64_t pair = 0; pair < kKeys / 2; ++pair) {
      const uint32_t* vrow = vt + ((pair / 16) * cols + c0) * 256 + (pair % 16) * 16;
      __m512bh v[NC];
      for (int64_t c = 0; c < NC; ++c) v[c] = (__m512bh)_mm512_load_si512(vrow + c * 256);
      for (int64_t r = 0; r < 4; ++r) {
        const __m512bh a = bf16_pair(&p[r0 + r][2 * pair]);
        for (int64_t c = 0; c < NC; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], a, v[c]);
      }
    }
    for (int64_t r = 0; r < rn; ++r)
      for (int64_t c = 0; c < NC; ++c)
        _mm512_storeu_ps(acc + (r0 + r) * d + (c0 + c) * 16, o[r][c]);
  }
}

void values_direct(const uint16_t (*p)[kKeys], const uint32_t* vt, int64_t d,
                   const float* alpha, float* acc, int64_t nr) {
  const int64_t cols = d / 16;  // even: d is a multiple of 32
  int64_t c0 = 0;
  for (; c0 + 4 <= cols; c0 += 4) values_columns<4>(p, vt, cols, c0, alpha, acc, d, nr);
  if (c0 < cols) values_columns<2>(p, vt, cols, c0, alpha, acc, d, nr);
}
#endif

// GCC's tile intrinsics take the tile's number as a literal (it is pasted into the
// instruction), so the two helpers below are macros.
//
// One chunk of 32 of d of S = Q K^T: the chunk's Q rows into tile QT, the four quarters'
// K tiles (k, k + step, ...) into tiles 1 and 6 in turn, so a load never waits for the
// product just issued, added into S tiles 2-5 (consecutive products: other accumulators).
#define SCORES_CHUNK(QT, q, ld, k, step) \
  do {                                   \
    TILE_LOADD(QT, q, ld);               \
    TILE_LOADD(1, k, 64);                \
    TILE_DPBF16PS(2, QT, 1);             \
    TILE_LOADD(6, (k) + (step), 64);     \
    TILE_DPBF16PS(3, QT, 6);             \
    TILE_LOADD(1, (k) + 2 * (step), 64); \
    TILE_DPBF16PS(4, QT, 1);             \
    TILE_LOADD(6, (k) + 3 * (step), 64); \
    TILE_DPBF16PS(5, QT, 6);             \
  } while (0)

// P V for one half of a block (P tile PT: 16 rows x 32 keys) and nc (2 or 4) columns of
// 16 of d: V tiles into 1 and 5 in turn, added into tiles 0, 2, 3, 4.
#define VALUES_HALF(PT, v, nc)      \
  do {                              \
    TILE_LOADD(1, v, 64);           \
    TILE_DPBF16PS(0, PT, 1);        \
    TILE_LOADD(5, (v) + 256, 64);   \
    TILE_DPBF16PS(2, PT, 5);        \
    if ((nc) > 2) {                 \
      TILE_LOADD(1, (v) + 512, 64); \
      TILE_DPBF16PS(3, PT, 1);      \
      TILE_LOADD(5, (v) + 768, 64); \
      TILE_DPBF16PS(4, PT, 5);      \
    }                               \
  } while (0)

// One KV head of a task: its rows over the keys [k0, k1) the rows see.
void amx_head(const Task<BF16>& t, int64_t h, float* o, float* lse) {
  const int64_t d = t.d, r_count = t.n_rows * t.grp, stride = t.hkv * d;
  if (r_count == 0) return;
  const int64_t k1 = std::min(t.n_keys, t.hi(r_count - 1));
  const int64_t k0 = t.grid_start(t.lo(0), kKeys), kend = t.grid_end(k1);
  const int64_t blocks = std::max<int64_t>(0, (k1 - k0 + kKeys - 1) / kKeys);
  const int64_t chunks = d / 32, cols = d / 16, tiles = (r_count + kRows - 1) / kRows;
  const int64_t k_block = kKeys / 16 * chunks * 256, v_block = kKeys / 32 * cols * 256;
  uint16_t* qb = scratch<uint16_t, 0>(tiles * kRows * d);
  uint32_t* kp = scratch<uint32_t, 1>(blocks * k_block);
  uint32_t* vp = scratch<uint32_t, 2>(blocks * v_block);
  std::memset(qb, 0, tiles * kRows * d * sizeof(uint16_t));
  for (int64_t r = 0; r < r_count; ++r)
    std::memcpy(qb + r * d, t.q16 + t.head_of(h, r) * d, d * sizeof(uint16_t));
  const uint16_t* kh = t.k + h * d;
  const uint16_t* vh = t.v + h * d;
  // Blocks are packed when a tile first needs them, in order, and each packing prefetches
  // the next block's K and V rows into L2: the rows' trip from memory (the pool's rows 512
  // bytes apart, evicted by the weights between layers) runs under this block's products
  // rather than before any of them (a decode step's shared-prefix groups in bf16, AMD Zen
  // 4: 12 layers' groups 4.4-5.7 ms -> 3.6-4.3 ms; docs/benchmarks.md).
  int64_t packed = 0;  // blocks [0, packed) are packed
  auto pack_upto = [&](int64_t last_b) {
    for (; packed <= last_b && packed < blocks; ++packed) {
      const int64_t b = packed;
      const int64_t* slots = t.slots + k0 + b * kKeys;
      const int64_t n = std::min(kKeys, kend - k0 - b * kKeys);
      pack_k(kh, slots, n, stride, d, kp + b * k_block);
      pack_v(vh, slots, n, stride, d, vp + b * v_block);
      const int64_t n1 = std::min(kKeys, kend - k0 - (b + 1) * kKeys);  // <= 0: the last
      for (int64_t j = 0; j < n1; ++j) {
        prefetch_row<BF16>(kh + slots[kKeys + j] * stride, d);
        prefetch_row<BF16>(vh + slots[kKeys + j] * stride, d);
      }
    }
  };
  alignas(64) float s[kRows][kKeys];
#ifdef RADIXLM_AMX
  alignas(64) float pv[4][kRows][16];
#endif
  alignas(64) uint16_t p[kRows][kKeys];
  alignas(64) float m[kRows], l[kRows], alpha[kRows];
  int64_t lo[kRows], hi[kRows], row_lo[kRows], row_hi[kRows];
  float* acc = scratch<float, 3>(kRows * d);
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t r0 = tile * kRows, nr = std::min(kRows, r_count - r0);
    std::fill(m, m + kRows, kNegInf);
    std::fill(l, l + kRows, 0.f);
    std::memset(acc, 0, kRows * d * sizeof(float));
    for (int64_t r = 0; r < nr; ++r) t.start(t.head_of(h, r0 + r), m[r], l[r], acc + r * d);
    // each row's keys [row_lo, row_hi), once per tile (t.lo / t.hi divide by the group)
    for (int64_t r = 0; r < kRows; ++r) {
      row_lo[r] = r < nr ? t.lo(r0 + r) : 0;
      row_hi[r] = r < nr ? std::min(t.hi(r0 + r), k1) : 0;
    }
    // the blocks some row of the tile sees (rows' positions grow with r)
    const int64_t first = std::max<int64_t>(0, (t.lo(r0) - k0) / kKeys);
    const int64_t last = std::min(blocks, (t.hi(r0 + nr - 1) - k0 + kKeys - 1) / kKeys);
    const uint16_t* qt = qb + r0 * d;
    for (int64_t b = first; b < last; ++b) {
      pack_upto(b);
      const int64_t kb = k0 + b * kKeys;
      for (int64_t r = 0; r < kRows; ++r) {
        lo[r] = std::clamp<int64_t>(row_lo[r] - kb, 0, kKeys);
        hi[r] = std::clamp<int64_t>(row_hi[r] - kb, 0, kKeys);
      }
      const uint32_t* kt = kp + b * k_block;
#ifdef RADIXLM_AMX
      // S = Q K^T: four tiles of 16 keys (2-5); chunks of d alternate their Q tile
      TILE_ZERO(2);
      TILE_ZERO(3);
      TILE_ZERO(4);
      TILE_ZERO(5);
      for (int64_t c = 0; c < chunks; ++c) {
        if (c % 2 == 0)
          SCORES_CHUNK(0, qt + c * 32, d * sizeof(uint16_t), kt + c * 256, chunks * 256);
        else
          SCORES_CHUNK(7, qt + c * 32, d * sizeof(uint16_t), kt + c * 256, chunks * 256);
      }
      TILE_STORED(2, &s[0][0], kKeys * sizeof(float));
      TILE_STORED(3, &s[0][16], kKeys * sizeof(float));
      TILE_STORED(4, &s[0][32], kKeys * sizeof(float));
      TILE_STORED(5, &s[0][48], kKeys * sizeof(float));
#else
      scores_direct(qt, d, kt, nr, s);
#endif
      softmax_block(s, lo, hi, t.scale, t.cap, m, l, alpha, p);
      const uint32_t* vt = vp + b * v_block;
#ifdef RADIXLM_AMX
      // P V: P as two tiles of 32 keys (6, 7), four columns of 16 at a time (0, 2, 3, 4)
      TILE_LOADD(6, &p[0][0], kKeys * sizeof(uint16_t));
      TILE_LOADD(7, &p[0][32], kKeys * sizeof(uint16_t));
      for (int64_t c0 = 0; c0 < cols; c0 += 4) {
        const int64_t nc = std::min<int64_t>(4, cols - c0);
        TILE_ZERO(0);
        TILE_ZERO(2);
        TILE_ZERO(3);
        TILE_ZERO(4);
        // V block layout: [half of 32 keys][column][16 pairs][16 of d]
        VALUES_HALF(6, vt + c0 * 256, nc);
        VALUES_HALF(7, vt + (cols + c0) * 256, nc);
        TILE_STORED(0, &pv[0][0][0], 64);
        if (nc > 1) TILE_STORED(2, &pv[1][0][0], 64);
        if (nc > 2) {  // columns come in pairs (d a multiple of 32): 2 or 4
          TILE_STORED(3, &pv[2][0][0], 64);
          TILE_STORED(4, &pv[3][0][0], 64);
        }
        for (int64_t r = 0; r < nr; ++r) {
          const __m512 ar = _mm512_set1_ps(alpha[r]);
          for (int64_t c = 0; c < nc; ++c) {
            float* a = acc + r * d + (c0 + c) * 16;
            _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_loadu_ps(a), ar, _mm512_load_ps(pv[c][r])));
          }
        }
      }
#else
      values_direct(p, vt, d, alpha, acc, nr);
#endif
    }
    for (int64_t r = 0; r < nr; ++r)
      t.finish(t.head_of(h, r0 + r), m[r], l[r], acc + r * d, o, lse);
  }
}

}  // namespace

#ifdef RADIXLM_AMX
bool amx_ready() {
  // Linux hands out the tiles' state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
  // XTILEDATA), once per process
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}
#else
bool amx_ready() { return false; }
#endif

bool tiles_ready() {
#ifdef RADIXLM_AMX
  return amx_ready();
#else
  return true;  // VDPBF16PS on the packed tiles: AVX512-BF16 alone
#endif
}

void amx_task(const Task<BF16>& t, int64_t h0, int64_t h1, float* o, float* lse) {
#ifdef RADIXLM_AMX
  configure_tiles();
#endif
  for (int64_t h = h0; h < h1; ++h) amx_head(t, h, o, lse);
#ifdef RADIXLM_AMX
  TILE_RELEASE();
#endif
}

#else  // neither AMX-BF16 nor AVX512-BF16 in this build: paged_attention never calls amx_task

bool amx_ready() { return false; }
bool tiles_ready() { return false; }

void amx_task(const Task<BF16>&, int64_t, int64_t, float*, float*) { std::abort(); }

#endif
