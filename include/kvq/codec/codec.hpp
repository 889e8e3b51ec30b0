// kvq: the codec concept, block geometry and the (codec, backend) dispatch point.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "../detail/numeric.h"

KVQ_NAMESPACE_BEGIN

/// How a codec groups the values of the cache.
enum class codec_layout {
  row,          ///< each (token, kv_head) row of head_dim values is encoded on its own
  token_group,  ///< G consecutive tokens of one kv_head are encoded together (per-channel groups)
};

/// Run-time parameters of a codec that has none.
struct no_params {
  friend constexpr bool operator==(no_params, no_params) = default;
};

/// Geometry of one encoded unit: a row (row codecs) or a tile of `tokens` tokens (token-group codecs).
///
/// A unit is `blocks` consecutive blocks of `block_bytes` bytes; each block covers
/// `block_channels` channels of head_dim (the last one zero-padded when it does not divide).
struct block_geometry {
  int block_channels = 1;       ///< channels covered by one block, padding included
  int blocks = 1;               ///< blocks per unit
  int tokens = 1;               ///< tokens per unit: 1 for row codecs, G for token-group codecs
  std::size_t block_bytes = 0;  ///< bytes per block, scales included

  /// Bytes of one encoded unit.
  constexpr auto bytes() const noexcept -> std::size_t { return static_cast<std::size_t>(blocks) * block_bytes; }
  /// Channels stored per token, padding included.
  constexpr auto padded_channels() const noexcept -> int { return blocks * block_channels; }
  friend constexpr bool operator==(block_geometry const&, block_geometry const&) = default;
};

/// A codec policy: a name (DESIGN §8), a layout, run-time parameters and a geometry per head_dim.
template <class C>
concept codec = requires {
  { C::name } -> std::convertible_to<std::string_view>;
  { C::layout } -> std::convertible_to<codec_layout>;
  typename C::params_type;
  { C::geometry(1) } -> std::same_as<block_geometry>;
};

/// A codec that encodes each (token, kv_head) row of head_dim values independently.
template <class C>
concept row_codec = codec<C> && (C::layout == codec_layout::row) &&
                    requires(float const* x, std::uint8_t* dst, std::uint8_t const* src, float* y, int head_dim,
                             typename C::params_type const& p) {
                      C::encode_row(x, head_dim, dst, p);  // x: (head_dim) -> dst: geometry(head_dim).bytes()
                      C::decode_row(src, head_dim, y, p);  // src -> y: (head_dim)
                    };

/// A codec that encodes G consecutive tokens of one kv_head together (KIVI keys).
template <class C>
concept token_group_codec =
    codec<C> && (C::layout == codec_layout::token_group) &&
    requires(float const* x, std::ptrdiff_t token_stride, std::uint8_t* dst, std::uint8_t const* src, float* y,
             int head_dim, int token, typename C::params_type const& p) {
      C::encode_tile(x, token_stride, head_dim, dst, p);  // x: (G, head_dim), rows token_stride apart
      C::decode_token(src, head_dim, token, y, p);        // token of the tile -> y: (head_dim)
    };

/// Effective bits per element of a codec at a head_dim (scales and padding included).
template <codec C>
constexpr auto bits_per_element(int head_dim) noexcept -> double {
  auto const g = C::geometry(head_dim);
  return static_cast<double>(g.bytes()) * 8.0 / (static_cast<double>(g.tokens) * head_dim);
}

/// A key codec and a value codec used together by one cache.
template <codec K, codec V>
struct kv_codecs {
  using key_codec = K;
  using value_codec = V;
};

namespace detail {
template <class T>
struct is_kv_codecs : std::false_type {};
template <class K, class V>
struct is_kv_codecs<kv_codecs<K, V>> : std::true_type {};
template <class T>
struct dependent_false : std::false_type {};
}  // namespace detail

/// Either a single codec (used for K and V) or a `kv_codecs` pair; named codec pairs such as
/// `kivi<4>` derive from `kv_codecs`.
template <class T>
concept codec_choice = codec<T> || std::is_base_of_v<kv_codecs<typename T::key_codec, typename T::value_codec>, T>;

/// The key and value codecs of a codec choice.
template <class T>
struct codec_pair {
  using key = typename T::key_codec;
  using value = typename T::value_codec;
};
template <codec C>
struct codec_pair<C> {
  using key = C;
  using value = C;
};

KVQ_NAMESPACE_END
