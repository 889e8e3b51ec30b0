// kvq: the bodies of kvq's GPU kernels, written once for CUDA, Metal and C++ (C++14 subset).
//
// Each function below is the work of one GPU thread (or, for the attention, of one block) over
// the arguments of core/kernel_args.h; the backends only wrap them in entry points that compute
// the thread's position: `__global__` kernels in backend/cuda/kernels.cuh, `kernel` functions in
// backend/metal/kernels.metal, and the host stand-ins of the tests, which run the very same code
// on the CPU. The codec math is the scalar reference's own (detail/*.h), so encoded bytes and
// decoded values are the CPU cache's by construction; the codec is a plain int that each backend
// makes a compile-time constant (a CUDA template argument, a Metal function constant), so the
// switches fold away.
//
// What the three languages do not share is kept to the macros below: the address space of a
// pointer (Metal requires `device` / `threadgroup` on every pointer into buffers or block-shared
// memory, C++ and CUDA have no such qualifier), the 64-bit integer type (Metal has `long`, no
// `long long`), exp/tanh (Metal's precise:: functions), the hardware fp8 conversions of CUDA
// sm_89+ (bit-identical to the software path) and the block barrier, which the attention takes
// from its `Threads` policy (see attention_block). No lambdas, no `if constexpr`, no exceptions.
//
// Rotated codecs (FORMATS.md §6.1) run their stored codec's bodies with the rotation R at the
// edges, as the CPU cache: the write kernels encode R x of every input row (residual rows are
// stored rotated), decode un-rotates on request (reads), and the attention rotates each query row
// once with the key side's seed and un-rotates each partial output row once with the value side's.
// Every rotated value is the one detail::rotate_forward_signs computes, bit for bit: the write and
// decode threads, which see one element or block, evaluate each coordinate they need through its
// own branch of the butterfly tree (rotated_coordinate: n - 1 rounded adds for a rotation block of
// n, in the butterflies' order), the attention whole rows in block-shared memory.
//
//   encode_rows_thread       one block of one row of a row codec (q8_0/q4_0: 32 channels; int8, tq: a
//                            row; f32/f16/fp8: a channel; KIVI values: a group of channels)
//   encode_key_tiles_thread  one channel of one KIVI key tile of G tokens
//   store_f16_rows_thread    one element of the KIVI key residual / value window (f16)
//   decode_thread            one element of a token range of one kv_head, to f32, f16 or bf16
//   attention_block          one block of flash-decoding attention: (split, kv_head and chunk of
//                            its rows: query tokens x query heads) of one sequence
//   combine_thread           merges the splits of one (sequence, row, channel), sinks included
// A `*_thread` function takes the linear index of its thread in a one-dimensional grid of
// write_step::threads (or the decode / combine count) threads and returns at once past the end.
#pragma once

#include "../detail/block_layouts.h"
#include "../detail/math_fp4.h"
#include "../detail/math_fp8.h"
#include "../detail/math_ggml.h"
#include "../detail/math_int8.h"
#include "../detail/math_kivi.h"
#include "../detail/math_tq.h"
#include "../detail/numeric.h"
#include "../detail/rotation.h"
#include "kernel_args.h"

#if !defined(__METAL_VERSION__)
#  include <math.h>
#endif

#if defined(__CUDACC__) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890)
#  include <cuda_fp8.h>
#  define KVQ_CUDA_HW_FP8 1
#endif

// Address spaces: Metal qualifies every pointer into buffers (`device`) and block-shared memory
// (`threadgroup`), and kernel arguments live in `constant` memory; C++ and CUDA need none of it.
#if defined(__METAL_VERSION__)
#  define KVQ_GLOBAL device
#  define KVQ_SHARED threadgroup
#  define KVQ_ARG(T) constant T&
#  define KVQ_THREAD thread
#else
#  define KVQ_GLOBAL
#  define KVQ_SHARED
#  define KVQ_ARG(T) T const&
#  define KVQ_THREAD
#endif

KVQ_NAMESPACE_BEGIN
namespace kernels {

namespace kd = ::kvq::detail;

#if defined(__METAL_VERSION__)
typedef long i64;  // Metal's 64-bit integer (it has no `long long`)
#else
typedef long long i64;
#endif
typedef kd::u8 u8;
typedef kd::u16 u16;

// ---- small helpers -------------------------------------------------------------------------------

/// Reads a little-endian u16 from any byte address.
KVQ_HOST_DEVICE unsigned ld_u16(KVQ_GLOBAL const u8* p) {
  return static_cast<unsigned>(p[0]) | (static_cast<unsigned>(p[1]) << 8);
}

/// Reads a little-endian u32 from any byte address.
KVQ_HOST_DEVICE unsigned ld_u32(KVQ_GLOBAL const u8* p) {
  return static_cast<unsigned>(p[0]) | (static_cast<unsigned>(p[1]) << 8) | (static_cast<unsigned>(p[2]) << 16) |
         (static_cast<unsigned>(p[3]) << 24);
}

/// Writes a little-endian u16 to any byte address.
KVQ_HOST_DEVICE void st_u16(KVQ_GLOBAL u8* p, unsigned v) {
  p[0] = static_cast<u8>(v & 0xffu);
  p[1] = static_cast<u8>((v >> 8) & 0xffu);
}

/// Writes a little-endian u32 to any byte address.
KVQ_HOST_DEVICE void st_u32(KVQ_GLOBAL u8* p, unsigned v) {
  p[0] = static_cast<u8>(v & 0xffu);
  p[1] = static_cast<u8>((v >> 8) & 0xffu);
  p[2] = static_cast<u8>((v >> 16) & 0xffu);
  p[3] = static_cast<u8>((v >> 24) & 0xffu);
}

/// The f16 value stored little-endian at p.
KVQ_HOST_DEVICE float ld_f16(KVQ_GLOBAL const u8* p) { return kd::f16_bits_to_f32(static_cast<u16>(ld_u16(p))); }

/// The signed value of a two's-complement byte.
KVQ_HOST_DEVICE int sext8(unsigned b) { return static_cast<int>(b & 0xffu) - static_cast<int>((b & 0x80u) << 1); }

KVQ_HOST_DEVICE int imin(int a, int b) { return a < b ? a : b; }

KVQ_HOST_DEVICE int imax(int a, int b) { return a > b ? a : b; }

KVQ_HOST_DEVICE float neg_inf() { return kd::f32_from_bits(0xff800000u); }

KVQ_HOST_DEVICE float quiet_nan() { return kd::f32_from_bits(0x7fc00000u); }

/// Rounds a float to f16 and back (round to nearest even; NaN stays NaN).
KVQ_HOST_DEVICE float round_f16(float x) { return kd::f16_bits_to_f32(kd::f32_to_f16_bits(x)); }

/// Rounds a float to f16 and back as the KIVI residual stores it: finite values saturate to ±65504.
KVQ_HOST_DEVICE float round_f16_satfinite(float x) { return kd::f16_bits_to_f32(kd::f32_to_f16_bits_satfinite(x)); }

/// e^x: the C library's expf on the host, CUDA's expf, Metal's precise::exp (never a fast form).
KVQ_HOST_DEVICE float exp_f32(float x) {
#if defined(__METAL_VERSION__)
  return metal::precise::exp(x);
#else
  return expf(x);
#endif
}

/// tanh(x), precise as exp_f32.
KVQ_HOST_DEVICE float tanh_f32(float x) {
#if defined(__METAL_VERSION__)
  return metal::precise::tanh(x);
#else
  return tanhf(x);
#endif
}

/// Bits of a tq codebook codec.
KVQ_HOST_DEVICE int tq_bits(int codec) { return codec - kvq_codec_tq2 + 2; }

KVQ_HOST_DEVICE bool is_tq(int codec) { return codec >= kvq_codec_tq2 && codec <= kvq_codec_tq4; }

/// Bits of a KIVI codec.
KVQ_HOST_DEVICE int kivi_bits(int codec) {
  return (codec == kvq_codec_kivi_key2 || codec == kvq_codec_kivi_value2)   ? 2
         : (codec == kvq_codec_kivi_key4 || codec == kvq_codec_kivi_value4) ? 4
                                                                            : 8;
}

KVQ_HOST_DEVICE bool is_kivi_key(int codec) { return codec >= kvq_codec_kivi_key2 && codec <= kvq_codec_kivi_key8; }

/// Bytes of one element of a kvq_elem_type.
KVQ_HOST_DEVICE i64 elem_bytes(int type) { return type == kvq_elem_f32 ? 4 : 2; }

/// Start of kv_head h's region in a layer allocation.
KVQ_HOST_DEVICE KVQ_GLOBAL u8* region_ptr(KVQ_GLOBAL u8* layer, kvq_region r, int h) {
  return layer + static_cast<i64>(r.head0) + static_cast<i64>(h) * static_cast<i64>(r.head_stride);
}
KVQ_HOST_DEVICE KVQ_GLOBAL const u8* region_ptr(KVQ_GLOBAL const u8* layer, kvq_region r, int h) {
  return layer + static_cast<i64>(r.head0) + static_cast<i64>(h) * static_cast<i64>(r.head_stride);
}
/// The f16 residual rows of kv_head h of region r in the allocation at `layer`.
KVQ_HOST_DEVICE KVQ_GLOBAL u8* residual_ptr(KVQ_GLOBAL u8* layer, kvq_region r, int h) {
  return layer + static_cast<i64>(r.residual0) + static_cast<i64>(h) * static_cast<i64>(r.residual_stride);
}
KVQ_HOST_DEVICE KVQ_GLOBAL const u8* residual_ptr(KVQ_GLOBAL const u8* layer, kvq_region r, int h) {
  return layer + static_cast<i64>(r.residual0) + static_cast<i64>(h) * static_cast<i64>(r.residual_stride);
}

// ---- fp8: hardware where it matches the shared software path bit for bit ------------------------

/// E4M3FN code of x / scale (detail/math_fp8.h). On CUDA sm_89 and later the saturating conversion
/// of a non-NaN quotient is the hardware `cvt.rn.satfinite.e4m3x2.f32`, which rounds to nearest
/// even and clamps overflow and ±Inf to ±448 exactly as the software path; NaN (which the hardware
/// may encode with its sign) and the non-saturating mode take the software path.
KVQ_HOST_DEVICE u8 fp8_e4m3_encode(float x, float scale, bool saturate) {
#if defined(KVQ_CUDA_HW_FP8)
  const float y = kd::div_rn(x, scale);
  if (saturate && !kd::is_nan_f32(y)) return static_cast<u8>(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3));
  return kd::f32_to_e4m3(y, saturate);
#else
  return kd::f32_to_e4m3_scaled(x, scale, saturate);
#endif
}

/// E5M2 code of x / scale (see fp8_e4m3_encode; saturating maximum 57344).
KVQ_HOST_DEVICE u8 fp8_e5m2_encode(float x, float scale, bool saturate) {
#if defined(KVQ_CUDA_HW_FP8)
  const float y = kd::div_rn(x, scale);
  if (saturate && !kd::is_nan_f32(y)) return static_cast<u8>(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E5M2));
  return kd::f32_to_e5m2(y, saturate);
#else
  return kd::f32_to_e5m2_scaled(x, scale, saturate);
#endif
}

/// Value of an E4M3FN code times scale. On CUDA sm_89 and later a finite code is widened by the
/// exact hardware fp8 -> f16 conversion; NaN codes take the software path (kvq's canonical NaN).
KVQ_HOST_DEVICE float fp8_e4m3_decode(u8 code, float scale) {
#if defined(KVQ_CUDA_HW_FP8)
  if ((code & 0x7fu) != 0x7fu) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
    return kd::mul_rn(kd::f16_bits_to_f32(static_cast<u16>(h.x)), scale);
  }
#endif
  return kd::e4m3_to_f32_scaled(code, scale);
}

/// Value of an E5M2 code times scale (E5M2 is the top byte of an f16: a shift, on every device).
KVQ_HOST_DEVICE float fp8_e5m2_decode(u8 code, float scale) { return kd::e5m2_to_f32_scaled(code, scale); }

// ---- rows of input ---------------------------------------------------------------------------------

/// A row of head_dim input values: its first element, element type, whether values pass through
/// f16 first, whether the row is rotated by R (seed) first and the key mean subtracted before that
/// (centered keys; null: none), and, for a rotated row, R x already computed by the calling
/// thread (rotate_input_row; null: each coordinate is computed alone). Rows of an f16 residual are
/// rows of type f16 (stored centered and rotated: never again).
struct row_ref {
  KVQ_GLOBAL const u8* p;
  int type;
  int round;
  int rotate;
  int head_dim;
  kd::u64 seed;
  KVQ_GLOBAL const float* mean;
  KVQ_THREAD const float* rotated;
};

/// Channel c of a row widened to f32, less the key mean where the row has one (x - mu, one
/// rounding, as the CPU cache's centered rows). Rows are aligned to their element type (user
/// input, f16 residual rows): typed loads.
KVQ_HOST_DEVICE float input_value(row_ref r, int c) {
  float x = 0.0f;
  if (r.type == kvq_elem_f32) {
    x = reinterpret_cast<KVQ_GLOBAL const float*>(r.p)[c];
  } else {
    const u16 h = reinterpret_cast<KVQ_GLOBAL const u16*>(r.p)[c];
    x = r.type == kvq_elem_f16 ? kd::f16_bits_to_f32(h) : kd::bf16_bits_to_f32(h);
  }
  return r.mean != nullptr ? kd::add_rn(x, -r.mean[c]) : x;
}

// ---- the rotation R (FORMATS.md §6.1) --------------------------------------------------------------

/// Output c (0 <= c < n) of the butterfly stages h = 1, 2, ..., n/2 of one rotation block of n
/// leaves (leaves.at(j), j = 0, 1, ... in turn), computed alone: the stages pair (u_i, u_(i+h))
/// into (u_i + u_(i+h), u_i - u_(i+h)), so output c is a binary tree over the leaves in index
/// order whose node at stage h adds or subtracts (bit h of c) its upper half to its lower half.
/// The tree is walked leaf by leaf with a stack of partial results (at most log2(n) + 1 of them),
/// each node the same rounded add as in detail::rotation_butterflies, so the result is theirs bit
/// for bit.
template <class Leaves>
KVQ_HOST_DEVICE float butterfly_output(Leaves leaves, int n, int c) {
  float stack[20] = {};  // head_dim <= 65536: blocks of at most 2^16 leaves
  int top = 0;
  for (int j = 0; j < n; ++j) {
    float v = leaves.at(j);
    for (int k = 0; ((j >> k) & 1) != 0; ++k) {
      const float lower = stack[--top];
      v = ((c >> k) & 1) != 0 ? kd::add_rn(lower, -v) : kd::add_rn(lower, v);
    }
    stack[top++] = v;
  }
  return stack[0];
}

/// The sign word of channel i under `seed`, computed once per 64 channels: `index` is the word
/// held in `word` (-1: none yet).
struct sign_words {
  kd::u64 seed;
  int index;
  kd::u64 word;
  KVQ_HOST_DEVICE float apply(float x, int i) {
    if (i / 64 != index) {
      index = i / 64;
      word = kd::rotation_sign_word(seed, index);
    }
    return kd::rotation_apply_sign(x, word, i % 64);
  }
};

KVQ_HOST_DEVICE sign_words make_sign_words(kd::u64 seed) {
  sign_words s;
  s.seed = seed;
  s.index = -1;
  s.word = 0;
  return s;
}

/// The leaves of R x over the rotation block at channel o of an input row: s_i x_i.
struct input_leaves {
  row_ref x;
  int o;
  sign_words signs;
  KVQ_HOST_DEVICE float at(int j) { return signs.apply(input_value(x, o + j), o + j); }
};

/// Channel c of R x for an input row x, as detail::rotate_forward_signs: the butterflies of c's
/// rotation block over s_i x_i, times c_n.
KVQ_HOST_DEVICE float rotated_coordinate(row_ref x, int c) {
  const int o = kd::rotation_block_start(x.head_dim, c);
  const int n = kd::rotation_block_size(x.head_dim, o);
  input_leaves leaves;
  leaves.x = x;
  leaves.o = o;
  leaves.signs = make_sign_words(x.seed);
  return kd::mul_rn(butterfly_output(leaves, n, c - o), kd::rotation_scale(n));
}

/// The butterfly stages h = 1, 2, ..., n/2 of every rotation block of a row x (head_dim), each block
/// then times c_n, in place, as detail::rotation_butterflies; `Row` is a pointer into the memory
/// that holds the row (block-shared or the thread's own).
template <class Row>
KVQ_HOST_DEVICE void rotation_blocks(Row x, int head_dim) {
  for (int o = 0; o < head_dim;) {
    const int n = kd::rotation_block_size(head_dim, o);
    Row u = x + o;
    for (int h = 1; h < n; h *= 2)
      for (int s = 0; s < n; s += 2 * h)
        for (int i = s; i < s + h; ++i) {
          const float a = u[i];
          const float b = u[i + h];
          u[i] = kd::add_rn(a, b);
          u[i + h] = kd::add_rn(a, -b);
        }
    const float cn = kd::rotation_scale(n);
    for (int i = 0; i < n; ++i) u[i] = kd::mul_rn(u[i], cn);
    o += n;
  }
}

/// Applies R (inverse false) or R^T (inverse true) to a row x: (head_dim) in block-shared memory,
/// as detail::rotate_forward_signs / rotate_inverse_signs: signs, butterflies per rotation block,
/// times c_n (R^T: the signs last).
KVQ_HOST_DEVICE void rotate_shared_row(KVQ_SHARED float* x, int head_dim, kd::u64 seed, bool inverse) {
  sign_words signs = make_sign_words(seed);
  if (!inverse)
    for (int i = 0; i < head_dim; ++i) x[i] = signs.apply(x[i], i);
  rotation_blocks(x, head_dim);
  if (inverse)
    for (int i = 0; i < head_dim; ++i) x[i] = signs.apply(x[i], i);
}

/// Value of channel c of a row, as the CPU cache reads it: widened to f32, rotated (a rotated
/// codec's input row), then f16-rounded for KIVI.
KVQ_HOST_DEVICE float row_value(row_ref r, int c) {
  const float x = r.rotate == 0 ? input_value(r, c) : (r.rotated != nullptr ? r.rotated[c] : rotated_coordinate(r, c));
  return r.round != 0 ? round_f16_satfinite(x) : x;
}

/// Batch row i of kv_head h of a write kernel (see kvq_source).
KVQ_HOST_DEVICE row_ref batch_row(KVQ_ARG(kvq_write_args) a, KVQ_GLOBAL const u8* layer, KVQ_GLOBAL const u8* input,
                                  int h, int i) {
  row_ref r;
  if (i < a.src.from_residual) {
    const int row = (a.src.residual_first + i) % a.dst.residual_rows;
    r.p = residual_ptr(layer, a.dst, h) + static_cast<i64>(row) * static_cast<i64>(a.head_dim) * 2;
    r.type = kvq_elem_f16;
    r.round = 0;
    r.rotate = 0;      // stored rotated
    r.mean = nullptr;  // stored centered
  } else {
    const i64 token = static_cast<i64>(a.src.first + i - a.src.from_residual);
    r.p = input +
          (token * static_cast<i64>(a.src.token_stride) + static_cast<i64>(h) * static_cast<i64>(a.src.head_stride)) *
              elem_bytes(a.src.type);
    r.type = a.src.type;
    r.round = a.src.round_f16;
    r.rotate = a.src.rotate;
    r.mean = a.src.mean != 0 ? reinterpret_cast<KVQ_GLOBAL const float*>(layer + static_cast<i64>(a.src.mean0)) +
                                   static_cast<i64>(h) * a.head_dim
                             : nullptr;
  }
  r.head_dim = a.head_dim;
  r.seed = a.dst.rotation_seed;
  r.rotated = nullptr;
  return r;
}

/// Widest row whose rotation a write thread computes whole into its own memory (head_dim log2
/// head_dim adds, once) instead of coordinate by coordinate (head_dim adds per coordinate read).
#define KVQ_ROTATED_ROW_MAX 256

/// Fills out (x.head_dim <= KVQ_ROTATED_ROW_MAX) with R x for a rotated input row x, every channel
/// bit for bit rotated_coordinate's: the signs, then the butterflies of each rotation block.
KVQ_HOST_DEVICE void rotate_input_row(row_ref x, KVQ_THREAD float* out) {
  sign_words signs = make_sign_words(x.seed);
  for (int i = 0; i < x.head_dim; ++i) out[i] = signs.apply(input_value(x, i), i);
  rotation_blocks(out, x.head_dim);
}

// ---- encoders ----------------------------------------------------------------------------------

/// Encodes block b (channels [32b, 32b + 32)) of a row as ggml block_q8_0 at blk (34 bytes); lanes
/// past head_dim are padding with code 0. As q8_0::encode_block.
KVQ_HOST_DEVICE void encode_q8_0(row_ref x, int head_dim, int b, KVQ_GLOBAL u8* blk) {
  const int c0 = 32 * b;
  const int n = imin(32, head_dim - c0);
  float amax = 0.0f;
  bool finite = true;
  for (int j = 0; j < n; ++j) {
    const float v = row_value(x, c0 + j);
    finite = finite && kd::is_finite_f32(v);
    const float av = kd::abs_f32(v);
    amax = av > amax ? av : amax;
  }
  if (!finite) {
    st_u16(blk, kd::poisoned_f16_scale);
    for (int j = 0; j < 32; ++j) blk[2 + j] = 0;
    return;
  }
  const float d = kd::q8_0_scale(amax);
  const float id = kd::ggml_inverse_scale(d);
  st_u16(blk, kd::f32_to_f16_bits(d));
  for (int j = 0; j < 32; ++j)
    blk[2 + j] = j < n ? static_cast<u8>(static_cast<unsigned>(kd::q8_0_code(row_value(x, c0 + j), id)) & 0xffu) : 0;
}

/// Encodes block b of a row as ggml block_q4_0 at blk (18 bytes). As q4_0::encode_block.
KVQ_HOST_DEVICE void encode_q4_0(row_ref x, int head_dim, int b, KVQ_GLOBAL u8* blk) {
  const int c0 = 32 * b;
  const int n = imin(32, head_dim - c0);
  float amax = 0.0f;
  float mx = 0.0f;
  bool finite = true;
  for (int j = 0; j < n; ++j) {
    const float v = row_value(x, c0 + j);
    finite = finite && kd::is_finite_f32(v);
    const float av = kd::abs_f32(v);
    if (amax < av) {
      amax = av;
      mx = v;
    }
  }
  if (!finite) {
    st_u16(blk, kd::poisoned_f16_scale);
    for (int j = 0; j < 16; ++j) blk[2 + j] = 0x88;
    return;
  }
  const float d = kd::q4_0_scale(mx);
  const float id = kd::ggml_inverse_scale(d);
  st_u16(blk, kd::f32_to_f16_bits(d));
  for (int j = 0; j < 16; ++j) {
    const int lo = kd::q4_0_code(j < n ? row_value(x, c0 + j) : 0.0f, id);
    const int hi = kd::q4_0_code(j + 16 < n ? row_value(x, c0 + j + 16) : 0.0f, id);
    blk[2 + j] = static_cast<u8>(static_cast<unsigned>(lo | (hi << 4)) & 0xffu);
  }
}

/// Encodes a whole row as int8 symmetric (fp32 scale, then head_dim codes). As int8_sym::encode_row.
KVQ_HOST_DEVICE void encode_int8(row_ref x, int head_dim, KVQ_GLOBAL u8* row) {
  float amax = 0.0f;
  bool finite = true;
  for (int i = 0; i < head_dim; ++i) {
    const float v = row_value(x, i);
    finite = finite && kd::is_finite_f32(v);
    const float av = kd::abs_f32(v);
    amax = av > amax ? av : amax;
  }
  const float scale = finite ? kd::int8_scale(amax) : kd::f32_from_bits(kd::int8_poisoned_scale_bits);
  st_u32(row, kd::f32_bits(scale));
  const bool coded = finite && scale != 0.0f;
  for (int i = 0; i < head_dim; ++i)
    row[kd::int8_row_header_bytes + i] =
        coded ? static_cast<u8>(static_cast<unsigned>(kd::int8_code(row_value(x, i), scale)) & 0xffu) : 0;
}

/// Encodes group b (channels [b gv, b gv + gv), gv = min(G, head_dim)) of a row as a KIVI value
/// block: fp16 scale, fp16 min, packed codes; pad lanes hold code 0. As kivi_value::encode_row.
KVQ_HOST_DEVICE void encode_kivi_value(row_ref x, int head_dim, int b, int group, int bits, KVQ_GLOBAL u8* row) {
  const int gv = imin(group, head_dim);
  const int c0 = b * gv;
  const int n = imin(gv, head_dim - c0);
  const int code_bytes = (gv * bits + 7) / 8;
  KVQ_GLOBAL u8* blk = row + static_cast<i64>(b) * (kd::kivi_group_header_bytes + code_bytes);
  kd::kivi_range r = kd::kivi_range_empty();
  for (int i = 0; i < n; ++i) r = kd::kivi_range_add(r, row_value(x, c0 + i));
  const kd::kivi_header hd = kd::kivi_make_header(r, bits);
  st_u16(blk, hd.scale);
  st_u16(blk + 2, hd.min);
  const float s = kd::f16_bits_to_f32(hd.scale);
  const float m = kd::f16_bits_to_f32(hd.min);
  const int per_byte = 8 / bits;
  for (int j = 0; j < code_bytes; ++j) {
    u8 byte = 0;
    for (int k = 0; k < per_byte && r.finite; ++k) {
      const int i = j * per_byte + k;
      if (i < n) byte = kd::kivi_pack(byte, kd::kivi_code(row_value(x, c0 + i), s, m, bits), i, bits);
    }
    blk[kd::kivi_group_header_bytes + j] = byte;
  }
}

/// Channel c of a row divided by the codec scale, as the FP4 encoders see it.
KVQ_HOST_DEVICE float fp4_input(row_ref x, int c, float scale) { return kd::div_rn(row_value(x, c), scale); }

/// Encodes block b (channels [32b, 32b + 32)) of a row as ggml block_mxfp4 at blk (17 bytes);
/// lanes past head_dim are zero padding. As mxfp4::encode_block.
KVQ_HOST_DEVICE void encode_mxfp4(row_ref x, int head_dim, int b, float scale, KVQ_GLOBAL u8* blk) {
  const int c0 = kd::qk_mxfp4 * b;
  const int n = imin(kd::qk_mxfp4, head_dim - c0);
  float amax = 0.0f;
  bool finite = true;
  for (int j = 0; j < n; ++j) {
    const float v = fp4_input(x, c0 + j, scale);
    finite = finite && kd::is_finite_f32(v);
    const float av = kd::abs_f32(v);
    amax = av > amax ? av : amax;
  }
  if (!finite) {
    blk[0] = kd::mxfp4_poisoned_scale;
    for (int j = 0; j < 16; ++j) blk[1 + j] = 0;
    return;
  }
  const u8 e = kd::mxfp4_exponent(amax);
  const float h = kd::mxfp4_half_scale(e);
  blk[0] = e;
  for (int j = 0; j < 16; ++j) {
    const int lo = kd::fp4_code(j < n ? fp4_input(x, c0 + j, scale) : 0.0f, h);
    const int hi = kd::fp4_code(j + 16 < n ? fp4_input(x, c0 + j + 16, scale) : 0.0f, h);
    blk[1 + j] = static_cast<u8>(lo | (hi << 4));
  }
}

/// Encodes block b (channels [64b, 64b + 64)) of a row as ggml block_nvfp4 at blk (36 bytes);
/// lanes past head_dim are zero padding. As nvfp4::encode_block.
KVQ_HOST_DEVICE void encode_nvfp4(row_ref x, int head_dim, int b, float scale, KVQ_GLOBAL u8* blk) {
  for (int s = 0; s < 4; ++s) {
    const int c0 = kd::qk_nvfp4 * b + kd::qk_nvfp4_sub * s;
    const int n = head_dim - c0 < 0 ? 0 : imin(kd::qk_nvfp4_sub, head_dim - c0);
    float amax = 0.0f;
    bool finite = true;
    for (int j = 0; j < n; ++j) {
      const float v = fp4_input(x, c0 + j, scale);
      finite = finite && kd::is_finite_f32(v);
      const float av = kd::abs_f32(v);
      amax = av > amax ? av : amax;
    }
    if (!finite) {
      blk[s] = kd::nvfp4_poisoned_scale;
      for (int j = 0; j < 8; ++j) blk[4 + 8 * s + j] = 0;
      continue;
    }
    const u8 d = kd::nvfp4_scale_code(kd::div_rn(amax, 6.0f));
    const float h = kd::nvfp4_half_scale(d);
    blk[s] = d;
    for (int j = 0; j < 8; ++j) {
      const int lo = kd::fp4_code(j < n ? fp4_input(x, c0 + j, scale) : 0.0f, h);
      const int hi = kd::fp4_code(j + 8 < n ? fp4_input(x, c0 + j + 8, scale) : 0.0f, h);
      blk[4 + 8 * s + j] = static_cast<u8>(lo | (hi << 4));
    }
  }
}

/// The values of an input row as the tq encoder reads them (at(i): row_value, rotated).
struct tq_input_row {
  row_ref x;
  KVQ_HOST_DEVICE float at(int i) { return row_value(x, i); }
};

/// Encodes a whole (rotated) row as a tq codebook row of `bits` bits (FORMATS.md §6.2 steps 2-8)
/// with the encoder the CPU runs (detail::tq_encode_row_values).
KVQ_HOST_DEVICE void encode_tq(row_ref x, int head_dim, int bits, KVQ_GLOBAL u8* row) {
  tq_input_row values;
  values.x = x;
  kd::tq_encode_row_values(bits, values, head_dim, row);
}

/// Encodes block b of a row of a row codec into `row` (the row's first byte).
KVQ_HOST_DEVICE void encode_block(int codec, row_ref x, int head_dim, int b, kvq_region r, KVQ_GLOBAL u8* row) {
  switch (codec) {
    case kvq_codec_f32:  // rows of 4 * head_dim bytes: aligned
      reinterpret_cast<KVQ_GLOBAL kd::u32*>(row)[b] = kd::f32_bits(row_value(x, b));
      break;
    case kvq_codec_f16:
      reinterpret_cast<KVQ_GLOBAL u16*>(row)[b] = kd::f32_to_f16_bits(row_value(x, b));
      break;
    case kvq_codec_q8_0:
      encode_q8_0(x, head_dim, b, row + static_cast<i64>(b) * static_cast<i64>(sizeof(kd::block_q8_0)));
      break;
    case kvq_codec_q4_0:
      encode_q4_0(x, head_dim, b, row + static_cast<i64>(b) * static_cast<i64>(sizeof(kd::block_q4_0)));
      break;
    case kvq_codec_int8:
      encode_int8(x, head_dim, row);
      break;
    case kvq_codec_fp8_e4m3:
      row[b] = fp8_e4m3_encode(row_value(x, b), r.codec_scale, r.fp8_saturate != 0);
      break;
    case kvq_codec_fp8_e5m2:
      row[b] = fp8_e5m2_encode(row_value(x, b), r.codec_scale, r.fp8_saturate != 0);
      break;
    case kvq_codec_mxfp4:
      encode_mxfp4(x, head_dim, b, r.codec_scale,
                   row + static_cast<i64>(b) * static_cast<i64>(sizeof(kd::block_mxfp4)));
      break;
    case kvq_codec_nvfp4:
      encode_nvfp4(x, head_dim, b, r.codec_scale,
                   row + static_cast<i64>(b) * static_cast<i64>(sizeof(kd::block_nvfp4)));
      break;
    case kvq_codec_tq2:
    case kvq_codec_tq3:
    case kvq_codec_tq4:  // one unit per row
      encode_tq(x, head_dim, tq_bits(codec), row);
      break;
    default:  // KIVI values
      encode_kivi_value(x, head_dim, b, r.group, kivi_bits(codec), row);
      break;
  }
}

/// encode_rows: block b of batch row i of kv_head h, encoded into unit first + i.
KVQ_HOST_DEVICE void encode_rows_at(int codec, KVQ_ARG(kvq_write_args) a, KVQ_GLOBAL u8* layer,
                                    KVQ_GLOBAL const u8* input, int h, int i, int b) {
  KVQ_GLOBAL u8* row = region_ptr(layer, a.dst, h) + static_cast<i64>(a.first + i) * static_cast<i64>(a.dst.unit_bytes);
  row_ref x = batch_row(a, layer, input, h, i);
  float rotated[KVQ_ROTATED_ROW_MAX];
  if (x.rotate != 0 && a.head_dim <= KVQ_ROTATED_ROW_MAX) {  // R x once, not per coordinate read
    rotate_input_row(x, rotated);
    x.rotated = rotated;
  }
  encode_block(codec, x, a.head_dim, b, a.dst, row);
}

/// encode_key_tiles: channel c of KIVI key tile first + j of kv_head h, its G values (batch rows
/// [jG, jG + G)) quantized together. As kivi_key::encode_tile.
KVQ_HOST_DEVICE void encode_key_tile_at(int codec, KVQ_ARG(kvq_write_args) a, KVQ_GLOBAL u8* layer,
                                        KVQ_GLOBAL const u8* input, int h, int j, int c) {
  const int bits = kivi_bits(codec);
  const int g = a.dst.group;
  KVQ_GLOBAL u8* tile =
      region_ptr(layer, a.dst, h) + static_cast<i64>(a.first + j) * static_cast<i64>(a.dst.unit_bytes);
  kd::kivi_range range = kd::kivi_range_empty();
  for (int t = 0; t < g; ++t) range = kd::kivi_range_add(range, row_value(batch_row(a, layer, input, h, j * g + t), c));
  const kd::kivi_header hd = kd::kivi_make_header(range, bits);
  st_u16(tile + 2 * static_cast<i64>(c), hd.scale);
  st_u16(tile + 2 * (static_cast<i64>(a.head_dim) + c), hd.min);
  const float s = kd::f16_bits_to_f32(hd.scale);
  const float m = kd::f16_bits_to_f32(hd.min);
  const int code_bytes = g * bits / 8;
  const int per_byte = 8 / bits;
  KVQ_GLOBAL u8* codes = tile + static_cast<i64>(kd::kivi_group_header_bytes) * a.head_dim +
                         static_cast<i64>(code_bytes) * static_cast<i64>(c);
  for (int k = 0; k < code_bytes; ++k) {
    u8 byte = 0;
    for (int e = 0; e < per_byte && range.finite; ++e) {
      const int t = k * per_byte + e;
      byte = kd::kivi_pack(byte, kd::kivi_code(row_value(batch_row(a, layer, input, h, j * g + t), c), s, m, bits), t,
                           bits);
    }
    codes[k] = byte;
  }
}

/// store_f16_rows: channel c of batch row i of kv_head h into f16 residual row
/// (first + i) % residual_rows, saturating finite values to ±65504.
KVQ_HOST_DEVICE void store_f16_at(KVQ_ARG(kvq_write_args) a, KVQ_GLOBAL u8* layer, KVQ_GLOBAL const u8* input, int h,
                                  int i, int c) {
  const int row = (a.first + i) % a.dst.residual_rows;
  KVQ_GLOBAL u16* res = reinterpret_cast<KVQ_GLOBAL u16*>(residual_ptr(layer, a.dst, h));
  res[static_cast<i64>(row) * a.head_dim + c] =
      kd::f32_to_f16_bits_satfinite(row_value(batch_row(a, layer, input, h, i), c));
}

/// Thread `idx` of encode_rows: threads (kv_heads, count, blocks), blocks fastest.
KVQ_HOST_DEVICE void encode_rows_thread(int codec, KVQ_ARG(kvq_write_args) a, KVQ_GLOBAL u8* layer,
                                        KVQ_GLOBAL const u8* input, i64 idx) {
  const i64 per_head = static_cast<i64>(a.count) * a.blocks;
  if (idx >= per_head * a.kv_heads) return;
  const int h = static_cast<int>(idx / per_head);
  const i64 rem = idx - static_cast<i64>(h) * per_head;
  const int i = static_cast<int>(rem / a.blocks);
  encode_rows_at(codec, a, layer, input, h, i, static_cast<int>(rem - static_cast<i64>(i) * a.blocks));
}

/// Thread `idx` of encode_key_tiles: threads (kv_heads, count / G, head_dim), channels fastest.
KVQ_HOST_DEVICE void encode_key_tiles_thread(int codec, KVQ_ARG(kvq_write_args) a, KVQ_GLOBAL u8* layer,
                                             KVQ_GLOBAL const u8* input, i64 idx) {
  const i64 per_head = static_cast<i64>(a.count / a.dst.group) * a.head_dim;
  if (idx >= per_head * a.kv_heads) return;
  const int h = static_cast<int>(idx / per_head);
  const i64 rem = idx - static_cast<i64>(h) * per_head;
  const int j = static_cast<int>(rem / a.head_dim);
  encode_key_tile_at(codec, a, layer, input, h, j, static_cast<int>(rem - static_cast<i64>(j) * a.head_dim));
}

/// The key mean of channel c of kv_head h of a centered key codec, from input tokens [0, count)
/// (the first chunk appended to an empty layer), into the f32 at byte src.mean0 + 4 (h head_dim +
/// c): the finite values summed in f32 in token order, divided by their count (0 without any), as
/// kvq::detail::chunk_key_mean.
KVQ_HOST_DEVICE void key_mean_at(KVQ_ARG(kvq_write_args) a, KVQ_GLOBAL u8* layer, KVQ_GLOBAL const u8* input, int h,
                                 int c) {
  row_ref r;
  r.p = input;
  r.type = a.src.type;
  r.round = 0;
  r.rotate = 0;
  r.head_dim = a.head_dim;
  r.seed = 0;
  r.mean = nullptr;
  r.rotated = nullptr;
  float sum = 0.0f;
  int n = 0;
  for (int t = 0; t < a.count; ++t) {
    r.p = input + (static_cast<i64>(t) * static_cast<i64>(a.src.token_stride) +
                   static_cast<i64>(h) * static_cast<i64>(a.src.head_stride)) *
                      elem_bytes(a.src.type);
    const float x = input_value(r, c);
    if (!kd::is_finite_f32(x)) continue;
    sum = kd::add_rn(sum, x);
    ++n;
  }
  reinterpret_cast<KVQ_GLOBAL float*>(layer + static_cast<i64>(a.src.mean0))[static_cast<i64>(h) * a.head_dim + c] =
      n > 0 ? kd::div_rn(sum, static_cast<float>(n)) : 0.0f;
}

/// Thread `idx` of store_f16_rows: threads (kv_heads, count, head_dim), channels fastest; with
/// mode kvq_write_key_mean, threads (kv_heads, head_dim) of key_mean_at.
KVQ_HOST_DEVICE void store_f16_rows_thread(KVQ_ARG(kvq_write_args) a, KVQ_GLOBAL u8* layer, KVQ_GLOBAL const u8* input,
                                           i64 idx) {
  if (a.mode == kvq_write_key_mean) {
    if (idx >= static_cast<i64>(a.kv_heads) * a.head_dim) return;
    const int h = static_cast<int>(idx / a.head_dim);
    key_mean_at(a, layer, input, h, static_cast<int>(idx - static_cast<i64>(h) * a.head_dim));
    return;
  }
  const i64 per_head = static_cast<i64>(a.count) * a.head_dim;
  if (idx >= per_head * a.kv_heads) return;
  const int h = static_cast<int>(idx / per_head);
  const i64 rem = idx - static_cast<i64>(h) * per_head;
  const int i = static_cast<int>(rem / a.head_dim);
  store_f16_at(a, layer, input, h, i, static_cast<int>(rem - static_cast<i64>(i) * a.head_dim));
}

// ---- decoders ----------------------------------------------------------------------------------

/// Channel c of an encoded row of a row codec.
KVQ_HOST_DEVICE float decode_row_element(int codec, KVQ_GLOBAL const u8* row, int head_dim, int c, kvq_region r) {
  switch (codec) {
    case kvq_codec_f32:
      return reinterpret_cast<KVQ_GLOBAL const float*>(row)[c];
    case kvq_codec_f16:
      return kd::f16_bits_to_f32(reinterpret_cast<KVQ_GLOBAL const u16*>(row)[c]);
    case kvq_codec_q8_0: {
      KVQ_GLOBAL const u8* blk = row + static_cast<i64>(c / 32) * static_cast<i64>(sizeof(kd::block_q8_0));
      return kd::q8_0_value(sext8(blk[2 + c % 32]), ld_f16(blk));
    }
    case kvq_codec_q4_0: {
      KVQ_GLOBAL const u8* blk = row + static_cast<i64>(c / 32) * static_cast<i64>(sizeof(kd::block_q4_0));
      const int j = c % 32;
      const int nibble = j < 16 ? static_cast<int>(blk[2 + j] & 0x0fu) : static_cast<int>(blk[2 + j - 16] >> 4);
      return kd::q4_0_value(nibble, ld_f16(blk));
    }
    case kvq_codec_int8:
      return kd::int8_value(sext8(row[kd::int8_row_header_bytes + c]), kd::f32_from_bits(ld_u32(row)));
    case kvq_codec_fp8_e4m3:
      return fp8_e4m3_decode(row[c], r.codec_scale);
    case kvq_codec_fp8_e5m2:
      return fp8_e5m2_decode(row[c], r.codec_scale);
    case kvq_codec_mxfp4: {
      KVQ_GLOBAL const u8* blk = row + static_cast<i64>(c / kd::qk_mxfp4) * static_cast<i64>(sizeof(kd::block_mxfp4));
      const int j = c % kd::qk_mxfp4;
      const int code = j < 16 ? static_cast<int>(blk[1 + j] & 0x0fu) : static_cast<int>(blk[1 + j - 16] >> 4);
      if (blk[0] == kd::mxfp4_poisoned_scale) return kd::fp4_nan();
      return kd::mul_rn(kd::fp4_value(code, kd::mxfp4_half_scale(blk[0])), r.codec_scale);
    }
    case kvq_codec_nvfp4: {
      KVQ_GLOBAL const u8* blk = row + static_cast<i64>(c / kd::qk_nvfp4) * static_cast<i64>(sizeof(kd::block_nvfp4));
      const int s = (c % kd::qk_nvfp4) / kd::qk_nvfp4_sub;
      const int k = c % kd::qk_nvfp4_sub;
      const u8 byte = blk[4 + 8 * s + k % 8];
      const int code = k < 8 ? static_cast<int>(byte & 0x0fu) : static_cast<int>(byte >> 4);
      if (blk[s] == kd::nvfp4_poisoned_scale) return kd::fp4_nan();
      return kd::mul_rn(kd::fp4_value(code, kd::nvfp4_half_scale(blk[s])), r.codec_scale);
    }
    case kvq_codec_tq2:
    case kvq_codec_tq3:
    case kvq_codec_tq4: {  // c[code_c] * g of c's rotation block (rotated space), as tq_decode_row
      const int bits = tq_bits(codec);
      KVQ_GLOBAL const u8* codes = row + kd::tq_scale_bytes(head_dim);
      const int bit = bits * c;
      unsigned window = codes[bit / 8];
      if (bit % 8 + bits > 8) window |= static_cast<unsigned>(codes[bit / 8 + 1]) << 8;
      const int code = static_cast<int>((window >> (bit % 8)) & ((1u << bits) - 1u));
      return kd::mul_rn(kd::tq_centroid(bits, code), ld_f16(row + 2 * kd::rotation_block_of(head_dim, c)));
    }
    default: {  // KIVI values
      const int bits = kivi_bits(codec);
      const int gv = imin(r.group, head_dim);
      const int lane = c % gv;
      KVQ_GLOBAL const u8* blk = row + static_cast<i64>(c / gv) * (kd::kivi_group_header_bytes + (gv * bits + 7) / 8);
      const int q = kd::kivi_unpack(blk[kd::kivi_group_header_bytes + kd::kivi_code_byte(lane, bits)], lane, bits);
      return kd::kivi_value(q, ld_f16(blk), ld_f16(blk + 2));
    }
  }
}

/// Channel c of token t of the kv_head whose units start at `reg` and residual rows at `res`: an
/// encoded row, a KIVI key tile, or an f16 residual row (t >= r.quantized).
KVQ_HOST_DEVICE float decode_element(int codec, KVQ_GLOBAL const u8* reg, KVQ_GLOBAL const u8* res, kvq_region r,
                                     int head_dim, int t, int c) {
  if (t >= r.quantized) {
    const int row = (r.residual_first + (t - r.quantized)) % r.residual_rows;
    return kd::f16_bits_to_f32(reinterpret_cast<KVQ_GLOBAL const u16*>(res)[static_cast<i64>(row) * head_dim + c]);
  }
  if (is_kivi_key(codec)) {
    const int bits = kivi_bits(codec);
    const int g = r.group;
    const int tt = t % g;
    KVQ_GLOBAL const u8* tile = reg + static_cast<i64>(t / g) * static_cast<i64>(r.unit_bytes);
    const float s = ld_f16(tile + 2 * static_cast<i64>(c));
    const float m = ld_f16(tile + 2 * (static_cast<i64>(head_dim) + c));
    KVQ_GLOBAL const u8* codes = tile + static_cast<i64>(kd::kivi_group_header_bytes) * head_dim +
                                 static_cast<i64>(g * bits / 8) * static_cast<i64>(c);
    const int q = kd::kivi_unpack(codes[kd::kivi_code_byte(tt, bits)], tt, bits);
    return kd::kivi_value(q, s, m);
  }
  return decode_row_element(codec, reg + static_cast<i64>(t) * static_cast<i64>(r.unit_bytes), head_dim, c, r);
}

/// The leaves of R^T y over the rotation block at channel o of token t: the decoded (rotated)
/// channels of the token.
struct decoded_leaves {
  int codec;
  KVQ_GLOBAL const u8* reg;
  KVQ_GLOBAL const u8* res;
  kvq_region r;
  int head_dim;
  int t;
  int o;
  KVQ_HOST_DEVICE float at(int j) { return decode_element(codec, reg, res, r, head_dim, t, o + j); }
};

/// Channel c of token t of kv_head `head`, un-rotated when a.unrotate (R^T of the decoded row, as
/// detail::rotate_inverse_signs: the butterflies of c's rotation block, times c_n, then s_c).
KVQ_HOST_DEVICE float read_element(int codec, KVQ_ARG(kvq_decode_args) a, KVQ_GLOBAL const u8* layer, int t, int c) {
  KVQ_GLOBAL const u8* reg = region_ptr(layer, a.src, a.head);
  KVQ_GLOBAL const u8* res = residual_ptr(layer, a.src, a.head);
  if (a.unrotate == 0) return decode_element(codec, reg, res, a.src, a.head_dim, t, c);
  decoded_leaves leaves;
  leaves.codec = codec;
  leaves.reg = reg;
  leaves.res = res;
  leaves.r = a.src;
  leaves.head_dim = a.head_dim;
  leaves.t = t;
  leaves.o = kd::rotation_block_start(a.head_dim, c);
  const int n = kd::rotation_block_size(a.head_dim, leaves.o);
  sign_words signs = make_sign_words(a.src.rotation_seed);
  return signs.apply(kd::mul_rn(butterfly_output(leaves, n, c - leaves.o), kd::rotation_scale(n)), c);
}

/// decode: channel c of token first + i of kv_head `head`, written as out_type at row i.
KVQ_HOST_DEVICE void decode_at(int codec, KVQ_ARG(kvq_decode_args) a, KVQ_GLOBAL const u8* layer, KVQ_GLOBAL u8* out,
                               int i, int c) {
  float v = read_element(codec, a, layer, a.first + i, c);
  if (a.add_mean != 0)  // centered keys: decode + mu in f32, then one rounding
    v = kd::add_rn(v, reinterpret_cast<KVQ_GLOBAL const float*>(
                          layer + static_cast<i64>(a.mean0))[static_cast<i64>(a.head) * a.head_dim + c]);
  const i64 o = static_cast<i64>(i) * static_cast<i64>(a.out_stride) + c;
  if (a.out_type == kvq_elem_f32) {
    reinterpret_cast<KVQ_GLOBAL float*>(out)[o] = v;  // outputs are aligned to their element type
  } else if (a.out_type == kvq_elem_f16) {
    reinterpret_cast<KVQ_GLOBAL u16*>(out)[o] = kd::f32_to_f16_bits(v);
  } else if (a.out_type == kvq_elem_f16_sat) {
    reinterpret_cast<KVQ_GLOBAL u16*>(out)[o] = kd::f32_to_f16_bits_satfinite(v);
  } else {
    reinterpret_cast<KVQ_GLOBAL u16*>(out)[o] = kd::f32_to_bf16_bits(v);
  }
}

/// Thread `idx` of decode: threads (count, head_dim), channels fastest.
KVQ_HOST_DEVICE void decode_thread(int codec, KVQ_ARG(kvq_decode_args) a, KVQ_GLOBAL const u8* layer,
                                   KVQ_GLOBAL u8* out, i64 idx) {
  if (idx >= static_cast<i64>(a.count) * a.head_dim) return;
  const int i = static_cast<int>(idx / a.head_dim);
  decode_at(codec, a, layer, out, i, static_cast<int>(idx - static_cast<i64>(i) * a.head_dim));
}

// ---- attention ---------------------------------------------------------------------------------

/// Integer dot product of block b of a q8_0 or q4_0 key row with a q8_0 query block (codes qc,
/// scale dq), as kvq::detail::dot_block: q8_0 sumi * (dk * dq), q4_0 (sumi * dk) * dq.
KVQ_HOST_DEVICE float block_dot(int codec, KVQ_GLOBAL const u8* row, int b, KVQ_SHARED const int8_t* qc, float dq) {
  int sumi = 0;
  if (codec == kvq_codec_q8_0) {
    KVQ_GLOBAL const u8* blk = row + static_cast<i64>(b) * static_cast<i64>(sizeof(kd::block_q8_0));
    for (int j = 0; j < 32; ++j) sumi += sext8(blk[2 + j]) * static_cast<int>(qc[j]);
    return kd::mul_rn(static_cast<float>(sumi), kd::mul_rn(ld_f16(blk), dq));
  }
  KVQ_GLOBAL const u8* blk = row + static_cast<i64>(b) * static_cast<i64>(sizeof(kd::block_q4_0));
  for (int j = 0; j < 16; ++j) {
    sumi += (static_cast<int>(blk[2 + j] & 0x0fu) - 8) * static_cast<int>(qc[j]);
    sumi += (static_cast<int>(blk[2 + j] >> 4) - 8) * static_cast<int>(qc[j + 16]);
  }
  return kd::mul_rn(kd::mul_rn(static_cast<float>(sumi), ld_f16(blk)), dq);
}

/// The first token of the units holding token t in an attention (see kvq_attention_args): its
/// page's first token in a paged cache, 0 in a flat one.
KVQ_HOST_DEVICE int attention_units_first(KVQ_ARG(kvq_attention_args) a, int t) {
  return a.page_tokens > 0 ? t / a.page_tokens * a.page_tokens : 0;
}

/// The units of kv_head kv holding token t: the region's in a flat cache, its page's in a paged
/// cache (page table `pages` from index `pages_first`).
KVQ_HOST_DEVICE KVQ_GLOBAL const u8* attention_units(KVQ_ARG(kvq_attention_args) a, KVQ_GLOBAL const int32_t* pages,
                                                     int pages_first, KVQ_GLOBAL const u8* layer, kvq_region r, int kv,
                                                     int t) {
  if (a.page_tokens > 0)
    layer += static_cast<i64>(pages[pages_first + t / a.page_tokens]) * static_cast<i64>(a.page_bytes);
  return region_ptr(layer, r, kv);
}

/// Channels [c0, c0 + n) (n <= 32, c0 a multiple of 32) of token t of kv_head kv in an attention
/// into dst[0, n): decode_element's values of the token's units (its page's in a paged cache), with
/// the units, the residual test and (q8_0, q4_0, mxfp4) the block scale taken once for the chunk.
KVQ_HOST_DEVICE void attention_chunk(int codec, KVQ_ARG(kvq_attention_args) a, KVQ_GLOBAL const int32_t* pages,
                                     int pages_first, KVQ_GLOBAL const u8* layer, kvq_region r,
                                     KVQ_GLOBAL const u8* res, int kv, int t, int c0, int n, KVQ_SHARED float* dst) {
  const int first = attention_units_first(a, t);
  KVQ_GLOBAL const u8* units = attention_units(a, pages, pages_first, layer, r, kv, t);
  r.quantized -= first;
  const int hd = a.head_dim;
  if (t - first >= r.quantized || is_kivi_key(codec)) {  // f16 residual rows, KIVI key tiles
    for (int j = 0; j < n; ++j) dst[j] = decode_element(codec, units, res, r, hd, t - first, c0 + j);
    return;
  }
  KVQ_GLOBAL const u8* row = units + static_cast<i64>(t - first) * static_cast<i64>(r.unit_bytes);
  if (codec == kvq_codec_q4_0) {
    KVQ_GLOBAL const u8* blk = row + static_cast<i64>(c0 / 32) * static_cast<i64>(sizeof(kd::block_q4_0));
    const float d = ld_f16(blk);
    for (int j = 0; j < n; ++j)
      dst[j] =
          kd::q4_0_value(j < 16 ? static_cast<int>(blk[2 + j] & 0x0fu) : static_cast<int>(blk[2 + j - 16] >> 4), d);
  } else if (codec == kvq_codec_q8_0) {
    KVQ_GLOBAL const u8* blk = row + static_cast<i64>(c0 / 32) * static_cast<i64>(sizeof(kd::block_q8_0));
    const float d = ld_f16(blk);
    for (int j = 0; j < n; ++j) dst[j] = kd::q8_0_value(sext8(blk[2 + j]), d);
  } else if (codec == kvq_codec_mxfp4) {
    KVQ_GLOBAL const u8* blk = row + static_cast<i64>(c0 / kd::qk_mxfp4) * static_cast<i64>(sizeof(kd::block_mxfp4));
    const bool poisoned = blk[0] == kd::mxfp4_poisoned_scale;
    const float h = kd::mxfp4_half_scale(blk[0]);
    for (int j = 0; j < n; ++j) {
      const int code = j < 16 ? static_cast<int>(blk[1 + j] & 0x0fu) : static_cast<int>(blk[1 + j - 16] >> 4);
      dst[j] = poisoned ? kd::fp4_nan() : kd::mul_rn(kd::fp4_value(code, h), r.codec_scale);
    }
  } else {
    for (int j = 0; j < n; ++j) dst[j] = decode_row_element(codec, row, hd, c0 + j, r);
  }
}

/// Thread tid's share (items tid, tid + nt, ...) of decoding tokens [t0, t0 + n) of kv_head kv into
/// dst (n, head_dim + 1), one item per 32 channels of a token (attention_chunk).
KVQ_HOST_DEVICE void attention_tile_share(int codec, KVQ_ARG(kvq_attention_args) a, KVQ_GLOBAL const int32_t* pages,
                                          int pages_first, KVQ_GLOBAL const u8* layer, kvq_region r,
                                          KVQ_GLOBAL const u8* res, int kv, int t0, int n, int tid, int nt,
                                          KVQ_SHARED float* dst) {
  const int hd = a.head_dim;
  const int nb = (hd + 31) / 32;
  for (int w = tid; w < n * nb; w += nt) {
    const int i = w / nb;
    const int c0 = 32 * (w - i * nb);
    attention_chunk(codec, a, pages, pages_first, layer, r, res, kv, t0 + i, c0, imin(32, hd - c0),
                    dst + i * (hd + 1) + c0);
  }
}

/// Tokens [*lo, *hi) that query token i of a multi-token attention attends (see
/// kvq_attention_args), before its custom mask row; empty when *lo >= *hi.
KVQ_HOST_DEVICE void query_range(KVQ_ARG(kvq_attention_args) a, kvq_attention_seq sq, int i, KVQ_THREAD int* lo,
                                 KVQ_THREAD int* hi) {
  const i64 pos = static_cast<i64>(sq.first_pos) + i;
  i64 e = sq.length;
  if (a.causal != 0 && pos + 1 < e) e = pos + 1;
  i64 b = 0;
  if (a.window > 0) {
    b = pos - a.window + 1;
    b = b < 0 ? 0 : (b > sq.length ? static_cast<i64>(sq.length) : b);
  }
  *lo = static_cast<int>(b);
  *hi = static_cast<int>(e > b ? e : b);
}

/// Row r of kv_head kv (query token r / group, query head kv * group + r % group) among the rows
/// of the partial states, (query token, query head) token-major: also its row in the query.
KVQ_HOST_DEVICE i64 attention_row(KVQ_ARG(kvq_attention_args) a, int kv, int r) {
  const int group = a.q_heads / a.kv_heads;
  return static_cast<i64>(r / group) * a.q_heads + kv * group + r % group;
}

/// True for the bits of -0.0f, the probability that marks a token with logit -Inf (weight 0, and
/// skipped in P·V as kvq::attend_range skips it, so 0 * Inf in V makes no NaN).
KVQ_HOST_DEVICE bool is_skipped(float p) { return kd::f32_bits(p) == 0x80000000u; }

/// One block of the partial attention (see kvq_attention_args): split bx and y = by of one
/// sequence `sq`, whose query is `query` (n_q, q_heads, head_dim), whose custom mask rows are at
/// `mask` (a.mask), and whose partial states go to part_out (splits, n_q * q_heads, head_dim),
/// part_max and part_sum (splits, n_q * q_heads). `smem` holds kvq_attention_smem_layout(...).total
/// floats; the smem "heads" are the block's rows.
///
/// `Threads` is the backend's view of the block's threads: `th.count()` threads take part;
/// the calling GPU thread runs the work of threads th.tid(k) for k in [0, th.lanes()) (one on a
/// GPU, all of them in turn in a CPU stand-in), and `th.barrier()` synchronises the block (a
/// __syncthreads, a threadgroup_barrier, nothing on the CPU). Barriers are the one construct the
/// languages do not share, so they come from the backend.
///
/// Per tile of `tile` tokens (of the union of its rows' ranges): the keys are decoded once into
/// block memory, 32 channels of a token per thread (or, for the integer dots of a q8_0 query with
/// q8_0/q4_0 keys, read in place), one thread per (row, token) computes a logit (-Inf outside the
/// row's tokens or where its mask excludes, plus its additive mask) and then its term of the online
/// softmax (as kvq::attend_range goes token by token), the values are decoded into the keys'
/// place, one thread per row sums its terms in token order, and one thread per (row, channel)
/// accumulates P·V. NaN/Inf as kvq::attend_range: a NaN or +Inf logit makes the row NaN, a -Inf
/// logit weighs 0.
template <class Threads>
KVQ_HOST_DEVICE void attention_block(int kcodec, int vcodec, KVQ_ARG(kvq_attention_args) a, kvq_attention_seq sq,
                                     KVQ_GLOBAL const u8* key_layer, KVQ_GLOBAL const u8* value_layer,
                                     KVQ_GLOBAL const int32_t* pages, KVQ_GLOBAL const float* query,
                                     KVQ_GLOBAL const u8* mask, KVQ_GLOBAL float* part_out, KVQ_GLOBAL float* part_max,
                                     KVQ_GLOBAL float* part_sum, KVQ_SHARED float* smem, int bx, int by, Threads th) {
  const int hd = a.head_dim;
  const int group = a.q_heads / a.kv_heads;
  const int kv = by / a.chunks;
  const int g0 = (by % a.chunks) * a.heads;  // the block's first row
  const int nh = imin(a.heads, a.n_q * group - g0);
  const int rows = a.n_q * a.q_heads;  // rows of the partial states
  // The tokens of the split, cut to the union of the rows' ranges.
  int u_lo = sq.end;
  int u_hi = sq.begin;
  for (int i = g0 / group; i <= (g0 + nh - 1) / group; ++i) {
    int lo = 0;
    int hi = 0;
    query_range(a, sq, i, &lo, &hi);
    if (lo < hi) {
      u_lo = imin(u_lo, lo);
      u_hi = imax(u_hi, hi);
    }
  }
  const int t_begin = imax(sq.begin + bx * a.split_tokens, u_lo);
  const int t_end = imin(imin(sq.end, sq.begin + bx * a.split_tokens + a.split_tokens), u_hi);
  const int T = a.tile;
  const int nb = (hd + 31) / 32;
  const int kstride = hd + 1;
  const bool int_dot = a.query_q8_0 != 0 && (kcodec == kvq_codec_q8_0 || kcodec == kvq_codec_q4_0);
  const float ninf = neg_inf();
  const int nt = th.count();
  const int lanes = th.lanes();

  kvq_region kr = a.key;
  kr.quantized = sq.key_quantized;
  kr.residual_first = 0;
  kr.residual0 = sq.key_residual0;
  kvq_region vr = a.value;
  vr.quantized = sq.value_quantized;
  vr.residual_first = sq.value_residual_first;
  vr.residual0 = sq.value_residual0;
  KVQ_GLOBAL const u8* kres = residual_ptr(key_layer, kr, kv);
  KVQ_GLOBAL const u8* vres = residual_ptr(value_layer, vr, kv);

  const kvq_attention_smem L = kvq_attention_smem_layout(hd, T, a.heads, a.query_q8_0);
  KVQ_SHARED float* q_s = smem + L.q;
  KVQ_SHARED float* o_s = smem + L.o;
  KVQ_SHARED float* k_s = smem + L.k;
  KVQ_SHARED float* p_s = smem + L.p;
  KVQ_SHARED float* w_s = smem + L.w;
  KVQ_SHARED float* e_s = smem + L.e;
  KVQ_SHARED float* m_s = smem + L.m;
  KVQ_SHARED float* l_s = smem + L.l;
  KVQ_SHARED float* c_s = smem + L.corr;
  KVQ_SHARED float* qd_s = smem + L.qd;
  KVQ_SHARED int8_t* qc_s = reinterpret_cast<KVQ_SHARED int8_t*>(smem + L.qcodes);
  KVQ_SHARED float* off_s = smem + L.off;

  // The query rows of this block: as given, rotated by the key side's R (a rotated key codec), then
  // rounded to q8_0 blocks on request as q8_0::encode_row and decode_row do (codes kept for the
  // integer dots), as kvq's prepare_query.
  for (int k = 0; k < lanes; ++k) {
    const int tid = th.tid(k);
    for (int w = tid; w < nh * hd; w += nt) q_s[w] = query[attention_row(a, kv, g0 + w / hd) * hd + w % hd];
    for (int w = tid; w < nh * hd; w += nt) o_s[w] = 0.0f;
    for (int w = tid; w < nh; w += nt) {
      m_s[w] = ninf;
      l_s[w] = 0.0f;
    }
  }
  if ((a.rotation & kvq_rotate_query) != 0) {
    th.barrier();
    for (int k = 0; k < lanes; ++k)
      for (int g = th.tid(k); g < nh; g += nt) rotate_shared_row(q_s + g * hd, hd, a.key.rotation_seed, false);
  }
  if (a.query_q8_0 != 0) {
    th.barrier();
    for (int k = 0; k < lanes; ++k) {
      for (int w = th.tid(k); w < nh * nb; w += nt) {  // each block in place
        const int g = w / nb;
        const int b = w % nb;
        KVQ_SHARED float* x = q_s + g * hd;
        const int c0 = 32 * b;
        const int n = imin(32, hd - c0);
        float amax = 0.0f;
        bool finite = true;
        for (int j = 0; j < n; ++j) {
          finite = finite && kd::is_finite_f32(x[c0 + j]);
          const float av = kd::abs_f32(x[c0 + j]);
          amax = av > amax ? av : amax;
        }
        const float d = kd::q8_0_scale(amax);
        const float id = finite ? kd::ggml_inverse_scale(d) : 0.0f;
        const float dq = kd::f16_bits_to_f32(finite ? kd::f32_to_f16_bits(d) : kd::poisoned_f16_scale);
        qd_s[g * nb + b] = dq;
        for (int j = 0; j < 32; ++j) {
          const int code = (finite && j < n) ? kd::q8_0_code(x[c0 + j], id) : 0;
          qc_s[(g * nb + b) * 32 + j] = static_cast<int8_t>(code);
          if (j < n) x[c0 + j] = kd::q8_0_value(code, dq);
        }
      }
    }
  }
  th.barrier();
  // Centered keys: each row's logit offset scale * (q . mu), q the prepared query row and mu the
  // key mean of kv taken into its space (rotated as the query), as kvq::detail::centered_call;
  // k_s holds mu until the first tile.
  if (a.key_mean != 0) {
    KVQ_GLOBAL const float* mu = reinterpret_cast<KVQ_GLOBAL const float*>(key_layer + static_cast<i64>(sq.key_mean0)) +
                                 static_cast<i64>(kv) * hd;
    for (int k = 0; k < lanes; ++k)
      for (int w = th.tid(k); w < hd; w += nt) k_s[w] = mu[w];
    th.barrier();
    if ((a.rotation & kvq_rotate_query) != 0) {
      for (int k = 0; k < lanes; ++k)
        if (th.tid(k) == 0) rotate_shared_row(k_s, hd, a.key.rotation_seed, false);
      th.barrier();
    }
    for (int k = 0; k < lanes; ++k) {
      for (int g = th.tid(k); g < nh; g += nt) {
        float dot = 0.0f;
        for (int c = 0; c < hd; ++c) dot = kd::madd_f32(q_s[g * hd + c], k_s[c], dot);
        off_s[g] = kd::mul_rn(dot, a.scale);
      }
    }
    th.barrier();
  }

  for (int t0 = t_begin; t0 < t_end; t0 += T) {
    const int n = imin(T, t_end - t0);

    // Keys of the tile, decoded once for all heads, 32 channels of a token per thread: k_s (n, hd + 1).
    if (!int_dot) {
      for (int k = 0; k < lanes; ++k)
        attention_tile_share(kcodec, a, pages, sq.pages_first, key_layer, kr, kres, kv, t0, n, th.tid(k), nt, k_s);
      th.barrier();
    }

    // Logits, one thread per (row, token); consecutive threads take consecutive tokens.
    for (int k = 0; k < lanes; ++k) {
      for (int w = th.tid(k); w < nh * n; w += nt) {
        const int g = w / n;
        const int i = w - g * n;
        const int qi = (g0 + g) / group;
        int lo = 0;
        int hi = 0;
        query_range(a, sq, qi, &lo, &hi);
        const i64 mrow = static_cast<i64>(qi) * static_cast<i64>(a.mask_stride) + t0 + i;
        if (t0 + i < lo || t0 + i >= hi ||
            (a.mask == kvq_mask_boolean && mask[mrow] == 0)) {  // outside the row's tokens
          p_s[g * T + i] = ninf;
          continue;
        }
        float dot = 0.0f;
        if (int_dot) {
          const int t = t0 + i;
          KVQ_GLOBAL const u8* row =
              attention_units(a, pages, sq.pages_first, key_layer, kr, kv, t) +
              static_cast<i64>(t - attention_units_first(a, t)) * static_cast<i64>(kr.unit_bytes);
          for (int b = 0; b < nb; ++b)
            dot = kd::add_rn(dot, block_dot(kcodec, row, b, qc_s + (g * nb + b) * 32, qd_s[g * nb + b]));
        } else {
          for (int c = 0; c < hd; ++c) dot += q_s[g * hd + c] * k_s[i * kstride + c];
        }
        float s = dot * a.scale;
        if (a.key_mean != 0) s = kd::add_rn(s, off_s[g]);  // centered keys: before the softcap
        if (a.softcap > 0.0f) s = a.softcap * tanh_f32(s / a.softcap);
        if (a.mask == kvq_mask_additive) s += reinterpret_cast<KVQ_GLOBAL const float*>(mask)[mrow];
        p_s[g * T + i] = s;
      }
    }
    th.barrier();

    // Online softmax as kvq::attend_range goes token by token: token i's probability
    // e_i = exp(s_i - m_i) is taken against the running max after it, m_i = max(m_old, s_0 .. s_i)
    // (so f16-rounded probabilities round the same values as the reference), then rescaled to the
    // tile's max by exp(m_i - m_new). One thread per (row, token) computes its m_i, m_new and
    // exponentials: w_s gets the weight of the value (-0.0 marks a -Inf logit, skipped in P·V),
    // e_s the term of the row's sum (0 for a skipped token).
    for (int k = 0; k < lanes; ++k) {
      for (int w = th.tid(k); w < nh * n; w += nt) {
        const int g = w / n;
        const int i = w - g * n;
        float m_new = m_s[g];
        float mi = m_new;
        for (int j = 0; j < n; ++j) {
          const float s = p_s[g * T + j];
          m_new = s > m_new ? s : m_new;  // NaN logits take no part in the max
          if (j == i) mi = m_new;
        }
        const float s = p_s[g * T + i];
        float wv = -0.0f;
        float term = 0.0f;
        if (s != ninf) {
          const float e = exp_f32(s - mi);  // NaN for NaN or +Inf logits, which then propagates
          const float rescale = mi == m_new ? 1.0f : exp_f32(mi - m_new);
          term = kd::mul_rn(e, rescale);
          wv = (a.probs_f16 != 0 ? round_f16(e) : e) * rescale;
        }
        w_s[g * T + i] = wv;
        e_s[g * T + i] = term;
      }
      // The values of the tile into k_s (the keys' readers are done), as the keys were decoded.
      attention_tile_share(vcodec, a, pages, sq.pages_first, value_layer, vr, vres, kv, t0, n, th.tid(k), nt, k_s);
    }
    th.barrier();
    // One thread per row: the tile's terms summed in token order, c_s the rescale of what came before.
    for (int k = 0; k < lanes; ++k) {
      for (int g = th.tid(k); g < nh; g += nt) {
        const float m_old = m_s[g];
        float m_new = m_old;
        float sum = 0.0f;
        for (int i = 0; i < n; ++i) {
          const float s = p_s[g * T + i];
          m_new = s > m_new ? s : m_new;
          sum += e_s[g * T + i];
        }
        const float corr = m_old == ninf ? 0.0f : (m_new == m_old ? 1.0f : exp_f32(m_old - m_new));
        c_s[g] = corr;
        l_s[g] = l_s[g] * corr + sum;
        m_s[g] = m_new;
      }
    }
    th.barrier();

    // P·V, one thread per (row, channel) in turn: the decoded values (k_s) serve every row, the
    // row's output held in a register over the tile's tokens.
    for (int k = 0; k < lanes; ++k) {
      for (int w = th.tid(k); w < nh * hd; w += nt) {
        const int g = w / hd;
        const int c = w - g * hd;
        float acc = o_s[w] * c_s[g];
        for (int i = 0; i < n; ++i) {
          const float wv = w_s[g * T + i];
          if (!is_skipped(wv)) acc += wv * k_s[i * kstride + c];
        }
        o_s[w] = acc;
      }
    }
    th.barrier();  // the next tile's keys overwrite the values in k_s
  }
  // Each row un-rotated once: the values were accumulated in the value side's rotated space.
  if ((a.rotation & kvq_unrotate_output) != 0) {
    for (int k = 0; k < lanes; ++k)
      for (int g = th.tid(k); g < nh; g += nt) rotate_shared_row(o_s + g * hd, hd, a.value.rotation_seed, true);
    th.barrier();
  }

  // The partial state of every row of the block.
  for (int k = 0; k < lanes; ++k) {
    const int tid = th.tid(k);
    for (int w = tid; w < nh * hd; w += nt) {
      const int g = w / hd;
      part_out[(static_cast<i64>(bx) * rows + attention_row(a, kv, g0 + g)) * hd + (w - g * hd)] = o_s[w];
    }
    for (int g = tid; g < nh; g += nt) {
      part_max[static_cast<i64>(bx) * rows + attention_row(a, kv, g0 + g)] = m_s[g];
      part_sum[static_cast<i64>(bx) * rows + attention_row(a, kv, g0 + g)] = l_s[g];
    }
  }
}

/// combine: channel c of row h of sequence b. Merges the splits in order as kvq::combine and
/// normalises as kvq::finalize, with the row's sink (a.sinks > 0) joining the denominator (rows
/// that attended nothing output 0).
KVQ_HOST_DEVICE void combine_at(KVQ_ARG(kvq_combine_args) a, KVQ_GLOBAL const float* part_out,
                                KVQ_GLOBAL const float* part_max, KVQ_GLOBAL const float* part_sum,
                                KVQ_GLOBAL const float* sinks, KVQ_GLOBAL float* out, int b, int h, int c) {
  const float ninf = neg_inf();
  float m = ninf;
  float l = 0.0f;
  float o = 0.0f;
  for (int s = 0; s < a.splits; ++s) {
    const i64 sh = (static_cast<i64>(b) * a.splits + s) * a.q_heads + h;
    const float mb = part_max[sh];
    const float lb = part_sum[sh];
    if (mb == ninf && !kd::is_nan_f32(lb)) continue;  // the split attended nothing
    const float mm = (kd::is_nan_f32(m) || kd::is_nan_f32(mb)) ? quiet_nan() : (mb > m ? mb : m);
    const float ca = m == ninf ? 0.0f : exp_f32(m - mm);
    const float cb = exp_f32(mb - mm);
    o = o * ca + part_out[sh * a.head_dim + c] * cb;
    l = l * ca + lb * cb;
    m = mm;
  }
  const i64 oi = (static_cast<i64>(b) * a.q_heads + h) * a.head_dim + c;
  const float sink = a.sinks > 0 ? sinks[h % a.sinks] : ninf;
  if (l == 0.0f || kd::f32_bits(sink) == 0xff800000u) {  // no sink: a bit test, immune to finite-math flags
    out[oi] = l == 0.0f ? 0.0f : o * (1.0f / l);
    return;
  }
  // The sink's exp(sink - max) joins the sum, as kvq::detail::finalize_head.
  const float mm = kd::is_nan_f32(m) ? m : (sink > m ? sink : m);
  const float corr = exp_f32(m - mm);
  l = kd::madd_f32(l, corr, exp_f32(sink - mm));
  const float inv = 1.0f / l;
  out[oi] = corr == 1.0f ? o * inv : kd::mul_rn(o, corr) * inv;
}

/// Thread `idx` of combine: threads (batch, rows, head_dim), channels fastest.
KVQ_HOST_DEVICE void combine_thread(KVQ_ARG(kvq_combine_args) a, KVQ_GLOBAL const float* part_out,
                                    KVQ_GLOBAL const float* part_max, KVQ_GLOBAL const float* part_sum,
                                    KVQ_GLOBAL const float* sinks, KVQ_GLOBAL float* out, i64 idx) {
  const i64 per_seq = static_cast<i64>(a.q_heads) * a.head_dim;
  if (idx >= per_seq * a.batch) return;
  const int b = static_cast<int>(idx / per_seq);
  const i64 rem = idx - static_cast<i64>(b) * per_seq;
  const int h = static_cast<int>(rem / a.head_dim);
  combine_at(a, part_out, part_max, part_sum, sinks, out, b, h,
             static_cast<int>(rem - static_cast<i64>(h) * a.head_dim));
}

}  // namespace kernels
KVQ_NAMESPACE_END
