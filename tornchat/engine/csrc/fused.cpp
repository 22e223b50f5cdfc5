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

// A result's tensor: out (Forward::forward's, where the layer before wrote the same result, dead by then) resized
// to sizes if it is not of them, or a new one where out is undefined. A new tensor costs about 0.3 us, and a
// layer makes a dozen.
at::Tensor result_tensor(at::Tensor out, at::IntArrayRef sizes, const at::TensorOptions& options) {
  if (!out.defined()) return at::empty(sizes, options);
  TORCH_CHECK(out.scalar_type() == options.dtype() && out.is_contiguous(), "out must be contiguous, of the result's dtype");
  if (out.sizes() != sizes) out.resize_(sizes);
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

// Where a layer's keys and values sit in its cache of [capacity, kv_heads, head_dim] elements. The standard layout
// is PyTorch's (position-major), for the Python loop's caches. The forward's caches (FORWARD) are laid out for
// attend's vectors: keys in blocks of KEY_BLOCK positions, transposed, so that one vector holds a dimension of 16
// keys (block b of head h: [head_dim][16]); in bf16 dimensions 2t and 2t + 1 are interleaved ([head_dim / 2][16][2])
// and values positions 2s and 2s + 1 ([head_dim][2] a pair), so that one 64-byte load, a shift and a mask give two
// fp32 vectors (widening bf16 lane by lane costs several instructions per vector). Values are in the keys' blocks
// of 16 positions too, each head's together (value_at).
// fused.py's forward_layout / standard_layout convert.
constexpr int64_t KEY_BLOCK = 16;

template <bool FORWARD, typename Kv>
inline int64_t key_at(int64_t p, int64_t h, int64_t i, int64_t kv_heads, int64_t d) {
  if constexpr (!FORWARD) return (p * kv_heads + h) * d + i;
  const int64_t block = (p / KEY_BLOCK * kv_heads + h) * d * KEY_BLOCK, lane = p % KEY_BLOCK;
  if constexpr (std::is_same_v<Kv, BFloat16>) return block + (i / 2 * KEY_BLOCK + lane) * 2 + i % 2;
  return block + i * KEY_BLOCK + lane;
}

template <bool FORWARD, typename Kv>
inline int64_t value_at(int64_t p, int64_t h, int64_t i, int64_t kv_heads, int64_t d) {
  if constexpr (!FORWARD) return (p * kv_heads + h) * d + i;
  // Each head's 16 positions of a block side by side: the weighted sum walks a head's positions in order, and
  // position-major rows (kv_heads * head_dim apart, a page at 8 x 128 bf16 pairs) missed the TLB at every step.
  const int64_t block = (p / KEY_BLOCK * kv_heads + h) * KEY_BLOCK * d, q = p % KEY_BLOCK;
  if constexpr (std::is_same_v<Kv, BFloat16>) return block + (q / 2 * d + i) * 2 + q % 2;
  return block + q * d + i;
}

// One head's head_dim values rotated: pairs (a, b) at 2j, 2j + 1 with f's (cos, sin) of pair j give a c - b s and
// a s + b c, each product rounded before the sum (no fused multiply-add, also where the default target has one, as
// on ARM), 8 values a vector where the CPU has AVX2: the same bits either way.
#if defined(__GNUC__) && !defined(__clang__)
#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define NO_CONTRACT
#endif
#ifdef VEC_X86
TARGET_AVX2 NO_CONTRACT void rotate_avx2(const float* x, const float* f, float* out, int64_t head_dim) {
  for (int64_t i = 0; i < head_dim; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i), cs = _mm256_loadu_ps(f + i);
    const __m256 cos_products = _mm256_mul_ps(v, _mm256_moveldup_ps(cs));  // a c, b c
    const __m256 sin_products = _mm256_mul_ps(_mm256_permute_ps(v, 0xB1), _mm256_movehdup_ps(cs));  // b s, a s
    _mm256_storeu_ps(out + i, _mm256_addsub_ps(cos_products, sin_products));
  }
}
#endif

NO_CONTRACT void rotate(const float* x, const float* f, float* out, int64_t head_dim) {
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
#undef NO_CONTRACT

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
  const F s = GELU ? g * (1.5957691216057308f + 0.07135481627159893f * (g * g)) : g;
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

// Attention of n rows over the cache, computed so that row r of n gets the same bits whatever n is: each
// row's scores, softmax and weighted sum depend only on its query and the positions 0 .. start + r it sees, in a
// fixed order. A speculative verify's rows then equal one-token steps, and a prefill chunk's rows equal a
// prompt fed token by token. Keys are blocked (key_at): a query's scores over 16 positions are one vector, each
// lane its own sum over the dimensions, so there is no horizontal sum per key, and queries that share a KV head
// (a step's grouped heads, a chunk's neighbouring rows) share each load of keys and values. The loops are compiled
// once per instruction-set path (attend_path; vec.h), each product added to its sum in one fused multiply-add on
// the vector paths, so that AVX2 and AVX-512 machines get the same bits; with AVX-512 BF16 a bf16 cache's scores
// take VDPBF16PS, whose two multiply-adds per pair of dims are the same operations.
//
// The semantics, per query q and position j (what attend_ref computes, up to fp32 rounding order):
//   score_j = s * scale, s = one sum over the dims in order of pairs t, q_2t+1 k_j,2t+1 and then q_2t k_j,2t
//             (denormals flushed to zero; with a bf16 cache q is a bf16 vector, so each product is exact);
//   w_j = exp(score_j - max score), total = the 16-lane sums of w in order of 16-position groups, then a tree;
//   out = (sum over even j of w_j v_j + sum over odd j of w_j v_j) / total, each sum in order of j.

// Queries that share each load of keys and values, at most: 2 T accumulators in registers. AVX-512 has 32
// registers of 16 lanes; AVX2 16 of 8, where the loops over values take the 16 lanes a half at a time (HalfOf), so
// that 6 queries' 12 sums, a pair of values and a weight's broadcast fit (the scores: 6 queries' two halves).
// 2026-11-28, AMD Zen 3, a 1B's 2,048-token prefill: attention 1.1-1.2x faster than 2 queries with both halves at
// once (4 queries by halves: the same; 2 with both halves was 1.45x one query). The baseline's tile is 1. A
// query's bits do not depend on its tile.
constexpr int TILE = 8, AVX2_TILE = 6, BASELINE_TILE = 1;

// The vector the loops over keys and values hold in a register: a Halves type's half (its lanes 0 .. 7 are the
// 16 lanes' first half, part 0), else the type itself (one part). Each lane's sums are the same either way.
template <typename F> struct HalfOf { using type = F; static constexpr int parts = 1; };
template <typename H> struct HalfOf<Halves<H>> { using type = H; static constexpr int parts = 2; };
template <typename V> constexpr int64_t lanes_of = sizeof(V) / sizeof(float);

// A step's tile, at most this many queries (its grouped heads), reads the cache from memory: it prefetches a
// block's values while scoring its keys, and on AVX-512 sums two chunks of 16 dims per pass over the values (4 T
// accumulators; AVX2's registers hold one chunk's), half the passes over a head's values. A prefill chunk's
// tiles of 8 read what the chunk just wrote, and the prefetches only cost them.
constexpr int STEP_TILE = 4;

// How many key blocks ahead of the one being read its keys and values are prefetched. A step's attention reads
// the cache from memory (the weights streamed through since evicted it), and one block ahead (a few hundred
// cycles of work) asked too late: 8 read a 1B's cache of 8,000 positions at 31-32 against 22-23 GB/s, 1.4x
// faster (2026-11-27, AMD Zen 5; 4 in between, 16 no better).
constexpr int64_t AHEAD_BLOCKS = 8;

struct Query {
  const float* q;   // [head_dim]
  float* out;       // [head_dim]
  int64_t seen;     // positions first .. seen - 1
  int64_t first;    // 0, or past a sliding window's start
};

// 32 bf16 in (a, b) pairs -> the a's and the b's as fp32: bf16 is the top half of an fp32.
template <typename F>
inline __attribute__((always_inline)) void split_pairs(const BFloat16* p, F& a, F& b) {
  const auto words = load_vec<typename Lanes<F>::Uint>(p);
  a = bit_cast<F>(words << 16);
  b = bit_cast<F>(words & 0xffff0000u);
}

// Dimensions 2t and 2t + 1 of a key block's 16 keys (key_at's forward layout), or of its keys part * lanes ..
// in a vector V of fewer lanes.
template <typename V>
inline __attribute__((always_inline)) void key_pair(const float* block, int64_t t, int part, V& k0, V& k1) {
  k0 = load_vec<V>(block + 2 * t * KEY_BLOCK + part * lanes_of<V>);
  k1 = load_vec<V>(block + (2 * t + 1) * KEY_BLOCK + part * lanes_of<V>);
}
template <typename V>
inline __attribute__((always_inline)) void key_pair(const BFloat16* block, int64_t t, int part, V& k0, V& k1) {
  split_pairs(block + 2 * t * KEY_BLOCK + 2 * part * lanes_of<V>, k0, k1);
}

// Dims 16c .. 16c + 15 of KV head h's values (in a vector V of fewer lanes: its part, dims 16c + part * lanes ..),
// two positions at a time from an even j (value_at's forward layout; values points at position 0), walked by
// pointer: value_at's divisions and products at every pair cost more than the pair's multiply-adds.
template <typename V, typename Kv>
struct ValuePairs {
  const Kv* at;  // positions j and j + 1
  int64_t j, d, within, across;  // within: the step to j + 2 inside a block of KEY_BLOCK; across: from a block's last pair
  int64_t ahead;  // the same dims AHEAD_BLOCKS blocks further on, where the hardware prefetcher has not gone

  ValuePairs(const Kv* values, int64_t h, int64_t kv_heads, int64_t d_, int64_t j_, int64_t c, int part = 0)
      : at(values + value_at<true, Kv>(j_, h, c * LANES, kv_heads, d_) +
           (std::is_same_v<Kv, float> ? 1 : 2) * part * lanes_of<V>),
        j(j_), d(d_), within(2 * d_), across(2 * d_ + (kv_heads - 1) * KEY_BLOCK * d_),
        ahead(AHEAD_BLOCKS * kv_heads * KEY_BLOCK * d_) {}

  // k: the chunk k further on (dims 16 (c + k) ..).
  inline __attribute__((always_inline)) void read(V& v0, V& v1, int64_t k = 0) const {
    if constexpr (std::is_same_v<Kv, float>) {
      v0 = load_vec<V>(at + k * LANES);
      v1 = load_vec<V>(at + k * LANES + d);
    } else {
      split_pairs(at + 2 * k * LANES, v0, v1);
    }
  }
  inline __attribute__((always_inline)) V read_first() const {  // position j alone (the last of an odd count)
    V v0, v1;
    read(v0, v1);
    return v0;
  }
  inline __attribute__((always_inline)) void prefetch(int64_t k = 0) const {  // chunk k further on, ahead
    __builtin_prefetch(at + ahead + k * (std::is_same_v<Kv, float> ? 1 : 2) * LANES);
  }
  inline __attribute__((always_inline)) void next() {
    j += 2;
    at += j & (KEY_BLOCK - 1) ? within : across;
  }
};

// MXCSR's flush-to-zero and denormals-are-zero for a scope: VDPBF16PS flushes its inputs' and its sums'
// denormals whatever MXCSR says, so the fused multiply-adds that stand for it elsewhere flush them too, and every
// path's scores get the same bits, also where a product is tiny.
struct FlushDenormals {
#ifdef VEC_X86
  unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

// Query values 2t, 2t + 1 (bf16 values: attend_many's contract) as a pair of bf16 in one 32-bit word, the layout
// of a key block's pair (key_at) and of VDPBF16PS's operands.
inline uint32_t bf16_pair(const float* q, int64_t t) {
  uint32_t even, odd;
  std::memcpy(&even, q + 2 * t, 4);
  std::memcpy(&odd, q + 2 * t + 1, 4);
  return even >> 16 | (odd & 0xffff0000u);
}
inline float bf16_half(uint32_t pair, int half) {
  const uint32_t bits = half ? pair & 0xffff0000u : pair << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Scores of T queries over key blocks 0 .. blocks - 1 of one KV head (keys: its first block), into
// scores[m * scores_stride + 16 b ..]. Each score is one chain of fused multiply-adds over the dims, pair t's dim
// 2t + 1 and then dim 2t, flushing denormals: what VDPBF16PS does for a pair (DOT: the avx512bf16 path, on a bf16
// cache, one instruction for a pair of dims of 16 keys where the others take two and split the pairs first).
// With a bf16 cache the queries are bf16 values (attend_many's contract). A step's tile prefetches the head's values
// (head_values: its first block) block by block meanwhile: a short cache's are then there when the weighted sum
// comes to them.
template <typename F, int T, bool DOT, typename Kv>
inline __attribute__((always_inline)) void score_tile(const Query* queries, const Kv* keys, const Kv* head_values,
                                                      int64_t block_stride,
                                                      int64_t first_block, int64_t blocks, int64_t d, float scale,
                                                      float* scores, int64_t scores_stride) {
  using V = typename HalfOf<F>::type;
  constexpr bool bf16 = std::is_same_v<Kv, BFloat16>;
  constexpr bool dot = DOT && bf16;
  const FlushDenormals flushed;
  uint32_t pairs[dot ? T : 1][dot ? 128 : 1];  // VDPBF16PS's query pairs (d <= 256)
  if constexpr (dot)
    for (int m = 0; m < T; ++m)
      for (int64_t t = 0; t < d / 2; ++t) pairs[m][t] = bf16_pair(queries[m].q, t);
  constexpr int parts = HalfOf<F>::parts;
  for (int64_t b = first_block; b < blocks; ++b) {
    const Kv* block = keys + b * block_stride;
    // Both halves of a 16-lane vector in each pass over the dims (AVX2: 6 queries' 12 sums, a pair of keys and a
    // broadcast fill the 16 registers): a sum's chain takes two dependent multiply-adds per pair of dims, and one
    // half's 6 chains alone waited on them.
    V acc[T][parts];
    for (int m = 0; m < T; ++m)
      for (int part = 0; part < parts; ++part) acc[m][part] = V{};
    for (int64_t t = 0; t < d / 2; ++t) {
      // A line per pair of dims: a block's keys (and values, as many bytes) over its d / 2 steps.
      __builtin_prefetch(block + AHEAD_BLOCKS * block_stride + 2 * t * KEY_BLOCK);
      if constexpr (T <= STEP_TILE) __builtin_prefetch(head_values + b * block_stride + 2 * t * KEY_BLOCK);
      if constexpr (dot) {
#ifdef VEC_X86
        // The builtin, not _mm512_dpbf16_ps: a lambda (tile_stage's) is compiled for the default target whatever
        // encloses it, and an intrinsic may not be inlined there; the builtin expands where the lambda is inlined.
        typedef short Bf16Pairs __attribute__((vector_size(64)));
        const auto k = bit_cast<Bf16Pairs>(load_vec<IntVec>(block + 2 * t * KEY_BLOCK));
        for (int m = 0; m < T; ++m)
          acc[m][0] = __builtin_ia32_dpbf16ps_v16sf(acc[m][0], k, bit_cast<Bf16Pairs>(IntVec{} + int32_t(pairs[m][t])));
#endif
      } else {
        for (int part = 0; part < parts; ++part) {
          // The queries' values read again for each half: GCC would otherwise hold both halves' broadcasts
          // beside the sums and spill the sums (AVX2: 1.1x slower).
          if constexpr (parts > 1) asm volatile("" ::: "memory");
          V k0, k1;
          key_pair(block, t, part, k0, k1);
          for (int m = 0; m < T; ++m) {
            acc[m][part] += queries[m].q[2 * t + 1] * k1;
            acc[m][part] += queries[m].q[2 * t] * k0;
          }
        }
      }
    }
    for (int m = 0; m < T; ++m)
      for (int part = 0; part < parts; ++part)
        store_vec(scores + m * scores_stride + b * KEY_BLOCK + part * lanes_of<V>, acc[m][part] * scale);
  }
}

// Scores of positions begin (a multiple of 16) .. seen - 1 -> weights in place (zero before first and past seen;
// lanes there are selected away, never computed with: they may hold anything, NaN included); returns 1 / the
// weights' total. The groups before first's add zeros and change no bit: a row's weights are the same whatever
// begin its tile has.
template <typename F>
inline __attribute__((always_inline)) float softmax_row(float* scores, int64_t begin, int64_t first, int64_t seen) {
  static constexpr int32_t iota[LANES] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const auto lane = load_vec<typename Lanes<F>::Int>(iota);
  const F lowest = F{} - INFINITY;
  F tops = lowest;
  const auto inside = [&](int64_t j) __attribute__((always_inline)) {
    const auto at = lane + static_cast<int32_t>(j);
    return (at >= static_cast<int32_t>(first)) & (at < static_cast<int32_t>(seen));
  };
  // Only a group that straddles first or seen needs its lanes' mask: building one took as long as the rest of
  // the row's softmax on AVX-512, where a comparison yields a mask register and GCC widens it to a vector.
  const auto straddles = [&](int64_t j) __attribute__((always_inline)) { return j < first || j + LANES > seen; };
  for (int64_t j = begin; j < seen; j += LANES) {
    F kept = load_vec<F>(scores + j);
    if (straddles(j)) kept = select(inside(j), kept, lowest);
    tops = select(tops > kept, tops, kept);
  }
  float lanes[LANES];
  store_vec(lanes, tops);
  float top = lanes[0];
  for (int l = 1; l < LANES; ++l) top = std::max(top, lanes[l]);
  F totals = F{};
  for (int64_t j = begin; j < seen; j += LANES) {
    F kept = exp_nonpositive(load_vec<F>(scores + j) - top);
    if (straddles(j)) kept = select(inside(j), kept, F{});
    store_vec(scores + j, kept);
    totals += kept;
  }
  return 1.0f / sum(totals);
}

// Chunks c .. c + C - 1 of 16 dims of T queries' weighted values: the positions all T see, two at a time
// (the even and odd sums), sharing each value load; then each query's own. A query whose window starts later
// has zero weights at the positions before it: adding them changes no bit. Each sum is the same whatever C.
template <typename F, int T, int C, typename Kv>
inline __attribute__((always_inline)) void value_chunks(const Query* queries, const Kv* values, int64_t h,
                                                        int64_t kv_heads, int64_t d, const float* scores,
                                                        int64_t width, const float* inverse, int64_t shared,
                                                        int64_t first_min, int64_t c) {
  using V = typename HalfOf<F>::type;
  for (int part = 0; part < HalfOf<F>::parts; ++part) {
    V even[C][T], odd[C][T];
    for (int k = 0; k < C; ++k)
      for (int m = 0; m < T; ++m) even[k][m] = odd[k][m] = V{};
    for (ValuePairs<V, Kv> pairs(values, h, kv_heads, d, first_min / 2 * 2, c, part); pairs.j < shared; pairs.next()) {
      for (int k = 0; k < C; ++k) {
        // Both halves prefetch, probably since a half's pass over a long cache evicts what the other fetched
        // (the second half without: a 1B prefill chunk's attention 1.03-1.12x slower, AMD Zen 3, 2026-11-28).
        pairs.prefetch(k);
        V v0, v1;
        pairs.read(v0, v1, k);
        for (int m = 0; m < T; ++m) {
          even[k][m] += scores[m * width + pairs.j] * v0;
          odd[k][m] += scores[m * width + pairs.j + 1] * v1;
        }
      }
    }
    for (int k = 0; k < C; ++k)
      for (int m = 0; m < T; ++m) {
        // The same statements as above, without a branch between the sums: a conditional update is compiled as a
        // select, which may not fuse the multiply-add the way the statements above do.
        const float* w = scores + m * width;
        ValuePairs<V, Kv> pairs(values, h, kv_heads, d, shared, c + k, part);
        for (; pairs.j + 2 <= queries[m].seen; pairs.next()) {
          V v0, v1;
          pairs.read(v0, v1);
          even[k][m] += w[pairs.j] * v0;
          odd[k][m] += w[pairs.j + 1] * v1;
        }
        if (pairs.j < queries[m].seen) even[k][m] += w[pairs.j] * pairs.read_first();
        const V scaled = (even[k][m] + odd[k][m]) * inverse[m];
        store_vec(queries[m].out + (c + k) * LANES + part * lanes_of<V>, scaled);
      }
  }
}

// What a tile's queries see together: key blocks first_block .. blocks - 1, their scores in rows of width, and
// the positions before shared (in pairs) that all of them see.
struct Span {
  int64_t first_min, first_block, blocks, width, shared;
};

inline __attribute__((always_inline)) Span span_of(const Query* queries, int64_t count) {
  int64_t seen_max = 0, seen_min = queries[0].seen, first_min = queries[0].first;
  for (int64_t m = 0; m < count; ++m) {
    seen_max = std::max(seen_max, queries[m].seen), seen_min = std::min(seen_min, queries[m].seen);
    first_min = std::min(first_min, queries[m].first);
  }
  const int64_t blocks = (seen_max + KEY_BLOCK - 1) / KEY_BLOCK;
  return Span{first_min, first_min / KEY_BLOCK, blocks, blocks * KEY_BLOCK, seen_min / 2 * 2};
}

// Chunks c0 .. c1 - 1 of T queries' weighted values, two a pass where the path's registers hold them (WIDE).
template <typename F, int T, int WIDE, typename Kv>
inline __attribute__((always_inline)) void weigh_values(const Query* queries, const Kv* values, int64_t h,
                                                        int64_t kv_heads, int64_t d, const float* scores,
                                                        const Span& span, const float* inverse, int64_t c0,
                                                        int64_t c1) {
  int64_t c = c0;
  if constexpr (T <= WIDE)
    for (; c + 2 <= c1; c += 2)
      value_chunks<F, T, 2>(queries, values, h, kv_heads, d, scores, span.width, inverse, span.shared,
                            span.first_min, c);
  for (; c < c1; ++c)
    value_chunks<F, T, 1>(queries, values, h, kv_heads, d, scores, span.width, inverse, span.shared, span.first_min, c);
}

// A tile of count (1 .. T) queries of KV head h (keys: its first block; values: position 0 of the layer) is
// attended in three stages: the scores of key blocks from .. to - 1 (clipped to the tile's), query from's
// softmax (into inverse[from]), the weighted values of chunks from .. to - 1; or all of them in turn (whole:
// from, to and inverse unused). Each query's sums keep their own order whatever T is and however the stages are
// split (attend_many runs a tile whole, or shares each stage between threads).
enum class Stage { whole, scores, softmax, values };

template <typename F, int T, int WIDE, bool DOT, typename Kv>
inline __attribute__((always_inline)) void tile_stage(Stage stage, const Query* queries, int64_t count,
                                                      const Kv* keys, const Kv* values, int64_t h,
                                                      int64_t kv_heads, int64_t d, float scale, float* scores,
                                                      float* inverse, int64_t from, int64_t to) {
  if constexpr (T > 1)
    if (count < T)
      return tile_stage<F, T - 1, WIDE, DOT>(stage, queries, count, keys, values, h, kv_heads, d, scale, scores,
                                             inverse, from, to);
  const Span span = span_of(queries, T);
  const auto scores_of = [&](int64_t first, int64_t last) __attribute__((always_inline)) {
    score_tile<F, T, DOT>(queries, keys, values + h * KEY_BLOCK * d, kv_heads * d * KEY_BLOCK,
                          std::max(first, span.first_block), std::min(last, span.blocks), d, scale, scores, span.width);
  };
  const auto softmax = [&](int64_t m) __attribute__((always_inline)) {
    return softmax_row<F>(scores + m * span.width, span.first_block * KEY_BLOCK, queries[m].first, queries[m].seen);
  };
  if (stage == Stage::whole) {
    float own[T];  // not inverse: a local array the compiler knows no store reaches
    scores_of(0, span.blocks);
    for (int m = 0; m < T; ++m) own[m] = softmax(m);
    weigh_values<F, T, WIDE>(queries, values, h, kv_heads, d, scores, span, own, 0, d / LANES);
  } else if (stage == Stage::scores) {
    scores_of(from, to);
  } else if (stage == Stage::softmax) {
    inverse[from] = softmax(from);
  } else {
    weigh_values<F, T, WIDE>(queries, values, h, kv_heads, d, scores, span, inverse, from, to);
  }
}

// tile_stage compiled for each instruction-set path (vec.h), each with its vectors, tile and the tiles that
// sum two chunks per pass (WIDE: up to that many queries), and VDPBF16PS for a bf16 cache's scores (DOT); the
// vector paths give the same bits.
#define ATTEND_ON(NAME, TARGET, F, T, WIDE, DOT)                                                                       \
  template <typename Kv>                                                                                            \
  TARGET void NAME(Stage stage, const Query* queries, int64_t count, const Kv* keys, const Kv* values, int64_t h,   \
                   int64_t kv_heads, int64_t d, float scale, float* scores, float* inverse, int64_t from,           \
                   int64_t to) {                                                                                    \
    tile_stage<F, T, WIDE, DOT>(stage, queries, count, keys, values, h, kv_heads, d, scale, scores, inverse, from, \
                                to);                                                                                \
  }
ATTEND_ON(attend_baseline, , Halves<Halves<Vec4>>, BASELINE_TILE, 0, false)
#ifdef VEC_X86
ATTEND_ON(attend_avx2, TARGET_AVX2, Halves<Vec8>, AVX2_TILE, 0, false)
ATTEND_ON(attend_avx512, TARGET_AVX512, Vec, TILE, STEP_TILE, false)
ATTEND_ON(attend_avx512bf16, TARGET_AVX512BF16, Vec, TILE, STEP_TILE, true)
#endif
#undef ATTEND_ON

// Whether this CPU's VDPBF16PS is the two fused multiply-adds score_tile takes it for (dim 2t + 1's product, then
// dim 2t's, each rounded to nearest even; the Intel SDM's definition, and what an AMD Zen 4 does): checked on pairs
// whose products cancel the sum and on sums of every size, so that a CPU whose instruction rounds otherwise keeps
// the avx512 path and the same bits as an AVX2 machine.
#ifdef VEC_X86
TARGET_AVX512BF16 bool bf16_dot_is_two_fmas() {
  uint32_t state = 12345;
  const auto next = [&] { return state = state * 1664525u + 1013904223u; };
  const auto value = [&](int spread) {  // a normal bf16 of either sign, exponent within 2^(+-spread)
    const uint32_t r = next();
    const uint32_t exponent = 127 + static_cast<int32_t>(r >> 8 & 63) % (2 * spread + 1) - spread;
    return static_cast<uint16_t>((r >> 31) << 15 | exponent << 7 | (r >> 16 & 0x7f));
  };
  const auto widen = [](uint16_t h) { return bf16_half(static_cast<uint32_t>(h) << 16, 1); };
  for (int round = 0; round < 256; ++round) {
    alignas(64) uint16_t a[32], b[32];
    alignas(64) float acc[16], got[16];
    for (int i = 0; i < 32; ++i) a[i] = value(20), b[i] = value(20);
    for (int i = 0; i < 16; ++i) {
      const float odd = widen(a[2 * i + 1]) * widen(b[2 * i + 1]), even = widen(a[2 * i]) * widen(b[2 * i]);
      acc[i] = round % 4 == 0 ? -odd : round % 4 == 1 ? -even : widen(value(30));
    }
    _mm512_store_ps(got, _mm512_dpbf16_ps(_mm512_load_ps(acc), (__m512bh)_mm512_load_si512(a),
                                          (__m512bh)_mm512_load_si512(b)));
    for (int i = 0; i < 16; ++i) {
      const float want = std::fma(widen(a[2 * i]), widen(b[2 * i]),
                                  std::fma(widen(a[2 * i + 1]), widen(b[2 * i + 1]), acc[i]));
      if (std::memcmp(&want, &got[i], 4) != 0) return false;
    }
  }
  return true;
}
#endif

enum class AttendPath { baseline, avx2, avx512, avx512bf16 };

// The path attention takes beside the block kernels' path isa ("" for block_isa(), which TORNCHAT_ISA sets): the
// best this CPU runs, lowered with the block kernels where they are lowered, so that TORNCHAT_ISA=avx2 runs the
// AVX2 loops on any machine ("generic": the baseline, whose bits may differ: no fused multiply-add). Where the
// CPU's VDPBF16PS is what score_tile takes it for, the best takes it; "avx512f" names the AVX-512 loops without it,
// for the tests to compare both on such a CPU.
AttendPath attend_path(const std::string& isa) {
  const auto isas = tornchat::block_isas();
#ifdef VEC_X86
  if (isa == "avx512f" && __builtin_cpu_supports("avx512f")) return AttendPath::avx512;
#endif
  TORCH_CHECK(isa.empty() || std::find(isas.begin(), isas.end(), isa) != isas.end(), "isa='", isa,
              "' is not an instruction-set path this CPU runs");
#ifdef VEC_X86
  const std::string chosen = isa.empty() ? tornchat::block_isa() : isa;
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  static const bool bf16_dot = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16") &&
                               bf16_dot_is_two_fmas();
  const AttendPath best = !avx2                                ? AttendPath::baseline
                          : bf16_dot                           ? AttendPath::avx512bf16
                          : __builtin_cpu_supports("avx512f") ? AttendPath::avx512
                                                               : AttendPath::avx2;
  if (chosen == "generic") return AttendPath::baseline;
  if ((chosen == "avx2" || chosen == "avxvnni") && chosen != isas.front())
    return std::min(best, AttendPath::avx2);
  return best;
#else
  return AttendPath::baseline;
#endif
}

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

template <typename Kv>
void stage_on(AttendPath path, Stage stage, const Query* queries, int64_t count, const Kv* keys, const Kv* values,
              int64_t h, int64_t kv_heads, int64_t d, float scale, float* scores, float* inverse, int64_t from,
              int64_t to) {
#ifdef VEC_X86
  if (path == AttendPath::avx512bf16)
    return attend_avx512bf16(stage, queries, count, keys, values, h, kv_heads, d, scale, scores, inverse, from, to);
  if (path == AttendPath::avx512)
    return attend_avx512(stage, queries, count, keys, values, h, kv_heads, d, scale, scores, inverse, from, to);
  if (path == AttendPath::avx2)
    return attend_avx2(stage, queries, count, keys, values, h, kv_heads, d, scale, scores, inverse, from, to);
#endif
  attend_baseline(stage, queries, count, keys, values, h, kv_heads, d, scale, scores, inverse, from, to);
}

// attend_many's split: key blocks a thread scores at a time, and from how many positions a cache is split (its
// three passes' forks and joins cost more than they save below 512: 2026-11-27, AMD Zen 5, a step of the 135M's
// 9 heads over 3 KV heads 1.2x faster at 2,000 positions, of Gemma 3 1B's 4 over 1 1.3x at 4,000).
constexpr int64_t SPLIT_BLOCKS = 8, SPLIT_FROM = 1024;
// Up to this many (tile, position, dimension) triples attention runs on the calling thread: a short cache's step
// took longer with a fork and join than alone (the 135M's 3 tiles of 64 dimensions: the same at 40 positions,
// 0.89x at 100, 1.4x faster split at 200; 2026-11-28, AMD Zen 3). Every tile is computed alike either way.
constexpr int64_t SERIAL_WORK = 3 * 128 * 64;

// One sequence's keys and values of one layer: [capacity, kv_heads, head_dim] each, in the forward's layout (key_at,
// value_at), fp32 or bf16 as attend_many is told.
struct LayerCache {
  const void* keys;
  const void* values;
  int64_t capacity;
};

// Rows of several sequences in one call (a batch of generations): sequence s has counts[s] consecutive rows of q
// at positions starts[s] .. over its own cache, caches[s] of kv_heads heads (bf16, else fp32). q [rows, heads,
// head_dim] (fp32 or bf16).
// With a bf16 cache q's values must be bf16 values (rope_store_rows rounds them so; attend rounds q): the scores'
// pairs of bf16 are then exact, whichever instructions take them.
// Returns fp32 [rows, heads * head_dim]: each row attended over its sequence's positions up to its own,
// softmax(scale * q . k) v, as fused.attend_ref computes it, the same bits whatever else is in the call. window: 0,
// or how many positions, its own included, a row sees (the last ones: a sliding-window layer). path: attend_path's.
at::Tensor attend_many(const at::Tensor& q, const std::vector<LayerCache>& caches, int64_t kv_heads, bool bf16,
                       const std::vector<int64_t>& starts, const std::vector<int64_t>& counts, double scale,
                       int64_t window, AttendPath path, at::Tensor out = at::Tensor()) {
  RECORD_FUNCTION("tornchat::attend", std::vector<c10::IValue>());  // for torch.profiler (bench/decode_speed.py)
  const size_t seqs = caches.size();
  TORCH_CHECK(starts.size() == seqs && counts.size() == seqs, "one cache, start and count per sequence");
  const auto queries = q.scalar_type() == at::kFloat && q.is_contiguous() ? q : q.to(at::kFloat).contiguous();
  const int64_t rows = queries.size(0), heads = queries.size(1), d = queries.size(2);
  TORCH_CHECK(seqs > 0, "no sequence");
  const int64_t groups = heads / kv_heads;
  const int64_t tile_size = path >= AttendPath::avx512 ? TILE : path == AttendPath::avx2 ? AVX2_TILE : BASELINE_TILE;
  TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(d % LANES == 0 && d <= 16 * LANES, "head_dim must be a multiple of 16, at most 256");
  // Each sequence's KV heads' queries, (row, grouped head) in order, in tiles of tile_size: a step's grouped
  // heads share a tile, a chunk's neighbouring rows too.
  std::vector<int64_t> first_row(seqs), tiles(seqs), first_tile(seqs + 1, 0);
  int64_t longest = 0;
  for (size_t s = 0; s < seqs; ++s) {
    TORCH_CHECK(starts[s] + counts[s] <= caches[s].capacity, "q does not fit the cache");
    TORCH_CHECK(caches[s].capacity % KEY_BLOCK == 0, "the cache's capacity must be a multiple of 16 positions");
    first_row[s] = s ? first_row[s - 1] + counts[s - 1] : 0;
    tiles[s] = (counts[s] * groups + tile_size - 1) / tile_size;
    first_tile[s + 1] = first_tile[s] + kv_heads * tiles[s];
    longest = std::max(longest, starts[s] + counts[s]);
  }
  TORCH_CHECK(first_row[seqs - 1] + counts[seqs - 1] == rows, "the counts must add up to q's rows");
  out = result_tensor(std::move(out), {rows, heads * d}, queries.options());
  const float* qp = queries.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t tile_count = first_tile[seqs], width = (longest + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
  // Tile t's queries, its sequence and KV head.
  const auto tile_at = [&](int64_t t, Query* tile, int64_t& s, int64_t& h) {
    s = std::upper_bound(first_tile.begin(), first_tile.end(), t) - first_tile.begin() - 1;
    const int64_t local = t - first_tile[s], m0 = local % tiles[s] * tile_size;
    h = local / tiles[s];
    const int64_t count = std::min<int64_t>(tile_size, counts[s] * groups - m0);
    for (int64_t m = 0; m < count; ++m) {
      const int64_t r = (m0 + m) / groups, head = h * groups + (m0 + m) % groups, row = first_row[s] + r;
      const int64_t seen = starts[s] + r + 1;
      tile[m] = Query{qp + (row * heads + head) * d, op + (row * heads + head) * d, seen,
                      window ? std::max<int64_t>(0, seen - window) : 0};
    }
    return count;
  };
  // f(sequence s's keys of KV head h, its values), typed as the caches are.
  const auto with_cache = [&](int64_t s, int64_t h, const auto& f) {
    if (bf16)
      f(static_cast<const BFloat16*>(caches[s].keys) + h * d * KEY_BLOCK, static_cast<const BFloat16*>(caches[s].values));
    else
      f(static_cast<const float*>(caches[s].keys) + h * d * KEY_BLOCK, static_cast<const float*>(caches[s].values));
  };
  const int threads = at::get_num_threads();
  if (threads == 1 || tile_count % threads == 0 || tile_count >= 4 * threads || longest < SPLIT_FROM) {
    const auto tiles_from = [&](int64_t first, int64_t last) {
      const std::unique_ptr<float[]> scores(new float[tile_size * width]);  // softmax_row reads what is written
      for (int64_t t = first; t < last; ++t) {
        Query tile[TILE];
        int64_t s, h;
        const int64_t count = tile_at(t, tile, s, h);
        with_cache(s, h, [&](const auto* head_keys, const auto* layer_values) {
          stage_on(path, Stage::whole, tile, count, head_keys, layer_values, h, kv_heads, d, float(scale),
                   scores.get(), nullptr, 0, 0);
        });
      }
    };
    if (tile_count * width * d <= SERIAL_WORK) tiles_from(0, tile_count);
    else tornchat::team::parallel_for(0, tile_count, 1, tiles_from);
    return out;
  }
  // Few tiles, not a multiple of the threads (a step of one sequence: a tile per KV head, 3 of them on 2 threads
  // left one thread reading two heads' caches while the other waited): each tile's three stages are shared out
  // in turn, its scores by SPLIT_BLOCKS key blocks, its softmax by query, its weighted values by two chunks of
  // dims. Every score, weight and sum is the same as unsplit: the same bits.
  struct Split {
    Query queries[TILE];
    int64_t count, s, h;
    float inverse[TILE];
  };
  std::vector<Split> split(tile_count);
  const std::unique_ptr<float[]> scores(new float[tile_count * tile_size * width]);
  std::vector<std::array<int64_t, 2>> score_jobs, softmax_jobs, value_jobs;  // (tile, first block / query / chunk)
  for (int64_t t = 0; t < tile_count; ++t) {
    Split& tile = split[t];
    tile.count = tile_at(t, tile.queries, tile.s, tile.h);
    const Span span = span_of(tile.queries, tile.count);
    for (int64_t b = span.first_block; b < span.blocks; b += SPLIT_BLOCKS) score_jobs.push_back({t, b});
    for (int64_t m = 0; m < tile.count; ++m) softmax_jobs.push_back({t, m});
    for (int64_t c = 0; c < d / LANES; c += 2) value_jobs.push_back({t, c});
  }
  const auto run = [&](Stage stage, const std::vector<std::array<int64_t, 2>>& jobs, int64_t span) {
    tornchat::team::parallel_for(0, static_cast<int64_t>(jobs.size()), 1, [&](int64_t first, int64_t last) {
      for (int64_t i = first; i < last; ++i) {
        Split& tile = split[jobs[i][0]];
        const int64_t from = jobs[i][1], to = stage == Stage::values ? std::min(from + span, d / LANES) : from + span;
        with_cache(tile.s, tile.h, [&](const auto* head_keys, const auto* layer_values) {
          stage_on(path, stage, tile.queries, tile.count, head_keys, layer_values, tile.h, kv_heads, d, float(scale),
                   scores.get() + jobs[i][0] * tile_size * width, tile.inverse, from, to);
        });
      }
    });
  };
  run(Stage::scores, score_jobs, SPLIT_BLOCKS);
  run(Stage::softmax, softmax_jobs, 1);
  run(Stage::values, value_jobs, 2);
  return out;
}

// One sequence: q [n, heads, head_dim] at positions start .. over keys and values (attend_many), on the path
// attend_path(isa) chooses.
at::Tensor attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t start, double scale,
                  int64_t window, const std::string& isa) {
  check_cpu_contiguous(keys, "keys");
  check_cpu_contiguous(values, "values");
  const bool bf16 = keys.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || keys.scalar_type() == at::kFloat, "the cache must be fp32 or bf16");
  TORCH_CHECK(values.scalar_type() == keys.scalar_type() && values.sizes() == keys.sizes() && keys.dim() == 3,
              "keys and values must share a dtype and a shape [capacity, kv_heads, head_dim]");
  TORCH_CHECK(q.dim() == 3 && keys.size(2) == q.size(2), "q must be [n, heads, head_dim] of the cache's head_dim");
  return attend_many(bf16 ? q.to(at::kBFloat16) : q, {LayerCache{keys.data_ptr(), values.data_ptr(), keys.size(0)}},
                     keys.size(1), bf16, {start}, {q.size(0)}, scale, window, attend_path(isa));
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
