// What fused.cpp and prefill.cpp share: 16-lane vectors in GCC's vector extensions, their loads, a sum and an
// exp over them, and how the loops over them are compiled.
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

typedef float Vec8 __attribute__((vector_size(32)));
typedef float Vec4 __attribute__((vector_size(16)));

inline __attribute__((always_inline)) float sum(Vec v) {  // a fixed tree
  const Vec8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const Vec4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// exp(x) for x <= 0 (scores minus their maximum): 2^(x log2 e) as an integer power, set in the exponent
// bits, times a degree-6 polynomial in the fraction (least-squares fit of 2^f on [0, 1], relative error
// within fp32 rounding).
inline __attribute__((always_inline)) Vec exp_nonpositive(Vec x) {
  const Vec floor_x = x > -87.0f ? x : Vec{} - 87.0f;
  const Vec t = floor_x * 1.44269504089f;
  IntVec whole = __builtin_convertvector(t, IntVec);  // toward zero
  whole += (__builtin_convertvector(whole, Vec) > t);  // -1 where that rounded up: floor
  const Vec f = t - __builtin_convertvector(whole, Vec);
  Vec p = Vec{} + 2.1683431e-4f;
  p = p * f + 1.2437946e-3f;
  p = p * f + 9.6799853e-3f;
  p = p * f + 5.5482150e-2f;
  p = p * f + 2.4023031e-1f;
  p = p * f + 6.9314691e-1f;
  p = p * f + 1.0f;
  const IntVec bits = (whole + 127) << 23;
  Vec power;
  std::memcpy(&power, &bits, sizeof power);
  return p * power;
}

void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
}

}  // namespace
