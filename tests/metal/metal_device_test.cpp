// kvq tests (macOS with metal-cpp, KVQ_METAL_CPP_DIR): kvq's Metal cache on the system's default
// GPU against the CPU cache: the checks of metal_cache_checks.cpp, built for a real device.
#include "catch_compat.hpp"
#include "metal/metal_cache_checks.hpp"

TEST_CASE("metal cache on the GPU matches the CPU cache", "[metal]") {
  for (int d : {8, 64, 80, 128}) {
    INFO("head_dim " << d);
    auto const failures = run_metal_cache_checks(d);
    for (auto const& f : failures) UNSCOPED_INFO(f);
    CHECK(failures.empty());
  }
}
