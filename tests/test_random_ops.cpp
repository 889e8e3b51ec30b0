// Property-based random-operation test of the cache, its attention and the any_cache facade.
//
// Each iteration picks a codec choice (every single codec, KIVI with G = 32 and G = 16, every mixed
// pair of the facade), a random shape, residual and fp8 parameters, and runs a random sequence of
// operations -- appends in f32 / f16 / bf16 with random strides and chunkings, reads of random
// ranges into random element types and strides, truncate, shift_left, reset, decode attention in
// every form, storage views and the debug counters -- about a third of them invalid. Every
// operation is checked against a shadow model that keeps, per (layer, kv_head), the f32 rows the
// cache is meant to encode (the input, or its saturated f16 rounding for the KIVI residual) and how
// many of them are quantized:
//   * valid operations: the cache's storage bytes equal the codec's scalar reference encoding of the
//     shadow (bit for bit, residual rows included), reads equal the reference decoding (NaN as NaN),
//     only the rows' head_dim elements of an output are written, the view counters, sizes, memory
//     report and non-finite block counts agree;
//   * invalid operations: the documented typed error, and nothing observable changes (bytes, state,
//     reads) and no output buffer is touched (strong guarantee);
//   * chunk independence: a twin cache fed the same tokens in other chunks and layouts holds the
//     same live bytes; the facade (when the choice has names) gives the same reads, attention and
//     errors;
//   * attention (decode_attention, attend_range split at random points + combine + finalize,
//     decode_attention_parallel) against a float64 softmax over the decoded values, within a bound
//     derived from fp32 accumulation (see attention_bound).
//
// Seeded and reproducible: KVQ_RANDOM_OPS_SEED (default below), KVQ_RANDOM_OPS_ITERATIONS (default
// 150: about a second in a Release build, 15 s in a Debug ASan+UBSan build), KVQ_RANDOM_OPS_FIRST
// (first iteration, to rerun a failing one alone). A failure names the seed, the iteration, the
// choice and the operations.
// scripts/random-ops.sh runs it long.
#include <kvq/any_cache.hpp>
#include <kvq/attention.hpp>
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
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "catch_compat.hpp"
#include "test_support.hpp"

namespace {

using kvq::bf16;
using kvq::f16;
using row_t = std::vector<float>;

constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();
constexpr float inf_f = std::numeric_limits<float>::infinity();
constexpr std::int64_t i64_max = std::numeric_limits<std::int64_t>::max();
constexpr std::int64_t i64_min = std::numeric_limits<std::int64_t>::min();

auto sz(std::int64_t n) -> std::size_t { return static_cast<std::size_t>(n); }

// ------------------------------------------------------------------------------------------------
// Settings and randomness
// ------------------------------------------------------------------------------------------------

/// An integer from the environment, or `fallback` when unset or unparsable.
auto env_int(char const* name, std::int64_t fallback) -> std::int64_t {
  char const* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  long long const x = std::strtoll(v, &end, 0);
  return end != nullptr && *end == '\0' ? static_cast<std::int64_t>(x) : fallback;
}

using kvq_test::rng;

/// Thrown at the first discrepancy of an iteration.
struct mismatch {
  std::string what;
};

void expect(bool ok, std::string const& what) {
  if (!ok) throw mismatch{what};
}

// ------------------------------------------------------------------------------------------------
// Elements
// ------------------------------------------------------------------------------------------------

using kvq_test::elem_bits;
using kvq_test::from_f32;

template <class T>
auto is_nan_elem(T x) -> bool {
  return std::isnan(kvq::to_f32(x));
}

/// Equal bits, or both NaN.
template <class T>
auto same_elem(T a, T b) -> bool {
  return elem_bits(a) == elem_bits(b) || (is_nan_elem(a) && is_nan_elem(b));
}

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

/// The f16 value the KIVI residual stores for x: finite values clipped to ±65504, then rounded
/// to f16 (NaN and ±Inf kept).
auto f16_sat(float x) -> float {
  if (std::isfinite(x)) x = std::clamp(x, -65504.0f, 65504.0f);
  return kvq::to_f32(kvq::to_f16(x));
}

auto f16_sat(row_t x) -> row_t {
  for (auto& v : x) v = f16_sat(v);
  return x;
}

// ------------------------------------------------------------------------------------------------
// Codec traits
// ------------------------------------------------------------------------------------------------

template <class C>
struct is_kivi_value : std::false_type {};
template <int B, int G>
struct is_kivi_value<kvq::kivi_value<B, G>> : std::true_type {};
template <class C>
struct is_kivi_key : std::false_type {};
template <int B, int G>
struct is_kivi_key<kvq::kivi_key<B, G>> : std::true_type {};

template <class C>
constexpr bool is_tile = C::layout == kvq::codec_layout::token_group;

template <class C>
constexpr auto group_of() -> int {
  if constexpr (is_tile<C> || is_kivi_value<C>::value) {
    return C::group;
  } else {
    return 1;
  }
}

template <class Choice>
using key_of = typename kvq::codec_pair<Choice>::key;
template <class Choice>
using value_of = typename kvq::codec_pair<Choice>::value;

/// The facade's name of a codec used as keys (as_key) or values, or "" when the facade has none.
template <class C>
auto facade_name() -> std::string {
  if constexpr (is_kivi_key<C>::value || is_kivi_value<C>::value) {
    return C::group == 32 ? "kivi" + std::to_string(C::bits) : "";
  } else if constexpr (kvq::rotated_codec<C>) {  // the facade's rotated codecs use the default seed
    return C::rotation_seed == kvq::default_rotation_seed ? std::string(C::name) : "";
  } else {
    return std::string(C::name);
  }
}

/// A readable name of a choice.
template <class Choice>
auto choice_name() -> std::string {
  auto one = [](auto tag) {
    using C = typename decltype(tag)::type;
    std::string n(C::name);
    if constexpr (is_kivi_key<C>::value || is_kivi_value<C>::value)
      n += std::to_string(C::bits) + "/G" + std::to_string(C::group);
    return n;
  };
  return one(std::type_identity<key_of<Choice>>{}) + " + " + one(std::type_identity<value_of<Choice>>{});
}

/// Stored scales of one encoded unit that are not finite (the test's own reading of each format).
template <class Codec>
auto count_nonfinite_scales(std::vector<std::uint8_t> const& unit, int d) -> std::int64_t {
  using C = kvq::stored_codec_t<Codec>;  // a rotated codec's scales are its stored codec's
  auto f16_at = [&](std::size_t off) {
    return kvq::to_f32(f16{static_cast<std::uint16_t>(unit[off] | (unit[off + 1] << 8))});
  };
  std::int64_t n = 0;
  if constexpr (std::is_same_v<C, kvq::q8_0> || std::is_same_v<C, kvq::q4_0> || is_kivi_value<C>::value) {
    auto const g = C::geometry(d);
    for (int b = 0; b < g.blocks; ++b) n += std::isfinite(f16_at(sz(b) * g.block_bytes)) ? 0 : 1;
  } else if constexpr (std::is_same_v<C, kvq::int8_sym>) {
    float s;
    std::memcpy(&s, unit.data(), 4);
    n += std::isfinite(s) ? 0 : 1;
  } else if constexpr (is_tile<C>) {
    for (int c = 0; c < d; ++c) n += std::isfinite(f16_at(2 * sz(c))) ? 0 : 1;
  } else if constexpr (requires { C::scale(nullptr, 0); }) {  // tq: one f16 scale per power-of-two block of d
    for (int b = 0; b < std::popcount(static_cast<unsigned>(d)); ++b) n += std::isfinite(f16_at(2 * sz(b))) ? 0 : 1;
  }
  return n;
}

// ------------------------------------------------------------------------------------------------
// The shadow model
// ------------------------------------------------------------------------------------------------

/// Keys or values of one (layer, kv_head): the f32 rows the cache encodes, and how many of them
/// are quantized (the rest are f16 residual / window rows, for KIVI).
struct stream {
  std::vector<row_t> src;
  std::int64_t quantized = 0;
  auto length() const -> std::int64_t { return static_cast<std::int64_t>(src.size()); }
};

/// Per-codec rules of the shadow, from the documented semantics (cache.hpp, docs/formats.md).
template <class C, bool IsValue>
struct rules {
  using params = typename C::params_type;

  /// Bytes of unit u (row, or tile of G tokens) of a stream, by the codec's scalar reference.
  static auto unit_bytes(stream const& s, std::int64_t u, int d, params const& p) -> std::vector<std::uint8_t> {
    std::vector<std::uint8_t> b(C::geometry(d).bytes());
    if constexpr (is_tile<C>) {
      std::vector<float> tile(sz(C::group) * sz(d));
      for (std::int64_t t = 0; t < C::group; ++t)
        std::copy(s.src[sz(u * C::group + t)].begin(), s.src[sz(u * C::group + t)].end(), tile.begin() + t * d);
      C::encode_tile(tile.data(), d, d, b.data(), p);
    } else {
      C::encode_row(s.src[sz(u)].data(), d, b.data(), p);
    }
    return b;
  }

  /// Units of quantized data in a stream.
  static auto units(stream const& s) -> std::int64_t {
    if constexpr (is_tile<C>) {
      return s.quantized / C::group;
    } else {
      return s.quantized;
    }
  }

  /// The decoded value of token t.
  static auto decoded(stream const& s, std::int64_t t, int d, params const& p) -> row_t {
    if (t >= s.quantized) return s.src[sz(t)];  // an f16 residual / window row (KIVI)
    row_t y(sz(d));
    if constexpr (is_tile<C>) {
      auto const b = unit_bytes(s, t / C::group, d, p);
      C::decode_token(b.data(), d, static_cast<int>(t % C::group), y.data(), p);
    } else {
      auto const b = unit_bytes(s, t, d, p);
      C::decode_row(b.data(), d, y.data(), p);
    }
    return y;
  }

  /// Token t as the attention kernels read it: decoded by the stored codec, so in the rotated
  /// space for a rotated codec (whose choices here are row codecs).
  static auto stored(stream const& s, std::int64_t t, int d, params const& p) -> row_t {
    if constexpr (kvq::rotated_codec<C>) {
      static_assert(!is_tile<C>, "rotated KIVI keys are not among this test's choices");
      row_t y(sz(d));
      auto const b = unit_bytes(s, t, d, p);
      kvq::stored_codec_t<C>::decode_row(b.data(), d, y.data(), p);
      return y;
    } else {
      return decoded(s, t, d, p);
    }
  }

  /// |min| of the group of each channel of token t (KIVI key tiles), else zeros: the SIMD kernels
  /// compute q·k of a KIVI key as Σ (q_c s_c) code_c + Σ q_c m_c, whose rounding is relative to
  /// Σ |q_c| (|k_c| + 2 |m_c|) rather than Σ |q_c k_c|.
  static auto key_offsets(stream const& s, std::int64_t t, int d, params const& p) -> row_t {
    row_t o(sz(d), 0.0f);
    if constexpr (is_tile<C>) {
      if (t < s.quantized) {
        auto const b = unit_bytes(s, t / C::group, d, p);
        for (int c = 0; c < d; ++c) o[sz(c)] = std::fabs(C::group_params(b.data(), d, c).min);
      }
    } else {
      (void)s, (void)t, (void)p;
    }
    return o;
  }

  static void push(stream& s, row_t const& x, int residual) {
    if constexpr (is_tile<C>) {
      s.src.push_back(f16_sat(x));
      std::int64_t const f = residual > 0 ? residual : C::group;
      if (s.length() - s.quantized == f) s.quantized += f;
    } else if constexpr (IsValue && is_kivi_value<C>::value) {
      s.src.push_back(f16_sat(x));
      if (residual == 0) {
        s.quantized = s.length();
      } else {
        while (s.length() - s.quantized > residual) ++s.quantized;
      }
    } else {
      s.src.push_back(x);
      s.quantized = s.length();
    }
  }

  static void truncate(stream& s, std::int64_t n, int d, params const& p) {
    if (s.length() <= n) return;
    if constexpr (is_tile<C>) {
      if (n < s.quantized) {
        std::int64_t const q = n / C::group * C::group;
        std::vector<row_t> back;  // decoded from the tile as it is (before any of its rows change)
        for (std::int64_t t = q; t < n; ++t) back.push_back(f16_sat(decoded(s, t, d, p)));
        for (std::int64_t t = q; t < n; ++t) s.src[sz(t)] = back[sz(t - q)];
        s.quantized = q;
      }
    } else {
      s.quantized = std::min(s.quantized, n);
    }
    s.src.resize(sz(n));
  }

  static void shift(stream& s, std::int64_t n) {
    if (s.length() == 0) return;
    s.src.erase(s.src.begin(), s.src.begin() + static_cast<std::ptrdiff_t>(n));
    s.quantized = std::max<std::int64_t>(s.quantized - n, 0);
  }
};

// ------------------------------------------------------------------------------------------------
// Inputs
// ------------------------------------------------------------------------------------------------

/// How the values of an iteration are drawn.
struct value_style {
  double magnitude = 1.0;  ///< scale of the normal values
  bool special = false;    ///< occasionally NaN, ±Inf, values beyond the f16 range, subnormals
  bool constant_channel = false;
  bool extreme_channel = false;  ///< channel 0 is ±70000: beyond f16, KIVI groups clipped at both ends
};

auto draw_value(rng& r, value_style const& st, int channel) -> float {
  if (st.constant_channel && channel == 1) return 0.375f;
  if (st.extreme_channel && channel == 0) return r.chance(0.5) ? 7e4f : -7e4f;
  if (r.chance(0.02)) return 0.0f;
  if (st.special && r.chance(0.01)) {
    static std::vector<float> const specials = {nan_f, inf_f,  -inf_f, 1e5f,     -1e5f,    7e4f,      1e7f, -6e5f,
                                                3e38f, -3e38f, 1e-40f, 65504.0f, 65520.0f, -65519.0f, 9e6f};
    return r.pick(specials);
  }
  double v = r.normal() * st.magnitude;
  if (channel % 17 == 3) v *= 8.0;
  return static_cast<float>(v);
}

/// A (tokens, kv_heads, head_dim) tensor of T in a random layout; elements outside the rows are
/// NaN so that reading them would show.
template <class T>
struct tensor {
  std::vector<T> data;
  std::int64_t tokens = 0;
  int heads = 0;
  int dim = 0;
  std::int64_t ts = 0;
  std::int64_t hs = 0;

  auto view() const -> kvq::kv_tensor<T> { return {data.empty() ? nullptr : data.data(), tokens, heads, dim, ts, hs}; }
  auto row(std::int64_t t, int h) const -> row_t {
    row_t x(sz(dim));
    for (int c = 0; c < dim; ++c) x[sz(c)] = kvq::to_f32(data[sz(t * ts + h * hs + c)]);
    return x;
  }
};

/// Lays out rows[t][h] (f32 values already representable in T) in a random valid layout.
template <class T>
auto make_tensor(std::vector<std::vector<row_t>> const& rows, int heads, int dim, rng& r) -> tensor<T> {
  tensor<T> x;
  x.tokens = static_cast<std::int64_t>(rows.size());
  x.heads = heads;
  x.dim = dim;
  std::int64_t const pad = r.pick(std::vector<std::int64_t>{0, 0, 1, 3, 8});
  switch (r.below(3)) {
    case 0:  // token-major, maybe padded
      x.hs = dim + pad;
      x.ts = heads * x.hs + r.pick(std::vector<std::int64_t>{0, 0, 2, 5});
      break;
    case 1:  // head-major
      x.ts = dim + pad;
      x.hs = std::max<std::int64_t>(x.tokens, 1) * x.ts + r.pick(std::vector<std::int64_t>{0, 1, 7});
      break;
    default:  // dense token-major
      x.hs = dim;
      x.ts = static_cast<std::int64_t>(heads) * dim;
      break;
  }
  if (x.tokens == 1 && r.chance(0.3)) x.ts = r.pick(std::vector<std::int64_t>{0, 1, std::int64_t{1} << 40});
  std::int64_t size = 0;
  if (x.tokens > 0) size = (x.tokens - 1) * x.ts + (heads - 1) * x.hs + dim;
  x.data.assign(sz(size) + 3, from_f32<T>(nan_f));
  for (std::int64_t t = 0; t < x.tokens; ++t)
    for (int h = 0; h < heads; ++h)
      for (int c = 0; c < dim; ++c) x.data[sz(t * x.ts + h * x.hs + c)] = from_f32<T>(rows[sz(t)][sz(h)][sz(c)]);
  return x;
}

// ------------------------------------------------------------------------------------------------
// Snapshots and errors
// ------------------------------------------------------------------------------------------------

/// Everything observable of a cache: sizes, view counters and pointers, every storage byte
/// (unused capacity included) and the f32 read-back of every token.
struct snapshot {
  std::vector<std::int64_t> counters;
  std::vector<std::uintptr_t> pointers;
  std::vector<std::byte> raw;
  std::vector<std::uint32_t> reads;
  friend bool operator==(snapshot const&, snapshot const&) = default;
};

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
        s.counters.insert(s.counters.end(), {v.quantized_tokens, v.residual_tokens, v.residual_capacity,
                                             v.residual_first, static_cast<std::int64_t>(v.unit_bytes)});
        s.pointers.push_back(reinterpret_cast<std::uintptr_t>(v.units));
        s.pointers.push_back(reinterpret_cast<std::uintptr_t>(v.residual));
        std::int64_t const units = shape.capacity / v.tokens_per_unit;
        s.raw.insert(s.raw.end(), v.units, v.units + sz(units) * v.unit_bytes);
        if (v.residual != nullptr) {
          auto const* p = reinterpret_cast<std::byte const*>(v.residual);
          s.raw.insert(s.raw.end(), p, p + sz(v.residual_capacity) * sz(d) * 2);
        }
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

/// The facade's observable state: sizes and f32 reads.
auto take_snapshot_any(kvq::any_cache const& c) -> snapshot {
  snapshot s;
  auto const shape = c.shape();
  int const d = shape.head_dim;
  for (int l = 0; l < shape.layers; ++l) {
    std::int64_t const len = c.size(l);
    s.counters.push_back(len);
    for (int h = 0; h < shape.kv_heads; ++h) {
      std::vector<float> out(sz(len * d));
      c.read_keys(l, h, 0, len, out.data());
      for (float f : out) s.reads.push_back(kvq_test::bits(f));
      c.read_values(l, h, 0, len, out.data());
      for (float f : out) s.reads.push_back(kvq_test::bits(f));
    }
  }
  return s;
}

/// The kinds of kvq::error, for expectations.
enum class err { none, capacity, index, shape, argument, unsupported, other };

auto err_name(err e) -> char const* {
  switch (e) {
    case err::none:
      return "no error";
    case err::capacity:
      return "capacity_error";
    case err::index:
      return "index_error";
    case err::shape:
      return "shape_error";
    case err::argument:
      return "invalid_argument_error";
    case err::unsupported:
      return "unsupported_error";
    default:
      return "another error";
  }
}

/// Runs f and says which kvq::error it raised (and the message).
template <class F>
auto run_for_error(F&& f, std::string* message = nullptr) -> err {
  try {
    f();
  } catch (kvq::capacity_error const& e) {
    if (message) *message = e.what();
    return err::capacity;
  } catch (kvq::index_error const& e) {
    if (message) *message = e.what();
    return err::index;
  } catch (kvq::shape_error const& e) {
    if (message) *message = e.what();
    return err::shape;
  } catch (kvq::invalid_argument_error const& e) {
    if (message) *message = e.what();
    return err::argument;
  } catch (kvq::unsupported_error const& e) {
    if (message) *message = e.what();
    return err::unsupported;
  } catch (kvq::error const& e) {
    if (message) *message = e.what();
    return err::other;
  }
  return err::none;
}

// ------------------------------------------------------------------------------------------------
// Attention reference
// ------------------------------------------------------------------------------------------------

/// float64 attention of one query head over token rows k, v (decoded values) with the kernel's
/// float scale and soft-cap, and the bound of the fp32 kernel's error per channel:
///   * a logit q·k over d terms in fp32 (any summation order, SIMD or FMA) is within
///     eps_i = (d + 4) u · scale · Σ_c |q_c| (|k_c| + 2 |m_c|) + 4u |s_i| (+ 4u · softcap with
///     soft-capping), m_c the KIVI key group minimum (0 otherwise: see rules::key_offsets);
///   * the weight exp(s_i − m) is then off by a relative eta_i <= e^(eps_i + eps_max + u|s_i − m| + 8u) − 1
///     (the max m's error cancels in the normalisation up to eps_max);
///   * the running sum and Σ p·v over N tokens, and the online rescaling by exp(m_old − m_new)
///     (at most N rescales), add at most (4N + 16) u relative to Σ p |v|;
///   * f16 probabilities round each weight by max(2^-11 e_i, 2^-25) (e_i = exp(s_i − m) <= 1).
/// The bound is Σ_i p_i eta_i |v_i| + (4N + 16) u Σ_i p_i |v_i| (+ the f16 term); the test allows
/// twice that. A wrong token, head, channel, scale or rescale moves the output by O(p_i |v_i|).
/// R x in float64 (FORMATS.md §6.1 with exact arithmetic): the signs of `seed`, the butterflies
/// of each power-of-two block and 1/sqrt(n).
auto rotate_f64(std::vector<double> x, int d, std::uint64_t seed) -> std::vector<double> {
  for (int i = 0; i < d; ++i)
    if ((kvq::detail::rotation_sign_word(seed, i / 64) >> (i % 64)) & 1u) x[sz(i)] = -x[sz(i)];
  for (int o = 0; o < d;) {
    int const n = kvq::detail::rotation_block_size(d, o);
    for (int h = 1; h < n; h *= 2)
      for (int i = o; i < o + n; ++i)
        if (((i - o) & h) == 0) {
          double const a = x[sz(i)], b = x[sz(i + h)];
          x[sz(i)] = a + b;
          x[sz(i + h)] = a - b;
        }
    for (int i = o; i < o + n; ++i) x[sz(i)] /= std::sqrt(static_cast<double>(n));
    o += n;
  }
  return x;
}

struct head_reference {
  std::vector<double> out;
  std::vector<double> bound;
  bool nan = false;  ///< a NaN or +Inf logit: the kernel outputs NaN for the whole head
};

auto reference_head(std::vector<row_t const*> const& k, std::vector<row_t const*> const& k_offsets,
                    std::vector<row_t const*> const& v, row_t const& q, float scale, float softcap,
                    bool f16_probabilities) -> head_reference {
  std::size_t const d = q.size();
  head_reference r;
  r.out.assign(d, 0.0);
  r.bound.assign(d, 0.0);
  std::size_t const n = k.size();
  if (n == 0) return r;
  constexpr double u = 0x1.0p-24;
  std::vector<double> s(n), eps(n);
  double m = -std::numeric_limits<double>::infinity(), eps_max = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    double dot = 0.0, mag = 0.0;
    for (std::size_t c = 0; c < d; ++c) {
      dot += static_cast<double>(q[c]) * static_cast<double>((*k[i])[c]);
      mag += std::fabs(static_cast<double>(q[c])) *
             (std::fabs(static_cast<double>((*k[i])[c])) + 2.0 * static_cast<double>((*k_offsets[i])[c]));
    }
    double x = dot * static_cast<double>(scale);
    double e = (static_cast<double>(d) + 4.0) * u * static_cast<double>(scale) * mag + 4.0 * u * std::fabs(x);
    if (softcap > 0.0f) {
      x = static_cast<double>(softcap) * std::tanh(x / static_cast<double>(softcap));
      e += 4.0 * u * static_cast<double>(softcap);
    }
    if (std::isnan(x) || x == std::numeric_limits<double>::infinity()) r.nan = true;
    s[i] = x;
    eps[i] = e;
    m = std::max(m, x);
    eps_max = std::max(eps_max, e);
  }
  if (r.nan) return r;
  std::vector<double> w(n);
  double z = 0.0;
  for (std::size_t i = 0; i < n; ++i) z += (w[i] = std::exp(s[i] - m));
  for (std::size_t i = 0; i < n; ++i) {
    double const p = w[i] / z;
    double const eta = std::expm1(eps[i] + eps_max + u * std::fabs(s[i] - m) + 8.0 * u);
    double const f16_term = f16_probabilities ? std::max(w[i] * 0x1.0p-11, 0x1.0p-25) / z : 0.0;
    for (std::size_t c = 0; c < d; ++c) {
      double const vc = static_cast<double>((*v[i])[c]);
      r.out[c] += p * vc;
      r.bound[c] += (p * (eta + (4.0 * static_cast<double>(n) + 16.0) * u) + f16_term) * std::fabs(vc);
    }
  }
  return r;
}

// ------------------------------------------------------------------------------------------------
// The driver of one iteration
// ------------------------------------------------------------------------------------------------

struct iteration_log {
  std::vector<std::string> ops;
  void add(std::string s) { ops.push_back(std::move(s)); }
  auto tail(std::size_t n) const -> std::string {
    std::string out;
    std::size_t const from = ops.size() > n ? ops.size() - n : 0;
    if (from > 0) out += "  ... " + std::to_string(from) + " earlier operations\n";
    for (std::size_t i = from; i < ops.size(); ++i) out += "  #" + std::to_string(i) + " " + ops[i] + "\n";
    return out;
  }
};

/// Counts of what an iteration did (printed once at the end of the test).
struct tally {
  std::int64_t iterations = 0, ops = 0, invalid = 0, appends = 0, reads = 0, attention = 0, facade = 0;
};

template <class Choice>
class driver {
 public:
  using K = key_of<Choice>;
  using V = value_of<Choice>;
  using cache_t = kvq::QuantizedKVCache<Choice>;
  using options_t = typename cache_t::options;
  using key_rules = rules<K, false>;
  using value_rules = rules<V, true>;
  static constexpr bool uses_residual = is_tile<K> || is_kivi_value<V>::value;
  static constexpr int residual_group = std::max(group_of<K>(), group_of<V>());  // both divide 32 or are 16

  driver(rng& r, iteration_log& log, tally& t) : r_(r), log_(log), tally_(t) {}

  void run() {
    construction_errors();
    pick_shape();
    cache_ = std::make_unique<cache_t>(shape_, opt_);
    twin_ = std::make_unique<cache_t>(shape_, opt_);
    std::string const kn = facade_name<K>(), vn = facade_name<V>();
    auto const pairs = kvq::supported_codec_pairs();
    bool const supported = !kn.empty() && !vn.empty() && std::any_of(pairs.begin(), pairs.end(), [&](auto const& p) {
      return p.first == kn && p.second == vn;
    });
    if (supported && r_.chance(0.5)) {
      kvq::any_cache_options ao;
      ao.residual = opt_.residual;
      if constexpr (std::is_same_v<typename K::params_type, kvq::fp8_params>) ao.key_fp8 = opt_.key;
      if constexpr (std::is_same_v<typename V::params_type, kvq::fp8_params>) ao.value_fp8 = opt_.value;
      if (r_.chance(0.5)) {
        facade_ = kvq::make_any_cache(shape_, kn, vn, ao);
      } else {
        std::vector<std::pair<std::string, std::string>> per_layer(sz(shape_.layers), {kn, vn});
        facade_ = kvq::make_any_cache(shape_, per_layer, ao);
      }
      log_.add("facade " + kn + "/" + vn);
      ++tally_.facade;
    }
    model_.assign(sz(shape_.layers), std::vector<std::pair<stream, stream>>(sz(shape_.kv_heads)));
    expect(cache_->memory().total_bytes == kvq::plan_memory<Choice>(shape_, opt_.residual).total_bytes,
           "memory() differs from plan_memory");
    int const ops = r_.range_int(10, 40);
    for (int i = 0; i < ops; ++i) {
      ++tally_.ops;
      step();
      if (r_.chance(0.15)) check_all();
    }
    check_all();
  }

 private:
  // ---- setup ------------------------------------------------------------------------------------

  void construction_errors() {
    if (!r_.chance(0.25)) return;
    kvq::cache_shape bad{1, 1, 32, 64};
    switch (r_.below(5)) {
      case 0:
        bad.layers = r_.pick(std::vector<int>{0, -1, std::numeric_limits<int>::min()});
        break;
      case 1:
        bad.kv_heads = r_.pick(std::vector<int>{0, -3});
        break;
      case 2:
        bad.head_dim = r_.pick(std::vector<int>{0, -8, 65537, std::numeric_limits<int>::max()});
        break;
      case 3:
        bad.capacity = r_.pick(std::vector<std::int64_t>{0, -5, (std::int64_t{1} << 40) + 1, i64_min});
        break;
      default:
        bad = {1 << 20, 1 << 20, 65536, std::int64_t{1} << 40};
        break;  // beyond size_t
    }
    log_.add("construct an invalid shape");
    expect(run_for_error([&] { cache_t c(bad); }) == err::argument, "constructor: invalid shape not refused");
    expect(run_for_error([&] { (void)kvq::plan_memory<Choice>(bad); }) == err::argument,
           "plan_memory: invalid shape not refused");
    if constexpr (uses_residual) {
      options_t o;
      o.residual = r_.pick(std::vector<int>{-residual_group, residual_group + 1, 31, 1});
      log_.add("construct with residual " + std::to_string(o.residual));
      expect(run_for_error([&] { cache_t c({1, 1, 32, 64}, o); }) == err::argument, "constructor: bad residual");
      expect(run_for_error([&] {
               (void)kvq::plan_memory<Choice>({1, 1, 32, 64}, o.residual);
             }) == err::argument,
             "plan_memory: bad residual");
    }
    if constexpr (std::is_same_v<typename K::params_type, kvq::fp8_params>) {
      options_t o;
      o.key.scale = r_.pick(std::vector<float>{0.0f, -1.0f, nan_f, inf_f});
      log_.add("construct with fp8 key scale " + std::to_string(o.key.scale));
      expect(run_for_error([&] { cache_t c({1, 1, 32, 64}, o); }) == err::argument, "constructor: bad fp8 scale");
    }
    std::string const kn = facade_name<K>(), vn = facade_name<V>();
    auto const pairs = kvq::supported_codec_pairs();
    bool const in_facade =
        std::find(pairs.begin(), pairs.end(), std::pair<std::string_view, std::string_view>(kn, vn)) != pairs.end();
    if (in_facade) {
      expect(run_for_error([&] { (void)kvq::make_any_cache(bad, kn, vn); }) == err::argument,
             "make_any_cache: invalid shape not refused");
      if (bad.layers >= 0 && bad.layers < 4) {
        std::vector<std::pair<std::string, std::string>> per(sz(bad.layers), {kn, vn});
        expect(run_for_error([&] { (void)kvq::make_any_cache(bad, per); }) == err::argument,
               "make_any_cache (per layer): invalid shape not refused");
      }
    }
  }

  void pick_shape() {
    static std::vector<int> const dims = {1, 2, 7, 8, 16, 31, 32, 33, 40, 64, 80, 96, 128, 160};
    shape_.layers = r_.range_int(1, 3);
    shape_.kv_heads = r_.range_int(1, 3);
    shape_.head_dim = r_.pick(dims);
    shape_.capacity = r_.chance(0.3) ? r_.range(1, 40) : r_.range(40, 200);
    if constexpr (uses_residual) {
      opt_.residual = residual_group * r_.range_int(0, 4);
    } else {
      opt_.residual = r_.range_int(-5, 200);  // ignored
    }
    auto fp8 = [&] {
      kvq::fp8_params p;
      p.scale = r_.pick(std::vector<float>{1.0f, 1.0f, 0.5f, 0.03125f, 3.0f, 1e-3f});
      p.overflow = r_.chance(0.3) ? kvq::fp8_overflow::no_saturate : kvq::fp8_overflow::saturate;
      return p;
    };
    if constexpr (std::is_same_v<typename K::params_type, kvq::fp8_params>) opt_.key = fp8();
    if constexpr (std::is_same_v<typename V::params_type, kvq::fp8_params>) opt_.value = fp8();
    style_.magnitude = std::pow(10.0, r_.uniform() * 4.0 - 2.0);
    style_.special = r_.chance(0.2);
    style_.constant_channel = r_.chance(0.3);
    style_.extreme_channel = r_.chance(0.1);
    std::ostringstream s;
    s << "shape {" << shape_.layers << ", " << shape_.kv_heads << ", " << shape_.head_dim << ", " << shape_.capacity
      << "} R " << opt_.residual << " magnitude " << style_.magnitude << (style_.special ? " special" : "")
      << (style_.extreme_channel ? " extreme channel 0" : "");
    log_.add(s.str());
  }

  // ---- one random operation ---------------------------------------------------------------------

  void step() {
    bool const invalid = r_.chance(0.3);
    if (invalid) ++tally_.invalid;
    switch (r_.below(invalid ? 6 : 10)) {
      case 0:
      case 1:
      case 2:
        append(invalid);
        break;
      case 3:
        read(invalid);
        break;
      case 4:
        if (invalid) {
          attention_invalid();
        } else {
          truncate();
        }
        break;
      case 5:
        if (invalid) {
          misc_invalid();
        } else {
          shift();
        }
        break;
      case 6:
      case 7:
        attention();
        break;
      case 8:
        append(false);
        break;
      default:
        if (r_.chance(0.15)) {
          reset();
        } else {
          read(false);
        }
        break;
    }
  }

  // ---- appends ----------------------------------------------------------------------------------

  /// Random rows (tokens, kv_heads, head_dim), rounded to T.
  template <class T>
  auto random_rows(std::int64_t n) -> std::vector<std::vector<row_t>> {
    std::vector<std::vector<row_t>> rows(sz(n), std::vector<row_t>(sz(shape_.kv_heads), row_t(sz(shape_.head_dim))));
    for (auto& t : rows)
      for (auto& h : t)
        for (int c = 0; c < shape_.head_dim; ++c) h[sz(c)] = kvq::to_f32(from_f32<T>(draw_value(r_, style_, c)));
    return rows;
  }

  /// Calls f.template operator()<T>() for an element type T drawn from float, f16 and bf16.
  template <class F>
  void with_random_element(F&& f) {
    switch (r_.below(3)) {
      case 0:
        f.template operator()<float>();
        break;
      case 1:
        f.template operator()<f16>();
        break;
      default:
        f.template operator()<bf16>();
        break;
    }
  }

  void append(bool invalid) {
    with_random_element([&]<class T>() { append_as<T>(invalid); });
  }

  template <class T>
  void append_as(bool invalid) {
    ++tally_.appends;
    int const l = r_.range_int(0, shape_.layers - 1);
    std::int64_t const len = cache_->size(l);
    std::int64_t const room = shape_.capacity - len;
    std::int64_t n = 0;
    if (room > 0) n = r_.chance(0.4) ? r_.range(0, std::min<std::int64_t>(room, 3)) : r_.range(0, room);
    auto const kr = random_rows<T>(n);
    auto const vr = random_rows<T>(n);
    auto k = make_tensor<T>(kr, shape_.kv_heads, shape_.head_dim, r_);
    auto v = make_tensor<T>(vr, shape_.kv_heads, shape_.head_dim, r_);
    std::ostringstream s;
    s << "append " << type_name<T>() << " layer " << l << " tokens " << n << " (key strides " << k.ts << ", " << k.hs
      << "; value strides " << v.ts << ", " << v.hs << ")";
    if (invalid) {
      invalid_append(l, k, v, s.str());
      return;
    }
    log_.add(s.str());
    cache_->append(l, k.view(), v.view());
    if (facade_) facade_->append(l, k.view(), v.view());
    // The twin: the same tokens in other chunks, each chunk in its own (dense) layout.
    std::int64_t first = 0;
    while (first < n) {
      std::int64_t const c = r_.chance(0.5) ? 1 : r_.range(1, n - first);
      std::vector<std::vector<row_t>> kc(kr.begin() + first, kr.begin() + first + c);
      std::vector<std::vector<row_t>> vc(vr.begin() + first, vr.begin() + first + c);
      auto const kt = make_tensor<T>(kc, shape_.kv_heads, shape_.head_dim, r_);
      auto const vt = make_tensor<T>(vc, shape_.kv_heads, shape_.head_dim, r_);
      twin_->append(l, kt.view(), vt.view());
      first += c;
    }
    for (std::int64_t t = 0; t < n; ++t)
      for (int h = 0; h < shape_.kv_heads; ++h) {
        auto& m = model_[sz(l)][sz(h)];
        key_rules::push(m.first, kr[sz(t)][sz(h)], opt_.residual);
        value_rules::push(m.second, vr[sz(t)][sz(h)], opt_.residual);
      }
    check_layer(l);
  }

  template <class T>
  void invalid_append(int l, tensor<T>& k, tensor<T>& v, std::string const& base) {
    std::int64_t const len = cache_->size(l);
    err want = err::shape;
    std::string what;
    int layer = l;
    kvq::kv_tensor<T> kv = k.view(), vv = v.view();
    std::vector<T> extra(16, from_f32<T>(1.0f));
    switch (r_.below(9)) {
      case 0:
        layer = r_.pick(std::vector<int>{-1, shape_.layers, std::numeric_limits<int>::min()});
        want = err::index;
        what = "bad layer " + std::to_string(layer);
        break;
      case 1:
        (r_.chance(0.5) ? kv : vv).kv_heads = shape_.kv_heads + r_.range_int(1, 2);
        what = "kv_heads mismatch";
        break;
      case 2:
        (r_.chance(0.5) ? kv : vv).head_dim = shape_.head_dim + r_.pick(std::vector<int>{-1, 1, 7});
        what = "head_dim mismatch";
        break;
      case 3:
        kv.tokens = vv.tokens = r_.pick(std::vector<std::int64_t>{-1, i64_min});
        what = "negative token count";
        break;
      case 4: {
        auto& x = r_.chance(0.5) ? kv : vv;
        x.data = nullptr;
        x.tokens = kv.tokens = vv.tokens = std::max<std::int64_t>(x.tokens, 1);
        if (kv.tokens > shape_.capacity - len) want = err::shape;  // null data is checked first
        what = "null data";
        break;
      }
      case 5: {
        // Values valid on their own (dense, in `extra`) but one token more than the keys.
        vv.tokens = kv.tokens + 1;
        vv.head_stride = shape_.head_dim;
        vv.token_stride = static_cast<std::int64_t>(shape_.head_dim) * shape_.kv_heads;
        extra.assign(sz(vv.tokens * vv.token_stride + 1), from_f32<T>(1.0f));
        vv.data = extra.data();
        what = "unequal token counts";
        break;
      }
      case 6: {
        auto& x = r_.chance(0.5) ? kv : vv;
        x.tokens = kv.tokens = vv.tokens = std::max<std::int64_t>(x.tokens, 2);
        if (x.data == nullptr) x.data = extra.data();
        if (r_.chance(0.5)) {
          x.token_stride = -std::max<std::int64_t>(x.token_stride, 1);
          what = "negative stride";
        } else if (shape_.kv_heads > 1 && r_.chance(0.5)) {
          x.token_stride = shape_.head_dim;
          x.head_stride = shape_.head_dim;
          what = "overlapping strides";
        } else {
          x.token_stride = r_.pick(std::vector<std::int64_t>{i64_max, std::int64_t{1} << 62, i64_max - 5});
          x.head_stride = shape_.head_dim;
          what = "strides beyond the address space";
        }
        break;
      }
      case 7: {
        if (shape_.head_dim < 2) return;
        auto& x = r_.chance(0.5) ? kv : vv;
        x.tokens = kv.tokens = vv.tokens = std::max<std::int64_t>(x.tokens, 1);
        if (x.data == nullptr) x.data = extra.data();
        if (shape_.kv_heads < 2) {
          x.tokens = kv.tokens = vv.tokens = 2;
          x.token_stride = shape_.head_dim - 1;
        } else {
          x.head_stride = shape_.head_dim - 1;
          x.token_stride = static_cast<std::int64_t>(shape_.head_dim) * shape_.kv_heads * 4;
        }
        what = "rows overlapping by one element";
        break;
      }
      default: {
        // Past the capacity: a valid pair of tensors with too many tokens.
        std::int64_t const n = shape_.capacity - len + r_.range(1, 3);
        auto const kr = random_rows<T>(n);
        k = make_tensor<T>(kr, shape_.kv_heads, shape_.head_dim, r_);
        v = make_tensor<T>(kr, shape_.kv_heads, shape_.head_dim, r_);
        kv = k.view();
        vv = v.view();
        want = err::capacity;
        what = "past the capacity (" + std::to_string(n) + " tokens)";
        break;
      }
    }
    log_.add(base + ", invalid: " + what);
    auto const before = take_snapshot(*cache_);
    std::string msg;
    err const got = run_for_error([&] { cache_->append(layer, kv, vv); }, &msg);
    expect(got == want, std::string("append (") + what + "): expected " + err_name(want) + ", got " + err_name(got) +
                            " '" + msg + "'");
    expect(take_snapshot(*cache_) == before, "append (" + what + "): a failed append changed the cache");
    if (facade_) {
      auto const fb = take_snapshot_any(*facade_);
      err const fg = run_for_error([&] { facade_->append(layer, kv, vv); });
      expect(fg == want,
             std::string("facade append (") + what + "): expected " + err_name(want) + ", got " + err_name(fg));
      expect(take_snapshot_any(*facade_) == fb, "facade append (" + what + "): a failed append changed the cache");
    }
  }

  // ---- reads ------------------------------------------------------------------------------------

  void read(bool invalid) {
    ++tally_.reads;
    with_random_element([&]<class T>() { read_as<T>(invalid); });
  }

  template <class T>
  void read_as(bool invalid) {
    int l = r_.range_int(0, shape_.layers - 1);
    int h = r_.range_int(0, shape_.kv_heads - 1);
    bool keys = r_.chance(0.5);
    std::int64_t const len = cache_->size(l);
    int const d = shape_.head_dim;
    std::int64_t first = r_.range(0, len);
    std::int64_t count = r_.range(0, len - first);
    std::int64_t stride = r_.pick(std::vector<std::int64_t>{0, 0, d, d + 1, d + 5, 3 * d});
    T* out_ptr = nullptr;
    err want = err::none;
    std::string what;
    if (invalid) {
      switch (r_.below(7)) {
        case 0:
          l = r_.pick(std::vector<int>{-1, shape_.layers, std::numeric_limits<int>::max()});
          want = err::index;
          what = "bad layer";
          break;
        case 1:
          h = r_.pick(std::vector<int>{-1, shape_.kv_heads});
          want = err::index;
          what = "bad head";
          break;
        case 2: {
          auto const bad = r_.pick(std::vector<std::pair<std::int64_t, std::int64_t>>{{-1, 1},
                                                                                      {len, 1},
                                                                                      {0, len + 1},
                                                                                      {1, -1},
                                                                                      {i64_max, 1},
                                                                                      {i64_min, -1},
                                                                                      {len + 5, 0},
                                                                                      {0, i64_max},
                                                                                      {i64_max, i64_max},
                                                                                      {-3, i64_min}});
          first = bad.first;
          count = bad.second;
          want = err::index;
          what = "range [" + std::to_string(first) + " + " + std::to_string(count) + "]";
          break;
        }
        case 3:
          stride = r_.pick(std::vector<std::int64_t>{-1, d - 1, i64_min});
          if (stride == 0) stride = -1;
          want = err::shape;
          what = "stride " + std::to_string(stride);
          break;
        case 4:
          if (count == 0) {
            if (len == 0) return;
            first = 0;
            count = len;
          }
          want = err::shape;
          what = "null output";
          break;
        case 5:
          if (len < 2) return;
          first = 0;
          count = 2;
          stride = r_.pick(std::vector<std::int64_t>{i64_max, i64_max / 2, std::int64_t{1} << 62});
          want = err::shape;
          what = "rows beyond the address space";
          break;
        default:
          if (len == 0) return;
          first = 0;
          count = len;
          l = shape_.layers + 7;
          want = err::index;
          what = "bad layer and valid range";
          break;
      }
    }
    std::int64_t const s = stride == 0 ? d : stride;
    std::size_t size = 8;
    if (want == err::none && count > 0) size = sz((count - 1) * s + d) + 8;
    T const sentinel = from_f32<T>(-1234.5f);
    std::vector<T> out(size, sentinel);
    if (what != "null output") out_ptr = out.data();
    std::ostringstream msg;
    msg << (keys ? "read_keys " : "read_values ") << type_name<T>() << " layer " << l << " head " << h << " [" << first
        << " + " << count << "] stride " << stride << (invalid ? ", invalid: " + what : "");
    log_.add(msg.str());
    auto call = [&] {
      if (keys) {
        cache_->read_keys(l, h, first, count, out_ptr, stride);
      } else {
        cache_->read_values(l, h, first, count, out_ptr, stride);
      }
    };
    if (want != err::none) {
      auto const before = take_snapshot(*cache_);
      std::string m;
      err const got = run_for_error(call, &m);
      expect(got == want,
             "read (" + what + "): expected " + err_name(want) + ", got " + err_name(got) + " '" + m + "'");
      expect(take_snapshot(*cache_) == before, "read (" + what + "): a failed read changed the cache");
      expect(std::all_of(out.begin(), out.end(), [&](T x) { return elem_bits(x) == elem_bits(sentinel); }),
             "read (" + what + "): a failed read wrote its output");
      if (facade_ && std::is_same_v<T, float>) {
        std::vector<float> fo(out.size(), -1234.5f);
        float* fp = out_ptr == nullptr ? nullptr : fo.data();
        err const fg = run_for_error([&] {
          if (keys) {
            facade_->read_keys(l, h, first, count, fp, stride);
          } else {
            facade_->read_values(l, h, first, count, fp, stride);
          }
        });
        expect(fg == want, "facade read (" + what + "): expected " + err_name(want) + ", got " + err_name(fg));
        expect(std::all_of(fo.begin(), fo.end(), [](float x) { return x == -1234.5f; }),
               "facade read (" + what + "): a failed read wrote its output");
      }
      return;
    }
    call();
    auto const& m = model_[sz(l)][sz(h)];
    for (std::int64_t i = 0; i < count; ++i) {
      row_t const want_row = keys ? key_rules::decoded(m.first, first + i, d, opt_.key)
                                  : value_rules::decoded(m.second, first + i, d, opt_.value);
      for (int c = 0; c < d; ++c) {
        T const g = out[sz(i * s + c)];
        T const w = from_f32<T>(want_row[sz(c)]);
        if (!same_elem(g, w)) {
          std::ostringstream e;
          e << "read: token " << first + i << " channel " << c << " got bits 0x" << std::hex << elem_bits(g)
            << ", want 0x" << elem_bits(w) << std::dec << " (" << want_row[sz(c)] << ")";
          throw mismatch{e.str()};
        }
      }
      for (std::int64_t c = d; c < s && i * s + c < static_cast<std::int64_t>(out.size()); ++c)
        if (elem_bits(out[sz(i * s + c)]) != elem_bits(sentinel)) throw mismatch{"read: wrote between rows"};
    }
    for (std::size_t i = count > 0 ? sz((count - 1) * s + d) : 0; i < out.size(); ++i)
      if (elem_bits(out[i]) != elem_bits(sentinel)) throw mismatch{"read: wrote past the last row"};
    if (facade_ && std::is_same_v<T, float>) {
      std::vector<float> fo(out.size(), -1234.5f);
      if (keys) {
        facade_->read_keys(l, h, first, count, fo.data(), stride);
      } else {
        facade_->read_values(l, h, first, count, fo.data(), stride);
      }
      for (std::size_t i = 0; i < fo.size(); ++i)
        if (!same_elem(fo[i], kvq::to_f32(out[i]))) throw mismatch{"facade read differs from the cache's"};
    }
  }

  // ---- truncate, shift, reset ---------------------------------------------------------------------

  auto max_length() const -> std::int64_t {
    std::int64_t m = 0;
    for (int l = 0; l < shape_.layers; ++l) m = std::max(m, cache_->size(l));
    return m;
  }

  void truncate() {
    std::int64_t const n = r_.range(0, max_length() + 2);
    log_.add("truncate " + std::to_string(n));
    cache_->truncate(n);
    twin_->truncate(n);
    if (facade_) facade_->truncate(n);
    for (auto& layer : model_)
      for (auto& m : layer) {
        key_rules::truncate(m.first, n, shape_.head_dim, opt_.key);
        value_rules::truncate(m.second, n, shape_.head_dim, opt_.value);
      }
    for (int l = 0; l < shape_.layers; ++l) check_layer(l);
  }

  /// The error shift_left(n) must raise, from the model.
  auto shift_error(std::int64_t n) const -> err {
    if (n < 0) return err::argument;
    if (is_tile<K> && n % group_of<K>() != 0) return err::unsupported;
    for (int l = 0; l < shape_.layers; ++l) {
      std::int64_t const len = model_[sz(l)][0].first.length();
      if (len != 0 && n > len) return err::index;
    }
    return err::none;
  }

  void shift() {
    // A valid n: at most the shortest non-empty layer, a multiple of G for KIVI keys.
    std::int64_t lim = i64_max;
    for (int l = 0; l < shape_.layers; ++l)
      if (cache_->size(l) > 0) lim = std::min(lim, cache_->size(l));
    if (lim == i64_max) lim = 0;
    std::int64_t n = r_.range(0, lim);
    if constexpr (is_tile<K>) n = n / group_of<K>() * group_of<K>();
    expect(shift_error(n) == err::none, "shift: the test picked an invalid n");
    log_.add("shift_left " + std::to_string(n));
    cache_->shift_left(n);
    twin_->shift_left(n);
    if (facade_) facade_->shift_left(n);
    for (auto& layer : model_)
      for (auto& m : layer) {
        key_rules::shift(m.first, n);
        value_rules::shift(m.second, n);
      }
    for (int l = 0; l < shape_.layers; ++l) check_layer(l);
  }

  void reset() {
    log_.add("reset");
    cache_->reset();
    twin_->reset();
    if (facade_) facade_->reset();
    for (auto& layer : model_)
      for (auto& m : layer) m = {};
    check_all();
  }

  void misc_invalid() {
    auto const before = take_snapshot(*cache_);
    std::optional<snapshot> fbefore;
    if (facade_) fbefore = take_snapshot_any(*facade_);
    err want = err::none, got = err::none, fgot = err::none;
    bool facade_called = false;
    std::string what, m;
    switch (r_.below(6)) {
      case 0: {
        std::int64_t const n = r_.pick(std::vector<std::int64_t>{-1, -100, i64_min});
        what = "truncate " + std::to_string(n);
        want = err::argument;
        got = run_for_error([&] { cache_->truncate(n); }, &m);
        if (facade_) fgot = run_for_error([&] { facade_->truncate(n); });
        facade_called = true;
        break;
      }
      case 1: {
        std::int64_t n = r_.pick(
            std::vector<std::int64_t>{-1, i64_min, 1, 3, 17, 31, 33, max_length() + 1, max_length() + 32, i64_max});
        want = shift_error(n);
        if (want == err::none) return;
        what = "shift_left " + std::to_string(n);
        got = run_for_error([&] { cache_->shift_left(n); }, &m);
        if (facade_) fgot = run_for_error([&] { facade_->shift_left(n); });
        facade_called = true;
        break;
      }
      case 2: {
        int const l = r_.pick(std::vector<int>{-1, shape_.layers});
        int const h = r_.pick(std::vector<int>{-1, shape_.kv_heads, 0});
        what = "storage views of layer " + std::to_string(l) + " head " + std::to_string(h);
        want = err::index;
        got = run_for_error([&] { (void)cache_->key_storage(l, h); }, &m);
        expect(run_for_error([&] { (void)cache_->value_storage(l, h); }) == err::index, "value_storage: bad index");
        break;
      }
      case 3: {
        int const h = r_.pick(std::vector<int>{-1, shape_.kv_heads});
        what = "storage views of head " + std::to_string(h);
        want = err::index;
        got = run_for_error([&] { (void)cache_->key_storage(0, h); }, &m);
        break;
      }
      case 4: {
        int const l = r_.pick(std::vector<int>{-1, shape_.layers, std::numeric_limits<int>::min()});
        what = "size / nonfinite_blocks of layer " + std::to_string(l);
        want = err::index;
        got = run_for_error([&] { (void)cache_->size(l); }, &m);
        expect(run_for_error([&] { (void)cache_->nonfinite_blocks(l); }) == err::index, "nonfinite_blocks: bad layer");
        if (facade_) {
          facade_called = true;
          fgot = run_for_error([&] { (void)facade_->size(l); });
          expect(run_for_error([&] { (void)facade_->nonfinite_blocks(l); }) == err::index,
                 "facade nonfinite_blocks: bad layer");
        }
        break;
      }
      default: {
        what = "combine / finalize of mismatched partial states";
        want = err::shape;
        auto a = kvq::attention_partial::empty(2, shape_.head_dim);
        auto b = kvq::attention_partial::empty(r_.chance(0.5) ? 4 : 2, shape_.head_dim + (r_.chance(0.5) ? 1 : 0));
        if (b.q_heads == 2 && b.head_dim == shape_.head_dim) b.out.resize(1);
        got = run_for_error([&] { kvq::combine(a, b); }, &m);
        expect(run_for_error([&] { kvq::finalize(b.q_heads == 2 ? b : a, nullptr); }) == err::shape,
               "finalize: bad state or null output accepted");
        break;
      }
    }
    log_.add("invalid: " + what);
    expect(got == want, what + ": expected " + err_name(want) + ", got " + err_name(got) + " '" + m + "'");
    if (facade_ && facade_called) expect(fgot == want, "facade " + what + ": expected " + err_name(want));
    expect(take_snapshot(*cache_) == before, what + ": a failed call changed the cache");
    if (facade_) expect(take_snapshot_any(*facade_) == *fbefore, "facade " + what + ": a failed call changed it");
  }

  // ---- attention --------------------------------------------------------------------------------

  struct attention_call {
    int layer = 0;
    int q_heads = 1;
    kvq::attention_options opt;
    std::vector<float> q;
  };

  /// A valid random call; queries scaled so that the largest |logit| is a few units to ~25.
  auto random_attention() -> attention_call {
    attention_call a;
    a.layer = r_.range_int(0, shape_.layers - 1);
    int const kv = shape_.kv_heads, d = shape_.head_dim;
    a.q_heads = kv * r_.pick(std::vector<int>{1, 1, 2, 4});
    if (r_.chance(0.3)) a.opt.scale = static_cast<float>(r_.uniform() * 0.5);
    if (r_.chance(0.3)) a.opt.window = r_.range(1, 40);
    if (r_.chance(0.2)) a.opt.softcap = static_cast<float>(5.0 + 30.0 * r_.uniform());
    if (r_.chance(0.3)) a.opt.query = kvq::query_precision::q8_0;
    if (r_.chance(0.2)) a.opt.probabilities = kvq::probability_precision::f16;
    a.q.assign(sz(a.q_heads) * sz(d), 0.0f);
    std::int64_t const len = cache_->size(a.layer);
    std::int64_t const begin = a.opt.window > 0 ? std::max<std::int64_t>(0, len - a.opt.window) : 0;
    float const scale = a.opt.scale > 0.0f ? a.opt.scale : 1.0f / std::sqrt(static_cast<float>(d));
    int const group = a.q_heads / kv;
    double const target = 0.5 + 24.5 * r_.uniform();
    for (int h = 0; h < a.q_heads; ++h) {
      row_t dir(sz(d));
      for (auto& x : dir) x = static_cast<float>(r_.normal());
      double mx = 0.0;
      auto const& m = model_[sz(a.layer)][sz(h / group)];
      for (std::int64_t t = begin; t < len; ++t) {
        row_t const k = key_rules::decoded(m.first, t, d, opt_.key);
        double dot = 0.0;
        for (int c = 0; c < d; ++c) dot += static_cast<double>(dir[sz(c)]) * static_cast<double>(k[sz(c)]);
        if (std::isfinite(dot)) mx = std::max(mx, std::fabs(dot) * static_cast<double>(scale));
      }
      double const alpha = mx > 1e-30 && mx < 1e30 ? target / mx : 1.0;
      for (int c = 0; c < d; ++c) a.q[sz(h) * sz(d) + sz(c)] = static_cast<float>(alpha * dir[sz(c)]);
    }
    return a;
  }

  auto describe(attention_call const& a) const -> std::string {
    std::ostringstream s;
    s << "layer " << a.layer << " q_heads " << a.q_heads << " scale " << a.opt.scale << " window " << a.opt.window
      << " softcap " << a.opt.softcap << (a.opt.query == kvq::query_precision::q8_0 ? " q8_0-query" : "")
      << (a.opt.probabilities == kvq::probability_precision::f16 ? " f16-probabilities" : "");
    return s.str();
  }

  /// Compares an output against the float64 reference, head by head (see reference_head).
  void check_attention_output(attention_call const& a, std::vector<float> const& got, std::string const& form) {
    int const kv = shape_.kv_heads, d = shape_.head_dim, group = a.q_heads / kv;
    std::int64_t const len = cache_->size(a.layer);
    std::int64_t const begin = a.opt.window > 0 ? std::max<std::int64_t>(0, len - a.opt.window) : 0;
    float const scale = a.opt.scale > 0.0f ? a.opt.scale : 1.0f / std::sqrt(static_cast<float>(d));
    for (int kh = 0; kh < kv; ++kh) {
      auto const& m = model_[sz(a.layer)][sz(kh)];
      std::vector<row_t> keys, offsets, values;
      bool tame = true;  // every attended K and V finite and moderate: the bound applies
      // Rotated codecs: the reference works in the rotated space, as the kernels do.
      for (std::int64_t t = begin; t < len; ++t) {
        keys.push_back(key_rules::stored(m.first, t, d, opt_.key));
        offsets.push_back(key_rules::key_offsets(m.first, t, d, opt_.key));
        values.push_back(value_rules::stored(m.second, t, d, opt_.value));
        for (int c = 0; c < d; ++c)
          tame = tame && std::fabs(keys.back()[sz(c)]) < 1e6f && std::fabs(values.back()[sz(c)]) < 1e6f;
      }
      std::vector<row_t const*> kp, op, vp;
      for (auto const& x : keys) kp.push_back(&x);
      for (auto const& x : offsets) op.push_back(&x);
      for (auto const& x : values) vp.push_back(&x);
      for (int g = 0; g < group; ++g) {
        int const h = kh * group + g;
        row_t q(a.q.begin() + h * d, a.q.begin() + (h + 1) * d);
        if constexpr (kvq::rotated_codec<K>) kvq::detail::rotate_forward(q.data(), d, K::rotation_seed);
        if (a.opt.query == kvq::query_precision::q8_0) {
          std::vector<std::uint8_t> b(kvq::q8_0::geometry(d).bytes());
          kvq::q8_0::encode_row(q.data(), d, b.data());
          kvq::q8_0::decode_row(b.data(), d, q.data());
        }
        float const* o = got.data() + sz(h) * sz(d);
        if (keys.empty()) {
          for (int c = 0; c < d; ++c)
            if (o[c] != 0.0f) throw mismatch{form + ": a head attending to nothing is not zero"};
          continue;
        }
        if (!tame) continue;  // NaN/Inf/huge values: covered by test_attention's NaN/Inf rules
        auto const ref =
            reference_head(kp, op, vp, q, scale, a.opt.softcap, a.opt.probabilities == kvq::probability_precision::f16);
        if (ref.nan) continue;
        // A rotated value side: the output rotated back exactly is compared in the rotated space,
        // with the float un-rotation's rounding (log2 n + 1 rounded steps per block) added.
        std::vector<double> oc(o, o + d), extra(sz(d), 0.0);
        if constexpr (kvq::rotated_codec<V>) {
          oc = rotate_f64(oc, d, V::rotation_seed);
          for (int b0 = 0; b0 < d;) {
            int const n = kvq::detail::rotation_block_size(d, b0);
            double l1 = 0;
            for (int i = b0; i < b0 + n; ++i) l1 += std::fabs(ref.out[sz(i)]) + ref.bound[sz(i)];
            for (int i = b0; i < b0 + n; ++i) extra[sz(i)] = (std::log2(n) + 2.0) * 0x1.0p-23 * l1;
            b0 += n;
          }
        }
        for (int c = 0; c < d; ++c) {
          double const err_c = std::fabs(oc[sz(c)] - ref.out[sz(c)]);
          double const tol = 2.0 * ref.bound[sz(c)] + extra[sz(c)] + 1e-37;
          if (!(err_c <= tol)) {
            std::ostringstream e;
            e << form << " (" << describe(a) << "): head " << h << " channel " << c << " got " << oc[sz(c)]
              << ", float64 " << ref.out[sz(c)] << ", error " << err_c << " > bound " << tol;
            throw mismatch{e.str()};
          }
        }
      }
    }
  }

  void attention() {
    ++tally_.attention;
    auto const a = random_attention();
    log_.add("attention " + describe(a));
    std::size_t const n = a.q.size();
    std::vector<float> out(n + 4, -7.0f);
    kvq::decode_attention(*cache_, a.layer, a.q.data(), a.q_heads, out.data(), a.opt);
    for (std::size_t i = n; i < out.size(); ++i) expect(out[i] == -7.0f, "decode_attention wrote past its output");
    out.resize(n);
    check_attention_output(a, out, "decode_attention");
    // The split form at random token boundaries.
    std::int64_t const len = cache_->size(a.layer);
    std::int64_t const begin = a.opt.window > 0 ? std::max<std::int64_t>(0, len - a.opt.window) : 0;
    kvq::attention_options ow = a.opt;
    ow.window = 0;  // the split form takes the range itself
    std::vector<std::int64_t> cuts = {begin, len};
    int const parts = r_.range_int(0, 3);
    for (int i = 0; i < parts; ++i) cuts.push_back(r_.range(begin, len));
    std::sort(cuts.begin(), cuts.end());
    auto part = kvq::attend_range(*cache_, a.layer, a.q.data(), a.q_heads, cuts[0], cuts[1], ow);
    for (std::size_t i = 1; i + 1 < cuts.size(); ++i)
      kvq::combine(part, kvq::attend_range(*cache_, a.layer, a.q.data(), a.q_heads, cuts[i], cuts[i + 1], ow));
    std::vector<float> split(n);
    kvq::finalize(part, split.data());
    check_attention_output(a, split, "attend_range split " + std::to_string(cuts.size() - 1) + " ways");
    if (r_.chance(0.3)) {
      std::vector<float> par(n);
      kvq::decode_attention_parallel(*cache_, a.layer, a.q.data(), a.q_heads, par.data(), r_.range_int(1, 3), a.opt);
      check_attention_output(a, par, "decode_attention_parallel");
    }
    if (facade_) {
      std::vector<float> fo(n);
      facade_->attention(a.layer, a.q.data(), a.q_heads, fo.data(), a.opt);
      for (std::size_t i = 0; i < n; ++i)
        if (!same_elem(fo[i], out[i])) throw mismatch{"facade attention differs from the cache's"};
    }
  }

  void attention_invalid() {
    auto a = random_attention();
    std::vector<float> out(a.q.size() + 4, -7.0f);
    float* optr = out.data();
    float const* qptr = a.q.data();
    int layer = a.layer, q_heads = a.q_heads;
    std::int64_t begin = 0, end = cache_->size(layer);
    err want = err::shape;
    std::string what;
    bool split = false;
    switch (r_.below(7)) {
      case 0:
        layer = r_.pick(std::vector<int>{-1, shape_.layers});
        want = err::index;
        what = "bad layer";
        break;
      case 1:
        q_heads = r_.pick(std::vector<int>{0, -shape_.kv_heads, shape_.kv_heads + 1});
        if (shape_.kv_heads == 1 && q_heads > 0) q_heads = 0;
        what = "q_heads " + std::to_string(q_heads);
        break;
      case 2:
        qptr = nullptr;
        what = "null query";
        break;
      case 3:
        optr = nullptr;
        what = "null output";
        break;
      case 4:
        switch (r_.below(4)) {
          case 0:
            a.opt.scale = r_.pick(std::vector<float>{-1.0f, nan_f, inf_f});
            break;
          case 1:
            a.opt.softcap = r_.pick(std::vector<float>{-2.0f, nan_f, inf_f});
            break;
          default:
            a.opt.window = r_.pick(std::vector<std::int64_t>{-1, i64_min});
            break;
        }
        want = err::argument;
        what = "bad options";
        break;
      case 5: {
        split = true;
        auto const bad = r_.pick(std::vector<std::pair<std::int64_t, std::int64_t>>{
            {-1, end}, {0, end + 1}, {end, end - 1}, {i64_min, 0}, {0, i64_max}});
        begin = bad.first;
        end = bad.second;
        if (end < begin || begin < 0 || end > cache_->size(layer)) {
          want = err::index;
        } else {
          return;
        }
        what = "attend_range [" + std::to_string(begin) + ", " + std::to_string(end) + ")";
        break;
      }
      default:
        split = true;
        layer = shape_.layers;
        want = err::index;
        what = "attend_range bad layer";
        break;
    }
    log_.add("attention " + describe(a) + ", invalid: " + what);
    auto const before = take_snapshot(*cache_);
    std::string m;
    err const got = run_for_error(
        [&] {
          if (split) {
            (void)kvq::attend_range(*cache_, layer, qptr, q_heads, begin, end, a.opt);
          } else if (r_.chance(0.3)) {
            kvq::decode_attention_parallel(*cache_, layer, qptr, q_heads, optr, 2, a.opt);
          } else {
            kvq::decode_attention(*cache_, layer, qptr, q_heads, optr, a.opt);
          }
        },
        &m);
    expect(got == want,
           "attention (" + what + "): expected " + err_name(want) + ", got " + err_name(got) + " '" + m + "'");
    expect(std::all_of(out.begin(), out.end(), [](float x) { return x == -7.0f; }),
           "attention (" + what + "): a failed call wrote its output");
    expect(take_snapshot(*cache_) == before, "attention (" + what + "): changed the cache");
    if (facade_) {
      err const fg = run_for_error([&] {
        if (split) {
          (void)facade_->attend(layer, qptr, q_heads, begin, end, a.opt);
        } else {
          facade_->attention(layer, qptr, q_heads, optr, a.opt);
        }
      });
      expect(fg == want, "facade attention (" + what + "): expected " + err_name(want) + ", got " + err_name(fg));
      expect(std::all_of(out.begin(), out.end(), [](float x) { return x == -7.0f; }),
             "facade attention (" + what + "): a failed call wrote its output");
    }
  }

  // ---- full checks ------------------------------------------------------------------------------

  /// Bytes, counters, reads and non-finite counts of layer l against the model; the twin's live
  /// bytes against the cache's.
  void check_layer(int l) {
    expect(cache_->size(l) == model_[sz(l)][0].first.length(), "size differs from the model");
    if (facade_) expect(facade_->size(l) == cache_->size(l), "facade size differs");
    kvq::nonfinite_report want_nf;
    for (int h = 0; h < shape_.kv_heads; ++h) {
      auto const& m = model_[sz(l)][sz(h)];
      std::string const where = "layer " + std::to_string(l) + " head " + std::to_string(h);
      want_nf.key_blocks += check_stream<K, false>(cache_->key_storage(l, h), twin_->key_storage(l, h), m.first,
                                                   opt_.key, where + " keys");
      want_nf.value_blocks += check_stream<V, true>(cache_->value_storage(l, h), twin_->value_storage(l, h), m.second,
                                                    opt_.value, where + " values");
    }
    expect(cache_->nonfinite_blocks(l) == want_nf, "nonfinite_blocks differs from the model's count");
    if (facade_) expect(facade_->nonfinite_blocks(l) == want_nf, "facade nonfinite_blocks differs");
  }

  /// Checks one stream's storage view against the model and the twin's; returns the model's count
  /// of blocks with a non-finite scale.
  template <class C, bool IsValue>
  auto check_stream(kvq::storage_view const& v, kvq::storage_view const& tw, stream const& s,
                    typename C::params_type const& p, std::string const& where) -> std::int64_t {
    using R = rules<C, IsValue>;
    int const d = shape_.head_dim;
    std::int64_t const len = s.length();
    expect(v.quantized_tokens == s.quantized, where + ": quantized tokens " + std::to_string(v.quantized_tokens) +
                                                  ", model " + std::to_string(s.quantized));
    expect(v.residual_tokens == len - s.quantized, where + ": residual tokens differ");
    expect(v.unit_bytes == C::geometry(d).bytes(), where + ": unit bytes differ");
    expect(tw.quantized_tokens == v.quantized_tokens && tw.residual_tokens == v.residual_tokens &&
               tw.residual_first == v.residual_first,
           where + ": the twin (other chunks) has other counters");
    std::int64_t nonfinite = 0;
    for (std::int64_t u = 0; u < R::units(s); ++u) {
      auto const want = R::unit_bytes(s, u, d, p);
      auto const* got = reinterpret_cast<std::uint8_t const*>(v.units) + sz(u) * v.unit_bytes;
      auto const* twin = reinterpret_cast<std::uint8_t const*>(tw.units) + sz(u) * v.unit_bytes;
      if (std::memcmp(got, want.data(), want.size()) != 0) {
        std::size_t b = 0;
        while (got[b] == want[b]) ++b;
        throw mismatch{where + ": unit " + std::to_string(u) + " differs from the scalar reference at byte " +
                       std::to_string(b) + " (got " + std::to_string(got[b]) + ", want " + std::to_string(want[b]) +
                       ")"};
      }
      expect(std::memcmp(twin, want.data(), want.size()) == 0,
             where + ": the twin's unit " + std::to_string(u) + " differs (chunking changed the bytes)");
      nonfinite += count_nonfinite_scales<C>(want, d);
    }
    if (v.residual != nullptr) {
      std::int64_t const cap = std::max<std::int64_t>(v.residual_capacity, 1);
      for (std::int64_t i = 0; i < v.residual_tokens; ++i) {
        std::int64_t const slot = (v.residual_first + i) % cap;
        row_t const& want = s.src[sz(s.quantized + i)];
        for (int c = 0; c < d; ++c) {
          std::uint16_t const g = v.residual[sz(slot) * sz(d) + sz(c)].bits;
          std::uint16_t const tg = tw.residual[sz(slot) * sz(d) + sz(c)].bits;
          std::uint16_t const w = kvq::to_f16(want[sz(c)]).bits;
          if (g != w)
            throw mismatch{where + ": residual row of token " + std::to_string(s.quantized + i) + " channel " +
                           std::to_string(c) + " holds f16 bits " + std::to_string(g) + ", the model " +
                           std::to_string(w) + " (" + std::to_string(want[sz(c)]) + ")"};
          if (tg != g) throw mismatch{where + ": the twin's residual row differs"};
        }
      }
    } else {
      expect(len == s.quantized, where + ": tokens outside the quantized storage without a residual");
    }
    return nonfinite;
  }

  void check_all() {
    for (int l = 0; l < shape_.layers; ++l) check_layer(l);
    // Reads of everything, f32, against the model (sub-ranges are covered by read()).
    int const d = shape_.head_dim;
    for (int l = 0; l < shape_.layers; ++l)
      for (int h = 0; h < shape_.kv_heads; ++h) {
        std::int64_t const len = cache_->size(l);
        auto const& m = model_[sz(l)][sz(h)];
        std::vector<float> out(sz(len * d));
        cache_->read_keys(l, h, 0, len, out.data());
        for (std::int64_t t = 0; t < len; ++t) {
          row_t const want = key_rules::decoded(m.first, t, d, opt_.key);
          for (int c = 0; c < d; ++c)
            if (!same_elem(out[sz(t * d + c)], want[sz(c)]))
              throw mismatch{"full read of keys differs at token " + std::to_string(t) + " channel " +
                             std::to_string(c)};
        }
        cache_->read_values(l, h, 0, len, out.data());
        for (std::int64_t t = 0; t < len; ++t) {
          row_t const want = value_rules::decoded(m.second, t, d, opt_.value);
          for (int c = 0; c < d; ++c)
            if (!same_elem(out[sz(t * d + c)], want[sz(c)]))
              throw mismatch{"full read of values differs at token " + std::to_string(t) + " channel " +
                             std::to_string(c)};
        }
      }
    if (facade_)
      expect(take_snapshot_any(*facade_).reads == take_snapshot(*cache_).reads, "facade reads differ from the cache's");
    kvq::nonfinite_report total;
    for (int l = 0; l < shape_.layers; ++l) {
      auto const x = cache_->nonfinite_blocks(l);
      total.key_blocks += x.key_blocks;
      total.value_blocks += x.value_blocks;
    }
    expect(cache_->nonfinite_blocks() == total, "nonfinite_blocks() is not the sum over layers");
  }

  rng& r_;
  iteration_log& log_;
  tally& tally_;
  kvq::cache_shape shape_{};
  options_t opt_{};
  value_style style_{};
  std::unique_ptr<cache_t> cache_, twin_;
  std::unique_ptr<kvq::any_cache> facade_;
  std::vector<std::vector<std::pair<stream, stream>>> model_;  // [layer][head] = (keys, values)
};

// ------------------------------------------------------------------------------------------------
// Choices
// ------------------------------------------------------------------------------------------------

using choices = std::tuple<
    kvq::f32_codec, kvq::f16_codec, kvq::q8_0, kvq::q4_0, kvq::int8_sym, kvq::fp8_e4m3, kvq::fp8_e5m2, kvq::kivi<2>,
    kvq::kivi<4>, kvq::kivi<8>, kvq::kivi<4, 16>, kvq::kv_codecs<kvq::q8_0, kvq::q4_0>,
    kvq::kv_codecs<kvq::q8_0, kvq::f16_codec>, kvq::kv_codecs<kvq::f16_codec, kvq::q8_0>,
    kvq::kv_codecs<kvq::f16_codec, kvq::q4_0>, kvq::kv_codecs<kvq::int8_sym, kvq::q4_0>,
    kvq::kv_codecs<kvq::fp8_e4m3, kvq::q4_0>, kvq::kv_codecs<kvq::q8_0, kvq::kivi_value<4>>,
    kvq::kv_codecs<kvq::int8_sym, kvq::kivi_value<4>>, kvq::kv_codecs<kvq::int8_sym, kvq::kivi_value<2>>,
    kvq::kv_codecs<kvq::kivi_key<8>, kvq::kivi_value<4>>, kvq::kv_codecs<kvq::kivi_key<4>, kvq::kivi_value<2>>,
    kvq::kv_codecs<kvq::kivi_key<8>, kvq::kivi_value<2>>, kvq::kv_codecs<kvq::kivi_key<2, 16>, kvq::fp8_e5m2>,
    kvq::kv_codecs<kvq::fp8_e5m2, kvq::kivi_value<8, 16>>, kvq::rotated<kvq::q4_0>, kvq::tq4,
    kvq::kv_codecs<kvq::rotated<kvq::q8_0, 3>, kvq::tq3>>;

struct choice_entry {
  std::string name;
  void (*run)(rng&, iteration_log&, tally&);
};

template <class Choice>
void run_choice(rng& r, iteration_log& log, tally& t) {
  driver<Choice>(r, log, t).run();
}

template <class... C>
auto make_entries(std::tuple<C...> const*) -> std::vector<choice_entry> {
  return {choice_entry{choice_name<C>(), &run_choice<C>}...};
}

auto entries() -> std::vector<choice_entry> const& {
  static auto const e = make_entries(static_cast<choices const*>(nullptr));
  return e;
}

}  // namespace

TEST_CASE("random operations against a shadow model, every codec choice", "[random_ops]") {
  auto const seed = static_cast<std::uint64_t>(env_int("KVQ_RANDOM_OPS_SEED", 0x6b7671));
  std::int64_t const iterations = env_int("KVQ_RANDOM_OPS_ITERATIONS", 150);
  std::int64_t const first = env_int("KVQ_RANDOM_OPS_FIRST", 0);
  auto const& choice_list = entries();
  tally t;
  std::int64_t failures = 0;
  auto const start = std::chrono::steady_clock::now();
  for (std::int64_t i = first; i < first + iterations && failures < 5; ++i) {
    // Every iteration has its own stream, so that one can be rerun alone (KVQ_RANDOM_OPS_FIRST=i,
    // KVQ_RANDOM_OPS_ITERATIONS=1); the choices are visited in turn.
    rng r(seed ^ (0x9e3779b97f4a7c15ull * static_cast<std::uint64_t>(i + 1)));
    auto const& e = choice_list[sz(i % static_cast<std::int64_t>(choice_list.size()))];
    iteration_log log;
    ++t.iterations;
    std::string failure;
    try {
      e.run(r, log, t);
    } catch (mismatch const& m) {
      failure = m.what;
    } catch (std::exception const& x) {
      failure = std::string("unexpected exception: ") + x.what();
    }
    if (!failure.empty()) {
      ++failures;
      std::ostringstream s;
      s << "iteration " << i << " (" << e.name << "): " << failure << "\nrerun: KVQ_RANDOM_OPS_SEED=" << seed
        << " KVQ_RANDOM_OPS_FIRST=" << i << " KVQ_RANDOM_OPS_ITERATIONS=1\noperations:\n"
        << log.tail(25);
      FAIL_CHECK(s.str());
    }
  }
  double const seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "random ops: seed %llu, %lld iterations, %lld operations (%lld invalid, %lld appends, %lld reads, "
      "%lld attention), %lld with the facade, %.1f s\n",
      static_cast<unsigned long long>(seed), static_cast<long long>(t.iterations), static_cast<long long>(t.ops),
      static_cast<long long>(t.invalid), static_cast<long long>(t.appends), static_cast<long long>(t.reads),
      static_cast<long long>(t.attention), static_cast<long long>(t.facade), seconds);
  CHECK(failures == 0);
}
