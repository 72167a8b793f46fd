// One task of the CPU attention kernel: a segment's query rows over its key slots, with
// the options of the call (paged_attention.cpp's FMA path, amx_attention.cpp's AMX path).
#pragma once

#include "kv_load.h"

#include <algorithm>
#include <cstdint>

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

  // the keys [lo, hi) of the segment that row r (of a head) sees: row i of n is at key
  // position n_keys - n + i (decode: its one row is the last key; extend: the new tokens
  // are the last n keys), and a window keeps the `window` positions ending there
  int64_t lo(int64_t r) const {
    return window > 0 ? std::max<int64_t>(0, n_keys - n_rows + r / grp + 1 - window) : 0;
  }
  int64_t hi(int64_t r) const { return causal ? n_keys - n_rows + r / grp + 1 : n_keys; }
};
