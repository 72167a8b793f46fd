// The greedy pick of a batch of float32 logits on the CPU: each row's first index of its
// maximum, NaN counting as the maximum (torch's max(dim=-1).indices: the first NaN when a
// row has one, else the first index whose value equals the row's max, +0.0 and -0.0 alike).
//
//   argmax_rows(x [B, V] float32, rows contiguous) -> [B] int64
//
// Two vector passes over a row (the max and whether a NaN is there, then the first index
// holding it; the row is in cache for the second), rows split over the threads. torch's
// max over a [32, 32k] batch took ~1 ms on two threads, a decode step's 2%.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "kv_load.h"

#include <cmath>
#include <cstdint>
#include <limits>

namespace {

// The vectors of a pass: a register's width of floats and their compare masks. AVX2 takes
// 8: without AVX-512 GCC lowers a 16-float compare and select lane by lane, through the
// stack (2.5x torch's max on Zen 3).
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int kW = 8;
typedef float vf __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t vi __attribute__((vector_size(32)));
inline bool any_lane(vi m) { return _mm256_movemask_ps(reinterpret_cast<__m256>(m)) != 0; }
#else
constexpr int kW = 16;
typedef float vf __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t vi __attribute__((vector_size(64)));
inline bool any_lane(vi m) {
  for (int i = 0; i < kW; ++i)
    if (m[i] != 0) return true;
  return false;
}
#endif
inline vf loadw(const float* p) { return *reinterpret_cast<const vf*>(p); }

int64_t row_argmax(const float* x, int64_t v) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  // four running maxima (independent chains); a NaN compares false, kept out of them
  vf best[4] = {vf{} - kInf, vf{} - kInf, vf{} - kInf, vf{} - kInf};
  vi nan = {};
  int64_t j = 0;
  for (; j + 4 * kW <= v; j += 4 * kW)
    for (int c = 0; c < 4; ++c) {
      const vf a = loadw(x + j + kW * c);
      best[c] = a > best[c] ? a : best[c];
      nan |= a != a;
    }
  for (; j + kW <= v; j += kW) {
    const vf a = loadw(x + j);
    best[0] = a > best[0] ? a : best[0];
    nan |= a != a;
  }
  float m = -kInf;
  for (int c = 0; c < 4; ++c)
    for (int i = 0; i < kW; ++i) m = best[c][i] > m ? best[c][i] : m;
  bool has_nan = any_lane(nan);
  for (int64_t t = j; t < v; ++t) {
    m = x[t] > m ? x[t] : m;
    has_nan = has_nan || std::isnan(x[t]);
  }
  // the first index holding it, a vector at a time
  const vf mv = vf{} + m;
  for (j = 0; j + kW <= v; j += kW) {
    const vf a = loadw(x + j);
    const vi hit = has_nan ? (a != a) : (a == mv);
    if (any_lane(hit))
      for (int i = 0; i < kW; ++i)
        if (hit[i] != 0) return j + i;
  }
  for (; j < v; ++j)
    if (has_nan ? std::isnan(x[j]) : x[j] == m) return j;
  return 0;  // not reached: some element is the max or a NaN
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 &&
                  x.size(1) > 0,
              "argmax_rows: x must be [B, V > 0] float32 with contiguous rows");
  const int64_t b = x.size(0), v = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({b}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, b, std::max<int64_t>(1, 16384 / v), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = row_argmax(xp + r * stride, v);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixlm_cpu, m) { m.def("argmax_rows(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
