// kvq: element math of the codebook codecs tq2 / tq3 / tq4 (FORMATS.md §6.2; C++14 subset: C++,
// CUDA, Metal): the Lloyd-Max centroids of a unit Gaussian and their boundaries, the row sizes,
// the correctly rounded square root. The row encoders and decoders over host pointers are in
// codec/tq_codebook.hpp; the GPU kernels' own (over device pointers) in core/kernel_bodies.h.
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

}  // namespace detail
KVQ_NAMESPACE_END
