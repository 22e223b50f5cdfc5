// Attention over the forward's KV cache (attention.cpp), for fused.cpp's Forward and Python.
//
// Attention of n rows over the cache, computed so that row r of n gets the same bits whatever n is: each
// row's scores, softmax and weighted sum depend only on its query and the positions 0 .. start + r it sees, in a
// fixed order. A speculative verify's rows then equal one-token steps, and a prefill chunk's rows equal a
// prompt fed token by token. Keys are blocked (key_at): a query's scores over 16 positions are one vector, each
// lane its own sum over the dimensions, so there is no horizontal sum per key, and queries that share a KV head
// (a step's grouped heads, a chunk's neighbouring rows) share each load of keys and values. The loops are compiled
// once per instruction-set path (attend_path; vec.h), each product added to its sum in one fused multiply-add on
// the vector paths, so that AVX2 and AVX-512 machines get the same bits; with AVX-512 BF16 a bf16 cache's scores
// and weighted values take VDPBF16PS, whose two multiply-adds per pair are the same operations.
//
// The semantics, per query q and position j (what attend_ref computes, up to fp32 rounding order):
//   score_j = s * scale, s = one sum over the dims in order of pairs t, q_2t+1 k_j,2t+1 and then q_2t k_j,2t
//             (denormals flushed to zero; with a bf16 cache q is a bf16 vector, so each product is exact);
//   w_j = exp(score_j - max score), with a bf16 cache rounded to the nearest bf16 (ties away from zero);
//   total = the 16-lane sums of w in order of 16-position groups, then a tree;
//   out = (A + B) / total: pair j, j + 1 (j even) adds w_j+1 v_j+1 and then w_j v_j to chain A where j / 2 is
//         even, B where it is odd, each chain in order of j, denormals flushed (the last position of an odd
//         count alone, in its pair's chain).
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace tornchat {

// The vector loops' instruction-set paths (vec.h), worst first; the gate (fused.cpp) takes attention's.
enum class AttendPath { baseline, avx2, avx512, avx512bf16 };

// The path attention takes beside the block kernels' path isa ("" for block_isa(), which TORNCHAT_ISA sets): the
// best this CPU runs, lowered with the block kernels where they are lowered, so that TORNCHAT_ISA=avx2 runs the
// AVX2 loops on any machine ("generic": the baseline, whose bits may differ: no fused multiply-add). Where the
// CPU's VDPBF16PS is what score_tile takes it for, the best takes it; "avx512f" names the AVX-512 loops without it,
// for the tests to compare both on such a CPU.
AttendPath attend_path(const std::string& isa);

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
                       int64_t window, AttendPath path, at::Tensor out = at::Tensor());

// One sequence: q [n, heads, head_dim] at positions start .. over keys and values (attend_many), on the path
// attend_path(isa) chooses.
at::Tensor attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t start, double scale,
                  int64_t window, const std::string& isa);

}  // namespace tornchat
