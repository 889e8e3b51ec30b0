// The README's usage example, compiled and run: a Llama-3-8B-shaped cache, append, attend, facade.
#include <kvq/error.hpp>  // first on purpose: the headers work in any include order
#include <kvq/kvq.hpp>

#include <cmath>
#include <vector>

#include "catch_compat.hpp"
#include "test_support.hpp"

TEST_CASE("README usage example", "[readme]") {
  int const l = 3, n = 40;
  auto const k = kvq_test::normal_data(static_cast<std::size_t>(n) * 8 * 128, 1);
  auto const v = kvq_test::normal_data(static_cast<std::size_t>(n) * 8 * 128, 2);
  auto const q = kvq_test::normal_data(32 * 128, 3);
  std::vector<float> out(32 * 128), out_any(32 * 128);
  int const m = 5;
  auto const qs = kvq_test::normal_data(static_cast<std::size_t>(m) * 32 * 128, 4);
  std::vector<float> outs(static_cast<std::size_t>(m) * 32 * 128), outs_any(outs.size());

  // --- as in README.md ---
  kvq::QuantizedKVCache<kvq::kv_codecs<kvq::q8_0, kvq::q4_0>> cache({32, 8, 128, 8192});
  cache.append(l, kvq::token_major(k.data(), n, 8, 128), kvq::token_major(v.data(), n, 8, 128));
  kvq::decode_attention(cache, l, q.data(), /*q_heads=*/32, out.data());
  kvq::attention(cache, l, qs.data(), m, /*q_heads=*/32, outs.data());
  auto any = kvq::make_any_cache({32, 8, 128, 8192}, "q8_0", "q4_0");
  // --- end ---

  any->append(l, kvq::token_major(k.data(), n, 8, 128), kvq::token_major(v.data(), n, 8, 128));
  any->attention(l, q.data(), 32, out_any.data());
  any->attention(l, qs.data(), m, 32, outs_any.data());
  for (std::size_t i = 0; i < outs.size(); ++i) {
    REQUIRE(std::isfinite(outs[i]));
    CHECK(kvq_test::bits(outs[i]) == kvq_test::bits(outs_any[i]));
  }
  CHECK(cache.size(l) == n);
  CHECK(cache.size(0) == 0);
  for (std::size_t i = 0; i < out.size(); ++i) {
    REQUIRE(std::isfinite(out[i]));
    CHECK(kvq_test::bits(out[i]) == kvq_test::bits(out_any[i]));  // same codecs, same bytes, same result
  }
  // 32 layers x 8 heads x 8192 tokens x (4 q8_0 blocks + 4 q4_0 blocks) per (token, head).
  CHECK(cache.memory().key_bytes == std::size_t{32} * 8 * 8192 * 4 * 34);
  CHECK(cache.memory().value_bytes == std::size_t{32} * 8 * 8192 * 4 * 18);
  CHECK(cache.memory().bits_per_element == 6.5);
}
