// The generic path: plain C++, one (row, column) at a time, the same operations as the vector paths (the
// semantics in blocks.h): what a CPU without them runs, and the bits every other path is tested against.
#include "common.h"

namespace tornchat {
namespace blocks_detail {

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
