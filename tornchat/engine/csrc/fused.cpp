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

#include "blocks.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

// The row loops below split rows between threads (a prefill chunk's 512 rows; a step's one stays on this
// thread): each row is computed by itself, the same way whatever the split.
constexpr int64_t ROW_GRAIN = 16;

template <typename Out>
void rms_norm_rows(const float* x, const float* w, Out* out, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* xr = x + r * hidden;
      Out* yr = out + r * hidden;
      float squares = 0.f;
      for (int64_t i = 0; i < hidden; ++i) squares += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
      for (int64_t i = 0; i < hidden; ++i) yr[i] = static_cast<Out>(xr[i] * inv * w[i]);
    }
  });
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
  at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
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
  });
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
  at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const T* gate = gate_up + r * 2 * width;
      const T* up = gate + width;
      T* y = out + r * width;
      for (int64_t i = 0; i < width; ++i) {
        const float g = to_float(gate[i]);
        y[i] = static_cast<T>(g / (1.f + std::exp(-g)) * to_float(up[i]));
      }
    }
  });
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

// A projection: its weights' parts in their GGML types (blocks.h), each row computed as if alone.
struct Linear {
  std::vector<at::Tensor> parts;
  std::vector<int64_t> types;
  std::string isa;  // the kernels' instruction-set path (blocks.h)

  at::Tensor operator()(const at::Tensor& x) const { return tornchat::block_mm(x, parts, types, isa); }
};

struct Layer {
  at::Tensor attn_norm, ffn_norm, bqkv;  // bqkv: empty where the model has no q/k/v biases
  Linear wqkv, wo, w13, w2;
};

// The lean forward through every layer in one call, the Python loop of llama.LlamaRunner._layers without its
// ~25 Python-level operations per layer, which cost more than a decode step's small kernels. n rows at once
// (a decode step's one, a verify's k + 1, a prefill chunk's up to 512) give each row exactly what that row
// alone at its position gives: rows meet only in attention, whose every row is computed as if alone
// (attend), and every other operation, the block kernels included, computes a row by itself.
class Forward {
 public:
  // Per layer: vectors attn_norm, ffn_norm, bqkv (or empty); the parts and GGML types of wqkv, wo, w13, w2.
  // isa: the block kernels' path, one of block_isas().
  Forward(const std::vector<at::Tensor>& vectors, const std::vector<std::vector<at::Tensor>>& parts,
          const std::vector<std::vector<int64_t>>& types, int64_t heads, int64_t kv_heads, double eps, double scale,
          const std::string& isa)
      : heads_(heads), kv_heads_(kv_heads), eps_(eps), scale_(scale) {
    TORCH_CHECK(vectors.size() % 3 == 0 && parts.size() == vectors.size() / 3 * 4 && types.size() == parts.size(),
                "3 vectors and 4 matrices per layer");
    for (size_t i = 0; i < vectors.size() / 3; ++i) {
      const auto linear = [&](size_t m) { return Linear{parts[4 * i + m], types[4 * i + m], isa}; };
      layers_.push_back(Layer{vectors[3 * i], vectors[3 * i + 1], vectors[3 * i + 2], linear(0), linear(1), linear(2),
                              linear(3)});
    }
  }

  // x [n, hidden] fp32, the tokens' embeddings; kv [layers, 2, capacity, kv_heads, head_dim], freqs
  // [n, head_dim / 2, 2] of positions start..start + n - 1. Writes the tokens' keys and values there;
  // returns x after the layers.
  at::Tensor forward(at::Tensor x, const at::Tensor& kv, const at::Tensor& freqs, int64_t start) const {
    const int64_t n = x.size(0);
    TORCH_CHECK(kv.size(0) == static_cast<int64_t>(layers_.size()) && start + n <= kv.size(2) && freqs.size(0) == n,
                "the cache does not fit this step");
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      auto qkv = layer.wqkv(rms_norm(x, layer.attn_norm, eps_, false));
      if (layer.bqkv.numel()) qkv = qkv + layer.bqkv;
      const auto keys = kv.select(0, i).select(0, 0), values = kv.select(0, i).select(0, 1);
      auto q = rope_store(qkv.contiguous(), freqs, keys.narrow(0, start, n), values.narrow(0, start, n), heads_, kv_heads_);
      x = x + layer.wo(attend(q, keys, values, start, scale_));
      x = x + layer.w2(silu_mul(layer.w13(rms_norm(x, layer.ffn_norm, eps_, false))));
    }
    return x;
  }

 private:
  std::vector<Layer> layers_;
  int64_t heads_, kv_heads_;
  double eps_, scale_;
};

}  // namespace

PYBIND11_MODULE(_fused, m) {
  m.def("rms_norm", &rms_norm, "RMS norm of fp32 rows, out in fp32 or bf16");
  m.def("rope_store", &rope_store, "RoPE on queries and keys; keys and values written into the cache");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("attend", &attend, "causal attention of n decode rows over the cache, each row as if alone");
  tornchat::define_blocks(m);
  pybind11::class_<Forward>(m, "Forward")
      .def(pybind11::init<const std::vector<at::Tensor>&, const std::vector<std::vector<at::Tensor>>&,
                          const std::vector<std::vector<int64_t>>&, int64_t, int64_t, double, double,
                          const std::string&>())
      // Without the GIL: the server's IOLoop thread keeps answering and streaming during a step.
      .def("forward", &Forward::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
