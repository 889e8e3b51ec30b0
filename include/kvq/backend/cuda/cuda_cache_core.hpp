// kvq: the CUDA backend as a device of the cache core, independent of the CUDA runtime.
//
// `cuda_cache_core<Choice, Runtime>` is QuantizedKVCache<Choice, kvq::cuda> (cuda_cache.cuh)
// on the host: the cache core (core/cache_core.hpp: checks, layer state, plans, memory) over
// `cuda_device<Runtime>`, plus the batched flash-decoding attention. It reaches the GPU only
// through `Runtime`:
//
//   using stream_type = ...;
//   auto allocate(void** p, std::size_t bytes) -> device_status;        // zero-filled
//   void deallocate(void* p) noexcept;
//   auto sm_count() const -> int;  auto smem_per_block() const -> std::size_t;
//   auto copy_2d(void* dst, std::size_t dpitch, void const* src, std::size_t spitch, std::size_t width,
//                std::size_t height, stream_type) -> device_status;   // device to device
//   auto zero(void* p, std::size_t bytes, stream_type) -> device_status;
//   auto upload(void* dst, void const* src, std::size_t bytes, stream_type) -> device_status;    // host to device
//   auto download(void* dst, void const* src, std::size_t bytes, stream_type) -> device_status;  // device to host,
//   waited for template <int C> auto encode_rows(kvq_write_args const&, unsigned char* layer, void const* input,
//                long long threads, stream_type) -> device_status;
//   template <int C> auto encode_key_tiles(...same...) -> device_status;
//   auto store_f16_rows(...same...) -> device_status;
//   template <int C> auto decode(kvq_decode_args const&, unsigned char const* layer, void* out,
//                long long threads, stream_type) -> device_status;
//   template <int KC, int VC> auto attention(kvq_attention_args const&, kvq_cuda::attention_batch const&,
//                unsigned gx, unsigned gy, unsigned gz, int threads, std::size_t smem_bytes, stream_type)
//                -> device_status;
//   auto combine(kvq_combine_args const&, float const* part_out, float const* part_max,
//                float const* part_sum, float const* sinks, float* out, long long threads, stream_type)
//                -> device_status;
//   auto synchronize(stream_type) -> device_status;
//
// The CUDA runtime implements it with cudaMalloc and kernel launches (cuda_cache.cuh); the host
// test implements it by running the kernel bodies of core/kernel_bodies.h on the CPU, so this file
// and those bodies are tested without a GPU.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <type_traits>

#include "../../attention.hpp"
#include "../../cache.hpp"
#include "../../core/cache_core.hpp"
#include "../../core/kernel_bodies.h"
#include "../../core/query_launches.hpp"
#include "../../error.hpp"
#include "../backend.hpp"

namespace kvq_cuda {

/// Sequences per attention launch (the batched entry launches once per 64 sequences).
constexpr int max_batch = 64;

/// The sequences of one attention launch: their layers, codec state and attended ranges, the
/// queries (batch, n_q, q_heads, head_dim), the custom mask rows (multi-token attention; else
/// null) and the partial states (batch, splits, n_q * q_heads[, head_dim]).
/// Flat caches: up to max_batch sequences in `seq` and `layer`. Paged caches: any number of
/// sequences in device memory (`seqs`), all in the pool `layer[0]`, reading the page-table buffer
/// `pages`.
struct attention_batch {
  kvq_attention_seq seq[max_batch];
  unsigned char const* layer[max_batch];
  kvq_attention_seq const* seqs;  ///< paged: the sequences in device memory (else null)
  std::int32_t const* pages;      ///< paged: the page-table buffer the sequences index (else null)
  void const* mask;               ///< the custom mask rows of kvq_attention_args::mask (else null)
  float const* q;
  float* part_out;
  float* part_max;
  float* part_sum;
};

}  // namespace kvq_cuda

KVQ_NAMESPACE_BEGIN

/// Codecs with kernel bodies are implemented on the CUDA backend.
template <detail::kernel_codec_of C>
struct implements<C, cuda> : std::true_type {};

/// Device scratch memory of the attention and of shift_left, grown on demand (growing frees the
/// old buffer, which waits for the device; reserve the largest size once to keep the hot path
/// free of it).
template <class Runtime>
class basic_cuda_workspace {
 public:
  explicit basic_cuda_workspace(Runtime const& rt) : rt_(rt) {}
  basic_cuda_workspace(basic_cuda_workspace const&) = delete;
  basic_cuda_workspace& operator=(basic_cuda_workspace const&) = delete;
  ~basic_cuda_workspace() {
    if (data_ != nullptr) rt_.deallocate(data_);
  }

  /// Makes the scratch at least `bytes` long; raises device_error when the allocation fails.
  void reserve(std::size_t bytes) {
    if (bytes <= bytes_) return;
    if (data_ != nullptr) rt_.deallocate(data_);
    data_ = nullptr;
    bytes_ = 0;
    void* p = nullptr;
    device_status const st = rt_.allocate(&p, bytes);
    if (!st.ok())
      detail::raise<device_error>(std::string("CUDA: ") + st.call + " of " + std::to_string(bytes) +
                                  " bytes of scratch failed: " + st.text);
    data_ = p;
    bytes_ = bytes;
  }
  auto data() const noexcept -> void* { return data_; }
  auto bytes() const noexcept -> std::size_t { return bytes_; }
  auto runtime() const noexcept -> Runtime const& { return rt_; }

 private:
  Runtime rt_;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

namespace detail {

/// The cache core's device over a CUDA runtime: device memory, kernel launches, moves through a
/// workspace (cudaMemcpy2DAsync has no overlap semantics).
template <class Runtime>
class cuda_device {
 public:
  using backend_tag = cuda;
  using stream_type = typename Runtime::stream_type;
  using layer_type = unsigned char*;
  using input_type = void const*;
  using output_type = void*;
  static constexpr char const* name = "CUDA cache";
  static constexpr std::int64_t max_capacity = (std::int64_t{1} << 31) - 1;
  static constexpr bool host_memory = false;

  explicit cuda_device(Runtime rt)
      : rt_(std::move(rt)), workspace_(std::make_unique<basic_cuda_workspace<Runtime>>(rt_)) {}

  auto runtime() const noexcept -> Runtime const& { return rt_; }
  auto workspace() noexcept -> basic_cuda_workspace<Runtime>& { return *workspace_; }

  auto allocate(std::size_t bytes) -> unsigned char* {
    void* p = nullptr;
    device_status const st = rt_.allocate(&p, bytes);
    if (!st.ok())
      raise<device_error>(std::string(name) + ": " + st.call + " of " + std::to_string(bytes) +
                          " bytes for a layer failed: " + st.text);
    return static_cast<unsigned char*>(p);
  }
  void deallocate(unsigned char* p, std::size_t) noexcept { rt_.deallocate(p); }
  auto address(unsigned char* layer) const noexcept -> std::byte* { return reinterpret_cast<std::byte*>(layer); }
  auto output_at(unsigned char* layer, std::size_t offset) const noexcept -> void* { return layer + offset; }
  auto offset_output(void* out, std::size_t bytes) const noexcept -> void* {
    return static_cast<unsigned char*>(out) + bytes;
  }
  auto finish(stream_type) const noexcept -> device_status { return {}; }
  /// Copies `bytes` bytes at `offset` of `layer` to host memory `dst` once all of the device's work
  /// (every stream) is done.
  auto copy_out(unsigned char* layer, std::size_t offset, void* dst, std::size_t bytes) -> device_status {
    device_status const st = rt_.synchronize_device();
    return st.ok() ? rt_.download(dst, layer + offset, bytes, stream_type{}) : st;
  }
  /// Copies `bytes` bytes of host memory `src` to `offset` of `layer` once all of the device's work is
  /// done, and waits for the copy.
  auto copy_in(unsigned char* layer, std::size_t offset, void const* src, std::size_t bytes) -> device_status {
    device_status st = rt_.synchronize_device();
    if (st.ok()) st = rt_.upload(layer + offset, src, bytes, stream_type{});
    return st.ok() ? rt_.synchronize_device() : st;
  }

  template <codec C>
  auto write(write_step const& s, unsigned char* layer, void const* input, stream_type stream) -> device_status {
    constexpr int id = kernel_codec<C>::value;
    if (s.kernel == write_kernel::encode_rows)
      return rt_.template encode_rows<id>(s.args, layer, input, s.threads, stream);
    if (s.kernel == write_kernel::encode_key_tiles)
      return rt_.template encode_key_tiles<id>(s.args, layer, input, s.threads, stream);
    return rt_.store_f16_rows(s.args, layer, input, s.threads, stream);
  }

  template <codec C>
  auto decode(kvq_decode_args const& a, unsigned char* layer, void* out, stream_type stream) -> device_status {
    return rt_.template decode<kernel_codec<C>::value>(a, layer, out, static_cast<long long>(a.count) * a.head_dim,
                                                       stream);
  }

  /// Moves m.bytes from m.src to m.dst (m.src >= m.dst) inside every kv_head's region, in chunks
  /// through the workspace, lowest first, so overlapping ranges move correctly.
  auto move(unsigned char* layer, std::size_t region0, std::size_t head_stride, int kv_heads, byte_move const& m,
            stream_type stream) -> device_status {
    if (m.bytes == 0 || m.src == m.dst) return {};
    std::size_t const kv = static_cast<std::size_t>(kv_heads);
    workspace_->reserve(shift_chunk * kv);
    auto* tmp = static_cast<unsigned char*>(workspace_->data());
    for (std::size_t off = 0; off < m.bytes; off += shift_chunk) {
      std::size_t const w = std::min(shift_chunk, m.bytes - off);
      device_status st = rt_.copy_2d(tmp, w, layer + region0 + m.src + off, head_stride, w, kv, stream);
      if (st.ok()) st = rt_.copy_2d(layer + region0 + m.dst + off, head_stride, tmp, w, w, kv, stream);
      if (!st.ok()) return st;
    }
    return {};
  }

 private:
  static constexpr std::size_t shift_chunk = std::size_t{4} << 20;  // bytes per kv_head moved per step

  Runtime rt_;
  std::unique_ptr<basic_cuda_workspace<Runtime>> workspace_;
};

}  // namespace detail

template <codec_choice Choice, class Runtime>
class cuda_cache_core;

namespace detail {
template <codec_choice Choice, class Runtime>
void cuda_attention_batch(std::span<cuda_cache_core<Choice, Runtime>* const> caches, int layer, float const* q,
                          int q_heads, float* out, attention_options const& opt, basic_cuda_workspace<Runtime>& ws,
                          typename Runtime::stream_type stream);
template <codec_choice Choice, class Runtime>
void cuda_attention_tokens(cuda_cache_core<Choice, Runtime>& c, int layer, float const* q, std::int64_t n_q,
                           int q_heads, float* out, attention_options const& opt, basic_cuda_workspace<Runtime>& ws,
                           typename Runtime::stream_type stream);
}  // namespace detail

/// The host logic of the CUDA cache over a runtime (see the file comment); QuantizedKVCache<Choice,
/// kvq::cuda> is this over the CUDA runtime.
template <codec_choice Choice, class Runtime>
class cuda_cache_core : public cache_codecs<Choice> {
  using core_type = cache_core<Choice, detail::cuda_device<Runtime>>;

 public:
  using stream_type = typename Runtime::stream_type;
  static constexpr int key_id = detail::kernel_codec<typename core_type::key_codec>::value;
  static constexpr int value_id = detail::kernel_codec<typename core_type::value_codec>::value;

  /// Run-time options of a CUDA cache (the CPU cache's, without the allocator hook).
  struct options {
    int residual = 128;                    ///< KIVI residual length R (a multiple of G; 0 allowed); ignored otherwise
    typename core_type::key_params key{};  ///< run-time parameters of the key codec (e.g. fp8 scale)
    typename core_type::value_params value{};  ///< run-time parameters of the value codec
    int threads = 128;                         ///< threads per block of the attention kernel (a multiple of 32, <= 256)
    std::int64_t split_tokens = 0;             ///< > 0: tokens per split of the attention (else planned per call)
  };

  /// Allocates a zero-filled cache of `shape`. Raises invalid_argument_error on a bad shape or
  /// option (the CPU cache's checks, plus capacity < 2^31 tokens and a head_dim whose attention
  /// fits the shared memory of a block), device_error when an allocation fails.
  cuda_cache_core(cache_shape const& shape, options const& opt, Runtime rt)
      : opt_(checked(shape, opt, rt)),
        core_(shape, opt.residual, opt.key, opt.value, detail::cuda_device<Runtime>(std::move(rt))) {}

  cuda_cache_core(cuda_cache_core const&) = delete;
  cuda_cache_core& operator=(cuda_cache_core const&) = delete;

  /// The cache's shape.
  auto shape() const noexcept -> cache_shape const& { return core_.shape(); }
  /// The cache's options.
  auto get_options() const noexcept -> options const& { return opt_; }
  /// Tokens currently held by `layer` (as of the calls made so far; the device may still be busy).
  auto size(int layer) const -> std::int64_t { return core_.size(layer); }
  /// Memory use: the CPU cache's accounting (same layout; the attention scratch is not counted).
  auto memory() const noexcept -> memory_report { return core_.memory(); }
  /// False once a CUDA call failed: every later call then raises device_error.
  auto usable() const noexcept -> bool { return core_.usable(); }
  /// The runtime.
  auto runtime() const noexcept -> Runtime const& { return core_.device().runtime(); }

  /// Device pointer to `layer`'s allocation (the CPU cache's layer layout, see cache.hpp).
  auto layer_data(int layer) const -> std::byte const* {
    return reinterpret_cast<std::byte const*>(core_.layer(layer));
  }
  /// Bytes of one layer's allocation.
  auto layer_bytes() const noexcept -> std::size_t { return core_.layer_bytes(); }

  /// Non-owning view of the key storage of (layer, head); the pointers are device pointers.
  auto key_storage(int layer, int head) const -> storage_view { return core_.key_storage(layer, head); }
  /// Non-owning view of the value storage of (layer, head); the pointers are device pointers.
  auto value_storage(int layer, int head) const -> storage_view { return core_.value_storage(layer, head); }

  /// Appends `keys` and `values` (same token count; device pointers, f32/f16/bf16) to `layer`,
  /// on `stream`; returns without waiting.
  template <element T>
  void append(int layer, kv_tensor<T> const& keys, kv_tensor<T> const& values, stream_type stream) {
    core_.check_append(layer, detail::describe(keys), detail::describe(values));
    int const type = detail::kernel_elem<T>();
    core_.append_checked(layer, keys.tokens, keys.data,
                         detail::kernel_source(type, keys.token_stride, keys.head_stride), values.data,
                         detail::kernel_source(type, values.token_stride, values.head_stride), stream);
  }

  /// Decodes keys [first, first + count) of (layer, head) into device memory `out`, rows
  /// `out_stride` elements apart (0: head_dim), on `stream`; returns without waiting.
  template <element T>
  void read_keys(int layer, int head, std::int64_t first, std::int64_t count, T* out, std::int64_t out_stride,
                 stream_type stream) {
    read_impl(true, layer, head, first, count, out, out_stride, stream);
  }
  /// Decodes values [first, first + count) of (layer, head) into device memory (see read_keys).
  template <element T>
  void read_values(int layer, int head, std::int64_t first, std::int64_t count, T* out, std::int64_t out_stride,
                   stream_type stream) {
    read_impl(false, layer, head, first, count, out, out_stride, stream);
  }

  /// Keeps the first n tokens of every layer (speculative-decoding rollback); layers holding n or
  /// fewer tokens are unchanged. Cutting into a quantized KIVI key tile decodes its kept tokens
  /// back into the f16 residual on `stream` (lossy, as on the CPU).
  void truncate(std::int64_t n, stream_type stream) { core_.truncate(n, stream); }

  /// Drops the oldest n tokens of every layer (sliding window) on `stream`. Raises index_error when
  /// a non-empty layer holds fewer than n tokens, unsupported_error for KIVI keys when n is not a
  /// multiple of G. The bytes move through the workspace (which may grow, see basic_cuda_workspace).
  void shift_left(std::int64_t n, stream_type stream) { core_.shift_left(n, stream); }

  /// Empties every layer.
  void reset() noexcept { core_.reset(); }

  /// Decode attention of the query q (q_heads, head_dim; device f32) over every token of `layer`
  /// into out (q_heads, head_dim; device f32), on `stream`; returns without waiting. Same options
  /// and NaN/Inf rules as kvq::decode_attention. Uses the cache's own workspace.
  void attention(int layer, float const* q, int q_heads, float* out, attention_options const& opt, stream_type stream) {
    cuda_cache_core* self = this;
    detail::cuda_attention_batch<Choice, Runtime>(std::span<cuda_cache_core* const>(&self, 1), layer, q, q_heads, out,
                                                  opt, core_.device().workspace(), stream);
  }

  /// Attention of n_q query tokens (q and out (n_q, q_heads, head_dim), opt.mask_data on the
  /// device, opt.sinks on the host) over `layer`, on `stream`; returns without waiting. Options,
  /// masks, errors and results (to fp32 rounding) as the CPU kvq::attention. Uses the cache's own
  /// workspace.
  void attention(int layer, float const* q, std::int64_t n_q, int q_heads, float* out, attention_options const& opt,
                 stream_type stream) {
    detail::cuda_attention_tokens<Choice, Runtime>(*this, layer, q, n_q, q_heads, out, opt, core_.device().workspace(),
                                                   stream);
  }

  /// Waits for `stream` and reports any failure of the work queued so far as device_error; a
  /// failure marks the cache unusable.
  void synchronize(stream_type stream) {
    core_.check_usable();
    core_.succeed(core_.device().runtime().synchronize(stream));
  }

  /// Raises device_error if the cache is unusable (a CUDA call failed earlier).
  void check_usable() const { core_.check_usable(); }

  /// Centered keys (`centered<C>`): copies the key means μ of `layer` (kv_heads × head_dim f32, the
  /// CPU cache's key_mean of each head in turn) to host memory `out`, once the device's work is
  /// done; zeros while the layer is empty. Raises index_error, device_error.
  void read_key_means(int layer, float* out) requires core_type::device_means { core_.read_key_means(layer, out); }

  /// The cache core (state, sides, layers) that the batched attention reads.
  auto core() noexcept -> core_type& { return core_; }
  auto core() const noexcept -> core_type const& { return core_; }

 private:
  static auto checked(cache_shape const& s, options const& o, Runtime const& rt) -> options const& {
    detail::check_cache_options<typename core_type::key_codec, typename core_type::value_codec>(
        s, o.residual, o.key, o.value, detail::cuda_device<Runtime>::max_capacity, "CUDA cache");
    check_launch(s.head_dim, s.kv_heads, o, rt, "CUDA cache");
    return o;
  }

 public:
  /// Raises invalid_argument_error naming `who` unless the launch settings of `o` are valid (threads
  /// a multiple of 32 in [32, 256], split_tokens >= 0) and the attention of `head_dim` fits the
  /// shared memory of a block of `rt`.
  static void check_launch(int head_dim, int kv_heads, options const& o, Runtime const& rt, char const* who) {
    using detail::check;
    check<invalid_argument_error>(o.threads >= 32 && o.threads <= 256 && o.threads % 32 == 0, [&] {
      return std::string(who) + ": threads = " + std::to_string(o.threads) + " must be a multiple of 32 in [32, 256]";
    });
    check<invalid_argument_error>(o.split_tokens >= 0, [&] {
      return std::string(who) + ": split_tokens = " + std::to_string(o.split_tokens) + " is negative";
    });
    detail::attention_plan probe;
    check<invalid_argument_error>(
        detail::plan_attention(head_dim, kv_heads, kv_heads, 1, 0, true, attention_device(rt, o), probe), [&] {
          return std::string(who) + ": head_dim = " + std::to_string(head_dim) + " needs more shared memory than the " +
                 std::to_string(rt.smem_per_block()) + " bytes of a block";
        });
  }

  /// The attention launch settings of a runtime and options: tiles of 32 tokens, about 8 blocks
  /// per SM (a full wave at 128 threads: registers and shared memory allow 8).
  static auto attention_device(Runtime const& rt, options const& o) -> detail::attention_device {
    detail::attention_device d;
    d.smem_limit = rt.smem_per_block();
    d.threads = o.threads;
    d.max_tile = 32;
    d.target_blocks = 8 * static_cast<std::int64_t>(std::max(rt.sm_count(), 1));
    d.split_tokens = o.split_tokens;
    return d;
  }

 private:
  template <element T>
  void read_impl(bool keys, int layer, int head, std::int64_t first, std::int64_t count, T* out,
                 std::int64_t out_stride, stream_type stream) {
    char const* what = keys ? "read_keys" : "read_values";
    core_.check_read(what, layer, head, first, count);
    std::int64_t const stride = detail::check_read_output(what, shape().head_dim, count, out, out_stride);
    core_.read_checked(keys, layer, head, first, count, static_cast<void*>(out), detail::kernel_elem<T>(), stride,
                       stream);
  }

  options opt_;
  core_type core_;
};

namespace detail {

/// Bytes of `n` bytes rounded up to the 256-byte alignment of the workspace's parts.
inline auto workspace_align(std::size_t n) -> std::size_t { return (n + 255) / 256 * 256; }

/// Copies the sinks (q_heads floats of host memory; none when null) to `dst` of the device on
/// `stream`; returns the device pointer, or null without sinks.
template <class Runtime, class Core>
auto upload_sinks(Runtime const& rt, Core& core, float const* sinks, int q_heads, void* dst,
                  typename Runtime::stream_type stream) -> float const* {
  if (sinks == nullptr) return nullptr;
  core.succeed(rt.upload(dst, sinks, static_cast<std::size_t>(q_heads) * sizeof(float), stream));
  return static_cast<float const*>(dst);
}

/// What the launches of one attention call share: the cache's kv heads and head_dim, the query
/// heads, the workspace of the partial states and the sinks (q_heads floats on the device, or null).
struct cuda_attention_call {
  int kv_heads = 0;
  int head_dim = 0;
  int q_heads = 0;
  float* scratch = nullptr;
  float const* sinks = nullptr;
};

/// Launches the partial attention of `batch` sequences (the grid's z) of `rows` (query token, query
/// head) rows each, as `plan` says, with b's partial states pointed into call.scratch, then the
/// combine into `out`; zeros the batch * rows output rows instead when `plan` attends nothing.
template <int KC, int VC, class Runtime, class Core>
void cuda_attend_rows(Runtime const& rt, Core& core, cuda_attention_call const& call, kvq_attention_args const& a,
                      attention_plan const& plan, kvq_cuda::attention_batch& b, std::size_t rows, std::size_t batch,
                      float* out, typename Runtime::stream_type stream) {
  std::size_t const d = static_cast<std::size_t>(call.head_dim);
  if (plan.splits == 0) {
    core.succeed(rt.zero(out, batch * rows * d * sizeof(float), stream));
    return;
  }
  std::size_t const parts = batch * static_cast<std::size_t>(plan.splits) * rows;
  b.part_out = call.scratch;
  b.part_max = call.scratch + parts * d;
  b.part_sum = b.part_max + parts;
  kvq_combine_args cb{};
  cb.q_heads = static_cast<std::int32_t>(rows);
  cb.head_dim = call.head_dim;
  cb.splits = plan.splits;
  cb.batch = static_cast<std::int32_t>(batch);
  cb.sinks = call.sinks != nullptr ? call.q_heads : 0;
  core.succeed(rt.template attention<KC, VC>(a, b, static_cast<unsigned>(plan.splits),
                                             static_cast<unsigned>(call.kv_heads * plan.chunks),
                                             static_cast<unsigned>(batch), plan.threads, plan.smem_bytes, stream));
  core.succeed(rt.combine(cb, b.part_out, b.part_max, b.part_sum, call.sinks, out,
                          static_cast<long long>(batch * rows * d), stream));
}

/// Decode attention of `caches` (same shape and options) over `layer`, one query token each:
/// q and out (caches.size(), q_heads, head_dim) f32 on the device. Checks everything first (no
/// cache changes either way), then launches the attention and combine kernels once per 64
/// sequences.
template <codec_choice Choice, class Runtime>
void cuda_attention_batch(std::span<cuda_cache_core<Choice, Runtime>* const> caches, int layer, float const* q,
                          int q_heads, float* out, attention_options const& opt, basic_cuda_workspace<Runtime>& ws,
                          typename Runtime::stream_type stream) {
  using cache = cuda_cache_core<Choice, Runtime>;
  check<shape_error>(!caches.empty(), "attention: no cache");
  for (cache const* c : caches) check<invalid_argument_error>(c != nullptr, "attention: a cache is null");
  cache& c0 = *caches[0];
  for (cache const* c : caches) c->check_usable();
  cache_shape const& shape = c0.shape();
  for (cache const* c : caches) {
    check<shape_error>(c->shape() == shape && c->get_options().residual == c0.get_options().residual &&
                           c->get_options().key == c0.get_options().key &&
                           c->get_options().value == c0.get_options().value,
                       "attention: the caches of a batch must have the same shape and options");
    c->size(layer);
  }
  int const d = shape.head_dim;
  check<shape_error>(q_heads > 0 && q_heads % shape.kv_heads == 0, [&] {
    return "attention: " + std::to_string(q_heads) + " query heads is not a positive multiple of " +
           std::to_string(shape.kv_heads) + " kv heads";
  });
  check<shape_error>(q != nullptr && out != nullptr, "attention: the query or the output is null");
  check_attention_options(opt);
  check_sinks(opt.sinks, q_heads);
  float const scale = opt.scale > 0.0f ? opt.scale : 1.0f / std::sqrt(static_cast<float>(d));
  std::int64_t span = 0;
  for (cache const* c : caches) {
    std::int64_t const len = c->size(layer);
    std::int64_t const begin = opt.window > 0 ? std::max<std::int64_t>(0, len - opt.window) : 0;
    span = std::max(span, len - begin);
  }
  std::size_t const batch = caches.size();
  int const launch_batch = static_cast<int>(std::min<std::size_t>(batch, kvq_cuda::max_batch));
  attention_plan plan;
  check<invalid_argument_error>(
      plan_attention(d, shape.kv_heads, q_heads, launch_batch, span, opt.query == query_precision::q8_0,
                     cache::attention_device(c0.runtime(), c0.get_options()), plan),
      [&] { return "attention: the shared memory of a block is too small for head_dim " + std::to_string(d); });
  auto& core0 = c0.core();
  std::size_t const qd = static_cast<std::size_t>(q_heads) * static_cast<std::size_t>(d);
  if (plan.splits == 0) {  // nothing attended: zeros
    core0.succeed(c0.runtime().zero(out, batch * qd * sizeof(float), stream));
    return;
  }
  std::size_t const scratch_bytes = workspace_align(plan.scratch_floats * sizeof(float));
  ws.reserve(scratch_bytes + static_cast<std::size_t>(q_heads) * sizeof(float));
  auto* scratch = static_cast<float*>(ws.data());
  float const* sinks = upload_sinks(c0.runtime(), core0, opt.sinks, q_heads,
                                    static_cast<unsigned char*>(ws.data()) + scratch_bytes, stream);
  std::size_t const per_launch = static_cast<std::size_t>(launch_batch) * static_cast<std::size_t>(plan.splits);

  kvq_attention_args const a =
      attention_arguments(core0.key_side(), core0.value_side(), d, shape.kv_heads, q_heads, plan, scale, opt.softcap,
                          opt.query == query_precision::q8_0, detail::device_probabilities_f16(opt));
  kvq_cuda::attention_batch b{};
  b.part_out = scratch;
  b.part_max = scratch + per_launch * qd;
  b.part_sum = b.part_max + per_launch * static_cast<std::size_t>(q_heads);
  kvq_combine_args cb{};
  cb.q_heads = q_heads;
  cb.head_dim = d;
  cb.splits = plan.splits;
  cb.sinks = sinks != nullptr ? q_heads : 0;
  for (std::size_t b0 = 0; b0 < batch; b0 += kvq_cuda::max_batch) {
    int const nb = static_cast<int>(std::min<std::size_t>(batch - b0, kvq_cuda::max_batch));
    b.q = q + b0 * qd;
    for (int i = 0; i < nb; ++i) {
      auto const& core = caches[b0 + static_cast<std::size_t>(i)]->core();
      layer_state const& st = core.state(layer);
      std::int64_t const begin = opt.window > 0 ? std::max<std::int64_t>(0, st.length - opt.window) : 0;
      b.seq[i] = attention_sequence(core.key_side(), core.value_side(), st, begin, st.length);
      b.layer[i] = core.layer(layer);
    }
    cb.batch = nb;
    core0.succeed(c0.runtime().template attention<cache::key_id, cache::value_id>(
        a, b, static_cast<unsigned>(plan.splits), static_cast<unsigned>(shape.kv_heads * plan.chunks),
        static_cast<unsigned>(nb), plan.threads, plan.smem_bytes, stream));
    core0.succeed(c0.runtime().combine(cb, b.part_out, b.part_max, b.part_sum, sinks, out + b0 * qd,
                                       static_cast<long long>(nb) * static_cast<long long>(qd), stream));
  }
}

/// Attention of n_q query tokens of `c` over `layer` (see cuda_cache_core::attention): checks
/// everything first, then one partial-attention launch and its combine per launch of
/// plan_query_launches.
template <codec_choice Choice, class Runtime>
void cuda_attention_tokens(cuda_cache_core<Choice, Runtime>& c, int layer, float const* q, std::int64_t n_q,
                           int q_heads, float* out, attention_options const& opt, basic_cuda_workspace<Runtime>& ws,
                           typename Runtime::stream_type stream) {
  using cache = cuda_cache_core<Choice, Runtime>;
  c.check_usable();
  std::int64_t const len = c.size(layer);
  cache_shape const& shape = c.shape();
  int const d = shape.head_dim;
  attention_options kopt;
  std::int64_t const first = check_query_tokens(opt, n_q, q_heads, shape.kv_heads, len, q, out, kopt);
  if (n_q == 0) return;
  bool const q8 = opt.query == query_precision::q8_0;
  auto const dev = cache::attention_device(c.runtime(), c.get_options());
  auto const launches = plan_query_launches(
      kopt, n_q, first, len, shape.kv_heads, d, [&](int tokens, std::int64_t span, attention_plan& p) {
        return plan_attention(d, shape.kv_heads, q_heads, 1, span, q8, dev, p, tokens);
      });
  std::size_t scratch_floats = 0;
  for (auto const& l : launches) scratch_floats = std::max(scratch_floats, l.plan.scratch_floats);
  std::size_t const scratch_bytes = workspace_align(scratch_floats * sizeof(float));
  auto& core = c.core();
  ws.reserve(scratch_bytes + static_cast<std::size_t>(q_heads) * sizeof(float));
  auto* scratch = static_cast<float*>(ws.data());
  float const* sinks = upload_sinks(c.runtime(), core, opt.sinks, q_heads,
                                    static_cast<unsigned char*>(ws.data()) + scratch_bytes, stream);
  float const scale = opt.scale > 0.0f ? opt.scale : 1.0f / std::sqrt(static_cast<float>(d));
  std::size_t const qd = static_cast<std::size_t>(q_heads) * static_cast<std::size_t>(d);
  std::size_t const mask_row =
      static_cast<std::size_t>(kopt.mask_stride) * (opt.mask == mask_kind::additive ? sizeof(float) : 1);
  cuda_attention_call const call{shape.kv_heads, d, q_heads, scratch, sinks};
  for (auto const& l : launches) {
    std::size_t const i0 = static_cast<std::size_t>(l.first);
    std::size_t const rows = static_cast<std::size_t>(l.tokens) * static_cast<std::size_t>(q_heads);
    kvq_attention_args a{};
    kvq_cuda::attention_batch b{};
    if (l.plan.splits > 0) {  // else no query of the launch attends anything: zeros
      a = attention_arguments(core.key_side(), core.value_side(), d, shape.kv_heads, q_heads, l.plan, scale,
                              opt.softcap, q8, detail::device_probabilities_f16(opt));
      set_query_tokens(a, static_cast<int>(l.tokens), kopt, kopt.mask_stride);
      b.seq[0] = attention_sequence(core.key_side(), core.value_side(), core.state(layer), l.begin, l.end);
      b.seq[0].first_pos = static_cast<std::int32_t>(first + l.first);
      b.layer[0] = core.layer(layer);
      b.q = q + i0 * qd;
      bool const custom = opt.mask == mask_kind::additive || opt.mask == mask_kind::boolean;
      b.mask = custom ? static_cast<unsigned char const*>(opt.mask_data) + i0 * mask_row : nullptr;
    }
    cuda_attend_rows<cache::key_id, cache::value_id>(c.runtime(), core, call, a, l.plan, b, rows, 1, out + i0 * qd,
                                                     stream);
  }
}

}  // namespace detail
KVQ_NAMESPACE_END
