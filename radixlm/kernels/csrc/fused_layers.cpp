// Fused elementwise layer kernels on the CPU: what torch runs as 4-8 separate passes (and,
// in bfloat16, as many dtype conversions) done in one pass over each row.
//
//   rms_norm(x [N,H], w [H], eps)               -> norm(x) * w
//   fused_add_rms_norm(x, residual, w, eps)     -> (norm(x + residual) * w, x + residual)
//   rotary_neox(q [N,Hq,D], k [N,Hkv,D], cos_sin [P,D] float32, positions [N] int64)
//                                               -> (q rotated, k rotated), new tensors
//   silu_and_mul(x [N,2I])                      -> silu(x[:, :I]) * x[:, I:]
//
// x, residual, q, k: float32 or bfloat16 (w: the same dtype or float32), rows may be
// strided, elements contiguous; outputs are contiguous in the input's dtype. Arithmetic is
// float32 in the order of the torch reference (radixlm/kernels/reference.py): the residual
// sum is rounded to the input dtype before it is normalised, mean = sum(x^2) / H,
// out = (x * rsqrt(mean + eps)) * w; rotary x1 * cos - x2 * sin, x2 * cos + x1 * sin;
// silu(g) = g / (1 + exp(-g)). The sum of squares adds in torch's own order in float32
// rows of 8 or more (torch_order_rms_scale: the reference's bits), in 16 lanes in
// bfloat16; exp is a polynomial (relative error ~2e-7). bfloat16 results round to nearest even,
// as torch does. Rows are split across threads with at::parallel_for. Multiply-adds are not
// contracted into FMAs here (GCC contracts by default in C++), so that float32 products
// round as torch's separate mul / sub / add kernels round them, and neither reassociated
// nor turned into reciprocals (the library's flags allow both for the attention kernel):
// (x * r) * w stays two products in that order, sum / H a division.
#pragma GCC optimize("fp-contract=off", "no-associative-math", "no-reciprocal-math")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "kv_load.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

namespace {

typedef int32_t i16v __attribute__((vector_size(64)));

// Elements per thread chunk: below this a call runs on the calling thread.
constexpr int64_t kGrainElems = 16384;

inline void store16(float* p, v16 x) { *reinterpret_cast<v16*>(p) = x; }

#if defined(__AVX2__) && !defined(__AVX512F__)
// Without AVX-512 GCC lowers a 16-float vector's comparisons and selects lane by lane
// (scalar compares and moves: exp's clamp made silu_and_mul 4x slower than torch's on
// AMD Zen 3); what needs them is written in 8-float vectors (v8, an AVX2 register) here.
typedef int32_t i8v __attribute__((vector_size(32)));

#endif


struct IoF32 {
  using S = float;
  static v16 load(const S* p) { return load16(p); }
  static float one(const S* p) { return *p; }
  static void store(S* p, v16 x) { store16(p, x); }
#if defined(__AVX2__) && !defined(__AVX512F__)
  static v8 load8(const S* p) { return ::load8(p); }
  static void store8(S* p, v8 x) { *reinterpret_cast<v8*>(p) = x; }
#endif
};
struct IoBF16 {
  using S = uint16_t;
  static v16 load(const S* p) { return BF16::load(p); }
  static float one(const S* p) { return bf16_bits(*p); }
  static void store(S* p, v16 x) { store_bf16(p, x); }
#if defined(__AVX2__) && !defined(__AVX512F__)
  static v8 load8(const S* p) { return BF16::load8(p); }
  static void store8(S* p, v8 x) { store_bf16_8(p, x); }
#endif
};

// The first n <= 16 elements (the rest 0), and their store: row tails go through these.
template <class IO>
inline v16 load_n(const typename IO::S* p, int64_t n) {
  if (n == 16) return IO::load(p);
  float t[16] = {};
  for (int64_t i = 0; i < n; ++i) t[i] = IO::one(p + i);
  return load16(t);
}
template <class IO>
inline void store_n(typename IO::S* p, v16 x, int64_t n) {
  if (n == 16) return IO::store(p, x);
  typename IO::S t[16];
  IO::store(t, x);
  std::memcpy(p, t, n * sizeof(typename IO::S));
}

inline float hsum16(v16 x) {
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += x[i];
  return s;
}

// exp(x) lane-wise, x clamped to [-87, 88]: x = n ln2 + r, exp(r) by Cephes' degree-6
// polynomial, 2^n through the exponent bits (n = floor(t + 0.5) by truncating t + 128.5,
// which stays positive). Relative error about 2e-7.
// V: 16 or 8 floats, I: as many int32.
template <class V, class I>
inline V exp_v(V x) {
  const V lo = x - x - 87.0f, hi = x - x + 88.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const I n = __builtin_convertvector(x * 1.44269504088896341f + 128.5f, I) - 128;
  const V nf = __builtin_convertvector(n, V);
  const V r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;
  V p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const I bits = (n + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(row_elems, 1)); }

// ------------------------------------------------------------------------- RMSNorm

// float32: rsqrt(mean(x^2) + eps) of one row with torch's own sum (SumKernel.cpp's
// cascade_sum over a contiguous row, as torch's x86 builds dispatch it: vectors of 8
// lanes, four of them side by side, in cascade levels of 2^max(4, ceil(log2 n)/4)
// iterations; the tail and then the 8 lanes added one by one), mean = sum / H, and
// 1 / sqrt(mean + eps): the bits of the reference's pow(2).mean(-1) + eps and rsqrt, so a
// float32 model stays bit-for-bit where transformers' does (a 16-lane sum drifted its
// logits by 1.4e-4 over 12 layers). cpu_fused checks the bits against torch once per
// process before it uses this.
typedef float v8f __attribute__((vector_size(32), aligned(4), may_alias));

float torch_order_rms_scale(const float* x, int64_t h, float eps) {
  const int64_t vs = h / 8;      // whole vectors of 8
  const int64_t size = vs / 4;   // rows of four vectors
  int64_t lg = 1;
  if (size > 2) lg = 64 - __builtin_clzll(static_cast<uint64_t>(size - 1));
  const int64_t power = std::max<int64_t>(4, lg / 4), step = int64_t{1} << power;
  const int64_t mask = step - 1;
  auto sq = [&](int64_t v) {
    const v8f a = *reinterpret_cast<const v8f*>(x + 8 * v);
    return a * a;
  };
  v8f acc[4][4] = {};
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < 4; ++k) acc[0][k] += sq(4 * i + k);
    for (int j = 1; j < 4; ++j) {
      for (int k = 0; k < 4; ++k) {
        acc[j][k] += acc[j - 1][k];
        acc[j - 1][k] = v8f{};
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < 4; ++k) acc[0][k] += sq(4 * i + k);
  for (int j = 1; j < 4; ++j)
    for (int k = 0; k < 4; ++k) acc[0][k] += acc[j][k];
  v8f part = acc[0][0];
  for (int64_t v = size * 4; v < vs; ++v) part += sq(v);
  for (int k = 1; k < 4; ++k) part += acc[0][k];
  float sum = 0.0f;
  for (int64_t k = vs * 8; k < h; ++k) sum += x[k] * x[k];
  for (int k = 0; k < 8; ++k) sum += part[k];
  const float mean = sum / static_cast<float>(h);
  return 1.0f / std::sqrt(mean + eps);
}

// One row: pass 1 sums (and with a residual stores x + residual, rounded to the dtype),
// pass 2 normalises what pass 1 left (the rounded sum, or x).
template <class IO, class W>
void rms_row(const typename IO::S* x, const typename IO::S* res, typename IO::S* sum,
             typename IO::S* out, const typename W::S* w, int64_t h, float eps) {
  v16 acc0 = {}, acc1 = {};
  const typename IO::S* src = x;
  for (int64_t j = 0; j < h; j += 16) {
    const int64_t m = std::min<int64_t>(16, h - j);
    v16 v = load_n<IO>(x + j, m);
    if (res != nullptr) {
      store_n<IO>(sum + j, v + load_n<IO>(res + j, m), m);
      v = load_n<IO>(sum + j, m);
    }
    if ((j / 16) % 2 == 0) acc0 += v * v; else acc1 += v * v;
  }
  if (res != nullptr) src = sum;
  float r;
  if constexpr (std::is_same_v<IO, IoF32>) {
    r = torch_order_rms_scale(src, h, eps);
  } else {
    const float mean = hsum16(acc0 + acc1) / static_cast<float>(h);
    r = 1.0f / std::sqrt(mean + eps);
  }
  for (int64_t j = 0; j < h; j += 16) {
    const int64_t m = std::min<int64_t>(16, h - j);
    store_n<IO>(out + j, (load_n<IO>(src + j, m) * r) * load_n<W>(w + j, m), m);
  }
}

template <class IO, class W>
void rms_all(const at::Tensor& x, const at::Tensor* res, at::Tensor* sum, at::Tensor& out,
             const at::Tensor& w, float eps) {
  using S = typename IO::S;
  const int64_t n = x.size(0), h = x.size(1);
  const S* xp = static_cast<const S*>(x.data_ptr());
  const S* rp = res ? static_cast<const S*>(res->data_ptr()) : nullptr;
  S* sp = sum ? static_cast<S*>(sum->data_ptr()) : nullptr;
  S* op = static_cast<S*>(out.data_ptr());
  const typename W::S* wp = static_cast<const typename W::S*>(w.data_ptr());
  const int64_t xs = x.stride(0), rs = res ? res->stride(0) : 0;
  at::parallel_for(0, n, grain(h), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      rms_row<IO, W>(xp + i * xs, rp ? rp + i * rs : nullptr, sp ? sp + i * h : nullptr,
                     op + i * h, wp, h, eps);
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": [N, H] with contiguous rows");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              ": float32 or bfloat16, got ", t.scalar_type());
}

// x [N,H]; residual given: returns (out, x + residual), else (out, undefined)
std::tuple<at::Tensor, at::Tensor> rms_dispatch(const at::Tensor& x, const at::Tensor* res,
                                                const at::Tensor& w, double eps) {
  check_rows(x, "x");
  const int64_t h = x.size(1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == h && w.is_contiguous(), "weight: [H] contiguous");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() || w.scalar_type() == at::kFloat,
              "weight: x's dtype or float32");
  if (res != nullptr) {
    check_rows(*res, "residual");
    TORCH_CHECK(res->sizes() == x.sizes() && res->scalar_type() == x.scalar_type(),
                "residual: x's shape and dtype");
  }
  at::Tensor out = at::empty({x.size(0), h}, x.options());
  at::Tensor sum = res ? at::empty({x.size(0), h}, x.options()) : at::Tensor();
  const float e = static_cast<float>(eps);
  const bool wf = w.scalar_type() == at::kFloat;
  if (x.scalar_type() == at::kFloat) {
    rms_all<IoF32, IoF32>(x, res, res ? &sum : nullptr, out, w, e);
  } else if (wf) {
    rms_all<IoBF16, IoF32>(x, res, res ? &sum : nullptr, out, w, e);
  } else {
    rms_all<IoBF16, IoBF16>(x, res, res ? &sum : nullptr, out, w, e);
  }
  return {out, sum};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return std::get<0>(rms_dispatch(x, nullptr, w, eps));
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x,
                                                      const at::Tensor& residual,
                                                      const at::Tensor& w, double eps) {
  return rms_dispatch(x, &residual, w, eps);
}

// ------------------------------------------------------------------------- rotary

// heads rows of one token: out = rotate_half(x) with this position's cos / sin
template <class IO>
void rotate_heads(const typename IO::S* x, int64_t head_stride, typename IO::S* out,
                  int64_t heads, int64_t d, const float* cs) {
  const int64_t half = d / 2;
  const float* sn = cs + half;
  for (int64_t hd = 0; hd < heads; ++hd) {
    const typename IO::S* a = x + hd * head_stride;
    typename IO::S* o = out + hd * d;
    for (int64_t j = 0; j < half; j += 16) {
      const int64_t m = std::min<int64_t>(16, half - j);
      const v16 c = load_n<IoF32>(cs + j, m), s = load_n<IoF32>(sn + j, m);
      const v16 x1 = load_n<IO>(a + j, m), x2 = load_n<IO>(a + half + j, m);
      store_n<IO>(o + j, x1 * c - x2 * s, m);
      store_n<IO>(o + half + j, x2 * c + x1 * s, m);
    }
  }
}

template <class IO>
void rotary_all(const at::Tensor& q, const at::Tensor& k, const float* cs, const int64_t* pos,
                at::Tensor& qo, at::Tensor& ko) {
  using S = typename IO::S;
  const int64_t n = q.size(0), hq = q.size(1), hk = k.size(1), d = q.size(2);
  const S* qp = static_cast<const S*>(q.data_ptr());
  const S* kp = static_cast<const S*>(k.data_ptr());
  S* qop = static_cast<S*>(qo.data_ptr());
  S* kop = static_cast<S*>(ko.data_ptr());
  at::parallel_for(0, n, grain((hq + hk) * d), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* c = cs + pos[i] * d;
      rotate_heads<IO>(qp + i * q.stride(0), q.stride(1), qop + i * hq * d, hq, d, c);
      rotate_heads<IO>(kp + i * k.stride(0), k.stride(1), kop + i * hk * d, hk, d, c);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rotary_neox(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& cos_sin,
                                               const at::Tensor& positions) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "q [N, Hq, D] and k [N, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "q, k: one dtype, float32 or bfloat16");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "q, k: contiguous head rows");
  const int64_t n = q.size(0), d = q.size(2);
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.size(1) == d && cos_sin.is_contiguous() &&
                  cos_sin.scalar_type() == at::kFloat,
              "cos_sin_cache: contiguous float32 [max_pos, D]");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == n && positions.is_contiguous() &&
                  positions.scalar_type() == at::kLong,
              "positions: contiguous int64 [N]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(pos[i] >= 0 && pos[i] < cos_sin.size(0), "position ", pos[i],
                " outside the rotary table [0, ", cos_sin.size(0), ")");
  at::Tensor qo = at::empty(q.sizes(), q.options());
  at::Tensor ko = at::empty(k.sizes(), k.options());
  const float* cs = cos_sin.data_ptr<float>();
  if (q.scalar_type() == at::kFloat) {
    rotary_all<IoF32>(q, k, cs, pos, qo, ko);
  } else {
    rotary_all<IoBF16>(q, k, cs, pos, qo, ko);
  }
  return {qo, ko};
}

// ------------------------------------------------------------------------- SiLU x up

template <class IO>
void silu_all(const at::Tensor& x, at::Tensor& out) {
  using S = typename IO::S;
  const int64_t n = x.size(0), inter = x.size(1) / 2, xs = x.stride(0);
  const S* xp = static_cast<const S*>(x.data_ptr());
  S* op = static_cast<S*>(out.data_ptr());
  at::parallel_for(0, n, grain(inter), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const S* g = xp + i * xs;
      S* o = op + i * inter;
      int64_t j = 0;
#if defined(__AVX2__) && !defined(__AVX512F__)
      for (; j + 8 <= inter; j += 8) {
        const v8 gv = IO::load8(g + j), uv = IO::load8(g + inter + j);
        IO::store8(o + j, gv / (exp_v<v8, i8v>(-gv) + 1.0f) * uv);
      }
#endif
      for (; j < inter; j += 16) {  // AVX2: the last inter % 8
        const int64_t m = std::min<int64_t>(16, inter - j);
        const v16 gv = load_n<IO>(g + j, m), uv = load_n<IO>(g + inter + j, m);
        store_n<IO>(o + j, gv / (exp_v<v16, i16v>(-gv) + 1.0f) * uv, m);
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x: [N, 2I]");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == at::kFloat) {
    silu_all<IoF32>(x, out);
  } else {
    silu_all<IoBF16>(x, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixlm_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) "
        "-> (Tensor, Tensor)");
  m.def("rotary_neox(Tensor q, Tensor k, Tensor cos_sin_cache, Tensor positions) "
        "-> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_neox", &rotary_neox);
  m.impl("silu_and_mul", &silu_and_mul);
}
