// Exhaustive check of the FP8 encoders: all 2^32 float32 bit patterns, E4M3FN and E5M2, both overflow
// modes, against an independent rule written here from the format definition (no bit tricks):
//   the nearest value among the format's finite magnitudes, computed exactly in double, ties to the even
//   code, with one virtual value past the max (the next value of the exponent range, 480 or 2^16);
//   choosing the virtual value, or a ±Inf input, is an overflow, which the mode turns into ±max finite
//   (saturate) or 0x7f|sign / 0x7c|sign (no saturate); NaN gives 0x7f; the sign is OR'ed in otherwise.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "catch_compat.hpp"
#include "kvq/codec/fp8.hpp"

namespace {

/// The finite magnitudes of an fp8 format in code order (which is value order), plus the virtual next one.
struct reference_format {
  char const* name;
  int mbits;
  int bias;
  int finite_codes;             // codes 0 .. finite_codes - 1 are the finite magnitudes
  std::uint8_t nosat_overflow;  // no-saturate overflow code (before the sign)
  std::vector<double> value;    // finite_codes + 1 values; the last is the virtual next value
  std::vector<double> mid;      // finite_codes midpoints: mid[k] = (value[k] + value[k + 1]) / 2, exact

  reference_format(char const* n, int m, int b, int finite, std::uint8_t overflow)
      : name(n), mbits(m), bias(b), finite_codes(finite), nosat_overflow(overflow) {
    for (int k = 0; k <= finite_codes; ++k) value.push_back(magnitude(k));
    for (int k = 0; k < finite_codes; ++k) mid.push_back((value[k] + value[k + 1]) / 2);
  }

  /// Value of magnitude code k, by definition: m * 2^(1-bias-mbits) if e = 0, else (1 + m/2^mbits) * 2^(e-bias).
  auto magnitude(int k) const -> double {
    int const e = k >> mbits;
    int const m = k & ((1 << mbits) - 1);
    return e == 0 ? std::ldexp(m, 1 - bias - mbits) : std::ldexp((1 << mbits) + m, e - bias - mbits);
  }

  auto max_code() const -> std::uint8_t { return static_cast<std::uint8_t>(finite_codes - 1); }

  /// Magnitude code of the nearest value to |x| (ties to even code); finite_codes means overflow.
  auto nearest(std::uint32_t abs_bits) const -> int {
    if (abs_bits == 0x7f800000u) return finite_codes;  // ±Inf is beyond every value
    float f;
    std::memcpy(&f, &abs_bits, 4);
    double const a = f;
    auto const j = static_cast<int>(std::upper_bound(mid.begin(), mid.end(), a) - mid.begin());  // mids <= a
    if (j > 0 && mid[static_cast<std::size_t>(j - 1)] == a && (j - 1) % 2 == 0) return j - 1;    // tie -> even
    return j;
  }

  /// Expected code of the input with sign bit `sign` (0 or 0x80) whose magnitude rounds to `k`.
  auto code(int k, std::uint8_t sign, bool saturate) const -> std::uint8_t {
    if (k == finite_codes) return static_cast<std::uint8_t>(sign | (saturate ? max_code() : nosat_overflow));
    return static_cast<std::uint8_t>(sign | k);
  }
};

struct mismatch_log {
  std::uint64_t count[2][2] = {};  // [format][saturate]
  std::uint32_t first[2][2] = {};
};

}  // namespace

TEST_CASE("fp8 exhaustive: the reference tables follow the format definition", "[fp8][exhaustive]") {
  reference_format const e4m3("e4m3fn", 3, 7, 127, 0x7f);
  reference_format const e5m2("e5m2", 2, 15, 124, 0x7c);
  CHECK(e4m3.value[126] == 448.0);
  CHECK(e4m3.value[127] == 480.0);
  CHECK(e4m3.mid[126] == 464.0);
  CHECK(e4m3.value[1] == std::ldexp(1.0, -9));
  CHECK(e4m3.value[8] == std::ldexp(1.0, -6));
  CHECK(e5m2.value[123] == 57344.0);
  CHECK(e5m2.value[124] == 65536.0);
  CHECK(e5m2.mid[123] == 61440.0);
  CHECK(e5m2.value[1] == std::ldexp(1.0, -16));
  CHECK(e5m2.value[4] == std::ldexp(1.0, -14));
  // Decoding is exact: every finite code's value, both signs, is the table value.
  for (int k = 0; k < 127; ++k) {
    CHECK(static_cast<double>(kvq::detail::e4m3_to_f32(static_cast<std::uint8_t>(k))) == e4m3.value[k]);
    CHECK(static_cast<double>(kvq::detail::e4m3_to_f32(static_cast<std::uint8_t>(0x80 | k))) == -e4m3.value[k]);
  }
  for (int k = 0; k < 124; ++k) {
    CHECK(static_cast<double>(kvq::detail::e5m2_to_f32(static_cast<std::uint8_t>(k))) == e5m2.value[k]);
    CHECK(static_cast<double>(kvq::detail::e5m2_to_f32(static_cast<std::uint8_t>(0x80 | k))) == -e5m2.value[k]);
  }
  CHECK(std::signbit(kvq::detail::e4m3_to_f32(0x80)));
  CHECK(std::signbit(kvq::detail::e5m2_to_f32(0x80)));
}

TEST_CASE("fp8 exhaustive: all 2^32 inputs, both formats, both modes", "[fp8][exhaustive]") {
  reference_format const formats[2] = {{"e4m3fn", 3, 7, 127, 0x7f}, {"e5m2", 2, 15, 124, 0x7c}};
  constexpr std::uint32_t chunks = 1024;  // chunks of the 2^31 magnitudes, handed out to threads
  constexpr std::uint32_t chunk_size = 0x80000000u / chunks;
  std::atomic<std::uint32_t> next_chunk{0};
  unsigned const threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<mismatch_log> logs(threads);
  std::vector<std::uint64_t> visited(threads, 0);

  auto const worker = [&](unsigned t) {
    mismatch_log& log = logs[t];
    for (std::uint32_t c = next_chunk++; c < chunks; c = next_chunk++) {
      std::uint32_t const begin = c * chunk_size;
      for (std::uint32_t a = begin; a < begin + chunk_size; ++a) {
        bool const is_nan = a > 0x7f800000u;
        int const k[2] = {is_nan ? 0 : formats[0].nearest(a), is_nan ? 0 : formats[1].nearest(a)};
        for (std::uint32_t s = 0; s < 2; ++s) {
          std::uint32_t const u = a | (s << 31);
          float x;
          std::memcpy(&x, &u, 4);
          auto const sign = static_cast<std::uint8_t>(s << 7);
          for (int sat = 0; sat < 2; ++sat) {
            std::uint8_t const got[2] = {kvq::detail::f32_to_e4m3(x, sat != 0), kvq::detail::f32_to_e5m2(x, sat != 0)};
            for (int f = 0; f < 2; ++f) {
              std::uint8_t const want = is_nan ? std::uint8_t{0x7f} : formats[f].code(k[f], sign, sat != 0);
              if (got[f] != want && log.count[f][sat]++ == 0) log.first[f][sat] = u;
            }
          }
        }
      }
      visited[t] += 2ull * chunk_size;
    }
  };

  auto const start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) pool.emplace_back(worker, t);
  for (auto& th : pool) th.join();
  double const seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  std::uint64_t inputs = 0;
  for (auto const v : visited) inputs += v;
  REQUIRE(inputs == (1ull << 32));
  std::uint64_t total = 0;
  for (int f = 0; f < 2; ++f) {
    for (int sat = 0; sat < 2; ++sat) {
      std::uint64_t n = 0;
      std::uint32_t first = 0;
      for (auto const& log : logs) {
        if (log.count[f][sat] != 0 && n == 0) first = log.first[f][sat];
        n += log.count[f][sat];
      }
      std::printf("fp8 exhaustive %-6s %-11s: %llu mismatches over 2^32 inputs\n", formats[f].name,
                  sat ? "saturate" : "no_saturate", static_cast<unsigned long long>(n));
      INFO(formats[f].name << (sat ? " saturate" : " no_saturate") << ": " << n << " mismatches, first input bits 0x"
                           << std::hex << first);
      CHECK(n == 0);
      total += n;
    }
  }
  std::printf("fp8 exhaustive: %u threads, %.1f s\n", threads, seconds);
  REQUIRE(total == 0);
}
