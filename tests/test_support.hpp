// Helpers shared by kvq's tests: golden-vector loading, hex parsing, bit comparisons, seeded data.
#pragma once

#include <kvq/detail/numeric.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvq_test {

/// Loads a JSON file from the golden test-vector directory, or throws naming the missing path.
inline auto load_testvectors(std::string const& file) -> nlohmann::json {
  std::string const path = std::string(KVQ_TESTVECTORS_DIR) + "/" + file;
  std::ifstream in(path);
  if (!in) throw std::runtime_error("golden test vectors not found: " + path + " (set KVQ_TESTVECTORS_DIR)");
  return nlohmann::json::parse(in);
}

/// Parses "3f800000" (8 hex digits of the binary32 bits) into the float.
inline auto f32_from_hex(std::string const& s) -> float {
  return std::bit_cast<float>(static_cast<std::uint32_t>(std::stoul(s, nullptr, 16)));
}

/// Parses a hex byte string ("0a1b...") into bytes.
inline auto bytes_from_hex(std::string const& s) -> std::vector<std::uint8_t> {
  std::vector<std::uint8_t> out(s.size() / 2);
  for (std::size_t i = 0; i < out.size(); ++i)
    out[i] = static_cast<std::uint8_t>(std::stoul(s.substr(2 * i, 2), nullptr, 16));
  return out;
}

/// Formats bytes as lowercase hex (for readable failure messages).
inline auto hex(std::vector<std::uint8_t> const& b) -> std::string {
  static char const* digits = "0123456789abcdef";
  std::string s;
  for (auto v : b) {
    s += digits[v >> 4];
    s += digits[v & 15];
  }
  return s;
}

/// Bit pattern of a float.
inline auto bits(float x) -> std::uint32_t { return std::bit_cast<std::uint32_t>(x); }

/// True when both are NaN, or both have identical bits.
inline auto same_value(float a, float b) -> bool { return (std::isnan(a) && std::isnan(b)) || bits(a) == bits(b); }

/// The same for binary16: a NaN's sign and payload come from the arithmetic that made it, which
/// differs between processors (x86's default NaN is negative, a GPU's positive), so any two NaNs match.
inline auto same_value(kvq::f16 a, kvq::f16 b) -> bool {
  auto const nan = [](kvq::f16 h) { return (h.bits & 0x7c00u) == 0x7c00u && (h.bits & 0x03ffu) != 0; };
  return (nan(a) && nan(b)) || a.bits == b.bits;
}

/// The same for bfloat16.
inline auto same_value(kvq::bf16 a, kvq::bf16 b) -> bool {
  auto const nan = [](kvq::bf16 h) { return (h.bits & 0x7f80u) == 0x7f80u && (h.bits & 0x007fu) != 0; };
  return (nan(a) && nan(b)) || a.bits == b.bits;
}

/// The raw bits of an element (float, kvq::f16 or kvq::bf16), for bit-exact comparisons.
template <class T>
auto elem_bits(T x) -> std::uint32_t {
  if constexpr (std::is_same_v<T, float>) {
    return std::bit_cast<std::uint32_t>(x);
  } else {
    return x.bits;
  }
}

/// Rounds a float to the element type (round to nearest even).
template <class T>
auto from_f32(float x) -> T {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, kvq::f16>) {
    return kvq::to_f16(x);
  } else {
    return kvq::to_bf16(x);
  }
}

/// A seeded splitmix64 stream with uniform and normal draws: the same numbers on every standard
/// library (std::*_distribution are not portable, so pinned bounds could not use them).
class rng {
 public:
  explicit rng(std::uint64_t seed) : s_(seed) {}
  /// The next 64 bits.
  auto next() -> std::uint64_t {
    std::uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  /// Uniform in (0, 1).
  auto uniform() -> double { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; }
  /// Uniform integer in [0, n), n > 0.
  auto below(std::int64_t n) -> std::int64_t {
    return static_cast<std::int64_t>(next() % static_cast<std::uint64_t>(n));
  }
  /// Uniform integer in [lo, hi].
  auto range(std::int64_t lo, std::int64_t hi) -> std::int64_t { return lo + below(hi - lo + 1); }
  /// Uniform int in [lo, hi].
  auto range_int(int lo, int hi) -> int { return static_cast<int>(range(lo, hi)); }
  /// True with probability p.
  auto chance(double p) -> bool { return uniform() < p; }
  /// A uniformly chosen element of a non-empty vector.
  template <class T>
  auto pick(std::vector<T> const& v) -> T const& {
    return v[static_cast<std::size_t>(below(static_cast<std::int64_t>(v.size())))];
  }
  /// N(0, 1) by Box-Muller; each pair of uniforms gives two normals.
  auto normal() -> double {
    if (have_spare_) {
      have_spare_ = false;
      return spare_;
    }
    double const r = std::sqrt(-2.0 * std::log(uniform()));
    double const a = 6.283185307179586 * uniform();
    spare_ = r * std::sin(a);
    have_spare_ = true;
    return r * std::cos(a);
  }

 private:
  std::uint64_t s_;
  double spare_ = 0.0;
  bool have_spare_ = false;
};

/// Seeded N(0, 1) data.
inline auto normal_data(std::size_t n, std::uint32_t seed, float sigma = 1.0f) -> std::vector<float> {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

/// Seeded KV-like rows: N(0, 1) with a few channels 5-20x larger ("outlier channels"); (rows, dim).
inline auto outlier_rows(int rows, int dim, std::uint32_t seed) -> std::vector<float> {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> gain(static_cast<std::size_t>(dim), 1.0f);
  for (int c = 3; c < dim; c += 37) gain[static_cast<std::size_t>(c)] = 5.0f + static_cast<float>((c * 7) % 16);
  std::vector<float> v(static_cast<std::size_t>(rows) * static_cast<std::size_t>(dim));
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < dim; ++c)
      v[static_cast<std::size_t>(r) * static_cast<std::size_t>(dim) + static_cast<std::size_t>(c)] =
          dist(rng) * gain[static_cast<std::size_t>(c)];
  return v;
}

}  // namespace kvq_test
