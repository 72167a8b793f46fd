// The KV pool's write: each new token's K and V rows copied into its slot, in one call
// for both buffers (torch's k_buf[loc] = k runs an index_put per buffer, whose per-element
// iterator costs ~100x a row copy at decode sizes).
//
//   store_kv(k_buf [S,Hkv,D], v_buf [S,Hkv,D], loc [N] int64, k [N,Hkv,D], v [N,Hkv,D])
//
// k_buf and v_buf: one dtype; each slot's [Hkv, D] block contiguous (the slot stride may
// be anything). k, v: the buffers' dtype, or float32 into a bfloat16 pool (rounded to
// nearest even, as torch's .to(bfloat16)); each token's block contiguous, rows strided
// (v is usually a view of the fused qkv projection). Every slot is checked against S
// before anything is written. Rows are split across threads only for long extends.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kGrainRows = 256;

bool rows_contiguous(const at::Tensor& t) {
  return t.dim() == 3 && t.stride(2) == 1 && (t.size(1) == 1 || t.stride(1) == t.size(2));
}

// float32 -> bfloat16, round to nearest even; NaN stays a quiet NaN (torch's conversion)
inline uint16_t to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  if (f != f) return 0x7FC0;
  return static_cast<uint16_t>((b + (((b >> 16) & 1u) + 0x7FFFu)) >> 16);
}

void copy_rows(const at::Tensor& buf, const at::Tensor& src, const int64_t* slots) {
  const int64_t n = src.size(0), row = src.size(1) * src.size(2);
  const int64_t bs = buf.stride(0), ss = src.stride(0);
  const bool same = buf.scalar_type() == src.scalar_type();
  const int64_t esz = buf.element_size(), grain = n * row > 65536 ? kGrainRows : n;
  char* bp = static_cast<char*>(buf.data_ptr());
  const char* sp = static_cast<const char*>(src.data_ptr());
  at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      char* dst = bp + slots[i] * bs * esz;
      const char* s = sp + i * ss * src.element_size();
      if (same) {
        std::memcpy(dst, s, row * esz);
      } else {  // float32 -> bfloat16
        const float* f = reinterpret_cast<const float*>(s);
        uint16_t* o = reinterpret_cast<uint16_t*>(dst);
        for (int64_t j = 0; j < row; ++j) o[j] = to_bf16(f[j]);
      }
    }
  });
}

void store_kv(at::Tensor k_buf, at::Tensor v_buf, const at::Tensor& loc, const at::Tensor& k,
              const at::Tensor& v) {
  TORCH_CHECK(rows_contiguous(k_buf) && k_buf.sizes() == v_buf.sizes() &&
                  k_buf.strides() == v_buf.strides() &&
                  k_buf.scalar_type() == v_buf.scalar_type(),
              "k_buf, v_buf: one [S, Hkv, D] layout and dtype, each slot contiguous");
  TORCH_CHECK(loc.dim() == 1 && loc.is_contiguous() && loc.scalar_type() == at::kLong,
              "loc: contiguous int64 [N]");
  const int64_t n = loc.size(0), slots = k_buf.size(0);
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(rows_contiguous(*t) && t->size(0) == n && t->size(1) == k_buf.size(1) &&
                    t->size(2) == k_buf.size(2),
                "k, v: [N, Hkv, D] with each token's block contiguous");
    TORCH_CHECK(t->scalar_type() == k_buf.scalar_type() ||
                    (t->scalar_type() == at::kFloat && k_buf.scalar_type() == at::kBFloat16),
                "k, v: the pool's dtype, or float32 into a bfloat16 pool");
  }
  const int64_t* lp = loc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(lp[i] >= 0 && lp[i] < slots, "slot ", lp[i], " outside the pool [0, ", slots,
                ")");
  copy_rows(k_buf, k, lp);
  copy_rows(v_buf, v, lp);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixlm_cpu, m) {
  m.def("store_kv(Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor loc, Tensor k, Tensor v) -> ()");
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) { m.impl("store_kv", &store_kv); }
