// kvq: the cache core, the one implementation of a quantized KV cache's host logic.
//
// `cache_core<Choice, Device>` owns, for every backend: argument validation with the strong
// guarantee (every check runs before anything changes), the storage layout (storage_layout.hpp),
// the per-layer state machine with KIVI's residual rules and the plans of append / read / truncate
// / shift / reset (plans.hpp), the memory accounting, the storage views, and the failure state of
// a device. A backend is a `Device`: memory, a stream or queue where it has one, and kernel
// launches for the plans the core hands it:
//
//   using backend_tag;                        // kvq::cpu, kvq::cuda or kvq::metal
//   using stream_type;                        // what every operation is ordered on (CPU: none)
//   using layer_type;                         // a layer allocation (pointer, MTLBuffer*, ...)
//   using input_type; using output_type;      // where appended rows come from / decoded rows go
//   static constexpr char const* name;        // "cache", "CUDA cache", "Metal cache" (messages)
//   static constexpr std::int64_t max_capacity;  // tokens per layer (GPU kernels index in 32 bits)
//   auto allocate(std::size_t bytes) -> layer_type;              // zero-filled; raises on failure
//   void deallocate(layer_type, std::size_t bytes) noexcept;
//   auto address(layer_type) const -> std::byte*;                // for storage views
//   auto output_at(layer_type, std::size_t offset) -> output_type;  // rows inside a layer
//   auto offset_output(output_type, std::size_t bytes) -> output_type;  // `bytes` further on (paged reads)
//   template <class C> auto write(write_step const&, layer_type, input_type, stream_type) -> device_status;
//   template <class C> auto decode(kvq_decode_args const&, layer_type, output_type, stream_type) -> device_status;
//   auto move(layer_type, std::size_t region0, std::size_t head_stride, int kv_heads, byte_move const&,
//             stream_type) -> device_status;                   // inside every kv_head's region
//   auto finish(stream_type) -> device_status;                   // the end of one operation's work
//
// The CPU backend (backend/cpu/cpu_device.hpp) is a device whose kernels are called directly on
// host memory; CUDA (backend/cuda) and Metal (backend/metal) launch the kernel bodies of
// core/kernel_bodies.h. Attention is each backend's own (the CPU's SIMD kernels, the GPUs'
// flash-decoding launches planned by plan_attention).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "../backend/backend.hpp"
#include "../codec/centered.hpp"
#include "../detail/host_vector.hpp"
#include "../error.hpp"
#include "checks.hpp"
#include "plans.hpp"
#include "storage_layout.hpp"

KVQ_NAMESPACE_BEGIN

/// The outcome of one device call: ok, or the failing call's name and the device's message.
struct device_status {
  char const* call = nullptr;  ///< nullptr when the call succeeded
  char const* text = "";       ///< the device's error string
  constexpr auto ok() const noexcept -> bool { return call == nullptr; }
};

namespace detail {

/// The stream of a device that has none (the CPU): operations run when called.
struct no_stream {};

/// An appended tensor as the checks see it, whatever its element type and memory.
struct kv_tensor_desc {
  std::int64_t tokens = 0;
  int kv_heads = 0;
  int head_dim = 0;
  std::int64_t token_stride = 0;  ///< elements
  std::int64_t head_stride = 0;   ///< elements
  bool has_data = false;
  std::size_t element_bytes = 4;
};

/// The description of a host or device tensor of element type T.
template <element T>
constexpr auto describe(kv_tensor<T> const& x) -> kv_tensor_desc {
  return {x.tokens, x.kv_heads, x.head_dim, x.token_stride, x.head_stride, x.data != nullptr, sizeof(T)};
}

}  // namespace detail

/// The codec types of a codec choice, which every cache class exposes by deriving from this:
/// `QuantizedKVCache<kvq::kivi<4>>::key_codec` is kivi_key<4, 32>.
template <codec_choice Choice>
struct cache_codecs {
  using key_codec = typename codec_pair<Choice>::key;
  using value_codec = typename codec_pair<Choice>::value;
  using key_params = typename key_codec::params_type;
  using value_params = typename value_codec::params_type;
};

namespace detail {

/// Raises what appending tensors `keys` and `values` to a cache of `kv_heads` x `head_dim` would
/// violate in the tensors themselves (shape_error: heads, head_dim, counts, data, strides).
inline void check_append_tensors(int kv_heads, int head_dim, kv_tensor_desc const& keys, kv_tensor_desc const& values) {
  cache_shape const s{1, kv_heads, head_dim, 1};
  check_kv_tensor(s, keys.kv_heads, keys.head_dim, keys.tokens, keys.has_data, keys.token_stride, keys.head_stride,
                  keys.element_bytes, "keys");
  check_kv_tensor(s, values.kv_heads, values.head_dim, values.tokens, values.has_data, values.token_stride,
                  values.head_stride, values.element_bytes, "values");
  check<shape_error>(keys.tokens == values.tokens, [&] {
    return "append: keys have " + std::to_string(keys.tokens) + " tokens but values have " +
           std::to_string(values.tokens);
  });
}

}  // namespace detail

/// What the flat and the paged cores share: the codec and device types of `Choice` on `Device`
/// (an unimplemented combination fails to compile, naming it), and the failure state of the
/// device (after a failed device call every operation raises device_error).
template <codec_choice Choice, class Device>
class core_base : public cache_codecs<Choice> {
 public:
  using codecs = cache_codecs<Choice>;
  using key_codec = typename codecs::key_codec;
  using value_codec = typename codecs::value_codec;
  using key_params = typename codecs::key_params;
  using value_params = typename codecs::value_params;
  using stream_type = typename Device::stream_type;
  using layer_type = typename Device::layer_type;
  using input_type = typename Device::input_type;
  using output_type = typename Device::output_type;
  static_assert(require_implemented<key_codec, typename Device::backend_tag>());
  static_assert(require_implemented<value_codec, typename Device::backend_tag>());
  static_assert(key_codec::layout == codec_layout::row || key_codec::layout == codec_layout::token_group);
  static_assert(value_codec::layout == codec_layout::row,
                "kvq: value codecs must be row codecs (values are quantized per token)");
  static_assert(!centered_codec<value_codec>, "kvq: centered<C> is a key codec (values are not centered)");

  /// Centered keys on a GPU: the key means live in device memory beside the storage (the CPU
  /// caches keep theirs on the host, codec/centered.hpp).
  static constexpr bool device_means = centered_codec<key_codec> && !std::is_same_v<typename Device::backend_tag, cpu>;

  /// False once a device call failed: every later operation then raises device_error.
  auto usable() const noexcept -> bool { return failure_.empty(); }
  /// Raises device_error if a device call failed earlier.
  void check_usable() const {
    detail::check<device_error>(failure_.empty(), [&] {
      return std::string(Device::name) + ": unusable after an earlier failure: " + failure_;
    });
  }
  /// Raises device_error naming the failed call (and marks the cache unusable) unless `s` is ok.
  void succeed(device_status const& s) {
    if (s.ok()) return;
    failure_ = std::string(s.call) + ": " + s.text;
    detail::raise<device_error>(std::string(Device::name) + ": " + failure_);
  }

 private:
  std::string failure_;
};

/// The host logic of a cache of codec choice `Choice` on `Device` (see the file comment).
template <codec_choice Choice, class Device>
class cache_core : public core_base<Choice, Device> {
  using base = core_base<Choice, Device>;

 public:
  using base::check_usable;
  using base::succeed;
  using typename base::input_type;
  using typename base::key_codec;
  using typename base::key_params;
  using typename base::layer_type;
  using typename base::output_type;
  using typename base::stream_type;
  using typename base::value_codec;
  using typename base::value_params;

  /// Validates shape and options (check_cache_options, with the device's capacity limit), then
  /// allocates every layer, zero-filled. Raises invalid_argument_error on a bad shape or option,
  /// and what the device raises when an allocation fails (nothing stays allocated then).
  cache_core(cache_shape const& shape, int residual, key_params const& key, value_params const& value, Device dev)
      : dev_(std::move(dev)),
        shape_(validated(shape, residual, key, value)),
        residual_(residual),
        key_(key),
        value_(value) {
    auto const kl = detail::region_layout<key_codec, false>::make(shape_, residual);
    auto const vl = detail::region_layout<value_codec, true>::make(shape_, residual);
    std::size_t const kv = static_cast<std::size_t>(shape_.kv_heads);
    key_side_ = detail::make_cache_side<key_codec, false>(shape_, residual, key, 0, kl.bytes());
    value_side_ = detail::make_cache_side<value_codec, true>(shape_, residual, value, kv * kl.bytes(), vl.bytes());
    layer_bytes_ = kv * (kl.bytes() + vl.bytes());
    if constexpr (base::device_means) {  // each layer's key means (kv_heads, head_dim) f32 after its storage
      key_side_.device_means = true;
      key_side_.means0 = (layer_bytes_ + storage_alignment - 1) / storage_alignment * storage_alignment;
      means_bytes_ = kv * static_cast<std::size_t>(shape_.head_dim) * sizeof(float);
    }
    layers_.reserve(static_cast<std::size_t>(shape_.layers));
    // Frees the layers allocated so far when an allocation raises (a guard rather than try/catch,
    // so that the header also compiles with exceptions disabled).
    struct release_on_failure {
      cache_core* self;
      ~release_on_failure() {
        if (self == nullptr) return;
        for (auto& l : self->layers_) self->dev_.deallocate(l, self->alloc_bytes());
        self->layers_.clear();
      }
    } guard{this};
    for (int l = 0; l < shape_.layers; ++l) layers_.push_back(dev_.allocate(alloc_bytes()));
    guard.self = nullptr;
    state_.assign(static_cast<std::size_t>(shape_.layers), detail::layer_state{});
  }

  cache_core(cache_core const&) = delete;
  cache_core& operator=(cache_core const&) = delete;
  /// Takes the layers of `o`, which is left with no layers (every layer index out of range).
  cache_core(cache_core&& o) noexcept
      : base(std::move(o)),
        dev_(std::move(o.dev_)),
        shape_(o.shape_),
        residual_(o.residual_),
        key_(o.key_),
        value_(o.value_),
        key_side_(o.key_side_),
        value_side_(o.value_side_),
        layer_bytes_(o.layer_bytes_),
        means_bytes_(o.means_bytes_),
        layers_(std::move(o.layers_)),
        state_(std::move(o.state_)) {
    o.layers_.clear();
    o.state_.clear();
    o.shape_.layers = 0;
  }
  cache_core& operator=(cache_core&&) = delete;
  ~cache_core() {
    for (auto& l : layers_) dev_.deallocate(l, alloc_bytes());
  }

  auto shape() const noexcept -> cache_shape const& { return shape_; }
  auto residual() const noexcept -> int { return residual_; }
  auto key_options() const noexcept -> key_params const& { return key_; }
  auto value_options() const noexcept -> value_params const& { return value_; }
  auto key_side() const noexcept -> detail::cache_side const& { return key_side_; }
  auto value_side() const noexcept -> detail::cache_side const& { return value_side_; }
  auto device() noexcept -> Device& { return dev_; }
  auto device() const noexcept -> Device const& { return dev_; }
  /// Bytes of one layer's allocation.
  auto layer_bytes() const noexcept -> std::size_t { return layer_bytes_; }
  /// The allocation of `layer`; raises index_error when out of range.
  auto layer(int layer) const -> layer_type {
    check_layer(layer);
    return layers_[static_cast<std::size_t>(layer)];
  }
  /// The state of `layer`; raises index_error when out of range.
  auto state(int layer) const -> detail::layer_state const& {
    check_layer(layer);
    return state_[static_cast<std::size_t>(layer)];
  }
  /// Tokens held by `layer`; raises index_error when out of range.
  auto size(int layer) const -> std::int64_t { return state(layer).length; }
  /// Memory use: the layout's every byte (device scratch excluded).
  auto memory() const noexcept -> memory_report {
    return detail::plan_memory_unchecked<key_codec, value_codec>(shape_, residual_);
  }

  /// Raises index_error unless 0 <= layer < layers.
  void check_layer(int layer) const { detail::check_layer_index(layer, shape_.layers); }
  /// Raises index_error unless 0 <= head < kv_heads.
  void check_head(int head) const { detail::check_head_index(head, shape_.kv_heads); }

  /// Raises what an append of tensors `keys` and `values` to `layer` would violate (index_error,
  /// shape_error, capacity_error; see QuantizedKVCache::append) for elements of `element_bytes`.
  void check_append(int layer, detail::kv_tensor_desc const& keys, detail::kv_tensor_desc const& values) const {
    check_usable();
    check_layer(layer);
    detail::check_append_tensors(shape_.kv_heads, shape_.head_dim, keys, values);
    std::int64_t const length = state_[static_cast<std::size_t>(layer)].length;
    detail::check<capacity_error>(keys.tokens <= shape_.capacity - length, [&] {
      return "append: layer " + std::to_string(layer) + " holds " + std::to_string(length) + " tokens; appending " +
             std::to_string(keys.tokens) + " exceeds the capacity of " + std::to_string(shape_.capacity);
    });
  }

  /// Appends n checked tokens (check_append) from `keys` / `values`, described by `ks` / `vs`.
  void append_checked(int layer, std::int64_t n, input_type keys, kvq_source ks, input_type values, kvq_source vs,
                      stream_type stream) {
    if (n == 0) return;
    auto& st = state_[static_cast<std::size_t>(layer)];
    layer_type const l = layers_[static_cast<std::size_t>(layer)];
    if constexpr (base::device_means) {  // the first chunk into an empty layer fixes mu; keys are stored less mu
      if (st.length == 0)
        succeed(dev_.template write<key_codec>(
            detail::key_mean_step(shape_.head_dim, shape_.kv_heads, n, ks, key_side_.means0), l, keys, stream));
      ks.mean = 1;
      ks.mean0 = key_side_.means0;
    }
    auto const plan = detail::plan_append(key_side_, value_side_, shape_.head_dim, shape_.kv_heads, st, n, ks, vs);
    for (int i = 0; i < plan.count; ++i) {
      auto const& s = plan.steps[i];
      if (s.values) {
        succeed(dev_.template write<value_codec>(s, l, values, stream));
      } else {
        succeed(dev_.template write<key_codec>(s, l, keys, stream));
      }
    }
    succeed(dev_.finish(stream));
    st = plan.next;
  }

  /// Raises what a read of tokens [first, first + count) of (layer, head) would violate
  /// (index_error), `what` naming the operation.
  void check_read(char const* what, int layer, int head, std::int64_t first, std::int64_t count) const {
    check_usable();
    check_layer(layer);
    check_head(head);
    detail::check_read_range(what, layer, state_[static_cast<std::size_t>(layer)].length, first, count);
  }

  /// Decodes checked tokens [first, first + count) of (layer, head), keys or values, into `out`
  /// as kernel element type `out_type`, rows `stride` elements apart.
  void read_checked(bool keys, int layer, int head, std::int64_t first, std::int64_t count, output_type out,
                    int out_type, std::int64_t stride, stream_type stream) {
    if (count == 0) return;
    auto const& st = state_[static_cast<std::size_t>(layer)];
    kvq_decode_args a =
        decode_arguments(keys ? detail::key_region(key_side_, st) : detail::value_region(value_side_, st), head, first,
                         count, out_type, stride);
    a.unrotate = keys ? rotated_codec<key_codec> : rotated_codec<value_codec>;  // reads return Rᵀ decode
    if (keys && key_side_.device_means) {  // centered keys: reads return decode + mu
      a.add_mean = 1;
      a.mean0 = key_side_.means0;
    }
    layer_type const l = layers_[static_cast<std::size_t>(layer)];
    if (keys) {
      succeed(dev_.template decode<key_codec>(a, l, out, stream));
    } else {
      succeed(dev_.template decode<value_codec>(a, l, out, stream));
    }
    succeed(dev_.finish(stream));
  }

  /// Keeps the first n tokens of every layer (speculative-decoding rollback); layers holding n or
  /// fewer tokens are unchanged. Cutting into a quantized KIVI key tile decodes its kept tokens
  /// back into the f16 residual (lossy). Raises invalid_argument_error for n < 0.
  void truncate(std::int64_t n, stream_type stream) {
    check_usable();
    detail::check<invalid_argument_error>(n >= 0,
                                          [&] { return "truncate: n = " + std::to_string(n) + " is negative"; });
    detail::vector<detail::layer_state> next = state_;
    bool queued = false;
    for (int l = 0; l < shape_.layers; ++l) {
      auto const& st = state_[static_cast<std::size_t>(l)];
      auto const p = detail::plan_truncate(key_side_, value_side_, st, n);
      layer_type const layer = layers_[static_cast<std::size_t>(l)];
      for (int h = 0; h < shape_.kv_heads && p.untile_count > 0; ++h) {
        // The residual saturates finite values to ±65504.
        kvq_decode_args const a = decode_arguments(detail::key_region(key_side_, st), h, p.untile_first, p.untile_count,
                                                   kvq_elem_f16_sat, shape_.head_dim);
        std::size_t const residual =
            key_side_.region.residual0 + static_cast<std::size_t>(h) * key_side_.region.residual_stride;
        succeed(dev_.template decode<key_codec>(a, layer, dev_.output_at(layer, residual), stream));
        queued = true;
      }
      next[static_cast<std::size_t>(l)] = p.next;
    }
    if (queued) succeed(dev_.finish(stream));
    state_ = std::move(next);
  }

  /// Drops the oldest n tokens of every layer (sliding window). Raises invalid_argument_error for
  /// n < 0, unsupported_error for KIVI keys when n is not a multiple of G, index_error when a
  /// non-empty layer holds fewer than n tokens.
  void shift_left(std::int64_t n, stream_type stream) {
    check_usable();
    detail::check<invalid_argument_error>(n >= 0,
                                          [&] { return "shift_left: n = " + std::to_string(n) + " is negative"; });
    if constexpr (key_codec::layout == codec_layout::token_group)
      detail::check<unsupported_error>(n % key_codec::group == 0, [&] {
        return "shift_left: KIVI keys shift by multiples of G = " + std::to_string(key_codec::group) + ", not " +
               std::to_string(n);
      });
    for (std::size_t l = 0; l < state_.size(); ++l)
      detail::check<index_error>(state_[l].length == 0 || n <= state_[l].length, [&] {
        return "shift_left: layer " + std::to_string(l) + " holds " + std::to_string(state_[l].length) +
               " tokens, cannot drop " + std::to_string(n);
      });
    if (n == 0) return;
    for (std::size_t l = 0; l < state_.size(); ++l) {
      auto& st = state_[l];
      if (st.length == 0) continue;
      auto const p = detail::plan_shift(key_side_, value_side_, shape_.head_dim, st, n);
      for (int i = 0; i < p.key_count; ++i)
        succeed(dev_.move(layers_[l], key_side_.region.head0, key_side_.region.head_stride, shape_.kv_heads, p.key[i],
                          stream));
      succeed(dev_.move(layers_[l], value_side_.region.head0, value_side_.region.head_stride, shape_.kv_heads, p.value,
                        stream));
      st = p.next;
    }
    succeed(dev_.finish(stream));
  }

  /// Sets the state of `layer` (checked) to `st`, a state valid for this layout, once the caller
  /// has written the storage that `st` describes (loading a saved cache).
  void restore_state(int layer, detail::layer_state const& st) noexcept {
    state_[static_cast<std::size_t>(layer)] = st;
  }

  /// Empties every layer.
  void reset() noexcept {
    for (auto& st : state_) st = detail::layer_state{};
  }

  /// Centered keys on a GPU: copies the key means of `layer` (kv_heads x head_dim f32) into host
  /// memory `out` once the device's work is done; zeros while the layer is empty (its mean is
  /// fixed by the next append). Raises index_error, device_error.
  void read_key_means(int layer, float* out) {
    static_assert(base::device_means, "kvq: only centered keys of a GPU cache have device key means");
    check_usable();
    std::size_t const n = means_bytes_ / sizeof(float);
    if (size(layer) == 0) {
      for (std::size_t i = 0; i < n; ++i) out[i] = 0.0f;
      return;
    }
    succeed(dev_.copy_out(layers_[static_cast<std::size_t>(layer)], key_side_.means0, out, means_bytes_));
  }

  /// Centered keys on a GPU: sets the key means of `layer` (checked) from host memory `mu`
  /// (kv_heads x head_dim f32), for a layer that holds tokens (loading a saved cache); waits.
  void write_key_means(int layer, float const* mu) {
    static_assert(base::device_means, "kvq: only centered keys of a GPU cache have device key means");
    succeed(dev_.copy_in(layers_[static_cast<std::size_t>(layer)], key_side_.means0, mu, means_bytes_));
  }

  /// Non-owning view of the key storage of (layer, head), at the device's addresses; its pointers
  /// stay valid until the cache is destroyed or moved from, its counters until the next non-const
  /// call. Raises index_error.
  auto key_storage(int layer, int head) const -> storage_view { return storage(true, layer, head); }

  /// Non-owning view of the value storage of (layer, head); as key_storage.
  auto value_storage(int layer, int head) const -> storage_view { return storage(false, layer, head); }

 private:
  /// The decode of tokens [first, first + count) of kv_head `head` of region `src` into rows of
  /// `out_type`, `stride` elements apart.
  auto decode_arguments(kvq_region const& src, int head, std::int64_t first, std::int64_t count, int out_type,
                        std::int64_t stride) const -> kvq_decode_args {
    kvq_decode_args a{};
    a.src = src;
    a.out_stride = static_cast<std::uint64_t>(stride);
    a.head_dim = shape_.head_dim;
    a.head = head;
    a.first = static_cast<std::int32_t>(first);
    a.count = static_cast<std::int32_t>(count);
    a.out_type = out_type;
    return a;
  }

  auto storage(bool keys, int layer, int head) const -> storage_view {
    auto const& st = state(layer);
    check_head(head);
    detail::cache_side const& side = keys ? key_side_ : value_side_;
    kvq_region const r = keys ? detail::key_region(side, st) : detail::value_region(side, st);
    storage_view v;
    v.units = dev_.address(layers_[static_cast<std::size_t>(layer)]) + r.head0 +
              static_cast<std::size_t>(head) * r.head_stride;
    v.unit_bytes = r.unit_bytes;
    v.quantized_tokens = r.quantized;
    if (side.tiles || side.kivi_value) {  // KIVI: the f16 key residual, or the values window (a ring)
      v.residual = reinterpret_cast<f16 const*>(dev_.address(layers_[static_cast<std::size_t>(layer)]) + r.residual0 +
                                                static_cast<std::size_t>(head) * r.residual_stride);
      v.residual_capacity = side.residual;
    }
    if (side.tiles) {
      v.tokens_per_unit = r.group;
      v.residual_tokens = st.length - st.key_quantized;
    }
    if (side.kivi_value) {
      v.residual_tokens = st.window_tokens;
      v.residual_first = st.window_first;
    }
    return v;
  }

  static auto validated(cache_shape const& s, int residual, key_params const& key, value_params const& value)
      -> cache_shape {
    detail::check_cache_options<key_codec, value_codec>(s, residual, key, value, Device::max_capacity, Device::name);
    return s;
  }

  auto alloc_bytes() const -> std::size_t {
    if (means_bytes_ > 0) return key_side_.means0 + means_bytes_;
    return layer_bytes_ == 0 ? storage_alignment : layer_bytes_;
  }

  Device dev_;
  cache_shape shape_;
  int residual_ = 0;
  key_params key_{};
  value_params value_{};
  detail::cache_side key_side_;
  detail::cache_side value_side_;
  std::size_t layer_bytes_ = 0;
  std::size_t means_bytes_ = 0;  // device key means of one layer (centered keys on a GPU), else 0
  detail::vector<layer_type> layers_;
  detail::vector<detail::layer_state> state_;
};

KVQ_NAMESPACE_END
