// kvq: the CUDA backend's kernel arguments and kernel bodies, written as host/device functions.
//
// Every kernel of the CUDA backend (kernels.cuh) is a thin `__global__` wrapper that computes its
// thread's index and calls one function of this file. The functions are KVQ_HOST_DEVICE and
// contain no CUDA-only construct (no __shared__, no __syncthreads, no warp intrinsics), so a plain
// C++ compiler runs the very same code on the CPU: tests/test_cuda_host.cpp checks it against the
// scalar reference without a GPU. The codec math is the shared reference code (kvq/detail/*.h):
// encoded bytes and decoded values are the CPU cache's by construction, whatever `--fmad` says.
//
//   encode_rows_thread      one block of one row of a row codec (q8_0/q4_0: 32 channels; int8: a
//                           row; f32/f16/fp8: a channel; KIVI values: a group of channels)
//   encode_key_tile_thread  one channel of one KIVI key tile of G tokens
//   store_f16_thread        one element of the KIVI key residual / value window (f16)
//   decode_thread           one element of a token range of one kv_head, to f32, f16 or bf16
//   attention_block         one thread block of flash-decoding attention: a (split of the context,
//                           kv_head, chunk of its query heads, sequence); barriers are calls to
//                           `threads.run(phase)`, which runs `phase(tid)` on every thread and then
//                           synchronises (a __syncthreads on the GPU, a loop on the CPU)
//   combine_thread          merges the partial states of the splits of one (sequence, head, channel)
//
// Argument structs and codec ids live in namespace kvq_cuda, outside kvq's per-ISA inline
// namespace: a __global__ function's signature must be the same in nvcc's host and device passes,
// whose ISA namespaces differ (kvq::isa_scalar and kvq::isa_device).
#pragma once

#include "../../detail/block_layouts.h"
#include "../../detail/math_fp8.h"
#include "../../detail/math_ggml.h"
#include "../../detail/math_int8.h"
#include "../../detail/math_kivi.h"
#include "../../detail/numeric.h"

#if defined(__CUDACC__) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890)
#  include <cuda_fp8.h>
#  define KVQ_CUDA_HW_FP8 1
#endif

namespace kvq_cuda {

/// Codec of a kernel (a template argument of the kernels, so every switch below folds away).
enum codec_id : int {
  codec_f32 = 0,
  codec_f16 = 1,
  codec_q8_0 = 2,
  codec_q4_0 = 3,
  codec_int8 = 4,
  codec_fp8_e4m3 = 5,
  codec_fp8_e5m2 = 6,
  codec_kivi_value2 = 7,  ///< KIVI values (per token), 2-bit
  codec_kivi_value4 = 8,
  codec_kivi_value8 = 9,
  codec_kivi_key2 = 10,  ///< KIVI keys (per channel over tiles of G tokens), 2-bit
  codec_kivi_key4 = 11,
  codec_kivi_key8 = 12,
};

/// Element type of an input (appended keys/values) or output (decoded rows).
enum elem_type : int {
  elem_f32 = 0,
  elem_f16 = 1,
  elem_bf16 = 2,
  elem_f16_sat = 3,  ///< output only: f16 with finite values saturating to ±65504 (the KIVI residual)
};

/// Where the keys (or values) of a layer live in the layer's allocation, and their codec state.
///
/// kv_head h's region starts at byte `head0 + h * head_stride`; it holds the encoded units (rows,
/// or tiles of `group` tokens for KIVI keys) from byte 0 and, for KIVI, f16 rows of head_dim
/// elements from byte `residual_offset`. Token t < quantized is in unit t (rows) or t / group
/// (tiles); token t >= quantized is residual row (residual_first + t - quantized) % residual_rows.
struct region {
  long long head0;
  long long head_stride;
  long long residual_offset;
  long long unit_bytes;  ///< bytes per encoded row (row codecs) or tile (KIVI keys)
  int group;             ///< KIVI group size G (0 for the other codecs)
  int quantized;         ///< tokens [0, quantized) are encoded units
  int residual_rows;     ///< rows of the residual buffer (>= 1; the ring modulus)
  int residual_first;    ///< residual row of token `quantized`
  float fp8_scale;       ///< fp8 codecs: code = fp8(x / scale), value = fp8 * scale
  int fp8_saturate;      ///< fp8 codecs: 1 saturates overflow to ±max finite, 0 does not
};

/// Where the rows of a write batch come from.
///
/// Batch row i of kv_head h is residual row (residual_first + i) % residual_rows of the destination
/// region when i < from_residual (f16, already rounded), and otherwise input token
/// first + i - from_residual: elements `data + token * token_stride + h * head_stride + c` of type
/// `type`, rounded to f16 first when `round_f16` (KIVI quantizes stored f16 values).
struct source {
  void const* data;
  long long token_stride;  ///< elements
  long long head_stride;   ///< elements
  int type;                ///< elem_type
  int first;
  int from_residual;
  int residual_first;
  int round_f16;
};

/// Arguments of the write kernels (encode_rows, encode_key_tiles, store_f16_rows).
///
///   encode_rows:      threads (kv_heads, count, blocks); batch row i of head h -> unit first + i
///   encode_key_tiles: threads (kv_heads, count / G, head_dim); tile j of head h holds batch rows
///                     [jG, jG + G) -> tile first + j
///   store_f16_rows:   threads (kv_heads, count, head_dim); batch row i of head h -> residual row
///                     (first + i) % residual_rows
struct write_args {
  unsigned char* layer;
  region dst;
  source src;
  int head_dim;
  int kv_heads;
  int count;   ///< batch rows per kv_head
  int first;   ///< destination unit or residual row of batch row 0
  int blocks;  ///< blocks per encoded row (encode_rows)
};

/// Arguments of the decode kernel: tokens [first, first + count) of kv_head `head` to rows of
/// `out_type`, `out_stride` elements apart. Threads (count, head_dim).
struct decode_args {
  unsigned char const* layer;
  region src;
  void* out;
  long long out_stride;
  int head_dim;
  int head;
  int first;
  int count;
  int out_type;
};

/// Sequences per attention launch (the batched entry launches once per 64 sequences).
constexpr int max_batch = 64;

/// One sequence of an attention launch: its layer allocation, codec state and attended range.
struct attention_seq {
  unsigned char const* layer;
  int key_quantized;
  int value_quantized;
  int value_residual_first;
  int begin;
  int end;
  int reserved;
};

/// Arguments of the attention kernel (flash decoding, one query token per sequence).
///
/// Blocks (splits, kv_heads * chunks, batch); block (s, y, b) attends query heads
/// [kv * group + chunk * heads, ... + heads) of kv_head kv = y / chunks (chunk = y % chunks,
/// group = q_heads / kv_heads) of sequence b to its tokens [begin + s * split_tokens, ...), `tile`
/// tokens at a time, and writes the unnormalised partial state of each head: part_out
/// (batch, splits, q_heads, head_dim), part_max and part_sum (batch, splits, q_heads).
/// The query is (batch, q_heads, head_dim) f32.
struct attention_args {
  region key;    ///< `quantized` and `residual_first` come from the sequence
  region value;  ///< idem
  float const* q;
  float* part_out;
  float* part_max;
  float* part_sum;
  int head_dim;
  int kv_heads;
  int q_heads;
  int batch;
  int split_tokens;  ///< tokens per split (a multiple of tile)
  int splits;
  int tile;        ///< tokens per step (<= 32)
  int heads;       ///< query heads per block
  int chunks;      ///< blocks per kv_head along the query heads
  float scale;     ///< softmax scale (resolved: never 0)
  float softcap;   ///< > 0: logit = softcap * tanh(logit / softcap)
  int query_q8_0;  ///< 1: the query is rounded to q8_0 (integer block dots for q8_0/q4_0 keys)
  int probs_f16;   ///< 1: probabilities are rounded to f16 before they multiply V
  attention_seq seq[max_batch];
};

/// Arguments of the combine kernel: merges `splits` partial states per (sequence, query head) in
/// split order and writes the normalised output (batch, q_heads, head_dim). Threads
/// (batch, q_heads, head_dim).
struct combine_args {
  float const* part_out;
  float const* part_max;
  float const* part_sum;
  float* out;
  int q_heads;
  int head_dim;
  int splits;
  int batch;
};

/// Offsets, in floats, of the shared-memory arrays of the attention block, and their total.
struct attention_smem {
  int q;       ///< (heads, head_dim) query (dequantized when the query is q8_0)
  int o;       ///< (heads, head_dim) unnormalised output
  int k;       ///< (tile, head_dim + 1) decoded keys (rows padded: no bank conflicts)
  int p;       ///< (heads, tile) logits, then probabilities
  int w;       ///< (heads, tile) weights of the values (probabilities, f16-rounded on request)
  int m;       ///< (heads) running max
  int l;       ///< (heads) running sum
  int corr;    ///< (heads) rescale factor of the current tile
  int qd;      ///< (heads, blocks) q8_0 query scales (query_q8_0 only)
  int qcodes;  ///< (heads, blocks, 32) q8_0 query codes as bytes (query_q8_0 only)
  int total;   ///< floats in all
};

/// Shared-memory layout of the attention block for head_dim, tile, heads per block and query precision.
KVQ_HOST_DEVICE attention_smem attention_smem_layout(int head_dim, int tile, int heads, int query_q8_0) {
  const int blocks = (head_dim + 31) / 32;
  attention_smem s;
  s.q = 0;
  s.o = s.q + heads * head_dim;
  s.k = s.o + heads * head_dim;
  s.p = s.k + tile * (head_dim + 1);
  s.w = s.p + heads * tile;
  s.m = s.w + heads * tile;
  s.l = s.m + heads;
  s.corr = s.l + heads;
  s.qd = s.corr + heads;
  s.qcodes = s.qd + (query_q8_0 != 0 ? heads * blocks : 0);
  s.total = s.qcodes + (query_q8_0 != 0 ? heads * blocks * 8 : 0);  // 32 codes = 8 floats per block
  return s;
}

}  // namespace kvq_cuda

KVQ_NAMESPACE_BEGIN
namespace cuda_detail {

namespace kc = ::kvq_cuda;

// ---- small helpers -------------------------------------------------------------------------------

/// Reads a little-endian u16 from any byte address.
KVQ_HOST_DEVICE unsigned ld_u16(unsigned char const* p) {
  return static_cast<unsigned>(p[0]) | (static_cast<unsigned>(p[1]) << 8);
}

/// Reads a little-endian u32 from any byte address.
KVQ_HOST_DEVICE unsigned ld_u32(unsigned char const* p) {
  return static_cast<unsigned>(p[0]) | (static_cast<unsigned>(p[1]) << 8) | (static_cast<unsigned>(p[2]) << 16) |
         (static_cast<unsigned>(p[3]) << 24);
}

/// Writes a little-endian u16 to any byte address.
KVQ_HOST_DEVICE void st_u16(unsigned char* p, unsigned v) {
  p[0] = static_cast<unsigned char>(v & 0xffu);
  p[1] = static_cast<unsigned char>((v >> 8) & 0xffu);
}

/// Writes a little-endian u32 to any byte address.
KVQ_HOST_DEVICE void st_u32(unsigned char* p, unsigned v) {
  p[0] = static_cast<unsigned char>(v & 0xffu);
  p[1] = static_cast<unsigned char>((v >> 8) & 0xffu);
  p[2] = static_cast<unsigned char>((v >> 16) & 0xffu);
  p[3] = static_cast<unsigned char>((v >> 24) & 0xffu);
}

/// The signed value of a two's-complement byte.
KVQ_HOST_DEVICE int sext8(unsigned b) { return static_cast<int>(b & 0xffu) - static_cast<int>((b & 0x80u) << 1); }

KVQ_HOST_DEVICE int imin(int a, int b) { return a < b ? a : b; }

KVQ_HOST_DEVICE float neg_inf() { return detail::f32_from_bits(0xff800000u); }

KVQ_HOST_DEVICE float quiet_nan() { return detail::f32_from_bits(0x7fc00000u); }

/// Rounds a float to f16 and back (round to nearest even; NaN stays NaN).
KVQ_HOST_DEVICE float round_f16(float x) { return detail::f16_bits_to_f32(detail::f32_to_f16_bits(x)); }

/// Rounds a float to f16 and back as the KIVI residual stores it: finite values saturate to ±65504.
KVQ_HOST_DEVICE float round_f16_satfinite(float x) {
  return detail::f16_bits_to_f32(detail::f32_to_f16_bits_satfinite(x));
}

/// e^x (the C library's expf on the host, CUDA's expf on the device; never a fast approximation).
KVQ_HOST_DEVICE float exp_f32(float x) { return expf(x); }

/// tanh(x) (C library / CUDA tanhf).
KVQ_HOST_DEVICE float tanh_f32(float x) { return tanhf(x); }

/// Bits of a KIVI codec.
KVQ_HOST_DEVICE constexpr int kivi_bits(int codec) {
  return (codec == kc::codec_kivi_key2 || codec == kc::codec_kivi_value2)   ? 2
         : (codec == kc::codec_kivi_key4 || codec == kc::codec_kivi_value4) ? 4
                                                                            : 8;
}

KVQ_HOST_DEVICE constexpr bool is_kivi_key(int codec) {
  return codec >= kc::codec_kivi_key2 && codec <= kc::codec_kivi_key8;
}

KVQ_HOST_DEVICE constexpr bool is_kivi_value(int codec) {
  return codec >= kc::codec_kivi_value2 && codec <= kc::codec_kivi_value8;
}

/// Bytes of one element of an elem_type.
KVQ_HOST_DEVICE long long elem_bytes(int type) { return type == kc::elem_f32 ? 4 : 2; }

/// Start of kv_head h's region in a layer allocation.
KVQ_HOST_DEVICE unsigned char* region_ptr(unsigned char* layer, kc::region const& r, int h) {
  return layer + r.head0 + static_cast<long long>(h) * r.head_stride;
}
KVQ_HOST_DEVICE unsigned char const* region_ptr(unsigned char const* layer, kc::region const& r, int h) {
  return layer + r.head0 + static_cast<long long>(h) * r.head_stride;
}

// ---- fp8 conversions: hardware where it matches the shared software path bit for bit ---------------

/// E4M3FN code of x / scale (kvq's rules, detail/math_fp8.h). On sm_89 and later the saturating
/// conversion of a non-NaN quotient is the hardware `cvt.rn.satfinite.e4m3x2.f32`, which rounds to
/// nearest even and clamps overflow and ±Inf to ±448 exactly as the software path; NaN (which the
/// hardware may encode with its sign) and the non-saturating mode take the software path.
KVQ_HOST_DEVICE unsigned char fp8_e4m3_encode(float x, float scale, bool saturate) {
#if defined(KVQ_CUDA_HW_FP8)
  const float y = detail::div_rn(x, scale);
  if (saturate && !detail::is_nan_f32(y))
    return static_cast<unsigned char>(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3));
  return detail::f32_to_e4m3(y, saturate);
#else
  return detail::f32_to_e4m3_scaled(x, scale, saturate);
#endif
}

/// E5M2 code of x / scale (see fp8_e4m3_encode; saturating maximum 57344).
KVQ_HOST_DEVICE unsigned char fp8_e5m2_encode(float x, float scale, bool saturate) {
#if defined(KVQ_CUDA_HW_FP8)
  const float y = detail::div_rn(x, scale);
  if (saturate && !detail::is_nan_f32(y))
    return static_cast<unsigned char>(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E5M2));
  return detail::f32_to_e5m2(y, saturate);
#else
  return detail::f32_to_e5m2_scaled(x, scale, saturate);
#endif
}

/// Value of an E4M3FN code times scale. On sm_89 and later a finite code is widened by the exact
/// hardware fp8 -> f16 conversion; NaN codes take the software path (kvq's canonical NaN).
KVQ_HOST_DEVICE float fp8_e4m3_decode(unsigned char code, float scale) {
#if defined(KVQ_CUDA_HW_FP8)
  if ((code & 0x7fu) != 0x7fu) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
    return detail::mul_rn(detail::f16_bits_to_f32((detail::u16)h.x), scale);
  }
#endif
  return detail::e4m3_to_f32_scaled(code, scale);
}

/// Value of an E5M2 code times scale (E5M2 is the top byte of an f16: a shift, on every architecture).
KVQ_HOST_DEVICE float fp8_e5m2_decode(unsigned char code, float scale) {
  return detail::e5m2_to_f32_scaled(code, scale);
}

// ---- rows of input ---------------------------------------------------------------------------------

/// A row of head_dim input values: its first element, element type and whether values pass
/// through f16 first.
struct row_ref {
  unsigned char const* p;
  int type;
  int round;
};

/// Value of channel c of a row, as the CPU cache reads it (widened to f32, then f16-rounded for KIVI).
/// Rows are aligned to their element type (user input, f16 residual rows): typed loads.
KVQ_HOST_DEVICE float row_value(row_ref r, int c) {
  float x;
  if (r.type == kc::elem_f32) {
    x = reinterpret_cast<float const*>(r.p)[c];
  } else {
    const detail::u16 h = reinterpret_cast<detail::u16 const*>(r.p)[c];
    x = r.type == kc::elem_f16 ? detail::f16_bits_to_f32(h) : detail::bf16_bits_to_f32(h);
  }
  return r.round != 0 ? round_f16_satfinite(x) : x;
}

/// Batch row i of kv_head h of a write kernel (see kvq_cuda::source).
KVQ_HOST_DEVICE row_ref batch_row(kc::write_args const& a, int h, int i) {
  row_ref r;
  if (i < a.src.from_residual) {
    const int row = (a.src.residual_first + i) % a.dst.residual_rows;
    r.p = region_ptr(static_cast<unsigned char const*>(a.layer), a.dst, h) + a.dst.residual_offset +
          static_cast<long long>(row) * static_cast<long long>(a.head_dim) * 2;
    r.type = kc::elem_f16;
    r.round = 0;
  } else {
    const long long token = static_cast<long long>(a.src.first + i - a.src.from_residual);
    r.p = static_cast<unsigned char const*>(a.src.data) +
          (token * a.src.token_stride + static_cast<long long>(h) * a.src.head_stride) * elem_bytes(a.src.type);
    r.type = a.src.type;
    r.round = a.src.round_f16;
  }
  return r;
}

// ---- encoders ----------------------------------------------------------------------------------

/// Encodes block b (channels [32b, 32b + 32)) of a row as ggml block_q8_0 at blk (34 bytes); lanes
/// past head_dim are padding with code 0. As q8_0::encode_block.
KVQ_HOST_DEVICE void encode_q8_0(row_ref x, int head_dim, int b, unsigned char* blk) {
  const int c0 = 32 * b;
  const int n = imin(32, head_dim - c0);
  float amax = 0.0f;
  bool finite = true;
  for (int j = 0; j < n; ++j) {
    const float v = row_value(x, c0 + j);
    finite = finite && detail::is_finite_f32(v);
    const float a = detail::abs_f32(v);
    amax = a > amax ? a : amax;
  }
  if (!finite) {
    st_u16(blk, detail::poisoned_f16_scale);
    for (int j = 0; j < 32; ++j) blk[2 + j] = 0;
    return;
  }
  const float d = detail::q8_0_scale(amax);
  const float id = detail::ggml_inverse_scale(d);
  st_u16(blk, detail::f32_to_f16_bits(d));
  for (int j = 0; j < 32; ++j)
    blk[2 + j] =
        j < n ? static_cast<unsigned char>(static_cast<unsigned>(detail::q8_0_code(row_value(x, c0 + j), id)) & 0xffu)
              : 0;
}

/// Encodes block b of a row as ggml block_q4_0 at blk (18 bytes). As q4_0::encode_block.
KVQ_HOST_DEVICE void encode_q4_0(row_ref x, int head_dim, int b, unsigned char* blk) {
  const int c0 = 32 * b;
  const int n = imin(32, head_dim - c0);
  float amax = 0.0f;
  float mx = 0.0f;
  bool finite = true;
  for (int j = 0; j < n; ++j) {
    const float v = row_value(x, c0 + j);
    finite = finite && detail::is_finite_f32(v);
    const float a = detail::abs_f32(v);
    if (amax < a) {
      amax = a;
      mx = v;
    }
  }
  if (!finite) {
    st_u16(blk, detail::poisoned_f16_scale);
    for (int j = 0; j < 16; ++j) blk[2 + j] = 0x88;
    return;
  }
  const float d = detail::q4_0_scale(mx);
  const float id = detail::ggml_inverse_scale(d);
  st_u16(blk, detail::f32_to_f16_bits(d));
  for (int j = 0; j < 16; ++j) {
    const int lo = detail::q4_0_code(j < n ? row_value(x, c0 + j) : 0.0f, id);
    const int hi = detail::q4_0_code(j + 16 < n ? row_value(x, c0 + j + 16) : 0.0f, id);
    blk[2 + j] = static_cast<unsigned char>(static_cast<unsigned>(lo | (hi << 4)) & 0xffu);
  }
}

/// Encodes a whole row as int8 symmetric (fp32 scale, then head_dim codes). As int8_sym::encode_row.
KVQ_HOST_DEVICE void encode_int8(row_ref x, int head_dim, unsigned char* row) {
  float amax = 0.0f;
  bool finite = true;
  for (int i = 0; i < head_dim; ++i) {
    const float v = row_value(x, i);
    finite = finite && detail::is_finite_f32(v);
    const float a = detail::abs_f32(v);
    amax = a > amax ? a : amax;
  }
  const float scale = finite ? detail::int8_scale(amax) : detail::f32_from_bits(detail::int8_poisoned_scale_bits);
  st_u32(row, detail::f32_bits(scale));
  const bool coded = finite && scale != 0.0f;
  for (int i = 0; i < head_dim; ++i)
    row[detail::int8_row_header_bytes + i] =
        coded ? static_cast<unsigned char>(static_cast<unsigned>(detail::int8_code(row_value(x, i), scale)) & 0xffu)
              : 0;
}

/// Encodes group b (channels [b gv, b gv + gv), gv = min(G, head_dim)) of a row as a KIVI value
/// block: fp16 scale, fp16 min, packed codes; pad lanes hold code 0. As kivi_value::encode_row.
KVQ_HOST_DEVICE void encode_kivi_value(row_ref x, int head_dim, int b, int group, int bits, unsigned char* row) {
  const int gv = imin(group, head_dim);
  const int c0 = b * gv;
  const int n = imin(gv, head_dim - c0);
  const int code_bytes = (gv * bits + 7) / 8;
  unsigned char* blk = row + static_cast<long long>(b) * (detail::kivi_group_header_bytes + code_bytes);
  detail::kivi_range r = detail::kivi_range_empty();
  for (int i = 0; i < n; ++i) r = detail::kivi_range_add(r, row_value(x, c0 + i));
  const detail::kivi_header hd = detail::kivi_make_header(r, bits);
  st_u16(blk, hd.scale);
  st_u16(blk + 2, hd.min);
  const float s = detail::f16_bits_to_f32(hd.scale);
  const float m = detail::f16_bits_to_f32(hd.min);
  const int per_byte = 8 / bits;
  for (int j = 0; j < code_bytes; ++j) {
    detail::u8 byte = 0;
    for (int k = 0; k < per_byte && r.finite; ++k) {
      const int i = j * per_byte + k;
      if (i < n) byte = detail::kivi_pack(byte, detail::kivi_code(row_value(x, c0 + i), s, m, bits), i, bits);
    }
    blk[detail::kivi_group_header_bytes + j] = byte;
  }
}

/// Encodes block b of a row of codec C into `row` (the row's first byte).
template <int C>
KVQ_HOST_DEVICE void encode_block(row_ref x, int head_dim, int b, kc::region const& r, unsigned char* row) {
  if constexpr (C == kc::codec_f32) {
    reinterpret_cast<detail::u32*>(row)[b] = detail::f32_bits(row_value(x, b));  // rows of 4 * head_dim bytes: aligned
  } else if constexpr (C == kc::codec_f16) {
    reinterpret_cast<detail::u16*>(row)[b] = detail::f32_to_f16_bits(row_value(x, b));
  } else if constexpr (C == kc::codec_q8_0) {
    encode_q8_0(x, head_dim, b, row + static_cast<long long>(b) * static_cast<long long>(sizeof(detail::block_q8_0)));
  } else if constexpr (C == kc::codec_q4_0) {
    encode_q4_0(x, head_dim, b, row + static_cast<long long>(b) * static_cast<long long>(sizeof(detail::block_q4_0)));
  } else if constexpr (C == kc::codec_int8) {
    encode_int8(x, head_dim, row);
  } else if constexpr (C == kc::codec_fp8_e4m3) {
    row[b] = fp8_e4m3_encode(row_value(x, b), r.fp8_scale, r.fp8_saturate != 0);
  } else if constexpr (C == kc::codec_fp8_e5m2) {
    row[b] = fp8_e5m2_encode(row_value(x, b), r.fp8_scale, r.fp8_saturate != 0);
  } else {
    static_assert(is_kivi_value(C), "kvq: encode_block needs a row codec");
    encode_kivi_value(x, head_dim, b, r.group, kivi_bits(C), row);
  }
}

/// Thread `idx` of encode_rows: threads (kv_heads, count, blocks), blocks fastest.
template <int C>
KVQ_HOST_DEVICE void encode_rows_thread(kc::write_args const& a, long long idx) {
  const long long per_head = static_cast<long long>(a.count) * a.blocks;
  if (idx >= per_head * a.kv_heads) return;
  const int h = static_cast<int>(idx / per_head);
  const long long rem = idx - static_cast<long long>(h) * per_head;
  const int i = static_cast<int>(rem / a.blocks);
  const int b = static_cast<int>(rem - static_cast<long long>(i) * a.blocks);
  unsigned char* row = region_ptr(a.layer, a.dst, h) + static_cast<long long>(a.first + i) * a.dst.unit_bytes;
  encode_block<C>(batch_row(a, h, i), a.head_dim, b, a.dst, row);
}

/// Thread `idx` of encode_key_tiles: threads (kv_heads, count / G, head_dim), channels fastest. One
/// channel of a KIVI key tile: its G values quantized together. As kivi_key::encode_tile.
template <int C>
KVQ_HOST_DEVICE void encode_key_tile_thread(kc::write_args const& a, long long idx) {
  static_assert(is_kivi_key(C), "kvq: encode_key_tile_thread needs KIVI keys");
  constexpr int bits = kivi_bits(C);
  const int g = a.dst.group;
  const int tiles = a.count / g;
  const long long per_head = static_cast<long long>(tiles) * a.head_dim;
  if (idx >= per_head * a.kv_heads) return;
  const int h = static_cast<int>(idx / per_head);
  const long long rem = idx - static_cast<long long>(h) * per_head;
  const int j = static_cast<int>(rem / a.head_dim);
  const int c = static_cast<int>(rem - static_cast<long long>(j) * a.head_dim);
  unsigned char* tile = region_ptr(a.layer, a.dst, h) + static_cast<long long>(a.first + j) * a.dst.unit_bytes;
  detail::kivi_range range = detail::kivi_range_empty();
  for (int t = 0; t < g; ++t) range = detail::kivi_range_add(range, row_value(batch_row(a, h, j * g + t), c));
  const detail::kivi_header hd = detail::kivi_make_header(range, bits);
  st_u16(tile + 2 * static_cast<long long>(c), hd.scale);
  st_u16(tile + 2 * (static_cast<long long>(a.head_dim) + c), hd.min);
  const float s = detail::f16_bits_to_f32(hd.scale);
  const float m = detail::f16_bits_to_f32(hd.min);
  const int code_bytes = g * bits / 8;
  const int per_byte = 8 / bits;
  unsigned char* codes = tile + static_cast<long long>(detail::kivi_group_header_bytes) * a.head_dim +
                         static_cast<long long>(code_bytes) * static_cast<long long>(c);
  for (int k = 0; k < code_bytes; ++k) {
    detail::u8 byte = 0;
    for (int e = 0; e < per_byte && range.finite; ++e) {
      const int t = k * per_byte + e;
      byte = detail::kivi_pack(byte, detail::kivi_code(row_value(batch_row(a, h, j * g + t), c), s, m, bits), t, bits);
    }
    codes[k] = byte;
  }
}

/// Thread `idx` of store_f16_rows: threads (kv_heads, count, head_dim), channels fastest.
KVQ_HOST_DEVICE void store_f16_thread(kc::write_args const& a, long long idx) {
  const long long per_head = static_cast<long long>(a.count) * a.head_dim;
  if (idx >= per_head * a.kv_heads) return;
  const int h = static_cast<int>(idx / per_head);
  const long long rem = idx - static_cast<long long>(h) * per_head;
  const int i = static_cast<int>(rem / a.head_dim);
  const int c = static_cast<int>(rem - static_cast<long long>(i) * a.head_dim);
  const int row = (a.first + i) % a.dst.residual_rows;
  detail::u16* res = reinterpret_cast<detail::u16*>(region_ptr(a.layer, a.dst, h) + a.dst.residual_offset);
  res[static_cast<long long>(row) * a.head_dim + c] =
      detail::f32_to_f16_bits_satfinite(row_value(batch_row(a, h, i), c));
}

// ---- decoders ----------------------------------------------------------------------------------

/// Channel c of an encoded row of row codec C.
template <int C>
KVQ_HOST_DEVICE float decode_row_element(unsigned char const* row, int head_dim, int c, kc::region const& r) {
  if constexpr (C == kc::codec_f32) {
    return reinterpret_cast<float const*>(row)[c];
  } else if constexpr (C == kc::codec_f16) {
    return detail::f16_bits_to_f32(reinterpret_cast<detail::u16 const*>(row)[c]);
  } else if constexpr (C == kc::codec_q8_0) {
    unsigned char const* blk =
        row + static_cast<long long>(c / 32) * static_cast<long long>(sizeof(detail::block_q8_0));
    return detail::q8_0_value(sext8(blk[2 + c % 32]), detail::f16_bits_to_f32(static_cast<detail::u16>(ld_u16(blk))));
  } else if constexpr (C == kc::codec_q4_0) {
    unsigned char const* blk =
        row + static_cast<long long>(c / 32) * static_cast<long long>(sizeof(detail::block_q4_0));
    const int j = c % 32;
    const int nibble = j < 16 ? static_cast<int>(blk[2 + j] & 0x0fu) : static_cast<int>(blk[2 + j - 16] >> 4);
    return detail::q4_0_value(nibble, detail::f16_bits_to_f32(static_cast<detail::u16>(ld_u16(blk))));
  } else if constexpr (C == kc::codec_int8) {
    return detail::int8_value(sext8(row[detail::int8_row_header_bytes + c]), detail::f32_from_bits(ld_u32(row)));
  } else if constexpr (C == kc::codec_fp8_e4m3) {
    return fp8_e4m3_decode(row[c], r.fp8_scale);
  } else if constexpr (C == kc::codec_fp8_e5m2) {
    return fp8_e5m2_decode(row[c], r.fp8_scale);
  } else {
    static_assert(is_kivi_value(C), "kvq: decode_row_element needs a row codec");
    constexpr int bits = kivi_bits(C);
    const int gv = imin(r.group, head_dim);
    const int lane = c % gv;
    unsigned char const* blk =
        row + static_cast<long long>(c / gv) * (detail::kivi_group_header_bytes + (gv * bits + 7) / 8);
    const int q =
        detail::kivi_unpack(blk[detail::kivi_group_header_bytes + detail::kivi_code_byte(lane, bits)], lane, bits);
    return detail::kivi_value(q, detail::f16_bits_to_f32(static_cast<detail::u16>(ld_u16(blk))),
                              detail::f16_bits_to_f32(static_cast<detail::u16>(ld_u16(blk + 2))));
  }
}

/// Channel c of token t of the kv_head whose region starts at `reg`: an encoded row, a KIVI key
/// tile, or an f16 residual row (t >= r.quantized).
template <int C>
KVQ_HOST_DEVICE float decode_element(unsigned char const* reg, kc::region const& r, int head_dim, int t, int c) {
  if (t >= r.quantized) {
    const int row = (r.residual_first + (t - r.quantized)) % r.residual_rows;
    return detail::f16_bits_to_f32(
        reinterpret_cast<detail::u16 const*>(reg + r.residual_offset)[static_cast<long long>(row) * head_dim + c]);
  }
  if constexpr (is_kivi_key(C)) {
    constexpr int bits = kivi_bits(C);
    const int g = r.group;
    const int tt = t % g;
    unsigned char const* tile = reg + static_cast<long long>(t / g) * r.unit_bytes;
    const float s = detail::f16_bits_to_f32(static_cast<detail::u16>(ld_u16(tile + 2 * static_cast<long long>(c))));
    const float m =
        detail::f16_bits_to_f32(static_cast<detail::u16>(ld_u16(tile + 2 * (static_cast<long long>(head_dim) + c))));
    unsigned char const* codes = tile + static_cast<long long>(detail::kivi_group_header_bytes) * head_dim +
                                 static_cast<long long>(g * bits / 8) * static_cast<long long>(c);
    const int q = detail::kivi_unpack(codes[detail::kivi_code_byte(tt, bits)], tt, bits);
    return detail::kivi_value(q, s, m);
  } else {
    return decode_row_element<C>(reg + static_cast<long long>(t) * r.unit_bytes, head_dim, c, r);
  }
}

/// Thread `idx` of decode: threads (count, head_dim), channels fastest.
template <int C>
KVQ_HOST_DEVICE void decode_thread(kc::decode_args const& a, long long idx) {
  if (idx >= static_cast<long long>(a.count) * a.head_dim) return;
  const int i = static_cast<int>(idx / a.head_dim);
  const int c = static_cast<int>(idx - static_cast<long long>(i) * a.head_dim);
  const float v = decode_element<C>(region_ptr(a.layer, a.src, a.head), a.src, a.head_dim, a.first + i, c);
  const long long o = static_cast<long long>(i) * a.out_stride + c;
  if (a.out_type == kc::elem_f32) {
    static_cast<float*>(a.out)[o] = v;  // outputs are aligned to their element type
  } else if (a.out_type == kc::elem_f16) {
    static_cast<detail::u16*>(a.out)[o] = detail::f32_to_f16_bits(v);
  } else if (a.out_type == kc::elem_f16_sat) {
    static_cast<detail::u16*>(a.out)[o] = detail::f32_to_f16_bits_satfinite(v);
  } else {
    static_cast<detail::u16*>(a.out)[o] = detail::f32_to_bf16_bits(v);
  }
}

// ---- attention ---------------------------------------------------------------------------------

/// Integer dot product of block b of a q8_0 or q4_0 key row with a q8_0 query block (codes qc,
/// scale dq), as kvq::detail::dot_block: q8_0 sumi * (dk * dq), q4_0 (sumi * dk) * dq.
template <int C>
KVQ_HOST_DEVICE float block_dot(unsigned char const* row, int b, signed char const* qc, float dq) {
  int sumi = 0;
  if constexpr (C == kc::codec_q8_0) {
    unsigned char const* blk = row + static_cast<long long>(b) * static_cast<long long>(sizeof(detail::block_q8_0));
    for (int j = 0; j < 32; ++j) sumi += sext8(blk[2 + j]) * static_cast<int>(qc[j]);
    const float dk = detail::f16_bits_to_f32(static_cast<detail::u16>(ld_u16(blk)));
    return detail::mul_rn(static_cast<float>(sumi), detail::mul_rn(dk, dq));
  } else {
    static_assert(C == kc::codec_q4_0, "kvq: block_dot needs q8_0 or q4_0 keys");
    unsigned char const* blk = row + static_cast<long long>(b) * static_cast<long long>(sizeof(detail::block_q4_0));
    for (int j = 0; j < 16; ++j) {
      sumi += (static_cast<int>(blk[2 + j] & 0x0fu) - 8) * static_cast<int>(qc[j]);
      sumi += (static_cast<int>(blk[2 + j] >> 4) - 8) * static_cast<int>(qc[j + 16]);
    }
    const float dk = detail::f16_bits_to_f32(static_cast<detail::u16>(ld_u16(blk)));
    return detail::mul_rn(detail::mul_rn(static_cast<float>(sumi), dk), dq);
  }
}

/// True for the bits of -0.0f, the probability that marks a token with logit -Inf (weight 0, and
/// skipped in P·V as kvq::attend_range skips it, so 0 * Inf in V makes no NaN).
KVQ_HOST_DEVICE bool is_skipped(float p) { return detail::f32_bits(p) == 0x80000000u; }

/// One block of the attention kernel (see kvq_cuda::attention_args): split bx, y = by, sequence bz;
/// `smem` holds attention_smem_layout(...).total floats; `threads.count()` threads run it, and
/// `threads.run(f)` runs f(tid) on each, then synchronises them.
///
/// Per tile of `tile` tokens: the keys are decoded once into shared memory (or, for the integer
/// dots of a q8_0 query with q8_0/q4_0 keys, read in place), one thread per (head, token) computes
/// a logit, one thread per head the tile's new running max, one thread per (head, token) the
/// probability, and one thread per channel accumulates P·V, decoding every value once for all
/// heads of the block. NaN/Inf as kvq::attend_range: a NaN or +Inf logit makes the head NaN, a
/// -Inf logit weighs 0.
template <int KC, int VC, class Threads>
KVQ_HOST_DEVICE void attention_block(kc::attention_args const& a, int bx, int by, int bz, float* smem,
                                     Threads& threads) {
  const int hd = a.head_dim;
  const int group = a.q_heads / a.kv_heads;
  const int kv = by / a.chunks;
  const int g0 = (by % a.chunks) * a.heads;
  const int nh = imin(a.heads, group - g0);
  const int h0 = kv * group + g0;
  kc::attention_seq const& sq = a.seq[bz];
  const int t_begin = sq.begin + bx * a.split_tokens;
  const int t_end = imin(sq.end, t_begin + a.split_tokens);
  const int T = a.tile;
  const int nb = (hd + 31) / 32;
  const int kstride = hd + 1;
  constexpr bool int_keys = KC == kc::codec_q8_0 || KC == kc::codec_q4_0;
  const bool int_dot = int_keys && a.query_q8_0 != 0;
  const float ninf = neg_inf();

  kc::region kr = a.key;
  kr.quantized = sq.key_quantized;
  kr.residual_first = 0;
  kc::region vr = a.value;
  vr.quantized = sq.value_quantized;
  vr.residual_first = sq.value_residual_first;
  unsigned char const* kreg = region_ptr(sq.layer, kr, kv);
  unsigned char const* vreg = region_ptr(sq.layer, vr, kv);

  const kc::attention_smem L = kc::attention_smem_layout(hd, T, a.heads, a.query_q8_0);
  float* q_s = smem + L.q;
  float* o_s = smem + L.o;
  float* k_s = smem + L.k;
  float* p_s = smem + L.p;
  float* w_s = smem + L.w;
  float* m_s = smem + L.m;
  float* l_s = smem + L.l;
  float* c_s = smem + L.corr;
  float* qd_s = smem + L.qd;
  signed char* qc_s = reinterpret_cast<signed char*>(smem + L.qcodes);
  float const* qin = a.q + (static_cast<long long>(bz) * a.q_heads + h0) * hd;
  const int nt = threads.count();

  // The query heads of this block: as given, or rounded to q8_0 blocks as q8_0::encode_row and
  // decode_row do (codes kept for the integer dots).
  threads.run([&](int tid) {
    if (a.query_q8_0 != 0) {
      for (int w = tid; w < nh * nb; w += nt) {
        const int g = w / nb;
        const int b = w % nb;
        float const* x = qin + static_cast<long long>(g) * hd;
        const int c0 = 32 * b;
        const int n = imin(32, hd - c0);
        float amax = 0.0f;
        bool finite = true;
        for (int j = 0; j < n; ++j) {
          finite = finite && detail::is_finite_f32(x[c0 + j]);
          const float av = detail::abs_f32(x[c0 + j]);
          amax = av > amax ? av : amax;
        }
        const float d = detail::q8_0_scale(amax);
        const float id = finite ? detail::ggml_inverse_scale(d) : 0.0f;
        const float dq = detail::f16_bits_to_f32(finite ? detail::f32_to_f16_bits(d) : detail::poisoned_f16_scale);
        qd_s[g * nb + b] = dq;
        for (int j = 0; j < 32; ++j) {
          const int code = (finite && j < n) ? detail::q8_0_code(x[c0 + j], id) : 0;
          qc_s[(g * nb + b) * 32 + j] = static_cast<signed char>(code);
          if (j < n) q_s[g * hd + c0 + j] = detail::q8_0_value(code, dq);
        }
      }
    } else {
      for (int w = tid; w < nh * hd; w += nt) q_s[w] = qin[w];
    }
    for (int w = tid; w < nh * hd; w += nt) o_s[w] = 0.0f;
    for (int w = tid; w < nh; w += nt) {
      m_s[w] = ninf;
      l_s[w] = 0.0f;
    }
  });

  for (int t0 = t_begin; t0 < t_end; t0 += T) {
    const int n = imin(T, t_end - t0);

    // Keys of the tile, decoded once for all heads: k_s (n, hd + 1).
    if (!int_dot) {
      threads.run([&](int tid) {
        for (int w = tid; w < n * hd; w += nt) {
          const int i = w / hd;
          const int c = w - i * hd;
          k_s[i * kstride + c] = decode_element<KC>(kreg, kr, hd, t0 + i, c);
        }
      });
    }

    // Logits, one thread per (head, token); consecutive threads take consecutive tokens.
    threads.run([&](int tid) {
      for (int w = tid; w < nh * n; w += nt) {
        const int g = w / n;
        const int i = w - g * n;
        float dot = 0.0f;
        if constexpr (int_keys) {
          if (int_dot) {
            unsigned char const* row = kreg + static_cast<long long>(t0 + i) * kr.unit_bytes;
            for (int b = 0; b < nb; ++b)
              dot = detail::add_rn(dot, block_dot<KC>(row, b, qc_s + (g * nb + b) * 32, qd_s[g * nb + b]));
          }
        }
        if (!int_dot) {
          float const* qg = q_s + g * hd;
          float const* kk = k_s + i * kstride;
          for (int c = 0; c < hd; ++c) dot += qg[c] * kk[c];
        }
        float s = dot * a.scale;
        if (a.softcap > 0.0f) s = a.softcap * tanh_f32(s / a.softcap);
        p_s[g * T + i] = s;
      }
    });

    // New running max per head (NaN logits take no part) and the rescale of what came before.
    threads.run([&](int tid) {
      for (int g = tid; g < nh; g += nt) {
        const float m_old = m_s[g];
        float mt = ninf;
        for (int i = 0; i < n; ++i) {
          const float s = p_s[g * T + i];
          mt = s > mt ? s : mt;
        }
        const float m_new = mt > m_old ? mt : m_old;
        c_s[g] = m_old == ninf ? 0.0f : (m_new == m_old ? 1.0f : exp_f32(m_old - m_new));
        m_s[g] = m_new;
      }
    });

    // Probabilities p = exp(s - m) (NaN for NaN or +Inf logits), and the weights of the values.
    threads.run([&](int tid) {
      for (int w = tid; w < nh * n; w += nt) {
        const int g = w / n;
        const int i = w - g * n;
        const float s = p_s[g * T + i];
        const float p = s == ninf ? -0.0f : exp_f32(s - m_s[g]);
        p_s[g * T + i] = p;
        w_s[g * T + i] = a.probs_f16 != 0 ? round_f16(p) : p;
      }
    });

    // P·V per channel (every value element decoded once for all heads), and the running sums.
    threads.run([&](int tid) {
      for (int c = tid; c < hd; c += nt) {
        for (int g = 0; g < nh; ++g) o_s[g * hd + c] *= c_s[g];
        for (int i = 0; i < n; ++i) {
          const float v = decode_element<VC>(vreg, vr, hd, t0 + i, c);
          for (int g = 0; g < nh; ++g) {
            const float p = p_s[g * T + i];
            if (!is_skipped(p)) o_s[g * hd + c] += w_s[g * T + i] * v;
          }
        }
      }
      for (int g = tid; g < nh; g += nt) {
        float sum = 0.0f;
        for (int i = 0; i < n; ++i) sum += p_s[g * T + i];
        l_s[g] = l_s[g] * c_s[g] + sum;
      }
    });
  }

  // The partial state of every head of the block.
  threads.run([&](int tid) {
    const long long base = static_cast<long long>(bz) * a.splits + bx;
    for (int w = tid; w < nh * hd; w += nt) {
      const int g = w / hd;
      a.part_out[(base * a.q_heads + h0 + g) * hd + (w - g * hd)] = o_s[w];
    }
    for (int g = tid; g < nh; g += nt) {
      a.part_max[base * a.q_heads + h0 + g] = m_s[g];
      a.part_sum[base * a.q_heads + h0 + g] = l_s[g];
    }
  });
}

/// Thread `idx` of combine: threads (batch, q_heads, head_dim). Merges the splits in order as
/// kvq::combine and normalises as kvq::finalize (heads that attended nothing output 0).
KVQ_HOST_DEVICE void combine_thread(kc::combine_args const& a, long long idx) {
  const long long per_seq = static_cast<long long>(a.q_heads) * a.head_dim;
  if (idx >= per_seq * a.batch) return;
  const int b = static_cast<int>(idx / per_seq);
  const long long rem = idx - static_cast<long long>(b) * per_seq;
  const int h = static_cast<int>(rem / a.head_dim);
  const int c = static_cast<int>(rem - static_cast<long long>(h) * a.head_dim);
  const float ninf = neg_inf();
  float m = ninf;
  float l = 0.0f;
  float o = 0.0f;
  for (int s = 0; s < a.splits; ++s) {
    const long long sh = (static_cast<long long>(b) * a.splits + s) * a.q_heads + h;
    const float mb = a.part_max[sh];
    const float lb = a.part_sum[sh];
    if (mb == ninf && !detail::is_nan_f32(lb)) continue;  // the split attended nothing
    const float mm = (detail::is_nan_f32(m) || detail::is_nan_f32(mb)) ? quiet_nan() : (mb > m ? mb : m);
    const float ca = m == ninf ? 0.0f : exp_f32(m - mm);
    const float cb = exp_f32(mb - mm);
    o = o * ca + a.part_out[sh * a.head_dim + c] * cb;
    l = l * ca + lb * cb;
    m = mm;
  }
  a.out[(static_cast<long long>(b) * a.q_heads + h) * a.head_dim + c] = l == 0.0f ? 0.0f : o * (1.0f / l);
}

}  // namespace cuda_detail
KVQ_NAMESPACE_END
