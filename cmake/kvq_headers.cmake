# The public headers of kvq, listed explicitly (no glob): installed and compiled one by one.
set(KVQ_PUBLIC_HEADERS
    include/kvq/kvq.hpp
    include/kvq/error.hpp
    include/kvq/memory_resource.hpp
    include/kvq/cache.hpp
    include/kvq/attention.hpp
    include/kvq/any_cache.hpp
    include/kvq/backend/backend.hpp
    include/kvq/backend/cpu/kernels.hpp
    include/kvq/backend/cpu/scalar.hpp
    include/kvq/backend/cpu/simd_codecs.hpp
    include/kvq/backend/cpu/attention_kernels.hpp
    include/kvq/backend/cpu/avx2.hpp
    include/kvq/backend/cpu/avx512.hpp
    include/kvq/backend/cpu/neon.hpp
    include/kvq/simd.hpp
    include/kvq/version.hpp
    include/kvq/detail/config.h
    include/kvq/detail/isa_tag.h
    include/kvq/detail/host_vector.hpp
    include/kvq/detail/numeric.h
    include/kvq/detail/block_layouts.h
    include/kvq/detail/math_ggml.h
    include/kvq/detail/math_int8.h
    include/kvq/detail/math_fp8.h
    include/kvq/detail/math_kivi.h
    include/kvq/codec/codec.hpp
    include/kvq/codec/passthrough.hpp
    include/kvq/codec/q8_0.hpp
    include/kvq/codec/q4_0.hpp
    include/kvq/codec/int8.hpp
    include/kvq/codec/fp8.hpp
    include/kvq/codec/kivi.hpp
    include/kvq/backend/metal/kvq_metal_args.h
    include/kvq/backend/metal/kernels_metal_src.hpp
    include/kvq/backend/metal/metal_cache.hpp
    include/kvq/backend/cuda/cuda_device.h
    include/kvq/backend/cuda/cuda_cache_core.hpp
)

# Optional headers that need a third-party library (not compiled on their own; installed with the rest).
set(KVQ_OPTIONAL_HEADERS
    include/kvq/fmt.hpp  # {fmt} formatters: needs fmt 9+
)
