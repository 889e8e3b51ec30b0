// kvq: which CPU instruction set kvq's kernels were compiled for.
#pragma once

#include <string_view>

#include "backend/cpu/kernels.hpp"

KVQ_NAMESPACE_BEGIN

/// The CPU kernel level of this translation unit, fixed by its compiler flags: "avx512_vnni",
/// "avx512", "avx2", "neon" or "scalar".
///
/// **Example**: `std::printf("kvq kernels: %s\n", kvq::simd_level().data());`
inline constexpr auto simd_level() noexcept -> std::string_view { return cpu_kernels::simd_level(); }

KVQ_NAMESPACE_END
