// The loader's fuzz target. Every input is offered, as it is and with its checksums recomputed
// (so that mutations reach the checks behind them), to flat caches and to a paged cache of the
// seed images' configurations, and to kvq::load. A rejected input must raise one of kvq's typed
// errors and leave its destination as it was; an accepted one must read, attend, save again and
// load again from its own image to the same contents. Anything else aborts.
//
// Built with clang -fsanitize=fuzzer,address,undefined by scripts/fuzz.sh. Built without
// libFuzzer (KVQ_FUZZ_MAIN) it is the corpus regression test: every file named on the command
// line, or in a directory named there, runs once; `--write-seeds DIR` writes the seed corpus.
#include <kvq/attention.hpp>
#include <kvq/cache.hpp>
#include <kvq/codec/fp8.hpp>
#include <kvq/codec/int8.hpp>
#include <kvq/codec/kivi.hpp>
#include <kvq/codec/q4_0.hpp>
#include <kvq/paged_attention.hpp>
#include <kvq/paged_cache.hpp>
#include <kvq/persist.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../tests/persist_support.hpp"

namespace {

constexpr int layers = 2;
constexpr int kv_heads = 1;
constexpr int head_dim = 32;
constexpr int residual = 16;
constexpr int page_tokens = 16;
constexpr int q_heads = 2;
constexpr std::int64_t capacity = 64;

using bytes = std::vector<std::byte>;
using kvq_test::flat_contents;
using kvq_test::same_floats;
using flat_q4 = kvq::QuantizedKVCache<kvq::q4_0>;
using flat_kivi = kvq::QuantizedKVCache<kvq::kivi<2, 16>>;
using flat_fp8 = kvq::QuantizedKVCache<kvq::fp8_e4m3>;
using paged_choice = kvq::kv_codecs<kvq::int8_sym, kvq::kivi_value<4, 16>>;
using paged_t = kvq::PagedKVCache<paged_choice>;

[[noreturn]] void fail(char const* what) {
  std::fprintf(stderr, "fuzz_load: %s\n", what);
  std::abort();
}

/// Deterministic tokens (tokens, kv_heads, head_dim).
auto tokens(std::uint32_t seed, std::int64_t n) -> std::vector<float> {
  return kvq_test::persist_tokens(seed, n, kv_heads, head_dim);
}

template <class Cache>
void fill(Cache& c, int layer, std::int64_t n, std::uint32_t seed) {
  auto const k = tokens(seed, n), v = tokens(seed + 1000, n);
  c.append(layer, kvq::token_major(k.data(), n, kv_heads, head_dim), kvq::token_major(v.data(), n, kv_heads, head_dim));
}
void fill(paged_t& c, kvq::sequence_id s, int layer, std::int64_t n, std::uint32_t seed) {
  auto const k = tokens(seed, n), v = tokens(seed + 1000, n);
  c.append(s, layer, kvq::token_major(k.data(), n, kv_heads, head_dim),
           kvq::token_major(v.data(), n, kv_heads, head_dim));
}

template <class Cache>
auto make_flat() -> Cache {
  return Cache({layers, kv_heads, head_dim, capacity}, {.residual = residual});
}
auto make_paged() -> paged_t {
  return paged_t({layers, kv_heads, head_dim, page_tokens, 8, 3}, {.residual = residual});
}

template <class Cache>
auto image_of(Cache const& c) -> bytes {
  bytes out;
  kvq::vector_writer w(out);
  kvq::save(c, w);
  return out;
}
auto export_of(paged_t& p, kvq::sequence_id s, std::int64_t first, std::int64_t count) -> bytes {
  bytes out;
  kvq::vector_writer w(out);
  kvq::export_sequence(p, s, first, count, w);
  return out;
}

/// The source of the paged seeds: a sequence of 40 tokens in a pool like the destination's.
auto paged_source() -> paged_t& {
  static paged_t p = make_paged();
  static bool const filled = [] {
    kvq::sequence_id const s = p.add_sequence();
    for (int l = 0; l < layers; ++l) fill(p, s, l, 40, 5 + static_cast<std::uint32_t>(l));
    return true;
  }();
  (void)filled;
  return p;
}

/// The seed corpus: real images of every destination's configuration.
auto seeds() -> std::vector<std::pair<std::string, bytes>> {
  std::vector<std::pair<std::string, bytes>> out;
  auto q4 = make_flat<flat_q4>();
  fill(q4, 0, 20, 1);
  fill(q4, 1, 7, 2);
  out.emplace_back("flat_q4_0", image_of(q4));
  auto kivi = make_flat<flat_kivi>();  // mid-residual, the value window wrapped by a shift
  fill(kivi, 0, 27, 3);
  fill(kivi, 1, 45, 4);
  kivi.shift_left(16);
  fill(kivi, 1, 3, 5);
  out.emplace_back("flat_kivi2_mid_residual", image_of(kivi));
  auto fp8 = make_flat<flat_fp8>();
  fill(fp8, 1, 9, 6);
  out.emplace_back("flat_fp8_e4m3", image_of(fp8));
  out.emplace_back("flat_fp8_e4m3_empty", image_of(make_flat<flat_fp8>()));
  paged_t& p = paged_source();
  kvq::sequence_id const s = p.sequences().front();
  out.emplace_back("paged_whole", export_of(p, s, 0, 40));
  out.emplace_back("paged_prefix_16", export_of(p, s, 0, 16));
  out.emplace_back("paged_prefix_23", export_of(p, s, 0, 23));
  out.emplace_back("paged_continuation_16", export_of(p, s, 16, 24));
  return out;
}

auto same_bytes(bytes const& a, bytes const& b) -> bool {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size()) == 0);
}

/// True on every 16th call: the full comparisons, which cost more than the load, run that often.
auto full_check() -> bool {
  static unsigned calls = 0;
  return ++calls % 16 == 0;
}

/// Runs `f`, which may only fail with kvq's typed errors; returns whether it succeeded.
template <class F>
auto accepted(F&& f) -> bool {
  try {
    f();
    return true;
  } catch (kvq::format_error const&) {
  } catch (kvq::capacity_error const&) {
  } catch (kvq::invalid_argument_error const&) {
  } catch (kvq::index_error const&) {
  }
  return false;
}

/// A flat destination holding some tokens, and its image.
template <class Cache>
struct flat_destination {
  Cache cache = make_flat<Cache>();
  bytes before;
  flat_destination() {
    fill(cache, 0, 5, 9);
    before = image_of(cache);
  }
  auto unchanged() const -> bool {
    if (cache.size(0) != 5 || cache.size(1) != 0) return false;
    return !full_check() || same_bytes(image_of(cache), before);
  }
};

template <class Cache>
auto flat(bytes const& input) -> bool {
  static flat_destination<Cache> d;
  if (!accepted([&] { kvq::load_into(d.cache, kvq::span_reader(input)); })) {
    if (!d.unchanged()) fail("a rejected load changed its destination");
    return false;
  }
  std::vector<float> q(static_cast<std::size_t>(q_heads) * head_dim, 0.25f), out(q.size());
  for (int l = 0; l < layers; ++l) kvq::decode_attention(d.cache, l, q.data(), q_heads, out.data());
  bytes const again = image_of(d.cache);
  static Cache copy = make_flat<Cache>();
  kvq::load_into(copy, kvq::span_reader(again));  // an image kvq wrote must load
  if (!same_floats(flat_contents(copy), flat_contents(d.cache)) || !same_bytes(image_of(copy), again))
    fail("a reloaded cache differs");
  (void)accepted([&] {  // a fresh cache of the saved shape, within a small memory limit
    auto fresh = kvq::load<Cache>(kvq::span_reader(input), {.max_bytes = std::size_t{1} << 20});
    if (!same_floats(flat_contents(fresh), flat_contents(d.cache))) fail("load and load_into differ");
  });
  kvq::load_into(d.cache, kvq::span_reader(d.before));
  return true;
}

/// The paged destination: a sequence holding the source's first 16 tokens, all encoded.
struct paged_destination {
  paged_t cache = make_paged();
  kvq::sequence_id seq = -1;
  bytes before;
  std::int64_t free_pages = 0;
  paged_destination() {
    paged_t& p = paged_source();
    seq = kvq::import_sequence(cache, kvq::span_reader(export_of(p, p.sequences().front(), 0, 16)));
    before = export_of(cache, seq, 0, 16);
    free_pages = cache.free_pages();
  }
  auto unchanged() -> bool {
    if (cache.free_pages() != free_pages || cache.sequences().size() != 1 || cache.size(seq) != 16) return false;
    return !full_check() || same_bytes(export_of(cache, seq, 0, 16), before);
  }
};

auto paged(bytes const& input) -> bool {
  static paged_destination d;
  kvq::sequence_id got = -1;
  bool const fresh = accepted([&] { got = kvq::import_sequence(d.cache, kvq::span_reader(input)); });
  if (fresh) {
    bytes const again = export_of(d.cache, got, 0, d.cache.size(got));
    std::vector<float> q(static_cast<std::size_t>(q_heads) * head_dim, 0.25f), out(q.size());
    kvq::sequence_id const ids[] = {got};
    for (int l = 0; l < layers; ++l)
      kvq::paged_decode_attention(d.cache, l, std::span<kvq::sequence_id const>(ids), q.data(), q_heads, out.data());
    d.cache.release(got);
    kvq::sequence_id const t = kvq::import_sequence(d.cache, kvq::span_reader(again));
    if (!same_bytes(export_of(d.cache, t, 0, d.cache.size(t)), again)) fail("a re-imported sequence differs");
    d.cache.release(t);
  }
  bool const continued = accepted([&] { kvq::import_sequence(d.cache, d.seq, kvq::span_reader(input)); });
  if (continued) d.cache.truncate(d.seq, 16);
  if (!d.unchanged()) fail("an import changed the paged cache beyond what it added");
  return fresh || continued;
}

/// `input` with its checksums recomputed where its directory lies inside it.
auto resealed(bytes b) -> bytes {
  using namespace kvq::detail;
  if (b.size() < saved_header_bytes) return b;
  std::uint64_t const dir = get_u64(b.data() + 64);
  std::uint32_t const n = get_u32(b.data() + 32);
  if (n <= 64 && dir <= b.size() && (b.size() - dir) / saved_entry_bytes >= n) {
    for (std::uint32_t l = 0; l < n; ++l) {
      std::byte* e = b.data() + dir + l * saved_entry_bytes;
      std::uint64_t const off = get_u64(e), len = get_u64(e + 8);
      if (off <= b.size() && len <= b.size() - off)
        put_u32(e + 16, crc32c::of(std::span<std::byte const>(b).subspan(off, len)));
    }
  }
  put_u32(b.data() + 248, crc32c::of(std::span<std::byte const>(b).first(248)));
  if (dir >= saved_header_bytes && dir <= b.size() - 8) {
    crc32c f;
    f.update(std::span<std::byte const>(b).first(saved_header_bytes));
    f.update(std::span<std::byte const>(b).subspan(dir, b.size() - dir - 8));
    put_u32(b.data() + b.size() - 8, f.value());
  }
  return b;
}

/// Offers `input` to every destination; returns how many accepted it.
auto run(bytes const& input) -> int {
  int n = flat<flat_q4>(input) ? 1 : 0;
  n += flat<flat_kivi>(input) ? 1 : 0;
  n += flat<flat_fp8>(input) ? 1 : 0;
  n += paged(input) ? 1 : 0;
  return n;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  bytes const input(reinterpret_cast<std::byte const*>(data), reinterpret_cast<std::byte const*>(data) + size);
  run(input);
  bytes const sealed = resealed(input);
  if (!same_bytes(sealed, input)) run(sealed);
  return 0;
}

#if defined(KVQ_FUZZ_MAIN)
#  include <filesystem>
#  include <fstream>
#  include <iterator>

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  if (argc == 3 && std::string(argv[1]) == "--write-seeds") {
    for (auto const& [name, image] : seeds())
      std::ofstream(fs::path(argv[2]) / (name + ".kvq"), std::ios::binary)
          .write(reinterpret_cast<char const*>(image.data()), static_cast<std::streamsize>(image.size()));
    return 0;
  }
  int runs = 0;
  auto one = [&](fs::path const& p) {
    std::ifstream in(p, std::ios::binary);
    std::string const s((std::istreambuf_iterator<char>(in)), {});
    LLVMFuzzerTestOneInput(reinterpret_cast<std::uint8_t const*>(s.data()), s.size());
    ++runs;
  };
  for (int i = 1; i < argc; ++i) {
    fs::path const p(argv[i]);
    if (fs::is_directory(p)) {
      for (auto const& e : fs::directory_iterator(p))
        if (e.is_regular_file()) one(e.path());
    } else {
      one(p);
    }
  }
  // The seeds, as this build writes them, must load where they belong.
  for (auto const& [name, image] : seeds()) {
    if (run(image) == 0) {
      std::fprintf(stderr, "fuzz_load: no destination accepts the seed %s\n", name.c_str());
      return 1;
    }
    ++runs;
  }
  std::printf("fuzz_load: %d inputs ran\n", runs);
  return runs > 0 ? 0 : 1;
}
#endif
