// kvq: the codebook codecs tq_codebook<B> (B = 2, 3, 4) of already rotated rows (FORMATS.md §6.2
// steps 2-8); the public codecs tq2 / tq3 / tq4 (tq.hpp) wrap them with the rotation R.
//
// Per rotation block of size n: the norm nu = sqrtf(sum of y_i^2) (32 partial sums, reduced in a
// fixed tree), z_i = y_i * (sqrtf(n) / nu), code_i = the number of boundaries t_j < z_i between the
// Lloyd-Max centroids of a unit Gaussian (a value on a boundary takes the lower code), and the f16
// scale g = nu / rho with rho the norm of the chosen centroids (norm correction). A block of zeros
// stores scale +0 and codes 0. Decoding gives y^_i = c[code_i] * g, still in the rotated space. A
// row holding a NaN or ±Inf stores the f16 NaN 0x7E00 as every scale and codes 0, and decodes to
// NaN.
//
// Row layout: the little-endian f16 scales of the blocks in block order, then the B-bit codes of
// all head_dim coordinates as one LSB-first bit stream (coordinate i at bit B*i), ceil(B*d/8)
// bytes. At head_dim 128: 34 / 50 / 66 bytes for B = 2 / 3 / 4.
//
// The detail functions are host and CUDA code (C++14 subset), for the SIMD and GPU kernels; the
// ones Metal shares (centroids, boundaries, row sizes) are in detail/math_tq.h. This header does
// not depend on rotated.hpp, so the CPU kernels (backend/cpu) can include it.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "../detail/math_tq.h"
#include "../detail/numeric.h"
#include "../detail/rotation.h"
#include "codec.hpp"

KVQ_NAMESPACE_BEGIN
namespace detail {

#if !defined(__METAL_VERSION__)

/// The f16 scale bits of block `block` of an encoded row.
KVQ_HOST_DEVICE u16 tq_scale_bits(const u8* src, int block) {
  return static_cast<u16>(src[2 * block] | (src[2 * block + 1] << 8));
}

/// The scale g of block `block` of an encoded row, as a float32.
KVQ_HOST_DEVICE float tq_block_scale(const u8* src, int block) { return f16_bits_to_f32(tq_scale_bits(src, block)); }

/// The code of coordinate i of an encoded row of head_dim coordinates (bits = 2, 3, 4).
KVQ_HOST_DEVICE int tq_code(int bits, const u8* src, int head_dim, int i) {
  const u8* codes = src + tq_scale_bytes(head_dim);
  const int bit = bits * i;
  const int shift = bit % 8;
  u32 window = codes[bit / 8];
  if (shift + bits > 8) window |= static_cast<u32>(codes[bit / 8 + 1]) << 8;
  return static_cast<int>((window >> shift) & ((1u << bits) - 1u));
}

/// The code of coordinate i of an encoded row of head_dim coordinates of the B-bit codec.
template <int B>
KVQ_HOST_DEVICE int tq_code(const u8* src, int head_dim, int i) {
  return tq_code(B, src, head_dim, i);
}

/// The decoded value c[code_i] * g of coordinate i of an encoded row (rotated space).
KVQ_HOST_DEVICE float tq_decode_element(int bits, const u8* src, int head_dim, int i) {
  return mul_rn(tq_centroid(bits, tq_code(bits, src, head_dim, i)),
                tq_block_scale(src, rotation_block_of(head_dim, i)));
}

/// The centroids (2^bits) and boundaries (2^bits - 1) of the bits-bit codebook as float32.
KVQ_HOST_DEVICE void tq_tables(int bits, float* centroid, float* boundary) {
  for (int c = 0; c < (1 << bits); ++c) centroid[c] = tq_centroid(bits, c);
  for (int j = 0; j + 1 < (1 << bits); ++j) boundary[j] = tq_boundary(bits, j);
}

/// A row of floats in host memory, as the shared encoder reads it (at(i) = y[i]).
struct tq_float_row {
  const float* y;
  KVQ_HOST_DEVICE float at(int i) const { return y[i]; }
};

/// Encodes the finite rotation block y: (n) whose first coordinate is coordinate `offset` of the
/// row (FORMATS.md §6.2 steps 2-5): ORs its codes into the row's zeroed code bytes `codes` and
/// returns the f16 bits of its scale. `centroid` and `boundary` come from tq_tables.
KVQ_HOST_DEVICE u16 tq_encode_block(int bits, const float* y, int offset, int n, u8* codes, const float* centroid,
                                    const float* boundary) {
  return tq_encode_block_values(bits, tq_float_row{y}, offset, n, codes, centroid, boundary);
}

/// Encodes a rotated row y: (head_dim) into tq_row_bytes(bits, head_dim) bytes (FORMATS.md §6.2
/// steps 2-8).
KVQ_HOST_DEVICE void tq_encode_row(int bits, const float* y, int head_dim, u8* dst) {
  tq_encode_row_values(bits, tq_float_row{y}, head_dim, dst);
}

/// Decodes an encoded row into y^: (head_dim), y^_i = c[code_i] * g (rotated space; NaN for a
/// poisoned row).
KVQ_HOST_DEVICE void tq_decode_row(int bits, const u8* src, int head_dim, float* out) {
  float centroid[16];
  for (int c = 0; c < (1 << bits); ++c) centroid[c] = tq_centroid(bits, c);
  int block = 0;
  for (int offset = 0; offset < head_dim; ++block) {
    const int n = rotation_block_size(head_dim, offset);
    const float g = tq_block_scale(src, block);
    for (int i = offset; i < offset + n; ++i) out[i] = mul_rn(centroid[tq_code(bits, src, head_dim, i)], g);
    offset += n;
  }
}

#endif  // !__METAL_VERSION__

/// The B-bit codebook codec (B = 2, 3, 4) of already rotated rows: FORMATS.md §6.2 steps 2-8, one
/// unit per row covering all of head_dim (its rotation blocks are inside the unit).
template <int B>
struct tq_codebook {
  static_assert(B >= 2 && B <= 4, "tq codebooks have 2, 3 or 4 bits per coordinate");

  static constexpr std::string_view name = B == 2 ? "tq2-codebook" : B == 3 ? "tq3-codebook" : "tq4-codebook";
  static constexpr codec_layout layout = codec_layout::row;
  static constexpr int bits = B;
  using params_type = no_params;

  /// One unit per row: head_dim channels, 2 bytes per rotation block plus ceil(B * head_dim / 8).
  static constexpr auto geometry(int head_dim) noexcept -> block_geometry {
    return {head_dim, 1, 1, static_cast<std::size_t>(tq_row_bytes(B, head_dim))};
  }

  /// Encodes one rotated row y: (head_dim) into geometry(head_dim).bytes() bytes.
  static void encode_row(float const* y, int head_dim, std::uint8_t* dst, params_type const& = {}) noexcept {
    tq_encode_row(B, y, head_dim, dst);
  }

  /// Decodes one row into out: (head_dim), in the rotated space (no inverse rotation).
  static void decode_row(std::uint8_t const* src, int head_dim, float* out, params_type const& = {}) noexcept {
    tq_decode_row(B, src, head_dim, out);
  }

  /// The code of coordinate i of an encoded row.
  static auto code(std::uint8_t const* src, int head_dim, int i) noexcept -> int {
    return tq_code(B, src, head_dim, i);
  }

  /// The scale g of rotation block `block` of an encoded row.
  static auto scale(std::uint8_t const* src, int block) noexcept -> float { return tq_block_scale(src, block); }
};

}  // namespace detail
KVQ_NAMESPACE_END
