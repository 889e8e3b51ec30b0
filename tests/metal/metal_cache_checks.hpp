// kvq tests: entry point of metal_cache_checks.cpp (the Metal cache against the CPU cache).
#pragma once

#include <string>
#include <vector>

/// Runs kvq's Metal cache against the CPU cache for several codecs at `head_dim` (on the mock
/// metal-cpp, or on the default Metal device; see metal_cache_checks.cpp); returns the failures,
/// empty when everything agrees.
auto run_metal_cache_checks(int head_dim) -> std::vector<std::string>;

/// Runs the Metal cache's multi-token attention (and sinks) against the CPU kvq::attention for
/// several codecs at `head_dim`; returns the failures, empty when everything agrees.
auto run_metal_attention_checks(int head_dim) -> std::vector<std::string>;
