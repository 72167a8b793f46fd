// Paged attention on the CPU, reading K and V from the pool in place.
//
// Segment s: query rows q_rows[q_indptr[s] : q_indptr[s+1]] attend to the keys at slots
// kv_indices[kv_indptr[s] : kv_indptr[s+1]] of k_buf / v_buf: all of them, or, with
// causal, row i of n the first n_keys - n + i + 1 (extend: the prefix, then the new tokens,
// whose K/V are stored in the pool before attention). Decode is one
// segment per sequence (its one query row over its whole KV); a shared-prefix group is one
// segment (all its members' rows over the shared slots). A row is in at most one segment.
//
// window W > 0 (sliding-window layers): row i of n stands at key position p = n_keys - n + i
// and sees only keys j > p - W (with causal, p - W < j <= p: transformers' sliding-window
// mask when the keys are consecutive positions of the sequence ending at its rows; only
// differences count, so they may start mid-sequence; the plan passes a window only for such
// segments, never for a shared-prefix group's, whose rows are its members'). cap > 0 (Gemma 2): each score s
// becomes cap * tanh(s / cap) before the softmax; lse is over the capped scores. A tile of
// rows skips a key block none of its rows sees before computing a score: with a window, a
// row costs about W keys whatever the prompt's length; causally, the blocks past the tile.
//
//   q      [N, Hq, D]  float32 or       k_buf, v_buf  [S, Hkv, D]  float32, bfloat16,
//          bfloat16 (AMX tiles where      float16 or float8_e5m2
//          they pay, amx_attention.cpp)
//   o      [N, Hq, D]  float32 (rows in no segment: 0)
//   lse    [N, Hq]     float32 (rows in no segment, or over no keys: -inf)
//
// With o_init / lse_init (an earlier pass over other keys, e.g. a shared prefix's), each
// row's softmax starts from that pass's state (m = lse, l = 1, acc = o): the result is the
// attention over both key sets, merged exactly; rows in no segment keep the initial values.
//
// A task is a piece of a segment (cut_pieces: all its KV heads or one, all its rows or a
// range of them), taken by the threads costliest first; its rows are
// (query row, query head of that KV head), in tiles of up to 4 rows whose accumulators
// stay in registers, so each key row is loaded once per tile of the GQA group. Keys go in
// blocks of kBlock: scores, then an online-softmax update (running max m, sum l,
// accumulator acc). A task visits (block, head) in order; while it works on one, the rows
// of the next visit (the block's next head, or the next block's first) are prefetched into
// L2 (slots are scattered, which the hardware prefetcher cannot follow). One visit ahead
// is enough to hide DRAM latency; prefetching further (the next block of every head, or
// two blocks ahead) was 1.25-1.4x slower over the 12 layers of a bf16 pool of 32 x 512
// scattered tokens (decode_step.py's shape). Head widths 32/64/96/128/256
// have vector variants; others take the scalar path.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "amx_attention.h"
#include "attention_task.h"
#include "kv_load.h"
#include "packed_attention.h"
#include "vec_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kBlock = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The vector path: D = 16 * DC, a tile of RT rows of one head over one block of keys, the
// tile's accumulators held in registers for the whole block. The rows to prefetch meanwhile:
// slots ahead[0:n_ahead) (n_ahead 0: none, or not this tile's job) of the head whose rows
// start at kn / vn. A tile none of whose rows sees a key of the block (causal: the block
// is past them; a window: it is behind them) returns false before computing anything.
template <class KV, int DC, int RT>
bool tile_block(const Task<KV>& t, const typename KV::S* kh, const typename KV::S* vh,
                const int64_t* slots, int64_t b0, int64_t nb, const int64_t* ahead,
                int64_t n_ahead, const typename KV::S* kn, const typename KV::S* vn,
                const float* const* qr, int64_t r0, float* m, float* l, float* acc) {
  constexpr int64_t D = DC * 16;
  // rows' positions grow with r: the tile sees keys [lo(first row), hi(last row))
  if (t.hi(r0 + RT - 1) <= b0 || t.lo(r0) >= b0 + nb) return false;
  const int64_t stride = t.hkv * D;
  float s[RT][kBlock];
  v16 part[RT][16];
  v16 qv[RT][DC];  // the tile's query rows, held in registers over the block
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < DC; ++c) qv[r][c] = load16(qr[r] + c * 16);
  // part[r][j % 16]: key j's 16 lane sums for row r; every 16 keys, their scores into s
  const auto reduce_part = [&](int64_t j) {
    if (j % 16 == 15)
      for (int r = 0; r < RT; ++r) {
        const v16 x = reduce16(part[r]) * t.scale;
        std::memcpy(&s[r][j - 15], &x, sizeof x);
      }
  };
  bool scored = false;
#if defined(__AVX512BF16__)
  // a bf16 q over a bf16 pool (q widened from bf16: exact both ways): the scores on
  // VDPBF16PS, pairs of d multiplied and added in float32 from the key rows as they are
  // (no widening of K), the products the float32 path makes, summed in another order
  if constexpr (std::is_same_v<KV, BF16> && DC % 2 == 0) {
    if (t.q16 != nullptr) {
      __m512bh qp[RT][DC / 2];
      for (int r = 0; r < RT; ++r)
        for (int c = 0; c < DC / 2; ++c) {
          __m512 lo, hi;
          std::memcpy(&lo, &qv[r][2 * c], sizeof lo);
          std::memcpy(&hi, &qv[r][2 * c + 1], sizeof hi);
          qp[r][c] = _mm512_cvtne2ps_pbh(hi, lo);
        }
      for (int64_t j = 0; j < nb; ++j) {
        const uint16_t* kp = kh + slots[j] * stride;
        if (j < n_ahead) prefetch_row<KV>(kn + ahead[j] * stride, D);
        __m512 a[RT];
        for (int r = 0; r < RT; ++r) a[r] = _mm512_setzero_ps();
        for (int c = 0; c < DC / 2; ++c) {
          const __m512bh k = (__m512bh)_mm512_loadu_si512(kp + c * 32);
          for (int r = 0; r < RT; ++r) a[r] = _mm512_dpbf16_ps(a[r], qp[r][c], k);
        }
        for (int r = 0; r < RT; ++r) std::memcpy(&part[r][j % 16], &a[r], sizeof a[r]);
        reduce_part(j);
      }
      scored = true;
    }
  }
#endif
  for (int64_t j = 0; j < (scored ? 0 : nb); ++j) {  // the float32 products
    const typename KV::S* kp = kh + slots[j] * stride;
    if (j < n_ahead) prefetch_row<KV>(kn + ahead[j] * stride, D);
    v16 a[RT] = {};
    for (int c = 0; c < DC; ++c) {
      const v16 k = KV::load(kp + c * 16);
      for (int r = 0; r < RT; ++r) a[r] += qv[r][c] * k;
    }
    for (int r = 0; r < RT; ++r) part[r][j % 16] = a[r];
    reduce_part(j);
  }
  for (int64_t j = nb - nb % 16; j < nb; ++j)
    for (int r = 0; r < RT; ++r) s[r][j] = hsum(part[r][j % 16]) * t.scale;
  v16 o[RT][DC];
  for (int r = 0; r < RT; ++r) {
    if (t.cap > 0.f) soft_cap(s[r], nb, t.cap);
    const int64_t lo = std::clamp<int64_t>(t.lo(r0 + r) - b0, 0, nb);
    const int64_t hi = std::clamp<int64_t>(t.hi(r0 + r) - b0, 0, nb);
    const float alpha = softmax_update(s[r], nb, lo, hi, m[r], l[r]);
    for (int c = 0; c < DC; ++c) o[r][c] = load16(acc + r * D + c * 16) * alpha;
  }
  for (int64_t j = 0; j < nb; ++j) {
    const typename KV::S* vp = vh + slots[j] * stride;
    if (j < n_ahead) prefetch_row<KV>(vn + ahead[j] * stride, D);
    for (int c = 0; c < DC; ++c) {
      const v16 v = KV::load(vp + c * 16);
      for (int r = 0; r < RT; ++r) o[r][c] += s[r][j] * v;
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < DC; ++c) std::memcpy(acc + r * D + c * 16, &o[r][c], sizeof(v16));
  return true;
}

// Rows [r, r_count) of one head in tiles of RT (the last one smaller).
template <class KV, int DC, int RT>
void head_block(const Task<KV>& t, const typename KV::S* kh, const typename KV::S* vh,
                const int64_t* slots, int64_t b0, int64_t nb, const int64_t* ahead,
                int64_t n_ahead, const typename KV::S* kn, const typename KV::S* vn,
                const float* const* qr, int64_t r, int64_t r_count, float* m, float* l,
                float* acc) {
  constexpr int64_t D = DC * 16;
  for (; r + RT <= r_count; r += RT) {
    if (tile_block<KV, DC, RT>(t, kh, vh, slots, b0, nb, ahead, n_ahead, kn, vn, qr + r, r,
                               m + r, l + r, acc + r * D))
      n_ahead = 0;  // the first tile that runs prefetches for all
  }
  if constexpr (RT > 1) {
    if (r < r_count)
      head_block<KV, DC, RT - 1>(t, kh, vh, slots, b0, nb, ahead, n_ahead, kn, vn, qr, r,
                                 r_count, m, l, acc);
  }
}

// The scalar path (D not a multiple of 16, or a width the vector path has no variant for):
// one key at a time, converted to float into a scratch row.
template <class KV>
void generic_block(const Task<KV>& t, const typename KV::S* kh, const typename KV::S* vh,
                   const int64_t* slots, int64_t b0, int64_t nb, const float* const* qr,
                   int64_t r_count, float* m, float* l, float* acc) {
  const int64_t d = t.d, stride = t.hkv * d;
  std::vector<float> scores(r_count * kBlock), row(d);
  for (int64_t j = 0; j < nb; ++j) {
    for (int64_t i = 0; i < d; ++i) row[i] = KV::one(kh + slots[j] * stride + i);
    for (int64_t r = 0; r < r_count; ++r) {
      if (b0 + j < t.lo(r) || b0 + j >= t.hi(r)) continue;  // a key the row does not see
      float x = 0.f;
      for (int64_t i = 0; i < d; ++i) x += qr[r][i] * row[i];
      scores[r * kBlock + j] = x * t.scale;
    }
  }
  for (int64_t r = 0; r < r_count; ++r) {
    float* sr = scores.data() + r * kBlock;
    if (t.cap > 0.f) soft_cap(sr, nb, t.cap);
    const float alpha = softmax_update(sr, nb, std::clamp<int64_t>(t.lo(r) - b0, 0, nb),
                                       std::clamp<int64_t>(t.hi(r) - b0, 0, nb), m[r], l[r]);
    for (int64_t i = 0; i < d; ++i) acc[r * d + i] *= alpha;
  }
  for (int64_t j = 0; j < nb; ++j) {
    for (int64_t i = 0; i < d; ++i) row[i] = KV::one(vh + slots[j] * stride + i);
    for (int64_t r = 0; r < r_count; ++r)
      for (int64_t i = 0; i < d; ++i) acc[r * d + i] += scores[r * kBlock + j] * row[i];
  }
}

// Heads [h0, h1) of one segment. Per key block, every head of the range in turn, each
// visit prefetching the next one's rows (the first visit's are prefetched here).
template <class KV, int DC>
void run_task(const Task<KV>& t, int64_t h0, int64_t h1, float* o, float* lse) {
  const int64_t r_count = t.n_rows * t.grp;  // rows per head: (query row i, head j of group)
  const int64_t nh = h1 - h0, d = t.d;
  std::vector<const float*> qr(nh * r_count);
  std::vector<float> widened(t.q16 != nullptr ? nh * r_count * d : 0);  // a bf16 q's rows
  for (int64_t h = 0; h < nh; ++h)
    for (int64_t i = 0; i < t.n_rows; ++i)
      for (int64_t j = 0; j < t.grp; ++j) {
        const int64_t x = h * r_count + i * t.grp + j;
        const int64_t at = t.head_of(h0 + h, i * t.grp + j) * d;
        if (t.q16 == nullptr) {
          qr[x] = t.q + at;
          continue;
        }
        for (int64_t c = 0; c < d; ++c) widened[x * d + c] = bf16_bits(t.q16[at + c]);
        qr[x] = widened.data() + x * d;
      }
  std::vector<float> m(nh * r_count, kNegInf), l(nh * r_count, 0.f), acc(nh * r_count * d, 0.f);
  for (int64_t h = 0; h < nh; ++h)  // an earlier pass's state, where there is one
    for (int64_t r = 0; r < r_count; ++r) {
      const int64_t x = h * r_count + r;
      t.start(t.head_of(h0 + h, r), m[x], l[x], acc.data() + x * d);
    }
  // the keys some row of the task sees: a window skips the blocks before the first row's,
  // causality those after the last row's (rows' positions grow with r)
  const int64_t k1 = r_count > 0 ? std::min(t.n_keys, t.hi(r_count - 1)) : 0;
  const int64_t k0 = t.grid_start(r_count > 0 ? t.lo(0) : 0, kBlock), kend = t.grid_end(k1);
  for (int64_t j = k0; j < std::min(k0 + kBlock, k1); ++j) {
    prefetch_row<KV>(t.k + (t.slots[j] * t.hkv + h0) * d, d);
    prefetch_row<KV>(t.v + (t.slots[j] * t.hkv + h0) * d, d);
  }
  constexpr int RT = DC == 0 ? 1 : std::max(1, std::min(4, 16 / DC));
  for (int64_t b = k0; b < k1; b += kBlock) {
    const int64_t nb = std::min(kBlock, kend - b);
    for (int64_t h = 0; h < nh; ++h) {
      const bool last = h + 1 == nh;  // next visit: the next block's first head
      const int64_t* ahead = t.slots + (last ? b + kBlock : b);
      const int64_t n_ahead = last ? std::clamp<int64_t>(k1 - b - kBlock, 0, kBlock) : nb;
      const typename KV::S* kn = t.k + (last ? h0 : h0 + h + 1) * d;
      const typename KV::S* vn = t.v + (last ? h0 : h0 + h + 1) * d;
      const typename KV::S* kh = t.k + (h0 + h) * d;
      const typename KV::S* vh = t.v + (h0 + h) * d;
      const float* const* q = qr.data() + h * r_count;
      float *mh = m.data() + h * r_count, *lh = l.data() + h * r_count;
      float* ah = acc.data() + h * r_count * d;
      if constexpr (DC == 0) {
        generic_block<KV>(t, kh, vh, t.slots + b, b, nb, q, r_count, mh, lh, ah);
      } else {
        head_block<KV, DC, RT>(t, kh, vh, t.slots + b, b, nb, ahead, n_ahead, kn, vn, q, 0,
                               r_count, mh, lh, ah);
      }
    }
  }
  for (int64_t h = 0; h < nh; ++h)
    for (int64_t r = 0; r < r_count; ++r) {
      const int64_t x = h * r_count + r;
      t.finish(t.head_of(h0 + h, r), m[x], l[x], acc.data() + x * d, o, lse);
    }
}

// One piece of a call's work: query rows [r0, r1) of segment seg over KV heads [h0, h1),
// and what it costs (the scores it computes, about).
struct Piece {
  int64_t seg, r0, r1, h0, h1;
  double cost;
};

// Rows of a segment below which it is not cut further: enough rows per piece that a key
// block loaded into cache serves several tiles (and AMX gets whole tiles).
constexpr int64_t kMinPieceRows = 32;

// The call's segments cut into pieces for the threads. A segment whose cost is above a
// share of the whole (a long prompt beside decode rows) is cut by KV head and, causally,
// by query rows: rows [r0, r1) of n see exactly what they see in the whole segment when
// the keys past the last one's position are dropped (row i of n stands at n_keys - n + i).
// Without that cut a mixed batch (prompts first, then decode rows) put every prompt on
// the first thread: two threads took as long as one.
template <class KV>
std::vector<Piece> cut_pieces(const Task<KV>& base, const int64_t* qi, const int64_t* ki,
                              int64_t segs, int threads) {
  const int64_t hkv = base.hkv;
  auto row_keys = [&](int64_t s, int64_t i) {  // keys row i of segment s sees (about)
    const int64_t n = qi[s + 1] - qi[s], keys = ki[s + 1] - ki[s];
    const int64_t hi = base.causal ? keys - n + i + 1 : keys;
    return static_cast<double>(base.window > 0 ? std::min(hi, base.window) : hi);
  };
  auto cost = [&](int64_t s, int64_t r0, int64_t r1) {
    double c = 0;
    for (int64_t i = r0; i < r1; ++i) c += row_keys(s, i) + 1;  // + 1: a row's fixed work
    return c;
  };
  std::vector<double> seg_cost(segs);
  double total = 0;
  for (int64_t s = 0; s < segs; ++s) total += seg_cost[s] = cost(s, 0, qi[s + 1] - qi[s]);
  const double share = total / (4.0 * threads);  // pieces about this size balance well
  std::vector<Piece> pieces;
  for (int64_t s = 0; s < segs; ++s) {
    const int64_t n = qi[s + 1] - qi[s];
    // few segments, or a costly one: a piece per KV head
    const int64_t by_head = (segs < 2 * threads || seg_cost[s] > share) ? hkv : 1;
    int64_t by_row = 1;  // causal rows cut too, each piece at least kMinPieceRows
    if ((base.causal || base.window == 0) && seg_cost[s] / by_head > share)
      by_row = std::clamp<int64_t>(static_cast<int64_t>(seg_cost[s] / by_head / share), 1,
                                   std::max<int64_t>(1, n / kMinPieceRows));
    for (int64_t p = 0; p < by_row; ++p) {
      const int64_t r0 = p * n / by_row, r1 = (p + 1) * n / by_row;
      const double c = cost(s, r0, r1) / by_head;
      for (int64_t h = 0; h < by_head; ++h)
        pieces.push_back({s, r0, r1, h * hkv / by_head, (h + 1) * hkv / by_head, c});
    }
  }
  // costliest first, each thread taking the next when it is free: the last to finish
  // are short ones
  std::stable_sort(pieces.begin(), pieces.end(),
                   [](const Piece& a, const Piece& b) { return a.cost > b.cost; });
  return pieces;
}

template <class KV, int DC>
void run_all(const Task<KV>& base, const int64_t* qi, const int64_t* ki, int64_t segs,
             float* op, float* lp) {
  const bool amx = base.q16 != nullptr && base.d % 32 == 0 && base.d <= 256 && tiles_ready();
  const int64_t min_rows = tiles_min_rows(), min_keys = tiles_min_keys();
  const bool packed = packed_on();
  const int threads = at::get_num_threads();
  const std::vector<Piece> pieces = cut_pieces(base, qi, ki, segs, threads);
  const int64_t count = static_cast<int64_t>(pieces.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(threads, count), 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < count;) {
      const Piece& pc = pieces[i];
      const int64_t s = pc.seg, n = qi[s + 1] - qi[s];
      Task<KV> t = base;
      t.rows = base.rows + qi[s];
      t.slots = base.slots + ki[s];
      t.n_keys = ki[s + 1] - ki[s];
      t.n_rows = n;
      if (pc.r1 - pc.r0 < n) {  // a cut: blocks on the whole segment's grid
        t.grid0 = t.lo(0);
        t.grid1 = std::min(t.n_keys, t.hi(n * t.grp - 1));
        t.rows += pc.r0;
        t.n_rows = pc.r1 - pc.r0;
        // rows past r1 dropped: causally, so are the keys only they see
        t.n_keys -= base.causal ? n - pc.r1 : 0;
      }
      if constexpr (std::is_same_v<KV, BF16>) {  // a bf16 q with rows enough: AMX tiles
        if (amx && t.n_rows * t.grp >= min_rows && t.n_keys >= min_keys) {
          amx_task(t, pc.h0, pc.h1, op, lp);
          continue;
        }
      }
      if constexpr (DC > 0) {  // a float32 q with rows and keys enough: the packed path
        if (packed && t.q != nullptr && t.n_rows * t.grp >= kPackedMinRows &&
            t.n_keys >= kPackedMinKeys) {
          packed_task<KV, DC>(t, pc.h0, pc.h1, op, lp);
          continue;
        }
      }
      run_task<KV, DC>(t, pc.h0, pc.h1, op, lp);
    }
  });
}

// The head width picks the vector variant (DC = D / 16), or the scalar one (DC = 0).
template <class KV>
void dispatch_width(const Task<KV>& base, const int64_t* qi, const int64_t* ki, int64_t segs,
                    float* op, float* lp) {
  switch (base.d) {
    case 32: return run_all<KV, 2>(base, qi, ki, segs, op, lp);
    case 64: return run_all<KV, 4>(base, qi, ki, segs, op, lp);
    case 96: return run_all<KV, 6>(base, qi, ki, segs, op, lp);
    case 128: return run_all<KV, 8>(base, qi, ki, segs, op, lp);
    case 256: return run_all<KV, 16>(base, qi, ki, segs, op, lp);
    default: return run_all<KV, 0>(base, qi, ki, segs, op, lp);
  }
}

template <class KV>
void launch(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
            const at::Tensor& q_rows, const at::Tensor& kv_indices, const int64_t* qi,
            const int64_t* ki, int64_t segs, float scale, bool causal, float* op, float* lp,
            const float* o_init, const float* lse_init, int64_t window, float cap) {
  const int64_t hq = q.size(1), hkv = k_buf.size(1);
  const bool wide = q.scalar_type() == at::kFloat;
  const Task<KV> base{wide ? q.data_ptr<float>() : nullptr,
                      wide ? nullptr : static_cast<const uint16_t*>(q.data_ptr()),
                      static_cast<const typename KV::S*>(k_buf.data_ptr()),
                      static_cast<const typename KV::S*>(v_buf.data_ptr()),
                      q_rows.data_ptr<int64_t>(), kv_indices.data_ptr<int64_t>(), 0, 0, hq, hkv,
                      hq / hkv, q.size(2), scale, causal, o_init, lse_init, window, cap};
  dispatch_width<KV>(base, qi, ki, segs, op, lp);
}

// The smallest and largest of x[0:n) (n > 0), in one pass the compiler vectorises.
std::pair<int64_t, int64_t> extent(const int64_t* x, int64_t n) {
  int64_t lo = x[0], hi = x[0];
  for (int64_t i = 1; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  return {lo, hi};
}

// The index tensors name rows of q and slots of the pool: a call whose pointers or
// indices leave them is an error, never a read or write out of bounds. O(segments + rows
// + slots) per call, against the kernel's rows x slots.
void check_indices(const int64_t* qi, const int64_t* ki, int64_t segs, const at::Tensor& q_rows,
                   const at::Tensor& kv_indices, int64_t n, int64_t pool) {
  TORCH_CHECK(qi[0] >= 0 && ki[0] >= 0, "q_indptr and kv_indptr: from 0 up");
  for (int64_t s = 0; s < segs; ++s)
    TORCH_CHECK(qi[s] <= qi[s + 1] && ki[s] <= ki[s + 1],
                "q_indptr and kv_indptr: non-decreasing");
  TORCH_CHECK(qi[segs] <= q_rows.numel(), "q_indptr ends at ", qi[segs], ", past q_rows' ",
              q_rows.numel());
  TORCH_CHECK(ki[segs] <= kv_indices.numel(), "kv_indptr ends at ", ki[segs],
              ", past kv_indices' ", kv_indices.numel());
  if (qi[segs] > qi[0]) {
    const auto [lo, hi] = extent(q_rows.data_ptr<int64_t>() + qi[0], qi[segs] - qi[0]);
    TORCH_CHECK(lo >= 0 && hi < n, "q_rows: rows of q, in [0, ", n, ")");
  }
  if (ki[segs] > ki[0]) {
    const auto [lo, hi] = extent(kv_indices.data_ptr<int64_t>() + ki[0], ki[segs] - ki[0]);
    TORCH_CHECK(lo >= 0 && hi < pool, "kv_indices: slots of the pool, in [0, ", pool, ")");
  }
}

std::tuple<at::Tensor, at::Tensor> paged_attention(
    const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
    const at::Tensor& q_rows, const at::Tensor& q_indptr, const at::Tensor& kv_indptr,
    const at::Tensor& kv_indices, double sm_scale, bool causal,
    const c10::optional<at::Tensor>& o_init, const c10::optional<at::Tensor>& lse_init,
    int64_t window, double logit_cap) {
  TORCH_CHECK(window >= 0 && logit_cap >= 0, "window and logit_cap: >= 0 (0: none)");
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.dim() == 3, "q, k_buf, v_buf: 3-D");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "q: float32 or bfloat16");
  TORCH_CHECK(v_buf.scalar_type() == k_buf.scalar_type(), "k_buf and v_buf: one dtype");
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
  TORCH_CHECK(o_init.has_value() == lse_init.has_value(), "o_init and lse_init: both or none");
  const bool init = o_init.has_value();
  if (init)
    TORCH_CHECK(o_init->scalar_type() == at::kFloat && lse_init->scalar_type() == at::kFloat &&
                    o_init->is_contiguous() && lse_init->is_contiguous() &&
                    o_init->sizes() == q.sizes() && lse_init->sizes() == at::IntArrayRef({n, hq}),
                "o_init [N, Hq, D] and lse_init [N, Hq]: contiguous float32");
  const int64_t* qi = q_indptr.data_ptr<int64_t>();
  const int64_t* ki = kv_indptr.data_ptr<int64_t>();
  check_indices(qi, ki, segs, q_rows, kv_indices, n, k_buf.size(0));
  // rows in no segment keep the initial state (an earlier pass's o and lse), or 0 / -inf
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor o = init ? o_init->clone() : at::zeros({n, hq, d}, f32);
  at::Tensor lse = init ? lse_init->clone() : at::full({n, hq}, kNegInf, f32);
  const float* oi = init ? o_init->data_ptr<float>() : nullptr;
  const float* li = init ? lse_init->data_ptr<float>() : nullptr;
  float* op = o.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const float scale = static_cast<float>(sm_scale);
  const auto run = [&](auto kv) {  // kv: the pool dtype's loader (kv_load.h)
    launch<decltype(kv)>(q, k_buf, v_buf, q_rows, kv_indices, qi, ki, segs, scale, causal, op,
                         lp, oi, li, window, static_cast<float>(logit_cap));
  };
  switch (k_buf.scalar_type()) {
    case at::kFloat: run(F32{}); break;
    case at::kBFloat16: run(BF16{}); break;
    case at::kHalf: run(F16{}); break;
    case at::kFloat8_e5m2: run(E5M2{}); break;
    default:
      TORCH_CHECK(false, "k_buf/v_buf: float32, bfloat16, float16 or float8_e5m2, got ",
                  k_buf.scalar_type());
  }
  return {o, lse};
}

}  // namespace

TORCH_LIBRARY(radixlm_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor q_rows, Tensor q_indptr, "
        "Tensor kv_indptr, Tensor kv_indices, float sm_scale, bool causal, "
        "Tensor? o_init=None, Tensor? lse_init=None, int window=0, float logit_cap=0.0) "
        "-> (Tensor, Tensor)");
  m.def("amx_ready() -> bool", &amx_ready);  // no tensors: a catch-all kernel
  m.def("bf16_tiles_ready() -> bool", &tiles_ready);
  m.def("bf16_tiles_min_rows() -> int", &tiles_min_rows);
  m.def("bf16_tiles_min_keys() -> int", &tiles_min_keys);
  m.def("packed_on() -> bool", &packed_on);
  m.def("packed_min_rows() -> int", [] { return kPackedMinRows; });
  m.def("packed_min_keys() -> int", [] { return kPackedMinKeys; });
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
