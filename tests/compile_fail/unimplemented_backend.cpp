// Compile-fail case: a (codec, backend) combination without kernels stops compilation with a message naming it.
// With -DKVQ_COMPILE_FAIL the cache is instantiated for the Metal backend tag, which has no host cache here; without
// it, for the CPU backend, which compiles.
#include <kvq/kvq.hpp>

#if defined(KVQ_COMPILE_FAIL)
using backend_under_test = kvq::metal;
#else
using backend_under_test = kvq::cpu;
#endif

int main() {
  kvq::QuantizedKVCache<kvq::q4_0, backend_under_test> cache({1, 1, 32, 32});
  return static_cast<int>(cache.size(0));
}
