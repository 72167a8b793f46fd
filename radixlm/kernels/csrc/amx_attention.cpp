// Attention on AMX-BF16 tiles: the path paged_attention takes for a bfloat16 q over a
// bfloat16 pool when a task has at least kAmxMinRows rows per head (extend chunks, shared
// prefix groups). Per (task, KV head):
//
//   1. pack: the head's rows of q into Q [R16, D] bf16 (R16: rows rounded up to 16, zeros
//      past R), and the keys it sees, in blocks of 32, into tiles: K as B of S = Q K^T
//      (tile (half, c): 16 pairs of d x 16 keys, each a u32 of two bf16: the VNNI layout)
//      and V as B of O = P V (tile t: 16 pairs of keys x 16 of d);
//   2. for each tile of 16 rows, for each block of 32 keys its rows see:
//        S [16, 32] fp32 = Q K^T           (D / 32 tile products per 16 keys)
//        online softmax per row (scale, soft cap, window / causal bounds; running max m,
//        sum l), probabilities rounded to bf16 into P [16, 32]
//        acc [16, D] = acc * alpha + P V   (one tile product per 16 of d)
//   3. o = acc / l, lse = m + log l.
//
// Tiles (all 16 rows x 64 bytes): 0 Q, 1 K, 2-3 S (two halves of 16 keys), 4 P, 5 V, 6 PV.
// Differences from the FMA path: q and the probabilities are rounded to bf16 before their
// products (sums in fp32), as torch's bf16 attention rounds them; the tests bound the
// result against float64 over the rounded inputs.
#include "amx_attention.h"

#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define RADIXLM_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kKeys = 64;  // keys per block: two P tiles of 32 (64 bytes a row)
constexpr int64_t kRows = 16;  // rows per tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Free {
  void operator()(void* p) const { std::free(p); }
};

// 64-byte aligned scratch (tile loads and stores of whole cache lines)
template <class T>
std::unique_ptr<T[], Free> scratch(int64_t n) {
  const size_t bytes = ((n * sizeof(T) + 63) / 64) * 64;
  return std::unique_ptr<T[], Free>(static_cast<T*>(std::aligned_alloc(64, bytes ? bytes : 64)));
}

}  // namespace

#ifdef RADIXLM_AMX

namespace {

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig c;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = 16;
  }
  _tile_loadconfig(&c);
}

// A block's K (keys slots[0:n), n <= kKeys; the rest zero) as the B tiles of S = Q K^T:
// tile (quarter, c), 16 keys by 32 of d, row p column j = the u32 (K[key][c*32 + 2p],
// K[key][c*32 + 2p + 1]) of key quarter*16 + j: the keys' rows read as u32, transposed.
void pack_k(const uint16_t* kh, const int64_t* slots, int64_t n, int64_t stride, int64_t d,
            uint32_t* out) {
  const int64_t chunks = d / 32;
  if (n < kKeys) std::memset(out, 0, kKeys / 16 * chunks * 256 * sizeof(uint32_t));
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(kh + slots[j] * stride);
    uint32_t* col = out + (j / 16) * chunks * 256 + j % 16;
    for (int64_t p = 0; p < d / 2; ++p) col[(p / 16) * 256 + (p % 16) * 16] = row[p];
  }
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

// One KV head of a task: its rows over the keys [k0, k1) the rows see.
void amx_head(const Task<BF16>& t, int64_t h, float* o, float* lse) {
  const int64_t d = t.d, r_count = t.n_rows * t.grp, stride = t.hkv * d;
  if (r_count == 0) return;
  const int64_t k0 = t.lo(0), k1 = std::min(t.n_keys, t.hi(r_count - 1));
  const int64_t blocks = std::max<int64_t>(0, (k1 - k0 + kKeys - 1) / kKeys);
  const int64_t chunks = d / 32, cols = d / 16, tiles = (r_count + kRows - 1) / kRows;
  const int64_t k_block = kKeys / 16 * chunks * 256, v_block = kKeys / 32 * cols * 256;
  auto qb = scratch<uint16_t>(tiles * kRows * d);
  auto kp = scratch<uint32_t>(blocks * k_block);
  auto vp = scratch<uint32_t>(blocks * v_block);
  std::memset(qb.get(), 0, tiles * kRows * d * sizeof(uint16_t));
  auto head_of = [&](int64_t r) { return t.rows[r / t.grp] * t.hq + h * t.grp + r % t.grp; };
  for (int64_t r = 0; r < r_count; ++r)
    std::memcpy(qb.get() + r * d, t.q16 + head_of(r) * d, d * sizeof(uint16_t));
  const uint16_t* kh = t.k + h * d;
  const uint16_t* vh = t.v + h * d;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t n = std::min(kKeys, k1 - k0 - b * kKeys);
    const int64_t* slots = t.slots + k0 + b * kKeys;
    pack_k(kh, slots, n, stride, d, kp.get() + b * k_block);
    pack_v(vh, slots, n, stride, d, vp.get() + b * v_block);
  }
  alignas(64) float s[kRows][kKeys];
  alignas(64) float pv[4][kRows][16];
  alignas(64) uint16_t p[kRows][kKeys];
  alignas(64) float m[kRows], l[kRows], alpha[kRows];
  int64_t lo[kRows], hi[kRows];
  auto acc = scratch<float>(kRows * d);
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t r0 = tile * kRows, nr = std::min(kRows, r_count - r0);
    std::fill(m, m + kRows, kNegInf);
    std::fill(l, l + kRows, 0.f);
    std::memset(acc.get(), 0, kRows * d * sizeof(float));
    if (t.lse_init != nullptr) {  // continue an earlier pass: m = its lse, l = 1, acc = o
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t head = head_of(r0 + r);
        if (t.lse_init[head] == kNegInf) continue;
        m[r] = t.lse_init[head];
        l[r] = 1.f;
        std::memcpy(acc.get() + r * d, t.o_init + head * d, d * sizeof(float));
      }
    }
    // the blocks some row of the tile sees (rows' positions grow with r)
    const int64_t first = std::max<int64_t>(0, (t.lo(r0) - k0) / kKeys);
    const int64_t last = std::min(blocks, (t.hi(r0 + nr - 1) - k0 + kKeys - 1) / kKeys);
    const uint16_t* qt = qb.get() + r0 * d;
    for (int64_t b = first; b < last; ++b) {
      const int64_t kb = k0 + b * kKeys;
      for (int64_t r = 0; r < kRows; ++r) {
        lo[r] = r < nr ? std::clamp<int64_t>(t.lo(r0 + r) - kb, 0, kKeys) : 0;
        hi[r] = r < nr ? std::clamp<int64_t>(std::min(t.hi(r0 + r), k1) - kb, 0, kKeys) : 0;
      }
      // S = Q K^T: four tiles of 16 keys
      const uint32_t* kt = kp.get() + b * k_block;
      _tile_zero(2);
      _tile_zero(3);
      _tile_zero(4);
      _tile_zero(5);
      for (int64_t c = 0; c < chunks; ++c) {
        _tile_loadd(0, qt + c * 32, d * sizeof(uint16_t));
        _tile_loadd(1, kt + (0 * chunks + c) * 256, 64);
        _tile_dpbf16ps(2, 0, 1);
        _tile_loadd(1, kt + (1 * chunks + c) * 256, 64);
        _tile_dpbf16ps(3, 0, 1);
        _tile_loadd(1, kt + (2 * chunks + c) * 256, 64);
        _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(1, kt + (3 * chunks + c) * 256, 64);
        _tile_dpbf16ps(5, 0, 1);
      }
      _tile_stored(2, &s[0][0], kKeys * sizeof(float));
      _tile_stored(3, &s[0][16], kKeys * sizeof(float));
      _tile_stored(4, &s[0][32], kKeys * sizeof(float));
      _tile_stored(5, &s[0][48], kKeys * sizeof(float));
      softmax_block(s, lo, hi, t.scale, t.cap, m, l, alpha, p);
      // P V: P as two tiles of 32 keys (6, 7), four columns of 16 at a time (0, 2, 3, 4)
      _tile_loadd(6, &p[0][0], kKeys * sizeof(uint16_t));
      _tile_loadd(7, &p[0][32], kKeys * sizeof(uint16_t));
      const uint32_t* vt = vp.get() + b * v_block;
      for (int64_t c0 = 0; c0 < cols; c0 += 4) {
        const int64_t nc = std::min<int64_t>(4, cols - c0);
        _tile_zero(0);
        _tile_zero(2);
        _tile_zero(3);
        _tile_zero(4);
        // V block layout: [half of 32 keys][column][16 pairs][16 of d]
        const uint32_t* v0 = vt + c0 * 256;
        const uint32_t* v1 = vt + (cols + c0) * 256;
        _tile_loadd(1, v0, 64);
        _tile_dpbf16ps(0, 6, 1);
        _tile_loadd(1, v1, 64);
        _tile_dpbf16ps(0, 7, 1);
        if (nc > 1) {
          _tile_loadd(1, v0 + 256, 64);
          _tile_dpbf16ps(2, 6, 1);
          _tile_loadd(1, v1 + 256, 64);
          _tile_dpbf16ps(2, 7, 1);
        }
        if (nc > 2) {
          _tile_loadd(1, v0 + 512, 64);
          _tile_dpbf16ps(3, 6, 1);
          _tile_loadd(1, v1 + 512, 64);
          _tile_dpbf16ps(3, 7, 1);
          _tile_loadd(1, v0 + 768, 64);
          _tile_dpbf16ps(4, 6, 1);
          _tile_loadd(1, v1 + 768, 64);
          _tile_dpbf16ps(4, 7, 1);
        }
        _tile_stored(0, &pv[0][0][0], 64);
        if (nc > 1) _tile_stored(2, &pv[1][0][0], 64);
        if (nc > 2) {
          _tile_stored(3, &pv[2][0][0], 64);
          _tile_stored(4, &pv[3][0][0], 64);
        }
        for (int64_t r = 0; r < nr; ++r) {
          const __m512 ar = _mm512_set1_ps(alpha[r]);
          for (int64_t c = 0; c < nc; ++c) {
            float* a = acc.get() + r * d + (c0 + c) * 16;
            _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_loadu_ps(a), ar, _mm512_load_ps(pv[c][r])));
          }
        }
      }
    }
    for (int64_t r = 0; r < nr; ++r) {
      if (!(l[r] > 0.f)) continue;  // no key seen: the row keeps its initial o and lse
      const int64_t head = head_of(r0 + r);
      const float inv = 1.f / l[r];
      for (int64_t i = 0; i < d; ++i) o[head * d + i] = acc[r * d + i] * inv;
      lse[head] = m[r] + std::log(l[r]);
    }
  }
}

}  // namespace

bool amx_ready() {
  // Linux hands out the tiles' state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
  // XTILEDATA), once per process
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

void amx_task(const Task<BF16>& t, int64_t h0, int64_t h1, float* o, float* lse) {
  configure_tiles();
  for (int64_t h = h0; h < h1; ++h) amx_head(t, h, o, lse);
  _tile_release();
}

#else  // no AMX-BF16 in this build: paged_attention never calls amx_task

bool amx_ready() { return false; }

void amx_task(const Task<BF16>&, int64_t, int64_t, float*, float*) { std::abort(); }

#endif
