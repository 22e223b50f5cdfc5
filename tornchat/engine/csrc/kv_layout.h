// The KV cache's layout, shared by fused.cpp's rope_store, which writes the cache, and attention.cpp, which reads it.
#pragma once
#include <cstdint>
#include <type_traits>

#include "vec.h"

namespace {

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

}  // namespace
