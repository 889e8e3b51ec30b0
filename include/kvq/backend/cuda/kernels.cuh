// kvq: the CUDA kernels of the quantized KV cache, templated on the codec, and their launchers.
//
// Each kernel is a thin wrapper: it computes its thread's index and calls the kernel body in
// cuda_device.h (shared with the host test that runs the bodies on the CPU). Kernels and launchers
// live in namespace kvq_cuda, outside kvq's per-ISA inline namespace, and take only kvq_cuda
// argument structs and integer codec ids, so their signatures are the same in nvcc's host and
// device passes. Include from .cu files only (nvcc).
//
//   encode_rows<C>          (kv_heads, tokens, blocks)       encode rows of a row codec
//   encode_key_tiles<C>     (kv_heads, tiles, head_dim)      encode KIVI key tiles per channel
//   store_f16_rows          (kv_heads, tokens, head_dim)     write the KIVI residual / window
//   decode<C>               (tokens, head_dim)               decode a token range to f32/f16/bf16
//   attention<KC, VC>       blocks (splits, kv_heads * chunks, batch), `threads` threads and
//                           dynamic shared memory: flash-decoding partial states
//   combine                 (batch, q_heads, head_dim)       merge the splits and normalise
#pragma once

#if !defined(__CUDACC__)
#  error "kvq/backend/cuda/kernels.cuh is CUDA code: include it from .cu files compiled by nvcc"
#endif

#include <cuda_runtime.h>

#include "cuda_device.h"

namespace kvq_cuda {

/// Threads per block of the element-wise kernels.
constexpr int elementwise_threads = 256;

/// The threads of one block as the attention body sees them: run(f) runs f(threadIdx.x) and then
/// synchronises the block.
struct block_threads {
  KVQ_HOST_DEVICE int count() const {
#if defined(__CUDA_ARCH__)
    return (int)blockDim.x;
#else
    return 1;
#endif
  }
  template <class F>
  KVQ_HOST_DEVICE void run(F&& f) {
#if defined(__CUDA_ARCH__)
    f((int)threadIdx.x);
    __syncthreads();
#else
    (void)f;
#endif
  }
};

/// Index of the calling thread in a one-dimensional grid.
__device__ __forceinline__ long long global_thread() {
  return (long long)blockIdx.x * (long long)blockDim.x + (long long)threadIdx.x;
}

template <int C>
__global__ void encode_rows(const __grid_constant__ write_args a, long long n) {
  const long long i = global_thread();
  if (i < n) ::kvq::cuda_detail::encode_rows_thread<C>(a, i);
}

template <int C>
__global__ void encode_key_tiles(const __grid_constant__ write_args a, long long n) {
  const long long i = global_thread();
  if (i < n) ::kvq::cuda_detail::encode_key_tile_thread<C>(a, i);
}

template <int Unused = 0>
__global__ void store_f16_rows(const __grid_constant__ write_args a, long long n) {
  const long long i = global_thread();
  if (i < n) ::kvq::cuda_detail::store_f16_thread(a, i);
}

template <int C>
__global__ void decode(const __grid_constant__ decode_args a, long long n) {
  const long long i = global_thread();
  if (i < n) ::kvq::cuda_detail::decode_thread<C>(a, i);
}

template <int KC, int VC>
__global__ void __launch_bounds__(256) attention(const __grid_constant__ attention_args a) {
  extern __shared__ float kvq_attention_smem[];
  block_threads threads;
  ::kvq::cuda_detail::attention_block<KC, VC>(a, (int)blockIdx.x, (int)blockIdx.y, (int)blockIdx.z, kvq_attention_smem,
                                              threads);
}

template <int Unused = 0>
__global__ void combine(const __grid_constant__ combine_args a, long long n) {
  const long long i = global_thread();
  if (i < n) ::kvq::cuda_detail::combine_thread(a, i);
}

/// Blocks of `elementwise_threads` covering n threads.
inline unsigned elementwise_blocks(long long n) {
  return (unsigned)((n + elementwise_threads - 1) / elementwise_threads);
}

}  // namespace kvq_cuda
