// One decode token of a linear-attention layer, its state read and written in place in the
// state pool (radix_cache/state_pool.py): torch's step gathers each sequence's state out of
// the pool, makes four passes over it (decay, recall, write, read out) and scatters it back;
// a Gated DeltaNet state is Hv * Dk * Dv float32 a layer (1 MiB at 16 heads of 128 x 128),
// so at 32 sequences a step moved gigabytes. Here each (sequence, head) reads its state
// twice and writes it once, in place.
//
//   gated_delta_step(q [B, Hk, Dk], k [B, Hk, Dk], v [B, Hv, Dv], g [B, Hv] f32,
//                    beta [B, Hv] f32, ssm [S, Hv, Dk, Dv] f32 (the pool, updated),
//                    slots [B] int64, scale, l2norm, out [B, Hv, Dv] f32 (written))
//       s = ssm[slot, h] * exp(g); pred = k^T s; s += k (beta (v - pred))^T; out = q^T s
//       (q, k l2-normalised with eps 1e-6 when asked, q times scale; head h of Hv reads
//       q / k head h / (Hv / Hk)): layers/gated_delta.py recurrent_gated_delta_rule_step.
//   conv1d_step(x [B, C], weight [C, K], bias [C]?, conv [S, C, K - 1] (the pool, updated),
//               slots [B] int64, silu, out [B, C] in x's dtype (written))
//       window = [conv[slot], x]; out = act(sum(window * weight) + bias);
//       conv[slot] = window[1:]: layers/short_conv.py causal_conv1d_step.
//   mamba2_step(xbc [B, H * P + 2 * G * N] (x | B | C, after the conv), dt [B, H],
//               A_log [H], D [H], dt_bias [H], ssm [S, H, P, N] f32 (the pool, updated),
//               slots [B] int64, dt_min, dt_max, out [B, H, P] in xbc's dtype (written))
//       dt = clamp(softplus(dt + dt_bias), dt_min, dt_max); s = ssm[slot, h];
//       s = s * exp(dt * -exp(A_log)) + (dt x) B^T; out = s C + D x (head h reads group
//       h / (H / G) of B and C): layers/mamba2.py ssd_step. A Mamba2 state is H * P * N
//       float32 a layer (4 MiB at 128 heads of 64 x 128); each is read and written once.
// q, k, v, x, xbc, dt, weight, conv and out: float32 or bfloat16 (bf16 widened as read); the
// arithmetic is float32, as the torch steps' for those dtypes.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return float(v); }

void check_slots(const at::Tensor& slots, int64_t batch, int64_t pool, const char* op) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1 &&
                  slots.size(0) == batch,
              op, ": slots must be int64 [", batch, "]");
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(s[b] >= 0 && s[b] < pool, op, ": slot ", s[b], " outside the pool of ", pool);
  // two sequences on one slot would race on its state
  std::vector<int64_t> sorted(s, s + batch);
  std::sort(sorted.begin(), sorted.end());
  TORCH_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(), op,
              ": a slot appears twice in slots");
}

// One head's q or k as float32 into dst (Dk), l2-normalised when asked, times mul.
template <class T>
void head_vector(const T* src, int64_t dk, bool l2norm, float mul, float* dst) {
  float ss = 0.f;
  for (int64_t i = 0; i < dk; ++i) {
    dst[i] = widen(src[i]);
    ss += dst[i] * dst[i];
  }
  const float f = (l2norm ? 1.f / std::sqrt(ss + 1e-6f) : 1.f);
  // as torch: x * rsqrt(...) rounded, then times scale
  for (int64_t i = 0; i < dk; ++i) dst[i] = dst[i] * f * mul;
}

template <class T>
void delta_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& g, const at::Tensor& beta, const at::Tensor& ssm,
                const at::Tensor& slots, double scale, bool l2norm, const at::Tensor& out) {
  const int64_t batch = q.size(0), hk = q.size(1), dk = q.size(2), hv = v.size(1),
                dv = v.size(2);
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* sp = ssm.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t rep = hv / hk;
  at::parallel_for(0, batch * hv, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> qn(dk), kn(dk), pred(dv), delta(dv), o(dv);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / hv, h = w % hv, kh = h / rep;
      head_vector(qp + (b * hk + kh) * dk, dk, l2norm, float(scale), qn.data());
      head_vector(kp + (b * hk + kh) * dk, dk, l2norm, 1.f, kn.data());
      float* s = sp + (slot[b] * hv + h) * dk * dv;
      const float decay = std::exp(gp[b * hv + h]), bt = bp[b * hv + h];
      // what the decayed state recalls for k
      std::fill(pred.begin(), pred.end(), 0.f);
      for (int64_t i = 0; i < dk; ++i) {
        const float ki = kn[i];
        const float* si = s + i * dv;
        for (int64_t j = 0; j < dv; ++j) pred[j] += ki * (si[j] * decay);
      }
      const T* vr = vp + (b * hv + h) * dv;
      for (int64_t j = 0; j < dv; ++j) delta[j] = (widen(vr[j]) - pred[j]) * bt;
      // the write, and the read-out of the new state, in one pass
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t i = 0; i < dk; ++i) {
        const float ki = kn[i], qi = qn[i];
        float* si = s + i * dv;
        for (int64_t j = 0; j < dv; ++j) {
          const float nv = si[j] * decay + ki * delta[j];
          si[j] = nv;
          o[j] += qi * nv;
        }
      }
      std::copy(o.begin(), o.end(), op + (b * hv + h) * dv);
    }
  });
}

void gated_delta_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& g, const at::Tensor& beta, const at::Tensor& ssm,
                      const at::Tensor& slots, double scale, bool l2norm, const at::Tensor& out) {
  const char* op = "gated_delta_step";
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0),
              op, ": q, k must be [B, Hk, Dk] and v [B, Hv, Dv]");
  const int64_t batch = q.size(0), hk = q.size(1), dk = q.size(2), hv = v.size(1),
                dv = v.size(2);
  TORCH_CHECK(hk > 0 && hv % hk == 0, op, ": Hv (", hv, ") must be a multiple of Hk (", hk, ")");
  const auto dt = q.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16) && k.scalar_type() == dt &&
                  v.scalar_type() == dt && q.is_contiguous() && k.is_contiguous() &&
                  v.is_contiguous(),
              op, ": q, k, v must be contiguous float32 or bfloat16 of one dtype");
  for (const at::Tensor* t : {&g, &beta})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == batch && t->size(1) == hv,
                op, ": g and beta must be float32 [", batch, ", ", hv, "]");
  TORCH_CHECK(ssm.scalar_type() == at::kFloat && ssm.is_contiguous() && ssm.dim() == 4 &&
                  ssm.size(1) == hv && ssm.size(2) == dk && ssm.size(3) == dv,
              op, ": ssm must be the float32 pool [S, ", hv, ", ", dk, ", ", dv, "]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 3 &&
                  out.size(0) == batch && out.size(1) == hv && out.size(2) == dv,
              op, ": out must be float32 [", batch, ", ", hv, ", ", dv, "]");
  for (const at::Tensor* t : {&q, &k, &v, &g, &beta, &ssm, &out, &slots})
    TORCH_CHECK(t->device().is_cpu(), op, ": CPU tensors only");
  check_slots(slots, batch, ssm.size(0), op);
  if (dt == at::kFloat)
    delta_step<float>(q, k, v, g, beta, ssm, slots, scale, l2norm, out);
  else
    delta_step<c10::BFloat16>(q, k, v, g, beta, ssm, slots, scale, l2norm, out);
}

template <class X, class S>
void conv_step(const at::Tensor& x, const at::Tensor& weight, const float* bias,
               const at::Tensor& conv, const at::Tensor& slots, bool silu,
               const at::Tensor& out) {
  const int64_t batch = x.size(0), c = x.size(1), kw = weight.size(1), width = kw - 1;
  const X* xp = x.data_ptr<X>();
  const X* wp = weight.data_ptr<X>();
  S* cp = conv.data_ptr<S>();
  X* op = out.data_ptr<X>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  at::parallel_for(0, batch, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      S* st = cp + slot[b] * c * width;
      for (int64_t ch = 0; ch < c; ++ch) {
        S* sc = st + ch * width;
        const X* wc = wp + ch * kw;
        const float xv = widen(xp[b * c + ch]);
        float acc = 0.f;
        for (int64_t t = 0; t < width; ++t) acc += widen(sc[t]) * widen(wc[t]);
        acc += xv * widen(wc[width]);
        if (bias) acc += bias[ch];
        if (silu) acc = acc / (1.f + std::exp(-acc));
        op[b * c + ch] = X(acc);
        for (int64_t t = 0; t + 1 < width; ++t) sc[t] = sc[t + 1];
        if (width > 0) sc[width - 1] = S(xv);
      }
    }
  });
}

void conv1d_step(const at::Tensor& x, const at::Tensor& weight,
                 const std::optional<at::Tensor>& bias, const at::Tensor& conv,
                 const at::Tensor& slots, bool silu, const at::Tensor& out) {
  const char* op = "conv1d_step";
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.size(0) == x.size(1) &&
                  weight.size(1) >= 1,
              op, ": x must be [B, C] and weight [C, K]");
  const int64_t batch = x.size(0), c = x.size(1), width = weight.size(1) - 1;
  const auto dt = x.scalar_type(), st = conv.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16) && weight.scalar_type() == dt &&
                  out.scalar_type() == dt && x.is_contiguous() && weight.is_contiguous() &&
                  out.is_contiguous() && out.sizes() == x.sizes(),
              op, ": x, weight and out must be contiguous float32 or bfloat16 of one dtype");
  TORCH_CHECK((st == at::kFloat || st == at::kBFloat16) && conv.is_contiguous() &&
                  conv.dim() == 3 && conv.size(1) == c && conv.size(2) == width,
              op, ": conv must be the pool [S, ", c, ", ", width, "] in float32 or bfloat16");
  at::Tensor bias_f;
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == c, op, ": bias must be [", c, "]");
    bias_f = bias->to(at::kFloat).contiguous();
    bp = bias_f.data_ptr<float>();
  }
  for (const at::Tensor* t : {&x, &weight, &conv, &out, &slots})
    TORCH_CHECK(t->device().is_cpu(), op, ": CPU tensors only");
  check_slots(slots, batch, conv.size(0), op);
  if (dt == at::kFloat) {
    st == at::kFloat ? conv_step<float, float>(x, weight, bp, conv, slots, silu, out)
                     : conv_step<float, c10::BFloat16>(x, weight, bp, conv, slots, silu, out);
  } else {
    st == at::kFloat
        ? conv_step<c10::BFloat16, float>(x, weight, bp, conv, slots, silu, out)
        : conv_step<c10::BFloat16, c10::BFloat16>(x, weight, bp, conv, slots, silu, out);
  }
}

// torch's softplus (beta 1, threshold 20)
inline float softplus(float v) { return v > 20.f ? v : std::log1p(std::exp(v)); }

// The parameters of one layer's heads ([H], any float dtype) as float32.
struct Mamba2Params {
  at::Tensor a_log, d, dt_bias;
  Mamba2Params(const at::Tensor& a, const at::Tensor& d_, const at::Tensor& bias)
      : a_log(a.to(at::kFloat).contiguous()), d(d_.to(at::kFloat).contiguous()),
        dt_bias(bias.to(at::kFloat).contiguous()) {}
};

template <class X>
void ssd_step(const at::Tensor& xbc, const at::Tensor& dt, const Mamba2Params& prm,
              const at::Tensor& ssm, const at::Tensor& slots, float dt_min, float dt_max,
              const at::Tensor& out) {
  const int64_t batch = xbc.size(0), width = xbc.size(1), hv = ssm.size(1), p = ssm.size(2),
                n = ssm.size(3), inter = hv * p, groups = (width - inter) / (2 * n),
                rep = hv / groups;
  const X *xp = xbc.data_ptr<X>(), *dtp = dt.data_ptr<X>();
  const float *ap = prm.a_log.data_ptr<float>(), *dp = prm.d.data_ptr<float>(),
              *bias = prm.dt_bias.data_ptr<float>();
  float* sp = ssm.data_ptr<float>();
  X* op = out.data_ptr<X>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  at::parallel_for(0, batch * hv, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> bv(n), cv(n);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / hv, h = w % hv, g = h / rep;
      const X* row = xp + b * width;  // x | B | C of sequence b
      for (int64_t j = 0; j < n; ++j) {
        bv[j] = widen(row[inter + g * n + j]);
        cv[j] = widen(row[inter + (groups + g) * n + j]);
      }
      const float step = std::min(
          std::max(softplus(widen(dtp[b * hv + h]) + bias[h]), dt_min), dt_max);
      const float decay = std::exp(step * -std::exp(ap[h]));
      float* s = sp + (slot[b] * hv + h) * p * n;
      // each row of the state decayed, written and read out in one pass
      for (int64_t i = 0; i < p; ++i) {
        const float xi = widen(row[h * p + i]), write = step * xi;
        float* si = s + i * n;
        float acc = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          const float nv = si[j] * decay + write * bv[j];
          si[j] = nv;
          acc += nv * cv[j];
        }
        op[(b * hv + h) * p + i] = X(acc + xi * dp[h]);
      }
    }
  });
}

void mamba2_step(const at::Tensor& xbc, const at::Tensor& dt, const at::Tensor& a_log,
                 const at::Tensor& d, const at::Tensor& dt_bias, const at::Tensor& ssm,
                 const at::Tensor& slots, double dt_min, double dt_max, const at::Tensor& out) {
  const char* op = "mamba2_step";
  TORCH_CHECK(ssm.scalar_type() == at::kFloat && ssm.is_contiguous() && ssm.dim() == 4 &&
                  ssm.size(1) > 0 && ssm.size(2) > 0 && ssm.size(3) > 0,
              op, ": ssm must be the float32 pool [S, H, P, N]");
  const int64_t hv = ssm.size(1), p = ssm.size(2), n = ssm.size(3);
  TORCH_CHECK(xbc.dim() == 2 && xbc.size(1) > hv * p && (xbc.size(1) - hv * p) % (2 * n) == 0,
              op, ": xbc must be [B, ", hv, " * ", p, " + 2 * G * ", n, "]");
  const int64_t batch = xbc.size(0), groups = (xbc.size(1) - hv * p) / (2 * n);
  TORCH_CHECK(hv % groups == 0, op, ": H (", hv, ") must be a multiple of G (", groups, ")");
  const auto dtype = xbc.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && dt.scalar_type() == dtype &&
                  out.scalar_type() == dtype && xbc.is_contiguous() && dt.is_contiguous() &&
                  out.is_contiguous(),
              op, ": xbc, dt and out must be contiguous float32 or bfloat16 of one dtype");
  TORCH_CHECK(dt.dim() == 2 && dt.size(0) == batch && dt.size(1) == hv, op,
              ": dt must be [", batch, ", ", hv, "]");
  TORCH_CHECK(out.dim() == 3 && out.size(0) == batch && out.size(1) == hv && out.size(2) == p,
              op, ": out must be [", batch, ", ", hv, ", ", p, "]");
  for (const at::Tensor* t : {&a_log, &d, &dt_bias})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == hv, op, ": A_log, D and dt_bias must be [", hv,
                "]");
  for (const at::Tensor* t : {&xbc, &dt, &a_log, &d, &dt_bias, &ssm, &out, &slots})
    TORCH_CHECK(t->device().is_cpu(), op, ": CPU tensors only");
  check_slots(slots, batch, ssm.size(0), op);
  const Mamba2Params prm(a_log, d, dt_bias);
  if (dtype == at::kFloat)
    ssd_step<float>(xbc, dt, prm, ssm, slots, float(dt_min), float(dt_max), out);
  else
    ssd_step<c10::BFloat16>(xbc, dt, prm, ssm, slots, float(dt_min), float(dt_max), out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixlm_cpu, m) {
  m.def("gated_delta_step(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) ssm, "
        "Tensor slots, float scale, bool l2norm, Tensor(b!) out) -> ()");
  m.def("conv1d_step(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv, Tensor slots, "
        "bool silu, Tensor(b!) out) -> ()");
  m.def("mamba2_step(Tensor xbc, Tensor dt, Tensor A_log, Tensor D, Tensor dt_bias, "
        "Tensor(a!) ssm, Tensor slots, float dt_min, float dt_max, Tensor(b!) out) -> ()");
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) {
  m.impl("gated_delta_step", &gated_delta_step);
  m.impl("conv1d_step", &conv1d_step);
  m.impl("mamba2_step", &mamba2_step);
}
