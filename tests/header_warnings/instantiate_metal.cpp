// kvq header warning check: instantiates the Metal cache (backend/metal/metal_cache.hpp) on the
// mock metal-cpp of tests/metal/mock_metal_cpp (included as system headers: they stand for Apple's),
// for every codec, with the strict consumer flags of tests/header_warnings/CMakeLists.txt.
// Compile-only: nothing here is ever run.
#include <kvq/attention.hpp>
#include <kvq/cache.hpp>
#include <kvq/kvq.hpp>

#include <cstdint>
#include <memory>

// As tests/metal/metal_cache_checks.cpp does it: metal_cache.hpp declares the cache only on Apple
// platforms with KVQ_WITH_METAL.
#include <metal_shim.hpp>
#if !defined(__APPLE__)
#  define __APPLE__ 1
#  define KVQ_UNDEF_APPLE 1
#endif
#define KVQ_WITH_METAL 1
#include <kvq/backend/metal/metal_cache.hpp>
#include <kvq/persist.hpp>
#if defined(KVQ_UNDEF_APPLE)
#  undef __APPLE__
#endif

namespace kvq_header_warnings {

/// Every operation of the Metal cache of codec choice Choice.
template <class Choice>
void use_metal(MTL::Device* device, MTL::CommandQueue* queue, float const* x, kvq::f16 const* h, kvq::bf16 const* b,
               float* out) {
  using cache_t = kvq::QuantizedKVCache<Choice, kvq::metal>;
  auto lib = std::make_shared<kvq::metal_library>(device);
  typename cache_t::options o;
  o.residual = 32;
  cache_t c(lib, queue, {2, 2, 64, 256}, o);
  c.append(0, kvq::token_major(x, 3, 2, 64), kvq::token_major(x, 3, 2, 64));
  c.append(0, kvq::token_major(h, 3, 2, 64), kvq::token_major(h, 3, 2, 64));
  c.append(1, kvq::token_major(b, 3, 2, 64), kvq::token_major(b, 3, 2, 64));
  MTL::Buffer* buf = c.layer_buffer(0);
  kvq::metal_tensor const t{buf, 0, 1, 2, 64, 128, 64, kvq_metal_elem_f32};
  c.append(1, t, t);
  c.read_keys(0, 1, 0, 2, out);
  c.read_values(0, 1, 0, 2, reinterpret_cast<kvq::f16*>(out), 64);
  c.read(true, 0, 0, 0, 2, buf, 64, kvq_metal_elem_f16, 64);
  c.attention(0, x, 4, out);
  c.attention(0, buf, 16, 4, buf, 0, {});
  c.attention(0, x, std::int64_t{2}, 4, out);
  auto const part = c.attend(0, x, 4, 0, 1);
  kvq::finalize(part, out);
  c.truncate(2);
  c.shift_left(1);
  c.synchronize();
  out[0] = static_cast<float>(c.memory().bits_per_element + static_cast<double>(c.size(0)));
  // Saving and loading.
  std::vector<std::byte> image;
  kvq::vector_writer w(image);
  kvq::save(c, w);
  kvq::load_into(c, kvq::span_reader(image));
  out[2] = static_cast<float>(kvq::saved_bytes(c));
  c.reset();

  // The paged cache.
  using paged_t = kvq::PagedKVCache<Choice, kvq::metal>;
  paged_t p(lib, queue, {2, 2, 64, 32, 8, 4}, o);
  auto const s = p.add_sequence();
  p.reserve(s, 3);
  p.append(s, 0, kvq::token_major(x, 3, 2, 64), kvq::token_major(x, 3, 2, 64));
  p.append(s, 1, kvq::token_major(h, 3, 2, 64), kvq::token_major(h, 3, 2, 64));
  auto const f = p.fork(s);
  p.append(f, 1, kvq::token_major(b, 1, 2, 64), kvq::token_major(b, 1, 2, 64));
  p.read_keys(f, 0, 1, 0, 2, out);
  p.read_values(f, 1, 0, 0, 2, reinterpret_cast<kvq::f16*>(out), 64);
  kvq::sequence_id const ids[] = {s, f};
  p.attention(0, std::span<kvq::sequence_id const>(ids), x, 4, out);
  kvq::query_chunk const chunks[] = {{s, 2, 0, nullptr, 0}, {f, 1, -1, nullptr, 0}};
  p.attention(0, std::span<kvq::query_chunk const>(chunks), x, 4, out);
  p.truncate(f, 1);
  p.release(f);
  // Exporting and importing a sequence.
  std::vector<std::byte> shipped;
  kvq::vector_writer ws(shipped);
  kvq::export_sequence(p, s, ws);
  kvq::export_sequence(p, s, 0, 1, ws);
  auto const imported = kvq::import_sequence(p, kvq::span_reader(shipped));
  kvq::import_sequence(p, imported, kvq::span_reader(shipped));
  p.synchronize();
  out[1] =
      static_cast<float>(p.memory().bits_per_element + static_cast<double>(p.pages().used_bytes) +
                         static_cast<double>(p.size(s) + p.size(s, 1)) + static_cast<double>(p.page_table(s).size()) +
                         static_cast<double>(p.pool_buffer()->length()));
}

}  // namespace kvq_header_warnings

/// Keeps the instantiations (an external function the compiler must emit).
void kvq_header_warnings_metal(MTL::Device* device, MTL::CommandQueue* queue, float const* x, kvq::f16 const* h,
                               kvq::bf16 const* b, float* out);
void kvq_header_warnings_metal(MTL::Device* device, MTL::CommandQueue* queue, float const* x, kvq::f16 const* h,
                               kvq::bf16 const* b, float* out) {
  using namespace kvq_header_warnings;
  use_metal<kvq::f32_codec>(device, queue, x, h, b, out);
  use_metal<kvq::f16_codec>(device, queue, x, h, b, out);
  use_metal<kvq::q8_0>(device, queue, x, h, b, out);
  use_metal<kvq::mxfp4>(device, queue, x, h, b, out);
  use_metal<kvq::nvfp4>(device, queue, x, h, b, out);
  use_metal<kvq::q4_0>(device, queue, x, h, b, out);
  use_metal<kvq::int8_sym>(device, queue, x, h, b, out);
  use_metal<kvq::fp8_e4m3>(device, queue, x, h, b, out);
  use_metal<kvq::fp8_e5m2>(device, queue, x, h, b, out);
  use_metal<kvq::kivi<2>>(device, queue, x, h, b, out);
  use_metal<kvq::kivi<4>>(device, queue, x, h, b, out);
  use_metal<kvq::kivi<8>>(device, queue, x, h, b, out);
  use_metal<kvq::kv_codecs<kvq::q8_0, kvq::q4_0>>(device, queue, x, h, b, out);
  use_metal<kvq::kv_codecs<kvq::kivi_key<8>, kvq::fp8_e5m2>>(device, queue, x, h, b, out);
}
