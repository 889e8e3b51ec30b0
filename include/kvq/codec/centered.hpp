// kvq: centered<C>, key centering: a key codec C applied to k − μ, μ a per-(layer, kv_head,
// channel) mean of the keys.
//
// Softmax is invariant to a constant added to every logit of one query: with keys stored as
// C(k − μ), the logits computed from the stored keys differ from the true ones by scale · (q·μ),
// the same for every token, so the attention adds that term back once per query row (it matters
// where it does not cancel: before a softcap, and against a sink). Centering removes the large
// common part of the keys (a channel bias, outlier channels' offsets), so C's per-block scale
// spends its codes on what varies between tokens.
//
// μ (f32, kv_heads × head_dim per layer, and per sequence in a paged cache) is fixed by the first
// append into an empty layer: the mean of that chunk's keys per (kv_head, channel), over the
// finite values (a channel with none gets 0), so a NaN or Inf key poisons its own blocks only,
// as with C. It is kept while the layer holds tokens (truncate, shift_left) and cleared when the
// layer becomes empty (reset, truncation or a shift to 0 tokens). Reads return decode + μ.
// centered<rotated<X>> subtracts μ, then rotates (the stored bytes are X(R(k − μ))).
//
// Keys only (values are weighted, not dotted, so a shift does not cancel). The CPU caches keep μ
// here (key_means); the CUDA and Metal caches keep it in device memory beside each layer's (or
// each sequence's) storage, where the kernels of core/kernel_bodies.h compute, subtract and add it
// by the same rules (core/cache_core.hpp, paged_core.hpp).
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "../backend/backend.hpp"
#include "../core/cache_types.hpp"
#include "../detail/host_vector.hpp"
#include "codec.hpp"
#include "rotated.hpp"

KVQ_NAMESPACE_BEGIN

/// A codec whose keys are stored centered: it names the codec applied to k − μ.
template <class C>
concept centered_codec = codec<C> && requires {
  typename C::centered_inner;
};

namespace detail {

/// "ctr-" followed by C's name, as a constant array.
template <codec C>
inline constexpr auto const& centered_name_chars = prefixed_name_chars<C, 'c', 't', 'r', '-'>;

/// The stored codec and rotation seed of a rotated C, forwarded so that centered<rotated<X>> is a
/// rotated codec (its queries, inputs and reads are rotated as rotated<X>'s).
template <class C>
struct centered_rotation {};
template <rotated_codec C>
struct centered_rotation<C> {
  using stored_codec = typename C::stored_codec;
  static constexpr std::uint64_t rotation_seed = C::rotation_seed;
};

}  // namespace detail

/// Key codec C applied to k − μ (see the file comment). Same geometry, parameters, layout and
/// NaN rules as C; `encode_row` / `decode_row` are C's (they see centered rows: the mean lives in
/// the cache, not in the bytes).
template <codec C>
struct centered : detail::rotated_constants<C>, detail::centered_rotation<C> {
  static_assert(!centered_codec<C>, "kvq: centered<centered<C>> is not a codec; center once");
  using centered_inner = C;
  static constexpr std::string_view name{detail::centered_name_chars<C>.data(), detail::centered_name_chars<C>.size()};
  static constexpr codec_layout layout = C::layout;
  using params_type = typename C::params_type;

  /// C's geometry.
  static constexpr auto geometry(int head_dim) noexcept -> block_geometry { return C::geometry(head_dim); }
};

/// A centered codec that is not rotated stores its inner codec's bytes (a rotated one is a
/// rotated_codec, whose stored codec is the rotated codec's).
template <centered_codec C>
requires(!rotated_codec<C>) struct stored_codec_of<C> {
  using type = stored_codec_t<typename C::centered_inner>;
};

namespace detail {

/// The key means μ of one cache (flat: its layers; paged: one sequence's layers): per layer a
/// flag and kv_heads × head_dim floats, zero until fixed.
class key_means {
 public:
  key_means() = default;
  key_means(int layers, int kv_heads, int head_dim)
      : kv_heads_(kv_heads),
        head_dim_(head_dim),
        mu_(static_cast<std::size_t>(layers) * static_cast<std::size_t>(kv_heads) * static_cast<std::size_t>(head_dim),
            0.0f),
        fixed_(static_cast<std::size_t>(layers), 0) {}

  /// Floats per layer (kv_heads × head_dim).
  auto per_layer() const noexcept -> std::size_t {
    return static_cast<std::size_t>(kv_heads_) * static_cast<std::size_t>(head_dim_);
  }
  /// True once the first append into the (then empty) layer fixed its μ.
  auto fixed(int layer) const noexcept -> bool { return fixed_[static_cast<std::size_t>(layer)] != 0; }
  /// μ of (layer, head): head_dim floats (zeros while not fixed).
  auto of(int layer, int head) const noexcept -> float const* {
    return mu_.data() + static_cast<std::size_t>(layer) * per_layer() +
           static_cast<std::size_t>(head) * static_cast<std::size_t>(head_dim_);
  }
  /// μ of every head of `layer`: (kv_heads, head_dim).
  auto layer(int layer) noexcept -> float* { return mu_.data() + static_cast<std::size_t>(layer) * per_layer(); }
  auto layer(int layer) const noexcept -> float const* { return of(layer, 0); }
  /// Sets μ of `layer` to `mu` (kv_heads × head_dim floats) and marks it fixed.
  void fix(int layer, float const* mu) noexcept {
    std::copy(mu, mu + per_layer(), this->layer(layer));
    fixed_[static_cast<std::size_t>(layer)] = 1;
  }
  /// Clears μ of `layer` (it empties).
  void clear(int layer) noexcept {
    std::fill_n(this->layer(layer), per_layer(), 0.0f);
    fixed_[static_cast<std::size_t>(layer)] = 0;
  }

 private:
  int kv_heads_ = 0;
  int head_dim_ = 0;
  vector<float> mu_;
  vector<unsigned char> fixed_;
};

/// What a cache of key codec K keeps for centering: key_means for a centered K, else nothing.
struct no_key_means {
  no_key_means() = default;
  no_key_means(int, int, int) noexcept {}
};
template <class K>
using key_means_for = std::conditional_t<centered_codec<K>, key_means, no_key_means>;

/// Writes into `mu` (kv_heads × head_dim) the mean over the tokens of `keys` of every (kv_head,
/// channel), over its finite values (0 where there is none): their f32 sum in token order, each
/// add rounded, divided by their count (f32, correctly rounded). Every backend computes this very
/// rule (the GPUs in kvq::kernels::key_mean_at; f32 because Metal has no double), so μ, and with
/// it the stored bytes, are the same on all of them.
template <class T>
void chunk_key_mean(kv_tensor<T> const& keys, float* mu) {
  vector<float> sum(static_cast<std::size_t>(keys.head_dim));
  vector<std::int64_t> n(static_cast<std::size_t>(keys.head_dim));
  for (int h = 0; h < keys.kv_heads; ++h) {
    std::fill(sum.begin(), sum.end(), 0.0f);
    std::fill(n.begin(), n.end(), 0);
    for (std::int64_t t = 0; t < keys.tokens; ++t) {
      T const* row = keys.data + t * keys.token_stride + static_cast<std::int64_t>(h) * keys.head_stride;
      for (int c = 0; c < keys.head_dim; ++c) {
        float const x = to_f32(row[c]);
        if (!std::isfinite(x)) continue;
        sum[static_cast<std::size_t>(c)] += x;
        ++n[static_cast<std::size_t>(c)];
      }
    }
    for (int c = 0; c < keys.head_dim; ++c) {
      std::size_t const cc = static_cast<std::size_t>(c);
      mu[static_cast<std::size_t>(h) * static_cast<std::size_t>(keys.head_dim) + cc] =
          n[cc] > 0 ? sum[cc] / static_cast<float>(n[cc]) : 0.0f;
    }
  }
}

/// The rows k − μ of `keys`, token-major f32 (tokens, kv_heads, head_dim), into `out`.
template <class T>
void centered_keys(kv_tensor<T> const& keys, float const* mu, vector<float>& out) {
  std::size_t const d = static_cast<std::size_t>(keys.head_dim);
  std::size_t const kv = static_cast<std::size_t>(keys.kv_heads);
  out.resize(static_cast<std::size_t>(keys.tokens) * kv * d);
  for (std::int64_t t = 0; t < keys.tokens; ++t)
    for (std::size_t h = 0; h < kv; ++h) {
      T const* row = keys.data + t * keys.token_stride + static_cast<std::int64_t>(h) * keys.head_stride;
      float* y = out.data() + (static_cast<std::size_t>(t) * kv + h) * d;
      float const* m = mu + h * d;
      for (std::size_t c = 0; c < d; ++c) y[c] = to_f32(row[c]) - m[c];
    }
}

/// Adds μ (head_dim floats) to `count` f32 rows `stride` apart.
inline void add_key_mean(float* rows, std::int64_t count, std::int64_t stride, int head_dim, float const* mu) noexcept {
  for (std::int64_t i = 0; i < count; ++i)
    for (int c = 0; c < head_dim; ++c) rows[i * stride + c] += mu[c];
}

/// scale · (q·μ) for `rows` query rows of head_dim floats (rows of q head_dim apart), into `out`;
/// μ is in the space of the prepared query (rotated for a rotated key codec).
inline void key_mean_offsets(float const* q, int rows, int head_dim, float const* mu, float scale,
                             float* out) noexcept {
  for (int r = 0; r < rows; ++r) {
    float const* qr = q + static_cast<std::size_t>(r) * static_cast<std::size_t>(head_dim);
    float dot = 0.0f;
    for (int c = 0; c < head_dim; ++c) dot = std::fma(qr[c], mu[c], dot);
    out[r] = dot * scale;
  }
}

}  // namespace detail

KVQ_NAMESPACE_END
