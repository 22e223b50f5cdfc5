// What fused.cpp and prefill.cpp share: 16-lane vectors in GCC's vector extensions, their loads, and how the
// loops over them are compiled.
//
// Built without -march (the wheel must run on any x86-64), the loops are cloned for AVX-512, AVX2 and
// baseline (target_clones, chosen at load time); the vectors spell out 16 lanes, so the lanes and every
// reduction's order are the same in each clone.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#ifndef CLONED  // a build may set it (-DCLONED=) to compile the loops for its own -march only
#if defined(__x86_64__) && defined(__linux__)
#define CLONED __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONED  // elsewhere (ARM, macOS) the compiler's default target
#endif
#endif

namespace {

using c10::BFloat16;

typedef float Vec __attribute__((vector_size(64)));  // 16 floats
typedef int32_t IntVec __attribute__((vector_size(64)));
typedef uint32_t UintVec __attribute__((vector_size(64)));
typedef uint16_t HalfVec __attribute__((vector_size(32)));
constexpr int64_t LANES = 16;

inline float to_float(float v) { return v; }
inline float to_float(BFloat16 v) { return static_cast<float>(v); }

inline __attribute__((always_inline)) Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline __attribute__((always_inline)) Vec load(const BFloat16* p) {  // bf16 is the top half of an fp32
  HalfVec halves;
  std::memcpy(&halves, p, sizeof halves);
  const UintVec bits = __builtin_convertvector(halves, UintVec) << 16;
  Vec v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
}

}  // namespace
