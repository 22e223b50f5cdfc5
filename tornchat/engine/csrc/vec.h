// What fused.cpp's and attention.cpp's vector loops use: 16-lane vectors in GCC's vector extensions, their
// loads, a sum, a fused multiply-add, an exp and a sigmoid over them, and the instruction sets they are compiled
// for; and the checks and result tensors both files' operations share.
//
// Built without -march (the wheel must run on any x86-64), a loop is compiled once per path below and chosen at
// run time (attention.cpp's attend_path). The vectors spell out 16 lanes, so the lanes and every reduction's order
// are the same on each path, and setup.py builds with -ffp-contract=off on every architecture, so that the
// compiler fuses no product into a sum by itself: the fused multiply-adds are fmadd's, written out, and each path
// makes exactly those (x86's vector paths and aarch64 in one instruction, x86's baseline by libm's fmaf). Every
// path, on every architecture, gives the same bits.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#ifdef __aarch64__
#include <arm_neon.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#define VEC_X86 1
#define TARGET_AVX512 __attribute__((target("avx2,fma,avx512f")))
#define TARGET_AVX512BF16 __attribute__((target("avx2,fma,avx512f,avx512bf16")))
#define TARGET_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace {

using c10::BFloat16;

typedef float Vec __attribute__((vector_size(64)));  // 16 floats: one AVX-512 register
typedef int32_t IntVec __attribute__((vector_size(64)));
typedef uint32_t UintVec __attribute__((vector_size(64)));
typedef float Vec8 __attribute__((vector_size(32)));  // one AVX2 register
typedef int32_t IntVec8 __attribute__((vector_size(32)));
typedef uint32_t UintVec8 __attribute__((vector_size(32)));
typedef float Vec4 __attribute__((vector_size(16)));  // one SSE or NEON register
typedef int32_t IntVec4 __attribute__((vector_size(16)));
typedef uint32_t UintVec4 __attribute__((vector_size(16)));
constexpr int64_t LANES = 16;

// 16 lanes as two vectors of 8 (AVX2), or as halves of halves of 4 (SSE, NEON). GCC keeps a 16-lane vector
// that no register holds on the stack, moving it piece by piece: attention ran 6x slower on AVX2 than on
// AVX-512 that way. Each operation below is the 16-lane one on each half (lo: lanes 0 .. 7), so every lane
// gets the same bits.
template <typename H>
struct Halves {
  H lo, hi;
};

#define HALVES_OPERATOR(OP)                                                                                       \
  template <typename H>                                                                                           \
  inline __attribute__((always_inline)) auto operator OP(Halves<H> a, Halves<H> b) {                              \
    return Halves<decltype(a.lo OP b.lo)>{a.lo OP b.lo, a.hi OP b.hi};                                            \
  }                                                                                                               \
  template <typename H, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>>                         \
  inline __attribute__((always_inline)) auto operator OP(Halves<H> a, S b) {                                      \
    return Halves<decltype(a.lo OP b)>{a.lo OP b, a.hi OP b};                                                     \
  }                                                                                                               \
  template <typename H, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>>                         \
  inline __attribute__((always_inline)) auto operator OP(S a, Halves<H> b) {                                      \
    return Halves<decltype(a OP b.lo)>{a OP b.lo, a OP b.hi};                                                     \
  }
HALVES_OPERATOR(+)
HALVES_OPERATOR(-)
HALVES_OPERATOR(*)
HALVES_OPERATOR(/)
HALVES_OPERATOR(&)
HALVES_OPERATOR(<<)
HALVES_OPERATOR(>>)
HALVES_OPERATOR(<)
HALVES_OPERATOR(>)
HALVES_OPERATOR(>=)
#undef HALVES_OPERATOR

template <typename H>
inline __attribute__((always_inline)) Halves<H> operator-(Halves<H> a) { return {-a.lo, -a.hi}; }
template <typename H>
inline __attribute__((always_inline)) Halves<H>& operator+=(Halves<H>& a, Halves<H> b) {
  return a = a + b;
}

// A float vector type's int32 and uint32 vectors of as many lanes.
template <typename F> struct Lanes;
template <> struct Lanes<Vec> { using Int = IntVec; using Uint = UintVec; };
template <> struct Lanes<Vec8> { using Int = IntVec8; using Uint = UintVec8; };
template <> struct Lanes<Vec4> { using Int = IntVec4; using Uint = UintVec4; };
template <typename H> struct Lanes<Halves<H>> {
  using Int = Halves<typename Lanes<H>::Int>;
  using Uint = Halves<typename Lanes<H>::Uint>;
};

// mask ? a : b, lane by lane (mask: a comparison's result).
template <typename M, typename V>
inline __attribute__((always_inline)) V select(M mask, V a, V b) { return mask ? a : b; }
template <typename M, typename H>
inline __attribute__((always_inline)) Halves<H> select(Halves<M> mask, Halves<H> a, Halves<H> b) {
  return {select(mask.lo, a.lo, b.lo), select(mask.hi, a.hi, b.hi)};
}

// v's lanes as the type of like's (float <-> int32, toward zero).
template <typename V, typename To>
inline __attribute__((always_inline)) To convert_like(V v, To) { return __builtin_convertvector(v, To); }
template <typename H, typename To>
inline __attribute__((always_inline)) Halves<To> convert_like(Halves<H> v, Halves<To> like) {
  return {convert_like(v.lo, like.lo), convert_like(v.hi, like.hi)};
}

// Loads, stores and reinterpretations of 16 lanes, a half at a time for Halves: a copy of the whole struct goes
// through the stack in narrow pieces, and the wide load that follows them stalls.
template <typename V>
struct Io {
  static inline __attribute__((always_inline)) V load(const void* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static inline __attribute__((always_inline)) void store(void* p, V v) { std::memcpy(p, &v, sizeof v); }
  template <typename From>
  static inline __attribute__((always_inline)) V cast(From v) { return (V)v; }  // GCC's vector casts keep the bits
};
template <typename H>
struct Io<Halves<H>> {
  static inline __attribute__((always_inline)) Halves<H> load(const void* p) {
    return {Io<H>::load(p), Io<H>::load(static_cast<const char*>(p) + sizeof(H))};
  }
  static inline __attribute__((always_inline)) void store(void* p, Halves<H> v) {
    Io<H>::store(p, v.lo);
    Io<H>::store(static_cast<char*>(p) + sizeof(H), v.hi);
  }
  template <typename From>
  static inline __attribute__((always_inline)) Halves<H> cast(Halves<From> v) {
    return {Io<H>::cast(v.lo), Io<H>::cast(v.hi)};
  }
};
template <typename V>
inline __attribute__((always_inline)) V load_vec(const void* p) { return Io<V>::load(p); }
template <typename V>
inline __attribute__((always_inline)) void store_vec(void* p, V v) { Io<V>::store(p, v); }
template <typename To, typename From>
inline __attribute__((always_inline)) To bit_cast(From v) { return Io<To>::cast(v); }

// a * b + c, rounded once, lane by lane: the loops' only fused multiply-adds (see the top). x86's builtins, not
// the intrinsics: a lambda is compiled for the default target whatever encloses it, and an intrinsic may not be
// inlined there; the builtin expands where the lambda is inlined, in a function of the path's target.
template <typename F>
inline __attribute__((always_inline)) F fmadd(F a, F b, F c) {
#if defined(__aarch64__)
  if constexpr (sizeof(F) == 16) return (F)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
#elif defined(VEC_X86)
  if constexpr (sizeof(F) == 64) return __builtin_ia32_vfmaddps512_mask(a, b, c, (unsigned short)-1, 4);
  if constexpr (sizeof(F) == 32) return __builtin_ia32_vfmaddps256(a, b, c);
#endif
  // x86-64's baseline, which has no such instruction: libm's, a lane at a time
  F out;
  for (size_t i = 0; i < sizeof(F) / sizeof(float); ++i) out[i] = std::fma(a[i], b[i], c[i]);
  return out;
}
template <typename H>
inline __attribute__((always_inline)) Halves<H> fmadd(Halves<H> a, Halves<H> b, Halves<H> c) {
  return {fmadd(a.lo, b.lo, c.lo), fmadd(a.hi, b.hi, c.hi)};
}
// a in every lane, its bits kept. Written -(-a - 0): GCC 12 makes that one broadcast, where from a - 0 or from
// braces {a, a, ..} it built the vector a lane at a time (attention's AVX2 and AVX-512F loops 4-16x slower), and
// 0 + a would turn -0 into +0.
template <typename F>
inline __attribute__((always_inline)) F splat(float a) { return -(-a - F{}); }

inline float to_float(float v) { return v; }
inline float to_float(BFloat16 v) { return static_cast<float>(v); }

// The sum of 16 lanes in a fixed tree: lanes i and i + 8, then i and i + 4, then (0 + 2) + (1 + 3).
inline __attribute__((always_inline)) float sum(Vec4 b) { return (b[0] + b[2]) + (b[1] + b[3]); }
inline __attribute__((always_inline)) float sum(Vec8 a) {
  return sum(Vec4(__builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7)));
}
inline __attribute__((always_inline)) float sum(Vec v) {
  return sum(Vec8(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15)));
}
template <typename H>
inline __attribute__((always_inline)) float sum(Halves<H> v) { return sum(v.lo + v.hi); }

// exp(x) for x <= 0 (scores minus their maximum): 2^(x log2 e) as an integer power, set in the exponent
// bits, times a degree-6 polynomial in the fraction (least-squares fit of 2^f on [0, 1], relative error
// within fp32 rounding).
template <typename F>
inline __attribute__((always_inline)) F exp_nonpositive(F x) {
  const F floor_x = select(x > -87.0f, x, F{} - 87.0f);
  const F t = floor_x * 1.44269504089f;
  auto whole = convert_like(t, typename Lanes<F>::Int{});  // toward zero
  whole += convert_like(whole, F{}) > t;  // -1 where that rounded up: floor
  const F f = t - convert_like(whole, F{});
  F p = splat<F>(2.1683431e-4f);
  p = fmadd(p, f, splat<F>(1.2437946e-3f));
  p = fmadd(p, f, splat<F>(9.6799853e-3f));
  p = fmadd(p, f, splat<F>(5.5482150e-2f));
  p = fmadd(p, f, splat<F>(2.4023031e-1f));
  p = fmadd(p, f, splat<F>(6.9314691e-1f));
  p = fmadd(p, f, splat<F>(1.0f));
  return p * bit_cast<F>((whole + 127) << 23);
}

// 1 / (1 + exp(-s)), from exp_nonpositive of -|s|: exp(-|s|) / (1 + exp(-|s|)) where s < 0.
template <typename F>
inline __attribute__((always_inline)) F sigmoid(F s) {
  const auto negative = s < 0.0f;
  const F z = exp_nonpositive(select(negative, s, F{} - s));
  return select(negative, z, F{} + 1.0f) / (1.0f + z);
}

void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
}

// A result's tensor: out (Forward::forward's, where the layer before wrote the same result, dead by then) resized
// to sizes if it is not of them, or a new one where out is undefined. A new tensor costs about 0.3 us, and a
// layer makes a dozen.
at::Tensor result_tensor(at::Tensor out, at::IntArrayRef sizes, const at::TensorOptions& options) {
  if (!out.defined()) return at::empty(sizes, options);
  TORCH_CHECK(out.scalar_type() == options.dtype() && out.is_contiguous(), "out must be contiguous, of the result's dtype");
  if (out.sizes() != sizes) out.resize_(sizes);
  return out;
}

}  // namespace
