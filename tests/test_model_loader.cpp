// kvq::llama2c loaders and engine on synthetic files (no model needed): valid files load and run
// exactly like an independent reference forward pass; corrupted, truncated or absurd files raise
// format_error / io_error with messages naming the file and the field, never crash. When the real
// stories260K files are present, truncated copies of them are checked too.
#include "catch_compat.hpp"
#if __has_include(<catch2/catch_message.hpp>)
#  include <catch2/catch_message.hpp>  // Catch2 v3: INFO, WARN, FAIL with messages
#endif

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <llama2c/llama2c.hpp>
#include <random>
#include <string>
#include <vector>

namespace fs = std::filesystem;
namespace l2 = kvq::llama2c;
using Catch::Matchers::WithinAbs;

namespace {

using bytes = std::vector<unsigned char>;

/// A fresh directory under the system temp directory, removed on destruction.
struct temp_dir {
  fs::path path;
  temp_dir() {
    std::random_device rd;
    path = fs::temp_directory_path() / ("kvq_llama2c_test_" + std::to_string(rd()) + "_" + std::to_string(rd()));
    fs::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  auto file(std::string const& name) const -> std::string { return (path / name).string(); }
};

void write_file(std::string const& path, bytes const& b) {
  // Remove, then create: truncating an existing file makes ext4 flush it at close (auto_da_alloc),
  // which makes the many rewrites below slow.
  std::error_code ec;
  fs::remove(path, ec);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<char const*>(b.data()), static_cast<std::streamsize>(b.size()));
  REQUIRE(out.good());
}

auto read_file(std::string const& path) -> bytes {
  std::ifstream in(path, std::ios::binary);
  return bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void put_u32(bytes& b, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) b.push_back(static_cast<unsigned char>(v >> (8 * i)));
}
void put_i32(bytes& b, std::int32_t v) { put_u32(b, static_cast<std::uint32_t>(v)); }
void put_f32(bytes& b, float v) {
  std::uint32_t u;
  std::memcpy(&u, &v, 4);
  put_u32(b, u);
}
void set_i32(bytes& b, std::size_t at, std::int32_t v) {
  for (int i = 0; i < 4; ++i)
    b[at + static_cast<std::size_t>(i)] = static_cast<unsigned char>(static_cast<std::uint32_t>(v) >> (8 * i));
}

/// The message of the E that f() throws; fails the test on any other outcome.
template <class E, class F>
auto message_of(F&& f) -> std::string {
  try {
    f();
  } catch (E const& e) {
    return e.what();
  } catch (std::exception const& e) {
    FAIL("unexpected exception type: " << e.what());
  }
  FAIL("no exception was thrown");
  return {};
}

auto contains(std::string const& s, std::string const& part) -> bool { return s.find(part) != std::string::npos; }

/// A small random llama2.c model, written in the version-0 format.
struct synth_model {
  int dim = 32, hidden = 40, layers = 2, heads = 4, kv_heads = 2, vocab = 40, seq_len = 48;
  bool shared = true;
  bool tables = true;
  std::vector<float> emb, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, freq_real, freq_imag, wcls;

  auto head_dim() const -> int { return dim / heads; }
  auto kv_dim() const -> int { return kv_heads * head_dim(); }

  explicit synth_model(std::uint32_t seed, bool shared_classifier = true, bool with_tables = true)
      : shared(shared_classifier), tables(with_tables) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> n(0.0f, 1.0f);
    auto fill = [&](std::vector<float>& v, std::size_t count, float sigma, float mean = 0.0f) {
      v.resize(count);
      for (auto& x : v) x = mean + sigma * n(rng);
    };
    auto const D = std::size_t(dim), H = std::size_t(hidden), L = std::size_t(layers), KV = std::size_t(kv_dim());
    fill(emb, std::size_t(vocab) * D, 1.0f);
    fill(rms_att, L * D, 0.1f, 1.0f);
    fill(wq, L * D * D, 0.4f);
    fill(wk, L * KV * D, 0.4f);
    fill(wv, L * KV * D, 0.3f);
    fill(wo, L * D * D, 0.2f);
    fill(rms_ffn, L * D, 0.1f, 1.0f);
    fill(w1, L * H * D, 0.2f);
    fill(w2, L * D * H, 0.2f);
    fill(w3, L * H * D, 0.2f);
    fill(rms_final, D, 0.1f, 1.0f);
    fill(freq_real, std::size_t(seq_len) * std::size_t(head_dim() / 2), 1.0f);
    fill(freq_imag, std::size_t(seq_len) * std::size_t(head_dim() / 2), 1.0f);
    if (!shared) fill(wcls, std::size_t(vocab) * D, 0.5f);
  }

  auto header() const -> std::array<std::int32_t, 7> {
    return {dim, hidden, layers, heads, kv_heads, shared ? vocab : -vocab, seq_len};
  }

  auto file(std::array<std::int32_t, 7> const& h) const -> bytes {
    bytes b;
    for (auto v : h) put_i32(b, v);
    for (auto const* t : {&emb, &rms_att, &wq, &wk, &wv, &wo, &rms_ffn, &w1, &w2, &w3, &rms_final})
      for (float x : *t) put_f32(b, x);
    if (tables)
      for (auto const* t : {&freq_real, &freq_imag})
        for (float x : *t) put_f32(b, x);
    for (float x : wcls) put_f32(b, x);
    return b;
  }
  auto file() const -> bytes { return file(header()); }

  /// Independent forward pass in double over every position of `tokens`: the logits of each.
  auto reference(std::vector<int> const& tokens) const -> std::vector<std::vector<double>> {
    int const hd = head_dim(), kvd = kv_dim(), group = heads / kv_heads;
    std::vector<std::vector<double>> kc(static_cast<std::size_t>(layers)), vc(static_cast<std::size_t>(layers));
    std::vector<std::vector<double>> out;
    auto mat = [](std::vector<float> const& w, std::size_t off, std::vector<double> const& x, int rows) {
      std::vector<double> y(std::size_t(rows), 0.0);
      for (std::size_t i = 0; i < y.size(); ++i)
        for (std::size_t j = 0; j < x.size(); ++j) y[i] += double(w[off + i * x.size() + j]) * x[j];
      return y;
    };
    auto norm = [](std::vector<double> const& x, std::vector<float> const& w, std::size_t off) {
      double ss = 0;
      for (double v : x) ss += v * v;
      double const inv = 1.0 / std::sqrt(ss / double(x.size()) + 1e-5);
      std::vector<double> y(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) y[i] = double(w[off + i]) * x[i] * inv;
      return y;
    };
    auto rope = [&](std::vector<double>& v, int pos) {
      for (std::size_t i = 0; i < v.size(); i += 2) {
        double const freq = std::pow(10000.0, -double(int(i) % hd) / double(hd));
        double const c = std::cos(pos * freq), s = std::sin(pos * freq);
        double const a = v[i], b = v[i + 1];
        v[i] = a * c - b * s;
        v[i + 1] = a * s + b * c;
      }
    };
    auto const D = std::size_t(dim), H = std::size_t(hidden), KV = std::size_t(kvd);
    for (std::size_t pos = 0; pos < tokens.size(); ++pos) {
      std::vector<double> x(D);
      for (std::size_t i = 0; i < D; ++i) x[i] = emb[std::size_t(tokens[pos]) * D + i];
      for (std::size_t l = 0; l < std::size_t(layers); ++l) {
        auto const xb = norm(x, rms_att, l * D);
        auto q = mat(wq, l * D * D, xb, dim);
        auto k = mat(wk, l * KV * D, xb, kvd);
        auto const v = mat(wv, l * KV * D, xb, kvd);
        rope(q, int(pos));
        rope(k, int(pos));
        kc[l].insert(kc[l].end(), k.begin(), k.end());
        vc[l].insert(vc[l].end(), v.begin(), v.end());
        std::vector<double> att(D, 0.0);
        for (int h = 0; h < heads; ++h) {
          std::size_t const kh = std::size_t(h / group);
          std::vector<double> s(pos + 1);
          double mx = -1e300;
          for (std::size_t t = 0; t <= pos; ++t) {
            double dot = 0;
            for (int c = 0; c < hd; ++c)
              dot += q[std::size_t(h * hd + c)] * kc[l][t * KV + kh * std::size_t(hd) + std::size_t(c)];
            s[t] = dot / std::sqrt(double(hd));
            mx = std::max(mx, s[t]);
          }
          double sum = 0;
          for (auto& e : s) sum += (e = std::exp(e - mx));
          for (std::size_t t = 0; t <= pos; ++t)
            for (int c = 0; c < hd; ++c)
              att[std::size_t(h * hd + c)] += s[t] / sum * vc[l][t * KV + kh * std::size_t(hd) + std::size_t(c)];
        }
        auto const o = mat(wo, l * D * D, att, dim);
        for (std::size_t i = 0; i < D; ++i) x[i] += o[i];
        auto const xf = norm(x, rms_ffn, l * D);
        auto g = mat(w1, l * H * D, xf, hidden);
        auto const u = mat(w3, l * H * D, xf, hidden);
        for (std::size_t i = 0; i < H; ++i) g[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
        auto const f = mat(w2, l * D * H, g, dim);
        for (std::size_t i = 0; i < D; ++i) x[i] += f[i];
      }
      auto const xn = norm(x, rms_final, 0);
      out.push_back(mat(shared ? emb : wcls, 0, xn, vocab));
    }
    return out;
  }
};

/// Checks an engine (f32 cache) against the reference on `steps` positions.
void check_against_reference(synth_model const& s, l2::model const& m, int steps) {
  std::mt19937 rng(7);
  std::vector<int> tokens(static_cast<std::size_t>(steps));
  for (auto& t : tokens) t = int(rng() % std::uint32_t(s.vocab));
  auto const ref = s.reference(tokens);
  l2::engine e(m, "f32", "f32");
  double worst = 0;
  for (int p = 0; p < steps; ++p) {
    auto const& logits = e.forward(tokens[std::size_t(p)], p);
    REQUIRE(logits.size() == std::size_t(s.vocab));
    for (std::size_t i = 0; i < logits.size(); ++i)
      worst = std::max(
          worst, std::fabs(double(logits[i]) - ref[std::size_t(p)][i]) / (1.0 + std::fabs(ref[std::size_t(p)][i])));
  }
  INFO("largest relative logit difference vs the double reference: " << worst);
  CHECK(worst < 1e-4);
}

}  // namespace

TEST_CASE("valid synthetic models load and run like the reference forward pass", "[llama2c][loader]") {
  temp_dir dir;
  SECTION("shared classifier, with the RoPE tables (llama2.c's layout)") {
    synth_model const s(1);
    write_file(dir.file("m.bin"), s.file());
    auto const m = l2::load_model(dir.file("m.bin"));
    auto const& c = m.config();
    CHECK(c.dim == 32);
    CHECK(c.hidden_dim == 40);
    CHECK(c.n_layers == 2);
    CHECK(c.n_heads == 4);
    CHECK(c.n_kv_heads == 2);
    CHECK(c.vocab_size == 40);
    CHECK(c.seq_len == 48);
    CHECK(c.shared_classifier);
    CHECK(c.head_dim() == 8);
    CHECK(m.path() == dir.file("m.bin"));
    CHECK(m.wcls() == m.token_embedding());
    CHECK(m.w2(1)[5] == s.w2[std::size_t(32 * 40) + 5]);
    CHECK(m.rms_final()[31] == s.rms_final[31]);
    CHECK_THROWS_AS(m.wq(2), kvq::index_error);
    check_against_reference(s, m, 48);
  }
  SECTION("shared classifier, RoPE tables omitted") {
    synth_model const s(2, true, false);
    write_file(dir.file("m.bin"), s.file());
    auto const m = l2::load_model(dir.file("m.bin"));
    CHECK(m.rms_final()[0] == s.rms_final[0]);
    check_against_reference(s, m, 20);
  }
  SECTION("separate classifier (negative vocab_size)") {
    synth_model const s(3, false, true);
    write_file(dir.file("m.bin"), s.file());
    auto const m = l2::load_model(dir.file("m.bin"));
    CHECK_FALSE(m.config().shared_classifier);
    CHECK(m.config().vocab_size == 40);
    CHECK(m.wcls() != m.token_embedding());
    CHECK(m.wcls()[0] == s.wcls[0]);
    CHECK(m.wcls()[40 * 32 - 1] == s.wcls.back());
    check_against_reference(s, m, 20);
  }
  SECTION("NaN in the ignored RoPE tables is accepted") {
    synth_model s(4);
    s.freq_imag[3] = std::numeric_limits<float>::quiet_NaN();
    write_file(dir.file("m.bin"), s.file());
    CHECK_NOTHROW(l2::load_model(dir.file("m.bin")));
  }
}

namespace {

/// Loose bound of mean |Δlogit| / mean |logit| against the f32 cache, per codec.
auto loose_bound(std::string_view codec) -> double {
  // Rotated forms: their plain codec's bound with a margin (at this model's small head_dim the
  // rotation mixes few channels; measured: rot-mxfp4 0.36, rot-kivi2 0.45).
  if (codec == "rot-f32") return 1e-5;  // the rotation's own rounding (measured 5.9e-7)
  if (codec.starts_with("rot-")) return 1.25 * loose_bound(codec.substr(4));
  if (codec == "tq2") return 0.75;  // measured 0.64
  if (codec == "tq3") return 0.5;   // measured 0.40
  if (codec == "f32") return 0.0;
  if (codec == "f16") return 1e-3;
  if (codec == "q8_0" || codec == "int8" || codec == "kivi8") return 0.03;
  if (codec == "kivi2") return 0.75;
  return 0.35;  // 4-bit and fp8
}

}  // namespace

TEST_CASE("every facade codec pair runs the synthetic model", "[llama2c][engine]") {
  temp_dir dir;
  synth_model const s(5);
  write_file(dir.file("m.bin"), s.file());
  auto const m = l2::load_model(dir.file("m.bin"));
  l2::engine ref(m, "f32", "f32");
  std::vector<std::vector<float>> ref_logits;
  for (int p = 0; p < 48; ++p) ref_logits.push_back(ref.forward((p * 7) % 40, p));
  for (auto const& [k, v] : kvq::supported_codec_pairs()) {
    for (int r : {0, 32}) {
      kvq::any_cache_options o;
      o.residual = r;
      l2::engine e(m, k, v, o);
      double diff = 0, mag = 0;
      for (int p = 0; p < 48; ++p) {
        auto const& logits = e.forward((p * 7) % 40, p);
        for (std::size_t i = 0; i < logits.size(); ++i) {
          REQUIRE(std::isfinite(logits[i]));
          diff += std::fabs(double(logits[i]) - ref_logits[std::size_t(p)][i]);
          mag += std::fabs(double(ref_logits[std::size_t(p)][i]));
        }
      }
      double const rel = diff / mag;
      INFO(k << "/" << v << " R=" << r << ": mean |logit difference| / mean |logit| vs the f32 cache = " << rel);
      CHECK(e.position() == 48);
      // Sanity only, by the weaker codec of the pair (this random model amplifies cache errors;
      // measured: q8_0/int8/kivi8 ~0.012, fp8_e4m3 0.08, q4_0 0.19, kivi2 up to 0.48 at R = 0).
      CHECK(rel <= std::max(loose_bound(k), loose_bound(v)));
      CHECK_THROWS_AS(e.forward(0, 48), kvq::index_error);  // seq_len reached
    }
  }
}

TEST_CASE("model files: malformed headers name the field", "[llama2c][loader]") {
  temp_dir dir;
  synth_model const s(6);
  std::string const path = dir.file("bad.bin");
  struct bad_field {
    int index;
    std::int32_t value;
    char const* expect;
  };
  std::vector<bad_field> const cases = {
      {0, 0, "dim = 0"},
      {0, -32, "dim = -32"},
      {0, 70000, "dim = 70000"},
      {0, std::numeric_limits<std::int32_t>::min(), "dim"},
      {1, 0, "hidden_dim = 0"},
      {1, (1 << 20) + 1, "hidden_dim"},
      {2, 0, "n_layers = 0"},
      {2, 1025, "n_layers = 1025"},
      {3, 0, "n_heads = 0"},
      {3, 64, "n_heads = 64"},  // more heads than dim
      {3, 3, "n_heads = 3 does not divide dim"},
      {3, 32, "odd"},  // head_dim 1
      {4, 0, "n_kv_heads = 0"},
      {4, 8, "n_kv_heads = 8"},  // more kv heads than heads
      {4, 3, "n_kv_heads = 3 does not divide n_heads"},
      {5, 0, "vocab_size = 0"},
      {5, 1000001, "vocab_size = 1000001"},
      {5, -1000001, "vocab_size = -1000001"},
      {5, std::numeric_limits<std::int32_t>::min(), "vocab_size = -2147483648"},
      {6, 0, "seq_len = 0"},
      {6, -1, "seq_len = -1"},
      {6, 10000001, "seq_len = 10000001"},
  };
  for (auto const& c : cases) {
    auto h = s.header();
    h[std::size_t(c.index)] = c.value;
    write_file(path, s.file(h));
    auto const msg = message_of<l2::format_error>([&] { l2::load_model(path); });
    INFO("field " << c.index << " = " << c.value << ": " << msg);
    CHECK(contains(msg, c.expect));
    CHECK(contains(msg, path));
  }
}

TEST_CASE("model files: sizes that do not match the header", "[llama2c][loader]") {
  temp_dir dir;
  std::string const path = dir.file("bad.bin");
  synth_model const s(7);
  bytes const good = s.file();

  SECTION("too short for the header") {
    for (std::size_t n : {0, 1, 3, 4, 27}) {
      write_file(path, bytes(good.begin(), good.begin() + std::ptrdiff_t(n)));
      auto const msg = message_of<l2::format_error>([&] { l2::load_model(path); });
      INFO(msg);
      CHECK(contains(msg, "28-byte header"));
      CHECK(contains(msg, path));
    }
  }
  SECTION("every truncation, and extra bytes") {
    std::vector<std::size_t> sizes;
    for (std::size_t n = 28; n < good.size(); n += n < 200 ? 1 : 53) sizes.push_back(n);
    sizes.push_back(good.size() - 1);
    for (std::size_t n : sizes) {
      if (n == good.size() - 4 * 48 * 8) continue;  // exactly without the RoPE tables: accepted (tested above)
      write_file(path, bytes(good.begin(), good.begin() + std::ptrdiff_t(n)));
      auto const msg = message_of<l2::format_error>([&] { l2::load_model(path); });
      INFO(n << " bytes: " << msg);
      CHECK(contains(msg, "does not match the header"));
    }
    for (std::size_t extra : {1, 4, 400}) {
      bytes b = good;
      b.resize(b.size() + extra, 0);
      write_file(path, b);
      auto const msg = message_of<l2::format_error>([&] { l2::load_model(path); });
      INFO(msg);
      CHECK(contains(msg, "size " + std::to_string(b.size()) + " bytes"));
      CHECK(contains(msg, std::to_string(good.size())));
    }
  }
  SECTION("separate classifier needs the RoPE tables before wcls") {
    synth_model const u(8, false, false);  // wcls directly after rms_final: not the format
    write_file(path, u.file());
    auto const msg = message_of<l2::format_error>([&] { l2::load_model(path); });
    INFO(msg);
    CHECK(contains(msg, "negative vocab_size"));
  }
  SECTION("absurd but in-range dimensions fail on the size check, without allocating") {
    auto h = s.header();
    h = {65536, 1 << 20, 1024, 65536 / 128, 65536 / 128, -1000000, 10000000};
    write_file(path, s.file(h));
    auto const msg = message_of<l2::format_error>([&] { l2::load_model(path); });
    INFO(msg);
    CHECK(contains(msg, "does not match the header"));
  }
  SECTION("newer llama2.c export versions are named") {
    bytes b = good;
    b[0] = 0x32;  // int32 0x616b3432 little-endian = "24ka"; llama2.c writes the magic as that uint32
    b[1] = 0x34;
    b[2] = 0x6b;
    b[3] = 0x61;
    write_file(path, b);
    auto msg = message_of<l2::format_error>([&] { l2::load_model(path); });
    CHECK(contains(msg, "ak42"));
    std::memcpy(b.data(), "ak42", 4);
    write_file(path, b);
    msg = message_of<l2::format_error>([&] { l2::load_model(path); });
    CHECK(contains(msg, "ak42"));
  }
}

TEST_CASE("model files: non-finite weights name the tensor", "[llama2c][loader]") {
  temp_dir dir;
  std::string const path = dir.file("nan.bin");
  SECTION("NaN in wk") {
    synth_model s(9);
    s.wk[17] = std::numeric_limits<float>::quiet_NaN();
    write_file(path, s.file());
    auto const msg = message_of<l2::format_error>([&] { l2::load_model(path); });
    INFO(msg);
    CHECK(contains(msg, "tensor wk"));
    CHECK(contains(msg, "index 17"));
  }
  SECTION("Inf in the separate classifier") {
    synth_model s(10, false);
    s.wcls.back() = std::numeric_limits<float>::infinity();
    write_file(path, s.file());
    auto const msg = message_of<l2::format_error>([&] { l2::load_model(path); });
    INFO(msg);
    CHECK(contains(msg, "tensor wcls"));
  }
}

TEST_CASE("model files: unreadable paths are io_error", "[llama2c][loader]") {
  temp_dir dir;
  auto msg = message_of<l2::io_error>([&] { l2::load_model(dir.file("missing.bin")); });
  CHECK(contains(msg, "missing.bin"));
  CHECK(contains(msg, "does not exist"));
  msg = message_of<l2::io_error>([&] { l2::load_model(dir.path.string()); });
  CHECK(contains(msg, "not a regular file"));
  msg = message_of<l2::io_error>([&] { l2::load_tokenizer(dir.file("missing.bin"), 10); });
  CHECK(contains(msg, "tokenizer"));
  msg = message_of<l2::io_error>([&] { l2::read_text_file(dir.file("missing.txt")); });
  CHECK(contains(msg, "missing.txt"));
  // Both are kvq errors.
  CHECK_THROWS_AS(l2::load_model(dir.file("missing.bin")), kvq::error);
}

TEST_CASE("model files: random header corruption never crashes", "[llama2c][loader]") {
  temp_dir dir;
  std::string const path = dir.file("fuzz.bin");
  synth_model const s(11);
  bytes const good = s.file();
  std::mt19937 rng(12345);
  int loaded = 0, rejected = 0;
  for (int it = 0; it < 400; ++it) {
    bytes b = good;
    int const flips = 1 + int(rng() % 3);
    for (int f = 0; f < flips; ++f) b[rng() % 28] = static_cast<unsigned char>(rng());
    if (it % 4 == 0) b.resize(rng() % (b.size() + 1));
    write_file(path, b);
    try {
      auto const m = l2::load_model(path);
      ++loaded;
      l2::engine e(m, "f32", "f32");
      for (float x : e.forward(0, 0)) REQUIRE(std::isfinite(x));
    } catch (l2::format_error const&) {
      ++rejected;
    }
  }
  CHECK(loaded + rejected == 400);
  CHECK(rejected > 300);
}

// ---- tokenizer ---------------------------------------------------------------------------------

namespace {

/// A llama2.c-style vocabulary: specials, 256 byte pieces, then a few pieces to merge.
struct synth_tokenizer {
  int max_len = 7;
  std::vector<std::pair<float, std::string>> tokens;

  synth_tokenizer() {
    tokens = {{0.0f, "<unk>"}, {0.0f, "\n<s>\n"}, {0.0f, "\n</s>\n"}};
    char buf[8];
    for (int b = 0; b < 256; ++b) {
      std::snprintf(buf, sizeof buf, "<0x%02X>", b);
      tokens.emplace_back(0.0f, buf);
    }
    // 259 ...
    for (auto const& [score, piece] :
         std::vector<std::pair<float, std::string>>{{-1000, " "},
                                                    {-1000, "a"},
                                                    {-1000, "b"},
                                                    {-1000, "c"},  // 259-262
                                                    {-5, "aa"},
                                                    {-3, "ab"},
                                                    {-1, "bc"},
                                                    {-10, " a"},  // 263-266
                                                    {-1000, "\xC3\xA9"},
                                                    {-1000, "x"},
                                                    {-1000, "<0xZZ>"},  // 267-269 (é, x, not a byte)
                                                    {-1000, "x"},
                                                    {-1000, ""}})  // 270 (duplicate of x), 271 (empty)
      tokens.emplace_back(score, piece);
  }
  auto vocab() const -> int { return int(tokens.size()); }
  auto file() const -> bytes {
    bytes b;
    put_i32(b, max_len);
    for (auto const& [score, piece] : tokens) {
      put_f32(b, score);
      put_i32(b, std::int32_t(piece.size()));
      b.insert(b.end(), piece.begin(), piece.end());
    }
    return b;
  }
};

}  // namespace

TEST_CASE("tokenizer: run.c's encode and decode rules on a synthetic vocabulary", "[llama2c][tokenizer]") {
  temp_dir dir;
  synth_tokenizer const st;
  write_file(dir.file("t.bin"), st.file());
  auto const t = l2::load_tokenizer(dir.file("t.bin"), st.vocab());
  CHECK(t.vocab_size() == 272);
  CHECK(t.max_token_length() == 7);
  CHECK(t.lookup("x") == 268);  // first of a repeated piece
  CHECK(t.lookup("zz") == -1);
  CHECK(t.score(264) == -3.0f);

  CHECK(t.encode("", false).empty());
  CHECK(t.encode("", true, true) == std::vector<int>{1, 2});
  // Equal best scores: the leftmost pair merges first.
  CHECK(t.encode("aaa", false) == std::vector<int>{259, 263, 260});
  // The highest score wins over position: "bc" (-1) before "ab" (-3), then " a" (-10).
  CHECK(t.encode("abc", false) == std::vector<int>{266, 265});
  CHECK(t.encode("abc", true, true) == std::vector<int>{1, 266, 265, 2});
  // Code points: a known one is one piece; an unknown one is its bytes + 3.
  CHECK(t.encode("\xC3\xA9", false) == std::vector<int>{259, 267});
  CHECK(t.encode("\xC3\xBC", false) == std::vector<int>{259, 0xC3 + 3, 0xBC + 3});
  CHECK(t.encode("\xF0\x9F\x98\x80", false) == std::vector<int>{259, 0xF0 + 3, 0x9F + 3, 0x98 + 3, 0x80 + 3});
  // A lead byte groups up to 3 continuation bytes (so "é" + a stray continuation is not "é").
  CHECK(t.encode("\xC3\xA9\xA9", false) == std::vector<int>{259, 0xC3 + 3, 0xA9 + 3, 0xA9 + 3});
  CHECK(t.encode("\x80", false) == std::vector<int>{259, 0x80 + 3});
  CHECK(t.encode("\n", false) == std::vector<int>{259, 13});
  std::string const with_nul("a\0b", 3);
  CHECK(t.encode(with_nul, false) == std::vector<int>{266, 3, 261});

  CHECK(t.decode(1, 266) == "a");  // space dropped after BOS
  CHECK(t.decode(260, 266) == " a");
  CHECK(t.decode(1, 0x41 + 3) == "A");
  CHECK(t.decode(1, 0x0A + 3) == "\n");
  CHECK(t.decode(1, 3) == std::string(1, '\0'));
  CHECK(t.decode(1, 269) == "<0xZZ>");  // not a byte piece: literal
  CHECK(t.decode(1, 271).empty());
  auto const ids = t.encode("abc aaa\xC3\xBCx", true);
  CHECK(t.decode(std::span<int const>(ids).subspan(1)) == "abc aaa\xC3\xBCx");
  CHECK_THROWS_AS(t.decode(1, 272), kvq::index_error);

  // A vocabulary without byte-fallback tokens cannot encode unknown bytes: a typed error.
  synth_tokenizer small;
  small.tokens.resize(100);
  write_file(dir.file("small.bin"), small.file());
  auto const ts = l2::load_tokenizer(dir.file("small.bin"), 100);
  CHECK_THROWS_AS(ts.encode("\xFF", false), kvq::invalid_argument_error);
}

TEST_CASE("tokenizer files: malformed contents name the problem", "[llama2c][tokenizer]") {
  temp_dir dir;
  std::string const path = dir.file("t.bin");
  synth_tokenizer const st;
  bytes const good = st.file();
  int const V = st.vocab();
  auto fails = [&](bytes const& b, int vocab = 272) {
    write_file(path, b);
    auto const msg = message_of<l2::format_error>([&] { l2::load_tokenizer(path, vocab); });
    CHECK(contains(msg, path));
    return msg;
  };

  CHECK(contains(fails({}), "too short"));
  CHECK(contains(fails({7, 0, 0}), "too short"));
  for (std::int32_t m : {0, -5, 65537, std::numeric_limits<std::int32_t>::min()}) {
    bytes b = good;
    set_i32(b, 0, m);
    CHECK(contains(fails(b), "max_token_length = " + std::to_string(m)));
  }
  {
    bytes b = good;  // token 0's score is NaN
    set_i32(b, 4, 0x7fc00000);
    CHECK(contains(fails(b), "token 0 has a NaN score"));
  }
  {
    bytes b = good;  // token 0's length is -1
    set_i32(b, 8, -1);
    CHECK(contains(fails(b), "token 0 has length -1"));
  }
  {
    bytes b = good;  // token 0's length is huge
    set_i32(b, 8, std::numeric_limits<std::int32_t>::max());
    CHECK(contains(fails(b), "outside [0, max_token_length = 7]"));
  }
  {
    bytes b = good;  // max_token_length 5: token 2 ("\n</s>\n", 6 bytes) is too long
    set_i32(b, 0, 5);
    CHECK(contains(fails(b), "token 2 has length 6"));
  }
  {
    bytes b = good;
    b.push_back(0);
    CHECK(contains(fails(b), "1 trailing bytes"));
  }
  CHECK(contains(fails(good, V - 1), "trailing bytes"));
  CHECK(contains(fails(good, V + 1), "truncated at token 272"));
  // Every truncation is a format_error (never a crash or an over-read).
  for (std::size_t n = 4; n < good.size(); ++n) {
    write_file(path, bytes(good.begin(), good.begin() + std::ptrdiff_t(n)));
    CHECK_THROWS_AS(l2::load_tokenizer(path, V), l2::format_error);
  }
  // vocab_size is the caller's argument: out of range is invalid_argument_error.
  write_file(path, good);
  CHECK_THROWS_AS(l2::load_tokenizer(path, 0), kvq::invalid_argument_error);
  CHECK_THROWS_AS(l2::load_tokenizer(path, -3), kvq::invalid_argument_error);
  CHECK_THROWS_AS(l2::load_tokenizer(path, 1000001), kvq::invalid_argument_error);
  // Random corruption: loads or format_error.
  std::mt19937 rng(99);
  for (int it = 0; it < 300; ++it) {
    bytes b = good;
    for (int f = 0; f < 3; ++f) b[rng() % b.size()] = static_cast<unsigned char>(rng());
    write_file(path, b);
    try {
      auto const t = l2::load_tokenizer(path, V);
      CHECK(t.vocab_size() == V);
      (void)t.encode("abc aaa\xC3\xBC", true);
    } catch (l2::format_error const&) {
    }
  }
}

TEST_CASE("real model files: truncated and extended copies are rejected", "[llama2c][loader]") {
  char const* env = std::getenv("KVQ_MODELS_DIR");
  std::string const dir_models = env != nullptr && *env != '\0' ? env : KVQ_MODELS_DIR;
  std::string const model = dir_models + "/stories260K/stories260K.bin";
  std::string const tok = dir_models + "/stories260K/tok512.bin";
  if (!fs::is_regular_file(model) || !fs::is_regular_file(tok)) {
    WARN("stories260K files not found under " << dir_models << ": real-file truncation checks not run");
    return;
  }
  temp_dir dir;
  std::string const path = dir.file("copy.bin");
  bytes const m = read_file(model);
  REQUIRE(m.size() == 1056540);
  for (std::size_t n : {std::size_t(0), std::size_t(3), std::size_t(27), std::size_t(28), std::size_t(29),
                        std::size_t(1000), m.size() / 2, m.size() - 4 * 2048 - 1, m.size() - 4, m.size() - 1}) {
    write_file(path, bytes(m.begin(), m.begin() + std::ptrdiff_t(n)));
    auto const msg = message_of<l2::format_error>([&] { l2::load_model(path); });
    INFO(n << " bytes: " << msg);
    CHECK(contains(msg, path));
  }
  {
    // Dropping exactly the two RoPE tables is the accepted table-less layout.
    write_file(path, bytes(m.begin(), m.end() - 4 * 2 * 2048));
    auto const lm = l2::load_model(path);
    CHECK(lm.config().dim == 64);
  }
  {
    bytes b = m;
    b.insert(b.end(), {0, 0, 0, 0});
    write_file(path, b);
    CHECK_THROWS_AS(l2::load_model(path), l2::format_error);
  }
  bytes const t = read_file(tok);
  REQUIRE(t.size() == 6227);
  for (std::size_t n = 0; n < t.size(); ++n) {
    write_file(path, bytes(t.begin(), t.begin() + std::ptrdiff_t(n)));
    CHECK_THROWS_AS(l2::load_tokenizer(path, 512), l2::format_error);
  }
  write_file(path, t);
  CHECK(l2::load_tokenizer(path, 512).vocab_size() == 512);
}
