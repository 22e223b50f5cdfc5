// The grouped and panel layouts (blocks.h group_blocks, panel_blocks): a part's rows rearranged in place into
// the layout a path reads, and a rearranged part's bytes as the file stores them.
#include "common.h"

namespace tornchat {
namespace blocks_detail {

// One row of nb blocks of 32 values between the file's layout and the grouped one, either way (to_grouped), by
// words: a block's fields and its levels' 4-byte steps each go to their place (Q4_K's nibbles change bytes: a
// file's 32 bytes hold sub-blocks 2c and 2c + 1 in their low and high nibbles, the grouped steps one sub-block's
// features 4t.. and 16 + 4t..).
void regroup_row(const uint8_t* from, uint8_t* to, int64_t nb, int64_t type, bool to_grouped) {
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

}  // namespace blocks_detail

using namespace blocks_detail;

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

}  // namespace tornchat
