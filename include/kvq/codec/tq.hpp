// kvq: the rotated codebook codecs tq2, tq3 and tq4 (FORMATS.md §6.2): tq<B> is
// rotated<tq_codebook<B>> (tq_codebook.hpp: the codebook of rotated rows, steps 2-8; rotated.hpp:
// the rotation R of step 1).
#pragma once

#include <cstdint>
#include <string_view>

#include "rotated.hpp"
#include "tq_codebook.hpp"

KVQ_NAMESPACE_BEGIN

/// tq<B> (B = 2, 3, 4): FORMATS.md §6.2 whole, the codebook codec of R x with rotation seed `Seed`
/// (below 2^32). Row bytes 2 · (rotation blocks) + ⌈B · head_dim / 8⌉: 34 / 50 / 66 at head_dim 128
/// for tq2 / tq3 / tq4 (2.125 / 3.125 / 4.125 bits per element). A rotated codec: the caches store
/// tq_codebook<B>(R x), attention works on it in the rotated space, reads return Rᵀ ŷ.
template <int B, std::uint64_t Seed = default_rotation_seed>
struct tq : rotated<detail::tq_codebook<B>, Seed> {
  static constexpr std::string_view name = B == 2 ? "tq2" : B == 3 ? "tq3" : "tq4";
};

/// 2-bit codebook codec (2.125 bits per element at head_dim 128).
using tq2 = tq<2>;
/// 3-bit codebook codec (3.125 bits per element at head_dim 128).
using tq3 = tq<3>;
/// 4-bit codebook codec (4.125 bits per element at head_dim 128).
using tq4 = tq<4>;

KVQ_NAMESPACE_END
