// The x86 paths: x86_kernels.inc once per instruction set.
//
// How: each int32 lane must hold one block's dot, so a group's 8 unpacked weight blocks (8 vectors of 32
// levels) are transposed as 8 x 8 int32 once per column, and the activations are stored transposed the same
// way when quantized (Acts::qt); then 8 VPDPBUSD (or VPMADDUBSW + VPMADDWD) steps give the 8 blocks' dots in
// 8 lanes, and the fp32 work is 2-3 instructions per 8 blocks per (row, column). VPDPBUSD multiplies unsigned
// by signed bytes: the levels are unsigned and the offsets enter as the accumulator's start, -offset * sum q
// (exact); Q8_0 adds 128 to its levels on the VNNI paths and uses VPSIGNB on AVX2, where VPMADDUBSW's int16
// pair sums stay below 2 * 128 * 127 = 32512 (at most 2 * 63 * 127 for the other types: no saturation).
//
// Built without -march: each x86 path is x86_kernels.inc compiled again under its own `#pragma GCC target`
// (below), chosen at run time by __builtin_cpu_supports (dispatch.cpp). Each kernel computes a tile of R rows
// by 4 columns: every weight block is unpacked and transposed once for the R rows (R up to 8, AVX-512 16),
// each (row, column) its own chain. AVX-512 holds two columns per 512-bit register, each half doing the
// 256-bit operations. Two AVX-512 kernels skip that transpose where it does not pay: one row alone (a decode
// step) folds each column's blocks in their own order (quant_group_row; not Q4_0, Q4_1, whose nibbles a few
// permutes put in the transposed layout: q4_pair, and on AVX2 a 4 x 4 dword transpose: q4_steps), and from
// PANEL_ROWS rows (a prefill chunk) the columns are unpacked once into panels of 16 that one VPDPBUSD
// takes against a row's broadcast activations (vnni_columns); the avx2 path does the same from AVX2_PANEL_ROWS
// rows with panels of 8 columns and VPMADDUBSW (avx2_columns). The tiles prefetch their weights in address
// order, a tile and PREFETCH_IN_ORDER bytes ahead (prefetch_in_order; to L2 past IN_L1_AHEAD); the float tiles
// PREFETCH bytes ahead in each column.
// Rows may come grouped (blocks.h group_blocks): each whole group's levels stored in the transposed steps, so the
// tiles load them (grouped_steps; AVX-512: grouped_pair) and the panels pack them as loaded. Which types a path
// takes grouped is blocks.py's GROUPING (avx2, avxvnni: all five; AVX-512: the Q4 types and Q6_K, as its one-row
// kernel reads Q8_0 faster in the file's layout); every path computes either layout. A grouped row's short
// last group of one or two blocks (K = 576: 18 blocks) is taken for a tile's 4 columns at once, as one
// transposed group (short_tail; the AVX-512 tiles too, in 256-bit vectors).
// Q4_0, Q4_1 and Q8_0 parts whose rows come in slabs of 16 may come paneled (blocks.h panel_blocks, blocks.py's
// PANELING: the avx512vnni path alone): 16 columns' block b in one slot, so that every row count takes the
// panels' arithmetic, 16 columns a VPDPBUSD, straight from the nibbles (p16_tile; from PANEL_ROWS rows
// vnni_columns on the slots unpacked: pack_p16), with no transpose and no per-column sum of lanes.
// The "amx" path is avx512vnni's with every 16 rows on AMX tiles: TDPBUSD gives one block's exact dots for
// 16 columns x 16 rows, then the same fp32 operations (amx_columns, on the same panels), so it too gives the
// same bits; block_isas() lists it first where the CPU and the kernel (arch_prctl ARCH_REQ_XCOMP_PERM) allow
// it. TORNCHAT_ISA=avx512vnni turns it off.

#include "common.h"

#ifdef TORNCHAT_X86

#define PASS_NS avx2_path
#define PASS_VNNI 0
#define PASS_RMAX 8
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
#include "x86_kernels.inc"
#pragma GCC pop_options
#undef PASS_NS
#undef PASS_VNNI
#undef PASS_RMAX

#define PASS_NS avxvnni_path
#define PASS_VNNI 1
#define PASS_RMAX 8
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2,avxvnni")
#include "x86_kernels.inc"
#pragma GCC pop_options
#undef PASS_NS
#undef PASS_VNNI
#undef PASS_RMAX

#define PASS_NS avx512vnni_path
#define PASS_VNNI 2
#define PASS_RMAX 16
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#include "x86_kernels.inc"
#pragma GCC pop_options
#undef PASS_NS
#undef PASS_VNNI
#undef PASS_RMAX

#endif  // TORNCHAT_X86
