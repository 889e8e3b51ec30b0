// main() of test_cuda_device: exits with 4 (CTest's SKIP_RETURN_CODE for the `cuda` tests) when
// the CUDA runtime reports no device, else runs the Catch2 session. Catch2 v2 has no SKIP, so the
// skip is reported through the exit code; the implementation of Catch2 is compiled here (g++).
#if __has_include(<catch2/catch_session.hpp>)
#  include <catch2/catch_session.hpp>
#else
#  define CATCH_CONFIG_RUNNER
#  if defined(__GNUC__) && !defined(__clang__)
#    pragma GCC diagnostic push
#    pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#  endif
#  include <catch2/catch.hpp>
#  if defined(__GNUC__) && !defined(__clang__)
#    pragma GCC diagnostic pop
#  endif
#endif

#include <cuda_runtime.h>

#include <cstdio>

int main(int argc, char** argv) {
  int devices = 0;
  cudaError_t const e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device (%s)\n", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    std::fflush(stdout);
    return 4;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
    std::printf("CUDA device 0: %s, compute capability %d.%d\n", prop.name, prop.major, prop.minor);
  return Catch::Session().run(argc, argv);
}
