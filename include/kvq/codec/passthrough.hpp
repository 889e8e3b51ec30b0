// kvq: the f32 and f16 pass-through codecs, the unquantized baselines.
//
// f32 stores the values bit for bit. f16 stores each value rounded to nearest-even binary16
// (|x| >= 65520 becomes ±Inf, NaN stays NaN) and decodes exactly.
#pragma once

#include <cstring>

#include "codec.hpp"

KVQ_NAMESPACE_BEGIN

/// IEEE binary32 per element: 32 bits per element, lossless.
struct f32_codec {
  static constexpr std::string_view name = "f32";
  static constexpr codec_layout layout = codec_layout::row;
  using params_type = no_params;

  static constexpr auto geometry(int head_dim) noexcept -> block_geometry { return {1, head_dim, 1, 4}; }

  /// Copies x: (head_dim) into dst as little-endian binary32.
  static void encode_row(float const* x, int head_dim, std::uint8_t* dst, params_type const& = {}) noexcept {
    std::memcpy(dst, x, static_cast<std::size_t>(head_dim) * 4);
  }
  /// Copies head_dim binary32 values back into y.
  static void decode_row(std::uint8_t const* src, int head_dim, float* y, params_type const& = {}) noexcept {
    std::memcpy(y, src, static_cast<std::size_t>(head_dim) * 4);
  }
};

/// IEEE binary16 per element: 16 bits per element, round to nearest even.
struct f16_codec {
  static constexpr std::string_view name = "f16";
  static constexpr codec_layout layout = codec_layout::row;
  using params_type = no_params;

  static constexpr auto geometry(int head_dim) noexcept -> block_geometry { return {1, head_dim, 1, 2}; }

  /// Rounds x: (head_dim) to binary16 into dst.
  static void encode_row(float const* x, int head_dim, std::uint8_t* dst, params_type const& = {}) noexcept {
    for (int i = 0; i < head_dim; ++i) {
      std::uint16_t const h = detail::f32_to_f16_bits(x[i]);
      std::memcpy(dst + 2 * i, &h, 2);
    }
  }
  /// Widens head_dim binary16 values into y (exact).
  static void decode_row(std::uint8_t const* src, int head_dim, float* y, params_type const& = {}) noexcept {
    for (int i = 0; i < head_dim; ++i) {
      std::uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      y[i] = detail::f16_bits_to_f32(h);
    }
  }
};

KVQ_NAMESPACE_END
