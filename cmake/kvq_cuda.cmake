# kvq's CUDA backend in the build: installation of the .cuh headers, and the CUDA language for the
# CUDA tests and benchmarks. Included from the top-level CMakeLists.txt: include(cmake/kvq_cuda.cmake)
#
# KVQ_ENABLE_CUDA: AUTO (default) enables CUDA when a working nvcc is found (CMAKE_CUDA_COMPILER,
# the CUDACXX environment variable, nvcc on PATH, or CUDA's standard location /usr/local/cuda);
# ON requires it; OFF never looks. KVQ_CUDA_ARCHITECTURES (default 80;89;90, or `native`) becomes
# CMAKE_CUDA_ARCHITECTURES unless that is set. Sets KVQ_CUDA_ENABLED (ON/OFF) for tests and bench.
#
# CMake 3.25 cannot map C++20 to an nvcc 13 flag, so kvq_cuda_flags (an INTERFACE target for the
# CUDA targets) passes -std=c++20 itself; nvcc's default --fmad=true is kept on purpose: kvq's
# results must not depend on it.

# The .cuh headers need nvcc; they are not in the verified header set (which compiles each header as
# C++), but they are installed next to the headers they include.
if(KVQ_INSTALL)
  include(GNUInstallDirs)
  install(FILES "${CMAKE_CURRENT_LIST_DIR}/../include/kvq/backend/cuda/kernels.cuh"
                "${CMAKE_CURRENT_LIST_DIR}/../include/kvq/backend/cuda/cuda_cache.cuh"
          DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}/kvq/backend/cuda")
endif()

set(KVQ_CUDA_ENABLED OFF)
if(KVQ_ENABLE_CUDA STREQUAL "OFF" OR NOT (KVQ_BUILD_TESTS OR KVQ_BUILD_BENCHMARKS))
  return()
endif()

if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
  find_program(_kvq_nvcc nvcc)
  if(NOT _kvq_nvcc AND EXISTS "/usr/local/cuda/bin/nvcc")
    set(ENV{CUDACXX} "/usr/local/cuda/bin/nvcc")
  endif()
  unset(_kvq_nvcc CACHE)
endif()
include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  if(KVQ_ENABLE_CUDA STREQUAL "ON")
    message(FATAL_ERROR "kvq: KVQ_ENABLE_CUDA=ON but no working CUDA compiler (nvcc) was found; set "
                        "CMAKE_CUDA_COMPILER or CUDACXX")
  endif()
  message(STATUS "kvq: no CUDA compiler found: the CUDA tests and benchmarks are not built")
  return()
endif()

if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES "${KVQ_CUDA_ARCHITECTURES}")
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
set(KVQ_CUDA_ENABLED ON)
message(STATUS "kvq: CUDA tests and benchmarks with ${CMAKE_CUDA_COMPILER} (${CMAKE_CUDA_COMPILER_VERSION}), "
               "architectures ${CMAKE_CUDA_ARCHITECTURES}")

# kvq_cuda_flags: what every kvq CUDA target needs (C++20 for nvcc, warnings of the host pass).
add_library(kvq_cuda_flags INTERFACE)
target_compile_options(
  kvq_cuda_flags
  INTERFACE "$<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>"
            "$<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>"
            "$<$<AND:$<COMPILE_LANGUAGE:CUDA>,$<BOOL:${KVQ_WERROR}>>:--Werror=all-warnings>")
target_link_libraries(kvq_cuda_flags INTERFACE CUDA::cudart)
