// One task of the CPU attention kernel: a segment's query rows over its key slots, with
// the options of the call (paged_attention.cpp's FMA path, amx_attention.cpp's AMX path).
#pragma once

#include "kv_load.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

template <class KV>
struct Task {
  const float* q;          // [N, Hq, D] float32, or null when q16 is given
  const uint16_t* q16;     // [N, Hq, D] bfloat16 (its bits), or null
  const typename KV::S* k;
  const typename KV::S* v;
  const int64_t* rows;     // this segment's query rows
  const int64_t* slots;    // this segment's key slots
  int64_t n_rows, n_keys, hq, hkv, grp, d;
  float scale;
  bool causal;  // row i of n sees the first n_keys - n + i + 1 keys (its own is the last)
  // where a row's softmax starts (o, lse of an earlier pass over other keys; null: empty)
  const float* o_init = nullptr;
  const float* lse_init = nullptr;
  int64_t window = 0;  // > 0: row i of n sees only keys j > n_keys - n + i - window
  float cap = 0.f;     // > 0: scores become cap * tanh(score / cap)
  // a piece of a segment (its rows cut for the threads): the segment's first key block
  // start and last block end (-1: this task's own), so that key blocks fall where they
  // fall in the whole segment and every score and softmax sum is computed as it is there
  int64_t grid0 = -1, grid1 = -1;

  // where the task's blocks of `block` keys start (k0: its first row's first key) and
  // where its last block ends (k1: its last row's last key)
  int64_t grid_start(int64_t k0, int64_t block) const {
    return grid0 < 0 ? k0 : grid0 + (k0 - grid0) / block * block;
  }
  int64_t grid_end(int64_t k1) const { return grid1 < 0 ? k1 : grid1; }

  // the keys [lo, hi) of the segment that row r (of a head) sees: row i of n is at key
  // position n_keys - n + i (decode: its one row is the last key; extend: the new tokens
  // are the last n keys), and a window keeps the `window` positions ending there
  int64_t lo(int64_t r) const {
    return window > 0 ? std::max<int64_t>(0, n_keys - n_rows + r / grp + 1 - window) : 0;
  }
  int64_t hi(int64_t r) const { return causal ? n_keys - n_rows + r / grp + 1 : n_keys; }

  // the (query row, head) of row r of KV head h: its index in q, o ([N, Hq]) and lse
  int64_t head_of(int64_t h, int64_t r) const {
    return rows[r / grp] * hq + h * grp + r % grp;
  }

  // a row's online-softmax state at the start (m, l, acc[d] already empty: -inf, 0, 0):
  // an earlier pass's normalised o with m = its lse and l = 1, where there is one
  void start(int64_t head, float& m, float& l, float* acc) const {
    if (lse_init == nullptr || lse_init[head] == -std::numeric_limits<float>::infinity()) return;
    m = lse_init[head];
    l = 1.f;
    std::memcpy(acc, o_init + head * d, d * sizeof(float));
  }

  // a row's result from its state; a row that saw no key keeps the initial o and lse
  void finish(int64_t head, float m, float l, const float* acc, float* o, float* lse) const {
    if (!(l > 0.f)) return;
    const float inv = 1.f / l;
    for (int64_t i = 0; i < d; ++i) o[head * d + i] = acc[i] * inv;
    lse[head] = m + std::log(l);
  }
};
