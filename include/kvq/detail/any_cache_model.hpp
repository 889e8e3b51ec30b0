// kvq: the definition behind each entry of the any_cache facade (any_cache.hpp): one
// QuantizedKVCache<Choice> behind the run-time interface. any_cache.hpp includes it, unless
// KVQ_ANY_CACHE_SEPARATE is defined; any_cache_instances.hpp always does.
#pragma once

#include <memory>
#include <string_view>
#include <type_traits>

#include "../any_cache.hpp"
#include "../attention.hpp"
#include "../cache.hpp"

KVQ_NAMESPACE_BEGIN
namespace detail {

/// any_cache over one QuantizedKVCache<Choice>.
template <codec_choice Choice>
class any_cache_model final : public any_cache {
 public:
  using cache_type = QuantizedKVCache<Choice>;

  any_cache_model(cache_shape const& shape, std::string_view k_name, std::string_view v_name,
                  any_cache_options const& o)
      : cache_(shape, cache_options(o)), k_name_(k_name), v_name_(v_name) {}

  auto shape() const -> cache_shape override { return cache_.shape(); }
  auto key_codec_name(int layer) const -> std::string_view override {
    cache_.check_layer(layer);
    return k_name_;
  }
  auto value_codec_name(int layer) const -> std::string_view override {
    cache_.check_layer(layer);
    return v_name_;
  }
  auto size(int layer) const -> std::int64_t override { return cache_.size(layer); }
  void append(int layer, kv_tensor<float> const& k, kv_tensor<float> const& v) override { cache_.append(layer, k, v); }
  void append(int layer, kv_tensor<f16> const& k, kv_tensor<f16> const& v) override { cache_.append(layer, k, v); }
  void append(int layer, kv_tensor<bf16> const& k, kv_tensor<bf16> const& v) override { cache_.append(layer, k, v); }
  void read_keys(int layer, int head, std::int64_t first, std::int64_t count, float* out,
                 std::int64_t stride) const override {
    cache_.read_keys(layer, head, first, count, out, stride);
  }
  void read_values(int layer, int head, std::int64_t first, std::int64_t count, float* out,
                   std::int64_t stride) const override {
    cache_.read_values(layer, head, first, count, out, stride);
  }
  void truncate(std::int64_t n) override { cache_.truncate(n); }
  void shift_left(std::int64_t n) override { cache_.shift_left(n); }
  void reset() override { cache_.reset(); }
  auto memory() const -> memory_report override { return cache_.memory(); }
  auto nonfinite_blocks(int layer) const -> nonfinite_report override { return cache_.nonfinite_blocks(layer); }
  auto nonfinite_blocks() const -> nonfinite_report override { return cache_.nonfinite_blocks(); }
  void attention(int layer, float const* q, int q_heads, float* out, attention_options const& opt) const override {
    decode_attention(cache_, layer, q, q_heads, out, opt);
  }
  void attention(int layer, float const* q, std::int64_t n_q, int q_heads, float* out, attention_options const& opt,
                 int threads) const override {
    ::kvq::attention(cache_, layer, q, n_q, q_heads, out, opt, threads);
  }
  auto attend(int layer, float const* q, int q_heads, std::int64_t begin, std::int64_t end,
              attention_options const& opt) const -> attention_partial override {
    return attend_range(cache_, layer, q, q_heads, begin, end, opt);
  }

  /// The typed cache (for code that wants the compile-time interface back).
  auto typed() const -> cache_type const& { return cache_; }

 private:
  static auto cache_options(any_cache_options const& o) -> typename cache_type::options {
    typename cache_type::options c;
    c.residual = o.residual;
    c.memory = o.memory;
    if constexpr (std::is_same_v<typename cache_type::key_params, fp8_params>) c.key = o.key_fp8;
    if constexpr (std::is_same_v<typename cache_type::value_params, fp8_params>) c.value = o.value_fp8;
    if constexpr (std::is_same_v<typename cache_type::key_params, fp4_params>) c.key = o.key_fp4;
    if constexpr (std::is_same_v<typename cache_type::value_params, fp4_params>) c.value = o.value_fp4;
    return c;
  }

  cache_type cache_;
  std::string_view k_name_;
  std::string_view v_name_;
};

template <class Choice>
auto make_model(cache_shape const& s, any_cache_options const& o, std::string_view k, std::string_view v)
    -> std::unique_ptr<any_cache> {
  return std::make_unique<any_cache_model<Choice>>(s, k, v, o);
}

}  // namespace detail
KVQ_NAMESPACE_END
