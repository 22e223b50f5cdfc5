// A prefill chunk's matrix products in int8 (quant.DynamicInt8Weight).
//
// A chunk of hundreds of rows is bound by arithmetic, and int8 x int8 -> int32 products (torch._int_mm, oneDNN
// with AVX-512 VNNI) ran 1.3-1.9 TOPS on a Zen 5 where bf16 F.linear peaked at ~890 GFLOP/s. What it takes
// around the product: each row of x quantized to int8 (but for a few outlier columns, kept in fp32: OUTLIERS),
// each weight row to int8 with one scale, and the int32 sums scaled back. In PyTorch ops those were a pass over
// [rows, N] each and cost as much as the product on wide outputs; here each is one vectorized pass, and the
// product runs a block of output columns at a time (BLOCK), converting that block's int4 weights just before
// it, so that the int8 weights and the int32 sums are written and read back while in cache.
//
// Semantics (the tests hold these functions to PyTorch references): arithmetic is fp32, each operation
// rounded as written (no fused multiply-adds), rounding to integers and to bf16 is to nearest even.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "vec.h"  // the loops cloned per instruction set, as in fused.cpp

namespace {

// GCC contracts a * b + c into an FMA by default, one rounding where the references round twice.
#define EXACT __attribute__((optimize("fp-contract=off")))

typedef int16_t ShortVec __attribute__((vector_size(32)));
typedef uint8_t ByteVec __attribute__((vector_size(16)));
typedef int8_t Int8Vec __attribute__((vector_size(16)));
// Output columns per _int_mm call: with 512 rows, [K, 2048] int8 weights and [512, 2048] int32 sums stay in
// cache, and the product ran 1.75-1.9 TOPS against 1.2-1.5 on a 1B model's whole gate and up projection.
constexpr int64_t BLOCK = 2048;
// 1.5 * 2^23: adding and subtracting it rounds any |v| < 2^22 to an integer, ties to even, in every clone.
constexpr float ROUNDER = 12582912.f;
// Input features multiplied in fp32 (outliers): on the embedded SmolLM2-135M, over 1,536 tokens, 16 took the int8
// prefill's KL divergence from the decode kernels' logits 0.035 -> 0.010 (bf16 prefill: 0.0017), greedy agreement
// 0.971 -> 0.996, perplexity +1.9% -> +0.7%, for ~4% of a 1B prefill's time (8: 0.012, 0.995, +0.9%).
constexpr int64_t OUTLIERS = 16;

inline __attribute__((always_inline)) Vec round_even(Vec v) { return (v + ROUNDER) - ROUNDER; }
inline __attribute__((always_inline)) float round_even(float v) { return (v + ROUNDER) - ROUNDER; }

inline __attribute__((always_inline)) void store_int8(int8_t* p, Vec integral) {
  const Int8Vec bytes = __builtin_convertvector(__builtin_convertvector(integral, IntVec), Int8Vec);
  std::memcpy(p, &bytes, sizeof bytes);
}

inline __attribute__((always_inline)) void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

inline __attribute__((always_inline)) void store(BFloat16* p, Vec v) {  // rounded to nearest even, as c10::BFloat16
  UintVec u;
  std::memcpy(&u, &v, sizeof u);
  const HalfVec bits = __builtin_convertvector((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, HalfVec);
  std::memcpy(p, &bits, sizeof bits);
}

// Columns [first, last) of x [rows, K]: their largest |x| over the rows.
template <typename T>
inline __attribute__((always_inline)) void column_max(const T* x, float* out, int64_t rows, int64_t k, int64_t first,
                                                      int64_t last) {
  int64_t c = first;
  for (; c + LANES <= last; c += LANES) {
    Vec top = Vec{};
    for (int64_t r = 0; r < rows; ++r) {
      const Vec v = load(x + r * k + c);
      const Vec magnitude = v < 0.f ? -v : v;
      top = magnitude > top ? magnitude : top;
    }
    store(out + c, top);
  }
  for (; c < last; ++c) {
    float top = 0.f;
    for (int64_t r = 0; r < rows; ++r) top = std::max(top, std::fabs(to_float(x[r * k + c])));
    out[c] = top;
  }
}

CLONED void column_max_fp32(const float* x, float* out, int64_t rows, int64_t k, int64_t first, int64_t last) {
  column_max(x, out, rows, k, first, last);
}

CLONED void column_max_bf16(const BFloat16* x, float* out, int64_t rows, int64_t k, int64_t first, int64_t last) {
  column_max(x, out, rows, k, first, last);
}

// The `count` columns of x [rows, K] (fp32 or bf16, contiguous) with the largest |x|, ties to the lower index, in
// increasing order. A few input features carry values far beyond the rest (rms-normed hidden states of small
// models especially); a row's one int8 scale would round every other feature to a few levels, so these are
// multiplied in fp32 instead (OUTLIERS).
std::vector<int64_t> outliers(const at::Tensor& x, int64_t count, float* largest) {
  const int64_t rows = x.size(0), k = x.size(1);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::parallel_for(0, (k + LANES - 1) / LANES, 16, [&](int64_t first, int64_t last) {
    if (bf16)
      column_max_bf16(x.data_ptr<BFloat16>(), largest, rows, k, first * LANES, std::min(last * LANES, k));
    else
      column_max_fp32(x.data_ptr<float>(), largest, rows, k, first * LANES, std::min(last * LANES, k));
  });
  std::vector<int64_t> order(k);
  for (int64_t c = 0; c < k; ++c) order[c] = c;
  count = std::min(count, k);
  std::partial_sort(order.begin(), order.begin() + count, order.end(), [&](int64_t a, int64_t b) {
    return largest[a] > largest[b] || (largest[a] == largest[b] && a < b);
  });
  order.resize(count);
  std::sort(order.begin(), order.end());
  return order;
}

// One row, the columns where keep is 0 left out: scale = m / 127 and q = round(x * (127 / m)) (0 where m is 0), m the
// largest |x| kept. No clamp is needed: |x| * (127 / m) rounds to at most 127.00002, which rounds to 127.
template <typename T>
inline __attribute__((always_inline)) void quantize_row(const T* x, const float* keep, int8_t* q, float* scale, int64_t k) {
  Vec top = Vec{};
  int64_t i = 0;
  for (; i + LANES <= k; i += LANES) {
    const Vec v = load(x + i) * load(keep + i);
    const Vec magnitude = v < 0.f ? -v : v;
    top = magnitude > top ? magnitude : top;
  }
  float largest = 0.f;
  for (int64_t lane = 0; lane < LANES; ++lane) largest = std::max(largest, top[lane]);
  for (; i < k; ++i) largest = std::max(largest, std::fabs(to_float(x[i]) * keep[i]));
  const float inverse = largest > 0.f ? 127.f / largest : 0.f;
  *scale = largest / 127.f;
  for (i = 0; i + LANES <= k; i += LANES) store_int8(q + i, round_even((load(x + i) * load(keep + i)) * inverse));
  for (; i < k; ++i) q[i] = static_cast<int8_t>(round_even((to_float(x[i]) * keep[i]) * inverse));
}

CLONED EXACT void quantize_rows_fp32(const float* x, const float* keep, int8_t* q, float* scales, int64_t first,
                                     int64_t last, int64_t k) {
  for (int64_t r = first; r < last; ++r) quantize_row(x + r * k, keep, q + r * k, scales + r, k);
}

CLONED EXACT void quantize_rows_bf16(const BFloat16* x, const float* keep, int8_t* q, float* scales, int64_t first,
                                     int64_t last, int64_t k) {
  for (int64_t r = first; r < last; ++r) quantize_row(x + r * k, keep, q + r * k, scales + r, k);
}

// x [rows, K] fp32 or bf16, contiguous -> q int8 [rows, K] and scales [rows]: x ~ q * scale, symmetric per row,
// the given columns left out (q 0 there). keep: room for [K].
void quantize_into(const at::Tensor& x, const std::vector<int64_t>& columns, float* keep, int8_t* q, float* scales) {
  RECORD_FUNCTION("tornchat::quantize_rows", std::vector<c10::IValue>());
  const int64_t k = x.size(1);
  std::fill(keep, keep + k, 1.f);
  for (const int64_t c : columns) keep[c] = 0.f;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::parallel_for(0, x.size(0), 16, [&](int64_t first, int64_t last) {
    if (bf16)
      quantize_rows_bf16(x.data_ptr<BFloat16>(), keep, q, scales, first, last, k);
    else
      quantize_rows_fp32(x.data_ptr<float>(), keep, q, scales, first, last, k);
  });
}

void check_rows(const at::Tensor& x) {
  check_cpu_contiguous(x, "x");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be fp32 or bf16 [rows, K]");
}

// The outlier columns on their own (the tests' entry point): int64 [min(count, K)].
at::Tensor outlier_columns(const at::Tensor& x, int64_t count) {
  check_rows(x);
  std::vector<float> largest(x.size(1));
  const auto columns = outliers(x, count, largest.data());
  return at::tensor(columns, x.options().dtype(at::kLong));
}

// The row quantizer on its own (the tests' entry point): (int8 [rows, K], fp32 scales [rows]), columns (int64)
// left out.
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, const at::Tensor& columns) {
  check_rows(x);
  const auto c = columns.to(at::kLong).contiguous();
  const std::vector<int64_t> left_out(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  auto q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  auto scales = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  std::vector<float> keep(x.size(1));
  quantize_into(x, left_out, keep.data(), q.data_ptr<int8_t>(), scales.data_ptr<float>());
  return {q, scales};
}

// out[r, j] = (float(acc[r, j]) * x_scales[r] + e[r, j]) * w_scales[j] for rows [first, last), out's rows `stride`
// apart, e[r, j] = sum over t in order of x_outliers[r, t] * w_outliers[t, j] (x's outlier columns [rows, count],
// their int8 weights as floats [count, cols]). ROWS rows at a time share each load of the weights.
template <int64_t ROWS, typename Out>
inline __attribute__((always_inline)) void scale_tile(const int32_t* acc, const float* x_scales, const float* w_scales,
                                                      const float* x_outliers, const float* w_outliers, int64_t count,
                                                      Out* out, int64_t r, int64_t cols, int64_t stride) {
  int64_t j = 0;
  for (; j + LANES <= cols; j += LANES) {
    Vec e[ROWS];
    for (int64_t i = 0; i < ROWS; ++i) e[i] = Vec{};
    for (int64_t t = 0; t < count; ++t) {
      const Vec w = load(w_outliers + t * cols + j);
      for (int64_t i = 0; i < ROWS; ++i) e[i] = e[i] + x_outliers[(r + i) * count + t] * w;
    }
    const Vec scale = load(w_scales + j);
    for (int64_t i = 0; i < ROWS; ++i) {
      IntVec sums;
      std::memcpy(&sums, acc + (r + i) * cols + j, sizeof sums);
      store(out + (r + i) * stride + j, (__builtin_convertvector(sums, Vec) * x_scales[r + i] + e[i]) * scale);
    }
  }
  for (; j < cols; ++j) {
    for (int64_t i = 0; i < ROWS; ++i) {
      float e = 0.f;
      for (int64_t t = 0; t < count; ++t) e = e + x_outliers[(r + i) * count + t] * w_outliers[t * cols + j];
      out[(r + i) * stride + j] =
          static_cast<Out>((static_cast<float>(acc[(r + i) * cols + j]) * x_scales[r + i] + e) * w_scales[j]);
    }
  }
}

template <typename Out>
inline __attribute__((always_inline)) void scale_rows(const int32_t* acc, const float* x_scales, const float* w_scales,
                                                      const float* x_outliers, const float* w_outliers, int64_t count,
                                                      Out* out, int64_t first, int64_t last, int64_t cols, int64_t stride) {
  int64_t r = first;
  for (; r + 4 <= last; r += 4) scale_tile<4>(acc, x_scales, w_scales, x_outliers, w_outliers, count, out, r, cols, stride);
  for (; r < last; ++r) scale_tile<1>(acc, x_scales, w_scales, x_outliers, w_outliers, count, out, r, cols, stride);
}

CLONED EXACT void scale_rows_fp32(const int32_t* acc, const float* xs, const float* ws, const float* x_outliers,
                                  const float* w_outliers, int64_t count, float* out, int64_t first, int64_t last,
                                  int64_t cols, int64_t stride) {
  scale_rows(acc, xs, ws, x_outliers, w_outliers, count, out, first, last, cols, stride);
}

CLONED EXACT void scale_rows_bf16(const int32_t* acc, const float* xs, const float* ws, const float* x_outliers,
                                  const float* w_outliers, int64_t count, BFloat16* out, int64_t first, int64_t last,
                                  int64_t cols, int64_t stride) {
  scale_rows(acc, xs, ws, x_outliers, w_outliers, count, out, first, last, cols, stride);
}

// acc int32 [rows, cols], x_scales [rows], w_scales [cols], x_outliers [rows, count], w_outliers [count, cols] fp32
// -> out: a view [rows, cols] of contiguous rows (fp32 or bf16), possibly a block of a wider tensor's columns.
void scale_into(const int32_t* acc, const float* x_scales, const float* w_scales, const float* x_outliers,
                const float* w_outliers, int64_t count, at::Tensor& out) {
  RECORD_FUNCTION("tornchat::scale_products", std::vector<c10::IValue>());
  const int64_t rows = out.size(0), cols = out.size(1), stride = out.stride(0);
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  at::parallel_for(0, rows, 8, [&](int64_t first, int64_t last) {
    if (bf16)
      scale_rows_bf16(acc, x_scales, w_scales, x_outliers, w_outliers, count, out.data_ptr<BFloat16>(), first, last, cols,
                      stride);
    else
      scale_rows_fp32(acc, x_scales, w_scales, x_outliers, w_outliers, count, out.data_ptr<float>(), first, last, cols,
                      stride);
  });
}

// The epilogue on its own (the tests' entry point): acc int32 [rows, N], x_scales [rows], w_scales [N],
// x_outliers [rows, count], w_outliers [count, N] fp32.
at::Tensor scale_products(const at::Tensor& acc, const at::Tensor& x_scales, const at::Tensor& w_scales,
                          const at::Tensor& x_outliers, const at::Tensor& w_outliers, bool bf16_out) {
  for (const auto* t : {&acc, &x_scales, &w_scales, &x_outliers, &w_outliers}) check_cpu_contiguous(*t, "acc and scales");
  TORCH_CHECK(acc.scalar_type() == at::kInt && acc.dim() == 2, "acc must be int32 [rows, N]");
  const int64_t rows = acc.size(0), n = acc.size(1), count = w_outliers.size(0);
  for (const auto* t : {&x_scales, &w_scales, &x_outliers, &w_outliers}) TORCH_CHECK(t->scalar_type() == at::kFloat, "fp32 scales");
  TORCH_CHECK(x_scales.numel() == rows && w_scales.numel() == n && x_outliers.numel() == rows * count &&
              w_outliers.numel() == count * n, "scales must be [rows] and [N], outliers [rows, count] and [count, N]");
  auto out = at::empty(acc.sizes(), acc.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  scale_into(acc.data_ptr<int32_t>(), x_scales.data_ptr<float>(), w_scales.data_ptr<float>(), x_outliers.data_ptr<float>(),
             w_outliers.data_ptr<float>(), count, out);
  return out;
}

// 16 rows' scales and zeros from [K / group, N, 2] (each row's pair adjacent).
inline __attribute__((always_inline)) void load_pairs(const float* p, Vec& scale, Vec& zero) {
  const Vec a = load(p), b = load(p + LANES);
  scale = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  zero = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

inline __attribute__((always_inline)) void load_pairs(const BFloat16* p, Vec& scale, Vec& zero) {
  UintVec pairs;  // a row's scale in the low half, its zero in the high half
  std::memcpy(&pairs, p, sizeof pairs);
  const UintVec s = pairs << 16, z = pairs & 0xFFFF0000u;
  std::memcpy(&scale, &s, sizeof scale);
  std::memcpy(&zero, &z, sizeof zero);
}

// Rows [first, last) (a multiple of 16 apart): scales[r] = m / 127 and inverses[r] = 127 / m (0 where m is 0),
// m the largest value row r can hold, the max over its groups of |(0 - 8) * s + z| and |(15 - 8) * s + z|: a
// value is monotone in its level, so none exceeds m, computed with the same roundings, and round(value *
// inverse) needs no clamp (at most 127.00002 before rounding).
template <typename T>
inline __attribute__((always_inline)) void int4_scales(const T* scales_and_zeros, float* scales, float* inverses,
                                                       int64_t n, int64_t groups, int64_t first, int64_t last) {
  for (int64_t r = first; r < last; r += LANES) {
    Vec largest = Vec{};
    for (int64_t g = 0; g < groups; ++g) {
      Vec s, z;
      load_pairs(scales_and_zeros + (g * n + r) * 2, s, z);
      Vec low = s * -8.f, high = s * 7.f;
      low = low + z, high = high + z;
      low = low < 0.f ? -low : low, high = high < 0.f ? -high : high;
      largest = low > largest ? low : largest;
      largest = high > largest ? high : largest;
    }
    for (int64_t lane = 0; lane < LANES; ++lane) {
      inverses[r - first + lane] = largest[lane] > 0.f ? 127.f / largest[lane] : 0.f;
      scales[r - first + lane] = largest[lane] / 127.f;
    }
  }
}

CLONED EXACT void int4_scales_fp32(const float* sz, float* scales, float* inverses, int64_t n, int64_t groups,
                                   int64_t first, int64_t last) {
  int4_scales(sz, scales, inverses, n, groups, first, last);
}

CLONED EXACT void int4_scales_bf16(const BFloat16* sz, float* scales, float* inverses, int64_t n, int64_t groups,
                                   int64_t first, int64_t last) {
  int4_scales(sz, scales, inverses, n, groups, first, last);
}

// One block of block_rows rows (2 * HALF_VECS vectors of 16), the input features [first_k, last_k) of one group:
// q = round(((level - 8) * s + z) * inverse), the value as quant.Int4Weight.dequantize computes it in fp32,
// scaled, written to out[kk * stride + row]. The block's scales, zeros and inverses stay in registers for the
// group's features, whose bytes follow one another. The packed layout (quant.Int4Layout, as in fused.cpp's
// dequantize_features): each block is [K, block_rows / 2] bytes, byte j holding rows j and j + block_rows / 2
// (HALVES) or 2j and 2j + 1, the first in the low nibble.
template <int64_t HALF_VECS, bool HALVES, typename T>
inline __attribute__((always_inline)) void int4_block(const uint8_t* bytes, const T* scales_and_zeros,
                                                      const float* inverse, int8_t* out, int64_t first_k, int64_t last_k,
                                                      int64_t stride) {
  constexpr int64_t VECS = 2 * HALF_VECS, HALF = HALF_VECS * LANES;
  Vec s[VECS], z[VECS], inv[VECS];
  for (int64_t v = 0; v < VECS; ++v) {
    load_pairs(scales_and_zeros + v * LANES * 2, s[v], z[v]);
    inv[v] = load(inverse + v * LANES);
  }
  for (int64_t kk = first_k; kk < last_k; ++kk) {
    Vec levels[VECS];
    for (int64_t h = 0; h < HALF_VECS; ++h) {
      ByteVec raw;
      std::memcpy(&raw, bytes + kk * HALF + h * LANES, sizeof raw);
      const ShortVec wide = __builtin_convertvector(raw, ShortVec);  // via 16 bits: GCC 12 widens bytes to 32 one by one
      const Vec low = __builtin_convertvector((wide & 15) - 8, Vec), high = __builtin_convertvector((wide >> 4) - 8, Vec);
      if (HALVES) {
        levels[h] = low, levels[HALF_VECS + h] = high;
      } else {  // rows 2j, 2j + 1, ...: interleave
        levels[2 * h] = __builtin_shufflevector(low, high, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        levels[2 * h + 1] = __builtin_shufflevector(low, high, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
      }
    }
    for (int64_t v = 0; v < VECS; ++v) {
      Vec value = levels[v] * s[v];
      value = value + z[v];
      store_int8(out + kk * stride + v * LANES, round_even(value * inv[v]));
    }
  }
}

// Groups [first_g, last_g) of rows [first_row, first_row + rows) -> out, int8 [K, rows].
template <typename T>
inline __attribute__((always_inline)) void int4_groups(const uint8_t* packed, const T* scales_and_zeros,
                                                       const float* inverses, int8_t* out, int64_t k, int64_t n,
                                                       int64_t group, int64_t first_g, int64_t last_g, int64_t first_row,
                                                       int64_t rows, int64_t block_rows, bool halves) {
  for (int64_t g = first_g; g < last_g; ++g) {
    for (int64_t row0 = 0; row0 < rows; row0 += block_rows) {
      const uint8_t* bytes = packed + (first_row + row0) * k / 2;
      const T* sz = scales_and_zeros + (g * n + first_row + row0) * 2;
      const int64_t first_k = g * group, last_k = first_k + group;
      const float* inv = inverses + row0;
      int8_t* y = out + row0;
      if (block_rows == 64 && halves) int4_block<2, true>(bytes, sz, inv, y, first_k, last_k, rows);
      else if (block_rows == 64) int4_block<2, false>(bytes, sz, inv, y, first_k, last_k, rows);
      else if (halves) int4_block<1, true>(bytes, sz, inv, y, first_k, last_k, rows);
      else int4_block<1, false>(bytes, sz, inv, y, first_k, last_k, rows);
    }
  }
}

CLONED EXACT void int4_groups_fp32(const uint8_t* packed, const float* sz, const float* inverses, int8_t* out, int64_t k,
                                   int64_t n, int64_t group, int64_t first_g, int64_t last_g, int64_t first_row,
                                   int64_t rows, int64_t block_rows, bool halves) {
  int4_groups(packed, sz, inverses, out, k, n, group, first_g, last_g, first_row, rows, block_rows, halves);
}

CLONED EXACT void int4_groups_bf16(const uint8_t* packed, const BFloat16* sz, const float* inverses, int8_t* out,
                                   int64_t k, int64_t n, int64_t group, int64_t first_g, int64_t last_g,
                                   int64_t first_row, int64_t rows, int64_t block_rows, bool halves) {
  int4_groups(packed, sz, inverses, out, k, n, group, first_g, last_g, first_row, rows, block_rows, halves);
}

struct Int4 {
  const at::Tensor& packed;  // uint8 [N, K / 2]
  const at::Tensor& scales_and_zeros;  // [K / group, N, 2], fp32 or bf16
  int64_t group, block_rows;
  bool halves;

  int64_t n() const { return packed.size(0); }
  int64_t k() const { return packed.size(1) * 2; }

  void check() const {
    check_cpu_contiguous(packed, "packed");
    check_cpu_contiguous(scales_and_zeros, "scales_and_zeros");
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2, "packed must be uint8 [N, K / 2]");
    TORCH_CHECK(scales_and_zeros.scalar_type() == at::kFloat || scales_and_zeros.scalar_type() == at::kBFloat16,
                "scales_and_zeros must be fp32 or bf16");
    TORCH_CHECK(group > 0 && k() % group == 0 && scales_and_zeros.dim() == 3 && scales_and_zeros.size(0) == k() / group &&
                scales_and_zeros.size(1) == n() && scales_and_zeros.size(2) == 2, "scales_and_zeros must be [K / group, N, 2]");
    TORCH_CHECK((block_rows == 32 || block_rows == 64) && n() % block_rows == 0, "N must be whole blocks of 32 or 64 rows");
  }

  // Rows [first_row, first_row + rows), whole blocks, into values (int8 [K, rows]) and their scales (fp32 [rows]);
  // inverses: room for [rows].
  void convert(int64_t first_row, int64_t rows, int8_t* values, float* scales, float* inverses) const {
    RECORD_FUNCTION("tornchat::int4_to_int8", std::vector<c10::IValue>());
    const int64_t groups = k() / group;
    const bool bf16 = scales_and_zeros.scalar_type() == at::kBFloat16;
    at::parallel_for(0, rows / LANES, 4, [&](int64_t first, int64_t last) {
      if (bf16)
        int4_scales_bf16(scales_and_zeros.data_ptr<BFloat16>() + first_row * 2, scales + first * LANES,
                         inverses + first * LANES, n(), groups, first * LANES, last * LANES);
      else
        int4_scales_fp32(scales_and_zeros.data_ptr<float>() + first_row * 2, scales + first * LANES,
                         inverses + first * LANES, n(), groups, first * LANES, last * LANES);
    });
    at::parallel_for(0, groups, 1, [&](int64_t first, int64_t last) {
      if (bf16)
        int4_groups_bf16(packed.data_ptr<uint8_t>(), scales_and_zeros.data_ptr<BFloat16>(), inverses, values, k(), n(),
                         group, first, last, first_row, rows, block_rows, halves);
      else
        int4_groups_fp32(packed.data_ptr<uint8_t>(), scales_and_zeros.data_ptr<float>(), inverses, values, k(), n(),
                         group, first, last, first_row, rows, block_rows, halves);
    });
  }
};

// Packed int4 weights (quant.Int4Weight, this CPU's layout) -> (int8 [K, N], fp32 scales [N]): each row's values
// over its scale (the tests' entry point; int4_linear converts a block of rows at a time).
std::tuple<at::Tensor, at::Tensor> int4_to_int8(const at::Tensor& packed, const at::Tensor& scales_and_zeros, int64_t group,
                                                int64_t block_rows, bool halves) {
  const Int4 weights{packed, scales_and_zeros, group, block_rows, halves};
  weights.check();
  auto values = at::empty({weights.k(), weights.n()}, packed.options().dtype(at::kChar));
  auto scales = at::empty({weights.n()}, packed.options().dtype(at::kFloat));
  std::vector<float> inverses(weights.n());
  weights.convert(0, weights.n(), values.data_ptr<int8_t>(), scales.data_ptr<float>(), inverses.data());
  return {values, scales};
}

// What a product works in, carved out of the caller's scratch (uint8, grown here as needed and kept from call to
// call): fresh tensors cost their page faults at every call, a 16 MB block of weights ~4 ms.
struct Buffers {
  float* largest;  // per input feature, [K]
  float* keep;  // [K]
  int8_t* q;  // x's rows quantized, [rows, K]
  float* x_scales;  // [rows]
  float* x_outliers;  // x's outlier columns, [rows, OUTLIERS]
  int8_t* values;  // a block of weights, [K, BLOCK]
  float* w_scales;  // [BLOCK]
  float* inverses;  // [BLOCK]
  float* w_outliers;  // the block's weights at the outlier columns, [OUTLIERS, BLOCK]
  int32_t* sums;  // [rows, BLOCK]
};

Buffers carve(at::Tensor& scratch, int64_t rows, int64_t k, int64_t width, bool converts) {
  TORCH_CHECK(scratch.device().is_cpu() && scratch.scalar_type() == at::kByte && scratch.dim() == 1,
              "scratch must be a 1-D uint8 CPU tensor");
  const int64_t weights = converts ? width : 0;
  const int64_t sizes[] = {k * 4,           k * 4,       rows * k,         rows * 4,        rows * OUTLIERS * 4,
                           k * weights,     weights * 4, weights * 4,      OUTLIERS * width * 4, rows * width * 4};
  int64_t total = 64;  // room to align the start
  for (const int64_t size : sizes) total += (size + 63) / 64 * 64;
  if (scratch.numel() < total) scratch.resize_({total});
  auto* at = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(scratch.data_ptr<uint8_t>()) + 63) / 64 * 64);
  uint8_t* parts[10];
  for (int i = 0; i < 10; ++i) parts[i] = at, at += (sizes[i] + 63) / 64 * 64;
  return {reinterpret_cast<float*>(parts[0]), reinterpret_cast<float*>(parts[1]), reinterpret_cast<int8_t*>(parts[2]),
          reinterpret_cast<float*>(parts[3]), reinterpret_cast<float*>(parts[4]), reinterpret_cast<int8_t*>(parts[5]),
          reinterpret_cast<float*>(parts[6]), reinterpret_cast<float*>(parts[7]), reinterpret_cast<float*>(parts[8]),
          reinterpret_cast<int32_t*>(parts[9])};
}

// x's outlier columns picked (outliers) and its rows quantized without them (quantize_into); then for each block
// of output columns: its int8 weights [K, cols] and scales from `block(first, cols, buffers)`, which also writes
// the block's weights at the outlier columns as floats into buffers.w_outliers [count, cols]; their product by
// _int_mm, scaled, the outlier columns' products added (scale_into), into out's columns.
template <typename Block>
at::Tensor blocked_linear(const at::Tensor& x_in, int64_t n, int64_t k, bool bf16_out, at::Tensor& scratch,
                          bool converts, Block block) {
  const auto x = x_in.contiguous();
  check_rows(x);
  TORCH_CHECK(x.size(1) == k, "x must be [rows, K]");
  const int64_t rows = x.size(0);
  const Buffers buffers = carve(scratch, rows, k, std::min(n, BLOCK), converts);
  const auto columns = outliers(x, OUTLIERS, buffers.largest);
  const int64_t count = columns.size();
  quantize_into(x, columns, buffers.keep, buffers.q, buffers.x_scales);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < count; ++t)
      buffers.x_outliers[r * count + t] = x.scalar_type() == at::kBFloat16
                                              ? static_cast<float>(x.data_ptr<BFloat16>()[r * k + columns[t]])
                                              : x.data_ptr<float>()[r * k + columns[t]];
  const auto q = at::from_blob(buffers.q, {rows, k}, x.options().dtype(at::kChar));
  auto out = at::empty({rows, n}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  for (int64_t first = 0; first < n; first += BLOCK) {
    const int64_t cols = std::min(BLOCK, n - first);
    const auto [values, w_scales] = block(first, cols, columns, buffers);
    auto sums = at::from_blob(buffers.sums, {rows, cols}, x.options().dtype(at::kInt));
    at::_int_mm_out(sums, q, values);
    auto columns_out = out.narrow(1, first, cols);
    scale_into(buffers.sums, buffers.x_scales, w_scales, buffers.x_outliers, buffers.w_outliers, count, columns_out);
  }
  return out;
}

// x [rows, K] (fp32 or bf16) times packed int4 weights [N, K] -> [rows, N] in bf16 or fp32: the weights' rows
// quantized to int8 (int4_to_int8), x's rows without its OUTLIERS largest columns (outlier_columns,
// quantize_rows), those columns in fp32: out = (acc * x_scale[row] + x[:, outliers] @ v[outliers, :]) *
// w_scale[column] (scale_products), v the int8 weights [K, N].
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_and_zeros, int64_t group,
                       int64_t block_rows, bool halves, bool bf16_out, at::Tensor scratch) {
  RECORD_FUNCTION("tornchat::int4_linear", std::vector<c10::IValue>());
  const Int4 weights{packed, scales_and_zeros, group, block_rows, halves};
  weights.check();
  const int64_t k = weights.k();
  TORCH_CHECK(BLOCK % block_rows == 0, "BLOCK must be whole blocks of rows");
  return blocked_linear(x, weights.n(), k, bf16_out, scratch, true,
                        [&](int64_t first, int64_t cols, const std::vector<int64_t>& columns, const Buffers& b) {
                          weights.convert(first, cols, b.values, b.w_scales, b.inverses);
                          for (size_t t = 0; t < columns.size(); ++t)
                            for (int64_t j = 0; j < cols; ++j)
                              b.w_outliers[t * cols + j] = b.values[columns[t] * cols + j];
                          return std::make_tuple(at::from_blob(b.values, {k, cols}, packed.options().dtype(at::kChar)),
                                                 b.w_scales);
                        });
}

// x [rows, K] (fp32 or bf16) times int8 weights (values int8 [N, K], one scale per row, fp32 or bf16) -> [rows, N]
// in bf16 or fp32, as int4_linear with the weights' own values and scales.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales, bool bf16_out,
                       at::Tensor scratch) {
  RECORD_FUNCTION("tornchat::int8_linear", std::vector<c10::IValue>());
  check_cpu_contiguous(values, "values");
  TORCH_CHECK(values.scalar_type() == at::kChar && values.dim() == 2, "values must be int8 [N, K]");
  TORCH_CHECK(scales.numel() == values.size(0), "scales must be [N]");
  const auto w_scales = scales.to(at::kFloat).contiguous();
  const int64_t k = values.size(1);
  const int8_t* v = values.data_ptr<int8_t>();
  return blocked_linear(x, values.size(0), k, bf16_out, scratch, false,
                        [&](int64_t first, int64_t cols, const std::vector<int64_t>& columns, const Buffers& b) {
                          for (size_t t = 0; t < columns.size(); ++t)
                            for (int64_t j = 0; j < cols; ++j) b.w_outliers[t * cols + j] = v[(first + j) * k + columns[t]];
                          return std::make_tuple(values.narrow(0, first, cols).t(), w_scales.data_ptr<float>() + first);
                        });
}

// A prefill chunk's attention scores, one KV head's rows (chunk_attention.py): [rows, end] bf16, row i at
// position start + (row0 + i) % n of the chunk (rows are (group, position)), seeing columns 0 .. that position.
// Visible columns of row i, and the largest among them.
inline int64_t visible(int64_t i, int64_t row0, int64_t start, int64_t n) { return start + (row0 + i) % n + 1; }

CLONED float largest_visible(const BFloat16* row, int64_t seen) {
  Vec top = Vec{} - INFINITY;
  int64_t j = 0;
  for (; j + LANES <= seen; j += LANES) {
    const Vec v = load(row + j);
    top = v > top ? v : top;
  }
  float m = -INFINITY;
  for (int64_t l = 0; l < LANES; ++l) m = std::max(m, top[l]);
  for (; j < seen; ++j) m = std::max(m, static_cast<float>(row[j]));
  return m;
}

// Each row's largest visible score, rounded to bf16 [rows, 1]: the shift chunk_attention subtracts inside its
// second product.
at::Tensor causal_row_max(const at::Tensor& scores, int64_t start, int64_t n, int64_t row0) {
  RECORD_FUNCTION("tornchat::causal_row_max", std::vector<c10::IValue>());
  check_cpu_contiguous(scores, "scores");
  TORCH_CHECK(scores.scalar_type() == at::kBFloat16 && scores.dim() == 2 && scores.size(1) >= start + n,
              "scores must be bf16 [rows, at least start + n]");
  const int64_t rows = scores.size(0), end = scores.size(1);
  auto out = at::empty({rows, 1}, scores.options());
  const BFloat16* s = scores.data_ptr<BFloat16>();
  BFloat16* o = out.data_ptr<BFloat16>();
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) o[i] = BFloat16(largest_visible(s + i * end, visible(i, row0, start, n)));
  });
  return out;
}

// Softmax of each row's visible scores in place: exp(score - largest) / their sum in fp32, rounded to bf16; the
// columns a row does not see become 0.
CLONED void softmax_row(BFloat16* row, float* e, int64_t seen, int64_t end) {
  const float top = largest_visible(row, seen);
  const Vec top_v = Vec{} + top;
  Vec total = Vec{};
  int64_t j = 0;
  for (; j + LANES <= seen; j += LANES) {
    const Vec v = exp_nonpositive(load(row + j) - top_v);
    store(e + j, v);
    total += v;
  }
  float sum_e = sum(total);
  for (; j < seen; ++j) sum_e += e[j] = std::exp(static_cast<float>(row[j]) - top);
  const Vec inverse = Vec{} + 1.0f / sum_e;
  for (j = 0; j + LANES <= seen; j += LANES) store(row + j, load(e + j) * inverse);
  for (; j < seen; ++j) row[j] = BFloat16(e[j] * inverse[0]);
  for (j = seen; j < end; ++j) row[j] = BFloat16(0.0f);
}

void causal_softmax_(at::Tensor scores, int64_t start, int64_t n, int64_t row0) {
  RECORD_FUNCTION("tornchat::causal_softmax_", std::vector<c10::IValue>());
  check_cpu_contiguous(scores, "scores");
  TORCH_CHECK(scores.scalar_type() == at::kBFloat16 && scores.dim() == 2 && scores.size(1) >= start + n,
              "scores must be bf16 [rows, at least start + n]");
  const int64_t rows = scores.size(0), end = scores.size(1);
  BFloat16* s = scores.data_ptr<BFloat16>();
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    std::vector<float> e(end);
    for (int64_t i = first; i < last; ++i) softmax_row(s + i * end, e.data(), visible(i, row0, start, n), end);
  });
}

}  // namespace

PYBIND11_MODULE(_prefill, m) {
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("outlier_columns", &outlier_columns, "the columns with the largest magnitudes", nogil);
  m.def("quantize_rows", &quantize_rows, "rows to int8, one symmetric scale per row, some columns left out", nogil);
  m.def("scale_products", &scale_products, "int32 products scaled, the outlier columns' products added, in bf16 or fp32",
        nogil);
  m.def("int4_to_int8", &int4_to_int8, "packed int4 weights to int8 [K, N] with one scale per row", nogil);
  m.def("int4_linear", &int4_linear, "x times packed int4 weights, both quantized to int8", nogil);
  m.def("int8_linear", &int8_linear, "x quantized to int8 times int8 weights", nogil);
  m.def("causal_row_max", &causal_row_max, "each row's largest score it sees, in bf16", nogil);
  m.def("causal_softmax_", &causal_softmax_, "softmax of each row's scores it sees, the rest 0, in place", nogil);
}
