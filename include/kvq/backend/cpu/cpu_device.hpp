// kvq: the CPU as a device of the cache core: host memory from a memory resource, and the plans
// of core/plans.hpp run directly with the CPU kernels (the SIMD level of this translation unit,
// backend/cpu/kernels.hpp).
//
// Rows are gathered per plan step (from the input, widened to f32, or from the f16 residual),
// encoded by whole batches of rows or tiles, and decoded straight into the caller's memory.
// Stateless apart from the memory resource: appends on different layers may run concurrently.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>

#include "../../codec/rotated.hpp"
#include "../../core/cache_core.hpp"
#include "../../memory_resource.hpp"
#include "kernels.hpp"

#if defined(__linux__)
#  include <sys/mman.h>
#endif

KVQ_NAMESPACE_BEGIN
namespace detail {

/// The size of a transparent huge page on x86-64 (and of the ranges kvq advises elsewhere).
inline constexpr std::size_t huge_page_bytes = std::size_t{2} << 20;

/// Asks the kernel to back the huge_page_bytes-aligned part of [p, p + bytes) with transparent
/// huge pages (Linux: madvise MADV_HUGEPAGE, which the "madvise" mode needs); a hint, ignored where
/// it is refused or unknown. First touches then fault once per 2 MiB instead of once per 4 KiB.
inline void advise_huge_pages(void* p, std::size_t bytes) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  std::uintptr_t const begin = reinterpret_cast<std::uintptr_t>(p);
  std::uintptr_t const first = (begin + huge_page_bytes - 1) & ~std::uintptr_t{huge_page_bytes - 1};
  std::uintptr_t const last = (begin + bytes) & ~std::uintptr_t{huge_page_bytes - 1};
  if (last > first) (void)::madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

/// The run-time parameters of codec C as its region carries them (fp8 / fp4 scale, fp8 overflow).
template <codec C>
auto params_of(kvq_region const& r) -> typename C::params_type {
  typename C::params_type p{};
  if constexpr (std::is_same_v<typename C::params_type, fp8_params>) {
    p.scale = r.codec_scale;
    p.overflow = r.fp8_saturate != 0 ? fp8_overflow::saturate : fp8_overflow::no_saturate;
  } else if constexpr (std::is_same_v<typename C::params_type, fp4_params>) {
    p.scale = r.codec_scale;
  }
  return p;
}

/// The cache core's device for host memory and the CPU kernels (see the file comment).
class cpu_device {
 public:
  using backend_tag = cpu;
  using stream_type = no_stream;
  using layer_type = std::byte*;
  using input_type = void const*;
  using output_type = void*;
  static constexpr char const* name = "cache";
  static constexpr std::int64_t max_capacity = std::int64_t{1} << 40;
  static constexpr bool host_memory = true;  ///< address() is host memory, readable in place

  /// A device allocating from `memory` (nullptr: the default resource), which must outlive it.
  explicit cpu_device(kvq::memory_resource* memory = nullptr)
      : memory_(memory != nullptr ? memory : kvq::get_default_memory_resource()),
        new_delete_(memory_->is_equal(*kvq::new_delete_memory_resource())) {}

  /// `bytes` zero-filled bytes from the resource, advised for huge pages (advise_huge_pages):
  /// aligned to huge_page_bytes when they are that many and the resource is new/delete (whose
  /// alignment costs address space only), else to storage_alignment (a caller's resource, an arena
  /// sized by plan_memory say, is never asked for more). kvq::load of a new 72 MiB cache (8 layers)
  /// measured 4-5x faster than with 4 KiB pages on a virtual machine, where each fault is costly.
  auto allocate(std::size_t bytes) -> std::byte* {
    void* p = memory_->allocate(bytes, alignment(bytes));
    advise_huge_pages(p, bytes);  // before the first touch
    std::memset(p, 0, bytes);
    return static_cast<std::byte*>(p);
  }
  void deallocate(std::byte* p, std::size_t bytes) noexcept { memory_->deallocate(p, bytes, alignment(bytes)); }
  /// The alignment allocate(bytes) asks the resource for.
  auto alignment(std::size_t bytes) const noexcept -> std::size_t {
    return new_delete_ && bytes >= huge_page_bytes ? huge_page_bytes : storage_alignment;
  }
  auto address(std::byte* layer) const noexcept -> std::byte* { return layer; }
  auto output_at(std::byte* layer, std::size_t offset) const noexcept -> void* { return layer + offset; }
  auto offset_output(void* out, std::size_t bytes) const noexcept -> void* {
    return static_cast<std::byte*>(out) + bytes;
  }
  auto finish(no_stream) const noexcept -> device_status { return {}; }
  /// Copies `bytes` bytes at `offset` of `layer` to host memory `dst`.
  auto copy_out(std::byte* layer, std::size_t offset, void* dst, std::size_t bytes) const noexcept -> device_status {
    std::memcpy(dst, layer + offset, bytes);
    return {};
  }
  /// Copies `bytes` bytes of host memory `src` to `offset` of `layer`.
  auto copy_in(std::byte* layer, std::size_t offset, void const* src, std::size_t bytes) const noexcept
      -> device_status {
    std::memcpy(layer + offset, src, bytes);
    return {};
  }

  /// Runs one write step of an append plan with the kernels of codec C.
  template <codec Codec>
  auto write(write_step const& s, std::byte* layer, void const* input, no_stream) const -> device_status {
    using C = stored_codec_t<Codec>;  // the kernels of the stored bytes; input rows are rotated first
    kvq_write_args const& a = s.args;
    int const d = a.head_dim;
    auto const params = params_of<C>(a.dst);
    side_rotation<Codec> const rotation(d);
    row_rotation const* rot = rotation.get();
    if (s.kernel == write_kernel::encode_key_tiles) {
      if constexpr (C::layout == codec_layout::token_group) {
        // A tile of G tokens is read token by token for a block of kv_heads at once (in memory
        // order, the input is token-major), into (kv_heads block, G, head_dim) scratch, then
        // encoded head by head from there.
        int const g = a.dst.group;
        int const block = std::clamp(tile_scratch_floats / (g * d), 1, a.kv_heads);
        write_scratch scratch(d, g * block);
        for (int j = 0; j < a.count / g; ++j) {
          for (int h0 = 0; h0 < a.kv_heads; h0 += block) {
            int const nh = std::min(block, a.kv_heads - h0);
            for (int t = 0; t < g; ++t) {
              prefetch_input_rows(a, input, j * g + t + 1, h0, nh);
              copy_token_rows(a, layer, input, j * g + t, h0, nh, scratch.row(t), std::ptrdiff_t{g} * d, rot);
            }
            for (int k = 0; k < nh; ++k)
              encode_tile<C>(scratch.row(k * g), d, d, unit(layer, a, h0 + k, a.first + j), params);
          }
        }
      }
      return {};
    }
    write_scratch scratch(d, write_scratch::chunk);
    // Encoded rows and f16 residual rows: token by token, the kv_heads of a token in one call (up to
    // a chunk of them). The input is read in memory order (token-major), which measured 1.4-1.9x
    // faster than chunks of tokens head by head, and a call's rows fill whole batches of the kernels.
    for (int i = 0; i < a.count; ++i) {
      for (int h0 = 0; h0 < a.kv_heads; h0 += write_scratch::chunk) {
        int const nh = std::min(write_scratch::chunk, a.kv_heads - h0);
        if (f16_input_as_stored<C>(s, rot, i)) {
          copy_f16_input_rows(a, layer, input, s.kernel == write_kernel::store_f16_rows, i, h0, nh);
          continue;
        }
        prefetch_input_rows(a, input, i + 1, h0, nh);
        auto const [rows, stride] = token_rows_of(a, layer, input, i, h0, nh, scratch, rot);
        if (s.kernel == write_kernel::encode_rows) {
          if constexpr (C::layout == codec_layout::row)
            cpu_kernels::encode_rows<C>(rows, stride, nh, d, unit(layer, a, h0, a.first + i), a.dst.head_stride,
                                        params);
        } else {  // store_f16_rows: finite values beyond ±65504 saturate
          std::int64_t const row = (a.first + i) % a.dst.residual_rows;
          for (int k = 0; k < nh; ++k)
            cpu_kernels::convert_to_f16_satfinite(rows + static_cast<std::ptrdiff_t>(k) * stride,
                                                  residual_row(layer, a.dst, h0 + k, row, d), d);
        }
      }
    }
    return {};
  }

  /// Decodes the tokens of a decode argument with the kernels of codec C, into `out` (un-rotated
  /// when C is rotated and the argument asks for it).
  template <codec Codec>
  auto decode(kvq_decode_args const& a, std::byte* layer, void* out, no_stream) const -> device_status {
    using C = stored_codec_t<Codec>;
    int const d = a.head_dim;
    auto const params = params_of<C>(a.src);
    detail::vector<float> row(static_cast<std::size_t>(d));
    side_rotation<Codec> const rotation(d);
    for (int i = 0; i < a.count; ++i) {
      decode_token<C>(a.src, layer, a.head, a.first + i, d, row.data(), params);
      if (a.unrotate != 0) rotation.inverse_rows(row.data(), 1, d);
      std::size_t const o = static_cast<std::size_t>(i) * a.out_stride;
      switch (a.out_type) {
        case kvq_elem_f32:
          std::memcpy(static_cast<float*>(out) + o, row.data(), static_cast<std::size_t>(d) * sizeof(float));
          break;
        case kvq_elem_f16:
          cpu_kernels::convert_from_f32(row.data(), static_cast<f16*>(out) + o, d);
          break;
        case kvq_elem_f16_sat:  // a decoded KIVI group can reach 65536
          cpu_kernels::convert_to_f16_satfinite(row.data(), static_cast<f16*>(out) + o, d);
          break;
        default:
          cpu_kernels::convert_from_f32(row.data(), static_cast<bf16*>(out) + o, d);
          break;
      }
    }
    return {};
  }

  /// Decodes token t of kv_head `head` of a region (an encoded unit or an f16 residual row) to f32.
  template <codec C>
  static void decode_token(kvq_region const& r, std::byte const* layer, int head, std::int64_t t, int d, float* y,
                           typename C::params_type const& params) {
    std::byte const* reg = layer + r.head0 + static_cast<std::size_t>(head) * r.head_stride;
    if (t >= r.quantized) {
      std::int64_t const row = (r.residual_first + (t - r.quantized)) % r.residual_rows;
      auto const* res =
          reinterpret_cast<f16 const*>(layer + r.residual0 + static_cast<std::size_t>(head) * r.residual_stride);
      cpu_kernels::convert_to_f32(res + row * d, y, d);
    } else if constexpr (C::layout == codec_layout::token_group) {
      auto const* tile =
          reinterpret_cast<std::uint8_t const*>(reg) + static_cast<std::size_t>(t / r.group) * r.unit_bytes;
      cpu_kernels::decode_tile_tokens<C>(tile, d, static_cast<int>(t % r.group), 1, y, d, params);
    } else {
      cpu_kernels::decode_rows<C>(
          reinterpret_cast<std::uint8_t const*>(reg) + static_cast<std::size_t>(t) * r.unit_bytes, r.unit_bytes, 1, d,
          y, d, params);
    }
  }

  /// memmove of `m` inside every kv_head's region.
  auto move(std::byte* layer, std::size_t region0, std::size_t head_stride, int kv_heads, byte_move const& m,
            no_stream) const -> device_status {
    if (m.bytes == 0 || m.src == m.dst) return {};
    for (int h = 0; h < kv_heads; ++h) {
      std::byte* reg = layer + region0 + static_cast<std::size_t>(h) * head_stride;
      std::memmove(reg + m.dst, reg + m.src, m.bytes);
    }
    return {};
  }

 private:
  template <codec C>
  static void encode_tile(float const* tile, std::ptrdiff_t stride, int d, std::uint8_t* dst,
                          typename C::params_type const& params) {
    cpu_kernels::encode_tile<C>(tile, stride, d, dst, params);
  }

  static auto unit(std::byte* layer, kvq_write_args const& a, int h, std::int64_t u) -> std::uint8_t* {
    return reinterpret_cast<std::uint8_t*>(layer + a.dst.head0 + static_cast<std::size_t>(h) * a.dst.head_stride) +
           static_cast<std::size_t>(u) * a.dst.unit_bytes;
  }

  static auto residual_row(std::byte* layer, kvq_region const& r, int h, std::int64_t row, int d) -> f16* {
    return reinterpret_cast<f16*>(layer + r.residual0 + static_cast<std::size_t>(h) * r.residual_stride) + row * d;
  }

  /// f32 elements of the key tiles gathered at once (128 KiB: within L2).
  static constexpr int tile_scratch_floats = 32 * 1024;

  /// Scratch of a write step: `rows` f32 rows of head_dim, on the stack when they fit in 33 KiB.
  class write_scratch {
   public:
    static constexpr int chunk = 32;  // input rows per kernel call (16 KiB of f32 at head_dim 128)
    write_scratch(int d, int rows) : d_(d) {
      std::size_t const floats = static_cast<std::size_t>(rows) * static_cast<std::size_t>(d);
      if (floats > stack_floats) heap_.reset(new float[floats]);  // uninitialised: written before read
    }
    auto rows() noexcept -> float* { return heap_ ? heap_.get() : stack_; }
    auto row(int i) noexcept -> float* { return rows() + static_cast<std::ptrdiff_t>(i) * d_; }

   private:
    static constexpr std::size_t stack_floats = 33 * 256;
    int d_;
    alignas(64) float stack_[stack_floats];
    std::unique_ptr<float[]> heap_;
  };

  /// True when batch row i of step s is f16 input that the step stores as f16 (the f16 cache's rows,
  /// f16 residual rows), neither rotated nor centered: its bits are stored as they are, NaNs quieted,
  /// which is what widening to f32 and narrowing back gives.
  template <codec C>
  static bool f16_input_as_stored(write_step const& s, row_rotation const* rot, int i) noexcept {
    kvq_source const& src = s.args.src;
    bool const f16_rows = (s.kernel == write_kernel::store_f16_rows && s.args.mode == kvq_write_rows) ||
                          (s.kernel == write_kernel::encode_rows && std::is_same_v<C, f16_codec>);
    return f16_rows && src.type == kvq_elem_f16 && rot == nullptr && src.mean == 0 && i >= src.from_residual;
  }

  /// Batch row i of kv_heads [h0, h0 + n) of f16 input into its f16 rows (f16_input_as_stored):
  /// residual rows (first + i) % residual_rows when `residual`, else units first + i.
  static void copy_f16_input_rows(kvq_write_args const& a, std::byte* layer, void const* input, bool residual, int i,
                                  int h0, int n) noexcept {
    int const d = a.head_dim;
    std::int64_t const token = a.src.first + i - a.src.from_residual;
    for (int k = 0; k < n; ++k) {
      int const h = h0 + k;
      f16 const* x = static_cast<f16 const*>(input) + token * static_cast<std::int64_t>(a.src.token_stride) +
                     static_cast<std::int64_t>(h) * static_cast<std::int64_t>(a.src.head_stride);
      f16* y = residual ? residual_row(layer, a.dst, h, (a.first + i) % a.dst.residual_rows, d)
                        : reinterpret_cast<f16*>(unit(layer, a, h, a.first + i));
      cpu_kernels::copy_f16_quieted(x, y, d);
    }
  }

  /// Batch row i of kv_heads [h0, h0 + n) as f32 rows (pointer, stride in floats): the f32 input
  /// itself when the rows need nothing done to them, else copy_token_rows into the scratch (n <= its
  /// rows).
  static auto token_rows_of(kvq_write_args const& a, std::byte* layer, void const* input, int i, int h0, int n,
                            write_scratch& scratch, row_rotation const* rot)
      -> std::pair<float const*, std::ptrdiff_t> {
    bool const as_is = a.src.type == kvq_elem_f32 && rot == nullptr && a.src.round_f16 == 0 && a.src.mean == 0 &&
                       i >= a.src.from_residual;
    if (as_is)
      return {static_cast<float const*>(input) +
                  (a.src.first + i - a.src.from_residual) * static_cast<std::int64_t>(a.src.token_stride) +
                  static_cast<std::int64_t>(h0) * static_cast<std::int64_t>(a.src.head_stride),
              static_cast<std::ptrdiff_t>(a.src.head_stride)};
    copy_token_rows(a, layer, input, i, h0, n, scratch.rows(), a.head_dim, rot);
    return {scratch.rows(), a.head_dim};
  }

  /// Asks for the f32 input rows of batch row i, kv_heads [h0, h0 + n), to be brought into L2;
  /// nothing for a row past the step, one from the residual or f16 / bf16 input. The write loops ask
  /// one token ahead: a token's f32 rows of every kv_head span whole 4 KiB pages, where the hardware
  /// prefetcher starts over (q4_0 / q8_0 f32 prefill appends measured 1.1-1.6x faster with the
  /// AVX-512 kernels, unchanged with the compute-bound AVX2 ones; f16 input,
  /// half as many bytes a token, measured slower with it). Always inlined: GCC finds a function of
  /// prefetches alone free of side effects and drops its calls.
  KVQ_CPU_ALWAYS_INLINE static void prefetch_input_rows(kvq_write_args const& a, void const* input, int i, int h0,
                                                        int n) noexcept {
#if defined(__GNUC__)
    if (i >= a.count || i < a.src.from_residual || a.src.type != kvq_elem_f32) return;
    std::size_t const elem = sizeof(float);
    std::size_t const token = static_cast<std::size_t>(a.src.first + i - a.src.from_residual);
    auto const* first = static_cast<unsigned char const*>(input) + token * a.src.token_stride * elem;
    std::size_t const row_bytes = static_cast<std::size_t>(a.head_dim) * elem;
    for (int k = 0; k < n; ++k) {
      unsigned char const* row = first + static_cast<std::size_t>(h0 + k) * a.src.head_stride * elem;
      for (std::size_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(row + o, 0, 2);
    }
#else
    (void)a;
    (void)input;
    (void)i;
    (void)h0;
    (void)n;
#endif
  }

  /// Batch row i of kv_heads [h0, h0 + n) as f32 rows into out + k * out_stride (see kvq_source): a
  /// residual row as stored (i < from_residual), or an input row widened, rotated by `rot` when not
  /// null and f16-rounded, saturating, when the step says so, each while it is in L1.
  static void copy_token_rows(kvq_write_args const& a, std::byte* layer, void const* input, int i, int h0, int n,
                              float* out, std::ptrdiff_t out_stride, row_rotation const* rot) {
    int const d = a.head_dim;
    if (i < a.src.from_residual) {  // stored rotated and rounded already
      std::int64_t const row = (a.src.residual_first + i) % a.dst.residual_rows;
      for (int k = 0; k < n; ++k)
        cpu_kernels::convert_to_f32(residual_row(layer, a.dst, h0 + k, row, d), out + k * out_stride, d);
      return;
    }
    std::int64_t const token = a.src.first + i - a.src.from_residual;
    for (int k = 0; k < n; ++k) read_input_row(a, input, token, h0 + k, out + k * out_stride, rot);
  }

  /// Input row (token, kv_head h) as the step encodes it, into y: (head_dim) widened to f32,
  /// rotated by `rot` when not null, then f16-rounded, saturating, when the step says so (as stored
  /// in the f16 residual: finite values beyond ±65504 become ±65504, not Inf).
  static void read_input_row(kvq_write_args const& a, void const* input, std::int64_t token, int h, float* y,
                             row_rotation const* rot) {
    int const d = a.head_dim;
    std::int64_t const at = token * static_cast<std::int64_t>(a.src.token_stride) +
                            static_cast<std::int64_t>(h) * static_cast<std::int64_t>(a.src.head_stride);
    if (a.src.type == kvq_elem_f32) {
      float const* x = static_cast<float const*>(input) + at;
      if (rot != nullptr) {
        rot->forward_rows(x, d, y, d, 1);  // rotated on the way from the input to y
      } else if (a.src.round_f16 != 0) {
        cpu_kernels::round_to_f16_satfinite(x, y, d);  // widened and rounded in one pass
        return;
      } else {
        cpu_kernels::convert_to_f32(x, y, d);
      }
    } else {
      if (a.src.type == kvq_elem_f16)
        cpu_kernels::convert_to_f32(static_cast<f16 const*>(input) + at, y, d);
      else
        cpu_kernels::convert_to_f32(static_cast<bf16 const*>(input) + at, y, d);
      if (rot != nullptr) rot->forward_rows(y, 1, d);
    }
    if (a.src.round_f16 != 0) cpu_kernels::round_to_f16_satfinite(y, y, d);
  }

  kvq::memory_resource* memory_;
  bool new_delete_;  ///< memory_ is the new/delete resource
};

}  // namespace detail
KVQ_NAMESPACE_END
