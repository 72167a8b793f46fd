// The AMX path of the CPU attention kernel (amx_attention.cpp): a task's rows in tiles of
// 16, their scores and weighted values multiplied on AMX-BF16 tiles.
#pragma once

#include "attention_task.h"

#include <cstdint>

// Whether this build targets AMX-BF16 and the OS lets this process use its tiles (asked
// for once; false on CPUs without AMX, where paged_attention keeps the FMA path).
bool amx_ready();

// Whether paged_attention takes bf16 rows to amx_task: AMX tiles granted, or a build for
// AVX512-BF16 without AMX, whose products run on VDPBF16PS over the same packing.
bool tiles_ready();

// Heads [h0, h1) of one segment: t.q16 (bfloat16 q) over a bfloat16 pool, d a multiple of
// 32 up to 256. Same contract as the FMA path's run_task (o, lse of the rows; o_init /
// lse_init, window, cap, causal), with q, K, V and the probabilities multiplied as bf16
// (float32 sums): what torch's bf16 attention does.
void amx_task(const Task<BF16>& t, int64_t h0, int64_t h1, float* o, float* lse);

// The least rows per head (query rows x heads of the group) a task needs to take the AMX
// path: below it, packing the keys into tiles costs more than the FMA path's products.
constexpr int64_t kAmxMinRows = 16;
// Without AMX (VDPBF16PS on the packed tiles, AVX512-BF16 alone), measured on AMD Zen 4:
// one thread, 4 segments of 128-2,048 scattered keys, the direct products took 0.78-1.82x
// the FMA path's time at 3-9 rows per head, 0.67-0.86x at 12 (0.63-0.80x at 15, 0.58-0.74x
// at 24), the longer the keys the less they gain.
constexpr int64_t kDirectMinRows = 12;
// and keys: a block of 64 is packed whatever its keys, so a short segment costs about what
// a long one does (32 segments of n rows causal over their own n keys, one thread, direct /
// FMA time: 2.07x at 4, 1.37x at 16, 1.06x at 20, 0.94x at 24, 0.87x at 32, 0.55x at 64)
constexpr int64_t kDirectMinKeys = 24;

inline int64_t tiles_min_rows() { return amx_ready() ? kAmxMinRows : kDirectMinRows; }
inline int64_t tiles_min_keys() { return amx_ready() ? 0 : kDirectMinKeys; }
