// A row's bits on aarch64, alone and among other rows: block_mm on every GGML type the kernels read, on each of
// the paths the (emulated) CPU runs and against the generic path's, and attention
// over bf16 and fp32 caches, with and without a sliding window, on the machine's threads. Built and run under
// qemu-user by run.sh (no ARM machine is at hand); prints one line per check and exits 1 if any row differs.
// With a path argument it also writes attention's outputs over exact inputs there (exact_attention), for
// same_as_x86.py to compare with x86's.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "attention.h"
#include "blocks.h"

namespace {

// Random blocks of a type with sane fp16 scales: (type, bytes a block, values a block, offsets of its fp16 fields).
struct Layout {
  const char* name;
  int64_t type, bytes, values;
  std::vector<int> halves;
};

at::Tensor random_blocks(const Layout& t, int64_t n, int64_t k) {
  at::Tensor w = at::randint(0, 256, {n, k / t.values * t.bytes}, at::kByte);
  uint8_t* p = w.data_ptr<uint8_t>();
  const int64_t blocks = n * (k / t.values);
  // each fp16 field its own value, 2^-9 .. 2^-6, so that a scale taken for another (d for dmin) shows
  const at::Tensor halves = (at::rand({blocks, static_cast<int64_t>(t.halves.size())}) * 0.014 + 0.002).to(at::kHalf);
  const uint8_t* h = reinterpret_cast<const uint8_t*>(halves.data_ptr<at::Half>());
  for (int64_t b = 0; b < blocks; ++b)
    for (size_t i = 0; i < t.halves.size(); ++i) std::memcpy(p + b * t.bytes + t.halves[i], h + 2 * (b * t.halves.size() + i), 2);
  return w;
}

int rows_apart(const at::Tensor& together, const std::function<at::Tensor(int64_t)>& alone) {
  int differ = 0;
  for (int64_t r = 0; r < together.size(0); ++r) {
    const at::Tensor one = alone(r).contiguous(), row = together[r].contiguous();
    if (std::memcmp(one.data_ptr<float>(), row.data_ptr<float>(), row.numel() * 4) != 0) ++differ;
  }
  return differ;
}

// n values in [-1, 1) on a grid of 2^-11, from a multiplicative hash of their index: the same on any machine (no
// generator, no libm). same_as_x86.py makes them alike.
at::Tensor exact_values(int64_t n, int64_t seed) {
  const at::Tensor i = at::arange(n, at::kLong) + seed * 1000003;
  return at::floor_divide((i * 2654435761LL).remainder(4294967296LL), 1048576).to(at::kFloat) / 2048.0 - 1.0;
}

// Attention over exact_values, the cases same_as_x86.py lists in the same order: bf16 and fp32 caches with and
// without a window, and one whose scores' products are denormal (queries and keys of 2^-66), which every path
// flushes to zero. Returns their outputs, one after another.
at::Tensor exact_attention() {
  const int64_t heads = 8, kv_heads = 2, d = 64, capacity = 1216, start = 1100, count = 20;
  std::vector<at::Tensor> outs;
  int64_t seed = 0;
  for (const auto dtype : {at::kBFloat16, at::kFloat})
    for (const int64_t window : {int64_t{0}, int64_t{500}, int64_t{-1}}) {  // -1: denormal products
      const double tiny = window < 0 ? std::ldexp(1.0, -66) : 1.0;
      const at::Tensor keys = (exact_values(capacity * kv_heads * d, ++seed) * 4 * tiny).view({capacity, kv_heads, d}).to(dtype);
      const at::Tensor values = (exact_values(capacity * kv_heads * d, ++seed) * 4).view({capacity, kv_heads, d}).to(dtype);
      const at::Tensor q = (exact_values(count * heads * d, ++seed) * 4 * tiny).view({count, heads, d});
      outs.push_back(tornchat::attend(q, keys, values, start, window < 0 ? std::ldexp(1.0, 120) : 0.125,
                                      std::max<int64_t>(window, 0), "").flatten());
    }
  return at::cat(outs);
}

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(2);
  at::manual_seed(0);
  int failures = 0;
  const int64_t n = 48, rows = 300;
  const std::vector<Layout> layouts = {
      {"Q4_0", tornchat::Q4_0, 18, 32, {0}},        {"Q4_1", tornchat::Q4_1, 20, 32, {0, 2}},
      {"Q5_0", tornchat::Q5_0, 22, 32, {0}},        {"Q5_1", tornchat::Q5_1, 24, 32, {0, 2}},
      {"Q8_0", tornchat::Q8_0, 34, 32, {0}},        {"Q4_K", tornchat::Q4_K, 144, 256, {0, 2}},
      {"Q5_K", tornchat::Q5_K, 176, 256, {0, 2}},   {"Q6_K", tornchat::Q6_K, 210, 256, {208}},
  };
  const std::vector<std::string> isas = tornchat::block_isas();  // best first; "generic" last
  std::string names;
  for (const std::string& isa : isas) names += " " + isa;
  std::printf("block_mm paths:%s\n", names.c_str());
  for (const Layout& t : layouts)
    for (const int64_t k : {1024, 576}) {  // 576: the 135M's rows, whose last group of 32-blocks is short
      if (k % t.values) continue;
      const at::Tensor x = at::randn({rows, k}) * 3;
      const std::vector<at::Tensor> parts{random_blocks(t, n, k)};
      const std::vector<int64_t> types{t.type};
      const at::Tensor generic = tornchat::block_mm(x, parts, types, "generic");
      for (const std::string& isa : isas) {
        const at::Tensor together = tornchat::block_mm(x, parts, types, isa);
        const int differ = rows_apart(together, [&](int64_t r) {
          return tornchat::block_mm(x.slice(0, r, r + 1).contiguous(), parts, types, isa)[0];
        });
        // every path the generic path's bits, at row counts that leave each tile height's remainder
        int from_generic = rows_apart(together, [&](int64_t r) { return generic[r]; });
        for (const int64_t some : {2, 3, 5, 7}) {
          const at::Tensor few = tornchat::block_mm(x.slice(0, 0, some).contiguous(), parts, types, isa);
          from_generic += rows_apart(few, [&](int64_t r) { return generic[r]; });
        }
        std::printf("block_mm %s, K %lld, %s: %d of %lld rows differ alone from among %lld; %d differ from generic's\n",
                    t.name, (long long)k, isa.c_str(), differ, (long long)rows, (long long)rows, from_generic);
        failures += differ + from_generic;
      }
    }
  const int64_t heads = 8, kv_heads = 2, d = 64, capacity = 1216, start = 1100, count = 100;
  for (const auto dtype : {at::kBFloat16, at::kFloat})
    for (const int64_t window : {int64_t{0}, int64_t{500}}) {
      const at::Tensor keys = at::randn({capacity, kv_heads, d}).to(dtype);
      const at::Tensor values = at::randn({capacity, kv_heads, d}).to(dtype);
      const at::Tensor q = at::randn({count, heads, d});
      const at::Tensor together = tornchat::attend(q, keys, values, start, 0.125, window, "");
      const int differ = rows_apart(together, [&](int64_t r) {
        return tornchat::attend(q.slice(0, r, r + 1).contiguous(), keys, values, start + r, 0.125, window, "")[0];
      });
      std::printf("attend %s cache, window %lld: %d of %lld rows differ alone from among %lld\n",
                  dtype == at::kFloat ? "fp32" : "bf16", (long long)window, differ, (long long)count,
                  (long long)count);
      failures += differ;
    }
  if (argc > 1) {
    const at::Tensor out = exact_attention().contiguous();
    std::FILE* file = std::fopen(argv[1], "wb");
    const bool written = file && std::fwrite(out.data_ptr<float>(), 4, out.numel(), file) == size_t(out.numel());
    if (file) std::fclose(file);
    std::printf("attention over exact inputs: %lld values written to %s\n", (long long)out.numel(), argv[1]);
    failures += !written;
  }
  return failures ? 1 : 0;
}
