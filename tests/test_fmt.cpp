// <kvq/fmt.hpp>: every formatter's output, exactly.
#include <kvq/fmt.hpp>
#include <kvq/kvq.hpp>

#include <string>

#include "catch_compat.hpp"

TEST_CASE("fmt: cache shape, memory and non-finite reports", "[fmt]") {
  kvq::cache_shape const shape{32, 8, 128, 8192};
  CHECK(fmt::format("{}", shape) == "{layers: 32, kv_heads: 8, head_dim: 128, capacity: 8192}");
  auto const m = kvq::plan_memory<kvq::kv_codecs<kvq::q8_0, kvq::q4_0>>(shape);
  CHECK(fmt::format("{}", m) ==
        "436207616 B (keys 285212672, values 150994944, residual 0, alignment 0; "
        "53248 B/token, 6.5 bits/element)");
  kvq::nonfinite_report r;
  r.key_blocks = 2;
  r.value_blocks = 5;
  CHECK(fmt::format("{}", r) == "{key_blocks: 2, value_blocks: 5}");
}

TEST_CASE("fmt: attention options and precisions", "[fmt]") {
  kvq::attention_options o;
  CHECK(fmt::format("{}", o) == "{scale: auto, window: 0, softcap: 0, query: f32, probabilities: f32}");
  o.scale = 0.125f;
  o.window = 4096;
  o.softcap = 30.0f;
  o.query = kvq::query_precision::q8_0;
  o.probabilities = kvq::probability_precision::f16;
  CHECK(fmt::format("{}", o) == "{scale: 0.125, window: 4096, softcap: 30, query: q8_0, probabilities: f16}");
  CHECK(fmt::format("{} {}", kvq::query_precision::f32, kvq::probability_precision::f16) == "f32 f16");
  CHECK(fmt::format("{}", kvq::probability_precision::i8) == "i8");
}

TEST_CASE("fmt: codecs and codec pairs by name", "[fmt]") {
  CHECK(fmt::format("{}", kvq::q8_0{}) == "q8_0");
  CHECK(fmt::format("{}", kvq::fp8_e5m2{}) == "fp8_e5m2");
  CHECK(fmt::format("{}", kvq::kv_codecs<kvq::q8_0, kvq::q4_0>{}) == "q8_0/q4_0");
  CHECK(fmt::format("{}", kvq::kivi<4>{}) == "kivi4");
}

TEST_CASE("fmt: a format spec is refused", "[fmt]") {
  CHECK_THROWS_AS(fmt::format(fmt::runtime("{:x}"), kvq::cache_shape{1, 1, 8, 8}), fmt::format_error);
}
