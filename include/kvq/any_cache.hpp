// kvq: a run-time facade over QuantizedKVCache, for codecs chosen by name (an engine's
// `--cache-type-k q8_0 --cache-type-v q4_0` flags), optionally per layer.
//
// Only the explicit list of (key codec, value codec) pairs in `supported_codec_pairs()` is compiled
// (every codec with itself plus a few mixed pairs), so the facade never instantiates every K×V
// combination. Names are those of DESIGN §8: f32, f16, q4_0, q8_0, int8, fp8_e4m3, fp8_e5m2,
// mxfp4, nvfp4, kivi2, kivi4, kivi8 (as keys: per-channel KIVI keys; as values: per-token KIVI
// values).
//
// Every entry is compiled in each translation unit that includes this header. Programs with many
// such translation units can compile them once instead: see any_cache_instances.hpp
// (KVQ_ANY_CACHE_SEPARATE).
#pragma once

#include <array>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "attention.hpp"
#include "cache.hpp"
#include "codec/fp4.hpp"
#include "codec/fp8.hpp"
#include "codec/int8.hpp"
#include "codec/kivi.hpp"
#include "codec/passthrough.hpp"
#include "codec/q4_0.hpp"
#include "codec/q8_0.hpp"
#include "codec/rotated.hpp"
#include "codec/tq.hpp"

KVQ_NAMESPACE_BEGIN

/// Options of a facade cache.
struct any_cache_options {
  int residual = 128;                      ///< KIVI residual length R (multiple of 32)
  fp8_params key_fp8{};                    ///< fp8 scale and overflow mode of fp8 keys
  fp8_params value_fp8{};                  ///< fp8 scale and overflow mode of fp8 values
  fp4_params key_fp4{};                    ///< scale of mxfp4 / nvfp4 keys
  fp4_params value_fp4{};                  ///< scale of mxfp4 / nvfp4 values
  kvq::memory_resource* memory = nullptr;  ///< allocator hook; nullptr = the default resource
};

/// The run-time interface of a cache whose codecs were chosen by name.
class any_cache {
 public:
  virtual ~any_cache() = default;

  /// The cache's shape.
  virtual auto shape() const -> cache_shape = 0;
  /// Name of the key codec of `layer`.
  virtual auto key_codec_name(int layer) const -> std::string_view = 0;
  /// Name of the value codec of `layer`.
  virtual auto value_codec_name(int layer) const -> std::string_view = 0;
  /// Tokens held by `layer`.
  virtual auto size(int layer) const -> std::int64_t = 0;
  /// Appends keys and values to `layer` (see QuantizedKVCache::append).
  virtual void append(int layer, kv_tensor<float> const& keys, kv_tensor<float> const& values) = 0;
  virtual void append(int layer, kv_tensor<f16> const& keys, kv_tensor<f16> const& values) = 0;
  virtual void append(int layer, kv_tensor<bf16> const& keys, kv_tensor<bf16> const& values) = 0;
  /// Reads keys [first, first + count) of (layer, head) as f32 rows `stride` apart (0 = head_dim);
  /// preconditions and errors as QuantizedKVCache::read_keys.
  virtual void read_keys(int layer, int head, std::int64_t first, std::int64_t count, float* out,
                         std::int64_t stride = 0) const = 0;
  /// Reads values [first, first + count) of (layer, head) as f32 rows `stride` apart (0 = head_dim);
  /// preconditions and errors as QuantizedKVCache::read_values.
  virtual void read_values(int layer, int head, std::int64_t first, std::int64_t count, float* out,
                           std::int64_t stride = 0) const = 0;
  /// See QuantizedKVCache::truncate.
  virtual void truncate(std::int64_t n) = 0;
  /// See QuantizedKVCache::shift_left.
  virtual void shift_left(std::int64_t n) = 0;
  /// See QuantizedKVCache::reset.
  virtual void reset() = 0;
  /// Memory use, every byte accounted for.
  virtual auto memory() const -> memory_report = 0;
  /// Stored blocks of `layer` whose scale is NaN or ±Inf (see QuantizedKVCache::nonfinite_blocks).
  virtual auto nonfinite_blocks(int layer) const -> nonfinite_report = 0;
  /// Stored blocks of every layer whose scale is NaN or ±Inf.
  virtual auto nonfinite_blocks() const -> nonfinite_report = 0;
  /// Decode attention of q (q_heads, head_dim) over `layer` into out (q_heads, head_dim); see
  /// decode_attention (a null q or out raises shape_error).
  virtual void attention(int layer, float const* q, int q_heads, float* out,
                         attention_options const& opt = {}) const = 0;
  /// Attention of n_q query tokens q (n_q, q_heads, head_dim) over `layer` into out (same
  /// shape), on `threads` threads; see kvq::attention (masks, positions, sinks in `opt`).
  virtual void attention(int layer, float const* q, std::int64_t n_q, int q_heads, float* out,
                         attention_options const& opt = {}, int threads = 1) const = 0;
  /// Partial attention over tokens [begin, end) of `layer` (split form; see attend_range).
  virtual auto attend(int layer, float const* q, int q_heads, std::int64_t begin, std::int64_t end,
                      attention_options const& opt = {}) const -> attention_partial = 0;
};

/// The (key, value) codec name pairs the facade can build.
inline auto supported_codec_pairs() -> std::vector<std::pair<std::string_view, std::string_view>>;

/// Builds a cache with the named key and value codecs for every layer; raises
/// invalid_argument_error for an invalid shape (checked first) or option, unsupported_error for a
/// pair outside `supported_codec_pairs()` (the message lists them).
inline auto make_any_cache(cache_shape const& shape, std::string_view key_codec, std::string_view value_codec,
                           any_cache_options const& opt = {}) -> std::unique_ptr<any_cache>;

/// Builds a cache with one (key, value) codec pair per layer. Raises invalid_argument_error for an
/// invalid shape or option (as the single-pair overload does), then shape_error unless
/// `per_layer.size() == shape.layers`, unsupported_error for a pair outside `supported_codec_pairs()`.
inline auto make_any_cache(cache_shape const& shape, std::vector<std::pair<std::string, std::string>> const& per_layer,
                           any_cache_options const& opt = {}) -> std::unique_ptr<any_cache>;

namespace detail {

/// A new cache of codec choice Choice behind the facade, named k / v. Defined in
/// detail/any_cache_model.hpp: included below unless KVQ_ANY_CACHE_SEPARATE is defined, in which
/// case one translation unit of the program must include any_cache_instances.hpp.
template <class Choice>
auto make_model(cache_shape const& s, any_cache_options const& o, std::string_view k, std::string_view v)
    -> std::unique_ptr<any_cache>;

}  // namespace detail

KVQ_NAMESPACE_END

#if !defined(KVQ_ANY_CACHE_SEPARATE)
#  include "detail/any_cache_model.hpp"
#endif

/// The explicit list of instantiations behind the facade: X(group, key name, value name, Choice)
/// for every entry, in three groups of about the same compile time (any_cache_instances.hpp).
#define KVQ_ANY_CACHE_PAIRS(X)                                                                          \
  X(0, "f32", "f32", f32_codec)                                                                         \
  X(0, "f16", "f16", f16_codec)                                                                         \
  X(0, "q4_0", "q4_0", q4_0)                                                                            \
  X(0, "q8_0", "q8_0", q8_0)                                                                            \
  X(0, "int8", "int8", int8_sym)                                                                        \
  X(0, "fp8_e4m3", "fp8_e4m3", fp8_e4m3)                                                                \
  X(0, "fp8_e5m2", "fp8_e5m2", fp8_e5m2)                                                                \
  X(0, "mxfp4", "mxfp4", mxfp4)                                                                         \
  X(0, "nvfp4", "nvfp4", nvfp4)                                                                         \
  X(0, "kivi2", "kivi2", kivi<2>)                                                                       \
  X(0, "kivi4", "kivi4", kivi<4>)                                                                       \
  X(0, "kivi8", "kivi8", kivi<8>)                                                                       \
  X(1, "q8_0", "q4_0", kv_codecs<q8_0, q4_0>)                                                           \
  X(1, "q8_0", "f16", kv_codecs<q8_0, f16_codec>)                                                       \
  X(1, "f16", "q8_0", kv_codecs<f16_codec, q8_0>)                                                       \
  X(1, "f16", "q4_0", kv_codecs<f16_codec, q4_0>)                                                       \
  X(1, "int8", "q4_0", kv_codecs<int8_sym, q4_0>)                                                       \
  X(1, "fp8_e4m3", "q4_0", kv_codecs<fp8_e4m3, q4_0>)                                                   \
  X(1, "q8_0", "kivi4", kv_codecs<q8_0, ::kvq::kivi_value<4>>)                                          \
  X(1, "int8", "kivi4", kv_codecs<int8_sym, ::kvq::kivi_value<4>>)                                      \
  X(1, "int8", "kivi2", kv_codecs<int8_sym, ::kvq::kivi_value<2>>)                                      \
  X(1, "kivi8", "kivi4", kv_codecs<::kvq::kivi_key<8>, ::kvq::kivi_value<4>>)                           \
  X(1, "kivi4", "kivi2", kv_codecs<::kvq::kivi_key<4>, ::kvq::kivi_value<2>>)                           \
  X(1, "kivi8", "kivi2", kv_codecs<::kvq::kivi_key<8>, ::kvq::kivi_value<2>>)                           \
  X(1, "rot-f32", "rot-f32", rotated<f32_codec>)                                                        \
  X(1, "rot-f16", "rot-f16", rotated<f16_codec>)                                                        \
  X(1, "rot-q4_0", "rot-q4_0", rotated<q4_0>)                                                           \
  X(2, "rot-q8_0", "rot-q8_0", rotated<q8_0>)                                                           \
  X(2, "rot-int8", "rot-int8", rotated<int8_sym>)                                                       \
  X(2, "rot-fp8_e4m3", "rot-fp8_e4m3", rotated<fp8_e4m3>)                                               \
  X(2, "rot-fp8_e5m2", "rot-fp8_e5m2", rotated<fp8_e5m2>)                                               \
  X(2, "rot-mxfp4", "rot-mxfp4", rotated<mxfp4>)                                                        \
  X(2, "rot-nvfp4", "rot-nvfp4", rotated<nvfp4>)                                                        \
  X(2, "rot-kivi2", "rot-kivi2", kv_codecs<rotated<::kvq::kivi_key<2>>, rotated<::kvq::kivi_value<2>>>) \
  X(2, "rot-kivi4", "rot-kivi4", kv_codecs<rotated<::kvq::kivi_key<4>>, rotated<::kvq::kivi_value<4>>>) \
  X(2, "rot-kivi8", "rot-kivi8", kv_codecs<rotated<::kvq::kivi_key<8>>, rotated<::kvq::kivi_value<8>>>) \
  X(2, "rot-q4_0", "q4_0", kv_codecs<rotated<q4_0>, q4_0>)                                              \
  X(2, "rot-q8_0", "q4_0", kv_codecs<rotated<q8_0>, q4_0>)                                              \
  X(2, "rot-q8_0", "rot-q4_0", kv_codecs<rotated<q8_0>, rotated<q4_0>>)                                 \
  X(2, "rot-kivi4", "kivi4", kv_codecs<rotated<::kvq::kivi_key<4>>, ::kvq::kivi_value<4>>)              \
  X(0, "tq2", "tq2", tq2)                                                                               \
  X(0, "tq3", "tq3", tq3)                                                                               \
  X(0, "tq4", "tq4", tq4)                                                                               \
  X(1, "tq4", "tq3", kv_codecs<tq4, tq3>)                                                               \
  X(2, "rot-q8_0", "tq4", kv_codecs<rotated<q8_0>, tq4>)                                                \
  X(0, "ctr-q4_0", "q4_0", kv_codecs<centered<q4_0>, q4_0>)                                             \
  X(1, "ctr-rot-q4_0", "q4_0", kv_codecs<centered<rotated<q4_0>>, q4_0>)                                \
  X(2, "ctr-rot-q4_0", "rot-q4_0", kv_codecs<centered<rotated<q4_0>>, rotated<q4_0>>)

KVQ_NAMESPACE_BEGIN
namespace detail {

using any_cache_factory = std::unique_ptr<any_cache> (*)(cache_shape const&, any_cache_options const&);

struct any_cache_entry {
  std::string_view key;
  std::string_view value;
  any_cache_factory make;
};

#define KVQ_DETAIL_ANY_CACHE_ENTRY(GROUP, KNAME, VNAME, ...)                                                         \
  any_cache_entry{KNAME, VNAME, [](cache_shape const& s, any_cache_options const& o) -> std::unique_ptr<any_cache> { \
                    return make_model<__VA_ARGS__>(s, o, KNAME, VNAME);                                              \
                  }},

/// The table behind the facade, in the order of KVQ_ANY_CACHE_PAIRS.
inline auto any_cache_table() -> std::span<any_cache_entry const> {
  static any_cache_entry const table[] = {KVQ_ANY_CACHE_PAIRS(KVQ_DETAIL_ANY_CACHE_ENTRY)};
  return table;
}

#undef KVQ_DETAIL_ANY_CACHE_ENTRY

/// any_cache made of one single-layer cache per layer (per-layer codec choice).
class layered_any_cache final : public any_cache {
 public:
  layered_any_cache(cache_shape const& shape, std::vector<std::unique_ptr<any_cache>> layers)
      : shape_(shape), layers_(std::move(layers)) {}

  auto shape() const -> cache_shape override { return shape_; }
  auto key_codec_name(int layer) const -> std::string_view override { return at(layer).key_codec_name(0); }
  auto value_codec_name(int layer) const -> std::string_view override { return at(layer).value_codec_name(0); }
  auto size(int layer) const -> std::int64_t override { return at(layer).size(0); }
  void append(int layer, kv_tensor<float> const& k, kv_tensor<float> const& v) override { at(layer).append(0, k, v); }
  void append(int layer, kv_tensor<f16> const& k, kv_tensor<f16> const& v) override { at(layer).append(0, k, v); }
  void append(int layer, kv_tensor<bf16> const& k, kv_tensor<bf16> const& v) override { at(layer).append(0, k, v); }
  void read_keys(int layer, int head, std::int64_t first, std::int64_t count, float* out,
                 std::int64_t stride) const override {
    at(layer).read_keys(0, head, first, count, out, stride);
  }
  void read_values(int layer, int head, std::int64_t first, std::int64_t count, float* out,
                   std::int64_t stride) const override {
    at(layer).read_values(0, head, first, count, out, stride);
  }
  void truncate(std::int64_t n) override {
    check<invalid_argument_error>(n >= 0, "truncate: n = " + std::to_string(n) + " is negative");
    for (auto& l : layers_) l->truncate(n);
  }
  void shift_left(std::int64_t n) override {
    // Validate on every layer first so that a failure leaves every layer unchanged; the checks in
    // the order of QuantizedKVCache::shift_left (sign, then the KIVI multiple, then the lengths).
    check<invalid_argument_error>(n >= 0, "shift_left: n = " + std::to_string(n) + " is negative");
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      std::string_view const k = layers_[i]->key_codec_name(0);
      if (k.starts_with("kivi") || k.starts_with("rot-kivi"))
        check<unsupported_error>(n % 32 == 0, "shift_left: KIVI keys of layer " + std::to_string(i) +
                                                  " shift by multiples of G = 32, not " + std::to_string(n));
    }
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      std::int64_t const len = layers_[i]->size(0);
      check<index_error>(len == 0 || n <= len, "shift_left: layer " + std::to_string(i) + " holds " +
                                                   std::to_string(len) + " tokens, cannot drop " + std::to_string(n));
    }
    for (auto& l : layers_) l->shift_left(n);
  }
  void reset() override {
    for (auto& l : layers_) l->reset();
  }
  auto memory() const -> memory_report override {
    memory_report m;
    for (auto const& l : layers_) {
      auto const r = l->memory();
      m.total_bytes += r.total_bytes;
      m.key_bytes += r.key_bytes;
      m.value_bytes += r.value_bytes;
      m.residual_bytes += r.residual_bytes;
      m.alignment_bytes += r.alignment_bytes;
    }
    double const cap = static_cast<double>(shape_.capacity);
    m.bytes_per_token = static_cast<double>(m.total_bytes) / cap;
    m.bits_per_element = static_cast<double>(m.total_bytes) * 8.0 /
                         (cap * shape_.layers * shape_.kv_heads * static_cast<double>(shape_.head_dim) * 2.0);
    return m;
  }
  auto nonfinite_blocks(int layer) const -> nonfinite_report override { return at(layer).nonfinite_blocks(0); }
  auto nonfinite_blocks() const -> nonfinite_report override {
    nonfinite_report r;
    for (auto const& l : layers_) {
      auto const x = l->nonfinite_blocks(0);
      r.key_blocks += x.key_blocks;
      r.value_blocks += x.value_blocks;
    }
    return r;
  }
  void attention(int layer, float const* q, int q_heads, float* out, attention_options const& opt) const override {
    at(layer).attention(0, q, q_heads, out, opt);
  }
  void attention(int layer, float const* q, std::int64_t n_q, int q_heads, float* out, attention_options const& opt,
                 int threads) const override {
    at(layer).attention(0, q, n_q, q_heads, out, opt, threads);
  }
  auto attend(int layer, float const* q, int q_heads, std::int64_t begin, std::int64_t end,
              attention_options const& opt) const -> attention_partial override {
    return at(layer).attend(0, q, q_heads, begin, end, opt);
  }

 private:
  auto at(int layer) const -> any_cache& {
    check<index_error>(layer >= 0 && layer < shape_.layers, [&] {
      return "layer " + std::to_string(layer) + " is out of range [0, " + std::to_string(shape_.layers) + ")";
    });
    return *layers_[static_cast<std::size_t>(layer)];
  }

  cache_shape shape_;
  std::vector<std::unique_ptr<any_cache>> layers_;
};

inline auto find_entry(std::string_view k, std::string_view v) -> any_cache_entry const& {
  for (auto const& e : any_cache_table())
    if (e.key == k && e.value == v) return e;
  std::string list;
  for (auto const& e : any_cache_table()) {
    list.append(" ").append(e.key).append("/").append(e.value);
  }
  raise<unsupported_error>("no cache for key codec '" + std::string(k) + "' with value codec '" + std::string(v) +
                           "'; supported key/value pairs:" + list);
}

}  // namespace detail

inline auto supported_codec_pairs() -> std::vector<std::pair<std::string_view, std::string_view>> {
  std::vector<std::pair<std::string_view, std::string_view>> out;
  for (auto const& e : detail::any_cache_table()) out.emplace_back(e.key, e.value);
  return out;
}

inline auto make_any_cache(cache_shape const& shape, std::string_view key_codec, std::string_view value_codec,
                           any_cache_options const& opt) -> std::unique_ptr<any_cache> {
  detail::check_cache_shape(shape, "cache");
  return detail::find_entry(key_codec, value_codec).make(shape, opt);
}

inline auto make_any_cache(cache_shape const& shape, std::vector<std::pair<std::string, std::string>> const& per_layer,
                           any_cache_options const& opt) -> std::unique_ptr<any_cache> {
  detail::check_cache_shape(shape, "cache");  // the rule of the single-pair overload, before the pair count
  detail::check<shape_error>(static_cast<std::int64_t>(per_layer.size()) == shape.layers,
                             "make_any_cache: " + std::to_string(per_layer.size()) + " codec pairs for " +
                                 std::to_string(shape.layers) + " layers");
  cache_shape one = shape;
  one.layers = 1;
  std::vector<std::unique_ptr<any_cache>> layers;
  for (auto const& [k, v] : per_layer) layers.push_back(detail::find_entry(k, v).make(one, opt));
  return std::make_unique<detail::layered_any_cache>(shape, std::move(layers));
}

KVQ_NAMESPACE_END
