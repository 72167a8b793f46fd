// The packed float32 path of the CPU attention kernel (packed_attention.cpp): a float32 q
// over any pool dtype, for tasks with rows enough per KV head (extend chunks, shared-prefix
// groups; on AVX2 decode steps too). Each block of 64 keys is widened and transposed once
// per (task, head) into K^T [d][64], then every tile of 3-6 rows (the head's rows in
// tiles as even as they divide: 7 as 3 + 4; fewer than 3 padded to 3) takes its RT x 64
// scores as outer products (q's element broadcast times 16 keys' elements: no lane sums)
// and its values from the rows in place, its accumulators in registers. The FMA path
// (paged_attention.cpp: tiles of 4 rows, each key's 16 lane sums reduced) is left to short
// tasks on AVX-512, where packing a block costs more than it saves.
#pragma once

#include "attention_task.h"

#include <cstdint>

// Whether paged_attention takes the path: a build with AVX-512 (a tile keeps 28 vectors in
// registers) or AVX2 and FMA (16 keys or 16 of d per pass: 15 of the 16 registers), unless
// RADIXLM_CPU_PACKED=0 (read once) keeps every float32 q on the FMA path.
bool packed_on();

// Heads [h0, h1) of one segment with a float32 q (t.q), d = 16 * DC. Same contract as the
// FMA path's run_task: o, lse of the rows; o_init / lse_init, window, cap, causal.
template <class KV, int DC>
void packed_task(const Task<KV>& t, int64_t h0, int64_t h1, float* o, float* lse);

// The least rows per head (query rows x heads of the group) and keys a task needs to take
// the packed path (benchmarks/packed_attention.py: 2 threads, 32 segments of scattered keys,
// heads of 64 in groups of 6, causal or not; packed / FMA time). AVX-512, on AMD Zen 4:
// 0.97-1.02x at 6 rows per head (one tile: nothing to share a packed block with),
// 0.85-0.92x at 12 over 64-512 keys, 0.79-0.86x at 24, 0.77-0.80x at 48; over 32 keys
// 1.08-1.15x slower at every row count (a block is scored as 64 keys whatever it holds).
// AVX2, on AMD Zen 3, where the FMA path's tiles of 16-float vectors do not fit the 16
// registers and live on the stack: 0.30-0.45x at 6 rows per head over 32-512 keys,
// 0.15-0.34x at 12-48 rows; at 3 (a decode step of the small preset, 12 / 4 heads) the
// engine's decode attention over cpu_time_split.py's unique workload took 1.63 s in tiles
// of 6 (half of each padding) and 1.35 in tiles of 3, against 2.16: every task takes it.
#if defined(__AVX512F__)
constexpr int64_t kPackedMinRows = 12;
constexpr int64_t kPackedMinKeys = 48;
#else
constexpr int64_t kPackedMinRows = 1;
constexpr int64_t kPackedMinKeys = 1;
#endif
