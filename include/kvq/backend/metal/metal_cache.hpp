// kvq: QuantizedKVCache<Choice, kvq::metal>, the quantized KV cache on an Apple GPU (metal-cpp).
//
// Available only on Apple platforms with KVQ_WITH_METAL defined; elsewhere this header declares
// nothing. It needs Apple's metal-cpp, supplied by the user: `#include <Metal/Metal.hpp>` must
// resolve, and exactly one translation unit of the program defines NS_PRIVATE_IMPLEMENTATION and
// MTL_PRIVATE_IMPLEMENTATION before including it; link -framework Metal -framework Foundation.
//
// Design:
//   * Storage: one shared-storage MTLBuffer per layer, laid out exactly as the CPU cache's layer
//     (cache.hpp), so bytes, memory accounting and `plan_memory` are the CPU cache's.
//   * Kernels: the embedded source (kernels_metal_src.hpp) compiled once per device with fast
//     math off (MTLMathModeSafe and precise functions, or fastMathEnabled = NO on older metal-cpp),
//     one pipeline per (kernel, codecs) made on first use with the codecs as function constants
//     (`metal_library`, shareable between caches of a device).
//   * Work is encoded on the caller's command queue, one command buffer per operation, in call
//     order. Operations on MTLBuffers return without waiting; those with host pointers (append from
//     host memory, reads to host memory, attention with host query/output) and shift_left wait.
//     `synchronize()` waits for everything; a failed command buffer then raises kvq::error and
//     marks the cache unusable (every later call raises).
//   * Host-side bookkeeping (token counts, KIVI residual/window positions) and all argument
//     checks happen before anything is encoded: a call that raises leaves the cache unchanged.
//   * Not thread-safe: every call encodes work and most update the bookkeeping; use a cache from
//     one thread at a time (unlike the CPU cache, reads are not const).
//   * Launch plans (which kernels, arguments, grids) come from kvq_metal_args.h, which the CPU
//     test harness of the kernels (tests/metal) runs on the CPU. This file itself has never been
//     compiled on a Mac by kvq's CI: see docs/metal.md.
#pragma once

#include "../../detail/host_vector.hpp"
#include "../backend.hpp"

#if defined(__APPLE__) && defined(KVQ_WITH_METAL)

#  include <Foundation/Foundation.hpp>
#  include <Metal/Metal.hpp>
#  include <algorithm>
#  include <cmath>
#  include <cstddef>
#  include <cstdint>
#  include <cstring>
#  include <map>
#  include <memory>
#  include <mutex>
#  include <string>
#  include <tuple>
#  include <utility>
#  include <vector>

#  include "../../attention.hpp"
#  include "../../cache.hpp"
#  include "kernels_metal_src.hpp"
#  include "kvq_metal_args.h"

KVQ_NAMESPACE_BEGIN

/// Codecs with Metal kernels are implemented on the Metal backend.
template <detail::metal_codec C>
struct implements<C, metal> : std::true_type {};

namespace detail {

/// Owns one reference to a metal-cpp object (one returned by new*, alloc/init, copy or retain).
template <class T>
class metal_ref {
 public:
  metal_ref() = default;
  explicit metal_ref(T* p) noexcept : p_(p) {}
  metal_ref(metal_ref&& o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  metal_ref& operator=(metal_ref&& o) noexcept {
    if (this != &o) reset(std::exchange(o.p_, nullptr));
    return *this;
  }
  metal_ref(metal_ref const&) = delete;
  metal_ref& operator=(metal_ref const&) = delete;
  ~metal_ref() { reset(); }
  void reset(T* p = nullptr) noexcept {
    if (p_ != nullptr) p_->release();
    p_ = p;
  }
  auto get() const noexcept -> T* { return p_; }
  auto operator->() const noexcept -> T* { return p_; }
  explicit operator bool() const noexcept { return p_ != nullptr; }

 private:
  T* p_ = nullptr;
};

/// Drains the objects autoreleased by metal-cpp calls of one kvq operation.
class metal_pool {
 public:
  metal_pool() : pool_(NS::AutoreleasePool::alloc()->init()) {}
  metal_pool(metal_pool const&) = delete;
  metal_pool& operator=(metal_pool const&) = delete;
  ~metal_pool() { pool_->release(); }

 private:
  NS::AutoreleasePool* pool_;
};

/// The message of an NSError, or `fallback`.
inline auto metal_error_text(NS::Error* e, char const* fallback) -> std::string {
  if (e != nullptr && e->localizedDescription() != nullptr) return e->localizedDescription()->utf8String();
  return fallback;
}

/// Asks for IEEE-exact math: MTLMathModeSafe and precise functions where metal-cpp has them
/// (macOS 15 SDK and later), fastMathEnabled = NO otherwise.
template <class Options>
inline void metal_safe_math(Options* o) {
  if constexpr (requires { o->setMathMode(static_cast<decltype(o->mathMode())>(0)); }) {
    o->setMathMode(static_cast<decltype(o->mathMode())>(0));  // MTL::MathModeSafe
    if constexpr (requires {
                    o->setMathFloatingPointFunctions(static_cast<decltype(o->mathFloatingPointFunctions())>(1));
                  })
      o->setMathFloatingPointFunctions(static_cast<decltype(o->mathFloatingPointFunctions())>(1));  // Precise
  } else {
    o->setFastMathEnabled(false);
  }
}

}  // namespace detail

/// kvq's Metal kernels compiled for one device: the library built from the embedded source with
/// fast math off, and the compute pipelines, specialised per codec and made on first use.
/// Thread-safe; share one between the caches of a device.
class metal_library {
 public:
  /// Compiles the kernels for `device`; raises kvq::error with the compiler's message on failure.
  explicit metal_library(MTL::Device* device) : device_(device->retain()) {
    detail::metal_pool pool;
    detail::metal_ref<MTL::CompileOptions> options(MTL::CompileOptions::alloc()->init());
    detail::metal_safe_math(options.get());
    std::string const src = metal_kernels_source();
    NS::Error* err = nullptr;
    library_.reset(device_->newLibrary(NS::String::string(src.c_str(), NS::UTF8StringEncoding), options.get(), &err));
    if (!library_) detail::raise<error>("Metal: compiling kvq's kernels failed: " + detail::metal_error_text(err, "?"));
  }

  auto device() const noexcept -> MTL::Device* { return device_.get(); }

  /// The pipeline of `kernel` with function constants (codec, value_codec).
  auto pipeline(detail::metal_kernel kernel, int codec, int value_codec) -> MTL::ComputePipelineState* {
    std::lock_guard<std::mutex> lock(mutex_);
    auto const key = std::make_tuple(static_cast<int>(kernel), codec, value_codec);
    auto it = pipelines_.find(key);
    if (it != pipelines_.end()) return it->second.get();
    detail::metal_pool pool;
    detail::metal_ref<MTL::FunctionConstantValues> constants(MTL::FunctionConstantValues::alloc()->init());
    constants->setConstantValue(&codec, MTL::DataTypeInt, NS::UInteger(0));
    constants->setConstantValue(&value_codec, MTL::DataTypeInt, NS::UInteger(1));
    char const* name = detail::metal_kernel_names[static_cast<int>(kernel)];
    NS::Error* err = nullptr;
    detail::metal_ref<MTL::Function> fn(
        library_->newFunction(NS::String::string(name, NS::UTF8StringEncoding), constants.get(), &err));
    if (!fn) detail::raise<error>(std::string("Metal: kernel ") + name + ": " + detail::metal_error_text(err, "?"));
    detail::metal_ref<MTL::ComputePipelineState> ps(device_->newComputePipelineState(fn.get(), &err));
    if (!ps) detail::raise<error>(std::string("Metal: pipeline ") + name + ": " + detail::metal_error_text(err, "?"));
    return pipelines_.emplace(key, std::move(ps)).first->second.get();
  }

 private:
  detail::metal_ref<MTL::Device> device_;
  detail::metal_ref<MTL::Library> library_;
  std::mutex mutex_;
  std::map<std::tuple<int, int, int>, detail::metal_ref<MTL::ComputePipelineState>> pipelines_;
};

/// Keys or values already in an MTLBuffer: element (t, h, c) at byte
/// `offset + (t * token_stride + h * head_stride + c) * sizeof(element)`.
struct metal_tensor {
  MTL::Buffer* buffer = nullptr;
  std::size_t offset = 0;  ///< bytes; a multiple of the element size
  std::int64_t tokens = 0;
  int kv_heads = 0;
  int head_dim = 0;
  std::int64_t token_stride = 0;  ///< elements
  std::int64_t head_stride = 0;   ///< elements
  int type = kvq_metal_elem_f32;  ///< kvq_metal_elem_f32, _f16 or _bf16
};

/// The quantized KV cache of one sequence on an Apple GPU. Same shape, options (less the
/// allocator hook), semantics and storage layout as the CPU cache; see the file comment.
///
/// **Example**:
/// ```
/// auto lib = std::make_shared<kvq::metal_library>(device);
/// kvq::QuantizedKVCache<kvq::q8_0, kvq::metal> cache(lib, queue, {32, 8, 128, 8192});
/// cache.append(layer, kvq::token_major(k, n, 8, 128), kvq::token_major(v, n, 8, 128));
/// cache.attention(layer, q, 32, out);
/// ```
template <codec_choice Choice>
class QuantizedKVCache<Choice, metal> {
 public:
  using key_codec = typename codec_pair<Choice>::key;
  using value_codec = typename codec_pair<Choice>::value;
  using key_params = typename key_codec::params_type;
  using value_params = typename value_codec::params_type;
  static_assert(require_implemented<key_codec, metal>());
  static_assert(require_implemented<value_codec, metal>());
  static_assert(value_codec::layout == codec_layout::row,
                "kvq: value codecs must be row codecs (values are quantized per token)");

  /// Run-time options of a cache (the CPU cache's, without the allocator hook).
  struct options {
    int residual = 128;           ///< KIVI residual length R (a multiple of G; 0 allowed); ignored otherwise
    key_params key{};             ///< run-time parameters of the key codec (e.g. fp8 scale)
    value_params value{};         ///< run-time parameters of the value codec
    std::uint32_t threads = 128;  ///< threads per threadgroup of the attention (a multiple of the SIMD width)
  };

  /// Allocates a cache of `shape` on the library's device; work goes to `queue`. Raises
  /// invalid_argument_error on a bad shape or option (as the CPU cache, plus the Metal limits:
  /// capacity < 2^31 tokens, and head_dim small enough for the attention's threadgroup memory).
  QuantizedKVCache(std::shared_ptr<metal_library> library, MTL::CommandQueue* queue, cache_shape const& shape,
                   options const& opt = options{})
      : library_(std::move(library)), queue_(queue != nullptr ? queue->retain() : nullptr), shape_(shape), opt_(opt) {
    using detail::check;
    check<invalid_argument_error>(library_ != nullptr && queue_, "Metal cache: no library or no command queue");
    check<invalid_argument_error>(shape.layers > 0, "cache: layers = " + std::to_string(shape.layers) + " must be > 0");
    check<invalid_argument_error>(shape.kv_heads > 0,
                                  "cache: kv_heads = " + std::to_string(shape.kv_heads) + " must be > 0");
    check<invalid_argument_error>(shape.head_dim > 0 && shape.head_dim <= 65536,
                                  "cache: head_dim = " + std::to_string(shape.head_dim) + " must be in [1, 65536]");
    check<invalid_argument_error>(
        shape.capacity > 0 && shape.capacity < (std::int64_t{1} << 31),
        "Metal cache: capacity = " + std::to_string(shape.capacity) + " must be in [1, 2^31)");
    check<invalid_argument_error>(opt.threads > 0, "Metal cache: threads must be > 0");
    int group = 0;
    if constexpr (key_codec::layout == codec_layout::token_group) group = key_codec::group;
    if constexpr (detail::has_value_window<value_codec>::value) group = std::max(group, value_codec::group);
    check<invalid_argument_error>(group == 0 || (opt.residual >= 0 && opt.residual % group == 0),
                                  "cache: KIVI residual R = " + std::to_string(opt.residual) +
                                      " must be a non-negative multiple of G = " + std::to_string(group));
    if constexpr (requires { fp8_params_valid(opt.key); })
      check<invalid_argument_error>(
          fp8_params_valid(opt.key),
          "cache: the key codec's fp8 scale = " + detail::format_float(opt.key.scale) + " must be finite and > 0");
    if constexpr (requires { fp8_params_valid(opt.value); })
      check<invalid_argument_error>(
          fp8_params_valid(opt.value),
          "cache: the value codec's fp8 scale = " + detail::format_float(opt.value.scale) + " must be finite and > 0");
    auto const kl = detail::region_layout<key_codec, false>::make(shape, opt.residual);
    auto const vl = detail::region_layout<value_codec, true>::make(shape, opt.residual);
    std::size_t const kv = static_cast<std::size_t>(shape.kv_heads);
    key_ = detail::make_metal_side<key_codec, false>(shape, opt.residual, opt.key, 0, kl.bytes());
    value_ = detail::make_metal_side<value_codec, true>(shape, opt.residual, opt.value, kv * kl.bytes(), vl.bytes());
    layer_bytes_ = kv * (kl.bytes() + vl.bytes());
    MTL::Device* dev = library_->device();
    smem_limit_ = dev->maxThreadgroupMemoryLength();
    detail::metal_attention_plan probe;
    check<invalid_argument_error>(detail::plan_metal_attention(key_, value_, detail::metal_state{}, shape.head_dim,
                                                               shape.kv_heads, shape.kv_heads, 0, 0, 1.0f,
                                                               attention_options{}, smem_limit_, opt.threads, 0, probe),
                                  "Metal cache: head_dim = " + std::to_string(shape.head_dim) +
                                      " needs more threadgroup memory than the " + std::to_string(smem_limit_) +
                                      " bytes the device has");
    detail::metal_pool pool;
    for (int l = 0; l < shape.layers; ++l) {
      detail::metal_ref<MTL::Buffer> b(
          dev->newBuffer(std::max<std::size_t>(layer_bytes_, 16), MTL::ResourceStorageModeShared));
      check<error>(static_cast<bool>(b), "Metal cache: allocating " + std::to_string(layer_bytes_) + " bytes failed");
      std::memset(b->contents(), 0, layer_bytes_);
      buffers_.push_back(std::move(b));
    }
    state_.assign(static_cast<std::size_t>(shape.layers), detail::metal_state{});
  }

  QuantizedKVCache(QuantizedKVCache const&) = delete;
  QuantizedKVCache& operator=(QuantizedKVCache const&) = delete;
  ~QuantizedKVCache() {
    if (last_) last_->waitUntilCompleted();  // the GPU may still use the buffers
  }

  auto shape() const noexcept -> cache_shape const& { return shape_; }
  auto get_options() const noexcept -> options const& { return opt_; }
  auto size(int layer) const -> std::int64_t { return state_at(layer).length; }
  /// Memory use (the CPU cache's accounting: the layout is the same; staging buffers excluded).
  auto memory() const noexcept -> memory_report { return plan_memory<Choice>(shape_, opt_.residual); }
  /// The buffer holding `layer` (the CPU cache's layer layout, see cache.hpp).
  auto layer_buffer(int layer) const -> MTL::Buffer* {
    state_at(layer);
    return buffers_[static_cast<std::size_t>(layer)].get();
  }

  /// Appends host keys and values (same token count) to `layer`; waits for the GPU.
  template <element T>
  void append(int layer, kv_tensor<T> const& keys, kv_tensor<T> const& values) {
    check_usable();
    check_tensor(keys.kv_heads, keys.head_dim, keys.tokens, keys.data != nullptr, "keys");
    check_tensor(values.kv_heads, values.head_dim, values.tokens, values.data != nullptr, "values");
    check_strides(keys.tokens, keys.token_stride, keys.head_stride, "keys");
    check_strides(values.tokens, values.token_stride, values.head_stride, "values");
    check_append(layer, keys.tokens, values.tokens);
    if (keys.tokens == 0) return;
    detail::metal_pool pool;
    auto k = stage(keys);
    auto v = stage(values);
    std::int64_t const ts = static_cast<std::int64_t>(shape_.kv_heads) * shape_.head_dim;
    encode_append(layer, keys.tokens, k.get(), 0, detail::metal_source(detail::metal_elem_id<T>(), ts, shape_.head_dim),
                  v.get(), 0, detail::metal_source(detail::metal_elem_id<T>(), ts, shape_.head_dim));
    wait();
  }

  /// Appends keys and values already on the GPU to `layer`; returns without waiting.
  void append(int layer, metal_tensor const& keys, metal_tensor const& values) {
    check_usable();
    check_metal_tensor(keys, "keys");
    check_metal_tensor(values, "values");
    check_append(layer, keys.tokens, values.tokens);
    if (keys.tokens == 0) return;
    detail::metal_pool pool;
    encode_append(layer, keys.tokens, keys.buffer, keys.offset,
                  detail::metal_source(keys.type, keys.token_stride, keys.head_stride), values.buffer, values.offset,
                  detail::metal_source(values.type, values.token_stride, values.head_stride));
  }

  /// Reads keys [first, first + count) of (layer, head) into host memory, rows `out_stride` apart.
  template <element T>
  void read_keys(int layer, int head, std::int64_t first, std::int64_t count, T* out, std::int64_t out_stride = 0) {
    read_host(true, layer, head, first, count, out, out_stride);
  }
  /// Reads values [first, first + count) of (layer, head) into host memory, rows `out_stride` apart.
  template <element T>
  void read_values(int layer, int head, std::int64_t first, std::int64_t count, T* out, std::int64_t out_stride = 0) {
    read_host(false, layer, head, first, count, out, out_stride);
  }
  /// Decodes keys (keys = true) or values [first, first + count) of (layer, head) into `out` at
  /// byte `offset`, as kvq_metal_elem `type`, rows `stride` elements apart; returns without waiting.
  void read(bool keys, int layer, int head, std::int64_t first, std::int64_t count, MTL::Buffer* out,
            std::size_t offset, int type, std::int64_t stride) {
    check_usable();
    check_read(layer, head, first, count);
    detail::check<shape_error>(stride >= shape_.head_dim, [&] {
      return "read: output stride " + std::to_string(stride) + " is smaller than head_dim " +
             std::to_string(shape_.head_dim);
    });
    detail::check<shape_error>(type == kvq_metal_elem_f32 || type == kvq_metal_elem_f16 || type == kvq_metal_elem_bf16,
                               "read: element type " + std::to_string(type) + " is not f32, f16 or bf16");
    // The rows span (count - 1) * stride + head_dim elements, computed without overflow.
    std::int64_t extent = shape_.head_dim;
    bool const spans = count == 0 || detail::add_product_within(extent, stride, count - 1,
                                                                std::numeric_limits<std::int64_t>::max() / 4);
    detail::check<shape_error>(out != nullptr && offset % detail::metal_elem_bytes(type) == 0 && spans &&
                                   (count == 0 || static_cast<std::size_t>(extent) * detail::metal_elem_bytes(type) <=
                                                      out->length() - std::min<std::size_t>(offset, out->length())) &&
                                   offset <= out->length(),
                               "read: the output buffer is null, misaligned or too small");
    if (count == 0) return;
    detail::metal_pool pool;
    MTL::ComputePipelineState* ps = decode_pipeline(keys);
    auto* cb = queue_->commandBuffer();
    auto* enc = cb->computeCommandEncoder();
    encode_decode(enc, ps, keys, layer, head, first, count, out, offset, type, stride);
    enc->endEncoding();
    commit(cb);
  }

  /// Keeps the first n tokens of every layer (see the CPU cache); returns without waiting.
  void truncate(std::int64_t n) {
    check_usable();
    detail::check<invalid_argument_error>(n >= 0, "truncate: n = " + std::to_string(n) + " is negative");
    detail::metal_pool pool;
    MTL::ComputePipelineState* ps = key_.tiles ? decode_pipeline(true) : nullptr;
    MTL::CommandBuffer* cb = nullptr;
    MTL::ComputeCommandEncoder* enc = nullptr;
    std::vector<detail::metal_state> next = state_;
    for (int l = 0; l < shape_.layers; ++l) {
      auto const p = detail::plan_metal_truncate(key_, value_, state_[static_cast<std::size_t>(l)], n);
      for (int h = 0; h < shape_.kv_heads && p.untile_count > 0; ++h) {
        if (enc == nullptr) {
          cb = queue_->commandBuffer();
          enc = cb->computeCommandEncoder();
        }
        // The cut tile's kept tokens go back to the f16 residual rows [0, untile_count).
        std::size_t const res =
            key_.region.head0 + static_cast<std::size_t>(h) * key_.region.head_stride + key_.region.residual_offset;
        encode_decode(enc, ps, true, l, h, p.untile_first, p.untile_count, buffers_[static_cast<std::size_t>(l)].get(),
                      res, kvq_metal_elem_f16_sat, shape_.head_dim);
      }
      next[static_cast<std::size_t>(l)] = p.next;
    }
    if (enc != nullptr) {
      enc->endEncoding();
      commit(cb);
    }
    state_ = std::move(next);
  }

  /// Drops the oldest n tokens of every layer (see the CPU cache). Waits for the GPU, then moves
  /// the bytes on the host (the buffers are in shared storage).
  void shift_left(std::int64_t n) {
    check_usable();
    detail::check<invalid_argument_error>(n >= 0, "shift_left: n = " + std::to_string(n) + " is negative");
    if constexpr (key_codec::layout == codec_layout::token_group)
      detail::check<unsupported_error>(n % key_codec::group == 0, "shift_left: KIVI keys shift by multiples of G = " +
                                                                      std::to_string(key_codec::group) + ", not " +
                                                                      std::to_string(n));
    for (int l = 0; l < shape_.layers; ++l) {
      auto const len = state_[static_cast<std::size_t>(l)].length;
      detail::check<index_error>(len == 0 || n <= len, "shift_left: layer " + std::to_string(l) + " holds " +
                                                           std::to_string(len) + " tokens, cannot drop " +
                                                           std::to_string(n));
    }
    if (n == 0) return;
    wait();
    for (int l = 0; l < shape_.layers; ++l) {
      auto& st = state_[static_cast<std::size_t>(l)];
      if (st.length == 0) continue;
      auto const p = detail::plan_metal_shift(key_, value_, shape_.head_dim, st, n);
      auto* base = static_cast<std::uint8_t*>(buffers_[static_cast<std::size_t>(l)]->contents());
      for (int h = 0; h < shape_.kv_heads; ++h) {
        std::uint8_t* kr = base + key_.region.head0 + static_cast<std::size_t>(h) * key_.region.head_stride;
        std::uint8_t* vr = base + value_.region.head0 + static_cast<std::size_t>(h) * value_.region.head_stride;
        for (int i = 0; i < p.key_count; ++i) std::memmove(kr + p.key[i].dst, kr + p.key[i].src, p.key[i].bytes);
        for (int i = 0; i < p.value_count; ++i)
          std::memmove(vr + p.value[i].dst, vr + p.value[i].src, p.value[i].bytes);
      }
      st = p.next;
    }
  }

  /// Empties every layer.
  void reset() noexcept {
    for (auto& st : state_) st = detail::metal_state{};
  }

  /// Decode attention of host q (q_heads, head_dim) over every token of `layer` into host out;
  /// waits for the GPU. Same options and NaN/Inf rules as kvq::decode_attention.
  void attention(int layer, float const* q, int q_heads, float* out, attention_options const& opt = {}) {
    check_usable();
    detail::check<shape_error>(q != nullptr && out != nullptr, "attention: the query or the output is null");
    detail::metal_pool pool;
    std::size_t const bytes = static_cast<std::size_t>(q_heads) * static_cast<std::size_t>(shape_.head_dim) * 4;
    check_attention(layer, q_heads, opt);
    detail::metal_ref<MTL::Buffer> qb(library_->device()->newBuffer(q, bytes, MTL::ResourceStorageModeShared));
    detail::metal_ref<MTL::Buffer> ob(library_->device()->newBuffer(bytes, MTL::ResourceStorageModeShared));
    detail::check<error>(qb && ob, "attention: allocating staging buffers failed");
    auto const range = attention_range(layer, 0, size(layer), opt);
    encode_attention(layer, qb.get(), 0, q_heads, ob.get(), 0, range.first, range.second, opt, 0);
    wait();
    std::memcpy(out, ob->contents(), bytes);
  }

  /// Decode attention with the query and the output (q_heads, head_dim, f32) in MTLBuffers;
  /// returns without waiting.
  void attention(int layer, MTL::Buffer* q, std::size_t q_offset, int q_heads, MTL::Buffer* out, std::size_t out_offset,
                 attention_options const& opt = {}) {
    check_usable();
    check_attention(layer, q_heads, opt);
    std::size_t const bytes = static_cast<std::size_t>(q_heads) * static_cast<std::size_t>(shape_.head_dim) * 4;
    detail::check<shape_error>(q != nullptr && out != nullptr && q_offset % 4 == 0 && out_offset % 4 == 0 &&
                                   q_offset + bytes <= q->length() && out_offset + bytes <= out->length(),
                               "attention: the query or output buffer is null, misaligned or too small");
    detail::metal_pool pool;
    auto const range = attention_range(layer, 0, size(layer), opt);
    encode_attention(layer, q, q_offset, q_heads, out, out_offset, range.first, range.second, opt, 0);
  }

  /// Partial attention over tokens [begin, end) of `layer` (the split form of kvq::attend_range):
  /// unnormalised output, running max and sum per query head; waits for the GPU.
  auto attend(int layer, float const* q, int q_heads, std::int64_t begin, std::int64_t end,
              attention_options const& opt = {}) -> attention_partial {
    check_usable();
    check_attention(layer, q_heads, opt);
    detail::check<shape_error>(q != nullptr, "attention: the query is null");
    std::int64_t const len = size(layer);
    detail::check<index_error>(begin >= 0 && begin <= end && end <= len,
                               "attention: range [" + std::to_string(begin) + ", " + std::to_string(end) +
                                   ") is outside the " + std::to_string(len) + " tokens of layer " +
                                   std::to_string(layer));
    auto const range = attention_range(layer, begin, end, opt);
    auto part = attention_partial::empty(q_heads, shape_.head_dim);
    if (range.first >= range.second) return part;
    detail::metal_pool pool;
    std::size_t const bytes = static_cast<std::size_t>(q_heads) * static_cast<std::size_t>(shape_.head_dim) * 4;
    detail::metal_ref<MTL::Buffer> qb(library_->device()->newBuffer(q, bytes, MTL::ResourceStorageModeShared));
    detail::check<error>(static_cast<bool>(qb), "attention: allocating staging buffers failed");
    encode_attention(layer, qb.get(), 0, q_heads, nullptr, 0, range.first, range.second, opt,
                     range.second - range.first);
    wait();
    std::memcpy(part.out.data(), scratch_->contents(), bytes);
    auto const* st = static_cast<float const*>(scratch_->contents()) +
                     static_cast<std::size_t>(q_heads) * static_cast<std::size_t>(shape_.head_dim);
    std::copy(st, st + q_heads, part.max.begin());
    std::copy(st + q_heads, st + 2 * q_heads, part.sum.begin());
    return part;
  }

  /// Waits for all work of this cache; raises kvq::error (and marks the cache unusable) if the GPU
  /// reported an error.
  void synchronize() { wait(); }

 private:
  auto state_at(int layer) const -> detail::metal_state const& {
    detail::check<index_error>(
        layer >= 0 && layer < shape_.layers,
        "layer " + std::to_string(layer) + " is out of range [0, " + std::to_string(shape_.layers) + ")");
    return state_[static_cast<std::size_t>(layer)];
  }

  void check_usable() const {
    detail::check<error>(failure_.empty(), "Metal cache unusable after a GPU error: " + failure_);
  }

  void check_tensor(int kv_heads, int head_dim, std::int64_t tokens, bool data, char const* what) const {
    std::string const w = std::string("append: ") + what;
    detail::check<shape_error>(kv_heads == shape_.kv_heads && head_dim == shape_.head_dim,
                               w + " have shape (" + std::to_string(kv_heads) + " heads, " + std::to_string(head_dim) +
                                   " dims); the cache has (" + std::to_string(shape_.kv_heads) + ", " +
                                   std::to_string(shape_.head_dim) + ")");
    detail::check<shape_error>(tokens >= 0, w + " token count " + std::to_string(tokens) + " is negative");
    detail::check<shape_error>(tokens == 0 || data, w + " data is null");
  }

  /// The CPU cache's rule: rows of head_dim contiguous elements must not overlap.
  void check_strides(std::int64_t tokens, std::int64_t ts, std::int64_t hs, char const* what) const {
    // (4-byte elements: the largest input type, so the extent limit holds for every type.)
    detail::check_tensor_strides(tokens, shape_.kv_heads, shape_.head_dim, ts, hs, 4, what);
  }

  void check_metal_tensor(metal_tensor const& x, char const* what) const {
    check_tensor(x.kv_heads, x.head_dim, x.tokens, x.buffer != nullptr, what);
    std::string const w = std::string("append: ") + what;
    detail::check<shape_error>(
        x.type == kvq_metal_elem_f32 || x.type == kvq_metal_elem_f16 || x.type == kvq_metal_elem_bf16,
        w + " element type " + std::to_string(x.type) + " is not f32, f16 or bf16");
    std::size_t const es = detail::metal_elem_bytes(x.type);
    detail::check<shape_error>(x.offset % es == 0, w + " offset " + std::to_string(x.offset) + " is misaligned");
    check_strides(x.tokens, x.token_stride, x.head_stride, what);
    if (x.tokens == 0) return;
    std::int64_t const last = (x.tokens - 1) * x.token_stride + (x.kv_heads - 1) * x.head_stride + x.head_dim;
    detail::check<shape_error>(x.offset + static_cast<std::size_t>(last) * es <= x.buffer->length(),
                               w + " extend past the end of their buffer");
  }

  void check_append(int layer, std::int64_t k_tokens, std::int64_t v_tokens) const {
    auto const& st = state_at(layer);
    detail::check<shape_error>(k_tokens == v_tokens, "append: keys have " + std::to_string(k_tokens) +
                                                         " tokens but values have " + std::to_string(v_tokens));
    detail::check<capacity_error>(k_tokens <= shape_.capacity - st.length,
                                  "append: layer " + std::to_string(layer) + " holds " + std::to_string(st.length) +
                                      " tokens; appending " + std::to_string(k_tokens) + " exceeds the capacity of " +
                                      std::to_string(shape_.capacity));
  }

  void check_read(int layer, int head, std::int64_t first, std::int64_t count) const {
    std::int64_t const len = state_at(layer).length;
    detail::check<index_error>(
        head >= 0 && head < shape_.kv_heads,
        "kv_head " + std::to_string(head) + " is out of range [0, " + std::to_string(shape_.kv_heads) + ")");
    detail::check_read_range("read", layer, len, first, count);
  }

  void check_attention(int layer, int q_heads, attention_options const& opt) const {
    state_at(layer);
    detail::check<shape_error>(q_heads > 0 && q_heads % shape_.kv_heads == 0,
                               "attention: " + std::to_string(q_heads) + " query heads is not a positive multiple of " +
                                   std::to_string(shape_.kv_heads) + " kv heads");
    detail::check<invalid_argument_error>(detail::is_finite_f32(opt.scale) && opt.scale >= 0.0f &&
                                              detail::is_finite_f32(opt.softcap) && opt.softcap >= 0.0f &&
                                              opt.window >= 0,
                                          "attention: scale, softcap and window must be finite and non-negative");
  }

  /// The attended range of [begin, end) after the window option (as kvq::attend_range).
  auto attention_range(int layer, std::int64_t begin, std::int64_t end, attention_options const& opt) const
      -> std::pair<std::int64_t, std::int64_t> {
    std::int64_t const len = size(layer);
    if (opt.window > 0) begin = std::max(begin, len - opt.window);
    return {begin, std::max(begin, end)};
  }

  /// Copies a host tensor into a new shared buffer, dense token-major.
  template <element T>
  auto stage(kv_tensor<T> const& x) -> detail::metal_ref<MTL::Buffer> {
    std::size_t const row = static_cast<std::size_t>(shape_.head_dim) * sizeof(T);
    std::size_t const bytes = static_cast<std::size_t>(x.tokens) * static_cast<std::size_t>(shape_.kv_heads) * row;
    detail::metal_ref<MTL::Buffer> b(library_->device()->newBuffer(bytes, MTL::ResourceStorageModeShared));
    detail::check<error>(static_cast<bool>(b), "append: allocating a staging buffer failed");
    auto* dst = static_cast<std::uint8_t*>(b->contents());
    for (std::int64_t t = 0; t < x.tokens; ++t)
      for (int h = 0; h < shape_.kv_heads; ++h, dst += row)
        std::memcpy(dst, x.data + t * x.token_stride + h * x.head_stride, row);
    return b;
  }

  /// The decode pipeline of the keys or the values (fetched before any encoder is opened, so
  /// that a failure to make it leaves no encoder open).
  auto decode_pipeline(bool keys) -> MTL::ComputePipelineState* {
    return library_->pipeline(detail::metal_kernel::decode, keys ? key_.codec : value_.codec, 0);
  }

  /// Encodes a grid kernel over (grid_x, grid_y) threads (the kernels bounds-check the grid).
  static void dispatch(MTL::ComputeCommandEncoder* enc, MTL::ComputePipelineState* ps, std::uint32_t grid_x,
                       std::uint32_t grid_y) {
    enc->setComputePipelineState(ps);
    NS::UInteger const w = std::max<NS::UInteger>(ps->threadExecutionWidth(), 1);
    NS::UInteger const hgt =
        std::max<NS::UInteger>(1, std::min<NS::UInteger>(ps->maxTotalThreadsPerThreadgroup() / w, 4));
    enc->dispatchThreadgroups(MTL::Size((grid_x + w - 1) / w, (grid_y + hgt - 1) / hgt, 1), MTL::Size(w, hgt, 1));
  }

  void encode_append(int layer, std::int64_t n, MTL::Buffer* kb, std::size_t koff, kvq_metal_source ks, MTL::Buffer* vb,
                     std::size_t voff, kvq_metal_source vs) {
    auto& st = state_[static_cast<std::size_t>(layer)];
    auto const plan = detail::plan_metal_append(key_, value_, shape_.head_dim, shape_.kv_heads, st, n, ks, vs);
    MTL::ComputePipelineState* ps[4] = {};
    for (int i = 0; i < plan.count; ++i)
      ps[i] = library_->pipeline(plan.steps[i].kernel, plan.steps[i].values ? value_.codec : key_.codec, 0);
    auto* cb = queue_->commandBuffer();
    auto* enc = cb->computeCommandEncoder();  // serial dispatch: each step sees the previous one's writes
    for (int i = 0; i < plan.count; ++i) {
      auto const& s = plan.steps[i];
      enc->setBytes(&s.args, sizeof s.args, 0);
      enc->setBuffer(buffers_[static_cast<std::size_t>(layer)].get(), 0, 1);
      enc->setBuffer(s.values ? vb : kb, s.values ? voff : koff, 2);
      dispatch(enc, ps[i], s.grid_x, s.grid_y);
    }
    enc->endEncoding();
    commit(cb);
    st = plan.next;
  }

  void encode_decode(MTL::ComputeCommandEncoder* enc, MTL::ComputePipelineState* ps, bool keys, int layer, int head,
                     std::int64_t first, std::int64_t count, MTL::Buffer* out, std::size_t offset, int type,
                     std::int64_t stride) {
    auto const& st = state_[static_cast<std::size_t>(layer)];
    kvq_metal_decode_args a{};
    a.src = keys ? detail::metal_key_region(key_, st) : detail::metal_value_region(value_, st);
    a.out_stride = static_cast<std::uint64_t>(stride);
    a.head_dim = shape_.head_dim;
    a.head = head;
    a.first = static_cast<std::int32_t>(first);
    a.count = static_cast<std::int32_t>(count);
    a.out_type = type;
    enc->setBytes(&a, sizeof a, 0);
    enc->setBuffer(buffers_[static_cast<std::size_t>(layer)].get(), 0, 1);
    enc->setBuffer(out, offset, 2);
    dispatch(enc, ps, static_cast<std::uint32_t>(shape_.head_dim), static_cast<std::uint32_t>(count));
  }

  template <element T>
  void read_host(bool keys, int layer, int head, std::int64_t first, std::int64_t count, T* out,
                 std::int64_t out_stride) {
    check_usable();
    std::int64_t const d = shape_.head_dim;
    check_read(layer, head, first, count);
    std::int64_t const stride = detail::check_read_output("read", shape_.head_dim, count, out, out_stride);
    if (count == 0) return;
    detail::metal_pool pool;
    std::size_t const row = static_cast<std::size_t>(d) * sizeof(T);
    detail::metal_ref<MTL::Buffer> b(
        library_->device()->newBuffer(static_cast<std::size_t>(count) * row, MTL::ResourceStorageModeShared));
    detail::check<error>(static_cast<bool>(b), "read: allocating a staging buffer failed");
    MTL::ComputePipelineState* ps = decode_pipeline(keys);
    auto* cb = queue_->commandBuffer();
    auto* enc = cb->computeCommandEncoder();
    encode_decode(enc, ps, keys, layer, head, first, count, b.get(), 0, detail::metal_elem_id<T>(), d);
    enc->endEncoding();
    commit(cb);
    wait();
    auto const* src = static_cast<std::uint8_t const*>(b->contents());
    for (std::int64_t t = 0; t < count; ++t)
      std::memcpy(out + t * stride, src + static_cast<std::size_t>(t) * row, row);
  }

  /// Encodes kvq_attention_partial (+ kvq_attention_combine when `out` is set) over [begin, end).
  /// With `out` null, the partial state of one split is left at the start of scratch_ as out
  /// (q_heads, head_dim), max (q_heads), sum (q_heads).
  void encode_attention(int layer, MTL::Buffer* q, std::size_t q_off, int q_heads, MTL::Buffer* out,
                        std::size_t out_off, std::int64_t begin, std::int64_t end, attention_options const& opt,
                        std::int64_t split_tokens) {
    int const d = shape_.head_dim;
    float const scale = opt.scale > 0.0f ? opt.scale : 1.0f / std::sqrt(static_cast<float>(d));
    MTL::ComputePipelineState* ps =
        library_->pipeline(detail::metal_kernel::attention_partial, key_.codec, value_.codec);
    MTL::ComputePipelineState* combine = library_->pipeline(detail::metal_kernel::attention_combine, 0, 0);
    NS::UInteger const w = std::max<NS::UInteger>(ps->threadExecutionWidth(), 1);
    NS::UInteger const threads =
        std::max<NS::UInteger>(w, std::min<NS::UInteger>(opt_.threads, ps->maxTotalThreadsPerThreadgroup()) / w * w);
    std::size_t const smem = smem_limit_ - std::min<std::size_t>(smem_limit_, ps->staticThreadgroupMemoryLength());
    detail::metal_attention_plan plan;
    detail::check<invalid_argument_error>(
        detail::plan_metal_attention(key_, value_, state_[static_cast<std::size_t>(layer)], d, shape_.kv_heads, q_heads,
                                     begin, end, scale, opt, smem, static_cast<std::uint32_t>(threads), split_tokens,
                                     plan),
        "attention: the threadgroup memory of this device is too small for head_dim " + std::to_string(d));
    auto* cb = queue_->commandBuffer();
    if (plan.empty) {  // nothing attended: the output is zeros (callers never ask for an empty partial)
      if (out == nullptr) return;
      auto* blit = cb->blitCommandEncoder();
      blit->fillBuffer(
          out, NS::Range::Make(out_off, static_cast<NS::UInteger>(q_heads) * static_cast<NS::UInteger>(d) * 4), 0);
      blit->endEncoding();
      commit(cb);
      return;
    }
    auto* enc = cb->computeCommandEncoder();
    std::size_t const splits = plan.threadgroups_x;
    std::size_t const qd = static_cast<std::size_t>(q_heads) * static_cast<std::size_t>(d);
    std::size_t const need = (splits * qd + 2 * splits * static_cast<std::size_t>(q_heads)) * 4;
    ensure_scratch(need);
    std::size_t const o_max = splits * qd * 4;
    std::size_t const o_sum = o_max + splits * static_cast<std::size_t>(q_heads) * 4;
    enc->setComputePipelineState(ps);
    enc->setBytes(&plan.args, sizeof plan.args, 0);
    enc->setBuffer(buffers_[static_cast<std::size_t>(layer)].get(), 0, 1);
    enc->setBuffer(buffers_[static_cast<std::size_t>(layer)].get(), 0, 2);
    enc->setBuffer(q, q_off, 3);
    enc->setBuffer(scratch_.get(), 0, 4);
    enc->setBuffer(scratch_.get(), o_max, 5);
    enc->setBuffer(scratch_.get(), o_sum, 6);
    enc->setThreadgroupMemoryLength(plan.smem_bytes, 0);
    enc->dispatchThreadgroups(MTL::Size(plan.threadgroups_x, plan.threadgroups_y, 1), MTL::Size(plan.threads, 1, 1));
    if (out != nullptr) {
      enc->setBytes(&plan.combine, sizeof plan.combine, 0);
      enc->setBuffer(scratch_.get(), 0, 1);
      enc->setBuffer(scratch_.get(), o_max, 2);
      enc->setBuffer(scratch_.get(), o_sum, 3);
      enc->setBuffer(out, out_off, 4);
      dispatch(enc, combine, static_cast<std::uint32_t>(d), static_cast<std::uint32_t>(q_heads));
    }
    enc->endEncoding();
    commit(cb);
  }

  /// Makes scratch_ at least `bytes` long; a replaced buffer stays alive until the next wait.
  void ensure_scratch(std::size_t bytes) {
    if (scratch_ && scratch_->length() >= bytes) return;
    if (scratch_) retired_.push_back(std::move(scratch_));
    scratch_.reset(library_->device()->newBuffer(std::max<std::size_t>(bytes, 256), MTL::ResourceStorageModeShared));
    detail::check<error>(static_cast<bool>(scratch_), "attention: allocating scratch memory failed");
  }

  void commit(MTL::CommandBuffer* cb) {
    cb->commit();
    last_.reset(cb->retain());
  }

  /// Waits for the last committed command buffer (the queue runs them in order) and checks it.
  void wait() {
    if (!last_) return;
    detail::metal_pool pool;  // error() and its description are autoreleased
    last_->waitUntilCompleted();
    bool const failed = last_->status() == MTL::CommandBufferStatusError;
    std::string const msg = failed ? detail::metal_error_text(last_->error(), "command buffer failed") : "";
    last_.reset();
    retired_.clear();
    if (failed) {
      failure_ = msg;
      detail::raise<error>("Metal cache: GPU error: " + msg);
    }
  }

  std::shared_ptr<metal_library> library_;
  detail::metal_ref<MTL::CommandQueue> queue_;
  cache_shape shape_;
  options opt_;
  detail::metal_side key_;
  detail::metal_side value_;
  std::size_t layer_bytes_ = 0;
  std::size_t smem_limit_ = 0;
  std::vector<detail::metal_ref<MTL::Buffer>> buffers_;
  std::vector<detail::metal_state> state_;
  detail::metal_ref<MTL::Buffer> scratch_;
  std::vector<detail::metal_ref<MTL::Buffer>> retired_;
  detail::metal_ref<MTL::CommandBuffer> last_;
  std::string failure_;
};

KVQ_NAMESPACE_END

#endif  // __APPLE__ && KVQ_WITH_METAL
