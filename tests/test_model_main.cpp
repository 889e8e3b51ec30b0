// main() of test_model: exits with 4 (CTest's SKIP_RETURN_CODE for these tests) when the model
// files are absent, else runs the Catch2 session. In its own translation unit because with Catch2 v2
// the test framework's implementation is compiled here (CATCH_CONFIG_RUNNER).
#if __has_include(<catch2/catch_session.hpp>)
#  include <catch2/catch_session.hpp>
#else
#  define CATCH_CONFIG_RUNNER
// GCC 12 reports false maybe-uninitialized warnings inside libstdc++'s <regex>, which Catch2 v2's
// implementation uses, when optimising with sanitizers on; they are not this project's code.
#  if defined(__GNUC__) && !defined(__clang__)
#    pragma GCC diagnostic push
#    pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#  endif
#  include <catch2/catch.hpp>
#  if defined(__GNUC__) && !defined(__clang__)
#    pragma GCC diagnostic pop
#  endif
#endif

#include <cstdio>
#include <string>
#include <vector>

namespace kvq_model_test {
auto missing_model_files() -> std::vector<std::string>;  // test_model.cpp
}

int main(int argc, char** argv) {
  auto const missing = kvq_model_test::missing_model_files();
  if (!missing.empty()) {
    std::printf("SKIPPED: model files not found (set KVQ_MODELS_DIR in CMake or the environment):\n");
    for (auto const& p : missing) std::printf("  %s\n", p.c_str());
    std::fflush(stdout);
    return 4;
  }
  return Catch::Session().run(argc, argv);
}
