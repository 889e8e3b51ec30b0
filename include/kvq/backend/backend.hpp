// kvq: backend tags and the (codec, backend) dispatch point.
//
// A backend owns the cache's memory and its kernels. `kernels<Codec, Backend>` is specialised for
// every implemented combination; any other combination stops compilation with a message naming it.
#pragma once

#include "../codec/codec.hpp"

KVQ_NAMESPACE_BEGIN

/// The CPU backend: host memory, scalar reference kernels (SIMD kernels slot in per ISA).
struct cpu {
  static constexpr std::string_view name = "cpu";
};

/// The CUDA backend tag (device memory, .cuh kernels).
struct cuda {
  static constexpr std::string_view name = "cuda";
};

/// The Metal backend tag (.metal shaders, metal-cpp host dispatch).
struct metal {
  static constexpr std::string_view name = "metal";
};

/// A backend tag.
template <class B>
concept backend = requires {
  { B::name } -> std::convertible_to<std::string_view>;
};

/// Instantiating this type reports that `Codec` has no kernels on `Backend`.
template <class Codec, class Backend>
struct codec_not_implemented_for_backend {
  static_assert(detail::dependent_false<Codec>::value,
                "kvq: this (codec, backend) combination is not implemented: see "
                "codec_not_implemented_for_backend<Codec, Backend> in the instantiation trace");
  static constexpr bool value = false;
};

/// True when `Backend` implements `Codec`; specialised by each backend.
template <class Codec, class Backend>
struct implements : std::false_type {};

/// Every codec is implemented on the CPU backend.
template <codec Codec>
struct implements<Codec, cpu> : std::true_type {};

/// Evaluates to true for an implemented combination; otherwise fails to compile naming it.
template <class Codec, class Backend>
constexpr bool require_implemented() {
  if constexpr (implements<Codec, Backend>::value) {
    return true;
  } else {
    return codec_not_implemented_for_backend<Codec, Backend>::value;
  }
}

KVQ_NAMESPACE_END
