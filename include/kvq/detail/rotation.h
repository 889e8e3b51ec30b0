// kvq: the rotation R of the rotated codecs (C++14 subset; C++, CUDA, Metal).
//
// R is kvq's randomized-sign fast Walsh–Hadamard transform (FORMATS.md §6.1), defined bit-exactly
// so that every backend rotates to the same floats:
//   * blocks: head_dim d is split by its binary expansion, largest power of two first (d = 80 ->
//     [0,64) + [64,80)); each block is rotated on its own (R is block-diagonal);
//   * signs: s_i = -1 when bit (i mod 64) of the splitmix64 word w_(i/64) of the seed is 1, i the
//     channel index within the row (not within the block); applying a sign flips the sign bit;
//   * forward, per block of size n: signs, butterfly stages h = 1, 2, 4, ..., n/2 in that order
//     ((a, b) -> (a + b, a - b), each a rounded float32 add), then a product by c_n, the float32
//     nearest 1/sqrt(n);
//   * inverse: the same butterflies, the product by c_n, then the signs.
// Every rounded step goes through add_rn / mul_rn: no contraction, whatever the compiler flags.
// The functions taking pointers are host and CUDA only (a Metal pointer needs an address space).
#pragma once

#include "config.h"

KVQ_NAMESPACE_BEGIN
namespace detail {

#if defined(__METAL_VERSION__)
typedef ulong u64;
#else
typedef uint64_t u64;
#endif

/// The splitmix64 increment (the golden-ratio constant).
KVQ_CONSTEXPR_VAR u64 rotation_splitmix_gamma = 0x9E3779B97F4A7C15u;
/// The float32 nearest 1/sqrt(2) (bits 3f3504f3).
KVQ_CONSTEXPR_VAR u32 rotation_rsqrt2_bits = 0x3f3504f3u;

/// The j-th output (j = 0 first) of splitmix64 seeded with `seed`: the mix of seed + (j+1)·gamma.
KVQ_HOST_DEVICE u64 rotation_sign_word(u64 seed, int j) {
  u64 z = seed + (static_cast<u64>(j) + 1u) * rotation_splitmix_gamma;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9u;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBu;
  return z ^ (z >> 31);
}

/// Number of 64-bit sign words of a row of head_dim channels: ceil(head_dim / 64).
KVQ_HOST_DEVICE constexpr int rotation_word_count(int head_dim) { return (head_dim + 63) / 64; }

/// Size of the rotation block starting at channel `offset` (a block start, 0 <= offset < head_dim):
/// the largest power of two not above head_dim - offset; 0 when offset >= head_dim.
KVQ_HOST_DEVICE constexpr int rotation_block_size(int head_dim, int offset) {
  const int rest = head_dim - offset;
  if (rest <= 0) return 0;
  int n = 1;
  while (n <= rest / 2) n *= 2;
  return n;
}

/// Number of rotation blocks of head_dim (> 0): the number of 1 bits of head_dim.
KVQ_HOST_DEVICE constexpr int rotation_block_count(int head_dim) {
  int count = 0;
  for (u32 v = static_cast<u32>(head_dim); v != 0u; v >>= 1) count += static_cast<int>(v & 1u);
  return count;
}

/// Index of the rotation block holding channel i (0 <= i < head_dim).
KVQ_HOST_DEVICE constexpr int rotation_block_of(int head_dim, int i) {
  int block = 0;
  int offset = 0;
  for (int n = rotation_block_size(head_dim, 0); offset + n <= i; n = rotation_block_size(head_dim, offset)) {
    offset += n;
    ++block;
  }
  return block;
}

/// Offset of the rotation block holding channel i (0 <= i < head_dim).
KVQ_HOST_DEVICE constexpr int rotation_block_start(int head_dim, int i) {
  int offset = 0;
  for (int n = rotation_block_size(head_dim, 0); offset + n <= i; n = rotation_block_size(head_dim, offset))
    offset += n;
  return offset;
}

/// c_n, the float32 nearest 1/sqrt(n) for a power of two n (1 <= n <= 2^30): 2^(-e/2) exactly for
/// n = 2^e with e even, the float32 nearest 1/sqrt(2) times 2^(-(e-1)/2) (exact scaling) for e odd.
KVQ_HOST_DEVICE float rotation_scale(int n) {
  int e = 0;
  while ((n >> e) > 1) ++e;
  if ((e & 1) == 0) return f32_from_bits(static_cast<u32>(127 - e / 2) << 23);
  return f32_from_bits(rotation_rsqrt2_bits - (static_cast<u32>((e - 1) / 2) << 23));
}

/// s · x exactly: x with its sign bit flipped when bit `bit` (0..63) of the sign word is 1.
KVQ_HOST_DEVICE float rotation_apply_sign(float x, u64 word, int bit) {
  const u32 flip = static_cast<u32>((word >> bit) & 1u) << 31;
  return f32_from_bits(f32_bits(x) ^ flip);
}

#if !defined(__METAL_VERSION__)

/// Writes the rotation_word_count(head_dim) sign words of `seed` to `words`.
KVQ_HOST_DEVICE void rotation_sign_words(u64 seed, int head_dim, u64* words) {
  for (int j = 0; j < rotation_word_count(head_dim); ++j) words[j] = rotation_sign_word(seed, j);
}

/// Applies the signs s_i of the sign words `words` to x: (head_dim), in place.
KVQ_HOST_DEVICE void rotation_apply_signs(float* x, int head_dim, const u64* words) {
  for (int i = 0; i < head_dim; ++i) x[i] = rotation_apply_sign(x[i], words[i / 64], i % 64);
}

/// Applies the signs s_i of `seed` to x: (head_dim), in place, each word computed once.
KVQ_HOST_DEVICE void rotation_apply_signs_seed(float* x, int head_dim, u64 seed) {
  for (int j = 0; 64 * j < head_dim; ++j) {
    const u64 word = rotation_sign_word(seed, j);
    const int end = head_dim - 64 * j < 64 ? head_dim : 64 * j + 64;
    for (int i = 64 * j; i < end; ++i) x[i] = rotation_apply_sign(x[i], word, i - 64 * j);
  }
}

/// The butterfly stages h = 1, 2, ..., n/2 (in that order) of one block u: (n), n a power of two:
/// (u_i, u_(i+h)) -> (u_i + u_(i+h), u_i - u_(i+h)) for every i with (i & h) = 0.
KVQ_HOST_DEVICE void rotation_butterflies(float* u, int n) {
  for (int h = 1; h < n; h *= 2)
    for (int s = 0; s < n; s += 2 * h)
      for (int i = s; i < s + h; ++i) {
        const float a = u[i];
        const float b = u[i + h];
        u[i] = add_rn(a, b);
        u[i + h] = add_rn(a, -b);
      }
}

/// The butterflies of every block of x: (head_dim), then the product of each block by its c_n.
KVQ_HOST_DEVICE void rotation_transform_blocks(float* x, int head_dim) {
  for (int offset = 0; offset < head_dim;) {
    const int n = rotation_block_size(head_dim, offset);
    rotation_butterflies(x + offset, n);
    const float c = rotation_scale(n);
    for (int i = offset; i < offset + n; ++i) x[i] = mul_rn(x[i], c);
    offset += n;
  }
}

/// y = R x in place (x: (head_dim)), R of the given seed.
KVQ_HOST_DEVICE void rotate_forward(float* x, int head_dim, u64 seed) {
  rotation_apply_signs_seed(x, head_dim, seed);
  rotation_transform_blocks(x, head_dim);
}

/// x = R^T y in place (x: (head_dim)), R of the given seed.
KVQ_HOST_DEVICE void rotate_inverse(float* x, int head_dim, u64 seed) {
  rotation_transform_blocks(x, head_dim);
  rotation_apply_signs_seed(x, head_dim, seed);
}

/// rotate_forward with the seed's sign words precomputed by rotation_sign_words (same bits).
KVQ_HOST_DEVICE void rotate_forward_signs(float* x, int head_dim, const u64* words) {
  rotation_apply_signs(x, head_dim, words);
  rotation_transform_blocks(x, head_dim);
}

/// rotate_inverse with the seed's sign words precomputed by rotation_sign_words (same bits).
KVQ_HOST_DEVICE void rotate_inverse_signs(float* x, int head_dim, const u64* words) {
  rotation_transform_blocks(x, head_dim);
  rotation_apply_signs(x, head_dim, words);
}

#endif  // !__METAL_VERSION__

}  // namespace detail
KVQ_NAMESPACE_END
