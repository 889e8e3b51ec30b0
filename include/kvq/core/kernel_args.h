// kvq: the arguments of kvq's GPU kernels, one definition for every backend (C++14 subset: C++,
// CUDA and the Metal Shading Language compile it alike).
//
// The cache core (core/cache_core.hpp) plans every append, read, truncate and attention as kernel
// launches over these structs; the CUDA kernels (backend/cuda) and the Metal kernels
// (backend/metal) receive them unchanged, by value or through `setBytes`, and hand them to the
// kernel bodies of core/kernel_bodies.h. The structs hold only fixed-width integers and floats
// (no pointers: buffers travel beside them), ordered so that every compiler lays them out alike;
// their sizes are pinned by static_assert. They live in the global namespace with a `kvq_` prefix,
// outside kvq's per-ISA inline namespace, so that a CUDA `__global__` signature is the same in
// nvcc's host and device passes and a Metal shader spells them as the host does.
#pragma once

#include "../detail/config.h"

#if !defined(__METAL_VERSION__)
#  include <stdint.h>
#endif

/// Codec of a kernel: a template argument of the CUDA kernels, a function constant of the Metal
/// pipelines, so every codec switch of the kernel bodies folds away. A rotated codec
/// (FORMATS.md §6.1) runs the kernels of its stored codec; the rotation is an argument (the
/// region's seed and the flags of kvq_source::rotate, kvq_decode_args::unrotate and
/// kvq_attention_args::rotation).
enum kvq_codec_id : int32_t {
  kvq_codec_f32 = 0,
  kvq_codec_f16 = 1,
  kvq_codec_q8_0 = 2,
  kvq_codec_q4_0 = 3,
  kvq_codec_int8 = 4,
  kvq_codec_fp8_e4m3 = 5,
  kvq_codec_fp8_e5m2 = 6,
  kvq_codec_kivi_value2 = 7,  ///< KIVI values, per token, 2-bit
  kvq_codec_kivi_value4 = 8,
  kvq_codec_kivi_value8 = 9,
  kvq_codec_kivi_key2 = 10,  ///< KIVI keys, per channel over tiles of G tokens, 2-bit
  kvq_codec_kivi_key4 = 11,
  kvq_codec_kivi_key8 = 12,
  kvq_codec_mxfp4 = 13,  ///< ggml MXFP4: blocks of 32, E8M0 scale, E2M1 codes
  kvq_codec_nvfp4 = 14,  ///< ggml NVFP4: blocks of 64, four UE4M3 scales, E2M1 codes
  kvq_codec_tq2 = 15,    ///< tq codebook of rotated rows (FORMATS.md §6.2), 2-bit
  kvq_codec_tq3 = 16,
  kvq_codec_tq4 = 17,
};

/// Element type of a kernel's input (appended keys/values) or output (decoded rows).
enum kvq_elem_type : int32_t {
  kvq_elem_f32 = 0,
  kvq_elem_f16 = 1,
  kvq_elem_bf16 = 2,
  kvq_elem_f16_sat = 3,  ///< output only: f16 with finite values saturating to ±65504 (the KIVI residual)
};

/// Where the keys (or values) of one layer live in the layer's allocation, and how they are encoded.
///
/// kv_head h's encoded units (rows, or tiles of `group` tokens for KIVI keys) start at byte
/// `head0 + h * head_stride` of the allocation; for KIVI, its f16 residual rows of head_dim
/// elements start at byte `residual0 + h * residual_stride` (in a flat cache right after the
/// units; in a paged cache the units are a page's and the residual rows the sequence's). Token
/// t < quantized is in unit t (rows) or t / group (tiles); token t >= quantized is residual row
/// (residual_first + t - quantized) % residual_rows (a ring for the KIVI values window). Token
/// indices are relative to the units' start, so `quantized` may be negative (a page past the
/// quantized tokens) or beyond the units.
struct kvq_region {
  uint64_t head0;            ///< byte offset of kv_head 0's units in the allocation
  uint64_t head_stride;      ///< bytes between the units of consecutive kv_heads
  uint64_t residual0;        ///< byte offset of kv_head 0's f16 residual rows in the allocation
  uint64_t residual_stride;  ///< bytes between the residual rows of consecutive kv_heads
  uint32_t unit_bytes;       ///< bytes per encoded row (row codecs) or tile (KIVI keys)
  int32_t group;             ///< KIVI group size G (0 for the other codecs)
  int32_t quantized;         ///< tokens [0, quantized) are encoded units
  int32_t residual_rows;     ///< rows of the residual buffer (>= 1; the ring modulus)
  int32_t residual_first;    ///< residual row of token `quantized`
  float codec_scale;         ///< fp8, mxfp4, nvfp4: code = codec(x / scale), value = codec * scale
  int32_t fp8_saturate;      ///< fp8 codecs: 1 saturates overflow to ±max finite, 0 does not
  uint32_t rotation_seed;    ///< rotated codecs: the seed of R (used where an operation's flag says so)
};
static_assert(sizeof(kvq_region) == 64, "kvq_region must be 64 bytes on every compiler");

/// Where the rows of a write batch come from.
///
/// Batch row i of kv_head h is residual row (residual_first + i) % residual_rows of the
/// destination region when i < from_residual (f16, already rounded), and otherwise input token
/// first + i - from_residual: element `(token * token_stride + h * head_stride + c)` of the input,
/// of type `type`, rounded to f16 first when `round_f16` (KIVI quantizes stored f16 values).
struct kvq_source {
  uint64_t token_stride;   ///< elements between consecutive tokens of the input
  uint64_t head_stride;    ///< elements between consecutive kv_heads of the input
  int32_t type;            ///< kvq_elem_type of the input
  int32_t first;           ///< input token of the first batch row that comes from the input
  int32_t from_residual;   ///< batch rows [0, from_residual) come from the residual rows
  int32_t residual_first;  ///< residual row of batch row 0
  int32_t round_f16;       ///< 1: input values are rounded to f16 before they are encoded
  int32_t rotate;          ///< 1: input rows are rotated by R (dst.rotation_seed) first; residual rows never
  uint64_t mean0;          ///< centered keys: byte offset in the allocation of kv_head 0's key mean (head_dim f32)
  int32_t mean;            ///< 1: the key mean of kv_head h is subtracted from input rows first (before R)
  int32_t reserved;
};
static_assert(sizeof(kvq_source) == 56, "kvq_source must be 56 bytes on every compiler");

/// Arguments of the write kernels (buffers: the layer allocation, the input).
///
///   encode_rows:      threads (kv_heads, count, blocks); batch row i of head h -> unit first + i
///   encode_key_tiles: threads (kv_heads, count / G, head_dim); tile j of head h holds batch rows
///                     [jG, jG + G) -> tile first + j
///   store_f16_rows:   threads (kv_heads, count, head_dim); batch row i of head h -> f16 residual
///                     row (first + i) % residual_rows
///   key means (store_f16_rows with mode kvq_write_key_mean): threads (kv_heads, head_dim); the
///                     mean of channel c of kv_head h over input tokens [0, count) -> the f32 at
///                     byte src.mean0 + 4 (h head_dim + c)
struct kvq_write_args {
  kvq_region dst;
  kvq_source src;
  int32_t head_dim;
  int32_t kv_heads;
  int32_t count;   ///< batch rows per kv_head
  int32_t first;   ///< destination unit (row or tile) or residual row of batch row 0
  int32_t blocks;  ///< blocks per encoded row (encode_rows)
  int32_t mode;    ///< kvq_write_mode: store_f16_rows's own work, or the key means
};
static_assert(sizeof(kvq_write_args) == 144, "kvq_write_args must be 144 bytes on every compiler");

/// What the codec-independent write kernel (store_f16_rows) does (kvq_write_args::mode).
enum kvq_write_mode : int32_t {
  kvq_write_rows = 0,      ///< f16 residual / window rows
  kvq_write_key_mean = 1,  ///< the key means of a centered key codec, from the first chunk of a layer
};

/// Arguments of the decode kernel (buffers: the layer allocation, the output): tokens
/// [first, first + count) of kv_head `head` to rows of `out_type`, `out_stride` elements apart.
/// Threads (count, head_dim).
struct kvq_decode_args {
  kvq_region src;
  uint64_t out_stride;
  int32_t head_dim;
  int32_t head;
  int32_t first;
  int32_t count;
  int32_t out_type;
  int32_t unrotate;  ///< 1: un-rotate the decoded rows by R (src.rotation_seed): reads of a rotated codec
  uint64_t mean0;    ///< centered keys: byte offset of kv_head 0's key mean (head_dim f32) in the allocation
  int32_t add_mean;  ///< 1: add the key mean of `head` to each decoded (un-rotated) value before the rounding
  int32_t reserved;
};
static_assert(sizeof(kvq_decode_args) == 112, "kvq_decode_args must be 112 bytes on every compiler");

/// One sequence of an attention launch: the codec state of its layer, its attended tokens and,
/// in a paged cache, its page table and residual rows.
struct kvq_attention_seq {
  int32_t key_quantized;         ///< the key region's `quantized`
  int32_t value_quantized;       ///< the value region's `quantized`
  int32_t value_residual_first;  ///< the value region's `residual_first`
  int32_t begin;                 ///< first attended token (of any query token)
  int32_t end;                   ///< one past the last attended token (of any query token)
  int32_t pages_first;           ///< paged: index of the sequence's first page id in the page-table buffer
  int32_t length;                ///< tokens of the sequence's layer (the end of an unmasked query's range)
  int32_t first_pos;             ///< position of the launch's query token 0 (decode: length - 1)
  uint64_t key_residual0;        ///< the key region's `residual0` (paged: the sequence's residual slot)
  uint64_t value_residual0;      ///< the value region's `residual0`
  uint64_t key_mean0;            ///< centered keys: byte offset of kv_head 0's key mean in the key allocation
};
static_assert(sizeof(kvq_attention_seq) == 56, "kvq_attention_seq must be 56 bytes on every compiler");

/// The rotated sides of an attention (kvq_attention_args::rotation): the query of each row is
/// rotated by the key side's R once, before any q8_0 rounding; each row's partial output is
/// un-rotated by the value side's R once, before it is written (R^T is linear, so it commutes
/// with the combine and the normalisation).
enum kvq_rotation_flags : int32_t {
  kvq_rotate_query = 1,
  kvq_unrotate_output = 2,
};

/// Custom mask of a multi-token attention (kvq_attention_args::mask).
enum kvq_mask_type : int32_t {
  kvq_mask_none = 0,
  kvq_mask_additive = 1,  ///< f32 added to the logits (-Inf excludes)
  kvq_mask_boolean = 2,   ///< bytes: 0 excludes the token
};

/// Arguments of the partial attention kernel (flash decoding over n_q query tokens per sequence).
///
/// The rows of kv_head kv are the pairs (query token i, query head kv * group + g), row
/// r = i * group + g (group = q_heads / kv_heads), n_q * group of them. Blocks (splits,
/// kv_heads * chunks, sequences); block (s, y) of a sequence attends rows [chunk * heads, ... +
/// heads) of kv_head kv = y / chunks (chunk = y % chunks) to its tokens [begin + s *
/// split_tokens, min(end, ... + split_tokens)), `tile` tokens at a time, each row only to its own
/// tokens: those of query token i at position p = first_pos + i are [max(0, p - window + 1) when
/// window > 0, else 0; min(length, p + 1) when causal, else length), less those its custom mask
/// row excludes (mask buffer: (n_q, mask_stride) f32 or bytes, column j = token j). It writes the
/// unnormalised partial state of each row: out (splits, n_q * q_heads, head_dim), max and sum
/// (splits, n_q * q_heads) per sequence, row (i, h) at i * q_heads + h. The query is (n_q,
/// q_heads, head_dim) f32 per sequence.
///
/// Paged caches (page_tokens > 0): token t of a sequence lives in page
/// pages[pages_first + t / page_tokens] (the page-table buffer), whose units for kv_head h start
/// at byte page * page_bytes + key.head0 + h * key.head_stride (values alike) of the pool, token
/// t % page_tokens of them; the regions' head0 are then offsets inside a page.
struct kvq_attention_args {
  kvq_region key;    ///< `quantized` and `residual_first` come from the sequence
  kvq_region value;  ///< idem
  int32_t head_dim;
  int32_t kv_heads;
  int32_t q_heads;
  int32_t split_tokens;  ///< tokens per split (a multiple of tile)
  int32_t splits;
  int32_t tile;          ///< tokens decoded per step (<= 32)
  int32_t heads;         ///< query heads per block
  int32_t chunks;        ///< blocks per kv_head along the query heads
  float scale;           ///< softmax scale (resolved: never 0)
  float softcap;         ///< > 0: logit = softcap * tanh(logit / softcap)
  int32_t query_q8_0;    ///< 1: the query is rounded to q8_0 (integer block dots for q8_0/q4_0 keys)
  int32_t probs_f16;     ///< 1: probabilities are rounded to f16 before they multiply V
  uint64_t page_bytes;   ///< paged: bytes between consecutive pages of the pool
  int32_t page_tokens;   ///< paged: tokens per page; 0 for a flat cache (one region per layer)
  int32_t n_q;           ///< query tokens per sequence (1: decode)
  int32_t causal;        ///< 1: query token i attends no token past its position
  int32_t window;        ///< > 0: query token i attends only the `window` tokens up to its position
  int32_t mask;          ///< kvq_mask_type of the mask buffer
  int32_t rotation;      ///< kvq_rotation_flags: rotated key / value side (seeds in the regions)
  uint64_t mask_stride;  ///< elements between the mask rows of consecutive query tokens
  int32_t key_mean;      ///< 1: centered keys: row r's logit gets scale * (q_r . mu) (mu in q's space) before softcap
  int32_t reserved;
};
static_assert(sizeof(kvq_attention_args) == 224, "kvq_attention_args must be 224 bytes on every compiler");

/// Arguments of the combine kernel: merges `splits` partial states per (sequence, row) in split
/// order and writes the normalised output (batch, rows, head_dim), rows = q_heads (n_q * q_heads
/// for n_q query tokens). With sinks > 0, row r's sink logit sinks[r % sinks] (the sink buffer,
/// one per query head) joins its denominator. Threads (batch, rows, head_dim).
struct kvq_combine_args {
  int32_t q_heads;  ///< rows per sequence
  int32_t head_dim;
  int32_t splits;
  int32_t batch;
  int32_t sinks;  ///< query heads of the sink buffer; 0: no sinks
  int32_t reserved;
};
static_assert(sizeof(kvq_combine_args) == 24, "kvq_combine_args must be 24 bytes on every compiler");

/// Offsets, in floats, of the block-shared arrays of the partial attention, and their total.
struct kvq_attention_smem {
  int32_t q;       ///< (heads, head_dim) query, f32 (dequantized when the query is q8_0)
  int32_t o;       ///< (heads, head_dim) unnormalised output
  int32_t k;       ///< (tile, head_dim + 1) decoded keys (rows padded: no bank conflicts)
  int32_t p;       ///< (heads, tile) logits
  int32_t w;       ///< (heads, tile) weights of the values (probabilities, f16-rounded on request)
  int32_t e;       ///< (heads, tile) terms of the rows' sums (probabilities against the tile's max)
  int32_t m;       ///< (heads) running max
  int32_t l;       ///< (heads) running sum
  int32_t corr;    ///< (heads) rescale factor of the current tile
  int32_t qd;      ///< (heads, blocks) q8_0 query scales (query_q8_0 only)
  int32_t qcodes;  ///< (heads, blocks, 32) q8_0 query codes as bytes (query_q8_0 only)
  int32_t off;     ///< (heads) logit offsets of centered keys (scale * q.mu)
  int32_t total;   ///< floats in all, a multiple of 4 (Metal wants 16-byte multiples)
};

/// Block-shared memory layout of the partial attention for a head_dim, tile, heads per block and
/// query precision.
KVQ_HOST_DEVICE kvq_attention_smem kvq_attention_smem_layout(int32_t head_dim, int32_t tile, int32_t heads,
                                                             int32_t query_q8_0) {
  const int32_t blocks = (head_dim + 31) / 32;
  kvq_attention_smem s;
  s.q = 0;
  s.o = s.q + heads * head_dim;
  s.k = s.o + heads * head_dim;
  s.p = s.k + tile * (head_dim + 1);
  s.w = s.p + heads * tile;
  s.e = s.w + heads * tile;
  s.m = s.e + heads * tile;
  s.l = s.m + heads;
  s.corr = s.l + heads;
  s.qd = s.corr + heads;
  s.qcodes = s.qd + (query_q8_0 != 0 ? heads * blocks : 0);
  s.off = s.qcodes + (query_q8_0 != 0 ? heads * blocks * 8 : 0);  // 32 codes = 8 floats per block
  const int32_t end = s.off + heads;
  s.total = (end + 3) / 4 * 4;
  return s;
}
