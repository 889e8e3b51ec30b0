// kvq benchmark: saving and loading caches through the public entries of <kvq/persist.hpp> against
// memcpy of the same bytes, in one run: kvq::save, kvq::load_into and kvq::load of a flat cache,
// kvq::export_sequence and kvq::import_sequence of one long sequence of a paged cache.
//
// Cache: 8 layers, 8 kv_heads, head_dim 128, 8192 tokens in every layer, for q8_0, q4_0, kivi4
// (G = 32, R = 128) and fp8_e4m3; one image is 70 to 140 MiB (counter bytes). Keys are N(0,1) with
// four outlier channels ×10, values N(0,1). Rows, all over buffers in memory:
//   persist/<codec>/save       kvq::save into a preallocated buffer (kvq::span_writer)
//   persist/<codec>/load_into  kvq::load_into an existing cache, reset first (an engine restoring a
//                              prompt cache), from a buffer (kvq::span_reader)
//   persist/<codec>/replace    kvq::load_into a cache holding tokens (the image checked, then copied)
//   persist/<codec>/load       kvq::load of a new cache from a buffer (its allocation and release
//                              included)
//   persist/<codec>/memcpy     memcpy of kvq::saved_bytes(cache) bytes from one buffer to another
//   persist/<codec>/memcpy_new memcpy of those bytes into a new allocation, freed after (the
//                              reference of `load`, which also fills memory the kernel hands over)
//   persist/<codec>/export     kvq::export_sequence of a whole 8192-token sequence of a paged cache
//                              (pages of 64 tokens) into a preallocated buffer
//   persist/<codec>/import     kvq::import_sequence of such an export as a new sequence (releasing
//                              the sequence the same slot of the rotation imported before)
// Bytes: bytes_per_second counts image bytes (a memcpy reads and writes as many; so do the others).
// The summary's % of memcpy = (bytes / time) / (memcpy bytes / memcpy time), i.e. the ratio of GB/s.
// memcpy is the C library's: glibc writes around the caches (non-temporal stores) only for copies
// beyond its threshold (3/4 of the shared cache), so the reference depends on the image's size.
//
// Working set: every row rotates over n copies (caches, images, buffers, sequences), iteration i
// using copy i mod n, with n such that the bytes a cycle touches (source and destination) are at
// least twice the last-level cache (--kvq_working_set_mib=N overrides that floor, for smoke tests),
// so no result comes from cache. The copies of one (codec, flat or paged) are built once outside
// the timing, shared by its rows, and freed before the next are built.
#include <kvq/cache.hpp>
#include <kvq/codec/fp8.hpp>
#include <kvq/codec/kivi.hpp>
#include <kvq/codec/q4_0.hpp>
#include <kvq/codec/q8_0.hpp>
#include <kvq/paged_cache.hpp>
#include <kvq/persist.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <benchmark/benchmark.h>

#include "bench_common.hpp"

namespace kvq_bench {
namespace {

constexpr int layers = 8;
constexpr int kv_heads = 8;
constexpr std::int64_t tokens = 8192;
constexpr int page_tokens = 64;
constexpr int kivi_residual = 128;

/// The cache every row saves or loads, in words (recorded in the JSON context).
auto cache_description() -> std::string {
  return std::to_string(layers) + " layers × " + std::to_string(kv_heads) + " kv_heads × head_dim " +
         std::to_string(head_dim) + " × " + std::to_string(tokens) + " tokens";
}

/// Bytes one cycle of the rotation must at least touch (twice the last-level cache by default).
std::size_t g_working_set = 0;

/// Tokens in the pool of synthetic keys and values that caches are filled from.
constexpr std::int64_t pool_tokens = 1024;

/// Token-major (pool_tokens, kv_heads, head_dim) keys and values.
struct kv_pool {
  std::vector<float> keys, values;
};

auto pool() -> kv_pool const& {
  static kv_pool const p = [] {
    kv_pool q;
    std::size_t const n = static_cast<std::size_t>(pool_tokens) * kv_heads * head_dim;
    q.keys.resize(n);
    q.values.resize(n);
    fill_normal(q.keys.data(), n, 11);
    add_outlier_channels(q.keys.data(), n, 10.0f);
    fill_normal(q.values.data(), n, 23);
    return q;
  }();
  return p;
}

/// Calls append(layer, keys, values) until every layer holds `tokens` tokens from the pool.
template <class Append>
void fill(Append&& append) {
  auto const& p = pool();
  std::int64_t const stride = static_cast<std::int64_t>(kv_heads) * head_dim;
  for (int l = 0; l < layers; ++l) {
    std::int64_t offset = (static_cast<std::int64_t>(l) * 389) % pool_tokens, done = 0;
    while (done < tokens) {
      std::int64_t const n = std::min(tokens - done, pool_tokens - offset);
      append(l, kvq::token_major(p.keys.data() + offset * stride, n, kv_heads, head_dim),
             kvq::token_major(p.values.data() + offset * stride, n, kv_heads, head_dim));
      done += n;
      offset = 0;
    }
  }
}

/// Copies in the rotation of codec Choice: enough that a cycle touches g_working_set bytes when an
/// iteration touches its image twice (read and written).
template <class Choice>
auto copies_for() -> std::size_t {
  std::size_t const image = kvq::plan_memory<Choice>({layers, kv_heads, head_dim, tokens}, kivi_residual).total_bytes;
  std::size_t const touched = std::max<std::size_t>(2 * image, 1);
  return std::max<std::size_t>(1, (g_working_set + touched - 1) / touched);
}

/// The copies of one (codec, flat or paged), type-erased for the registry.
struct fixture_base {
  virtual ~fixture_base() = default;
};

/// n filled flat caches, their images, and n buffers of an image's size (save and memcpy write there).
template <class Choice>
struct flat_fixture final : fixture_base {
  using cache_type = kvq::QuantizedKVCache<Choice>;
  std::vector<std::unique_ptr<cache_type>> caches;
  std::vector<buffer> images, scratch;
  std::size_t image_bytes = 0;
};

/// One paged pool holding n sequences of `tokens` tokens and room for n more (the imports), the n
/// exports, and n buffers of an export's size (export writes there).
template <class Choice>
struct paged_fixture final : fixture_base {
  using cache_type = kvq::PagedKVCache<Choice>;
  std::unique_ptr<cache_type> paged;
  std::vector<kvq::sequence_id> sources, imported;
  std::vector<buffer> exports, scratch;
  std::size_t image_bytes = 0;
};

/// Builds the flat fixture of codec Choice: each cache filled by appends, then saved into its image.
template <class Choice>
auto build_flat() -> std::unique_ptr<flat_fixture<Choice>> {
  using cache_type = typename flat_fixture<Choice>::cache_type;
  auto f = std::make_unique<flat_fixture<Choice>>();
  std::size_t const n = copies_for<Choice>();
  typename cache_type::options opt;
  opt.residual = kivi_residual;
  for (std::size_t i = 0; i < n; ++i) {
    f->caches.push_back(std::make_unique<cache_type>(kvq::cache_shape{layers, kv_heads, head_dim, tokens}, opt));
    cache_type& c = *f->caches.back();
    fill([&](int l, auto const& k, auto const& v) { c.append(l, k, v); });
    f->image_bytes = kvq::saved_bytes(c);
    f->images.emplace_back(f->image_bytes);
    f->scratch.emplace_back(f->image_bytes);
    kvq::span_writer w(std::span<std::byte>(f->images.back().data(), f->image_bytes));
    kvq::save(c, w);
  }
  return f;
}

/// Builds the paged fixture of codec Choice: each source sequence filled by appends, then exported.
template <class Choice>
auto build_paged() -> std::unique_ptr<paged_fixture<Choice>> {
  using cache_type = typename paged_fixture<Choice>::cache_type;
  auto f = std::make_unique<paged_fixture<Choice>>();
  std::size_t const n = copies_for<Choice>();
  std::int64_t const pages_per_sequence = (tokens + page_tokens - 1) / page_tokens + 1;
  int const sequences = static_cast<int>(2 * n);
  f->paged = std::make_unique<cache_type>(
      kvq::paged_shape{layers, kv_heads, head_dim, page_tokens, pages_per_sequence * sequences, sequences},
      typename cache_type::options{kivi_residual});
  for (std::size_t i = 0; i < n; ++i) {
    kvq::sequence_id const id = f->paged->add_sequence();
    f->sources.push_back(id);
    f->imported.push_back(-1);
    fill([&](int l, auto const& k, auto const& v) { f->paged->append(id, l, k, v); });
    std::vector<std::byte> bytes;
    kvq::export_sequence(*f->paged, id, kvq::vector_writer(bytes));
    f->image_bytes = bytes.size();
    f->exports.emplace_back(bytes.size());
    std::memcpy(f->exports.back().data(), bytes.data(), bytes.size());
    f->scratch.emplace_back(bytes.size());
  }
  return f;
}

/// The key of the live fixture and the fixture, one for the whole suite.
struct live_fixture {
  std::string key;
  std::unique_ptr<fixture_base> fixture;
};

auto live() -> live_fixture& {
  static live_fixture l;
  return l;
}

/// The one live fixture: rows of the same key share it; a new key frees the old fixture, whatever
/// its codec, before building the next, so only one working set is in memory at a time.
template <class Fixture, class Build>
auto acquire(std::string const& key, Build&& build) -> Fixture& {
  live_fixture& l = live();
  if (l.key != key) {
    l.fixture.reset();
    l.key.clear();
    l.fixture = build();
    l.key = key;
  }
  return static_cast<Fixture&>(*l.fixture);
}

/// Records `bytes` image bytes per iteration, the rotation's copies and the bytes a cycle touches.
void report(benchmark::State& state, std::size_t bytes, std::size_t copies) {
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(bytes));
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["copies"] = static_cast<double>(copies);
  state.counters["working_set_bytes"] = 2.0 * static_cast<double>(bytes) * static_cast<double>(copies);
}

/// The flat operations of the benchmark.
enum class flat_op { save, load_into, replace, load, memcpy, memcpy_new };

/// One flat row: iteration i runs `op` on copy i mod n.
template <class Choice>
void bm_flat(benchmark::State& state, std::string const& codec, flat_op op) {
  using cache_type = typename flat_fixture<Choice>::cache_type;
  auto& f = acquire<flat_fixture<Choice>>(codec + "/flat", [] { return build_flat<Choice>(); });
  std::size_t const n = f.caches.size(), bytes = f.image_bytes;
  std::size_t i = 0;
  for (auto _ : state) {
    std::span<std::byte const> const image(f.images[i].data(), bytes);
    std::byte* out = f.scratch[i].data();
    switch (op) {
      case flat_op::save:
        kvq::save(*f.caches[i], kvq::span_writer(std::span<std::byte>(out, bytes)));
        break;
      case flat_op::load_into:
        f.caches[i]->reset();
        kvq::load_into(*f.caches[i], kvq::span_reader(image));
        break;
      case flat_op::replace:
        kvq::load_into(*f.caches[i], kvq::span_reader(image));
        break;
      case flat_op::load: {
        cache_type const c = kvq::load<cache_type>(kvq::span_reader(image));
        benchmark::DoNotOptimize(&c);
        break;
      }
      case flat_op::memcpy:
        std::memcpy(out, image.data(), bytes);
        break;
      case flat_op::memcpy_new: {
        std::unique_ptr<std::byte[]> const fresh(new std::byte[bytes]);
        std::memcpy(fresh.get(), image.data(), bytes);
        benchmark::DoNotOptimize(fresh.get());
        break;
      }
    }
    benchmark::DoNotOptimize(out);
    benchmark::ClobberMemory();
    if (++i == n) i = 0;
  }
  report(state, bytes, n);
}

/// One paged row: iteration i exports source sequence i mod n, or imports export i mod n.
template <class Choice>
void bm_paged(benchmark::State& state, std::string const& codec, bool import) {
  auto& f = acquire<paged_fixture<Choice>>(codec + "/paged", [] { return build_paged<Choice>(); });
  std::size_t const n = f.sources.size(), bytes = f.image_bytes;
  std::size_t i = 0;
  for (auto _ : state) {
    if (import) {
      if (f.imported[i] >= 0) f.paged->release(f.imported[i]);
      f.imported[i] =
          kvq::import_sequence(*f.paged, kvq::span_reader(std::span<std::byte const>(f.exports[i].data(), bytes)));
    } else {
      kvq::export_sequence(*f.paged, f.sources[i], kvq::span_writer(std::span<std::byte>(f.scratch[i].data(), bytes)));
    }
    benchmark::ClobberMemory();
    if (++i == n) i = 0;
  }
  report(state, bytes, n);
}

/// Registers persist/<name>/<op> for every operation, the rows sharing a fixture next to each other.
template <class Choice>
void register_codec(std::string const& name) {
  struct flat_row {
    char const* op;
    flat_op which;
  };
  constexpr flat_row flat_rows[] = {{"save", flat_op::save},       {"load_into", flat_op::load_into},
                                    {"replace", flat_op::replace}, {"load", flat_op::load},
                                    {"memcpy", flat_op::memcpy},   {"memcpy_new", flat_op::memcpy_new}};
  for (auto const& r : flat_rows) {
    flat_op const which = r.which;
    benchmark::RegisterBenchmark(("persist/" + name + "/" + r.op).c_str(),
                                 [name, which](benchmark::State& s) { bm_flat<Choice>(s, name, which); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  for (bool import : {false, true})
    benchmark::RegisterBenchmark(("persist/" + name + (import ? "/import" : "/export")).c_str(),
                                 [name, import](benchmark::State& s) { bm_paged<Choice>(s, name, import); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
}

/// Registers the rows of every codec, in the order of the summary's tables.
void register_all() {
  register_codec<kvq::q8_0>("q8_0");
  register_codec<kvq::q4_0>("q4_0");
  register_codec<kvq::kivi<4>>("kivi4");
  register_codec<kvq::fp8_e4m3>("fp8_e4m3");
}

}  // namespace
}  // namespace kvq_bench

int main(int argc, char** argv) {
  kvq_bench::g_working_set = kvq_bench::take_working_set_flag(argc, argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  kvq_bench::add_machine_context();
  benchmark::AddCustomContext("kvq_suite", "persist");
  benchmark::AddCustomContext("working_set_min_bytes", std::to_string(kvq_bench::g_working_set));
  benchmark::AddCustomContext("persist_cache", kvq_bench::cache_description());
  kvq_bench::register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
