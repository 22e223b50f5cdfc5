// Matrix products on GGUF blocks as the file stores them (blocks.cpp), for fused.cpp's DecodeStep and Python.
//
// A weight matrix [N, K] is one or more parts stacked by rows, each part uint8 [N_i, row_bytes] in a GGML
// type (the type ids below are GGML's own). Activations are quantized per block of 32 input features to int8
// with an fp32 scale; each weight block's integer dot product with them is exact (int32), and the fp32 sums
// over blocks run in a fixed order per output, so a row's result has the same bits whatever the number of
// rows in the call and wherever the row sits in it (batch invariance). The float types are multiplied in
// fp32, each output's sum over K in a fixed order too.
#pragma once
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

namespace tornchat {

// GGML type ids (ggml.h's enum ggml_type).
enum GgmlType : int64_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
};

// The instruction-set paths this CPU runs, best first ("amx", "avx512vnni", "avxvnni", "avx2", "generic"):
// detected by CPUID (and, for AMX, the kernel's permission to use its tiles). Every path gives the same bits.
// The environment variable TORNCHAT_ISA names a lower one to use instead; one this CPU lacks is an error.
std::vector<std::string> block_isas();

// The path block_mm takes when none is named: the best of block_isas(), or TORNCHAT_ISA's.
std::string block_isa();

// x [rows, K] (fp32 or bf16) times the parts' [sum N_i, K] transposed: fp32 [rows, sum N_i]. isa: one of
// block_isas() or "" for block_isa(). Threads split the output columns, never K. out: where to write it (resized
// to [rows, sum N_i], its storage kept where large enough), or an undefined tensor for a new one.
at::Tensor block_mm(const at::Tensor& x, const std::vector<at::Tensor>& parts, const std::vector<int64_t>& types,
                    const std::string& isa, at::Tensor out = at::Tensor());

// Adds block_isas, block_isa and block_mm (without the GIL) to fused.cpp's Python module.
void define_blocks(pybind11::module_& m);

}  // namespace tornchat
