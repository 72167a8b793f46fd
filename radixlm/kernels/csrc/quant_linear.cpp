// y = x W^T (+ bias) by a quantized weight (kernels/qweight.py's w4, w8, fp8), packed by
// kernels/quant_linear.py into panels of 16 output rows. A decode step reads every weight
// once, so its time is the bytes read: 4-bit codes are a quarter of bf16's, 8-bit half.
//
//   quant_linear(x [M, K] f32|bf16, data, scales, mins?, zeros?, rowf, kind, n, block,
//                bias?, y [M, N] in x's dtype, written)
//   quant_dequant(data, scales, mins?, zeros?, rowf, kind, n, k, block, row0, row1, dtype)
//       -> W rows [rows, K] in dtype (float32 or bfloat16), for the prefill path
//   quant_pack(data, scales, mins?, zeros?, kind, n, k, group, block)
//       -> (data, scales, mins, zeros, rowf)
//   quant_linear_isa() -> int      w4 / w8: 2 AVX512-VNNI, 1 AVX2, 0 plain C++
//   quant_linear_fp8_isa() -> int  fp8 / w8wo: 2 AVX512-BF16 + VBMI, 1 AVX2 (FMAs), 0 plain
//
// Kinds: 0 w4, 1 w8 (x rounded to int8), 2 fp8, 3 w8wo: weight-only int8 (codes -127..127
// as sign and magnitude bytes, multiplied exactly as bf16 by x in bf16, as fp8 is), 4 w6:
// w8 codes in -32..31 (GGUF Q6_K's, Q5_K's) in six bits, multiplied as w8's.
//
// The layout (P = ceil(N / 16) panels, B = block: 32, or 16 for groups of 16; nb = Kpad / B):
//   data    uint8 [P][nb][chunks][64]: a chunk holds 4 consecutive columns of 16 rows,
//           w8: [row][col] bytes q + 128 (B/4 chunks), w4: [row][col] nibbles, the low one
//           of the block's first half, the high one of its second (B/8 chunks), w6: q + 32
//           as w4's nibbles of its low 4 bits, then B/16 chunks of its bits 4-5, four codes
//           a byte (w6_high_byte), fp8: the code bytes in the order unpacklo/hi_epi8 of two
//           lookups leaves them (below).
//   scales  fp16 [P][nb][16]: the block's group scale / rowf, mins (optional) the same;
//   zeros   int8 [P][nb][16] (optional, w4 / w8, instead of mins): integer zero points z,
//           W = (q - z) * scale, where every offset of the weight is -z * scale exactly
//           (GGUF Q4_0's -8 d, AWQ / GPTQ zeros): subtracted as integers (below);
//   rowf    float32 [P * 16]: per row max |scale|, |min| (fp16 then holds them in [-1, 1]).
//   Coded scales (w4 / w6 / w8 without zero points, where quant_pack finds them): scales
//           and mins hold int8 codes [P][nb][16] and factors fp16 [P][nsb][2][16] (per 256
//           columns: the scales', the mins'; relative to rowf), scale = code * factor, as
//           GGUF's k-quants store theirs (Q4_K: 0.578 bytes a weight, not 0.625).
//
// w4 / w6 / w8 (llama.cpp's scheme): x is quantized per 32 columns to int8 (d = amax / 127);
// a block's integer dot products use vpdpbusd (u8 weights x s8 x, 16 rows in the lanes,
// 4 columns a step, x's 4 bytes broadcast), no horizontal sums. w8's unsigned q + 128
// adds 128 * sum(xq), taken out by starting the sum at -128 * sum(xq) (w6: q + 32, its
// two high bits put back beside the nibble by shifts and a ternary-logic merge); zero points
// start it at -z * sum(xq) too, so a block's sum is sum((q - z) xq), exact, before it goes
// to float, times scale * d; float mins add min * sum(q d) (x's sum as rounded, so that
// q s + min multiplies one x, as llama.cpp's k-quant dots use their bsums).
// fp8: two 128-entry byte lookups (vpermt2b) give the high and low bytes of the code's
// bf16 (exact: zero, denormals and NaN too), interleaved, then vdpbf16ps with x in bf16;
// on AVX2 the code's bits placed as an fp16's, widened by F16C, FMAs with float32 x.
// w8wo is the same kernel with other tables (the bf16 of magnitudes 0-127: exact) and on
// AVX2 the magnitude given its sign and widened to float.
// Threads take panels; x's rows go in blocks of up to 8 (4 for fp8) per pass of a panel.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define QL_AVX512 1
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define QL_FP8_AVX512 1
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QL_AVX2 1
#endif

namespace {

constexpr int64_t kPanel = 16;   // output rows per panel (one zmm of int32 / float lanes)
constexpr int64_t kXBlock = 32;  // columns of x per int8 scale
constexpr int64_t kSuper = 256;  // columns per factor of coded scales (GGUF's super-block)
enum Kind : int64_t { kW4 = 0, kW8 = 1, kFP8 = 2, kW8WO = 3, kW6 = 4 };

// The kinds multiplied in bf16 (x rounded to bf16; codes widened by table lookups).
inline bool bf16_kind(int64_t kind) { return kind == kFP8 || kind == kW8WO; }

// Offsets of an integer kernel: none, float mins, integer zero points.
enum Ofs : int { kNone = 0, kMins = 1, kZeros = 2 };

// Bytes of a block of one panel.
inline int64_t block_bytes(int64_t kind, int64_t block) {
  const int64_t bits = kind == kW4 ? 4 : kind == kW6 ? 6 : 8;
  return block * kPanel * bits / 8;
}

// w6: the bit of a block's high-bits region where the code at (row r, stored column c) keeps
// its bits 4-5: chunk (c % (B/2)) / 8 of the region, byte 4 r + c % 4, bits 2 * slot (slot:
// the low-nibble chunk's parity, then which half of the block the column is in).
inline int64_t w6_high_byte(int64_t block, int r, int64_t c) {
  return block * kPanel / 2 + ((c % (block / 2)) / 8) * 64 + r * 4 + c % 4;
}
inline int w6_high_shift(int64_t block, int64_t c) {
  return 2 * (2 * (((c % (block / 2)) / 4) % 2) + (c >= block / 2 ? 1 : 0));
}

// fp8 e4m3fn code -> its value (exact in float32 and in bf16).
float fp8_value(uint8_t code) {
  const int mag = code & 0x7F, e = mag >> 3, m = mag & 7;
  float v = mag == 0x7F ? NAN : e == 0 ? std::ldexp(float(m), -9) : std::ldexp(8.f + m, e - 10);
  return code & 0x80 ? -v : v;
}

// w8wo's byte (sign bit, 7-bit magnitude) -> its value.
float int7_value(uint8_t code) { return code & 0x80 ? -float(code & 0x7F) : float(code); }

// The value of every code of a bf16 kind (built once).
const float* code_table(int64_t kind) {
  static const auto tables = [] {
    std::array<float, 512> t{};
    for (int c = 0; c < 256; ++c) {
      t[c] = fp8_value(uint8_t(c));
      t[256 + c] = int7_value(uint8_t(c));
    }
    return t;
  }();
  return tables.data() + (kind == kW8WO ? 256 : 0);
}

// Position inside a 64-byte fp8 chunk of (row r, column c of 4): unpacklo_epi8 takes bytes
// 0-7 of each 128-bit lane, unpackhi 8-15, and a bf16 pair's f32 lane is its row.
inline int fp8_pos(int r, int c) { return 16 * (r / 4) + (c >= 2 ? 8 : 0) + (r % 4) * 2 + c % 2; }

// The packed weight and its shape, as the kernels read it.
struct Weight {
  const uint8_t* data;
  const c10::Half* scales;  // fp16 scales (null: coded scales, below)
  const c10::Half* mins;    // fp16 offsets (null: none, or coded)
  const int8_t* zeros;      // null: no integer zero points
  const float* rowf;
  int64_t kind, n, kpad, block, nb, panels;
  // coded scales (integer kinds whose block scales are small integer multiples of one
  // factor per 256 columns, as GGUF k-quants store them): int8 codes [P][nb][16] of the
  // scales and offsets, and fp16 factors [P][nsb][2][16] (scale's, offset's; relative to
  // rowf): scale = code * factor
  const int8_t* scodes = nullptr;
  const int8_t* mcodes = nullptr;  // null: no offsets (with scodes)
  const c10::Half* factors = nullptr;

  const uint8_t* panel(int64_t p) const { return data + p * nb * block_bytes(kind, block); }
  // The code at row r of a panel's block, column c (stored order), zero point not taken.
  float code(const uint8_t* wb, int r, int64_t c) const {
    if (kind == kW8) return float(int(wb[(c / 4) * 64 + r * 4 + c % 4]) - 128);
    if (kind == kW4 || kind == kW6) {
      const int64_t half = c / (block / 2), cc = c % (block / 2);
      const uint8_t b = wb[(cc / 4) * 64 + r * 4 + cc % 4];
      const int lo = half ? b >> 4 : b & 15;
      if (kind == kW4) return float(lo);
      const int hi = (wb[w6_high_byte(block, r, c)] >> w6_high_shift(block, c)) & 3;
      return float(lo + 16 * hi - 32);  // w6 stores q + 32
    }
    return code_table(kind)[wb[(c / 4) * 64 + fp8_pos(r, int(c % 4))]];
  }
  // Block b's zero points of panel p (16 rows), or null.
  const int8_t* zero_points(int64_t p, int64_t b) const {
    return zeros ? zeros + (p * nb + b) * kPanel : nullptr;
  }
  bool offsets() const { return mins || mcodes; }
  // blocks a factor of the coded scales covers, and the factors' rows (two per panel)
  int64_t super_blocks() const { return kSuper / block; }
  const c10::Half* factor_row(int64_t p, int64_t b) const {
    const int64_t nsb = (nb + super_blocks() - 1) / super_blocks();
    return factors + (p * nsb + b / super_blocks()) * 2 * kPanel;
  }
  // Block b's scale and offset of row r of panel p, relative to rowf.
  float scale(int64_t p, int64_t b, int r) const {
    const int64_t i = (p * nb + b) * kPanel + r;
    return scodes ? float(scodes[i]) * float(factor_row(p, b)[r]) : float(scales[i]);
  }
  float offset(int64_t p, int64_t b, int r) const {
    const int64_t i = (p * nb + b) * kPanel + r;
    return mcodes ? float(mcodes[i]) * float(factor_row(p, b)[kPanel + r])
                  : mins ? float(mins[i]) : 0.f;
  }
};

// x quantized per xblock columns (w4 / w6 / w8): codes, scales, and per block of B the
// codes' sum (w8's correction), x's float sum (the offsets' term of the float paths) and
// its sum as rounded (the integer paths'). xblock is 32, or 256 (kSuper) for a weight with
// coded scales on AVX-512: one x scale a super-block lets its blocks' integer sums times
// their integer scale codes add up exactly before one conversion to float (as llama.cpp's
// k-quant dots meet Q8_K's x).
struct XQuant {
  std::vector<int8_t> q;
  std::vector<float> d, fsum;
  std::vector<int32_t> qsum;
  int64_t kpad, nb;
  int64_t xblock, nx;  // x's columns per scale, scales per row (d is [M][nx])
  // x's sum as rounded (sum of q * d) per block: the float offsets' term of the integer
  // paths, so that (q s + min) multiplies one x, as llama.cpp's k-quant dots do (its bsums)
  std::vector<float> rsum;
};

#if defined(QL_AVX512)
// 16 of x from column c of a row (float or bf16, widened exactly), zero at and past k.
inline __m512 load_x16(const float* xr, int64_t c, int64_t k) {
  const __mmask16 m = c + 16 <= k ? __mmask16(0xFFFF)
                      : c >= k    ? __mmask16(0)
                                  : __mmask16((1u << (k - c)) - 1);
  return _mm512_maskz_loadu_ps(m, xr + c);
}
inline __m512 load_x16(const c10::BFloat16* xr, int64_t c, int64_t k) {
  const __mmask16 m = c + 16 <= k ? __mmask16(0xFFFF)
                      : c >= k    ? __mmask16(0)
                                  : __mmask16((1u << (k - c)) - 1);
  const __m256i h = _mm256_maskz_loadu_epi16(m, xr + c);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// One row of quantize_x, 16 columns a step: the same codes as the scalar loop (the
// product x * (127 / amax) rounded to nearest even, in float32), the sums per block of B
// (16 or 32) columns in another order (qsum exact; rsum d * qsum, one rounding).
template <class T>
void quantize_row(const T* xr, int64_t k, int64_t kpad, int64_t block, int64_t xblock,
                  int8_t* q, float* d, int32_t* qsum, float* fsum, float* rsum) {
  const __m512 lim = _mm512_set1_ps(127.f);
  float amax = 0.f;
  for (int64_t c0 = 0; c0 < kpad; c0 += kXBlock) {
    if (c0 % xblock == 0) {  // a new scale: the largest |x| of its columns
      __m512 m = _mm512_setzero_ps();
      for (int64_t c = c0; c < std::min(c0 + xblock, kpad); c += 16)
        m = _mm512_max_ps(m, _mm512_abs_ps(load_x16(xr, c, k)));
      amax = _mm512_reduce_max_ps(m);
      d[c0 / xblock] = amax / 127.f;
    }
    const __m512 a = load_x16(xr, c0, k), b = load_x16(xr, c0 + 16, k);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m512 vinv = _mm512_set1_ps(inv), nlim = _mm512_set1_ps(-127.f);
    // round to nearest even (the default mode), then clamp as the scalar loop
    const __m512i qa = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(
        _mm512_roundscale_ps(_mm512_mul_ps(a, vinv), _MM_FROUND_TO_NEAREST_INT), lim), nlim));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(
        _mm512_roundscale_ps(_mm512_mul_ps(b, vinv), _MM_FROUND_TO_NEAREST_INT), lim), nlim));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + c0), _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + c0 + 16), _mm512_cvtepi32_epi8(qb));
    const int32_t sa = _mm512_reduce_add_epi32(qa), sb = _mm512_reduce_add_epi32(qb);
    const float fa = _mm512_reduce_add_ps(a), fb = _mm512_reduce_add_ps(b);
    const float dd = amax / 127.f;
    if (block == 16) {
      const int64_t i = c0 / 16;
      qsum[i] = sa, qsum[i + 1] = sb, fsum[i] = fa, fsum[i + 1] = fb;
      rsum[i] = float(sa) * dd, rsum[i + 1] = float(sb) * dd;
    } else {
      const int64_t i = c0 / 32;
      qsum[i] = sa + sb, fsum[i] = fa + fb, rsum[i] = float(sa + sb) * dd;
    }
  }
}
#endif

template <class T>  // float or c10::BFloat16 (widened as read: exact)
XQuant quantize_x(const T* x, int64_t m, int64_t k, int64_t kpad, int64_t block,
                  int64_t xblock = kXBlock) {
  const int64_t nx = (kpad + xblock - 1) / xblock;
  XQuant xq{std::vector<int8_t>(m * kpad, 0), std::vector<float>(m * nx, 0.f),
            std::vector<float>(m * kpad / block, 0.f), std::vector<int32_t>(m * kpad / block, 0),
            kpad, kpad / block, xblock, nx, std::vector<float>(m * kpad / block, 0.f)};
  at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * k;
#if defined(QL_AVX512)
      quantize_row(xr, k, kpad, block, xblock, xq.q.data() + r * kpad, xq.d.data() + r * nx,
                   xq.qsum.data() + r * xq.nb, xq.fsum.data() + r * xq.nb,
                   xq.rsum.data() + r * xq.nb);
      continue;
#endif
      for (int64_t c0 = 0; c0 < kpad; c0 += xblock) {
        const int64_t c1 = std::min(c0 + xblock, k);
        float amax = 0.f;
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(float(xr[c])));
        const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        xq.d[r * nx + c0 / xblock] = d;
        for (int64_t c = c0; c < c1; ++c) {
          const int v = int(std::nearbyint(float(xr[c]) * inv));
          xq.q[r * kpad + c] = int8_t(std::clamp(v, -127, 127));
          xq.qsum[r * xq.nb + c / block] += xq.q[r * kpad + c];
          xq.fsum[r * xq.nb + c / block] += float(xr[c]);
        }
        for (int64_t b = c0 / block; b < (c1 + block - 1) / block && b < xq.nb; ++b)
          xq.rsum[r * xq.nb + b] = float(xq.qsum[r * xq.nb + b]) * d;
      }
    }
  });
  return xq;
}

// ---------------------------------------------------------------- plain C++ (any CPU)
// Rows [i0, i1) of x (float32, unquantized) by panel p: y[i][16 p + r] (before rowf).
void panel_plain(const Weight& w, int64_t p, const float* x, int64_t k, int64_t i0, int64_t i1,
                 float* y, int64_t ldy) {
  const uint8_t* wp = w.panel(p);
  for (int64_t i = i0; i < i1; ++i) {
    float acc[kPanel] = {0};
    for (int64_t b = 0; b < w.nb; ++b) {
      const uint8_t* wb = wp + b * block_bytes(w.kind, w.block);
      const int8_t* z = w.zero_points(p, b);
      const int64_t c1 = std::min(w.block, k - b * w.block);
      for (int r = 0; r < kPanel; ++r) {
        float dot = 0.f, xs = 0.f;
        const float zr = z ? float(z[r]) : 0.f;
        for (int64_t c = 0; c < c1; ++c) {
          const float xv = x[i * k + b * w.block + c];
          dot += (w.code(wb, r, c) - zr) * xv;  // q - z: exact
          xs += xv;
        }
        acc[r] += dot * w.scale(p, b, r) + w.offset(p, b, r) * xs;
      }
    }
    std::memcpy(y + i * ldy + p * kPanel, acc, sizeof(acc));
  }
}

#if defined(QL_AVX512)
// ---------------------------------------------------------------- AVX512-VNNI
// Rows [i0, i0 + R) of quantized x by panel p, y before rowf. NA: integer accumulators per
// row (4 at one row, 2 at two: shorter chains of dependent vpdpbusd; more rows interleave).
// BITS: 4 (w4), 6 (w6: w4's nibbles and a region of high bits) or 8 (w8); SC: coded scales,
// x quantized per super-block (xq.xblock 256): a block's sum times its scale code (and
// x's block sum times its offset code) add up as integers over the super-block, then one
// conversion and one FMA each per row (per block, a float epilogue would cost a third of
// the vpdpbusd's issue slots). Exact: |sum| < 2^31 (w4: 8 blocks of 32 * 15 * 127 * 63).
template <int R, int BITS, int OFS, int B, bool SC>
void panel_vnni(const Weight& w, int64_t p, const XQuant& xq, int64_t i0, float* y,
                int64_t ldy) {
  constexpr bool W4 = BITS == 4, W6 = BITS == 6;
  constexpr int S = B / 4;  // 4-column steps per block
  constexpr int NA = R == 1 ? 4 : R == 2 ? 2 : 1;
  constexpr int64_t bytes = B * kPanel * BITS / 8;
  const uint8_t* wp = w.panel(p);
  const __m512i low4 = _mm512_set1_epi8(0x0F), high2 = _mm512_set1_epi8(0x30);
  constexpr int SPB = kSuper / B;  // blocks a super-block (coded scales)
  __m512 accf[R], fs, fm;  // fs, fm: the coded scales' factors of this super-block
  __m512i isum[R];  // SC: the super-block's integer sums, times their scale codes
  for (int r = 0; r < R; ++r) accf[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.nb; ++b) {
    const uint8_t* wb = wp + b * bytes;
    _mm_prefetch(reinterpret_cast<const char*>(wb + 8 * bytes), _MM_HINT_T0);
    __m512i acc[R][NA];
    // the sums start at -off * sum(xq): w8's bytes are q + 128 (the u8 x s8 sum is
    // sum(q x) + 128 sum(x)), w6's q + 32, and zero points add z
    __m512i off = _mm512_set1_epi32(W4 ? 0 : W6 ? 32 : 128);
    if constexpr (OFS == kZeros)
      off = _mm512_add_epi32(off, _mm512_cvtepi8_epi32(_mm_loadu_si128(
                                      reinterpret_cast<const __m128i*>(w.zero_points(p, b)))));
    for (int r = 0; r < R; ++r) {
      if constexpr (W4 && OFS != kZeros)
        acc[r][0] = _mm512_setzero_si512();
      else
        acc[r][0] = _mm512_mullo_epi32(off, _mm512_set1_epi32(-xq.qsum[(i0 + r) * xq.nb + b]));
      for (int a = 1; a < NA; ++a) acc[r][a] = _mm512_setzero_si512();
    }
    const int8_t* xb = xq.q.data() + i0 * xq.kpad + b * B;
    if constexpr (W4 || W6) {
      for (int j = 0; j < S / 2; ++j) {
        const __m512i v = _mm512_loadu_si512(wb + 64 * j);
        __m512i lo = _mm512_and_si512(v, low4);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        if constexpr (W6) {  // bits 4-5 from the high-bits region (w6_high_byte)
          __m512i h = _mm512_loadu_si512(wb + B * kPanel / 2 + 64 * (j / 2));
          if (j % 2) h = _mm512_srli_epi16(h, 4);
          // 0xF8: a | (b & c): the nibble, or the two bits moved up and masked
          lo = _mm512_ternarylogic_epi32(lo, _mm512_slli_epi16(h, 4), high2, 0xF8);
          hi = _mm512_ternarylogic_epi32(hi, _mm512_slli_epi16(h, 2), high2, 0xF8);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xb + r * xq.kpad;
          int32_t a, c;
          std::memcpy(&a, xr + 4 * j, 4);
          std::memcpy(&c, xr + B / 2 + 4 * j, 4);
          __m512i& a0 = acc[r][(2 * j) % NA];
          __m512i& a1 = acc[r][(2 * j + 1) % NA];
          a0 = _mm512_dpbusd_epi32(a0, lo, _mm512_set1_epi32(a));
          a1 = _mm512_dpbusd_epi32(a1, hi, _mm512_set1_epi32(c));
        }
      }
    } else {
      for (int j = 0; j < S; ++j) {
        const __m512i v = _mm512_loadu_si512(wb + 64 * j);
        for (int r = 0; r < R; ++r) {
          int32_t a;
          std::memcpy(&a, xb + r * xq.kpad + 4 * j, 4);
          acc[r][j % NA] = _mm512_dpbusd_epi32(acc[r][j % NA], v, _mm512_set1_epi32(a));
        }
      }
    }
    const int64_t sb = (p * w.nb + b) * kPanel;
    if constexpr (SC) {
      if (b % SPB == 0) {
        const c10::Half* f = w.factor_row(p, b);
        fs = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(f)));
        for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
      }
      const __m512i sc = _mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.scodes + sb)));
      for (int r = 0; r < R; ++r) {
        __m512i dot = acc[r][0];
        for (int a = 1; a < NA; ++a) dot = _mm512_add_epi32(dot, acc[r][a]);
        isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(dot, sc));
      }
      if (b % SPB == SPB - 1 || b == w.nb - 1)  // the super-block's end: to float, once
        for (int r = 0; r < R; ++r) {
          const __m512 d = _mm512_set1_ps(xq.d[(i0 + r) * xq.nx + b * B / kSuper]);
          accf[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(fs, d), accf[r]);
        }
      continue;
    }
    const __m512 s =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.scales + sb)));
    __m512 mn;
    if constexpr (OFS == kMins)
      mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.mins + sb)));
    for (int r = 0; r < R; ++r) {
      const int64_t i = i0 + r;
      __m512i dot = acc[r][0];
      for (int a = 1; a < NA; ++a) dot = _mm512_add_epi32(dot, acc[r][a]);
      const float d = xq.d[i * xq.nx + b * B / kXBlock];
      accf[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, _mm512_set1_ps(d)),
                                accf[r]);
      if constexpr (OFS == kMins)
        accf[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xq.rsum[i * xq.nb + b]), accf[r]);
    }
  }
  if constexpr (SC && OFS == kMins)  // the offsets times x's block sums as rounded, a pass of
    for (int64_t b = 0; b < w.nb; ++b) {  // their own (no registers left in the first)
      if (b % SPB == 0)
        fm = _mm512_cvtph_ps(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(w.factor_row(p, b) + kPanel)));
      const __m512 mn = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(w.mcodes + (p * w.nb + b) * kPanel)))), fm);
      for (int r = 0; r < R; ++r)
        accf[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xq.rsum[(i0 + r) * xq.nb + b]), accf[r]);
    }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (i0 + r) * ldy + p * kPanel, accf[r]);
}
#endif

#if defined(QL_FP8_AVX512)
// ---------------------------------------------------------------- fp8: VBMI + AVX512-BF16
struct Fp8Tables {
  __m512i hi0, hi1, lo0, lo1;  // high / low byte of the bf16 of magnitudes 0-63, 64-127
};

// fp8's or w8wo's tables (the sign bit is the code's own in both).
Fp8Tables fp8_tables(int64_t kind) {
  alignas(64) uint8_t hi[128], lo[128];
  for (int c = 0; c < 128; ++c) {
    const float v = code_table(kind)[c];
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    // exact: fp8 has 3 mantissa bits, magnitudes up to 127 need 7
    const uint16_t bf = std::isnan(v) ? 0x7FC0 : uint16_t(bits >> 16);
    hi[c] = uint8_t(bf >> 8);
    lo[c] = uint8_t(bf & 0xFF);
  }
  return {_mm512_load_si512(hi), _mm512_load_si512(hi + 64), _mm512_load_si512(lo),
          _mm512_load_si512(lo + 64)};
}

// Rows [i0, i0 + R) of x (bf16 bits, [M][kpad]) by panel p, y before rowf.
// fsum: x's float sum per block ([M][nb], with offsets only).
template <int R, bool MINS, int B>
void panel_fp8(const Weight& w, int64_t p, const Fp8Tables& t, const uint16_t* xbf,
               const float* fsum, int64_t i0, float* y, int64_t ldy) {
  constexpr int S = B / 4;
  constexpr int NA = R == 1 ? 4 : 2;  // accumulators per row: shorter chains of vdpbf16ps
  constexpr int64_t bytes = B * kPanel;
  const uint8_t* wp = w.panel(p);
  const __m512i sign = _mm512_set1_epi8(char(0x80));
  __m512 accf[R];
  for (int r = 0; r < R; ++r) accf[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.nb; ++b) {
    const uint8_t* wb = wp + b * bytes;
    _mm_prefetch(reinterpret_cast<const char*>(wb + 4 * bytes), _MM_HINT_T0);
    __m512 acc[R][NA];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < NA; ++a) acc[r][a] = _mm512_setzero_ps();
    for (int j = 0; j < S; ++j) {
      const __m512i v = _mm512_loadu_si512(wb + 64 * j);
      // high byte: the magnitude's, with the code's sign bit (0xF8: a | (b & c))
      const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, v, t.hi1),
                                                   v, sign, 0xF8);
      const __m512i lo = _mm512_permutex2var_epi8(t.lo0, v, t.lo1);
      const __m512bh w0 = (__m512bh)_mm512_unpacklo_epi8(lo, hi);  // columns 0, 1
      const __m512bh w1 = (__m512bh)_mm512_unpackhi_epi8(lo, hi);  // columns 2, 3
      for (int r = 0; r < R; ++r) {
        const uint16_t* xr = xbf + (i0 + r) * w.kpad + b * B + 4 * j;
        int32_t a, c;
        std::memcpy(&a, xr, 4);
        std::memcpy(&c, xr + 2, 4);
        __m512& a0 = acc[r][(2 * j) % NA];
        __m512& a1 = acc[r][(2 * j + 1) % NA];
        a0 = _mm512_dpbf16_ps(a0, w0, (__m512bh)_mm512_set1_epi32(a));
        a1 = _mm512_dpbf16_ps(a1, w1, (__m512bh)_mm512_set1_epi32(c));
      }
    }
    const int64_t sb = (p * w.nb + b) * kPanel;
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
        w.scales + sb)));
    for (int r = 0; r < R; ++r) {
      __m512 dot = acc[r][0];
      for (int a = 1; a < NA; ++a) dot = _mm512_add_ps(dot, acc[r][a]);
      accf[r] = _mm512_fmadd_ps(dot, s, accf[r]);
    }
    if constexpr (MINS) {
      const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          w.mins + sb)));
      for (int r = 0; r < R; ++r)
        accf[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(fsum[(i0 + r) * w.nb + b]), accf[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (i0 + r) * ldy + p * kPanel, accf[r]);
}
#endif

#if defined(QL_AVX2)
// ---------------------------------------------------------------- AVX2
// u8 x s8 -> int32 sums of 4 (vpdpbusd's product), for |products| that fit maddubs' int16.
inline __m256i dot4(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// As panel_vnni, 16 rows in two halves of 8. w8's u8 q + 128 x s8 x could overflow
// maddubs' int16 pairs, so it multiplies |q| (0-128) by x with q's sign (|x| <= 127, so
// negating it cannot wrap, and a pair sums to at most 2 * 128 * 127 < 2^15). w6's u8
// q + 32 (0-63) meets x as w4's nibbles do (2 * 63 * 127 < 2^15), its sums starting at
// -32 * sum(xq). SC: coded scales.
template <int R, int BITS, int OFS, int B, bool SC>
void panel_avx2(const Weight& w, int64_t p, const XQuant& xq, int64_t i0, float* y,
                int64_t ldy) {
  constexpr bool W4 = BITS == 4, W6 = BITS == 6;
  constexpr int S = B / 4;
  constexpr int64_t bytes = B * kPanel * BITS / 8;
  const uint8_t* wp = w.panel(p);
  const __m256i low4 = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(char(0x80));
  const __m256i high2 = _mm256_set1_epi8(0x30);
  __m256 accf[R][2], fs[2], fm[2];  // fs, fm: the coded scales' factors of this super-block
  for (int r = 0; r < R; ++r) accf[r][0] = accf[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < w.nb; ++b) {
    const uint8_t* wb = wp + b * bytes;
    __m256i acc[R][2];
    if constexpr (SC) {
      if (b % (kSuper / B) == 0)
        for (int h = 0; h < 2; ++h) {
          const c10::Half* f = w.factor_row(p, b) + 8 * h;
          fs[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f)));
          fm[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f + 16)));
        }
    }
    if constexpr (OFS == kZeros || W6) {  // the sums start at -(z + w6's 32) * sum(xq)
      __m256i zh[2] = {_mm256_set1_epi32(W6 ? 32 : 0), _mm256_set1_epi32(W6 ? 32 : 0)};
      if constexpr (OFS == kZeros) {
        const __m128i z =
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.zero_points(p, b)));
        zh[0] = _mm256_add_epi32(zh[0], _mm256_cvtepi8_epi32(z));
        zh[1] = _mm256_add_epi32(zh[1], _mm256_cvtepi8_epi32(_mm_srli_si128(z, 8)));
      }
      for (int r = 0; r < R; ++r) {
        const __m256i qs = _mm256_set1_epi32(-xq.qsum[(i0 + r) * xq.nb + b]);
        for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_mullo_epi32(zh[h], qs);
      }
    } else {
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    }
    const int8_t* xb = xq.q.data() + i0 * xq.kpad + b * B;
    for (int j = 0; j < (W4 || W6 ? S / 2 : S); ++j) {
      for (int h = 0; h < 2; ++h) {
        const __m256i v =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * j + 32 * h));
        __m256i lo = _mm256_and_si256(v, low4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        if constexpr (W6) {  // bits 4-5 from the high-bits region (w6_high_byte)
          __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
              wb + B * kPanel / 2 + 64 * (j / 2) + 32 * h));
          if (j % 2) hb = _mm256_srli_epi16(hb, 4);
          lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(hb, 4), high2));
          hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(hb, 2), high2));
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xb + r * xq.kpad;
          int32_t a;
          std::memcpy(&a, xr + 4 * j, 4);
          const __m256i xa = _mm256_set1_epi32(a);
          if constexpr (W4 || W6) {
            int32_t c;
            std::memcpy(&c, xr + B / 2 + 4 * j, 4);
            acc[r][h] = _mm256_add_epi32(acc[r][h], dot4(lo, xa));
            acc[r][h] = _mm256_add_epi32(acc[r][h], dot4(hi, _mm256_set1_epi32(c)));
          } else {
            const __m256i q = _mm256_xor_si256(v, flip);  // q + 128 -> q (s8)
            acc[r][h] = _mm256_add_epi32(
                acc[r][h], dot4(_mm256_abs_epi8(q), _mm256_sign_epi8(xa, q)));
          }
        }
      }
    }
    const int64_t sb = (p * w.nb + b) * kPanel;
    for (int h = 0; h < 2; ++h) {
      __m256 s, mn;
      if constexpr (SC) {
        s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
            reinterpret_cast<const __m128i*>(w.scodes + sb + 8 * h)))), fs[h]);
        if constexpr (OFS == kMins)
          mn = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
              reinterpret_cast<const __m128i*>(w.mcodes + sb + 8 * h)))), fm[h]);
      } else {
        s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
            w.scales + sb + 8 * h)));
        if constexpr (OFS == kMins)
          mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
              w.mins + sb + 8 * h)));
      }
      for (int r = 0; r < R; ++r) {
        const int64_t i = i0 + r;
        const float d = xq.d[i * xq.nx + b * B / kXBlock];
        accf[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][h]),
                                     _mm256_mul_ps(s, _mm256_set1_ps(d)), accf[r][h]);
        if constexpr (OFS == kMins)
          accf[r][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xq.rsum[i * xq.nb + b]), accf[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h)
      _mm256_storeu_ps(y + (i0 + r) * ldy + p * kPanel + 8 * h, accf[r][h]);
}
#endif

#if defined(QL_AVX2)
// 16 fp8 codes -> 16 floats times 2^-8 (two halves of 8), exact, NaN too: the code's bits
// placed as an fp16's (the same mantissa bits; fp16's exponent bias is 8 more, and its
// denormals line up with e4m3's), then F16C's conversion.
inline void fp8x16(__m128i bytes, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_cvtepu8_epi16(bytes);
  const __m256i mag = _mm256_and_si256(v, _mm256_set1_epi16(0x7F));
  __m256i h = _mm256_or_si256(_mm256_slli_epi16(mag, 7),
                              _mm256_and_si256(_mm256_slli_epi16(v, 8),
                                               _mm256_set1_epi16(short(0x8000))));
  h = _mm256_or_si256(h, _mm256_and_si256(_mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7F)),
                                          _mm256_set1_epi16(0x7E00)));  // NaN: fp16 exponent 31
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// 16 w8wo codes (sign and magnitude) -> 16 floats (two halves of 8), exact.
inline void int7x16(__m128i bytes, __m256& lo, __m256& hi) {
  // sign_epi8 negates where the byte is negative as an int8: where its sign bit is set
  const __m128i q = _mm_sign_epi8(_mm_and_si128(bytes, _mm_set1_epi8(0x7F)), bytes);
  lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
  hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
}

// fp8 (or w8wo: INT7) on FMAs, rows [i0, i0 + R) of x (float32 [M][kpad], zeros past K) by
// panel p. A chunk's
// 8 vectors of 8 codes hold rows 4L..4L+3 x columns {2h, 2h+1} (vector 2L + h, as
// fp8_pos lays them out for AVX-512), so each meets x's pair of those columns and a row's
// two lanes are summed at the block's end (hadd).
template <int R, bool MINS, int B, bool INT7>
void panel_fp8_avx2(const Weight& w, int64_t p, const float* x, const float* fsum, int64_t i0,
                    float* y, int64_t ldy) {
  constexpr int S = B / 4;
  const uint8_t* wp = w.panel(p);
  const __m256 unit = _mm256_set1_ps(INT7 ? 1.f : 256.f);  // fp8 codes came out times 2^-8
  __m256 accf[R][2];
  for (int r = 0; r < R; ++r) accf[r][0] = accf[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < w.nb; ++b) {
    const uint8_t* wb = wp + b * B * kPanel;
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < 4; ++l) acc[r][l] = _mm256_setzero_ps();
    for (int j = 0; j < S; ++j) {
      __m256 wv[8];
      for (int q = 0; q < 4; ++q) {
        const __m128i bytes =
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 64 * j + 16 * q));
        if constexpr (INT7)
          int7x16(bytes, wv[2 * q], wv[2 * q + 1]);
        else
          fp8x16(bytes, wv[2 * q], wv[2 * q + 1]);
      }
      for (int r = 0; r < R; ++r) {
        const float* xr = x + (i0 + r) * w.kpad + b * B + 4 * j;
        const __m256 x0 = _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(xr)));
        const __m256 x1 =
            _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(xr + 2)));
        for (int l = 0; l < 4; ++l) {
          acc[r][l] = _mm256_fmadd_ps(wv[2 * l], x0, acc[r][l]);
          acc[r][l] = _mm256_fmadd_ps(wv[2 * l + 1], x1, acc[r][l]);
        }
      }
    }
    const int64_t sb = (p * w.nb + b) * kPanel;
    __m256 s[2], mn[2];
    for (int h = 0; h < 2; ++h) {
      s[h] = _mm256_mul_ps(unit, _mm256_cvtph_ps(_mm_loadu_si128(
                                     reinterpret_cast<const __m128i*>(w.scales + sb + 8 * h))));
      if constexpr (MINS)
        mn[h] = _mm256_cvtph_ps(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(w.mins + sb + 8 * h)));
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) {
        // hadd: rows 0 1 4 5 2 3 6 7 of the pair of vectors -> 0..7
        const __m256 rows = _mm256_castpd_ps(_mm256_permute4x64_pd(
            _mm256_castps_pd(_mm256_hadd_ps(acc[r][2 * h], acc[r][2 * h + 1])), 0xD8));
        accf[r][h] = _mm256_fmadd_ps(rows, s[h], accf[r][h]);
        if constexpr (MINS)
          accf[r][h] = _mm256_fmadd_ps(mn[h], _mm256_set1_ps(fsum[(i0 + r) * w.nb + b]),
                                       accf[r][h]);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h)
      _mm256_storeu_ps(y + (i0 + r) * ldy + p * kPanel + 8 * h, accf[r][h]);
}
#endif

// Calls F<R>(i0) over rows [0, m) in blocks of at most RMAX (a switch on the remainder).
template <int RMAX, class F>
void row_blocks(int64_t m, F&& f) {
  int64_t i = 0;
  for (; i + RMAX <= m; i += RMAX) f(std::integral_constant<int, RMAX>{}, i);
  switch (m - i) {
    case 0: break;
#define QL_CASE(n) \
  case n: if constexpr (n < RMAX) f(std::integral_constant<int, n>{}, i); break;
    QL_CASE(1) QL_CASE(2) QL_CASE(3) QL_CASE(4) QL_CASE(5) QL_CASE(6) QL_CASE(7)
#undef QL_CASE
  }
}

// Each panel in turn, threads taking consecutive runs of panels.
template <class F>
void over_panels(const Weight& w, F&& f) {
  at::parallel_for(0, w.panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) f(p);
  });
}

// Dispatch on (kind, mins, block) to the templated integer kernel of this ISA.
template <template <int, int, int, int, bool> class K, int RMAX>
void run_int(const Weight& w, const XQuant& xq, int64_t m, float* y, int64_t ldy) {
  auto go = [&](auto bits, auto ofs, auto blk, auto sc) {
    over_panels(w, [&](int64_t p) {
      row_blocks<RMAX>(m, [&](auto rows, int64_t i0) {
        K<decltype(rows)::value, decltype(bits)::value, decltype(ofs)::value,
          decltype(blk)::value, decltype(sc)::value>::run(w, p, xq, i0, y, ldy);
      });
    });
  };
  auto by_block = [&](auto bits, auto ofs, auto sc) {
    w.block == 32 ? go(bits, ofs, std::integral_constant<int, 32>{}, sc)
                  : go(bits, ofs, std::integral_constant<int, 16>{}, sc);
  };
  auto by_offsets = [&](auto bits) {
    using Mins = std::integral_constant<int, kMins>;
    using None = std::integral_constant<int, kNone>;
    if (w.scodes) {  // coded scales: never with integer zero points
      w.mcodes ? by_block(bits, Mins{}, std::true_type{})
               : by_block(bits, None{}, std::true_type{});
    } else if (w.zeros) {
      by_block(bits, std::integral_constant<int, kZeros>{}, std::false_type{});
    } else {
      w.mins ? by_block(bits, Mins{}, std::false_type{})
             : by_block(bits, None{}, std::false_type{});
    }
  };
  if (w.kind == kW4) by_offsets(std::integral_constant<int, 4>{});
  else if (w.kind == kW6) by_offsets(std::integral_constant<int, 6>{});
  else by_offsets(std::integral_constant<int, 8>{});
}

#if defined(QL_AVX512)
template <int R, int BITS, int OFS, int B, bool SC>
struct Vnni {
  static void run(const Weight& w, int64_t p, const XQuant& xq, int64_t i0, float* y,
                  int64_t ldy) {
    panel_vnni<R, BITS, OFS, B, SC>(w, p, xq, i0, y, ldy);
  }
};
#endif
#if defined(QL_AVX2)
template <int R, int BITS, int OFS, int B, bool SC>
struct Avx2 {
  static void run(const Weight& w, int64_t p, const XQuant& xq, int64_t i0, float* y,
                  int64_t ldy) {
    panel_avx2<R, BITS, OFS, B, SC>(w, p, xq, i0, y, ldy);
  }
};
#endif

Weight weight_of(const at::Tensor& data, const at::Tensor& scales,
                 const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& zeros,
                 const std::optional<at::Tensor>& factors, const at::Tensor& rowf,
                 int64_t kind, int64_t n, int64_t kpad, int64_t block, const char* op) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  TORCH_CHECK(kind >= 0 && kind <= 4 && (block == 16 || block == 32) && kpad % kXBlock == 0,
              op, ": kind ", kind, " block ", block, " padded K ", kpad);
  const int64_t nb = kpad / block;
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous() &&
                  data.numel() == panels * nb * block_bytes(kind, block),
              op, ": data is not the packing of [", n, ", ", kpad, "] kind ", kind);
  const bool coded = factors.has_value();
  for (const at::Tensor* t : {&scales, mins.has_value() ? &*mins : &scales})
    TORCH_CHECK(t->scalar_type() == (coded ? at::kChar : at::kHalf) && t->is_contiguous() &&
                    t->numel() == panels * nb * kPanel,
                op, ": scales / mins must be ", coded ? "int8 codes" : "fp16", " [", panels,
                ", ", nb, ", 16]");
  const int64_t nsb = (nb + kSuper / block - 1) / (kSuper / block);
  TORCH_CHECK(!coded || (!bf16_kind(kind) && !zeros.has_value() &&
                         factors->scalar_type() == at::kHalf && factors->is_contiguous() &&
                         factors->numel() == panels * nsb * 2 * kPanel),
              op, ": factors must be fp16 [", panels, ", ", nsb, ", 2, 16], of an integer "
              "kind without zero points");
  TORCH_CHECK(!zeros.has_value() || (!bf16_kind(kind) && !mins.has_value() &&
                                     zeros->scalar_type() == at::kChar &&
                                     zeros->is_contiguous() &&
                                     zeros->numel() == panels * nb * kPanel),
              op, ": zeros must be int8 [", panels, ", ", nb, ", 16], of w4 / w6 / w8, "
              "without mins");
  TORCH_CHECK(kind != kW8WO || !mins.has_value(), op, ": w8wo has no offsets");
  TORCH_CHECK(rowf.scalar_type() == at::kFloat && rowf.is_contiguous() &&
                  rowf.numel() == panels * kPanel, op, ": rowf must be float32 [", panels * 16, "]");
  Weight w{data.data_ptr<uint8_t>(), coded ? nullptr : scales.data_ptr<c10::Half>(),
           mins.has_value() && !coded ? mins->data_ptr<c10::Half>() : nullptr,
           zeros.has_value() ? zeros->data_ptr<int8_t>() : nullptr, rowf.data_ptr<float>(),
           kind, n, kpad, block, nb, panels};
  if (coded) {
    w.scodes = scales.data_ptr<int8_t>();
    w.mcodes = mins.has_value() ? mins->data_ptr<int8_t>() : nullptr;
    w.factors = factors->data_ptr<c10::Half>();
  }
  return w;
}

// y [m, P * 16] (before rowf and bias) by this build's widest kernel for the kind.
void products(const Weight& w, const at::Tensor& x, float* y, int64_t ldy) {
  const int64_t m = x.size(0), k = x.size(1);
#if defined(QL_FP8_AVX512)
  if (bf16_kind(w.kind)) {
    // x rounded to bf16 once (nearest even), zero past K
    at::Tensor xb = at::zeros({m, w.kpad}, x.options().dtype(at::kBFloat16));
    xb.narrow(1, 0, k).copy_(x);
    const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
    const Fp8Tables t = fp8_tables(w.kind);
    // with offsets: x's float sum per block (as the integer kinds')
    std::vector<float> fsum;
    if (w.mins) {
      const at::Tensor xf = x.to(at::kFloat).contiguous();
      fsum = quantize_x(xf.data_ptr<float>(), m, k, w.kpad, w.block).fsum;
    }
    auto go = [&](auto mins, auto blk) {
      over_panels(w, [&](int64_t p) {
        row_blocks<4>(m, [&](auto rows, int64_t i0) {
          panel_fp8<decltype(rows)::value, decltype(mins)::value, decltype(blk)::value>(
              w, p, t, xp, fsum.data(), i0, y, ldy);
        });
      });
    };
    using B16 = std::integral_constant<int, 16>;
    using B32 = std::integral_constant<int, 32>;
    if (w.mins)
      w.block == 32 ? go(std::true_type{}, B32{}) : go(std::true_type{}, B16{});
    else
      w.block == 32 ? go(std::false_type{}, B32{}) : go(std::false_type{}, B16{});
    return;
  }
#endif
#if defined(QL_AVX2)
  if (bf16_kind(w.kind)) {
    const at::Tensor xf = x.to(at::kFloat);
    at::Tensor xp = at::zeros({m, w.kpad}, xf.options());  // zeros past K (0 * code, no NaN)
    xp.narrow(1, 0, k).copy_(xf);
    std::vector<float> fsum;
    if (w.mins) fsum = quantize_x(xf.data_ptr<float>(), m, k, w.kpad, w.block).fsum;
    const float* xd = xp.data_ptr<float>();
    auto go = [&](auto mins, auto blk, auto int7) {
      over_panels(w, [&](int64_t p) {
        row_blocks<2>(m, [&](auto rows, int64_t i0) {
          panel_fp8_avx2<decltype(rows)::value, decltype(mins)::value, decltype(blk)::value,
                         decltype(int7)::value>(w, p, xd, fsum.data(), i0, y, ldy);
        });
      });
    };
    using B16 = std::integral_constant<int, 16>;
    using B32 = std::integral_constant<int, 32>;
    using T = std::true_type;
    using F = std::false_type;
    if (w.kind == kW8WO)  // no offsets
      w.block == 32 ? go(F{}, B32{}, T{}) : go(F{}, B16{}, T{});
    else if (w.mins)
      w.block == 32 ? go(T{}, B32{}, F{}) : go(T{}, B16{}, F{});
    else
      w.block == 32 ? go(F{}, B32{}, F{}) : go(F{}, B16{}, F{});
    return;
  }
#endif
#if defined(QL_AVX512) || defined(QL_AVX2)
  if (!bf16_kind(w.kind)) {
#if defined(QL_AVX512)
    const int64_t xblock = w.scodes ? kSuper : kXBlock;  // panel_vnni's SC path: per 256
#else
    const int64_t xblock = kXBlock;
#endif
    const XQuant xq = x.scalar_type() == at::kFloat
        ? quantize_x(x.data_ptr<float>(), m, k, w.kpad, w.block, xblock)
        : quantize_x(x.data_ptr<at::BFloat16>(), m, k, w.kpad, w.block, xblock);
#if defined(QL_AVX512)
    run_int<Vnni, 8>(w, xq, m, y, ldy);
#else
    run_int<Avx2, 2>(w, xq, m, y, ldy);
#endif
    return;
  }
#endif
  const at::Tensor xf = x.to(at::kFloat);
  const float* xp = xf.data_ptr<float>();
  over_panels(w, [&](int64_t p) { panel_plain(w, p, xp, k, 0, m, y, ldy); });
}

// y [M, N] (x's dtype, written) = x W^T + bias.
void quant_linear(const at::Tensor& x_in, const at::Tensor& data, const at::Tensor& scales,
                  const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& zeros,
                  const std::optional<at::Tensor>& factors, const at::Tensor& rowf, int64_t kind, int64_t n, int64_t block,
                  const std::optional<at::Tensor>& bias, const at::Tensor& y) {
  const auto dt = x_in.scalar_type();
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu() &&
                  (dt == at::kFloat || dt == at::kBFloat16),
              "quant_linear: x must be a 2-D float32 or bfloat16 CPU tensor");
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t kpad = (k + kXBlock - 1) / kXBlock * kXBlock;
  const Weight w =
      weight_of(data, scales, mins, zeros, factors, rowf, kind, n, kpad, block, "quant_linear");
  TORCH_CHECK(y.scalar_type() == dt && y.is_contiguous() && y.dim() == 2 && y.size(0) == m &&
                  y.size(1) == n,
              "quant_linear: y must be [", m, ", ", n, "] in x's dtype");
  const float* bp = nullptr;
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "quant_linear: bias must be [", n, "]");
    bias_f = bias->to(at::kFloat).contiguous();
    bp = bias_f.data_ptr<float>();
  }
  if (m == 0) return;
  // the panels' sums, 16 columns a panel (the last one's past N are padding)
  const int64_t ldy = w.panels * kPanel;
  const at::Tensor acc = at::empty({m, ldy}, x.options().dtype(at::kFloat));
  const float* ap = acc.data_ptr<float>();
  products(w, x, acc.data_ptr<float>(), ldy);
  auto finish = [&](auto* yp) {  // times the rows' factors, plus bias, in y's dtype
    using O = std::remove_pointer_t<decltype(yp)>;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t c = 0; c < n; ++c)
        yp[i * n + c] = O(ap[i * ldy + c] * w.rowf[c] + (bp ? bp[c] : 0.f));
  };
  if (dt == at::kFloat)
    finish(y.data_ptr<float>());
  else
    finish(y.data_ptr<at::BFloat16>());
}

// The codes of block b of a panel as floats, [16 rows][B columns] (no per-element branch
// on the kind: the prefill path decodes every weight of the tiles it multiplies).
void decode_block(const Weight& w, const uint8_t* wb, const float* table, float* out) {
  const int64_t B = w.block;
  for (int64_t j = 0; j < B / 4; ++j)
    for (int r = 0; r < kPanel; ++r)
      for (int t = 0; t < 4; ++t) {
        float* o = out + r * B;
        if (w.kind == kW8) {
          o[4 * j + t] = float(int(wb[j * 64 + r * 4 + t]) - 128);
        } else if (w.kind == kW4) {
          if (j >= B / 8) continue;
          const uint8_t byte = wb[j * 64 + r * 4 + t];
          o[4 * j + t] = float(byte & 15);
          o[B / 2 + 4 * j + t] = float(byte >> 4);
        } else if (w.kind == kW6) {
          if (j >= B / 8) continue;
          o[4 * j + t] = w.code(wb, r, 4 * j + t);
          o[B / 2 + 4 * j + t] = w.code(wb, r, B / 2 + 4 * j + t);
        } else {
          o[4 * j + t] = table[wb[j * 64 + fp8_pos(r, t)]];
        }
      }
}

// W rows [row0, row1) as [rows, k] of O (float or BFloat16), stored column order.
template <class O>
void dequant_rows(const Weight& w, int64_t k, int64_t row0, int64_t row1, O* op) {
  const float* table = code_table(w.kind);
  const int64_t B = w.block, bytes = block_bytes(w.kind, B);
  at::parallel_for(row0 / kPanel, (row1 + kPanel - 1) / kPanel, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> codes(kPanel * B);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t r0 = std::max(row0, p * kPanel), r1 = std::min(row1, (p + 1) * kPanel);
      for (int64_t b = 0; b < w.nb && b * B < k; ++b) {
        decode_block(w, w.panel(p) + b * bytes, table, codes.data());
        const int64_t c1 = std::min(B, k - b * B), sb = (p * w.nb + b) * kPanel;
        const int8_t* z = w.zero_points(p, b);
        for (int64_t row = r0; row < r1; ++row) {
          const int r = int(row - p * kPanel);
          const float s = w.scale(p, b, r) * w.rowf[row];
          const float mn = w.offset(p, b, r) * w.rowf[row];
          const float zr = z ? float(z[r]) : 0.f;
          O* o = op + (row - row0) * k + b * B;
          const float* c = codes.data() + r * B;
          for (int64_t i = 0; i < c1; ++i) o[i] = O((c[i] - zr) * s + mn);
        }
      }
    }
  });
}

// W rows [row0, row1) as [rows, k] in dtype (float32 or bfloat16), stored column order:
// the prefill path multiplies them tile by tile.
at::Tensor quant_dequant(const at::Tensor& data, const at::Tensor& scales,
                         const std::optional<at::Tensor>& mins,
                         const std::optional<at::Tensor>& zeros,
                         const std::optional<at::Tensor>& factors, const at::Tensor& rowf,
                         int64_t kind, int64_t n, int64_t k, int64_t block, int64_t row0,
                         int64_t row1, at::ScalarType dtype) {
  const int64_t kpad = (k + kXBlock - 1) / kXBlock * kXBlock;
  const Weight w =
      weight_of(data, scales, mins, zeros, factors, rowf, kind, n, kpad, block,
                "quant_dequant");
  TORCH_CHECK(0 <= row0 && row0 < row1 && row1 <= n, "quant_dequant: rows ", row0, "-", row1);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "quant_dequant: dtype must be float32 or bfloat16");
  at::Tensor out = at::empty({row1 - row0, k}, data.options().dtype(dtype));
  if (dtype == at::kFloat)
    dequant_rows(w, k, row0, row1, out.data_ptr<float>());
  else
    dequant_rows(w, k, row0, row1, out.data_ptr<at::BFloat16>());
  return out;
}

// A QuantWeight's codes and scales in the layout above, in one pass (the torch twin is
// quant_linear._pack_torch). data: w4 uint8 [n, ceil(k/2)], w8 and w8wo int8 [n, k] (w8wo:
// -127..127), fp8 bytes [n, k]; scales / mins float32 [n, groups], zeros (instead of mins)
// int8 [n, groups]. Returns (data, scales, mins, zeros (each or an empty tensor), rowf).
// A factor f and int8 codes c with f * c[i] == v[i] exactly in float32 (the smallest
// codes: the largest |v| gets the first code +-1, +-2, ... -128 that works: llama.cpp's
// Q6_K gives its largest scale -128, with d of either sign), or false. The quotients
// are taken in double and rounded once, so the library's reciprocal math cannot miss an
// exact one (a k-quant's d * sc divided by sc is d).
bool int8_factor(const float* v, int64_t cnt, float& f, int8_t* c) {
  float amax = 0.f;
  for (int64_t i = 0; i < cnt; ++i) amax = std::max(amax, std::fabs(v[i]));
  if (amax == 0.f) {
    f = 0.f;
    std::fill(c, c + cnt, int8_t(0));
    return true;
  }
  if (!std::isfinite(amax)) return false;
  for (int top = 2; top <= 257; ++top) {  // +f, -f for each top code
    const float cand = float(double(amax) / (top / 2)) * (top % 2 ? -1.f : 1.f);
    bool ok = cand != 0.f;
    for (int64_t i = 0; i < cnt && ok; ++i) {
      const double q = std::nearbyint(double(v[i]) / double(cand));
      ok = q >= -128 && q <= 127 && float(q) * cand == v[i];
      if (ok) c[i] = int8_t(q);
    }
    if (ok) {
      f = cand;
      return true;
    }
  }
  return false;
}

// The coded layout of a packing's scales (and offsets): int8 codes and fp16 factors per
// 256 columns (Weight::scodes), or false where a super-block's scales are not small
// integer multiples of one factor (then the fp16 layout stays).
bool code_scales(const float* sp, const float* mp, const float* rowf, int64_t n, int64_t groups,
                 int64_t group, int64_t block, int64_t panels, int64_t nb, int8_t* sc,
                 int8_t* mc, c10::Half* fac) {
  const int64_t per = kSuper / block, nsb = (nb + per - 1) / per;
  std::atomic<bool> ok{true};
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> v(per);
    std::vector<int8_t> c(per);
    for (int64_t p = p0; p < p1 && ok; ++p)
      for (int r = 0; r < kPanel && ok; ++r) {
        const int64_t row = p * kPanel + r;
        if (row >= n) continue;  // padding rows: zero codes and factors
        for (int64_t t = 0; t < nsb && ok; ++t)
          for (int which = 0; which < (mp ? 2 : 1) && ok; ++which) {
            const float* src = which ? mp : sp;
            const int64_t b0 = t * per, cnt = std::min(per, nb - b0);
            for (int64_t i = 0; i < cnt; ++i)
              v[i] = src[row * groups + std::min((b0 + i) * block / group, groups - 1)];
            float f;
            if (!int8_factor(v.data(), cnt, f, c.data())) {
              ok = false;
              break;
            }
            int8_t* dst = which ? mc : sc;
            for (int64_t i = 0; i < cnt; ++i) dst[(p * nb + b0 + i) * kPanel + r] = c[i];
            fac[((p * nsb + t) * 2 + which) * kPanel + r] = c10::Half(f / rowf[row]);
          }
      }
  });
  return ok;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quant_pack(
    const at::Tensor& data_in, const at::Tensor& scales_in,
    const std::optional<at::Tensor>& mins_in, const std::optional<at::Tensor>& zeros_in,
    int64_t kind, int64_t n, int64_t k, int64_t group, int64_t block) {
  TORCH_CHECK(kind >= 0 && kind <= 4 && (block == 16 || block == 32) && group > 0,
              "quant_pack: kind ", kind, " block ", block, " group ", group);
  const at::Tensor data = data_in.contiguous(), sc = scales_in.contiguous();
  const int64_t groups = (k + group - 1) / group, cols = kind == kW4 ? (k + 1) / 2 : k;
  TORCH_CHECK(data.numel() == n * cols && data.element_size() == 1,
              "quant_pack: data must be one byte a code, [", n, ", ", cols, "]");
  TORCH_CHECK(sc.scalar_type() == at::kFloat && sc.numel() == n * groups,
              "quant_pack: scales must be float32 [", n, ", ", groups, "]");
  at::Tensor mn;
  if (mins_in.has_value()) {
    mn = mins_in->contiguous();
    TORCH_CHECK(mn.scalar_type() == at::kFloat && mn.numel() == n * groups,
                "quant_pack: mins must be float32 [", n, ", ", groups, "]");
  }
  at::Tensor zr;
  if (zeros_in.has_value()) {
    zr = zeros_in->contiguous();
    TORCH_CHECK(!bf16_kind(kind) && !mn.defined() &&
                    zr.scalar_type() == at::kChar && zr.numel() == n * groups,
                "quant_pack: zeros must be int8 [", n, ", ", groups, "], of w4 / w6 / w8, "
                "without mins");
  }
  TORCH_CHECK(kind != kW6 || (data.scalar_type() == at::kChar &&
                              data.ge(-32).logical_and(data.le(31)).all().item<bool>()),
              "quant_pack: w6 takes int8 codes in -32..31");
  TORCH_CHECK(kind != kW8WO || (!mn.defined() && data.scalar_type() == at::kChar &&
                                data.ne(-128).all().item<bool>()),
              "quant_pack: w8wo takes int8 codes in -127..127 and no offsets");
  const int64_t kpad = (k + kXBlock - 1) / kXBlock * kXBlock, nb = kpad / block;
  const int64_t panels = (n + kPanel - 1) / kPanel, bytes = block_bytes(kind, block);
  const auto u8 = data.options().dtype(at::kByte);
  at::Tensor out = at::empty({panels, nb, bytes / 64, 64}, u8);
  at::Tensor s16 = at::zeros({panels, nb, kPanel}, sc.options().dtype(at::kHalf));
  at::Tensor m16 = mn.defined() ? at::zeros({panels, nb, kPanel}, s16.options())
                                : at::empty({0}, s16.options());
  at::Tensor z8 = at::zeros({zr.defined() ? panels * nb * kPanel : 0}, u8.dtype(at::kChar));
  at::Tensor rowf = at::ones({panels * kPanel}, sc.options());
  const auto* src = reinterpret_cast<const uint8_t*>(data.data_ptr());
  const float* sp = sc.data_ptr<float>();
  const float* mp = mn.defined() ? mn.data_ptr<float>() : nullptr;
  uint8_t* op = out.data_ptr<uint8_t>();
  auto* s16p = s16.data_ptr<c10::Half>();
  auto* m16p = mn.defined() ? m16.data_ptr<c10::Half>() : nullptr;
  const int8_t* zp = zr.defined() ? zr.data_ptr<int8_t>() : nullptr;
  int8_t* z8p = zr.defined() ? z8.data_ptr<int8_t>() : nullptr;
  float* rp = rowf.data_ptr<float>();
  // the code at (row, col) as its byte in the layout (w8: q + 128, w6: q + 32, w8wo: sign
  // and magnitude), padding meaning zero
  auto code = [&](int64_t row, int64_t col) -> uint8_t {
    if (row >= n || col >= k) return kind == kW8 ? 128 : kind == kW6 ? 32 : 0;
    if (kind == kW4) return (src[row * cols + col / 2] >> (4 * (col & 1))) & 15;
    const uint8_t byte = src[row * cols + col];
    if (kind == kW8) return uint8_t(byte + 128);
    if (kind == kW6) return uint8_t(byte + 32);
    if (kind == kW8WO) return int8_t(byte) < 0 ? uint8_t(0x80 | -int8_t(byte)) : byte;
    return byte;
  };
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      for (int r = 0; r < kPanel; ++r) {  // the rows' factors, then their scales
        const int64_t row = p * kPanel + r;
        if (row >= n) continue;
        float f = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          f = std::max(f, std::fabs(sp[row * groups + g]));
          if (mp) f = std::max(f, std::fabs(mp[row * groups + g]));
        }
        rp[row] = f > 0.f ? f : 1.f;
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t g = std::min(b * block / group, groups - 1);
          s16p[(p * nb + b) * kPanel + r] = c10::Half(sp[row * groups + g] / rp[row]);
          if (mp) m16p[(p * nb + b) * kPanel + r] = c10::Half(mp[row * groups + g] / rp[row]);
          if (zp) z8p[(p * nb + b) * kPanel + r] = zp[row * groups + g];
        }
      }
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* ob = op + (p * nb + b) * bytes;
        const int64_t c0 = b * block;
        if (kind == kW6) {  // w4's nibbles, then the high-bits region (w6_high_byte)
          std::memset(ob, 0, bytes);
          for (int r = 0; r < kPanel; ++r)
            for (int64_t c = 0; c < block; ++c) {
              const uint8_t q = code(p * kPanel + r, c0 + c);
              const int64_t cc = c % (block / 2);
              ob[(cc / 4) * 64 + r * 4 + cc % 4] |= (q & 15) << (c >= block / 2 ? 4 : 0);
              ob[w6_high_byte(block, r, c)] |= (q >> 4) << w6_high_shift(block, c);
            }
          continue;
        }
        for (int64_t j = 0; j < bytes / 64; ++j)
          for (int r = 0; r < kPanel; ++r)
            for (int t = 0; t < 4; ++t) {
              const int64_t row = p * kPanel + r, col = c0 + 4 * j + t;
              if (kind == kW4)
                ob[j * 64 + r * 4 + t] = code(row, col) | (code(row, col + block / 2) << 4);
              else if (kind == kW8)
                ob[j * 64 + r * 4 + t] = code(row, col);
              else
                ob[j * 64 + fp8_pos(r, t)] = code(row, col);
            }
      }
    }
  });
  // coded scales where every super-block's are small integer multiples of one factor
  if (!bf16_kind(kind) && !zr.defined()) {
    const int64_t nsb = (nb + kSuper / block - 1) / (kSuper / block);
    at::Tensor sc = at::zeros({panels, nb, kPanel}, u8.dtype(at::kChar));
    at::Tensor mc = mn.defined() ? at::zeros({panels, nb, kPanel}, sc.options())
                                 : at::empty({0}, sc.options());
    at::Tensor fac = at::zeros({panels, nsb, 2, kPanel}, s16.options());
    if (code_scales(sp, mp, rp, n, groups, group, block, panels, nb, sc.data_ptr<int8_t>(),
                    mn.defined() ? mc.data_ptr<int8_t>() : nullptr,
                    fac.data_ptr<c10::Half>()))
      return {out, sc, mc, z8.view({-1, nb, kPanel}), rowf, fac};
  }
  return {out, s16, m16, z8.view({-1, nb, kPanel}), rowf, at::empty({0}, s16.options())};
}

int64_t quant_linear_isa() {
#if defined(QL_AVX512)
  return 2;
#elif defined(QL_AVX2)
  return 1;
#else
  return 0;
#endif
}

// 2: fp8 by vdpbf16ps (x rounded to bf16), 1: by FMAs (float32 x), 0: the plain loop.
int64_t quant_linear_fp8_isa() {
#if defined(QL_FP8_AVX512)
  return 2;
#elif defined(QL_AVX2)
  return 1;
#else
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixlm_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor data, Tensor scales, Tensor? mins, Tensor? zeros, "
        "Tensor? factors, Tensor rowf, int kind, int n, int block, Tensor? bias, "
        "Tensor(a!) y) -> ()");
  m.def("quant_dequant(Tensor data, Tensor scales, Tensor? mins, Tensor? zeros, "
        "Tensor? factors, Tensor rowf, int kind, int n, int k, int block, int row0, int row1, "
        "ScalarType dtype) -> Tensor");
  m.def("quant_pack(Tensor data, Tensor scales, Tensor? mins, Tensor? zeros, int kind, int n, "
        "int k, int group, int block) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("quant_linear_isa() -> int", &quant_linear_isa);  // no tensors: a catch-all kernel
  m.def("quant_linear_fp8_isa() -> int", &quant_linear_fp8_isa);
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_dequant", &quant_dequant);
  m.impl("quant_pack", &quant_pack);
}
