// Matrix products on GGUF blocks as the file stores them (blocks/), for fused.cpp's Forward and Python.
//
// A weight matrix [N, K] is one or more parts stacked by rows, each part uint8 [N_i, row_bytes] in a GGML
// type (the type ids below are GGML's own). Activations are quantized per block of 32 input features to int8
// with an fp32 scale; each weight block's integer dot product with them is exact (int32), and the fp32 sums
// over blocks run in a fixed order per output, so a row's result has the same bits whatever the number of
// rows in the call and wherever the row sits in it (batch invariance). The float types are multiplied in
// fp32, each output's sum over K in a fixed order too.
//
// Semantics (tornchat/engine/blocks.py reference_mm computes the same in float64):
//   The weight matrix is the parts stacked by rows; part i is uint8 [N_i, row_bytes], each row K / block_size
//   consecutive GGML blocks exactly as a GGUF file stores them (ggml-common.h layouts; what the bytes mean is
//   tornchat/engine/ggml.py dequantize). Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F32, F16, BF16.
//   All parts share K, a multiple of 32 (of 256 for the K-quants).
//
//   Activations x [rows, K] fp32 (bf16 is converted), per row and block b of 32 features:
//     d[b] = max |x| / 127 (fp32), q[k] = round-half-even(x[k] * (127 / max |x|)) clamped to [-127, 127]
//     (0 where max |x| is 0), s[b] = sum of q over the block (an exact integer). Each row is quantized once.
//   Quantized types: a weight value is w = a[b] * (level - offset) + m[b] with, per 32-block (K-quants: per
//   sub-block) of a weight row,
//     Q4_0: a = d, offset 8, m = 0        Q4_1: a = d, m = min        Q5_0: a = d, offset 16
//     Q5_1: a = d, m = min                Q8_0: a = d, signed levels  Q4_K/Q5_K: a = d * sc[j], m = -dmin * mn[j]
//     Q6_K: two sub-blocks of 16 per 32-block, a = d * sc[j] (int8 sc), offset 32.
//   Output (r, n): 8 fp32 lanes, zero at first; block b = 8g + j (groups g of 8 blocks, the last one possibly
//   short) goes to lane j, in order of g:
//       lane j = fma(float(dot[b]), a[b] * d[b], lane j)       (Q6_K: twice, the first 16 features' dot with
//                                                               their sub-block's a, then the second 16's)
//       lane j = fma(m[b], d[b] * s[b], lane j)                 (the types with minimums)
//   where dot[b] is the exact int32 sum over the block's features of (level - offset) * q and each product
//   a * d, d * s is rounded to fp32; at the end out = ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
//   Every path (amx, avx512vnni, avxvnni, avx2, dotprod, neon, generic) does exactly these operations, so all
//   paths give the same bits (the integer dots are exact whatever instructions compute them), and so does every
//   row whatever the other rows of the call, their number, the thread count or the split of the matrix into
//   parts (batch invariance).
//   Float types: w in fp32 (exact from F16/BF16), the products summed with fused multiply-adds into 8 lanes,
//   feature k into lane k % 8 in order of k, then the same 8-lane sum; x is not quantized.
#pragma once
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

namespace tornchat {

// GGML type ids (ggml.h's enum ggml_type), and ours for the grouped layouts (group_blocks): GROUPED + the type's;
// for the panel layout (panel_blocks): PANELED + the type's.
enum GgmlType : int64_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
  GROUPED = 1000, Q4_0_G8 = GROUPED + Q4_0, Q4_1_G8 = GROUPED + Q4_1, Q8_0_G8 = GROUPED + Q8_0,
  Q4_K_G8 = GROUPED + Q4_K, Q6_K_G8 = GROUPED + Q6_K,
  PANELED = 2000, Q4_0_P16 = PANELED + Q4_0, Q4_1_P16 = PANELED + Q4_1, Q8_0_P16 = PANELED + Q8_0,
};

// The instruction-set paths this CPU runs, best first ("amx", "avx512vnni", "avxvnni", "avx2", "generic"; on
// aarch64 "dotprod", "neon", "generic"): detected by CPUID (and, for AMX, the kernel's permission to use its tiles; on
// aarch64 by the kernel's HWCAP_ASIMDDP). Every path gives the same bits.
// The environment variable TORNCHAT_ISA names a lower one to use instead; one this CPU lacks is an error.
std::vector<std::string> block_isas();

// The path block_mm takes when none is named: the best of block_isas(), or TORNCHAT_ISA's.
std::string block_isa();

// A weight matrix as block_mm reads it: its parts' rows (pointers into tensors the caller keeps alive), types
// and sizes, and the instruction-set path, checked and resolved once (block_matrix). A decode step's 120
// products each read their parts' tensor metadata again otherwise, cold after the weights streamed past.
struct BlockPart {
  const uint8_t* data;
  int64_t rows, row_bytes, type;
};
struct BlockMatrix {
  std::vector<BlockPart> parts;
  int64_t k = 0, n = 0;  // K, and the parts' rows in all
  bool any_quant = false;  // any part not F32, F16 or BF16
  int isa = 0;  // the path (blocks/dispatch.cpp's Isa)
};

// parts: uint8 [N_i, row_bytes] of the GGML types (or grouped ids) given, the same K; isa: one of block_isas()
// or "" for block_isa() (TORNCHAT_ISA read now). No parts: a matrix block_mm refuses.
BlockMatrix block_matrix(const std::vector<at::Tensor>& parts, const std::vector<int64_t>& types, const std::string& isa);

// x [rows, K] (fp32 or bf16) times the matrix's [N, K] transposed: fp32 [rows, N]. Threads split the output
// columns, never K. out: where to write it (resized to [rows, N], its storage kept where large enough), or an
// undefined tensor for a new one.
at::Tensor block_mm(const at::Tensor& x, const BlockMatrix& w, at::Tensor out = at::Tensor());
// The same, its matrix given as parts and types (block_matrix's).
at::Tensor block_mm(const at::Tensor& x, const std::vector<at::Tensor>& parts, const std::vector<int64_t>& types,
                    const std::string& isa, at::Tensor out = at::Tensor());

// The grouped layout of Q4_0, Q4_1, Q8_0, Q4_K and Q6_K rows (type ids Q4_0_G8 .. Q6_K_G8): the same bytes per row
// and the same values, each whole group of 8 blocks rearranged as [the 8 blocks' fp16 d][Q4_1: their fp16
// minimums][the levels, per step t of 4 features (Q4: 4 steps of nibble bytes 4t..4t+3, each byte holding
// features 4t.. and 16 + 4t..; Q8_0: 8 steps of bytes 4t..4t+3), block j's 4 bytes at 4j]; a row's short last
// group of nj blocks as [their nj fp16 d][Q4_1: their minimums][each block's levels as the file has them]. It is
// the layout the avx2 kernels take their steps in (Acts::qt's), so that a group costs them loads where the file's
// needs transposes, and a short group's scales one load. Q4_K: each super-block's 16 bytes of scales as they are,
// then its 8 sub-blocks' levels in the Q4 types' steps. Q6_K: the low 4 bits of its 8 blocks' levels in the Q4
// steps, then per block 2 dwords of high bits (features 4t.. and 16 + 4t.., step t's 2 bits at bit 2t of each
// byte), its scales and d as they are. group_blocks rearranges part (uint8 [N, row_bytes]
// of the type given) in place; ungroup_blocks returns a grouped part's bytes as the file stores them.
void group_blocks(at::Tensor part, int64_t type);
at::Tensor ungroup_blocks(const at::Tensor& part, int64_t type);

// The panel layout of Q4_0, Q4_1 and Q8_0 rows (Q4_0_P16 ..), which the avx512vnni path reads with 16 columns in
// the lanes of a vector: every 16 rows (N a multiple of 16) hold their blocks together, one slot of 16 blocks'
// bytes per block index b, the slots in the order lane j of a row's 8 sums takes them (b = j, j + 8, ... for
// j = 0 .. 7): the 16 rows' fp16 d, Q4_1's fp16 minimums, then the levels' 4-byte words w (Q4: 4, each byte
// holding features 4w + i and 16 + 4w + i in its low and high nibble; Q8_0: 8) as 64 bytes each, row i's word at
// 4i. The same bytes and values; panel_blocks rearranges part (uint8 [N, row_bytes]) in place, unpanel_blocks
// returns the file's bytes.
void panel_blocks(at::Tensor part, int64_t type);
at::Tensor unpanel_blocks(const at::Tensor& part, int64_t type);

// Adds block_isas, block_isa, block_mm (without the GIL), group_blocks, ungroup_blocks, panel_blocks and
// unpanel_blocks to fused.cpp's Python module.
void define_blocks(pybind11::module_& m);

}  // namespace tornchat
