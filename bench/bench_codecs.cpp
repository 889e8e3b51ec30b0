// kvq benchmark: encode and decode of every codec through kvq::cpu_kernels (the SIMD kernels the
// cache uses) at 256 MiB and 1 MiB of f32, next to memcpy and a read-only pass over the same bytes.
//
// Bytes: an encode reads the f32 rows and writes the encoded bytes; a decode reads the encoded
// bytes and writes f32 rows. Both move `f32 bytes + encoded bytes` (read + written), the count
// behind bytes_per_second. memcpy/<codec>/<size> copies half that many bytes, so it too reads and
// writes exactly that many, and read/<codec>/<size> reads the f32 bytes and the encoded bytes once.
// "% of memcpy" compares like with like: memcpy time / codec time for the same byte count.
//
// Entries: every row codec of DESIGN §8 under its name, and KIVI keys (tiles of G = 32 tokens) and
// values (rows) on their own as kivi<B>.k and kivi<B>.v; the summary combines the two. The rotated
// codecs rot-q4_0 and tq4 / tq3 / tq2 (FORMATS.md §6) run as the CPU cache runs them: rows rotated
// by R in chunks of 16 that stay in L1, then encoded by the kernels of the stored codec
// (kvq::stored_codec_t<C>: q4_0, or the tq codebook); decoded by those kernels, then un-rotated.
// Sizes: 256 MiB of f32 is far beyond the last-level cache (DRAM bandwidth); 1 MiB stays in cache.
#include <kvq/backend/cpu/kernels.hpp>
#include <kvq/codec/fp4.hpp>
#include <kvq/codec/fp8.hpp>
#include <kvq/codec/int8.hpp>
#include <kvq/codec/kivi.hpp>
#include <kvq/codec/passthrough.hpp>
#include <kvq/codec/q4_0.hpp>
#include <kvq/codec/q8_0.hpp>
#include <kvq/codec/rotated.hpp>
#include <kvq/codec/tq.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include "bench_common.hpp"

namespace kvq_bench {
namespace {

/// The f32 sizes measured: far beyond the caches, and inside them.
constexpr std::size_t sizes[] = {256 * mib, 1 * mib};

/// One codec entry: its name and its encode/decode of `rows` head_dim rows.
struct codec_entry {
  std::string name;
  std::size_t (*encoded_bytes)(std::size_t rows);
  void (*encode)(float const* x, std::size_t rows, std::uint8_t* dst);
  void (*decode)(std::uint8_t const* src, std::size_t rows, float* y);
};

/// A row codec: rows encoded one after another (kvq::cpu_kernels::encode_rows / decode_rows).
template <class C>
auto row_entry(std::string name) -> codec_entry {
  return {std::move(name), [](std::size_t rows) { return rows * C::geometry(head_dim).bytes(); },
          [](float const* x, std::size_t rows, std::uint8_t* dst) {
            kvq::cpu_kernels::encode_rows<C>(x, head_dim, static_cast<std::int64_t>(rows), head_dim, dst,
                                             C::geometry(head_dim).bytes());
          },
          [](std::uint8_t const* src, std::size_t rows, float* y) {
            kvq::cpu_kernels::decode_rows<C>(src, C::geometry(head_dim).bytes(), static_cast<std::int64_t>(rows),
                                             head_dim, y, head_dim);
          }};
}

/// A token-group codec (KIVI keys): tiles of C::group tokens (encode_tile / decode_tile_tokens).
template <class C>
auto tile_entry(std::string name) -> codec_entry {
  return {std::move(name), [](std::size_t rows) { return rows / C::group * C::geometry(head_dim).bytes(); },
          [](float const* x, std::size_t rows, std::uint8_t* dst) {
            std::size_t const tile_bytes = C::geometry(head_dim).bytes();
            for (std::size_t t = 0; t < rows / C::group; ++t)
              kvq::cpu_kernels::encode_tile<C>(x + t * C::group * head_dim, head_dim, head_dim, dst + t * tile_bytes);
          },
          [](std::uint8_t const* src, std::size_t rows, float* y) {
            std::size_t const tile_bytes = C::geometry(head_dim).bytes();
            for (std::size_t t = 0; t < rows / C::group; ++t)
              kvq::cpu_kernels::decode_tile_tokens<C>(src + t * tile_bytes, head_dim, 0, C::group,
                                                      y + t * C::group * head_dim, head_dim);
          }};
}

/// Rows of a rotated codec rotated (or un-rotated) and coded per chunk, as the CPU cache's gather does.
inline constexpr std::size_t rotation_chunk = 16;

/// A rotated codec C (FORMATS.md §6.1): each chunk of rows rotated by R under C's seed into an L1
/// scratch, then encoded by kvq::cpu_kernels::encode_rows of the stored codec; decoded by
/// decode_rows of the stored codec, then un-rotated in place.
template <class C>
auto rotated_row_entry(std::string name) -> codec_entry {
  using stored = kvq::stored_codec_t<C>;
  return {std::move(name), [](std::size_t rows) { return rows * C::geometry(head_dim).bytes(); },
          [](float const* x, std::size_t rows, std::uint8_t* dst) {
            std::size_t const bytes = C::geometry(head_dim).bytes();
            kvq::detail::row_rotation const rotation(head_dim, C::rotation_seed);
            std::vector<float> scratch(rotation_chunk * head_dim);
            for (std::size_t r0 = 0; r0 < rows; r0 += rotation_chunk) {
              std::size_t const n = std::min(rotation_chunk, rows - r0);
              rotation.forward_rows(x + r0 * head_dim, head_dim, scratch.data(), head_dim,
                                    static_cast<std::int64_t>(n));
              kvq::cpu_kernels::encode_rows<stored>(scratch.data(), head_dim, static_cast<std::int64_t>(n), head_dim,
                                                    dst + r0 * bytes, bytes);
            }
          },
          [](std::uint8_t const* src, std::size_t rows, float* y) {
            std::size_t const bytes = C::geometry(head_dim).bytes();
            kvq::detail::row_rotation const rotation(head_dim, C::rotation_seed);
            for (std::size_t r0 = 0; r0 < rows; r0 += rotation_chunk) {
              std::size_t const n = std::min(rotation_chunk, rows - r0);
              kvq::cpu_kernels::decode_rows<stored>(src + r0 * bytes, bytes, static_cast<std::int64_t>(n), head_dim,
                                                    y + r0 * head_dim, head_dim);
              rotation.inverse_rows(y + r0 * head_dim, static_cast<std::int64_t>(n), head_dim);
            }
          }};
}

/// Every entry, in the order of DESIGN §8, then the FP4 blocks (FORMATS.md §7) and the rotated
/// codecs (FORMATS.md §6).
auto entries() -> std::vector<codec_entry> {
  return {row_entry<kvq::f32_codec>("f32"),
          row_entry<kvq::f16_codec>("f16"),
          row_entry<kvq::q4_0>("q4_0"),
          row_entry<kvq::q8_0>("q8_0"),
          row_entry<kvq::int8_sym>("int8"),
          row_entry<kvq::fp8_e4m3>("fp8_e4m3"),
          row_entry<kvq::fp8_e5m2>("fp8_e5m2"),
          tile_entry<kvq::kivi_key<2, 32>>("kivi2.k"),
          row_entry<kvq::kivi_value<2, 32>>("kivi2.v"),
          tile_entry<kvq::kivi_key<4, 32>>("kivi4.k"),
          row_entry<kvq::kivi_value<4, 32>>("kivi4.v"),
          tile_entry<kvq::kivi_key<8, 32>>("kivi8.k"),
          row_entry<kvq::kivi_value<8, 32>>("kivi8.v"),
          row_entry<kvq::mxfp4>("mxfp4"),
          row_entry<kvq::nvfp4>("nvfp4"),
          rotated_row_entry<kvq::rotated<kvq::q4_0>>("rot-q4_0"),
          rotated_row_entry<kvq::tq4>("tq4"),
          rotated_row_entry<kvq::tq3>("tq3"),
          rotated_row_entry<kvq::tq2>("tq2")};
}

/// Buffers shared by every benchmark: the f32 input (N(0,1) with outlier channels), the encoded
/// bytes and the decoded output, each large enough for the biggest size.
struct workspace {
  buffer input{sizes[0]};
  buffer encoded{sizes[0]};
  buffer output{sizes[0]};
  std::string encoded_entry;     // which entry `encoded` holds, so a decode need not encode again
  std::size_t encoded_rows = 0;  // how many rows of it

  workspace() {
    fill_normal(input.as<float>(), sizes[0] / sizeof(float), 1);
    add_outlier_channels(input.as<float>(), sizes[0] / sizeof(float), 8.0f);
  }
};

auto shared_workspace() -> workspace& {
  static workspace w;
  return w;
}

/// Records the byte counts of one benchmark: bytes_per_second over `bytes` per iteration.
void report_bytes(benchmark::State& state, std::size_t f32_bytes, std::size_t encoded_bytes) {
  std::size_t const bytes = f32_bytes + encoded_bytes;
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(bytes));
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["f32_bytes"] = static_cast<double>(f32_bytes);
  state.counters["encoded_bytes"] = static_cast<double>(encoded_bytes);
}

void bm_encode(benchmark::State& state, codec_entry const& e, std::size_t size) {
  auto& w = shared_workspace();
  std::size_t const rows = size / (head_dim * sizeof(float));
  auto* dst = w.encoded.as<std::uint8_t>();
  for (auto _ : state) {
    e.encode(w.input.as<float>(), rows, dst);
    benchmark::DoNotOptimize(dst);
    benchmark::ClobberMemory();
  }
  w.encoded_entry = e.name;
  w.encoded_rows = rows;
  report_bytes(state, size, e.encoded_bytes(rows));
}

void bm_decode(benchmark::State& state, codec_entry const& e, std::size_t size) {
  auto& w = shared_workspace();
  std::size_t const rows = size / (head_dim * sizeof(float));
  auto const* src = w.encoded.as<std::uint8_t>();
  if (w.encoded_entry != e.name || w.encoded_rows < rows) {
    e.encode(w.input.as<float>(), rows, w.encoded.as<std::uint8_t>());
    w.encoded_entry = e.name;
    w.encoded_rows = rows;
  }
  auto* y = w.output.as<float>();
  for (auto _ : state) {
    e.decode(src, rows, y);
    benchmark::DoNotOptimize(y);
    benchmark::ClobberMemory();
  }
  report_bytes(state, size, e.encoded_bytes(rows));
}

void bm_memcpy(benchmark::State& state, codec_entry const& e, std::size_t size) {
  auto& w = shared_workspace();
  std::size_t const encoded = e.encoded_bytes(size / (head_dim * sizeof(float)));
  std::size_t const n = (size + encoded) / 2;
  for (auto _ : state) {
    std::memcpy(w.output.data(), w.input.data(), n);
    benchmark::ClobberMemory();
  }
  report_bytes(state, size, encoded);
}

void bm_read(benchmark::State& state, codec_entry const& e, std::size_t size) {
  auto& w = shared_workspace();
  std::size_t const encoded = e.encoded_bytes(size / (head_dim * sizeof(float)));
  for (auto _ : state) {
    std::uint64_t sum = read_pass(w.input.data(), size) + read_pass(w.encoded.data(), encoded);
    benchmark::DoNotOptimize(sum);
  }
  report_bytes(state, size, encoded);
}

/// Registers <op>/<entry>/<size> for every entry and size, the four operations of one entry and
/// size next to each other so that they see the same machine state.
void register_all() {
  static std::vector<codec_entry> const all = entries();
  using fn = void (*)(benchmark::State&, codec_entry const&, std::size_t);
  struct op {
    char const* name;
    fn run;
  };
  constexpr op ops[] = {{"encode", bm_encode}, {"decode", bm_decode}, {"memcpy", bm_memcpy}, {"read", bm_read}};
  for (auto const& e : all) {
    for (std::size_t size : sizes) {
      std::string const label = std::to_string(size / mib) + "MiB";
      for (auto const& o : ops) {
        std::string const name = std::string(o.name) + "/" + e.name + "/" + label;
        benchmark::RegisterBenchmark(name.c_str(), [run = o.run, &e, size](benchmark::State& s) { run(s, e, size); })
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
      }
    }
  }
}

}  // namespace
}  // namespace kvq_bench

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  kvq_bench::add_machine_context();
  benchmark::AddCustomContext("kvq_suite", "codecs");
  kvq_bench::register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
