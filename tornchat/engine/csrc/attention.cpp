// Attention (attention.h): each query row over the cache positions it sees, in tiles of queries that share each
// load of keys and values, its loops compiled once per instruction-set path (vec.h).
#include "attention.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include "blocks.h"
#include "kv_layout.h"
#include "team.h"
#include "vec.h"

#ifdef VEC_X86
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace tornchat {
namespace {

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

// Positions j, j + 1 of 16 dims of values as a path adds them (add_pair): two fp32 vectors, or (DOT) the bf16
// cache's 16 words, each dim's pair of positions.
template <typename V, bool DOT> struct ValuePair { V v0, v1; };
template <> struct ValuePair<Vec, true> { IntVec words; };

// chain + w_j+1 v_j+1 + w_j v_j: two fused multiply-adds, position j + 1's first, denormals flushed (the scope's
// FlushDenormals): what VDPBF16PS does with a pair, which DOT takes for them. weights: the row softmax_row left,
// fp32 (w[j]), or with DOT the bf16 weights packed (uint16 j: bf16 w_j, so that the pair's 32-bit word is
// VDPBF16PS's operand).
typedef short Bf16Pairs __attribute__((vector_size(64)));
template <bool DOT, typename V>
inline __attribute__((always_inline)) V add_pair(V chain, const ValuePair<V, DOT>& values, const float* weights,
                                                  int64_t j) {
  if constexpr (DOT) {
#ifdef VEC_X86
    int32_t pair;
    std::memcpy(&pair, reinterpret_cast<const uint16_t*>(weights) + j, 4);
    // The builtin, not _mm512_dpbf16_ps: see score_tile.
    return __builtin_ia32_dpbf16ps_v16sf(chain, bit_cast<Bf16Pairs>(values.words), bit_cast<Bf16Pairs>(IntVec{} + pair));
#else
    static_assert(!DOT, "VDPBF16PS is x86's");
#endif
  } else {
    chain = fmadd(splat<V>(weights[j + 1]), values.v1, chain);
    return fmadd(splat<V>(weights[j]), values.v0, chain);
  }
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
  // Chunk k's pair as add_pair takes it (DOT: a bf16 cache's words, as stored); lone: position j alone, the last
  // of an odd count, position j + 1's values taken as zeros (they may be anything, NaN included).
  template <bool DOT>
  inline __attribute__((always_inline)) ValuePair<V, DOT> pair(int64_t k = 0, bool lone = false) const {
    if constexpr (DOT) {
      const auto words = load_vec<IntVec>(at + 2 * k * LANES);
      return {lone ? words & 0xffff : words};
    } else {
      V v0, v1;
      read(v0, v1, k);
      return {v0, lone ? V{} : v1};
    }
  }
  inline __attribute__((always_inline)) void prefetch(int64_t k = 0) const {  // chunk k further on, ahead
    __builtin_prefetch(at + ahead + k * (std::is_same_v<Kv, float> ? 1 : 2) * LANES);
  }
  inline __attribute__((always_inline)) void next() {
    j += 2;
    at += j & (KEY_BLOCK - 1) ? within : across;
  }
};

// Denormals flushed to zero for a scope (x86: MXCSR's flush-to-zero and denormals-are-zero; aarch64: FPCR's FZ,
// both): VDPBF16PS flushes its inputs' and its sums' denormals whatever MXCSR says, so the fused multiply-adds that
// stand for it elsewhere flush them too, and every path's scores get the same bits, also where a product is tiny.
struct FlushDenormals {
#if defined(VEC_X86)
  unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
#elif defined(__aarch64__)
  // the registers by name: GCC's __builtin_aarch64_get_fpcr is not clang's (Apple's compiler)
  uint64_t saved = [] { uint64_t fpcr; asm volatile("mrs %0, fpcr" : "=r"(fpcr)); return fpcr; }();
  FlushDenormals() { asm volatile("msr fpcr, %0" ::"r"(saved | uint64_t{1} << 24)); }
  ~FlushDenormals() { asm volatile("msr fpcr, %0" ::"r"(saved)); }
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
            acc[m][part] = fmadd(splat<V>(queries[m].q[2 * t + 1]), k1, acc[m][part]);
            acc[m][part] = fmadd(splat<V>(queries[m].q[2 * t]), k0, acc[m][part]);
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
// begin its tile has. ROUND (a bf16 cache): each weight rounded to the nearest bf16 before it is summed, ties
// away from zero (two operations where ties to even took five: AVX2's attention 1.02-1.05x the time with those,
// 1.00-1.03x with these, AMD Zen 4; a weight is at least exp(-87), a normal number), the values VDPBF16PS takes;
// PACK: those stored as bf16 (uint16 j: position j's), the row's first half, for add_pair's DOT.
template <typename F, bool ROUND, bool PACK>
inline __attribute__((always_inline)) float softmax_row(float* scores, int64_t begin, int64_t first, int64_t seen) {
  static_assert(ROUND || !PACK, "packed weights are bf16");
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
    using Uint = typename Lanes<F>::Uint;
    if constexpr (ROUND) kept = bit_cast<F>((bit_cast<Uint>(kept) + 0x8000u) & 0xffff0000u);
    totals += kept;
    if constexpr (PACK) {
      // Group j's 16 bf16 over floats j / 2 .. j / 2 + 7: read already (this group's, or those before it).
      typedef uint16_t Half16 __attribute__((vector_size(32)));
      store_vec(reinterpret_cast<uint16_t*>(scores) + j, __builtin_convertvector(bit_cast<Uint>(kept) >> 16, Half16));
    } else {
      store_vec(scores + j, kept);
    }
  }
  return 1.0f / sum(totals);
}

// Chunks c .. c + C - 1 of 16 dims of T queries' weighted values: the positions all T see, a pair at a time
// (add_pair), sharing each value load; then each query's own. Pair j, j + 1 goes to chain j / 2 % 2, two chains in
// flight for each sum, whatever position a tile starts from. A query whose window starts later has zero weights at
// the positions before it: adding them changes no bit. Each sum is the same whatever C.
template <typename F, int T, int C, bool DOT, typename Kv>
inline __attribute__((always_inline)) void value_chunks(const Query* queries, const Kv* values, int64_t h,
                                                        int64_t kv_heads, int64_t d, const float* scores,
                                                        int64_t width, const float* inverse, int64_t shared,
                                                        int64_t first_min, int64_t c) {
  using V = typename HalfOf<F>::type;
  for (int part = 0; part < HalfOf<F>::parts; ++part) {
    V chains[2][C][T];
    for (int k = 0; k < C; ++k)
      for (int m = 0; m < T; ++m) chains[0][k][m] = chains[1][k][m] = V{};
    const auto shared_pair = [&](ValuePairs<V, Kv>& pairs, int chain) __attribute__((always_inline)) {
      for (int k = 0; k < C; ++k) {
        // Both halves prefetch, probably since a half's pass over a long cache evicts what the other fetched
        // (the second half without: a 1B prefill chunk's attention 1.03-1.12x slower, AMD Zen 3, 2026-11-28).
        pairs.prefetch(k);
        const auto pair = pairs.template pair<DOT>(k);
        for (int m = 0; m < T; ++m)
          chains[chain][k][m] = add_pair<DOT>(chains[chain][k][m], pair, scores + m * width, pairs.j);
      }
      pairs.next();
    };
    // From a multiple of 4 (zero weights before each query's first) to shared (another), pair j, j + 1 to chain
    // j / 2 % 2 without a branch.
    for (ValuePairs<V, Kv> pairs(values, h, kv_heads, d, first_min / 4 * 4, c, part); pairs.j < shared;)
      shared_pair(pairs, 0), shared_pair(pairs, 1);
    // Unrolled, so that no chain is indexed at run time: GCC otherwise kept the chains in memory and stored each
    // after every pair of the loop above (AVX-512 BF16: attention 1.2x slower than before VDPBF16PS).
#pragma GCC unroll 2
    for (int k = 0; k < C; ++k)
#pragma GCC unroll 8
      for (int m = 0; m < T; ++m) {
        // The same pairs as above, the last one of an odd count alone (its second value zero).
        const int64_t seen = queries[m].seen;
        V a = chains[0][k][m], b = chains[1][k][m];
        for (ValuePairs<V, Kv> own(values, h, kv_heads, d, shared, c + k, part); own.j < seen;) {
          a = add_pair<DOT>(a, own.template pair<DOT>(0, own.j + 1 == seen), scores + m * width, own.j);
          own.next();
          if (own.j >= seen) break;
          b = add_pair<DOT>(b, own.template pair<DOT>(0, own.j + 1 == seen), scores + m * width, own.j);
          own.next();
        }
        const V scaled = (a + b) * inverse[m];
        store_vec(queries[m].out + (c + k) * LANES + part * lanes_of<V>, scaled);
      }
  }
}

// What a tile's queries see together: key blocks first_block .. blocks - 1, their scores in rows of width, and
// the positions before shared (a multiple of 4: value_chunks' pairs of pairs) that all of them see.
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
  return Span{first_min, first_min / KEY_BLOCK, blocks, blocks * KEY_BLOCK, seen_min / 4 * 4};
}

// Chunks c0 .. c1 - 1 of T queries' weighted values, two a pass where the path's registers hold them (WIDE), a
// pair of positions a VDPBF16PS with DOT (a bf16 cache's weights packed by softmax_row).
template <typename F, int T, int WIDE, bool DOT, typename Kv>
inline __attribute__((always_inline)) void weigh_values(const Query* queries, const Kv* values, int64_t h,
                                                        int64_t kv_heads, int64_t d, const float* scores,
                                                        const Span& span, const float* inverse, int64_t c0,
                                                        int64_t c1) {
  const FlushDenormals flushed;
  int64_t c = c0;
  if constexpr (T <= WIDE)
    for (; c + 2 <= c1; c += 2)
      value_chunks<F, T, 2, DOT>(queries, values, h, kv_heads, d, scores, span.width, inverse, span.shared,
                                 span.first_min, c);
  for (; c < c1; ++c)
    value_chunks<F, T, 1, DOT>(queries, values, h, kv_heads, d, scores, span.width, inverse, span.shared,
                               span.first_min, c);
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
  constexpr bool bf16 = std::is_same_v<Kv, BFloat16>, dot = DOT && bf16;
  const Span span = span_of(queries, T);
  const auto scores_of = [&](int64_t first, int64_t last) __attribute__((always_inline)) {
    score_tile<F, T, DOT>(queries, keys, values + h * KEY_BLOCK * d, kv_heads * d * KEY_BLOCK,
                          std::max(first, span.first_block), std::min(last, span.blocks), d, scale, scores, span.width);
  };
  const auto softmax = [&](int64_t m) __attribute__((always_inline)) {
    return softmax_row<F, bf16, dot>(scores + m * span.width, span.first_block * KEY_BLOCK, queries[m].first,
                                     queries[m].seen);
  };
  if (stage == Stage::whole) {
    float own[T];  // not inverse: a local array the compiler knows no store reaches
    scores_of(0, span.blocks);
    for (int m = 0; m < T; ++m) own[m] = softmax(m);
    weigh_values<F, T, WIDE, dot>(queries, values, h, kv_heads, d, scores, span, own, 0, d / LANES);
  } else if (stage == Stage::scores) {
    scores_of(from, to);
  } else if (stage == Stage::softmax) {
    inverse[from] = softmax(from);
  } else {
    weigh_values<F, T, WIDE, dot>(queries, values, h, kv_heads, d, scores, span, inverse, from, to);
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

}  // namespace

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

at::Tensor attend_many(const at::Tensor& q, const std::vector<LayerCache>& caches, int64_t kv_heads, bool bf16,
                       const std::vector<int64_t>& starts, const std::vector<int64_t>& counts, double scale,
                       int64_t window, AttendPath path, at::Tensor out) {
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

}  // namespace tornchat
