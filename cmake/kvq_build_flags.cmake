# Flags for kvq's own tests, benchmarks, examples and tools. They are never put on kvq::kvq: a
# header-only library leaves the consumer's flags alone.

# kvq_test_flags: the CPU level chosen by KVQ_SIMD.
add_library(kvq_test_flags INTERFACE)
if(MSVC)
  set(_kvq_simd_native "")
  set(_kvq_simd_avx512 /arch:AVX512)
  set(_kvq_simd_avx2 /arch:AVX2)
else()
  set(_kvq_simd_native -march=native)
  set(_kvq_simd_avx512 -mavx512f -mavx512bw -mavx512vl -mavx2 -mfma -mf16c)
  set(_kvq_simd_avx2 -mavx2 -mfma -mf16c)
endif()
if(KVQ_SIMD MATCHES "^avx" AND NOT CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64|i.86|x86)$")
  message(FATAL_ERROR "KVQ_SIMD=${KVQ_SIMD} needs an x86 target (CMAKE_SYSTEM_PROCESSOR is ${CMAKE_SYSTEM_PROCESSOR})")
endif()
if(NOT KVQ_SIMD STREQUAL "scalar")
  target_compile_options(kvq_test_flags INTERFACE ${_kvq_simd_${KVQ_SIMD}})
endif()
message(STATUS "kvq: tests, benchmarks and examples use KVQ_SIMD=${KVQ_SIMD}")

# kvq_warnings: the warning level of kvq's own code; -Werror with KVQ_WERROR.
add_library(kvq_warnings INTERFACE)
if(MSVC)
  target_compile_options(kvq_warnings INTERFACE /W4 $<$<BOOL:${KVQ_WERROR}>:/WX>)
else()
  target_compile_options(kvq_warnings INTERFACE -Wall -Wextra -Wpedantic -Wshadow $<$<BOOL:${KVQ_WERROR}>:-Werror>)
  # GCC 12 reports std::string concatenation at -O3 as overlapping memcpy, a false positive
  # (https://gcc.gnu.org/bugzilla/show_bug.cgi?id=105329).
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
    target_compile_options(kvq_warnings INTERFACE -Wno-restrict)
  endif()
endif()

# kvq_any_cache_instances: the caches behind the any_cache facade compiled once per build, in three
# translation units (any_cache_instances.hpp), for kvq's own tests, tools and examples; whatever
# links it includes any_cache.hpp with KVQ_ANY_CACHE_SEPARATE, so that the facade's entries are not
# compiled again in each of its translation units.
set(_kvq_any_cache_tus)
foreach(group IN ITEMS 0 1 2)
  set(tu "${PROJECT_BINARY_DIR}/kvq_any_cache_instances_${group}.cpp")
  file(CONFIGURE OUTPUT "${tu}"
       CONTENT "#define KVQ_ANY_CACHE_INSTANCES_GROUP ${group}\n#include <kvq/any_cache_instances.hpp>\n")
  list(APPEND _kvq_any_cache_tus "${tu}")
endforeach()
add_library(kvq_any_cache_instances STATIC ${_kvq_any_cache_tus})
target_link_libraries(kvq_any_cache_instances PUBLIC kvq::kvq kvq_test_flags PRIVATE kvq_warnings)
target_compile_definitions(kvq_any_cache_instances PUBLIC KVQ_ANY_CACHE_SEPARATE)
