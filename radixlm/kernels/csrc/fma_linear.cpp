// A float32 linear layer, y = x W^T (+ bias), on FMAs: the float32 counterpart of
// amx_linear.cpp. On AVX-512 (AMD Zen 4) oneDNN's float32 kernels read the weights below
// the memory's rate at a few rows and multiply below the FMA units' at 16-32 (one thread,
// 32 rows of gate_up: 52 GFLOP/s, ~80 the peak measured there); this one holds an 8 x 48
// block of y in registers and streams the weights once (1.03-1.36x oneDNN at 1-32 rows).
// On AVX2 (AMD Zen 3) oneDNN's kernels reach ~60% of the FMA peak at 32 rows and ~77% at
// 512-2048, this one's 6 x 16 blocks ~75% and ~86%: 1.06-1.4x oneDNN at every row count
// measured, 1-2048, with 2 threads (docs/benchmarks.md).
//
//   fma_pack_linear(w [N, K] f32 or bf16) -> packed   the weight in panels of P columns,
//                                                     in w's dtype
//   fma_linear(x [M, K] f32 or bf16, packed, N, bias [N] or None) -> y [M, N], x's dtype
//   fma_linear_panel() -> int                  P: 48 (AVX-512), 16 (AVX2), 0 (no kernel)
//
// bf16 panels are widened as loaded (a shift: exact), a bf16 x once; the sums are float32
// and a bf16 y is rounded to nearest even: what oneDNN's bf16 kernels compute on CPUs with
// bf16 instructions, for CPUs without them (AVX2), where torch's bf16 matmul converts
// element by element (7-9x slower than these panels at 32-2,048 rows on AMD Zen 3).
//
// packed[p][k][c] = w[Pp + c][k] (N rounded up to P, zeros past it): a panel's K rows of
// P columns are contiguous. Per panel, per block of up to R rows of x (the rows split into
// blocks of even sizes): R x V accumulators (AVX-512: 8 rows x 3 vectors of 16 columns;
// AVX2: 6 x 2 of 8), and per k V weight vectors times each row's x[r][k] broadcast, one
// FMA each, k in order; then the bias is added. Threads take panels from a shared counter.
// At a few rows (up to 16 blocks: decode) the first half of the blocks also fetch the
// thread's next panel into L2, so every block finds its panel there; at more, the first
// block reads the panel from memory, prefetching 4 KiB ahead, and the rest find it in L2.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>

#include "kv_load.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define RADIXLM_FMA_LINEAR 1
#endif

namespace {

// The register a block works in, and its lane mask (a panel's columns past N): AVX-512's
// 16 floats, 32 registers; AVX2's 8 floats, 16 registers.
#if defined(__AVX512F__)
using vreg = __m512;
using vmask = __mmask16;
constexpr int64_t kLanes = 16;
constexpr int64_t kRows = 8, kVecs = 3;  // a register block: 8 rows x 3 vectors, 24 accumulators
inline vreg vzero() { return _mm512_setzero_ps(); }
inline vreg vload(const float* p) { return _mm512_loadu_ps(p); }
inline vreg vbroadcast(float x) { return _mm512_set1_ps(x); }
inline vreg vfma(vreg a, vreg b, vreg c) { return _mm512_fmadd_ps(a, b, c); }
inline vreg vadd(vreg a, vreg b) { return _mm512_add_ps(a, b); }
inline vmask lanes(int64_t n) {
  return n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<vmask>((1u << n) - 1);
}
inline vreg vload_masked(vmask m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
inline void vstore_masked(float* p, vmask m, vreg x) { _mm512_mask_storeu_ps(p, m, x); }
#elif defined(RADIXLM_FMA_LINEAR)
using vreg = __m256;
using vmask = __m256i;
constexpr int64_t kLanes = 8;
// 6 rows x 2 vectors: 12 accumulators, 2 weight vectors and a broadcast (4 x 3 left no
// register for the weights: each FMA loaded its own, 16 loads per k for 12 FMAs)
constexpr int64_t kRows = 6, kVecs = 2;
inline vreg vzero() { return _mm256_setzero_ps(); }
inline vreg vload(const float* p) { return _mm256_loadu_ps(p); }
inline vreg vbroadcast(float x) { return _mm256_set1_ps(x); }
inline vreg vfma(vreg a, vreg b, vreg c) { return _mm256_fmadd_ps(a, b, c); }
inline vreg vadd(vreg a, vreg b) { return _mm256_add_ps(a, b); }
inline vmask lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(n, 0, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vreg vload_masked(vmask m, const float* p) { return _mm256_maskload_ps(p, m); }
inline void vstore_masked(float* p, vmask m, vreg x) { _mm256_maskstore_ps(p, m, x); }
#else
constexpr int64_t kLanes = 16, kVecs = 3;
#endif
constexpr int64_t kPanel = kVecs * kLanes;  // columns per panel

template <class T>
void pack_panels(const T* src, T* dst, int64_t n, int64_t k) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t c = 0; c < kPanel && p * kPanel + c < n; ++c)
        for (int64_t kk = 0; kk < k; ++kk)
          dst[(p * k + kk) * kPanel + c] = src[(p * kPanel + c) * k + kk];
  });
}

at::Tensor fma_pack(const at::Tensor& weight) {
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat || bf16) &&
                  weight.device().is_cpu(),
              "fma_pack_linear: w must be a 2-D float32 or bfloat16 CPU tensor");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({panels * kPanel * k}, w.options());
  if (bf16)
    pack_panels(reinterpret_cast<const uint16_t*>(w.data_ptr()),
                reinterpret_cast<uint16_t*>(packed.data_ptr()), n, k);
  else
    pack_panels(w.data_ptr<float>(), packed.data_ptr<float>(), n, k);
  return packed;
}

#if defined(RADIXLM_FMA_LINEAR)

constexpr int64_t kAhead = 4096;  // bytes of the panel prefetched ahead of the first block
// At up to this many row blocks per panel (decode batches) the next panel is fetched while
// one runs: the first block alone would otherwise read the panel from memory at a rate
// above one core's share (AVX2, 32 rows: decode linears 15-18% faster); at more blocks its
// wait is a small share of the panel's time.
constexpr int64_t kFetchBlocks = 16;

// What a panel holds: float32, or a bfloat16 model's weights as they are (half the bytes),
// widened as loaded (a shift: exact).
struct PanelF32 {
  using T = float;
  static vreg load(const float* p) { return vload(p); }
};
struct PanelBF16 {
  using T = uint16_t;
#if defined(__AVX512F__)
  static vreg load(const uint16_t* p) { return (vreg)BF16::load(p); }
#else
  static vreg load(const uint16_t* p) { return (vreg)BF16::load8(p); }
#endif
};

// A row's n <= kLanes outputs from a register: float32 (masked), or rounded to bfloat16
// (to nearest even, as torch rounds).
inline void store_out(float* y, vreg v, int64_t n) { vstore_masked(y, lanes(n), v); }
inline void store_out(uint16_t* y, vreg v, int64_t n) {
  uint16_t t[kLanes];
  uint16_t* d = n >= kLanes ? y : t;
#if defined(__AVX512F__)
  store_bf16(d, (v16)v);
#else
  store_bf16_8(d, (v8)v);
#endif
  if (d == t && n > 0) std::memcpy(y, t, n * sizeof(uint16_t));
}

// What a block prefetches while it runs: its own panel kAhead bytes ahead (the panel's first
// block, when nothing fetched the panel before), and its share of the next panel's lines,
// into L2, spread over its k steps.
struct Fetch {
  bool ahead;
  const char* next;
  int64_t lines;
};

// Rows [0, R) of a block of x (row stride ldx) times one panel (k rows of kPanel) -> y's
// rows (the panel's first `cols` columns: fewer in the last panel), bias added.
template <int R, class P, class O>
void block(const float* x, int64_t ldx, const typename P::T* panel, int64_t k, Fetch f,
           const float* bias, O* y, int64_t ldy, int64_t cols) {
  vreg acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kVecs; ++c) acc[r][c] = vzero();
  int64_t due = 0;
  for (int64_t kk = 0; kk < k; ++kk) {
    const typename P::T* b = panel + kk * kPanel;
    if (f.ahead) {
      const char* ahead = reinterpret_cast<const char*>(b) + kAhead;
      for (int64_t o = 0; o < kPanel * int64_t{sizeof *b}; o += 64)
        _mm_prefetch(ahead + o, _MM_HINT_T0);
    }
    if (f.lines > 0) {
      for (due += f.lines; due >= k; due -= k, f.next += 64) _mm_prefetch(f.next, _MM_HINT_T1);
    }
    vreg w[kVecs];
    for (int c = 0; c < kVecs; ++c) w[c] = P::load(b + c * kLanes);
    for (int r = 0; r < R; ++r) {
      const vreg a = vbroadcast(x[r * ldx + kk]);
      for (int c = 0; c < kVecs; ++c) acc[r][c] = vfma(a, w[c], acc[r][c]);
    }
  }
  // the masks made here, after the loop: held across it they took registers it needs
  for (int c = 0; c < kVecs; ++c) {
    const vreg bv = bias != nullptr ? vload_masked(lanes(cols - c * kLanes), bias + c * kLanes)
                                    : vzero();
    for (int r = 0; r < R; ++r)
      store_out(y + r * ldy + c * kLanes, vadd(acc[r][c], bv), cols - c * kLanes);
  }
}

// f(std::integral_constant<int, r>) for a run-time r in [1, R].
template <int R, class F>
void with_rows(int64_t r, F&& f) {
  if constexpr (R > 1) {
    if (r < R) return with_rows<R - 1>(r, f);
  }
  f(std::integral_constant<int, R>{});
}

// x's m rows times one panel, in as few blocks as kRows allows, of as even sizes (32 rows:
// 6, 6, 5, 5, 5, 5 on AVX2 rather than 6 x 5 and 2: a block of fewer rows than the FMA
// latency covers waits on its accumulators); `next` (or nullptr): the panel to fetch
// meanwhile, each of the first half of the blocks its share of the lines; `fetched`: this
// panel was.
template <class P, class O>
void panel_rows(const float* x, int64_t ldx, const typename P::T* panel, int64_t k, int64_t m,
                const float* bias, O* y, int64_t ldy, int64_t cols, bool fetched,
                const typename P::T* next) {
  const int64_t nb = (m + kRows - 1) / kRows;
  const int64_t lines = next != nullptr ? k * kPanel * int64_t{sizeof *next} / 64 : 0;
  const int64_t nf = (nb + 1) / 2;  // the blocks that fetch it: the first half (32 rows on
                                    // AVX2: 5-8% faster than spread over all six)
  for (int64_t b = 0, r = 0; b < nb; ++b) {
    const int64_t rb = (m - r + nb - b - 1) / (nb - b);  // rows left over blocks left, rounded up
    const int64_t l0 = std::min(b, nf) * lines / nf, l1 = std::min(b + 1, nf) * lines / nf;
    const Fetch f{b == 0 && !fetched, reinterpret_cast<const char*>(next) + l0 * 64, l1 - l0};
    with_rows<kRows>(rb, [&](auto R) {
      block<decltype(R)::value, P>(x + r * ldx, ldx, panel, k, f, bias, y + r * ldy, ldy, cols);
    });
    r += rb;
  }
}

// y [m, n] = x [m, k] times the panels. Threads take the panels one at a time from a
// shared counter (a thread slowed by another process on its core takes fewer), each holding
// its next panel's ticket while it works on one: at up to kFetchBlocks row blocks that panel
// is fetched meanwhile.
template <class P, class O>
void run(const float* x, int64_t ldx, const typename P::T* packed, int64_t m, int64_t n,
         int64_t k, const float* bias, O* y) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const bool fetch = (m + kRows - 1) / kRows <= kFetchBlocks;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), panels), 1, [&](int64_t, int64_t) {
    bool fetched = false;  // the panel taken was fetched while the last one ran
    for (int64_t p = next.fetch_add(1, std::memory_order_relaxed); p < panels;) {
      const int64_t q = next.fetch_add(1, std::memory_order_relaxed), col0 = p * kPanel;
      panel_rows<P>(x, ldx, packed + p * kPanel * k, k, m,
                    bias == nullptr ? nullptr : bias + col0, y + col0, n, n - col0, fetched,
                    fetch && q < panels ? packed + q * kPanel * k : nullptr);
      fetched = fetch;
      p = q;
    }
  });
}

#endif

at::Tensor fma_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n,
                      const std::optional<at::Tensor>& bias) {
  const auto dt = x_in.scalar_type();
  TORCH_CHECK(x_in.dim() == 2 && (dt == at::kFloat || dt == at::kBFloat16) &&
                  x_in.device().is_cpu(),
              "fma_linear: x must be a 2-D float32 or bfloat16 CPU tensor");
  const int64_t m = x_in.size(0), k = x_in.size(1), panels = (n + kPanel - 1) / kPanel;
  const bool bf16_panels = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(n > 0 && (packed.scalar_type() == at::kFloat || bf16_panels) &&
                  packed.is_contiguous() && packed.numel() == panels * kPanel * k,
              "fma_linear: packed is not fma_pack_linear's packing of an [", n, ", ", k,
              "] weight");
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "fma_linear: bias must be [N]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({m, n}, x_in.options());  // x's dtype
#if defined(RADIXLM_FMA_LINEAR)
  if (m == 0) return y;
  // a bfloat16 x widened once (exact; m x k against the product's m x k x n)
  const at::Tensor x = dt == at::kFloat && x_in.stride(1) == 1 ? x_in
                                                                : x_in.to(at::kFloat).contiguous();
  const float* xp = x.data_ptr<float>();
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const int64_t ldx = x.stride(0);
  auto into = [&](auto* yp) {
    if (bf16_panels)
      run<PanelBF16>(xp, ldx, reinterpret_cast<const uint16_t*>(packed.data_ptr()), m, n, k, bp,
                     yp);
    else
      run<PanelF32>(xp, ldx, packed.data_ptr<float>(), m, n, k, bp, yp);
  };
  if (dt == at::kFloat)
    into(y.data_ptr<float>());
  else
    into(reinterpret_cast<uint16_t*>(y.data_ptr()));
#else
  TORCH_CHECK(false, "fma_linear: this build has neither AVX-512 nor AVX2 with FMA");
#endif
  return y;
}

// Columns per panel of this build's packing, 0 where it has no kernel.
int64_t fma_linear_panel() {
#if defined(RADIXLM_FMA_LINEAR)
  return kPanel;
#else
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixlm_cpu, m) {
  m.def("fma_pack_linear(Tensor w) -> Tensor");
  m.def("fma_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("fma_linear_panel() -> int", &fma_linear_panel);  // no tensors: a catch-all kernel
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) {
  m.impl("fma_pack_linear", &fma_pack);
  m.impl("fma_linear", &fma_linear);
}
