// kvq: Metal kernels of the quantized KV cache: append (encode), read (decode) and decode attention
// (flash decoding) for every kvq codec, written over kvq's shared codec math (kvq/detail/*.h).
//
// The element math (rounding, scales, fp8/f16 conversions, KIVI parameters) is the scalar
// reference's own code, shared with the CPU and CUDA backends; the kernels here only index, loop,
// load and store. Encoded bytes and decoded values are meant to be identical to the CPU cache's
// (cache.hpp) and attention to agree with kvq::decode_attention within fp32 rounding.
//
// Kernels (arguments: kvq_metal_args.h; buffer 0 is always the argument struct):
//   kvq_encode_rows       encode rows of a row codec (keys or values) into the cache
//   kvq_encode_key_tiles  encode KIVI key tiles (per channel over G tokens) into the cache
//   kvq_store_f16_rows    store rows as f16 into the KIVI key residual / value window
//   kvq_decode            decode a token range of one kv_head to f32, f16 or bf16
//   kvq_attention_partial partial attention state per (kv_head, split of the context)
//   kvq_attention_combine merge the splits and normalise
// The codec is a function constant (index 0; index 1 is the value codec of the attention), so
// each pipeline is specialised and the codec switches below fold away.
//
// Numerics need fast math off: build the library with MTLCompileOptions mathMode = safe (or
// fastMathEnabled = NO) and precise math functions, or `xcrun metal -fno-fast-math`; the pragmas
// below also ask for no contraction of a*b+c into an FMA (kvq's mul_rn/add_rn rely on it).
//
// Pointers carry their address space (device / threadgroup / constant / thread). Threadgroup
// barriers and SIMD-group reductions appear only in the kernel bodies, never in the shared math.
// A host test compiles this file as C++ through a shim (tests/metal/metal_shim.hpp); the two
// KVQ_METAL_* macros below are the only concessions to it.

#pragma METAL fp math_mode(safe)
#pragma METAL fp contract(off)
#pragma clang fp contract(off)

#include <metal_stdlib>
using namespace metal;

#include "../../detail/block_layouts.h"
#include "../../detail/math_fp8.h"
#include "../../detail/math_ggml.h"
#include "../../detail/math_int8.h"
#include "../../detail/math_kivi.h"
#include "../../detail/numeric.h"
#include "kvq_metal_args.h"

#if !defined(KVQ_METAL_FUNCTION_CONSTANT)
#  define KVQ_METAL_FUNCTION_CONSTANT(type, name, index) constant type name [[function_constant(index)]];
#endif
#if !defined(KVQ_METAL_THREADGROUP_BUFFER)
#  define KVQ_METAL_THREADGROUP_BUFFER(index) [[threadgroup(index)]]
#endif

/// The codec of a row kernel, or the key codec of the attention (a kvq_metal_codec).
KVQ_METAL_FUNCTION_CONSTANT(int, kvq_codec, 0)
/// The value codec of the attention (a kvq_metal_codec).
KVQ_METAL_FUNCTION_CONSTANT(int, kvq_value_codec, 1)

namespace kvq_msl {

namespace kd = kvq::detail;

/// Reads a little-endian u16 from any byte address.
inline uint ld_u16(device const uchar* p) { return uint(p[0]) | (uint(p[1]) << 8); }

/// Reads a little-endian u32 from any byte address.
inline uint ld_u32(device const uchar* p) {
  return uint(p[0]) | (uint(p[1]) << 8) | (uint(p[2]) << 16) | (uint(p[3]) << 24);
}

/// Writes a little-endian u16 to any byte address.
inline void st_u16(device uchar* p, uint v) {
  p[0] = uchar(v & 0xffu);
  p[1] = uchar((v >> 8) & 0xffu);
}

/// Writes a little-endian u32 to any byte address.
inline void st_u32(device uchar* p, uint v) {
  p[0] = uchar(v & 0xffu);
  p[1] = uchar((v >> 8) & 0xffu);
  p[2] = uchar((v >> 16) & 0xffu);
  p[3] = uchar((v >> 24) & 0xffu);
}

/// The signed value of a two's-complement byte.
inline int sext8(uint b) { return int(b & 0xffu) - int((b & 0x80u) << 1); }

inline int imin(int a, int b) { return a < b ? a : b; }

inline float neg_inf() { return kd::f32_from_bits(0xff800000u); }

inline float quiet_nan() { return kd::f32_from_bits(0x7fc00000u); }

/// Rounds a float to f16 and back (round to nearest even; NaN stays NaN).
inline float round_f16(float x) { return kd::f16_bits_to_f32(kd::f32_to_f16_bits(x)); }

/// Rounds a float to f16 and back as the KIVI residual stores it: finite values saturate to ±65504.
inline float round_f16_satfinite(float x) { return kd::f16_bits_to_f32(kd::f32_to_f16_bits_satfinite(x)); }

/// Bits of a KIVI codec.
inline int kivi_bits(int codec) {
  return (codec == kvq_metal_kivi_key2 || codec == kvq_metal_kivi_value2)   ? 2
         : (codec == kvq_metal_kivi_key4 || codec == kvq_metal_kivi_value4) ? 4
                                                                            : 8;
}

inline bool is_kivi_key(int codec) { return codec >= kvq_metal_kivi_key2 && codec <= kvq_metal_kivi_key8; }

/// Bytes of one element of a kvq_metal_elem type.
inline ulong elem_bytes(int type) { return type == kvq_metal_elem_f32 ? 4ul : 2ul; }

/// Start of kv_head h's region of a layer buffer.
inline device uchar* region_ptr(device uchar* layer, constant kvq_metal_region& r, int h) {
  return layer + r.head0 + ulong(h) * r.head_stride;
}
inline device const uchar* region_ptr(device const uchar* layer, constant kvq_metal_region& r, int h) {
  return layer + r.head0 + ulong(h) * r.head_stride;
}

/// A row of head_dim input values: its first element, element type and whether values pass
/// through f16 first. Rows of an f16 residual are rows of type f16.
struct row_ref {
  device const uchar* p;
  int type;
  int round;
};

/// Value of channel c of a row, as the CPU cache reads it (load_f32, then f16 rounding for KIVI).
inline float row_value(row_ref r, int c) {
  float x;
  if (r.type == kvq_metal_elem_f32) {
    x = ((device const float*)r.p)[c];
  } else {
    const kd::u16 h = kd::u16(((device const ushort*)r.p)[c]);
    x = r.type == kvq_metal_elem_f16 ? kd::f16_bits_to_f32(h) : kd::bf16_bits_to_f32(h);
  }
  return r.round != 0 ? round_f16_satfinite(x) : x;
}

/// Batch row i of kv_head h of a write kernel (see kvq_metal_source).
inline row_ref batch_row(constant kvq_metal_write_args& a, device const uchar* layer, device const uchar* input, int h,
                         int i) {
  row_ref r;
  if (i < a.src.from_residual) {
    const int row = (a.src.residual_first + i) % a.dst.residual_rows;
    r.p = region_ptr(layer, a.dst, h) + a.dst.residual_offset + ulong(row) * ulong(a.head_dim) * 2ul;
    r.type = kvq_metal_elem_f16;
    r.round = 0;
  } else {
    const ulong token = ulong(a.src.first + i - a.src.from_residual);
    r.p = input + (token * a.src.token_stride + ulong(h) * a.src.head_stride) * elem_bytes(a.src.type);
    r.type = a.src.type;
    r.round = a.src.round_f16;
  }
  return r;
}

// ------------------------------------------------------------------------------------------------
// Encoders: one block of one row per thread (q8_0/q4_0: 32 channels; int8: the whole row;
// f32/f16/fp8: one channel; KIVI values: one group of min(G, head_dim) channels).

/// q8_0 scale d = amax/127 of channels [c0, c0 + n) of a row; `finite` is false when one is NaN/Inf.
inline float q8_0_block_scale(row_ref x, int c0, int n, thread bool& finite) {
  float amax = 0.0f;
  bool fin = true;
  for (int j = 0; j < n; ++j) {
    const float v = row_value(x, c0 + j);
    fin = fin && kd::is_finite_f32(v);
    const float a = kd::abs_f32(v);
    amax = a > amax ? a : amax;
  }
  finite = fin;
  return kd::q8_0_scale(amax);
}

/// Encodes block b of a row as ggml block_q8_0 (34 bytes at blk); lanes past head_dim are padding.
inline void encode_q8_0(row_ref x, int head_dim, int b, device uchar* blk) {
  const int c0 = 32 * b;
  const int n = imin(32, head_dim - c0);
  bool finite = true;
  const float d = q8_0_block_scale(x, c0, n, finite);
  if (!finite) {
    st_u16(blk, kd::poisoned_f16_scale);
    for (int j = 0; j < 32; ++j) blk[2 + j] = uchar(0);
    return;
  }
  const float id = kd::ggml_inverse_scale(d);
  st_u16(blk, kd::f32_to_f16_bits(d));
  for (int j = 0; j < 32; ++j)
    blk[2 + j] = j < n ? uchar(uint(kd::q8_0_code(row_value(x, c0 + j), id)) & 0xffu) : uchar(0);
}

/// Encodes block b of a row as ggml block_q4_0 (18 bytes at blk); lanes past head_dim are padding.
inline void encode_q4_0(row_ref x, int head_dim, int b, device uchar* blk) {
  const int c0 = 32 * b;
  const int n = imin(32, head_dim - c0);
  float amax = 0.0f;
  float mx = 0.0f;
  bool finite = true;
  for (int j = 0; j < n; ++j) {
    const float v = row_value(x, c0 + j);
    finite = finite && kd::is_finite_f32(v);
    const float a = kd::abs_f32(v);
    if (amax < a) {
      amax = a;
      mx = v;
    }
  }
  if (!finite) {
    st_u16(blk, kd::poisoned_f16_scale);
    for (int j = 0; j < 16; ++j) blk[2 + j] = uchar(0x88);
    return;
  }
  const float d = kd::q4_0_scale(mx);
  const float id = kd::ggml_inverse_scale(d);
  st_u16(blk, kd::f32_to_f16_bits(d));
  for (int j = 0; j < 16; ++j) {
    const int lo = kd::q4_0_code(j < n ? row_value(x, c0 + j) : 0.0f, id);
    const int hi = kd::q4_0_code(j + 16 < n ? row_value(x, c0 + j + 16) : 0.0f, id);
    blk[2 + j] = uchar(uint(lo | (hi << 4)) & 0xffu);
  }
}

/// Encodes a whole row as int8 symmetric: fp32 scale then head_dim codes.
inline void encode_int8(row_ref x, int head_dim, device uchar* row) {
  float amax = 0.0f;
  bool finite = true;
  for (int i = 0; i < head_dim; ++i) {
    const float v = row_value(x, i);
    finite = finite && kd::is_finite_f32(v);
    const float a = kd::abs_f32(v);
    amax = a > amax ? a : amax;
  }
  const float scale = finite ? kd::int8_scale(amax) : kd::f32_from_bits(kd::int8_poisoned_scale_bits);
  st_u32(row, kd::f32_bits(scale));
  const bool coded = finite && scale != 0.0f;
  for (int i = 0; i < head_dim; ++i)
    row[kd::int8_row_header_bytes + i] = coded ? uchar(uint(kd::int8_code(row_value(x, i), scale)) & 0xffu) : uchar(0);
}

/// Encodes group b (channels [b * gv, b * gv + gv), gv = min(G, head_dim)) of a row as a KIVI value
/// block: fp16 scale, fp16 min, packed codes; lanes past head_dim are padding with code 0.
inline void encode_kivi_value(row_ref x, int head_dim, int b, int group, int bits, device uchar* row) {
  const int gv = imin(group, head_dim);
  const int c0 = b * gv;
  const int n = imin(gv, head_dim - c0);
  const int code_bytes = (gv * bits + 7) / 8;
  device uchar* blk = row + ulong(b) * ulong(kd::kivi_group_header_bytes + code_bytes);
  kd::kivi_range r = kd::kivi_range_empty();
  for (int i = 0; i < n; ++i) r = kd::kivi_range_add(r, row_value(x, c0 + i));
  const kd::kivi_header h = kd::kivi_make_header(r, bits);
  st_u16(blk, h.scale);
  st_u16(blk + 2, h.min);
  const float s = kd::f16_bits_to_f32(h.scale);
  const float m = kd::f16_bits_to_f32(h.min);
  const int per_byte = 8 / bits;
  for (int j = 0; j < code_bytes; ++j) {
    kd::u8 byte = 0;
    for (int k = 0; k < per_byte && r.finite; ++k) {
      const int i = j * per_byte + k;
      if (i < n) byte = kd::kivi_pack(byte, kd::kivi_code(row_value(x, c0 + i), s, m, bits), i, bits);
    }
    blk[kd::kivi_group_header_bytes + j] = uchar(byte);
  }
}

/// Encodes block b of a row of a row codec into `row`, the row's first byte.
inline void encode_block(int codec, row_ref x, int head_dim, int b, constant kvq_metal_region& r, device uchar* row) {
  switch (codec) {
    case kvq_metal_f32:
      ((device uint*)row)[b] = kd::f32_bits(row_value(x, b));
      break;
    case kvq_metal_f16:
      ((device ushort*)row)[b] = ushort(kd::f32_to_f16_bits(row_value(x, b)));
      break;
    case kvq_metal_q8_0:
      encode_q8_0(x, head_dim, b, row + ulong(b) * sizeof(kd::block_q8_0));
      break;
    case kvq_metal_q4_0:
      encode_q4_0(x, head_dim, b, row + ulong(b) * sizeof(kd::block_q4_0));
      break;
    case kvq_metal_int8:
      encode_int8(x, head_dim, row);
      break;
    case kvq_metal_fp8_e4m3:
      row[b] = uchar(kd::f32_to_e4m3_scaled(row_value(x, b), r.fp8_scale, r.fp8_saturate != 0));
      break;
    case kvq_metal_fp8_e5m2:
      row[b] = uchar(kd::f32_to_e5m2_scaled(row_value(x, b), r.fp8_scale, r.fp8_saturate != 0));
      break;
    default:  // KIVI values
      encode_kivi_value(x, head_dim, b, r.group, kivi_bits(codec), row);
      break;
  }
}

// ------------------------------------------------------------------------------------------------
// Decoders: one element (token t, channel c) of a kv_head's region.

/// Channel c of an encoded row of a row codec.
inline float decode_row_element(int codec, device const uchar* row, int head_dim, int c, constant kvq_metal_region& r) {
  switch (codec) {
    case kvq_metal_f32:
      return ((device const float*)row)[c];
    case kvq_metal_f16:
      return kd::f16_bits_to_f32(kd::u16(((device const ushort*)row)[c]));
    case kvq_metal_q8_0: {
      device const uchar* blk = row + ulong(c / 32) * sizeof(kd::block_q8_0);
      return kd::q8_0_value(sext8(blk[2 + c % 32]), kd::f16_bits_to_f32(kd::u16(ld_u16(blk))));
    }
    case kvq_metal_q4_0: {
      device const uchar* blk = row + ulong(c / 32) * sizeof(kd::block_q4_0);
      const int j = c % 32;
      const int nibble = j < 16 ? int(blk[2 + j] & 0x0fu) : int(blk[2 + j - 16] >> 4);
      return kd::q4_0_value(nibble, kd::f16_bits_to_f32(kd::u16(ld_u16(blk))));
    }
    case kvq_metal_int8:
      return kd::int8_value(sext8(row[kd::int8_row_header_bytes + c]), kd::f32_from_bits(ld_u32(row)));
    case kvq_metal_fp8_e4m3:
      return kd::e4m3_to_f32_scaled(kd::u8(row[c]), r.fp8_scale);
    case kvq_metal_fp8_e5m2:
      return kd::e5m2_to_f32_scaled(kd::u8(row[c]), r.fp8_scale);
    default: {  // KIVI values
      const int bits = kivi_bits(codec);
      const int gv = imin(r.group, head_dim);
      const int lane = c % gv;
      device const uchar* blk = row + ulong(c / gv) * ulong(kd::kivi_group_header_bytes + (gv * bits + 7) / 8);
      const int q =
          kd::kivi_unpack(kd::u8(blk[kd::kivi_group_header_bytes + kd::kivi_code_byte(lane, bits)]), lane, bits);
      return kd::kivi_value(q, kd::f16_bits_to_f32(kd::u16(ld_u16(blk))),
                            kd::f16_bits_to_f32(kd::u16(ld_u16(blk + 2))));
    }
  }
}

/// Channel c of token t of the kv_head whose region starts at `reg`: an encoded row, a KIVI key
/// tile, or an f16 residual row (t >= r.quantized).
inline float decode_element(int codec, device const uchar* reg, constant kvq_metal_region& r, int head_dim, int t,
                            int c) {
  if (t >= r.quantized) {
    const int row = (r.residual_first + (t - r.quantized)) % r.residual_rows;
    device const ushort* res = (device const ushort*)(reg + r.residual_offset);
    return kd::f16_bits_to_f32(kd::u16(res[ulong(row) * ulong(head_dim) + ulong(c)]));
  }
  if (is_kivi_key(codec)) {
    const int bits = kivi_bits(codec);
    const int g = r.group;
    const int tt = t % g;
    device const uchar* tile = reg + ulong(t / g) * r.unit_bytes;
    const float s = kd::f16_bits_to_f32(kd::u16(ld_u16(tile + 2 * c)));
    const float m = kd::f16_bits_to_f32(kd::u16(ld_u16(tile + 2 * (head_dim + c))));
    device const uchar* codes = tile + ulong(kd::kivi_group_header_bytes * head_dim) + ulong(g * bits / 8) * ulong(c);
    const int q = kd::kivi_unpack(kd::u8(codes[kd::kivi_code_byte(tt, bits)]), tt, bits);
    return kd::kivi_value(q, s, m);
  }
  return decode_row_element(codec, reg + ulong(t) * r.unit_bytes, head_dim, c, r);
}

/// Integer dot product of block b of a q8_0/q4_0 key row with a q8_0 query block (codes qc,
/// scale dq), in ggml's order and rounding (as kvq::detail::dot_block).
inline float block_dot(int codec, device const uchar* row, int b, threadgroup const int8_t* qc, float dq) {
  int sumi = 0;
  if (codec == kvq_metal_q8_0) {
    device const uchar* blk = row + ulong(b) * sizeof(kd::block_q8_0);
    for (int j = 0; j < 32; ++j) sumi += sext8(blk[2 + j]) * int(qc[j]);
    const float dk = kd::f16_bits_to_f32(kd::u16(ld_u16(blk)));
    return kd::mul_rn(float(sumi), kd::mul_rn(dk, dq));
  }
  device const uchar* blk = row + ulong(b) * sizeof(kd::block_q4_0);
  for (int j = 0; j < 16; ++j) {
    const int byte = int(blk[2 + j]);
    sumi += ((byte & 0x0f) - 8) * int(qc[j]);
    sumi += ((byte >> 4) - 8) * int(qc[j + 16]);
  }
  const float dk = kd::f16_bits_to_f32(kd::u16(ld_u16(blk)));
  return kd::mul_rn(kd::mul_rn(float(sumi), dk), dq);
}

}  // namespace kvq_msl

// ------------------------------------------------------------------------------------------------
// Write kernels.

/// dst unit (first + i) of kv_head h = encode(batch row i of h), block gid.x; gid.y = h * count + i.
kernel void kvq_encode_rows(constant kvq_metal_write_args& a [[buffer(0)]], device uchar* layer [[buffer(1)]],
                            device const uchar* input [[buffer(2)]], uint2 gid [[thread_position_in_grid]]) {
  const int b = int(gid.x);
  const int r = int(gid.y);
  if (b >= a.blocks || r >= a.count * a.kv_heads) return;
  const int h = r / a.count;
  const int i = r % a.count;
  const kvq_msl::row_ref x = kvq_msl::batch_row(a, layer, input, h, i);
  device uchar* row = kvq_msl::region_ptr(layer, a.dst, h) + ulong(a.first + i) * a.dst.unit_bytes;
  kvq_msl::encode_block(kvq_codec, x, a.head_dim, b, a.dst, row);
}

/// KIVI key tile (first + j) of kv_head h, channel c = gid.x: the G batch rows [jG, jG + G) of h
/// quantized per channel; gid.y = h * tiles + j.
kernel void kvq_encode_key_tiles(constant kvq_metal_write_args& a [[buffer(0)]], device uchar* layer [[buffer(1)]],
                                 device const uchar* input [[buffer(2)]], uint2 gid [[thread_position_in_grid]]) {
  namespace kd = kvq::detail;
  const int g = a.dst.group;
  const int tiles = a.count / g;
  const int c = int(gid.x);
  const int r = int(gid.y);
  if (c >= a.head_dim || r >= tiles * a.kv_heads) return;
  const int h = r / tiles;
  const int j = r % tiles;
  const int bits = kvq_msl::kivi_bits(kvq_codec);
  device uchar* tile = kvq_msl::region_ptr(layer, a.dst, h) + ulong(a.first + j) * a.dst.unit_bytes;
  kd::kivi_range range = kd::kivi_range_empty();
  for (int t = 0; t < g; ++t)
    range = kd::kivi_range_add(range, kvq_msl::row_value(kvq_msl::batch_row(a, layer, input, h, j * g + t), c));
  const kd::kivi_header hd = kd::kivi_make_header(range, bits);
  kvq_msl::st_u16(tile + 2 * c, hd.scale);
  kvq_msl::st_u16(tile + 2 * (a.head_dim + c), hd.min);
  const float s = kd::f16_bits_to_f32(hd.scale);
  const float m = kd::f16_bits_to_f32(hd.min);
  const int code_bytes = g * bits / 8;
  const int per_byte = 8 / bits;
  device uchar* codes = tile + ulong(kd::kivi_group_header_bytes * a.head_dim) + ulong(code_bytes) * ulong(c);
  for (int k = 0; k < code_bytes; ++k) {
    kd::u8 byte = 0;
    for (int e = 0; e < per_byte && range.finite; ++e) {
      const int t = k * per_byte + e;
      const float v = kvq_msl::row_value(kvq_msl::batch_row(a, layer, input, h, j * g + t), c);
      byte = kd::kivi_pack(byte, kd::kivi_code(v, s, m, bits), t, bits);
    }
    codes[k] = uchar(byte);
  }
}

/// f16 residual row (first + i) % residual_rows of kv_head h, channel gid.x = f16(batch row i of h);
/// gid.y = h * count + i.
kernel void kvq_store_f16_rows(constant kvq_metal_write_args& a [[buffer(0)]], device uchar* layer [[buffer(1)]],
                               device const uchar* input [[buffer(2)]], uint2 gid [[thread_position_in_grid]]) {
  const int c = int(gid.x);
  const int r = int(gid.y);
  if (c >= a.head_dim || r >= a.count * a.kv_heads) return;
  const int h = r / a.count;
  const int i = r % a.count;
  const int row = (a.first + i) % a.dst.residual_rows;
  const float v = kvq_msl::row_value(kvq_msl::batch_row(a, layer, input, h, i), c);
  device ushort* res = (device ushort*)(kvq_msl::region_ptr(layer, a.dst, h) + a.dst.residual_offset);
  res[ulong(row) * ulong(a.head_dim) + ulong(c)] = ushort(kvq::detail::f32_to_f16_bits_satfinite(v));
}

// ------------------------------------------------------------------------------------------------
// Read kernel.

/// out[i * out_stride + c] = token (first + i), channel c of kv_head `head`; gid = (c, i).
kernel void kvq_decode(constant kvq_metal_decode_args& a [[buffer(0)]], device const uchar* layer [[buffer(1)]],
                       device uchar* out [[buffer(2)]], uint2 gid [[thread_position_in_grid]]) {
  const int c = int(gid.x);
  const int i = int(gid.y);
  if (c >= a.head_dim || i >= a.count) return;
  const float v =
      kvq_msl::decode_element(kvq_codec, kvq_msl::region_ptr(layer, a.src, a.head), a.src, a.head_dim, a.first + i, c);
  const ulong o = ulong(i) * a.out_stride + ulong(c);
  if (a.out_type == kvq_metal_elem_f32) {
    ((device float*)out)[o] = v;
  } else if (a.out_type == kvq_metal_elem_f16) {
    ((device ushort*)out)[o] = ushort(kvq::detail::f32_to_f16_bits(v));
  } else if (a.out_type == kvq_metal_elem_f16_sat) {
    ((device ushort*)out)[o] = ushort(kvq::detail::f32_to_f16_bits_satfinite(v));
  } else {
    ((device ushort*)out)[o] = ushort(kvq::detail::f32_to_bf16_bits(v));
  }
}

// ------------------------------------------------------------------------------------------------
// Decode attention.

/// Partial attention of `heads` query heads of one kv_head over one split of the context.
///
///   o[g] = sum_t exp(s[g,t] - m[g]) * V[t],  l[g] = sum_t exp(s[g,t] - m[g]),  m[g] = max_t s[g,t]
///   s[g,t] = scale * q[g]·K[t] (soft-capped), t in the split; written unnormalised per split.
/// Per tile of `tile` tokens: the threadgroup decodes the keys once into threadgroup memory, each
/// SIMD-group computes whole logits (lanes over head_dim, simd_sum), then one SIMD-group per head
/// updates the online softmax (simd_max, simd_sum), and each thread accumulates P·V for its
/// channels, decoding every value element once for all the heads of the threadgroup.
/// NaN/Inf as kvq::attend_range: NaN or +Inf logits make the head NaN, -Inf logits weigh 0.
kernel void kvq_attention_partial(
    constant kvq_metal_attention_args& a [[buffer(0)]], device const uchar* key_layer [[buffer(1)]],
    device const uchar* value_layer [[buffer(2)]], device const float* query [[buffer(3)]],
    device float* part_out [[buffer(4)]], device float* part_max [[buffer(5)]], device float* part_sum [[buffer(6)]],
    threadgroup float* smem KVQ_METAL_THREADGROUP_BUFFER(0), uint2 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]], uint threads [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]], uint sg [[simdgroup_index_in_threadgroup]],
    uint simdgroups [[simdgroups_per_threadgroup]], uint width [[threads_per_simdgroup]]) {
  namespace kd = kvq::detail;
  const int hd = a.head_dim;
  const int group = a.q_heads / a.kv_heads;
  const int kv = int(tg.y) / a.chunks;
  const int g0 = (int(tg.y) % a.chunks) * a.heads;
  const int nh = kvq_msl::imin(a.heads, group - g0);
  const int h0 = kv * group + g0;
  const int split = int(tg.x);
  const int t_begin = a.begin + split * a.split_tokens;
  const int t_end = kvq_msl::imin(a.end, t_begin + a.split_tokens);
  const int T = a.tile;
  const int nb = (hd + 31) / 32;
  const int it = int(tid);
  const int nt = int(threads);
  const int il = int(lane);
  const int nw = int(width);
  const int kcodec = kvq_codec;
  const int vcodec = kvq_value_codec;
  const bool int_dot = a.query_q8_0 != 0 && (kcodec == kvq_metal_q8_0 || kcodec == kvq_metal_q4_0);
  const float ninf = kvq_msl::neg_inf();

  const kvq_metal_attention_smem L = kvq_metal_attention_layout(hd, T, a.heads, a.query_q8_0);
  threadgroup float* q_s = smem + L.q;                                // (heads, hd)
  threadgroup float* o_s = smem + L.o;                                // (heads, hd)
  threadgroup float* k_s = smem + L.k;                                // (T, hd)
  threadgroup float* p_s = smem + L.p;                                // (heads, T)
  threadgroup float* w_s = smem + L.w;                                // (heads, T)
  threadgroup float* m_s = smem + L.m;                                // (heads)
  threadgroup float* l_s = smem + L.l;                                // (heads)
  threadgroup float* c_s = smem + L.corr;                             // (heads)
  threadgroup float* qd_s = smem + L.qd;                              // (heads, nb)
  threadgroup int8_t* qc_s = (threadgroup int8_t*)(smem + L.qcodes);  // (heads, nb, 32)
  device const uchar* kreg = kvq_msl::region_ptr(key_layer, a.key, kv);
  device const uchar* vreg = kvq_msl::region_ptr(value_layer, a.value, kv);

  // The query heads of this threadgroup: as given, or rounded to q8_0 blocks (kept as codes too).
  if (a.query_q8_0 != 0) {
    for (int w = it; w < nh * nb; w += nt) {
      const int g = w / nb;
      const int b = w % nb;
      kvq_msl::row_ref x;
      x.p = (device const uchar*)(query + ulong(h0 + g) * ulong(hd));
      x.type = kvq_metal_elem_f32;
      x.round = 0;
      const int c0 = 32 * b;
      const int n = kvq_msl::imin(32, hd - c0);
      bool finite = true;
      const float d = kvq_msl::q8_0_block_scale(x, c0, n, finite);
      const float id = finite ? kd::ggml_inverse_scale(d) : 0.0f;
      const float dq = kd::f16_bits_to_f32(finite ? kd::f32_to_f16_bits(d) : kd::poisoned_f16_scale);
      qd_s[g * nb + b] = dq;
      for (int j = 0; j < 32; ++j) {
        const int code = (finite && j < n) ? kd::q8_0_code(kvq_msl::row_value(x, c0 + j), id) : 0;
        qc_s[(g * nb + b) * 32 + j] = int8_t(code);
        if (j < n) q_s[g * hd + c0 + j] = kd::q8_0_value(code, dq);
      }
    }
  } else {
    for (int w = it; w < nh * hd; w += nt) q_s[w] = query[ulong(h0) * ulong(hd) + ulong(w)];
  }
  for (int w = it; w < nh * hd; w += nt) o_s[w] = 0.0f;
  for (int w = it; w < nh; w += nt) {
    m_s[w] = ninf;
    l_s[w] = 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (int t0 = t_begin; t0 < t_end; t0 += T) {
    const int n = kvq_msl::imin(T, t_end - t0);

    // Keys of the tile, decoded once for all heads.
    if (!int_dot) {
      for (int w = it; w < n * hd; w += nt)
        k_s[w] = kvq_msl::decode_element(kcodec, kreg, a.key, hd, t0 + w / hd, w % hd);
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    // Logits: one SIMD-group per (head, token), lanes over channels (or q8_0 blocks).
    for (int pr = int(sg); pr < nh * n; pr += int(simdgroups)) {
      const int g = pr / n;
      const int i = pr % n;
      float part = 0.0f;
      if (int_dot) {
        device const uchar* row = kreg + ulong(t0 + i) * a.key.unit_bytes;
        for (int b = il; b < nb; b += nw)
          part += kvq_msl::block_dot(kcodec, row, b, qc_s + (g * nb + b) * 32, qd_s[g * nb + b]);
      } else {
        for (int c = il; c < hd; c += nw) part += q_s[g * hd + c] * k_s[i * hd + c];
      }
      const float dot = simd_sum(part);
      if (il == 0) {
        float s = dot * a.scale;
        if (a.softcap > 0.0f) s = a.softcap * precise::tanh(s / a.softcap);
        p_s[g * T + i] = s;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // Online softmax, as kvq::attend_range goes token by token: one SIMD-group per head, lanes
    // over the tile's tokens. Token i's probability is taken against the running max after it,
    // m_i = max(m, s_0 .. s_i), exactly where the reference takes it (so probabilities rounded to
    // f16 are rounded at the same values), then rescaled by exp(m_i - m_new) to the tile's max.
    for (int g = int(sg); g < nh; g += int(simdgroups)) {
      const float m_old = m_s[g];
      float mloc = ninf;
      for (int i = il; i < n; i += nw) {
        const float s = p_s[g * T + i];
        mloc = s > mloc ? s : mloc;  // NaN logits take no part in the max
      }
      const float mt = simd_max(mloc);
      const float m_new = mt > m_old ? mt : m_old;
      float lsum = 0.0f;
      for (int i = il; i < n; i += nw) {
        float mi = m_old;
        for (int j = 0; j <= i; ++j) {
          const float sj = p_s[g * T + j];
          mi = sj > mi ? sj : mi;
        }
        const float s = p_s[g * T + i];
        const float p = s == ninf ? 0.0f : precise::exp(s - mi);  // NaN for NaN or +Inf logits
        const float pv = a.probs_f16 != 0 ? kvq_msl::round_f16(p) : p;
        const float rescale = (p == 0.0f || mi == m_new) ? 1.0f : precise::exp(mi - m_new);
        lsum += p * rescale;
        w_s[g * T + i] = pv * rescale;
      }
      const float tsum = simd_sum(lsum);
      if (il == 0) {
        const float corr = m_new == m_old ? 1.0f : (m_old == ninf ? 0.0f : precise::exp(m_old - m_new));
        c_s[g] = corr;
        l_s[g] = l_s[g] * corr + tsum;
        m_s[g] = m_new;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // P·V: each thread owns channels; every value element is decoded once for all heads.
    for (int c = it; c < hd; c += nt) {
      for (int g = 0; g < nh; ++g) o_s[g * hd + c] *= c_s[g];
      for (int i = 0; i < n; ++i) {
        const float v = kvq_msl::decode_element(vcodec, vreg, a.value, hd, t0 + i, c);
        for (int g = 0; g < nh; ++g) o_s[g * hd + c] += w_s[g * T + i] * v;
      }
    }
    // No barrier needed here: the next tile writes k_s and p_s, whose readers finished before the
    // logits barrier, and w_s and c_s only after its own logits barrier, which every thread
    // reaches after its P·V.
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // o_s channels are written out by other threads

  for (int w = it; w < nh * hd; w += nt)
    part_out[(ulong(split) * ulong(a.q_heads) + ulong(h0 + w / hd)) * ulong(hd) + ulong(w % hd)] = o_s[w];
  for (int w = it; w < nh; w += nt) {
    part_max[ulong(split) * ulong(a.q_heads) + ulong(h0 + w)] = m_s[w];
    part_sum[ulong(split) * ulong(a.q_heads) + ulong(h0 + w)] = l_s[w];
  }
}

/// out[h, c] = (merge over splits s, in order, of the partial states) normalised; heads that
/// attended nothing output 0. The merge is kvq::combine: rescale by exp(m_s - m).
kernel void kvq_attention_combine(constant kvq_metal_combine_args& a [[buffer(0)]],
                                  device const float* part_out [[buffer(1)]],
                                  device const float* part_max [[buffer(2)]],
                                  device const float* part_sum [[buffer(3)]], device float* out [[buffer(4)]],
                                  uint2 gid [[thread_position_in_grid]]) {
  namespace kd = kvq::detail;
  const int c = int(gid.x);
  const int h = int(gid.y);
  if (c >= a.head_dim || h >= a.q_heads) return;
  const float ninf = kvq_msl::neg_inf();
  float m = ninf;
  float l = 0.0f;
  float o = 0.0f;
  for (int s = 0; s < a.splits; ++s) {
    const ulong sh = ulong(s) * ulong(a.q_heads) + ulong(h);
    const float mb = part_max[sh];
    const float lb = part_sum[sh];
    if (mb == ninf && !kd::is_nan_f32(lb)) continue;  // the split attended nothing
    const float mm = (kd::is_nan_f32(m) || kd::is_nan_f32(mb)) ? kvq_msl::quiet_nan() : (mb > m ? mb : m);
    const float ca = m == ninf ? 0.0f : precise::exp(m - mm);
    const float cb = precise::exp(mb - mm);
    o = o * ca + part_out[sh * ulong(a.head_dim) + ulong(c)] * cb;
    l = l * ca + lb * cb;
    m = mm;
  }
  out[ulong(h) * ulong(a.head_dim) + ulong(c)] = l == 0.0f ? 0.0f : o * (1.0f / l);
}
