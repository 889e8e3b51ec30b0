// kvq header warning check: instantiates the CUDA cache's host logic (cuda_cache_core) over a
// runtime that calls the kernel bodies of core/kernel_bodies.h on the CPU (as
// tests/test_cuda_host.cpp does), for every codec, with the strict consumer flags of
// tests/header_warnings/CMakeLists.txt. Compile-only: nothing here is ever run.
#include <kvq/backend/cuda/cuda_cache_core.hpp>
#include <kvq/backend/cuda/cuda_paged_cache.hpp>
#include <kvq/core/kernel_bodies.h>
#include <kvq/persist.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

namespace kvq_header_warnings {

/// A runtime of cuda_cache_core running the kernel bodies on the CPU.
struct host_runtime {
  using stream_type = int;
  auto sm_count() const -> int { return 4; }
  auto smem_per_block() const -> std::size_t { return 48 * 1024; }
  auto allocate(void** p, std::size_t bytes) const -> kvq::device_status {
    *p = std::calloc(bytes, 1);
    return {};
  }
  void deallocate(void* p) const noexcept { std::free(p); }
  auto copy_2d(void*, std::size_t, void const*, std::size_t, std::size_t, std::size_t, int) const
      -> kvq::device_status {
    return {};
  }
  auto upload(void* dst, void const* src, std::size_t bytes, int) const -> kvq::device_status {
    std::memcpy(dst, src, bytes);
    return {};
  }
  auto download(void* dst, void const* src, std::size_t bytes, int) const -> kvq::device_status {
    std::memcpy(dst, src, bytes);
    return {};
  }
  auto zero(void*, std::size_t, int) const -> kvq::device_status { return {}; }
  auto synchronize(int) const -> kvq::device_status { return {}; }
  auto synchronize_device() const -> kvq::device_status { return {}; }
  static auto in(void const* p) -> unsigned char const* { return static_cast<unsigned char const*>(p); }
  template <int C>
  auto encode_rows(kvq_write_args const& a, unsigned char* layer, void const* input, long long n, int) const
      -> kvq::device_status {
    for (long long i = 0; i < n; ++i) kvq::kernels::encode_rows_thread(C, a, layer, in(input), i);
    return {};
  }
  template <int C>
  auto encode_key_tiles(kvq_write_args const& a, unsigned char* layer, void const* input, long long n, int) const
      -> kvq::device_status {
    for (long long i = 0; i < n; ++i) kvq::kernels::encode_key_tiles_thread(C, a, layer, in(input), i);
    return {};
  }
  auto store_f16_rows(kvq_write_args const& a, unsigned char* layer, void const* input, long long n, int) const
      -> kvq::device_status {
    for (long long i = 0; i < n; ++i) kvq::kernels::store_f16_rows_thread(a, layer, in(input), i);
    return {};
  }
  template <int C>
  auto decode(kvq_decode_args const& a, unsigned char const* layer, void* out, long long n, int) const
      -> kvq::device_status {
    for (long long i = 0; i < n; ++i) kvq::kernels::decode_thread(C, a, layer, static_cast<unsigned char*>(out), i);
    return {};
  }
  /// The threads of one emulated block.
  struct threads {
    int n;
    auto count() const -> int { return n; }
    auto lanes() const -> int { return n; }
    auto tid(int k) const -> int { return k; }
    void barrier() const {}
  };
  template <int KC, int VC>
  auto attention(kvq_attention_args const& a, kvq_cuda::attention_batch const& b, unsigned gx, unsigned gy, unsigned gz,
                 int nthreads, std::size_t smem_bytes, int) const -> kvq::device_status {
    std::vector<float> sm(smem_bytes / sizeof(float));
    long long const rows = static_cast<long long>(a.n_q) * a.q_heads;
    long long const qd = rows * a.head_dim;
    for (unsigned z = 0; z < gz; ++z)
      for (unsigned y = 0; y < gy; ++y)
        for (unsigned x = 0; x < gx; ++x) {
          long long const part = static_cast<long long>(z) * a.splits;
          kvq::kernels::attention_block(
              KC, VC, a, b.seqs != nullptr ? b.seqs[z] : b.seq[z], b.seqs != nullptr ? b.layer[0] : b.layer[z],
              b.seqs != nullptr ? b.layer[0] : b.layer[z], b.pages, b.q + z * qd,
              static_cast<unsigned char const*>(b.mask), b.part_out + part * qd, b.part_max + part * rows,
              b.part_sum + part * rows, sm.data(), static_cast<int>(x), static_cast<int>(y), threads{nthreads});
        }
    return {};
  }
  auto combine(kvq_combine_args const& a, float const* po, float const* pm, float const* ps, float const* sinks,
               float* out, long long n, int) const -> kvq::device_status {
    for (long long i = 0; i < n; ++i) kvq::kernels::combine_thread(a, po, pm, ps, sinks, out, i);
    return {};
  }
};

/// Every operation of cuda_cache_core<Choice>, and the batched attention.
template <class Choice>
void use_core(float const* x, kvq::f16 const* h, kvq::bf16 const* b, float* out) {
  using core_t = kvq::cuda_cache_core<Choice, host_runtime>;
  typename core_t::options o;
  o.residual = 32;
  core_t c({2, 2, 64, 256}, o, host_runtime{});
  c.append(0, kvq::token_major(x, 3, 2, 64), kvq::token_major(x, 3, 2, 64), 0);
  c.append(0, kvq::token_major(h, 3, 2, 64), kvq::token_major(h, 3, 2, 64), 0);
  c.append(1, kvq::token_major(b, 3, 2, 64), kvq::token_major(b, 3, 2, 64), 0);
  c.read_keys(0, 1, 0, 2, out, 0, 0);
  c.read_values(0, 1, 0, 2, reinterpret_cast<kvq::f16*>(out), 64, 0);
  c.read_values(0, 0, 0, 2, reinterpret_cast<kvq::bf16*>(out), 64, 0);
  kvq::storage_view const kv = c.key_storage(0, 0);
  kvq::storage_view const vv = c.value_storage(0, 0);
  out[0] = static_cast<float>(kv.unit_bytes + vv.unit_bytes + c.layer_bytes());
  c.attention(0, x, 4, out, {}, 0);
  kvq::attention_options mt;
  mt.mask = kvq::mask_kind::none;
  c.attention(0, x, std::int64_t{2}, 4, out, mt, 0);
  kvq::basic_cuda_workspace<host_runtime> ws(c.runtime());
  core_t* cores[] = {&c};
  kvq::detail::cuda_attention_batch<Choice, host_runtime>(std::span<core_t* const>(cores), 0, x, 4, out, {}, ws, 0);
  c.truncate(2, 0);
  c.shift_left(1, 0);
  c.synchronize(0);
  out[1] = static_cast<float>(c.memory().bits_per_element);
  // Saving and loading.
  std::vector<std::byte> image;
  kvq::vector_writer w(image);
  kvq::save(c, w);
  kvq::load_into(c, kvq::span_reader(image));
  out[3] = static_cast<float>(kvq::saved_bytes(c));
  c.reset();

  // The paged cache.
  using paged_t = kvq::cuda_paged_cache_core<Choice, host_runtime>;
  paged_t p({2, 2, 64, 32, 8, 4}, o, host_runtime{});
  auto const s = p.add_sequence();
  p.reserve(s, 3);
  p.append(s, 0, kvq::token_major(x, 3, 2, 64), kvq::token_major(x, 3, 2, 64), 0);
  p.append(s, 1, kvq::token_major(h, 3, 2, 64), kvq::token_major(h, 3, 2, 64), 0);
  auto const f = p.fork(s, 0);
  p.append(f, 1, kvq::token_major(b, 1, 2, 64), kvq::token_major(b, 1, 2, 64), 0);
  p.read_keys(f, 0, 1, 0, 2, out, 0, 0);
  p.read_values(f, 1, 0, 0, 2, reinterpret_cast<kvq::f16*>(out), 64, 0);
  kvq::sequence_id const ids[] = {s, f};
  p.attention(0, std::span<kvq::sequence_id const>(ids), x, 4, out, {}, 0);
  kvq::query_chunk const chunks[] = {{s, 2, 0, nullptr, 0}, {s, 1, -1, nullptr, 0}};
  p.attention(0, std::span<kvq::query_chunk const>(chunks), x, 4, out, {}, 0);
  p.truncate(f, 1, 0);
  p.release(f);
  // Exporting and importing a sequence.
  std::vector<std::byte> shipped;
  kvq::vector_writer sw(shipped);
  kvq::export_sequence(p, s, sw);
  kvq::export_sequence(p, s, 0, 1, sw);
  auto const imported = kvq::import_sequence(p, kvq::span_reader(shipped));
  kvq::import_sequence(p, imported, kvq::span_reader(shipped));
  p.synchronize(0);
  out[2] = static_cast<float>(p.memory().bits_per_element + static_cast<double>(p.pages().used_bytes) +
                              static_cast<double>(p.size(s) + p.size(s, 1)) +
                              static_cast<double>(p.page_table(s).size() + p.pool_bytes()));
}

}  // namespace kvq_header_warnings

/// Keeps the instantiations (an external function the compiler must emit).
void kvq_header_warnings_cuda_host(float const* x, kvq::f16 const* h, kvq::bf16 const* b, float* out);
void kvq_header_warnings_cuda_host(float const* x, kvq::f16 const* h, kvq::bf16 const* b, float* out) {
  using namespace kvq_header_warnings;
  use_core<kvq::f32_codec>(x, h, b, out);
  use_core<kvq::f16_codec>(x, h, b, out);
  use_core<kvq::q8_0>(x, h, b, out);
  use_core<kvq::q4_0>(x, h, b, out);
  use_core<kvq::int8_sym>(x, h, b, out);
  use_core<kvq::fp8_e4m3>(x, h, b, out);
  use_core<kvq::mxfp4>(x, h, b, out);
  use_core<kvq::nvfp4>(x, h, b, out);
  use_core<kvq::fp8_e5m2>(x, h, b, out);
  use_core<kvq::kivi<2>>(x, h, b, out);
  use_core<kvq::kivi<4>>(x, h, b, out);
  use_core<kvq::kivi<8>>(x, h, b, out);
  use_core<kvq::kv_codecs<kvq::q8_0, kvq::q4_0>>(x, h, b, out);
  use_core<kvq::kv_codecs<kvq::kivi_key<8>, kvq::fp8_e5m2>>(x, h, b, out);
}
