// kvq: the FP8 codecs E4M3FN and E5M2, one byte per element, scalar reference.
//
// Each value of a (token, kv_head) row is stored as one OCP FP8 byte, code = fp8(x / scale), and
// read back as fp8 * scale (vLLM's convention; scale is a run-time parameter, 1 by default, never
// stored in the cache). Rounding is to nearest, ties to even, bit-exact with CUDA's
// __nv_cvt_float_to_fp8; E5M2 codes are the high byte of an IEEE binary16. 8 bits per element.
// NaN/Inf (see detail/math_fp8.h):
//   * NaN encodes to 0x7f in both modes (the sign is dropped, as CUDA), which decodes to NaN;
//   * overflow and ±Inf give ±max finite (E4M3FN ±448, E5M2 ±57344) under fp8_overflow::saturate,
//     the default; under fp8_overflow::no_saturate they give NaN 0x7f|sign (E4M3FN, which has no
//     infinities) or ±Inf 0x7c|sign (E5M2);
//   * decoding is exact: E4M3FN 0x7f/0xff and E5M2 0x7d..0x7f/0xfd..0xff decode to NaN, E5M2
//     0x7c/0xfc to ±Inf (times scale).
#pragma once

#include <cstdint>
#include <limits>

#include "../detail/math_fp8.h"
#include "codec.hpp"

KVQ_NAMESPACE_BEGIN

/// What an FP8 encoder does with values beyond the largest finite value, and with ±Inf.
enum class fp8_overflow {
  saturate,     ///< clamp to ±max finite (CUDA __NV_SATFINITE, vLLM's KV cache)
  no_saturate,  ///< E4M3FN: NaN (0x7f|sign); E5M2: ±Inf (CUDA __NV_NOSAT, PyTorch casts)
};

/// Run-time parameters of the FP8 codecs: the dequantization scale and the overflow mode.
struct fp8_params {
  float scale = 1.0f;                              ///< code = fp8(x / scale), value = fp8 * scale
  fp8_overflow overflow = fp8_overflow::saturate;  ///< overflow handling of the encoder
  friend constexpr bool operator==(fp8_params const&, fp8_params const&) = default;
};

/// True when `p.scale` is finite and greater than zero (required by every FP8 encode and decode).
constexpr auto fp8_params_valid(fp8_params const& p) noexcept -> bool {
  return p.scale > 0.0f && p.scale <= std::numeric_limits<float>::max() &&
         (p.overflow == fp8_overflow::saturate || p.overflow == fp8_overflow::no_saturate);
}

/// OCP FP8 E4M3FN per element: max finite 448, no infinities.
struct fp8_e4m3 {
  static constexpr std::string_view name = "fp8_e4m3";
  static constexpr codec_layout layout = codec_layout::row;
  using params_type = fp8_params;

  /// One byte per channel.
  static constexpr auto geometry(int head_dim) noexcept -> block_geometry { return {1, head_dim, 1, 1}; }

  /// Code of one value: fp8_e4m3(x / p.scale) under p.overflow.
  static auto encode(float x, params_type const& p = {}) noexcept -> std::uint8_t {
    return detail::f32_to_e4m3_scaled(x, p.scale, p.overflow == fp8_overflow::saturate);
  }
  /// Value of one code: its exact E4M3FN value times p.scale.
  static auto decode(std::uint8_t code, params_type const& p = {}) noexcept -> float {
    return detail::e4m3_to_f32_scaled(code, p.scale);
  }

  /// Encodes x: (head_dim) into head_dim bytes.
  static void encode_row(float const* x, int head_dim, std::uint8_t* dst, params_type const& p = {}) noexcept {
    for (int i = 0; i < head_dim; ++i) dst[i] = encode(x[i], p);
  }
  /// Decodes head_dim bytes into y: (head_dim).
  static void decode_row(std::uint8_t const* src, int head_dim, float* y, params_type const& p = {}) noexcept {
    for (int i = 0; i < head_dim; ++i) y[i] = decode(src[i], p);
  }
};

/// OCP FP8 E5M2 per element: max finite 57344, with ±Inf.
struct fp8_e5m2 {
  static constexpr std::string_view name = "fp8_e5m2";
  static constexpr codec_layout layout = codec_layout::row;
  using params_type = fp8_params;

  /// One byte per channel.
  static constexpr auto geometry(int head_dim) noexcept -> block_geometry { return {1, head_dim, 1, 1}; }

  /// Code of one value: fp8_e5m2(x / p.scale) under p.overflow.
  static auto encode(float x, params_type const& p = {}) noexcept -> std::uint8_t {
    return detail::f32_to_e5m2_scaled(x, p.scale, p.overflow == fp8_overflow::saturate);
  }
  /// Value of one code: its exact E5M2 value times p.scale.
  static auto decode(std::uint8_t code, params_type const& p = {}) noexcept -> float {
    return detail::e5m2_to_f32_scaled(code, p.scale);
  }

  /// Encodes x: (head_dim) into head_dim bytes.
  static void encode_row(float const* x, int head_dim, std::uint8_t* dst, params_type const& p = {}) noexcept {
    for (int i = 0; i < head_dim; ++i) dst[i] = encode(x[i], p);
  }
  /// Decodes head_dim bytes into y: (head_dim).
  static void decode_row(std::uint8_t const* src, int head_dim, float* y, params_type const& p = {}) noexcept {
    for (int i = 0; i < head_dim; ++i) y[i] = decode(src[i], p);
  }
};

KVQ_NAMESPACE_END
