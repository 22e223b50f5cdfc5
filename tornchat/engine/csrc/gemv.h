// Decode-step matrix-vector products on int8 activations (gemv.cpp), for fused.cpp's DecodeStep and Python.
#pragma once
#include <ATen/ATen.h>

namespace tornchat {

// Whether this CPU runs the kernels below (AVX-512 VNNI and VBMI); where it does not, callers keep PyTorch's.
bool vnni_supported();

// x [rows, K] (fp32 or bf16) times packed int4 weights in PyTorch's AVX-512 CPU layout (quant.Int4Layout(64,
// halves)) with bf16 scales_and_zeros [K / 32, N, 2]: fp32 [rows, N]. See gemv.cpp for the semantics.
at::Tensor vnni_int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_and_zeros);

// x [rows, K] times int8 values [N, K] with a scale per row (fp32 or bf16 scales [N]): fp32 [rows, N].
at::Tensor vnni_int8_mm(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales);

}  // namespace tornchat
