// A float32 linear layer, y = x W^T (+ bias), for the few-row products of decode steps,
// on AVX-512 FMAs: the float32 counterpart of amx_linear.cpp. oneDNN's float32 kernels
// read the weights below the memory's rate at a few rows and multiply below the FMA units'
// at 16-32 (one thread, 32 rows of gate_up: 52 GFLOP/s, ~80 the peak measured here); this
// one holds an 8 x 48 block of y in registers and streams the weights once (1.03-1.36x
// oneDNN at 1-32 rows, docs/benchmarks.md).
//
//   fma_pack_linear(w [N, K] f32) -> packed   the weight in panels of 48 columns
//   fma_linear(x [M, K] f32, packed, N, bias [N] or None) -> y [M, N] f32
//   fma_linear_ready() -> bool                 this build has the AVX-512 path
//
// packed[p][k][c] = w[48p + c][k] (N rounded up to 48, zeros past it): a panel's K rows of
// 48 columns are contiguous, so a thread's panels are one forward stream. Per panel, per
// block of up to 8 rows of x: 24 accumulators (8 rows x 3 vectors of 16 columns), and per
// k three weight vectors times each row's x[r][k] broadcast, one FMA each, k in order;
// then the bias is added. The first row block reads the panel from memory, prefetching
// 4 KiB ahead; the rest find it in L2. Threads split the panels.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 48;  // columns per panel: three vectors
constexpr int64_t kRows = 8;    // rows of x per register block

at::Tensor fma_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "fma_pack_linear: w must be a 2-D float32 CPU tensor");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({panels * kPanel * k}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t c = 0; c < kPanel && p * kPanel + c < n; ++c)
        for (int64_t kk = 0; kk < k; ++kk)
          dst[(p * k + kk) * kPanel + c] = src[(p * kPanel + c) * k + kk];
  });
  return packed;
}

#if defined(__AVX512F__)

constexpr int64_t kAhead = 4096;  // bytes of the panel prefetched ahead of the first block

// Rows [0, R) of a block of x (row stride ldx) times one panel (k rows of 48) -> y's rows
// (columns masked to the panel's share of N), bias added.
template <int R>
void block(const float* x, int64_t ldx, const float* panel, int64_t k, bool first,
           const float* bias, float* y, int64_t ldy, __mmask16 m0, __mmask16 m1,
           __mmask16 m2) {
  __m512 acc[R][3];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* b = panel + kk * kPanel;
    if (first) {
      const char* ahead = reinterpret_cast<const char*>(b) + kAhead;
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
      _mm_prefetch(ahead + 128, _MM_HINT_T0);
    }
    const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16),
                 b2 = _mm512_loadu_ps(b + 32);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + kk]);
      acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(a, b2, acc[r][2]);
    }
  }
  __m512 bv[3] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  if (bias != nullptr) {
    bv[0] = _mm512_maskz_loadu_ps(m0, bias);
    bv[1] = _mm512_maskz_loadu_ps(m1, bias + 16);
    bv[2] = _mm512_maskz_loadu_ps(m2, bias + 32);
  }
  for (int r = 0; r < R; ++r) {
    float* out = y + r * ldy;
    _mm512_mask_storeu_ps(out, m0, _mm512_add_ps(acc[r][0], bv[0]));
    _mm512_mask_storeu_ps(out + 16, m1, _mm512_add_ps(acc[r][1], bv[1]));
    _mm512_mask_storeu_ps(out + 32, m2, _mm512_add_ps(acc[r][2], bv[2]));
  }
}

// Rows [r, m) in blocks of R (the last block smaller).
template <int R>
void rows(const float* x, int64_t ldx, const float* panel, int64_t k, int64_t r, int64_t m,
          const float* bias, float* y, int64_t ldy, __mmask16 m0, __mmask16 m1, __mmask16 m2) {
  for (; r + R <= m; r += R)
    block<R>(x + r * ldx, ldx, panel, k, r == 0, bias, y + r * ldy, ldy, m0, m1, m2);
  if constexpr (R > 1) {
    if (r < m) rows<R - 1>(x, ldx, panel, k, r, m, bias, y, ldy, m0, m1, m2);
  }
}

inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
}

#endif

at::Tensor fma_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "fma_linear: x must be a 2-D float32 CPU tensor");
  const int64_t m = x_in.size(0), k = x_in.size(1), panels = (n + kPanel - 1) / kPanel;
  TORCH_CHECK(n > 0 && packed.scalar_type() == at::kFloat && packed.is_contiguous()
                  && packed.numel() == panels * kPanel * k,
              "fma_linear: packed is not fma_pack_linear's packing of an [", n, ", ", k,
              "] weight");
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "fma_linear: bias must be [N]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({m, n}, x_in.options());
#if defined(__AVX512F__)
  if (m == 0) return y;
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const float* xp = x.data_ptr<float>();
  const float* pp = packed.data_ptr<float>();
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t col0 = p * kPanel, cols = n - col0;
      rows<kRows>(xp, ldx, pp + p * kPanel * k, k, 0, m, bp == nullptr ? nullptr : bp + col0,
                  yp + col0, n, lanes(cols), lanes(cols - 16), lanes(cols - 32));
    }
  });
#else
  TORCH_CHECK(false, "fma_linear: this build has no AVX-512");
#endif
  return y;
}

bool fma_linear_ready() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixlm_cpu, m) {
  m.def("fma_pack_linear(Tensor w) -> Tensor");
  m.def("fma_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("fma_linear_ready() -> bool", &fma_linear_ready);  // no tensors: a catch-all kernel
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) {
  m.impl("fma_pack_linear", &fma_pack);
  m.impl("fma_linear", &fma_linear);
}
