// kvq benchmarks: the arithmetic peaks of the machine behind the attention roofline — f32 FMA and
// int8 dot-product throughput, each as independent accumulator chains at the widest vector width
// the compiler flags allow (AVX-512, AVX2, NEON; a scalar loop otherwise).
#pragma once

#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#  include <immintrin.h>
#endif
#if defined(__ARM_NEON)
#  include <arm_neon.h>
#endif

namespace kvq_bench {

/// Hides a value from the optimiser without an instruction, so work on it cannot be hoisted out of
/// a loop (GCC and Clang; elsewhere a no-op).
template <class T>
inline void opaque(T& x) noexcept {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__) || defined(__aarch64__))
  if constexpr (std::is_integral_v<T>) {
    __asm__ volatile("" : "+r"(x));
  } else {
#  if defined(__aarch64__)
    __asm__ volatile("" : "+w"(x));
#  else
    __asm__ volatile("" : "+v"(x));
#  endif
  }
#else
  (void)x;
#endif
}

/// Result of a peak loop: multiply-adds done and a value depending on all of them.
struct peak_result {
  double macs = 0;
  double checksum = 0;
};

/// `rounds` rounds of f32 fused multiply-adds on 16 independent accumulators (latency × ports of
/// every current core is below 16 vectors in flight).
inline auto fma_peak_loop(std::int64_t rounds) noexcept -> peak_result {
  constexpr int chains = 16;
#if defined(__AVX512F__)
  __m512 acc[chains];
  for (int i = 0; i < chains; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  __m512 const m = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-6f);
  for (std::int64_t r = 0; r < rounds; ++r)
    for (int i = 0; i < chains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], m, b);
  for (int i = 1; i < chains; ++i) acc[0] = _mm512_add_ps(acc[0], acc[i]);
  alignas(64) float lanes[16];  // summed through memory: GCC 12 warns inside _mm512_reduce_add_*
  _mm512_store_ps(lanes, acc[0]);
  double sum = 0;
  for (float x : lanes) sum += x;
  return {static_cast<double>(rounds) * chains * 16, sum};
#elif defined(__AVX2__) && defined(__FMA__)
  constexpr int ymm_chains = 12;  // 16 ymm registers: 12 chains and the two constants
  __m256 acc[ymm_chains];
  for (int i = 0; i < ymm_chains; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i));
  __m256 const m = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-6f);
  for (std::int64_t r = 0; r < rounds; ++r)
    for (int i = 0; i < ymm_chains; ++i) acc[i] = _mm256_fmadd_ps(acc[i], m, b);
  for (int i = 1; i < ymm_chains; ++i) acc[0] = _mm256_add_ps(acc[0], acc[i]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc[0]);
  double sum = 0;
  for (float x : lanes) sum += x;
  (void)chains;
  return {static_cast<double>(rounds) * ymm_chains * 8, sum};
#elif defined(__ARM_NEON) && defined(__aarch64__)
  float32x4_t acc[chains];
  for (int i = 0; i < chains; ++i) acc[i] = vdupq_n_f32(static_cast<float>(i));
  float32x4_t const m = vdupq_n_f32(0.999999f), b = vdupq_n_f32(1e-6f);
  for (std::int64_t r = 0; r < rounds; ++r)
    for (int i = 0; i < chains; ++i) acc[i] = vfmaq_f32(b, acc[i], m);
  for (int i = 1; i < chains; ++i) acc[0] = vaddq_f32(acc[0], acc[i]);
  return {static_cast<double>(rounds) * chains * 4, static_cast<double>(vaddvq_f32(acc[0]))};
#else
  float acc[chains];
  for (int i = 0; i < chains; ++i) acc[i] = static_cast<float>(i);
  for (std::int64_t r = 0; r < rounds; ++r) {
    for (int i = 0; i < chains; ++i) acc[i] = acc[i] * 0.999999f + 1e-6f;
    opaque(acc[0]);
  }
  double sum = 0;
  for (float x : acc) sum += x;
  return {static_cast<double>(rounds) * chains, sum};
#endif
}

/// `rounds` rounds of int8 dot products (u8 × s8 into int32) on 16 independent accumulators: VNNI
/// vpdpbusd where compiled in, else maddubs + madd (the sequence an AVX2/AVX-512BW kernel uses),
/// NEON sdot, or a scalar loop. One multiply-add of two int8 values counts as one MAC.
inline auto int8_peak_loop(std::int64_t rounds) noexcept -> peak_result {
  constexpr int chains = 16;
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  __m512i acc[chains];
  for (int i = 0; i < chains; ++i) acc[i] = _mm512_set1_epi32(i);
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  for (std::int64_t r = 0; r < rounds; ++r) {
    for (int i = 0; i < chains; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
    opaque(a);
  }
  for (int i = 1; i < chains; ++i) acc[0] = _mm512_add_epi32(acc[0], acc[i]);
  alignas(64) std::int32_t lanes[16];
  _mm512_store_si512(lanes, acc[0]);
  double sum = 0;
  for (std::int32_t x : lanes) sum += x;
  return {static_cast<double>(rounds) * chains * 64, sum};
#elif defined(__AVX512F__) && defined(__AVX512BW__)
  __m512i acc[chains];
  for (int i = 0; i < chains; ++i) acc[i] = _mm512_set1_epi32(i);
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  __m512i const ones = _mm512_set1_epi16(1);
  for (std::int64_t r = 0; r < rounds; ++r) {
    for (int i = 0; i < chains; ++i)
      acc[i] = _mm512_add_epi32(acc[i], _mm512_madd_epi16(_mm512_maddubs_epi16(a, b), ones));
    opaque(a);
  }
  for (int i = 1; i < chains; ++i) acc[0] = _mm512_add_epi32(acc[0], acc[i]);
  alignas(64) std::int32_t lanes[16];
  _mm512_store_si512(lanes, acc[0]);
  double sum = 0;
  for (std::int32_t x : lanes) sum += x;
  return {static_cast<double>(rounds) * chains * 64, sum};
#elif defined(__AVX2__)
  constexpr int ymm_chains = 12;
  __m256i acc[ymm_chains];
  for (int i = 0; i < ymm_chains; ++i) acc[i] = _mm256_set1_epi32(i);
  __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2);
  __m256i const ones = _mm256_set1_epi16(1);
  for (std::int64_t r = 0; r < rounds; ++r) {
    for (int i = 0; i < ymm_chains; ++i)
      acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones));
    opaque(a);
  }
  for (int i = 1; i < ymm_chains; ++i) acc[0] = _mm256_add_epi32(acc[0], acc[i]);
  alignas(32) std::int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[0]);
  double sum = 0;
  for (std::int32_t x : lanes) sum += x;
  (void)chains;
  return {static_cast<double>(rounds) * ymm_chains * 32, sum};
#elif defined(__ARM_NEON) && defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
  int32x4_t acc[chains];
  for (int i = 0; i < chains; ++i) acc[i] = vdupq_n_s32(i);
  int8x16_t a = vdupq_n_s8(3), b = vdupq_n_s8(-2);
  for (std::int64_t r = 0; r < rounds; ++r) {
    for (int i = 0; i < chains; ++i) acc[i] = vdotq_s32(acc[i], a, b);
    opaque(a);
  }
  for (int i = 1; i < chains; ++i) acc[0] = vaddq_s32(acc[0], acc[i]);
  return {static_cast<double>(rounds) * chains * 16, static_cast<double>(vaddvq_s32(acc[0]))};
#elif defined(__ARM_NEON) && defined(__aarch64__)
  int32x4_t acc[chains];
  for (int i = 0; i < chains; ++i) acc[i] = vdupq_n_s32(i);
  int8x8_t a = vdup_n_s8(3), b = vdup_n_s8(-2);
  for (std::int64_t r = 0; r < rounds; ++r) {
    for (int i = 0; i < chains; ++i) acc[i] = vpadalq_s16(acc[i], vmull_s8(a, b));
    opaque(a);
  }
  for (int i = 1; i < chains; ++i) acc[0] = vaddq_s32(acc[0], acc[i]);
  return {static_cast<double>(rounds) * chains * 8, static_cast<double>(vaddvq_s32(acc[0]))};
#else
  std::int32_t acc[chains];
  for (int i = 0; i < chains; ++i) acc[i] = i;
  std::int8_t a = 3, b = -2;
  for (std::int64_t r = 0; r < rounds; ++r) {
    for (int i = 0; i < chains; ++i) acc[i] += static_cast<std::int32_t>(a) * b;
    opaque(a);
  }
  double sum = 0;
  for (std::int32_t x : acc) sum += x;
  return {static_cast<double>(rounds) * chains, sum};
#endif
}

/// The name of the int8 dot-product instruction sequence int8_peak_loop measures.
inline constexpr auto int8_peak_kind() noexcept -> char const* {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  return "avx512 vpdpbusd";
#elif defined(__AVX512F__) && defined(__AVX512BW__)
  return "avx512 vpmaddubsw+vpmaddwd";
#elif defined(__AVX2__)
  return "avx2 vpmaddubsw+vpmaddwd";
#elif defined(__ARM_NEON) && defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
  return "neon sdot";
#elif defined(__ARM_NEON) && defined(__aarch64__)
  return "neon smull+sadalp";
#else
  return "scalar";
#endif
}

/// The name of the f32 FMA width fma_peak_loop measures.
inline constexpr auto fma_peak_kind() noexcept -> char const* {
#if defined(__AVX512F__)
  return "avx512 vfmadd (16 lanes)";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2 vfmadd (8 lanes)";
#elif defined(__ARM_NEON) && defined(__aarch64__)
  return "neon fmla (4 lanes)";
#else
  return "scalar";
#endif
}

}  // namespace kvq_bench
