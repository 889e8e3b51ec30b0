// kvq: element math of the codebook codecs tq2 / tq3 / tq4 (FORMATS.md §6.2; C++14 subset: C++,
// CUDA, Metal): the Lloyd-Max centroids of a unit Gaussian and their boundaries, the row sizes,
// the correctly rounded square root, and the row encoder every backend runs (over a row accessor:
// host memory on the CPU, rotated coordinates computed in place by the GPU kernel bodies). The
// decoders and the CPU's pointer forms are in codec/tq_codebook.hpp.
#pragma once

#if !defined(__METAL_VERSION__)
#  include <math.h>
#endif

#include "numeric.h"
#include "rotation.h"

KVQ_NAMESPACE_BEGIN
namespace detail {

/// The f16 scale of every block of a row that holds a NaN or ±Inf.
KVQ_CONSTEXPR_VAR u16 tq_poisoned_scale = 0x7e00u;

/// fl32(sqrt(x)), correctly rounded on every backend.
KVQ_HOST_DEVICE float tq_sqrt(float x) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#elif defined(__METAL_VERSION__)
  return metal::precise::sqrt(x);
#else
  return sqrtf(x);
#endif
}

/// Bits of the j-th positive centroid (ascending, 0 <= j < 2^(bits-1)) of the bits-bit codebook.
KVQ_HOST_DEVICE u32 tq_positive_centroid_bits(int bits, int j) {
  if (bits == 2) return j == 0 ? 0x3ee7d567u : 0x3fc154cau;
  if (bits == 3) {
    switch (j) {
      case 0:
        return 0x3e7afb7fu;
      case 1:
        return 0x3f418937u;
      case 2:
        return 0x3fac0831u;
      default:
        return 0x4009ba5eu;
    }
  }
  switch (j) {
    case 0:
      return 0x3e037b4au;
    case 1:
      return 0x3ec6b50bu;
    case 2:
      return 0x3f28240bu;
    case 3:
      return 0x3f714120u;
    case 4:
      return 0x3fa0cb29u;
    case 5:
      return 0x3fcf1aa0u;
    case 6:
      return 0x40046a7fu;
    default:
      return 0x402ee2ebu;
  }
}

/// The centroid c_code (0 <= code < 2^bits, ascending, c_(2^bits-1-j) = -c_j) of the bits-bit
/// codebook (bits = 2, 3, 4) as a float32.
KVQ_HOST_DEVICE float tq_centroid(int bits, int code) {
  const int half = 1 << (bits - 1);
  if (code >= half) return f32_from_bits(tq_positive_centroid_bits(bits, code - half));
  return f32_from_bits(tq_positive_centroid_bits(bits, half - 1 - code) | 0x80000000u);
}

/// The boundary t_j = (c_j + c_(j+1)) * 0.5 in float32 (0 <= j < 2^bits - 1).
KVQ_HOST_DEVICE float tq_boundary(int bits, int j) {
  return mul_rn(add_rn(tq_centroid(bits, j), tq_centroid(bits, j + 1)), 0.5f);
}

/// The code of a normalised value z: the number of boundaries t_j strictly below z.
KVQ_HOST_DEVICE int tq_code_of(int bits, float z) {
  int code = 0;
  for (int j = 0; j < (1 << bits) - 1; ++j) code += tq_boundary(bits, j) < z ? 1 : 0;
  return code;
}

/// Number of bytes of the f16 scales of a row (two per rotation block); the codes follow them.
KVQ_HOST_DEVICE constexpr int tq_scale_bytes(int head_dim) { return 2 * rotation_block_count(head_dim); }

/// Number of bytes of an encoded row: the scales, then ceil(bits * head_dim / 8) bytes of codes.
KVQ_HOST_DEVICE constexpr int tq_row_bytes(int bits, int head_dim) {
  return tq_scale_bytes(head_dim) + (bits * head_dim + 7) / 8;
}

/// Adds v * v (product rounded) to partial sum i mod 32 of p: (32), a pointer in any address space.
template <class P>
KVQ_HOST_DEVICE void tq_accumulate_square(P p, int i, float v) {
  p[i & 31] = add_rn(p[i & 31], mul_rn(v, v));
}

/// Reduces the 32 partial sums p in place, p_l += p_(l+16) for l < 16, then +8, +4, +2, +1, and
/// returns p_0.
template <class P>
KVQ_HOST_DEVICE float tq_reduce_partials(P p) {
  for (int w = 16; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) p[l] = add_rn(p[l], p[l + w]);
  return p[0];
}

/// Writes the scale bits of block `block` of an encoded row (a byte pointer in any address space).
template <class Bytes>
KVQ_HOST_DEVICE void tq_set_scale_bits(Bytes dst, int block, u16 scale) {
  dst[2 * block] = static_cast<u8>(scale & 0xffu);
  dst[2 * block + 1] = static_cast<u8>(scale >> 8);
}

/// Coordinates [offset, offset + n) of a row read through `Row` (at(i): coordinate i), as the
/// block encoder reads them (at(i): coordinate offset + i).
template <class Row>
struct tq_block_values {
  Row row;
  int offset;
  KVQ_HOST_DEVICE float at(int i) { return row.at(offset + i); }
};

/// Encodes the finite rotation block y (at(i), 0 <= i < n) whose first coordinate is coordinate
/// `offset` of the row (FORMATS.md §6.2 steps 2-5): ORs its codes into the row's zeroed code bytes
/// `codes` and returns the f16 bits of its scale. `centroid` and `boundary` hold the codebook's
/// 2^bits centroids and 2^bits - 1 boundaries as float32. The one encoder of every backend: the
/// CPU reads y from memory, the GPU kernel bodies compute each rotated coordinate.
template <class Block, class Codes, class Table>
KVQ_HOST_DEVICE u16 tq_encode_block_values(int bits, Block y, int offset, int n, Codes codes, Table centroid,
                                           Table boundary) {
  const int levels = 1 << bits;
  float p[32];
  for (int l = 0; l < 32; ++l) p[l] = 0.0f;
  for (int i = 0; i < n; ++i) tq_accumulate_square(p, i, y.at(i));
  const float nu = tq_sqrt(tq_reduce_partials(p));
  if (nu == 0.0f) return 0;  // a block of zeros: scale +0, codes 0
  const float k = div_rn(tq_sqrt(static_cast<float>(n)), nu);
  for (int l = 0; l < 32; ++l) p[l] = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float z = mul_rn(y.at(i), k);
    int code = 0;
    for (int j = 0; j + 1 < levels; ++j) code += boundary[j] < z ? 1 : 0;
    const int bit = bits * (offset + i);
    const u32 shifted = static_cast<u32>(code) << (bit % 8);
    codes[bit / 8] = static_cast<u8>(codes[bit / 8] | (shifted & 0xffu));
    if (shifted > 0xffu) codes[bit / 8 + 1] = static_cast<u8>(codes[bit / 8 + 1] | (shifted >> 8));
    tq_accumulate_square(p, i, centroid[code]);
  }
  const float rho = tq_sqrt(tq_reduce_partials(p));
  return f32_to_f16_bits(div_rn(nu, rho));
}

/// Encodes a rotated row y (at(i): coordinate i, 0 <= i < head_dim) into tq_row_bytes(bits,
/// head_dim) bytes at dst (FORMATS.md §6.2 steps 2-8): a row holding a NaN or an infinity stores
/// tq_poisoned_scale in every block and codes 0.
template <class Row, class Bytes>
KVQ_HOST_DEVICE void tq_encode_row_values(int bits, Row y, int head_dim, Bytes dst) {
  const int blocks = rotation_block_count(head_dim);
  Bytes codes = dst + 2 * blocks;
  const int code_bytes = (bits * head_dim + 7) / 8;
  for (int k = 0; k < code_bytes; ++k) codes[k] = 0;
  bool finite = true;
  for (int i = 0; i < head_dim && finite; ++i) finite = is_finite_f32(y.at(i));
  if (!finite) {
    for (int b = 0; b < blocks; ++b) tq_set_scale_bits(dst, b, tq_poisoned_scale);
    return;
  }
  float centroid[16];
  float boundary[15];
  for (int c = 0; c < (1 << bits); ++c) centroid[c] = tq_centroid(bits, c);
  for (int j = 0; j + 1 < (1 << bits); ++j) boundary[j] = tq_boundary(bits, j);
  int block = 0;
  for (int offset = 0; offset < head_dim; ++block) {
    const int n = rotation_block_size(head_dim, offset);
    tq_block_values<Row> values;
    values.row = y;
    values.offset = offset;
    tq_set_scale_bits(dst, block, tq_encode_block_values(bits, values, offset, n, codes, centroid, boundary));
    offset += n;
  }
}

}  // namespace detail
KVQ_NAMESPACE_END
