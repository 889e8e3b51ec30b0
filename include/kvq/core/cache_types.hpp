// kvq: the public types of every cache: shape, input tensors, memory and storage reports.
//
// Shared by the CPU, CUDA and Metal caches (and by the cache core that implements them once).
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>

#include "../detail/numeric.h"

KVQ_NAMESPACE_BEGIN

/// Alignment in bytes of every array of the cache's storage.
inline constexpr std::size_t storage_alignment = 64;

/// Shape of a cache for one sequence.
struct cache_shape {
  int layers = 0;
  int kv_heads = 0;
  int head_dim = 0;
  std::int64_t capacity = 0;  ///< tokens per layer
  friend constexpr bool operator==(cache_shape const&, cache_shape const&) = default;
};

/// Element types accepted for input and output: float, f16 and bf16.
template <class T>
concept element = std::same_as<T, float> || std::same_as<T, f16> || std::same_as<T, bf16>;

/// A read-only view of (tokens, kv_heads, head_dim) elements; head_dim is contiguous and the
/// strides, in elements, place token t, head h at `data + t * token_stride + h * head_stride`.
template <element T>
struct kv_tensor {
  T const* data = nullptr;
  std::int64_t tokens = 0;
  int kv_heads = 0;
  int head_dim = 0;
  std::int64_t token_stride = 0;
  std::int64_t head_stride = 0;
};

/// A dense token-major view [tokens][kv_heads][head_dim].
template <element T>
constexpr auto token_major(T const* data, std::int64_t tokens, int kv_heads, int head_dim) -> kv_tensor<T> {
  return {data, tokens, kv_heads, head_dim, static_cast<std::int64_t>(kv_heads) * head_dim, head_dim};
}

/// Memory use of a cache, every byte accounted for.
struct memory_report {
  std::size_t total_bytes = 0;      ///< bytes allocated
  std::size_t key_bytes = 0;        ///< quantized key storage (scales and padding included)
  std::size_t value_bytes = 0;      ///< quantized value storage (scales and padding included)
  std::size_t residual_bytes = 0;   ///< KIVI f16 residual / window buffers
  std::size_t alignment_bytes = 0;  ///< bytes lost to 64-byte alignment
  double bytes_per_token = 0;       ///< total_bytes / capacity (all layers, K and V)
  double bits_per_element = 0;      ///< total_bytes * 8 / (capacity * layers * kv_heads * head_dim * 2)
};

/// Stored blocks whose scale is NaN or ±Inf, so that they decode to NaN or ±Inf (see
/// `QuantizedKVCache::nonfinite_blocks`): a block is a q8_0 / q4_0 / mxfp4 block of 32 channels,
/// an nvfp4 sub-block of 16, an int8 row, a KIVI value group, a KIVI key channel of one tile
/// (G tokens), or a tq rotation block.
struct nonfinite_report {
  std::int64_t key_blocks = 0;    ///< poisoned key blocks
  std::int64_t value_blocks = 0;  ///< poisoned value blocks
  /// key_blocks + value_blocks.
  constexpr auto total() const noexcept -> std::int64_t { return key_blocks + value_blocks; }
  friend constexpr bool operator==(nonfinite_report const&, nonfinite_report const&) = default;
};

/// A non-owning view of one (layer, kv_head)'s key or value storage.
struct storage_view {
  std::byte const* units = nullptr;    ///< encoded rows or tiles, 64-byte aligned
  std::size_t unit_bytes = 0;          ///< bytes per row (row codecs) or per tile (KIVI keys)
  int tokens_per_unit = 1;             ///< 1 for rows, G for tiles
  std::int64_t quantized_tokens = 0;   ///< tokens [0, quantized_tokens) live in `units`
  f16 const* residual = nullptr;       ///< f16 rows of the residual (KIVI), else nullptr
  std::int64_t residual_tokens = 0;    ///< tokens [quantized_tokens, length) live in `residual`
  std::int64_t residual_capacity = 0;  ///< rows of the residual buffer
  std::int64_t residual_first = 0;     ///< ring index of token `quantized_tokens` (values window)
};

KVQ_NAMESPACE_END
