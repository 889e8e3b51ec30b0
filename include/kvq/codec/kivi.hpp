// kvq: the KIVI codecs (arXiv 2402.02750): keys per channel, values per token, scalar reference.
//
// Asymmetric b-bit quantization (b = Bits in {2, 4, 8}) with an fp16 scale and an fp16 minimum per
// group; x^ = q * scale + min. Keys are grouped per channel over G consecutive tokens of one kv
// head (a "tile", `kivi_key`); values are grouped per token over gv = min(G, head_dim) consecutive
// channels (`kivi_value`). Numerics, pinned once and identical on every backend:
//   * Per group: mn = min, mx = max over the group's finite real elements in fp32 (padding lanes
//     take no part); scale = div_rn(mx - mn, 2^b - 1) in fp32; stored scale_h =
//     f32_to_f16_bits_sat(scale), min_h = f32_to_f16_bits_sat(mn) (saturating fp16 so the
//     parameters are never Inf: |x| beyond 65504 is clipped). A zero mn or mx counts as +0.
//   * Codes use the stored (fp16-rounded) parameters s = f16->f32(scale_h), m = f16->f32(min_h):
//     q = clamp(round_half_even(div_rn(x - m, s)), 0, 2^b - 1): true division, ties to even (as
//     torch.round); the quotient is clamped to [0, 2^b - 1] before rounding (as KIVI: clamp then
//     round). If s == 0 (constant group or scale underflow) every code is 0: a constant group
//     decodes to its fp16-rounded value, never NaN.
//   * Decode: x^ = add_rn(mul_rn((float)q, s), m) (explicit rounding, never an FMA).
//   * NaN/Inf: a group holding a NaN or ±Inf is poisoned: scale_h = min_h = 0x7e00 (fp16 NaN),
//     codes 0, so it decodes to NaN.
//   * Packing: codes LSB-first: element i of a packed run sits at bits [b*i, b*i + b) of the
//     little-endian byte stream (equivalent to KIVI's int32 words, little-endian).
// Element math: detail/math_kivi.h. All fp16 fields are little-endian.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "../detail/block_layouts.h"
#include "../detail/math_kivi.h"
#include "codec.hpp"

KVQ_NAMESPACE_BEGIN

/// The decoded (fp32) scale and minimum of one KIVI group: x^ = q * scale + min.
struct kivi_scale_min {
  float scale;
  float min;
};

namespace detail {

/// Reads a little-endian u16.
inline auto kivi_load_u16(std::uint8_t const* p) noexcept -> u16 {
  return static_cast<u16>(p[0] | (static_cast<unsigned>(p[1]) << 8));
}

/// Writes a little-endian u16.
inline void kivi_store_u16(std::uint8_t* p, u16 v) noexcept {
  p[0] = static_cast<std::uint8_t>(v & 0xffu);
  p[1] = static_cast<std::uint8_t>(v >> 8);
}

/// Decodes the stored parameters at scale_src / min_src.
inline auto kivi_load_params(std::uint8_t const* scale_src, std::uint8_t const* min_src) noexcept -> kivi_scale_min {
  return {f16_bits_to_f32(kivi_load_u16(scale_src)), f16_bits_to_f32(kivi_load_u16(min_src))};
}

/// Encodes one group of n real elements x[0], x[stride], ... into its header and `lanes` packed
/// codes (lanes n..lanes-1 are padding with code 0); codes_dst must hold ceil(lanes*bits/8) bytes.
inline void kivi_encode_group(float const* x, std::ptrdiff_t stride, int n, int lanes, int bits,
                              std::uint8_t* scale_dst, std::uint8_t* min_dst, std::uint8_t* codes_dst) noexcept {
  kivi_range r = kivi_range_empty();
  for (int i = 0; i < n; ++i) r = kivi_range_add(r, x[i * stride]);
  kivi_header const h = kivi_make_header(r, bits);
  kivi_store_u16(scale_dst, h.scale);
  kivi_store_u16(min_dst, h.min);
  int const code_bytes = (lanes * bits + 7) / 8;
  for (int j = 0; j < code_bytes; ++j) codes_dst[j] = 0;
  if (!r.finite) return;
  float const s = f16_bits_to_f32(h.scale);
  float const m = f16_bits_to_f32(h.min);
  for (int i = 0; i < n; ++i) {
    int const q = kivi_code(x[i * stride], s, m, bits);
    std::uint8_t& byte = codes_dst[kivi_code_byte(i, bits)];
    byte = kivi_pack(byte, q, i, bits);
  }
}

/// The name of the KIVI pair with b bits.
constexpr auto kivi_pair_name(int bits) noexcept -> std::string_view {
  return bits == 2 ? "kivi2" : bits == 4 ? "kivi4" : bits == 8 ? "kivi8" : "kivi?";
}

}  // namespace detail

/// KIVI keys: per channel, groups of G consecutive tokens of one kv head (a tile).
///
/// Tile layout (geometry(head_dim).bytes() bytes): [head_dim x u16 scale][head_dim x u16 min]
/// [head_dim x code_bytes bytes of codes, channel-major; channel c's G codes packed along tokens].
template <int Bits, int G = 32>
struct kivi_key {
  static_assert(Bits == 2 || Bits == 4 || Bits == 8, "kvq::kivi_key: Bits must be 2, 4 or 8");
  static_assert(G >= 8 && G % 8 == 0, "kvq::kivi_key: the group size G must be a multiple of 8 (8, 16, 32, ...)");

  static constexpr std::string_view name = "kivi_key";
  static constexpr codec_layout layout = codec_layout::token_group;
  static constexpr int bits = Bits;
  static constexpr int group = G;
  /// Bytes of packed codes per channel of a tile: G * Bits / 8.
  static constexpr int code_bytes = G * Bits / 8;
  using params_type = no_params;

  /// One block per tile covering all head_dim channels of G tokens: 4 parameter bytes and
  /// code_bytes code bytes per channel.
  static constexpr auto geometry(int head_dim) noexcept -> block_geometry {
    return {head_dim, 1, G, static_cast<std::size_t>(head_dim) * (detail::kivi_group_header_bytes + code_bytes)};
  }

  /// Byte offset, inside a tile, of channel c's fp16 scale.
  static constexpr auto scale_offset(int /*head_dim*/, int c) noexcept -> std::size_t {
    return 2 * static_cast<std::size_t>(c);
  }
  /// Byte offset, inside a tile, of channel c's fp16 minimum.
  static constexpr auto min_offset(int head_dim, int c) noexcept -> std::size_t {
    return 2 * (static_cast<std::size_t>(head_dim) + static_cast<std::size_t>(c));
  }
  /// Byte offset, inside a tile, of channel c's packed codes.
  static constexpr auto codes_offset(int head_dim, int c) noexcept -> std::size_t {
    return detail::kivi_group_header_bytes * static_cast<std::size_t>(head_dim) +
           static_cast<std::size_t>(code_bytes) * static_cast<std::size_t>(c);
  }

  /// Encodes x: (G, head_dim), rows token_stride floats apart, into one tile.
  static void encode_tile(float const* x, std::ptrdiff_t token_stride, int head_dim, std::uint8_t* dst,
                          params_type const& = {}) noexcept {
    for (int c = 0; c < head_dim; ++c)
      detail::kivi_encode_group(x + c, token_stride, G, G, Bits, dst + scale_offset(head_dim, c),
                                dst + min_offset(head_dim, c), dst + codes_offset(head_dim, c));
  }

  /// Decoded scale and minimum of channel c of a tile.
  static auto group_params(std::uint8_t const* tile, int head_dim, int c) noexcept -> kivi_scale_min {
    return detail::kivi_load_params(tile + scale_offset(head_dim, c), tile + min_offset(head_dim, c));
  }

  /// Code (0 .. 2^Bits - 1) of channel c at token t (0 .. G-1) of a tile.
  static auto code(std::uint8_t const* tile, int head_dim, int c, int t) noexcept -> int {
    return detail::kivi_unpack(
        tile[codes_offset(head_dim, c) + static_cast<std::size_t>(detail::kivi_code_byte(t, Bits))], t, Bits);
  }

  /// Decodes token t (0 .. G-1) of a tile into y: (head_dim).
  static void decode_token(std::uint8_t const* src, int head_dim, int t, float* y, params_type const& = {}) noexcept {
    for (int c = 0; c < head_dim; ++c) {
      kivi_scale_min const p = group_params(src, head_dim, c);
      y[c] = detail::kivi_value(code(src, head_dim, c, t), p.scale, p.min);
    }
  }

  /// Decodes a whole tile into y: (G, head_dim), rows token_stride floats apart.
  static void decode_tile(std::uint8_t const* src, int head_dim, float* y, std::ptrdiff_t token_stride,
                          params_type const& p = {}) noexcept {
    for (int t = 0; t < G; ++t) decode_token(src, head_dim, t, y + t * token_stride, p);
  }
};

/// KIVI values: per token, groups of gv = min(G, head_dim) consecutive channels.
///
/// Row layout: ceil(head_dim / gv) blocks of [u16 scale][u16 min][ceil(gv * Bits / 8) bytes of
/// packed codes]; the last block is zero-padded when gv does not divide head_dim (pad lanes take
/// no part in min/max and hold code 0).
template <int Bits, int G = 32>
struct kivi_value {
  static_assert(Bits == 2 || Bits == 4 || Bits == 8, "kvq::kivi_value: Bits must be 2, 4 or 8");
  static_assert(G >= 8 && G % 8 == 0, "kvq::kivi_value: the group size G must be a multiple of 8 (8, 16, 32, ...)");

  static constexpr std::string_view name = "kivi_value";
  static constexpr codec_layout layout = codec_layout::row;
  static constexpr int bits = Bits;
  static constexpr int group = G;
  using params_type = no_params;

  /// Channels per group at a head_dim: min(G, head_dim).
  static constexpr auto group_channels(int head_dim) noexcept -> int { return head_dim < G ? head_dim : G; }

  /// Blocks of group_channels(head_dim) channels, each 4 parameter bytes plus the packed codes.
  static constexpr auto geometry(int head_dim) noexcept -> block_geometry {
    int const gv = group_channels(head_dim);
    return {gv, (head_dim + gv - 1) / gv, 1,
            static_cast<std::size_t>(detail::kivi_group_header_bytes + (gv * Bits + 7) / 8)};
  }

  /// Decoded scale and minimum of group g of a row.
  static auto group_params(std::uint8_t const* row, int head_dim, int g) noexcept -> kivi_scale_min {
    std::uint8_t const* const b = row + static_cast<std::size_t>(g) * geometry(head_dim).block_bytes;
    return detail::kivi_load_params(b, b + 2);
  }

  /// Code (0 .. 2^Bits - 1) of channel c of a row.
  static auto code(std::uint8_t const* row, int head_dim, int c) noexcept -> int {
    auto const g = geometry(head_dim);
    int const lane = c % g.block_channels;
    std::uint8_t const* const b = row + static_cast<std::size_t>(c / g.block_channels) * g.block_bytes;
    return detail::kivi_unpack(b[detail::kivi_group_header_bytes + detail::kivi_code_byte(lane, Bits)], lane, Bits);
  }

  /// Encodes one row x: (head_dim) into geometry(head_dim).bytes() bytes.
  static void encode_row(float const* x, int head_dim, std::uint8_t* dst, params_type const& = {}) noexcept {
    auto const g = geometry(head_dim);
    for (int c = 0; c < head_dim; c += g.block_channels, dst += g.block_bytes) {
      int const n = head_dim - c < g.block_channels ? head_dim - c : g.block_channels;
      detail::kivi_encode_group(x + c, 1, n, g.block_channels, Bits, dst, dst + 2,
                                dst + detail::kivi_group_header_bytes);
    }
  }

  /// Decodes one row into y: (head_dim).
  static void decode_row(std::uint8_t const* src, int head_dim, float* y, params_type const& = {}) noexcept {
    auto const g = geometry(head_dim);
    for (int c = 0; c < head_dim; c += g.block_channels, src += g.block_bytes) {
      int const n = head_dim - c < g.block_channels ? head_dim - c : g.block_channels;
      kivi_scale_min const p = detail::kivi_load_params(src, src + 2);
      std::uint8_t const* const codes = src + detail::kivi_group_header_bytes;
      for (int i = 0; i < n; ++i) {
        int const q = detail::kivi_unpack(codes[detail::kivi_code_byte(i, Bits)], i, Bits);
        y[c + i] = detail::kivi_value(q, p.scale, p.min);
      }
    }
  }
};

/// KIVI-b: per-channel keys and per-token values, both b-bit with groups of G (DESIGN names
/// "kivi2", "kivi4", "kivi8").
template <int Bits, int G = 32>
struct kivi : kv_codecs<kivi_key<Bits, G>, kivi_value<Bits, G>> {
  static_assert(Bits == 2 || Bits == 4 || Bits == 8, "kvq::kivi: Bits must be 2, 4 or 8");
  static constexpr std::string_view name = detail::kivi_pair_name(Bits);
  static constexpr int bits = Bits;
  static constexpr int group = G;
};

KVQ_NAMESPACE_END
