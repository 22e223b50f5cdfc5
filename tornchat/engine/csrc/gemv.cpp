// Decode-step matrix-vector products with int8 activations, on AVX-512 VNNI.
//
// A decode step reads every weight once, so it runs at the speed the
// weights stream from memory, if the arithmetic keeps up. PyTorch's int4 CPU
// kernel turns each 4-bit level into an fp32 and multiplies in fp32: 39-40
// GB/s on a 1B model's matrices on a Zen 5 core pair whose memory reads ~48,
// 22 on one core. Here the activations are quantized instead, as
// llama.cpp's Q8 blocks do: each group of 32 input features becomes int8
// levels with one fp32 scale, so 64 products of a weight level and an
// activation level cost one VPDPBUSD. The result is not PyTorch's bit for
// bit (the activations are rounded to 8 bits per group); autotune's quality
// gate measures it like any other format.
//
// Semantics (tornchat/engine/quant.vnni_reference computes it in PyTorch):
//   x, per row and group g of 32 features: d[g] = max |x| / 127,
//     xq[k] = round-half-even(x[k] * (127 / max |x|)) in [-127, 127] (0 where max |x| is 0), s[g] = sum of xq;
//   int4 (value = (level - 8) * scale + zero, PyTorch's packed layout):
//     out[n] = sum over g of d[g] * (scale[g, n] * sum(level * xq) + (zero[g, n] - 8 * scale[g, n]) * s[g]);
//   int8 (value = w * scale[n]): out[n] = scale[n] * sum over g of d[g] * sum(w * xq).
// Each row of x is computed alone and in the same order whatever the number of rows, so a verify's rows
// equal one-row steps. Built without -march: these functions carry their own target, and the callers
// ask vnni_supported() first.
#include "gemv.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define TORNCHAT_VNNI 1
#define VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512vbmi")))
#endif

namespace tornchat {

namespace {

constexpr int64_t GROUP = 32;  // activation levels share a scale per 32 input features: int4's group
constexpr int64_t BLOCK = 64;  // rows per block of PyTorch's AVX-512 int4 layout
constexpr int64_t PREFETCH = 4096;  // bytes ahead in the weights' stream that int4_block asks for

struct Quantized {  // one row of x as int8 levels per group (see the semantics above)
  std::vector<int8_t> levels;  // [K]
  std::vector<float> scale;  // d [K / 32]
  std::vector<float> sum;  // s [K / 32], exact integers
};

at::Tensor rows_fp32(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x must be [rows, K] with the weights' K");
  return x.to(at::kFloat).contiguous();
}

#ifdef TORNCHAT_VNNI

VNNI void quantize_row(const float* x, int64_t k, Quantized& q) {
  q.levels.resize(k), q.scale.resize(k / GROUP), q.sum.resize(k / GROUP);
  for (int64_t g = 0; g < k / GROUP; ++g) {
    const __m512 a = _mm512_loadu_ps(x + g * GROUP), b = _mm512_loadu_ps(x + g * GROUP + 16);
    const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __m512 inverse = _mm512_set1_ps(largest > 0 ? 127.0f / largest : 0.0f);
    // The default rounding mode is to nearest even; products past 127 by an ulp saturate to it.
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inverse)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inverse));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q.levels.data() + g * GROUP), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q.levels.data() + g * GROUP + 16), _mm512_cvtsepi32_epi8(qb));
    q.scale[g] = largest / 127.0f;
    q.sum[g] = static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
  }
}

// One block of 64 rows for one row of x. The block is [K, 32] bytes: byte j of feature k holds row j's level
// in its low nibble and row j + 32's in its high one. VPDPBUSD wants four features of one row in each 32-bit
// lane, so each step takes four features (128 bytes) and gathers them per row with VPERMT2B.
VNNI void int4_block(const uint8_t* block, const uint32_t* params, int64_t n, int64_t k, const Quantized& q,
                     float* out) {
  __m512i gather_low, gather_high;  // lane r: bytes r, 32 + r, 64 + r, 96 + r (rows r), and 16 + r, ... (rows 16 + r)
  alignas(64) uint8_t low[64], high[64];
  for (int r = 0; r < 16; ++r)
    for (int f = 0; f < 4; ++f) low[4 * r + f] = 32 * f + r, high[4 * r + f] = 32 * f + 16 + r;
  gather_low = _mm512_load_si512(low), gather_high = _mm512_load_si512(high);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i top = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m512 result[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t g = 0; g < k / GROUP; ++g) {
    __m512i dots[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    const uint8_t* bytes = block + g * GROUP * 32;
    // Software prefetches took a 1B model's matrices from 40 to 45-47 GB/s on two Zen 5 cores (memory ~48):
    // the block's scales are 256 bytes in each row of the [K / 32, N, 2] array, more streams than a hardware
    // prefetcher follows, so the next block's (the next 256 bytes of each row) are asked for a block ahead;
    // the weights PREFETCH bytes ahead (8 KiB did no better).
    for (int i = 0; i < 4; ++i)
      _mm_prefetch(reinterpret_cast<const char*>(params + g * n + BLOCK + 16 * i), _MM_HINT_T0);
    for (int step = 0; step < GROUP / 4; ++step) {
      _mm_prefetch(reinterpret_cast<const char*>(bytes + PREFETCH + 128 * step), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(bytes + PREFETCH + 128 * step + 64), _MM_HINT_T0);
      const __m512i a = _mm512_loadu_si512(bytes + 128 * step), b = _mm512_loadu_si512(bytes + 128 * step + 64);
      const __m512i a_low = _mm512_and_si512(a, nibble), b_low = _mm512_and_si512(b, nibble);
      const __m512i a_high = _mm512_and_si512(_mm512_srli_epi16(a, 4), nibble);
      const __m512i b_high = _mm512_and_si512(_mm512_srli_epi16(b, 4), nibble);
      int32_t four;
      std::memcpy(&four, q.levels.data() + g * GROUP + 4 * step, sizeof four);
      const __m512i x = _mm512_set1_epi32(four);
      dots[0] = _mm512_dpbusd_epi32(dots[0], _mm512_permutex2var_epi8(a_low, gather_low, b_low), x);
      dots[1] = _mm512_dpbusd_epi32(dots[1], _mm512_permutex2var_epi8(a_low, gather_high, b_low), x);
      dots[2] = _mm512_dpbusd_epi32(dots[2], _mm512_permutex2var_epi8(a_high, gather_low, b_high), x);
      dots[3] = _mm512_dpbusd_epi32(dots[3], _mm512_permutex2var_epi8(a_high, gather_high, b_high), x);
    }
    const __m512 d = _mm512_set1_ps(q.scale[g]), s = _mm512_set1_ps(q.sum[g]);
    for (int i = 0; i < 4; ++i) {
      // (scale, zero) bf16 pairs, one 32-bit word per row: bf16 is the top half of an fp32.
      const __m512i pairs = _mm512_loadu_si512(params + g * n + 16 * i);
      const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(pairs, top));
      const __m512 lowest = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, zero);  // 8 * scale is exact
      const __m512 t = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dots[i]), _mm512_mul_ps(lowest, s));
      result[i] = _mm512_fmadd_ps(t, d, result[i]);
    }
  }
  for (int i = 0; i < 4; ++i) _mm512_storeu_ps(out + 16 * i, result[i]);
}

// Rows [first, last) of int8 values [N, K] for one row of x. VPDPBUSD multiplies unsigned by signed bytes:
// the weights' magnitudes by the activations with the weights' signs.
VNNI void int8_rows(const int8_t* values, const float* scales, int64_t k, int64_t first, int64_t last,
                    const Quantized& q, const float* lane_scales, float* out) {
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t row = first; row < last; ++row) {
    const int8_t* w = values + row * k;
    __m512 total = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk += 64) {
      const __m512i weights = _mm512_loadu_si512(w + kk);
      const __mmask64 negative = _mm512_movepi8_mask(weights);
      const __m512i x = _mm512_loadu_si512(q.levels.data() + kk);
      const __m512i signed_x = _mm512_mask_sub_epi8(x, negative, zero, x);
      const __m512i dot = _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(weights), signed_x);
      total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_loadu_ps(lane_scales + kk / 4), total);
    }
    out[row] = _mm512_reduce_add_ps(total) * scales[row];
  }
}

#endif  // TORNCHAT_VNNI

}  // namespace

bool vnni_supported() {
#ifdef TORNCHAT_VNNI
  static const bool supported = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
                                __builtin_cpu_supports("avx512vbmi");
  return supported;
#else
  return false;
#endif
}

at::Tensor vnni_int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_and_zeros) {
  RECORD_FUNCTION("tornchat::vnni_int4_mm", std::vector<c10::IValue>());
  TORCH_CHECK(vnni_supported(), "this CPU lacks AVX-512 VNNI and VBMI");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(), "packed must be uint8 [N, K / 2]");
  const int64_t n = packed.size(0), k = packed.size(1) * 2;
  TORCH_CHECK(n % BLOCK == 0 && k % GROUP == 0, "N must be a multiple of 64 and K of 32");
  TORCH_CHECK(scales_and_zeros.scalar_type() == at::kBFloat16 && scales_and_zeros.is_contiguous() &&
              scales_and_zeros.size(0) == k / GROUP && scales_and_zeros.size(1) == n && scales_and_zeros.size(2) == 2,
              "scales_and_zeros must be contiguous bf16 [K / 32, N, 2]");
  const auto rows = rows_fp32(x, k);
  auto out = at::empty({rows.size(0), n}, rows.options());
#ifdef TORNCHAT_VNNI
  std::vector<Quantized> quantized(rows.size(0));
  for (int64_t r = 0; r < rows.size(0); ++r) quantize_row(rows.data_ptr<float>() + r * k, k, quantized[r]);
  const uint8_t* bytes = packed.data_ptr<uint8_t>();
  const auto* params = reinterpret_cast<const uint32_t*>(scales_and_zeros.data_ptr());
  float* y = out.data_ptr<float>();
  at::parallel_for(0, n / BLOCK, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b)
      for (size_t r = 0; r < quantized.size(); ++r)
        int4_block(bytes + b * BLOCK * k / 2, params + b * BLOCK, n, k, quantized[r], y + r * n + b * BLOCK);
  });
#endif
  return out;
}

at::Tensor vnni_int8_mm(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales) {
  RECORD_FUNCTION("tornchat::vnni_int8_mm", std::vector<c10::IValue>());
  TORCH_CHECK(vnni_supported(), "this CPU lacks AVX-512 VNNI and VBMI");
  TORCH_CHECK(values.scalar_type() == at::kChar && values.dim() == 2 && values.is_contiguous(), "values must be int8 [N, K]");
  const int64_t n = values.size(0), k = values.size(1);
  TORCH_CHECK(k % 64 == 0 && scales.numel() == n, "K must be a multiple of 64, scales [N]");
  const auto rows = rows_fp32(x, k);
  const auto row_scales = scales.to(at::kFloat).contiguous();
  auto out = at::empty({rows.size(0), n}, rows.options());
#ifdef TORNCHAT_VNNI
  std::vector<Quantized> quantized(rows.size(0));
  std::vector<std::vector<float>> lane_scales(rows.size(0), std::vector<float>(k / 4));
  for (int64_t r = 0; r < rows.size(0); ++r) {
    quantize_row(rows.data_ptr<float>() + r * k, k, quantized[r]);
    for (int64_t lane = 0; lane < k / 4; ++lane) lane_scales[r][lane] = quantized[r].scale[lane * 4 / GROUP];
  }
  float* y = out.data_ptr<float>();
  at::parallel_for(0, n, 256, [&](int64_t first, int64_t last) {
    for (size_t r = 0; r < quantized.size(); ++r)
      int8_rows(values.data_ptr<int8_t>(), row_scales.data_ptr<float>(), k, first, last, quantized[r],
                lane_scales[r].data(), y + r * n);
  });
#endif
  return out;
}

}  // namespace tornchat
