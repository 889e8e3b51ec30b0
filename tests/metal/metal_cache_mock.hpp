// kvq tests: entry point of metal_cache_mock.cpp (the Metal cache on a mock metal-cpp).
#pragma once

#include <string>
#include <vector>

/// Runs kvq's Metal cache against the CPU cache for several codecs at `head_dim`, on the mock
/// metal-cpp whose GPU is the shim; returns the failures (empty when everything agrees).
auto run_metal_cache_mock(int head_dim) -> std::vector<std::string>;
