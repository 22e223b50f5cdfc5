// The aarch64 paths: arm_kernels.inc once with the Armv8.2 dot product (dotprod: SDOT; Neoverse N1 and later,
// Graviton 2 and later, Apple M1 and later, Cortex-A76 / Raspberry Pi 5) and once on Armv8.0's Advanced SIMD,
// which every aarch64 CPU has (neon: Cortex-A72 / Raspberry Pi 4, Graviton 1), where the generic path's one
// (row, column) at a time, its levels decoded again for every row, would run a 1B step in about a second.
//
// The same operations as the semantics in blocks.h, so the generic path's bits: each block's 32 levels minus the
// type's offset as signed bytes (they fit: -32..31 for Q6_K, -128..127 for Q8_0), their exact int32 dot with the
// row's quantized activations (SDOT, or multiplies to int16 and pairwise adds: a sum over 4 lanes either way, the
// lanes then added pairwise, exact), and per lane j = block j of a group the fp32 multiply and fused
// multiply-adds of the semantics, 4 lanes to a vector. A column's group is decoded once for a tile of up to 4
// rows. The file's layout only (a part in the grouped layout, which only the x86 paths are given, goes to the
// generic path, as do the float types).
#include "common.h"

#ifdef TORNCHAT_ARM
#include <arm_neon.h>
#ifdef __linux__
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

#define PASS_NS neon_path
#define PASS_DOT 0
#include "arm_kernels.inc"
#undef PASS_NS
#undef PASS_DOT

#ifdef TORNCHAT_ARM_DOTPROD
// SDOT in this pass's functions whatever the build's baseline (-march=armv8-a has none; with clang, only a baseline
// that has it: common.h); dispatch.cpp calls them only where the CPU has it, and every CPU with it implements
// Armv8.2 (GCC's arm_neon.h declares SDOT so).
#define PASS_NS dotprod_path
#define PASS_DOT 1
#ifndef __clang__
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod")
#endif
#include "arm_kernels.inc"
#ifndef __clang__
#pragma GCC pop_options
#endif
#undef PASS_NS
#undef PASS_DOT

namespace tornchat {
namespace blocks_detail {
namespace dotprod_path {

bool available() {
#if defined(__ARM_FEATURE_DOTPROD)
  return true;  // the build's baseline has it (Apple silicon's does)
#elif defined(__linux__) && defined(HWCAP_ASIMDDP)
  return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#else
  return false;
#endif
}

}  // namespace dotprod_path
}  // namespace blocks_detail
}  // namespace tornchat
#endif  // TORNCHAT_ARM_DOTPROD

#endif  // TORNCHAT_ARM
