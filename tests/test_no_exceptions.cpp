// The cache built with KVQ_NO_EXCEPTIONS (and, where the compiler allows, -fno-exceptions): valid
// calls work as usual, and a failed check prints "kvq: <message>" and aborts. CTest runs this
// program through a script that requires the abort and the message of the append past capacity.
#include <kvq/cache.hpp>
#include <kvq/codec/kivi.hpp>
#include <kvq/codec/q8_0.hpp>
#include <kvq/paged_cache.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <vector>

#if !defined(KVQ_NO_EXCEPTIONS)
#  error "test_no_exceptions must be compiled with -DKVQ_NO_EXCEPTIONS"
#endif

namespace {

/// Fails the test with a normal exit (the script requires an abort).
void require(bool ok, char const* what) {
  if (!ok) {
    std::printf("FAILED: %s\n", what);
    std::fflush(stdout);
    std::_Exit(0);
  }
}

template <class Choice>
void exercise() {
  int const d = 32;
  kvq::QuantizedKVCache<Choice> cache({1, 2, d, 64});
  std::vector<float> keys(static_cast<std::size_t>(40 * 2 * d)), values(keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    keys[i] = static_cast<float>(i % 17) - 8.0f;
    values[i] = static_cast<float>(i % 5) * 0.5f;
  }
  cache.append(0, kvq::token_major(keys.data(), 40, 2, d), kvq::token_major(values.data(), 40, 2, d));
  require(cache.size(0) == 40, "size after append");
  std::vector<float> out(static_cast<std::size_t>(40 * d));
  cache.read_values(0, 1, 0, 40, out.data());
  require(std::fabs(out[0] - values[static_cast<std::size_t>(d)]) < 0.02f, "first value of head 1");
  cache.truncate(10);
  require(cache.size(0) == 10, "size after truncate");
  cache.reset();
  require(cache.size(0) == 0, "size after reset");

  // The paged cache: a fork, a copy-on-write append, a truncate and releases.
  kvq::PagedKVCache<Choice> paged({1, 2, d, 32, 8, 4});
  auto const a = paged.add_sequence();
  paged.append(a, 0, kvq::token_major(keys.data(), 40, 2, d), kvq::token_major(values.data(), 40, 2, d));
  auto const b = paged.fork(a);
  paged.append(b, 0, kvq::token_major(keys.data(), 1, 2, d), kvq::token_major(values.data(), 1, 2, d));
  // q8_0 writes token 40 into the shared second page (a copy); KIVI keeps it in the f16 residual.
  constexpr bool kivi = std::is_same_v<Choice, kvq::kivi<4>>;
  require(paged.size(b) == 41 && paged.used_pages() == (kivi ? 2 : 3), "paged fork and copy-on-write");
  paged.read_values(a, 0, 1, 0, 40, out.data());
  require(std::fabs(out[0] - values[static_cast<std::size_t>(d)]) < 0.02f, "paged first value of head 1");
  paged.truncate(b, 20);
  paged.release(a);
  paged.release(b);
  require(paged.free_pages() == 8, "paged pages returned");
}

}  // namespace

int main() {
  exercise<kvq::q8_0>();
  exercise<kvq::kivi<4>>();

  kvq::QuantizedKVCache<kvq::q8_0> cache({1, 1, 8, 4});
  std::vector<float> x(5 * 8, 1.0f);
  cache.append(0, kvq::token_major(x.data(), 3, 1, 8), kvq::token_major(x.data(), 3, 1, 8));
  std::printf("valid calls passed; appending past the capacity must abort now\n");
  std::fflush(stdout);
  cache.append(0, kvq::token_major(x.data(), 2, 1, 8), kvq::token_major(x.data(), 2, 1, 8));
  std::printf("FAILED: the append past the capacity returned\n");
  return 0;
}
