// Tests of the rotation R of the rotated codecs (detail/rotation.h, FORMATS.md §6.1): the splitmix64
// sign words, the block split, c_n, the forward and inverse transforms against a float64 matrix
// reference, hand-checked bits, and the precomputed-words variants.
#include <kvq/detail/rotation.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "catch_compat.hpp"
#include "test_support.hpp"

using kvq_test::bits;

namespace {

using kvq::detail::rotate_forward;
using kvq::detail::rotate_forward_signs;
using kvq::detail::rotate_inverse;
using kvq::detail::rotate_inverse_signs;

constexpr std::uint64_t default_seed = 0x6B7671;

/// An independent splitmix64 stream (the generator's reference formulation, state kept across calls).
class splitmix64 {
 public:
  explicit splitmix64(std::uint64_t seed) : state_(seed) {}
  auto next() -> std::uint64_t {
    state_ += UINT64_C(0x9E3779B97F4A7C15);
    std::uint64_t z = state_;
    z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
    return z ^ (z >> 31);
  }

 private:
  std::uint64_t state_;
};

/// The blocks of head_dim from its bits, highest first.
auto reference_blocks(int head_dim) -> std::vector<int> {
  std::vector<int> sizes;
  for (int b = 30; b >= 0; --b)
    if ((head_dim >> b) & 1) sizes.push_back(1 << b);
  return sizes;
}

/// Sign s_i of channel i of a row of `seed`, from the independent generator.
auto reference_signs(std::uint64_t seed, int head_dim) -> std::vector<double> {
  splitmix64 g(seed);
  std::vector<double> s(static_cast<std::size_t>(head_dim));
  std::uint64_t word = 0;
  for (int i = 0; i < head_dim; ++i) {
    if (i % 64 == 0) word = g.next();
    s[static_cast<std::size_t>(i)] = ((word >> (i % 64)) & 1u) != 0 ? -1.0 : 1.0;
  }
  return s;
}

/// y = R x in float64 with the Hadamard matrix H_ij = (-1)^popcount(i & j) of each block.
auto reference_forward(std::vector<float> const& x, std::uint64_t seed) -> std::vector<double> {
  int const d = static_cast<int>(x.size());
  auto const s = reference_signs(seed, d);
  std::vector<double> y(x.size());
  int offset = 0;
  for (int n : reference_blocks(d)) {
    double const c = 1.0 / std::sqrt(static_cast<double>(n));
    for (int i = 0; i < n; ++i) {
      double acc = 0.0;
      for (int j = 0; j < n; ++j) {
        auto const col = static_cast<std::size_t>(offset + j);
        double const h = (std::popcount(static_cast<unsigned>(i & j)) & 1) != 0 ? -1.0 : 1.0;
        acc += h * s[col] * static_cast<double>(x[col]);
      }
      y[static_cast<std::size_t>(offset + i)] = acc * c;
    }
    offset += n;
  }
  return y;
}

/// Seeded N(0, 1) rows with a few large channels, from the portable generator.
auto test_row(int head_dim, std::uint64_t seed) -> std::vector<float> {
  kvq_test::rng r(seed);
  std::vector<float> x(static_cast<std::size_t>(head_dim));
  for (auto& v : x) v = static_cast<float>(r.normal() * (r.chance(0.05) ? 12.0 : 1.0));
  return x;
}

/// The block of size n that holds channel i, as (offset, n).
auto block_of(int head_dim, int i) -> std::pair<int, int> {
  int offset = 0;
  for (int n : reference_blocks(head_dim)) {
    if (i < offset + n) return {offset, n};
    offset += n;
  }
  return {offset, 0};
}

/// Number of positions whose float bits differ.
auto differing(std::vector<float> const& a, std::vector<float> const& b) -> int {
  int n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) n += bits(a[i]) != bits(b[i]) ? 1 : 0;
  return n;
}

auto log2_int(int n) -> int {
  int e = 0;
  while ((1 << e) < n) ++e;
  return e;
}

constexpr double eps32 = 0x1.0p-24;  // unit roundoff of float32

}  // namespace

TEST_CASE("rotation sign words are the splitmix64 outputs of the seed", "[rotation]") {
  // Anchors computed offline: splitmix64's first output for seed 0 is the published e220a839...
  CHECK(kvq::detail::rotation_sign_word(0, 0) == UINT64_C(0xE220A8397B1DCDAF));
  CHECK(kvq::detail::rotation_sign_word(default_seed, 0) == UINT64_C(0x7D7B99D125C36734));
  CHECK(kvq::detail::rotation_sign_word(default_seed, 1) == UINT64_C(0x04919AFFDEB113BD));
  for (std::uint64_t seed : {default_seed, std::uint64_t{0}, std::uint64_t{1}, ~std::uint64_t{0}}) {
    splitmix64 g(seed);
    kvq_test::rng h(seed);  // the tests' own splitmix64 stream: a second formulation
    for (int j = 0; j < 40; ++j) {
      auto const w = g.next();
      INFO("seed " << seed << " word " << j);
      CHECK(kvq::detail::rotation_sign_word(seed, j) == w);
      CHECK(h.next() == w);
    }
  }
  std::vector<std::uint64_t> words(16, 0);
  kvq::detail::rotation_sign_words(default_seed, 1000, words.data());
  CHECK(kvq::detail::rotation_word_count(1000) == 16);
  CHECK(kvq::detail::rotation_word_count(128) == 2);
  CHECK(kvq::detail::rotation_word_count(1) == 1);
  for (int j = 0; j < 16; ++j)
    CHECK(words[static_cast<std::size_t>(j)] == kvq::detail::rotation_sign_word(default_seed, j));
}

TEST_CASE("rotation blocks follow the binary expansion of head_dim, largest first", "[rotation]") {
  auto blocks = [](int d) {
    std::vector<int> sizes;
    for (int o = 0; o < d; o += sizes.back()) sizes.push_back(kvq::detail::rotation_block_size(d, o));
    return sizes;
  };
  CHECK(blocks(128) == std::vector<int>{128});
  CHECK(blocks(80) == std::vector<int>{64, 16});
  CHECK(blocks(96) == std::vector<int>{64, 32});
  CHECK(blocks(40) == std::vector<int>{32, 8});
  CHECK(blocks(8) == std::vector<int>{8});
  CHECK(blocks(1) == std::vector<int>{1});
  CHECK(blocks(7) == std::vector<int>{4, 2, 1});
  CHECK(blocks(65) == std::vector<int>{64, 1});
  CHECK(blocks(1000) == std::vector<int>{512, 256, 128, 64, 32, 8});
  CHECK(kvq::detail::rotation_block_size(80, 80) == 0);
  for (int d = 1; d <= 1100; ++d) {
    INFO("head_dim " << d);
    REQUIRE(blocks(d) == reference_blocks(d));
    REQUIRE(kvq::detail::rotation_block_count(d) == static_cast<int>(reference_blocks(d).size()));
    int b = 0;
    int offset = 0;
    for (int n : reference_blocks(d)) {
      for (int i = offset; i < offset + n; ++i) {
        REQUIRE(kvq::detail::rotation_block_of(d, i) == b);
        REQUIRE(kvq::detail::rotation_block_start(d, i) == offset);
      }
      offset += n;
      ++b;
    }
  }
  static_assert(kvq::detail::rotation_block_count(128) == 1 && kvq::detail::rotation_block_count(80) == 2 &&
                kvq::detail::rotation_block_count(7) == 3);
}

TEST_CASE("rotation scale c_n is the float32 nearest 1/sqrt(n)", "[rotation]") {
  using kvq::detail::rotation_scale;
  CHECK(bits(rotation_scale(2)) == 0x3f3504f3u);
  CHECK(bits(rotation_scale(8)) == 0x3eb504f3u);
  CHECK(bits(rotation_scale(32)) == 0x3e3504f3u);
  CHECK(bits(rotation_scale(128)) == 0x3db504f3u);
  CHECK(bits(rotation_scale(512)) == 0x3d3504f3u);
  CHECK(rotation_scale(1) == 1.0f);
  CHECK(rotation_scale(4) == 0.5f);
  CHECK(rotation_scale(16) == 0.25f);
  CHECK(rotation_scale(64) == 0.125f);
  CHECK(rotation_scale(256) == 0.0625f);
  for (int e = 0; e <= 16; ++e) {
    int const n = 1 << e;
    INFO("n " << n);
    CHECK(bits(rotation_scale(n)) == bits(static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)))));
  }
}

TEST_CASE("rotate_forward matches the float64 Hadamard reference", "[rotation]") {
  for (int d : {1, 2, 3, 8, 40, 64, 80, 96, 128, 256, 1000}) {
    for (std::uint64_t seed : {default_seed, std::uint64_t{12345}}) {
      auto const x = test_row(d, seed + static_cast<std::uint64_t>(d));
      auto y = x;
      rotate_forward(y.data(), d, seed);
      auto const ref = reference_forward(x, seed);
      int bad = 0;
      double worst = 0.0;
      for (int i = 0; i < d; ++i) {
        auto const [offset, n] = block_of(d, i);
        double l1 = 0.0;
        for (int j = offset; j < offset + n; ++j) l1 += std::fabs(static_cast<double>(x[static_cast<std::size_t>(j)]));
        // Each butterfly stage rounds once per output (error <= eps * the l1 norm of its inputs),
        // and the product by c_n once more.
        double const bound = eps32 * (log2_int(n) + 2) * l1 / std::sqrt(static_cast<double>(n));
        double const err =
            std::fabs(static_cast<double>(y[static_cast<std::size_t>(i)]) - ref[static_cast<std::size_t>(i)]);
        if (err > bound) ++bad;
        worst = std::max(worst, err / bound);
      }
      INFO("head_dim " << d << " seed " << seed << " worst error / bound " << worst);
      CHECK(bad == 0);
    }
  }
}

TEST_CASE("rotate_inverse undoes rotate_forward and R preserves the norm", "[rotation]") {
  for (int d : {1, 2, 3, 8, 40, 64, 80, 96, 128, 256, 1000}) {
    auto const x = test_row(d, 77 + static_cast<std::uint64_t>(d));
    auto y = x;
    rotate_forward(y.data(), d, default_seed);
    auto back = y;
    rotate_inverse(back.data(), d, default_seed);
    int offset = 0;
    for (int n : reference_blocks(d)) {
      double nx = 0.0;
      double ny = 0.0;
      for (int i = offset; i < offset + n; ++i) {
        nx += static_cast<double>(x[static_cast<std::size_t>(i)]) * x[static_cast<std::size_t>(i)];
        ny += static_cast<double>(y[static_cast<std::size_t>(i)]) * y[static_cast<std::size_t>(i)];
      }
      nx = std::sqrt(nx);
      ny = std::sqrt(ny);
      double const stages = log2_int(n) + 2;
      INFO("head_dim " << d << " block at " << offset << " of " << n);
      // |‖Rx‖ - ‖x‖| <= ‖fl(Rx) - Rx‖ <= sqrt(n) * eps * stages * ‖x‖_1 / sqrt(n) <= eps * stages * sqrt(n) * ‖x‖.
      CHECK(std::fabs(ny - nx) <= eps32 * stages * std::sqrt(static_cast<double>(n)) * nx);
      for (int i = offset; i < offset + n; ++i)
        CHECK(std::fabs(static_cast<double>(back[static_cast<std::size_t>(i)]) - x[static_cast<std::size_t>(i)]) <=
              2.0 * eps32 * stages * std::sqrt(static_cast<double>(n)) * nx);
      offset += n;
    }
  }
}

TEST_CASE("rotation bits by hand", "[rotation]") {
  // Seed 0x6B7671: word 0 ends in the bits 0100, so of channels 0..3 only channel 2 is negated.
  REQUIRE((kvq::detail::rotation_sign_word(default_seed, 0) & 15u) == 4u);
  // d = 4: u = (1, 2, -3, 4); h = 1: (3, -1, 1, -7); h = 2: (4, -8, 2, 6); times c_4 = 1/2.
  std::vector<float> x = {1.0f, 2.0f, 3.0f, 4.0f};
  rotate_forward(x.data(), 4, default_seed);
  CHECK(x == std::vector<float>{2.0f, -4.0f, 1.0f, 3.0f});
  rotate_inverse(x.data(), 4, default_seed);
  CHECK(x == std::vector<float>{1.0f, 2.0f, 3.0f, 4.0f});

  // Seed 6: word 0 ends in 0000 (no sign flip). d = 2, x = (1, 2^-24): 1 + 2^-24 is a tie that rounds
  // to 1 (even), 1 - 2^-24 is exact (3f7fffff); times c_2 = 3f3504f3 gives 3f3504f3 and 3f3504f2.
  REQUIRE((kvq::detail::rotation_sign_word(6, 0) & 3u) == 0u);
  std::vector<float> t = {1.0f, 0x1.0p-24f};
  rotate_forward(t.data(), 2, 6);
  CHECK(bits(t[0]) == 0x3f3504f3u);
  CHECK(bits(t[1]) == 0x3f3504f2u);

  // The order of the stages matters. Seed 6, d = 4, x = (1, a, a, a), a = 2^-24 (exactly
  // (1 + 3a, 1 - a, 1 - a, 1 - a) / 2): h = 1 gives (1, 1 - a, 2a, 0) (1 + a ties to 1), then h = 2
  // (1 + 2a, 1 - a, 1 - 2a, 1 - a); h = 2 first would give (1 + 2a, 1 - 2a, 1 - a, 1 - a).
  REQUIRE((kvq::detail::rotation_sign_word(6, 0) & 15u) == 0u);
  std::vector<float> s = {1.0f, 0x1.0p-24f, 0x1.0p-24f, 0x1.0p-24f};
  rotate_forward(s.data(), 4, 6);
  CHECK(s == std::vector<float>{0.5f + 0x1.0p-24f, 0.5f - 0x1.0p-25f, 0.5f - 0x1.0p-24f, 0.5f - 0x1.0p-25f});

  // The sign of channel i comes from bit i mod 64 of word i / 64, i counted from the row's start:
  // d = 65 ends with a block of size 1 at channel 64, whose sign is bit 0 of word 1 (set: negated),
  // while bit 0 of word 0 is clear.
  REQUIRE((kvq::detail::rotation_sign_word(default_seed, 1) & 1u) == 1u);
  REQUIRE((kvq::detail::rotation_sign_word(default_seed, 0) & 1u) == 0u);
  std::vector<float> e(65, 0.0f);
  e[64] = 1.5f;
  rotate_forward(e.data(), 65, default_seed);
  CHECK(e[64] == -1.5f);
  for (int i = 0; i < 64; ++i) CHECK(e[static_cast<std::size_t>(i)] == 0.0f);
  rotate_inverse(e.data(), 65, default_seed);
  CHECK(e[64] == 1.5f);
}

TEST_CASE("rotation with precomputed sign words gives the same bits", "[rotation]") {
  for (int d : {1, 2, 3, 8, 40, 64, 65, 80, 96, 128, 200, 256, 1000}) {
    for (std::uint64_t seed : {default_seed, std::uint64_t{1}, UINT64_C(0xDEADBEEFCAFEF00D)}) {
      std::vector<std::uint64_t> words(static_cast<std::size_t>(kvq::detail::rotation_word_count(d)));
      kvq::detail::rotation_sign_words(seed, d, words.data());
      auto const x = test_row(d, seed ^ static_cast<std::uint64_t>(d));
      auto a = x;
      auto b = x;
      rotate_forward(a.data(), d, seed);
      rotate_forward_signs(b.data(), d, words.data());
      INFO("head_dim " << d << " seed " << seed);
      CHECK(differing(a, b) == 0);
      rotate_inverse(a.data(), d, seed);
      rotate_inverse_signs(b.data(), d, words.data());
      CHECK(differing(a, b) == 0);
    }
  }
}

TEST_CASE("different seeds rotate differently", "[rotation]") {
  for (int d : {8, 40, 128, 1000}) {
    auto const x = test_row(d, 5);
    auto a = x;
    auto b = x;
    rotate_forward(a.data(), d, default_seed);
    rotate_forward(b.data(), d, default_seed + 1);
    int differ = 0;
    for (int i = 0; i < d; ++i) differ += a[static_cast<std::size_t>(i)] != b[static_cast<std::size_t>(i)] ? 1 : 0;
    INFO("head_dim " << d);
    CHECK(differ > d / 2);
  }
}
