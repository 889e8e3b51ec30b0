// kvq: the q4_0 codec (ggml block_q4_0), scalar reference.
//
// Blocks of 32 channels of one (token, kv_head) row: an fp16 scale d = max/-8 (max = the first
// element of largest magnitude, sign kept) and 32 4-bit codes min(15, trunc(x/d + 8.5)) computed
// from the unrounded d, exactly as ggml. Byte j holds element j (low nibble) and j+16 (high).
// 4.5 bits per element. Padding lanes are zeros that take no part in the scan for max.
// NaN/Inf: a block holding one decodes entirely to NaN (see detail/math_ggml.h).
#pragma once

#include <cstring>

#include "../detail/block_layouts.h"
#include "../detail/math_ggml.h"
#include "codec.hpp"

KVQ_NAMESPACE_BEGIN

/// ggml q4_0: per token, blocks of 32 channels, fp16 scale + 16 bytes of nibbles.
struct q4_0 {
  static constexpr std::string_view name = "q4_0";
  static constexpr codec_layout layout = codec_layout::row;
  static constexpr int block_size = detail::qk_ggml;
  using params_type = no_params;

  /// One block of 32 channels per started 32 channels of head_dim.
  static constexpr auto geometry(int head_dim) noexcept -> block_geometry {
    return {block_size, (head_dim + block_size - 1) / block_size, 1, sizeof(detail::block_q4_0)};
  }

  /// Encodes `n` (1..32) values into one block; lanes n..31 are zero padding.
  static void encode_block(float const* x, int n, std::uint8_t* dst) noexcept {
    detail::block_q4_0 b{};
    float amax = 0.0f;
    float max = 0.0f;
    bool finite = true;
    for (int j = 0; j < n; ++j) {
      finite = finite && detail::is_finite_f32(x[j]);
      float const a = detail::abs_f32(x[j]);
      if (amax < a) {
        amax = a;
        max = x[j];
      }
    }
    int codes[32];
    if (!finite) {
      b.d = detail::poisoned_f16_scale;
      for (int j = 0; j < 32; ++j) codes[j] = 8;
    } else {
      float const d = detail::q4_0_scale(max);
      float const id = detail::ggml_inverse_scale(d);
      b.d = detail::f32_to_f16_bits(d);
      for (int j = 0; j < 32; ++j) codes[j] = detail::q4_0_code(j < n ? x[j] : 0.0f, id);
    }
    for (int j = 0; j < 16; ++j) b.qs[j] = static_cast<std::uint8_t>(codes[j] | (codes[j + 16] << 4));
    std::memcpy(dst, &b, sizeof b);
  }

  /// Decodes the first `n` (1..32) values of one block.
  static void decode_block(std::uint8_t const* src, int n, float* y) noexcept {
    detail::block_q4_0 b;
    std::memcpy(&b, src, sizeof b);
    float const d = detail::f16_bits_to_f32(b.d);
    for (int j = 0; j < n; ++j) {
      int const nibble = j < 16 ? (b.qs[j] & 0x0f) : (b.qs[j - 16] >> 4);
      y[j] = detail::q4_0_value(nibble, d);
    }
  }

  /// Encodes one row x: (head_dim) into geometry(head_dim).bytes() bytes.
  static void encode_row(float const* x, int head_dim, std::uint8_t* dst, params_type const& = {}) noexcept {
    for (int c = 0; c < head_dim; c += block_size, dst += sizeof(detail::block_q4_0))
      encode_block(x + c, head_dim - c < block_size ? head_dim - c : block_size, dst);
  }

  /// Decodes one row into y: (head_dim).
  static void decode_row(std::uint8_t const* src, int head_dim, float* y, params_type const& = {}) noexcept {
    for (int c = 0; c < head_dim; c += block_size, src += sizeof(detail::block_q4_0))
      decode_block(src, head_dim - c < block_size ? head_dim - c : block_size, y + c);
  }
};

KVQ_NAMESPACE_END
