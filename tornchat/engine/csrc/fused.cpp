// The lean forward's small operations, each one pass over its data.
//
// A decode step on a small model spends as long dispatching ~40 tiny eager
// PyTorch ops per layer as in its matmuls; each function here replaces
// several of them. Their semantics are defined by the PyTorch references
// in tornchat/engine/fused.py, which the tests compare them with. Arithmetic
// is fp32; bf16 outputs are rounded once, to nearest even.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/utils/pybind.h>

#include "gemv.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

template <typename Out>
void rms_norm_rows(const float* x, const float* w, Out* out, int64_t rows, int64_t hidden, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * hidden;
    Out* yr = out + r * hidden;
    float squares = 0.f;
    for (int64_t i = 0; i < hidden; ++i) squares += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
    for (int64_t i = 0; i < hidden; ++i) yr[i] = static_cast<Out>(xr[i] * inv * w[i]);
  }
}

// x [rows, hidden] fp32, weight [hidden] fp32 -> [rows, hidden], bf16 if bf16_out else fp32.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool bf16_out) {
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(weight, "weight");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm takes fp32");
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  TORCH_CHECK(weight.numel() == hidden, "weight must have x's last size");
  auto out = at::empty(x.sizes(), x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  if (bf16_out)
    rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<BFloat16>(), rows, hidden, float(eps));
  else
    rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), rows, hidden, float(eps));
  return out;
}

template <typename In, typename Kv>
void rope_store_rows(const In* qkv, const float* freqs, Kv* queries, Kv* keys, Kv* values, int64_t rows,
                     int64_t heads, int64_t kv_heads, int64_t head_dim) {
  const int64_t width = (heads + 2 * kv_heads) * head_dim, half = head_dim / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const In* row = qkv + r * width;
    const float* f = freqs + r * head_dim;  // (cos, sin) pairs, magnitude included
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
      const In* src = row + h * head_dim;
      Kv* dst = h < heads ? queries + (r * heads + h) * head_dim : keys + (r * kv_heads + h - heads) * head_dim;
      for (int64_t j = 0; j < half; ++j) {
        const float a = to_float(src[2 * j]), b = to_float(src[2 * j + 1]);
        const float c = f[2 * j], s = f[2 * j + 1];
        dst[2 * j] = static_cast<Kv>(a * c - b * s);
        dst[2 * j + 1] = static_cast<Kv>(a * s + b * c);
      }
    }
    const In* v = row + (heads + kv_heads) * head_dim;
    Kv* vdst = values + r * kv_heads * head_dim;
    for (int64_t i = 0; i < kv_heads * head_dim; ++i) vdst[i] = static_cast<Kv>(to_float(v[i]));
  }
}

// qkv [rows, (heads + 2 kv_heads) * head_dim] (fp32 or bf16), freqs [rows, head_dim / 2, 2] fp32,
// keys and values [rows, kv_heads, head_dim] views into the cache (fp32 or bf16, both alike).
// Rotates queries and keys, writes keys and values into the cache; returns queries [rows, heads, head_dim]
// in the cache's dtype.
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& freqs, at::Tensor keys, at::Tensor values,
                      int64_t heads, int64_t kv_heads) {
  check_cpu_contiguous(qkv, "qkv");
  check_cpu_contiguous(freqs, "freqs");
  check_cpu_contiguous(keys, "keys");
  check_cpu_contiguous(values, "values");
  const int64_t rows = qkv.size(0), head_dim = keys.size(-1);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * head_dim, "qkv width does not match the heads");
  TORCH_CHECK(freqs.scalar_type() == at::kFloat && freqs.numel() == rows * head_dim, "freqs must be fp32 [rows, head_dim / 2, 2]");
  TORCH_CHECK(keys.numel() == rows * kv_heads * head_dim && values.sizes() == keys.sizes(), "keys and values must be [rows, kv_heads, head_dim]");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type(), "keys and values must share a dtype");
  auto queries = at::empty({rows, heads, head_dim}, keys.options());
  const bool in_bf16 = qkv.scalar_type() == at::kBFloat16, kv_bf16 = keys.scalar_type() == at::kBFloat16;
  TORCH_CHECK(in_bf16 || qkv.scalar_type() == at::kFloat, "qkv must be fp32 or bf16");
  TORCH_CHECK(kv_bf16 || keys.scalar_type() == at::kFloat, "the cache must be fp32 or bf16");
  const float* f = freqs.data_ptr<float>();
#define ROPE(IN, KV) \
  rope_store_rows(qkv.data_ptr<IN>(), f, queries.data_ptr<KV>(), keys.data_ptr<KV>(), values.data_ptr<KV>(), rows, heads, kv_heads, head_dim)
  if (in_bf16 && kv_bf16) ROPE(BFloat16, BFloat16);
  else if (in_bf16) ROPE(BFloat16, float);
  else if (kv_bf16) ROPE(float, BFloat16);
  else ROPE(float, float);
#undef ROPE
  return queries;
}

template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t width) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gate_up + r * 2 * width;
    const T* up = gate + width;
    T* y = out + r * width;
    for (int64_t i = 0; i < width; ++i) {
      const float g = to_float(gate[i]);
      y[i] = static_cast<T>(g / (1.f + std::exp(-g)) * to_float(up[i]));
    }
  }
}

// gate_up [rows, 2 * width] (gate then up) -> silu(gate) * up [rows, width], same dtype (fp32 or bf16).
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_cpu_contiguous(gate_up, "gate_up");
  const int64_t width = gate_up.size(-1) / 2, rows = gate_up.numel() / (2 * width);
  auto out = at::empty({rows, width}, gate_up.options());
  if (gate_up.scalar_type() == at::kBFloat16)
    silu_mul_rows(gate_up.data_ptr<BFloat16>(), out.data_ptr<BFloat16>(), rows, width);
  else if (gate_up.scalar_type() == at::kFloat)
    silu_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, width);
  else
    TORCH_CHECK(false, "silu_mul takes fp32 or bf16");
  return out;
}

// Attention of decode rows over the cache, computed so that row r of n gets the same bits whatever n is:
// each row's scores, softmax and weighted sum depend only on its query and the positions 0 .. start + r it
// sees, in a fixed order. A speculative verify's rows then equal one-token steps, and a step pays no
// dispatch for a library kernel (PyTorch's SDPA took ~50 us a layer for one row on the embedded model).
// The loops are cloned per instruction set (vec.h).

// One query head's row r over positions 0 .. start + r, head_dim = CHUNKS * LANES (0: chunks at run time).
// Compile-time chunks keep a row's output in registers.
template <int64_t CHUNKS, typename Kv>
inline __attribute__((always_inline)) void attend_row(const float* query, const Kv* keys, const Kv* values,
                                                      float* out, float* scores, int64_t stride, int64_t runtime_chunks,
                                                      int64_t seen, float scale) {
  const int64_t chunks = CHUNKS ? CHUNKS : runtime_chunks;
  const IntVec lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  Vec q[16];
  for (int64_t c = 0; c < chunks; ++c) q[c] = load(query + c * LANES);
  int64_t j = 0;
  for (; j + 4 <= seen; j += 4) {  // four keys at a time: independent chains for the out-of-order core
    const Kv* k = keys + j * stride;
    Vec acc0 = q[0] * load(k), acc1 = q[0] * load(k + stride), acc2 = q[0] * load(k + 2 * stride),
        acc3 = q[0] * load(k + 3 * stride);
    for (int64_t c = 1; c < chunks; ++c) {
      acc0 += q[c] * load(k + c * LANES);
      acc1 += q[c] * load(k + stride + c * LANES);
      acc2 += q[c] * load(k + 2 * stride + c * LANES);
      acc3 += q[c] * load(k + 3 * stride + c * LANES);
    }
    scores[j] = sum(acc0) * scale;
    scores[j + 1] = sum(acc1) * scale;
    scores[j + 2] = sum(acc2) * scale;
    scores[j + 3] = sum(acc3) * scale;
  }
  for (; j < seen; ++j) {  // the same arithmetic as each chain above
    const Kv* k = keys + j * stride;
    Vec acc = q[0] * load(k);
    for (int64_t c = 1; c < chunks; ++c) acc += q[c] * load(k + c * LANES);
    scores[j] = sum(acc) * scale;
  }
  float top = scores[0];
  for (int64_t j = 1; j < seen; ++j) top = std::max(top, scores[j]);
  Vec totals = Vec{};
  for (int64_t j = 0; j < seen; j += LANES) {  // scores has room past seen: the tail lanes are zeroed
    const Vec e = exp_nonpositive(load(scores + j) - top);
    const Vec kept = (lane + static_cast<int32_t>(j)) < static_cast<int32_t>(seen) ? e : Vec{};
    std::memcpy(scores + j, &kept, sizeof kept);
    totals += kept;
  }
  const float inverse = 1.0f / sum(totals);
  Vec even[16], odd[16];  // sums over even and odd positions: two chains
  for (int64_t c = 0; c < chunks; ++c) even[c] = odd[c] = Vec{};
  for (j = 0; j + 2 <= seen; j += 2) {
    const Kv* v = values + j * stride;
    const float w0 = scores[j], w1 = scores[j + 1];
    for (int64_t c = 0; c < chunks; ++c) {
      even[c] += w0 * load(v + c * LANES);
      odd[c] += w1 * load(v + stride + c * LANES);
    }
  }
  if (j < seen) {
    const Kv* v = values + j * stride;
    for (int64_t c = 0; c < chunks; ++c) even[c] += scores[j] * load(v + c * LANES);
  }
  for (int64_t c = 0; c < chunks; ++c) {
    const Vec scaled = (even[c] + odd[c]) * inverse;
    std::memcpy(out + c * LANES, &scaled, sizeof scaled);
  }
}

// Query head `head`'s rows r = 0 .. n - 1, row r over positions 0 .. start + r.
template <typename Kv>
inline __attribute__((always_inline)) void attend_head(const float* q, const Kv* keys, const Kv* values, float* out,
                                                       float* scores, int64_t n, int64_t heads, int64_t kv_heads,
                                                       int64_t d, int64_t head, int64_t start, float scale) {
  const int64_t stride = kv_heads * d, offset = head / (heads / kv_heads) * d, chunks = d / LANES;
  for (int64_t r = 0; r < n; ++r) {
    const float* query = q + (r * heads + head) * d;
    float* dst = out + (r * heads + head) * d;
    const int64_t seen = start + r + 1;
    switch (chunks) {  // the common head_dims: 32, 64, 128
      case 2: attend_row<2>(query, keys + offset, values + offset, dst, scores, stride, chunks, seen, scale); break;
      case 4: attend_row<4>(query, keys + offset, values + offset, dst, scores, stride, chunks, seen, scale); break;
      case 8: attend_row<8>(query, keys + offset, values + offset, dst, scores, stride, chunks, seen, scale); break;
      default: attend_row<0>(query, keys + offset, values + offset, dst, scores, stride, chunks, seen, scale);
    }
  }
}

CLONED
void attend_head_fp32(const float* q, const float* keys, const float* values, float* out, float* scores, int64_t n,
                      int64_t heads, int64_t kv_heads, int64_t d, int64_t head, int64_t start, float scale) {
  attend_head(q, keys, values, out, scores, n, heads, kv_heads, d, head, start, scale);
}

CLONED
void attend_head_bf16(const float* q, const BFloat16* keys, const BFloat16* values, float* out, float* scores, int64_t n,
                      int64_t heads, int64_t kv_heads, int64_t d, int64_t head, int64_t start, float scale) {
  attend_head(q, keys, values, out, scores, n, heads, kv_heads, d, head, start, scale);
}

// q [n, heads, head_dim] (fp32 or bf16), keys and values one layer's cache [capacity, kv_heads, head_dim]
// (fp32 or bf16) holding positions 0 .. start + n - 1. Returns fp32 [n, heads * head_dim]: row r attended over
// positions 0 .. start + r, softmax(scale * q . k) v, as fused.attend_ref computes it.
at::Tensor attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t start, double scale) {
  RECORD_FUNCTION("tornchat::attend", std::vector<c10::IValue>());  // for torch.profiler (bench/decode_speed.py)
  check_cpu_contiguous(keys, "keys");
  check_cpu_contiguous(values, "values");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type() && keys.sizes() == values.sizes(), "keys and values must match");
  TORCH_CHECK(keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16, "the cache must be fp32 or bf16");
  const auto queries = q.to(at::kFloat).contiguous();
  const int64_t n = queries.size(0), heads = queries.size(1), d = queries.size(2), kv_heads = keys.size(1);
  TORCH_CHECK(keys.size(2) == d && heads % kv_heads == 0 && start + n <= keys.size(0), "q does not fit the cache");
  TORCH_CHECK(d % LANES == 0 && d <= 16 * LANES, "head_dim must be a multiple of 16, at most 256");
  auto out = at::empty({n, heads * d}, queries.options());
  const float* qp = queries.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool bf16 = keys.scalar_type() == at::kBFloat16;
  // Contiguous heads per thread: heads sharing a KV head follow one another, which finds its keys in cache.
  at::parallel_for(0, heads, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores(start + n + LANES);
    for (int64_t head = first; head < last; ++head) {
      if (bf16)
        attend_head_bf16(qp, keys.data_ptr<BFloat16>(), values.data_ptr<BFloat16>(), op, scores.data(), n, heads,
                         kv_heads, d, head, start, float(scale));
      else
        attend_head_fp32(qp, keys.data_ptr<float>(), values.data_ptr<float>(), op, scores.data(), n, heads, kv_heads,
                         d, head, start, float(scale));
    }
  });
  return out;
}

// A projection as the decode step reads it: plain weights (F.linear), packed int4 or per-row int8, through
// PyTorch's kernels or, on int8 activations, gemv.cpp's (VNNI_INT4, VNNI_INT8: fed fp32, they quantize it).
struct Linear {
  enum Kind : int64_t { PLAIN = 0, INT4 = 1, INT8 = 2, VNNI_INT4 = 3, VNNI_INT8 = 4 };
  int64_t kind;
  at::Tensor a, b;  // plain: weight, -; int4: packed, scales_and_zeros; int8: values, scales
  int64_t group_size;

  at::ScalarType input() const {
    return kind == PLAIN ? a.scalar_type() : kind >= VNNI_INT4 ? at::kFloat : b.scalar_type();
  }

  // Every kind gives each row of x the bits it gives that row alone, so a verify step over n rows computes
  // what n one-row steps would: the int4 and int8 kernels reduce each row the same way whatever the row
  // count, while a plain matmul's reduction order changes with it (GEMV against GEMM), hence one row at a time.
  at::Tensor operator()(const at::Tensor& x) const {
    const auto in = x.to(input());
    if (kind == INT4) return at::_weight_int4pack_mm_for_cpu(in, a, group_size, b);
    if (kind == INT8) return at::_weight_int8pack_mm(in, a, b);
    if (kind == VNNI_INT4) return tornchat::vnni_int4_mm(in, a, b);
    if (kind == VNNI_INT8) return tornchat::vnni_int8_mm(in, a, b);
    if (in.size(0) == 1) return at::linear(in, a);
    std::vector<at::Tensor> rows;
    for (int64_t r = 0; r < in.size(0); ++r) rows.push_back(at::linear(in.narrow(0, r, 1), a));
    return at::cat(rows);
  }
};

struct Layer {
  at::Tensor attn_norm, ffn_norm, bqkv;  // bqkv: empty where the model has no q/k/v biases
  Linear wqkv, wo, w13, w2;
};

// Decode steps through every layer, the Python loop of llama.LlamaRunner._layers in one call: that loop's
// ~25 Python-level operations per layer cost more than the layer's small kernels. n rows at once (a
// speculative verify) give each row exactly what a one-row step at its position gives: rows meet only
// in attention, whose every row is computed as if alone (attend).
class DecodeStep {
 public:
  // Per layer, tensors: attn_norm, ffn_norm, bqkv (or empty), then a and b of wqkv, wo, w13, w2 (b empty for
  // plain weights); ints: the kind and the group size of wqkv, wo, w13, w2.
  // own_attention: attend, else PyTorch's SDPA row by row (whichever autotune timed faster for the model).
  DecodeStep(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& ints, int64_t heads, int64_t kv_heads,
             double eps, double scale, bool own_attention)
      : heads_(heads), kv_heads_(kv_heads), eps_(eps), scale_(scale), own_attention_(own_attention) {
    TORCH_CHECK(tensors.size() % 11 == 0 && ints.size() * 11 == tensors.size() * 8, "11 tensors and 8 ints per layer");
    for (size_t i = 0; i < tensors.size() / 11; ++i) {
      const at::Tensor* t = &tensors[11 * i];
      const int64_t* n = &ints[8 * i];
      layers_.push_back(Layer{t[0], t[1], t[2], Linear{n[0], t[3], t[4], n[4]}, Linear{n[1], t[5], t[6], n[5]},
                              Linear{n[2], t[7], t[8], n[6]}, Linear{n[3], t[9], t[10], n[7]}});
    }
  }

  // x [n, hidden] fp32, the tokens' embeddings; kv [layers, 2, capacity, kv_heads, head_dim], freqs
  // [n, head_dim / 2, 2] of positions start..start + n - 1. Writes the tokens' keys and values there;
  // returns x after the layers.
  at::Tensor forward(at::Tensor x, const at::Tensor& kv, const at::Tensor& freqs, int64_t start) const {
    const int64_t n = x.size(0), head_dim = kv.size(-1), groups = heads_ / kv_heads_;
    TORCH_CHECK(kv.size(0) == static_cast<int64_t>(layers_.size()) && start + n <= kv.size(2) && freqs.size(0) == n,
                "the cache does not fit this step");
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      auto qkv = layer.wqkv(rms_norm(x, layer.attn_norm, eps_, layer.wqkv.input() == at::kBFloat16));
      if (layer.bqkv.numel()) qkv = qkv + layer.bqkv;
      const auto keys = kv.select(0, i).select(0, 0), values = kv.select(0, i).select(0, 1);
      auto q = rope_store(qkv.contiguous(), freqs, keys.narrow(0, start, n), values.narrow(0, start, n), heads_, kv_heads_);
      x = x + layer.wo(own_attention_ ? attend(q, keys, values, start, scale_) : sdpa_rows(q, keys, values, start));
      x = x + layer.w2(silu_mul(layer.w13(rms_norm(x, layer.ffn_norm, eps_, layer.w13.input() == at::kBFloat16))));
    }
    return x;
  }

 private:
  std::vector<Layer> layers_;
  // Each row alone, in the call a one-row step makes.
  at::Tensor sdpa_rows(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t start) const {
    const int64_t n = q.size(0), head_dim = q.size(2), groups = heads_ / kv_heads_;
    std::vector<at::Tensor> rows;
    for (int64_t r = 0; r < n; ++r) {
      const int64_t seen = start + r + 1;
      rows.push_back(at::scaled_dot_product_attention(
          q.narrow(0, r, 1).view({1, kv_heads_, groups, head_dim}), keys.narrow(0, 0, seen).unsqueeze(0).transpose(1, 2),
          values.narrow(0, 0, seen).unsqueeze(0).transpose(1, 2), {}, 0.0, false, scale_).reshape({1, heads_ * head_dim}));
    }
    return n == 1 ? rows[0] : at::cat(rows);
  }

  int64_t heads_, kv_heads_;
  double eps_, scale_;
  bool own_attention_;
};

// Packed int4 weights -> [N, K] values (level - 8) * scale + zero, as quant.Int4Weight.dequantize computes
// them: in fp32, or with each operation rounded to bf16 as PyTorch's bf16 elementwise ops round. The layout
// (quant.Int4Layout): blocks of block_rows rows, each [K, block_rows / 2] bytes; byte j holds rows j and
// j + block_rows / 2 (halves) or rows 2j and 2j + 1, the first in the low nibble.
//
// A prefill chunk dequantizes every layer it runs through, so this must cost little beside the matrix
// product it feeds: the values are written as [K, N], where one input feature's bytes hold consecutive
// rows (16-lane vectors, contiguous stores), and handed back as its transposed view; a matmul reads
// either order. (Writing [N, K] a value at a time took 83 ms for a 1B model's gate and up projection,
// twice their bf16 product on 512 rows.)
inline __attribute__((always_inline)) UintVec bf16_bits(Vec v) {  // round to nearest even, as c10::BFloat16
  UintVec u;
  std::memcpy(&u, &v, sizeof u);
  return (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
}

inline __attribute__((always_inline)) Vec bf16_round(Vec v) {
  const UintVec u = bf16_bits(v);
  Vec r;
  std::memcpy(&r, &u, sizeof r);
  return r;
}

typedef uint8_t ByteVec __attribute__((vector_size(16)));

// Input features [first_k, last_k) of one group, every block of rows: each feature's values are one
// contiguous run of the output, its scales and zeros one contiguous run of params (already rounded to the
// output type). fp-contract off: (level - 8) * scale + zero is two roundings in the reference, not an FMA.
CLONED __attribute__((optimize("fp-contract=off"))) void dequantize_features(
    const uint8_t* packed, const float* scale, const float* zero, void* out, int64_t n, int64_t k, int64_t first_k,
    int64_t last_k, int64_t block_rows, bool halves, bool bf16_out) {
  const int64_t half = block_rows / 2;
  for (int64_t kk = first_k; kk < last_k; ++kk) {
    for (int64_t row0 = 0; row0 < n; row0 += block_rows) {
      const uint8_t* bytes = packed + row0 * k / 2 + kk * half;  // block row0 / block_rows is [K, half] bytes
      for (int64_t j = 0; j < half; j += LANES) {
        ByteVec raw;
        std::memcpy(&raw, bytes + j, sizeof raw);
        const IntVec wide = __builtin_convertvector(raw, IntVec);
        Vec low = __builtin_convertvector((wide & 15) - 8, Vec), high = __builtin_convertvector((wide >> 4) - 8, Vec);
        int64_t at_low = row0 + j, at_high = row0 + j + half;  // halves: rows j.., j + half..
        if (!halves) {  // rows 2j, 2j + 1, ...: interleave
          const Vec a = __builtin_shufflevector(low, high, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
          const Vec b = __builtin_shufflevector(low, high, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
          low = a, high = b, at_low = row0 + 2 * j, at_high = row0 + 2 * j + LANES;
        }
        for (int part = 0; part < 2; ++part) {
          const int64_t at = part ? at_high : at_low;
          const Vec level = part ? high : low;
          const Vec product = level * load(scale + at);  // a statement of its own: no compiler fuses it
          if (bf16_out) {
            const UintVec value = bf16_bits(bf16_round(product) + load(zero + at));
            const HalfVec bits = __builtin_convertvector(value >> 16, HalfVec);
            std::memcpy(static_cast<uint16_t*>(out) + kk * n + at, &bits, sizeof bits);
          } else {
            const Vec value = product + load(zero + at);
            std::memcpy(static_cast<float*>(out) + kk * n + at, &value, sizeof value);
          }
        }
      }
    }
  }
}

// into: a [K, N] buffer to write into (a prefill reuses one per matrix: a fresh 67 MB tensor costs its
// page faults, ~25 ms, at every layer), or none for a new tensor.
at::Tensor dequantize_int4(const at::Tensor& packed, const at::Tensor& scales_and_zeros, int64_t group, int64_t block_rows,
                           bool halves, bool bf16_out, const std::optional<at::Tensor>& into) {
  check_cpu_contiguous(packed, "packed");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2, "packed must be uint8 [N, K / 2]");
  const int64_t n = packed.size(0), k = packed.size(1) * 2;
  TORCH_CHECK(n % block_rows == 0 && k % group == 0 && scales_and_zeros.size(0) == k / group &&
              scales_and_zeros.size(1) == n && block_rows % (2 * LANES) == 0, "packed rows, groups and scales_and_zeros do not fit");
  // [K / group, N, 2] -> per group, scales then zeros of every row, rounded once to the output type.
  auto params = scales_and_zeros.to(bf16_out ? at::kBFloat16 : at::kFloat).to(at::kFloat).permute({0, 2, 1}).contiguous();
  const float* p = params.data_ptr<float>();
  const auto dtype = bf16_out ? at::kBFloat16 : at::kFloat;
  at::Tensor out = into ? *into : at::empty({k, n}, dtype);
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == dtype && out.size(0) == k && out.size(1) == n,
              "into must be a contiguous [K, N] tensor of the output dtype");
  const uint8_t* bytes = packed.data_ptr<uint8_t>();
  void* y = out.data_ptr();
  at::parallel_for(0, k / group, 1, [&](int64_t first, int64_t last) {
    for (int64_t g = first; g < last; ++g) {
      const float* scale = p + (g * 2) * n;
      dequantize_features(bytes, scale, scale + n, y, n, k, g * group, (g + 1) * group, block_rows, halves, bf16_out);
    }
  });
  return out.t();
}

}  // namespace

PYBIND11_MODULE(_fused, m) {
  m.def("rms_norm", &rms_norm, "RMS norm of fp32 rows, out in fp32 or bf16");
  m.def("rope_store", &rope_store, "RoPE on queries and keys; keys and values written into the cache");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("attend", &attend, "causal attention of n decode rows over the cache, each row as if alone");
  m.def("dequantize_int4", &dequantize_int4, "packed int4 weights to fp32 or bf16 values, as a [K, N] tensor's transposed view",
        pybind11::arg("packed"), pybind11::arg("scales_and_zeros"), pybind11::arg("group"), pybind11::arg("block_rows"),
        pybind11::arg("halves"), pybind11::arg("bf16_out"), pybind11::arg("into") = std::nullopt,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("vnni_supported", &tornchat::vnni_supported, "whether this CPU runs vnni_int4_mm and vnni_int8_mm");
  m.def("vnni_int4_mm", &tornchat::vnni_int4_mm, "x times packed int4 weights on int8 activations (gemv.cpp)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("vnni_int8_mm", &tornchat::vnni_int8_mm, "x times per-row int8 weights on int8 activations (gemv.cpp)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<DecodeStep>(m, "DecodeStep")
      .def(pybind11::init<const std::vector<at::Tensor>&, const std::vector<int64_t>&, int64_t, int64_t, double, double,
                          bool>())
      // Without the GIL: the server's IOLoop thread keeps answering and streaming during a step.
      .def("forward", &DecodeStep::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
