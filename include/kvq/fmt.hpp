// kvq: {fmt} formatters for kvq's public value types, for engines that log with fmt or spdlog.
//
// Optional: include it only where {fmt} (version 9 or later) is available; nothing else in kvq
// depends on fmt. Formats, each on one line:
//   cache_shape          {layers: 32, kv_heads: 8, head_dim: 128, capacity: 8192}
//   memory_report        436207616 B (keys 285212672, values 150994944, residual 0, alignment 0; 53248 B/token, 6.5
//   bits/element) nonfinite_report     {key_blocks: 0, value_blocks: 3} attention_options    {scale: auto, window: 0,
//   softcap: 0, query: f32, probabilities: f32} query_precision, probability_precision   f32, q8_0, f16, i8 a codec or
//   codec pair (an object of the tag type: kvq::q8_0{}, kvq::kivi<4>{})   q8_0, q8_0/q4_0, kivi4
// Every formatter takes an empty format spec ("{}").
#pragma once

#include <fmt/format.h>

#include <string_view>

#include "attention.hpp"
#include "cache.hpp"
#include "codec/codec.hpp"

KVQ_NAMESPACE_BEGIN
namespace detail {

/// The name of a query precision.
constexpr auto name_of(query_precision p) noexcept -> std::string_view {
  return p == query_precision::q8_0 ? "q8_0" : "f32";
}

/// The name of a probability precision.
constexpr auto name_of(probability_precision p) noexcept -> std::string_view {
  return p == probability_precision::f16 ? "f16" : p == probability_precision::i8 ? "i8" : "f32";
}

/// A formatter base for kvq's types: accepts only the empty format spec.
struct fmt_no_spec {
  constexpr auto parse(fmt::format_parse_context& ctx) -> decltype(ctx.begin()) {
    auto it = ctx.begin();
    if (it != ctx.end() && *it != '}') throw fmt::format_error("kvq types take no format spec: use {}");
    return it;
  }
};

}  // namespace detail
KVQ_NAMESPACE_END

/// kvq::cache_shape as {layers: L, kv_heads: H, head_dim: D, capacity: N}.
template <>
struct fmt::formatter<kvq::cache_shape> : kvq::detail::fmt_no_spec {
  auto format(kvq::cache_shape const& s, fmt::format_context& ctx) const -> decltype(ctx.out()) {
    return fmt::format_to(ctx.out(), "{{layers: {}, kv_heads: {}, head_dim: {}, capacity: {}}}", s.layers, s.kv_heads,
                          s.head_dim, s.capacity);
  }
};

/// kvq::memory_report as the total and its parts in bytes, bytes per token and bits per element.
template <>
struct fmt::formatter<kvq::memory_report> : kvq::detail::fmt_no_spec {
  auto format(kvq::memory_report const& m, fmt::format_context& ctx) const -> decltype(ctx.out()) {
    return fmt::format_to(
        ctx.out(), "{} B (keys {}, values {}, residual {}, alignment {}; {} B/token, {} bits/element)", m.total_bytes,
        m.key_bytes, m.value_bytes, m.residual_bytes, m.alignment_bytes, m.bytes_per_token, m.bits_per_element);
  }
};

/// kvq::nonfinite_report as {key_blocks: K, value_blocks: V}.
template <>
struct fmt::formatter<kvq::nonfinite_report> : kvq::detail::fmt_no_spec {
  auto format(kvq::nonfinite_report const& r, fmt::format_context& ctx) const -> decltype(ctx.out()) {
    return fmt::format_to(ctx.out(), "{{key_blocks: {}, value_blocks: {}}}", r.key_blocks, r.value_blocks);
  }
};

/// kvq::query_precision by name (f32, q8_0).
template <>
struct fmt::formatter<kvq::query_precision> : kvq::detail::fmt_no_spec {
  auto format(kvq::query_precision p, fmt::format_context& ctx) const -> decltype(ctx.out()) {
    return fmt::format_to(ctx.out(), "{}", kvq::detail::name_of(p));
  }
};

/// kvq::probability_precision by name (f32, f16, i8).
template <>
struct fmt::formatter<kvq::probability_precision> : kvq::detail::fmt_no_spec {
  auto format(kvq::probability_precision p, fmt::format_context& ctx) const -> decltype(ctx.out()) {
    return fmt::format_to(ctx.out(), "{}", kvq::detail::name_of(p));
  }
};

/// kvq::attention_options field by field; a scale of 0 (1/sqrt(head_dim)) prints as auto.
template <>
struct fmt::formatter<kvq::attention_options> : kvq::detail::fmt_no_spec {
  auto format(kvq::attention_options const& o, fmt::format_context& ctx) const -> decltype(ctx.out()) {
    auto out = ctx.out();
    if (o.scale == 0.0f)
      out = fmt::format_to(out, "{{scale: auto");
    else
      out = fmt::format_to(out, "{{scale: {}", o.scale);
    return fmt::format_to(out, ", window: {}, softcap: {}, query: {}, probabilities: {}}}", o.window, o.softcap,
                          kvq::detail::name_of(o.query), kvq::detail::name_of(o.probabilities));
  }
};

/// A codec tag by its name (kvq::q8_0{} prints q8_0).
template <kvq::codec C>
struct fmt::formatter<C> : kvq::detail::fmt_no_spec {
  auto format(C const&, fmt::format_context& ctx) const -> decltype(ctx.out()) {
    return fmt::format_to(ctx.out(), "{}", std::string_view(C::name));
  }
};

/// A codec pair: a named pair by its name (kivi<4> prints kivi4), kv_codecs<K, V> as K/V.
template <class P>
requires(!kvq::codec<P> && kvq::codec_choice<P>) struct fmt::formatter<P> : kvq::detail::fmt_no_spec {
  auto format(P const&, fmt::format_context& ctx) const -> decltype(ctx.out()) {
    if constexpr (requires { std::string_view(P::name); })
      return fmt::format_to(ctx.out(), "{}", std::string_view(P::name));
    else
      return fmt::format_to(ctx.out(), "{}/{}", std::string_view(P::key_codec::name),
                            std::string_view(P::value_codec::name));
  }
};
