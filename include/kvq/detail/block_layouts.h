// kvq: the byte layouts of every codec's blocks, shared by every backend (C++14 subset).
//
// All multi-byte fields are little-endian. Sizes are fixed by static_assert so that the CPU,
// CUDA and Metal views of a block agree byte for byte.
#pragma once

#include "config.h"

KVQ_NAMESPACE_BEGIN
namespace detail {

/// ggml `block_q8_0`: fp16 scale d, then 32 signed codes; x[j] = qs[j] * d.
struct block_q8_0 {
  u16 d;
  signed char qs[32];
};
static_assert(sizeof(block_q8_0) == 34, "block_q8_0 must be 34 bytes (ggml layout)");

/// ggml `block_q4_0`: fp16 scale d, then 16 bytes; byte j holds element j in its low nibble and
/// element j + 16 in its high nibble; x[j] = (nibble - 8) * d.
struct block_q4_0 {
  u16 d;
  u8 qs[16];
};
static_assert(sizeof(block_q4_0) == 18, "block_q4_0 must be 18 bytes (ggml layout)");

/// Elements per q8_0 / q4_0 block.
KVQ_CONSTEXPR_VAR int qk_ggml = 32;

/// int8 symmetric row: fp32 scale, then head_dim signed codes; x[i] = q[i] * scale.
KVQ_CONSTEXPR_VAR int int8_row_header_bytes = 4;

/// KIVI scale and minimum of one group: two fp16 values, scale first.
KVQ_CONSTEXPR_VAR int kivi_group_header_bytes = 4;

}  // namespace detail
KVQ_NAMESPACE_END
