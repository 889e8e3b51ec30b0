// Tests of saving, loading and shipping caches (persist.hpp, core/saved_format.hpp): CRC-32C,
// bit-identical round trips for every codec choice and both cache kinds through every writer and
// reader, paged exports of prefixes and continuations, the loader's validation (every truncation,
// every flipped byte, mismatched codecs and shapes, bad records) with the destination unchanged,
// and the committed images of tests/data/persist, which every architecture must reproduce and load.
//
// KVQ_PERSIST_WRITE_DIR=<dir> makes the golden-image test write its images there instead of
// comparing (to regenerate tests/data/persist and the fuzzer's seed corpus).
#include <kvq/attention.hpp>
#include <kvq/cache.hpp>
#include <kvq/codec/fp4.hpp>
#include <kvq/codec/fp8.hpp>
#include <kvq/codec/int8.hpp>
#include <kvq/codec/kivi.hpp>
#include <kvq/codec/passthrough.hpp>
#include <kvq/codec/q4_0.hpp>
#include <kvq/codec/q8_0.hpp>
#include <kvq/codec/rotated.hpp>
#include <kvq/codec/tq.hpp>
#include <kvq/paged_attention.hpp>
#include <kvq/paged_cache.hpp>
#include <kvq/persist.hpp>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "catch_compat.hpp"
#include "persist_support.hpp"

namespace {

using bytes = std::vector<std::byte>;
using kvq_test::flat_contents;
using kvq_test::same_floats;
using q8k_q4v = kvq::kv_codecs<kvq::q8_0, kvq::q4_0>;
using int8k_kivi4v = kvq::kv_codecs<kvq::int8_sym, kvq::kivi_value<4>>;
using rot_kivi4 = kvq::kv_codecs<kvq::rotated<kvq::kivi_key<4>>, kvq::rotated<kvq::kivi_value<4>>>;
using all_choices = std::tuple<kvq::f32_codec, kvq::f16_codec, kvq::q8_0, kvq::q4_0, kvq::int8_sym, kvq::fp8_e4m3,
                               kvq::fp8_e5m2, kvq::mxfp4, kvq::nvfp4, q8k_q4v, int8k_kivi4v, kvq::kivi<2>, kvq::kivi<4>,
                               kvq::kivi<8, 16>, kvq::rotated<kvq::q8_0>, rot_kivi4, kvq::tq3>;

constexpr int layers = 2;
constexpr int kv_heads = 2;
constexpr int head_dim = 64;
constexpr int page_tokens = 32;
constexpr int residual = 32;
constexpr int q_heads = 4;

/// Deterministic inputs on every platform (no std distributions): (tokens, kv_heads, head_dim)
/// values in about [-4, 4), channel 3 of keys an outlier.
auto inputs(std::uint32_t seed, std::int64_t tokens, bool keys) -> std::vector<float> {
  std::vector<float> x(static_cast<std::size_t>(tokens) * kv_heads * head_dim);
  std::uint32_t s = seed * 2654435761u + (keys ? 1u : 7u);
  for (std::size_t i = 0; i < x.size(); ++i) {
    s = s * 1664525u + 1013904223u;
    x[i] = static_cast<float>(static_cast<std::int32_t>(s >> 8) - (1 << 23)) / static_cast<float>(1 << 21);
    if (keys && i % head_dim == 3) x[i] *= 8.0f;
  }
  return x;
}

template <class Cache>
void fill(Cache& c, int layer, std::int64_t n, std::uint32_t seed) {
  auto const k = inputs(seed, n, true);
  auto const v = inputs(seed, n, false);
  c.append(layer, kvq::token_major(k.data(), n, kv_heads, head_dim), kvq::token_major(v.data(), n, kv_heads, head_dim));
}

template <class Choice>
void fill(kvq::PagedKVCache<Choice>& c, kvq::sequence_id s, int layer, std::int64_t n, std::uint32_t seed) {
  auto const k = inputs(seed, n, true);
  auto const v = inputs(seed, n, false);
  c.append(s, layer, kvq::token_major(k.data(), n, kv_heads, head_dim),
           kvq::token_major(v.data(), n, kv_heads, head_dim));
}

template <class Choice>
auto make_flat(std::int64_t capacity = 512) -> kvq::QuantizedKVCache<Choice> {
  typename kvq::QuantizedKVCache<Choice>::options o;
  o.residual = residual;
  return kvq::QuantizedKVCache<Choice>({layers, kv_heads, head_dim, capacity}, o);
}

template <class Choice>
auto make_paged(std::int64_t pages = 64, int max_sequences = 8) -> kvq::PagedKVCache<Choice> {
  typename kvq::PagedKVCache<Choice>::options o;
  o.residual = residual;
  return kvq::PagedKVCache<Choice>({layers, kv_heads, head_dim, page_tokens, pages, max_sequences}, o);
}

/// A flat cache in a state that exercises every counter: layers of different lengths, appended in
/// uneven chunks, truncated and shifted (KIVI: residual rows pending, a wrapped value window).
template <class Choice>
auto busy_flat() -> kvq::QuantizedKVCache<Choice> {
  auto c = make_flat<Choice>();
  fill(c, 0, 77, 1);
  fill(c, 0, 51, 2);
  fill(c, 1, 203, 3);
  c.truncate(190);
  fill(c, 1, 9, 4);
  c.shift_left(32);
  fill(c, 0, 5, 5);
  return c;
}

template <class Cache>
auto saved(Cache const& c) -> bytes {
  bytes out;
  kvq::vector_writer w(out);
  kvq::save(c, w);
  return out;
}

template <class Cache>
auto attend(Cache const& c, int layer) -> std::vector<float> {
  auto const q = inputs(99, 2, true);  // (q_heads, head_dim)
  std::vector<float> out(static_cast<std::size_t>(q_heads) * head_dim);
  kvq::decode_attention(c, layer, q.data(), q_heads, out.data());
  return out;
}

/// Tokens [0, n) of (seq, layer) of a paged cache, keys then values per head.
template <class Paged>
auto paged_contents(Paged const& p, kvq::sequence_id s, std::int64_t n) -> std::vector<float> {
  std::vector<float> all;
  for (int l = 0; l < layers; ++l) {
    std::int64_t const m = std::min(n, p.size(s, l));
    for (int h = 0; h < kv_heads; ++h) {
      std::vector<float> k(static_cast<std::size_t>(m) * head_dim), v(k.size());
      p.read_keys(s, l, h, 0, m, k.data());
      p.read_values(s, l, h, 0, m, v.data());
      all.insert(all.end(), k.begin(), k.end());
      all.insert(all.end(), v.begin(), v.end());
    }
  }
  return all;
}

/// Recomputes every checksum of an image (to test the checks behind them).
void reseal(bytes& b) {
  using namespace kvq::detail;
  std::uint64_t const dir = get_u64(b.data() + 64);
  std::uint32_t const n = get_u32(b.data() + 32);
  for (std::uint32_t l = 0; l < n; ++l) {
    std::byte* e = b.data() + dir + l * saved_entry_bytes;
    put_u32(e + 16, crc32c::of(std::span<std::byte const>(b).subspan(get_u64(e), get_u64(e + 8))));
  }
  put_u32(b.data() + 248, crc32c::of(std::span<std::byte const>(b).first(248)));
  crc32c f;
  f.update(std::span<std::byte const>(b).first(saved_header_bytes));
  f.update(std::span<std::byte const>(b).subspan(dir, b.size() - dir - 8));
  put_u32(b.data() + b.size() - 8, f.value());
}

/// Requires `f` to raise E with a message containing every one of `fragments`.
template <class E, class F>
void require_error(F&& f, std::initializer_list<char const*> fragments) {
  std::string message;
  try {
    f();
  } catch (E const& e) {
    message = e.what();
  }
  INFO("message: " << message);
  REQUIRE(!message.empty());
  for (char const* x : fragments) REQUIRE(message.find(x) != std::string::npos);
}

/// Requires loading `image` into `dst` to raise format_error naming `fragment`, `dst` unchanged.
template <class Choice, class Cache>
void require_format_error(Cache& dst, bytes const& image, char const* fragment) {
  bytes const before = saved(dst);
  require_error<kvq::format_error>([&] { kvq::load_into(dst, kvq::span_reader(image)); }, {fragment});
  REQUIRE(saved(dst) == before);
}

}  // namespace

TEST_CASE("persist: CRC-32C matches the published check value on every path", "[persist][crc]") {
  using kvq::detail::crc32c;
  auto const check = std::as_bytes(std::span("123456789", 9));
  REQUIRE(crc32c::of(check) == 0xE3069283u);
  REQUIRE(crc32c::portable(check) == 0xE3069283u);
  REQUIRE(crc32c::of({}) == 0u);
  std::uint32_t s = 1;
  for (std::size_t n : {1u, 7u, 8u, 63u, 767u, 768u, 769u, 4095u, 8704u, 12287u, 12288u, 12289u, 40000u, 100003u}) {
    bytes b(n);
    for (auto& x : b) x = static_cast<std::byte>((s = s * 1664525u + 1013904223u) >> 24);
    crc32c c;  // a streaming split gives the one-shot value
    c.update(std::span<std::byte const>(b).first(n / 3));
    c.update(std::span<std::byte const>(b).subspan(n / 3));
    INFO("n = " << n);
    REQUIRE(crc32c::of(b) == crc32c::portable(b));
    REQUIRE(c.value() == crc32c::portable(b));
  }
}

TEMPLATE_LIST_TEST_CASE("persist: a saved flat cache loads bit-identical through every reader and writer",
                        "[persist][roundtrip]", all_choices) {
  auto const c = busy_flat<TestType>();
  bytes const image = saved(c);
  REQUIRE(image.size() == kvq::saved_bytes(c));
  REQUIRE(image.size() % 64 == 0);

  auto check = [&](kvq::QuantizedKVCache<TestType> const& d) {
    REQUIRE(d.shape() == c.shape());
    for (int l = 0; l < layers; ++l) REQUIRE(d.size(l) == c.size(l));
    REQUIRE(saved(d) == image);  // storage and state: the same bytes again
    REQUIRE(same_floats(flat_contents(d), flat_contents(c)));
    for (int l = 0; l < layers; ++l) REQUIRE(same_floats(attend(d, l), attend(c, l)));
    for (int l = 0; l < layers; ++l)
      for (int h = 0; h < kv_heads; ++h) {
        kvq::storage_view const a = c.key_storage(l, h), b = d.key_storage(l, h);
        REQUIRE(a.quantized_tokens == b.quantized_tokens);
        REQUIRE(a.residual_tokens == b.residual_tokens);
        REQUIRE(std::memcmp(a.units, b.units,
                            static_cast<std::size_t>(a.quantized_tokens / a.tokens_per_unit) * a.unit_bytes) == 0);
      }
  };

  SECTION("span writer, span reader, load") {
    bytes buf(image.size());
    kvq::span_writer w(buf);
    kvq::save(c, w);
    REQUIRE(w.written() == image.size());
    REQUIRE(buf == image);
    kvq::span_reader r(buf);
    check(kvq::load<kvq::QuantizedKVCache<TestType>>(r));
    REQUIRE(r.consumed() == image.size());
  }
  SECTION("a full span writer raises capacity_error") {
    bytes buf(image.size() - 1);
    kvq::span_writer w(buf);
    REQUIRE_THROWS_AS(kvq::save(c, w), kvq::capacity_error);
  }
  SECTION("streams and load_into a used cache") {
    std::stringstream ss;
    kvq::ostream_writer w(ss);
    kvq::save(c, w);
    auto d = make_flat<TestType>();
    fill(d, 1, 300, 42);
    kvq::istream_reader r(ss);
    kvq::load_into(d, r);
    check(d);
  }
  SECTION("files") {
    auto const path =
        (std::filesystem::temp_directory_path() /
         ("kvq_persist_" + std::to_string(image.size()) + "_" + std::string(kvq::codec_pair<TestType>::key::name) +
          "_" + std::string(kvq::codec_pair<TestType>::value::name) + ".kvq"))
            .string();
    {
      kvq::file_writer w(path);
      kvq::save(c, w);
      w.close();
    }
    kvq::file_reader r(path);
    check(kvq::load<kvq::QuantizedKVCache<TestType>>(r));
    std::filesystem::remove(path);
  }
  SECTION("appending after a load continues exactly as the original") {
    auto d = kvq::load<kvq::QuantizedKVCache<TestType>>(kvq::span_reader(image));
    auto e = busy_flat<TestType>();
    for (int l = 0; l < layers; ++l) {
      fill(d, l, 45, 77);
      fill(e, l, 45, 77);
    }
    REQUIRE(saved(d) == saved(e));
  }
  SECTION("two images in one stream load one after the other") {
    std::stringstream ss;
    kvq::ostream_writer w(ss);
    auto const empty = make_flat<TestType>();
    kvq::save(c, w);
    kvq::save(empty, w);
    kvq::istream_reader r(ss);
    check(kvq::load<kvq::QuantizedKVCache<TestType>>(r));
    REQUIRE(saved(kvq::load<kvq::QuantizedKVCache<TestType>>(r)) == saved(empty));
  }
}

TEMPLATE_LIST_TEST_CASE("persist: paged exports import bit-identical, as prefixes and continuations",
                        "[persist][paged]", all_choices) {
  auto p = make_paged<TestType>();
  kvq::sequence_id const s = p.add_sequence();
  std::int64_t const n = 150;  // not on a page, KIVI tile or window boundary
  for (int l = 0; l < layers; ++l) {
    fill(p, s, l, 64, 10 + static_cast<std::uint32_t>(l));
    fill(p, s, l, n - 64, 20 + static_cast<std::uint32_t>(l));
  }
  auto const free_before = p.free_pages();

  SECTION("a whole sequence") {
    bytes image;
    kvq::vector_writer w(image);
    kvq::export_sequence(p, s, w);
    auto q = make_paged<TestType>();
    kvq::sequence_id const t = kvq::import_sequence(q, kvq::span_reader(image));
    REQUIRE(q.size(t) == n);
    REQUIRE(same_floats(paged_contents(q, t, n), paged_contents(p, s, n)));
    auto const qv = inputs(5, 2, true);  // (q_heads, head_dim)
    std::vector<float> a(static_cast<std::size_t>(q_heads) * head_dim), b(a.size());
    kvq::sequence_id const ps[] = {s}, qs[] = {t};
    kvq::paged_decode_attention(p, 1, std::span<kvq::sequence_id const>(ps), qv.data(), q_heads, a.data());
    kvq::paged_decode_attention(q, 1, std::span<kvq::sequence_id const>(qs), qv.data(), q_heads, b.data());
    REQUIRE(same_floats(a, b));
    // Both continue identically, and re-export the same bytes.
    for (int l = 0; l < layers; ++l) {
      fill(p, s, l, 40, 30);
      fill(q, t, l, 40, 30);
    }
    bytes again_p, again_q;
    kvq::vector_writer wp(again_p), wq(again_q);
    kvq::export_sequence(p, s, wp);
    kvq::export_sequence(q, t, wq);
    REQUIRE(again_p == again_q);
  }
  SECTION("a flat cache's image imports as a sequence and an export loads as a flat cache") {
    auto f = make_flat<TestType>();
    for (int l = 0; l < layers; ++l) {
      fill(f, l, 64, 10 + static_cast<std::uint32_t>(l));
      fill(f, l, n - 64, 20 + static_cast<std::uint32_t>(l));
    }
    auto q = make_paged<TestType>();
    kvq::sequence_id const t = kvq::import_sequence(q, kvq::span_reader(saved(f)));
    REQUIRE(same_floats(paged_contents(q, t, n), flat_contents(f)));
    bytes image;
    kvq::vector_writer w(image);
    kvq::export_sequence(p, s, w);
    auto g = kvq::load<kvq::QuantizedKVCache<TestType>>(kvq::span_reader(image));
    REQUIRE(same_floats(flat_contents(g), flat_contents(f)));
  }
  SECTION("a prefix equals a truncated fork, and exporting changes nothing") {
    for (std::int64_t cut : {std::int64_t{0}, std::int64_t{1}, std::int64_t{37}, std::int64_t{64}, std::int64_t{100}}) {
      bytes image;
      kvq::vector_writer w(image);
      kvq::export_sequence(p, s, 0, cut, w);
      REQUIRE(p.free_pages() == free_before);
      REQUIRE(p.sequences().size() == 1);
      // A cut into a KIVI key tile decodes its kept tokens into the f16 residual, as truncate does.
      kvq::sequence_id const f = p.fork(s);
      p.truncate(f, cut);
      bytes want;
      kvq::vector_writer wf(want);
      kvq::export_sequence(p, f, wf);
      auto const want_contents = paged_contents(p, f, cut);
      p.release(f);
      INFO("cut = " << cut);
      REQUIRE(image == want);
      auto q = make_paged<TestType>();
      kvq::sequence_id const t = kvq::import_sequence(q, kvq::span_reader(image));
      REQUIRE(q.size(t) == cut);
      REQUIRE(same_floats(paged_contents(q, t, cut), want_contents));
    }
  }
  SECTION("a continuation appends to the sequence holding the tokens before it") {
    bytes head, tail;
    kvq::vector_writer wh(head), wt(tail);
    kvq::export_sequence(p, s, 0, 64, wh);
    kvq::export_sequence(p, s, 64, n - 64, wt);
    auto q = make_paged<TestType>();
    kvq::sequence_id const t = kvq::import_sequence(q, kvq::span_reader(head));
    kvq::sequence_id const u = q.fork(t);  // its pages are shared: the import takes fresh ones
    kvq::import_sequence(q, t, kvq::span_reader(tail));
    REQUIRE(q.size(t) == n);
    REQUIRE(same_floats(paged_contents(q, t, n), paged_contents(p, s, n)));
    REQUIRE(q.size(u) == 64);
    // The same continuation cannot land twice, nor start a new sequence, nor start off a page.
    REQUIRE_THROWS_AS(kvq::import_sequence(q, t, kvq::span_reader(tail)), kvq::invalid_argument_error);
    REQUIRE_THROWS_AS(kvq::import_sequence(q, kvq::span_reader(tail)), kvq::invalid_argument_error);
    REQUIRE_THROWS_AS(kvq::export_sequence(p, s, 33, 10, wt), kvq::invalid_argument_error);
    constexpr bool residual_codec = kvq::detail::has_value_window<typename kvq::codec_pair<TestType>::value>::value ||
                                    kvq::codec_pair<TestType>::key::layout == kvq::codec_layout::token_group;
    if constexpr (residual_codec) {
      // Tokens before 128 are still in the f16 residual: no continuation can start there.
      bytes late;
      kvq::vector_writer wl(late);
      REQUIRE_THROWS_AS(kvq::export_sequence(p, s, 128, n - 128, wl), kvq::invalid_argument_error);
      REQUIRE(late.empty());
    }
  }
  SECTION("misuse raises typed errors and changes nothing") {
    bytes image;
    kvq::vector_writer w(image);
    REQUIRE_THROWS_AS(kvq::export_sequence(p, s, 0, n + 1, w), kvq::invalid_argument_error);
    REQUIRE_THROWS_AS(kvq::export_sequence(p, s + 1, 0, 1, w), kvq::index_error);
    REQUIRE(image.empty());
    kvq::export_sequence(p, s, w);
    auto small = make_paged<TestType>(3, 2);  // 150 tokens need 5 pages
    REQUIRE_THROWS_AS(kvq::import_sequence(small, kvq::span_reader(image)), kvq::capacity_error);
    REQUIRE(small.free_pages() == 3);
    REQUIRE(small.sequences().empty());
    auto one = make_paged<TestType>(64, 1);
    (void)one.add_sequence();
    REQUIRE_THROWS_AS(kvq::import_sequence(one, kvq::span_reader(image)), kvq::capacity_error);
    REQUIRE_THROWS_AS(kvq::import_sequence(one, 12345, kvq::span_reader(image)), kvq::index_error);
    bytes bad = image;
    bad[bad.size() / 2] ^= std::byte{0x10};
    auto q = make_paged<TestType>();
    REQUIRE_THROWS_AS(kvq::import_sequence(q, kvq::span_reader(bad)), kvq::format_error);
    REQUIRE(q.free_pages() == 64);
    REQUIRE(q.sequences().empty());
  }
}

TEST_CASE("persist: images carry no rows of released, reset or truncated tokens", "[persist][residual]") {
  using choice = kvq::kivi<4>;
  auto one = make_flat<choice>();
  fill(one, 0, 1, 7);
  auto reused = make_flat<choice>();
  fill(reused, 0, 40, 1);
  fill(reused, 1, 77, 2);
  reused.reset();
  fill(reused, 0, 1, 7);
  REQUIRE(saved(reused) == saved(one));
  auto cut = make_flat<choice>();
  fill(cut, 0, 1, 7);
  fill(cut, 0, 30, 8);
  cut.truncate(1);
  REQUIRE(saved(cut) == saved(one));

  auto p = make_paged<choice>(16, 1);
  kvq::sequence_id const a = p.add_sequence();
  fill(p, a, 0, 40, 1);
  p.release(a);
  kvq::sequence_id const b = p.add_sequence();  // the same residual slot
  fill(p, b, 0, 1, 7);
  auto fresh = make_paged<choice>(16, 1);
  kvq::sequence_id const c = fresh.add_sequence();
  fill(fresh, c, 0, 1, 7);
  bytes x, y;
  kvq::vector_writer wx(x), wy(y);
  kvq::export_sequence(p, b, wx);
  kvq::export_sequence(fresh, c, wy);
  REQUIRE(x == y);
  // And the loader requires unused rows to be zero.
  bytes bad = saved(one);
  std::size_t const unused_key_row =
      kvq::detail::saved_header_bytes + 64 + 5 * head_dim * 2;  // layer 0 (no key tiles yet), head 0, row 5
  bad[unused_key_row] = std::byte{1};
  reseal(bad);
  auto dst = make_flat<choice>();
  require_format_error<choice>(dst, bad, "unused key residual row");
}

TEST_CASE("persist: the loader rejects every truncation and every flipped byte, changing nothing",
          "[persist][validation]") {
  using choice = kvq::kivi<4>;
  auto src = make_flat<choice>(128);
  fill(src, 0, 45, 1);
  fill(src, 1, 3, 2);
  bytes const image = saved(src);
  auto dst = make_flat<choice>(128);
  fill(dst, 0, 20, 9);
  bytes const before = saved(dst);
  for (std::size_t n = 0; n < image.size(); ++n) {
    bytes const cut(image.begin(), image.begin() + static_cast<std::ptrdiff_t>(n));
    INFO("length " << n);
    REQUIRE_THROWS_AS(kvq::load_into(dst, kvq::span_reader(cut)), kvq::format_error);
    std::stringstream ss(std::string(reinterpret_cast<char const*>(cut.data()), cut.size()));
    kvq::istream_reader r(ss);
    REQUIRE_THROWS_AS(kvq::load_into(dst, r), kvq::format_error);
  }
  for (std::size_t i = 0; i < image.size(); ++i) {
    bytes bad = image;
    bad[i] ^= std::byte{static_cast<unsigned char>(1u << (i % 8))};
    INFO("byte " << i);
    REQUIRE_THROWS_AS(kvq::load_into(dst, kvq::span_reader(bad)), kvq::format_error);
    REQUIRE_THROWS_AS(kvq::load<kvq::QuantizedKVCache<choice>>(kvq::span_reader(bad)), kvq::format_error);
  }
  REQUIRE(saved(dst) == before);
  // An empty destination checks sections while it copies them: a damaged one leaves it empty.
  auto empty = make_flat<choice>(128);
  bytes const nothing = saved(empty);
  for (std::size_t i = kvq::detail::saved_header_bytes; i < image.size(); i += 7) {
    bytes bad = image;
    bad[i] ^= std::byte{0x40};
    INFO("byte " << i);
    REQUIRE_THROWS_AS(kvq::load_into(empty, kvq::span_reader(bad)), kvq::format_error);
    REQUIRE(empty.size(0) == 0);
    REQUIRE(empty.size(1) == 0);
  }
  REQUIRE(saved(empty) == nothing);
  kvq::load_into(empty, kvq::span_reader(image));
  REQUIRE(saved(empty) == image);
  kvq::load_into(dst, kvq::span_reader(image));
  REQUIRE(saved(dst) == image);
}

TEST_CASE("persist: mismatches and bad records are named", "[persist][validation]") {
  using choice = kvq::kivi<4>;
  auto src = make_flat<choice>(256);
  fill(src, 0, 150, 1);
  fill(src, 1, 70, 2);
  bytes const image = saved(src);
  auto dst = make_flat<choice>(256);

  SECTION("codecs: the message names both") {
    auto other = make_flat<kvq::q4_0>(256);
    bytes const before = saved(other);
    require_error<kvq::format_error>([&] { kvq::load_into(other, kvq::span_reader(image)); },
                                     {"kivi_key 4-bit G=32", "q4_0"});
    REQUIRE(saved(other) == before);
    kvq::QuantizedKVCache<kvq::fp8_e4m3> a({layers, kv_heads, head_dim, 64}, {.residual = 0, .key = {2.0f}});
    kvq::QuantizedKVCache<kvq::fp8_e4m3> b({layers, kv_heads, head_dim, 64}, {.residual = 0, .key = {0.5f}});
    require_error<kvq::format_error>([&] { kvq::load_into(b, kvq::span_reader(saved(a))); }, {"scale 2", "scale 0.5"});
    kvq::QuantizedKVCache<choice> r64({layers, kv_heads, head_dim, 256}, {.residual = 64});
    REQUIRE_THROWS_AS(kvq::load_into(r64, kvq::span_reader(image)), kvq::format_error);
  }
  SECTION("shape and capacity") {
    kvq::QuantizedKVCache<choice> wide({layers, kv_heads + 1, head_dim, 256}, {.residual = residual});
    require_error<kvq::format_error>([&] { kvq::load_into(wide, kvq::span_reader(image)); }, {"kv_heads"});
    kvq::QuantizedKVCache<choice> deep({layers + 1, kv_heads, head_dim, 256}, {.residual = residual});
    REQUIRE_THROWS_AS(kvq::load_into(deep, kvq::span_reader(image)), kvq::format_error);
    auto small = make_flat<choice>(128);  // layer 0 holds 150 tokens
    require_format_error<choice>(small, image, "length must be in [0, 128]");
    REQUIRE_THROWS_AS(kvq::load<kvq::QuantizedKVCache<choice>>(kvq::span_reader(image), {.max_bytes = 1000}),
                      kvq::capacity_error);
    auto const bigger = kvq::load<kvq::QuantizedKVCache<choice>>(kvq::span_reader(image), {.capacity = 1024});
    REQUIRE(bigger.shape().capacity == 1024);
    REQUIRE(same_floats(flat_contents(bigger), flat_contents(src)));
  }
  SECTION("header fields, with valid checksums") {
    auto patch = [&](std::size_t at, std::uint32_t v) {
      bytes b = image;
      kvq::detail::put_u32(b.data() + at, v);
      reseal(b);
      return b;
    };
    require_format_error<choice>(dst, patch(8, 2), "unknown format version 2");
    require_format_error<choice>(dst, patch(12, 0x04030201u), "endianness");
    require_format_error<choice>(dst, patch(20, 3), "unknown image kind 3");
    require_format_error<choice>(dst, patch(40, head_dim * 2), "head_dim");
    bytes magic = image;
    magic[0] = std::byte{'X'};
    require_format_error<choice>(dst, magic, "bad magic");
    bytes damaged = image;
    damaged[100] ^= std::byte{1};
    require_format_error<choice>(dst, damaged, "header checksum");
  }
  SECTION("layer records out of range, with valid checksums") {
    std::size_t const rec = kvq::detail::saved_header_bytes;  // layer 0's record
    auto patch = [&](std::size_t field, std::uint64_t v) {
      bytes b = image;
      kvq::detail::put_u64(b.data() + rec + 8 * field, v);
      reseal(b);
      return b;
    };
    require_format_error<choice>(dst, patch(0, 151), "layer 0 record");             // length vs sections
    require_format_error<choice>(dst, patch(1, 100), "multiple of G");              // keys quantized
    require_format_error<choice>(dst, patch(1, 64), "key residual");                // 86 rows > F
    require_format_error<choice>(dst, patch(3, 33), "add up");                      // window tokens
    require_format_error<choice>(dst, patch(4, 40), "window's first row");          // window ring row
    require_format_error<choice>(dst, patch(0, std::uint64_t{1} << 63), "length");  // negative
  }
}

namespace {

/// The committed images: flat caches and a paged export that every platform must write
/// byte for byte and load.
template <class Choice>
auto golden_flat() -> kvq::QuantizedKVCache<Choice> {
  auto c = make_flat<Choice>(128);
  fill(c, 0, 41, 1);
  fill(c, 1, 70, 2);
  return c;
}

template <class Choice>
void golden(std::string const& name, bytes const& image, auto&& load_check) {
  std::string const file = std::string(KVQ_TEST_DATA_DIR) + "/persist/" + name + ".kvq";
  if (char const* dir = std::getenv("KVQ_PERSIST_WRITE_DIR")) {
    std::ofstream(std::string(dir) + "/" + name + ".kvq", std::ios::binary)
        .write(reinterpret_cast<char const*>(image.data()), static_cast<std::streamsize>(image.size()));
    return;
  }
  std::ifstream in(file, std::ios::binary);
  REQUIRE(in.good());
  std::string const raw((std::istreambuf_iterator<char>(in)), {});
  bytes want(raw.size());
  std::memcpy(want.data(), raw.data(), raw.size());
  INFO(file);
  REQUIRE(image == want);  // this platform writes the committed bytes
  load_check(want);        // and loads them
}

}  // namespace

TEST_CASE("persist: the committed images are written and loaded byte for byte on this platform", "[persist][golden]") {
  auto const q4 = golden_flat<kvq::q4_0>();
  golden<kvq::q4_0>("flat_q4_0", saved(q4), [&](bytes const& b) {
    REQUIRE(same_floats(flat_contents(kvq::load<kvq::QuantizedKVCache<kvq::q4_0>>(kvq::span_reader(b))),
                        flat_contents(q4)));
  });
  auto const kivi = golden_flat<kvq::kivi<2>>();
  golden<kvq::kivi<2>>("flat_kivi2_mid_residual", saved(kivi), [&](bytes const& b) {
    REQUIRE(same_floats(flat_contents(kvq::load<kvq::QuantizedKVCache<kvq::kivi<2>>>(kvq::span_reader(b))),
                        flat_contents(kivi)));
  });
  auto const fp8 = golden_flat<kvq::fp8_e4m3>();
  golden<kvq::fp8_e4m3>("flat_fp8_e4m3", saved(fp8), [&](bytes const& b) {
    REQUIRE(same_floats(flat_contents(kvq::load<kvq::QuantizedKVCache<kvq::fp8_e4m3>>(kvq::span_reader(b))),
                        flat_contents(fp8)));
  });
  auto p = make_paged<int8k_kivi4v>(16, 2);
  kvq::sequence_id const s = p.add_sequence();
  for (int l = 0; l < layers; ++l) fill(p, s, l, 45, 3);
  bytes image;
  kvq::vector_writer w(image);
  kvq::export_sequence(p, s, 0, 40, w);
  golden<int8k_kivi4v>("paged_int8_kivi4v_prefix", image, [&](bytes const& b) {
    auto q = make_paged<int8k_kivi4v>(16, 2);
    kvq::sequence_id const t = kvq::import_sequence(q, kvq::span_reader(b));
    REQUIRE(same_floats(paged_contents(q, t, 40), paged_contents(p, s, 40)));
  });
}
