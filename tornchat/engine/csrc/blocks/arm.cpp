// The dotprod path: 64-bit ARM with the Armv8.2 dot product (SDOT: Neoverse N1 and later, Graviton 2 and later,
// Apple M1 and later, Cortex-A76 / Raspberry Pi 5), where the generic path's one (row, column) at a time, its
// levels decoded again for every row, ran a 1B step in about a second. The same operations as the semantics in
// blocks.h, so the generic path's bits: each block's 32 levels minus the type's offset as signed bytes (they fit:
// -32..31 for Q6_K, -128..127 for Q8_0), their exact int32 dot with the row's quantized activations by SDOT (each
// instruction sums 4 products per lane; the lanes are then added pairwise, exact), and per lane j = block j of a
// group the fp32 multiply and fused multiply-adds of the semantics, 4 lanes to a vector. A column's group is
// decoded once for a tile of up to 4 rows. The file's layout only (no grouped or panel layout is read here);
// float types take the generic path.
#include "common.h"

#ifdef TORNCHAT_ARM
#include <arm_neon.h>
#ifdef __linux__
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

// SDOT in this file's functions whatever the build's baseline (-march=armv8-a has none); dispatch.cpp calls them
// only where the CPU has it, and every CPU with it implements Armv8.2 (GCC's arm_neon.h declares SDOT so).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("dotprod"))), apply_to = function)
#else
#pragma GCC target("arch=armv8.2-a+dotprod")
#endif

namespace tornchat {
namespace blocks_detail {
namespace dotprod_path {

namespace {

constexpr int RMAX = 4;  // rows sharing a column's decoded group

// Block j of group g of a weight row in the file's layout: its levels minus the type's offset, features 0-15 in
// lo and 16-31 in hi (generic_levels' values).
template <int64_t T>
inline __attribute__((always_inline)) void levels(const uint8_t* row, int64_t g, int j, int8x16_t& lo, int8x16_t& hi) {
  const uint8x16_t low4 = vdupq_n_u8(0x0F);
  if constexpr (T == Q4_0 || T == Q4_1 || T == Q5_0 || T == Q5_1) {
    constexpr int64_t bytes = T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : 24;
    constexpr int64_t qs_at = T == Q4_0 ? 2 : T == Q4_1 ? 4 : T == Q5_0 ? 6 : 8;
    const uint8_t* blk = row + (g * 8 + j) * bytes;
    const uint8x16_t qs = vld1q_u8(blk + qs_at);
    uint8x16_t a = vandq_u8(qs, low4), b = vshrq_n_u8(qs, 4);
    if constexpr (T == Q5_0 || T == Q5_1) {  // feature i's fifth bit is bit i of qh
      uint8_t qh[4];
      std::memcpy(qh, blk + (T == Q5_0 ? 2 : 4), 4);
      static const uint8_t bit_of[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
      const uint8x16_t bit = vld1q_u8(bit_of), fifth = vdupq_n_u8(0x10);
      a = vorrq_u8(a, vandq_u8(vtstq_u8(vcombine_u8(vdup_n_u8(qh[0]), vdup_n_u8(qh[1])), bit), fifth));
      b = vorrq_u8(b, vandq_u8(vtstq_u8(vcombine_u8(vdup_n_u8(qh[2]), vdup_n_u8(qh[3])), bit), fifth));
    }
    constexpr int offset = T == Q4_0 ? 8 : T == Q5_0 ? 16 : 0;
    lo = vsubq_s8(vreinterpretq_s8_u8(a), vdupq_n_s8(offset));
    hi = vsubq_s8(vreinterpretq_s8_u8(b), vdupq_n_s8(offset));
  } else if constexpr (T == Q8_0) {
    const uint8_t* blk = row + (g * 8 + j) * 34;
    lo = vld1q_s8(reinterpret_cast<const int8_t*>(blk + 2));
    hi = vld1q_s8(reinterpret_cast<const int8_t*>(blk + 18));
  } else if constexpr (T == Q4_K || T == Q5_K) {
    // blocks 2i and 2i + 1 are the low and high nibbles of the same 32 bytes
    const uint8_t* sb = row + g * (T == Q4_K ? 144 : 176);
    const uint8_t* qs = sb + (T == Q4_K ? 16 : 48) + 32 * (j / 2);
    uint8x16_t a = vld1q_u8(qs), b = vld1q_u8(qs + 16);
    a = j % 2 ? vshrq_n_u8(a, 4) : vandq_u8(a, low4);
    b = j % 2 ? vshrq_n_u8(b, 4) : vandq_u8(b, low4);
    if constexpr (T == Q5_K) {  // feature i's fifth bit is bit j of qh[i]: moved to bit 4 (a negative count shifts right)
      const int8x16_t to_bit4 = vdupq_n_s8(static_cast<int8_t>(4 - j));
      const uint8x16_t fifth = vdupq_n_u8(0x10);
      a = vorrq_u8(a, vandq_u8(vshlq_u8(vld1q_u8(sb + 16), to_bit4), fifth));
      b = vorrq_u8(b, vandq_u8(vshlq_u8(vld1q_u8(sb + 32), to_bit4), fifth));
    }
    lo = vreinterpretq_s8_u8(a), hi = vreinterpretq_s8_u8(b);
  } else if constexpr (T == Q6_K) {
    // half j / 4 of the super-block: its 64 bytes ql (low nibbles for blocks 0, 1 of the half, high for 2, 3) and
    // 32 bytes qh (bit pair j % 4 of each byte: the level's bits 4 and 5)
    const uint8_t* sb = row + g * 210;
    const uint8_t* ql = sb + 64 * (j / 4) + 32 * (j % 2);
    const uint8_t* qh = sb + 128 + 32 * (j / 4);
    const int8x16_t to_bits45 = vdupq_n_s8(static_cast<int8_t>(4 - 2 * (j % 4)));
    const uint8x16_t bits45 = vdupq_n_u8(0x30);
    uint8x16_t a = vld1q_u8(ql), b = vld1q_u8(ql + 16);
    a = (j / 2) % 2 ? vshrq_n_u8(a, 4) : vandq_u8(a, low4);
    b = (j / 2) % 2 ? vshrq_n_u8(b, 4) : vandq_u8(b, low4);
    a = vorrq_u8(a, vandq_u8(vshlq_u8(vld1q_u8(qh), to_bits45), bits45));
    b = vorrq_u8(b, vandq_u8(vshlq_u8(vld1q_u8(qh + 16), to_bits45), bits45));
    lo = vsubq_s8(vreinterpretq_s8_u8(a), vdupq_n_s8(32));
    hi = vsubq_s8(vreinterpretq_s8_u8(b), vdupq_n_s8(32));
  }
}

// Group g's scales as decode_meta gives them, four blocks to a vector (h: blocks 4h .. 4h + 3): ws (a), wm (m),
// and Q6_K's sub-block scales split into lo (each block's first 16 features) and hi (its second 16). In vectors,
// where decode_meta's scalar bit work and fp16 conversions took about as many instructions as a row's dots of the
// group. The same products of the same exact values (fp16 widens exactly, in hardware): the same bits.
template <int64_t T>
inline __attribute__((always_inline)) void scales(const uint8_t* row, int64_t g, int nj, float32x4_t* ws,
                                                  float32x4_t* wm, float32x4_t* lo, float32x4_t* hi) {
  const auto halves = [](const uint8_t* p) {  // fp16 words at p, p + 2 widened (exactly) to lanes 0, 1
    uint32_t two;
    std::memcpy(&two, p, 4);
    return vcvt_f32_f16(vreinterpret_f16_u32(vdup_n_u32(two)));
  };
  const auto widen = [](uint8x8_t b, float32x4_t& first, float32x4_t& second) {  // 8 unsigned bytes to fp32
    const uint16x8_t w = vmovl_u8(b);
    first = vcvtq_f32_u32(vmovl_u16(vget_low_u16(w))), second = vcvtq_f32_u32(vmovl_u16(vget_high_u16(w)));
  };
  if constexpr (T == Q4_K || T == Q5_K) {
    // the 12 scale bytes as three words u0 u1 u2: sc = u0 & 63 (blocks 0-3), (u2 & 15) | (u0 >> 6) << 4 (4-7);
    // mn = u1 & 63, (u2 >> 4) | (u1 >> 6) << 4, byte by byte
    const uint8_t* sb = row + g * (T == Q4_K ? 144 : 176);
    uint32_t u[3];
    std::memcpy(u, sb + 4, 12);
    const uint32_t sc_low = u[0] & 0x3f3f3f3f, mn_low = u[1] & 0x3f3f3f3f;
    const uint32_t sc_high = (u[2] & 0x0f0f0f0f) | ((u[0] >> 6) & 0x03030303) << 4;
    const uint32_t mn_high = ((u[2] >> 4) & 0x0f0f0f0f) | ((u[1] >> 6) & 0x03030303) << 4;
    const uint32x2_t sc = vset_lane_u32(sc_high, vdup_n_u32(sc_low), 1), mn = vset_lane_u32(mn_high, vdup_n_u32(mn_low), 1);
    const float32x4_t d_dmin = halves(sb);
    const float d = vgetq_lane_f32(d_dmin, 0), dmin = vgetq_lane_f32(d_dmin, 1);
    float32x4_t f[2];
    widen(vreinterpret_u8_u32(sc), f[0], f[1]);
    for (int h = 0; h < 2; ++h) ws[h] = vmulq_n_f32(f[h], d);
    widen(vreinterpret_u8_u32(mn), f[0], f[1]);
    for (int h = 0; h < 2; ++h) wm[h] = vmulq_f32(vdupq_n_f32(-dmin), f[h]);
  } else if constexpr (T == Q6_K) {
    const uint8_t* sb = row + g * 210;
    const float d = vgetq_lane_f32(halves(sb + 206), 1);  // the super-block's last 2 bytes
    const int8x16_t sc = vld1q_s8(reinterpret_cast<const int8_t*>(sb + 192));  // sub-block 2j + e: block j's half e
    const int16x8_t w[2] = {vmovl_s8(vget_low_s8(sc)), vmovl_s8(vget_high_s8(sc))};
    for (int h = 0; h < 2; ++h) {
      const float32x4_t a = vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(w[h]))), d);
      const float32x4_t b = vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_high_s16(w[h]))), d);
      lo[h] = vuzp1q_f32(a, b), hi[h] = vuzp2q_f32(a, b);
    }
  } else {  // a scale (and minimum) per block: fp16 words gathered, widened by the hardware's exact conversion
    constexpr int64_t bytes = T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : T == Q5_1 ? 24 : 34;
    constexpr bool with_min = T == Q4_1 || T == Q5_1;
    uint16_t dh[8] = {0, 0, 0, 0, 0, 0, 0, 0}, mh[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // zero past the row's blocks
    for (int j = 0; j < nj; ++j) {
      const uint8_t* blk = row + (g * 8 + j) * bytes;
      std::memcpy(&dh[j], blk, 2);
      if constexpr (with_min) std::memcpy(&mh[j], blk + 2, 2);
    }
    for (int h = 0; h < 2; ++h) {
      ws[h] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(dh + 4 * h)));
      wm[h] = with_min ? vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(mh + 4 * h))) : vdupq_n_f32(0.0f);
    }
  }
}

// Lanes [sum of a, sum of b, sum of c, sum of d] (exact int32).
inline __attribute__((always_inline)) int32x4_t lane_totals(int32x4_t a, int32x4_t b, int32x4_t c, int32x4_t d) {
  return vpaddq_s32(vpaddq_s32(a, b), vpaddq_s32(c, d));
}

// Group g of column `row` for R rows (NJ: 8 for a whole group, else 0 and nj its blocks): its levels and scales
// decoded once, then each row's dots and the semantics' fp32 operations, lanes 0-3 (blocks 0-3) in one vector
// and 4-7 in the other. A block's dot is one chain of two SDOT (exact int32); Q6_K's halves stay apart.
template <int64_t T, int R, int NJ>
inline __attribute__((always_inline)) void add_group(const Acts& a, const uint8_t* row, int64_t g, int nj, int64_t r0,
                                                     float32x4_t (*acc)[2]) {
  if (NJ) nj = NJ;
  float32x4_t ws[2], wm[2], lo[2], hi[2];
  scales<T>(row, g, nj, ws, wm, lo, hi);
  int8x16_t lv[8][2];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    if (j < nj) levels<T>(row, g, j, lv[j][0], lv[j][1]);
    else lv[j][0] = lv[j][1] = vdupq_n_s8(0);
  }
  for (int r = 0; r < R; ++r) {
    const int8_t* q = a.q.data() + (r0 + r) * a.k + g * 256;
    const int64_t at = (r0 + r) * a.nbp + g * 8;  // the row's scales, zero past nb (nbp)
    const float32x4_t d[2] = {vld1q_f32(a.d.data() + at), vld1q_f32(a.d.data() + at + 4)};
    int32x4_t first[8], second[8];  // per block (4 partial sums): all 32 features; Q6_K: features 0-15, 16-31
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      first[j] = second[j] = vdupq_n_s32(0);
      if (j >= nj) continue;  // nothing past the row's K is read
      first[j] = vdotq_s32(first[j], lv[j][0], vld1q_s8(q + 32 * j));
      if constexpr (T == Q6_K) second[j] = vdotq_s32(second[j], lv[j][1], vld1q_s8(q + 32 * j + 16));
      else first[j] = vdotq_s32(first[j], lv[j][1], vld1q_s8(q + 32 * j + 16));
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // blocks 4h .. 4h + 3
      const int32x4_t* f = first + 4 * h;
      const int32x4_t dots = lane_totals(f[0], f[1], f[2], f[3]);
      if constexpr (T == Q6_K) {  // each half-block's dot with its sub-block's scale, the first 16 features first
        const int32x4_t* s = second + 4 * h;
        acc[r][h] = vfmaq_f32(acc[r][h], vcvtq_f32_s32(dots), vmulq_f32(lo[h], d[h]));
        acc[r][h] = vfmaq_f32(acc[r][h], vcvtq_f32_s32(lane_totals(s[0], s[1], s[2], s[3])), vmulq_f32(hi[h], d[h]));
      } else {
        acc[r][h] = vfmaq_f32(acc[r][h], vcvtq_f32_s32(dots), vmulq_f32(ws[h], d[h]));
      }
      if constexpr (has_min(T)) acc[r][h] = vfmaq_f32(acc[r][h], wm[h], vld1q_f32(a.ds.data() + at + 4 * h));
    }
  }
}

// Rows r0 .. r0 + R of column c, group after group, then each row's 8 lanes summed as lane_sum sums them.
template <int64_t T, int R>
void column_rows(const Job& jb, int64_t c, int64_t r0) {
  const uint8_t* row = jb.w + c * jb.row_bytes;
  const int64_t full = jb.nb / 8;
  float32x4_t acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vdupq_n_f32(0.0f);
  for (int64_t g = 0; g < full; ++g) add_group<T, R, 8>(*jb.a, row, g, 8, r0, acc);
  if constexpr (!k_quant(T))  // a K-quant's row is whole super-blocks
    if (jb.nb % 8) add_group<T, R, 0>(*jb.a, row, full, static_cast<int>(jb.nb % 8), r0, acc);
  for (int r = 0; r < R; ++r) {  // ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
    const float32x4_t b = vaddq_f32(acc[r][0], acc[r][1]);
    const float32x2_t pairs = vadd_f32(vget_low_f32(b), vget_high_f32(b));
    jb.out[(r0 + r) * jb.n_total + jb.col_offset + c] = vget_lane_f32(pairs, 0) + vget_lane_f32(pairs, 1);
  }
}

template <int64_t T>
void run_type(const Job& jb, int64_t c0, int64_t c1) {
  const int64_t rows = jb.a->rows;
  for (int64_t c = c0; c < c1; ++c) {
    int64_t r = 0;
    for (; r + RMAX <= rows; r += RMAX) column_rows<T, RMAX>(jb, c, r);
    switch (rows - r) {
      case 3: column_rows<T, 3>(jb, c, r); break;
      case 2: column_rows<T, 2>(jb, c, r); break;
      case 1: column_rows<T, 1>(jb, c, r); break;
      default: break;
    }
  }
}

}  // namespace

bool available() {
#if defined(__ARM_FEATURE_DOTPROD)
  return true;  // the build's baseline has it (Apple silicon's does)
#elif defined(__linux__) && defined(HWCAP_ASIMDDP)
  return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#else
  return false;
#endif
}

void run(const Job& jb, int64_t c0, int64_t c1) {
  if (jb.grouped) return generic_run(jb, c0, c1);  // the x86 paths' layouts, read here as the generic path reads them
  switch (jb.type) {
    case Q4_0: return run_type<Q4_0>(jb, c0, c1);
    case Q4_1: return run_type<Q4_1>(jb, c0, c1);
    case Q5_0: return run_type<Q5_0>(jb, c0, c1);
    case Q5_1: return run_type<Q5_1>(jb, c0, c1);
    case Q8_0: return run_type<Q8_0>(jb, c0, c1);
    case Q4_K: return run_type<Q4_K>(jb, c0, c1);
    case Q5_K: return run_type<Q5_K>(jb, c0, c1);
    case Q6_K: return run_type<Q6_K>(jb, c0, c1);
    default: return generic_run(jb, c0, c1);  // the float types
  }
}

}  // namespace dotprod_path
}  // namespace blocks_detail
}  // namespace tornchat

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif  // TORNCHAT_ARM
