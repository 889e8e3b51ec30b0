// kvq: the CPU scalar reference kernels: the codecs' own per-row and per-tile functions in loops.
//
// Every SIMD kernel of kvq::cpu_kernels reproduces these bit for bit (encoded bytes identical, decoded
// values bit-identical). They are always compiled and are what kvq::cpu_kernels uses without SIMD flags.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <type_traits>

#include "../../codec/codec.hpp"
#include "../../detail/numeric.h"
#include "../../detail/rotation.h"

// Kernels whose register arrays must stay in registers force their inner steps inline (GCC's size
// heuristics may decline them, and below -O3 it does not unroll their loops), as do helpers whose
// only effect GCC does not count as one (prefetches).
#if !defined(KVQ_CPU_ALWAYS_INLINE)
#  if defined(__GNUC__)
#    define KVQ_CPU_ALWAYS_INLINE __attribute__((always_inline))
#  else
#    define KVQ_CPU_ALWAYS_INLINE
#  endif
#endif

KVQ_NAMESPACE_BEGIN
namespace cpu_kernels {

/// An element type kvq converts to and from f32: float, f16 or bf16.
template <class T>
concept cpu_element = std::is_same_v<T, float> || std::is_same_v<T, f16> || std::is_same_v<T, bf16>;

namespace scalar {

/// The name of this instruction set, as reported by simd_level().
inline constexpr std::string_view name = "scalar";

/// Encodes `rows` rows x + r * x_stride (head_dim floats each) into dst + r * dst_stride.
template <row_codec C>
void encode_rows(float const* x, std::ptrdiff_t x_stride, std::int64_t rows, int head_dim, std::uint8_t* dst,
                 std::size_t dst_stride, typename C::params_type const& p = {}) noexcept {
  for (std::int64_t r = 0; r < rows; ++r)
    C::encode_row(x + r * x_stride, head_dim, dst + static_cast<std::size_t>(r) * dst_stride, p);
}

/// Decodes `rows` encoded rows src + r * src_stride into y + r * y_stride (head_dim floats each).
template <row_codec C>
void decode_rows(std::uint8_t const* src, std::size_t src_stride, std::int64_t rows, int head_dim, float* y,
                 std::ptrdiff_t y_stride, typename C::params_type const& p = {}) noexcept {
  for (std::int64_t r = 0; r < rows; ++r)
    C::decode_row(src + static_cast<std::size_t>(r) * src_stride, head_dim, y + r * y_stride, p);
}

/// Encodes one tile x: (C::group, head_dim), rows token_stride floats apart, into dst.
template <token_group_codec C>
void encode_tile(float const* x, std::ptrdiff_t token_stride, int head_dim, std::uint8_t* dst,
                 typename C::params_type const& p = {}) noexcept {
  C::encode_tile(x, token_stride, head_dim, dst, p);
}

/// Decodes tokens first_token .. first_token + count - 1 of a tile into y: (count, head_dim), rows
/// y_stride floats apart.
template <token_group_codec C>
void decode_tile_tokens(std::uint8_t const* tile, int head_dim, int first_token, int count, float* y,
                        std::ptrdiff_t y_stride, typename C::params_type const& p = {}) noexcept {
  for (int t = 0; t < count; ++t) C::decode_token(tile, head_dim, first_token + t, y + t * y_stride, p);
}

/// x <- R x (FORMATS.md §6.1) for `rows` rows x + r * stride of head_dim floats, R given by its
/// sign words (detail::rotation_sign_words).
inline void rotate_forward_rows(float* x, std::int64_t rows, std::ptrdiff_t stride, int head_dim,
                                std::uint64_t const* words) noexcept {
  for (std::int64_t r = 0; r < rows; ++r) detail::rotate_forward_signs(x + r * stride, head_dim, words);
}

/// y + r * y_stride <- R (x + r * x_stride) for `rows` rows of head_dim floats (rows of y that do
/// not overlap x's).
inline void rotate_forward_rows(float const* x, std::ptrdiff_t x_stride, float* y, std::ptrdiff_t y_stride,
                                std::int64_t rows, int head_dim, std::uint64_t const* words) noexcept {
  for (std::int64_t r = 0; r < rows; ++r) {
    std::copy_n(x + r * x_stride, head_dim, y + r * y_stride);
    detail::rotate_forward_signs(y + r * y_stride, head_dim, words);
  }
}

/// x <- R^T x for `rows` rows x + r * stride of head_dim floats.
inline void rotate_inverse_rows(float* x, std::int64_t rows, std::ptrdiff_t stride, int head_dim,
                                std::uint64_t const* words) noexcept {
  for (std::int64_t r = 0; r < rows; ++r) detail::rotate_inverse_signs(x + r * stride, head_dim, words);
}

/// Widens n elements to float (exact).
template <cpu_element T>
void convert_to_f32(T const* src, float* dst, std::int64_t n) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    if (n > 0) std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(float));
  } else {
    for (std::int64_t i = 0; i < n; ++i) dst[i] = to_f32(src[i]);
  }
}

/// Narrows n floats to T, round to nearest even (NaN quieted, payload kept as numeric.h says).
template <cpu_element T>
void convert_from_f32(float const* src, T* dst, std::int64_t n) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    if (n > 0) std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(float));
  } else if constexpr (std::is_same_v<T, f16>) {
    for (std::int64_t i = 0; i < n; ++i) dst[i] = to_f16(src[i]);
  } else {
    for (std::int64_t i = 0; i < n; ++i) dst[i] = to_bf16(src[i]);
  }
}

/// Narrows n floats to f16 as the KIVI residual stores them: round to nearest even, finite values
/// beyond ±65504 saturating to ±65504, ±Inf and NaN as convert_from_f32 (numeric.h
/// f32_to_f16_bits_satfinite).
inline void convert_to_f16_satfinite(float const* src, f16* dst, std::int64_t n) noexcept {
  for (std::int64_t i = 0; i < n; ++i) dst[i].bits = detail::f32_to_f16_bits_satfinite(src[i]);
}

/// dst = src with every NaN quieted (bit 9 set, sign and payload kept), n elements: the bits that
/// widening f16 to float and narrowing back (convert_from_f32 or convert_to_f16_satfinite) give.
/// One loop, which compilers vectorize for the instruction set they target.
inline void copy_f16_quieted(f16 const* src, f16* dst, std::int64_t n) noexcept {
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint16_t const h = src[i].bits;
    dst[i].bits = static_cast<std::uint16_t>(h | ((h & 0x7fffu) > 0x7c00u ? 0x0200u : 0u));
  }
}

/// dst = the f32 value of convert_to_f16_satfinite(src), n elements (dst may be src).
inline void round_to_f16_satfinite(float const* src, float* dst, std::int64_t n) noexcept {
  for (std::int64_t i = 0; i < n; ++i) dst[i] = detail::f16_bits_to_f32(detail::f32_to_f16_bits_satfinite(src[i]));
}

}  // namespace scalar
}  // namespace cpu_kernels
KVQ_NAMESPACE_END
