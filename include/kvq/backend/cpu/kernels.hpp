// kvq: the CPU kernels the cache calls — encode/decode of rows and KIVI key tiles, element
// conversions, the rotation R of the rotated codecs — dispatched at compile time to the best
// instruction set the flags allow.
//
//   kvq::cpu_kernels::scalar  the reference (always compiled)
//   kvq::cpu_kernels::avx2    AVX2 + FMA + F16C            (avx2.hpp; also compiled in AVX-512 builds)
//   kvq::cpu_kernels::avx512  AVX-512 F + BW + VL           (avx512.hpp)
//   kvq::cpu_kernels::neon    AArch64 NEON                  (neon.hpp)
// kvq::cpu_kernels::encode_rows etc. forward to the best of these; every one of them gives the
// same bytes and the same decoded bits as the scalar reference (tests/test_simd_codecs.cpp).
// Codecs without a SIMD kernel (any user codec) run the scalar reference. (kvq::cpu itself is the
// CPU backend tag of backend/backend.hpp.) All of it lives in kvq's per-ISA inline
// namespace (config.h), so translation units built with different -m flags never share a kernel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "../../codec/fp8.hpp"
#include "../../codec/int8.hpp"
#include "../../codec/kivi.hpp"
#include "../../codec/passthrough.hpp"
#include "../../codec/q4_0.hpp"
#include "../../codec/q8_0.hpp"
#include "scalar.hpp"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#  include "avx2.hpp"
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#  include "avx512.hpp"
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#  include "neon.hpp"
#endif

KVQ_NAMESPACE_BEGIN
namespace cpu_kernels {

#if defined(KVQ_CPU_HAS_AVX512)
namespace best = avx512;
#elif defined(KVQ_CPU_HAS_AVX2)
namespace best = avx2;
#elif defined(KVQ_CPU_HAS_NEON)
namespace best = neon;
#else
namespace best = scalar;
#endif

#if defined(KVQ_CPU_HAS_AVX512) || defined(KVQ_CPU_HAS_AVX2) || defined(KVQ_CPU_HAS_NEON)
/// The decode-attention kernel of the best instruction set (attention_kernels.hpp).
using attention_kernel = best::attention_kernel;
/// True when this translation unit has a SIMD attention kernel (otherwise attention.hpp runs its
/// scalar reference).
inline constexpr bool has_simd_attention = true;
#else
inline constexpr bool has_simd_attention = false;
#endif

/// The CPU kernel level compiled into this translation unit: "avx512_vnni", "avx512", "avx2",
/// "neon" or "scalar".
inline constexpr std::string_view simd_level() noexcept {
#if defined(KVQ_CPU_HAS_AVX512) && defined(__AVX512VNNI__)
  return "avx512_vnni";
#else
  return best::name;
#endif
}

/// Encodes `rows` rows x + r * x_stride (head_dim floats each) into dst + r * dst_stride
/// (C::geometry(head_dim).bytes() bytes each).
template <row_codec C>
void encode_rows(float const* x, std::ptrdiff_t x_stride, std::int64_t rows, int head_dim, std::uint8_t* dst,
                 std::size_t dst_stride, typename C::params_type const& p = {}) noexcept {
  best::encode_rows<C>(x, x_stride, rows, head_dim, dst, dst_stride, p);
}

/// Decodes `rows` encoded rows src + r * src_stride into y + r * y_stride (head_dim floats each).
template <row_codec C>
void decode_rows(std::uint8_t const* src, std::size_t src_stride, std::int64_t rows, int head_dim, float* y,
                 std::ptrdiff_t y_stride, typename C::params_type const& p = {}) noexcept {
  best::decode_rows<C>(src, src_stride, rows, head_dim, y, y_stride, p);
}

/// Encodes one tile x: (C::group, head_dim), rows token_stride floats apart, into dst (KIVI keys).
template <token_group_codec C>
void encode_tile(float const* x, std::ptrdiff_t token_stride, int head_dim, std::uint8_t* dst,
                 typename C::params_type const& p = {}) noexcept {
  best::encode_tile<C>(x, token_stride, head_dim, dst, p);
}

/// Decodes tokens first_token .. first_token + count - 1 of a tile into y: (count, head_dim), rows
/// y_stride floats apart.
template <token_group_codec C>
void decode_tile_tokens(std::uint8_t const* tile, int head_dim, int first_token, int count, float* y,
                        std::ptrdiff_t y_stride, typename C::params_type const& p = {}) noexcept {
  best::decode_tile_tokens<C>(tile, head_dim, first_token, count, y, y_stride, p);
}

/// x <- R x (FORMATS.md §6.1) for `rows` rows x + r * stride of head_dim floats, R given by its
/// sign words (detail::rotation_sign_words): bit-identical to detail::rotate_forward_signs, NaN
/// payloads aside (which the reference's own compilation does not fix either).
inline void rotate_forward_rows(float* x, std::int64_t rows, std::ptrdiff_t stride, int head_dim,
                                std::uint64_t const* words) noexcept {
  best::rotate_forward_rows(x, rows, stride, head_dim, words);
}

/// y + r * y_stride <- R (x + r * x_stride) for `rows` rows of head_dim floats, rows of y that do
/// not overlap x's: the rotation of the in-place form, read from x and written to y in one pass.
inline void rotate_forward_rows(float const* x, std::ptrdiff_t x_stride, float* y, std::ptrdiff_t y_stride,
                                std::int64_t rows, int head_dim, std::uint64_t const* words) noexcept {
  best::rotate_forward_rows(x, x_stride, y, y_stride, rows, head_dim, words);
}

/// x <- R^T x for `rows` rows x + r * stride of head_dim floats: bit-identical to
/// detail::rotate_inverse_signs (NaN payloads aside).
inline void rotate_inverse_rows(float* x, std::int64_t rows, std::ptrdiff_t stride, int head_dim,
                                std::uint64_t const* words) noexcept {
  best::rotate_inverse_rows(x, rows, stride, head_dim, words);
}

/// Widens n float, f16 or bf16 elements to float (exact; f16 NaNs keep their payload).
template <cpu_element T>
void convert_to_f32(T const* src, float* dst, std::int64_t n) noexcept {
  best::convert_to_f32(src, dst, n);
}

/// Narrows n floats to float, f16 or bf16: round to nearest even, overflow to ±Inf, NaN quieted
/// keeping sign and top payload bits — identical to numeric.h's to_f16 / to_bf16.
template <cpu_element T>
void convert_from_f32(float const* src, T* dst, std::int64_t n) noexcept {
  best::convert_from_f32(src, dst, n);
}

/// Narrows n floats to f16 as the KIVI residual stores them: round to nearest even, finite values
/// beyond ±65504 saturating to ±65504 (numeric.h f32_to_f16_bits_satfinite).
inline void convert_to_f16_satfinite(float const* src, f16* dst, std::int64_t n) noexcept {
  best::convert_to_f16_satfinite(src, dst, n);
}

/// dst = src with every NaN quieted: f16 stored as widening to float and narrowing back would
/// store it (scalar::copy_f16_quieted, the same loop on every instruction set).
inline void copy_f16_quieted(f16 const* src, f16* dst, std::int64_t n) noexcept {
  scalar::copy_f16_quieted(src, dst, n);
}

/// dst = the f32 value of convert_to_f16_satfinite(src), n elements (dst may be src).
inline void round_to_f16_satfinite(float const* src, float* dst, std::int64_t n) noexcept {
  best::round_to_f16_satfinite(src, dst, n);
}

}  // namespace cpu_kernels
KVQ_NAMESPACE_END
