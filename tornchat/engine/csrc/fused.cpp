// The lean forward's small operations, each one pass over its data, and the whole forward (Forward) that runs them
// with attention (attention.cpp) and the block kernels' products (blocks/) layer after layer.
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

#include "attention.h"
#include "blocks.h"
#include "kv_layout.h"
#include "team.h"
#include "vec.h"

#ifdef VEC_X86
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using tornchat::attend;
using tornchat::attend_many;
using tornchat::attend_path;
using tornchat::AttendPath;
using tornchat::LayerCache;

// The row loops below split rows between threads (a prefill chunk's 512 rows; a step's one stays on this
// thread): each row is computed by itself, the same way whatever the split.
constexpr int64_t ROW_GRAIN = 16;

// x[0]^2 + .. + x[n - 1]^2 in 8 lanes, value i into lane i % 8 in order, the lanes summed as the block kernels sum
// theirs: a fixed order the compiler can vectorize (one running sum was a chain of n dependent additions: 2.5 us
// of a 135M layer's norm, 2026-11-28).
inline float sum_of_squares(const float* x, int64_t n) {
  float lanes[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) lanes[j] += x[i + j] * x[i + j];
  for (; i < n; ++i) lanes[i % 8] += x[i] * x[i];
  return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
}

// delta (or null): added to x in place first, the residual stream's update (x + delta, the same fp32 sums as
// PyTorch's), so that the forward's add and the next norm are one pass and x stays one buffer.
template <typename Out>
void rms_norm_rows(float* x, const float* delta, const float* w, Out* out, int64_t rows, int64_t hidden, float eps) {
  tornchat::team::parallel_for(0, rows, ROW_GRAIN, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      float* xr = x + r * hidden;
      Out* yr = out + r * hidden;
      if (delta)
        for (int64_t i = 0; i < hidden; ++i) xr[i] += delta[r * hidden + i];
      const float inv = 1.f / std::sqrt(sum_of_squares(xr, hidden) / static_cast<float>(hidden) + eps);
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
  float* xp = const_cast<float*>(x.data_ptr<float>());  // read only: no delta
  if (bf16_out)
    rms_norm_rows(xp, nullptr, weight.data_ptr<float>(), out.data_ptr<BFloat16>(), rows, hidden, float(eps));
  else
    rms_norm_rows(xp, nullptr, weight.data_ptr<float>(), out.data_ptr<float>(), rows, hidden, float(eps));
  return out;
}

// x += delta in place (both fp32 [rows, hidden]), then rms_norm(x, weight) in fp32: what x = x + delta followed by
// rms_norm gives, without a new x and a second pass. out: result_tensor's.
at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps,
                        at::Tensor out = at::Tensor()) {
  check_cpu_contiguous(delta, "delta");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == at::kFloat, "delta must be fp32 of x's shape");
  out = result_tensor(std::move(out), x.sizes(), x.options());
  rms_norm_rows(x.data_ptr<float>(), delta.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(),
                x.size(0), x.size(-1), float(eps));
  return out;
}

// One head's head_dim values rotated: pairs (a, b) at 2j, 2j + 1 with f's (cos, sin) of pair j give a c - b s and
// a s + b c, each product rounded before the sum (no fused multiply-add: vec.h), 8 values a vector where the CPU
// has AVX2: the same bits either way.
#ifdef VEC_X86
TARGET_AVX2 void rotate_avx2(const float* x, const float* f, float* out, int64_t head_dim) {
  for (int64_t i = 0; i < head_dim; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i), cs = _mm256_loadu_ps(f + i);
    const __m256 cos_products = _mm256_mul_ps(v, _mm256_moveldup_ps(cs));  // a c, b c
    const __m256 sin_products = _mm256_mul_ps(_mm256_permute_ps(v, 0xB1), _mm256_movehdup_ps(cs));  // b s, a s
    _mm256_storeu_ps(out + i, _mm256_addsub_ps(cos_products, sin_products));
  }
}
#endif

void rotate(const float* x, const float* f, float* out, int64_t head_dim) {
#ifdef VEC_X86
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2 && head_dim % 8 == 0) return rotate_avx2(x, f, out, head_dim);
#endif
  for (int64_t j = 0; j < head_dim / 2; ++j) {
    const float a = x[2 * j], b = x[2 * j + 1], c = f[2 * j], s = f[2 * j + 1];
    out[2 * j] = a * c - b * s;
    out[2 * j + 1] = a * s + b * c;
  }
}

// Rows r = 0 .. rows - 1 are positions start + r; keys and values point at position 0 of a layer's cache.
// qk_norm: null, or [2, head_dim] weights (queries', keys') of a per-head RMS norm before the rotation (Qwen3).
// Queries are rounded to the cache's type Kv and stored as Q: Kv, or fp32 for attention to read as it is.
template <bool FORWARD, typename In, typename Q, typename Kv>
void rope_store_rows(const In* qkv, const float* freqs, const float* qk_norm, float eps, Q* queries, Kv* keys,
                     Kv* values, int64_t rows, int64_t start, int64_t heads, int64_t kv_heads, int64_t head_dim) {
  const int64_t width = (heads + 2 * kv_heads) * head_dim;
  TORCH_CHECK(head_dim % 2 == 0 && head_dim <= 256, "head_dim must be even, at most 256");
  tornchat::team::parallel_for(0, rows, ROW_GRAIN, [&](int64_t first, int64_t last) {
    float x[256], rotated[256];
    for (int64_t r = first; r < last; ++r) {
      const In* row = qkv + r * width;
      const float* f = freqs + r * head_dim;  // (cos, sin) pairs, magnitude included
      const int64_t p = start + r;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        const In* src = row + h * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) x[i] = to_float(src[i]);
        if (qk_norm) {
          const float* w = qk_norm + (h < heads ? 0 : head_dim);
          const float inv = 1.f / std::sqrt(sum_of_squares(x, head_dim) / static_cast<float>(head_dim) + eps);
          for (int64_t i = 0; i < head_dim; ++i) x[i] = x[i] * inv * w[i];
        }
        rotate(x, f, rotated, head_dim);
        if (h < heads) {
          Q* q = queries + (r * heads + h) * head_dim;
          for (int64_t i = 0; i < head_dim; ++i) q[i] = static_cast<Q>(static_cast<Kv>(rotated[i]));
        } else {
          for (int64_t i = 0; i < head_dim; ++i)
            keys[key_at<FORWARD, Kv>(p, h - heads, i, kv_heads, head_dim)] = static_cast<Kv>(rotated[i]);
        }
      }
      const In* v = row + (heads + kv_heads) * head_dim;
      for (int64_t h = 0; h < kv_heads; ++h)
        for (int64_t i = 0; i < head_dim; ++i)
          values[value_at<FORWARD, Kv>(p, h, i, kv_heads, head_dim)] = static_cast<Kv>(to_float(v[h * head_dim + i]));
    }
  });
}

// qk_norm's weights (rope_store_rows), or null where it is empty.
const float* qk_norm_weights(const at::Tensor& qk_norm, int64_t head_dim) {
  if (!qk_norm.numel()) return nullptr;
  check_cpu_contiguous(qk_norm, "qk_norm");
  TORCH_CHECK(qk_norm.scalar_type() == at::kFloat && qk_norm.numel() == 2 * head_dim, "qk_norm must be fp32 [2, head_dim]");
  return qk_norm.data_ptr<float>();
}

// Rows row0 .. row0 + rows - 1 of qkv (fp32 or bf16) and freqs, at positions start ..: their rotated queries into
// the same rows of queries [.., heads, head_dim] (the cache's dtype, or fp32 holding the values rounded to it),
// their keys and values into one layer's cache at keys and values (bf16 where kv_bf16, else fp32;
// rope_store_rows). Pointers, not views: a step made five views a layer and sequence, which cost more than the
// step's rotation itself.
template <bool FORWARD>
void rope_store_into(const at::Tensor& qkv, const at::Tensor& freqs, const float* norm, double eps, at::Tensor& queries,
                     bool kv_bf16, void* keys, void* values, int64_t row0, int64_t rows, int64_t start, int64_t heads,
                     int64_t kv_heads) {
  const int64_t head_dim = queries.size(-1), width = (heads + 2 * kv_heads) * head_dim;
  TORCH_CHECK(qkv.is_contiguous() && qkv.dim() == 2 && qkv.size(1) == width && row0 + rows <= qkv.size(0) &&
                  queries.is_contiguous() && row0 + rows <= queries.size(0),
              "qkv must be contiguous [rows, (heads + 2 kv_heads) * head_dim], the queries' rows among them");
  const bool in_bf16 = qkv.scalar_type() == at::kBFloat16, q_fp32 = queries.scalar_type() == at::kFloat;
  TORCH_CHECK(in_bf16 || qkv.scalar_type() == at::kFloat, "qkv must be fp32 or bf16");
  TORCH_CHECK(q_fp32 || (kv_bf16 && queries.scalar_type() == at::kBFloat16), "queries must be fp32 or the cache's dtype");
  const float* f = freqs.data_ptr<float>() + row0 * head_dim;
#define ROPE(IN, Q, KV)                                                                                           \
  rope_store_rows<FORWARD>(qkv.data_ptr<IN>() + row0 * width, f, norm, float(eps),                                \
                           queries.data_ptr<Q>() + row0 * heads * head_dim, static_cast<KV*>(keys),                \
                           static_cast<KV*>(values), rows, start, heads, kv_heads, head_dim)
  if (in_bf16 && kv_bf16 && q_fp32) ROPE(BFloat16, float, BFloat16);
  else if (in_bf16 && kv_bf16) ROPE(BFloat16, BFloat16, BFloat16);
  else if (in_bf16) ROPE(BFloat16, float, float);
  else if (kv_bf16 && q_fp32) ROPE(float, float, BFloat16);
  else if (kv_bf16) ROPE(float, BFloat16, BFloat16);
  else ROPE(float, float, float);
#undef ROPE
}

// qkv [rows, (heads + 2 kv_heads) * head_dim] (fp32 or bf16), freqs [rows, head_dim / 2, 2] fp32,
// keys and values [rows, kv_heads, head_dim] views into the cache (fp32 or bf16, both alike), the standard layout;
// qk_norm None or fp32 [2, head_dim] (rope_store_rows). Rotates queries and keys, writes keys and values into the
// cache; returns queries [rows, heads, head_dim] in the cache's dtype.
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& freqs, at::Tensor keys, at::Tensor values,
                      int64_t heads, int64_t kv_heads, const std::optional<at::Tensor>& qk_norm, double eps) {
  check_cpu_contiguous(qkv, "qkv");
  check_cpu_contiguous(freqs, "freqs");
  check_cpu_contiguous(keys, "keys");
  check_cpu_contiguous(values, "values");
  const int64_t rows = qkv.size(0), head_dim = keys.size(-1);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * head_dim, "qkv width does not match the heads");
  TORCH_CHECK(freqs.scalar_type() == at::kFloat && freqs.numel() == rows * head_dim, "freqs must be fp32 [rows, head_dim / 2, 2]");
  TORCH_CHECK(keys.numel() == rows * kv_heads * head_dim && values.sizes() == keys.sizes(), "keys and values must be [rows, kv_heads, head_dim]");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type(), "keys and values must share a dtype");
  TORCH_CHECK(keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16, "the cache must be fp32 or bf16");
  auto queries = at::empty({rows, heads, head_dim}, keys.options());
  rope_store_into<false>(qkv, freqs, qk_norm_weights(qk_norm.value_or(at::Tensor()), head_dim), eps, queries,
                         keys.scalar_type() == at::kBFloat16, keys.data_ptr(), values.data_ptr(), 0, rows, 0, heads,
                         kv_heads);
  return queries;
}

// act(gate) * up over 16 lanes, act(g) = g * sigmoid(s): SiLU's s = g, or GELU's tanh approximation (Gemma 3),
// whose 0.5 (1 + tanh u) is sigmoid(2u), s = 2u = 2 sqrt(2 / pi) (g + 0.044715 g^3). In vectors, not libm's
// scalar tanh and exp per value: those took a third of a Gemma 3 prefill.
template <bool GELU, typename F>
inline __attribute__((always_inline)) F gated_lanes(F g, F up) {
  const F s = GELU ? g * fmadd(splat<F>(0.07135481627159893f), g * g, splat<F>(1.5957691216057308f)) : g;
  return g * sigmoid(s) * up;
}

// Rows first .. last - 1 of gate_up [rows, 2 * width] (gate then up) -> out [rows, width], 16 values at a time (a
// short last group padded with zeros, so that every value takes the same operations).
template <bool GELU, typename F, typename T>
inline __attribute__((always_inline)) void gated_rows_on(const T* gate_up, T* out, int64_t first, int64_t last,
                                                         int64_t width) {
  for (int64_t r = first; r < last; ++r) {
    const T* gate = gate_up + r * 2 * width;
    const T* up = gate + width;
    T* y = out + r * width;
    for (int64_t i = 0; i < width; i += LANES) {
      const int64_t n = std::min<int64_t>(LANES, width - i);
      if constexpr (std::is_same_v<T, float>) {
        if (n == LANES) {  // fp32 straight from and to the rows: copying each value took most of the time
          store_vec(y + i, gated_lanes<GELU>(load_vec<F>(gate + i), load_vec<F>(up + i)));
          continue;
        }
      }
      float g[LANES] = {}, u[LANES] = {}, act[LANES];
      for (int64_t j = 0; j < n; ++j) g[j] = to_float(gate[i + j]), u[j] = to_float(up[i + j]);
      store_vec(act, gated_lanes<GELU>(load_vec<F>(g), load_vec<F>(u)));
      for (int64_t j = 0; j < n; ++j) y[i + j] = static_cast<T>(act[j]);
    }
  }
}

// gated_rows_on compiled for each instruction-set path (vec.h); the vector paths give the same bits. (A lambda
// is compiled for the default target whatever encloses it: the threads' lambda calls these.)
#define GATED_ON(NAME, TARGET, F)                                                                               \
  template <bool GELU, typename T>                                                                             \
  TARGET void NAME(const T* gate_up, T* out, int64_t first, int64_t last, int64_t width) {                      \
    gated_rows_on<GELU, F>(gate_up, out, first, last, width);                                                   \
  }
GATED_ON(gated_baseline, , Halves<Halves<Vec4>>)
#ifdef VEC_X86
GATED_ON(gated_avx2, TARGET_AVX2, Halves<Vec8>)
GATED_ON(gated_avx512, TARGET_AVX512, Vec)
#endif
#undef GATED_ON

// gate_up [rows, 2 * width] (gate then up) -> act(gate) * up [rows, width], same dtype (fp32 or bf16); act is SiLU,
// or with GELU the tanh approximation of GELU (gated_lanes), on the vector path attention takes.
template <bool GELU, typename T>
void gated_on(AttendPath path, const T* gate_up, T* out, int64_t rows, int64_t width) {
  tornchat::team::parallel_for(0, rows, ROW_GRAIN, [&](int64_t first, int64_t last) {
#ifdef VEC_X86
    if (path >= AttendPath::avx512) return gated_avx512<GELU>(gate_up, out, first, last, width);
    if (path == AttendPath::avx2) return gated_avx2<GELU>(gate_up, out, first, last, width);
#endif
    gated_baseline<GELU>(gate_up, out, first, last, width);
  });
}

template <bool GELU>
at::Tensor gated(const at::Tensor& gate_up, AttendPath path, at::Tensor out = at::Tensor()) {
  check_cpu_contiguous(gate_up, "gate_up");
  const int64_t width = gate_up.size(-1) / 2, rows = gate_up.numel() / (2 * width);
  out = result_tensor(std::move(out), {rows, width}, gate_up.options());
  if (gate_up.scalar_type() == at::kBFloat16)
    gated_on<GELU>(path, gate_up.data_ptr<BFloat16>(), out.data_ptr<BFloat16>(), rows, width);
  else if (gate_up.scalar_type() == at::kFloat)
    gated_on<GELU>(path, gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, width);
  else
    TORCH_CHECK(false, "silu_mul and gelu_mul take fp32 or bf16");
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up, const std::string& isa) { return gated<false>(gate_up, attend_path(isa)); }
at::Tensor gelu_mul(const at::Tensor& gate_up, const std::string& isa) { return gated<true>(gate_up, attend_path(isa)); }
at::Tensor gate(const at::Tensor& gate_up, bool gelu, AttendPath path, at::Tensor out = at::Tensor()) {
  return gelu ? gated<true>(gate_up, path, std::move(out)) : gated<false>(gate_up, path, std::move(out));
}

// A projection: its weights' parts in their GGML types (blocks.h), each row computed as if alone.
struct Linear {
  std::vector<at::Tensor> parts;  // kept alive: matrix points into them
  tornchat::BlockMatrix matrix;

  Linear() = default;
  // isa: the kernels' instruction-set path (blocks.h)
  Linear(std::vector<at::Tensor> parts_, const std::vector<int64_t>& types, const std::string& isa)
      : parts(std::move(parts_)), matrix(tornchat::block_matrix(parts, types, isa)) {}

  // out: where to write (block_mm), or undefined for a new tensor
  at::Tensor operator()(const at::Tensor& x, at::Tensor out = at::Tensor()) const {
    return tornchat::block_mm(x, matrix, std::move(out));
  }
};

// A mixture-of-experts MLP (llama.Experts): the router's matrix [experts, hidden] as F32 blocks, and each
// expert's gate and up (stacked) and down projections.
struct Experts {
  Linear router;
  std::vector<Linear> w13, w2;
  int64_t top_k = 0;
  bool norm_top_k = false;
};

struct Layer {
  at::Tensor attn_norm, ffn_norm, bqkv, qk_norm;  // bqkv, qk_norm: empty where the model has none
  Linear wqkv, wo, w13, w2;  // w13, w2 without parts where the MLP is a mixture of experts
  Experts moe;               // no experts where the MLP is dense
  // Gemma 3 (Forward::gemma): norms of the attention's and the MLP's outputs (or empty), and the attention window
  // (0: none), whose layers take the second RoPE table; kind_index: the layer's index among the windowed layers,
  // or among the others, which is its index in its cache where the windowed layers' caches are apart from the
  // others' (Forward::forward's window_kvs)
  at::Tensor post_attn_norm, post_ffn_norm;
  int64_t window = 0, kind_index = 0;
};

// Up to this many (row, expert) slots, a mixture's threads split the experts rather than each expert's products:
// a decode step's 8 experts of a few hundred features are too small to split well, and each split costs a fork
// and join.
constexpr int64_t FEW_SLOTS = 64;

// Up to this many rows a forward runs its layers in one team of threads (team.h): a one-row step of the 135M
// 0.97x the time with one as with a fork and join per loop, 4 rows 0.988x (2026-11-28, AMD Zen 3).
constexpr int64_t TEAM_ROWS = 64;

// One row's routing (llama.route): the softmax of its router logits in fp32, its top_k experts, most probable
// first (of equal ones the lower index), and their probabilities, divided by their sum where norm_top_k.
void route_row(const float* logits, int64_t count, int64_t top_k, bool norm_top_k, int64_t* chosen, float* weights) {
  std::vector<float> p(logits, logits + count);
  const float top = *std::max_element(p.begin(), p.end());
  float total = 0.f;
  for (auto& v : p) total += v = std::exp(v - top);
  for (auto& v : p) v /= total;
  float kept = 0.f;
  for (int64_t j = 0; j < top_k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < count; ++e)
      if (std::find(chosen, chosen + j, e) == chosen + j && (best < 0 || p[e] > p[best])) best = e;
    chosen[j] = best, weights[j] = p[best];
    kept += p[best];
  }
  if (norm_top_k)
    for (int64_t j = 0; j < top_k; ++j) weights[j] /= kept;
}

// The mixture-of-experts MLP of rows h [rows, hidden] fp32 (llama.mixture): each row routed, then each expert's
// matrices run once on the rows routed to it, gathered (a decode step's row reads its top_k experts' blocks and no
// others'); a row's top_k outputs are weighted and summed in order of rank. The block kernels compute each row by
// itself, so a row's bits do not depend on which rows share its experts.
at::Tensor mixture(const Experts& moe, const at::Tensor& h, bool gelu, AttendPath path) {
  const auto logits = moe.router(h).contiguous();
  const int64_t rows = h.size(0), hidden = h.size(1), count = logits.size(1), k = moe.top_k;
  std::vector<int64_t> chosen(rows * k);
  std::vector<float> weights(rows * k);
  for (int64_t r = 0; r < rows; ++r)
    route_row(logits.data_ptr<float>() + r * count, count, k, moe.norm_top_k, &chosen[r * k], &weights[r * k]);
  std::vector<std::vector<int64_t>> slots(count);  // each expert's (row, rank) slots r * k + rank, in row order
  for (int64_t s = 0; s < rows * k; ++s) slots[chosen[s]].push_back(s);
  std::vector<int64_t> used;
  for (int64_t e = 0; e < count; ++e)
    if (!slots[e].empty()) used.push_back(e);
  std::vector<at::Tensor> at_slots(used.size()), ys(used.size());
  const auto expert = [&](size_t i) {
    at_slots[i] = at::tensor(slots[used[i]], at::kLong);
    ys[i] = moe.w2[used[i]](gate(moe.w13[used[i]](h.index_select(0, at::floor_divide(at_slots[i], k))), gelu, path));
  };
  if (rows * k <= FEW_SLOTS) {
    // A step's few rows: the threads take whole experts (the products inside run on the thread that calls
    // them), one fork and join a layer instead of two per expert; each product's bits are the same.
    tornchat::team::parallel_for(0, static_cast<int64_t>(used.size()), 1, [&](int64_t first, int64_t last) {
      for (int64_t i = first; i < last; ++i) expert(i);
    });
  } else {
    for (size_t i = 0; i < used.size(); ++i) expert(i);
  }
  auto outputs = at::empty({rows * k, hidden}, h.options());
  for (size_t i = 0; i < used.size(); ++i) outputs.index_copy_(0, at_slots[i], ys[i]);
  auto out = at::empty({rows, hidden}, h.options());
  const float* o = outputs.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  tornchat::team::parallel_for(0, rows, ROW_GRAIN, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r)
      for (int64_t i = 0; i < hidden; ++i) {
        float sum = 0.f;
        for (int64_t j = 0; j < k; ++j) sum += weights[r * k + j] * o[(r * k + j) * hidden + i];
        dst[r * hidden + i] = sum;
      }
  });
  return out;
}

// The lean forward through every layer in one call, the Python loop of llama.LlamaRunner._layers without its
// ~25 Python-level operations per layer, which cost more than a decode step's small kernels. n rows at once
// (a decode step's one, a verify's k + 1, a prefill chunk's up to 512) give each row exactly what that row
// alone at its position gives: rows meet only in attention, whose every row is computed as if alone
// (attend), and every other operation, the block kernels included, computes a row by itself.
class Forward {
 public:
  // Per layer: vectors attn_norm, ffn_norm, bqkv and qk_norm (or empty); the parts and GGML types of wqkv, wo,
  // w13, w2.
  // isa: the block kernels' path, one of block_isas(); attention takes attend_path(isa).
  Forward(const std::vector<at::Tensor>& vectors, const std::vector<std::vector<at::Tensor>>& parts,
          const std::vector<std::vector<int64_t>>& types, int64_t heads, int64_t kv_heads, double eps, double scale,
          const std::string& isa)
      : heads_(heads), kv_heads_(kv_heads), eps_(eps), scale_(scale), isa_(isa), attend_path_(attend_path(isa)) {
    TORCH_CHECK(vectors.size() % 4 == 0 && parts.size() == vectors.size() && types.size() == parts.size(),
                "4 vectors and 4 matrices per layer");
    for (size_t i = 0; i < vectors.size() / 4; ++i) {
      const auto linear = [&](size_t m) { return Linear{parts[4 * i + m], types[4 * i + m], isa}; };
      layers_.push_back(Layer{vectors[4 * i], vectors[4 * i + 1], vectors[4 * i + 2], vectors[4 * i + 3], linear(0), linear(1), linear(2),
                              linear(3)});
    }
  }

  // Gemma 3's parts: per layer post_attn_norm and post_ffn_norm (or empty) in norms, its attention window in
  // windows (0: none); gelu: GELU (tanh) gating instead of SiLU.
  void gemma(const std::vector<at::Tensor>& norms, const std::vector<int64_t>& windows, bool gelu) {
    TORCH_CHECK(norms.size() == 2 * layers_.size() && windows.size() == layers_.size(),
                "2 norms and a window per layer");
    windowed_ = 0;
    for (size_t i = 0; i < layers_.size(); ++i) {
      layers_[i].post_attn_norm = norms[2 * i], layers_[i].post_ffn_norm = norms[2 * i + 1];
      layers_[i].window = windows[i];
      layers_[i].kind_index = windows[i] ? windowed_++ : static_cast<int64_t>(i) - windowed_;
      window_ = std::max(window_, windows[i]);
    }
    gelu_ = gelu;
  }

  // Layer i's MLP as a mixture of experts (llama.Experts): the router's parts and types (one F32 part), each
  // expert's gate-and-up and down parts and types.
  void set_experts(int64_t i, const std::vector<at::Tensor>& router_parts, const std::vector<int64_t>& router_types,
                   const std::vector<std::vector<at::Tensor>>& w13_parts, const std::vector<std::vector<int64_t>>& w13_types,
                   const std::vector<std::vector<at::Tensor>>& w2_parts, const std::vector<std::vector<int64_t>>& w2_types,
                   int64_t top_k, bool norm_top_k) {
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(layers_.size()), "no layer ", i);
    const size_t count = w13_parts.size();
    TORCH_CHECK(count > 0 && w13_types.size() == count && w2_parts.size() == count && w2_types.size() == count,
                "the same experts' gate-and-up and down matrices");
    TORCH_CHECK(top_k > 0 && top_k <= static_cast<int64_t>(count), "top_k must be 1 .. experts");
    Experts moe{Linear{router_parts, router_types, isa_}, {}, {}, top_k, norm_top_k};
    for (size_t e = 0; e < count; ++e) {
      moe.w13.push_back(Linear{w13_parts[e], w13_types[e], isa_});
      moe.w2.push_back(Linear{w2_parts[e], w2_types[e], isa_});
    }
    layers_[i].moe = std::move(moe);
  }

  // x [rows, hidden] fp32, the tokens' embeddings: sequence s's counts[s] rows, one after another, at positions
  // starts[s] .. of its cache kvs[s] [layers, 2, capacity, kv_heads, head_dim]; freqs [rows, head_dim / 2, 2]
  // of each row's position, local_freqs (or none) the same from the windowed layers' table. Writes the tokens'
  // keys and values into their caches; returns x after the layers.
  // window_kvs (or none): the windowed layers' caches apart, [windowed layers, 2, capacity, kv_heads, head_dim]
  // holding positions window_starts[s] .. (a multiple of 16, so that a position keeps its lane in a key block,
  // and the sums their order: the same bits as from position 0), kvs[s] then the other layers'. A row reads
  // only the positions its window sees, so the earlier ones need not be held.
  // Rows meet only in the matrix products, which compute each row by itself: a sequence gets the same bits
  // batched with others as alone.
  at::Tensor forward(at::Tensor x, const std::vector<at::Tensor>& kvs, const at::Tensor& freqs,
                     const std::vector<int64_t>& starts, const std::vector<int64_t>& counts,
                     const std::optional<at::Tensor>& local_freqs, const std::vector<at::Tensor>& window_kvs,
                     const std::vector<int64_t>& window_starts) const {
    const size_t seqs = kvs.size();
    const bool apart = !window_kvs.empty();
    TORCH_CHECK(seqs > 0 && starts.size() == seqs && counts.size() == seqs, "one cache, start and count per sequence");
    TORCH_CHECK(!apart || (window_kvs.size() == seqs && window_starts.size() == seqs && windowed_ > 0),
                "a windowed cache and its start per sequence, for a model with windowed layers");
    const int64_t shared_layers = static_cast<int64_t>(layers_.size()) - (apart ? windowed_ : 0);
    int64_t total = 0;
    for (size_t s = 0; s < seqs; ++s) {
      TORCH_CHECK(kvs[s].size(0) == shared_layers && starts[s] + counts[s] <= kvs[s].size(2),
                  "the cache does not fit this step");
      if (apart) {
        const int64_t first_seen = std::max<int64_t>(0, starts[s] + 1 - window_);
        TORCH_CHECK(window_kvs[s].size(0) == windowed_ && window_starts[s] % KEY_BLOCK == 0 &&
                    window_starts[s] <= first_seen && starts[s] + counts[s] - window_starts[s] <= window_kvs[s].size(2),
                    "the windowed cache does not hold what this step sees");
      }
      total += counts[s];
    }
    TORCH_CHECK(x.size(0) == total && freqs.size(0) == total, "x and freqs must have the sequences' rows");
    // The caches are read and written through pointers (rope_store_into, LayerCache): their layout checked here.
    const int64_t head_dim = kvs[0].size(-1);
    const bool bf16 = kvs[0].scalar_type() == at::kBFloat16;
    TORCH_CHECK(bf16 || kvs[0].scalar_type() == at::kFloat, "the cache must be fp32 or bf16");
    for (const auto* group : {&kvs, &window_kvs})
      for (const at::Tensor& kv : *group) {
        check_cpu_contiguous(kv, "a cache");
        TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2 && kv.size(3) == kv_heads_ && kv.size(4) == head_dim &&
                        kv.scalar_type() == kvs[0].scalar_type() && kv.size(2) % KEY_BLOCK == 0,
                    "every cache must be [layers, 2, capacity (a multiple of 16), kv_heads, head_dim] of one dtype");
      }
    for (const at::Tensor* table : {&freqs, local_freqs ? &*local_freqs : &freqs}) {
      check_cpu_contiguous(*table, "freqs");
      TORCH_CHECK(table->scalar_type() == at::kFloat && table->numel() == total * head_dim, "freqs must be fp32 [rows, head_dim / 2, 2]");
    }
    TORCH_CHECK(!local_freqs || local_freqs->sizes() == freqs.sizes(), "local_freqs must be freqs' shape");
    // The gate-and-up products of every dense layer in one buffer: a prefill chunk's is the forward's largest
    // activation (32 MiB at 1B), at or past malloc's largest threshold for mapping memory anew, so that each
    // layer's own tensor was mapped, faulted in page by page and unmapped: 5-10% of a 1B prefill.
    at::Tensor gate_up;
    // Each layer's other results written where the layer before wrote its own, dead by then (result_tensor).
    at::Tensor qkv_out, q, attended, o_out, h_out, gated_out, down_out, normed_out;
    // The residual stream is updated in place (add_rms_norm), in a copy: the caller's x stays as it was. normed:
    // the next layer's attention norm of it.
    x = x.contiguous().to(at::kFloat, false, true);
    const auto layers = [&] {
      at::Tensor normed = layers_.empty() ? x : rms_norm(x, layers_[0].attn_norm, eps_, false);
      for (size_t i = 0; i < layers_.size(); ++i) {
        const Layer& layer = layers_[i];
        const at::Tensor& table = layer.window && local_freqs ? *local_freqs : freqs;
        qkv_out = layer.wqkv(normed, qkv_out);
        const auto qkv = layer.bqkv.numel() ? (qkv_out + layer.bqkv).contiguous() : qkv_out;
        // the queries in fp32, each rounded to the cache's dtype as before (rope_store_rows), for attention to read
        // as they are: converting them there took a tensor and a copy a layer
        q = result_tensor(q, {total, heads_, head_dim}, kvs[0].options().dtype(at::kFloat));
        std::vector<LayerCache> caches(seqs);
        std::vector<int64_t> begins(starts);  // each sequence's first row's index in the cache it reads
        const float* qk_norm = qk_norm_weights(layer.qk_norm, head_dim);
        for (size_t s = 0, row = 0; s < seqs; row += counts[s], ++s) {
          const bool own = apart && layer.window;
          const at::Tensor& kv = own ? window_kvs[s] : kvs[s];  // [layers, 2, capacity, kv_heads, head_dim]
          char* keys = static_cast<char*>(kv.data_ptr()) + (apart ? layer.kind_index : i) * kv.stride(0) * kv.element_size();
          char* values = keys + kv.stride(1) * kv.element_size();
          if (own) begins[s] -= window_starts[s];
          caches[s] = LayerCache{keys, values, kv.size(2)};
          rope_store_into<true>(qkv, table, qk_norm, eps_, q, bf16, keys, values, row, counts[s], begins[s], heads_,
                                kv_heads_);
        }
        attended = attend_many(q, caches, kv_heads_, bf16, begins, counts, scale_, layer.window, attend_path_, attended);
        auto out = o_out = layer.wo(attended, o_out);
        const auto h = h_out = add_rms_norm(
            x, layer.post_attn_norm.numel() ? rms_norm(out, layer.post_attn_norm, eps_, false) : out, layer.ffn_norm, eps_,
            h_out);
        if (layer.moe.w13.empty()) {
          gate_up = layer.w13(h, gate_up);
          gated_out = gate(gate_up, gelu_, attend_path_, gated_out);
          out = down_out = layer.w2(gated_out, down_out);
        } else {
          out = mixture(layer.moe, h, gelu_, attend_path_);
        }
        if (layer.post_ffn_norm.numel()) out = rms_norm(out, layer.post_ffn_norm, eps_, false);
        if (i + 1 < layers_.size()) {
          normed = normed_out = add_rms_norm(x, out, layers_[i + 1].attn_norm, eps_, normed_out);
        } else {
          x.add_(out);
        }
      }
      return x;
    };
    // A step's few rows: each loop is short, so its threads stay together through the layers (team.h); a
    // prefill chunk's loops are long, and its ATen calls (inline within a team) keep their own threads.
    return total <= TEAM_ROWS ? tornchat::team::with_team(layers) : layers();
  }

 private:
  std::vector<Layer> layers_;
  int64_t heads_, kv_heads_;
  int64_t windowed_ = 0, window_ = 0;  // how many layers have a window, and the largest
  double eps_, scale_;
  bool gelu_ = false;
  std::string isa_;
  AttendPath attend_path_;
};

// team.h as tests/test_fused_ops.py sees it: the parts (first, last, indices a loop nested in the part visited)
// of `loops` successive team::parallel_for(0, n, grain) calls inside one with_team, or with team false of as many
// at::parallel_for calls; the part holding index fail_at throws in the last loop.
std::vector<std::array<int64_t, 3>> team_parts(int64_t n, int64_t grain, int64_t loops, bool team, int64_t fail_at) {
  std::mutex lock;
  std::vector<std::array<int64_t, 3>> parts;
  const auto all = [&] {
    for (int64_t i = 0; i < loops; ++i) {
      const auto part = [&](int64_t first, int64_t last) {
        std::atomic<int64_t> visited{0};
        tornchat::team::parallel_for(first, last, 1, [&](int64_t a, int64_t b) { visited += b - a; });
        TORCH_CHECK(i + 1 < loops || fail_at < first || fail_at >= last, "part ", first, "..", last, " failed");
        const std::lock_guard<std::mutex> held(lock);
        parts.push_back({first, last, visited.load()});
      };
      if (team) tornchat::team::parallel_for(0, n, grain, part);
      else at::parallel_for(0, n, grain, part);
    }
    return 0;
  };
  if (team) tornchat::team::with_team(all);
  else all();
  std::sort(parts.begin(), parts.end());
  return parts;
}

// team::share as tests/test_fused_ops.py sees it: each item of 0 .. n - 1 and whether the calling thread took it,
// where the first `slow` items each take sleep_us, inside one with_team (team) or not.
std::vector<std::array<int64_t, 2>> team_shared(int64_t n, int64_t slow, int64_t sleep_us, bool team) {
  std::mutex lock;
  std::vector<std::array<int64_t, 2>> done;
  const auto caller = std::this_thread::get_id();
  const auto all = [&] {
    tornchat::team::share(n, [&](int64_t item) {
      if (item < slow) std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
      const std::lock_guard<std::mutex> held(lock);
      done.push_back({item, std::this_thread::get_id() == caller});
    });
    return 0;
  };
  if (team) tornchat::team::with_team(all);
  else all();
  std::sort(done.begin(), done.end());
  return done;
}

}  // namespace

PYBIND11_MODULE(_fused, m) {
  m.def("rms_norm", &rms_norm, "RMS norm of fp32 rows, out in fp32 or bf16");
  m.def("rope_store", &rope_store, "RoPE on queries and keys (RMS-normed per head first with qk_norm); keys and values "
        "written into the cache", pybind11::arg("qkv"), pybind11::arg("freqs"), pybind11::arg("keys"),
        pybind11::arg("values"), pybind11::arg("heads"), pybind11::arg("kv_heads"), pybind11::arg("qk_norm") = pybind11::none(),
        pybind11::arg("eps") = 0.0);
  m.def("silu_mul", &silu_mul, "silu(gate) * up", pybind11::arg("gate_up"), pybind11::arg("isa") = "");
  m.def("gelu_mul", &gelu_mul, "gelu_tanh(gate) * up", pybind11::arg("gate_up"), pybind11::arg("isa") = "");
  m.def("attend", &attend, "causal attention of n rows over a cache in the forward's layout, each row as if alone",
        pybind11::arg("q"), pybind11::arg("keys"), pybind11::arg("values"), pybind11::arg("start"),
        pybind11::arg("scale"), pybind11::arg("window") = 0, pybind11::arg("isa") = "");
  m.def("_team_parts", &team_parts, "team.h's parts of a loop, for the tests", pybind11::arg("n"), pybind11::arg("grain"),
        pybind11::arg("loops"), pybind11::arg("team"), pybind11::arg("fail_at") = -1,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("_team_shared", &team_shared, "team.h's share of n items, for the tests", pybind11::arg("n"),
        pybind11::arg("slow"), pybind11::arg("sleep_us"), pybind11::arg("team"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  tornchat::define_blocks(m);
  pybind11::class_<Forward>(m, "Forward")
      .def(pybind11::init<const std::vector<at::Tensor>&, const std::vector<std::vector<at::Tensor>>&,
                          const std::vector<std::vector<int64_t>>&, int64_t, int64_t, double, double,
                          const std::string&>())
      // Without the GIL: the server's IOLoop thread keeps answering and streaming during a step.
      .def("gemma", &Forward::gemma)
      .def("set_experts", &Forward::set_experts)
      .def("forward", &Forward::forward, pybind11::arg("x"), pybind11::arg("kvs"), pybind11::arg("freqs"),
           pybind11::arg("starts"), pybind11::arg("counts"), pybind11::arg("local_freqs") = pybind11::none(),
           pybind11::arg("window_kvs") = std::vector<at::Tensor>(), pybind11::arg("window_starts") = std::vector<int64_t>(),
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
