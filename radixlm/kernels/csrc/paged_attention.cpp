// Paged attention on the CPU, reading K and V from the pool in place.
//
// Segment s: query rows q_rows[q_indptr[s] : q_indptr[s+1]] attend to the keys at slots
// kv_indices[kv_indptr[s] : kv_indptr[s+1]] of k_buf / v_buf: all of them, or, with
// causal, row i of n the first n_keys - n + i + 1 (extend: the prefix, then the new tokens,
// whose K/V are stored in the pool before attention). Decode is one
// segment per sequence (its one query row over its whole KV); a shared-prefix group is one
// segment (all its members' rows over the shared slots). A row is in at most one segment.
//
//   q      [N, Hq, D]  float32          k_buf, v_buf  [S, Hkv, D]  float32
//   o      [N, Hq, D]  float32 (rows in no segment: 0)
//   lse    [N, Hq]     float32 (rows in no segment, or over no keys: -inf)
//
// One task per (segment, KV head): its rows are (query row, query head of that KV head),
// so each key row is loaded once for the whole GQA group. Keys go in blocks of kBlock:
// scores, then an online-softmax update (running max m, sum l, accumulator acc).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kBlock = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 (scores minus their running max), as a polynomial the compiler
// vectorises (the libm call it would otherwise make is scalar): x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by Cephes' degree-6 minimax polynomial, 2^n through the exponent
// bits. Relative error about 2e-7; x below -87 (exp < 2e-38) gives 2^-126, not 0.
inline float exp_neg(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// 16 floats: GCC's vector extension, so the inner loops are explicit vector code
typedef float v16 __attribute__((vector_size(64), aligned(4), may_alias));

inline v16 load16(const float* p) { return *reinterpret_cast<const v16*>(p); }

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

inline float hsum(v16 x) {  // halving tree: 4 vector adds, no scalar loop
  const v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// scores[r * kBlock] = scale * q_r . k for RT rows at once (each chunk of k loaded once);
// D a multiple of 16
template <int RT>
inline void score_rows(const float* const* qr, const float* kp, int64_t d, float scale,
                       float* scores) {
  v16 acc[RT] = {};
  for (int64_t i = 0; i < d; i += 16) {
    const v16 k = load16(kp + i);
    for (int r = 0; r < RT; ++r) acc[r] += load16(qr[r] + i) * k;
  }
  for (int r = 0; r < RT; ++r) scores[r * kBlock] = hsum(acc[r]) * scale;
}

// acc_r += p_r * v for RT rows at once; D a multiple of 16
template <int RT>
inline void accumulate_rows(float* acc, const float* p, const float* vp, int64_t d) {
  for (int64_t i = 0; i < d; i += 16) {
    const v16 v = load16(vp + i);
    for (int r = 0; r < RT; ++r) {
      v16* a = reinterpret_cast<v16*>(acc + r * d + i);
      *a += p[r * kBlock] * v;
    }
  }
}

inline float dot(const float* a, const float* b, int64_t d) {
  float s = 0.f;
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

// one key against all r_count rows: tiles of 4 rows, vector code when D % 16 == 0
void score_key(const float* const* qr, int64_t r_count, const float* kp, int64_t d,
               float scale, float* scores) {
  int64_t r = 0;
  if (d % 16 == 0) {
    for (; r + 4 <= r_count; r += 4) score_rows<4>(qr + r, kp, d, scale, scores + r * kBlock);
    switch (r_count - r) {
      case 3: score_rows<3>(qr + r, kp, d, scale, scores + r * kBlock); return;
      case 2: score_rows<2>(qr + r, kp, d, scale, scores + r * kBlock); return;
      case 1: score_rows<1>(qr + r, kp, d, scale, scores + r * kBlock); return;
      default: return;
    }
  }
  for (; r < r_count; ++r) scores[r * kBlock] = dot(qr[r], kp, d) * scale;
}

void accumulate_key(float* acc, int64_t r_count, const float* p, const float* vp, int64_t d) {
  int64_t r = 0;
  if (d % 16 == 0) {
    for (; r + 4 <= r_count; r += 4) accumulate_rows<4>(acc + r * d, p + r * kBlock, vp, d);
    switch (r_count - r) {
      case 3: accumulate_rows<3>(acc + r * d, p + r * kBlock, vp, d); return;
      case 2: accumulate_rows<2>(acc + r * d, p + r * kBlock, vp, d); return;
      case 1: accumulate_rows<1>(acc + r * d, p + r * kBlock, vp, d); return;
      default: return;
    }
  }
  for (; r < r_count; ++r)
    for (int64_t i = 0; i < d; ++i) acc[r * d + i] += p[r * kBlock] * vp[i];
}

// Key rows are gathered through kv_indices, which the hardware prefetcher cannot follow:
// ask for the row kAhead keys on while this one is scored.
constexpr int64_t kAhead = 6;

inline void prefetch_row(const float* p, int64_t d) {
  for (int64_t i = 0; i < d; i += 16) __builtin_prefetch(p + i, 0, 3);
}

struct Task {
  const float* q;
  const float* k;
  const float* v;
  const int64_t* rows;     // this segment's query rows
  const int64_t* slots;    // this segment's key slots
  int64_t n_rows, n_keys, hq, hkv, grp, d, h;
  float scale;
  bool causal;  // row i of n sees the first n_keys - n + i + 1 keys (its own is the last)
};

// The online softmax over one block of keys, for all r_count rows of a task.
// Keys [b0, b0 + nb) of the segment.
void block_update(const Task& t, int64_t b0, int64_t nb, const float* const* qr,
                  int64_t r_count, float* scores, float* m, float* l, float* acc) {
  const int64_t* slots = t.slots + b0;
  for (int64_t j = 0; j < nb; ++j) {
    if (j + kAhead < nb) prefetch_row(t.k + (slots[j + kAhead] * t.hkv + t.h) * t.d, t.d);
    score_key(qr, r_count, t.k + (slots[j] * t.hkv + t.h) * t.d, t.d, t.scale, scores + j);
  }
  for (int64_t r = 0; r < r_count; ++r) {
    float* s = scores + r * kBlock;
    // keys of this block the row sees: all, or up to its own position when causal
    const int64_t seen = t.causal
        ? std::clamp<int64_t>(t.n_keys - t.n_rows + r / t.grp + 1 - b0, 0, nb) : nb;
    float bm = kNegInf;
    for (int64_t j = 0; j < seen; ++j) bm = std::max(bm, s[j]);
    const float new_m = std::max(m[r], bm);
    const float alpha = m[r] == kNegInf ? 0.f : std::exp(m[r] - new_m);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < nb; ++j) {
      s[j] = j < seen ? exp_neg(s[j] - new_m) : 0.f;
      sum += s[j];
    }
    l[r] = l[r] * alpha + sum;
    m[r] = new_m;
    if (alpha != 1.f) {
      float* a = acc + r * t.d;
      for (int64_t i = 0; i < t.d; ++i) a[i] *= alpha;
    }
  }
  for (int64_t j = 0; j < nb; ++j) {
    if (j + kAhead < nb) prefetch_row(t.v + (slots[j + kAhead] * t.hkv + t.h) * t.d, t.d);
    accumulate_key(acc, r_count, scores + j, t.v + (slots[j] * t.hkv + t.h) * t.d, t.d);
  }
}

// Heads [h0, h1) of one segment. Per key block, every head of the range in turn: the
// block's K and V rows (all heads of a token are one contiguous row) stay in cache.
void run_task(Task t, int64_t h0, int64_t h1, float* o, float* lse) {
  const int64_t r_count = t.n_rows * t.grp;  // rows per head: (query row i, head j of group)
  const int64_t nh = h1 - h0;
  std::vector<const float*> qr(nh * r_count);
  for (int64_t h = 0; h < nh; ++h)
    for (int64_t i = 0; i < t.n_rows; ++i)
      for (int64_t j = 0; j < t.grp; ++j)
        qr[h * r_count + i * t.grp + j] = t.q + (t.rows[i] * t.hq + (h0 + h) * t.grp + j) * t.d;
  std::vector<float> scores(r_count * kBlock), m(nh * r_count, kNegInf),
      l(nh * r_count, 0.f), acc(nh * r_count * t.d, 0.f);
  for (int64_t b = 0; b < t.n_keys; b += kBlock) {
    const int64_t nb = std::min(kBlock, t.n_keys - b);
    for (int64_t h = 0; h < nh; ++h) {
      t.h = h0 + h;
      block_update(t, b, nb, qr.data() + h * r_count, r_count, scores.data(),
                   m.data() + h * r_count, l.data() + h * r_count,
                   acc.data() + h * r_count * t.d);
    }
  }
  for (int64_t h = 0; h < nh; ++h) {
    for (int64_t r = 0; r < r_count; ++r) {
      const int64_t head = t.rows[r / t.grp] * t.hq + (h0 + h) * t.grp + r % t.grp;
      const int64_t x = h * r_count + r;
      if (l[x] > 0.f) {
        const float inv = 1.f / l[x];
        for (int64_t i = 0; i < t.d; ++i) o[head * t.d + i] = acc[x * t.d + i] * inv;
        lse[head] = m[x] + std::log(l[x]);
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor> paged_attention(
    const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
    const at::Tensor& q_rows, const at::Tensor& q_indptr, const at::Tensor& kv_indptr,
    const at::Tensor& kv_indices, double sm_scale, bool causal) {
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.dim() == 3, "q, k_buf, v_buf: 3-D");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_buf.scalar_type() == at::kFloat &&
                  v_buf.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(q.is_contiguous() && k_buf.is_contiguous() && v_buf.is_contiguous(),
              "contiguous q, k_buf, v_buf");
  for (const at::Tensor* t : {&q_rows, &q_indptr, &kv_indptr, &kv_indices})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1,
                "index tensors: contiguous int64 vectors");
  const int64_t n = q.size(0), hq = q.size(1), d = q.size(2), hkv = k_buf.size(1);
  TORCH_CHECK(k_buf.size(2) == d && v_buf.sizes() == k_buf.sizes() && hq % hkv == 0,
              "k_buf/v_buf [S, Hkv, D] with Hq a multiple of Hkv");
  const int64_t segs = q_indptr.numel() - 1;
  TORCH_CHECK(segs >= 0 && kv_indptr.numel() == segs + 1, "q_indptr, kv_indptr: [G+1]");
  at::Tensor o = at::zeros({n, hq, d}, q.options());
  at::Tensor lse = at::full({n, hq}, kNegInf, q.options());
  const int64_t* qi = q_indptr.data_ptr<int64_t>();
  const int64_t* ki = kv_indptr.data_ptr<int64_t>();
  Task base{q.data_ptr<float>(), k_buf.data_ptr<float>(), v_buf.data_ptr<float>(),
            q_rows.data_ptr<int64_t>(), kv_indices.data_ptr<int64_t>(), 0, 0, hq, hkv,
            hq / hkv, d, 0, static_cast<float>(sm_scale), causal};
  float* op = o.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  // a task is a whole segment (all KV heads) when there are segments enough to keep every
  // thread busy, else one KV head of a segment
  const int64_t split = segs >= 2 * at::get_num_threads() ? 1 : hkv;
  at::parallel_for(0, segs * split, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / split, part = task % split;
      Task t = base;
      t.rows = base.rows + qi[s];
      t.n_rows = qi[s + 1] - qi[s];
      t.slots = base.slots + ki[s];
      t.n_keys = ki[s + 1] - ki[s];
      const int64_t h0 = part * hkv / split, h1 = (part + 1) * hkv / split;
      run_task(t, h0, h1, op, lp);
    }
  });
  return {o, lse};
}

}  // namespace

TORCH_LIBRARY(radixlm_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor q_rows, Tensor q_indptr, "
        "Tensor kv_indptr, Tensor kv_indices, float sm_scale, bool causal) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
