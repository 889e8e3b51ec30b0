// kvq: the int8 symmetric codec, one fp32 scale per (token, kv_head), scalar reference.
//
// A row of head_dim values is stored as a little-endian fp32 scale = amax/127 followed by
// head_dim int8 codes clamp(rne(x/scale), -127, 127): 8 + 32/head_dim bits per element.
// The numeric choices are listed in detail/math_int8.h.
#pragma once

#include <cstring>

#include "../detail/block_layouts.h"
#include "../detail/math_int8.h"
#include "codec.hpp"

KVQ_NAMESPACE_BEGIN

/// int8 symmetric: one fp32 scale per (token, kv_head) row.
struct int8_sym {
  static constexpr std::string_view name = "int8";
  static constexpr codec_layout layout = codec_layout::row;
  using params_type = no_params;

  /// One block covering the whole row: 4 scale bytes + head_dim codes.
  static constexpr auto geometry(int head_dim) noexcept -> block_geometry {
    return {head_dim, 1, 1, static_cast<std::size_t>(detail::int8_row_header_bytes + head_dim)};
  }

  /// Encodes x: (head_dim) into 4 + head_dim bytes.
  static void encode_row(float const* x, int head_dim, std::uint8_t* dst, params_type const& = {}) noexcept {
    float amax = 0.0f;
    bool finite = true;
    for (int i = 0; i < head_dim; ++i) {
      finite = finite && detail::is_finite_f32(x[i]);
      float const a = detail::abs_f32(x[i]);
      amax = a > amax ? a : amax;
    }
    float const scale = finite ? detail::int8_scale(amax) : detail::f32_from_bits(detail::int8_poisoned_scale_bits);
    std::memcpy(dst, &scale, 4);
    auto* q = reinterpret_cast<signed char*>(dst + detail::int8_row_header_bytes);
    bool const coded = finite && scale != 0.0f;
    for (int i = 0; i < head_dim; ++i) q[i] = coded ? static_cast<signed char>(detail::int8_code(x[i], scale)) : 0;
  }

  /// Decodes 4 + head_dim bytes into y: (head_dim).
  static void decode_row(std::uint8_t const* src, int head_dim, float* y, params_type const& = {}) noexcept {
    float scale;
    std::memcpy(&scale, src, 4);
    auto const* q = reinterpret_cast<signed char const*>(src + detail::int8_row_header_bytes);
    for (int i = 0; i < head_dim; ++i) y[i] = detail::int8_value(q[i], scale);
  }
};

KVQ_NAMESPACE_END
