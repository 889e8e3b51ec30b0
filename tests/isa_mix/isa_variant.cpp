// One translation unit of the mixed-flags test, compiled once per instruction-set flag set with
// KVQ_VARIANT naming the entry point. Each copy uses the same inline functions of kvq (the cache's
// constructor, append, reads, decode attention); built for different instruction sets they must
// land in different inline namespaces, or the linker would keep one copy for all of them.
#include <kvq/kvq.hpp>

#include <cstdint>
#include <cstring>
#include <vector>

#include "isa_mix.hpp"

namespace {

// A deterministic pseudo-random value in [-2, 2) (the same in every variant: integer arithmetic).
float value_at(std::uint32_t i) {
  std::uint32_t x = i * 2654435761u + 12345u;
  x ^= x >> 13;
  x *= 0x5bd1e995u;
  x ^= x >> 15;
  return static_cast<float>(x % 4096u) / 1024.0f - 2.0f;
}

}  // namespace

extern "C" void KVQ_VARIANT(isa_mix_result* r) {
  constexpr int kv_heads = 2, head_dim = 64, tokens = 70, q_heads = 4;
  std::vector<float> k(static_cast<std::size_t>(tokens) * kv_heads * head_dim);
  std::vector<float> v(k.size());
  std::vector<float> q(static_cast<std::size_t>(q_heads) * head_dim);
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = value_at(static_cast<std::uint32_t>(i));
    v[i] = value_at(static_cast<std::uint32_t>(i + 100000));
  }
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = value_at(static_cast<std::uint32_t>(i + 200000));

  kvq::QuantizedKVCache<kvq::kv_codecs<kvq::q8_0, kvq::q4_0>> cache({1, kv_heads, head_dim, 128});
  cache.append(0, kvq::token_major(k.data(), tokens, kv_heads, head_dim),
               kvq::token_major(v.data(), tokens, kv_heads, head_dim));
  std::vector<float> keys(static_cast<std::size_t>(tokens) * head_dim);
  cache.read_keys(0, 1, 0, tokens, keys.data());
  std::vector<float> out(q.size());
  kvq::decode_attention(cache, 0, q.data(), q_heads, out.data());

  std::memcpy(r->keys, keys.data(), sizeof r->keys);
  std::memcpy(r->attention, out.data(), sizeof r->attention);
  std::string_view const level = kvq::simd_level();
  std::memset(r->level, 0, sizeof r->level);
  std::memcpy(r->level, level.data(), level.size() < sizeof r->level ? level.size() : sizeof r->level - 1);
}
