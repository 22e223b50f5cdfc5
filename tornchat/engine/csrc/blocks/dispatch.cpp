// block_mm (blocks.h): the path chosen by CPUID or TORNCHAT_ISA, the activations quantized once per call (in
// plain C++ here, in vectors by the x86 paths), the columns cut into chunks the threads share (team::share:
// never K); and the Python bindings.
#include "common.h"

namespace tornchat {

using namespace blocks_detail;

namespace {

enum class Isa { generic, avx2, avxvnni, avx512vnni, amx, neon, dotprod };

const char* isa_name(Isa i) {
  switch (i) {
    case Isa::amx: return "amx";
    case Isa::avx512vnni: return "avx512vnni";
    case Isa::avxvnni: return "avxvnni";
    case Isa::avx2: return "avx2";
    case Isa::dotprod: return "dotprod";
    case Isa::neon: return "neon";
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
#ifdef TORNCHAT_ARM_DOTPROD
  if (dotprod_path::available()) out.push_back(Isa::dotprod);
#endif
#ifdef TORNCHAT_ARM
  out.push_back(Isa::neon);
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
          // The product rounded to fp32, then to the nearest integer, ties to even (the default rounding mode;
          // NaN is clamped to -127). No addition follows the product: rounding it by adding and subtracting
          // 1.5 * 2^23 let GCC fuse the product into the addition (one rounding, not two) where the target has a
          // fused multiply-add in its baseline, as aarch64 does, in the copies of this loop inlined into the
          // threads' loops and not in the one a single row calls: a row's bits then depended on the row count.
          float v = std::nearbyint(xb[i] * inverse);
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
#ifdef TORNCHAT_ARM_DOTPROD
      case Isa::dotprod: dotprod_path::run(jb, c0, c1); break;
#endif
#ifdef TORNCHAT_ARM
      case Isa::neon: neon_path::run(jb, c0, c1); break;
#endif
      default: generic_run(jb, c0, c1);
    }
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
