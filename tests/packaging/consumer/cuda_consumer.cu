// A CUDA source of a consumer that links kvq::kvq and nothing else: the C++20 that kvq needs must
// reach nvcc through the target (compiled only; no GPU is needed to build it).
#include <kvq/backend/cuda/cuda_cache.cuh>
#include <kvq/kvq.hpp>

// One instantiation per kind of codec: the host cache, the GPU cache and its attention.
void kvq_cuda_consumer(float const* k, float const* v, float const* q, float* out, cudaStream_t stream) {
  kvq::QuantizedKVCache<kvq::kv_codecs<kvq::q8_0, kvq::q4_0>, kvq::cuda> cache({1, 2, 64, 128});
  cache.append(0, kvq::token_major(k, 4, 2, 64), kvq::token_major(v, 4, 2, 64), stream);
  kvq::decode_attention(cache, 0, q, 4, out, {}, stream);
  kvq::QuantizedKVCache<kvq::kivi<4>, kvq::cuda> kivi({1, 2, 64, 128});
  kivi.append(0, kvq::token_major(k, 4, 2, 64), kvq::token_major(v, 4, 2, 64), stream);
  kvq::QuantizedKVCache<kvq::q8_0> host({1, 2, 64, 128});
  host.append(0, kvq::token_major(k, 4, 2, 64), kvq::token_major(v, 4, 2, 64));
}
