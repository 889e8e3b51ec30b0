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
//   * Host logic: the cache core (core/cache_core.hpp: checks, token counts, KIVI residual and
//     window positions, the plans of every operation) over `metal_device`; every check happens
//     before anything is encoded, so a call that raises leaves the cache unchanged.
//   * Not thread-safe: every call encodes work and most update the bookkeeping; use a cache from
//     one thread at a time (unlike the CPU cache, reads are not const).
//   * Kernels: kernels.metal, entry points over the kernel bodies of core/kernel_bodies.h that the
//     CUDA backend and the host tests share; the tests run this file on a mock metal-cpp whose
//     "GPU" runs kernels.metal on the CPU (tests/metal). It has never been compiled on a Mac by
//     kvq's CI: see docs/metal.md.
#pragma once

#include "../../core/plans.hpp"
#include "../../detail/host_vector.hpp"
#include "../backend.hpp"

KVQ_NAMESPACE_BEGIN

/// Codecs with kernel bodies are implemented on the Metal backend (on every platform, so that
/// code that only names the combination compiles anywhere).
template <detail::kernel_codec_of C>
struct implements<C, metal> : std::true_type {};

KVQ_NAMESPACE_END

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
#  include <span>
#  include <string>
#  include <tuple>
#  include <utility>
#  include <vector>

#  include "../../attention.hpp"
#  include "../../cache.hpp"
#  include "../../core/cache_core.hpp"
#  include "../../core/paged_core.hpp"
#  include "../../core/query_launches.hpp"
#  include "../../paged_attention.hpp"
#  include "../../paged_cache.hpp"
#  include "kernels_metal_src.hpp"

/// Element types of Metal tensors and reads (metal_tensor::type, QuantizedKVCache::read): the
/// kernel element types of core/kernel_args.h under their Metal names.
enum kvq_metal_elem : int32_t {
  kvq_metal_elem_f32 = kvq_elem_f32,
  kvq_metal_elem_f16 = kvq_elem_f16,
  kvq_metal_elem_bf16 = kvq_elem_bf16,
};

KVQ_NAMESPACE_BEGIN

namespace detail {

/// Kernels of kvq's Metal backend, in the order of `metal_kernel_names`.
enum class metal_kernel : int {
  encode_rows,
  encode_key_tiles,
  store_f16_rows,
  decode,
  attention_partial,
  attention_combine,
};

/// The function names of the kernels in kernels.metal.
inline constexpr char const* metal_kernel_names[] = {
    "kvq_encode_rows", "kvq_encode_key_tiles",  "kvq_store_f16_rows",
    "kvq_decode",      "kvq_attention_partial", "kvq_attention_combine",
};

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

namespace detail {

/// A buffer and a byte offset into it: where a Metal kernel reads input or writes output.
struct metal_span {
  MTL::Buffer* buffer = nullptr;
  std::size_t offset = 0;
};

/// The cache core's device on an Apple GPU: shared-storage buffers, work encoded on one command
/// queue (one command buffer per operation, opened on its first kernel and committed by
/// finish()), the pipelines of the cache's codecs made at construction, and the failure of a
/// command buffer reported when it is waited for.
class metal_device {
 public:
  using backend_tag = metal;
  using stream_type = no_stream;
  using layer_type = MTL::Buffer*;
  using input_type = metal_span;
  using output_type = metal_span;
  static constexpr char const* name = "Metal cache";
  static constexpr std::int64_t max_capacity = (std::int64_t{1} << 31) - 1;
  static constexpr bool host_memory = false;  ///< shared storage, but read only after the GPU's work
  /// What a kvq operation driving the core directly holds while it runs (drains autoreleased objects).
  using operation_scope = metal_pool;

  /// A device encoding on `queue` with the kernels of `library`, for key codec `key` and value
  /// codec `value` (kvq_codec_id); makes their pipelines (raises kvq::error when one fails).
  metal_device(std::shared_ptr<metal_library> library, MTL::CommandQueue* queue, int key, int value)
      : library_(std::move(library)), queue_(queue->retain()) {
    for (int k = 0; k < 4; ++k) {
      pipeline(static_cast<metal_kernel>(k), key);
      pipeline(static_cast<metal_kernel>(k), value);
    }
    pipeline(metal_kernel::attention_partial, key, value);
    pipeline(metal_kernel::attention_combine, 0, 0);
  }
  metal_device(metal_device&&) noexcept = default;
  metal_device& operator=(metal_device&&) = delete;

  auto library() const noexcept -> metal_library& { return *library_; }
  auto queue() const noexcept -> MTL::CommandQueue* { return queue_.get(); }

  /// The pipeline of `kernel` for codec `codec` (and `value` for the attention).
  auto pipeline(metal_kernel kernel, int codec, int value = 0) const -> MTL::ComputePipelineState* {
    return library_->pipeline(kernel, codec, value);
  }

  auto allocate(std::size_t bytes) -> MTL::Buffer* {
    metal_pool pool;
    MTL::Buffer* b = library_->device()->newBuffer(std::max<std::size_t>(bytes, 16), MTL::ResourceStorageModeShared);
    check<error>(b != nullptr, [&] { return "Metal cache: allocating " + std::to_string(bytes) + " bytes failed"; });
    std::memset(b->contents(), 0, bytes);
    return b;
  }
  void deallocate(MTL::Buffer* b, std::size_t) noexcept { b->release(); }
  auto address(MTL::Buffer* b) const noexcept -> std::byte* { return static_cast<std::byte*>(b->contents()); }
  auto output_at(MTL::Buffer* b, std::size_t offset) const noexcept -> metal_span { return {b, offset}; }
  auto offset_output(metal_span out, std::size_t bytes) const noexcept -> metal_span {
    out.offset += bytes;
    return out;
  }

  template <codec C>
  auto write(write_step const& s, MTL::Buffer* layer, metal_span input, no_stream) -> device_status {
    static constexpr metal_kernel kernels[] = {metal_kernel::encode_rows, metal_kernel::encode_key_tiles,
                                               metal_kernel::store_f16_rows};
    MTL::ComputeCommandEncoder* enc = encoder();  // serial dispatch: each step sees the previous one's writes
    enc->setBytes(&s.args, sizeof s.args, 0);
    enc->setBuffer(layer, 0, 1);
    enc->setBuffer(input.buffer, input.offset, 2);
    dispatch(enc, pipeline(kernels[static_cast<int>(s.kernel)], kernel_codec<C>::value), s.threads);
    return {};
  }

  template <codec C>
  auto decode(kvq_decode_args const& a, MTL::Buffer* layer, metal_span out, no_stream) -> device_status {
    MTL::ComputeCommandEncoder* enc = encoder();
    enc->setBytes(&a, sizeof a, 0);
    enc->setBuffer(layer, 0, 1);
    enc->setBuffer(out.buffer, out.offset, 2);
    dispatch(enc, pipeline(metal_kernel::decode, kernel_codec<C>::value),
             static_cast<std::int64_t>(a.count) * a.head_dim);
    return {};
  }

  /// Waits for the GPU, then moves the bytes on the host (the buffers are in shared storage).
  auto move(MTL::Buffer* layer, std::size_t region0, std::size_t head_stride, int kv_heads, byte_move const& m,
            no_stream) -> device_status {
    device_status const st = wait();
    if (!st.ok()) return st;
    auto* base = static_cast<std::byte*>(layer->contents()) + region0;
    for (int h = 0; h < kv_heads; ++h) {
      std::byte* reg = base + static_cast<std::size_t>(h) * head_stride;
      std::memmove(reg + m.dst, reg + m.src, m.bytes);
    }
    return {};
  }

  /// Waits for the GPU, then copies `bytes` bytes at `offset` of `b` to host memory `dst`.
  auto copy_out(MTL::Buffer* b, std::size_t offset, void* dst, std::size_t bytes) -> device_status {
    device_status const st = wait();
    if (st.ok()) std::memcpy(dst, static_cast<std::byte const*>(b->contents()) + offset, bytes);
    return st;
  }
  /// Waits for the GPU, then copies `bytes` bytes of host memory `src` to `offset` of `b`.
  auto copy_in(MTL::Buffer* b, std::size_t offset, void const* src, std::size_t bytes) -> device_status {
    device_status const st = wait();
    if (st.ok()) std::memcpy(static_cast<std::byte*>(b->contents()) + offset, src, bytes);
    return st;
  }

  /// Commits the operation's command buffer, if it encoded anything.
  auto finish(no_stream = {}) -> device_status {
    if (encoder_ != nullptr) {
      encoder_->endEncoding();
      encoder_ = nullptr;
    }
    if (open_ != nullptr) {
      open_->commit();
      last_.reset(open_->retain());
      open_ = nullptr;
    }
    return {};
  }

  /// The compute encoder of the operation's command buffer (opened on first use).
  auto encoder() -> MTL::ComputeCommandEncoder* {
    if (encoder_ == nullptr) {
      if (open_ == nullptr) open_ = queue_->commandBuffer();
      encoder_ = open_->computeCommandEncoder();
    }
    return encoder_;
  }
  /// The operation's command buffer (opened on first use), for blits.
  auto command_buffer() -> MTL::CommandBuffer* {
    if (open_ == nullptr) open_ = queue_->commandBuffer();
    return open_;
  }

  /// Waits for the last committed command buffer (the queue runs them in order); its failure, if
  /// it failed. Staging buffers retired by the operations before it are freed.
  auto wait() -> device_status {
    if (!last_) return {};
    metal_pool pool;  // error() and its description are autoreleased
    last_->waitUntilCompleted();
    bool const failed = last_->status() == MTL::CommandBufferStatusError;
    failure_text_ = failed ? metal_error_text(last_->error(), "command buffer failed") : "";
    last_.reset();
    retired_.clear();
    if (failed) return {"GPU error", failure_text_.c_str()};
    return {};
  }

  /// Keeps a staging buffer alive until the next wait.
  void retire(metal_ref<MTL::Buffer> b) { retired_.push_back(std::move(b)); }

  /// Encodes a kernel over a one-dimensional grid of n threads (the kernels bounds-check it).
  static void dispatch(MTL::ComputeCommandEncoder* enc, MTL::ComputePipelineState* ps, std::int64_t n) {
    enc->setComputePipelineState(ps);
    NS::UInteger const w = std::max<NS::UInteger>(
        std::min<NS::UInteger>(ps->maxTotalThreadsPerThreadgroup(), 4 * ps->threadExecutionWidth()), 1);
    NS::UInteger const groups = (static_cast<NS::UInteger>(n) + w - 1) / w;
    enc->dispatchThreadgroups(MTL::Size(std::max<NS::UInteger>(groups, 1), 1, 1), MTL::Size(w, 1, 1));
  }

 private:
  std::shared_ptr<metal_library> library_;
  metal_ref<MTL::CommandQueue> queue_;
  MTL::CommandBuffer* open_ = nullptr;             // autoreleased, alive within the operation's pool
  MTL::ComputeCommandEncoder* encoder_ = nullptr;  // of open_
  metal_ref<MTL::CommandBuffer> last_;
  std::vector<metal_ref<MTL::Buffer>> retired_;
  std::string failure_text_;
};

/// The attention launch settings on Metal: tiles of up to 4096 / head_dim tokens (at most 32),
/// about 64 threadgroups per launch.
inline auto metal_attention_device(int head_dim, std::size_t smem, std::uint32_t threads, std::int64_t split_tokens)
    -> attention_device {
  attention_device d;
  d.smem_limit = smem;
  d.threads = static_cast<int>(threads);
  d.max_tile = std::clamp(4096 / std::max(head_dim, 1), 1, 32);
  d.target_blocks = 64;
  d.split_tokens = split_tokens;
  return d;
}

/// Raises invalid_argument_error naming `who` unless `threads` > 0 and the attention of `head_dim`
/// fits the threadgroup memory of the library's device.
inline void metal_check_launch(metal_library& library, int head_dim, int kv_heads, std::uint32_t threads,
                               char const* who) {
  check<invalid_argument_error>(threads > 0, [&] { return std::string(who) + ": threads must be > 0"; });
  std::size_t const smem = library.device()->maxThreadgroupMemoryLength();
  attention_plan probe;
  check<invalid_argument_error>(plan_attention(head_dim, kv_heads, kv_heads, 1, 0, false,
                                               metal_attention_device(head_dim, smem, threads, 0), probe),
                                [&] {
                                  return std::string(who) + ": head_dim = " + std::to_string(head_dim) +
                                         " needs more threadgroup memory than the " + std::to_string(smem) +
                                         " bytes the device has";
                                });
}

/// Binds the sinks (q_heads floats of host memory; none when null) to buffer `index` of `enc` (the
/// combine kernel's): as bytes when they fit setBytes, else in a staging buffer that `dev` keeps
/// until its next wait. Without sinks a placeholder is bound (the kernel does not read it).
inline void metal_bind_sinks(metal_device& dev, MTL::ComputeCommandEncoder* enc, float const* sinks, int q_heads,
                             NS::UInteger index) {
  std::size_t const bytes = static_cast<std::size_t>(q_heads) * sizeof(float);
  if (sinks == nullptr) {
    float const none = 0.0f;
    enc->setBytes(&none, sizeof none, index);
  } else if (bytes <= 4096) {
    enc->setBytes(sinks, bytes, index);
  } else {
    metal_ref<MTL::Buffer> b(dev.library().device()->newBuffer(sinks, bytes, MTL::ResourceStorageModeShared));
    check<error>(static_cast<bool>(b), "attention: allocating staging buffers failed");
    enc->setBuffer(b.get(), 0, index);
    dev.retire(std::move(b));
  }
}

/// Binds a placeholder to the custom-mask buffer of the partial attention (index 8), which a
/// launch without a custom mask does not read.
inline void metal_bind_no_mask(MTL::ComputeCommandEncoder* enc) {
  std::int32_t const none = 0;
  enc->setBytes(&none, sizeof none, 8);
}

/// The attention kernels of a cache on its device: the partial attention of its codecs and the
/// combine, with the threads per threadgroup (the cache's option rounded down to the SIMD width,
/// at least one SIMD group) and the threadgroup memory left to the partial attention.
struct metal_attention_kernels {
  MTL::ComputePipelineState* partial = nullptr;
  MTL::ComputePipelineState* combine = nullptr;
  NS::UInteger threads = 0;
  std::size_t smem = 0;

  /// The launch settings of these kernels for `head_dim`, splits of `split_tokens` (0: planned).
  auto device(int head_dim, std::int64_t split_tokens) const -> attention_device {
    return metal_attention_device(head_dim, smem, static_cast<std::uint32_t>(threads), split_tokens);
  }
};

/// The attention kernels of `dev` for key codec `key` and value codec `value` (kvq_codec_id), at
/// most `threads` threads per threadgroup.
inline auto metal_attention_kernels_of(metal_device& dev, int key, int value, std::uint32_t threads)
    -> metal_attention_kernels {
  metal_attention_kernels k;
  k.partial = dev.pipeline(metal_kernel::attention_partial, key, value);
  k.combine = dev.pipeline(metal_kernel::attention_combine, 0, 0);
  NS::UInteger const w = std::max<NS::UInteger>(k.partial->threadExecutionWidth(), 1);
  k.threads =
      std::max<NS::UInteger>(w, std::min<NS::UInteger>(threads, k.partial->maxTotalThreadsPerThreadgroup()) / w * w);
  std::size_t const limit = dev.library().device()->maxThreadgroupMemoryLength();
  k.smem = limit - std::min<std::size_t>(limit, k.partial->staticThreadgroupMemoryLength());
  return k;
}

/// The buffers the dispatches of one attention call use: the cache's layer or pool, the queries,
/// the partial states, the sequences (null: each dispatch's own, as bytes), the page-table buffer
/// (null: a flat cache), the custom mask rows (null: none), the output (null: no combine, the
/// partial states stay) and the sinks (q_heads floats of host memory, or null).
struct metal_attention_buffers {
  MTL::Buffer* layer = nullptr;
  MTL::Buffer* q = nullptr;
  MTL::Buffer* part = nullptr;
  MTL::Buffer* seqs = nullptr;
  MTL::Buffer* pages = nullptr;
  MTL::Buffer* mask = nullptr;
  MTL::Buffer* out = nullptr;
  float const* sinks = nullptr;
};

/// The buffers of an attention over `layer` (a cache's layer or pool) with the queries in `q`, the
/// partial states in `part`, the output in `out` and the host `sinks`; no sequences, page tables
/// or mask rows.
inline auto metal_attention_io(MTL::Buffer* layer, MTL::Buffer* q, MTL::Buffer* part, MTL::Buffer* out,
                               float const* sinks) -> metal_attention_buffers {
  metal_attention_buffers io;
  io.layer = layer;
  io.q = q;
  io.part = part;
  io.out = out;
  io.sinks = sinks;
  return io;
}

/// One partial-attention dispatch (grid: plan.splits x kv_heads * plan.chunks x batch) and its
/// combine: `batch` sequences of `rows` (query token, query head) rows each, their queries and
/// outputs at byte offsets of the call's buffers, the mask rows at byte mask_offset.
struct metal_attention_dispatch {
  kvq_attention_args args{};
  attention_plan plan;
  kvq_attention_seq seq{};  ///< the sequence, unless the call's buffers hold them
  std::size_t rows = 0;
  std::size_t batch = 1;
  std::size_t q_offset = 0;
  std::size_t out_offset = 0;
  std::size_t mask_offset = 0;
};

/// Encodes on `dev` each dispatch of `list` that attends anything (plan.splits > 0) over `io`,
/// with its combine when io.out is set, and commits them if there were any.
inline void metal_encode_attention(metal_device& dev, metal_attention_kernels const& k,
                                   metal_attention_buffers const& io, int kv_heads, int q_heads, int head_dim,
                                   std::span<metal_attention_dispatch const> list) {
  MTL::ComputeCommandEncoder* enc = nullptr;
  for (metal_attention_dispatch const& x : list) {
    if (x.plan.splits == 0) continue;
    std::size_t const parts = x.batch * static_cast<std::size_t>(x.plan.splits) * x.rows;
    std::size_t const o_max = parts * static_cast<std::size_t>(head_dim) * 4;
    std::size_t const o_sum = o_max + parts * 4;
    if (enc == nullptr) enc = dev.encoder();
    enc->setComputePipelineState(k.partial);
    enc->setBytes(&x.args, sizeof x.args, 0);
    if (io.seqs != nullptr) {
      enc->setBuffer(io.seqs, 0, 1);
    } else {
      enc->setBytes(&x.seq, sizeof x.seq, 1);
    }
    enc->setBuffer(io.layer, 0, 2);
    enc->setBuffer(io.q, x.q_offset, 3);
    enc->setBuffer(io.part, 0, 4);
    enc->setBuffer(io.part, o_max, 5);
    enc->setBuffer(io.part, o_sum, 6);
    if (io.pages != nullptr) {
      enc->setBuffer(io.pages, 0, 7);
    } else {
      std::int32_t const no_pages = 0;  // a flat cache has no page table
      enc->setBytes(&no_pages, sizeof no_pages, 7);
    }
    if (io.mask != nullptr) {
      enc->setBuffer(io.mask, x.mask_offset, 8);
    } else {
      metal_bind_no_mask(enc);
    }
    enc->setThreadgroupMemoryLength(x.plan.smem_bytes, 0);
    enc->dispatchThreadgroups(
        MTL::Size(static_cast<NS::UInteger>(x.plan.splits), static_cast<NS::UInteger>(kv_heads * x.plan.chunks),
                  static_cast<NS::UInteger>(x.batch)),
        MTL::Size(k.threads, 1, 1));
    if (io.out == nullptr) continue;
    kvq_combine_args const cb{
        static_cast<std::int32_t>(x.rows), head_dim, x.plan.splits, static_cast<std::int32_t>(x.batch),
        io.sinks != nullptr ? q_heads : 0, 0};
    enc->setBytes(&cb, sizeof cb, 0);
    enc->setBuffer(io.part, 0, 1);
    enc->setBuffer(io.part, o_max, 2);
    enc->setBuffer(io.part, o_sum, 3);
    enc->setBuffer(io.out, x.out_offset, 4);
    metal_bind_sinks(dev, enc, io.sinks, q_heads, 5);
    metal_device::dispatch(enc, k.combine,
                           static_cast<std::int64_t>(x.batch * x.rows * static_cast<std::size_t>(head_dim)));
  }
  if (enc != nullptr) (void)dev.finish();
}

/// Reads `count` rows of head_dim elements T to host memory `out`, rows `stride` apart: `decode`
/// encodes the core's read into a staging span (dense rows), then this waits for the GPU (through
/// `core`, whose failure state a failed command buffer sets) and copies the rows out.
template <class Core, element T, class Decode>
void metal_read_to_host(Core& core, int head_dim, std::int64_t count, T* out, std::int64_t stride, Decode&& decode) {
  if (count == 0) return;
  metal_pool pool;
  std::size_t const row = static_cast<std::size_t>(head_dim) * sizeof(T);
  metal_ref<MTL::Buffer> b(core.device().library().device()->newBuffer(static_cast<std::size_t>(count) * row,
                                                                       MTL::ResourceStorageModeShared));
  check<error>(static_cast<bool>(b), "read: allocating a staging buffer failed");
  decode(metal_span{b.get(), 0});
  core.succeed(core.device().wait());
  auto const* src = static_cast<std::uint8_t const*>(b->contents());
  for (std::int64_t t = 0; t < count; ++t) std::memcpy(out + t * stride, src + static_cast<std::size_t>(t) * row, row);
}

/// Copies a host tensor of (tokens, kv_heads, head_dim) into a new shared buffer of `device`,
/// dense token-major.
template <element T>
auto metal_stage(metal_device& device, kv_tensor<T> const& x, int kv_heads, int head_dim) -> metal_ref<MTL::Buffer> {
  std::size_t const row = static_cast<std::size_t>(head_dim) * sizeof(T);
  std::size_t const bytes = static_cast<std::size_t>(x.tokens) * static_cast<std::size_t>(kv_heads) * row;
  metal_ref<MTL::Buffer> b(
      device.library().device()->newBuffer(std::max<std::size_t>(bytes, 16), MTL::ResourceStorageModeShared));
  check<error>(static_cast<bool>(b), "append: allocating a staging buffer failed");
  auto* dst = static_cast<std::uint8_t*>(b->contents());
  for (std::int64_t t = 0; t < x.tokens; ++t)
    for (int h = 0; h < kv_heads; ++h, dst += row)
      std::memcpy(dst, x.data + t * x.token_stride + h * x.head_stride, row);
  return b;
}

}  // namespace detail

/// The quantized KV cache of one sequence on an Apple GPU. Same shape, options (less the
/// allocator hook), semantics and storage layout as the CPU cache: the same cache core over
/// `metal_device`; see the file comment.
///
/// **Example**:
/// ```
/// auto lib = std::make_shared<kvq::metal_library>(device);
/// kvq::QuantizedKVCache<kvq::q8_0, kvq::metal> cache(lib, queue, {32, 8, 128, 8192});
/// cache.append(layer, kvq::token_major(k, n, 8, 128), kvq::token_major(v, n, 8, 128));
/// cache.attention(layer, q, 32, out);
/// ```
template <codec_choice Choice>
class QuantizedKVCache<Choice, metal> : public cache_codecs<Choice> {
  using core_type = cache_core<Choice, detail::metal_device>;
  using key_codec_t = typename core_type::key_codec;
  using value_codec_t = typename core_type::value_codec;

 public:
  /// Run-time options of a cache (the CPU cache's, without the allocator hook).
  struct options {
    int residual = 128;                    ///< KIVI residual length R (a multiple of G; 0 allowed); ignored otherwise
    typename core_type::key_params key{};  ///< run-time parameters of the key codec (e.g. fp8 scale)
    typename core_type::value_params value{};  ///< run-time parameters of the value codec
    std::uint32_t threads = 128;  ///< threads per threadgroup of the attention (a multiple of the SIMD width)
  };

  /// Allocates a cache of `shape` on the library's device; work goes to `queue`. Raises
  /// invalid_argument_error on a bad shape or option (as the CPU cache, plus the Metal limits:
  /// capacity < 2^31 tokens, and head_dim small enough for the attention's threadgroup memory),
  /// kvq::error when a pipeline or an allocation fails.
  QuantizedKVCache(std::shared_ptr<metal_library> library, MTL::CommandQueue* queue, cache_shape const& shape,
                   options const& opt = options{})
      : opt_(checked(library, queue, shape, opt)),
        core_(shape, opt.residual, opt.key, opt.value,
              detail::metal_device(std::move(library), queue, detail::kernel_codec<key_codec_t>::value,
                                   detail::kernel_codec<value_codec_t>::value)) {}

  QuantizedKVCache(QuantizedKVCache const&) = delete;
  QuantizedKVCache& operator=(QuantizedKVCache const&) = delete;
  ~QuantizedKVCache() {
    (void)core_.device().wait();  // the GPU may still use the buffers
  }

  auto shape() const noexcept -> cache_shape const& { return core_.shape(); }
  auto get_options() const noexcept -> options const& { return opt_; }
  auto size(int layer) const -> std::int64_t { return core_.size(layer); }
  /// Memory use (the CPU cache's accounting: the layout is the same; staging buffers excluded).
  auto memory() const noexcept -> memory_report { return core_.memory(); }
  /// The buffer holding `layer` (the CPU cache's layer layout, see cache.hpp).
  auto layer_buffer(int layer) const -> MTL::Buffer* { return core_.layer(layer); }

  /// Appends host keys and values (same token count) to `layer`; waits for the GPU.
  template <element T>
  void append(int layer, kv_tensor<T> const& keys, kv_tensor<T> const& values) {
    core_.check_append(layer, detail::describe(keys), detail::describe(values));
    if (keys.tokens == 0) return;
    detail::metal_pool pool;
    auto k = stage(keys);
    auto v = stage(values);
    int const type = detail::kernel_elem<T>();
    std::int64_t const ts = static_cast<std::int64_t>(shape().kv_heads) * shape().head_dim;
    core_.append_checked(layer, keys.tokens, {k.get(), 0}, detail::kernel_source(type, ts, shape().head_dim),
                         {v.get(), 0}, detail::kernel_source(type, ts, shape().head_dim), {});
    wait();
  }

  /// Appends keys and values already on the GPU to `layer`; returns without waiting.
  void append(int layer, metal_tensor const& keys, metal_tensor const& values) {
    core_.check_append(layer, describe(keys, "keys"), describe(values, "values"));
    if (keys.tokens == 0) return;
    detail::metal_pool pool;
    core_.append_checked(layer, keys.tokens, {keys.buffer, keys.offset},
                         detail::kernel_source(keys.type, keys.token_stride, keys.head_stride),
                         {values.buffer, values.offset},
                         detail::kernel_source(values.type, values.token_stride, values.head_stride), {});
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
    core_.check_read("read", layer, head, first, count);
    detail::check<shape_error>(stride >= shape().head_dim, [&] {
      return "read: output stride " + std::to_string(stride) + " is smaller than head_dim " +
             std::to_string(shape().head_dim);
    });
    detail::check<shape_error>(type == kvq_elem_f32 || type == kvq_elem_f16 || type == kvq_elem_bf16, [&] {
      return "read: element type " + std::to_string(type) + " is not f32, f16 or bf16";
    });
    // The rows span (count - 1) * stride + head_dim elements, computed without overflow.
    std::int64_t extent = shape().head_dim;
    bool const spans = count == 0 || detail::add_product_within(extent, stride, count - 1,
                                                                std::numeric_limits<std::int64_t>::max() / 4);
    std::size_t const es = detail::kernel_elem_bytes(type);
    detail::check<shape_error>(out != nullptr && offset % es == 0 && spans && offset <= out->length() &&
                                   (count == 0 || static_cast<std::size_t>(extent) * es <= out->length() - offset),
                               "read: the output buffer is null, misaligned or too small");
    if (count == 0) return;
    detail::metal_pool pool;
    core_.read_checked(keys, layer, head, first, count, {out, offset}, type, stride, {});
  }

  /// Keeps the first n tokens of every layer (see the CPU cache); returns without waiting.
  void truncate(std::int64_t n) {
    detail::metal_pool pool;
    core_.truncate(n, {});
  }

  /// Drops the oldest n tokens of every layer (see the CPU cache). Waits for the GPU, then moves
  /// the bytes on the host (the buffers are in shared storage).
  void shift_left(std::int64_t n) {
    detail::metal_pool pool;
    core_.shift_left(n, {});
  }

  /// Empties every layer.
  void reset() noexcept { core_.reset(); }

  /// Decode attention of host q (q_heads, head_dim) over every token of `layer` into host out;
  /// waits for the GPU. Same options and NaN/Inf rules as kvq::decode_attention.
  void attention(int layer, float const* q, int q_heads, float* out, attention_options const& opt = {}) {
    check_attention(layer, q_heads, opt);
    detail::check_sinks(opt.sinks, q_heads);
    detail::check<shape_error>(q != nullptr && out != nullptr, "attention: the query or the output is null");
    detail::metal_pool pool;
    std::size_t const bytes = static_cast<std::size_t>(q_heads) * static_cast<std::size_t>(shape().head_dim) * 4;
    MTL::Device* dev = core_.device().library().device();
    detail::metal_ref<MTL::Buffer> qb(dev->newBuffer(q, bytes, MTL::ResourceStorageModeShared));
    detail::metal_ref<MTL::Buffer> ob(dev->newBuffer(bytes, MTL::ResourceStorageModeShared));
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
    check_attention(layer, q_heads, opt);
    detail::check_sinks(opt.sinks, q_heads);
    std::size_t const bytes = static_cast<std::size_t>(q_heads) * static_cast<std::size_t>(shape().head_dim) * 4;
    detail::check<shape_error>(q != nullptr && out != nullptr && q_offset % 4 == 0 && out_offset % 4 == 0 &&
                                   q_offset + bytes <= q->length() && out_offset + bytes <= out->length(),
                               "attention: the query or output buffer is null, misaligned or too small");
    detail::metal_pool pool;
    auto const range = attention_range(layer, 0, size(layer), opt);
    encode_attention(layer, q, q_offset, q_heads, out, out_offset, range.first, range.second, opt, 0);
  }

  /// Attention of n_q query tokens over `layer` (chunked prefill, speculative verification), as the
  /// CPU kvq::attention: q and out (n_q, q_heads, head_dim) f32, opt.mask_data and opt.sinks in
  /// host memory; waits for the GPU. Same options, masks, errors and results (to fp32 rounding);
  /// n_q = 1 with the defaults is this cache's decode attention exactly.
  void attention(int layer, float const* q, std::int64_t n_q, int q_heads, float* out,
                 attention_options const& opt = {}) {
    core_.check_usable();
    std::int64_t const len = size(layer);
    int const d = shape().head_dim;
    attention_options kopt;
    std::int64_t const first = detail::check_query_tokens(opt, n_q, q_heads, shape().kv_heads, len, q, out, kopt);
    if (n_q == 0) return;
    detail::metal_pool pool;
    auto& dev = core_.device();
    detail::metal_attention_kernels const K =
        detail::metal_attention_kernels_of(dev, core_.key_side().codec, core_.value_side().codec, opt_.threads);
    bool const q8 = opt.query == query_precision::q8_0;
    auto const mdev = K.device(d, 0);
    auto const launches = detail::plan_query_launches(
        kopt, n_q, first, len, shape().kv_heads, d, [&](int tokens, std::int64_t span, detail::attention_plan& p) {
          return detail::plan_attention(d, shape().kv_heads, q_heads, 1, span, q8, mdev, p, tokens);
        });
    std::size_t scratch_floats = 0;
    for (auto const& l : launches) scratch_floats = std::max(scratch_floats, l.plan.scratch_floats);
    std::size_t const qd = static_cast<std::size_t>(q_heads) * static_cast<std::size_t>(d);
    std::size_t const total = static_cast<std::size_t>(n_q) * qd * 4;
    bool const custom = opt.mask == mask_kind::additive || opt.mask == mask_kind::boolean;
    std::size_t const elem = opt.mask == mask_kind::additive ? sizeof(float) : 1;
    std::size_t const mask_row = static_cast<std::size_t>(kopt.mask_stride) * elem;
    MTL::Device* device = dev.library().device();
    detail::metal_ref<MTL::Buffer> qb(device->newBuffer(q, total, MTL::ResourceStorageModeShared));
    detail::metal_ref<MTL::Buffer> ob(device->newBuffer(total, MTL::ResourceStorageModeShared));
    detail::metal_ref<MTL::Buffer> mb;
    if (custom)  // the rows up to the last one's len tokens
      mb.reset(device->newBuffer(opt.mask_data,
                                 static_cast<std::size_t>(n_q - 1) * mask_row + static_cast<std::size_t>(len) * elem,
                                 MTL::ResourceStorageModeShared));
    detail::check<error>(qb && ob && (mb || !custom), "attention: allocating staging buffers failed");
    std::memset(ob->contents(), 0, total);  // the launches that attend nothing leave zeros
    ensure_scratch(std::max<std::size_t>(scratch_floats, 1) * 4);
    float const scale = opt.scale > 0.0f ? opt.scale : 1.0f / std::sqrt(static_cast<float>(d));
    detail::vector<detail::metal_attention_dispatch> list;
    for (auto const& l : launches) {
      if (l.plan.splits == 0) continue;
      detail::metal_attention_dispatch x;
      x.args = detail::attention_arguments(core_.key_side(), core_.value_side(), d, shape().kv_heads, q_heads, l.plan,
                                           scale, opt.softcap, q8, detail::device_probabilities_f16(opt));
      detail::set_query_tokens(x.args, static_cast<int>(l.tokens), kopt, kopt.mask_stride);
      x.plan = l.plan;
      x.seq = detail::attention_sequence(core_.key_side(), core_.value_side(), core_.state(layer), l.begin, l.end);
      x.seq.first_pos = static_cast<std::int32_t>(first + l.first);
      x.rows = static_cast<std::size_t>(l.tokens) * static_cast<std::size_t>(q_heads);
      x.q_offset = x.out_offset = static_cast<std::size_t>(l.first) * qd * 4;
      x.mask_offset = static_cast<std::size_t>(l.first) * mask_row;
      list.push_back(x);
    }
    detail::metal_attention_buffers io =
        detail::metal_attention_io(core_.layer(layer), qb.get(), scratch_.get(), ob.get(), opt.sinks);
    io.mask = mb.get();
    detail::metal_encode_attention(dev, K, io, shape().kv_heads, q_heads, d, list);
    wait();
    std::memcpy(out, ob->contents(), total);
  }

  /// Partial attention over tokens [begin, end) of `layer` (the split form of kvq::attend_range):
  /// unnormalised output, running max and sum per query head; waits for the GPU.
  auto attend(int layer, float const* q, int q_heads, std::int64_t begin, std::int64_t end,
              attention_options const& opt = {}) -> attention_partial {
    check_attention(layer, q_heads, opt);
    detail::check<shape_error>(q != nullptr, "attention: the query is null");
    std::int64_t const len = size(layer);
    detail::check<index_error>(begin >= 0 && begin <= end && end <= len, [&] {
      return "attention: range [" + std::to_string(begin) + ", " + std::to_string(end) + ") is outside the " +
             std::to_string(len) + " tokens of layer " + std::to_string(layer);
    });
    auto const range = attention_range(layer, begin, end, opt);
    auto part = attention_partial::empty(q_heads, shape().head_dim);
    if (range.first >= range.second) return part;
    detail::metal_pool pool;
    std::size_t const bytes = static_cast<std::size_t>(q_heads) * static_cast<std::size_t>(shape().head_dim) * 4;
    detail::metal_ref<MTL::Buffer> qb(
        core_.device().library().device()->newBuffer(q, bytes, MTL::ResourceStorageModeShared));
    detail::check<error>(static_cast<bool>(qb), "attention: allocating staging buffers failed");
    encode_attention(layer, qb.get(), 0, q_heads, nullptr, 0, range.first, range.second, opt,
                     range.second - range.first);
    wait();
    std::memcpy(part.out.data(), scratch_->contents(), bytes);
    auto const* st = static_cast<float const*>(scratch_->contents()) +
                     static_cast<std::size_t>(q_heads) * static_cast<std::size_t>(shape().head_dim);
    std::copy(st, st + q_heads, part.max.begin());
    std::copy(st + q_heads, st + 2 * q_heads, part.sum.begin());
    return part;
  }

  /// Waits for all work of this cache; raises device_error (a kvq::error, and marks the cache
  /// unusable) if the GPU reported an error.
  void synchronize() {
    core_.check_usable();
    wait();
  }

  /// The cache core (state, sides, storage) that kvq's free functions (save, load, attention) use.
  /// Centered keys (`centered<C>`): copies the key means μ of `layer` (kv_heads × head_dim f32, the
  /// CPU cache's key_mean of each head in turn) to host memory `out`, once the device's work is
  /// done; zeros while the layer is empty. Raises index_error, device_error.
  void read_key_means(int layer, float* out) requires core_type::device_means { core_.read_key_means(layer, out); }

  auto core() noexcept -> core_type& { return core_; }
  auto core() const noexcept -> core_type const& { return core_; }

 private:
  static auto checked(std::shared_ptr<metal_library> const& library, MTL::CommandQueue* queue, cache_shape const& shape,
                      options const& opt) -> options const& {
    detail::check<invalid_argument_error>(library != nullptr && queue != nullptr,
                                          "Metal cache: no library or no command queue");
    detail::check_cache_options<key_codec_t, value_codec_t>(shape, opt.residual, opt.key, opt.value,
                                                            detail::metal_device::max_capacity, "Metal cache");
    detail::metal_check_launch(*library, shape.head_dim, shape.kv_heads, opt.threads, "Metal cache");
    return opt;
  }

  /// A Metal tensor as the core's checks see it, after the Metal-only checks (element type,
  /// offset alignment, extent within the buffer).
  auto describe(metal_tensor const& x, char const* what) const -> detail::kv_tensor_desc {
    std::string const w = std::string("append: ") + what;
    detail::check<shape_error>(x.type == kvq_elem_f32 || x.type == kvq_elem_f16 || x.type == kvq_elem_bf16, [&] {
      return w + " element type " + std::to_string(x.type) + " is not f32, f16 or bf16";
    });
    std::size_t const es = detail::kernel_elem_bytes(x.type);
    detail::check<shape_error>(x.offset % es == 0,
                               [&] { return w + " offset " + std::to_string(x.offset) + " is misaligned"; });
    detail::kv_tensor_desc d{x.tokens, x.kv_heads, x.head_dim, x.token_stride, x.head_stride, x.buffer != nullptr, es};
    // The core checks shape and strides; the extent within the buffer is checked here, after them.
    detail::check_kv_tensor(shape(), d.kv_heads, d.head_dim, d.tokens, d.has_data, d.token_stride, d.head_stride, es,
                            what);
    if (x.tokens > 0) {
      std::int64_t const last = (x.tokens - 1) * x.token_stride + (x.kv_heads - 1) * x.head_stride + x.head_dim;
      detail::check<shape_error>(x.offset + static_cast<std::size_t>(last) * es <= x.buffer->length(),
                                 [&] { return w + " extend past the end of their buffer"; });
    }
    return d;
  }

  void check_attention(int layer, int q_heads, attention_options const& opt) const {
    core_.check_usable();
    core_.check_layer(layer);
    detail::check<shape_error>(q_heads > 0 && q_heads % shape().kv_heads == 0, [&] {
      return "attention: " + std::to_string(q_heads) + " query heads is not a positive multiple of " +
             std::to_string(shape().kv_heads) + " kv heads";
    });
    detail::check_attention_options(opt);
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
    return detail::metal_stage(core_.device(), x, shape().kv_heads, shape().head_dim);
  }

  template <element T>
  void read_host(bool keys, int layer, int head, std::int64_t first, std::int64_t count, T* out,
                 std::int64_t out_stride) {
    core_.check_read("read", layer, head, first, count);
    std::int64_t const stride = detail::check_read_output("read", shape().head_dim, count, out, out_stride);
    detail::metal_read_to_host(core_, shape().head_dim, count, out, stride, [&](detail::metal_span staging) {
      core_.read_checked(keys, layer, head, first, count, staging, detail::kernel_elem<T>(), shape().head_dim, {});
    });
  }

  /// Encodes kvq_attention_partial (+ kvq_attention_combine when `out` is set) over [begin, end).
  /// With `out` null, the partial state of one split is left at the start of scratch_ as out
  /// (q_heads, head_dim), max (q_heads), sum (q_heads).
  void encode_attention(int layer, MTL::Buffer* q, std::size_t q_off, int q_heads, MTL::Buffer* out,
                        std::size_t out_off, std::int64_t begin, std::int64_t end, attention_options const& opt,
                        std::int64_t split_tokens) {
    int const d = shape().head_dim;
    float const scale = opt.scale > 0.0f ? opt.scale : 1.0f / std::sqrt(static_cast<float>(d));
    auto& dev = core_.device();
    detail::metal_attention_kernels const K =
        detail::metal_attention_kernels_of(dev, core_.key_side().codec, core_.value_side().codec, opt_.threads);
    detail::metal_attention_dispatch x;
    detail::check<invalid_argument_error>(
        detail::plan_attention(d, shape().kv_heads, q_heads, 1, end - begin, opt.query == query_precision::q8_0,
                               K.device(d, split_tokens), x.plan),
        [&] {
          return "attention: the threadgroup memory of this device is too small for head_dim " + std::to_string(d);
        });
    if (x.plan.splits == 0) {  // nothing attended: the output is zeros (callers never ask for an empty partial)
      if (out == nullptr) return;
      auto* blit = dev.command_buffer()->blitCommandEncoder();
      blit->fillBuffer(
          out, NS::Range::Make(out_off, static_cast<NS::UInteger>(q_heads) * static_cast<NS::UInteger>(d) * 4), 0);
      blit->endEncoding();
      (void)dev.finish();
      return;
    }
    std::size_t const splits = static_cast<std::size_t>(x.plan.splits);
    std::size_t const qd = static_cast<std::size_t>(q_heads) * static_cast<std::size_t>(d);
    ensure_scratch((splits * qd + 2 * splits * static_cast<std::size_t>(q_heads)) * 4);
    x.args = detail::attention_arguments(core_.key_side(), core_.value_side(), d, shape().kv_heads, q_heads, x.plan,
                                         scale, opt.softcap, opt.query == query_precision::q8_0,
                                         detail::device_probabilities_f16(opt));
    x.seq = detail::attention_sequence(core_.key_side(), core_.value_side(), core_.state(layer), begin, end);
    x.rows = static_cast<std::size_t>(q_heads);
    x.q_offset = q_off;
    x.out_offset = out_off;
    detail::metal_attention_buffers const io =
        detail::metal_attention_io(core_.layer(layer), q, scratch_.get(), out, opt.sinks);
    detail::metal_encode_attention(dev, K, io, shape().kv_heads, q_heads, d, {&x, 1});
  }

  /// Makes scratch_ at least `bytes` long; a replaced buffer stays alive until the next wait.
  void ensure_scratch(std::size_t bytes) {
    if (scratch_ && scratch_->length() >= bytes) return;
    if (scratch_) core_.device().retire(std::move(scratch_));
    scratch_.reset(core_.device().library().device()->newBuffer(std::max<std::size_t>(bytes, 256),
                                                                MTL::ResourceStorageModeShared));
    detail::check<error>(static_cast<bool>(scratch_), "attention: allocating scratch memory failed");
  }

  /// Waits for the GPU; a failed command buffer raises device_error and marks the cache unusable.
  void wait() { core_.succeed(core_.device().wait()); }

  options opt_;
  core_type core_;
  detail::metal_ref<MTL::Buffer> scratch_;
};

/// The paged cache on an Apple GPU: many sequences in one pool of quantized pages (one shared
/// buffer laid out as the CPU PagedKVCache's pool), the paged core (core/paged_core.hpp) over
/// `metal_device`, and batched decode attention in one dispatch for the whole batch plus the
/// combine (sequences and page tables in staging buffers). Host data in and out; every call waits
/// for the GPU.
///
/// **Example**:
/// ```
/// kvq::PagedKVCache<kvq::q4_0, kvq::metal> cache(lib, queue, {32, 8, 128, 64, 4096});
/// auto s = cache.add_sequence();
/// cache.append(s, layer, kvq::token_major(k, n, 8, 128), kvq::token_major(v, n, 8, 128));
/// cache.attention(layer, seqs, q, 32, out);
/// ```
template <codec_choice Choice>
class PagedKVCache<Choice, metal> : public cache_codecs<Choice> {
  using core_type = paged_core<Choice, detail::metal_device>;
  using key_codec_t = typename core_type::key_codec;
  using value_codec_t = typename core_type::value_codec;

 public:
  /// Run-time options (the Metal cache's).
  using options = typename QuantizedKVCache<Choice, metal>::options;

  /// Allocates the pool on the library's device; work goes to `queue`. Raises
  /// invalid_argument_error on a bad shape or option (the CPU paged cache's checks and the Metal
  /// limits), kvq::error when a pipeline or the allocation fails.
  PagedKVCache(std::shared_ptr<metal_library> library, MTL::CommandQueue* queue, paged_shape const& shape,
               options const& opt = options{})
      : opt_(checked(library, queue, shape, opt)),
        core_(shape, opt.residual, opt.key, opt.value,
              detail::metal_device(std::move(library), queue, detail::kernel_codec<key_codec_t>::value,
                                   detail::kernel_codec<value_codec_t>::value)) {}

  PagedKVCache(PagedKVCache const&) = delete;
  PagedKVCache& operator=(PagedKVCache const&) = delete;
  ~PagedKVCache() {
    (void)core_.device().wait();  // the GPU may still use the buffers
  }

  auto shape() const noexcept -> paged_shape const& { return core_.shape(); }
  auto get_options() const noexcept -> options const& { return opt_; }
  auto add_sequence() -> sequence_id { return core_.add_sequence(); }
  auto fork(sequence_id parent) -> sequence_id {
    detail::metal_pool pool;
    return core_.fork(parent, {});
  }
  void release(sequence_id seq) { core_.release(seq); }
  void reserve(sequence_id seq, std::int64_t n) { core_.reserve(seq, n); }
  auto contains(sequence_id seq) const noexcept -> bool { return core_.contains(seq); }
  auto size(sequence_id seq) const -> std::int64_t { return core_.size(seq); }
  auto size(sequence_id seq, int layer) const -> std::int64_t { return core_.size(seq, layer); }
  auto page_table(sequence_id seq) const -> std::span<std::int32_t const> {
    auto const& t = core_.page_table(seq);
    return {t.data(), t.size()};
  }
  auto pages() const noexcept -> page_report { return core_.pages(); }
  auto memory() const noexcept -> memory_report { return core_.memory(); }
  /// The buffer holding the pool (the CPU paged cache's layout, see paged_cache.hpp).
  auto pool_buffer() const noexcept -> MTL::Buffer* { return core_.pool(); }

  /// Appends host keys and values to `layer` of `seq` (see PagedKVCache::append); waits.
  template <element T>
  void append(sequence_id seq, int layer, kv_tensor<T> const& keys, kv_tensor<T> const& values) {
    core_.check_append(seq, layer, detail::describe(keys), detail::describe(values));
    if (keys.tokens == 0) return;
    detail::metal_pool pool;
    int const kv = shape().kv_heads, d = shape().head_dim;
    auto k = detail::metal_stage(core_.device(), keys, kv, d);
    auto v = detail::metal_stage(core_.device(), values, kv, d);
    int const type = detail::kernel_elem<T>();
    std::int64_t const ts = static_cast<std::int64_t>(kv) * d;
    core_.append_checked(seq, layer, keys.tokens, {k.get(), 0}, detail::kernel_source(type, ts, d), {v.get(), 0},
                         detail::kernel_source(type, ts, d), {});
    wait();
  }

  /// Reads keys [first, first + count) of (seq, layer, head) into host memory; waits.
  template <element T>
  void read_keys(sequence_id seq, int layer, int head, std::int64_t first, std::int64_t count, T* out,
                 std::int64_t out_stride = 0) {
    read_host(true, seq, layer, head, first, count, out, out_stride);
  }
  /// Reads values [first, first + count) of (seq, layer, head) into host memory; waits.
  template <element T>
  void read_values(sequence_id seq, int layer, int head, std::int64_t first, std::int64_t count, T* out,
                   std::int64_t out_stride = 0) {
    read_host(false, seq, layer, head, first, count, out, out_stride);
  }

  /// Keeps the first n tokens of every layer of `seq` (see PagedKVCache::truncate); waits.
  void truncate(sequence_id seq, std::int64_t n) {
    detail::metal_pool pool;
    core_.truncate(seq, n, {});
    wait();
  }

  /// Batched decode attention of host q (seqs.size(), q_heads, head_dim) over `layer` into host
  /// out; waits. Options, results (to fp32 rounding) and NaN/Inf rules as
  /// kvq::paged_decode_attention.
  void attention(int layer, std::span<sequence_id const> seqs, float const* q, int q_heads, float* out,
                 attention_options const& opt = {}) {
    core_.check_usable();
    core_.check_layer(layer);
    for (sequence_id s : seqs) core_.check_sequence(s, "attention");
    detail::check<shape_error>(q_heads > 0 && q_heads % shape().kv_heads == 0, [&] {
      return "attention: " + std::to_string(q_heads) + " query heads is not a positive multiple of " +
             std::to_string(shape().kv_heads) + " kv heads";
    });
    detail::check<shape_error>(seqs.empty() || (q != nullptr && out != nullptr),
                               "attention: the query or the output is null");
    detail::check_attention_options(opt);
    detail::check_sinks(opt.sinks, q_heads);
    if (seqs.empty()) return;
    detail::metal_pool pool;
    auto& dev = core_.device();
    int const d = shape().head_dim;
    float const scale = opt.scale > 0.0f ? opt.scale : 1.0f / std::sqrt(static_cast<float>(d));
    detail::metal_attention_kernels const K =
        detail::metal_attention_kernels_of(dev, core_.key_side().codec, core_.value_side().codec, opt_.threads);
    detail::paged_attention_launch L;
    detail::check<invalid_argument_error>(
        detail::plan_paged_attention(core_, layer, seqs, q_heads, opt.window, scale, opt.softcap,
                                     opt.query == query_precision::q8_0, detail::device_probabilities_f16(opt),
                                     K.device(d, 0), L),
        [&] {
          return "attention: the threadgroup memory of this device is too small for head_dim " + std::to_string(d);
        });
    std::size_t const batch = seqs.size();
    std::size_t const qd = static_cast<std::size_t>(q_heads) * static_cast<std::size_t>(d);
    if (L.plan.splits == 0) {
      std::fill(out, out + batch * qd, 0.0f);
      return;
    }
    MTL::Device* mdev = dev.library().device();
    std::size_t const splits = static_cast<std::size_t>(L.plan.splits);
    std::size_t const parts = batch * splits;
    detail::metal_ref<MTL::Buffer> qb(mdev->newBuffer(q, batch * qd * 4, MTL::ResourceStorageModeShared));
    detail::metal_ref<MTL::Buffer> ob(mdev->newBuffer(batch * qd * 4, MTL::ResourceStorageModeShared));
    detail::metal_ref<MTL::Buffer> part(
        mdev->newBuffer(parts * (qd + 2 * static_cast<std::size_t>(q_heads)) * 4, MTL::ResourceStorageModeShared));
    detail::metal_ref<MTL::Buffer> sq(
        mdev->newBuffer(L.seqs.data(), batch * sizeof(kvq_attention_seq), MTL::ResourceStorageModeShared));
    detail::metal_ref<MTL::Buffer> table(
        mdev->newBuffer(std::max<std::size_t>(L.pages.size(), 1) * 4, MTL::ResourceStorageModeShared));
    detail::check<error>(qb && ob && part && sq && table, "attention: allocating staging buffers failed");
    if (!L.pages.empty()) std::memcpy(table->contents(), L.pages.data(), L.pages.size() * 4);
    detail::metal_attention_dispatch x;
    x.args = L.args;
    x.plan = L.plan;
    x.rows = static_cast<std::size_t>(q_heads);
    x.batch = batch;
    detail::metal_attention_buffers io =
        detail::metal_attention_io(core_.pool(), qb.get(), part.get(), ob.get(), opt.sinks);
    io.seqs = sq.get();
    io.pages = table.get();
    detail::metal_encode_attention(dev, K, io, shape().kv_heads, q_heads, d, {&x, 1});
    wait();
    std::memcpy(out, ob->contents(), batch * qd * 4);
  }

  /// Multi-token attention of a batch of query chunks (kvq::query_chunk: a prefill chunk, a draft,
  /// a decode token, each over its own sequence) over `layer`: host q and out (Σ n_q, q_heads,
  /// head_dim), each chunk's mask_data and opt.sinks in host memory; waits. Per chunk, the
  /// dispatches of its launches (plan_query_launches) and their combines. Options, masks, errors
  /// and results (to fp32 rounding) as the CPU kvq::paged_attention (opt.first_pos, mask_data and
  /// mask_stride must stay unset).
  void attention(int layer, std::span<query_chunk const> chunks, float const* q, int q_heads, float* out,
                 attention_options const& opt = {}) {
    core_.check_usable();
    auto& dev = core_.device();
    int const d = shape().head_dim;
    detail::metal_attention_kernels const K =
        detail::metal_attention_kernels_of(dev, core_.key_side().codec, core_.value_side().codec, opt_.threads);
    detail::paged_query_plan const P =
        detail::plan_paged_query_chunks(core_, layer, chunks, q, q_heads, out, opt, K.device(d, 0));
    if (P.rows == 0) return;
    detail::metal_pool pool;
    std::size_t const qd = static_cast<std::size_t>(q_heads) * static_cast<std::size_t>(d);
    std::size_t const total = static_cast<std::size_t>(P.rows) * qd * 4;
    bool const custom = opt.mask == mask_kind::additive || opt.mask == mask_kind::boolean;
    std::size_t const elem = opt.mask == mask_kind::additive ? sizeof(float) : 1;
    MTL::Device* mdev = dev.library().device();
    detail::metal_ref<MTL::Buffer> qb(mdev->newBuffer(q, total, MTL::ResourceStorageModeShared));
    detail::metal_ref<MTL::Buffer> ob(mdev->newBuffer(total, MTL::ResourceStorageModeShared));
    detail::metal_ref<MTL::Buffer> part(
        mdev->newBuffer(std::max<std::size_t>(P.scratch_floats, 1) * 4, MTL::ResourceStorageModeShared));
    detail::metal_ref<MTL::Buffer> table(
        mdev->newBuffer(std::max<std::size_t>(P.pages.size(), 1) * 4, MTL::ResourceStorageModeShared));
    detail::check<error>(qb && ob && part && table, "attention: allocating staging buffers failed");
    // The custom mask rows of every chunk, one after another: chunk c's rows from masks[c].
    detail::vector<std::size_t> mask_at(chunks.size(), 0);
    detail::metal_ref<MTL::Buffer> mb;
    if (custom) {
      std::size_t bytes = 0;
      detail::vector<std::size_t> sizes(chunks.size(), 0);
      for (std::size_t c = 0; c < chunks.size(); ++c) {
        query_chunk const& ch = chunks[c];
        if (ch.n_q == 0) continue;
        std::int64_t const len = size(ch.seq, layer);
        std::int64_t const stride = ch.mask_stride > 0 ? ch.mask_stride : len;
        // the rows up to the last one's len tokens
        sizes[c] =
            (static_cast<std::size_t>(ch.n_q - 1) * static_cast<std::size_t>(stride) + static_cast<std::size_t>(len)) *
            elem;
        mask_at[c] = bytes;
        bytes += (sizes[c] + 15) / 16 * 16;
      }
      mb.reset(mdev->newBuffer(std::max<std::size_t>(bytes, 16), MTL::ResourceStorageModeShared));
      detail::check<error>(static_cast<bool>(mb), "attention: allocating staging buffers failed");
      for (std::size_t c = 0; c < chunks.size(); ++c)
        if (sizes[c] > 0)
          std::memcpy(static_cast<unsigned char*>(mb->contents()) + mask_at[c], chunks[c].mask_data, sizes[c]);
    }
    if (!P.pages.empty()) std::memcpy(table->contents(), P.pages.data(), P.pages.size() * 4);
    std::memset(ob->contents(), 0, total);  // the launches that attend nothing leave zeros
    // The chunk of each launch, for its mask rows.
    std::size_t chunk = 0;
    std::int64_t chunk_end = chunks.empty() ? 0 : chunks[0].n_q;
    detail::vector<detail::metal_attention_dispatch> list;
    for (auto const& l : P.launches) {
      while (l.row0 >= chunk_end) chunk_end += chunks[++chunk].n_q;
      if (l.plan.splits == 0) continue;
      detail::metal_attention_dispatch x;
      x.args = l.args;
      x.plan = l.plan;
      x.seq = l.seq;
      x.rows = static_cast<std::size_t>(l.tokens) * static_cast<std::size_t>(q_heads);
      x.q_offset = x.out_offset = static_cast<std::size_t>(l.row0) * qd * 4;
      if (custom)
        x.mask_offset =
            mask_at[chunk] + static_cast<std::size_t>(static_cast<unsigned char const*>(l.mask) -
                                                      static_cast<unsigned char const*>(chunks[chunk].mask_data));
      list.push_back(x);
    }
    detail::metal_attention_buffers io =
        detail::metal_attention_io(core_.pool(), qb.get(), part.get(), ob.get(), opt.sinks);
    io.pages = table.get();
    io.mask = mb.get();
    detail::metal_encode_attention(dev, K, io, shape().kv_heads, q_heads, d, list);
    wait();
    std::memcpy(out, ob->contents(), total);
  }

  /// Waits for all work of this cache; raises device_error if the GPU reported an error.
  void synchronize() {
    core_.check_usable();
    wait();
  }

  /// The cache core (state, sides, storage) that kvq's free functions (save, load, attention) use.
  /// Centered keys (`centered<C>`): copies the key means μ of `layer` of `seq` (kv_heads × head_dim
  /// f32) to host memory `out`, once the device's work is done; zeros while the layer is empty.
  /// Raises index_error, device_error.
  void read_key_means(sequence_id seq, int layer, float* out) requires core_type::device_means {
    core_.read_key_means(seq, layer, out);
  }

  auto core() noexcept -> core_type& { return core_; }
  auto core() const noexcept -> core_type const& { return core_; }

 private:
  static auto checked(std::shared_ptr<metal_library> const& library, MTL::CommandQueue* queue, paged_shape const& shape,
                      options const& opt) -> options const& {
    detail::check<invalid_argument_error>(library != nullptr && queue != nullptr,
                                          "Metal paged cache: no library or no command queue");
    detail::check_paged_options<key_codec_t, value_codec_t>(shape, opt.residual, opt.key, opt.value,
                                                            detail::metal_device::max_capacity, "Metal paged cache");
    detail::metal_check_launch(*library, shape.head_dim, shape.kv_heads, opt.threads, "Metal paged cache");
    return opt;
  }

  template <element T>
  void read_host(bool keys, sequence_id seq, int layer, int head, std::int64_t first, std::int64_t count, T* out,
                 std::int64_t out_stride) {
    core_.check_read("read", seq, layer, head, first, count);
    std::int64_t const stride = detail::check_read_output("read", shape().head_dim, count, out, out_stride);
    detail::metal_read_to_host(core_, shape().head_dim, count, out, stride, [&](detail::metal_span staging) {
      core_.read_checked(keys, seq, layer, head, first, count, staging, detail::kernel_elem<T>(), shape().head_dim, {});
    });
  }

  /// Waits for the GPU; a failed command buffer raises device_error and marks the cache unusable.
  void wait() { core_.succeed(core_.device().wait()); }

  options opt_;
  core_type core_;
};

KVQ_NAMESPACE_END

#endif  // __APPLE__ && KVQ_WITH_METAL
