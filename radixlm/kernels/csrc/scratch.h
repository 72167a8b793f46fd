// Per-thread scratch buffers of the CPU attention's packed paths (amx_attention.cpp,
// packed_attention.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <new>

// 64-byte aligned scratch (tile loads and stores of whole cache lines), one per thread and
// purpose, kept between calls: a fresh allocation of this size each call would be mapped
// anew (glibc maps blocks over 128 KiB) and fault in every page again.
template <class T, int Purpose>
T* scratch(int64_t n) {
  struct Buffer {
    void* p = nullptr;
    size_t bytes = 0;
    ~Buffer() { std::free(p); }
  };
  thread_local Buffer b;
  const size_t bytes = ((std::max<int64_t>(n, 1) * sizeof(T) + 63) / 64) * 64;
  if (bytes > b.bytes) {
    std::free(b.p);
    b.p = std::aligned_alloc(64, bytes);
    if (b.p == nullptr) throw std::bad_alloc();
    b.bytes = bytes;
  }
  return static_cast<T*>(b.p);
}
