// A bfloat16 linear layer, y = x W^T (+ bias), on AMX-BF16 tiles (or, on a CPU without
// AMX, AVX512-BF16 dot products over the same packing), for the few-row products of decode
// steps, where oneDNN's kernels read the weights at half the memory bandwidth
// one core has (a decode step's linears read every weight once, so their time is the
// weights' bytes over the bandwidth they reach).
//
//   amx_pack_linear(w [N, K] bf16) -> packed   the weight in tile order, once per layer
//   amx_linear(x [M, K] bf16, packed, N, bias [N] bf16/fp32 or None) -> y [M, N] bf16
//
// packed: the columns of y in pairs of 16-column blocks (N rounded up to 32, K to 32, zeros
// past them); pair p, K block kb (32 of K), block t (0, 1) is one B tile: 16 rows (pairs of
// K) x 16 columns x 2 (the VNNI layout),
//   packed[p][kb][t][r][2c + i] = w[32p + 16t + c][32kb + 2r + i]
// where the CPU has AMX (packed where it runs); without, the two blocks' rows alternate,
//   packed[p][kb][r][t][2c + i] (the same values, one forward stream per pair).
// A pair's tiles for all of K are contiguous (K / 32 x 2 KiB), so a thread reads its pairs
// as one forward stream, which the hardware prefetcher follows.
//
// Per pair, per chunk of 32 rows of x: C [32, 32] fp32 in four tiles (rows 0-15 / 16-31 x
// columns 0-15 / 16-31) = sum over K blocks of A (two tiles of x) times B (the pair's two
// tiles): 2 + 2 loads per 4 tile products. The pair's tiles come from memory for the first
// chunk and from L2 for the rest. Sums in fp32; y rounded to bf16 (to nearest even) after
// the bias is added in fp32. x's rows are copied into a zero-padded buffer (M to 16, K to
// 32) first when they are not already in that shape. Threads split the pairs.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "amx_attention.h"
#include "amx_tiles.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPair = 32;   // columns of y per pair of B tiles
constexpr int64_t kKBlock = 32;  // K per tile product (16 pairs)
constexpr int64_t kChunk = 32;   // rows of x per C block (two A tiles)

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16
                  && weight.device().is_cpu(),
              "amx_pack_linear: w must be a 2-D bfloat16 CPU tensor");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t np = round_up(n, kPair), kp = round_up(k, kKBlock), kb_count = kp / kKBlock;
  at::Tensor packed = at::zeros({np * kp}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  // AMX: block t's 16 rows contiguous (a tile, rows 64 bytes apart); AVX512-BF16 alone: the
  // two blocks' row r side by side (128 bytes), so a pair is read as one forward stream
  const bool tiles = amx_ready();
  at::parallel_for(0, np / kPair, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t kb = 0; kb < kb_count; ++kb)
        for (int64_t t = 0; t < 2; ++t) {
          uint16_t* block = dst + (p * kb_count + kb) * 2 * 16 * 32;
          for (int64_t c = 0; c < 16; ++c) {
            const int64_t col = p * kPair + t * 16 + c;
            if (col >= n) continue;
            for (int64_t r = 0; r < 16; ++r)
              for (int64_t i = 0; i < 2; ++i) {
                const int64_t kk = kb * kKBlock + 2 * r + i;
                const int64_t at = tiles ? (t * 16 + r) * 32 : (r * 2 + t) * 32;
                if (kk < k) block[at + 2 * c + i] = src[col * k + kk];
              }
          }
        }
  });
  return packed;
}

#if defined(__AVX512BF16__)

// C [rows, 32] fp32 (row stride 32) + bias -> y's rows (columns [col0, col0 + cols)).
void write_rows(const float* c, int64_t rows, const float* bias, uint16_t* y, int64_t ldy,
                int64_t col0, int64_t cols) {
  const __mmask16 lo = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 hi = cols >= 32 ? 0xFFFF
                       : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias != nullptr) {
    b0 = _mm512_maskz_loadu_ps(lo, bias + col0);
    b1 = _mm512_maskz_loadu_ps(hi, bias + col0 + 16);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v0 = _mm512_add_ps(_mm512_load_ps(c + r * 32), b0);
    const __m512 v1 = _mm512_add_ps(_mm512_load_ps(c + r * 32 + 16), b1);
    uint16_t* out = y + r * ldy + col0;
    _mm256_mask_storeu_epi16(out, lo, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v0)));
    _mm256_mask_storeu_epi16(out + 16, hi, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v1)));
  }
}

// Without AMX (AVX512-BF16 alone, e.g. AMD Zen 4): the pair's K block read 128 bytes at a
// time, row r of both blocks (each 16 columns x one pair of K: one vector), so per row of x
// one VDPBF16PS per block with the pair x[m][32kb + 2r, +1] broadcast adds two products to
// each of the 16 columns. R rows of x x 32 columns live in 2R accumulators; the first block
// of rows reads the pair from memory as one forward stream (the hardware prefetcher keeps
// ahead of it: software prefetches, as the tiles use, made no difference), the rest from L2.
constexpr int64_t kDotRows = 12;  // rows of x per register block: 24 accumulators

template <int R>
void dot_block(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t kb_count, float* c) {
  __m512 acc[R][2];
  for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    const uint16_t* bt = b + kb * 2 * 16 * 32;
    const uint16_t* ak = a + kb * kKBlock;
    for (int r = 0; r < 16; ++r) {
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bt + r * 64);
      const __m512bh b1 = (__m512bh)_mm512_loadu_si512(bt + r * 64 + 32);
      for (int m = 0; m < R; ++m) {
        const __m512bh av = radixlm_amx::bf16_pair(ak + m * lda + 2 * r);
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], av, b0);
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], av, b1);
      }
    }
  }
  for (int m = 0; m < R; ++m) {
    _mm512_store_ps(c + m * 32, acc[m][0]);
    _mm512_store_ps(c + m * 32 + 16, acc[m][1]);
  }
}

// Rows [r, m) of x times pair b in blocks of R (the last block smaller) -> y's rows.
template <int R>
void dot_rows(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t kb_count, int64_t r,
              int64_t m, const float* bias, uint16_t* y, int64_t ldy, int64_t col0,
              int64_t cols, float* c) {
  for (; r + R <= m; r += R) {
    dot_block<R>(a + r * lda, lda, b, kb_count, c);
    write_rows(c, R, bias, y + r * ldy, ldy, col0, cols);
  }
  if constexpr (R > 1) {
    if (r < m) dot_rows<R - 1>(a, lda, b, kb_count, r, m, bias, y, ldy, col0, cols, c);
  }
}

void dot_pairs(const uint16_t* a, int64_t m, int64_t kp, const uint16_t* packed,
               const float* bias, uint16_t* y, int64_t n, int64_t p0, int64_t p1) {
  alignas(64) float c[kDotRows * 32];
  const int64_t kb_count = kp / kKBlock;
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* b = packed + p * kb_count * 2 * 16 * 32;
    const int64_t col0 = p * kPair, cols = std::min<int64_t>(kPair, n - col0);
    dot_rows<kDotRows>(a, kp, b, kb_count, 0, m, bias, y, n, col0, cols, c);
  }
}

#endif

#ifdef RADIXLM_AMX

using radixlm_amx::configure_tiles;

// The weights' bytes kAhead bytes past a pair's K block (2 KiB), into L1: a decode step
// reads each weight once, so without this every tile load waits on memory (32 rows, one
// thread: 5.3 GB/s without, 6.3 with).
constexpr int64_t kAhead = 8192;
inline void prefetch_ahead(const uint16_t* bt) {
  const char* p = reinterpret_cast<const char*>(bt) + kAhead;
  for (int i = 0; i < 2048; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}

// C [16 * A, 32] = one chunk of x's rows (A tiles of 16 from a0) times a pair's tiles:
// C tiles 4 5 (rows 0-15) and 6 7 (rows 16-31). first: the chunk that reads the pair from
// memory, prefetching ahead.
template <int A>
void chunk(const uint16_t* a0, int64_t lda, const uint16_t* b, int64_t kb_count, bool first,
           float* c) {
  _tile_zero(4);
  _tile_zero(5);
  if constexpr (A == 2) {
    _tile_zero(6);
    _tile_zero(7);
  }
  const int64_t row16 = 16 * lda / 2;  // elements from row 0 to row 16 of x
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    const uint16_t* bt = b + kb * 2 * 16 * 32;
    if (first) prefetch_ahead(bt);
    _tile_loadd(0, a0 + kb * kKBlock, lda);
    _tile_loadd(2, bt, 64);
    _tile_loadd(3, bt + 16 * 32, 64);
    _tile_dpbf16ps(4, 0, 2);
    if constexpr (A == 2) _tile_loadd(1, a0 + row16 + kb * kKBlock, lda);
    _tile_dpbf16ps(5, 0, 3);
    if constexpr (A == 2) {
      _tile_dpbf16ps(6, 1, 2);
      _tile_dpbf16ps(7, 1, 3);
    }
  }
  _tile_stored(4, c, 128);
  _tile_stored(5, c + 16, 128);
  if constexpr (A == 2) {
    _tile_stored(6, c + 16 * 32, 128);
    _tile_stored(7, c + 16 * 32 + 16, 128);
  }
}

// Pairs [p0, p1): every chunk of x's rows times each pair's tiles.
void run_pairs(const uint16_t* a, int64_t mp, int64_t kp, const uint16_t* packed,
               const float* bias, uint16_t* y, int64_t m, int64_t n, int64_t p0, int64_t p1) {
  configure_tiles();
  alignas(64) float c[kChunk * 32];
  const int64_t kb_count = kp / kKBlock, lda = kp * 2;
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* b = packed + p * kb_count * 2 * 16 * 32;
    const int64_t col0 = p * kPair, cols = std::min<int64_t>(kPair, n - col0);
    for (int64_t r0 = 0; r0 < mp; r0 += kChunk) {
      if (r0 + 16 < mp)
        chunk<2>(a + r0 * kp, lda, b, kb_count, r0 == 0, c);
      else  // the last 16 rows
        chunk<1>(a + r0 * kp, lda, b, kb_count, r0 == 0, c);
      write_rows(c, std::min<int64_t>(kChunk, m - r0), bias, y + r0 * n, n, col0, cols);
    }
  }
  _tile_release();
}

#endif

// This build and CPU can run amx_linear: AMX tiles, or AVX512-BF16 dot products without.
bool linear_ready() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "amx_linear: x must be a 2-D bfloat16 CPU tensor");
  TORCH_CHECK(linear_ready(), "amx_linear: this build or CPU has neither AMX-BF16 nor AVX512-BF16");
  const int64_t m = x.size(0), k = x.size(1);
  const bool tiles = amx_ready();  // else AVX512-BF16 dot products: no rows of padding
  const int64_t np = round_up(n, kPair), kp = round_up(k, kKBlock);
  const int64_t mp = tiles ? round_up(m, 16) : m;
  TORCH_CHECK(n > 0 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous()
                  && packed.numel() == np * kp,
              "amx_linear: packed is not amx_pack_linear's packing of an [", n, ", ", k,
              "] weight");
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "amx_linear: bias must be [N]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  at::Tensor a = x;
  if (mp != m || kp != k || !x.is_contiguous()) {
    // rows copied and zero-padded here: torch's zeros + narrow().copy_() took ~40 us,
    // more than a 768 x 768 product's share of a decode step
    a = at::empty({mp, kp}, x.options());
    uint16_t* dst = reinterpret_cast<uint16_t*>(a.data_ptr());
    const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr());
    if (x.stride(1) == 1) {
      for (int64_t r = 0; r < m; ++r) {
        std::memcpy(dst + r * kp, src + r * x.stride(0), k * sizeof(uint16_t));
        std::memset(dst + r * kp + k, 0, (kp - k) * sizeof(uint16_t));
      }
      std::memset(dst + m * kp, 0, (mp - m) * kp * sizeof(uint16_t));
    } else {
      a.zero_();
      a.narrow(0, 0, m).narrow(1, 0, k).copy_(x);
    }
  }
#if defined(__AVX512BF16__)
  const uint16_t* ap = reinterpret_cast<const uint16_t*>(a.data_ptr());
  const uint16_t* bp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const float* biasp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, np / kPair, 1, [&](int64_t p0, int64_t p1) {
#ifdef RADIXLM_AMX
    if (tiles) return run_pairs(ap, mp, kp, bp, biasp, yp, m, n, p0, p1);
#endif
    dot_pairs(ap, m, kp, bp, biasp, yp, n, p0, p1);
  });
#else
  (void)tiles;
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixlm_cpu, m) {
  m.def("amx_pack_linear(Tensor w) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("amx_linear_ready() -> bool", &linear_ready);  // no tensors: a catch-all kernel
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) {
  m.impl("amx_pack_linear", &pack);
  m.impl("amx_linear", &linear);
}
