// kvq: the q8_0 codec (ggml block_q8_0), scalar reference.
//
// Blocks of 32 channels of one (token, kv_head) row: an fp16 scale d = amax/127 and 32 int8 codes
// roundf(x/d) (computed as x * (1/d) from the unrounded d, exactly as ggml). 8.5 bits per element.
// Padding lanes (head_dim not a multiple of 32) are zeros that take no part in amax.
// NaN/Inf: a block holding one decodes entirely to NaN (see detail/math_ggml.h).
#pragma once

#include <cstring>

#include "../detail/block_layouts.h"
#include "../detail/math_ggml.h"
#include "codec.hpp"

KVQ_NAMESPACE_BEGIN

/// ggml q8_0: per token, blocks of 32 channels, fp16 scale + 32 x int8.
struct q8_0 {
  static constexpr std::string_view name = "q8_0";
  static constexpr codec_layout layout = codec_layout::row;
  static constexpr int block_size = detail::qk_ggml;
  using params_type = no_params;

  /// One block of 32 channels per started 32 channels of head_dim.
  static constexpr auto geometry(int head_dim) noexcept -> block_geometry {
    return {block_size, (head_dim + block_size - 1) / block_size, 1, sizeof(detail::block_q8_0)};
  }

  /// Encodes `n` (1..32) values into one block; lanes n..31 are zero padding.
  static void encode_block(float const* x, int n, std::uint8_t* dst) noexcept {
    detail::block_q8_0 b{};
    float amax = 0.0f;
    bool finite = true;
    for (int j = 0; j < n; ++j) {
      finite = finite && detail::is_finite_f32(x[j]);
      float const a = detail::abs_f32(x[j]);
      amax = a > amax ? a : amax;
    }
    if (!finite) {
      b.d = detail::poisoned_f16_scale;
    } else {
      float const d = detail::q8_0_scale(amax);
      float const id = detail::ggml_inverse_scale(d);
      b.d = detail::f32_to_f16_bits(d);
      for (int j = 0; j < n; ++j) b.qs[j] = static_cast<signed char>(detail::q8_0_code(x[j], id));
    }
    std::memcpy(dst, &b, sizeof b);
  }

  /// Decodes the first `n` (1..32) values of one block.
  static void decode_block(std::uint8_t const* src, int n, float* y) noexcept {
    detail::block_q8_0 b;
    std::memcpy(&b, src, sizeof b);
    float const d = detail::f16_bits_to_f32(b.d);
    for (int j = 0; j < n; ++j) y[j] = detail::q8_0_value(b.qs[j], d);
  }

  /// Encodes one row x: (head_dim) into geometry(head_dim).bytes() bytes.
  static void encode_row(float const* x, int head_dim, std::uint8_t* dst, params_type const& = {}) noexcept {
    for (int c = 0; c < head_dim; c += block_size, dst += sizeof(detail::block_q8_0))
      encode_block(x + c, head_dim - c < block_size ? head_dim - c : block_size, dst);
  }

  /// Decodes one row into y: (head_dim).
  static void decode_row(std::uint8_t const* src, int head_dim, float* y, params_type const& = {}) noexcept {
    for (int c = 0; c < head_dim; c += block_size, src += sizeof(detail::block_q8_0))
      decode_block(src, head_dim - c < block_size ? head_dim - c : block_size, y + c);
  }
};

KVQ_NAMESPACE_END
