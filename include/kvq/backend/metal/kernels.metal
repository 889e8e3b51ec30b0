// kvq: Metal kernels of the quantized KV cache: entry points over the shared kernel bodies.
//
// Every kernel below only reads its thread's position and calls one function of
// core/kernel_bodies.h, the bodies that the CUDA kernels and the host tests run too; the element
// math (rounding, scales, fp8/f16 conversions, KIVI parameters) is the scalar reference's own code
// (kvq/detail/*.h). Encoded bytes and decoded values are the CPU cache's, and attention agrees
// with kvq::decode_attention within fp32 rounding.
//
// Kernels (arguments: core/kernel_args.h; buffer 0 is always the argument struct):
//   kvq_encode_rows       encode rows of a row codec (keys or values) into the cache
//   kvq_encode_key_tiles  encode KIVI key tiles (per channel over G tokens) into the cache
//   kvq_store_f16_rows    store rows as f16 into the KIVI key residual / value window
//   kvq_decode            decode a token range of one kv_head to f32, f16 or bf16
//   kvq_attention_partial partial attention state per (kv_head and its rows, split of the context);
//                         buffer 8: the custom mask rows of a multi-token attention (else unused)
//   kvq_attention_combine merge the splits and normalise; buffer 5: the sinks (else unused)
// The codec is a function constant (index 0; index 1 is the value codec of the attention), so
// each pipeline is specialised and the codec switches of the bodies fold away. Grids are
// one-dimensional (the bodies take a linear thread index and bounds-check it), except the
// attention's threadgroups.
//
// Numerics need fast math off: build the library with MTLCompileOptions mathMode = safe (or
// fastMathEnabled = NO) and precise math functions, or `xcrun metal -fno-fast-math`; the pragmas
// below also ask for no contraction of a*b+c into an FMA (kvq's mul_rn/add_rn rely on it).
//
// A host test compiles this file as C++ through a shim (tests/metal/metal_shim.hpp); the two
// KVQ_METAL_* macros below are the only concessions to it.

#pragma METAL fp math_mode(safe)
#pragma METAL fp contract(off)
#pragma clang fp contract(off)

#include <metal_stdlib>
using namespace metal;

#include "../../core/kernel_bodies.h"

#if !defined(KVQ_METAL_FUNCTION_CONSTANT)
#  define KVQ_METAL_FUNCTION_CONSTANT(type, name, index) constant type name [[function_constant(index)]];
#endif
#if !defined(KVQ_METAL_THREADGROUP_BUFFER)
#  define KVQ_METAL_THREADGROUP_BUFFER(index) [[threadgroup(index)]]
#endif

/// The codec of a row kernel, or the key codec of the attention (a kvq_codec_id).
KVQ_METAL_FUNCTION_CONSTANT(int, kvq_codec, 0)
/// The value codec of the attention (a kvq_codec_id).
KVQ_METAL_FUNCTION_CONSTANT(int, kvq_value_codec, 1)

/// The threads of a threadgroup as the attention body sees them: each thread runs its own work
/// (one lane) and the barrier is a threadgroup barrier (the one construct the bodies cannot share).
struct kvq_metal_threads {
  int n;
  int t;
  int count() const { return n; }
  int lanes() const { return 1; }
  int tid(int) const { return t; }
  void barrier() const { threadgroup_barrier(mem_flags::mem_threadgroup); }
};

kernel void kvq_encode_rows(constant kvq_write_args& a [[buffer(0)]], device uchar* layer [[buffer(1)]],
                            device const uchar* input [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  kvq::kernels::encode_rows_thread(kvq_codec, a, layer, input, long(gid));
}

kernel void kvq_encode_key_tiles(constant kvq_write_args& a [[buffer(0)]], device uchar* layer [[buffer(1)]],
                                 device const uchar* input [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  kvq::kernels::encode_key_tiles_thread(kvq_codec, a, layer, input, long(gid));
}

kernel void kvq_store_f16_rows(constant kvq_write_args& a [[buffer(0)]], device uchar* layer [[buffer(1)]],
                               device const uchar* input [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  kvq::kernels::store_f16_rows_thread(a, layer, input, long(gid));
}

kernel void kvq_decode(constant kvq_decode_args& a [[buffer(0)]], device const uchar* layer [[buffer(1)]],
                       device uchar* out [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  kvq::kernels::decode_thread(kvq_codec, a, layer, out, long(gid));
}

kernel void kvq_attention_partial(constant kvq_attention_args& a [[buffer(0)]],
                                  constant kvq_attention_seq* seqs [[buffer(1)]],
                                  device const uchar* layer [[buffer(2)]], device const float* query [[buffer(3)]],
                                  device float* part_out [[buffer(4)]], device float* part_max [[buffer(5)]],
                                  device float* part_sum [[buffer(6)]], device const int* pages [[buffer(7)]],
                                  device const uchar* mask [[buffer(8)]],
                                  threadgroup float* smem KVQ_METAL_THREADGROUP_BUFFER(0),
                                  uint3 tg [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                                  uint threads [[threads_per_threadgroup]]) {
  kvq_metal_threads th;
  th.n = int(threads);
  th.t = int(tid);
  const int b = int(tg.z);
  const long rows = long(a.n_q) * a.q_heads;
  const long q_per_seq = rows * a.head_dim;
  const long part = long(b) * a.splits;
  kvq::kernels::attention_block(kvq_codec, kvq_value_codec, a, seqs[b], layer, layer, pages, query + b * q_per_seq,
                                mask, part_out + part * q_per_seq, part_max + part * rows, part_sum + part * rows, smem,
                                int(tg.x), int(tg.y), th);
}

kernel void kvq_attention_combine(constant kvq_combine_args& a [[buffer(0)]],
                                  device const float* part_out [[buffer(1)]],
                                  device const float* part_max [[buffer(2)]],
                                  device const float* part_sum [[buffer(3)]], device float* out [[buffer(4)]],
                                  device const float* sinks [[buffer(5)]], uint gid [[thread_position_in_grid]]) {
  kvq::kernels::combine_thread(a, part_out, part_max, part_sum, sinks, out, long(gid));
}
