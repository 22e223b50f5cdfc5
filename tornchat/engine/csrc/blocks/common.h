// What the parts of the block kernels share (blocks.h is their contract): the types' block sizes, the
// activations quantized once per call (Acts), a kernel's job, the grouped layout's offsets, and each path's
// entry points. dispatch.cpp chooses a path and calls them; generic.cpp, x86.cpp, arm.cpp and layouts.cpp define
// them.
#pragma once

#include "../blocks.h"
#include "../team.h"

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
#if defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(TORNCHAT_GENERIC_ONLY)
#define TORNCHAT_ARM 1
// The dotprod pass (arm.cpp) needs SDOT in functions of its own target: GCC's arm_neon.h declares it so, clang's
// (14's, at least) only where the build's baseline has the dot product (as Apple's does).
#if !defined(__clang__) || defined(__ARM_FEATURE_DOTPROD)
#define TORNCHAT_ARM_DOTPROD 1
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

// One row of nb blocks of 32 values between the file's layout and the grouped one, either way (layouts.cpp).
void regroup_row(const uint8_t* from, uint8_t* to, int64_t nb, int64_t type, bool to_grouped);

// Columns c0..c1 of a job on the generic path (generic.cpp).
void generic_run(const Job& jb, int64_t c0, int64_t c1);

#ifdef TORNCHAT_X86
// The x86 paths (x86.cpp). quantize_row: row r of x into a, as dispatch.cpp's quantize_rows does it in plain
// C++ (the avxvnni path takes avx2's); run: columns c0..c1 of a job.
namespace avx2_path {
void quantize_row(const float* x, int64_t r, Acts& a);
void run(const Job& jb, int64_t c0, int64_t c1);
}  // namespace avx2_path
namespace avxvnni_path {
void run(const Job& jb, int64_t c0, int64_t c1);
}  // namespace avxvnni_path
namespace avx512vnni_path {
void quantize_row(const float* x, int64_t r, Acts& a);
void run(const Job& jb, int64_t c0, int64_t c1);
#ifdef __linux__
bool amx_enable();  // whether Linux lets this process use AMX's tiles (asked once)
#endif
}  // namespace avx512vnni_path
#endif

#ifdef TORNCHAT_ARM
// The aarch64 paths (arm.cpp): columns c0..c1 of a job with the Armv8.2 dot product (and whether this CPU has it)
// or on Advanced SIMD alone, which every aarch64 CPU has; the activations quantized as the generic path does.
#ifdef TORNCHAT_ARM_DOTPROD
namespace dotprod_path {
bool available();
void run(const Job& jb, int64_t c0, int64_t c1);
}  // namespace dotprod_path
#endif
namespace neon_path {
void run(const Job& jb, int64_t c0, int64_t c1);
}  // namespace neon_path
#endif

}  // namespace blocks_detail
}  // namespace tornchat
