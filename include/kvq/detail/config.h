// kvq: configuration macros shared by C++, CUDA and Metal.
//
// This header is written in the C++14 subset that Metal Shading Language, CUDA and
// host C++ all accept. It defines the host/device decoration macros, the bit-cast
// helpers and the rounding barriers that keep kvq's numerics independent of the
// consumer's floating-point contraction flags.
#pragma once

#if defined(__METAL_VERSION__)
#  include <metal_stdlib>
#  define KVQ_METAL 1
#else
#  include <stdint.h>
#  if !defined(__CUDACC_RTC__)
#    include <math.h>
#  endif
#endif

// kvq's public headers are C++20 (concepts, defaulted comparisons): say so before anything else fails.
#if defined(__cplusplus) && !defined(__METAL_VERSION__) && !defined(__CUDACC_RTC__)
#  if defined(_MSVC_LANG) && !defined(__clang__)
#    define KVQ_CPLUSPLUS _MSVC_LANG
#  else
#    define KVQ_CPLUSPLUS __cplusplus
#  endif
#  if KVQ_CPLUSPLUS < 202002L
#    error "kvq requires C++20: compile with -std=c++20 (or /std:c++20); CUDA sources need nvcc -std=c++20"
#  endif
#endif

// Results may not depend on value-changing optimisations. GCC and clang announce the ones that
// change values through macros, and those are refused outright: -ffast-math (__FAST_MATH__),
// -ffinite-math-only / -fno-honor-nans+infinities (__FINITE_MATH_ONLY__), -fassociative-math
// (__ASSOCIATIVE_MATH__), -freciprocal-math (__RECIPROCAL_MATH__) and -fno-signed-zeros
// (__NO_SIGNED_ZEROS__); the last four are what -funsafe-math-optimizations turns on. Clang 14
// announces only the first two, so under clang kvq's own code is also compiled with precise
// floating point (#pragma float_control below), which undoes the others for kvq's code.
#if defined(__FAST_MATH__)
#  error "kvq: -ffast-math (__FAST_MATH__) changes kvq's numerics; compile kvq users without it"
#endif
#if defined(__FINITE_MATH_ONLY__) && __FINITE_MATH_ONLY__
#  error \
      "kvq: -ffinite-math-only (__FINITE_MATH_ONLY__) drops kvq's NaN and Inf semantics; compile kvq users without it"
#endif
#if defined(__ASSOCIATIVE_MATH__)
#  error \
      "kvq: -fassociative-math (__ASSOCIATIVE_MATH__, part of -funsafe-math-optimizations) changes kvq's numerics; compile kvq users without it"
#endif
#if defined(__RECIPROCAL_MATH__)
#  error \
      "kvq: -freciprocal-math (__RECIPROCAL_MATH__, part of -funsafe-math-optimizations) changes kvq's numerics; compile kvq users without it"
#endif
#if defined(__NO_SIGNED_ZEROS__)
#  error \
      "kvq: -fno-signed-zeros (__NO_SIGNED_ZEROS__, part of -funsafe-math-optimizations) changes kvq's stored bytes; compile kvq users without it"
#endif
#if defined(__FLT_EVAL_METHOD__) && (__FLT_EVAL_METHOD__ != 0) && !defined(__METAL_VERSION__)
#  error "kvq: float expressions must be evaluated in float (FLT_EVAL_METHOD 0); x87 excess precision is not supported"
#endif

// The instruction set the including translation unit is compiled for. Everything kvq defines lives
// in an inline namespace named after it (kvq::isa_avx512_vnni_..., reached as kvq::...), so
// translation units built with different -m flags never share an inline function: no ODR clash,
// and no AVX-512 code reached from a TU that was built for AVX2. The level picks the kernels; the
// tag (detail/isa_tag.h) adds every other instruction-set extension the compiler was allowed.
#if defined(__METAL_VERSION__) || defined(__CUDA_ARCH__)
#  define KVQ_ISA_NAME device
#else
// ---- kvq-embed: host-only begin ----
#  if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
      defined(__AVX512BF16__)
#    define KVQ_ISA_LEVEL_NAME avx512_vnni_bf16
#  elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#    define KVQ_ISA_LEVEL_NAME avx512_vnni
#  elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#    define KVQ_ISA_LEVEL_NAME avx512
#  elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#    define KVQ_ISA_LEVEL_NAME avx2
#  elif defined(__aarch64__) && defined(__ARM_NEON)
#    define KVQ_ISA_LEVEL_NAME neon
#  else
#    define KVQ_ISA_LEVEL_NAME scalar
#  endif
#  include "isa_tag.h"
// ---- kvq-embed: host-only end ----
#endif
#define KVQ_PP_CAT_(a, b) a##b
#define KVQ_PP_CAT(a, b) KVQ_PP_CAT_(a, b)
#if defined(__METAL_VERSION__)
#  define KVQ_NAMESPACE_BEGIN namespace kvq {
#  define KVQ_NAMESPACE_END }
#else
#  if defined(__clang__)
// Under clang, kvq's own code is compiled with precise floating point whatever the consumer's
// flags (-funsafe-math-optimizations, -fno-honor-nans, -freciprocal-math, ... are not announced
// by clang 14), and without FMA contraction, so its results equal those of any other build.
#    define KVQ_FP_PRECISE_BEGIN _Pragma("float_control(precise, on, push)") _Pragma("clang fp contract(off)")
#    define KVQ_FP_PRECISE_END _Pragma("float_control(pop)")
#  else
#    define KVQ_FP_PRECISE_BEGIN
#    define KVQ_FP_PRECISE_END
#  endif
#  define KVQ_NAMESPACE_BEGIN \
    KVQ_FP_PRECISE_BEGIN      \
    namespace kvq {           \
    inline namespace KVQ_PP_CAT(isa_, KVQ_ISA_NAME) {
#  define KVQ_NAMESPACE_END \
    }                       \
    }                       \
    KVQ_FP_PRECISE_END
#endif

#if defined(__CUDACC__)
#  define KVQ_HOST_DEVICE __host__ __device__ __forceinline__
#  define KVQ_DEVICE __device__ __forceinline__
#elif defined(__METAL_VERSION__)
#  define KVQ_HOST_DEVICE inline
#  define KVQ_DEVICE inline
#else
#  define KVQ_HOST_DEVICE inline
#  define KVQ_DEVICE inline
#endif

// Declares a namespace-scope constant: MSL requires program-scope variables to live in the
// `constant` address space, so `constexpr int x = 1;` alone does not compile as Metal.
#if defined(__METAL_VERSION__)
#  define KVQ_CONSTEXPR_VAR constant constexpr
#else
#  define KVQ_CONSTEXPR_VAR constexpr
#endif

KVQ_NAMESPACE_BEGIN
namespace detail {

#if defined(__METAL_VERSION__)
typedef uint u32;
typedef ushort u16;
typedef uchar u8;
typedef int i32;
#else
typedef uint32_t u32;
typedef uint16_t u16;
typedef uint8_t u8;
typedef int32_t i32;
#endif

/// Returns the IEEE-754 binary32 bit pattern of `x`.
KVQ_HOST_DEVICE u32 f32_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#elif defined(__METAL_VERSION__)
  return as_type<uint>(x);
#else
  return __builtin_bit_cast(u32, x);
#endif
}

/// Returns the float whose IEEE-754 binary32 bit pattern is `u`.
KVQ_HOST_DEVICE float f32_from_bits(u32 u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#elif defined(__METAL_VERSION__)
  return as_type<float>(u);
#else
  return __builtin_bit_cast(float, u);
#endif
}

/// Returns `x` unchanged but opaque to the optimiser, so it is rounded to float before use.
///
/// A product passed through this barrier cannot be contracted with a following addition
/// into a fused multiply-add, whatever `-ffp-contract` or `--fmad` says.
KVQ_HOST_DEVICE float fp_barrier(float x) {
#if defined(__CUDA_ARCH__) || defined(__METAL_VERSION__)
  return x;
#elif defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __asm__("" : "+x"(x));
  return x;
#elif defined(__GNUC__) && defined(__aarch64__)
  __asm__("" : "+w"(x));
  return x;
#elif defined(__GNUC__)
  __asm__("" : "+m"(x));
  return x;
#else
  volatile float v = x;
  return v;
#endif
}

/// Returns fl32(a * b): a product rounded to float that is never fused with a later add.
KVQ_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return fp_barrier(a * b);
#endif
}

/// Returns fl32(a + b).
KVQ_HOST_DEVICE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

/// Returns a * b + c: fused (one rounding) where the target has a fused multiply-add, else the
/// product rounded and then the sum; never left to the compiler's contraction flags, so a build
/// gives the same result with -ffp-contract=off and =fast.
KVQ_HOST_DEVICE float madd_f32(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#elif defined(__METAL_VERSION__)
  return fma(a, b, c);
#elif defined(__GNUC__) && (defined(__FP_FAST_FMAF) || defined(__FMA__) || defined(__ARM_FEATURE_FMA))
  return __builtin_fmaf(a, b, c);
#else
  return fp_barrier(a * b) + c;
#endif
}

/// Returns fl32(a / b), correctly rounded.
KVQ_HOST_DEVICE float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

/// Returns true when `x` is neither NaN nor infinite (bit test: immune to fast-math assumptions).
KVQ_HOST_DEVICE bool is_finite_f32(float x) { return (f32_bits(x) & 0x7f800000u) != 0x7f800000u; }

/// Returns true when `x` is a NaN (bit test).
KVQ_HOST_DEVICE bool is_nan_f32(float x) { return (f32_bits(x) & 0x7fffffffu) > 0x7f800000u; }

/// Returns |x| by clearing the sign bit.
KVQ_HOST_DEVICE float abs_f32(float x) { return f32_from_bits(f32_bits(x) & 0x7fffffffu); }

/// Rounds a finite float to the nearest integer, ties to even, independent of the rounding mode.
///
/// Requires |x| < 2^31; the result is returned as a float holding an integer value.
KVQ_HOST_DEVICE float round_half_even(float x) {
  const u32 u = f32_bits(x);
  const u32 a = u & 0x7fffffffu;
  if (a >= 0x4b000000u) return x;                              // |x| >= 2^23: already an integer
  if (a < 0x3f000000u) return f32_from_bits(u & 0x80000000u);  // |x| < 0.5: signed zero
  const int e = static_cast<int>(a >> 23) - 127;               // -1 .. 22
  const u32 m = (a & 0x007fffffu) | 0x00800000u;               // 24-bit significand
  const int shift = 23 - e;                                    // 1 .. 24 fractional bits
  u32 q = m >> shift;
  const u32 rem = m & ((1u << shift) - 1u);
  const u32 half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  const float r = static_cast<float>(static_cast<int>(q));
  return (u & 0x80000000u) ? -r : r;
}

/// Rounds a finite float to the nearest integer, ties away from zero (C `roundf`).
///
/// Requires |x| < 2^31; the result is returned as a float holding an integer value.
KVQ_HOST_DEVICE float round_half_away(float x) {
  const u32 u = f32_bits(x);
  const u32 a = u & 0x7fffffffu;
  if (a >= 0x4b000000u) return x;
  if (a < 0x3f000000u) return f32_from_bits(u & 0x80000000u);
  const int e = static_cast<int>(a >> 23) - 127;
  const u32 m = (a & 0x007fffffu) | 0x00800000u;
  const int shift = 23 - e;
  u32 q = m >> shift;
  const u32 rem = m & ((1u << shift) - 1u);
  if (rem >= (1u << (shift - 1))) ++q;
  const float r = static_cast<float>(static_cast<int>(q));
  return (u & 0x80000000u) ? -r : r;
}

}  // namespace detail
KVQ_NAMESPACE_END
