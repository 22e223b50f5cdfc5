// Matrix products on GGUF blocks as the file stores them (contract: blocks.h).
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
//   Every path (amx, avx512vnni, avxvnni, avx2, generic) does exactly these operations, so all paths give the
//   same bits (the integer dots are exact whatever instructions compute them), and so does every row
//   whatever the other rows of the call, their number, the thread count or the split of the matrix into
//   parts (batch invariance).
//   Float types: w in fp32 (exact from F16/BF16), the products summed with fused multiply-adds into 8 lanes,
//   feature k into lane k % 8 in order of k, then the same 8-lane sum; x is not quantized.
//
// How: each int32 lane must hold one block's dot, so a group's 8 unpacked weight blocks (8 vectors of 32
// levels) are transposed as 8 x 8 int32 once per column, and the activations are stored transposed the same
// way when quantized (Acts::qt); then 8 VPDPBUSD (or VPMADDUBSW + VPMADDWD) steps give the 8 blocks' dots in
// 8 lanes, and the fp32 work is 2-3 instructions per 8 blocks per (row, column). VPDPBUSD multiplies unsigned
// by signed bytes: the levels are unsigned and the offsets enter as the accumulator's start, -offset * sum q
// (exact); Q8_0 adds 128 to its levels on the VNNI paths and uses VPSIGNB on AVX2, where VPMADDUBSW's int16
// pair sums stay below 2 * 128 * 127 = 32512 (at most 2 * 63 * 127 for the other types: no saturation).
//
// Built without -march: each x86 path is this file's second half compiled again under its own
// `#pragma GCC target` (the file includes itself) and chosen at run time by __builtin_cpu_supports. The
// generic path is plain C++ and the only one elsewhere. Threads share the output columns in chunks (team::share),
// never K. Each kernel computes a tile of R rows by 4 columns: every weight block is unpacked and transposed
// once for the R rows (R up to 8, AVX-512 16), each (row, column) its own chain. AVX-512 holds two columns
// per 512-bit register, each half doing the 256-bit operations. Two AVX-512 kernels skip that transpose
// where it does not pay: one row alone (a decode step) folds each column's blocks in their own order
// (quant_group_row; not Q4_0, Q4_1, whose nibbles a few permutes put in the transposed layout: q4_pair, and on
// AVX2 a 4 x 4 dword transpose: q4_steps), and
// from PANEL_ROWS rows (a prefill chunk) the columns are unpacked once into panels of 16 that one VPDPBUSD
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
#ifndef TORNCHAT_BLOCKS_PASS
#include "blocks.h"
#include "team.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(TORNCHAT_GENERIC_ONLY)
#include <immintrin.h>
#define TORNCHAT_X86 1
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace tornchat {
namespace blocks_detail {

constexpr int64_t QK = 32;  // features per activation block
constexpr int COLS = 4;  // output columns per kernel tile
// Rows from which the avx512vnni path unpacks columns into panels (vnni_columns): below it the unpacking costs
// more than the panels save (measured: docs/performance.md, "The many-row panels").
constexpr int64_t PANEL_ROWS = 64;
// The same for the avx2 path's panels (avx2_columns), which take rows 8 at a time. 2026-11-27, AMD Zen 3: the 1B's
// Q4_K and Q6_K products alone at 16 rows 1.04-1.10x the 8-row tiles' speed, at 8 rows 0.89-0.94x; but a whole
// forward of a chunk after a prefix (2026-11-28, same CPU kind) ran 16 rows 1.3-1.5x faster on the tiles (1B
// 148-166 against 219-222 ms, 135M 22-23 against 28-30), 32 rows alike (135M) or 1.05-1.15x (1B), and from 48
// (135M) or 64 (1B) rows faster on the panels.
constexpr int64_t AVX2_PANEL_ROWS = 32, AVX2_PANEL_M = 8;

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

inline float bf16_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

struct TypeInfo {
  int64_t values, bytes;
};

inline bool type_info(int64_t type, TypeInfo& info) {
  switch (type) {
    case F32: info = {1, 4}; return true;
    case F16: info = {1, 2}; return true;
    case BF16: info = {1, 2}; return true;
    case Q4_0: case Q4_0_G8: case Q4_0_P16: info = {32, 18}; return true;
    case Q4_1: case Q4_1_G8: case Q4_1_P16: info = {32, 20}; return true;
    case Q5_0: info = {32, 22}; return true;
    case Q5_1: info = {32, 24}; return true;
    case Q8_0: case Q8_0_G8: case Q8_0_P16: info = {32, 34}; return true;
    case Q4_K: case Q4_K_G8: info = {256, 144}; return true;
    case Q5_K: info = {256, 176}; return true;
    case Q6_K: case Q6_K_G8: info = {256, 210}; return true;
    default: return false;
  }
}

constexpr bool is_float(int64_t type) { return type == F32 || type == F16 || type == BF16; }

// The activations of every row, quantized once per call.
struct Acts {
  int64_t rows = 0, k = 0, nb = 0, nbp = 0;  // nbp: blocks padded to a multiple of 8
  std::vector<int8_t> q;  // [rows, K]
  // [rows, nbp * 32], per group of 8 blocks and step t of 4 features: 32 bytes whose 4-byte lane i holds
  // features 4t..4t+3 of block i (zero past nb): the layout that gives each int32 lane one block's dot
  std::vector<int8_t> qt;
  std::vector<float> d;  // [rows, nbp], zero past nb
  std::vector<float> ds;  // [rows, nbp]: d * s (fp32), zero past nb
  std::vector<int32_t> neg_sums;  // [rows, nbp]: -s
  std::vector<int32_t> neg_first, neg_second;  // [rows, nbp]: minus the sums of q over features 0-15, 16-31
  // [rows, 256] where a row ends in a group of one or two blocks (nb % 8): that group's 8 steps, block j's 4
  // features in lanes 4j .. 4j + 3 (short_tail: lane 4j + c is column c's block j)
  std::vector<int8_t> tail;
  // The panels' (amx_columns, vnni_columns), per 16 rows (rows / 16 tiles) and block: q as AMX tiles take it,
  // [t][row][4 features] (512 bytes), d and d * s of the 16 rows, and -s, -(first 16), -(second 16) times the
  // offsets the types subtract (8, 16, 128; Q6_K's 32), added to the dots
  std::vector<int8_t> qv;
  std::vector<float> tile_d, tile_ds;
  std::vector<int32_t> tile_sums3, tile_sums4, tile_sums7, tile_first5, tile_second5;
};

// Whether a row of nb blocks of 32 ends in a short group that short_tail takes (one or two blocks past its groups
// of 8): the rows Acts::tail is filled for.
inline bool short_tail_of(int64_t nb) { return nb % 8 != 0 && nb % 8 <= 2; }

// Fills the panels' part of a (the rows / 16 whole tiles of 16 rows).
inline void tile_rows(Acts& a) {
  const int64_t tiles = a.rows / 16;
  a.qv.resize(tiles * a.nb * 512);
  for (auto* v : {&a.tile_d, &a.tile_ds}) v->resize(tiles * a.nb * 16);
  for (auto* v : {&a.tile_sums3, &a.tile_sums4, &a.tile_sums7, &a.tile_first5, &a.tile_second5})
    v->resize(tiles * a.nb * 16);
  team::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t tile = t0; tile < t1; ++tile)
      for (int64_t b = 0; b < a.nb; ++b) {
        int8_t* dst = a.qv.data() + (tile * a.nb + b) * 512;
        for (int m = 0; m < 16; ++m) {
          const int64_t r = tile * 16 + m, at = r * a.nbp + b, to = (tile * a.nb + b) * 16 + m;
          for (int t = 0; t < 8; ++t) std::memcpy(dst + 64 * t + 4 * m, a.q.data() + r * a.k + b * QK + 4 * t, 4);
          a.tile_d[to] = a.d[at], a.tile_ds[to] = a.ds[at];
          a.tile_sums3[to] = a.neg_sums[at] * 8, a.tile_sums4[to] = a.neg_sums[at] * 16;
          a.tile_sums7[to] = a.neg_sums[at] * 128;
          a.tile_first5[to] = a.neg_first[at] * 32, a.tile_second5[to] = a.neg_second[at] * 32;
        }
      }
  });
}

// Everything a kernel needs for one part's columns.
struct Job {
  int64_t type, k, nb, row_bytes, n_total, col_offset;
  const uint8_t* w;  // the part's rows
  const Acts* a;
  const float* xf;  // fp32 x [rows, K] (float types)
  float* out;  // [rows, n_total]
  bool amx;  // AMX tiles for every 16 rows (the amx path: avx512vnni's, the same bits)
  bool grouped;  // type's rows in the grouped layout (group_blocks): Q4_0, Q4_1, Q8_0, Q4_K, Q6_K
  bool paneled;  // in the panel layout (panel_blocks): Q4_0, Q4_1, Q8_0 on the avx512vnni path
};

// Per group of 8 blocks of one weight row: the scales a (ws), the minimums m (wm), Q6_K's 16 sub-block
// scales (wsc). Lanes past the row's blocks are zero.
template <int64_t T>
inline __attribute__((always_inline)) void decode_meta(const uint8_t* row, int64_t g, int nj, float* ws, float* wm,
                                                       float* wsc) {
  if (T == Q4_K || T == Q5_K || T == Q6_K) {
    if (T == Q6_K) {
      const uint8_t* sb = row + g * 210;
      const float d = half_to_float(sb + 208);
      for (int i = 0; i < 16; ++i) wsc[i] = d * static_cast<float>(static_cast<int8_t>(sb[192 + i]));
      return;
    }
    const uint8_t* sb = row + g * (T == Q4_K ? 144 : 176);
    const float d = half_to_float(sb), dmin = half_to_float(sb + 2);
    const uint8_t* s = sb + 4;
    for (int j = 0; j < 4; ++j) {
      ws[j] = d * static_cast<float>(s[j] & 63);
      wm[j] = -dmin * static_cast<float>(s[4 + j] & 63);
      ws[4 + j] = d * static_cast<float>((s[8 + j] & 0xF) | ((s[j] >> 6) << 4));
      wm[4 + j] = -dmin * static_cast<float>((s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4));
    }
    return;
  }
  constexpr int64_t bytes = T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : T == Q5_1 ? 24 : 34;
  for (int j = 0; j < 8; ++j) {
    if (j < nj) {
      const uint8_t* blk = row + (g * 8 + j) * bytes;
      ws[j] = half_to_float(blk);
      wm[j] = (T == Q4_1 || T == Q5_1) ? half_to_float(blk + 2) : 0.0f;
    } else {
      ws[j] = 0.0f, wm[j] = 0.0f;
    }
  }
}

constexpr bool k_quant(int64_t t) { return t == Q4_K || t == Q5_K || t == Q6_K; }  // 256-value blocks
constexpr bool has_min(int64_t t) { return t == Q4_1 || t == Q5_1 || t == Q4_K || t == Q5_K; }
constexpr int offset_shift(int64_t t) {  // log2 of the offset subtracted from the levels, -1 for none
  return t == Q4_0 ? 3 : t == Q5_0 ? 4 : t == Q6_K ? 5 : -1;
}

// Where the panels' block dots start (tile_rows' arrays): minus the rows' sums times the offset type T's levels
// carry (Q8_0's 128: made unsigned; Q6_K's over its first 16 features, tile_second5 the second 16's), none
// where the type has a minimum instead.
template <int64_t T>
inline const int32_t* tile_start(const Acts& a) {
  constexpr int sh = offset_shift(T);
  return T == Q6_K ? a.tile_first5.data() : sh == 3 ? a.tile_sums3.data() : sh == 4 ? a.tile_sums4.data() :
         T == Q8_0 ? a.tile_sums7.data() : nullptr;
}

// ---------------------------------------------------------------------------------------------------------
// The generic path: plain C++, one (row, column) at a time, the same operations as the vector paths.

template <int64_t T>
void generic_levels(const uint8_t* row, int64_t g, int j, int32_t* lv) {  // 32 signed levels (minus offset)
  const int64_t b = g * 8 + j;
  if (T == Q4_0 || T == Q4_1 || T == Q5_0 || T == Q5_1) {
    const int64_t bytes = T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : 24;
    const uint8_t* blk = row + b * bytes;
    const uint8_t* qs = blk + (T == Q4_0 ? 2 : T == Q4_1 ? 4 : T == Q5_0 ? 6 : 8);
    uint32_t qh = 0;
    if (T == Q5_0 || T == Q5_1) std::memcpy(&qh, blk + (T == Q5_0 ? 2 : 4), 4);
    for (int i = 0; i < 32; ++i) {
      int v = i < 16 ? (qs[i] & 0xF) : (qs[i - 16] >> 4);
      if (T == Q5_0 || T == Q5_1) v |= ((qh >> i) & 1) << 4;
      lv[i] = v - (T == Q4_0 ? 8 : T == Q5_0 ? 16 : 0);
    }
  } else if (T == Q8_0) {
    const uint8_t* blk = row + b * 34;
    for (int i = 0; i < 32; ++i) lv[i] = static_cast<int8_t>(blk[2 + i]);
  } else if (T == Q4_K || T == Q5_K) {
    const uint8_t* sb = row + g * (T == Q4_K ? 144 : 176);
    const uint8_t* qs = sb + (T == Q4_K ? 16 : 48) + 32 * (j / 2);
    for (int i = 0; i < 32; ++i) {
      int v = (j & 1) ? (qs[i] >> 4) : (qs[i] & 0xF);
      if (T == Q5_K) v |= ((sb[16 + i] >> j) & 1) << 4;
      lv[i] = v;
    }
  } else if (T == Q6_K) {
    const uint8_t* sb = row + g * 210;
    const int half = j / 4, nib = (j >> 1) & 1, part = j & 1;
    const uint8_t* ql = sb + half * 64 + part * 32;
    const uint8_t* qh = sb + 128 + half * 32;
    for (int i = 0; i < 32; ++i)
      lv[i] = (((ql[i] >> (4 * nib)) & 0xF) | (((qh[i] >> (2 * (j & 3))) & 3) << 4)) - 32;
  }
}

// The grouped layout (blocks.h group_blocks): where block j of a whole group keeps its bytes. Q4_0, Q4_1, Q8_0
// (bytes per block 18, 20, 34; the header 2 or 4 bytes, the levels the rest).
// Q4_K, Q6_K: a super-block of 8 blocks is the group, its scales where the file has them (Q4_K's 16 bytes first,
// Q6_K's 18 last).
struct GroupedAt {
  int64_t bytes, head, levels_at, group;  // a block's bytes and header; where a group's levels start; its bytes
  explicit constexpr GroupedAt(int64_t type)
      : bytes(type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q8_0 ? 34 : 0), head(type == Q4_1 ? 4 : 2),
        levels_at(type == Q4_K ? 16 : type == Q6_K ? 0 : 8 * head), group(type == Q4_K ? 144 : type == Q6_K ? 210 : 8 * bytes) {}
};

// One row of nb blocks of 32 values between the file's layout and the grouped one, either way (to_grouped), by
// words: a block's fields and its levels' 4-byte steps each go to their place (Q4_K's nibbles change bytes: a
// file's 32 bytes hold sub-blocks 2c and 2c + 1 in their low and high nibbles, the grouped steps one sub-block's
// features 4t.. and 16 + 4t..).
inline void regroup_row(const uint8_t* from, uint8_t* to, int64_t nb, int64_t type, bool to_grouped) {
  const auto word = [](const uint8_t* p) {
    uint32_t w;
    std::memcpy(&w, p, 4);
    return w;
  };
  const auto put = [](uint8_t* p, uint32_t w) { std::memcpy(p, &w, 4); };
  constexpr uint32_t low = 0x0F0F0F0F, two = 0x03030303;
  if (type == Q6_K) {  // the file: ql's 64-byte half h holds blocks 4h + k (k = 2 nibble + part) in the nibble of its
                       // 32 bytes from 32 part, qh's 32-byte half their 2 high bits at bit 2k. Grouped: the low 4 bits
                       // in the Q4 steps (bytes 0-127), then block j's high 2 bits of features 4t.. (128 + 4j) and
                       // 16 + 4t.. (160 + 4j), step t's at bit 2t; the scales and d as they are
    for (int64_t g = 0; g < nb / 8; ++g) {
      const uint8_t* src = from + 210 * g;
      uint8_t* dst = to + 210 * g;
      std::memcpy(dst + 192, src + 192, 18);
      if (!to_grouped) std::memset(dst, 0, 192);  // the file's bytes are shared by 2 (ql) and 4 (qh) blocks: or'd
      for (int j = 0; j < 8; ++j) {
        const int k = j % 4, ql_at = 64 * (j / 4) + 32 * (k % 2), qh_at = 128 + 32 * (j / 4);
        uint32_t high[2] = {0, 0};
        for (int u = 0; u < 2; ++u) high[u] = to_grouped ? 0 : word(src + 128 + 32 * u + 4 * j);
        for (int t = 0; t < 4; ++t) {
          uint32_t steps = to_grouped ? 0 : word(src + 32 * t + 4 * j);
          for (int u = 0; u < 2; ++u) {  // features 16u + 4t..
            const int file_ql = ql_at + 16 * u + 4 * t, file_qh = qh_at + 16 * u + 4 * t;
            if (to_grouped) {
              steps |= ((word(src + file_ql) >> 4 * (k / 2)) & low) << 4 * u;
              high[u] |= ((word(src + file_qh) >> 2 * k) & two) << 2 * t;
            } else {
              put(dst + file_ql, word(dst + file_ql) | (((steps >> 4 * u) & low) << 4 * (k / 2)));
              put(dst + file_qh, word(dst + file_qh) | (((high[u] >> 2 * t) & two) << 2 * k));
            }
          }
          if (to_grouped) put(dst + 32 * t + 4 * j, steps);
        }
        if (to_grouped)
          for (int u = 0; u < 2; ++u) put(dst + 128 + 32 * u + 4 * j, high[u]);
      }
    }
    return;
  }
  if (type == Q4_K) {
    for (int64_t g = 0; g < nb / 8; ++g) {
      const uint8_t* src = from + 144 * g;
      uint8_t* dst = to + 144 * g;
      std::memcpy(dst, src, 16);  // d, dmin and the scales
      for (int c = 0; c < 4; ++c)
        for (int t = 0; t < 4; ++t) {
          const int file_at = 16 + 32 * c + 4 * t, even = 16 + 32 * t + 8 * c;  // sub-block 2c's step t, 2c + 1 beside it
          if (to_grouped) {
            const uint32_t a = word(src + file_at), b = word(src + file_at + 16);  // features 4t.., 16 + 4t..
            put(dst + even, (a & low) | ((b & low) << 4));
            put(dst + even + 4, ((a >> 4) & low) | (b & ~low));
          } else {
            const uint32_t l = word(src + even), h = word(src + even + 4);
            put(dst + file_at, (l & low) | ((h & low) << 4));
            put(dst + file_at + 16, ((l >> 4) & low) | (h & ~low));
          }
        }
    }
    return;
  }
  const GroupedAt at(type);
  const int64_t levels = at.bytes - at.head;
  for (int64_t first = 0; first < nb; first += 8) {
    const int64_t nj = std::min<int64_t>(8, nb - first);  // a short last group: its levels block by block
    const uint8_t* src = from + first * at.bytes;
    uint8_t* dst = to + first * at.bytes;
    const auto move = [&](int64_t file_at, int64_t grouped_at, int64_t n) {
      if (to_grouped) std::memcpy(dst + grouped_at, src + file_at, n);
      else std::memcpy(dst + file_at, src + grouped_at, n);
    };
    for (int64_t j = 0; j < nj; ++j) {
      for (int64_t f = 0; f < at.head / 2; ++f) move(j * at.bytes + 2 * f, f * 2 * nj + 2 * j, 2);  // d, minimum
      if (nj < 8) move(j * at.bytes + at.head, nj * at.head + j * levels, levels);
      else
        for (int64_t t = 0; t < levels / 4; ++t) move(j * at.bytes + at.head + 4 * t, at.levels_at + 32 * t + 4 * j, 4);
    }
  }
}

inline float lane_sum(const float* a) {
  const float b0 = a[0] + a[4], b1 = a[1] + a[5], b2 = a[2] + a[6], b3 = a[3] + a[7];
  return (b0 + b2) + (b1 + b3);
}

template <int64_t T>
void generic_quant(const Job& jb, int64_t c0, int64_t c1) {
  const Acts& a = *jb.a;
  const int64_t ng = (jb.nb + 7) / 8;
  std::vector<uint8_t> file_row(jb.grouped ? jb.row_bytes : 0);
  for (int64_t c = c0; c < c1; ++c) {
    const uint8_t* row = jb.w + c * jb.row_bytes;
    if (jb.grouped) {  // the same values from the file's layout
      regroup_row(row, file_row.data(), jb.nb, T, false);
      row = file_row.data();
    }
    for (int64_t r = 0; r < a.rows; ++r) {
      const int8_t* q = a.q.data() + r * a.k;
      const float* d = a.d.data() + r * a.nbp;
      const float* ds = a.ds.data() + r * a.nbp;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t g = 0; g < ng; ++g) {
        const int nj = static_cast<int>(std::min<int64_t>(8, jb.nb - g * 8));
        float ws[8], wm[8], wsc[16];
        decode_meta<T>(row, g, nj, ws, wm, wsc);
        for (int j = 0; j < 8; ++j) {
          const int64_t b = g * 8 + j;
          int32_t dots[2] = {0, 0};  // features 0-15, 16-31
          if (j < nj) {
            int32_t lv[32];
            generic_levels<T>(row, g, j, lv);
            for (int i = 0; i < 32; ++i) dots[i / 16] += lv[i] * q[b * QK + i];
          }
          if (T == Q6_K) {
            acc[j] = std::fma(static_cast<float>(dots[0]), wsc[2 * j] * d[b], acc[j]);
            acc[j] = std::fma(static_cast<float>(dots[1]), wsc[2 * j + 1] * d[b], acc[j]);
          } else {
            acc[j] = std::fma(static_cast<float>(dots[0] + dots[1]), ws[j] * d[b], acc[j]);
          }
          if (has_min(T)) acc[j] = std::fma(wm[j], ds[b], acc[j]);
        }
      }
      jb.out[r * jb.n_total + jb.col_offset + c] = lane_sum(acc);
    }
  }
}

template <int64_t T>
void generic_float(const Job& jb, int64_t c0, int64_t c1) {
  const int64_t rows = jb.a->rows;
  for (int64_t c = c0; c < c1; ++c) {
    const uint8_t* row = jb.w + c * jb.row_bytes;
    for (int64_t r = 0; r < rows; ++r) {
      const float* x = jb.xf + r * jb.k;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t k = 0; k < jb.k; ++k) {
        float w;
        if (T == F32) std::memcpy(&w, row + 4 * k, 4);
        else if (T == F16) w = half_to_float(row + 2 * k);
        else w = bf16_to_float(row + 2 * k);
        acc[k % 8] = std::fma(w, x[k], acc[k % 8]);
      }
      jb.out[r * jb.n_total + jb.col_offset + c] = lane_sum(acc);
    }
  }
}

void generic_run(const Job& jb, int64_t c0, int64_t c1) {
  switch (jb.type) {
    case Q4_0: return generic_quant<Q4_0>(jb, c0, c1);
    case Q4_1: return generic_quant<Q4_1>(jb, c0, c1);
    case Q5_0: return generic_quant<Q5_0>(jb, c0, c1);
    case Q5_1: return generic_quant<Q5_1>(jb, c0, c1);
    case Q8_0: return generic_quant<Q8_0>(jb, c0, c1);
    case Q4_K: return generic_quant<Q4_K>(jb, c0, c1);
    case Q5_K: return generic_quant<Q5_K>(jb, c0, c1);
    case Q6_K: return generic_quant<Q6_K>(jb, c0, c1);
    case F32: return generic_float<F32>(jb, c0, c1);
    case F16: return generic_float<F16>(jb, c0, c1);
    case BF16: return generic_float<BF16>(jb, c0, c1);
  }
}

}  // namespace blocks_detail
}  // namespace tornchat

// ---------------------------------------------------------------------------------------------------------
// The x86 paths: the second half of this file, once per instruction set.
#ifdef TORNCHAT_X86
#define TORNCHAT_BLOCKS_PASS 1

#define PASS_NS avx2_path
#define PASS_VNNI 0
#define PASS_RMAX 8
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
#include "blocks.cpp"  // this file again (its directory is searched first), under the target above
#pragma GCC pop_options
#undef PASS_NS
#undef PASS_VNNI
#undef PASS_RMAX

#define PASS_NS avxvnni_path
#define PASS_VNNI 1
#define PASS_RMAX 8
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2,avxvnni")
#include "blocks.cpp"  // this file again (its directory is searched first), under the target above
#pragma GCC pop_options
#undef PASS_NS
#undef PASS_VNNI
#undef PASS_RMAX

#define PASS_NS avx512vnni_path
#define PASS_VNNI 2
#define PASS_RMAX 16
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#include "blocks.cpp"  // this file again (its directory is searched first), under the target above
#pragma GCC pop_options
#undef PASS_NS
#undef PASS_VNNI
#undef PASS_RMAX
#endif  // TORNCHAT_X86

// ---------------------------------------------------------------------------------------------------------
// Dispatch, quantization of the activations, Python bindings.
namespace tornchat {

using namespace blocks_detail;

namespace {

enum class Isa { generic, avx2, avxvnni, avx512vnni, amx };

const char* isa_name(Isa i) {
  switch (i) {
    case Isa::amx: return "amx";
    case Isa::avx512vnni: return "avx512vnni";
    case Isa::avxvnni: return "avxvnni";
    case Isa::avx2: return "avx2";
    default: return "generic";
  }
}

std::vector<Isa> detected() {
  std::vector<Isa> out;
#ifdef TORNCHAT_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2");
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vnni"))
  {
#ifdef __linux__
    if (__builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") && avx512vnni_path::amx_enable())
      out.push_back(Isa::amx);
#endif
    out.push_back(Isa::avx512vnni);
  }
  if (avx2 && __builtin_cpu_supports("avxvnni")) out.push_back(Isa::avxvnni);
  if (avx2) out.push_back(Isa::avx2);
#endif
  out.push_back(Isa::generic);
  return out;
}

const std::vector<Isa>& cpu_isas() {
  static const std::vector<Isa> isas = detected();
  return isas;
}

std::string choices() {
  std::string s;
  for (Isa i : cpu_isas()) s += (s.empty() ? "" : ", ") + std::string(isa_name(i));
  return s;
}

Isa parse_isa(const std::string& name, const char* what) {
  for (Isa i : cpu_isas())
    if (name == isa_name(i)) return i;
  TORCH_CHECK(false, what, "='", name, "' is not an instruction-set path this CPU runs; choices: ", choices());
  return Isa::generic;
}

Isa chosen_isa() {
  const char* env = std::getenv("TORNCHAT_ISA");
  if (env != nullptr && *env != '\0') return parse_isa(env, "TORNCHAT_ISA");
  return cpu_isas().front();
}

#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
void quantize_rows(const float* x, int64_t rows, int64_t k, Acts& a, Isa isa) {
  a.rows = rows, a.k = k, a.nb = k / QK, a.nbp = (a.nb + 7) / 8 * 8;
  a.q.resize(rows * k);
  a.qt.assign(rows * a.nbp * QK, 0);
  a.d.assign(rows * a.nbp, 0.0f);
  a.ds.assign(rows * a.nbp, 0.0f);
  a.neg_sums.assign(rows * a.nbp, 0);
  a.neg_first.assign(rows * a.nbp, 0);
  a.neg_second.assign(rows * a.nbp, 0);
  if (short_tail_of(a.nb)) a.tail.resize(rows * 256);  // the x86 paths' quantize_row_by fills it
  team::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
#ifdef TORNCHAT_X86
      if (isa == Isa::avx512vnni || isa == Isa::amx) {
        avx512vnni_path::quantize_row(x + r * k, r, a);
        continue;
      }
      if (isa == Isa::avx2 || isa == Isa::avxvnni) {
        avx2_path::quantize_row(x + r * k, r, a);
        continue;
      }
#endif
      for (int64_t b = 0; b < a.nb; ++b) {
        const float* xb = x + r * k + b * QK;
        float largest = 0.0f;
        for (int i = 0; i < QK; ++i) largest = std::max(largest, std::fabs(xb[i]));
        const float inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
        int8_t* q = a.q.data() + r * k + b * QK;
        int32_t sums[2] = {0, 0};
        for (int i = 0; i < QK; ++i) {
          // round to nearest, ties to even (as nearbyint in the default rounding mode, without its call):
          // exact for |v| < 2^22, and |x * inverse| <= 127 (NaN stays NaN and is clamped as before)
          const float scaled = xb[i] * inverse;  // rounded to fp32 (no contraction: see the attribute)
          float v = (scaled + 12582912.0f) - 12582912.0f;
          v = std::min(127.0f, std::max(-127.0f, v));
          q[i] = static_cast<int8_t>(v);
          sums[i / 16] += q[i];
        }
        int8_t* qt = a.qt.data() + r * a.nbp * QK + (b / 8) * 256 + (b % 8) * 4;
        for (int t = 0; t < 8; ++t) std::memcpy(qt + 32 * t, q + 4 * t, 4);
        const float d = largest / 127.0f;
        const int64_t at = r * a.nbp + b;
        a.d[at] = d;
        a.ds[at] = d * static_cast<float>(sums[0] + sums[1]);
        a.neg_sums[at] = -(sums[0] + sums[1]);
        a.neg_first[at] = -sums[0];
        a.neg_second[at] = -sums[1];
      }
    }
  });
}

}  // namespace

std::vector<std::string> block_isas() {
  std::vector<std::string> out;
  for (Isa i : cpu_isas()) out.push_back(isa_name(i));
  return out;
}

std::string block_isa() { return isa_name(chosen_isa()); }

BlockMatrix block_matrix(const std::vector<at::Tensor>& parts, const std::vector<int64_t>& types, const std::string& isa) {
  TORCH_CHECK(parts.size() == types.size(), "block_mm: one type per part");
  BlockMatrix w;
  w.isa = static_cast<int>(isa.empty() ? chosen_isa() : parse_isa(isa, "isa"));
  for (size_t i = 0; i < parts.size(); ++i) {
    TypeInfo info;
    TORCH_CHECK(type_info(types[i], info), "block_mm: unsupported GGML type id ", types[i]);
    const auto& p = parts[i];
    TORCH_CHECK(p.device().is_cpu() && p.scalar_type() == at::kByte && p.dim() == 2 && p.is_contiguous(),
                "block_mm: each part must be a contiguous CPU uint8 tensor [N_i, row_bytes]");
    TORCH_CHECK(p.size(1) % info.bytes == 0, "block_mm: part ", i, "'s rows of ", p.size(1),
                " bytes are not whole blocks of type ", types[i]);
    const int64_t k = p.size(1) / info.bytes * info.values;
    TORCH_CHECK(i == 0 || k == w.k, "block_mm: part ", i, "'s rows hold ", k, " values, part 0's ", w.k);
    TORCH_CHECK(types[i] < PANELED || (static_cast<Isa>(w.isa) == Isa::avx512vnni && p.size(0) % 16 == 0),
                "block_mm: the panel layout (part ", i, ") is read by the avx512vnni path, in rows of 16");
    w.k = k, w.n += p.size(0);
    w.any_quant = w.any_quant || !is_float(types[i]);
    w.parts.push_back(BlockPart{p.data_ptr<uint8_t>(), p.size(0), p.size(1), types[i]});
  }
  return w;
}

at::Tensor block_mm(const at::Tensor& x, const std::vector<at::Tensor>& parts, const std::vector<int64_t>& types,
                    const std::string& isa, at::Tensor out) {
  return block_mm(x, block_matrix(parts, types, isa), std::move(out));
}

at::Tensor block_mm(const at::Tensor& x, const BlockMatrix& w, at::Tensor out) {
  const Isa isa = static_cast<Isa>(w.isa);
  TORCH_CHECK(!w.parts.empty(), "block_mm: at least one part");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "block_mm: x must be a CPU tensor [rows, K]");
  const int64_t k = x.size(1), rows = x.size(0), n_total = w.n;
  TORCH_CHECK(k == w.k, "block_mm: x has K = ", k, " features; the parts' rows (", w.parts[0].row_bytes,
              " bytes of type ", w.parts[0].type, ") hold ", w.k);
  TORCH_CHECK(k % QK == 0, "block_mm: K must be a multiple of 32");
  const bool any_quant = w.any_quant;
  // x as it is where it is fp32 already (a step's rows): a no-op to() still costs a dispatch, and a decode step
  // of the 135M makes 120 of these calls
  const auto xf = x.scalar_type() == at::kFloat && x.is_contiguous() ? x : x.to(at::kFloat).contiguous();
  if (out.defined()) {
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.device().is_cpu() && out.is_contiguous(),
                "block_mm: out must be a contiguous fp32 CPU tensor");
    if (out.dim() != 2 || out.size(0) != rows || out.size(1) != n_total) out.resize_({rows, n_total});  // a dispatch
  } else {
    out = at::empty({rows, n_total}, xf.options());
  }
  if (rows == 0 || n_total == 0) return out;
  thread_local Acts acts;  // the calling thread's buffers, kept from call to call
  // the amx path, and avx512vnni from PANEL_ROWS rows, unpack the columns into panels once for every 16 rows
  const bool panels = any_quant && ((isa == Isa::amx && rows >= 16) || (isa == Isa::avx512vnni && rows >= PANEL_ROWS));
  if (any_quant) quantize_rows(xf.data_ptr<float>(), rows, k, acts, isa);
  if (panels) tile_rows(acts);
  acts.rows = rows, acts.k = k;

  // Chunks of columns, each within one part, that the threads share: wider where columns are unpacked into
  // panels, as long as a chunk's panels (a byte of level and a quarter byte of scales a weight) stay within
  // 512 KiB, half a small L2 cache, since every 16 rows read them again: 128 columns of Qwen3 4B's down
  // projection (K = 9728) came from L3 (512 rows, 2026-11-27, Zen 5: 739-750 GOPS at 128 columns, 853-934 at 32).
  int64_t CHUNK = 32;
  if (panels)
    for (CHUNK = 128; CHUNK > 32 && CHUNK * k * 5 / 4 > (512 << 10);) CHUNK /= 2;
  std::vector<Job> jobs;
  std::vector<std::pair<int64_t, int64_t>> chunks;  // (job, first column)
  jobs.reserve(w.parts.size());
  chunks.reserve((n_total + CHUNK - 1) / CHUNK + w.parts.size());
  int64_t offset = 0;
  for (const BlockPart& part : w.parts) {
    const bool paneled = part.type > PANELED, grouped = !paneled && part.type > GROUPED;
    jobs.push_back(Job{paneled ? part.type - PANELED : grouped ? part.type - GROUPED : part.type, k, k / QK,
                       part.row_bytes, n_total, offset, part.data, &acts, xf.data_ptr<float>(), out.data_ptr<float>(),
                       isa == Isa::amx, grouped, paneled});
    for (int64_t c = 0; c < part.rows; c += CHUNK) chunks.emplace_back(jobs.size() - 1, c);
    offset += part.rows;
  }
  team::share(static_cast<int64_t>(chunks.size()), [&](int64_t i) {
    const Job& jb = jobs[chunks[i].first];
    const int64_t c0 = chunks[i].second;
    const int64_t c1 = std::min(c0 + CHUNK, w.parts[chunks[i].first].rows);
    switch (isa) {
#ifdef TORNCHAT_X86
      case Isa::amx:
      case Isa::avx512vnni: avx512vnni_path::run(jb, c0, c1); break;
      case Isa::avxvnni: avxvnni_path::run(jb, c0, c1); break;
      case Isa::avx2: avx2_path::run(jb, c0, c1); break;
#endif
      default: generic_run(jb, c0, c1);
    }
  });
  return out;
}

namespace {

int64_t grouped_blocks(const at::Tensor& part, int64_t type) {
  TORCH_CHECK(type == Q4_0 || type == Q4_1 || type == Q8_0 || type == Q4_K || type == Q6_K,
              "the grouped layouts are Q4_0's, Q4_1's, Q8_0's, Q4_K's and Q6_K's, not type ", type, "'s");
  TypeInfo info;
  type_info(type, info);
  TORCH_CHECK(part.device().is_cpu() && part.scalar_type() == at::kByte && part.dim() == 2 && part.is_contiguous() &&
                  part.size(1) % info.bytes == 0,
              "a part must be a contiguous CPU uint8 tensor [N, row_bytes] of whole blocks");
  return part.size(1) / info.bytes * info.values / QK;  // blocks of 32 values
}

}  // namespace

void group_blocks(at::Tensor part, int64_t type) {
  const int64_t nb = grouped_blocks(part, type), row_bytes = part.size(1);
  uint8_t* data = part.data_ptr<uint8_t>();
  at::parallel_for(0, part.size(0), 64, [&](int64_t r0, int64_t r1) {
    std::vector<uint8_t> row(row_bytes);
    for (int64_t r = r0; r < r1; ++r) {
      std::memcpy(row.data(), data + r * row_bytes, row_bytes);
      regroup_row(row.data(), data + r * row_bytes, nb, type, true);
    }
  });
}

at::Tensor ungroup_blocks(const at::Tensor& part, int64_t type) {
  const int64_t nb = grouped_blocks(part, type), row_bytes = part.size(1);
  auto out = at::empty_like(part);
  const uint8_t* from = part.data_ptr<uint8_t>();
  uint8_t* to = out.data_ptr<uint8_t>();
  at::parallel_for(0, part.size(0), 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) regroup_row(from + r * row_bytes, to + r * row_bytes, nb, type, false);
  });
  return out;
}

namespace {

// 16 rows of Q4_0, Q4_1 or Q8_0 (from, 16 * row_bytes) into their slab of the panel layout (to), or back (to_panels
// false): per slot the 16 rows' fp16 d, Q4_1's minimums, then their levels' 4-byte words side by side.
void repanel_rows(const uint8_t* from, uint8_t* to, int64_t nb, int64_t type, bool to_panels) {
  const GroupedAt at(type);
  const int64_t row_bytes = nb * at.bytes, slot_bytes = 16 * at.bytes, words = (at.bytes - at.head) / 4;
  int64_t slot = 0;
  for (int64_t j = 0; j < 8; ++j)
    for (int64_t b = j; b < nb; b += 8, ++slot)
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t file = i * row_bytes + b * at.bytes, panel = slot * slot_bytes;
        const auto move = [&](int64_t file_at, int64_t panel_at, int64_t n) {
          if (to_panels) std::memcpy(to + panel + panel_at, from + file + file_at, n);
          else std::memcpy(to + file + file_at, from + panel + panel_at, n);
        };
        for (int64_t f = 0; f < at.head / 2; ++f) move(2 * f, 32 * f + 2 * i, 2);  // d, the minimum
        for (int64_t q = 0; q < words; ++q) move(at.head + 4 * q, 16 * at.head + 64 * q + 4 * i, 4);
      }
}

int64_t paneled_blocks(const at::Tensor& part, int64_t type) {
  TORCH_CHECK(type == Q4_0 || type == Q4_1 || type == Q8_0, "the panel layout is Q4_0's, Q4_1's and Q8_0's, not type ",
              type, "'s");
  const int64_t bytes = GroupedAt(type).bytes;
  TORCH_CHECK(part.device().is_cpu() && part.scalar_type() == at::kByte && part.dim() == 2 && part.is_contiguous() &&
                  part.size(1) % bytes == 0 && part.size(0) % 16 == 0,
              "a part must be a contiguous CPU uint8 tensor [N, row_bytes] of whole blocks, N a multiple of 16");
  return part.size(1) / bytes;
}

}  // namespace

void panel_blocks(at::Tensor part, int64_t type) {
  const int64_t nb = paneled_blocks(part, type), slab = 16 * part.size(1);
  uint8_t* data = part.data_ptr<uint8_t>();
  at::parallel_for(0, part.size(0) / 16, 4, [&](int64_t s0, int64_t s1) {
    std::vector<uint8_t> rows(slab);
    for (int64_t s = s0; s < s1; ++s) {
      std::memcpy(rows.data(), data + s * slab, slab);
      repanel_rows(rows.data(), data + s * slab, nb, type, true);
    }
  });
}

at::Tensor unpanel_blocks(const at::Tensor& part, int64_t type) {
  const int64_t nb = paneled_blocks(part, type), slab = 16 * part.size(1);
  auto out = at::empty_like(part);
  const uint8_t* from = part.data_ptr<uint8_t>();
  uint8_t* to = out.data_ptr<uint8_t>();
  at::parallel_for(0, part.size(0) / 16, 4, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) repanel_rows(from + s * slab, to + s * slab, nb, type, false);
  });
  return out;
}

void define_blocks(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("block_isas", &block_isas, "the instruction-set paths of the block kernels this CPU runs, best first");
  m.def("block_isa", &block_isa, "the path block_mm takes by default (TORNCHAT_ISA's where set)");
  m.def("block_mm",
        [](const at::Tensor& x, const std::vector<at::Tensor>& parts, const std::vector<int64_t>& types,
           const std::string& isa) { return block_mm(x, parts, types, isa); },
        "x [rows, K] times GGUF-block weights' parts transposed: fp32 [rows, N]",
        py::arg("x"), py::arg("parts"), py::arg("types"), py::arg("isa") = "",
        py::call_guard<py::gil_scoped_release>());
  m.def("group_blocks", &group_blocks, "a Q4_0, Q4_1, Q8_0, Q4_K or Q6_K part's rows rearranged in place into the grouped layout",
        py::arg("part"), py::arg("type"));
  m.def("ungroup_blocks", &ungroup_blocks, "a grouped part's bytes as the file stores them (type: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)",
        py::arg("part"), py::arg("type"));
  m.def("panel_blocks", &panel_blocks, "a Q4_0, Q4_1 or Q8_0 part's rows rearranged in place into the panel layout",
        py::arg("part"), py::arg("type"));
  m.def("unpanel_blocks", &unpanel_blocks, "a paneled part's bytes as the file stores them (type: Q4_0, Q4_1, Q8_0)",
        py::arg("part"), py::arg("type"));
}

}  // namespace tornchat

#else  // TORNCHAT_BLOCKS_PASS: one x86 path, compiled under its own target

namespace tornchat {
namespace blocks_detail {
namespace PASS_NS {

#ifndef TORNCHAT_PREFETCH
#define TORNCHAT_PREFETCH 32768
#endif
// Bytes the float tiles prefetch ahead in each column's own stream. 32768 against 8192 (2026-11-27, AMD Zen 5,
// bench/blocks.py, when the quantized tiles took it too): long rows' products (Qwen3 4B's down, K = 9728)
// 1.3-1.9x faster, the others the same.
constexpr int PREFETCH = TORNCHAT_PREFETCH;

inline __attribute__((always_inline)) __m256i nibbles32(__m128i t) {  // 16 bytes -> 32 levels
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
}

inline __attribute__((always_inline)) __m256i nibbles32(const uint8_t* p) {
  return nibbles32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __attribute__((always_inline)) __m256i bits32(const uint8_t* p) {  // 32 bits -> 32 bytes of 0x10 or 0
  uint32_t x32;
  std::memcpy(&x32, p, 4);
  const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(x32)), shuffle);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

// Block j of group g of a weight row: 32 unsigned levels (Q8_0: signed, see dot).
template <int64_t T>
inline __attribute__((always_inline)) __m256i levels(const uint8_t* row, int64_t g, int j) {
  const int64_t b = g * 8 + j;
  if (T == Q4_0) return nibbles32(row + b * 18 + 2);
  if (T == Q4_1) return nibbles32(row + b * 20 + 4);
  if (T == Q5_0) return _mm256_or_si256(nibbles32(row + b * 22 + 6), bits32(row + b * 22 + 2));
  if (T == Q5_1) return _mm256_or_si256(nibbles32(row + b * 24 + 8), bits32(row + b * 24 + 4));
  if (T == Q8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * 34 + 2));
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if (T == Q4_K || T == Q5_K) {
    const uint8_t* sb = row + g * (T == Q4_K ? 144 : 176);
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + (T == Q4_K ? 16 : 48) + 32 * (j / 2)));
    __m256i v = _mm256_and_si256((j & 1) ? _mm256_srli_epi16(qs, 4) : qs, low4);
    if (T == Q5_K) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16));
      const __m256i h = j <= 4 ? _mm256_slli_epi16(qh, 4 - j) : _mm256_srli_epi16(qh, j - 4);
      v = _mm256_or_si256(v, _mm256_and_si256(h, _mm256_set1_epi8(0x10)));
    }
    return v;
  }
  // Q6_K
  const uint8_t* sb = row + g * 210;
  const int half = j / 4, nib = (j >> 1) & 1, part = j & 1, shift = 2 * (j & 3);
  const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + half * 64 + part * 32));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 128 + half * 32));
  const __m256i lo = _mm256_and_si256(nib ? _mm256_srli_epi16(ql, 4) : ql, low4);
  const __m256i hi = shift <= 4 ? _mm256_slli_epi16(qh, 4 - shift) : _mm256_srli_epi16(qh, shift - 4);
  return _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
}

// init + the dots of N steps of levels v (4 features of 8 blocks or 8 columns a step, see Acts::qt and
// avx2_columns) against the activations x(t) of each step. On AVX2, VPMADDUBSW's int16 pair sums of S steps are
// added in int16 before one VPMADDWD: exact while S * 2 * L * 127 <= 32767 for levels up to L (Q4 types 15: 8
// steps, Q5 31: 4, Q6_K 63: 2), so fewer multiplies for the same integers (the 1B's 8-row Q4_K products 1.17x,
// AMD Zen 3). Q8_0 (|levels| up to 128) takes one step each.
template <int64_t T>
constexpr int int16_steps() {
  return T == Q4_0 || T == Q4_1 || T == Q4_K ? 8 : T == Q5_0 || T == Q5_1 || T == Q5_K ? 4 : T == Q6_K ? 2 : 1;
}

template <int64_t T, int N, class Step>
inline __attribute__((always_inline)) __m256i dots(__m256i init, const __m256i* v, Step x) {
#if PASS_VNNI == 0
  constexpr int S = std::min(N, int16_steps<T>());
  for (int t = 0; t < N; t += S) {
    __m256i pairs = _mm256_maddubs_epi16(v[t], x(t));
    for (int s = 1; s < S; ++s) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(v[t + s], x(t + s)));
    init = _mm256_add_epi32(init, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
#elif PASS_VNNI == 1
  for (int t = 0; t < N; ++t) init = _mm256_dpbusd_avx_epi32(init, v[t], x(t));
#else
  for (int t = 0; t < N; ++t) init = _mm256_dpbusd_epi32(init, v[t], x(t));
#endif
  return init;
}

inline __attribute__((always_inline)) float lanes8(__m256 a) {
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));  // l0+l4, l1+l5, ...
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));  // (l0+l4)+(l2+l6), (l1+l5)+(l3+l7)
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

// The same sum of 8 lanes where each lane is a vector of columns (the panels' kernels): lane(j) gives lane j,
// add adds two.
template <class Lane, class Add>
inline __attribute__((always_inline)) auto lane_sum(Lane lane, Add add) {
  return add(add(add(lane(0), lane(4)), add(lane(2), lane(6))), add(add(lane(1), lane(5)), add(lane(3), lane(7))));
}

// Group g's scales a (ws) and minimums m (wm) of a weight row, lanes past nj zero; Q6_K: its 16 sub-block
// scales (lo: the first 16 features' of each block, hi: the second 16's). The same values decode_meta gives.
inline __attribute__((always_inline)) __m256 halves(__m256i v) {  // the low 16 bits of each lane -> 8 fp32
  const __m256i packed = _mm256_packus_epi32(v, v);  // per 128 bits: l0-3 l0-3 | l4-7 l4-7
  return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
}

#if PASS_VNNI == 2
// A group of Q4_0 or Q4_1 blocks (b = 18 or 20 bytes: a 2- or 4-byte header, then 16 bytes of nibbles) by word
// permutes of four 64-byte loads, where meta's gather and the 16-byte loads per block cost the one- and
// few-row tiles more than their dot products: head, the 8 blocks' d (words 0-7) and minimums (words 8-15); qs[0],
// qs[1], blocks 0-3's and 4-7's nibbles, a block per 128 bits. Blocks 0-3 lie in the group's first 128 bytes,
// 4-7 in the 64 bytes from byte 4b and the group's last 64. Bytes past the row's blocks are not read: zeros.
template <int64_t T>
struct Q4Layout {
  static constexpr int b = T == Q4_0 ? 18 : 20, h = b - 16, last = 8 * b - 64;  // block, header; last 64 from
  int16_t head[32], lo[32], hi[32];  // word indices of the permutes
  constexpr Q4Layout() : head(), lo(), hi() {
    for (int j = 0; j < 4; ++j) {
      head[j] = static_cast<int16_t>(j * b / 2), head[4 + j] = static_cast<int16_t>(32 + j * b / 2);
      head[8 + j] = static_cast<int16_t>(head[j] + 1), head[12 + j] = static_cast<int16_t>(head[4 + j] + 1);
      for (int i = 0; i < 8; ++i) {
        const int at = j * b + h + 2 * i;  // word i of block j's (or j + 4's) nibbles, from byte 0 (or 4b)
        lo[8 * j + i] = static_cast<int16_t>(at < 64 ? at / 2 : 32 + (at - 64) / 2);
        hi[8 * j + i] = static_cast<int16_t>(at < 64 ? at / 2 : 32 + (at + 4 * b - last) / 2);
      }
    }
  }
};

template <int64_t T>
inline __attribute__((always_inline)) void q4_group(const uint8_t* row, int64_t g, int nj, __m512i& head, __m512i* qs) {
  using L = Q4Layout<T>;
  static constexpr L layout{};
  const uint8_t* base = row + g * 8 * L::b;
  const auto load = [&](int at) {
    const int n = std::max(0, std::min(64, nj * L::b - at));
    return n == 64 ? _mm512_loadu_si512(base + at) : _mm512_maskz_loadu_epi8((1ULL << n) - 1, base + at);
  };
  const __m512i t0 = load(0), t1 = load(64), t2 = load(4 * L::b), t3 = load(L::last);
  head = _mm512_permutex2var_epi16(t0, _mm512_loadu_si512(layout.head), t2);
  qs[0] = _mm512_permutex2var_epi16(t0, _mm512_loadu_si512(layout.lo), t1);
  qs[1] = _mm512_permutex2var_epi16(t2, _mm512_loadu_si512(layout.hi), t3);
}
#endif

// The 32-bit blocks' scales from their first 4 bytes, a block per lane: d in the low half, the minimum (Q4_1,
// Q5_1) in the high half.
template <int64_t T>
inline __attribute__((always_inline)) void word_scales(__m256i words, __m256& ws, __m256& wm) {
  ws = halves(_mm256_and_si256(words, _mm256_set1_epi32(0xFFFF)));
  wm = T == Q4_1 || T == Q5_1 ? halves(_mm256_srli_epi32(words, 16)) : _mm256_setzero_ps();
}

// GATHER: the 32-bit blocks' d (and minimums) by one gather, else by 8 loads, which a lone row's kernel
// (quant_group_row) runs faster on an AMD Zen 5 (Q5_0 1.2x, Q8_0 1.15x a product) and the few-row tiles
// slower (Q5_1 at 4 rows 1.25x, on AVX2 1.1x). A short group (nj < 8) loads its blocks' words: a masked gather
// cost the tails more than their dots (AMD Zen 3).
template <int64_t T, bool GATHER = true>
inline __attribute__((always_inline)) void meta(const uint8_t* row, int64_t g, int nj, __m256& ws, __m256& wm,
                                                __m256& lo, __m256& hi) {
  ws = wm = lo = hi = _mm256_setzero_ps();
  if constexpr (T == Q6_K) {
    const uint8_t* sb = row + g * 210;
    uint16_t h;
    std::memcpy(&h, sb + 208, 2);
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(h));
    const __m128i sc = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 192)),
                                        _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));  // sub-blocks 0, 2, ..., 14
    hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));  // 1, 3, ..., 15
  } else if constexpr (T == Q4_K || T == Q5_K) {
    // the super-block's head as dwords [d and dmin, u0, u1, u2]; the 6-bit scales sc and minimums mn unpacked
    // in one vector, as meta2 does for two rows: [u0 & 63, (u2 & 15) | (u0 >> 6) << 4, u1 & 63,
    // (u2 >> 4 & 15) | (u1 >> 6) << 4] bytewise, sc then mn
    const __m128i head = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * (T == Q4_K ? 144 : 176)));
    const __m128i low = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(head, 0xED), _mm_setr_epi32(0, 0, 0, 4)),
                                      _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    const __m128i high = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(head, 0xA5), 2),
                                       _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    const __m128i sm = _mm_or_si128(low, high);
    const __m128 dd = _mm_cvtph_ps(head);  // d, dmin
    ws = _mm256_mul_ps(_mm256_broadcastss_ps(dd), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)));
    wm = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_xor_ps(_mm_movehdup_ps(dd), _mm_set1_ps(-0.0f))),
                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))));
  } else {
    constexpr int bytes = T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : T == Q5_1 ? 24 : 34;
    const __m256i at = _mm256_setr_epi32(0, bytes, 2 * bytes, 3 * bytes, 4 * bytes, 5 * bytes, 6 * bytes, 7 * bytes);
    const int* base = reinterpret_cast<const int*>(row + g * 8 * bytes);
    __m256i words;  // per block: d in the low half, the minimum (Q4_1, Q5_1) in the high half
    if (nj == 8 && GATHER) {
      words = _mm256_i32gather_epi32(base, at, 1);
    } else {
      const auto word = [&](int j) {
        int32_t v = 0;
        if (j < nj) std::memcpy(&v, row + (g * 8 + j) * bytes, 4);
        return v;
      };
      words = _mm256_setr_epi32(word(0), word(1), word(2), word(3), word(4), word(5), word(6), word(7));
    }
    word_scales<T>(words, ws, wm);
  }
}

// 8 vectors of 8 int32 lanes -> lane i of vector t is lane t of vector i.
inline __attribute__((always_inline)) void transpose8(__m256i* v) {
  const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
  const __m256i t4 = _mm256_unpacklo_epi32(v[4], v[5]), t5 = _mm256_unpackhi_epi32(v[4], v[5]);
  const __m256i t6 = _mm256_unpacklo_epi32(v[6], v[7]), t7 = _mm256_unpackhi_epi32(v[6], v[7]);
  const __m256i s0 = _mm256_unpacklo_epi64(t0, t2), s1 = _mm256_unpackhi_epi64(t0, t2);
  const __m256i s2 = _mm256_unpacklo_epi64(t1, t3), s3 = _mm256_unpackhi_epi64(t1, t3);
  const __m256i s4 = _mm256_unpacklo_epi64(t4, t6), s5 = _mm256_unpackhi_epi64(t4, t6);
  const __m256i s6 = _mm256_unpacklo_epi64(t5, t7), s7 = _mm256_unpackhi_epi64(t5, t7);
  v[0] = _mm256_permute2x128_si256(s0, s4, 0x20), v[4] = _mm256_permute2x128_si256(s0, s4, 0x31);
  v[1] = _mm256_permute2x128_si256(s1, s5, 0x20), v[5] = _mm256_permute2x128_si256(s1, s5, 0x31);
  v[2] = _mm256_permute2x128_si256(s2, s6, 0x20), v[6] = _mm256_permute2x128_si256(s2, s6, 0x31);
  v[3] = _mm256_permute2x128_si256(s3, s7, 0x20), v[7] = _mm256_permute2x128_si256(s3, s7, 0x31);
}

// Row r of the activations into a (its padding already zero), as quantize_rows quantizes it: block(x, largest,
// sums) quantizes one block's 32 values in vectors (the largest |x| with NaNs passed over, the product rounded to
// nearest even, then clamped with a NaN going to -127) and returns its q; its scale and exact integer sums are
// stored here, and each group's 8 blocks of q transposed once into Acts::qt's layout. A row's scalar loop cost the
// few-row products more than their dots (AVX-512), and 4.7% of a 1B's cold prefill on AVX2 (AMD Zen 3).
template <class Block>
inline void quantize_row_by(const float* x, int64_t r, Acts& a, Block block) {
  int8_t* q = a.q.data() + r * a.k;
  for (int64_t g = 0; g * 8 < a.nb; ++g) {
    __m256i v[8];
    for (int j = 0; j < 8; ++j) {
      const int64_t b = g * 8 + j, at = r * a.nbp + b;
      if (b >= a.nb) {
        v[j] = _mm256_setzero_si256();
        continue;
      }
      float largest;
      int32_t sums[2];
      v[j] = block(x + b * QK, largest, sums);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * QK), v[j]);
      const float d = largest / 127.0f;
      a.d[at] = d;
      a.ds[at] = d * static_cast<float>(sums[0] + sums[1]);
      a.neg_sums[at] = -(sums[0] + sums[1]);
      a.neg_first[at] = -sums[0];
      a.neg_second[at] = -sums[1];
    }
    transpose8(v);
    for (int t = 0; t < 8; ++t)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.qt.data() + (r * a.nbp + g * 8) * QK + 32 * t), v[t]);
    if (g == a.nb / 8 && short_tail_of(a.nb))  // the short group short_tail takes: its steps there too
      for (int t = 0; t < 8; ++t)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.tail.data() + r * 256 + 32 * t),
                            _mm256_permutevar8x32_epi32(v[t], _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)));
  }
}

#if PASS_VNNI == 2
inline void quantize_row(const float* x, int64_t r, Acts& a) {
  quantize_row_by(x, r, a, [](const float* xb, float& largest, int32_t* sums) {
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    // max(v, acc) keeps acc where v is NaN, as std::max(acc, v)
    largest = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_abs_ps(x1), _mm512_max_ps(_mm512_abs_ps(x0), _mm512_setzero_ps())));
    const __m512 inverse = _mm512_set1_ps(largest > 0.0f ? 127.0f / largest : 0.0f);
    __m128i bytes[2];
    for (int h = 0; h < 2; ++h) {
      const __m512 scaled = _mm512_roundscale_ps(_mm512_mul_ps(h ? x1 : x0, inverse),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i level = _mm512_cvttps_epi32(
          _mm512_min_ps(_mm512_max_ps(scaled, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f)));
      sums[h] = _mm512_reduce_add_epi32(level);
      bytes[h] = _mm512_cvtepi32_epi8(level);
    }
    return _mm256_set_m128i(bytes[1], bytes[0]);
  });
}
#elif PASS_VNNI == 0
// The same in 256-bit vectors, for the avx2 and avxvnni paths.
inline void quantize_row(const float* x, int64_t r, Acts& a) {
  quantize_row_by(x, r, a, [](const float* xb, float& largest, int32_t* sums) {
    const auto sum8 = [](__m256i v) {  // exact: at most 16 values of |q| <= 127
      const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
      const __m128i f = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
      return _mm_cvtsi128_si32(_mm_add_epi32(f, _mm_shuffle_epi32(f, 0xB1)));
    };
    __m256 xs[4], most = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      xs[i] = _mm256_loadu_ps(xb + 8 * i);
      most = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), xs[i]), most);  // keeps most where |x| is NaN
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    largest = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const __m256 inverse = _mm256_set1_ps(largest > 0.0f ? 127.0f / largest : 0.0f);
    __m256i level[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 scaled = _mm256_round_ps(_mm256_mul_ps(xs[i], inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      level[i] = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(scaled, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f)));
    }
    sums[0] = sum8(_mm256_add_epi32(level[0], level[1])), sums[1] = sum8(_mm256_add_epi32(level[2], level[3]));
    // int32 -> int8 in order: the packs work per 128 bits, a permute puts the 4-byte groups back in order
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(level[0], level[1]), _mm256_packs_epi32(level[2], level[3]));
    return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  });
}
#endif

constexpr int64_t group_bytes(int64_t T) {
  return T == Q4_0 ? 144 : T == Q4_1 ? 160 : T == Q5_0 ? 176 : T == Q5_1 ? 192 : T == Q8_0 ? 272 :
         T == Q4_K ? 144 : T == Q5_K ? 176 : 210;
}

// What a quantized tile's column c prefetches at group g (every x86 path): the tile's own bytes (COLS consecutive
// rows of row_bytes) taken in address order, one group's worth per (g, c) in the order the tile visits them,
// `distance` bytes past the tile's start. So a tile's prefetches are one sequential stream over memory a tile and
// PREFETCH_IN_ORDER bytes ahead, not COLS streams a row apart, PREFETCH bytes ahead in each (what the AVX-512
// tiles took until 2026-11-28, tuned on a Zen 5): every line is asked for at least a quarter of a tile and
// PREFETCH_IN_ORDER bytes before it is read. 2026-11-28, AMD Zen 3, the avx2 tiles, one row, two threads, from
// memory, the two alternating call by call: the 135M's Q4_1 576 x 1536 0.74-0.77x the time, its Q8_0 head
// 0.90-0.93x, the 1B's Q6_K head 0.82-0.85x, its Q4_K 2560 x 2048 and 16384 x 2048 0.86-0.90x, K = 8192 the same.
// Starting 32 KiB ahead (or two tiles, if more) was 2-13% slower than this distance; a tile and 2 KiB or 8 KiB, the
// same. 2026-11-28, AMD Zen 4, the AVX-512 tiles (PREFETCH ahead in each column against this), one row from
// memory: the 1B's Q4_K 16384 x 2048 0.55x the time, its Q6_K head 0.58x, qkv and o 0.55-0.59x, K = 8192 the same
// (at 2 and 4 rows 1.1x the time, slower); the 135M's Q4_1 576 x 1536 0.55x, its Q8_0 head 0.94-1.00x; a 1B
// decode step 0.70x.
// Lines asked for further ahead than IN_L1_AHEAD go to L2 (PREFETCHT1), not L1: a tile of rows longer than about
// 3 KB (K = 8192) asks for its lines more than 16 KB ahead, which with the activations overfill a 32 KB L1, so they
// were evicted before use. 2026-11-29, AMD Zen 4, from memory, alternating processes: the 1B's K = 8192 products
// at one row 0.67x the time (Q4_K) and 0.70x (Q6_K) on the AVX-512 tiles, 0.70-0.80x and 0.76-0.84x on the avx2
// ones, 0.7x at 4 rows on AVX-512; the 1B's one-row steps 0.92-0.93x (in one process, the two alternating). To L2
// at every distance, the K = 2048 products were 5-10% slower.
constexpr int64_t PREFETCH_IN_ORDER = 4096, IN_L1_AHEAD = 16384;
template <int64_t T>
inline __attribute__((always_inline)) void prefetch_in_order(const uint8_t* col, int c, int64_t g, int64_t row_bytes) {
  const int64_t distance = std::max<int64_t>(2 * PREFETCH_IN_ORDER, COLS * row_bytes + PREFETCH_IN_ORDER);
  const char* next = reinterpret_cast<const char*>(col - c * row_bytes + distance + (g * COLS + c) * group_bytes(T));
  if (distance <= IN_L1_AHEAD)
    for (int off = 0; off < group_bytes(T); off += 64) _mm_prefetch(next + off, _MM_HINT_T0);
  else
    for (int off = 0; off < group_bytes(T); off += 64) _mm_prefetch(next + off, _MM_HINT_T1);
}

// Four vectors whose 128-bit halves are Q4 blocks' 16 bytes of nibbles (features 4t.. in dword t's low nibbles,
// 16 + 4t.. in its high ones) -> their 8 steps: a 4 x 4 dword transpose per 128 bits puts dword t of y[i]'s half h
// in lane 4h + i of step t (the low nibbles) and of step t + 4 (the high ones).
inline __attribute__((always_inline)) void nibble_steps(const __m256i* y, __m256i* v) {
  const __m256i a0 = _mm256_unpacklo_epi32(y[0], y[1]), a1 = _mm256_unpackhi_epi32(y[0], y[1]);
  const __m256i a2 = _mm256_unpacklo_epi32(y[2], y[3]), a3 = _mm256_unpackhi_epi32(y[2], y[3]);
  const __m256i dwords[4] = {_mm256_unpacklo_epi64(a0, a2), _mm256_unpackhi_epi64(a0, a2),
                             _mm256_unpacklo_epi64(a1, a3), _mm256_unpackhi_epi64(a1, a3)};
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int t = 0; t < 4; ++t) {
    v[t] = _mm256_and_si256(dwords[t], low4);
    v[t + 4] = _mm256_and_si256(_mm256_srli_epi16(dwords[t], 4), low4);
  }
}

// Q4_0, Q4_1: a whole group's levels straight in the transposed layout (quant_group's v), and its scales, where
// unpacking each block, transpose8 and meta's gather cost the few-row tiles more than their dot products: block
// j's 16 bytes of nibbles hold features 4t..4t+3 in dword t's low nibbles and 16 + 4t.. in its high ones, so a
// 4 x 4 dword transpose of blocks j and j + 4 (one per 128 bits) gives step t and step t + 4 at once; the same
// transpose's first step puts the blocks' first dwords (d, and Q4_1's minimum) in lanes. The levels transpose8
// and the scales meta give (2026-11-28, AMD Zen 3: the 135M's Q4_1 products at 1-4 rows 1.2-1.4x as fast).
template <int64_t T>
inline __attribute__((always_inline)) void q4_steps(const uint8_t* row, int64_t g, __m256i* v, __m256& ws, __m256& wm) {
  constexpr int b = T == Q4_0 ? 18 : 20;
  const uint8_t* first = row + g * 8 * b;
  const auto block = [&](int j, int at) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(first + j * b + at)); };
  __m256i y[4], h[4];
  for (int j = 0; j < 4; ++j) {
    y[j] = _mm256_set_m128i(block(j + 4, b - 16), block(j, b - 16));
    h[j] = _mm256_set_m128i(block(j + 4, 0), block(j, 0));
  }
  // the blocks' first dwords, as meta gathers them
  word_scales<T>(_mm256_unpacklo_epi64(_mm256_unpacklo_epi32(h[0], h[1]), _mm256_unpacklo_epi32(h[2], h[3])), ws, wm);
  nibble_steps(y, v);
}

// Group g of a grouped row (group_blocks; nj blocks, a short last group fewer than 8): its scales (and Q4_1's
// minimums) as meta gives them, 8 (nj) fp16 in a row, one load each (the K-quants': meta's, from where the file
// has them); returns where its levels start. A short group's 16 bytes from either field lie within it, its levels
// following them (at least 16 bytes a block).
template <int64_t T>
inline __attribute__((always_inline)) const uint8_t* grouped_scales(const uint8_t* row, int64_t g, int nj, __m256& ws,
                                                                    __m256& wm, __m256& lo, __m256& hi) {
  constexpr GroupedAt at(T);
  if constexpr (k_quant(T)) {
    meta<T>(row, g, 8, ws, wm, lo, hi);
    return row + g * at.group + at.levels_at;
  } else {
    const uint8_t* p = row + g * 8 * at.bytes;
    const __m128i keep = nj == 8 ? _mm_set1_epi8(-1)
                                 : _mm_cmpgt_epi8(_mm_set1_epi8(static_cast<char>(2 * nj)),
                                                  _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const auto halves8 = [&](const uint8_t* q) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
      return _mm256_cvtph_ps(nj == 8 ? h : _mm_and_si128(h, keep));
    };
    ws = halves8(p);
    wm = T == Q4_1 ? halves8(p + 2 * nj) : _mm256_setzero_ps();
    return nj == 8 ? p + at.levels_at : p + nj * at.head;
  }
}

// A whole group of a grouped row: its levels already in the transposed steps (quant_group's v), from where
// grouped_scales says they start (grouped_steps: with its scales): loads, where the file's layout takes
// q4_steps' transposes or transpose8 and a gather.
// 2026-11-28, AMD Zen 3, 2 threads: the 135M's Q4_1 layers at 1, 2 and 4 rows 1.16x, 1.15x, 1.14x as fast, its
// Q8_0 head 1.46x, 1.28x, 1.23x (the head at one row then reads 36 GB/s), the 1B's layers (Q4_K grouped) 1.17x,
// 1.22x, 1.11x.
template <int64_t T>
inline __attribute__((always_inline)) void unpack_steps(const uint8_t* steps, __m256i* v) {
  if constexpr (T == Q8_0) {
    for (int t = 0; t < 8; ++t) v[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(steps + 32 * t));
  } else {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int t = 0; t < 4; ++t) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(steps + 32 * t));
      v[t] = _mm256_and_si256(bytes, low4);
      v[t + 4] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
    }
  }
  if constexpr (T == Q6_K) {  // step t's 2 high bits, at bit 2t of its half's byte, to bits 4-5
    const __m256i bits45 = _mm256_set1_epi8(0x30);
    for (int u = 0; u < 2; ++u) {
      const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(steps + 128 + 32 * u));
      const __m256i at45[4] = {_mm256_slli_epi16(high, 4), _mm256_slli_epi16(high, 2), high, _mm256_srli_epi16(high, 2)};
      for (int t = 0; t < 4; ++t) v[4 * u + t] = _mm256_or_si256(v[4 * u + t], _mm256_and_si256(at45[t], bits45));
    }
  }
}

template <int64_t T>
inline __attribute__((always_inline)) void grouped_steps(const uint8_t* row, int64_t g, __m256i* v, __m256& ws, __m256& wm,
                                                         __m256& lo, __m256& hi) {
  unpack_steps<T>(grouped_scales<T>(row, g, 8, ws, wm, lo, hi), v);
}

// Block j of a grouped row's short last group (nj < 8 blocks of a 32-block type), whose levels lie block after
// block from levels_at (grouped_scales) as the file has them: as levels<T> gives it.
template <int64_t T>
inline __attribute__((always_inline)) __m256i short_group_levels(const uint8_t* levels_at, int j) {
  if constexpr (T == Q8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(levels_at + 32 * j));
  return nibbles32(levels_at + 16 * j);
}

// Block j of a grouped row's whole group g as levels<T> gives it (the panels' packing).
template <int64_t T>
inline __attribute__((always_inline)) __m256i grouped_levels(const uint8_t* row, int64_t g, int j) {
  constexpr GroupedAt at(T);
  const uint8_t* p = row + g * at.group;
  if constexpr (T == Q8_0)
    return _mm256_i32gather_epi32(reinterpret_cast<const int*>(p + at.levels_at + 4 * j),
                                  _mm256_setr_epi32(0, 32, 64, 96, 128, 160, 192, 224), 1);
  const __m256i low = nibbles32(_mm_i32gather_epi32(reinterpret_cast<const int*>(p + at.levels_at + 4 * j),
                                                    _mm_setr_epi32(0, 32, 64, 96), 1));
  if constexpr (T != Q6_K) return low;
  // Q6_K: features 4t.. (16 + 4t..) take bits 2t of the first (second) high dword's bytes
  const auto high = [&](int u) {
    int32_t bits;
    std::memcpy(&bits, p + 128 + 32 * u + 4 * j, 4);
    return _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(bits), _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
  };
  return _mm256_or_si256(low, _mm256_slli_epi16(_mm256_set_m128i(high(1), high(0)), 4));
}

struct RowPtrs {  // one row of the quantized activations
  const int8_t *q, *qt;
  const float *d, *ds;
  const int32_t *sums, *first, *second;
  const int8_t* tail;  // short_tail's steps, where Acts::tail is filled
};

inline RowPtrs row_ptrs(const Acts& a, int64_t row) {
  const int64_t at = row * a.nbp;
  return RowPtrs{a.q.data() + row * a.k, a.qt.data() + at * QK, a.d.data() + at, a.ds.data() + at,
                 a.neg_sums.data() + at, a.neg_first.data() + at, a.neg_second.data() + at,
                 a.tail.empty() ? nullptr : a.tail.data() + row * 256};
}

// Where a tile's sums go: row r's column c at at[r * stride + c], for the first valid columns (a range's last
// tile repeats its last column to fill its four: the repeats' sums are dropped).
struct TileOut {
  float* at;
  int64_t stride;
  int valid;
  void put(int r, int c, float sum) const {
    if (c < valid) at[r * stride + c] = sum;
  }
};

// Q8_0 on AVX2: the dot of signed levels v (v_abs their absolute values) and activations x, 4 features a lane,
// added to init: VPSIGNB moves the levels' signs onto x, since VPMADDUBSW takes one side unsigned.
inline __attribute__((always_inline)) __m256i signed_dot(__m256i init, __m256i v_abs, __m256i v, __m256i x) {
  return _mm256_add_epi32(init, _mm256_madd_epi16(_mm256_maddubs_epi16(v_abs, _mm256_sign_epi8(x, v)), _mm256_set1_epi16(1)));
}

// The first nj of 8 vectors' lane sums, lane j holding vector j's (the lanes past nj zero): a short last group's
// blocks, each dotted in its own order (quant_group's TAIL), into the lanes the transposed steps give them.
template <class Dot>
inline __attribute__((always_inline)) __m256i block_lanes(int nj, Dot dot) {
  __m256i p[8];
  for (int j = 0; j < 8; ++j) p[j] = j < nj ? dot(j) : _mm256_setzero_si256();
  // per 128 bits: [sum of p0's 4 lanes, p1's, p2's, p3's] of its half, then the halves added
  const __m256i low = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
  if (nj <= 4)
    return _mm256_zextsi128_si256(_mm_add_epi32(_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1)));
  const __m256i high = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(low, high, 0x20), _mm256_permute2x128_si256(low, high, 0x31));
}

// Lane j of the result: block j's sum, from pair vectors p[i] holding blocks 2i (low 128 bits) and 2i + 1 (high),
// 4 lanes each (the first nj blocks; the pairs past them zero).
inline __attribute__((always_inline)) __m256i pair_lanes(int nj, const __m256i* p) {
  const __m256i low = _mm256_hadd_epi32(p[0], p[1]);  // per 128 bits: blocks 0 and 2 (1 and 3), 2 lanes each
  const __m256i high = nj > 4 ? _mm256_hadd_epi32(p[2], p[3]) : _mm256_setzero_si256();
  // [0, 2, 4, 6 | 1, 3, 5, 7] into order
  return _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(low, high), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Group g for R rows and the tile's columns: lane i of each int32 accumulator is block 8g + i's exact dot,
// summed over 8 steps of 4 features (the weights transposed once per column, the activations stored so).
// TAIL: a short last group of nj < 8 blocks (the 32-block types only) takes each block's dot against the plain
// activations and sums its lanes (block_lanes), where 8 transposed steps cost a whole group: the 135M's Q8_0
// head, whose K of 576 is 2.25 groups, 1.10-1.16x (AMD Zen 3). The same exact integers, so the same bits. A grouped
// row's group of one or two blocks (that head's, now) goes to short_tail instead.
template <int64_t T, int R, bool TAIL, bool G = false>
inline __attribute__((always_inline)) void quant_group(const uint8_t* const* w, int64_t g, int nj, const RowPtrs* x,
                                                       __m256 (*acc)[COLS], int64_t row_bytes) {
  constexpr int sh = offset_shift(T);
  static_assert(!TAIL || !k_quant(T), "the K-quants' groups are whole super-blocks");
  if (!TAIL) nj = 8;
  for (int c = 0; c < COLS; ++c) {
    prefetch_in_order<T>(w[c], c, g, row_bytes);
    __m256 ws, wm, lo, hi;
    __m256i v[8];
    if constexpr (G && !TAIL) {
      grouped_steps<T>(w[c], g, v, ws, wm, lo, hi);
    } else if constexpr (G) {  // Q8_0: v[j] block j's levels; Q4: v[2i], v[2i + 1] blocks 2i and 2i + 1's low and
                               // high nibbles (features 0-15, 16-31), one block per 128 bits
      const uint8_t* lv = grouped_scales<T>(w[c], g, nj, ws, wm, lo, hi);
      if constexpr (T == Q8_0) {
        for (int j = 0; j < nj; ++j) v[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lv + 32 * j));
      } else {
        const __m256i low4 = _mm256_set1_epi8(0x0F);
        for (int i = 0; 2 * i < nj; ++i) {  // a lone last block: its 16 bytes alone, none past the row
          const __m256i bytes = 2 * i + 1 < nj
                                    ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lv + 32 * i))
                                    : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lv + 32 * i)));
          v[2 * i] = _mm256_and_si256(bytes, low4);
          v[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
        }
      }
    } else if constexpr (!TAIL && (T == Q4_0 || T == Q4_1)) {
      q4_steps<T>(w[c], g, v, ws, wm);
    } else {
      meta<T>(w[c], g, nj, ws, wm, lo, hi);
#pragma GCC unroll 8
      for (int j = 0; j < nj; ++j) v[j] = levels<T>(w[c], g, j);
      if constexpr (!TAIL) transpose8(v);
    }
#if PASS_VNNI == 0
    __m256i v_abs[8];
    if constexpr (T == Q8_0)
      for (int t = 0; t < nj; ++t) v_abs[t] = _mm256_sign_epi8(v[t], v[t]);
#else
    if constexpr (T == Q8_0)
      for (int t = 0; t < nj; ++t) v[t] = _mm256_xor_si256(v[t], _mm256_set1_epi8(static_cast<char>(0x80)));
#endif
    for (int r = 0; r < R; ++r) {
      const int8_t* xt = x[r].qt + g * 256;
#define xs(t) _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xt + 32 * (t)))
      const __m256 d = _mm256_loadu_ps(x[r].d + g * 8);
      __m256 a = acc[r][c];
      if constexpr (T == Q6_K) {
        __m256i first = _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r].first + g * 8)), sh);
        __m256i second = _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r].second + g * 8)), sh);
        first = dots<T, 4>(first, v, [&](int t) { return xs(t); });
        second = dots<T, 4>(second, v + 4, [&](int t) { return xs(t + 4); });
        a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(first), _mm256_mul_ps(lo, d), a);
        a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(second), _mm256_mul_ps(hi, d), a);
      } else {
        __m256i sum;
        if constexpr (sh >= 0 || (T == Q8_0 && PASS_VNNI))
          sum = _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r].sums + g * 8)), sh >= 0 ? sh : 7);
        else
          sum = _mm256_setzero_si256();
        if constexpr (TAIL && G && T != Q8_0) {  // blocks by pairs, the activations' halves beside each other
          const int8_t* xq = x[r].q + g * 256;
          const auto block = [&](int j) {
            return j < nj ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * j)) : _mm256_setzero_si256();
          };
          __m256i pairs[4];
          for (int i = 0; i < 4; ++i) {
            if (2 * i >= nj) {
              pairs[i] = _mm256_setzero_si256();
              continue;
            }
            const __m256i x0 = block(2 * i), x1 = block(2 * i + 1);
            const __m256i low = _mm256_permute2x128_si256(x0, x1, 0x20), high = _mm256_permute2x128_si256(x0, x1, 0x31);
            pairs[i] = dots<T, 2>(_mm256_setzero_si256(), v + 2 * i, [&](int t) { return t ? high : low; });
          }
          sum = _mm256_add_epi32(sum, pair_lanes(nj, pairs));
        } else if constexpr (TAIL) {
          const int8_t* xq = x[r].q + g * 256;
          sum = _mm256_add_epi32(sum, block_lanes(nj, [&](int j) {
            const __m256i xj = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * j));
#if PASS_VNNI == 0
            if constexpr (T == Q8_0) return signed_dot(_mm256_setzero_si256(), v_abs[j], v[j], xj);
#endif
            return dots<T, 1>(_mm256_setzero_si256(), v + j, [&](int) { return xj; });
          }));
        }
#if PASS_VNNI == 0
        else if constexpr (T == Q8_0) {
          for (int t = 0; t < 8; ++t) sum = signed_dot(sum, v_abs[t], v[t], xs(t));
        }
#endif
        else {
          sum = dots<T, 8>(sum, v, [&](int t) { return xs(t); });
        }
        a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(ws, d), a);
      }
#undef xs
      if constexpr (has_min(T)) a = _mm256_fmadd_ps(wm, _mm256_loadu_ps(x[r].ds + g * 8), a);
      acc[r][c] = a;
    }
  }
}

#if PASS_VNNI == 2
// AVX-512: two columns per 512-bit register, each half doing exactly the 256-bit code's operations on its
// column (the same bits), so that each instruction serves two (row, column) chains.
inline __attribute__((always_inline)) void transpose8x2(__m512i* v) {
  const __m512i t0 = _mm512_unpacklo_epi32(v[0], v[1]), t1 = _mm512_unpackhi_epi32(v[0], v[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(v[2], v[3]), t3 = _mm512_unpackhi_epi32(v[2], v[3]);
  const __m512i t4 = _mm512_unpacklo_epi32(v[4], v[5]), t5 = _mm512_unpackhi_epi32(v[4], v[5]);
  const __m512i t6 = _mm512_unpacklo_epi32(v[6], v[7]), t7 = _mm512_unpackhi_epi32(v[6], v[7]);
  const __m512i s0 = _mm512_unpacklo_epi64(t0, t2), s1 = _mm512_unpackhi_epi64(t0, t2);
  const __m512i s2 = _mm512_unpacklo_epi64(t1, t3), s3 = _mm512_unpackhi_epi64(t1, t3);
  const __m512i s4 = _mm512_unpacklo_epi64(t4, t6), s5 = _mm512_unpackhi_epi64(t4, t6);
  const __m512i s6 = _mm512_unpacklo_epi64(t5, t7), s7 = _mm512_unpackhi_epi64(t5, t7);
  const __m512i low = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), high = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  v[0] = _mm512_permutex2var_epi64(s0, low, s4), v[4] = _mm512_permutex2var_epi64(s0, high, s4);
  v[1] = _mm512_permutex2var_epi64(s1, low, s5), v[5] = _mm512_permutex2var_epi64(s1, high, s5);
  v[2] = _mm512_permutex2var_epi64(s2, low, s6), v[6] = _mm512_permutex2var_epi64(s2, high, s6);
  v[3] = _mm512_permutex2var_epi64(s3, low, s7), v[7] = _mm512_permutex2var_epi64(s3, high, s7);
}

inline __attribute__((always_inline)) __m512 join(__m256 a, __m256 b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1);
}
inline __attribute__((always_inline)) __m512i join(__m256i a, __m256i b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

inline __attribute__((always_inline)) __m512i wide(const void* p) {  // 32 bytes in both halves
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Group g's scales for two weight rows at once (lanes 0-7 the first row's, 8-15 the second's): the very
// products meta gives each row (d * sc, -dmin * mn; Q6_K's d * sc), so the same bits. Q4_K, Q5_K: both rows'
// 6-bit scales and minimums unpacked together in vector registers, where meta's scalar bit work per row cost the
// small-row tiles more than their dot products; Q6_K: both rows' scales in one vector, not meta twice and joins.
template <int64_t T>
inline __attribute__((always_inline)) void meta2(const uint8_t* row0, const uint8_t* row1, int64_t g, int nj,
                                                 __m512& ws, __m512& wm, __m512& lo, __m512& hi) {
  if constexpr (T == Q4_K || T == Q5_K) {
    constexpr int64_t bytes = T == Q4_K ? 144 : 176;
    // per row (128 bits): d and dmin, then the scale bytes u0 u1 u2 (meta's)
    const __m256i head = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(row1 + g * bytes),
                                             reinterpret_cast<const __m128i*>(row0 + g * bytes));
    // [u0 & 63, (u2 & 15) | (u0 >> 6) << 4, u1 & 63, (u2 >> 4 & 15) | (u1 >> 6) << 4]: sc, then mn, per row
    const __m256i low = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_shuffle_epi32(head, 0xED), _mm256_setr_epi32(0, 0, 0, 4, 0, 0, 0, 4)),
        _mm256_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    const __m256i high = _mm256_and_si256(_mm256_srli_epi32(_mm256_shuffle_epi32(head, 0xA5), 2),
                                          _mm256_setr_epi32(0, 0x30303030, 0, 0x30303030, 0, 0x30303030, 0, 0x30303030));
    const __m256i sm = _mm256_permute4x64_epi64(_mm256_or_si256(low, high), 0xD8);  // sc0 sc1 mn0 mn1
    const __m512 dd = _mm512_castps256_ps512(
        _mm256_cvtph_ps(_mm_unpacklo_epi32(_mm256_castsi256_si128(head), _mm256_extracti128_si256(head, 1))));
    const __m512 d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2), dd);
    const __m512 dmin = _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3), dd);
    ws = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(sm))));
    wm = _mm512_mul_ps(_mm512_xor_ps(dmin, _mm512_set1_ps(-0.0f)),
                       _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(sm, 1))));
    lo = hi = _mm512_setzero_ps();
  } else if constexpr (T == Q6_K) {  // meta's products: both rows' 16 int8 scales split into even and odd at once
    uint16_t h0, h1;
    std::memcpy(&h0, row0 + g * 210 + 208, 2);
    std::memcpy(&h1, row1 + g * 210 + 208, 2);
    const __m512 d = join(_mm256_set1_ps(_cvtsh_ss(h0)), _mm256_set1_ps(_cvtsh_ss(h1)));
    const __m128i even_odd = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m256i sc = _mm256_shuffle_epi8(
        _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(row1 + g * 210 + 192),
                            reinterpret_cast<const __m128i*>(row0 + g * 210 + 192)),
        _mm256_broadcastsi128_si256(even_odd));
    const __m256i by_half = _mm256_permute4x64_epi64(sc, 0xD8);  // [row 0's even, row 1's even | the odd ones]
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(by_half))));
    hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(by_half, 1))));
    ws = wm = _mm512_setzero_ps();
  } else {
    __m256 s[2], m[2], l[2], h[2];
    meta<T>(row0, g, nj, s[0], m[0], l[0], h[0]);
    meta<T>(row1, g, nj, s[1], m[1], l[1], h[1]);
    ws = join(s[0], s[1]), wm = join(m[0], m[1]), lo = join(l[0], l[1]), hi = join(h[0], h[1]);
  }
}

// Q4_0, Q4_1: two weight rows' group (q4_group) straight into transpose8x2's layout, each row's 16 bytes of
// nibbles per block transposed as 4 dwords (features 4t..4t+3 in the low nibbles, 16 + 4t.. in the high ones)
// before the nibbles are split, and both rows' scales as meta2 gives them: the same levels and values.
template <int64_t T>
inline __attribute__((always_inline)) void q4_pair(const uint8_t* row0, const uint8_t* row1, int64_t g, int nj,
                                                   __m512& ws, __m512& wm, __m512i* v) {
  // lane 8s + j: dword s of block j (blocks 0-3 in the first table, a block per 4 dwords; 4-7 in the second)
  alignas(64) static constexpr int32_t steps01[16] = {0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29};
  const __m512i s01 = _mm512_load_si512(steps01), s23 = _mm512_add_epi32(s01, _mm512_set1_epi32(2));
  __m512i head[2], qs[2][2], steps[2][2];
  for (int r = 0; r < 2; ++r) {
    q4_group<T>(r ? row1 : row0, g, nj, head[r], qs[r]);
    steps[r][0] = _mm512_permutex2var_epi32(qs[r][0], s01, qs[r][1]);  // dwords 0 and 1 of blocks 0-7
    steps[r][1] = _mm512_permutex2var_epi32(qs[r][0], s23, qs[r][1]);  // 2 and 3
  }
  const __m512 f0 = _mm512_cvtph_ps(_mm512_castsi512_si256(head[0]));
  const __m512 f1 = _mm512_cvtph_ps(_mm512_castsi512_si256(head[1]));
  ws = _mm512_shuffle_f32x4(f0, f1, 0x44);
  wm = T == Q4_1 ? _mm512_shuffle_f32x4(f0, f1, 0xEE) : _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int t = 0; t < 4; ++t) {
    const __m512i both = _mm512_shuffle_i64x2(steps[0][t / 2], steps[1][t / 2], t % 2 ? 0xEE : 0x44);
    v[t] = _mm512_and_si512(both, low4);
    v[t + 4] = _mm512_and_si512(_mm512_srli_epi16(both, 4), low4);
  }
}

// unpack_steps for two grouped rows at once, row 0's steps in the low half of each vector and row 1's in the
// high one: the same levels, each operation on both rows' bytes, where unpack_steps on each row and a join per
// step took twice the operations (for Q4_K, 40 a group of two rows against 20).
template <int64_t T>
inline __attribute__((always_inline)) void unpack_steps2(const uint8_t* steps0, const uint8_t* steps1, __m512i* v) {
  const auto both = [&](int at) {
    return join(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(steps0 + at)),
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(steps1 + at)));
  };
  if constexpr (T == Q8_0) {
    for (int t = 0; t < 8; ++t) v[t] = both(32 * t);
  } else {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int t = 0; t < 4; ++t) {
      const __m512i bytes = both(32 * t);
      v[t] = _mm512_and_si512(bytes, low4);
      v[t + 4] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
    }
  }
  if constexpr (T == Q6_K) {
    const __m512i bits45 = _mm512_set1_epi8(0x30);
    for (int u = 0; u < 2; ++u) {
      const __m512i high = both(128 + 32 * u);
      const __m512i at45[4] = {_mm512_slli_epi16(high, 4), _mm512_slli_epi16(high, 2), high, _mm512_srli_epi16(high, 2)};
      for (int t = 0; t < 4; ++t) v[4 * u + t] = _mm512_or_si512(v[4 * u + t], _mm512_and_si512(at45[t], bits45));
    }
  }
}

// Two grouped rows' group g (group_blocks) in transpose8x2's layout, with their scales as meta2 gives them: a
// whole group's levels as they are stored (unpack_steps2), a short one's (nj < 8, the 32-block types) block by
// block and transposed here, as the file's are. The same levels and values as the file's layout: the same bits.
template <int64_t T, int NJ>
inline __attribute__((always_inline)) void grouped_pair(const uint8_t* row0, const uint8_t* row1, int64_t g, int nj,
                                                        __m512& ws, __m512& wm, __m512& lo, __m512& hi, __m512i* v) {
  if (NJ) nj = NJ;
  constexpr GroupedAt at(T);
  const uint8_t* row[2] = {row0, row1};
  const uint8_t* levels_at[2];
  if constexpr (k_quant(T)) {  // the scales where the file has them
    meta2<T>(row0, row1, g, 8, ws, wm, lo, hi);
    for (int r = 0; r < 2; ++r) levels_at[r] = row[r] + g * at.group + at.levels_at;
  } else {
    __m256 s[2], m[2], unused;
    for (int r = 0; r < 2; ++r) levels_at[r] = grouped_scales<T>(row[r], g, nj, s[r], m[r], unused, unused);
    ws = join(s[0], s[1]), wm = join(m[0], m[1]), lo = hi = _mm512_setzero_ps();
  }
  if (NJ == 8) return unpack_steps2<T>(levels_at[0], levels_at[1], v);
  __m256i u[2][8];
  for (int r = 0; r < 2; ++r)
    for (int j = 0; j < 8; ++j) u[r][j] = j < nj ? short_group_levels<T>(levels_at[r], j) : _mm256_setzero_si256();
  for (int t = 0; t < 8; ++t) v[t] = join(u[0][t], u[1][t]);
  transpose8x2(v);
}

// Group g for R rows and the tile's 4 columns: the two column pairs' levels are unpacked and transposed first
// (G: grouped rows, their levels stored transposed: grouped_pair), then each row loads its activations once
// per step for both pairs, and sums each half of its blocks (features 0-15, 16-31) in its own chain, added at
// the end (exact int32): two chains in flight per pair, not one chain of 8 dependent steps. The fp32
// operations are quant_group's, per lane.
template <int64_t T, int R, int NJ, bool G>
inline __attribute__((always_inline)) void quant_group512(const uint8_t* const* w, int64_t g, int nj, const RowPtrs* x,
                                                          __m512 (*acc)[COLS / 2], int64_t row_bytes) {
  constexpr int sh = offset_shift(T);
  if (NJ) nj = NJ;
  __m512 ws2[2], wm2[2], lo2[2], hi2[2];
  __m512i v[2][8];
#pragma GCC unroll 2
  for (int p = 0; p < COLS / 2; ++p) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      prefetch_in_order<T>(w[2 * p + h], 2 * p + h, g, row_bytes);
    }
    if constexpr (G) {
      grouped_pair<T, NJ>(w[2 * p], w[2 * p + 1], g, nj, ws2[p], wm2[p], lo2[p], hi2[p], v[p]);
    } else if constexpr (T == Q4_0 || T == Q4_1) {
      q4_pair<T>(w[2 * p], w[2 * p + 1], g, nj, ws2[p], wm2[p], v[p]);
      lo2[p] = hi2[p] = _mm512_setzero_ps();
    } else {
      meta2<T>(w[2 * p], w[2 * p + 1], g, nj, ws2[p], wm2[p], lo2[p], hi2[p]);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j)
        v[p][j] = j < nj ? join(levels<T>(w[2 * p], g, j), levels<T>(w[2 * p + 1], g, j)) : _mm512_setzero_si512();
      transpose8x2(v[p]);
    }
    if constexpr (T == Q8_0)
      for (int t = 0; t < 8; ++t) v[p][t] = _mm512_xor_si512(v[p][t], _mm512_set1_epi8(static_cast<char>(0x80)));
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const int8_t* xt = x[r].qt + g * 256;
    const __m512 d = _mm512_broadcast_f32x8(_mm256_loadu_ps(x[r].d + g * 8));
    __m512i first[2], second[2];
#pragma GCC unroll 2
    for (int p = 0; p < COLS / 2; ++p) {
      if constexpr (T == Q6_K) {
        first[p] = _mm512_slli_epi32(wide(x[r].first + g * 8), sh);
        second[p] = _mm512_slli_epi32(wide(x[r].second + g * 8), sh);
      } else if constexpr (sh >= 0 || T == Q8_0) {
        first[p] = _mm512_slli_epi32(wide(x[r].sums + g * 8), sh >= 0 ? sh : 7);
        second[p] = _mm512_setzero_si512();
      } else {
        first[p] = second[p] = _mm512_setzero_si512();
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m512i xw = wide(xt + 32 * t);
#pragma GCC unroll 2
      for (int p = 0; p < COLS / 2; ++p) {
        if (t < 4) first[p] = _mm512_dpbusd_epi32(first[p], v[p][t], xw);
        else second[p] = _mm512_dpbusd_epi32(second[p], v[p][t], xw);
      }
    }
#pragma GCC unroll 2
    for (int p = 0; p < COLS / 2; ++p) {
      __m512 a = acc[r][p];
      if constexpr (T == Q6_K) {
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(first[p]), _mm512_mul_ps(lo2[p], d), a);
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(second[p]), _mm512_mul_ps(hi2[p], d), a);
      } else {
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(first[p], second[p])), _mm512_mul_ps(ws2[p], d), a);
      }
      if constexpr (has_min(T)) a = _mm512_fmadd_ps(wm2[p], _mm512_broadcast_f32x8(_mm256_loadu_ps(x[r].ds + g * 8)), a);
      acc[r][p] = a;
    }
  }
}

// One row (a decode step, where no other row shares a transpose of the weights): each column's blocks stay in
// their own order, two blocks per 512-bit VPDPBUSD against the activations as quantized (Acts::q), and the 16
// lanes of 4-feature sums each gives are folded into the blocks' dots (Q6_K: their two halves' dots). The same
// exact int32 dots as quant_group's, then its very fp32 operations: the same bits, in about half the vector
// instructions (no 8 x 8 transpose per group and column). Not Q4_0, Q4_1: their nibbles come transposed with
// a few permutes (q4_pair), and quant_group512's tile of one row takes fewer instructions.
template <int64_t T, int NJ>
inline __attribute__((always_inline)) __m512i pair_levels(const uint8_t* row, int64_t g, int nj, int i) {
  if constexpr (T == Q4_K) {  // blocks 2i and 2i + 1 are the low and high nibbles of the same 32 bytes
    const __m512i qs = _mm512_broadcast_i64x4(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * 144 + 16 + 32 * i)));
    return _mm512_and_si512(_mm512_mask_srli_epi16(qs, 0xFFFF0000u, qs, 4), _mm512_set1_epi8(0x0F));
  } else if constexpr (T == Q6_K) {
    // Half h = i / 2 of the super-block: blocks 4h, 4h + 1 are the low nibbles of its 64 bytes ql (the first
    // 32 bytes, then the second), blocks 4h + 2, 4h + 3 their high nibbles; the fifth and sixth bits of all four
    // are bit pairs 0, 1, 2, 3 of the same 32 bytes qh. One load of each, where levels takes two per block.
    const uint8_t* sb = row + g * 210;
    const __m512i ql = _mm512_loadu_si512(sb + 64 * (i / 2));
    const __m512i qh =
        _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 128 + 32 * (i / 2))));
    // bit pair p moved to bits 4-5 (16-bit shifts: what crosses a byte lands outside 0x30): p = 0, 1 left by 4,
    // 2; p = 2, 3 right by 0, 2
    const __m512i counts = i % 2 ? _mm512_setr_epi64(0, 0, 0, 0, 0x0002000200020002, 0x0002000200020002,
                                                     0x0002000200020002, 0x0002000200020002)
                                 : _mm512_setr_epi64(0x0004000400040004, 0x0004000400040004, 0x0004000400040004,
                                                     0x0004000400040004, 0x0002000200020002, 0x0002000200020002,
                                                     0x0002000200020002, 0x0002000200020002);
    const __m512i high = _mm512_and_si512(i % 2 ? _mm512_srlv_epi16(qh, counts) : _mm512_sllv_epi16(qh, counts),
                                          _mm512_set1_epi8(0x30));
    const __m512i low = _mm512_and_si512(i % 2 ? _mm512_srli_epi16(ql, 4) : ql, _mm512_set1_epi8(0x0F));
    return _mm512_or_si512(low, high);
  } else if constexpr (T == Q5_0 || T == Q5_1) {
    // Both blocks' fifth bits, one per feature in feature order, are one 64-bit mask: a masked move sets them,
    // where bits32's shuffle, or, compare and and per block took more instructions than the block's dot.
    if (NJ) nj = NJ;
    constexpr int bytes = T == Q5_0 ? 22 : 24, qh = T == Q5_0 ? 2 : 4;
    const uint8_t* first = row + (g * 8 + 2 * i) * bytes;
    const bool second = 2 * i + 1 < nj;
    uint32_t h[2] = {0, 0};
    std::memcpy(&h[0], first + qh, 4);
    if (second) std::memcpy(&h[1], first + bytes + qh, 4);
    const __m512i low = join(nibbles32(first + qh + 4), second ? nibbles32(first + bytes + qh + 4) : _mm256_setzero_si256());
    const __mmask64 high = _cvtu64_mask64(h[0] | static_cast<uint64_t>(h[1]) << 32);
    return _mm512_or_si512(low, _mm512_maskz_mov_epi8(high, _mm512_set1_epi8(0x10)));
  } else {
    if (NJ) nj = NJ;
    const __m256i first = 2 * i < nj ? levels<T>(row, g, 2 * i) : _mm256_setzero_si256();
    const __m256i second = 2 * i + 1 < nj ? levels<T>(row, g, 2 * i + 1) : _mm256_setzero_si256();
    return join(first, second);
  }
}

template <int64_t T, int NJ>
inline __attribute__((always_inline)) void quant_group_row(const uint8_t* const* w, int64_t g, int nj,
                                                           const int8_t* q, const RowPtrs& x, __m256* acc,
                                                           int64_t row_bytes) {
  constexpr int sh = offset_shift(T);
  if (NJ) nj = NJ;
  // lanes (block 2i + e, first or second 16 features) of the folded sums -> [first 16 of blocks 0..7 | second 16]
  const __m512i halves_order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  const __m256 d = _mm256_loadu_ps(x.d + g * 8);
#pragma GCC unroll 4
  for (int c = 0; c < COLS; ++c) {
    prefetch_in_order<T>(w[c], c, g, row_bytes);
    __m256 ws, wm, lo, hi;
    meta<T, false>(w[c], g, nj, ws, wm, lo, hi);
    __m512i p[4];  // pair i: lanes 0-7 block 2i's 4-feature sums in feature order, lanes 8-15 block 2i + 1's
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      if (2 * i >= nj) {  // a short last group's missing blocks: zero dots, as their zero levels give
        p[i] = _mm512_setzero_si512();
        continue;
      }
      __m512i u = pair_levels<T, NJ>(w[c], g, nj, i);
      if constexpr (T == Q8_0) u = _mm512_xor_si512(u, _mm512_set1_epi8(static_cast<char>(0x80)));
      __m512i xq;
      if (NJ == 8) {
        xq = _mm512_loadu_si512(q + g * 256 + 64 * i);
      } else {  // a short last group: nothing past the row's K is read (zeros there, as in Acts::qt)
        const int valid = std::max(0, std::min(64, nj * 32 - 64 * i));
        xq = _mm512_maskz_loadu_epi8(valid == 64 ? ~0ULL : (1ULL << valid) - 1, q + g * 256 + 64 * i);
      }
      p[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, xq);
    }
    // 128-bit lane L of s holds, for pairs 0..3, the sums over their features 16L .. 16L + 15
    const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(p[0], p[1]), _mm512_unpackhi_epi32(p[0], p[1]));
    const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2], p[3]), _mm512_unpackhi_epi32(p[2], p[3]));
    const __m512i s = _mm512_permutexvar_epi32(
        halves_order, _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23)));
    const __m256i first = _mm512_castsi512_si256(s), second = _mm512_extracti64x4_epi64(s, 1);
    __m256 a = acc[c];
    if constexpr (T == Q6_K) {
      const __m256i f = _mm256_add_epi32(first, _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.first + g * 8)), sh));
      const __m256i h = _mm256_add_epi32(second, _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.second + g * 8)), sh));
      a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(f), _mm256_mul_ps(lo, d), a);
      a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_mul_ps(hi, d), a);
    } else {
      __m256i sum = _mm256_add_epi32(first, second);
      if constexpr (sh >= 0 || T == Q8_0)
        sum = _mm256_add_epi32(sum, _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sums + g * 8)), sh >= 0 ? sh : 7));
      a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(ws, d), a);
    }
    if constexpr (has_min(T)) a = _mm256_fmadd_ps(wm, _mm256_loadu_ps(x.ds + g * 8), a);
    acc[c] = a;
  }
}
#endif

// A grouped Q4_0, Q4_1 or Q8_0 row's (G; else Q8_0 in the file's layout) short last group of one or two blocks
// (the 135M's K = 576 ends in two), for the tile's 4 columns at once, and the tile's sums of 8 lanes: block j of
// column c takes lane 4j + c of one transposed group (8 steps against Acts::tail), where each column's own took a
// group's fp32 work and a shuffled sum of its lanes for a quarter of a group's bytes; then lanes 0 and 1 of the
// columns' accumulators are gathered there for those blocks' fp32 operations, and each column's 8 lanes are summed
// as lanes8 sums them. The same operations on every lane: the same bits. A block's lanes past nj take zero scales
// and activations, as quant_group's TAIL's do. 2026-11-28, AMD Zen 3: the 135M's Q4_1 products, one thread, at 1,
// 2, 4 and 8 rows 0.91-0.93x, 0.92-0.97x, 0.81-0.92x and 0.80-0.90x the time, its Q8_0 head (two threads) 0.89x at
// 4 rows; its whole steps 0.98-0.99x at one row, 0.97-1.00x at two, 0.90-0.91x at four. The AVX-512 tiles take it
// too (their accumulators split into these 256-bit ones): 2026-11-29, AMD Zen 4, Q4_1 49152 x 576 at 2 and 4 rows
// 0.87-0.95x and 0.88x the time, the 135M's 4-row steps 0.93-0.99x, one row the same; and its Q8_0 head in the
// file's layout (G false: the AVX-512 paths keep it so), 49152 x 576 at 2 rows 0.7-0.9x the time, at 4 rows
// 0.7-1.03x.
template <int64_t T, int R, bool G = true>
inline __attribute__((always_inline)) void short_tail(const Job& jb, const uint8_t* const* w, const RowPtrs* x,
                                                      __m256 (*acc)[COLS], const TileOut& out) {
  static_assert(COLS == 4 && (T == Q4_0 || T == Q4_1 || T == Q8_0), "four columns of a 32-block type");
  static_assert(G || T == Q8_0, "the file's layout: Q8_0's (the AVX-512 paths keep it)");
  constexpr GroupedAt at(T);
  constexpr int sh = offset_shift(T);
  const int64_t g = jb.nb / 8;
  const int nj = static_cast<int>(jb.nb % 8);
  // column c's nj fp16 scales (and minimums) in word c, the second one's zero where nj is 1
  const __m128i keep = _mm_set1_epi32(nj == 2 ? -1 : 0xffff);
  __m128i scale16[COLS], min16[COLS];
  // v[t]: step t of the 8 (block, column) pairs, lane 4j + c; for the Q4 types first [block 0 | block 1] of each
  // column (block j's 16 bytes: features 4t.. in dword t's low nibbles, 16 + 4t.. in its high ones)
  __m256i v[8], level[COLS];
  for (int c = 0; c < COLS; ++c) {
    prefetch_in_order<T>(w[c], c, g, jb.row_bytes);
    const uint8_t* p = w[c] + g * 8 * at.bytes;
    if constexpr (!G) {  // the file's Q8_0 blocks: 2 bytes of d, then 32 levels each
      uint16_t d[2] = {0, 0};
      for (int j = 0; j < nj; ++j) std::memcpy(&d[j], p + at.bytes * j, 2);
      scale16[c] = _mm_cvtsi32_si128(static_cast<int>(d[0] | static_cast<uint32_t>(d[1]) << 16));
      min16[c] = _mm_setzero_si128();
      v[c] = levels<T>(w[c], g, 0), v[4 + c] = nj == 2 ? levels<T>(w[c], g, 1) : _mm256_setzero_si256();
      continue;
    }
    // grouped_scales': nj scales, nj minimums, the levels (at least 16 bytes a block): 4 bytes from either field
    // lie within the group
    scale16[c] = _mm_loadu_si32(p);
    min16[c] = T == Q4_1 ? _mm_loadu_si32(p + 2 * nj) : _mm_setzero_si128();
    const uint8_t* lv = p + nj * at.head;
    const auto block = [&](int j) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lv + 32 * j)); };
    if constexpr (T == Q8_0)
      v[c] = block(0), v[4 + c] = nj == 2 ? block(1) : _mm256_setzero_si256();
    else
      level[c] = nj == 2 ? block(0) : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lv)));
  }
  const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);  // lane 4j + c <- fp16 2c + j
  // the words joined in registers: stored in an array and loaded as one vector, they missed store-to-load
  // forwarding (a 16-byte load over the compiler's 8-byte stores), where perf put a tenth of a one-row tile's time
  const auto lanes_of = [&](const __m128i* words) {
    const __m128i halves = _mm_and_si128(
        _mm_unpacklo_epi64(_mm_unpacklo_epi32(words[0], words[1]), _mm_unpacklo_epi32(words[2], words[3])), keep);
    return _mm256_permutevar8x32_ps(_mm256_cvtph_ps(halves), order);
  };
  const __m256 ws = lanes_of(scale16), wm = T == Q4_1 ? lanes_of(min16) : _mm256_setzero_ps();
  if constexpr (T == Q8_0) {
    transpose8(v);
  } else {
    nibble_steps(level, v);
  }
#if PASS_VNNI == 0
  __m256i v_abs[8];
  if constexpr (T == Q8_0)
    for (int t = 0; t < 8; ++t) v_abs[t] = _mm256_sign_epi8(v[t], v[t]);
#else
  if constexpr (T == Q8_0)
    for (int t = 0; t < 8; ++t) v[t] = _mm256_xor_si256(v[t], _mm256_set1_epi8(static_cast<char>(0x80)));
#endif
  const __m256i by_block = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);  // lane 4j + c <- block j's
  for (int r = 0; r < R; ++r) {
    const int8_t* xt = x[r].tail;
    const auto xs = [&](int t) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xt + 32 * t)); };
    __m256i sum = _mm256_setzero_si256();
    if constexpr (sh >= 0 || (T == Q8_0 && PASS_VNNI)) {
      const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r].sums + g * 8));
      sum = _mm256_slli_epi32(_mm256_permutevar8x32_epi32(sums, by_block), sh >= 0 ? sh : 7);
    }
#if PASS_VNNI == 0
    if constexpr (T == Q8_0)
      for (int t = 0; t < 8; ++t) sum = signed_dot(sum, v_abs[t], v[t], xs(t));
    else
#endif
      sum = dots<T, 8>(sum, v, xs);
    const __m256 d = _mm256_permutevar8x32_ps(_mm256_loadu_ps(x[r].d + g * 8), by_block);
    // the columns' lanes side by side: [lane 0 of columns 0-3 | lane 4 of them], [1 | 5], [2 | 6], [3 | 7]
    const auto pd = [](__m256 v) { return _mm256_castps_pd(v); };
    const __m256 a01 = _mm256_unpacklo_ps(acc[r][0], acc[r][1]), a23 = _mm256_unpacklo_ps(acc[r][2], acc[r][3]);
    const __m256 b01 = _mm256_unpackhi_ps(acc[r][0], acc[r][1]), b23 = _mm256_unpackhi_ps(acc[r][2], acc[r][3]);
    const __m256 l04 = _mm256_castpd_ps(_mm256_unpacklo_pd(pd(a01), pd(a23)));
    const __m256 l15 = _mm256_castpd_ps(_mm256_unpackhi_pd(pd(a01), pd(a23)));
    const __m256 l26 = _mm256_castpd_ps(_mm256_unpacklo_pd(pd(b01), pd(b23)));
    const __m256 l37 = _mm256_castpd_ps(_mm256_unpackhi_pd(pd(b01), pd(b23)));
    __m256 l01 = _mm256_permute2f128_ps(l04, l15, 0x20);  // lane 4j + c: column c's lane j, which block j adds to
    l01 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(ws, d), l01);
    if constexpr (has_min(T))
      l01 = _mm256_fmadd_ps(wm, _mm256_permutevar8x32_ps(_mm256_loadu_ps(x[r].ds + g * 8), by_block), l01);
    const __m128 lanes[8] = {_mm256_castps256_ps128(l01), _mm256_extractf128_ps(l01, 1),
                             _mm256_castps256_ps128(l26), _mm256_castps256_ps128(l37),
                             _mm256_extractf128_ps(l04, 1), _mm256_extractf128_ps(l15, 1),
                             _mm256_extractf128_ps(l26, 1), _mm256_extractf128_ps(l37, 1)};
    alignas(16) float sums[COLS];
    _mm_store_ps(sums, lane_sum([&](int j) { return lanes[j]; }, [](__m128 p, __m128 q) { return _mm_add_ps(p, q); }));
    for (int c = 0; c < COLS; ++c) out.put(r, c, sums[c]);
  }
}

template <int64_t T, int R, bool G = false>
void quant_tile(const Job& jb, const uint8_t* const* w, const RowPtrs* x, const TileOut& out) {
  constexpr int C = COLS;
  const int64_t full = jb.nb / 8;
  __m256 acc[R][C];
#if PASS_VNNI == 2
  if constexpr (R == 1 && T != Q4_0 && T != Q4_1 && !G) {  // one row: its blocks in their own order (quant_group_row)
    const int8_t* q = x[0].q;
    for (int c = 0; c < C; ++c) acc[0][c] = _mm256_setzero_ps();
    for (int64_t g = 0; g < full; ++g) quant_group_row<T, 8>(w, g, 8, q, x[0], acc[0], jb.row_bytes);
    if (jb.nb % 8) quant_group_row<T, 0>(w, full, static_cast<int>(jb.nb % 8), q, x[0], acc[0], jb.row_bytes);
    for (int c = 0; c < C; ++c) out.put(0, c, lanes8(acc[0][c]));
    return;
  }
  __m512 acc2[R][C / 2];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < C / 2; ++p) acc2[r][p] = _mm512_setzero_ps();
  for (int64_t g = 0; g < full; ++g) quant_group512<T, R, 8, G>(w, g, 8, x, acc2, jb.row_bytes);
  constexpr bool short_tails = T == Q8_0 || (G && (T == Q4_0 || T == Q4_1));
  const bool tail_apart = short_tails && short_tail_of(jb.nb);
  if (jb.nb % 8 && !tail_apart) quant_group512<T, R, 0, G>(w, full, static_cast<int>(jb.nb % 8), x, acc2, jb.row_bytes);
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < C / 2; ++p) {
      acc[r][2 * p] = _mm512_castps512_ps256(acc2[r][p]);
      acc[r][2 * p + 1] = _mm512_extractf32x8_ps(acc2[r][p], 1);
    }
  if constexpr (short_tails)
    if (tail_apart) return short_tail<T, R, G>(jb, w, x, acc, out);
#else
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t g = 0; g < full; ++g) quant_group<T, R, false, G>(w, g, 8, x, acc, jb.row_bytes);
  if constexpr (G && (T == Q4_0 || T == Q4_1 || T == Q8_0))
    if (short_tail_of(jb.nb)) return short_tail<T, R>(jb, w, x, acc, out);
  if constexpr (!k_quant(T))
    if (jb.nb % 8) quant_group<T, R, true, G>(w, full, static_cast<int>(jb.nb % 8), x, acc, jb.row_bytes);
#endif
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out.put(r, c, lanes8(acc[r][c]));
}

template <int64_t T, int R>
void float_tile(const Job& jb, const uint8_t* const* w, int64_t row0, const TileOut& out) {
  constexpr int C = COLS;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < jb.k; k += 8) {
    for (int c = 0; c < C; ++c) {
      __m256 v;
      if (T == F32) {
        v = _mm256_loadu_ps(reinterpret_cast<const float*>(w[c]) + k);
        _mm_prefetch(reinterpret_cast<const char*>(w[c] + 4 * k + PREFETCH), _MM_HINT_T0);
      } else {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[c] + 2 * k));
        if ((k & 31) == 0) _mm_prefetch(reinterpret_cast<const char*>(w[c] + 2 * k + PREFETCH), _MM_HINT_T0);
        v = T == F16 ? _mm256_cvtph_ps(h) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      }
      for (int r = 0; r < R; ++r)
        acc[r][c] = _mm256_fmadd_ps(v, _mm256_loadu_ps(jb.xf + (row0 + r) * jb.k + k), acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out.put(r, c, lanes8(acc[r][c]));
}

// Rows in tiles of R, the R rows sharing each unpacked weight block; 64 rows at a time so that their
// activations stay in L2 while the chunk's columns pass.
template <int64_t T, int R, bool G = false>
void tile(const Job& jb, const uint8_t* const* w, const RowPtrs* x, int64_t row0, const TileOut& out) {
  if constexpr (is_float(T)) {
    // the float kernels keep all their accumulators in registers: at most 4 rows at a time
    for (int r = 0; r < R;) {
      const TileOut rows_out{out.at + r * out.stride, out.stride, out.valid};
      if (R - r >= 4) float_tile<T, 4>(jb, w, row0 + r, rows_out), r += 4;
      else if (R - r >= 2) float_tile<T, 2>(jb, w, row0 + r, rows_out), r += 2;
      else float_tile<T, 1>(jb, w, row0 + r, rows_out), r += 1;
    }
  } else {
    quant_tile<T, R, G>(jb, w, x, out);
  }
}

#if PASS_VNNI == 2
// The columns c0..c1 unpacked once per call for the many-row kernels, in panels of 16 columns (the last one
// repeats the last column): per panel and block, the 16 columns' levels (Q8_0's made unsigned) and the two
// scales their type uses, ws and wm (Q6_K: lo and hi), as scales[block][f * 16 + column], f = 0, 1: a fifth
// of the panel's bytes, not a third as all four were (2026-11-27, Zen 5: 1.01-1.04x the products at 16 rows a
// tile, 1B and Qwen3 4B matrices). by_step: levels as [step t][column][4 features], the
// layout a VPDPBUSD over 16 columns takes, and the blocks in the order vnni_columns reads them (lane j's blocks
// j, j + 8, ... one after another: slot j * groups + g, groups * 8 slots a panel), so that the block it
// prefetches is the next one in memory; else levels as [column][32 features], the layout AMX tiles take, in
// order of b. G: the columns' rows are grouped (group_blocks).
template <int64_t T, bool G>
void pack_panels(const Job& jb, int64_t c0, int64_t c1, std::vector<uint8_t>& levels16, std::vector<float>& scales,
                 bool by_step) {
  const int64_t nb = jb.nb, panels = (c1 - c0 + 15) / 16, groups = (nb + 7) / 8, slots = by_step ? groups * 8 : nb;
  levels16.resize(panels * slots * 512);
  scales.resize(panels * slots * 32);
  // 16 columns' 8 values each (a group's blocks, or a block's 4-feature words) as 8 vectors holding columns i and
  // i + 8, transposed: vector j then holds value j of columns 0 .. 15 in order, the panels' rows.
  for (int64_t p = 0; p < panels; ++p) {
    const uint8_t* w[16];
    for (int i = 0; i < 16; ++i) w[i] = jb.w + std::min(c0 + 16 * p + i, c1 - 1) * jb.row_bytes;
    uint8_t* lv16 = levels16.data() + p * slots * 512;
    float* sc16 = scales.data() + p * slots * 32;
    for (int64_t g = 0; g < groups; ++g) {
      const int nj = static_cast<int>(std::min<int64_t>(8, nb - g * 8));
      const auto slot = [&](int j) { return by_step ? j * groups + g : g * 8 + j; };
      __m512i first[8], second[8];  // ws, wm (Q6_K: lo, hi)
      const uint8_t* grouped_levels_at[16];  // grouped: where each column's group keeps its levels
      for (int i = 0; i < 8; ++i) {
        __m256 a[4], b[4];
        if constexpr (G) {
          grouped_levels_at[i] = grouped_scales<T>(w[i], g, nj, a[0], a[1], a[2], a[3]);
          grouped_levels_at[i + 8] = grouped_scales<T>(w[i + 8], g, nj, b[0], b[1], b[2], b[3]);
        } else {
          meta<T>(w[i], g, nj, a[0], a[1], a[2], a[3]);
          meta<T>(w[i + 8], g, nj, b[0], b[1], b[2], b[3]);
        }
        constexpr int f = T == Q6_K ? 2 : 0;
        first[i] = _mm512_castps_si512(join(a[f], b[f]));
        second[i] = _mm512_castps_si512(join(a[f + 1], b[f + 1]));
      }
      transpose8x2(first);
      transpose8x2(second);
      for (int j = 0; j < nj; ++j) {
        _mm512_storeu_si512(sc16 + slot(j) * 32, first[j]);
        _mm512_storeu_si512(sc16 + slot(j) * 32 + 16, second[j]);
      }
      if constexpr (G) {
        if (by_step && nj == 8) {  // the steps as stored: column i's step t of the 8 blocks in one load
          __m256i steps[16][8];
          for (int i = 0; i < 16; ++i) unpack_steps<T>(grouped_levels_at[i], steps[i]);
          for (int t = 0; t < 8; ++t) {
            __m512i v[8];
            for (int i = 0; i < 8; ++i) v[i] = join(steps[i][t], steps[i + 8][t]);
            transpose8x2(v);  // v[j]: block j's step t of columns 0 .. 15
            for (int j = 0; j < 8; ++j) {
              if constexpr (T == Q8_0) v[j] = _mm512_xor_si512(v[j], _mm512_set1_epi8(static_cast<char>(0x80)));
              _mm512_storeu_si512(lv16 + slot(j) * 512 + 64 * t, v[j]);
            }
          }
          continue;
        }
      }
      for (int j = 0; j < nj; ++j) {
        uint8_t* block = lv16 + slot(j) * 512;
        const auto unsigned_levels = [&](int i) {
          __m256i v;  // a grouped short group's levels: block after block
          if constexpr (!G) v = levels<T>(w[i], g, j);
          else if (nj == 8) v = grouped_levels<T>(w[i], g, j);
          else v = short_group_levels<T>(grouped_levels_at[i], j);
          return T == Q8_0 ? _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80))) : v;
        };
        if (by_step) {
          __m512i v[8];
          for (int i = 0; i < 8; ++i) v[i] = join(unsigned_levels(i), unsigned_levels(i + 8));
          transpose8x2(v);
          for (int t = 0; t < 8; ++t) _mm512_storeu_si512(block + 64 * t, v[t]);
        } else {
          for (int i = 0; i < 16; ++i) _mm256_storeu_si256(reinterpret_cast<__m256i*>(block + 32 * i), unsigned_levels(i));
        }
      }
    }
  }
}

// Q4_0, Q4_1 and Q8_0 in the panel layout (blocks.h panel_blocks, the _P16 types): a slot holds one block index
// of 16 columns, so that the tiles below take its 8 steps for the 16 columns in one 512-bit VPDPBUSD each (lane
// i: column i), Q4's unpacked from nibbles with a mask and a shift, where the grouped layout's tiles of 4 columns
// transposed each group and summed each (row, column)'s 8 lanes alone. Lane j of a row's 8 vectors of sums
// takes its blocks j, j + 8, ... in order with the fp32 operations of every path, then lane_sum adds the 8: the
// same bits.
constexpr int64_t p16_slot_bytes(int64_t t) { return 16 * (t == Q4_0 ? 18 : t == Q4_1 ? 20 : 34); }

// A slot's 8 steps of 4 features for its 16 columns, as vnni_columns' panels hold them (Q8_0's made unsigned),
// and their scales (wm: Q4_1's minimums).
template <int64_t T>
inline __attribute__((always_inline)) void p16_slot(const uint8_t* at, __m512i* v, __m512& ws, __m512& wm) {
  ws = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
  if constexpr (T == Q4_1) wm = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32)));
  else wm = _mm512_setzero_ps();
  const uint8_t* levels = at + (T == Q4_1 ? 64 : 32);
  if constexpr (T == Q8_0) {
    for (int t = 0; t < 8; ++t)
      v[t] = _mm512_xor_si512(_mm512_loadu_si512(levels + 64 * t), _mm512_set1_epi8(static_cast<char>(0x80)));
    return;
  }
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int q = 0; q < 4; ++q) {
    const __m512i packed = _mm512_loadu_si512(levels + 64 * q);
    v[q] = _mm512_and_si512(packed, low);
    v[q + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
  }
}

// vnni_columns' panels of columns c0..c1 (whole slabs of 16) from the panel layout: the slots unpacked in place.
template <int64_t T>
inline void pack_p16(const Job& jb, int64_t c0, int64_t c1, std::vector<uint8_t>& levels16, std::vector<float>& scales) {
  const int64_t nb = jb.nb, panels = (c1 - c0 + 15) / 16, groups = (nb + 7) / 8, slots = groups * 8;
  levels16.resize(panels * slots * 512);
  scales.resize(panels * slots * 32);
  for (int64_t p = 0; p < panels; ++p) {
    const uint8_t* at = jb.w + (c0 / 16 + p) * 16 * jb.row_bytes;
    for (int64_t j = 0; j < 8; ++j)
      for (int64_t b = j; b < nb; b += 8, at += p16_slot_bytes(T)) {
        const int64_t slot = p * slots + j * groups + b / 8;
        __m512i v[8];
        __m512 ws, wm;
        p16_slot<T>(at, v, ws, wm);
        for (int t = 0; t < 8; ++t) _mm512_storeu_si512(levels16.data() + slot * 512 + 64 * t, v[t]);
        _mm512_storeu_ps(scales.data() + slot * 32, ws);
        _mm512_storeu_ps(scales.data() + slot * 32 + 16, wm);
      }
  }
}

// Many rows on AVX-512 without AMX (a prefill chunk): one 512-bit VPDPBUSD takes features 4t..4t+3 of a panel's
// 16 columns (pack_panels, by step) against one row's 4 activations broadcast, so that its 16 lanes are 16
// columns of one row and the fp32 work per block is a few instructions for 16 (row, column) chains, not for
// one. Each chain takes exactly the vector code's fp32 operations, lane j's blocks j, j + 8, ... in order,
// then the same sum of the 8 lanes: the same bits. Rows in tiles of 16 with their activations as the amx path
// takes them (tile_rows: the 16 rows' words of a block at fixed offsets from one pointer), so that the tile's
// 16 accumulators, a block's 8 level vectors and its scales stay in registers; a panel (40 KiB at K = 2048)
// comes from L2 once per 16 rows, its next block prefetched while one is summed. A block's dot runs as two
// chains of 4 VPDPBUSD, added (exact int32), not one of 8. 2026-11-27, AMD Zen 5, against 8-row tiles with
// row pointers and a chain of 8: Q4_K products 1.07-1.12x faster, Q6_K 1.20-1.24x; a 1B's 512-row prefill
// chunk 0.91x the time, Qwen3 4B's 0.90x (docs/performance.md).
template <int64_t T, bool G, bool P = false>
void vnni_columns(const Job& jb, int64_t c0, int64_t c1, int64_t rows16) {
  const Acts& a = *jb.a;
  const int64_t nb = jb.nb, panels = (c1 - c0 + 15) / 16, groups = (nb + 7) / 8;
  constexpr int sh = offset_shift(T);
  const int32_t *start = tile_start<T>(a), *start2 = a.tile_second5.data();
  thread_local std::vector<uint8_t> levels16;
  thread_local std::vector<float> scales;
  if constexpr (P) pack_p16<T>(jb, c0, c1, levels16, scales);
  else pack_panels<T, G>(jb, c0, c1, levels16, scales, true);
  alignas(64) float result[8][16][16];  // [lane j][row][column]
  for (int64_t r0 = 0; r0 < rows16; r0 += 16)
    for (int64_t p = 0; p < panels; ++p) {
      const uint8_t* lv16 = levels16.data() + p * groups * 8 * 512;
      const float* sc16 = scales.data() + p * groups * 8 * 32;
      for (int j = 0; j < 8; ++j) {
        __m512 acc[16];
        for (int m = 0; m < 16; ++m) acc[m] = _mm512_setzero_ps();
        for (int64_t b = j; b < nb; b += 8) {
          const int64_t slot = j * groups + b / 8;  // pack_panels' order: the next slot is the next block read
          __m512i lv[8];
          for (int t = 0; t < 8; ++t) lv[t] = _mm512_loadu_si512(lv16 + slot * 512 + 64 * t);
          const float* sc = sc16 + slot * 32;
          for (int t = 0; t < 8; ++t) _mm_prefetch(reinterpret_cast<const char*>(lv16 + (slot + 1) * 512 + 64 * t), _MM_HINT_T0);
          for (int t = 0; t < 2; ++t) _mm_prefetch(reinterpret_cast<const char*>(sc16 + (slot + 1) * 32 + 16 * t), _MM_HINT_T0);
          const __m512 s0 = _mm512_loadu_ps(sc), s1 = _mm512_loadu_ps(sc + 16);  // ws, wm (Q6_K: lo, hi)
          const int64_t to = (r0 / 16 * nb + b) * 16;  // the tile's block b in tile_rows' arrays
          const int8_t* q = a.qv.data() + to * 32;
          const float* d = a.tile_d.data() + to;
          const float* ds = a.tile_ds.data() + to;
#pragma GCC unroll 16
          for (int m = 0; m < 16; ++m) {
            const auto word = [&](int t) {  // row m's activations 4t..4t+3 of block b, broadcast
              int32_t w;
              std::memcpy(&w, q + 64 * t + 4 * m, 4);
              return _mm512_set1_epi32(w);
            };
            const __m512 dm = _mm512_set1_ps(d[m]);
            __m512i first = _mm512_setzero_si512(), second = _mm512_setzero_si512();
            if constexpr (sh >= 0 || T == Q8_0) first = _mm512_set1_epi32(start[to + m]);
            if constexpr (T == Q6_K) second = _mm512_set1_epi32(start2[to + m]);
            for (int t = 0; t < 4; ++t) first = _mm512_dpbusd_epi32(first, lv[t], word(t));
            for (int t = 4; t < 8; ++t) second = _mm512_dpbusd_epi32(second, lv[t], word(t));
            if constexpr (T == Q6_K) {
              acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(first), _mm512_mul_ps(s0, dm), acc[m]);
              acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(second), _mm512_mul_ps(s1, dm), acc[m]);
            } else {
              const __m512i sum = _mm512_add_epi32(first, second);
              acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(s0, dm), acc[m]);
            }
            if constexpr (has_min(T)) acc[m] = _mm512_fmadd_ps(s1, _mm512_set1_ps(ds[m]), acc[m]);
          }
        }
        for (int m = 0; m < 16; ++m) _mm512_store_ps(result[j][m], acc[m]);
      }
      const int64_t c = c0 + 16 * p;
      const __mmask16 valid = static_cast<__mmask16>((1u << std::min<int64_t>(16, c1 - c)) - 1);
      for (int m = 0; m < 16; ++m) {
        const __m512 sum = lane_sum([&](int j) { return _mm512_load_ps(result[j][m]); },
                                    [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); });
        _mm512_mask_storeu_ps(jb.out + (r0 + m) * jb.n_total + jb.col_offset + c, valid, sum);
      }
    }
}

// R rows (up to 8) of a slab of the panel layout: its slots read once, in the order they lie, the lines a slab
// and PREFETCH_IN_ORDER bytes ahead asked for as prefetch_in_order asks for a tile's (to L2 past IN_L1_AHEAD);
// per row a vector of sums for each lane j of the 8, then their sum.
template <int64_t T, int R>
void p16_tile(const Job& jb, const uint8_t* slab, const RowPtrs* x, const TileOut& out) {
  constexpr int sh = offset_shift(T);
  const int64_t ahead = std::max<int64_t>(2 * PREFETCH_IN_ORDER, 16 * jb.row_bytes + PREFETCH_IN_ORDER);
  alignas(64) float lane[8][R][16];
  const uint8_t* at = slab;
  for (int j = 0; j < 8; ++j) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = j; b < jb.nb; b += 8, at += p16_slot_bytes(T)) {
      const char* next = reinterpret_cast<const char*>(at + ahead);
      for (int l = 0; l < p16_slot_bytes(T); l += 64)
        if (ahead <= IN_L1_AHEAD) _mm_prefetch(next + l, _MM_HINT_T0);
        else _mm_prefetch(next + l, _MM_HINT_T1);
      __m512i v[8];
      __m512 ws, wm;
      p16_slot<T>(at, v, ws, wm);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* q = x[r].q + b * QK;
        const auto word = [&](int t) {  // activations 4t..4t+3 of block b, broadcast
          int32_t w;
          std::memcpy(&w, q + 4 * t, 4);
          return _mm512_set1_epi32(w);
        };
        // the offsets Q4_0 (8) and Q8_0 (128, made unsigned) add to their levels, taken off first
        __m512i first = T == Q4_1 ? _mm512_setzero_si512() : _mm512_set1_epi32(x[r].sums[b] * (sh >= 0 ? 1 << sh : 128));
        __m512i second = _mm512_setzero_si512();
        for (int t = 0; t < 4; ++t) first = _mm512_dpbusd_epi32(first, v[t], word(t));
        for (int t = 4; t < 8; ++t) second = _mm512_dpbusd_epi32(second, v[t], word(t));
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(first, second));
        acc[r] = _mm512_fmadd_ps(sum, _mm512_mul_ps(ws, _mm512_set1_ps(x[r].d[b])), acc[r]);
        if constexpr (T == Q4_1) acc[r] = _mm512_fmadd_ps(wm, _mm512_set1_ps(x[r].ds[b]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm512_store_ps(lane[j][r], acc[r]);
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << out.valid) - 1);
  for (int r = 0; r < R; ++r)
    _mm512_mask_storeu_ps(out.at + r * out.stride, valid,
                          lane_sum([&](int j) { return _mm512_load_ps(lane[j][r]); },
                                   [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); }));
}

// A paneled part's columns c0..c1 (whole slabs: the parts' rows and the chunks' first columns are multiples of
// 16): whole tiles of 16 rows from PANEL_ROWS rows in vnni_columns' panels, the rest in p16_tiles of up to 8.
template <int64_t T>
void run_p16(const Job& jb, int64_t c0, int64_t c1) {
  const int64_t nrows = jb.a->rows, slab_bytes = 16 * jb.row_bytes;
  int64_t first_row = 0;
  if (nrows >= PANEL_ROWS) {
    first_row = nrows / 16 * 16;
    vnni_columns<T, false, true>(jb, c0, c1, first_row);
  }
  constexpr int64_t ROW_BLOCK = 64;
  RowPtrs x[ROW_BLOCK];
  for (int64_t rb = first_row; rb < nrows; rb += ROW_BLOCK) {
    const int64_t re = std::min(nrows, rb + ROW_BLOCK);
    for (int64_t r = rb; r < re; ++r) x[r - rb] = row_ptrs(*jb.a, r);
    for (int64_t c = c0; c < c1; c += 16) {
      const uint8_t* slab = jb.w + c / 16 * slab_bytes;
      const int valid = static_cast<int>(std::min<int64_t>(16, c1 - c));
      for (int64_t r = rb; r < re;) {
        const int R = static_cast<int>(std::min<int64_t>(8, re - r));
        const RowPtrs* xr = x + (r - rb);
        const TileOut out{jb.out + r * jb.n_total + jb.col_offset + c, jb.n_total, valid};
        switch (R) {
          case 8: p16_tile<T, 8>(jb, slab, xr, out); break;
          case 7: p16_tile<T, 7>(jb, slab, xr, out); break;
          case 6: p16_tile<T, 6>(jb, slab, xr, out); break;
          case 5: p16_tile<T, 5>(jb, slab, xr, out); break;
          case 4: p16_tile<T, 4>(jb, slab, xr, out); break;
          case 3: p16_tile<T, 3>(jb, slab, xr, out); break;
          case 2: p16_tile<T, 2>(jb, slab, xr, out); break;
          default: p16_tile<T, 1>(jb, slab, xr, out);
        }
        r += R;
      }
    }
  }
}
#endif

#if PASS_VNNI == 0
// AVX2's many-row kernel (a prefill chunk). The columns are unpacked once per call into panels of 8, per block
// [step t][column][4 features] (256 bytes) and the block's two scales for the 8 columns (ws, wm; Q6_K lo, hi),
// so that VPMADDUBSW takes features 4t..4t+3 of 8 columns against one row's 4 activations broadcast: each
// int32 lane is one column, and a block's fp32 work is a few instructions for 8 (row, column) chains where the
// tiles spend them on one chain and transpose every block again for each 8 rows. Lane j's accumulators (blocks
// j, j + 8, ...) are a vector per row, kept in L1 (acc): the same fp32 operations in the same order as every
// path, then the same sum of the 8 lanes, so the same bits. Q8_0 (signed levels) stays on the tiles. Rows in
// tiles of M = 8 (16: 0.96x, 4: 0.87-0.99x). 2026-11-27, AMD Zen 3, 512 rows against the 8-row tiles: the 1B's
// Q4_K products 1.33-1.52x as fast, Q6_K 1.30-1.53x (docs/performance.md).
template <int64_t T, bool G>
void avx2_pack(const Job& jb, int64_t c0, int64_t c1, std::vector<uint8_t>& levels8, std::vector<float>& scales) {
  const int64_t nb = jb.nb, panels = (c1 - c0 + 7) / 8, groups = (nb + 7) / 8;
  levels8.resize(panels * nb * 256);
  scales.resize(panels * nb * 16);
  for (int64_t p = 0; p < panels; ++p) {
    const uint8_t* w[8];
    for (int i = 0; i < 8; ++i) w[i] = jb.w + std::min(c0 + 8 * p + i, c1 - 1) * jb.row_bytes;  // repeats the last
    uint8_t* lv = levels8.data() + p * nb * 256;
    float* sc = scales.data() + p * nb * 16;
    for (int64_t g = 0; g < groups; ++g) {
      const int nj = static_cast<int>(std::min<int64_t>(8, nb - g * 8));
      __m256i first[8], second[8];  // per column its group's 8 scales, transposed into per block its 8 columns'
      const uint8_t* grouped_levels_at[8];  // grouped: where each column's group keeps its levels
      for (int i = 0; i < 8; ++i) {
        __m256 f[4];
        if constexpr (G) grouped_levels_at[i] = grouped_scales<T>(w[i], g, nj, f[0], f[1], f[2], f[3]);
        else meta<T>(w[i], g, nj, f[0], f[1], f[2], f[3]);
        constexpr int at = T == Q6_K ? 2 : 0;
        first[i] = _mm256_castps_si256(f[at]), second[i] = _mm256_castps_si256(f[at + 1]);
      }
      transpose8(first);
      transpose8(second);
      for (int j = 0; j < nj; ++j) {
        const int64_t b = g * 8 + j;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(sc + b * 16), first[j]);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(sc + b * 16 + 8), second[j]);
        __m256i v[8];
        for (int i = 0; i < 8; ++i)  // a grouped short group's levels: block after block
          v[i] = !G ? levels<T>(w[i], g, j) : nj == 8 ? grouped_levels<T>(w[i], g, j)
                                                   : nibbles32(grouped_levels_at[i] + 16 * j);
        transpose8(v);
        for (int t = 0; t < 8; ++t) _mm256_storeu_si256(reinterpret_cast<__m256i*>(lv + b * 256 + 32 * t), v[t]);
      }
    }
  }
}

template <int64_t T, int M, bool G>
void avx2_columns(const Job& jb, int64_t c0, int64_t c1, int64_t rows) {
  const Acts& a = *jb.a;
  const int64_t nb = jb.nb, panels = (c1 - c0 + 7) / 8;
  constexpr int sh = offset_shift(T);
  thread_local std::vector<uint8_t> levels8;
  thread_local std::vector<float> scales;
  avx2_pack<T, G>(jb, c0, c1, levels8, scales);
  alignas(32) float acc[8][M][8];  // [lane j][row][column]
  for (int64_t r0 = 0; r0 < rows; r0 += M)
    for (int64_t p = 0; p < panels; ++p) {
      const uint8_t* lv8 = levels8.data() + p * nb * 256;
      const float* sc8 = scales.data() + p * nb * 16;
      std::memset(acc, 0, sizeof(acc));
      for (int64_t b = 0; b < nb; ++b) {
        __m256i lv[8];
        for (int t = 0; t < 8; ++t) lv[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lv8 + b * 256 + 32 * t));
        const __m256 s0 = _mm256_loadu_ps(sc8 + b * 16), s1 = _mm256_loadu_ps(sc8 + b * 16 + 8);
        float(*lane)[8] = acc[b % 8];
        for (int m = 0; m < M; ++m) {
          const int64_t at = (r0 + m) * a.nbp + b;
          const int8_t* q = a.q.data() + (r0 + m) * a.k + b * QK;
          const auto word = [&](int t) {  // the row's activations 4t..4t+3, broadcast
            int32_t v;  // VPBROADCASTD from memory; VBROADCASTSS ran the 1B's products 0.82-0.89x as fast (Zen 3)
            std::memcpy(&v, q + 4 * t, 4);
            return _mm256_set1_epi32(v);
          };
          const __m256 dm = _mm256_set1_ps(a.d[at]);
          __m256 l = _mm256_load_ps(lane[m]);
          if constexpr (T == Q6_K) {
            const __m256i first = dots<T, 4>(_mm256_set1_epi32(a.neg_first[at] * (1 << sh)), lv, word);
            const __m256i second = dots<T, 4>(_mm256_set1_epi32(a.neg_second[at] * (1 << sh)), lv + 4,
                                              [&](int t) { return word(t + 4); });
            l = _mm256_fmadd_ps(_mm256_cvtepi32_ps(first), _mm256_mul_ps(s0, dm), l);
            l = _mm256_fmadd_ps(_mm256_cvtepi32_ps(second), _mm256_mul_ps(s1, dm), l);
          } else {
            __m256i start = _mm256_setzero_si256();  // minus the offset times the row's sum of q
            if constexpr (sh >= 0) start = _mm256_set1_epi32(a.neg_sums[at] * (1 << sh));
            const __m256i sum = dots<T, 8>(start, lv, word);
            l = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(s0, dm), l);
          }
          if constexpr (has_min(T)) l = _mm256_fmadd_ps(s1, _mm256_set1_ps(a.ds[at]), l);
          _mm256_store_ps(lane[m], l);
        }
      }
      const int64_t c = c0 + 8 * p;
      const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(8, c1 - c))),
                                               _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      for (int m = 0; m < M; ++m) {
        const __m256 sum = lane_sum([&](int j) { return _mm256_load_ps(acc[j][m]); },
                                    [](__m256 x, __m256 y) { return _mm256_add_ps(x, y); });
        _mm256_maskstore_ps(jb.out + (r0 + m) * jb.n_total + jb.col_offset + c, valid, sum);
      }
    }
}
#endif

#if PASS_VNNI == 2 && defined(__linux__)
// AMX (the amx path): TDPBUSD gives 16 rows x 16 columns of one 32-feature block's exact dots at once, which
// then take exactly the fp32 operations of the vector code, per column in lane j = b % 8 (the same bits).
// The 16 columns' levels are packed once per call in the tiles' layout (4 features of one column per
// 32-bit word, 16 columns per 64-byte row) and serve every 16 rows.
#define AMX_TARGET __attribute__((target("avx2,fma,f16c,bmi2,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")))

bool amx_enable() {  // Linux hands out the tiles' state only on request (arch_prctl ARCH_REQ_XCOMP_PERM)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

template <int64_t T, bool G>
AMX_TARGET void amx_columns(const Job& jb, int64_t c0, int64_t c1, int64_t rows16) {
  const Acts& a = *jb.a;
  const int64_t nb = jb.nb;
  constexpr int sh = offset_shift(T);
  const int64_t panels = (c1 - c0 + 15) / 16;
  thread_local std::vector<uint8_t> levels16;  // per panel of 16 columns and block: 16 columns x 32 levels
  thread_local std::vector<float> scales;  // per panel and block: ws, wm (Q6_K: lo, hi) of each column
  pack_panels<T, G>(jb, c0, c1, levels16, scales, false);
  // TDPBUSD: a dots tile [16 columns][16 rows] int32 (from zero; the rows' -offset * sums are added in the
  // fp32 loop) += a levels tile (unsigned: [16 columns][32 or 16 features]) times an
  // activations tile (signed: [features / 4][16 rows x 4 features]). Blocks go through a ring of NT turns,
  // each with its own tiles, so that several blocks' tile work is in flight while one block's fp32 work runs.
  constexpr int NT = T == Q6_K ? 2 : 4;
  TileConfig cfg{};
  cfg.palette = 1;
  for (int i : {0, 1, 6, 7}) cfg.rows[i] = 16, cfg.colsb[i] = 64;
  for (int i : {2, 4}) cfg.rows[i] = 16, cfg.colsb[i] = T == Q6_K ? 16 : 32;
  for (int i : {3, 5}) cfg.rows[i] = T == Q6_K ? 4 : 8, cfg.colsb[i] = 64;
  _tile_loadconfig(&cfg);
  alignas(64) int32_t dots[NT][2][256];  // [turn][Q6_K's first, second 16 features][column x row]
  // the rows' -offset * sums per block, added to the dots (Q6_K: of the first and of the second 16 features)
  const int32_t *start = tile_start<T>(a), *start2 = a.tile_second5.data();
  const auto issue = [&](int64_t tile, int64_t p, int64_t b, int turn) AMX_TARGET {
    const uint8_t* lv = levels16.data() + (p * nb + b) * 512;
    const int8_t* qv = a.qv.data() + (tile * nb + b) * 512;
#define TORNCHAT_AMX_Q6(C0, C1, TURN)          \
    _tile_zero(C0);                            \
    _tile_zero(C1);                            \
    _tile_loadd(2, lv, 32);                    \
    _tile_loadd(3, qv, 64);                    \
    _tile_loadd(4, lv + 16, 32);               \
    _tile_loadd(5, qv + 256, 64);              \
    _tile_dpbusd(C0, 2, 3);                    \
    _tile_dpbusd(C1, 4, 5);                    \
    _tile_stored(C0, dots[TURN][0], 64);       \
    _tile_stored(C1, dots[TURN][1], 64);
#define TORNCHAT_AMX_ONE(C, A, B, TURN)        \
    _tile_zero(C);                             \
    _tile_loadd(A, lv, 32);                    \
    _tile_loadd(B, qv, 64);                    \
    _tile_dpbusd(C, A, B);                     \
    _tile_stored(C, dots[TURN][0], 64);
    if constexpr (T == Q6_K) {
      if (turn == 0) { TORNCHAT_AMX_Q6(0, 1, 0) } else { TORNCHAT_AMX_Q6(6, 7, 1 % NT) }
    } else {
      switch (turn) {
        case 0: TORNCHAT_AMX_ONE(0, 2, 3, 0) break;
        case 1: TORNCHAT_AMX_ONE(1, 4, 5, 1 % NT) break;
        case 2: TORNCHAT_AMX_ONE(6, 2, 3, 2 % NT) break;
        default: TORNCHAT_AMX_ONE(7, 4, 5, 3 % NT) break;
      }
    }
#undef TORNCHAT_AMX_ONE
#undef TORNCHAT_AMX_Q6
  };
  alignas(64) float result[8][16][16];  // [lane][column][row]
  // Each 16 rows' activations meet every panel of the unpacked columns, and write whole lines of out.
  for (int64_t r0 = 0; r0 < rows16; r0 += 16)
    for (int64_t p = 0; p < panels; ++p) {
    const int64_t tile = r0 / 16, c = c0 + 16 * p;
    const int valid = static_cast<int>(std::min<int64_t>(16, c1 - c));
    const float* sc16 = scales.data() + p * nb * 32;
    // Lane j's chain takes blocks j, j + 8, ... in order: one lane at a time keeps its 16 columns' chains
    // in registers.
    for (int j = 0; j < 8; ++j) {
      __m512 acc[16];
      for (int n = 0; n < 16; ++n) acc[n] = _mm512_setzero_ps();
      const int64_t count = j < nb ? (nb - j + 7) / 8 : 0;  // blocks j, j + 8, ...
      for (int64_t i = 0; i < std::min<int64_t>(NT - 1, count); ++i) issue(tile, p, j + 8 * i, static_cast<int>(i));
      for (int64_t i = 0; i < count; ++i) {
        const int turn = static_cast<int>(i % NT);
        if (i + NT - 1 < count) issue(tile, p, j + 8 * (i + NT - 1), static_cast<int>((i + NT - 1) % NT));
        const int64_t b = j + 8 * i;
        const int32_t* dot0 = dots[turn][0];
        const int32_t* dot1 = dots[turn][1];
        const int64_t to = (tile * nb + b) * 16;
        const __m512 d = _mm512_loadu_ps(a.tile_d.data() + to);
        const float* sc = sc16 + b * 32;
        __m512i offset = _mm512_setzero_si512(), offset2 = _mm512_setzero_si512();
        if constexpr (T == Q6_K) {
          offset = _mm512_loadu_si512(start + to);
          offset2 = _mm512_loadu_si512(start2 + to);
        } else if constexpr (sh >= 0 || T == Q8_0) {
          offset = _mm512_loadu_si512(start + to);
        }
#pragma GCC unroll 16
        for (int n = 0; n < 16; ++n) {
          if constexpr (T == Q6_K) {
            const __m512i first = _mm512_add_epi32(_mm512_load_si512(dot0 + 16 * n), offset);
            const __m512i second = _mm512_add_epi32(_mm512_load_si512(dot1 + 16 * n), offset2);
            acc[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(first), _mm512_mul_ps(_mm512_set1_ps(sc[n]), d), acc[n]);
            acc[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(second), _mm512_mul_ps(_mm512_set1_ps(sc[16 + n]), d), acc[n]);
          } else {
            const __m512i dot = _mm512_add_epi32(_mm512_load_si512(dot0 + 16 * n), offset);
            acc[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(_mm512_set1_ps(sc[n]), d), acc[n]);
          }
          if constexpr (has_min(T))
            acc[n] = _mm512_fmadd_ps(_mm512_set1_ps(sc[16 + n]), _mm512_loadu_ps(a.tile_ds.data() + to), acc[n]);
        }
      }
      for (int n = 0; n < 16; ++n) _mm512_store_ps(result[j][n], acc[n]);
    }
    for (int n = 0; n < valid; ++n) {
      _mm512_store_ps(result[0][n], lane_sum([&](int j) { return _mm512_load_ps(result[j][n]); },
                                             [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); }));
    }
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < valid; ++n) jb.out[(r0 + m) * jb.n_total + jb.col_offset + c + n] = result[0][n][m];
  }
  _tile_release();
}
#endif

template <int64_t T, bool G = false>
void run_type(const Job& jb, int64_t c0, int64_t c1) {
  const int64_t nrows = jb.a->rows;
  constexpr int64_t ROW_BLOCK = 64;
  int64_t first_row = 0;
#if PASS_VNNI == 2 && defined(__linux__)
  if constexpr (!is_float(T)) {
    if (jb.amx && nrows >= 16) {
      first_row = nrows / 16 * 16;
      amx_columns<T, G>(jb, c0, c1, first_row);
    }
  }
#endif
#if PASS_VNNI == 2
  if constexpr (!is_float(T)) {
    if (!jb.amx && nrows >= PANEL_ROWS) {
      first_row = nrows / 16 * 16;
      vnni_columns<T, G>(jb, c0, c1, first_row);
    }
  }
#endif
#if PASS_VNNI == 0
  if constexpr (!is_float(T) && T != Q8_0) {
    if (nrows >= AVX2_PANEL_ROWS) {
      first_row = nrows / AVX2_PANEL_M * AVX2_PANEL_M;
      avx2_columns<T, AVX2_PANEL_M, G>(jb, c0, c1, first_row);
    }
  }
#endif
  RowPtrs x[ROW_BLOCK];  // the block's rows' activations, once for all its tiles
  for (int64_t rb = first_row; rb < nrows; rb += ROW_BLOCK) {
    const int64_t re = std::min(nrows, rb + ROW_BLOCK);
    if constexpr (!is_float(T))
      for (int64_t r = rb; r < re; ++r) x[r - rb] = row_ptrs(*jb.a, r);
    for (int64_t c = c0; c < c1; c += COLS) {
      const uint8_t* w[COLS];
      for (int i = 0; i < COLS; ++i) w[i] = jb.w + std::min(c + i, c1 - 1) * jb.row_bytes;  // repeats the last
      const int valid = static_cast<int>(std::min<int64_t>(COLS, c1 - c));
      int64_t r = rb;
      while (r < re) {
        const int64_t left = re - r;
        // up to 8 rows in one tile of their own height: each weight block read and unpacked once
        const int R = left >= PASS_RMAX ? PASS_RMAX : left >= 8 ? 8 : static_cast<int>(left);
        const RowPtrs* xr = x + (r - rb);
        const TileOut out{jb.out + r * jb.n_total + jb.col_offset + c, jb.n_total, valid};
        if (R == PASS_RMAX) tile<T, PASS_RMAX, G>(jb, w, xr, r, out);
#if PASS_RMAX > 8
        else if (R == 8) tile<T, 8, G>(jb, w, xr, r, out);
#endif
        else if (R == 7) tile<T, 7, G>(jb, w, xr, r, out);
        else if (R == 6) tile<T, 6, G>(jb, w, xr, r, out);
        else if (R == 5) tile<T, 5, G>(jb, w, xr, r, out);
        else if (R == 4) tile<T, 4, G>(jb, w, xr, r, out);
        else if (R == 3) tile<T, 3, G>(jb, w, xr, r, out);
        else if (R == 2) tile<T, 2, G>(jb, w, xr, r, out);
        else tile<T, 1, G>(jb, w, xr, r, out);
        r += R;
      }
    }
  }
}

void run(const Job& jb, int64_t c0, int64_t c1) {
#if PASS_VNNI == 2
  if (jb.paneled) return jb.type == Q4_0 ? run_p16<Q4_0>(jb, c0, c1) : jb.type == Q4_1 ? run_p16<Q4_1>(jb, c0, c1)
                                         : run_p16<Q8_0>(jb, c0, c1);
#endif
  if (jb.grouped) {
    switch (jb.type) {
      case Q4_0: return run_type<Q4_0, true>(jb, c0, c1);
      case Q4_1: return run_type<Q4_1, true>(jb, c0, c1);
      case Q4_K: return run_type<Q4_K, true>(jb, c0, c1);
      case Q6_K: return run_type<Q6_K, true>(jb, c0, c1);
      default: return run_type<Q8_0, true>(jb, c0, c1);
    }
  }
  switch (jb.type) {
    case Q4_0: return run_type<Q4_0>(jb, c0, c1);
    case Q4_1: return run_type<Q4_1>(jb, c0, c1);
    case Q5_0: return run_type<Q5_0>(jb, c0, c1);
    case Q5_1: return run_type<Q5_1>(jb, c0, c1);
    case Q8_0: return run_type<Q8_0>(jb, c0, c1);
    case Q4_K: return run_type<Q4_K>(jb, c0, c1);
    case Q5_K: return run_type<Q5_K>(jb, c0, c1);
    case Q6_K: return run_type<Q6_K>(jb, c0, c1);
    case F32: return run_type<F32>(jb, c0, c1);
    case F16: return run_type<F16>(jb, c0, c1);
    case BF16: return run_type<BF16>(jb, c0, c1);
  }
}

}  // namespace PASS_NS
}  // namespace blocks_detail
}  // namespace tornchat

#endif  // TORNCHAT_BLOCKS_PASS
