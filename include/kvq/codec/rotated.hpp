// kvq: rotated<C>, any codec applied to rows rotated by kvq's randomized-sign Walsh–Hadamard
// transform R (FORMATS.md §6.1).
//
// A rotated side stores C(R x) for every appended row x (keys, values, or both: choose per side,
// e.g. `kv_codecs<rotated<q4_0>, rotated<q4_0>>`). R spreads a few outlier channels over every
// coordinate of their block, so a per-block scale fits the row better. Attention rotates each
// query head once (q·k = Rq·Rk) and un-rotates each output head once (values are accumulated in
// the rotated space), so the per-token work is C's; reads return Rᵀ decode(stored). Every step
// is a rounded f32 operation in a fixed order, so the stored bytes are the same on every backend.
//
// The seed is a template parameter (32 bits, recorded in saved fingerprints); the same seed must
// be used to read the bytes back. A KIVI side rotates what enters its f16 residual, so the
// residual, its flushes and truncation all live in the rotated space.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>
#include <vector>

#include "../backend/cpu/kernels.hpp"
#include "../detail/rotation.h"
#include "codec.hpp"

KVQ_NAMESPACE_BEGIN

/// The rotation seed of FORMATS.md §6.1, used unless a codec names another.
inline constexpr std::uint64_t default_rotation_seed = 0x6B7671;

/// A codec whose rows are stored rotated: it names the codec of the stored bytes and its seed.
template <class C>
concept rotated_codec = codec<C> && requires {
  typename C::stored_codec;
  { C::rotation_seed } -> std::convertible_to<std::uint64_t>;
};

/// The codec that reads and writes the stored bytes of C: C itself, or the inner codec of a
/// rotated codec (whose kernels then work in the rotated space).
template <class C>
struct stored_codec_of {
  using type = C;
};
template <rotated_codec C>
struct stored_codec_of<C> {
  using type = typename C::stored_codec;
};
template <class C>
using stored_codec_t = typename stored_codec_of<C>::type;

namespace detail {

/// The characters `Prefix` followed by C's name, as a constant array (the names of the wrapper
/// codecs: "rot-q4_0", "ctr-q4_0").
template <codec C, char... Prefix>
inline constexpr auto prefixed_name_chars = [] {
  std::array<char, C::name.size() + sizeof...(Prefix)> a{Prefix...};
  for (std::size_t i = 0; i < C::name.size(); ++i) a[i + sizeof...(Prefix)] = C::name[i];
  return a;
}();

/// "rot-" followed by C's name, as a constant array.
template <codec C>
inline constexpr auto const& rotated_name_chars = prefixed_name_chars<C, 'r', 'o', 't', '-'>;

/// The KIVI constants (bits, group) of C, forwarded when C has them.
template <class C>
struct rotated_constants {};
template <class C>
requires requires {
  C::bits;
  C::group;
}
struct rotated_constants<C> {
  static constexpr int bits = C::bits;
  static constexpr int group = C::group;
};

/// R and Rᵀ for rows of one head_dim under one seed, with the sign words computed once (held in
/// place up to head_dim 1024, so building one for a call allocates nothing).
class row_rotation {
 public:
  row_rotation(int head_dim, std::uint64_t seed) : head_dim_(head_dim) {
    auto const n = static_cast<std::size_t>(rotation_word_count(head_dim));
    if (n > small_.size()) large_.resize(n);
    rotation_sign_words(seed, head_dim, words());
  }
  /// x ← R x for one row of head_dim floats (the SIMD kernels of this translation unit's level,
  /// bit-identical to detail::rotate_forward_signs).
  void forward(float* x) const noexcept { forward_rows(x, 1, head_dim_); }
  /// x ← Rᵀ x for one row of head_dim floats.
  void inverse(float* x) const noexcept { inverse_rows(x, 1, head_dim_); }
  /// Applies forward to `rows` rows `stride` floats apart.
  void forward_rows(float* x, std::int64_t rows, std::ptrdiff_t stride) const noexcept {
    cpu_kernels::rotate_forward_rows(x, rows, stride, head_dim_, words());
  }
  /// y + r * y_stride <- R (x + r * x_stride) for `rows` rows (rows of y that do not overlap x's).
  void forward_rows(float const* x, std::ptrdiff_t x_stride, float* y, std::ptrdiff_t y_stride,
                    std::int64_t rows) const noexcept {
    cpu_kernels::rotate_forward_rows(x, x_stride, y, y_stride, rows, head_dim_, words());
  }
  /// Applies inverse to `rows` rows `stride` floats apart.
  void inverse_rows(float* x, std::int64_t rows, std::ptrdiff_t stride) const noexcept {
    cpu_kernels::rotate_inverse_rows(x, rows, stride, head_dim_, words());
  }

 private:
  auto words() noexcept -> std::uint64_t* { return large_.empty() ? small_.data() : large_.data(); }
  auto words() const noexcept -> std::uint64_t const* { return large_.empty() ? small_.data() : large_.data(); }
  int head_dim_;
  std::array<std::uint64_t, 16> small_{};
  std::vector<std::uint64_t> large_;
};

/// The rotation of codec C's side: R under C's seed when C is rotated, none otherwise.
template <class C>
struct side_rotation {
  static constexpr bool active = false;
  explicit side_rotation(int) noexcept {}
  void forward_rows(float*, std::int64_t, std::ptrdiff_t) const noexcept {}
  void inverse_rows(float*, std::int64_t, std::ptrdiff_t) const noexcept {}
  /// The rotation, or nullptr when the side is not rotated.
  auto get() const noexcept -> row_rotation const* { return nullptr; }
};
template <rotated_codec C>
struct side_rotation<C> : row_rotation {
  static constexpr bool active = true;
  explicit side_rotation(int head_dim) : row_rotation(head_dim, C::rotation_seed) {}
  auto get() const noexcept -> row_rotation const* { return this; }
};

}  // namespace detail

/// Codec C applied to R x (FORMATS.md §6.1) with rotation seed `Seed` (below 2^32).
///
/// Same geometry, parameters and NaN rules as C (a NaN or Inf input reaches every coordinate of
/// its rotation block, so C poisons the blocks covering it). `encode_row` / `decode_row` (and the
/// KIVI tile forms) rotate and un-rotate around C's; the caches and attention instead run C's
/// kernels on the stored bytes and rotate only queries, inputs and outputs.
template <codec C, std::uint64_t Seed = default_rotation_seed>
struct rotated : detail::rotated_constants<C> {
  static_assert(!rotated_codec<C>, "kvq: rotated<rotated<C>> is not a codec; rotate once");
  static_assert(Seed <= 0xffffffffu, "kvq: rotation seeds are below 2^32 (saved fingerprints hold 32 bits)");
  using stored_codec = C;
  static constexpr std::uint64_t rotation_seed = Seed;
  static constexpr std::string_view name{detail::rotated_name_chars<C>.data(), detail::rotated_name_chars<C>.size()};
  static constexpr codec_layout layout = C::layout;
  using params_type = typename C::params_type;

  /// C's geometry.
  static constexpr auto geometry(int head_dim) noexcept -> block_geometry { return C::geometry(head_dim); }

  /// Encodes R x for one row x: (head_dim).
  static void encode_row(float const* x, int head_dim, std::uint8_t* dst,
                         params_type const& p = {}) requires row_codec<C> {
    std::vector<float> y(x, x + head_dim);
    detail::row_rotation(head_dim, Seed).forward(y.data());
    C::encode_row(y.data(), head_dim, dst, p);
  }

  /// Decodes one row and un-rotates it into y: (head_dim).
  static void decode_row(std::uint8_t const* src, int head_dim, float* y,
                         params_type const& p = {}) requires row_codec<C> {
    C::decode_row(src, head_dim, y, p);
    detail::row_rotation(head_dim, Seed).inverse(y);
  }

  /// Encodes the rotated rows of a tile x: (G, head_dim), rows token_stride apart.
  static void encode_tile(float const* x, std::ptrdiff_t token_stride, int head_dim, std::uint8_t* dst,
                          params_type const& p = {}) requires token_group_codec<C> {
    std::vector<float> y(static_cast<std::size_t>(C::group) * static_cast<std::size_t>(head_dim));
    detail::row_rotation const r(head_dim, Seed);
    for (int t = 0; t < C::group; ++t) {
      float* row = y.data() + static_cast<std::ptrdiff_t>(t) * head_dim;
      for (int c = 0; c < head_dim; ++c) row[c] = x[static_cast<std::ptrdiff_t>(t) * token_stride + c];
      r.forward(row);
    }
    C::encode_tile(y.data(), head_dim, head_dim, dst, p);
  }

  /// Decodes token `token` of a tile and un-rotates it into y: (head_dim).
  static void decode_token(std::uint8_t const* src, int head_dim, int token, float* y,
                           params_type const& p = {}) requires token_group_codec<C> {
    C::decode_token(src, head_dim, token, y, p);
    detail::row_rotation(head_dim, Seed).inverse(y);
  }
};

KVQ_NAMESPACE_END
