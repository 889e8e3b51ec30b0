// kvq: the CUDA kernels of the quantized KV cache: entry points over the shared kernel bodies.
//
// Each kernel computes its thread's index and calls one function of core/kernel_bodies.h (the
// bodies every backend runs, and the host test runs on the CPU), with the codec as a template
// argument so its switches fold away. Kernels live in namespace kvq_cuda, outside kvq's per-ISA
// inline namespace, and take only the argument structs of core/kernel_args.h, pointers and
// integer codec ids, so their signatures are the same in nvcc's host and device passes. Include
// from .cu files only (nvcc).
//
//   encode_rows<C>          (kv_heads, tokens, blocks)       encode rows of a row codec
//   encode_key_tiles<C>     (kv_heads, tiles, head_dim)      encode KIVI key tiles per channel
//   store_f16_rows          (kv_heads, tokens, head_dim)     write the KIVI residual / window
//   decode<C>               (tokens, head_dim)               decode a token range to f32/f16/bf16
//   attention<KC, VC>       blocks (splits, kv_heads * chunks, batch), `threads` threads and
//                           dynamic shared memory: flash-decoding partial states of n_q tokens
//   combine                 (batch, rows, head_dim)          merge the splits, sinks, normalise
#pragma once

#if !defined(__CUDACC__)
#  error "kvq/backend/cuda/kernels.cuh is CUDA code: include it from .cu files compiled by nvcc"
#endif

#include <cuda_runtime.h>

#include "cuda_cache_core.hpp"

namespace kvq_cuda {

/// Threads per block of the element-wise kernels.
constexpr int elementwise_threads = 256;

/// The threads of a block as the attention body sees them: each GPU thread runs its own work
/// (one lane) and the barrier is __syncthreads.
struct block_threads {
  __device__ int count() const { return (int)blockDim.x; }
  __device__ int lanes() const { return 1; }
  __device__ int tid(int) const { return (int)threadIdx.x; }
  __device__ void barrier() const { __syncthreads(); }
};

/// Index of the calling thread in a one-dimensional grid.
__device__ __forceinline__ long long global_thread() {
  return (long long)blockIdx.x * (long long)blockDim.x + (long long)threadIdx.x;
}

template <int C>
__global__ void encode_rows(const __grid_constant__ kvq_write_args a, unsigned char* layer, void const* input) {
  ::kvq::kernels::encode_rows_thread(C, a, layer, static_cast<unsigned char const*>(input), global_thread());
}

template <int C>
__global__ void encode_key_tiles(const __grid_constant__ kvq_write_args a, unsigned char* layer, void const* input) {
  ::kvq::kernels::encode_key_tiles_thread(C, a, layer, static_cast<unsigned char const*>(input), global_thread());
}

template <int Unused = 0>
__global__ void store_f16_rows(const __grid_constant__ kvq_write_args a, unsigned char* layer, void const* input) {
  ::kvq::kernels::store_f16_rows_thread(a, layer, static_cast<unsigned char const*>(input), global_thread());
}

template <int C>
__global__ void decode(const __grid_constant__ kvq_decode_args a, unsigned char const* layer, void* out) {
  ::kvq::kernels::decode_thread(C, a, layer, static_cast<unsigned char*>(out), global_thread());
}

template <int KC, int VC>
__global__ void __launch_bounds__(256)
    attention(const __grid_constant__ kvq_attention_args a, const __grid_constant__ attention_batch batch) {
  extern __shared__ float kvq_attention_smem[];
  const int b = (int)blockIdx.z;
  const long long rows = (long long)a.n_q * a.q_heads;
  const long long q_per_seq = rows * a.head_dim;
  const long long part = (long long)b * a.splits;
  const kvq_attention_seq sq = batch.seqs != nullptr ? batch.seqs[b] : batch.seq[b];
  unsigned char const* layer = batch.seqs != nullptr ? batch.layer[0] : batch.layer[b];
  ::kvq::kernels::attention_block(KC, VC, a, sq, layer, layer, batch.pages, batch.q + b * q_per_seq,
                                  static_cast<unsigned char const*>(batch.mask), batch.part_out + part * q_per_seq,
                                  batch.part_max + part * rows, batch.part_sum + part * rows, kvq_attention_smem,
                                  (int)blockIdx.x, (int)blockIdx.y, block_threads{});
}

template <int Unused = 0>
__global__ void combine(const __grid_constant__ kvq_combine_args a, float const* part_out, float const* part_max,
                        float const* part_sum, float const* sinks, float* out) {
  ::kvq::kernels::combine_thread(a, part_out, part_max, part_sum, sinks, out, global_thread());
}

/// Blocks of `elementwise_threads` covering n threads.
inline unsigned elementwise_blocks(long long n) {
  return (unsigned)((n + elementwise_threads - 1) / elementwise_threads);
}

}  // namespace kvq_cuda
