// GGML blocks decoded to fp32 values, one pass over the bytes: the embedding rows a prompt looks up, and
// float copies of a quantized file where one is asked for (--quantize int8|int4, a GPU).
//
// The semantics are those of tornchat/engine/ggml.py (which the tests hold
// this to, bit for bit, and both to the gguf package's dequantizer). Every product of a
// block's scales and levels is exact in fp32 (at most 22 significant bits),
// so the order of the multiplications does not change a value.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Q4_K and Q5_K: sub-block j's 6-bit scale and minimum, from the 12 packed bytes.
void k_scale_min(const uint8_t* q, int j, float* scale, float* min) {
  if (j < 4) {
    *scale = q[j] & 63;
    *min = q[j + 4] & 63;
  } else {
    *scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

struct Type {
  int values, bytes;
};

Type type_of(const std::string& name) {
  if (name == "Q4_0") return {32, 18};
  if (name == "Q4_1") return {32, 20};
  if (name == "Q5_0") return {32, 22};
  if (name == "Q5_1") return {32, 24};
  if (name == "Q8_0") return {32, 34};
  if (name == "Q4_K") return {256, 144};
  if (name == "Q5_K") return {256, 176};
  if (name == "Q6_K") return {256, 210};
  TORCH_CHECK(false, "no C++ decoder for GGML type ", name);
}

// One row of a 4-bit type: levels 0..15, and per group of 32, value = level * scale + low.
void int4_row(const std::string& type, const uint8_t* row, int64_t k, uint8_t* levels, float* scales, float* lows) {
  const Type t = type_of(type);
  const bool q4_k = type == "Q4_K", q4_1 = type == "Q4_1";  // once a row: a comparison per block cost more
  for (int64_t b = 0; b < k / t.values; ++b) {
    const uint8_t* blk = row + b * t.bytes;
    uint8_t* out = levels + b * t.values;
    if (q4_k) {
      const float d = f16(blk), dmin = f16(blk + 2);
      for (int j = 0; j < 8; ++j) {
        float sc, m;
        k_scale_min(blk + 4, j, &sc, &m);
        scales[b * 8 + j] = d * sc;
        lows[b * 8 + j] = -dmin * m;
      }
      const uint8_t* qs = blk + 16;
      for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) {
          out[64 * c + l] = qs[32 * c + l] & 0xF;
          out[64 * c + 32 + l] = qs[32 * c + l] >> 4;
        }
    } else {
      const float d = f16(blk);
      scales[b] = d;
      lows[b] = q4_1 ? f16(blk + 2) : -8 * d;
      const uint8_t* qs = blk + (q4_1 ? 4 : 2);
      for (int l = 0; l < 16; ++l) {
        out[l] = qs[l] & 0xF;
        out[l + 16] = qs[l] >> 4;
      }
    }
  }
}

// One row of any type but the floats, as fp32 values.
void values_row(const std::string& type, const uint8_t* row, int64_t k, float* y) {
  const Type t = type_of(type);
  if (type == "Q4_0" || type == "Q4_1" || type == "Q4_K") {
    std::vector<uint8_t> levels(k);
    std::vector<float> scales(k / 32), lows(k / 32);
    int4_row(type, row, k, levels.data(), scales.data(), lows.data());
    for (int64_t i = 0; i < k; ++i) y[i] = levels[i] * scales[i / 32] + lows[i / 32];
    return;
  }
  const bool q8_0 = type == "Q8_0", q5_1 = type == "Q5_1", q5_0 = type == "Q5_0", q5_k = type == "Q5_K";
  for (int64_t b = 0; b < k / t.values; ++b) {
    const uint8_t* blk = row + b * t.bytes;
    float* out = y + b * t.values;
    if (q8_0) {
      const float d = f16(blk);
      for (int l = 0; l < 32; ++l) out[l] = static_cast<int8_t>(blk[2 + l]) * d;
    } else if (q5_0 || q5_1) {
      const uint8_t* qh = blk + (q5_1 ? 4 : 2);
      const uint8_t* qs = qh + 4;
      uint32_t high;
      std::memcpy(&high, qh, 4);
      const float d = f16(blk);
      for (int l = 0; l < 16; ++l) {
        const int q0 = (qs[l] & 0xF) | (((high >> l) & 1) << 4);
        const int q1 = (qs[l] >> 4) | (((high >> (l + 16)) & 1) << 4);
        if (q5_1) {
          const float m = f16(blk + 2);
          out[l] = q0 * d + m;
          out[l + 16] = q1 * d + m;
        } else {
          out[l] = (q0 - 16) * d;
          out[l + 16] = (q1 - 16) * d;
        }
      }
    } else if (q5_k) {
      const float d = f16(blk), dmin = f16(blk + 2);
      const uint8_t* qh = blk + 16;
      const uint8_t* qs = blk + 48;
      for (int c = 0; c < 4; ++c) {
        float sc1, m1, sc2, m2;
        k_scale_min(blk + 4, 2 * c, &sc1, &m1);
        k_scale_min(blk + 4, 2 * c + 1, &sc2, &m2);
        for (int l = 0; l < 32; ++l) {
          const int q0 = (qs[32 * c + l] & 0xF) | (((qh[l] >> (2 * c)) & 1) << 4);
          const int q1 = (qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4);
          out[64 * c + l] = d * sc1 * q0 - dmin * m1;
          out[64 * c + 32 + l] = d * sc2 * q1 - dmin * m2;
        }
      }
    } else {  // Q6_K
      const uint8_t* ql = blk;
      const uint8_t* qh = blk + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      const float d = f16(blk + 208);
      for (int half = 0; half < 2; ++half) {
        for (int l = 0; l < 32; ++l) {
          const int is = l / 16;
          const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
          const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
          const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
          const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
          out[128 * half + l] = d * sc[is] * q1;
          out[128 * half + l + 32] = d * sc[is + 2] * q2;
          out[128 * half + l + 64] = d * sc[is + 4] * q3;
          out[128 * half + l + 96] = d * sc[is + 6] * q4;
        }
        ql += 64;
        qh += 32;
        sc += 8;
      }
    }
  }
}

void check_raw(const at::Tensor& raw, const std::string& type, int64_t k) {
  TORCH_CHECK(raw.device().is_cpu() && raw.is_contiguous() && raw.scalar_type() == at::kByte && raw.dim() == 2,
              "raw must be a contiguous uint8 CPU tensor [rows, row_bytes]");
  const Type t = type_of(type);
  TORCH_CHECK(k % t.values == 0 && raw.size(1) == k / t.values * t.bytes, "row bytes do not fit ", k, " values of ", type);
}

// Any quantized type's rows -> fp32 values [N, K] (ggml.dequantize).
at::Tensor dequantize(const at::Tensor& raw, const std::string& type, int64_t k) {
  check_raw(raw, type, k);
  const int64_t n = raw.size(0), row_bytes = raw.size(1);
  auto out = at::empty({n, k}, at::kFloat);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) values_row(type, src + row * row_bytes, k, out.data_ptr<float>() + row * k);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(_ggml, m) {
  m.def("dequantize", &dequantize, "GGML rows into fp32 values", pybind11::call_guard<pybind11::gil_scoped_release>());
}
