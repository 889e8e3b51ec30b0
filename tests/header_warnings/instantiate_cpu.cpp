// kvq header warning check: instantiates the main CPU paths of the public headers (warnings in
// templates only show when they are instantiated), compiled with the strict consumer flags of
// tests/header_warnings/CMakeLists.txt. Compile-only: nothing here is ever run.
//
// Covered: QuantizedKVCache for every codec (directly; the any_cache facade's table as declarations)
// with append of f32/f16/bf16, reads, truncate/shift/reset, storage views and memory; decode
// attention (the default kernel, the scalar reference and every SIMD kernel compiled in, for
// every codec pair); the CPU codec kernels of every instruction set compiled in; simd_level; the
// rotation and the tq codebook codecs of rotated rows. The facade's caches themselves are
// instantiated by the generated translation unit of any_cache_instances.hpp, so here the facade
// only declares them (KVQ_ANY_CACHE_SEPARATE).
#define KVQ_ANY_CACHE_SEPARATE
#include <kvq/codec/tq.hpp>
#include <kvq/detail/rotation.h>
#include <kvq/kvq.hpp>
#include <kvq/persist.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace kvq_header_warnings {

using kvq::bf16;
using kvq::f16;
using kivi_value_4_16 = kvq::kivi_value<4, 16>;
using kivi_key_4_16 = kvq::kivi_key<4, 16>;

/// Appends, reads, attends, truncates and shifts a cache of codec choice Choice.
template <class Choice>
void use_cache(float const* x, f16 const* h, bf16 const* b, float* out) {
  using cache_t = kvq::QuantizedKVCache<Choice>;
  typename cache_t::options o;
  o.residual = 32;
  cache_t c({2, 2, 64, 256}, o);
  c.append(0, kvq::token_major(x, 3, 2, 64), kvq::token_major(x, 3, 2, 64));
  c.append(0, kvq::token_major(h, 3, 2, 64), kvq::token_major(h, 3, 2, 64));
  c.append(1, kvq::token_major(b, 3, 2, 64), kvq::token_major(b, 3, 2, 64));
  c.read_keys(0, 1, 0, 2, out);
  c.read_values(0, 1, 0, 2, out, 64);
  std::vector<f16> o16(256);
  std::vector<bf16> ob16(256);
  c.read_keys(0, 0, 0, 2, o16.data());
  c.read_values(0, 0, 0, 2, ob16.data());
  kvq::storage_view const kv = c.key_storage(0, 0);
  kvq::storage_view const vv = c.value_storage(0, 0);
  out[0] = static_cast<float>(kv.unit_bytes + vv.unit_bytes);
  kvq::attention_options opt;
  opt.query = kvq::query_precision::q8_0;
  opt.probabilities = kvq::probability_precision::f16;
  kvq::decode_attention(c, 0, x, 4, out, opt);
  kvq::decode_attention_parallel(c, 0, x, 4, out, 2);
  auto part = kvq::attend_range(c, 0, x, 4, 0, c.size(0), opt);
  kvq::combine(part, kvq::detail::attend_range_with<kvq::detail::reference_attention>(c, 0, x, 4, 0, 1, opt));
#if defined(KVQ_CPU_HAS_AVX2)
  kvq::combine(part, kvq::detail::attend_range_with<kvq::cpu_kernels::avx2::attention_kernel>(c, 0, x, 4, 0, 1, opt));
#endif
#if defined(KVQ_CPU_HAS_AVX512)
  kvq::combine(part, kvq::detail::attend_range_with<kvq::cpu_kernels::avx512::attention_kernel>(c, 0, x, 4, 0, 1, opt));
#endif
#if defined(KVQ_CPU_HAS_NEON)
  kvq::combine(part, kvq::detail::attend_range_with<kvq::cpu_kernels::neon::attention_kernel>(c, 0, x, 4, 0, 1, opt));
#endif
  kvq::finalize(part, out);
  kvq::attention(c, 0, x, 2, 4, out, opt, 2);
  kvq::detail::attention_with<kvq::detail::reference_attention>(c, 0, x, 1, 4, out, opt, 1);
  c.truncate(2);
  c.shift_left(1);
  out[1] = static_cast<float>(c.memory().bits_per_element + kvq::plan_memory<Choice>(c.shape(), 32).bits_per_element);
  cache_t moved(std::move(c));
  // Saving and loading.
  std::vector<std::byte> image;
  kvq::vector_writer w(image);
  kvq::save(moved, w);
  kvq::load_into(moved, kvq::span_reader(image));
  out[2] = static_cast<float>(kvq::saved_bytes(moved));
  auto const loaded = kvq::load<cache_t>(kvq::span_reader(image));
  out[3] = static_cast<float>(loaded.size(0));
  moved.reset();

  // The paged cache and its batched attention.
  using paged_t = kvq::PagedKVCache<Choice>;
  typename paged_t::options po;
  po.residual = 32;
  paged_t p({2, 2, 64, 32, 8, 4}, po);
  auto const s = p.add_sequence();
  p.reserve(s, 3);
  p.append(s, 0, kvq::token_major(x, 3, 2, 64), kvq::token_major(x, 3, 2, 64));
  p.append(s, 1, kvq::token_major(h, 3, 2, 64), kvq::token_major(h, 3, 2, 64));
  p.append(s, 1, kvq::token_major(b, 1, 2, 64), kvq::token_major(b, 1, 2, 64));
  auto const f = p.fork(s);
  p.read_keys(f, 0, 1, 0, 2, out);
  p.read_values(f, 1, 0, 0, 2, o16.data());
  kvq::sequence_id const ids[] = {s, f};
  kvq::paged_decode_attention(p, 0, std::span<kvq::sequence_id const>(ids), x, 4, out, opt, 2);
  kvq::detail::paged_attention_with<kvq::detail::reference_attention>(p, 0, std::span<kvq::sequence_id const>(ids), x,
                                                                      4, out, opt, 1);
  kvq::query_chunk const chunks[] = {{s, 2}, {f, 1}};
  kvq::paged_attention(p, 0, std::span<kvq::query_chunk const>(chunks), x, 4, out, opt, 2);
  kvq::paged_storage_view const pv = p.key_storage(f, 0, 1);
  out[2] = static_cast<float>(pv.page_bytes + p.value_storage(s, 1, 0).unit_bytes + p.page_table(f).size());
  p.truncate(f, 1);
  p.release(f);
  // Exporting and importing a sequence.
  std::vector<std::byte> shipped;
  kvq::vector_writer ws(shipped);
  kvq::export_sequence(p, s, ws);
  kvq::export_sequence(p, s, 0, 1, ws);
  auto const imported = kvq::import_sequence(p, kvq::span_reader(shipped));
  kvq::import_sequence(p, imported, kvq::span_reader(shipped));
  out[3] = static_cast<float>(p.memory().bits_per_element + static_cast<double>(p.pages().used_bytes) +
                              static_cast<double>(p.size(s) + p.size(s, 1) + p.free_pages() + p.used_pages()) +
                              static_cast<double>(kvq::pages_for_budget<Choice>(p.shape(), std::size_t{1} << 24, 32)));
}

/// The codec kernels of one instruction set (namespace NS) for row codec C.
#define KVQ_HW_ROW_CODEC(NS, C)                                 \
  NS::encode_rows<C>(x, 64, 2, 64, dst, 256, C::params_type{}); \
  NS::decode_rows<C>(dst, 256, 2, 64, y, 64, C::params_type{})
/// The codec kernels of one instruction set (namespace NS) for token-group codec C.
#define KVQ_HW_TILE_CODEC(NS, C)          \
  NS::encode_tile<C>(x, 64, 64, dst, {}); \
  NS::decode_tile_tokens<C>(dst, 64, 1, 3, y, 64, {})
/// Every codec and element conversion of one instruction set.
#define KVQ_HW_ISA(NS)                               \
  KVQ_HW_ROW_CODEC(NS, kvq::f32_codec);              \
  KVQ_HW_ROW_CODEC(NS, kvq::f16_codec);              \
  KVQ_HW_ROW_CODEC(NS, kvq::q8_0);                   \
  KVQ_HW_ROW_CODEC(NS, kvq::q4_0);                   \
  KVQ_HW_ROW_CODEC(NS, kvq::int8_sym);               \
  KVQ_HW_ROW_CODEC(NS, kvq::fp8_e4m3);               \
  KVQ_HW_ROW_CODEC(NS, kvq::fp8_e5m2);               \
  KVQ_HW_ROW_CODEC(NS, kvq::mxfp4);                  \
  KVQ_HW_ROW_CODEC(NS, kvq::nvfp4);                  \
  KVQ_HW_ROW_CODEC(NS, kvq::kivi_value<2>);          \
  KVQ_HW_ROW_CODEC(NS, kivi_value_4_16);             \
  KVQ_HW_ROW_CODEC(NS, kvq::kivi_value<8>);          \
  KVQ_HW_TILE_CODEC(NS, kvq::kivi_key<2>);           \
  KVQ_HW_TILE_CODEC(NS, kivi_key_4_16);              \
  KVQ_HW_TILE_CODEC(NS, kvq::kivi_key<8>);           \
  KVQ_HW_ROW_CODEC(NS, kvq::detail::tq_codebook<2>); \
  KVQ_HW_ROW_CODEC(NS, kvq::detail::tq_codebook<3>); \
  KVQ_HW_ROW_CODEC(NS, kvq::detail::tq_codebook<4>); \
  NS::rotate_forward_rows(y, 2, 64, 64, words);      \
  NS::rotate_inverse_rows(y, 2, 64, 64, words);      \
  NS::convert_to_f32(h, y, 64);                      \
  NS::convert_to_f32(b, y, 64);                      \
  NS::convert_to_f32(x, y, 64);                      \
  NS::convert_from_f32(x, h16, 64);                  \
  NS::convert_from_f32(x, b16, 64);                  \
  NS::convert_from_f32(x, y, 64)

/// The CPU codec kernels of every instruction set compiled in, and the dispatching entry points.
void use_kernels(float const* x, f16 const* h, bf16 const* b, std::uint8_t* dst, float* y, f16* h16, bf16* b16) {
  std::uint64_t const words[1] = {0x5a5a5a5a5a5a5a5au};
  KVQ_HW_ISA(kvq::cpu_kernels::scalar);
  KVQ_HW_ISA(kvq::cpu_kernels);
#if defined(KVQ_CPU_HAS_AVX2)
  KVQ_HW_ISA(kvq::cpu_kernels::avx2);
#endif
#if defined(KVQ_CPU_HAS_AVX512)
  KVQ_HW_ISA(kvq::cpu_kernels::avx512);
#endif
#if defined(KVQ_CPU_HAS_NEON)
  KVQ_HW_ISA(kvq::cpu_kernels::neon);
#endif
}

/// The rotation (seeded and with precomputed sign words) and the tq codebook codecs of rotated rows.
template <int B>
void use_tq_codebook(float* x, std::uint8_t* dst, float* y) {
  using codec_t = kvq::detail::tq_codebook<B>;
  std::uint64_t words[2];
  kvq::detail::rotation_sign_words(0x6B7671u, 80, words);
  kvq::detail::rotate_forward(x, 80, 0x6B7671u);
  kvq::detail::rotate_forward_signs(x, 80, words);
  codec_t::encode_row(x, 80, dst, typename codec_t::params_type{});
  codec_t::decode_row(dst, 80, y, typename codec_t::params_type{});
  kvq::detail::rotate_inverse(y, 80, 0x6B7671u);
  kvq::detail::rotate_inverse_signs(y, 80, words);
  y[0] = codec_t::scale(dst, 1) + kvq::detail::tq_decode_element(B, dst, 80, 70) +
         static_cast<float>(codec_t::code(dst, 80, 3) + kvq::detail::tq_code<B>(dst, 80, 4) +
                            static_cast<int>(codec_t::geometry(80).bytes()) + static_cast<int>(codec_t::name.size()));
}

/// Every codec choice of the facade, plus choices with other group sizes.
void use_all(float const* x, f16 const* h, bf16 const* b, float* out) {
  auto any = kvq::make_any_cache({2, 2, 64, 256}, "q8_0", "q4_0");
  any->append(0, kvq::token_major(x, 3, 2, 64), kvq::token_major(x, 3, 2, 64));
  any->attention(0, x, 4, out);
  auto layered = kvq::make_any_cache({2, 2, 64, 256}, {{"kivi4", "kivi4"}, {"fp8_e4m3", "q4_0"}});
  layered->append(1, kvq::token_major(h, 3, 2, 64), kvq::token_major(h, 3, 2, 64));
  layered->shift_left(1);
  auto const part = layered->attend(1, x, 2, 0, 1);
  kvq::finalize(part, out);
  out[0] = static_cast<float>(kvq::supported_codec_pairs().size() + kvq::simd_level().size());

  use_cache<kvq::f32_codec>(x, h, b, out);
  use_cache<kvq::f16_codec>(x, h, b, out);
  use_cache<kvq::q8_0>(x, h, b, out);
  use_cache<kvq::q4_0>(x, h, b, out);
  use_cache<kvq::int8_sym>(x, h, b, out);
  use_cache<kvq::fp8_e4m3>(x, h, b, out);
  use_cache<kvq::fp8_e5m2>(x, h, b, out);
  use_cache<kvq::mxfp4>(x, h, b, out);
  use_cache<kvq::nvfp4>(x, h, b, out);
  use_cache<kvq::kivi<2>>(x, h, b, out);
  use_cache<kvq::kivi<4, 16>>(x, h, b, out);
  use_cache<kvq::kivi<8>>(x, h, b, out);
  use_cache<kvq::kv_codecs<kvq::q8_0, kvq::q4_0>>(x, h, b, out);
  use_cache<kvq::kv_codecs<kvq::int8_sym, kvq::kivi_value<4>>>(x, h, b, out);
  use_cache<kvq::kv_codecs<kvq::kivi_key<8>, kvq::fp8_e5m2>>(x, h, b, out);
  use_cache<kvq::rotated<kvq::q4_0>>(x, h, b, out);
  use_cache<kvq::kv_codecs<kvq::rotated<kvq::kivi_key<4>>, kvq::rotated<kvq::kivi_value<2>, 9>>>(x, h, b, out);
  use_cache<kvq::tq2>(x, h, b, out);
  use_cache<kvq::kv_codecs<kvq::tq4, kvq::tq3>>(x, h, b, out);
}

}  // namespace kvq_header_warnings

/// Keeps the instantiations (an external function the compiler must emit).
void kvq_header_warnings_cpu(float const* x, kvq::f16 const* h, kvq::bf16 const* b, std::uint8_t* dst, float* y,
                             kvq::f16* h16, kvq::bf16* b16);
void kvq_header_warnings_cpu(float const* x, kvq::f16 const* h, kvq::bf16 const* b, std::uint8_t* dst, float* y,
                             kvq::f16* h16, kvq::bf16* b16) {
  kvq_header_warnings::use_kernels(x, h, b, dst, y, h16, b16);
  kvq_header_warnings::use_all(x, h, b, y);
  kvq_header_warnings::use_tq_codebook<2>(y, dst, y + 80);
  kvq_header_warnings::use_tq_codebook<3>(y, dst, y + 80);
  kvq_header_warnings::use_tq_codebook<4>(y, dst, y + 80);
}
