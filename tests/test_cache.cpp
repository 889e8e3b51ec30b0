// Tests of QuantizedKVCache: round trips for every codec against each codec's own encode/decode,
// the KIVI residual semantics (FORMATS.md §4.3), the documented storage layout, truncate,
// shift_left, reset, memory accounting, the allocator hook, errors with the strong guarantee, and
// concurrent appends and reads.
//
// Expectations come from `stream_model`, a reference written here from the documented semantics:
// it keeps, per (layer, kv_head), the decoded rows of the quantized tokens and the f16-rounded
// rows of the residual, and calls the codecs' encode_row/decode_row/encode_tile/decode_token
// itself. Every comparison is bit for bit.
#include <kvq/cache.hpp>
#include <kvq/codec/fp8.hpp>
#include <kvq/codec/int8.hpp>
#include <kvq/codec/kivi.hpp>
#include <kvq/codec/passthrough.hpp>
#include <kvq/codec/q4_0.hpp>
#include <kvq/codec/q8_0.hpp>
#include <kvq/codec/rotated.hpp>
#include <kvq/codec/tq.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <new>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "catch_compat.hpp"
#include "test_support.hpp"

namespace {

using kvq::bf16;
using kvq::f16;
using row_t = std::vector<float>;

constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();

auto sz(std::int64_t n) -> std::size_t { return static_cast<std::size_t>(n); }

// ---------------------------------------------------------------------------------------------
// Element types

using kvq_test::elem_bits;
using kvq_test::from_f32;

template <class T>
auto type_name() -> char const* {
  if constexpr (std::is_same_v<T, float>) {
    return "f32";
  } else if constexpr (std::is_same_v<T, f16>) {
    return "f16";
  } else {
    return "bf16";
  }
}

/// x rounded to f16 and widened back.
auto f16_round(float x) -> float { return kvq::to_f32(kvq::to_f16(x)); }

auto f16_round(row_t x) -> row_t {
  for (auto& v : x) v = f16_round(v);
  return x;
}

// ---------------------------------------------------------------------------------------------
// Codec traits used by the reference

template <class C>
struct is_kivi_value : std::false_type {};
template <int B, int G>
struct is_kivi_value<kvq::kivi_value<B, G>> : std::true_type {};

template <class Choice>
using key_of = typename kvq::codec_pair<Choice>::key;
template <class Choice>
using value_of = typename kvq::codec_pair<Choice>::value;

template <class C>
constexpr bool is_tile_codec = C::layout == kvq::codec_layout::token_group;

/// G of a token-group codec, 1 for a row codec.
template <class C>
constexpr auto group_of() -> int {
  if constexpr (is_tile_codec<C>) {
    return C::group;
  } else {
    return 1;
  }
}

/// True when the cache keeps an f16 residual for this choice (R matters).
template <class Choice>
constexpr bool uses_residual = is_tile_codec<key_of<Choice>> || is_kivi_value<value_of<Choice>>::value;

/// decode_row(encode_row(x)) of a row codec.
template <class C>
auto row_roundtrip(row_t const& x, typename C::params_type const& p) -> row_t {
  int const d = static_cast<int>(x.size());
  std::vector<std::uint8_t> bytes(C::geometry(d).bytes() + 16, 0xa5);
  C::encode_row(x.data(), d, bytes.data(), p);
  row_t y(x.size());
  C::decode_row(bytes.data(), d, y.data(), p);
  return y;
}

// ---------------------------------------------------------------------------------------------
// Inputs

enum class input_layout { dense, padded, head_major };

auto layout_name(input_layout l) -> char const* {
  return l == input_layout::dense ? "dense" : l == input_layout::padded ? "padded" : "head-major";
}

/// Seeded (tokens, kv_heads, head_dim) data in element type T, stored with the strides of `layout`;
/// elements outside the rows are NaN so that reading them would show.
template <class T>
struct kv_input {
  std::int64_t tokens = 0;
  int heads = 0;
  int dim = 0;
  std::int64_t ts = 0;
  std::int64_t hs = 0;
  std::vector<T> data;

  kv_input(std::int64_t n, int h, int d, input_layout layout, std::uint32_t seed) : tokens(n), heads(h), dim(d) {
    switch (layout) {
      case input_layout::dense:
        hs = d;
        ts = static_cast<std::int64_t>(h) * d;
        break;
      case input_layout::padded:
        hs = d + 3;
        ts = h * hs + 5;
        break;
      case input_layout::head_major:
        ts = d + 2;
        hs = n * ts + 7;
        break;
    }
    std::int64_t const size = (n - 1) * ts + (h - 1) * hs + d + ts + 8;
    data.assign(sz(size), from_f32<T>(nan_f));
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    for (std::int64_t t = 0; t < n; ++t)
      for (int k = 0; k < h; ++k)
        for (int c = 0; c < d; ++c) {
          float v = dist(rng);
          if (c % 17 == 3) v *= 12.0f;       // outlier channels
          if (c == 1 && k == 0) v = 0.375f;  // a constant channel (constant KIVI key groups)
          if ((t + c) % 29 == 0) v = 0.0f;   // some exact zeros
          at(t, k, c) = from_f32<T>(v);
        }
  }

  auto at(std::int64_t t, int h, int c) -> T& { return data[sz(t * ts + h * hs + c)]; }
  auto at(std::int64_t t, int h, int c) const -> T const& { return data[sz(t * ts + h * hs + c)]; }

  /// Tokens [first, first + count) as a view with this input's strides.
  auto view(std::int64_t first, std::int64_t count) const -> kvq::kv_tensor<T> {
    return {data.data() + first * ts, count, heads, dim, ts, hs};
  }

  /// Token t of head h widened to float.
  auto row(std::int64_t t, int h) const -> row_t {
    row_t r(sz(dim));
    for (int c = 0; c < dim; ++c) r[sz(c)] = kvq::to_f32(at(t, h, c));
    return r;
  }
};

// ---------------------------------------------------------------------------------------------
// The reference model

/// The expected content of one (layer, kv_head): decoded quantized rows and f16 residual rows.
template <class Choice>
struct stream_model {
  using K = key_of<Choice>;
  using V = value_of<Choice>;
  int dim = 0;
  int residual = 0;
  typename K::params_type kp{};
  typename V::params_type vp{};
  std::vector<row_t> kq;  // keys in tiles / rows
  std::vector<row_t> kr;  // KIVI key residual (f16 values)
  std::vector<row_t> vq;  // values in rows
  std::vector<row_t> vw;  // KIVI value window, oldest first (f16 values)

  auto length() const -> std::size_t { return kq.size() + kr.size(); }

  void append(row_t const& k, row_t const& v) {
    push_key(k);
    push_value(v);
  }

  void push_key(row_t const& x) {
    if constexpr (is_tile_codec<K>) {
      std::size_t const g = K::group;
      std::size_t const f = residual > 0 ? sz(residual) : g;
      kr.push_back(f16_round(x));
      if (kr.size() < f) return;
      std::vector<float> tile(g * sz(dim));
      std::vector<std::uint8_t> bytes(K::geometry(dim).bytes() + 16, 0x5a);
      for (std::size_t k0 = 0; k0 < f; k0 += g) {
        for (std::size_t t = 0; t < g; ++t) std::copy(kr[k0 + t].begin(), kr[k0 + t].end(), tile.begin() + t * sz(dim));
        K::encode_tile(tile.data(), dim, dim, bytes.data(), kp);
        for (std::size_t t = 0; t < g; ++t) {
          row_t y(sz(dim));
          K::decode_token(bytes.data(), dim, static_cast<int>(t), y.data(), kp);
          kq.push_back(std::move(y));
        }
      }
      kr.clear();
    } else {
      kq.push_back(row_roundtrip<K>(x, kp));
    }
  }

  void push_value(row_t const& x) {
    if constexpr (is_kivi_value<V>::value) {
      if (residual == 0) {
        vq.push_back(row_roundtrip<V>(f16_round(x), vp));
        return;
      }
      if (vw.size() == sz(residual)) {
        vq.push_back(row_roundtrip<V>(vw.front(), vp));
        vw.erase(vw.begin());
      }
      vw.push_back(f16_round(x));
    } else {
      vq.push_back(row_roundtrip<V>(x, vp));
    }
  }

  void truncate(std::size_t n) {
    if (length() <= n) return;
    if (n < kq.size()) {
      if constexpr (is_tile_codec<K>) {
        std::size_t const q = n / K::group * K::group;
        kr.clear();
        for (std::size_t t = q; t < n; ++t) kr.push_back(f16_round(kq[t]));  // the cut group goes back to f16
        kq.resize(q);
      } else {
        kq.resize(n);
      }
    } else {
      kr.resize(n - kq.size());
    }
    if (n < vq.size()) {
      vq.resize(n);
      vw.clear();
    } else {
      vw.resize(n - vq.size());
    }
  }

  void shift_left(std::size_t n) {
    if (length() == 0) return;
    auto drop = [n](std::vector<row_t>& quantized, std::vector<row_t>& res) {
      if (n <= quantized.size()) {
        quantized.erase(quantized.begin(), quantized.begin() + static_cast<std::ptrdiff_t>(n));
      } else {
        std::size_t const r = n - quantized.size();
        quantized.clear();
        res.erase(res.begin(), res.begin() + static_cast<std::ptrdiff_t>(r));
      }
    };
    drop(kq, kr);
    drop(vq, vw);
  }

  auto key(std::size_t t) const -> row_t const& { return t < kq.size() ? kq[t] : kr[t - kq.size()]; }
  auto value(std::size_t t) const -> row_t const& { return t < vq.size() ? vq[t] : vw[t - vq.size()]; }
};

// ---------------------------------------------------------------------------------------------
// A cache and its model side by side

template <class Choice>
using cache_of = kvq::QuantizedKVCache<Choice>;
template <class Choice>
using options_of = typename cache_of<Choice>::options;

/// Options with residual R and, for fp8 codecs, non-default scales (so that the parameters are
/// seen to reach the codec).
template <class Choice>
auto make_options(int residual) -> options_of<Choice> {
  options_of<Choice> o;
  o.residual = residual;
  if constexpr (std::is_same_v<typename key_of<Choice>::params_type, kvq::fp8_params>) o.key.scale = 0.5f;
  if constexpr (std::is_same_v<typename value_of<Choice>::params_type, kvq::fp8_params>) o.value.scale = 0.125f;
  return o;
}

template <class Choice>
struct harness {
  kvq::cache_shape shape;
  options_of<Choice> opt;
  cache_of<Choice> cache;
  std::vector<std::vector<stream_model<Choice>>> model;  // [layer][head]

  harness(kvq::cache_shape const& s, options_of<Choice> const& o) : shape(s), opt(o), cache(s, o) {
    model.resize(sz(s.layers));
    for (auto& l : model) {
      l.resize(sz(s.kv_heads));
      for (auto& m : l) {
        m.dim = s.head_dim;
        m.residual = o.residual;
        m.kp = o.key;
        m.vp = o.value;
      }
    }
  }

  /// Appends tokens [first, first + count) of k and v to `layer`, in the cache and the model.
  template <class T>
  void append(int layer, kv_input<T> const& k, kv_input<T> const& v, std::int64_t first, std::int64_t count) {
    cache.append(layer, k.view(first, count), v.view(first, count));
    for (std::int64_t t = first; t < first + count; ++t)
      for (int h = 0; h < shape.kv_heads; ++h) model[sz(layer)][sz(h)].append(k.row(t, h), v.row(t, h));
  }

  /// Appends tokens [first, first + sum(chunks)) in the given chunks.
  template <class T>
  void append_chunks(int layer, kv_input<T> const& k, kv_input<T> const& v, std::int64_t first,
                     std::vector<std::int64_t> const& chunks) {
    for (auto c : chunks) {
      append(layer, k, v, first, c);
      first += c;
    }
  }

  void truncate(std::int64_t n) {
    cache.truncate(n);
    for (auto& l : model)
      for (auto& m : l) m.truncate(sz(n));
  }

  void shift_left(std::int64_t n) {
    cache.shift_left(n);
    for (auto& l : model)
      for (auto& m : l) m.shift_left(sz(n));
  }
};

/// Describes the first difference between a read-back and the expected rows, or "" when none.
template <class T>
auto compare_rows(std::vector<T> const& got, std::int64_t stride, std::int64_t count, int dim, auto const& expected_row,
                  T sentinel) -> std::string {
  for (std::int64_t i = 0; i < count; ++i) {
    row_t const& want = expected_row(i);
    for (int c = 0; c < dim; ++c) {
      T const g = got[sz(i * stride + c)];
      T const w = from_f32<T>(want[sz(c)]);
      if (elem_bits(g) != elem_bits(w)) {
        std::ostringstream s;
        s << "row " << i << " channel " << c << ": got bits 0x" << std::hex << elem_bits(g) << ", want 0x"
          << elem_bits(w) << " (" << std::dec << want[sz(c)] << ")";
        return s.str();
      }
    }
    for (std::int64_t c = dim; c < stride && i * stride + c < static_cast<std::int64_t>(got.size()); ++c)
      if (elem_bits(got[sz(i * stride + c)]) != elem_bits(sentinel))
        return "row " + std::to_string(i) + ": padding written";
  }
  return {};
}

/// Checks every counter of the storage views and every token read back (to T, rows `pad` apart
/// beyond head_dim) against the model.
template <class T, class Choice>
void check_against_model(harness<Choice> const& x, int pad = 3) {
  using K = key_of<Choice>;
  using V = value_of<Choice>;
  auto const& c = x.cache;
  int const d = x.shape.head_dim;
  std::int64_t const stride = d + pad;
  T const sentinel = from_f32<T>(-1234.5f);
  for (int l = 0; l < x.shape.layers; ++l) {
    for (int h = 0; h < x.shape.kv_heads; ++h) {
      auto const& m = x.model[sz(l)][sz(h)];
      auto const len = static_cast<std::int64_t>(m.length());
      INFO("layer " << l << " head " << h << " length " << len << " output " << type_name<T>());
      REQUIRE(c.size(l) == len);
      auto const ks = c.key_storage(l, h);
      auto const vs = c.value_storage(l, h);
      CHECK(ks.quantized_tokens == static_cast<std::int64_t>(m.kq.size()));
      CHECK(ks.residual_tokens == static_cast<std::int64_t>(m.kr.size()));
      CHECK(vs.quantized_tokens == static_cast<std::int64_t>(m.vq.size()));
      CHECK(vs.residual_tokens == static_cast<std::int64_t>(m.vw.size()));
      CHECK(ks.tokens_per_unit == group_of<K>());
      CHECK(vs.tokens_per_unit == 1);
      CHECK((ks.residual != nullptr) == is_tile_codec<K>);
      CHECK((vs.residual != nullptr) == is_kivi_value<V>::value);

      std::vector<T> out(sz(len * stride + 1), sentinel);
      c.read_keys(l, h, 0, len, out.data(), stride);
      std::string diff = compare_rows(
          out, stride, len, d, [&](std::int64_t i) -> row_t const& { return m.key(sz(i)); }, sentinel);
      INFO("keys: " << diff);
      CHECK(diff.empty());
      std::fill(out.begin(), out.end(), sentinel);
      c.read_values(l, h, 0, len, out.data(), stride);
      diff = compare_rows(
          out, stride, len, d, [&](std::int64_t i) -> row_t const& { return m.value(sz(i)); }, sentinel);
      INFO("values: " << diff);
      CHECK(diff.empty());

      // A sub-range, dense output (out_stride 0 = head_dim).
      if (len >= 4) {
        std::int64_t const first = len / 3, count = len / 2;
        std::vector<T> sub(sz(count * d), sentinel);
        c.read_keys(l, h, first, count, sub.data());
        diff = compare_rows(
            sub, d, count, d, [&](std::int64_t i) -> row_t const& { return m.key(sz(first + i)); }, sentinel);
        INFO("key sub-range: " << diff);
        CHECK(diff.empty());
        c.read_values(l, h, first, count, sub.data());
        diff = compare_rows(
            sub, d, count, d, [&](std::int64_t i) -> row_t const& { return m.value(sz(first + i)); }, sentinel);
        INFO("value sub-range: " << diff);
        CHECK(diff.empty());
      }
    }
  }
}

template <class Choice>
void check_all_outputs(harness<Choice> const& x) {
  check_against_model<float>(x, 3);
  check_against_model<f16>(x, 1);
  check_against_model<bf16>(x, 7);
}

// ---------------------------------------------------------------------------------------------
// Snapshots (strong guarantee, chunking invariance)

/// Everything observable about a cache: sizes, view counters, raw storage bytes and a full f32
/// read-back of every (layer, kv_head).
struct snapshot {
  std::vector<std::int64_t> counters;
  std::vector<std::uintptr_t> pointers;
  std::vector<std::byte> raw;
  std::vector<std::uint32_t> reads;
  friend bool operator==(snapshot const&, snapshot const&) = default;
};

template <class Cache>
auto raw_bytes(Cache const& c, kvq::storage_view const& v, bool keys) -> std::vector<std::byte> {
  auto const s = c.shape();
  using C = typename Cache::key_codec;
  std::int64_t units = s.capacity;
  if (keys && is_tile_codec<C>) units = s.capacity / v.tokens_per_unit;
  std::vector<std::byte> out(v.units, v.units + sz(units) * v.unit_bytes);
  if (v.residual != nullptr) {
    auto const* r = reinterpret_cast<std::byte const*>(v.residual);
    out.insert(out.end(), r, r + sz(v.residual_capacity) * sz(s.head_dim) * 2);
  }
  return out;
}

template <class Cache>
auto take_snapshot(Cache const& c) -> snapshot {
  snapshot s;
  auto const shape = c.shape();
  int const d = shape.head_dim;
  for (int l = 0; l < shape.layers; ++l) {
    std::int64_t const len = c.size(l);
    s.counters.push_back(len);
    for (int h = 0; h < shape.kv_heads; ++h) {
      for (bool keys : {true, false}) {
        auto const v = keys ? c.key_storage(l, h) : c.value_storage(l, h);
        s.counters.insert(s.counters.end(),
                          {v.quantized_tokens, v.residual_tokens, v.residual_capacity, v.residual_first,
                           static_cast<std::int64_t>(v.unit_bytes), v.tokens_per_unit});
        s.pointers.push_back(reinterpret_cast<std::uintptr_t>(v.units));
        s.pointers.push_back(reinterpret_cast<std::uintptr_t>(v.residual));
        auto const raw = raw_bytes(c, v, keys);
        s.raw.insert(s.raw.end(), raw.begin(), raw.end());
      }
      std::vector<float> out(sz(len * d));
      c.read_keys(l, h, 0, len, out.data());
      for (float f : out) s.reads.push_back(kvq_test::bits(f));
      c.read_values(l, h, 0, len, out.data());
      for (float f : out) s.reads.push_back(kvq_test::bits(f));
    }
  }
  return s;
}

/// Runs f, which must raise E with a message containing `needle`, and checks that the cache is
/// unchanged bit for bit.
template <class E, class Cache, class F>
void require_error_unchanged(Cache const& c, F&& f, std::string const& needle) {
  static_assert(std::is_base_of_v<kvq::error, E>);
  snapshot const before = take_snapshot(c);
  bool thrown = false;
  std::string what;
  try {
    f();
  } catch (E const& e) {
    thrown = true;
    what = e.what();
  }
  INFO("expected an error containing '" << needle << "'; got '" << what << "'");
  CHECK(thrown);
  CHECK(what.find(needle) != std::string::npos);
  CHECK(take_snapshot(c) == before);
}

/// Runs f, which must raise E with a message containing `needle` (no cache to compare).
template <class E, class F>
void require_error(F&& f, std::string const& needle) {
  bool thrown = false;
  std::string what;
  try {
    f();
  } catch (E const& e) {
    thrown = true;
    what = e.what();
  }
  INFO("expected an error containing '" << needle << "'; got '" << what << "'");
  CHECK(thrown);
  CHECK(what.find(needle) != std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// Choices

using q8k_q4v = kvq::kv_codecs<kvq::q8_0, kvq::q4_0>;
using int8k_kivi4v = kvq::kv_codecs<kvq::int8_sym, kvq::kivi_value<4>>;

using rot_q4_0 = kvq::rotated<kvq::q4_0>;
using rot_q8k_fp8v = kvq::kv_codecs<kvq::rotated<kvq::q8_0>, kvq::rotated<kvq::fp8_e4m3, 12345>>;
using tq4k_tq2v = kvq::kv_codecs<kvq::tq4, kvq::tq<2, 99>>;
using all_choices = std::tuple<kvq::f32_codec, kvq::f16_codec, kvq::q8_0, kvq::q4_0, kvq::int8_sym, kvq::fp8_e4m3,
                               kvq::fp8_e5m2, q8k_q4v, int8k_kivi4v, kvq::kivi<2>, kvq::kivi<4>, kvq::kivi<8>, rot_q4_0,
                               rot_q8k_fp8v, kvq::tq3, tq4k_tq2v>;
// Choices without KIVI keys (int8k_kivi4v: KIVI values, whose window shifts by any n).
using row_choices = std::tuple<kvq::f16_codec, kvq::q8_0, kvq::q4_0, kvq::int8_sym, kvq::fp8_e4m3, q8k_q4v,
                               int8k_kivi4v, rot_q4_0, rot_q8k_fp8v, kvq::tq3>;
using kivi_choices = std::tuple<kvq::kivi<2>, kvq::kivi<4>, kvq::kivi<8, 16>>;

/// The residual lengths to try for a choice (R only matters with a KIVI part).
template <class Choice>
auto residuals() -> std::vector<int> {
  if constexpr (!uses_residual<Choice>) {
    return {128};
  } else if constexpr (group_of<key_of<Choice>>() == 16) {
    return {0, 16, 48};
  } else {
    return {0, 32, 128};
  }
}

// ---------------------------------------------------------------------------------------------
// 1. Round trips

/// Chunks summing to 300: single tokens, a prefill larger than R, small odd sizes.
std::vector<std::int64_t> const mixed_chunks = {1, 2, 61, 1, 1, 130, 5, 99};

template <class Choice, class T>
void round_trip(int head_dim, input_layout layout, int residual, std::uint32_t seed) {
  INFO("head_dim " << head_dim << ", input " << type_name<T>() << " " << layout_name(layout) << ", R = " << residual);
  harness<Choice> x({2, 2, head_dim, 320}, make_options<Choice>(residual));
  kv_input<T> const k(300, 2, head_dim, layout, seed);
  kv_input<T> const v(300, 2, head_dim, layout, seed + 1000);
  x.append_chunks(0, k, v, 0, mixed_chunks);
  x.append(1, k, v, 0, 300);  // layer 1: one prefill
  check_all_outputs(x);

  // The baselines, checked against the input directly as well.
  if constexpr (std::is_same_v<Choice, kvq::f32_codec> || std::is_same_v<Choice, kvq::f16_codec>) {
    std::vector<float> out(sz(300 * head_dim));
    for (int l = 0; l < 2; ++l)
      for (int h = 0; h < 2; ++h) {
        x.cache.read_keys(l, h, 0, 300, out.data());
        std::int64_t bad = 0;
        for (std::int64_t t = 0; t < 300; ++t)
          for (int c = 0; c < head_dim; ++c) {
            float const in = kvq::to_f32(k.at(t, h, c));
            float const want = std::is_same_v<Choice, kvq::f32_codec> ? in : f16_round(in);
            bad += kvq_test::bits(out[sz(t * head_dim + c)]) != kvq_test::bits(want);
          }
        CHECK(bad == 0);
      }
  }
}

TEMPLATE_LIST_TEST_CASE("cache: read-back equals each codec's own encode/decode", "[cache][roundtrip]", all_choices) {
  using Choice = TestType;
  constexpr int dims_f32[] = {1, 80, 256};
  constexpr int dims_f16[] = {8, 96, 192};
  constexpr int dims_bf16[] = {64, 112, 128};
  constexpr input_layout layouts[] = {input_layout::padded, input_layout::head_major, input_layout::dense};
  std::uint32_t seed = 11;
  for (int r : residuals<Choice>()) {
    for (int i = 0; i < 3; ++i) {
      round_trip<Choice, float>(dims_f32[i], layouts[i], r, seed++);
      round_trip<Choice, f16>(dims_f16[i], layouts[(i + 1) % 3], r, seed++);
      round_trip<Choice, bf16>(dims_bf16[i], layouts[(i + 2) % 3], r, seed++);
    }
  }
}

using many_heads_choices = std::tuple<kvq::q8_0, rot_q4_0, int8k_kivi4v>;

TEMPLATE_LIST_TEST_CASE("cache: appends to more kv_heads than one kernel call encodes", "[cache][roundtrip]",
                        many_heads_choices) {
  // The CPU write path encodes a token's kv_heads 32 at a time: 70 heads take three calls, with the
  // input used as it is (f32, dense and head-major) or gathered first (f16, the rotation).
  using Choice = TestType;
  harness<Choice> x({2, 70, 32, 64}, make_options<Choice>(32));
  kv_input<float> const k(40, 70, 32, input_layout::dense, 5);
  kv_input<float> const v(40, 70, 32, input_layout::head_major, 6);
  x.append_chunks(0, k, v, 0, {1, 23, 16});
  kv_input<f16> const k16(40, 70, 32, input_layout::padded, 7);
  kv_input<f16> const v16(40, 70, 32, input_layout::dense, 8);
  x.append(1, k16, v16, 0, 40);
  check_all_outputs(x);
}

TEST_CASE("cache: fp8 overflow mode and scales reach the codec", "[cache][roundtrip]") {
  using Choice = kvq::fp8_e4m3;
  options_of<Choice> o;
  o.key = {2.0f, kvq::fp8_overflow::no_saturate};
  o.value = {0.01f, kvq::fp8_overflow::saturate};
  harness<Choice> x({1, 2, 32, 40}, o);
  kv_input<float> k(40, 2, 32, input_layout::dense, 5);
  kv_input<float> v(40, 2, 32, input_layout::dense, 6);
  k.at(3, 1, 7) = 5000.0f;  // beyond 448 * 2: NaN without saturation
  v.at(3, 1, 7) = 5000.0f;  // saturates to 448 * 0.01
  x.append(0, k, v, 0, 40);
  check_all_outputs(x);
  std::vector<float> row(32);
  x.cache.read_keys(0, 1, 3, 1, row.data());
  CHECK(std::isnan(row[7]));
  x.cache.read_values(0, 1, 3, 1, row.data());
  CHECK(kvq_test::bits(row[7]) == kvq_test::bits(448.0f * 0.01f));
}

// ---------------------------------------------------------------------------------------------
// 2. KIVI residual semantics and the documented storage layout

/// Checks the KIVI counters of every (layer, head) against the formulas of FORMATS.md §4.3.
template <class Choice>
void check_kivi_counters(cache_of<Choice> const& c, int layer, std::int64_t len, int residual) {
  std::int64_t const g = key_of<Choice>::group;
  std::int64_t const f = residual > 0 ? residual : g;
  std::int64_t const r = residual;
  INFO("layer " << layer << ", L = " << len << ", R = " << r << ", G = " << g);
  REQUIRE(c.size(layer) == len);
  for (int h = 0; h < c.shape().kv_heads; ++h) {
    auto const ks = c.key_storage(layer, h);
    auto const vs = c.value_storage(layer, h);
    CHECK(ks.quantized_tokens == len / f * f);
    CHECK(ks.residual_tokens == len % f);
    CHECK(ks.residual_capacity == f);
    CHECK(vs.quantized_tokens == std::max<std::int64_t>(0, len - r));
    CHECK(vs.residual_tokens == std::min(len, r));
    CHECK(vs.residual_capacity == r);
    CHECK(vs.residual_first == (r > 0 ? std::max<std::int64_t>(0, len - r) % r : 0));
  }
}

TEMPLATE_LIST_TEST_CASE("cache: KIVI residual counters and chunking invariance", "[cache][kivi]", kivi_choices) {
  using Choice = TestType;
  int const d = 64;
  std::int64_t const total = 300;
  kv_input<float> const k(total, 2, d, input_layout::padded, 21);
  kv_input<float> const v(total, 2, d, input_layout::padded, 22);
  std::vector<std::vector<std::int64_t>> const chunkings = {
      std::vector<std::int64_t>(sz(total), 1),  // decode only
      {250, 1, 1, 1, 1, 1, 45},                 // a big prefill, then decode
      mixed_chunks,                             // mixed
      {total},                                  // one prefill
  };
  for (int r : residuals<Choice>()) {
    std::vector<snapshot> results;
    for (std::size_t i = 0; i < chunkings.size(); ++i) {
      INFO("chunking " << i);
      cache_of<Choice> c({1, 2, d, total}, make_options<Choice>(r));
      check_kivi_counters<Choice>(c, 0, 0, r);
      std::int64_t len = 0;
      for (auto n : chunkings[i]) {
        c.append(0, k.view(len, n), v.view(len, n));
        len += n;
        check_kivi_counters<Choice>(c, 0, len, r);
      }
      results.push_back(take_snapshot(c));
    }
    for (std::size_t i = 1; i < results.size(); ++i) {
      INFO("R = " << r << ", chunking " << i << " vs 0");
      CHECK(results[i].reads == results[0].reads);
      CHECK(results[i].raw == results[0].raw);
      CHECK(results[i].counters == results[0].counters);
    }
  }
}

/// Checks the bytes reachable through the storage views against the documented layout: row t (or
/// tile t / G) holds the codec's own encoding, residual rows hold the f16 bits of the tokens.
template <class Choice>
void check_storage_layout(int residual, int d, std::int64_t len) {
  using K = key_of<Choice>;
  using V = value_of<Choice>;
  INFO("R = " << residual << ", head_dim " << d << ", L = " << len);
  auto const o = make_options<Choice>(residual);
  cache_of<Choice> c({2, 3, d, 256}, o);
  kv_input<bf16> const k(len, 3, d, input_layout::head_major, 31);
  kv_input<bf16> const v(len, 3, d, input_layout::padded, 32);
  c.append(1, k.view(0, len / 2), v.view(0, len / 2));
  c.append(1, k.view(len / 2, len - len / 2), v.view(len / 2, len - len / 2));
  auto bytes_equal = [](std::byte const* p, std::vector<std::uint8_t> const& want) {
    return std::memcmp(p, want.data(), want.size()) == 0;
  };
  auto f16_row_equal = [d](f16 const* p, row_t const& x) {
    for (int i = 0; i < d; ++i)
      if (p[i].bits != kvq::to_f16(x[sz(i)]).bits) return false;
    return true;
  };
  for (int h = 0; h < 3; ++h) {
    INFO("head " << h);
    auto const ks = c.key_storage(1, h);
    auto const vs = c.value_storage(1, h);
    CHECK(ks.unit_bytes == K::geometry(d).bytes());
    CHECK(vs.unit_bytes == V::geometry(d).bytes());
    if constexpr (is_tile_codec<K>) {
      std::int64_t const g = K::group;
      std::vector<float> tile(sz(g * d));
      std::vector<std::uint8_t> want(K::geometry(d).bytes());
      for (std::int64_t i = 0; i < ks.quantized_tokens / g; ++i) {
        for (std::int64_t t = 0; t < g; ++t) {
          row_t const x = f16_round(k.row(i * g + t, h));
          std::copy(x.begin(), x.end(), tile.begin() + t * d);
        }
        K::encode_tile(tile.data(), d, d, want.data(), o.key);
        CHECK(bytes_equal(ks.units + sz(i) * ks.unit_bytes, want));
      }
      for (std::int64_t j = 0; j < ks.residual_tokens; ++j)
        CHECK(f16_row_equal(ks.residual + j * d, k.row(ks.quantized_tokens + j, h)));
    } else {
      std::vector<std::uint8_t> want(K::geometry(d).bytes());
      for (std::int64_t t = 0; t < ks.quantized_tokens; ++t) {
        K::encode_row(k.row(t, h).data(), d, want.data(), o.key);
        CHECK(bytes_equal(ks.units + sz(t) * ks.unit_bytes, want));
      }
    }
    std::vector<std::uint8_t> want(V::geometry(d).bytes());
    for (std::int64_t t = 0; t < vs.quantized_tokens; ++t) {
      row_t x = v.row(t, h);
      if constexpr (is_kivi_value<V>::value) x = f16_round(x);
      V::encode_row(x.data(), d, want.data(), o.value);
      CHECK(bytes_equal(vs.units + sz(t) * vs.unit_bytes, want));
    }
    for (std::int64_t i = 0; i < vs.residual_tokens; ++i) {
      std::int64_t const slot = (vs.residual_first + i) % vs.residual_capacity;
      CHECK(f16_row_equal(vs.residual + slot * d, v.row(vs.quantized_tokens + i, h)));
    }
  }
}

TEST_CASE("cache: KIVI keys and values with different group sizes", "[cache][kivi]") {
  // Keys in tiles of 16 tokens, values in groups of 24 channels: R must be a multiple of both.
  using Choice = kvq::kv_codecs<kvq::kivi_key<4, 16>, kvq::kivi_value<2, 24>>;
  for (int bad : {8, 24, 40}) {
    INFO("R = " << bad);
    require_error<kvq::invalid_argument_error>(
        [&] {
          cache_of<Choice> c({1, 1, 48, 256}, make_options<Choice>(bad));
        },
        "R = " + std::to_string(bad) + " must be a non-negative multiple of G = 48");
  }
  for (int r : {0, 48, 96}) {
    INFO("R = " << r);
    harness<Choice> x({1, 2, 48, 256}, make_options<Choice>(r));
    kv_input<float> const k(250, 2, 48, input_layout::padded, 111);
    kv_input<float> const v(250, 2, 48, input_layout::padded, 112);
    x.append_chunks(0, k, v, 0, {1, 100, 3, 1, 1, 144});
    check_against_model<float>(x);
    std::int64_t const f = r > 0 ? r : 16;
    CHECK(x.cache.key_storage(0, 1).quantized_tokens == 250 / f * f);
    CHECK(x.cache.value_storage(0, 1).quantized_tokens == 250 - r);
  }
}

TEST_CASE("cache: storage views expose the documented layout", "[cache][layout]") {
  check_storage_layout<kvq::kivi<4>>(64, 64, 200);
  check_storage_layout<kvq::kivi<4>>(128, 80, 200);  // window wrapped around (first != 0)
  check_storage_layout<kvq::kivi<2>>(0, 96, 101);
  check_storage_layout<kvq::kivi<8, 16>>(48, 8, 250);
  check_storage_layout<int8k_kivi4v>(32, 128, 77);
  check_storage_layout<kvq::q4_0>(128, 80, 50);
  check_storage_layout<kvq::int8_sym>(128, 64, 50);
  check_storage_layout<kvq::fp8_e5m2>(128, 8, 50);
  check_storage_layout<q8k_q4v>(128, 112, 50);
}

/// Appends the same values as f16 and as their f32 widening, in the same chunks, and checks that
/// every stored byte agrees: f16 rows (the f16 cache's, KIVI's residual and value window) take f16
/// input by a direct copy, which must store what widening and narrowing would, NaN payloads
/// (signalling ones quieted) and the f16 extremes included.
template <class Choice>
void check_f16_input_as_f32(int residual, int d, input_layout layout) {
  INFO("R = " << residual << ", head_dim " << d << ", layout " << static_cast<int>(layout));
  constexpr std::int64_t len = 150;
  constexpr std::uint16_t specials[] = {0x7c01, 0xfd55, 0x7fff, 0x7e00, 0x7c00, 0xfc00,
                                        0x7bff, 0xfbff, 0x0001, 0x83ff, 0x8000, 0x0400};
  auto make = [&](std::uint32_t seed) {
    kv_input<f16> x(len, 3, d, layout, seed);
    for (std::int64_t t = 0; t < len; t += 7)  // a few tokens, channels and heads each
      x.at(t, static_cast<int>(t % 3), static_cast<int>(t * 5 % d)).bits = specials[sz(t / 7) % std::size(specials)];
    return x;
  };
  auto widen = [](kv_input<f16> const& x) {
    kv_input<float> y(1, 1, 1, input_layout::dense, 0);
    y.tokens = x.tokens;
    y.heads = x.heads;
    y.dim = x.dim;
    y.ts = x.ts;
    y.hs = x.hs;
    y.data.resize(x.data.size());
    for (std::size_t i = 0; i < x.data.size(); ++i) y.data[i] = kvq::detail::f16_bits_to_f32(x.data[i].bits);
    return y;
  };
  kv_input<f16> const k16 = make(41), v16 = make(42);
  kv_input<float> const k32 = widen(k16), v32 = widen(v16);
  auto const o = make_options<Choice>(residual);
  cache_of<Choice> a({1, 3, d, 256}, o), b({1, 3, d, 256}, o);
  for (auto [first, n] : {std::pair{0, 5}, {5, 1}, {6, 70}, {76, 74}}) {
    a.append(0, k16.view(first, n), v16.view(first, n));
    b.append(0, k32.view(first, n), v32.view(first, n));
  }
  auto same = [d](auto const& x, auto const& y) {
    REQUIRE(x.quantized_tokens == y.quantized_tokens);
    REQUIRE(x.residual_tokens == y.residual_tokens);
    bool ok = std::memcmp(x.units, y.units, sz(x.quantized_tokens / x.tokens_per_unit) * x.unit_bytes) == 0;
    if (x.residual != nullptr)  // every row of the ring
      ok = ok && std::memcmp(x.residual, y.residual, sz(x.residual_capacity * d) * sizeof(f16)) == 0;
    return ok;
  };
  for (int h = 0; h < 3; ++h) {
    INFO("head " << h);
    CHECK(same(a.key_storage(0, h), b.key_storage(0, h)));
    CHECK(same(a.value_storage(0, h), b.value_storage(0, h)));
  }
}

TEST_CASE("cache: f16 input is stored as its f32 widening would be", "[cache][f16]") {
  for (auto layout : {input_layout::dense, input_layout::padded, input_layout::head_major}) {
    check_f16_input_as_f32<kvq::f16_codec>(128, 64, layout);
    check_f16_input_as_f32<kvq::kv_codecs<kvq::f16_codec, kvq::q4_0>>(128, 96, layout);
    check_f16_input_as_f32<kvq::kivi<4>>(64, 64, layout);
    check_f16_input_as_f32<kvq::kivi<2>>(0, 32, layout);
    check_f16_input_as_f32<int8k_kivi4v>(32, 40, layout);
  }
}

// ---------------------------------------------------------------------------------------------
// 3. truncate

TEMPLATE_LIST_TEST_CASE("cache: truncate of row codecs equals a fresh cache", "[cache][truncate]", row_choices) {
  using Choice = TestType;
  int const d = 96;
  kv_input<f16> const k(200, 2, d, input_layout::padded, 41);
  kv_input<f16> const v(200, 2, d, input_layout::padded, 42);
  harness<Choice> a({2, 2, d, 200}, make_options<Choice>(128));
  a.append_chunks(0, k, v, 0, {37, 1, 62});  // layer 0: 100 tokens
  a.append(1, k, v, 0, 40);                  // layer 1: 40 tokens
  std::vector<float> layer1_keys(sz(40 * d)), after(sz(40 * d));
  a.cache.read_keys(1, 1, 0, 40, layer1_keys.data());

  a.truncate(60);
  CHECK(a.cache.size(0) == 60);
  CHECK(a.cache.size(1) == 40);
  a.cache.read_keys(1, 1, 0, 40, after.data());
  CHECK(std::memcmp(after.data(), layer1_keys.data(), after.size() * 4) == 0);
  a.append(0, k, v, 120, 70);  // re-append other tokens
  check_all_outputs(a);

  harness<Choice> b({2, 2, d, 200}, make_options<Choice>(128));
  b.append(0, k, v, 0, 60);
  b.append(0, k, v, 120, 70);
  b.append(1, k, v, 0, 40);
  CHECK(take_snapshot(a.cache).reads == take_snapshot(b.cache).reads);

  // Truncating at or beyond the length changes nothing; a negative n is refused.
  snapshot const before = take_snapshot(a.cache);
  a.truncate(130);
  a.truncate(1000);
  CHECK(take_snapshot(a.cache) == before);
  require_error_unchanged<kvq::invalid_argument_error>(
      a.cache, [&] { a.cache.truncate(-1); }, "n = -1");

  // Truncate to zero, then start again.
  a.truncate(0);
  CHECK(a.cache.size(0) == 0);
  CHECK(a.cache.size(1) == 0);
  a.append(1, k, v, 5, 30);
  check_against_model<float>(a);
}

/// Reads keys [0, len) of (layer, head) to T.
template <class T, class Cache>
auto read_keys_as(Cache const& c, int layer, int head, std::int64_t len) -> std::vector<T> {
  std::vector<T> out(sz(len * c.shape().head_dim));
  c.read_keys(layer, head, 0, len, out.data());
  return out;
}

template <class T, class Cache>
auto read_values_as(Cache const& c, int layer, int head, std::int64_t len) -> std::vector<T> {
  std::vector<T> out(sz(len * c.shape().head_dim));
  c.read_values(layer, head, 0, len, out.data());
  return out;
}

TEMPLATE_LIST_TEST_CASE("cache: truncate into a quantized KIVI key group", "[cache][truncate][kivi]", kivi_choices) {
  using Choice = TestType;
  std::int64_t const g = key_of<Choice>::group;
  int const d = 80;
  kv_input<float> const k(600, 2, d, input_layout::dense, 51);
  kv_input<float> const v(600, 2, d, input_layout::dense, 52);
  for (int r : residuals<Choice>()) {
    INFO("R = " << r << ", G = " << g);
    std::int64_t const f = r > 0 ? r : g;
    harness<Choice> x({2, 2, d, 512}, make_options<Choice>(r));
    x.append_chunks(0, k, v, 0, mixed_chunks);  // 300 tokens
    x.append(1, k, v, 0, 10);
    std::int64_t const kq = 300 / f * f;
    // Cut into the middle of the last quantized group but one.
    std::int64_t const n = kq - g - g / 2 - 1;
    REQUIRE(n > 0);
    REQUIRE(n % g != 0);
    std::int64_t const q = n / g * g;

    std::vector<std::vector<float>> keys32, values32;
    std::vector<std::vector<f16>> keys16;
    for (int h = 0; h < 2; ++h) {
      keys32.push_back(read_keys_as<float>(x.cache, 0, h, 300));
      keys16.push_back(read_keys_as<f16>(x.cache, 0, h, 300));
      values32.push_back(read_values_as<float>(x.cache, 0, h, 300));
    }
    std::int64_t const vq_before = x.cache.value_storage(0, 0).quantized_tokens;

    x.truncate(n);
    CHECK(x.cache.size(0) == n);
    CHECK(x.cache.size(1) == 10);
    for (int h = 0; h < 2; ++h) {
      auto const ks = x.cache.key_storage(0, h);
      auto const vs = x.cache.value_storage(0, h);
      CHECK(ks.quantized_tokens == q);
      CHECK(ks.residual_tokens == n - q);
      CHECK(vs.quantized_tokens == std::min(vq_before, n));
      CHECK(vs.residual_tokens == n - std::min(vq_before, n));

      auto const k32 = read_keys_as<float>(x.cache, 0, h, n);
      auto const k16 = read_keys_as<f16>(x.cache, 0, h, n);
      auto const v32 = read_values_as<float>(x.cache, 0, h, n);
      std::int64_t same_quantized = 0, cut_f16 = 0, cut_f32 = 0, values_same = 0;
      for (std::int64_t i = 0; i < n * d; ++i) {
        auto const u = sz(i);
        if (i < q * d) {
          same_quantized += kvq_test::bits(k32[u]) == kvq_test::bits(keys32[sz(h)][u]);
        } else {
          // The cut group went back to the f16 residual: its tokens read as before to f16, and
          // as the f16 rounding of the previously read value to f32 (the documented loss).
          cut_f16 += k16[u].bits == keys16[sz(h)][u].bits;
          cut_f32 += kvq_test::bits(k32[u]) == kvq_test::bits(f16_round(keys32[sz(h)][u]));
        }
        values_same += kvq_test::bits(v32[u]) == kvq_test::bits(values32[sz(h)][u]);
      }
      CHECK(same_quantized == q * d);
      CHECK(cut_f16 == (n - q) * d);
      CHECK(cut_f32 == (n - q) * d);
      CHECK(values_same == n * d);
    }
    check_against_model<float>(x);

    // Appends continue from the truncated state (the cut tokens flush with the new ones).
    x.append_chunks(0, k, v, 300, {1, 2, 3, 100, 1, 90});
    check_all_outputs(x);

    // A cut at a multiple of G (inside the quantized part) keeps whole tiles only.
    std::int64_t const m = std::min<std::int64_t>(x.cache.key_storage(0, 0).quantized_tokens, 200) / g * g - g;
    REQUIRE(m > 0);
    x.truncate(m);
    CHECK(x.cache.key_storage(0, 1).quantized_tokens == m);
    CHECK(x.cache.key_storage(0, 1).residual_tokens == 0);
    x.append(0, k, v, 400, 150);
    check_against_model<float>(x);

    // Cutting into the value window only (n above the quantized values) and to zero.
    std::int64_t const len = x.cache.size(0);
    std::int64_t const vq = x.cache.value_storage(0, 0).quantized_tokens;
    if (r > 0 && len > vq + 1) {
      x.truncate(len - 1);
      CHECK(x.cache.value_storage(0, 0).quantized_tokens == vq);
      check_against_model<float>(x);
    }
    x.truncate(0);
    x.append_chunks(0, k, v, 7, {40, 1, 100});
    check_against_model<f16>(x);
  }
}

// ---------------------------------------------------------------------------------------------
// 4. shift_left

TEMPLATE_LIST_TEST_CASE("cache: shift_left of row codecs", "[cache][shift]", row_choices) {
  using Choice = TestType;
  int const d = 64;
  kv_input<float> const k(300, 2, d, input_layout::head_major, 61);
  kv_input<float> const v(300, 2, d, input_layout::head_major, 62);
  harness<Choice> x({3, 2, d, 160}, make_options<Choice>(128));
  x.append_chunks(0, k, v, 0, {1, 99});  // 100 tokens
  x.append(1, k, v, 0, 50);              // 50 tokens; layer 2 stays empty
  auto const old0 = read_keys_as<float>(x.cache, 0, 1, 100);
  auto const old1 = read_values_as<float>(x.cache, 1, 0, 50);

  x.shift_left(30);
  CHECK(x.cache.size(0) == 70);
  CHECK(x.cache.size(1) == 20);
  CHECK(x.cache.size(2) == 0);
  auto const new0 = read_keys_as<float>(x.cache, 0, 1, 70);
  auto const new1 = read_values_as<float>(x.cache, 1, 0, 20);
  CHECK(std::equal(new0.begin(), new0.end(), old0.begin() + 30 * d,
                   [](float a, float b) { return kvq_test::bits(a) == kvq_test::bits(b); }));
  CHECK(std::equal(new1.begin(), new1.end(), old1.begin() + 30 * d,
                   [](float a, float b) { return kvq_test::bits(a) == kvq_test::bits(b); }));
  check_against_model<float>(x);

  // Appending continues after the shifted tokens.
  x.append(0, k, v, 100, 90);
  x.append(2, k, v, 0, 10);
  check_all_outputs(x);

  // Too far for a non-empty layer: index_error, nothing changes (layer 2 holds 10).
  require_error_unchanged<kvq::index_error>(
      x.cache, [&] { x.cache.shift_left(21); }, "layer 1 holds 20 tokens");
  require_error_unchanged<kvq::invalid_argument_error>(
      x.cache, [&] { x.cache.shift_left(-3); }, "n = -3");
  snapshot const before = take_snapshot(x.cache);
  x.cache.shift_left(0);
  CHECK(take_snapshot(x.cache) == before);

  // Shift a whole layer out.
  x.shift_left(10);
  CHECK(x.cache.size(2) == 0);
  x.shift_left(10);  // empty layers are skipped
  CHECK(x.cache.size(1) == 0);
  x.append(1, k, v, 200, 60);
  check_against_model<float>(x);
}

TEMPLATE_LIST_TEST_CASE("cache: shift_left of KIVI by multiples of G", "[cache][shift][kivi]", kivi_choices) {
  using Choice = TestType;
  std::int64_t const g = key_of<Choice>::group;
  int const d = 64;
  kv_input<f16> const k(800, 2, d, input_layout::dense, 71);
  kv_input<f16> const v(800, 2, d, input_layout::dense, 72);
  for (int r : residuals<Choice>()) {
    INFO("R = " << r << ", G = " << g);
    harness<Choice> x({2, 2, d, 512}, make_options<Choice>(r));
    x.append_chunks(0, k, v, 0, mixed_chunks);  // 300 tokens
    x.append(1, k, v, 0, 4 * g);

    // Not a multiple of G: unsupported, nothing changes.
    require_error_unchanged<kvq::unsupported_error>(
        x.cache, [&] { x.cache.shift_left(g + 1); },
        "multiples of G = " + std::to_string(g) + ", not " + std::to_string(g + 1));
    // More than layer 1 holds: index_error.
    require_error_unchanged<kvq::index_error>(
        x.cache, [&] { x.cache.shift_left(5 * g); },
        "layer 1 holds " + std::to_string(4 * g) + " tokens, cannot drop " + std::to_string(5 * g));

    std::vector<std::vector<std::uint32_t>> before;
    for (int h = 0; h < 2; ++h) {
      auto const keys = read_keys_as<float>(x.cache, 0, h, 300);
      auto const values = read_values_as<float>(x.cache, 0, h, 300);
      std::vector<std::uint32_t> b;
      for (float f : keys) b.push_back(kvq_test::bits(f));
      for (float f : values) b.push_back(kvq_test::bits(f));
      before.push_back(b);
    }
    x.shift_left(2 * g);
    std::int64_t const len = 300 - 2 * g;
    CHECK(x.cache.size(0) == len);
    CHECK(x.cache.size(1) == 2 * g);
    for (int h = 0; h < 2; ++h) {
      auto const keys = read_keys_as<float>(x.cache, 0, h, len);
      auto const values = read_values_as<float>(x.cache, 0, h, len);
      std::int64_t same = 0;
      for (std::int64_t i = 0; i < len * d; ++i) {
        same += kvq_test::bits(keys[sz(i)]) == before[sz(h)][sz(i + 2 * g * d)];
        same += kvq_test::bits(values[sz(i)]) == before[sz(h)][sz(300 * d + i + 2 * g * d)];
      }
      CHECK(same == 2 * len * d);
    }
    check_against_model<float>(x);

    // Appends continue; then a shift beyond the quantized keys and values (into the residuals).
    x.append_chunks(0, k, v, 300, {1, 100, 1, 1, 97});
    check_against_model<float>(x);
    // deep > the quantized keys where R > G (with R = 0 only whole residual-free prefixes exist).
    std::int64_t const kq = x.cache.key_storage(0, 0).quantized_tokens;
    std::int64_t const deep = std::min((kq / g + 1) * g, x.cache.size(0) / g * g);
    if (x.cache.size(1) < deep) x.append(1, k, v, 0, deep - x.cache.size(1));
    if (r > g) CHECK(deep > kq);
    x.shift_left(deep);
    check_against_model<float>(x);
    x.append_chunks(0, k, v, 500, {3, 150, 1});
    x.append(1, k, v, 600, 3 * g);
    check_all_outputs(x);
  }
}

// ---------------------------------------------------------------------------------------------
// 5. reset

TEMPLATE_LIST_TEST_CASE("cache: reset empties every layer and appends work again", "[cache][reset]", all_choices) {
  using Choice = TestType;
  int const d = 40;
  kv_input<float> const k(200, 2, d, input_layout::padded, 81);
  kv_input<float> const v(200, 2, d, input_layout::padded, 82);
  auto const o = make_options<Choice>(uses_residual<Choice> ? 32 : 128);
  harness<Choice> x({2, 2, d, 100}, o);
  x.append(0, k, v, 0, 100);
  x.append(1, k, v, 0, 75);
  x.cache.reset();
  for (int l = 0; l < 2; ++l) {
    CHECK(x.cache.size(l) == 0);
    for (int h = 0; h < 2; ++h) {
      CHECK(x.cache.key_storage(l, h).quantized_tokens == 0);
      CHECK(x.cache.key_storage(l, h).residual_tokens == 0);
      CHECK(x.cache.value_storage(l, h).quantized_tokens == 0);
      CHECK(x.cache.value_storage(l, h).residual_tokens == 0);
      CHECK(x.cache.value_storage(l, h).residual_first == 0);
    }
  }
  // Refill to capacity with other tokens: equal to a fresh cache fed the same.
  harness<Choice> fresh({2, 2, d, 100}, o);
  for (auto* y : {&x, &fresh}) {
    y->append_chunks(0, k, v, 100, {1, 50, 49});
    y->append(1, k, v, 90, 3);
  }
  CHECK(take_snapshot(x.cache).reads == take_snapshot(fresh.cache).reads);
  x.model = fresh.model;
  check_against_model<float>(x);
}

// ---------------------------------------------------------------------------------------------
// 6. Memory accounting

/// Bytes of one encoded unit (row, or tile of G tokens for KIVI keys), from FORMATS.md / DESIGN §2.
template <class Codec>
auto documented_unit_bytes(int d) -> std::size_t {
  using C = kvq::stored_codec_t<Codec>;  // a rotated codec stores its inner codec's bytes
  auto const ud = sz(d);
  auto const blocks32 = (ud + 31) / 32;
  if constexpr (std::is_same_v<C, kvq::f32_codec>) {
    return 4 * ud;
  } else if constexpr (std::is_same_v<C, kvq::f16_codec>) {
    return 2 * ud;
  } else if constexpr (std::is_same_v<C, kvq::q8_0>) {
    return 34 * blocks32;  // fp16 scale + 32 int8
  } else if constexpr (std::is_same_v<C, kvq::q4_0>) {
    return 18 * blocks32;  // fp16 scale + 16 bytes of nibbles
  } else if constexpr (std::is_same_v<C, kvq::int8_sym>) {
    return 4 + ud;  // fp32 scale + head_dim int8
  } else if constexpr (std::is_same_v<C, kvq::fp8_e4m3> || std::is_same_v<C, kvq::fp8_e5m2>) {
    return ud;
  } else if constexpr (requires { C::scale(nullptr, 0); }) {  // tq: f16 per rotation block (popcount d), codes
    return 2 * sz(std::popcount(static_cast<unsigned>(d))) + (ud * sz(C::bits) + 7) / 8;
  } else if constexpr (is_kivi_value<C>::value) {
    std::size_t const gv = std::min<std::size_t>(sz(C::group), ud);
    return (ud + gv - 1) / gv * (4 + (gv * C::bits + 7) / 8);  // per group: fp16 scale, fp16 min, codes
  } else {
    static_assert(is_tile_codec<C>);
    return ud * (4 + sz(C::group) * C::bits / 8);  // per channel: fp16 scale, fp16 min, G codes
  }
}

auto align64(std::size_t n) -> std::size_t { return (n + 63) / 64 * 64; }

template <class Choice>
auto documented_memory(kvq::cache_shape const& s, int residual) -> kvq::memory_report {
  using K = key_of<Choice>;
  using V = value_of<Choice>;
  std::size_t const d = sz(s.head_dim);
  std::size_t const key_units = sz(s.capacity / group_of<K>());
  std::size_t const key_raw = key_units * documented_unit_bytes<K>(s.head_dim);
  std::size_t const key_res_rows = is_tile_codec<K> ? sz(residual > 0 ? residual : group_of<K>()) : 0;
  std::size_t const value_raw = sz(s.capacity) * documented_unit_bytes<V>(s.head_dim);
  std::size_t const value_res_rows = is_kivi_value<V>::value ? sz(residual) : 0;
  std::size_t const per_head =
      align64(key_raw) + align64(key_res_rows * d * 2) + align64(value_raw) + align64(value_res_rows * d * 2);
  std::size_t const lh = sz(s.layers) * sz(s.kv_heads);
  kvq::memory_report m;
  m.total_bytes = lh * per_head;
  m.key_bytes = lh * key_raw;
  m.value_bytes = lh * value_raw;
  m.residual_bytes = lh * (key_res_rows + value_res_rows) * d * 2;
  m.alignment_bytes = m.total_bytes - m.key_bytes - m.value_bytes - m.residual_bytes;
  m.bytes_per_token = static_cast<double>(m.total_bytes) / static_cast<double>(s.capacity);
  m.bits_per_element =
      static_cast<double>(m.total_bytes) * 8.0 / (static_cast<double>(s.capacity) * static_cast<double>(lh * d) * 2.0);
  return m;
}

void check_report(kvq::memory_report const& got, kvq::memory_report const& want) {
  CHECK(got.total_bytes == want.total_bytes);
  CHECK(got.key_bytes == want.key_bytes);
  CHECK(got.value_bytes == want.value_bytes);
  CHECK(got.residual_bytes == want.residual_bytes);
  CHECK(got.alignment_bytes == want.alignment_bytes);
  CHECK(got.bytes_per_token == want.bytes_per_token);
  CHECK(got.bits_per_element == want.bits_per_element);
}

TEMPLATE_LIST_TEST_CASE("cache: memory accounting follows the documented layout", "[cache][memory]", all_choices) {
  using Choice = TestType;
  struct cfg {
    kvq::cache_shape shape;
    int residual;
  };
  std::vector<cfg> const configs = {
      {{1, 1, 1, 1}, 0},    {{2, 3, 8, 100}, 32}, {{4, 8, 80, 333}, 128},  {{1, 2, 128, 4096}, 128},
      {{3, 1, 256, 64}, 0}, {{2, 2, 96, 31}, 32}, {{1, 4, 112, 1000}, 64}, {{2, 1, 192, 257}, 0},
  };
  for (auto const& c : configs) {
    INFO("layers " << c.shape.layers << ", kv_heads " << c.shape.kv_heads << ", head_dim " << c.shape.head_dim
                   << ", capacity " << c.shape.capacity << ", R = " << c.residual);
    auto const want = documented_memory<Choice>(c.shape, c.residual);
    auto const planned = kvq::plan_memory<Choice>(c.shape, c.residual);
    check_report(planned, want);
    cache_of<Choice> const cache(c.shape, make_options<Choice>(c.residual));
    check_report(cache.memory(), want);

    // The regions sit where the layout says: per layer, the key regions of every head, then the
    // value regions; residuals right after their (aligned) units.
    using K = key_of<Choice>;
    using V = value_of<Choice>;
    std::size_t const d = sz(c.shape.head_dim);
    std::size_t const key_units = sz(c.shape.capacity / group_of<K>());
    std::size_t const key_units_bytes = align64(key_units * documented_unit_bytes<K>(c.shape.head_dim));
    std::size_t const key_region =
        key_units_bytes + align64((is_tile_codec<K> ? sz(c.residual > 0 ? c.residual : group_of<K>()) : 0) * d * 2);
    std::size_t const value_units_bytes = align64(sz(c.shape.capacity) * documented_unit_bytes<V>(c.shape.head_dim));
    std::size_t const value_region =
        value_units_bytes + align64((is_kivi_value<V>::value ? sz(c.residual) : 0) * d * 2);
    for (int l = 0; l < c.shape.layers; ++l) {
      std::byte const* base = cache.key_storage(l, 0).units;
      for (int h = 0; h < c.shape.kv_heads; ++h) {
        auto const ks = cache.key_storage(l, h);
        auto const vs = cache.value_storage(l, h);
        CHECK(ks.units == base + sz(h) * key_region);
        CHECK(vs.units == base + sz(c.shape.kv_heads) * key_region + sz(h) * value_region);
        if (ks.residual != nullptr)
          CHECK(reinterpret_cast<std::byte const*>(ks.residual) == ks.units + key_units_bytes);
        if (vs.residual != nullptr)
          CHECK(reinterpret_cast<std::byte const*>(vs.residual) == vs.units + value_units_bytes);
      }
    }
  }
}

TEST_CASE("cache: bits per element of the DESIGN table", "[cache][memory]") {
  kvq::cache_shape const s{2, 4, 128, 4096};
  CHECK(kvq::plan_memory<kvq::q8_0>(s).bits_per_element == 8.5);
  CHECK(kvq::plan_memory<kvq::q4_0>(s).bits_per_element == 4.5);
  CHECK(kvq::plan_memory<kvq::f16_codec>(s).bits_per_element == 16.0);
  CHECK(kvq::plan_memory<kvq::f32_codec>(s).bits_per_element == 32.0);
  CHECK(kvq::plan_memory<kvq::int8_sym>(s).bits_per_element == 8.25);
  CHECK(kvq::plan_memory<kvq::fp8_e4m3>(s).bits_per_element == 8.0);
  CHECK(kvq::plan_memory<q8k_q4v>(s).bits_per_element == 6.5);
  for (std::int64_t cap : {64, 128, 192, 8192}) {
    CHECK(kvq::plan_memory<kvq::q8_0>({1, 1, 128, cap}).bits_per_element == 8.5);
    CHECK(kvq::plan_memory<kvq::q8_0>({1, 1, 128, cap}).alignment_bytes == 0);
  }
  // head_dim 8 with q4_0: one 18-byte block per 8 values (24 lanes of padding) = 18 bits.
  CHECK(kvq::plan_memory<kvq::q4_0>({1, 1, 8, 4096}).bits_per_element == 18.0);
  CHECK(kvq::plan_memory<kvq::q4_0>({1, 1, 8, 4096}).key_bytes == 4096u * 18u);

  // KIVI-4, G = 32, R = 128, capacity 4096, head_dim 128, per (layer, head):
  //   key tiles: 4096/32 tiles x 128 channels x (2 + 2 + 32*4/8) bytes = 128 x 2560 = 327680
  //   key residual: 128 tokens x 128 x 2 = 32768
  //   value rows: 4096 x 4 groups x (2 + 2 + 16) = 327680; value window: 32768
  //   total 720896 bytes for 4096 x 128 x 2 elements = 5.5 bits per element.
  auto const kivi4 = kvq::plan_memory<kvq::kivi<4>>({1, 1, 128, 4096}, 128);
  CHECK(kivi4.total_bytes == 720896u);
  CHECK(kivi4.key_bytes == 327680u);
  CHECK(kivi4.value_bytes == 327680u);
  CHECK(kivi4.residual_bytes == 65536u);
  CHECK(kivi4.alignment_bytes == 0u);
  CHECK(kivi4.bits_per_element == 5.5);
  CHECK(kivi4.bytes_per_token == 720896.0 / 4096.0);
  // KIVI-2, R = 32: tiles 128 x 128 x (4 + 8) = 196608, residual 8192; values 4096 x 4 x 12 = 196608,
  // window 8192: 409600 bytes = 3.125 bits per element.
  CHECK(kvq::plan_memory<kvq::kivi<2>>({1, 1, 128, 4096}, 32).bits_per_element == 3.125);
  // 32 layers x 8 heads: everything scales by 256.
  CHECK(kvq::plan_memory<kvq::kivi<4>>({32, 8, 128, 4096}, 128).total_bytes == 256u * 720896u);
}

// ---------------------------------------------------------------------------------------------
// 7. The allocator hook

/// A memory resource that records every allocation and deallocation.
class counting_resource : public kvq::memory_resource {
 public:
  struct block {
    void* p;
    std::size_t bytes;
    std::size_t align;
  };
  std::vector<block> live;
  std::vector<block> allocated;
  int deallocations = 0;
  int mismatched_deallocations = 0;
  int fail_at = -1;  // the attempt number (0-based) that throws bad_alloc
  int attempts = 0;

 private:
  auto do_allocate(std::size_t bytes, std::size_t align) -> void* override {
    if (attempts++ == fail_at) throw std::bad_alloc();
    void* p = kvq::new_delete_memory_resource()->allocate(bytes, align);
    live.push_back({p, bytes, align});
    allocated.push_back({p, bytes, align});
    return p;
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t align) override {
    ++deallocations;
    auto it = std::find_if(live.begin(), live.end(), [p](block const& b) { return b.p == p; });
    if (it == live.end() || it->bytes != bytes || it->align != align) {
      ++mismatched_deallocations;
      return;  // leak rather than free with the wrong size
    }
    live.erase(it);
    kvq::new_delete_memory_resource()->deallocate(p, bytes, align);
  }
  auto do_is_equal(kvq::memory_resource const& o) const noexcept -> bool override { return this == &o; }
};

template <class Choice>
void check_allocator_hook(kvq::cache_shape const& s, int residual) {
  counting_resource res;
  {
    auto o = make_options<Choice>(residual);
    o.memory = &res;
    cache_of<Choice> c(s, o);
    auto const m = c.memory();
    REQUIRE(res.allocated.size() == sz(s.layers));
    std::size_t total = 0;
    for (auto const& b : res.allocated) {
      CHECK(b.align == 64);
      CHECK(reinterpret_cast<std::uintptr_t>(b.p) % 64 == 0);
      CHECK(b.bytes == m.total_bytes / sz(s.layers));
      total += b.bytes;
    }
    CHECK(total == m.total_bytes);
    for (int l = 0; l < s.layers; ++l)
      for (int h = 0; h < s.kv_heads; ++h) {
        for (auto const& v : {c.key_storage(l, h), c.value_storage(l, h)}) {
          CHECK(reinterpret_cast<std::uintptr_t>(v.units) % kvq::storage_alignment == 0);
          CHECK(reinterpret_cast<std::uintptr_t>(v.residual) % kvq::storage_alignment == 0);
          // Every view lies inside the layer's allocation.
          auto const* base = static_cast<std::byte const*>(res.allocated[sz(l)].p);
          CHECK(v.units >= base);
          CHECK(v.units < base + res.allocated[sz(l)].bytes);
        }
      }
    // Appending, reading and moving allocate nothing from the resource.
    kv_input<float> const k(50, s.kv_heads, s.head_dim, input_layout::dense, 91);
    kv_input<float> const v(50, s.kv_heads, s.head_dim, input_layout::dense, 92);
    c.append(0, k.view(0, 50), v.view(0, 50));
    std::vector<float> out(sz(50 * s.head_dim));
    c.read_keys(0, 0, 0, 50, out.data());
    cache_of<Choice> moved(std::move(c));
    CHECK(moved.size(0) == 50);
    // The moved-from cache holds no layers: indexing one is an error, not undefined behaviour.
    CHECK_THROWS_AS(c.size(0), kvq::index_error);
    CHECK_THROWS_AS(c.key_storage(0, 0), kvq::index_error);
    c.reset();
    c.truncate(0);
    CHECK(c.memory().total_bytes == 0);
    CHECK(res.allocated.size() == sz(s.layers));
    CHECK(res.deallocations == 0);
  }
  CHECK(res.deallocations == s.layers);
  CHECK(res.mismatched_deallocations == 0);
  CHECK(res.live.empty());
}

TEST_CASE("cache: the allocator hook sees every allocation and deallocation", "[cache][memory]") {
  check_allocator_hook<kvq::q8_0>({3, 2, 80, 100}, 128);
  check_allocator_hook<kvq::kivi<4>>({2, 3, 64, 200}, 64);
  check_allocator_hook<int8k_kivi4v>({4, 1, 8, 64}, 32);
  check_allocator_hook<kvq::f16_codec>({1, 1, 1, 77}, 0);

  SECTION("without options.memory the default resource is used") {
    counting_resource res;
    auto* const previous = kvq::set_default_memory_resource(&res);
    {
      cache_of<kvq::q4_0> c({2, 1, 32, 64});
      CHECK(res.allocated.size() == 2);
    }
    kvq::set_default_memory_resource(previous);
    CHECK(res.deallocations == 2);
    CHECK(res.live.empty());
  }

  SECTION("a failed allocation frees what was allocated and propagates") {
    for (int fail : {0, 1, 3}) {
      counting_resource res;
      res.fail_at = fail;
      options_of<kvq::kivi<2>> o;
      o.memory = &res;
      CHECK_THROWS_AS(cache_of<kvq::kivi<2>>({4, 2, 64, 128}, o), std::bad_alloc);
      CHECK(res.allocated.size() == sz(fail));
      CHECK(res.deallocations == fail);
      CHECK(res.mismatched_deallocations == 0);
      CHECK(res.live.empty());
    }
  }
}

#if defined(__linux__)
/// The VmFlags line of the mapping of this process that holds address `a` ("" when none does).
std::string vm_flags_at(std::uintptr_t a) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    unsigned long lo = 0, hi = 0;  // a mapping's first line: "lo-hi perms offset dev inode path"
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2) {
      inside = lo <= a && a < hi;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line + " ";
    }
  }
  return "";
}

TEST_CASE("cache: layers of 2 MiB and more are advised for transparent huge pages", "[cache][memory]") {
  // Where the kernel has transparent huge pages, madvise(MADV_HUGEPAGE) marks the range "hg".
  bool const thp = std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled").good();
  std::uintptr_t const huge = std::uintptr_t{2} << 20;
  SECTION("new/delete memory: the layer starts on a huge page and is advised as a whole") {
    // 2 layers of 8 kv_heads x 128 x 4096 tokens of q8_0 keys and values: 8.5 MiB each.
    cache_of<kvq::q8_0> c({2, 8, 128, 4096});
    for (int l = 0; l < 2; ++l) {
      auto const base = reinterpret_cast<std::uintptr_t>(c.key_storage(l, 0).units);
      CHECK(base % huge == 0);
      CHECK((vm_flags_at(base).find(" hg ") != std::string::npos) == thp);
      CHECK((vm_flags_at(base + 3 * huge).find(" hg ") != std::string::npos) == thp);
    }
  }
  SECTION("a caller's resource: asked for the storage alignment only, its huge-page part advised") {
    counting_resource res;
    options_of<kvq::q8_0> o;
    o.memory = &res;
    cache_of<kvq::q8_0> c({1, 8, 128, 4096}, o);
    REQUIRE(res.allocated.size() == 1);
    CHECK(res.allocated[0].align == kvq::storage_alignment);
    auto const inner = (reinterpret_cast<std::uintptr_t>(res.allocated[0].p) + huge - 1) / huge * huge;
    CHECK((vm_flags_at(inner).find(" hg ") != std::string::npos) == thp);
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// 8. Errors and the strong guarantee

template <class Choice>
void check_errors(int residual) {
  int const d = 64;
  INFO("R = " << residual);
  cache_of<Choice> c({2, 2, d, 64}, make_options<Choice>(residual));
  kv_input<float> const k(64, 2, d, input_layout::padded, 101);
  kv_input<float> const v(64, 2, d, input_layout::padded, 102);
  c.append(0, k.view(0, 25), v.view(0, 25));
  c.append(0, k.view(25, 15), v.view(25, 15));  // layer 0: 40 tokens, KIVI residuals partly full
  c.append(1, k.view(0, 3), v.view(0, 3));

  // Capacity.
  require_error_unchanged<kvq::capacity_error>(
      c, [&] { c.append(0, k.view(0, 25), v.view(0, 25)); },
      "append: layer 0 holds 40 tokens; appending 25 exceeds the capacity of 64");
  c.append(0, k.view(40, 24), v.view(40, 24));  // exactly full is fine
  require_error_unchanged<kvq::capacity_error>(
      c, [&] { c.append(0, k.view(0, 1), v.view(0, 1)); }, "holds 64 tokens; appending 1 exceeds");

  // Layer and head.
  require_error_unchanged<kvq::index_error>(
      c, [&] { c.append(2, k.view(0, 1), v.view(0, 1)); }, "layer 2 is out of range [0, 2)");
  require_error_unchanged<kvq::index_error>(
      c, [&] { c.append(-1, k.view(0, 1), v.view(0, 1)); }, "layer -1 is out of range [0, 2)");
  std::vector<float> out(sz(64 * d + 8), -7.0f);
  auto const untouched = out;
  require_error_unchanged<kvq::index_error>(
      c, [&] { c.read_keys(0, 2, 0, 1, out.data()); }, "kv_head 2 is out of range [0, 2)");
  require_error_unchanged<kvq::index_error>(
      c, [&] { c.read_values(0, -1, 0, 1, out.data()); }, "kv_head -1 is out of range [0, 2)");
  require_error_unchanged<kvq::index_error>(
      c, [&] { c.read_values(5, 0, 0, 1, out.data()); }, "layer 5 is out of range [0, 2)");
  require_error_unchanged<kvq::index_error>(
      c, [&] { (void)c.key_storage(0, 9); }, "kv_head 9");
  require_error_unchanged<kvq::index_error>(
      c, [&] { (void)c.value_storage(3, 0); }, "layer 3");
  require_error_unchanged<kvq::index_error>(
      c, [&] { (void)c.size(-2); }, "layer -2");

  // Ranges.
  require_error_unchanged<kvq::index_error>(
      c, [&] { c.read_keys(1, 0, 2, 2, out.data()); }, "read_keys: range [2, 4) is outside the 3 tokens of layer 1");
  require_error_unchanged<kvq::index_error>(
      c, [&] { c.read_values(1, 1, -1, 2, out.data()); },
      "read_values: range [-1, 1) is outside the 3 tokens of layer 1");
  require_error_unchanged<kvq::index_error>(
      c, [&] { c.read_values(1, 1, 1, -1, out.data()); }, "range [1, 0)");
  require_error_unchanged<kvq::index_error>(
      c, [&] { c.read_keys(1, 1, 4, 0, out.data()); }, "range [4, 4)");
  require_error_unchanged<kvq::shape_error>(
      c, [&] { c.read_keys(0, 0, 0, 2, out.data(), d - 1); }, "output stride 63 is smaller than head_dim 64");
  require_error_unchanged<kvq::shape_error>(
      c, [&] { c.read_keys(0, 0, 0, 2, out.data(), -5); }, "output stride -5");
  require_error_unchanged<kvq::shape_error>(
      c, [&] { c.read_values(0, 0, 0, 2, static_cast<float*>(nullptr)); }, "output is null");
  CHECK(out == untouched);

  // Shapes and strides.
  kv_input<float> const k3(8, 3, d, input_layout::dense, 103);
  kv_input<float> const k_small(8, 2, d - 1, input_layout::dense, 104);
  require_error_unchanged<kvq::shape_error>(
      c, [&] { c.append(1, k3.view(0, 2), v.view(0, 2)); },
      "append: keys have shape (3 heads, 64 dims); the cache has (2, 64)");
  require_error_unchanged<kvq::shape_error>(
      c, [&] { c.append(1, k.view(0, 2), k_small.view(0, 2)); },
      "append: values have shape (2 heads, 63 dims); the cache has (2, 64)");
  require_error_unchanged<kvq::shape_error>(
      c, [&] { c.append(1, k.view(0, 3), v.view(0, 2)); }, "keys have 3 tokens but values have 2");
  auto overlap = k.view(0, 2);
  overlap.token_stride = d;
  overlap.head_stride = d;
  require_error_unchanged<kvq::shape_error>(
      c, [&] { c.append(1, k.view(0, 2), overlap); },
      "values strides (token 64, head 64) make rows of 64 elements overlap");
  auto heads_overlap = k.view(0, 1);
  heads_overlap.head_stride = d / 2;
  require_error_unchanged<kvq::shape_error>(
      c, [&] { c.append(1, heads_overlap, v.view(0, 1)); }, "keys strides (token 139, head 32) make rows");
  auto negative = k.view(0, 2);
  negative.token_stride = -negative.token_stride;
  require_error_unchanged<kvq::shape_error>(
      c, [&] { c.append(1, negative, v.view(0, 2)); }, "strides (token -139, head 67)");
  auto negative_tokens = k.view(0, 2);
  negative_tokens.tokens = -1;
  auto negative_tokens_v = v.view(0, 2);
  negative_tokens_v.tokens = -1;
  require_error_unchanged<kvq::shape_error>(
      c, [&] { c.append(1, negative_tokens, negative_tokens_v); }, "token count -1 is negative");
  auto null_keys = k.view(0, 2);
  null_keys.data = nullptr;
  require_error_unchanged<kvq::shape_error>(
      c, [&] { c.append(1, null_keys, v.view(0, 2)); }, "keys data is null");

  // truncate and shift_left.
  require_error_unchanged<kvq::invalid_argument_error>(
      c, [&] { c.truncate(-7); }, "truncate: n = -7 is negative");
  require_error_unchanged<kvq::invalid_argument_error>(
      c, [&] { c.shift_left(-1); }, "shift_left: n = -1 is negative");
  require_error_unchanged<kvq::index_error>(
      c, [&] { c.shift_left(is_tile_codec<key_of<Choice>> ? 32 : 4); }, "layer 1 holds 3 tokens, cannot drop");
  if constexpr (is_tile_codec<key_of<Choice>>)
    require_error_unchanged<kvq::unsupported_error>(
        c, [&] { c.shift_left(3); }, "G = 32, not 3");

  // After all that, the cache still works.
  c.truncate(60);
  c.append(0, k.view(0, 4), v.view(0, 4));
  CHECK(c.size(0) == 64);
  c.append(1, k.view(0, 0), v.view(0, 0));  // empty append
  CHECK(c.size(1) == 3);
}

TEST_CASE("cache: errors name the values and leave the cache unchanged", "[cache][errors]") {
  check_errors<kvq::q8_0>(128);
  check_errors<kvq::kivi<4>>(32);
  check_errors<kvq::kivi<2>>(0);
  check_errors<int8k_kivi4v>(32);
  check_errors<kvq::fp8_e5m2>(128);
}

TEST_CASE("cache: invalid shapes and options are refused at construction", "[cache][errors]") {
  using kvq::invalid_argument_error;
  require_error<invalid_argument_error>([] { cache_of<kvq::q8_0> c({0, 1, 64, 16}); }, "layers = 0 must be > 0");
  require_error<invalid_argument_error>([] { cache_of<kvq::q8_0> c({-2, 1, 64, 16}); }, "layers = -2");
  require_error<invalid_argument_error>([] { cache_of<kvq::q8_0> c({1, 0, 64, 16}); }, "kv_heads = 0 must be > 0");
  require_error<invalid_argument_error>([] { cache_of<kvq::q8_0> c({1, 1, 0, 16}); }, "head_dim = 0");
  require_error<invalid_argument_error>([] { cache_of<kvq::q8_0> c({1, 1, -64, 16}); }, "head_dim = -64");
  require_error<invalid_argument_error>([] { cache_of<kvq::q8_0> c({1, 1, 64, -5}); }, "capacity = -5");
  require_error<invalid_argument_error>([] { cache_of<kvq::q8_0> c({1, 1, 64, 0}); }, "capacity = 0");

  auto with_residual = [](int r) {
    options_of<kvq::kivi<4>> o;
    o.residual = r;
    return o;
  };
  require_error<invalid_argument_error>(
      [&] {
        cache_of<kvq::kivi<4>> c({1, 1, 64, 256}, with_residual(48));
      },
      "KIVI residual R = 48 must be a non-negative multiple of G = 32");
  require_error<invalid_argument_error>(
      [&] {
        cache_of<kvq::kivi<4>> c({1, 1, 64, 256}, with_residual(-32));
      },
      "R = -32");
  require_error<invalid_argument_error>(
      [] {
        options_of<kvq::kivi<2, 16>> o;
        o.residual = 40;
        cache_of<kvq::kivi<2, 16>> c({1, 1, 64, 256}, o);
      },
      "R = 40 must be a non-negative multiple of G = 16");
  require_error<invalid_argument_error>(
      [] {
        options_of<int8k_kivi4v> o;
        o.residual = 20;
        cache_of<int8k_kivi4v> c({1, 1, 64, 256}, o);
      },
      "R = 20");
  // Residuals do not matter without a KIVI part.
  CHECK_NOTHROW(cache_of<kvq::q4_0>({1, 1, 64, 256}, options_of<kvq::q4_0>{48, {}, {}, nullptr}));

  for (float bad : {0.0f, -1.0f, nan_f, std::numeric_limits<float>::infinity()}) {
    INFO("scale " << bad);
    require_error<invalid_argument_error>(
        [&] {
          options_of<kvq::fp8_e4m3> o;
          o.key.scale = bad;
          cache_of<kvq::fp8_e4m3> c({1, 1, 64, 16}, o);
        },
        "key codec's fp8 scale");
    require_error<invalid_argument_error>(
        [&] {
          options_of<kvq::kv_codecs<kvq::q8_0, kvq::fp8_e5m2>> o;
          o.value.scale = bad;
          kvq::QuantizedKVCache<kvq::kv_codecs<kvq::q8_0, kvq::fp8_e5m2>> c({1, 1, 64, 16}, o);
        },
        "value codec's fp8 scale");
  }
  // The message names the scale.
  require_error<invalid_argument_error>(
      [] {
        options_of<kvq::fp8_e4m3> o;
        o.key.scale = 0.0f;
        cache_of<kvq::fp8_e4m3> c({1, 1, 64, 16}, o);
      },
      "scale = 0");
  // A shape whose byte size does not fit in size_t is refused, not wrapped around.
  require_error<invalid_argument_error>(
      [] {
        cache_of<kvq::f32_codec> c({1 << 20, 1 << 20, 65536, std::int64_t{1} << 40});
      },
      "bytes");
}

// ---------------------------------------------------------------------------------------------
// 8b. Regressions found by random-operation testing (overflow in checks, f16 saturation of the
//     KIVI residual, non-finite scales, plan_memory validation)

TEST_CASE("cache: a read range at the int64 limits raises index_error without overflowing", "[cache][errors]") {
  cache_of<kvq::q8_0> c({1, 1, 32, 8});
  std::vector<float> out(64, -7.0f);
  auto const untouched = out;
  constexpr std::int64_t max = std::numeric_limits<std::int64_t>::max();
  constexpr std::int64_t min = std::numeric_limits<std::int64_t>::min();
  require_error_unchanged<kvq::index_error>(
      c, [&] { c.read_keys(0, 0, max, 1, out.data()); },
      "read_keys: range [9223372036854775807, 9223372036854775807 + 1)");
  require_error_unchanged<kvq::index_error>(
      c, [&] { c.read_values(0, 0, min, -1, out.data()); }, "range [-9223372036854775808, -9223372036854775808 + -1)");
  require_error_unchanged<kvq::index_error>(
      c, [&] { c.read_values(0, 0, 0, max, out.data()); }, "range [0, 9223372036854775807)");
  // Rows that no buffer can hold: (count - 1) * stride overflows.
  kv_input<float> const k(4, 1, 32, input_layout::dense, 7);
  c.append(0, k.view(0, 4), k.view(0, 4));
  require_error_unchanged<kvq::shape_error>(
      c, [&] { c.read_keys(0, 0, 0, 3, out.data(), max / 2); }, "do not fit in the address space");
  CHECK(out == untouched);
}

TEST_CASE("cache: huge strides are refused without overflow and nothing is appended", "[cache][errors]") {
  cache_of<kvq::q8_0> c({1, 2, 8, 8});
  std::vector<float> x(64, 1.0f);
  constexpr std::int64_t big = std::int64_t{1} << 62;
  kvq::kv_tensor<float> const t{x.data(), 2, 2, 8, big, big};
  require_error_unchanged<kvq::shape_error>(
      c, [&] { c.append(0, t, t); }, "make rows of 8 elements overlap");
  CHECK(c.size(0) == 0);
  // Non-overlapping (token-major and head-major) but beyond the address space.
  kvq::kv_tensor<float> const token_major{x.data(), 2, 2, 8, big, big / 2};
  require_error_unchanged<kvq::shape_error>(
      c, [&] { c.append(0, token_major, token_major); }, "address space");
  kvq::kv_tensor<float> const head_major{x.data(), 3, 2, 8, big / 4, big};
  require_error_unchanged<kvq::shape_error>(
      c, [&] { c.append(0, head_major, head_major); }, "address space");
  kvq::kv_tensor<float> const max_strides{x.data(), 2, 2, 8, std::numeric_limits<std::int64_t>::max(), 8};
  require_error_unchanged<kvq::shape_error>(
      c, [&] { c.append(0, max_strides, max_strides); }, "address space");
  CHECK(c.size(0) == 0);
  // Large strides that are valid and in range still work (a single token ignores its token stride).
  kvq::kv_tensor<float> const one{x.data(), 1, 2, 8, big, 16};
  c.append(0, one, one);
  CHECK(c.size(0) == 1);
}

/// x with every finite element beyond ±65504 clipped to ±65504 (what the KIVI residual stores).
auto f16_saturate(row_t x) -> row_t {
  for (auto& v : x)
    if (std::isfinite(v)) v = std::clamp(v, -65504.0f, 65504.0f);
  return f16_round(x);
}

TEST_CASE("cache: KIVI saturates finite inputs beyond the f16 range instead of poisoning the group", "[cache][kivi]") {
  for (int residual : {0, 32}) {
    INFO("R = " << residual);
    using C = kvq::kivi<4>;
    cache_of<C> c({1, 1, 32, 128}, make_options<C>(residual));
    std::vector<float> k(sz(64 * 32), 1.0f), v(k.size(), 1.0f);
    k[0] = 1e5f;
    v[0] = 1e5f;
    k[1] = -3e38f;
    v[1] = -3e38f;
    c.append(0, kvq::token_major(k.data(), 64, 1, 32), kvq::token_major(v.data(), 64, 1, 32));
    CHECK(c.nonfinite_blocks(0) == kvq::nonfinite_report{});
    // The expectation: the codec itself on the saturated rows, bit for bit.
    row_t const v0 = f16_saturate(row_t(v.begin(), v.begin() + 32));
    CHECK(v0[0] == 65504.0f);
    CHECK(v0[1] == -65504.0f);
    row_t const v0_read = row_roundtrip<kvq::kivi_value<4>>(v0, {});
    std::vector<float> tile(sz(32 * 32));
    for (std::size_t t = 0; t < 32; ++t) {
      row_t const r = f16_saturate(
          row_t(k.begin() + static_cast<std::ptrdiff_t>(t * 32), k.begin() + static_cast<std::ptrdiff_t>(t * 32 + 32)));
      std::copy(r.begin(), r.end(), tile.begin() + static_cast<std::ptrdiff_t>(t * 32));
    }
    std::vector<std::uint8_t> bytes(kvq::kivi_key<4>::geometry(32).bytes());
    kvq::kivi_key<4>::encode_tile(tile.data(), 32, 32, bytes.data());
    std::vector<float> out(sz(64 * 32));
    c.read_keys(0, 0, 0, 64, out.data());
    for (int t = 0; t < 32; ++t) {
      row_t want(32);
      kvq::kivi_key<4>::decode_token(bytes.data(), 32, t, want.data());
      for (int ch = 0; ch < 32; ++ch) {
        INFO("key token " << t << " channel " << ch);
        REQUIRE(kvq_test::bits(out[sz(t * 32 + ch)]) == kvq_test::bits(want[sz(ch)]));
      }
    }
    c.read_values(0, 0, 0, 64, out.data());
    for (int ch = 0; ch < 32; ++ch) {
      INFO("value channel " << ch);
      CHECK(kvq_test::bits(out[sz(ch)]) == kvq_test::bits(v0_read[sz(ch)]));
    }
    for (float x : out) CHECK(std::isfinite(x));
  }
}

TEST_CASE("cache: a truncated KIVI key group decoded beyond 65504 goes back to the residual saturated",
          "[cache][kivi][truncate]") {
  // A channel of {-65504, 65504, 0, ...}: scale fp16(131008 / 15) = 8736, so code 15 decodes to
  // -65504 + 15 * 8736 = 65536, beyond the f16 range.
  using C = kvq::kivi<4>;
  cache_of<C> c({1, 1, 32, 128}, make_options<C>(0));
  std::vector<float> k(sz(64 * 32), 0.0f), v(k.size(), 0.5f);
  k[0] = -65504.0f;
  k[32] = 65504.0f;
  c.append(0, kvq::token_major(k.data(), 32, 1, 32), kvq::token_major(v.data(), 32, 1, 32));
  std::vector<float> out(sz(64 * 32));
  c.read_keys(0, 0, 0, 2, out.data());
  CHECK(out[32] == 65536.0f);  // the quantized group's decoded value
  c.truncate(5);               // tokens 0-4 go back to the f16 residual
  c.read_keys(0, 0, 0, 5, out.data());
  CHECK(out[0] == -65504.0f);
  CHECK(out[32] == 65504.0f);  // saturated, not +Inf
  c.append(0, kvq::token_major(k.data() + 5 * 32, 27, 1, 32), kvq::token_major(v.data(), 27, 1, 32));
  CHECK(c.key_storage(0, 0).quantized_tokens == 32);
  CHECK(c.nonfinite_blocks(0) == kvq::nonfinite_report{});
  c.read_keys(0, 0, 0, 32, out.data());
  for (std::size_t i = 0; i < sz(32 * 32); ++i) CHECK(std::isfinite(out[i]));
}

TEST_CASE("cache: KIVI NaN and Inf inputs still poison their group", "[cache][kivi][nan]") {
  using C = kvq::kivi<2>;
  cache_of<C> c({1, 1, 64, 64}, make_options<C>(0));
  std::vector<float> k(sz(32 * 64), 0.25f), v(k.size(), 0.25f);
  k[3] = std::numeric_limits<float>::infinity();
  v[64 + 40] = nan_f;
  c.append(0, kvq::token_major(k.data(), 32, 1, 64), kvq::token_major(v.data(), 32, 1, 64));
  CHECK(c.nonfinite_blocks(0) == kvq::nonfinite_report{1, 1});  // key channel 3; value row 1, group 1
  std::vector<float> out(sz(32 * 64));
  c.read_keys(0, 0, 0, 32, out.data());
  for (int t = 0; t < 32; ++t) CHECK(std::isnan(out[sz(t * 64 + 3)]));
  c.read_values(0, 0, 1, 1, out.data());
  CHECK(std::isnan(out[40]));
  CHECK(std::isnan(out[63]));
  CHECK(out[31] == 0.25f);
}

TEST_CASE("cache: nonfinite_blocks counts q8_0/q4_0 scale overflow and poisoned blocks", "[cache][nan]") {
  // q8_0: amax 1e7 gives d = 78740 -> fp16 +Inf (ggml's bytes): the block reads {inf, nan, ...}.
  std::vector<float> x(64, 1.0f);
  x[0] = 1e7f;
  {
    cache_of<kvq::q8_0> c({2, 1, 64, 8});
    c.append(0, kvq::token_major(x.data(), 1, 1, 64), kvq::token_major(x.data(), 1, 1, 64));
    std::vector<float> const ones(64, 1.0f);
    c.append(1, kvq::token_major(ones.data(), 1, 1, 64), kvq::token_major(ones.data(), 1, 1, 64));
    CHECK(c.nonfinite_blocks(0) == kvq::nonfinite_report{1, 1});
    CHECK(c.nonfinite_blocks(1) == kvq::nonfinite_report{});
    CHECK(c.nonfinite_blocks() == kvq::nonfinite_report{1, 1});
    CHECK(c.nonfinite_blocks().total() == 2);
    std::vector<std::uint8_t> want(kvq::q8_0::geometry(64).bytes());
    kvq::q8_0::encode_row(x.data(), 64, want.data());
    CHECK(std::memcmp(c.key_storage(0, 0).units, want.data(), want.size()) == 0);  // ggml's bytes
    std::vector<float> out(64);
    c.read_keys(0, 0, 0, 1, out.data());
    CHECK(out[0] == std::numeric_limits<float>::infinity());
    CHECK(std::isnan(out[1]));
    CHECK(std::fabs(out[32] - 1.0f) < 1e-3f);  // the second block is fine
    require_error_unchanged<kvq::index_error>(
        c, [&] { (void)c.nonfinite_blocks(2); }, "layer 2 is out of range");
  }
  // q4_0: |max| 6e5 gives |d| = 75000 -> fp16 Inf.
  {
    std::vector<float> y(32, 1.0f);
    y[5] = -6e5f;
    cache_of<kvq::q4_0> c({1, 1, 32, 8});
    c.append(0, kvq::token_major(y.data(), 1, 1, 32), kvq::token_major(x.data() + 32, 1, 1, 32));
    CHECK(c.nonfinite_blocks(0) == kvq::nonfinite_report{1, 0});
    y[5] = -5e5f;  // |d| = 62500: finite
    c.append(0, kvq::token_major(y.data(), 1, 1, 32), kvq::token_major(y.data(), 1, 1, 32));
    CHECK(c.nonfinite_blocks(0) == kvq::nonfinite_report{1, 0});
  }
  // int8: only NaN/Inf input (fp32 scale); f16 and fp8 have no scales.
  {
    std::vector<float> y(32, 1.0f);
    y[7] = nan_f;
    cache_of<kvq::int8_sym> c({1, 1, 32, 8});
    c.append(0, kvq::token_major(y.data(), 1, 1, 32), kvq::token_major(x.data(), 1, 1, 32));
    CHECK(c.nonfinite_blocks(0) == kvq::nonfinite_report{1, 0});
    cache_of<kvq::f16_codec> f({1, 1, 32, 8});
    f.append(0, kvq::token_major(y.data(), 1, 1, 32), kvq::token_major(x.data(), 1, 1, 32));
    CHECK(f.nonfinite_blocks(0) == kvq::nonfinite_report{});
  }
}

TEST_CASE("cache: plan_memory refuses what the constructor refuses", "[cache][memory][errors]") {
  using kvq::invalid_argument_error;
  require_error<invalid_argument_error>([] { (void)kvq::plan_memory<kvq::f32_codec>({1, 1, 8, -5}); }, "capacity = -5");
  require_error<invalid_argument_error>([] { (void)kvq::plan_memory<kvq::q8_0>({0, 1, 8, 16}); }, "layers = 0");
  require_error<invalid_argument_error>([] { (void)kvq::plan_memory<kvq::q8_0>({1, -1, 8, 16}); }, "kv_heads = -1");
  require_error<invalid_argument_error>(
      [] {
        (void)kvq::plan_memory<kvq::q8_0>({1, 1, 70000, 16});
      },
      "head_dim = 70000");
  require_error<invalid_argument_error>(
      [] {
        (void)kvq::plan_memory<kvq::kivi<4>>({1, 1, 8, 64}, 31);
      },
      "KIVI residual R = 31");
  require_error<invalid_argument_error>([] { (void)kvq::plan_memory<kvq::kivi<4>>({1, 1, 8, 64}, -32); }, "R = -32");
  require_error<invalid_argument_error>(
      [] {
        (void)kvq::plan_memory<kvq::f32_codec>({1 << 20, 1 << 20, 65536, std::int64_t{1} << 40});
      },
      "bytes");
  // R is ignored without a KIVI part; valid shapes are sized as before.
  CHECK(kvq::plan_memory<kvq::q8_0>({1, 1, 128, 64}, 31).bits_per_element == 8.5);
  CHECK(kvq::plan_memory<kvq::kivi<4>>({1, 1, 128, 4096}, 0).total_bytes ==
        cache_of<kvq::kivi<4>>({1, 1, 128, 4096}, make_options<kvq::kivi<4>>(0)).memory().total_bytes);
}

// ---------------------------------------------------------------------------------------------
// 9. Threads

template <class Choice>
void check_threads(int residual) {
  constexpr int layers = 4;
  int const d = 64;
  kvq::cache_shape const s{layers, 2, d, 256};
  auto const o = make_options<Choice>(residual);
  std::vector<kv_input<float>> keys, values;
  for (int l = 0; l < layers; ++l) {
    keys.emplace_back(200, 2, d, input_layout::padded, 200 + l);
    values.emplace_back(200, 2, d, input_layout::padded, 300 + l);
  }
  std::vector<std::vector<std::int64_t>> const chunks = {
      {200}, std::vector<std::int64_t>(200, 1), {1, 2, 61, 1, 1, 130, 4}, {33, 33, 33, 101}};
  auto feed = [&](cache_of<Choice>& c, int l) {
    std::int64_t first = 0;
    for (auto n : chunks[sz(l)]) {
      c.append(l, keys[sz(l)].view(first, n), values[sz(l)].view(first, n));
      first += n;
    }
  };

  cache_of<Choice> sequential(s, o);
  for (int l = 0; l < layers; ++l) feed(sequential, l);

  cache_of<Choice> concurrent(s, o);
  {
    std::vector<std::thread> threads;
    for (int l = 0; l < layers; ++l) threads.emplace_back([&, l] { feed(concurrent, l); });
    for (auto& t : threads) t.join();
  }
  snapshot const got = take_snapshot(concurrent), expected = take_snapshot(sequential);
  CHECK(got.counters == expected.counters);
  CHECK(got.raw == expected.raw);
  CHECK(got.reads == expected.reads);

  // Concurrent reads from a const cache, each thread in its own order and output type.
  cache_of<Choice> const& shared = concurrent;
  std::vector<std::vector<float>> results(layers);
  {
    std::vector<std::thread> threads;
    for (int i = 0; i < layers; ++i)
      threads.emplace_back([&, i] {
        std::vector<float>& r = results[sz(i)];
        std::vector<float> row(sz(d));
        for (int j = 0; j < layers; ++j) {
          int const l = (i + j) % layers;
          for (int h = 0; h < 2; ++h)
            for (std::int64_t t = 0; t < 200; t += 7) {
              shared.read_keys(l, h, t, 1, row.data());
              r.insert(r.end(), row.begin(), row.end());
              shared.read_values(l, h, t, 1, row.data());
              r.insert(r.end(), row.begin(), row.end());
            }
          (void)shared.memory();
          (void)shared.key_storage(l, 1);
        }
      });
    for (auto& t : threads) t.join();
  }
  for (int i = 0; i < layers; ++i) {
    std::vector<float> want;
    std::vector<float> row(sz(d));
    for (int j = 0; j < layers; ++j) {
      int const l = (i + j) % layers;
      for (int h = 0; h < 2; ++h)
        for (std::int64_t t = 0; t < 200; t += 7) {
          sequential.read_keys(l, h, t, 1, row.data());
          want.insert(want.end(), row.begin(), row.end());
          sequential.read_values(l, h, t, 1, row.data());
          want.insert(want.end(), row.begin(), row.end());
        }
    }
    INFO("reader " << i);
    REQUIRE(results[sz(i)].size() == want.size());
    CHECK(std::memcmp(results[sz(i)].data(), want.data(), want.size() * 4) == 0);
  }
}

TEST_CASE("cache: concurrent appends to different layers and concurrent reads", "[cache][threads]") {
  check_threads<kvq::kivi<4>>(32);
  check_threads<kvq::kivi<2>>(0);
  check_threads<kvq::q4_0>(128);
}

}  // namespace
