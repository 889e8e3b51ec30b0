// Tests of multi-token attention (kvq::attention in kvq/attention.hpp and kvq::paged_attention in
// kvq/paged_attention.hpp): n query tokens over the quantized history, as chunked prefill,
// prefix-cache suffixes and speculative verification use it.
//   * against a float64 reference over the cache's own dequantized K/V (read_keys / read_values),
//     for every codec, n_q 1 / 2 / 7 / 16 / 100 / 512, histories that end off the tile grid, causal,
//     none, additive and boolean masks, windows crossing tiles, sinks, soft-cap, and KIVI with the
//     chunk partly in the f16 residual (the usual flow: append the chunk, then attend);
//   * n_q = 1 is decode_attention bit for bit; threads and query blocks only reorder fp32 sums;
//   * the paged form equals the flat cache's result on the same tokens;
//   * NaN/Inf: a NaN key poisons exactly the queries that attend it; a row masked everywhere
//     outputs zeros (or the sink's share: zeros);
//   * argument errors.
// Tolerance: the kernels sum in fp32 (and use a polynomial exp); with logits of unit scale over
// <= 1100 tokens the outputs stay within 2e-5 of the float64 result relative to Σ p |v| (the size
// of the terms summed), while a token wrongly attended or masked moves the output by about
// 1 / (tokens attended) of that size, > 1e-3 here.
#include <kvq/attention.hpp>
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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "catch_compat.hpp"

namespace {

constexpr float inf_f = std::numeric_limits<float>::infinity();

auto sz(std::int64_t n) -> std::size_t { return static_cast<std::size_t>(n); }

template <class Choice>
using cache_t = kvq::QuantizedKVCache<Choice>;

/// Token-major K/V rows [tokens][kv_heads][head_dim]: N(0, 1) with an outlier key channel (x6).
struct kv_rows {
  std::vector<float> k, v;
};

auto make_rows(std::int64_t tokens, int kv, int d, std::uint32_t seed) -> kv_rows {
  kv_rows x;
  x.k.resize(sz(tokens) * sz(kv) * sz(d));
  x.v.resize(x.k.size());
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd;
  for (std::size_t i = 0; i < x.k.size(); ++i) {
    x.k[i] = nd(gen) * (i % sz(d) == 5 ? 6.0f : 1.0f);
    x.v[i] = nd(gen);
  }
  return x;
}

/// Queries (n_q, q_heads, d) of N(0, 1 / 2) channels: logits of unit scale, no dominant token.
auto make_queries(std::int64_t n_q, int q_heads, int d, std::uint32_t seed) -> std::vector<float> {
  std::vector<float> q(sz(n_q) * sz(q_heads) * sz(d));
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd(0.0f, 0.7f);
  for (auto& e : q) e = nd(gen);
  return q;
}

/// Appends rows [t0, t1) of x to layer 0 in chunks of `step` tokens.
template <class Cache>
void append_rows(Cache& cache, kv_rows const& x, int kv, int d, std::int64_t t0, std::int64_t t1, std::int64_t step) {
  for (std::int64_t t = t0; t < t1; t += step) {
    std::int64_t const m = std::min(step, t1 - t);
    std::size_t const off = sz(t) * sz(kv) * sz(d);
    cache.append(0, kvq::token_major(x.k.data() + off, m, kv, d), kvq::token_major(x.v.data() + off, m, kv, d));
  }
}

/// The float64 reference: per query token i and head h, softmax over the tokens it attends (the
/// options' mask, window, scale, soft-cap and sinks) of the cache's own dequantized K/V. Also
/// returns Σ p |v| per element (the size of the terms summed).
template <class Cache>
void reference(Cache const& cache, float const* q, std::int64_t n_q, int q_heads, kvq::attention_options const& opt,
               std::vector<double>& out, std::vector<double>& size) {
  int const d = cache.shape().head_dim;
  int const kv = cache.shape().kv_heads;
  int const group = q_heads / kv;
  std::int64_t const len = cache.size(0);
  std::int64_t const first = opt.first_pos < 0 ? len - n_q : opt.first_pos;
  std::int64_t const stride = opt.mask_stride > 0 ? opt.mask_stride : len;
  double const scale = opt.scale > 0.0f ? opt.scale : 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<std::vector<float>> keys(sz(kv)), values(sz(kv));
  for (int h = 0; h < kv; ++h) {
    keys[sz(h)].resize(sz(len) * sz(d) + 1);
    values[sz(h)].resize(sz(len) * sz(d) + 1);
    cache.read_keys(0, h, 0, len, keys[sz(h)].data());
    cache.read_values(0, h, 0, len, values[sz(h)].data());
  }
  out.assign(sz(n_q) * sz(q_heads) * sz(d), 0.0);
  size.assign(out.size(), 0.0);
  std::vector<double> logit(sz(len));
  for (std::int64_t i = 0; i < n_q; ++i) {
    std::int64_t const pos = first + i;
    std::int64_t const end = opt.mask == kvq::mask_kind::causal ? std::min(len, pos + 1) : len;
    std::int64_t const begin = opt.window > 0 ? std::max<std::int64_t>(0, pos - opt.window + 1) : 0;
    for (int h = 0; h < q_heads; ++h) {
      float const* qh = q + (sz(i) * sz(q_heads) + sz(h)) * sz(d);
      auto const& K = keys[sz(h / group)];
      auto const& V = values[sz(h / group)];
      double m = -INFINITY;
      for (std::int64_t j = 0; j < len; ++j) {
        double l = -INFINITY;
        bool allowed = j >= begin && j < end;
        if (allowed && opt.mask == kvq::mask_kind::boolean)
          allowed = static_cast<std::uint8_t const*>(opt.mask_data)[sz(i) * sz(stride) + sz(j)] != 0;
        if (allowed) {
          double s = 0.0;
          for (int c = 0; c < d; ++c) s += static_cast<double>(qh[c]) * K[sz(j) * sz(d) + sz(c)];
          l = s * scale;
          if (opt.softcap > 0.0f) l = opt.softcap * std::tanh(l / opt.softcap);
          if (opt.mask == kvq::mask_kind::additive)
            l += static_cast<float const*>(opt.mask_data)[sz(i) * sz(stride) + sz(j)];
        }
        logit[sz(j)] = l;
        m = std::max(m, l);
      }
      double const sink = opt.sinks != nullptr ? opt.sinks[h] : -INFINITY;
      double* o = out.data() + (sz(i) * sz(q_heads) + sz(h)) * sz(d);
      double* z = size.data() + (sz(i) * sz(q_heads) + sz(h)) * sz(d);
      if (m == -INFINITY) continue;  // attends nothing: zeros
      double const mm = std::max(m, sink);
      double sum = std::exp(sink - mm);
      for (std::int64_t j = 0; j < len; ++j) sum += std::exp(logit[sz(j)] - mm);
      for (std::int64_t j = 0; j < len; ++j) {
        double const p = std::exp(logit[sz(j)] - mm) / sum;
        if (p == 0.0) continue;
        for (int c = 0; c < d; ++c) {
          o[c] += p * V[sz(j) * sz(d) + sz(c)];
          z[c] += p * std::fabs(V[sz(j) * sz(d) + sz(c)]);
        }
      }
    }
  }
}

/// Checks out against the float64 reference within 2e-5 of Σ p |v| (plus 1e-7).
template <class Cache>
void check_against_reference(Cache const& cache, float const* q, std::int64_t n_q, int q_heads,
                             kvq::attention_options const& opt, std::vector<float> const& out) {
  std::vector<double> ref, size;
  reference(cache, q, n_q, q_heads, opt, ref, size);
  double worst = 0.0;
  std::size_t at = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    double const e = std::fabs(out[i] - ref[i]) / (2e-5 * size[i] + 1e-7);
    if (!(e <= worst)) {
      worst = e;
      at = i;
    }
  }
  INFO("worst element " << at << ": " << out[at] << " vs " << ref[at] << " (size " << size[at] << ")");
  CHECK(worst <= 1.0);
}

template <class Choice>
void check_codec() {
  int const kv = 2, qh = 8, d = 64;
  for (std::int64_t prefix : {0, 45, 300}) {
    for (std::int64_t n_q : {1, 2, 7, 16, 100, 512}) {
      if (n_q == 512 && prefix != 45) continue;
      cache_t<Choice> cache({1, kv, d, 1100});
      auto const x = make_rows(prefix + n_q, kv, d, static_cast<std::uint32_t>(prefix * 7 + n_q));
      append_rows(cache, x, kv, d, 0, prefix, 13);
      append_rows(cache, x, kv, d, prefix, prefix + n_q, n_q);  // the chunk, in one append
      auto const q = make_queries(n_q, qh, d, static_cast<std::uint32_t>(n_q));
      std::vector<float> out(q.size());
      kvq::attention_options opt;
      INFO("prefix " << prefix << ", n_q " << n_q);
      {
        INFO("causal");
        kvq::attention(cache, 0, q.data(), n_q, qh, out.data(), opt);
        check_against_reference(cache, q.data(), n_q, qh, opt, out);
      }
      if (n_q > 100) continue;
      {
        INFO("window 40, soft-cap 2, sinks");
        std::vector<float> sinks(sz(qh));
        for (int h = 0; h < qh; ++h) sinks[sz(h)] = h == 3 ? -inf_f : 0.5f * static_cast<float>(h - 2);
        kvq::attention_options o = opt;
        o.window = 40;
        o.softcap = 2.0f;
        o.sinks = sinks.data();
        kvq::attention(cache, 0, q.data(), n_q, qh, out.data(), o);
        check_against_reference(cache, q.data(), n_q, qh, o, out);
      }
      {
        INFO("no mask from an earlier position, 2 threads");
        kvq::attention_options o = opt;
        o.mask = kvq::mask_kind::none;
        o.first_pos = prefix / 2;
        kvq::attention(cache, 0, q.data(), n_q, qh, out.data(), o, 2);
        check_against_reference(cache, q.data(), n_q, qh, o, out);
      }
      {
        INFO("boolean and additive masks (a tree of drafts over a visible prefix)");
        std::int64_t const len = prefix + n_q, stride = len + 3;
        std::vector<std::uint8_t> allow(sz(n_q) * sz(stride), 0);
        std::vector<float> bias(allow.size(), 0.0f);
        std::mt19937 gen(9);
        for (std::int64_t i = 0; i < n_q; ++i)
          for (std::int64_t j = 0; j < len; ++j) {
            bool const a = j < prefix ? gen() % 8 != 0 : (j - prefix == i || (j - prefix < i && gen() % 2 == 0));
            allow[sz(i) * sz(stride) + sz(j)] = a ? 1 : 0;
            bias[sz(i) * sz(stride) + sz(j)] = a ? 0.25f * static_cast<float>(j % 5) : -inf_f;
          }
        kvq::attention_options o = opt;
        o.mask = kvq::mask_kind::boolean;
        o.mask_data = allow.data();
        o.mask_stride = stride;
        kvq::attention(cache, 0, q.data(), n_q, qh, out.data(), o);
        check_against_reference(cache, q.data(), n_q, qh, o, out);
        o.mask = kvq::mask_kind::additive;
        o.mask_data = bias.data();
        kvq::attention(cache, 0, q.data(), n_q, qh, out.data(), o);
        check_against_reference(cache, q.data(), n_q, qh, o, out);
      }
    }
  }
}

using q8k_q4v = kvq::kv_codecs<kvq::q8_0, kvq::q4_0>;
using fp4_pair = kvq::kv_codecs<kvq::mxfp4, kvq::nvfp4>;
using kivi8_g16 = kvq::kivi<8, 16>;
using rot_q4_0 = kvq::rotated<kvq::q4_0>;
using rot_q8k_q4v = kvq::kv_codecs<kvq::rotated<kvq::q8_0>, kvq::q4_0>;
using rot_kivi4 = kvq::kv_codecs<kvq::rotated<kvq::kivi_key<4>>, kvq::rotated<kvq::kivi_value<4>>>;
using tq4k_tq3v = kvq::kv_codecs<kvq::tq4, kvq::tq3>;

#define KVQ_MQ_CHOICES                                                                                        \
  kvq::f32_codec, kvq::f16_codec, kvq::q8_0, kvq::q4_0, kvq::int8_sym, kvq::fp8_e4m3, kvq::fp8_e5m2, q8k_q4v, \
      fp4_pair, kvq::kivi<2>, kvq::kivi<4>, kivi8_g16, rot_q4_0, rot_q8k_q4v, rot_kivi4, kvq::tq2, tq4k_tq3v

/// Bitwise equality of two float vectors (NaN payloads included).
auto same_bits(std::vector<float> const& a, std::vector<float> const& b) -> bool {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEMPLATE_TEST_CASE("multi-token attention matches the float64 reference for every codec", "[attention][multi]",
                   KVQ_MQ_CHOICES) {
  check_codec<TestType>();
}

TEMPLATE_TEST_CASE("n_q = 1 is decode attention bit for bit", "[attention][multi]", KVQ_MQ_CHOICES) {
  int const kv = 2, qh = 6, d = 80;
  cache_t<TestType> cache({1, kv, d, 400});
  auto const x = make_rows(333, kv, d, 5);
  append_rows(cache, x, kv, d, 0, 333, 37);
  auto const q = make_queries(1, qh, d, 6);
  std::vector<float> sinks{0.1f, -inf_f, 2.0f, -1.0f, 0.0f, 5.0f};
  for (int variant = 0; variant < 4; ++variant) {
    kvq::attention_options o;
    if (variant == 1) o.window = 70;
    if (variant == 2) {
      o.softcap = 3.0f;
      o.query = kvq::query_precision::q8_0;
      o.probabilities = kvq::probability_precision::f16;
    }
    if (variant == 3) o.sinks = sinks.data();
    std::vector<float> a(q.size()), b(q.size());
    kvq::attention(cache, 0, q.data(), 1, qh, a.data(), o);
    kvq::decode_attention(cache, 0, q.data(), qh, b.data(), o);
    INFO("variant " << variant);
    CHECK(same_bits(a, b));
  }
}

TEST_CASE("query blocks and threads only reorder sums; paged chunks equal the flat cache", "[attention][multi]") {
  using choice = kvq::kivi<4>;
  int const kv = 2, qh = 8, d = 128;
  std::int64_t const prefix = 700, n_q = 150;
  cache_t<choice> flat({1, kv, d, 1024});
  kvq::PagedKVCache<choice> paged({1, kv, d, 64, 40});
  auto const x = make_rows(prefix + n_q, kv, d, 77);
  auto const seq = paged.add_sequence();
  append_rows(flat, x, kv, d, 0, prefix, 64);
  append_rows(flat, x, kv, d, prefix, prefix + n_q, n_q);
  for (std::int64_t t = 0; t < prefix + n_q; t += 64) {
    std::int64_t const m = std::min<std::int64_t>(64, prefix + n_q - t);
    std::size_t const off = sz(t) * sz(kv) * sz(d);
    paged.append(seq, 0, kvq::token_major(x.k.data() + off, m, kv, d), kvq::token_major(x.v.data() + off, m, kv, d));
  }
  auto const q = make_queries(n_q, qh, d, 3);
  std::vector<float> one(q.size()), two(q.size()), pg(q.size()), pg2(q.size());
  kvq::attention(flat, 0, q.data(), n_q, qh, one.data());
  kvq::attention(flat, 0, q.data(), n_q, qh, two.data(), {}, 2);
  check_against_reference(flat, q.data(), n_q, qh, {}, one);
  check_against_reference(flat, q.data(), n_q, qh, {}, two);
  kvq::query_chunk const chunk{seq, n_q};
  kvq::paged_attention(paged, 0, std::span<kvq::query_chunk const>(&chunk, 1), q.data(), qh, pg.data());
  kvq::paged_attention(paged, 0, std::span<kvq::query_chunk const>(&chunk, 1), q.data(), qh, pg2.data(), {}, 2);
  check_against_reference(flat, q.data(), n_q, qh, {}, pg);
  check_against_reference(flat, q.data(), n_q, qh, {}, pg2);
}

TEST_CASE("paged attention: a mixed batch of a prefill chunk, a draft and a decode token", "[attention][multi]") {
  using choice = kvq::q4_0;
  int const kv = 2, qh = 4, d = 64;
  kvq::PagedKVCache<choice> paged({1, kv, d, 32, 80});
  std::vector<kvq::sequence_id> seqs;
  std::vector<std::int64_t> lens{300, 90, 41};
  std::vector<kv_rows> data;
  for (std::size_t s = 0; s < lens.size(); ++s) {
    seqs.push_back(paged.add_sequence());
    data.push_back(make_rows(lens[s], kv, d, static_cast<std::uint32_t>(100 + s)));
    auto const& x = data.back();
    paged.append(seqs.back(), 0, kvq::token_major(x.k.data(), lens[s], kv, d),
                 kvq::token_major(x.v.data(), lens[s], kv, d));
  }
  std::vector<kvq::query_chunk> chunks{{seqs[0], 64}, {seqs[1], 8}, {seqs[2], 1}};
  std::int64_t const rows = 73;
  auto const q = make_queries(rows, qh, d, 11);
  std::vector<float> out(q.size());
  kvq::paged_attention(paged, 0, std::span<kvq::query_chunk const>(chunks), q.data(), qh, out.data());
  std::int64_t row = 0;
  for (std::size_t s = 0; s < lens.size(); ++s) {
    cache_t<choice> flat({1, kv, d, 512});
    append_rows(flat, data[s], kv, d, 0, lens[s], 32);
    std::int64_t const n = chunks[s].n_q;
    std::size_t const off = sz(row) * sz(qh) * sz(d);
    std::vector<float> part(out.begin() + static_cast<std::ptrdiff_t>(off),
                            out.begin() + static_cast<std::ptrdiff_t>(off + sz(n) * sz(qh) * sz(d)));
    INFO("sequence " << s);
    check_against_reference(flat, q.data() + off, n, qh, {}, part);
    row += n;
  }
}

TEST_CASE("multi-token attention: NaN keys poison exactly the queries that attend them", "[attention][multi][nan]") {
  int const kv = 1, qh = 2, d = 32;
  cache_t<kvq::f16_codec> cache({1, kv, d, 200});
  auto x = make_rows(100, kv, d, 4);
  x.k[sz(90) * sz(d) + 3] = std::numeric_limits<float>::quiet_NaN();  // token 90
  append_rows(cache, x, kv, d, 0, 100, 100);
  auto const q = make_queries(20, qh, d, 5);
  std::vector<float> out(q.size());
  kvq::attention(cache, 0, q.data(), 20, qh, out.data());  // positions 80 .. 99
  for (int i = 0; i < 20; ++i)
    for (int c = 0; c < qh * d; ++c) {
      float const y = out[sz(i) * sz(qh) * sz(d) + sz(c)];
      INFO("query " << i << " element " << c);
      CHECK(std::isnan(y) == (80 + i >= 90));
    }
  // A boolean mask that excludes token 90 keeps every query finite; excluding everything gives zeros.
  std::vector<std::uint8_t> allow(20 * 100, 1);
  for (int i = 0; i < 20; ++i) allow[sz(i) * 100 + 90] = 0;
  std::fill_n(allow.begin() + 5 * 100, 100, std::uint8_t{0});
  kvq::attention_options o;
  o.mask = kvq::mask_kind::boolean;
  o.mask_data = allow.data();
  float const sinks[2] = {1.0f, -inf_f};
  o.sinks = sinks;
  kvq::attention(cache, 0, q.data(), 20, qh, out.data(), o);
  for (int i = 0; i < 20; ++i)
    for (int c = 0; c < qh * d; ++c) {
      float const y = out[sz(i) * sz(qh) * sz(d) + sz(c)];
      INFO("query " << i << " element " << c);
      CHECK(std::isfinite(y));
      if (i == 5) CHECK(y == 0.0f);
    }
  // A +Inf additive mask entry makes the logit +Inf: that query's heads are NaN, as in decode.
  std::vector<float> bias(20 * 100, 0.0f);
  bias[sz(7) * 100 + 10] = inf_f;
  o.mask = kvq::mask_kind::additive;
  o.mask_data = bias.data();
  o.sinks = nullptr;
  x.k[sz(90) * sz(d) + 3] = 0.0f;
  cache_t<kvq::f16_codec> clean({1, kv, d, 200});
  append_rows(clean, x, kv, d, 0, 100, 100);
  kvq::attention(clean, 0, q.data(), 20, qh, out.data(), o);
  for (int i = 0; i < 20; ++i) {
    INFO("query " << i);
    CHECK(std::isnan(out[sz(i) * sz(qh) * sz(d)]) == (i == 7));
  }
}

TEST_CASE("multi-token attention argument errors", "[attention][multi][errors]") {
  int const kv = 2, qh = 4, d = 32;
  cache_t<kvq::q8_0> cache({2, kv, d, 64});
  auto const x = make_rows(10, kv, d, 1);
  append_rows(cache, x, kv, d, 0, 10, 10);
  auto const q = make_queries(10, qh, d, 2);
  std::vector<float> out(q.size(), 7.0f);
  auto const untouched = [&] { return std::all_of(out.begin(), out.end(), [](float y) { return y == 7.0f; }); };
  kvq::attention_options o;
  CHECK_THROWS_AS(kvq::attention(cache, 0, q.data(), -1, qh, out.data()), kvq::invalid_argument_error);
  CHECK_THROWS_AS(kvq::attention(cache, 0, q.data(), 11, qh, out.data()), kvq::index_error);  // first_pos -1
  o.first_pos = 5;
  CHECK_THROWS_AS(kvq::attention(cache, 0, q.data(), 6, qh, out.data(), o), kvq::index_error);  // past the end
  o.first_pos = -1;
  CHECK_THROWS_AS(kvq::attention(cache, 2, q.data(), 1, qh, out.data()), kvq::index_error);
  CHECK_THROWS_AS(kvq::attention(cache, 0, q.data(), 1, 3, out.data()), kvq::shape_error);
  CHECK_THROWS_AS(kvq::attention(cache, 0, nullptr, 1, qh, out.data()), kvq::shape_error);
  CHECK_THROWS_AS(kvq::attention(cache, 0, q.data(), 1, qh, nullptr), kvq::shape_error);
  CHECK_THROWS_AS(kvq::attention(cache, 0, q.data(), 1, qh, out.data(), o, 0), kvq::invalid_argument_error);
  o.mask = kvq::mask_kind::boolean;
  CHECK_THROWS_AS(kvq::attention(cache, 0, q.data(), 2, qh, out.data(), o), kvq::invalid_argument_error);
  std::vector<std::uint8_t> allow(20, 1);
  o.mask_data = allow.data();
  o.mask_stride = 9;  // below the 10 tokens
  CHECK_THROWS_AS(kvq::attention(cache, 0, q.data(), 2, qh, out.data(), o), kvq::invalid_argument_error);
  o = {};
  float sinks[4] = {0.0f, std::numeric_limits<float>::quiet_NaN(), 0.0f, 0.0f};
  o.sinks = sinks;
  CHECK_THROWS_AS(kvq::attention(cache, 0, q.data(), 2, qh, out.data(), o), kvq::invalid_argument_error);
  sinks[1] = inf_f;
  CHECK_THROWS_AS(kvq::attention(cache, 0, q.data(), 2, qh, out.data(), o), kvq::invalid_argument_error);
  CHECK_THROWS_AS(kvq::decode_attention(cache, 0, q.data(), qh, out.data(), o), kvq::invalid_argument_error);
  CHECK(untouched());
  // n_q = 0 is a valid empty call.
  kvq::attention(cache, 0, nullptr, 0, qh, nullptr);
  // The paged form keeps positions and masks per chunk.
  kvq::PagedKVCache<kvq::q8_0> paged({1, kv, d, 16, 8});
  auto const seq = paged.add_sequence();
  paged.append(seq, 0, kvq::token_major(x.k.data(), 10, kv, d), kvq::token_major(x.v.data(), 10, kv, d));
  kvq::query_chunk chunk{seq, 3};
  kvq::attention_options po;
  po.first_pos = 2;
  CHECK_THROWS_AS(
      kvq::paged_attention(paged, 0, std::span<kvq::query_chunk const>(&chunk, 1), q.data(), qh, out.data(), po),
      kvq::invalid_argument_error);
  chunk.first_pos = 8;
  CHECK_THROWS_AS(
      kvq::paged_attention(paged, 0, std::span<kvq::query_chunk const>(&chunk, 1), q.data(), qh, out.data()),
      kvq::index_error);
  chunk.seq = kvq::sequence_id{12345};
  CHECK_THROWS_AS(
      kvq::paged_attention(paged, 0, std::span<kvq::query_chunk const>(&chunk, 1), q.data(), qh, out.data()),
      kvq::index_error);
  CHECK(untouched());
}
