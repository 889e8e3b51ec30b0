// kvq benchmark: the write path engines call — QuantizedKVCache::append and PagedKVCache::append of
// token-major keys and values — against memcpy of the same bytes in the same pieces, in one run.
//
// Cache: one layer, 8 kv_heads, head_dim 128 (the flat cache holds 16384 tokens; the paged one has
// pages of 64 tokens). Keys are N(0,1) with four outlier channels ×10, values N(0,1), stored as f32,
// f16 and bf16 (the input types of append). Rows:
//   append/<codec>/<input>/prefill   appends of 512-token chunks until the layer holds 16384 tokens
//   append/<codec>/<input>/decode    appends of one token at a time until it holds 4096 tokens
//   append/<codec>/f32/paged_prefill the paged cache's append, 512-token chunks, 16384 tokens
//   append/<codec>/f32/paged_decode  the paged cache's append, one token at a time, 4096 tokens
//   memcpy/<codec>/<input>/<mode>    memcpy of as many bytes in as many pieces (see below)
// Each iteration first empties the layer (truncate(0), or the sequence released and added again),
// so every iteration writes the same memory, which an untimed fill touched first: the steady state
// of an engine.
//
// Bytes: an append reads the input keys and values and writes the encoded bytes (plan_memory's key
// and value bytes for the tokens; KIVI's f16 residual rows are rewritten in place); bytes_per_second
// counts `input bytes + encoded bytes`. Its memcpy twin copies half that many bytes per piece (so it
// reads and writes as many) from a source as large as the input to a destination as large as the
// cache, piece after piece, as the appends walk them. % of memcpy = memcpy time / append time.
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
#include <kvq/paged_cache.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include "bench_common.hpp"

namespace kvq_bench {
namespace {

constexpr int kv_heads = 8;
constexpr std::int64_t prefill_tokens = 16384;
constexpr std::int64_t prefill_chunk = 512;
constexpr std::int64_t decode_tokens = 4096;
constexpr int page_tokens = 64;
constexpr std::int64_t row_elements = static_cast<std::int64_t>(kv_heads) * head_dim;  // one token

/// The element types append takes.
enum class input { f32, f16, bf16 };

auto input_name(input in) -> std::string { return in == input::f32 ? "f32" : in == input::f16 ? "f16" : "bf16"; }
auto input_bytes(input in) -> std::size_t { return in == input::f32 ? 4 : 2; }

/// Token-major (prefill_tokens, kv_heads, head_dim) keys and values in every input type, built once.
struct kv_pool {
  std::vector<float> keys, values;
  std::vector<kvq::f16> keys16, values16;
  std::vector<kvq::bf16> keys_bf, values_bf;
};

auto pool() -> kv_pool const& {
  static kv_pool const p = [] {
    kv_pool q;
    std::size_t const n = static_cast<std::size_t>(prefill_tokens * row_elements);
    q.keys.resize(n);
    q.values.resize(n);
    fill_normal(q.keys.data(), n, 31);
    add_outlier_channels(q.keys.data(), n, 10.0f);
    fill_normal(q.values.data(), n, 37);
    q.keys16.resize(n);
    q.values16.resize(n);
    q.keys_bf.resize(n);
    q.values_bf.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      q.keys16[i] = kvq::to_f16(q.keys[i]);
      q.values16[i] = kvq::to_f16(q.values[i]);
      q.keys_bf[i] = kvq::to_bf16(q.keys[i]);
      q.values_bf[i] = kvq::to_bf16(q.values[i]);
    }
    return q;
  }();
  return p;
}

/// Calls f(keys, values) with the pool's token-major tensors of `in` for tokens [first, first + n).
template <class F>
void with_tensors(input in, std::int64_t first, std::int64_t n, F&& f) {
  auto const& p = pool();
  std::size_t const at = static_cast<std::size_t>(first * row_elements);
  switch (in) {
    case input::f32:
      f(kvq::token_major(p.keys.data() + at, n, kv_heads, head_dim),
        kvq::token_major(p.values.data() + at, n, kv_heads, head_dim));
      break;
    case input::f16:
      f(kvq::token_major(p.keys16.data() + at, n, kv_heads, head_dim),
        kvq::token_major(p.values16.data() + at, n, kv_heads, head_dim));
      break;
    case input::bf16:
      f(kvq::token_major(p.keys_bf.data() + at, n, kv_heads, head_dim),
        kvq::token_major(p.values_bf.data() + at, n, kv_heads, head_dim));
      break;
  }
}

/// Bytes an append of `tokens` tokens of codec Choice from `in` moves: input read + encoded written.
template <class Choice>
auto moved_bytes(input in, std::int64_t tokens) -> std::size_t {
  auto const m = kvq::plan_memory<Choice>({1, kv_heads, head_dim, tokens}, 128);
  return 2 * static_cast<std::size_t>(tokens * row_elements) * input_bytes(in) + m.key_bytes + m.value_bytes;
}

/// Appends [0, tokens) in pieces of `piece` tokens through `append(keys, values)`.
template <class Append>
void append_all(input in, std::int64_t tokens, std::int64_t piece, Append&& append) {
  for (std::int64_t t = 0; t < tokens; t += piece)
    with_tensors(in, t, std::min(piece, tokens - t), [&](auto const& k, auto const& v) { append(k, v); });
}

template <class Choice>
void bm_flat(benchmark::State& state, input in, std::int64_t tokens, std::int64_t piece) {
  kvq::QuantizedKVCache<Choice> cache({1, kv_heads, head_dim, prefill_tokens});
  append_all(in, prefill_tokens, prefill_chunk, [&](auto const& k, auto const& v) { cache.append(0, k, v); });
  for (auto _ : state) {
    cache.truncate(0);
    append_all(in, tokens, piece, [&](auto const& k, auto const& v) { cache.append(0, k, v); });
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(moved_bytes<Choice>(in, tokens)));
  state.counters["bytes"] = static_cast<double>(moved_bytes<Choice>(in, tokens));
}

template <class Choice>
void bm_paged(benchmark::State& state, std::int64_t tokens, std::int64_t piece) {
  std::int64_t const pages = (prefill_tokens + page_tokens - 1) / page_tokens + 2;
  kvq::PagedKVCache<Choice> cache(kvq::paged_shape{1, kv_heads, head_dim, page_tokens, pages, 2});
  kvq::sequence_id seq = cache.add_sequence();
  append_all(input::f32, prefill_tokens, prefill_chunk,
             [&](auto const& k, auto const& v) { cache.append(seq, 0, k, v); });
  for (auto _ : state) {
    cache.release(seq);
    seq = cache.add_sequence();
    append_all(input::f32, tokens, piece, [&](auto const& k, auto const& v) { cache.append(seq, 0, k, v); });
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(moved_bytes<Choice>(input::f32, tokens)));
  state.counters["bytes"] = static_cast<double>(moved_bytes<Choice>(input::f32, tokens));
}

/// memcpy of half an append's bytes, in as many pieces, from an input-sized source to a cache-sized
/// destination.
template <class Choice>
void bm_memcpy(benchmark::State& state, input in, std::int64_t tokens, std::int64_t piece) {
  std::size_t const bytes = moved_bytes<Choice>(in, tokens);
  std::int64_t const pieces = (tokens + piece - 1) / piece;
  std::size_t const per_piece = bytes / 2 / static_cast<std::size_t>(pieces);
  buffer src(per_piece * static_cast<std::size_t>(pieces)), dst(src.size());
  std::memset(src.data(), 1, src.size());
  for (auto _ : state) {
    for (std::int64_t i = 0; i < pieces; ++i) {
      std::size_t const at = static_cast<std::size_t>(i) * per_piece;
      std::memcpy(dst.data() + at, src.data() + at, per_piece);
    }
    benchmark::ClobberMemory();
  }
  std::size_t const copied = 2 * per_piece * static_cast<std::size_t>(pieces);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(copied));
  state.counters["bytes"] = static_cast<double>(copied);
}

/// Registers the rows of one codec: every input type for the flat cache, f32 for the paged one.
template <class Choice>
void register_codec(std::string const& name) {
  struct mode {
    char const* name;
    std::int64_t tokens, piece;
  };
  static constexpr mode modes[] = {{"prefill", prefill_tokens, prefill_chunk}, {"decode", decode_tokens, 1}};
  for (input in : {input::f32, input::f16, input::bf16}) {
    for (mode const& m : modes) {
      std::string const tail = "/" + name + "/" + input_name(in) + "/" + m.name;
      benchmark::RegisterBenchmark(("append" + tail).c_str(),
                                   [in, m](benchmark::State& s) { bm_flat<Choice>(s, in, m.tokens, m.piece); })
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
      benchmark::RegisterBenchmark(("memcpy" + tail).c_str(),
                                   [in, m](benchmark::State& s) { bm_memcpy<Choice>(s, in, m.tokens, m.piece); })
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  }
  for (mode const& m : modes) {
    std::string const tail = "/" + name + "/f32/paged_" + m.name;
    benchmark::RegisterBenchmark(("append" + tail).c_str(),
                                 [m](benchmark::State& s) { bm_paged<Choice>(s, m.tokens, m.piece); })
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("memcpy" + tail).c_str(),
                                 [m](benchmark::State& s) { bm_memcpy<Choice>(s, input::f32, m.tokens, m.piece); })
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
}

void register_all() {
  register_codec<kvq::f16_codec>("f16");
  register_codec<kvq::q8_0>("q8_0");
  register_codec<kvq::q4_0>("q4_0");
  register_codec<kvq::int8_sym>("int8");
  register_codec<kvq::fp8_e4m3>("fp8_e4m3");
  register_codec<kvq::kivi<2, 32>>("kivi2");
  register_codec<kvq::kivi<4, 32>>("kivi4");
  register_codec<kvq::rotated<kvq::q4_0>>("rot-q4_0");
  register_codec<kvq::tq4>("tq4");
  register_codec<kvq::mxfp4>("mxfp4");
  register_codec<kvq::nvfp4>("nvfp4");
}

}  // namespace
}  // namespace kvq_bench

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  kvq_bench::add_machine_context();
  benchmark::AddCustomContext("kvq_suite", "append");
  benchmark::AddCustomContext("append_cache", "1 layer × 8 kv_heads × head_dim 128, token-major input");
  kvq_bench::register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
