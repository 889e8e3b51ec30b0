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

/// ggml `block_mxfp4`: E8M0 scale exponent e, then 16 bytes; byte j holds element j in its low
/// nibble and element j + 16 in its high nibble (E2M1 codes); x[j] = E2M1(code) * 2^(e - 127).
struct block_mxfp4 {
  u8 e;
  u8 qs[16];
};
static_assert(sizeof(block_mxfp4) == 17, "block_mxfp4 must be 17 bytes (ggml layout)");

/// ggml `block_nvfp4`: four UE4M3 scales (one per sub-block of 16), then 32 bytes; sub-block s
/// uses qs[8s .. 8s + 7], byte 8s + j holding element 16s + j (low nibble) and 16s + j + 8 (high).
struct block_nvfp4 {
  u8 d[4];
  u8 qs[32];
};
static_assert(sizeof(block_nvfp4) == 36, "block_nvfp4 must be 36 bytes (ggml layout)");

/// Elements per mxfp4 block, per nvfp4 block, and per nvfp4 sub-block.
KVQ_CONSTEXPR_VAR int qk_mxfp4 = 32;
KVQ_CONSTEXPR_VAR int qk_nvfp4 = 64;
KVQ_CONSTEXPR_VAR int qk_nvfp4_sub = 16;

/// int8 symmetric row: fp32 scale, then head_dim signed codes; x[i] = q[i] * scale.
KVQ_CONSTEXPR_VAR int int8_row_header_bytes = 4;

/// KIVI scale and minimum of one group: two fp16 values, scale first.
KVQ_CONSTEXPR_VAR int kivi_group_header_bytes = 4;

}  // namespace detail
KVQ_NAMESPACE_END
