// kvq: the 4-bit float codecs mxfp4 and nvfp4 (ggml block_mxfp4 / block_nvfp4), scalar reference.
//
// mxfp4: blocks of 32 channels, an E8M0 scale exponent and 32 E2M1 codes (17 bytes, 4.25 bits per
// element). nvfp4: blocks of 64 channels, four UE4M3 scales of 16 channels and 64 E2M1 codes
// (36 bytes, 4.5 bits per element). Byte-exact with ggml's reference quantizers and dequantizers
// (FORMATS.md §7, detail/math_fp4.h), including their tie rule (the lower code wins) and scale
// rounding. Padding lanes are zeros (code 0) that take no part in amax. NaN/Inf: a block (mxfp4) or
// sub-block (nvfp4) holding one stores the NaN scale byte (0xFF / 0x7F) and decodes to NaN.
//
// An optional f32 scale, as for fp8: stored = codec(x / scale), read = decoded * scale (default 1,
// ggml's bytes exactly). ggml's nvfp4 has no per-tensor scale, so sub-blocks with amax below about
// 0.0059 decode to zeros and amax above 2688 saturates: the scale moves that window.
#pragma once

#include <cstring>
#include <limits>

#include "../detail/block_layouts.h"
#include "../detail/math_fp4.h"
#include "codec.hpp"

KVQ_NAMESPACE_BEGIN

/// Run-time parameters of the FP4 codecs: the dequantization scale.
struct fp4_params {
  float scale = 1.0f;  ///< code = fp4(x / scale), value = fp4 * scale
  friend constexpr bool operator==(fp4_params const&, fp4_params const&) = default;
};

/// True when `p.scale` is finite and greater than zero.
constexpr auto fp4_params_valid(fp4_params const& p) noexcept -> bool {
  return p.scale > 0.0f && p.scale <= std::numeric_limits<float>::max();
}

namespace detail {

/// x / scale as the FP4 encoders see it (exact for scale 1).
inline auto fp4_scaled(float x, fp4_params const& p) noexcept -> float { return div_rn(x, p.scale); }

/// The 16 values K[c] * h of a block at half-scale h, times the codec scale (the decoded values),
/// or 16 NaNs for a poisoned block.
inline void fp4_decode_table(float h, bool nan, float scale, float* table) noexcept {
  for (int c = 0; c < 16; ++c) table[c] = nan ? fp4_nan() : mul_rn(fp4_value(c, h), scale);
}

/// The 16 candidate values K[c] * h of the encoder at half-scale h.
inline void fp4_encode_table(float h, float* table) noexcept {
  for (int c = 0; c < 16; ++c) table[c] = fp4_value(c, h);
}

}  // namespace detail

/// ggml MXFP4: per token, blocks of 32 channels, E8M0 scale + 16 bytes of E2M1 nibbles.
struct mxfp4 {
  static constexpr std::string_view name = "mxfp4";
  static constexpr codec_layout layout = codec_layout::row;
  static constexpr int block_size = detail::qk_mxfp4;
  using params_type = fp4_params;

  /// One block of 32 channels per started 32 channels of head_dim.
  static constexpr auto geometry(int head_dim) noexcept -> block_geometry {
    return {block_size, (head_dim + block_size - 1) / block_size, 1, sizeof(detail::block_mxfp4)};
  }

  /// Encodes `n` (1..32) values into one block; lanes n..31 are zero padding.
  static void encode_block(float const* x, int n, std::uint8_t* dst, params_type const& p = {}) noexcept {
    detail::block_mxfp4 b{};
    float v[32] = {};
    float amax = 0.0f;
    bool finite = true;
    for (int j = 0; j < n; ++j) {
      v[j] = detail::fp4_scaled(x[j], p);
      finite = finite && detail::is_finite_f32(v[j]);
      float const a = detail::abs_f32(v[j]);
      amax = a > amax ? a : amax;
    }
    if (!finite) {
      b.e = detail::mxfp4_poisoned_scale;  // codes 0
    } else {
      b.e = detail::mxfp4_exponent(amax);
      float table[16];
      detail::fp4_encode_table(detail::mxfp4_half_scale(b.e), table);
      for (int j = 0; j < 16; ++j)
        b.qs[j] = static_cast<std::uint8_t>(detail::fp4_code_table(v[j], table) |
                                            (detail::fp4_code_table(v[j + 16], table) << 4));
    }
    std::memcpy(dst, &b, sizeof b);
  }

  /// Decodes the first `n` (1..32) values of one block.
  static void decode_block(std::uint8_t const* src, int n, float* y, params_type const& p = {}) noexcept {
    detail::block_mxfp4 b;
    std::memcpy(&b, src, sizeof b);
    float table[16];
    detail::fp4_decode_table(detail::mxfp4_half_scale(b.e), b.e == detail::mxfp4_poisoned_scale, p.scale, table);
    for (int j = 0; j < n; ++j) y[j] = table[j < 16 ? (b.qs[j] & 0x0f) : (b.qs[j - 16] >> 4)];
  }

  /// Encodes one row x: (head_dim) into geometry(head_dim).bytes() bytes.
  static void encode_row(float const* x, int head_dim, std::uint8_t* dst, params_type const& p = {}) noexcept {
    for (int c = 0; c < head_dim; c += block_size, dst += sizeof(detail::block_mxfp4))
      encode_block(x + c, head_dim - c < block_size ? head_dim - c : block_size, dst, p);
  }

  /// Decodes one row into y: (head_dim).
  static void decode_row(std::uint8_t const* src, int head_dim, float* y, params_type const& p = {}) noexcept {
    for (int c = 0; c < head_dim; c += block_size, src += sizeof(detail::block_mxfp4))
      decode_block(src, head_dim - c < block_size ? head_dim - c : block_size, y + c, p);
  }
};

/// ggml NVFP4: per token, blocks of 64 channels, four UE4M3 scales (one per 16 channels) + 32
/// bytes of E2M1 nibbles.
struct nvfp4 {
  static constexpr std::string_view name = "nvfp4";
  static constexpr codec_layout layout = codec_layout::row;
  static constexpr int block_size = detail::qk_nvfp4;
  static constexpr int sub_block = detail::qk_nvfp4_sub;
  using params_type = fp4_params;

  /// One block of 64 channels per started 64 channels of head_dim.
  static constexpr auto geometry(int head_dim) noexcept -> block_geometry {
    return {block_size, (head_dim + block_size - 1) / block_size, 1, sizeof(detail::block_nvfp4)};
  }

  /// Encodes `n` (1..64) values into one block; lanes n..63 are zero padding.
  static void encode_block(float const* x, int n, std::uint8_t* dst, params_type const& p = {}) noexcept {
    detail::block_nvfp4 b{};
    float v[64] = {};
    for (int j = 0; j < n; ++j) v[j] = detail::fp4_scaled(x[j], p);
    for (int s = 0; s < 4; ++s) {
      float const* xs = v + s * sub_block;
      float amax = 0.0f;
      bool finite = true;
      for (int j = 0; j < sub_block; ++j) {
        finite = finite && detail::is_finite_f32(xs[j]);
        float const a = detail::abs_f32(xs[j]);
        amax = a > amax ? a : amax;
      }
      if (!finite) {
        b.d[s] = detail::nvfp4_poisoned_scale;  // codes 0
        continue;
      }
      b.d[s] = detail::nvfp4_scale_code(detail::div_rn(amax, 6.0f));
      float table[16];
      detail::fp4_encode_table(detail::nvfp4_half_scale(b.d[s]), table);
      for (int j = 0; j < 8; ++j)
        b.qs[8 * s + j] = static_cast<std::uint8_t>(detail::fp4_code_table(xs[j], table) |
                                                    (detail::fp4_code_table(xs[j + 8], table) << 4));
    }
    std::memcpy(dst, &b, sizeof b);
  }

  /// Decodes the first `n` (1..64) values of one block.
  static void decode_block(std::uint8_t const* src, int n, float* y, params_type const& p = {}) noexcept {
    detail::block_nvfp4 b;
    std::memcpy(&b, src, sizeof b);
    float table[16];
    for (int j = 0; j < n; ++j) {
      int const s = j / sub_block;
      int const k = j % sub_block;
      if (k == 0)
        detail::fp4_decode_table(detail::nvfp4_half_scale(b.d[s]), b.d[s] == detail::nvfp4_poisoned_scale, p.scale,
                                 table);
      std::uint8_t const byte = b.qs[8 * s + k % 8];
      y[j] = table[k < 8 ? (byte & 0x0f) : (byte >> 4)];
    }
  }

  /// Encodes one row x: (head_dim) into geometry(head_dim).bytes() bytes.
  static void encode_row(float const* x, int head_dim, std::uint8_t* dst, params_type const& p = {}) noexcept {
    for (int c = 0; c < head_dim; c += block_size, dst += sizeof(detail::block_nvfp4))
      encode_block(x + c, head_dim - c < block_size ? head_dim - c : block_size, dst, p);
  }

  /// Decodes one row into y: (head_dim).
  static void decode_row(std::uint8_t const* src, int head_dim, float* y, params_type const& p = {}) noexcept {
    for (int c = 0; c < head_dim; c += block_size, src += sizeof(detail::block_nvfp4))
      decode_block(src, head_dim - c < block_size ? head_dim - c : block_size, y + c, p);
  }
};

KVQ_NAMESPACE_END
