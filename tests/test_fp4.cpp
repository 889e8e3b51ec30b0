// Tests of the mxfp4 and nvfp4 codecs: every ggml golden vector (bytes and dequantized floats)
// through the scalar reference, through the shared kernel bodies that CUDA and Metal run, and
// through the CPU cache; kvq's NaN/Inf rule, padding, the optional scale, the facade.
#include <kvq/codec/fp4.hpp>
#include <kvq/core/kernel_bodies.h>
#include <kvq/kvq.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "catch_compat.hpp"
#include "test_support.hpp"

using kvq_test::bits;
using kvq_test::bytes_from_hex;
using kvq_test::f32_from_hex;
using kvq_test::hex;

namespace {

template <class Codec>
auto encode(std::vector<float> const& x, kvq::fp4_params const& p = {}) -> std::vector<std::uint8_t> {
  int const n = static_cast<int>(x.size());
  std::vector<std::uint8_t> out(Codec::geometry(n).bytes());
  Codec::encode_row(x.data(), n, out.data(), p);
  return out;
}

template <class Codec>
auto decode(std::vector<std::uint8_t> const& b, int n, kvq::fp4_params const& p = {}) -> std::vector<float> {
  std::vector<float> y(static_cast<std::size_t>(n));
  Codec::decode_row(b.data(), n, y.data(), p);
  return y;
}

/// Encodes a row with the kernel bodies (one call per block, as one GPU thread does it).
template <class Codec>
auto kernel_encode(std::vector<float> const& x, float scale = 1.0f) -> std::vector<std::uint8_t> {
  int const n = static_cast<int>(x.size());
  auto const g = Codec::geometry(n);
  std::vector<std::uint8_t> out(g.bytes(), 0xcd);
  kvq_region r{};
  r.codec_scale = scale;
  kvq::kernels::row_ref row{};  // f32, no rounding, rotation or key mean
  row.p = reinterpret_cast<unsigned char const*>(x.data());
  row.type = kvq_elem_f32;
  row.head_dim = n;
  for (int b = 0; b < g.blocks; ++b)
    kvq::kernels::encode_block(kvq::detail::kernel_codec<Codec>::value, row, n, b, r, out.data());
  return out;
}

/// Decodes a row with the kernel bodies (one call per channel).
template <class Codec>
auto kernel_decode(std::vector<std::uint8_t> const& b, int n, float scale = 1.0f) -> std::vector<float> {
  kvq_region r{};
  r.codec_scale = scale;
  std::vector<float> y(static_cast<std::size_t>(n));
  for (int c = 0; c < n; ++c)
    y[static_cast<std::size_t>(c)] =
        kvq::kernels::decode_row_element(kvq::detail::kernel_codec<Codec>::value, b.data(), n, c, r);
  return y;
}

auto same_values(std::vector<float> const& got, nlohmann::json const& want) -> int {
  int bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (bits(got[i]) != bits(f32_from_hex(want[i].get<std::string>()))) ++bad;
  return bad;
}

template <class Codec>
void check_vector(nlohmann::json const& v, char const* key) {
  std::vector<float> x;
  for (auto const& h : v["input_f32"]) x.push_back(f32_from_hex(h.get<std::string>()));
  int const n = v["n"].get<int>();
  REQUIRE(static_cast<int>(x.size()) == n);
  auto const expected = bytes_from_hex(v[key]["bytes"].get<std::string>());
  INFO(v["name"].get<std::string>() << " " << key);
  CHECK(hex(encode<Codec>(x)) == hex(expected));
  CHECK(hex(kernel_encode<Codec>(x)) == hex(expected));
  // Decode the golden bytes (not ours) so that a decode bug is not masked by an encode bug.
  CHECK(same_values(decode<Codec>(expected, n), v[key]["dequant_f32"]) == 0);
  CHECK(same_values(kernel_decode<Codec>(expected, n), v[key]["dequant_f32"]) == 0);
}

}  // namespace

TEST_CASE("mxfp4 and nvfp4 reproduce every ggml golden vector", "[fp4][golden]") {
  auto const j = kvq_test::load_testvectors("ggml_mxfp4_nvfp4.json");
  REQUIRE(j["vectors"].size() == 47);
  for (auto const& v : j["vectors"]) {
    check_vector<kvq::mxfp4>(v, "mxfp4");
    check_vector<kvq::nvfp4>(v, "nvfp4");
  }
}

TEST_CASE("fp4 golden vectors through the CPU cache", "[fp4][golden]") {
  auto const j = kvq_test::load_testvectors("ggml_mxfp4_nvfp4.json");
  auto const& vs = j["vectors"];
  std::int64_t const t = static_cast<std::int64_t>(vs.size());
  std::vector<float> keys;
  for (auto const& v : vs)
    for (auto const& h : v["input_f32"]) keys.push_back(f32_from_hex(h.get<std::string>()));
  auto run = [&](auto codec, char const* key) {
    using C = decltype(codec);
    kvq::QuantizedKVCache<C> cache({1, 1, 64, t});
    cache.append(0, kvq::token_major(keys.data(), t, 1, 64), kvq::token_major(keys.data(), t, 1, 64));
    auto const view = cache.key_storage(0, 0);
    std::vector<float> out(static_cast<std::size_t>(t) * 64);
    cache.read_values(0, 0, 0, t, out.data());
    for (std::int64_t i = 0; i < t; ++i) {
      auto const& v = vs[static_cast<std::size_t>(i)];
      INFO(v["name"].get<std::string>() << " " << key);
      auto const* row =
          reinterpret_cast<std::uint8_t const*>(view.units) + static_cast<std::size_t>(i) * view.unit_bytes;
      CHECK(hex(std::vector<std::uint8_t>(row, row + view.unit_bytes)) == v[key]["bytes"].get<std::string>());
      std::vector<float> const got(out.begin() + i * 64, out.begin() + (i + 1) * 64);
      CHECK(same_values(got, v[key]["dequant_f32"]) == 0);
    }
    CHECK(cache.nonfinite_blocks().total() == 0);
  };
  run(kvq::mxfp4{}, "mxfp4");
  run(kvq::nvfp4{}, "nvfp4");
}

TEST_CASE("fp4 NaN and Inf poison their block (mxfp4) or sub-block (nvfp4)", "[fp4]") {
  float const inf = std::numeric_limits<float>::infinity();
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), inf, -inf}) {
    std::vector<float> x(64);
    for (int i = 0; i < 64; ++i) x[static_cast<std::size_t>(i)] = 0.25f * static_cast<float>(i % 7) - 0.5f;
    x[20] = bad;
    auto const m = encode<kvq::mxfp4>(x);
    CHECK(m[0] == 0xff);   // block 0 poisoned: scale byte 0xFF, codes 0
    CHECK(m[17] != 0xff);  // block 1 untouched
    for (int j = 1; j < 17; ++j) CHECK(m[static_cast<std::size_t>(j)] == 0);
    CHECK(hex(kernel_encode<kvq::mxfp4>(x)) == hex(m));
    auto const ym = decode<kvq::mxfp4>(m, 64);
    for (int i = 0; i < 64; ++i) CHECK(std::isnan(ym[static_cast<std::size_t>(i)]) == (i < 32));
    auto const nv = encode<kvq::nvfp4>(x);
    CHECK(nv[1] == 0x7f);  // sub-block 1 (channels 16..31) poisoned
    CHECK(nv[0] != 0x7f);
    CHECK(nv[2] != 0x7f);
    CHECK(hex(kernel_encode<kvq::nvfp4>(x)) == hex(nv));
    auto const yn = decode<kvq::nvfp4>(nv, 64);
    auto const yk = kernel_decode<kvq::nvfp4>(nv, 64);
    for (int i = 0; i < 64; ++i) {
      CHECK(std::isnan(yn[static_cast<std::size_t>(i)]) == (i >= 16 && i < 32));
      CHECK(bits(yk[static_cast<std::size_t>(i)]) == bits(yn[static_cast<std::size_t>(i)]));
    }
    // The cache counts the poisoned scales.
    kvq::QuantizedKVCache<kvq::kv_codecs<kvq::mxfp4, kvq::nvfp4>> cache({1, 1, 64, 4});
    cache.append(0, kvq::token_major(x.data(), 1, 1, 64), kvq::token_major(x.data(), 1, 1, 64));
    CHECK(cache.nonfinite_blocks() == kvq::nonfinite_report{1, 1});
  }
}

TEST_CASE("fp4 padding: lanes past head_dim are zeros that take no part", "[fp4]") {
  for (int d : {8, 40, 72, 100}) {
    INFO("head_dim " << d);
    std::vector<float> x(static_cast<std::size_t>(d));
    for (int i = 0; i < d; ++i) x[static_cast<std::size_t>(i)] = std::sin(0.37f * static_cast<float>(i)) * 3.0f;
    auto check = [&](auto codec) {
      using C = decltype(codec);
      auto const g = C::geometry(d);
      std::vector<float> padded(static_cast<std::size_t>(g.padded_channels()), 0.0f);
      std::copy(x.begin(), x.end(), padded.begin());
      auto const row = encode<C>(x);
      auto const full = encode<C>(padded);
      CHECK(hex(row) == hex(full));
      CHECK(hex(kernel_encode<C>(x)) == hex(row));
      auto const y = decode<C>(row, d);
      auto const yf = decode<C>(full, g.padded_channels());
      for (int i = 0; i < d; ++i) CHECK(bits(y[static_cast<std::size_t>(i)]) == bits(yf[static_cast<std::size_t>(i)]));
    };
    check(kvq::mxfp4{});
    check(kvq::nvfp4{});
  }
  CHECK(kvq::bits_per_element<kvq::mxfp4>(128) == 4.25);
  CHECK(kvq::bits_per_element<kvq::nvfp4>(128) == 4.5);
  CHECK(kvq::plan_memory<kvq::nvfp4>({2, 4, 128, 256}).key_bytes == 2u * 4u * 256u * 72u);
}

TEST_CASE("fp4 scale: stored = codec(x / scale), read = decoded * scale", "[fp4]") {
  std::vector<float> x(64);
  for (int i = 0; i < 64; ++i) x[static_cast<std::size_t>(i)] = 0.0001f * static_cast<float>(i * i % 29) - 0.001f;
  std::vector<float> scaled(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) scaled[i] = x[i] / 0.0004f;
  kvq::fp4_params const p{0.0004f};
  auto check = [&](auto codec) {
    using C = decltype(codec);
    auto const b = encode<C>(x, p);
    CHECK(hex(b) == hex(encode<C>(scaled)));
    CHECK(hex(kernel_encode<C>(x, p.scale)) == hex(b));
    auto const y = decode<C>(b, 64, p);
    auto const y1 = decode<C>(b, 64);
    auto const yk = kernel_decode<C>(b, 64, p.scale);
    for (std::size_t i = 0; i < 64; ++i) {
      CHECK(bits(y[i]) == bits(y1[i] * 0.0004f));
      CHECK(bits(yk[i]) == bits(y[i]));
    }
  };
  check(kvq::mxfp4{});
  check(kvq::nvfp4{});
  // nvfp4 without a scale flushes these small values to zero; with it they are kept.
  auto const flushed = decode<kvq::nvfp4>(encode<kvq::nvfp4>(x), 64);
  CHECK(std::all_of(flushed.begin(), flushed.end(), [](float v) { return v == 0.0f; }));
  auto const kept = decode<kvq::nvfp4>(encode<kvq::nvfp4>(x, p), 64, p);
  CHECK(std::any_of(kept.begin(), kept.end(), [](float v) { return v != 0.0f; }));
}
