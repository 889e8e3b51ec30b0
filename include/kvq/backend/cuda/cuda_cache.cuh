// kvq: QuantizedKVCache<Choice, kvq::cuda>, the quantized KV cache of one sequence in GPU memory.
//
// Include from .cu files compiled by nvcc with -std=c++20 (docs/cuda.md). Design:
//   * Storage: one cudaMalloc allocation per layer (never managed memory), zero-filled at
//     construction and laid out exactly as the CPU cache's layer (cache.hpp), so bytes, memory
//     accounting and `plan_memory` are the CPU cache's.
//   * Every operation takes the caller's stream and only enqueues work on it: appends from device
//     memory, reads into device memory, truncate, shift_left and attention return without waiting
//     (growing the attention scratch, and construction, do synchronise). Calls on one cache must be
//     ordered by the caller (one stream, or events between streams).
//   * Host-side bookkeeping and every argument check happen before anything is enqueued: a call
//     that raises a check leaves the cache unchanged. A failed CUDA call raises device_error naming
//     it and marks the cache unusable (every later call raises device_error); device faults of
//     queued work surface at `synchronize(stream)` (or any later CUDA call).
//   * Kernels: kernels.cuh over the shared kernel bodies (core/kernel_bodies.h); the host logic is
//     the cache core (core/cache_core.hpp) over the CUDA device of cuda_cache_core.hpp, tested on
//     the CPU by tests/test_cuda_host.cpp.
//   * Not thread-safe: use a cache from one host thread at a time.
#pragma once

#if !defined(__CUDACC__)
#  error "kvq/backend/cuda/cuda_cache.cuh is CUDA code: include it from .cu files compiled by nvcc"
#endif

#include <cuda_runtime.h>

#include <span>
#include <string>
#include <vector>

#include "cuda_cache_core.hpp"
#include "cuda_paged_cache.hpp"
#include "kernels.cuh"

KVQ_NAMESPACE_BEGIN
namespace detail {

/// `cuda_cache_core`'s runtime over the CUDA runtime API, for the device current at construction.
struct cuda_runtime {
  using stream_type = cudaStream_t;
  int device = 0;
  int sms = 1;
  std::size_t smem = 48 * 1024;

  /// The runtime of the current device; raises device_error when there is none.
  static auto current() -> cuda_runtime {
    cuda_runtime rt;
    cudaError_t e = cudaGetDevice(&rt.device);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&rt.sms, cudaDevAttrMultiProcessorCount, rt.device);
    int smem = 0;
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlock, rt.device);
    if (e != cudaSuccess)
      raise<device_error>(std::string("CUDA: querying the current device failed: ") + cudaGetErrorString(e));
    rt.smem = static_cast<std::size_t>(smem);
    return rt;
  }

  static auto status(cudaError_t e, char const* call) -> device_status {
    if (e == cudaSuccess) return {};
    return {call, cudaGetErrorString(e)};
  }
  /// The status of the last kernel launch (launch-configuration errors and earlier faults).
  static auto launched(char const* kernel) -> device_status { return status(cudaGetLastError(), kernel); }

  auto sm_count() const -> int { return sms; }
  auto smem_per_block() const -> std::size_t { return smem; }

  /// cudaMalloc + zero fill, waited for, so that work on any stream sees the zeros.
  auto allocate(void** p, std::size_t bytes) const -> device_status {
    *p = nullptr;
    cudaError_t e = cudaMalloc(p, bytes);
    if (e != cudaSuccess) return status(e, "cudaMalloc");
    e = cudaMemset(*p, 0, bytes);
    if (e == cudaSuccess) e = cudaStreamSynchronize(cudaStreamLegacy);
    if (e != cudaSuccess) {
      cudaFree(*p);
      *p = nullptr;
      return status(e, "cudaMemset");
    }
    return {};
  }
  void deallocate(void* p) const noexcept { cudaFree(p); }
  auto copy_2d(void* dst, std::size_t dpitch, void const* src, std::size_t spitch, std::size_t width,
               std::size_t height, stream_type s) const -> device_status {
    return status(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, cudaMemcpyDeviceToDevice, s),
                  "cudaMemcpy2DAsync");
  }
  auto upload(void* dst, void const* src, std::size_t bytes, stream_type s) const -> device_status {
    // From pageable memory: the call returns once the source has been staged, so it may go away.
    return status(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s), "cudaMemcpyAsync");
  }
  auto synchronize_device() const -> device_status {
    return status(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  auto download(void* dst, void const* src, std::size_t bytes, stream_type s) const -> device_status {
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s);
    if (e == cudaSuccess) e = cudaStreamSynchronize(s);
    return status(e, "cudaMemcpyAsync (device to host)");
  }
  auto zero(void* p, std::size_t bytes, stream_type s) const -> device_status {
    return status(cudaMemsetAsync(p, 0, bytes, s), "cudaMemsetAsync");
  }
  auto synchronize(stream_type s) const -> device_status {
    return status(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  }

  template <int C>
  auto encode_rows(kvq_write_args const& a, unsigned char* layer, void const* input, long long n, stream_type s) const
      -> device_status {
    if (n <= 0) return {};
    kvq_cuda::encode_rows<C><<<kvq_cuda::elementwise_blocks(n), kvq_cuda::elementwise_threads, 0, s>>>(a, layer, input);
    return launched("encode_rows kernel launch");
  }
  template <int C>
  auto encode_key_tiles(kvq_write_args const& a, unsigned char* layer, void const* input, long long n,
                        stream_type s) const -> device_status {
    if (n <= 0) return {};
    kvq_cuda::encode_key_tiles<C>
        <<<kvq_cuda::elementwise_blocks(n), kvq_cuda::elementwise_threads, 0, s>>>(a, layer, input);
    return launched("encode_key_tiles kernel launch");
  }
  auto store_f16_rows(kvq_write_args const& a, unsigned char* layer, void const* input, long long n,
                      stream_type s) const -> device_status {
    if (n <= 0) return {};
    kvq_cuda::store_f16_rows<>
        <<<kvq_cuda::elementwise_blocks(n), kvq_cuda::elementwise_threads, 0, s>>>(a, layer, input);
    return launched("store_f16_rows kernel launch");
  }
  template <int C>
  auto decode(kvq_decode_args const& a, unsigned char const* layer, void* out, long long n, stream_type s) const
      -> device_status {
    if (n <= 0) return {};
    kvq_cuda::decode<C><<<kvq_cuda::elementwise_blocks(n), kvq_cuda::elementwise_threads, 0, s>>>(a, layer, out);
    return launched("decode kernel launch");
  }
  template <int KC, int VC>
  auto attention(kvq_attention_args const& a, kvq_cuda::attention_batch const& b, unsigned gx, unsigned gy, unsigned gz,
                 int threads, std::size_t smem_bytes, stream_type s) const -> device_status {
    kvq_cuda::attention<KC, VC><<<dim3(gx, gy, gz), dim3(static_cast<unsigned>(threads)), smem_bytes, s>>>(a, b);
    return launched("attention kernel launch");
  }
  auto combine(kvq_combine_args const& a, float const* part_out, float const* part_max, float const* part_sum,
               float const* sinks, float* out, long long n, stream_type s) const -> device_status {
    if (n <= 0) return {};
    kvq_cuda::combine<><<<kvq_cuda::elementwise_blocks(n), kvq_cuda::elementwise_threads, 0, s>>>(
        a, part_out, part_max, part_sum, sinks, out);
    return launched("combine kernel launch");
  }
};

}  // namespace detail

/// Device scratch of the batched attention (see basic_cuda_workspace), on the current device.
class cuda_workspace : public basic_cuda_workspace<detail::cuda_runtime> {
 public:
  cuda_workspace() : basic_cuda_workspace<detail::cuda_runtime>(detail::cuda_runtime::current()) {}
};

/// The quantized KV cache of one sequence in GPU memory: the CPU cache's shape, options (less the
/// allocator hook, plus launch settings), semantics and storage layout, with device pointers and a
/// stream on every call. See the file comment and docs/cuda.md.
///
/// **Example**:
/// ```
/// kvq::QuantizedKVCache<kvq::q4_0, kvq::cuda> cache({32, 8, 128, 32768});
/// cache.append(layer, kvq::token_major(k_dev, n, 8, 128), kvq::token_major(v_dev, n, 8, 128), stream);
/// kvq::decode_attention(cache, layer, q_dev, 32, out_dev, {}, stream);
/// ```
template <codec_choice Choice>
class QuantizedKVCache<Choice, cuda> : public cuda_cache_core<Choice, detail::cuda_runtime> {
  using base = cuda_cache_core<Choice, detail::cuda_runtime>;

 public:
  using options = typename base::options;

  /// Allocates a zero-filled cache of `shape` on the current device (see cuda_cache_core).
  explicit QuantizedKVCache(cache_shape const& shape, options const& opt = options{})
      : base(shape, opt, detail::cuda_runtime::current()) {}
};

/// Decode attention of q (q_heads, head_dim; device f32) over every token of `layer` into out
/// (q_heads, head_dim; device f32), on `stream`, without waiting. Same options, results (to fp32
/// rounding) and NaN/Inf rules as the CPU kvq::decode_attention.
template <codec_choice Choice>
void decode_attention(QuantizedKVCache<Choice, cuda>& cache, int layer, float const* q, int q_heads, float* out,
                      attention_options const& opt, cudaStream_t stream) {
  cache.attention(layer, q, q_heads, out, opt, stream);
}

/// Attention of n_q query tokens over `layer` (chunked prefill, speculative verification), as the
/// CPU kvq::attention: q and out (n_q, q_heads, head_dim) f32 and opt.mask_data (additive: f32,
/// boolean: bytes; (n_q, mask_stride)) in device memory, opt.sinks (q_heads floats) in host
/// memory; on `stream`, without waiting. Same options, masks, errors and results (to fp32
/// rounding) as the CPU kvq::attention; n_q = 1 with the defaults is decode_attention exactly.
template <codec_choice Choice>
void attention(QuantizedKVCache<Choice, cuda>& cache, int layer, float const* q, std::int64_t n_q, int q_heads,
               float* out, attention_options const& opt, cudaStream_t stream) {
  cache.attention(layer, q, n_q, q_heads, out, opt, stream);
}

/// Decode attention of several sequences (caches of one shape and options) in one launch per 64
/// sequences: q and out are (caches.size(), q_heads, head_dim) f32 on the device; sequence i
/// attends to its own tokens of `layer`. Checks every cache first (none changes either way).
template <codec_choice Choice>
void decode_attention_batched(std::span<QuantizedKVCache<Choice, cuda>* const> caches, int layer, float const* q,
                              int q_heads, float* out, attention_options const& opt, cuda_workspace& workspace,
                              cudaStream_t stream) {
  using core = cuda_cache_core<Choice, detail::cuda_runtime>;
  std::vector<core*> cores(caches.begin(), caches.end());
  detail::cuda_attention_batch<Choice, detail::cuda_runtime>(std::span<core* const>(cores), layer, q, q_heads, out, opt,
                                                             workspace, stream);
}

/// The paged cache in GPU memory: many sequences in one pool of quantized pages, with the CPU
/// PagedKVCache's shape, semantics and pool layout, device pointers and a stream on every call
/// (see cuda_paged_cache_core and docs/paged.md).
///
/// **Example**:
/// ```
/// kvq::PagedKVCache<kvq::q4_0, kvq::cuda> cache({32, 8, 128, 64, 8192});
/// auto s = cache.add_sequence();
/// cache.append(s, layer, kvq::token_major(k_dev, n, 8, 128), kvq::token_major(v_dev, n, 8, 128), stream);
/// kvq::paged_decode_attention(cache, layer, seqs, q_dev, 32, out_dev, {}, stream);
/// ```
template <codec_choice Choice>
class PagedKVCache<Choice, cuda> : public cuda_paged_cache_core<Choice, detail::cuda_runtime> {
  using base = cuda_paged_cache_core<Choice, detail::cuda_runtime>;

 public:
  using options = typename base::options;
  /// Allocates a zero-filled pool of `shape` on the current device (see cuda_paged_cache_core).
  explicit PagedKVCache(paged_shape const& shape, options const& opt = options{})
      : base(shape, opt, detail::cuda_runtime::current()) {}
};

/// Batched decode attention of one query token per sequence of `seqs` over `layer` of a CUDA
/// paged cache: q and out (seqs.size(), q_heads, head_dim) f32 on the device, on `stream`, without
/// waiting; results (to fp32 rounding) as the CPU kvq::paged_decode_attention.
template <codec_choice Choice>
void paged_decode_attention(PagedKVCache<Choice, cuda>& cache, int layer, std::span<sequence_id const> seqs,
                            float const* q, int q_heads, float* out, attention_options const& opt,
                            cudaStream_t stream) {
  cache.attention(layer, seqs, q, q_heads, out, opt, stream);
}

/// Multi-token attention of a batch of query chunks (chunked prefill, speculative verification and
/// decode of many sequences in one call) over `layer` of a CUDA paged cache, as the CPU
/// kvq::paged_attention: q and out (Σ n_q, q_heads, head_dim) f32 and each chunk's mask_data in
/// device memory, opt.sinks (q_heads floats) in host memory; on `stream`, without waiting. Same
/// options, masks, errors and results (to fp32 rounding) as the CPU kvq::paged_attention.
template <codec_choice Choice>
void paged_attention(PagedKVCache<Choice, cuda>& cache, int layer, std::span<query_chunk const> chunks, float const* q,
                     int q_heads, float* out, attention_options const& opt, cudaStream_t stream) {
  cache.attention(layer, chunks, q, q_heads, out, opt, stream);
}

KVQ_NAMESPACE_END
