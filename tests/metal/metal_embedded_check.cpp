// kvq tests: compiles, as C++ through the shim, the single-file Metal source that
// kernels_metal_src.hpp embeds (regenerated into the build directory by scripts/embed_metal.py):
// the embedded text must be self-contained (no include left to resolve but <metal_stdlib>) and
// valid. Compile-only: the kernels run from metal_kernels.cpp.
#define KVQ_METAL_SHIM_LANGUAGE 1
#include "metal_shim.hpp"

#include "kvq_kernels_embedded.metal"
