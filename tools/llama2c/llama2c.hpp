// kvq::llama2c: a tiny inference engine for llama2.c "version 0" model files whose KV cache is a
// kvq cache. It is the example of integrating kvq into an engine and the real-model harness of the
// tests and of kvq-eval (perplexity, KL divergence and top-1 agreement of every codec).
//
// Depends on kvq and the standard library only. Single-threaded, batch 1, one sequence per engine;
// forward_pass is the engine's arithmetic without a cache, for engines that keep their own (kvq-eval
// --paged runs many sequences through one paged cache with it).
//
//   auto m = kvq::llama2c::load_model("stories260K.bin");
//   auto t = kvq::llama2c::load_tokenizer("tok512.bin", m.config().vocab_size);
//   kvq::llama2c::engine e(m, "kivi4", "kivi4", {.residual = 32});
//   auto ids = kvq::llama2c::greedy(e, 256);          // token ids after BOS
//   auto r = kvq::llama2c::perplexity(e, t, text);     // {nll, ppl, tokens, stories}
//
// File formats (accepted exactly as described here; anything else raises format_error):
//
// * Model (llama2.c legacy export, version 0): a header of 7 little-endian int32 — dim, hidden_dim,
//   n_layers, n_heads, n_kv_heads, vocab_size, seq_len — then float32 little-endian tensors, in
//   order: token_embedding [V][dim], rms_att [L][dim], wq [L][dim][dim], wk [L][kv_dim][dim],
//   wv [L][kv_dim][dim], wo [L][dim][dim], rms_ffn [L][dim], w1 [L][hidden][dim],
//   w2 [L][dim][hidden], w3 [L][hidden][dim], rms_final [dim], then the legacy RoPE tables
//   freq_cis_real and freq_cis_imag ([seq_len][head_dim/2] each, ignored), then wcls [V][dim] when
//   vocab_size is negative (V = |vocab_size|; a positive vocab_size shares the embedding table as
//   the classifier). Accepted file sizes:
//     - shared classifier:   28 + 4·(weights + RoPE tables)   (what llama2.c writes), or
//                            28 + 4·weights                   (RoPE tables omitted);
//     - separate classifier: 28 + 4·(weights + RoPE tables + V·dim) only (wcls follows the tables).
//   Header limits: 1 ≤ dim ≤ 65536, 1 ≤ hidden_dim ≤ 2^20, 1 ≤ n_layers ≤ 1024,
//   1 ≤ n_heads ≤ dim with n_heads | dim and head_dim = dim / n_heads even, 1 ≤ n_kv_heads ≤ n_heads
//   with n_kv_heads | n_heads, 1 ≤ |vocab_size| ≤ 10^6, 1 ≤ seq_len ≤ 10^7. Every weight (not the
//   ignored RoPE tables) must be finite. A file starting with the magic "ak42" (llama2.c's newer
//   export versions) is named as such.
// * Tokenizer (llama2.c tokenizer.bin): int32 max_token_length (1 ≤ · ≤ 65536), then vocab_size
//   records of {float32 score (not NaN), int32 len (0 ≤ len ≤ max_token_length), len bytes}; the
//   file must end exactly after the last record.
//
// Errors: io_error (a file cannot be opened or read) and format_error (its contents are malformed)
// derive from kvq::error; messages name the file and the field. Misuse of the engine (bad token,
// position out of order, unknown codec) raises kvq's own typed errors.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

// GCC 12 at -O3 reports a false -Wrestrict inside std::string's operator+ as inlined into
// kvq/any_cache.hpp's error messages (a known GCC 12 false positive); keep -Werror builds of this
// header working until that header sidesteps it.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 12
#  pragma GCC diagnostic push
#  pragma GCC diagnostic ignored "-Wrestrict"
#endif
#include <kvq/any_cache.hpp>
#include <kvq/attention.hpp>
#include <kvq/error.hpp>
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 12
#  pragma GCC diagnostic pop
#endif

namespace kvq::llama2c {

/// A model or tokenizer file's contents are malformed (message names the file and the field).
class format_error : public ::kvq::error {
 public:
  using ::kvq::error::error;
};

/// A file cannot be opened or read.
class io_error : public ::kvq::error {
 public:
  using ::kvq::error::error;
};

/// Token ids with a fixed meaning in llama2.c tokenizers.
inline constexpr int token_unk = 0;
inline constexpr int token_bos = 1;
inline constexpr int token_eos = 2;
/// Byte b is token b + byte_token_offset (byte fallback).
inline constexpr int byte_token_offset = 3;

/// Hyper-parameters from the model header (vocab_size is stored positive; see shared_classifier).
struct config {
  int dim = 0;
  int hidden_dim = 0;
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int vocab_size = 0;
  int seq_len = 0;
  bool shared_classifier = true;  ///< the classifier is the token embedding table

  constexpr auto head_dim() const -> int { return dim / n_heads; }
  constexpr auto kv_dim() const -> int { return n_kv_heads * head_dim(); }
};

namespace detail {

using u64 = std::uint64_t;

/// a·b, or false on overflow.
inline auto mul(u64 a, u64 b, u64& r) -> bool {
  if (a != 0 && b > std::numeric_limits<u64>::max() / a) return false;
  r = a * b;
  return true;
}

/// a + b, or false on overflow.
inline auto add(u64 a, u64 b, u64& r) -> bool {
  if (b > std::numeric_limits<u64>::max() - a) return false;
  r = a + b;
  return true;
}

/// Product of the factors, or false on overflow.
inline auto product(std::initializer_list<u64> factors, u64& r) -> bool {
  r = 1;
  for (u64 f : factors)
    if (!mul(r, f, r)) return false;
  return true;
}

inline auto byteswap32(std::uint32_t v) -> std::uint32_t {
  return (v >> 24) | ((v >> 8) & 0xff00u) | ((v << 8) & 0xff0000u) | (v << 24);
}

/// Little-endian int32 / float32 from 4 bytes.
inline auto le_u32(unsigned char const* p) -> std::uint32_t {
  return static_cast<std::uint32_t>(p[0]) | (static_cast<std::uint32_t>(p[1]) << 8) |
         (static_cast<std::uint32_t>(p[2]) << 16) | (static_cast<std::uint32_t>(p[3]) << 24);
}
inline auto le_i32(unsigned char const* p) -> std::int32_t { return std::bit_cast<std::int32_t>(le_u32(p)); }
inline auto le_f32(unsigned char const* p) -> float { return std::bit_cast<float>(le_u32(p)); }

/// Size of a regular file, or io_error.
inline auto file_size(std::string const& path, char const* what) -> u64 {
  std::error_code ec;
  auto const st = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(st))
    ::kvq::detail::raise<io_error>(std::string(what) + " file '" + path + "' cannot be opened: it does not exist");
  if (!std::filesystem::is_regular_file(st))
    ::kvq::detail::raise<io_error>(std::string(what) + " file '" + path + "' is not a regular file");
  auto const n = std::filesystem::file_size(path, ec);
  if (ec)
    ::kvq::detail::raise<io_error>(std::string(what) + " file '" + path + "': cannot get its size: " + ec.message());
  return static_cast<u64>(n);
}

/// Opens a file for binary reading, or io_error.
inline auto open_binary(std::string const& path, char const* what) -> std::ifstream {
  std::ifstream in(path, std::ios::binary);
  if (!in) ::kvq::detail::raise<io_error>(std::string(what) + " file '" + path + "' cannot be opened for reading");
  return in;
}

/// Reads exactly n bytes into dst, or io_error.
inline void read_exact(std::ifstream& in, void* dst, u64 n, std::string const& path, char const* what) {
  in.read(static_cast<char*>(dst), static_cast<std::streamsize>(n));
  if (!in || static_cast<u64>(in.gcount()) != n)
    ::kvq::detail::raise<io_error>(std::string(what) + " file '" + path +
                                   "': read error (file changed while loading?)");
}

/// y[i] = Σ_j w[i·n + j] · x[j] for i < d (row-major [d][n]); float accumulation in 8 fixed lanes.
inline void matmul(float* y, float const* x, float const* w, int n, int d) {
  for (int i = 0; i < d; ++i) {
    float const* row = w + static_cast<std::size_t>(i) * static_cast<std::size_t>(n);
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int j = 0;
    for (; j + 8 <= n; j += 8)
      for (int k = 0; k < 8; ++k) acc[k] += row[j + k] * x[j + k];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; j < n; ++j) s += row[j] * x[j];
    y[i] = s;
  }
}

/// out = x · w / sqrt(mean(x²) + 1e-5) (out may alias x).
inline void rmsnorm(float* out, float const* x, float const* w, int n) {
  double ss = 0.0;
  for (int i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  float const inv = static_cast<float>(1.0 / std::sqrt(ss / n + 1e-5));
  for (int i = 0; i < n; ++i) out[i] = w[i] * (inv * x[i]);
}

}  // namespace detail

class model;
class tokenizer;
inline auto load_model(std::string const& path) -> model;
inline auto load_tokenizer(std::string const& path, int vocab_size) -> tokenizer;

/// The weights of a llama2.c model (one float buffer; tensors are views into it).
class model {
 public:
  model() = default;

  auto config() const noexcept -> llama2c::config const& { return cfg_; }
  /// The file it was loaded from.
  auto path() const noexcept -> std::string const& { return path_; }
  /// Number of parameters (the ignored RoPE tables excluded).
  auto parameter_count() const noexcept -> std::size_t { return params_; }

  auto token_embedding() const -> float const* { return at(off_.emb); }
  auto rms_att(int l) const -> float const* { return at(off_.rms_att, l, sq(cfg_.dim, 1)); }
  auto wq(int l) const -> float const* { return at(off_.wq, l, sq(cfg_.dim, cfg_.dim)); }
  auto wk(int l) const -> float const* { return at(off_.wk, l, sq(cfg_.kv_dim(), cfg_.dim)); }
  auto wv(int l) const -> float const* { return at(off_.wv, l, sq(cfg_.kv_dim(), cfg_.dim)); }
  auto wo(int l) const -> float const* { return at(off_.wo, l, sq(cfg_.dim, cfg_.dim)); }
  auto rms_ffn(int l) const -> float const* { return at(off_.rms_ffn, l, sq(cfg_.dim, 1)); }
  auto w1(int l) const -> float const* { return at(off_.w1, l, sq(cfg_.hidden_dim, cfg_.dim)); }
  auto w2(int l) const -> float const* { return at(off_.w2, l, sq(cfg_.dim, cfg_.hidden_dim)); }
  auto w3(int l) const -> float const* { return at(off_.w3, l, sq(cfg_.hidden_dim, cfg_.dim)); }
  auto rms_final() const -> float const* { return at(off_.rms_final); }
  /// The classifier [vocab][dim] (the embedding table when shared).
  auto wcls() const -> float const* { return at(off_.wcls); }

 private:
  friend auto load_model(std::string const& path) -> model;

  struct offsets {
    std::size_t emb = 0, rms_att = 0, wq = 0, wk = 0, wv = 0, wo = 0, rms_ffn = 0, w1 = 0, w2 = 0, w3 = 0,
                rms_final = 0, wcls = 0;
  };

  static constexpr auto sq(int a, int b) -> std::size_t {
    return static_cast<std::size_t>(a) * static_cast<std::size_t>(b);
  }
  auto at(std::size_t off) const -> float const* { return w_.data() + off; }
  auto at(std::size_t off, int layer, std::size_t per_layer) const -> float const* {
    ::kvq::detail::check<index_error>(
        layer >= 0 && layer < cfg_.n_layers,
        "llama2c: layer " + std::to_string(layer) + " is out of range [0, " + std::to_string(cfg_.n_layers) + ")");
    return w_.data() + off + static_cast<std::size_t>(layer) * per_layer;
  }

  llama2c::config cfg_{};
  std::string path_;
  std::vector<float> w_;
  offsets off_{};
  std::size_t params_ = 0;
};

/// Loads and validates a llama2.c version-0 model file (see the top of this header for exactly
/// what is accepted). Raises io_error or format_error; never reads past what it validated.
inline auto load_model(std::string const& path) -> model {
  using detail::u64;
  auto fail = [&](std::string const& why) { ::kvq::detail::raise<format_error>("model file '" + path + "': " + why); };
  u64 const size = detail::file_size(path, "model");
  std::ifstream in = detail::open_binary(path, "model");

  constexpr u64 header_bytes = 28;
  if (size < 4) fail("file too short for the 28-byte header (" + std::to_string(size) + " bytes)");
  unsigned char hdr[header_bytes] = {};
  detail::read_exact(in, hdr, std::min<u64>(size, header_bytes), path, "model");
  if (std::memcmp(hdr, "ak42", 4) == 0 || detail::le_u32(hdr) == 0x616b3432u)
    fail(
        "starts with the magic 'ak42' of llama2.c's newer export versions; only the legacy version-0 format "
        "(no magic, 7 int32 header) is supported");
  if (size < header_bytes) fail("file too short for the 28-byte header (" + std::to_string(size) + " bytes)");

  std::int32_t f[7];
  for (int i = 0; i < 7; ++i) f[i] = detail::le_i32(hdr + 4 * i);
  auto field = [&](char const* name, std::int64_t v, std::int64_t lo, std::int64_t hi) {
    if (v < lo || v > hi)
      fail("header field " + std::string(name) + " = " + std::to_string(v) + " is outside [" + std::to_string(lo) +
           ", " + std::to_string(hi) + "]");
  };
  config c;
  field("dim", f[0], 1, 65536);
  field("hidden_dim", f[1], 1, std::int64_t{1} << 20);
  field("n_layers", f[2], 1, 1024);
  field("n_heads", f[3], 1, f[0]);
  field("n_kv_heads", f[4], 1, f[3]);
  std::int64_t const vocab = f[5];  // int64: |INT32_MIN| fits
  if (vocab == 0 || vocab < -1000000 || vocab > 1000000)
    fail("header field vocab_size = " + std::to_string(vocab) + " must be non-zero with |vocab_size| <= 1000000");
  field("seq_len", f[6], 1, 10000000);
  c.dim = f[0];
  c.hidden_dim = f[1];
  c.n_layers = f[2];
  c.n_heads = f[3];
  c.n_kv_heads = f[4];
  c.vocab_size = static_cast<int>(vocab < 0 ? -vocab : vocab);
  c.shared_classifier = vocab > 0;
  c.seq_len = f[6];
  if (c.dim % c.n_heads != 0)
    fail("header field n_heads = " + std::to_string(c.n_heads) + " does not divide dim = " + std::to_string(c.dim));
  if (c.head_dim() % 2 != 0)
    fail("head_dim = dim / n_heads = " + std::to_string(c.head_dim()) + " is odd (RoPE rotates pairs)");
  if (c.n_heads % c.n_kv_heads != 0)
    fail("header field n_kv_heads = " + std::to_string(c.n_kv_heads) +
         " does not divide n_heads = " + std::to_string(c.n_heads));

  // Tensor sizes in floats, overflow-checked (the limits above keep them far from 2^64, but the
  // arithmetic does not rely on it).
  u64 const D = static_cast<u64>(c.dim), H = static_cast<u64>(c.hidden_dim), L = static_cast<u64>(c.n_layers),
            KV = static_cast<u64>(c.kv_dim()), V = static_cast<u64>(c.vocab_size), S = static_cast<u64>(c.seq_len),
            HD = static_cast<u64>(c.head_dim());
  struct tensor {
    char const* name;
    u64 floats;
    bool weight;  // false: the ignored RoPE tables
  };
  std::vector<tensor> tensors;
  bool ok = true;
  auto push = [&](char const* name, std::initializer_list<u64> dims, bool weight = true) {
    u64 n = 0;
    ok = ok && detail::product(dims, n);
    tensors.push_back({name, n, weight});
  };
  push("token_embedding", {V, D});
  push("rms_att", {L, D});
  push("wq", {L, D, D});
  push("wk", {L, KV, D});
  push("wv", {L, KV, D});
  push("wo", {L, D, D});
  push("rms_ffn", {L, D});
  push("w1", {L, H, D});
  push("w2", {L, D, H});
  push("w3", {L, H, D});
  push("rms_final", {D});
  std::size_t const n_weights = tensors.size();
  push("freq_cis_real", {S, HD / 2}, false);
  push("freq_cis_imag", {S, HD / 2}, false);
  if (!c.shared_classifier) push("wcls", {V, D});

  u64 weights = 0, tables = 0, wcls = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    u64& sum = i < n_weights ? weights : (tensors[i].weight ? wcls : tables);
    ok = ok && detail::add(sum, tensors[i].floats, sum);
  }
  auto bytes_of = [&](u64 floats, u64& out) {
    return detail::mul(floats, 4, out) && detail::add(out, header_bytes, out);
  };
  u64 with_tables = 0, without_tables = 0, all = 0;
  u64 f_with = 0;
  ok = ok && detail::add(weights, tables, f_with) && bytes_of(f_with, with_tables) && bytes_of(weights, without_tables);
  u64 f_all = 0;
  ok = ok && detail::add(f_with, wcls, f_all) && bytes_of(f_all, all);
  if (!ok) fail("the header's dimensions overflow 64-bit size arithmetic");

  bool keep_tables = true;
  if (c.shared_classifier) {
    if (size == with_tables) {
      keep_tables = true;
    } else if (size == without_tables) {
      keep_tables = false;
    } else {
      fail("size " + std::to_string(size) + " bytes does not match the header (dim " + std::to_string(c.dim) +
           ", hidden_dim " + std::to_string(c.hidden_dim) + ", n_layers " + std::to_string(c.n_layers) + ", n_heads " +
           std::to_string(c.n_heads) + ", n_kv_heads " + std::to_string(c.n_kv_heads) + ", vocab_size " +
           std::to_string(vocab) + ", seq_len " + std::to_string(c.seq_len) + "): expected " +
           std::to_string(with_tables) + " bytes (with the RoPE tables) or " + std::to_string(without_tables) +
           " (without) — truncated or not a llama2.c version-0 file?");
    }
  } else if (size != all) {
    fail("size " + std::to_string(size) + " bytes does not match the header (negative vocab_size " +
         std::to_string(vocab) + ": separate classifier after the RoPE tables): expected " + std::to_string(all) +
         " bytes — truncated or not a llama2.c version-0 file?");
  }

  // The sizes match the real file, so the allocation below is bounded by the file size.
  u64 const file_floats = (size - header_bytes) / 4;
  if (file_floats > std::vector<float>().max_size()) fail("too large for this platform");
  model m;
  m.path_ = path;
  m.cfg_ = c;
  m.w_.resize(static_cast<std::size_t>(file_floats));
  in.seekg(static_cast<std::streamoff>(header_bytes));
  detail::read_exact(in, m.w_.data(), file_floats * 4, path, "model");
  if constexpr (std::endian::native == std::endian::big) {
    for (auto& x : m.w_) x = std::bit_cast<float>(detail::byteswap32(std::bit_cast<std::uint32_t>(x)));
  }

  // Offsets, and every weight finite.
  std::size_t off = 0;
  std::vector<std::size_t> starts;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    auto const& t = tensors[i];
    if (!t.weight && !keep_tables) {
      starts.push_back(off);
      continue;
    }
    starts.push_back(off);
    if (t.weight) {
      for (std::size_t j = 0; j < t.floats; ++j) {
        float const x = m.w_[off + j];
        if (!std::isfinite(x))
          fail("tensor " + std::string(t.name) + " holds a non-finite value (" + std::to_string(x) + ") at index " +
               std::to_string(j) + " (file offset " + std::to_string(header_bytes + 4 * (off + j)) + ")");
      }
      m.params_ += static_cast<std::size_t>(t.floats);
    }
    off += static_cast<std::size_t>(t.floats);
  }
  m.off_.emb = starts[0];
  m.off_.rms_att = starts[1];
  m.off_.wq = starts[2];
  m.off_.wk = starts[3];
  m.off_.wv = starts[4];
  m.off_.wo = starts[5];
  m.off_.rms_ffn = starts[6];
  m.off_.w1 = starts[7];
  m.off_.w2 = starts[8];
  m.off_.w3 = starts[9];
  m.off_.rms_final = starts[10];
  m.off_.wcls = c.shared_classifier ? starts[0] : starts[13];
  return m;
}

/// A llama2.c tokenizer: pieces, merge scores and run.c's encode/decode rules.
class tokenizer {
 public:
  tokenizer() = default;

  auto vocab_size() const noexcept -> int { return static_cast<int>(pieces_.size()); }
  auto max_token_length() const noexcept -> int { return max_len_; }
  auto piece(int id) const -> std::string const& {
    check_id(id);
    return pieces_[static_cast<std::size_t>(id)];
  }
  auto score(int id) const -> float {
    check_id(id);
    return scores_[static_cast<std::size_t>(id)];
  }
  /// The id of an exact piece, or -1 (the lowest id when a piece occurs twice).
  auto lookup(std::string_view s) const -> int {
    auto const it = index_.find(std::string(s));
    return it == index_.end() ? -1 : it->second;
  }

  /// Encodes `text` as run.c does: [BOS] if `bos`; the dummy-prefix piece " " when the text is
  /// non-empty; each UTF-8 code point (a byte plus up to 3 continuation bytes) as its piece or,
  /// when absent, as byte tokens (byte + 3); then repeatedly the adjacent pair whose concatenation
  /// is a piece with the highest score (leftmost on ties) is merged; [EOS] if `eos`.
  auto encode(std::string_view text, bool bos, bool eos = false) const -> std::vector<int> {
    std::vector<int> ids;
    if (bos) ids.push_back(checked_special(token_bos, "BOS"));
    auto push_chunk = [&](std::string_view chunk) {
      int const id = lookup(chunk);
      if (id >= 0) {
        ids.push_back(id);
        return;
      }
      for (char ch : chunk) {
        int const b = static_cast<unsigned char>(ch) + byte_token_offset;
        ::kvq::detail::check<invalid_argument_error>(
            b < vocab_size(), "llama2c: byte " + std::to_string(b - byte_token_offset) +
                                  " has no byte-fallback token in a vocabulary of " + std::to_string(vocab_size()));
        ids.push_back(b);
      }
    };
    if (!text.empty()) push_chunk(" ");
    for (std::size_t i = 0; i < text.size();) {
      std::size_t j = i + 1;
      while (j < text.size() && (static_cast<unsigned char>(text[j]) & 0xC0) == 0x80 && j - i < 4) ++j;
      push_chunk(text.substr(i, j - i));
      i = j;
    }
    // Merges. Each adjacent pair's merge (id, or -1) is looked up once and refreshed only next to
    // a merge; the choice (highest score, leftmost on ties) is run.c's.
    std::vector<int> merge(ids.size() > 1 ? ids.size() - 1 : 0);
    std::string pair;
    auto merged = [&](std::size_t i) {
      pair = pieces_[static_cast<std::size_t>(ids[i])];
      pair += pieces_[static_cast<std::size_t>(ids[i + 1])];
      auto const it = index_.find(pair);
      return it == index_.end() ? -1 : it->second;
    };
    for (std::size_t i = 0; i < merge.size(); ++i) merge[i] = merged(i);
    while (!merge.empty()) {
      std::size_t best = merge.size();
      for (std::size_t i = 0; i < merge.size(); ++i)
        if (merge[i] >= 0 && (best == merge.size() || scores_[static_cast<std::size_t>(merge[i])] >
                                                          scores_[static_cast<std::size_t>(merge[best])]))
          best = i;
      if (best == merge.size()) break;
      ids[best] = merge[best];
      ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(best) + 1);
      merge.erase(merge.begin() + static_cast<std::ptrdiff_t>(best));
      if (best < merge.size()) merge[best] = merged(best);
      if (best > 0) merge[best - 1] = merged(best - 1);
    }
    if (eos) ids.push_back(checked_special(token_eos, "EOS"));
    return ids;
  }

  /// The text of `token` following `prev` (run.c rules): after BOS a leading space is dropped; a
  /// piece "<0xHH>" is the raw byte HH.
  auto decode(int prev, int token) const -> std::string {
    std::string_view p = piece(token);
    if (prev == token_bos && !p.empty() && p.front() == ' ') p.remove_prefix(1);
    if (p.size() == 6 && p.substr(0, 3) == "<0x" && p[5] == '>') {
      int const hi = hex_digit(p[3]), lo = hex_digit(p[4]);
      if (hi >= 0 && lo >= 0) return std::string(1, static_cast<char>(hi * 16 + lo));
    }
    return std::string(p);
  }

  /// The text of a token sequence that followed `prev` (BOS by default).
  auto decode(std::span<int const> tokens, int prev = token_bos) const -> std::string {
    std::string out;
    for (int t : tokens) {
      out += decode(prev, t);
      prev = t;
    }
    return out;
  }

 private:
  friend auto load_tokenizer(std::string const& path, int vocab_size) -> tokenizer;

  static auto hex_digit(char ch) -> int {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    return -1;
  }
  void check_id(int id) const {
    ::kvq::detail::check<index_error>(id >= 0 && id < vocab_size(), "llama2c: token " + std::to_string(id) +
                                                                        " is outside the vocabulary [0, " +
                                                                        std::to_string(vocab_size()) + ")");
  }
  auto checked_special(int id, char const* name) const -> int {
    ::kvq::detail::check<invalid_argument_error>(id < vocab_size(), std::string("llama2c: the vocabulary of ") +
                                                                        std::to_string(vocab_size()) + " has no " +
                                                                        name + " token " + std::to_string(id));
    return id;
  }

  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string, int> index_;
  int max_len_ = 0;
};

/// Loads and validates a llama2.c tokenizer file holding exactly `vocab_size` tokens.
/// Raises invalid_argument_error for vocab_size outside [1, 10^6], io_error, or format_error.
inline auto load_tokenizer(std::string const& path, int vocab_size) -> tokenizer {
  using detail::u64;
  ::kvq::detail::check<invalid_argument_error>(
      vocab_size >= 1 && vocab_size <= 1000000,
      "load_tokenizer: vocab_size = " + std::to_string(vocab_size) + " must be in [1, 1000000]");
  auto fail = [&](std::string const& why) {
    ::kvq::detail::raise<format_error>("tokenizer file '" + path + "': " + why);
  };
  u64 const size = detail::file_size(path, "tokenizer");
  // A tokenizer of up to 10^6 pieces of up to 65536 bytes: refuse absurd files before reading.
  if (size > (u64{1} << 32)) fail("size " + std::to_string(size) + " bytes is implausibly large for a tokenizer");
  std::ifstream in = detail::open_binary(path, "tokenizer");
  std::vector<unsigned char> buf(static_cast<std::size_t>(size));
  detail::read_exact(in, buf.data(), size, path, "tokenizer");

  if (size < 4) fail("file too short for the 4-byte max_token_length (" + std::to_string(size) + " bytes)");
  std::int32_t const max_len = detail::le_i32(buf.data());
  if (max_len < 1 || max_len > 65536) fail("max_token_length = " + std::to_string(max_len) + " is outside [1, 65536]");
  tokenizer t;
  t.max_len_ = max_len;
  t.pieces_.reserve(static_cast<std::size_t>(vocab_size));
  t.scores_.reserve(static_cast<std::size_t>(vocab_size));
  std::size_t pos = 4;
  for (int i = 0; i < vocab_size; ++i) {
    if (size - pos < 8)
      fail("truncated at token " + std::to_string(i) + " of " + std::to_string(vocab_size) +
           ": its score and length need 8 bytes at offset " + std::to_string(pos) + ", " + std::to_string(size - pos) +
           " left");
    float const score = detail::le_f32(buf.data() + pos);
    std::int32_t const len = detail::le_i32(buf.data() + pos + 4);
    if (std::isnan(score)) fail("token " + std::to_string(i) + " has a NaN score (offset " + std::to_string(pos) + ")");
    if (len < 0 || len > max_len)
      fail("token " + std::to_string(i) + " has length " + std::to_string(len) +
           " outside [0, max_token_length = " + std::to_string(max_len) + "] (offset " + std::to_string(pos + 4) + ")");
    pos += 8;
    if (size - pos < static_cast<u64>(len))
      fail("truncated in token " + std::to_string(i) + ": its " + std::to_string(len) + " bytes at offset " +
           std::to_string(pos) + " run past the end (" + std::to_string(size - pos) + " left)");
    t.pieces_.emplace_back(reinterpret_cast<char const*>(buf.data() + pos), static_cast<std::size_t>(len));
    t.scores_.push_back(score);
    t.index_.emplace(t.pieces_.back(), i);  // keeps the first id of a repeated piece
    pos += static_cast<std::size_t>(len);
  }
  if (pos != size)
    fail(std::to_string(size - pos) + " trailing bytes after the last of " + std::to_string(vocab_size) +
         " tokens (offset " + std::to_string(pos) + "): wrong vocab_size or not a tokenizer file?");
  return t;
}

/// Reads a whole text file (e.g. the perplexity sample), or io_error.
inline auto read_text_file(std::string const& path) -> std::string {
  auto const size = detail::file_size(path, "text");
  std::ifstream in = detail::open_binary(path, "text");
  std::string s(static_cast<std::size_t>(size), '\0');
  detail::read_exact(in, s.data(), size, path, "text");
  return s;
}

/// One token's forward pass of a llama2.c model, split at the KV cache, so that an engine with its
/// own cache (e.g. a paged cache whose attention runs batched over sequences) runs the arithmetic of
/// `engine` exactly.
///
/// Per token: begin(token, pos); then per layer l in order: qkv(l) (RMSNorm (eps 1e-5) → q, k, v →
/// RoPE on adjacent pairs (2i, 2i+1) of q and k, with freq = 10000^(−(i mod head_dim)/head_dim)),
/// the caller stores k() and v() in its cache and writes the attention of q() over layer l (scale
/// 1/sqrt(head_dim), GQA) into att(), then finish_layer(l) (wo → residual; RMSNorm → SwiGLU FFN
/// (w2(silu(w1 x) · w3 x)) → residual); last, logits() (final RMSNorm and the classifier).
///
/// The model must outlive the pass. Not thread-safe; one pass per sequence in flight.
class forward_pass {
 public:
  /// Buffers for `m`; raises invalid_argument_error when the model is empty (not loaded).
  explicit forward_pass(model const& m) : model_(&m) {
    config const& c = m.config();
    ::kvq::detail::check<invalid_argument_error>(c.dim > 0, "llama2c::forward_pass: the model is empty (not loaded)");
    auto const d = static_cast<std::size_t>(c.dim);
    x_.resize(d);
    xb_.resize(d);
    xb2_.resize(d);
    q_.resize(d);
    att_.resize(d);
    k_.resize(static_cast<std::size_t>(c.kv_dim()));
    v_.resize(static_cast<std::size_t>(c.kv_dim()));
    hb_.resize(static_cast<std::size_t>(c.hidden_dim));
    hb2_.resize(static_cast<std::size_t>(c.hidden_dim));
    logits_.resize(static_cast<std::size_t>(c.vocab_size));
    cos_.resize(static_cast<std::size_t>(c.head_dim() / 2));
    sin_.resize(cos_.size());
  }

  /// The pass keeps a pointer to the model: a temporary model would dangle.
  explicit forward_pass(model&&) = delete;

  /// Starts `token` at position `pos`: its embedding and the RoPE angles. Raises index_error for a
  /// token outside the vocabulary or a position outside [0, seq_len).
  void begin(int token, int pos) {
    config const& c = model_->config();
    ::kvq::detail::check<index_error>(token >= 0 && token < c.vocab_size,
                                      "llama2c::forward_pass::begin: token " + std::to_string(token) +
                                          " is outside the vocabulary [0, " + std::to_string(c.vocab_size) + ")");
    ::kvq::detail::check<index_error>(pos >= 0 && pos < c.seq_len,
                                      "llama2c::forward_pass::begin: position " + std::to_string(pos) +
                                          " is outside [0, seq_len = " + std::to_string(c.seq_len) + ")");
    int const dim = c.dim, hd = c.head_dim();
    std::copy_n(model_->token_embedding() + static_cast<std::size_t>(token) * static_cast<std::size_t>(dim), dim,
                x_.begin());
    for (int i = 0; i < hd / 2; ++i) {
      float const freq = 1.0f / std::pow(10000.0f, static_cast<float>(2 * i) / static_cast<float>(hd));
      float const angle = static_cast<float>(pos) * freq;
      cos_[static_cast<std::size_t>(i)] = std::cos(angle);
      sin_[static_cast<std::size_t>(i)] = std::sin(angle);
    }
  }

  /// Layer `layer` up to the cache: q(), k() and v() of the current token, RoPE applied.
  void qkv(int layer) {
    config const& c = model_->config();
    model const& m = *model_;
    detail::rmsnorm(xb_.data(), x_.data(), m.rms_att(layer), c.dim);
    detail::matmul(q_.data(), xb_.data(), m.wq(layer), c.dim, c.dim);
    detail::matmul(k_.data(), xb_.data(), m.wk(layer), c.dim, c.kv_dim());
    detail::matmul(v_.data(), xb_.data(), m.wv(layer), c.dim, c.kv_dim());
    rope(q_.data(), c.dim, c.head_dim());
    rope(k_.data(), c.kv_dim(), c.head_dim());
  }

  /// The query of the current layer: (n_heads, head_dim).
  auto q() const noexcept -> std::span<float const> { return q_; }
  /// The key of the current layer: (n_kv_heads, head_dim).
  auto k() const noexcept -> std::span<float const> { return k_; }
  /// The value of the current layer: (n_kv_heads, head_dim).
  auto v() const noexcept -> std::span<float const> { return v_; }
  /// Where the caller writes the attention output of the current layer: (n_heads, head_dim).
  auto att() noexcept -> std::span<float> { return att_; }

  /// Layer `layer` after attention: wo and the residual, then the FFN and its residual.
  void finish_layer(int layer) {
    config const& c = model_->config();
    model const& m = *model_;
    int const dim = c.dim, hidden = c.hidden_dim;
    detail::matmul(xb2_.data(), att_.data(), m.wo(layer), dim, dim);
    for (int i = 0; i < dim; ++i) x_[static_cast<std::size_t>(i)] += xb2_[static_cast<std::size_t>(i)];

    detail::rmsnorm(xb_.data(), x_.data(), m.rms_ffn(layer), dim);
    detail::matmul(hb_.data(), xb_.data(), m.w1(layer), dim, hidden);
    detail::matmul(hb2_.data(), xb_.data(), m.w3(layer), dim, hidden);
    for (int i = 0; i < hidden; ++i) {
      float const g = hb_[static_cast<std::size_t>(i)];
      hb_[static_cast<std::size_t>(i)] = g / (1.0f + std::exp(-g)) * hb2_[static_cast<std::size_t>(i)];
    }
    detail::matmul(xb_.data(), hb_.data(), m.w2(layer), hidden, dim);
    for (int i = 0; i < dim; ++i) x_[static_cast<std::size_t>(i)] += xb_[static_cast<std::size_t>(i)];
  }

  /// Ends the token after its last layer: the logits (vocab_size; valid until the next call).
  auto logits() -> std::vector<float> const& {
    config const& c = model_->config();
    detail::rmsnorm(x_.data(), x_.data(), model_->rms_final(), c.dim);
    detail::matmul(logits_.data(), x_.data(), model_->wcls(), c.dim, c.vocab_size);
    return logits_;
  }

  auto get_model() const noexcept -> model const& { return *model_; }

 private:
  /// Rotates adjacent pairs of each head of v (n values, heads of hd) by the current angles.
  void rope(float* v, int n, int hd) const {
    for (int h = 0; h < n; h += hd)
      for (int i = 0; i < hd / 2; ++i) {
        float const c = cos_[static_cast<std::size_t>(i)], s = sin_[static_cast<std::size_t>(i)];
        float const a = v[h + 2 * i], b = v[h + 2 * i + 1];
        v[h + 2 * i] = a * c - b * s;
        v[h + 2 * i + 1] = a * s + b * c;
      }
  }

  model const* model_;
  std::vector<float> x_, xb_, xb2_, q_, k_, v_, att_, hb_, hb2_, logits_, cos_, sin_;
};

/// One-token-at-a-time forward pass of a llama2.c model whose K/V cache is a kvq::any_cache: a
/// forward_pass whose layers store k and v in the cache and attend over it.
///
/// The model must outlive the engine. Not thread-safe (one sequence).
class engine {
 public:
  /// An engine whose cache uses the named key/value codecs (see kvq::supported_codec_pairs()),
  /// capacity seq_len, with `cache_options` (e.g. the KIVI residual R) and `attention` options
  /// (scale 0 = 1/sqrt(head_dim)). Raises kvq::unsupported_error for an unknown pair.
  engine(model const& m, std::string_view key_codec, std::string_view value_codec,
         any_cache_options const& cache_options = {}, attention_options const& attention = {})
      : model_(&m), attention_(attention), pass_(checked(m)) {
    config const& c = m.config();
    cache_ = make_any_cache(cache_shape{c.n_layers, c.n_kv_heads, c.head_dim(), c.seq_len}, key_codec, value_codec,
                            cache_options);
    if (attention_.scale == 0.0f) attention_.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim()));
  }

  /// The engine keeps a pointer to the model: a temporary model would dangle.
  engine(model&&, std::string_view, std::string_view, any_cache_options const& = {},
         attention_options const& = {}) = delete;

  /// Runs `token` at position `pos` and returns the logits (vocab_size; valid until the next
  /// call). `pos` must equal the number of tokens already in the cache (0 after reset()) and be
  /// below seq_len; otherwise index_error, and nothing changes.
  auto forward(int token, int pos) -> std::vector<float> const& {
    config const& c = model_->config();
    ::kvq::detail::check<index_error>(token >= 0 && token < c.vocab_size,
                                      "llama2c::engine::forward: token " + std::to_string(token) +
                                          " is outside the vocabulary [0, " + std::to_string(c.vocab_size) + ")");
    ::kvq::detail::check<index_error>(pos >= 0 && pos < c.seq_len,
                                      "llama2c::engine::forward: position " + std::to_string(pos) +
                                          " is outside [0, seq_len = " + std::to_string(c.seq_len) + ")");
    for (int l = 0; l < c.n_layers; ++l)
      ::kvq::detail::check<index_error>(
          cache_->size(l) == pos, "llama2c::engine::forward: position " + std::to_string(pos) +
                                      " but the cache holds " + std::to_string(cache_->size(l)) + " tokens in layer " +
                                      std::to_string(l) + " (positions run 0, 1, 2, ...; reset() starts over)");
    int const hd = c.head_dim();
    pass_.begin(token, pos);
    for (int l = 0; l < c.n_layers; ++l) {
      pass_.qkv(l);
      cache_->append(l, token_major(pass_.k().data(), 1, c.n_kv_heads, hd),
                     token_major(pass_.v().data(), 1, c.n_kv_heads, hd));
      cache_->attention(l, pass_.q().data(), c.n_heads, pass_.att().data(), attention_);
      pass_.finish_layer(l);
    }
    return pass_.logits();
  }

  /// Runs the tokens of a chunk at positions pos, pos + 1, ... as one prefill step: per layer, the
  /// chunk's keys and values are appended in one call and its queries attend in one multi-token
  /// attention (kvq::attention, causal). Returns the logits (tokens.size(), vocab_size), valid
  /// until the next call. Positions as forward (pos = the tokens in the cache, the chunk within
  /// seq_len); otherwise index_error, and nothing changes.
  auto forward_chunk(std::span<int const> tokens, int pos) -> std::vector<float> const& {
    config const& c = model_->config();
    auto const n = static_cast<int>(tokens.size());
    ::kvq::detail::check<index_error>(pos >= 0 && n >= 1 && n <= c.seq_len - pos,
                                      "llama2c::engine::forward_chunk: positions [" + std::to_string(pos) + ", " +
                                          std::to_string(pos + n) +
                                          ") are outside [0, seq_len = " + std::to_string(c.seq_len) + ") or empty");
    for (int t : tokens)
      ::kvq::detail::check<index_error>(
          t >= 0 && t < c.vocab_size,
          "llama2c::engine::forward_chunk: token " + std::to_string(t) + " is outside the vocabulary");
    for (int l = 0; l < c.n_layers; ++l)
      ::kvq::detail::check<index_error>(cache_->size(l) == pos, "llama2c::engine::forward_chunk: position " +
                                                                    std::to_string(pos) + " but the cache holds " +
                                                                    std::to_string(cache_->size(l)) + " tokens");
    int const hd = c.head_dim();
    auto const un = static_cast<std::size_t>(n);
    auto const q_size = static_cast<std::size_t>(c.dim), kv_size = static_cast<std::size_t>(c.kv_dim());
    while (chunk_passes_.size() < un) chunk_passes_.emplace_back(*model_);
    chunk_q_.resize(un * q_size);
    chunk_att_.resize(un * q_size);
    chunk_k_.resize(un * kv_size);
    chunk_v_.resize(un * kv_size);
    for (std::size_t i = 0; i < un; ++i) chunk_passes_[i].begin(tokens[i], pos + static_cast<int>(i));
    for (int l = 0; l < c.n_layers; ++l) {
      for (std::size_t i = 0; i < un; ++i) {
        forward_pass& p = chunk_passes_[i];
        p.qkv(l);
        std::copy(p.q().begin(), p.q().end(), chunk_q_.begin() + static_cast<std::ptrdiff_t>(i * q_size));
        std::copy(p.k().begin(), p.k().end(), chunk_k_.begin() + static_cast<std::ptrdiff_t>(i * kv_size));
        std::copy(p.v().begin(), p.v().end(), chunk_v_.begin() + static_cast<std::ptrdiff_t>(i * kv_size));
      }
      cache_->append(l, token_major(chunk_k_.data(), n, c.n_kv_heads, hd),
                     token_major(chunk_v_.data(), n, c.n_kv_heads, hd));
      cache_->attention(l, chunk_q_.data(), n, c.n_heads, chunk_att_.data(), attention_);
      for (std::size_t i = 0; i < un; ++i) {
        auto att = chunk_passes_[i].att();
        std::copy_n(chunk_att_.begin() + static_cast<std::ptrdiff_t>(i * q_size), q_size, att.begin());
        chunk_passes_[i].finish_layer(l);
      }
    }
    auto const vocab = static_cast<std::size_t>(c.vocab_size);
    chunk_logits_.resize(un * vocab);
    for (std::size_t i = 0; i < un; ++i) {
      auto const& lg = chunk_passes_[i].logits();
      std::copy(lg.begin(), lg.end(), chunk_logits_.begin() + static_cast<std::ptrdiff_t>(i * vocab));
    }
    return chunk_logits_;
  }

  /// Empties the cache (the next forward is at position 0).
  void reset() { cache_->reset(); }
  /// Tokens in the cache (the next position).
  auto position() const -> int { return static_cast<int>(cache_->size(0)); }

  auto cache() noexcept -> any_cache& { return *cache_; }
  auto cache() const noexcept -> any_cache const& { return *cache_; }
  auto get_model() const noexcept -> model const& { return *model_; }
  auto attention() const noexcept -> attention_options const& { return attention_; }

 private:
  /// `m`, or invalid_argument_error when it is empty (before anything divides by its head count).
  static auto checked(model const& m) -> model const& {
    ::kvq::detail::check<invalid_argument_error>(m.config().dim > 0,
                                                 "llama2c::engine: the model is empty (not loaded)");
    return m;
  }

  model const* model_;
  attention_options attention_;
  forward_pass pass_;
  std::unique_ptr<any_cache> cache_;
  std::vector<forward_pass> chunk_passes_;  // one per token of the largest chunk so far
  std::vector<float> chunk_q_, chunk_k_, chunk_v_, chunk_att_, chunk_logits_;
};

/// Index of the largest logit (the first on ties), as run.c's argmax.
inline auto argmax(std::span<float const> logits) -> int {
  int best = 0;
  for (std::size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[static_cast<std::size_t>(best)]) best = static_cast<int>(i);
  return best;
}

/// out[i] = log softmax(logits)[i], in double (max-subtracted, so any finite logits work).
inline void log_softmax(std::span<float const> logits, std::vector<double>& out) {
  out.resize(logits.size());
  double mx = -std::numeric_limits<double>::infinity();
  for (float l : logits) mx = std::max(mx, static_cast<double>(l));
  double sum = 0.0;
  for (float l : logits) sum += std::exp(static_cast<double>(l) - mx);
  double const lse = mx + std::log(sum);
  for (std::size_t i = 0; i < logits.size(); ++i) out[i] = static_cast<double>(logits[i]) - lse;
}

/// Greedy decoding as run.c with temperature 0: resets the engine and runs `steps` forward passes
/// (clamped to seq_len) at positions 0, 1, ..., feeding prompt[0] (BOS by default), then the rest of
/// `prompt`, then each argmax. Returns every token after prompt[0] (prompt tail and generated
/// tokens); stops early, without it, when BOS is predicted after the prompt.
inline auto greedy(engine& e, int steps, std::vector<int> const& prompt = {token_bos}) -> std::vector<int> {
  ::kvq::detail::check<invalid_argument_error>(steps >= 0,
                                               "llama2c::greedy: steps = " + std::to_string(steps) + " is negative");
  ::kvq::detail::check<invalid_argument_error>(!prompt.empty(),
                                               "llama2c::greedy: the prompt is empty (start with BOS)");
  steps = std::min(steps, e.get_model().config().seq_len);
  e.reset();
  std::vector<int> out;
  int token = prompt[0];
  for (int pos = 0; pos < steps; ++pos) {
    auto const& logits = e.forward(token, pos);
    int next = 0;
    if (static_cast<std::size_t>(pos) + 1 < prompt.size()) {
      next = prompt[static_cast<std::size_t>(pos) + 1];
    } else {
      next = argmax(logits);
      if (next == token_bos) break;
    }
    out.push_back(next);
    token = next;
  }
  return out;
}

/// The stories of a text, as the perplexity method splits it: on "\n<|endoftext|>\n", the last
/// piece dropped when empty.
inline auto split_stories(std::string_view text) -> std::vector<std::string_view> {
  constexpr std::string_view sep = "\n<|endoftext|>\n";
  std::vector<std::string_view> out;
  std::size_t start = 0;
  while (true) {
    std::size_t const at = text.find(sep, start);
    if (at == std::string_view::npos) {
      out.push_back(text.substr(start));
      break;
    }
    out.push_back(text.substr(start, at - start));
    start = at + sep.size();
  }
  if (!out.empty() && out.back().empty()) out.pop_back();
  return out;
}

/// Result of a perplexity run.
struct perplexity_result {
  double nll = 0.0;         ///< mean negative log-likelihood (nats) over every scored token
  double ppl = 0.0;         ///< exp(nll)
  std::int64_t tokens = 0;  ///< tokens scored
  int stories = 0;          ///< stories evaluated
};

/// One scored position, as handed to a perplexity observer.
struct scored_position {
  int story = 0;                  ///< index of the story
  int pos = 0;                    ///< position whose logits predict `target` (0 = BOS)
  int target = 0;                 ///< the token at pos + 1
  std::span<float const> logits;  ///< the engine's logits (valid during the call only)
  std::span<double const> logp;   ///< log-softmax of the logits, in double (same lifetime)
};

/// Called for every scored position, in order (e.g. to compare with a reference run, or for
/// progress); may be empty.
using position_observer = std::function<void(scored_position const&)>;

/// The token ids of the stories of `text` as perplexity() scores them: split_stories, each encoded
/// with BOS (and the dummy prefix) and cut to its first seq_len tokens. Raises
/// invalid_argument_error when the tokenizer does not match the model.
inline auto story_tokens(model const& m, tokenizer const& tok, std::string_view text) -> std::vector<std::vector<int>> {
  config const& c = m.config();
  ::kvq::detail::check<invalid_argument_error>(
      tok.vocab_size() == c.vocab_size, "llama2c: the tokenizer has " + std::to_string(tok.vocab_size()) +
                                            " tokens but the model's vocabulary has " + std::to_string(c.vocab_size));
  std::vector<std::vector<int>> out;
  for (auto story : split_stories(text)) {
    auto ids = tok.encode(story, true);
    if (ids.size() > static_cast<std::size_t>(c.seq_len)) ids.resize(static_cast<std::size_t>(c.seq_len));
    out.push_back(std::move(ids));
  }
  return out;
}

/// Perplexity of `text` exactly as the models README defines it: split into stories
/// (split_stories), each encoded with BOS (and the dummy prefix), cut to its first
/// m = min(n, seq_len) tokens; the engine is reset per story and the predictions of positions
/// 1..m−1 from their prefixes are scored; the NLL is averaged over all scored tokens.
/// Log-softmax and sums in double. Raises invalid_argument_error when nothing can be scored or the
/// tokenizer does not match the model.
/// With chunk > 1, each story is prefilled in chunks of `chunk` tokens (engine::forward_chunk:
/// one append and one multi-token attention per layer and chunk) and every position is scored from
/// its chunk's logits; with a codec whose stored tokens do not depend on when they are attended
/// (all but KIVI, whose residual is flushed by the chunk's later tokens) the result equals the
/// token-by-token one within fp32 noise.
inline auto perplexity(engine& e, tokenizer const& tok, std::string const& text, position_observer const& observe = {},
                       int chunk = 1) -> perplexity_result {
  ::kvq::detail::check<invalid_argument_error>(chunk >= 1, "llama2c::perplexity: chunk must be >= 1");
  auto const stories = story_tokens(e.get_model(), tok, text);
  auto const vocab = static_cast<std::size_t>(e.get_model().config().vocab_size);
  perplexity_result r;
  double sum = 0.0;
  std::vector<double> logp;
  std::vector<float> row;
  for (std::size_t s = 0; s < stories.size(); ++s) {
    auto const& ids = stories[s];
    e.reset();
    for (std::size_t p0 = 0; p0 + 1 < ids.size(); p0 += static_cast<std::size_t>(chunk)) {
      std::size_t const n = std::min(static_cast<std::size_t>(chunk), ids.size() - 1 - p0);
      std::vector<float> const* rows = nullptr;
      if (chunk > 1) rows = &e.forward_chunk(std::span<int const>(ids.data() + p0, n), static_cast<int>(p0));
      for (std::size_t i = 0; i < n; ++i) {
        std::size_t const p = p0 + i;
        if (rows != nullptr)
          row.assign(rows->begin() + static_cast<std::ptrdiff_t>(i * vocab),
                     rows->begin() + static_cast<std::ptrdiff_t>((i + 1) * vocab));
        auto const& logits = rows != nullptr ? row : e.forward(ids[p], static_cast<int>(p));
        log_softmax(logits, logp);
        int const target = ids[p + 1];
        sum -= logp[static_cast<std::size_t>(target)];
        ++r.tokens;
        if (observe) observe({static_cast<int>(s), static_cast<int>(p), target, logits, logp});
      }
    }
    ++r.stories;
  }
  ::kvq::detail::check<invalid_argument_error>(r.tokens > 0, "llama2c::perplexity: the text has no token to score");
  r.nll = sum / static_cast<double>(r.tokens);
  r.ppl = std::exp(r.nll);
  return r;
}

/// A test run against a reference run on the same positions.
struct comparison_result {
  perplexity_result reference;
  perplexity_result test;
  double mean_kl = 0.0;         ///< mean over positions of KL(reference ‖ test), nats
  double max_kl = 0.0;          ///< largest per-position KL
  double top1_agreement = 0.0;  ///< fraction of positions whose argmax agrees
};

/// Runs `reference` and `test` (same model shape) in lockstep over the perplexity positions of
/// `text`, so nothing per position is stored: both perplexities, KL(reference ‖ test) and top-1
/// agreement. `progress(done, total)` is called after each story when given.
inline auto compare(engine& reference, engine& test, tokenizer const& tok, std::string const& text,
                    std::function<void(int, int)> const& progress = {}) -> comparison_result {
  ::kvq::detail::check<invalid_argument_error>(&reference != &test,
                                               "llama2c::compare: the reference and test engines are the same object");
  ::kvq::detail::check<invalid_argument_error>(
      reference.get_model().config().vocab_size == test.get_model().config().vocab_size &&
          reference.get_model().config().seq_len == test.get_model().config().seq_len,
      "llama2c::compare: the two engines' models differ in vocabulary or seq_len");
  auto const stories = story_tokens(reference.get_model(), tok, text);
  comparison_result r;
  double sum_ref = 0.0, sum_test = 0.0, sum_kl = 0.0;
  std::int64_t agree = 0;
  std::vector<double> lr, lt;
  for (std::size_t s = 0; s < stories.size(); ++s) {
    auto const& ids = stories[s];
    reference.reset();
    test.reset();
    for (std::size_t p = 0; p + 1 < ids.size(); ++p) {
      auto const& a = reference.forward(ids[p], static_cast<int>(p));
      auto const& b = test.forward(ids[p], static_cast<int>(p));
      log_softmax(a, lr);
      log_softmax(b, lt);
      auto const target = static_cast<std::size_t>(ids[p + 1]);
      sum_ref -= lr[target];
      sum_test -= lt[target];
      double kl = 0.0;
      for (std::size_t i = 0; i < lr.size(); ++i) kl += std::exp(lr[i]) * (lr[i] - lt[i]);
      kl = std::max(kl, 0.0);  // rounding can make an exact match slightly negative
      sum_kl += kl;
      r.max_kl = std::max(r.max_kl, kl);
      agree += argmax(a) == argmax(b) ? 1 : 0;
      ++r.test.tokens;
    }
    ++r.test.stories;
    if (progress) progress(static_cast<int>(s) + 1, static_cast<int>(stories.size()));
  }
  ::kvq::detail::check<invalid_argument_error>(r.test.tokens > 0, "llama2c::compare: the text has no token to score");
  auto const n = static_cast<double>(r.test.tokens);
  r.reference.tokens = r.test.tokens;
  r.reference.stories = r.test.stories;
  r.reference.nll = sum_ref / n;
  r.reference.ppl = std::exp(r.reference.nll);
  r.test.nll = sum_test / n;
  r.test.ppl = std::exp(r.test.nll);
  r.mean_kl = sum_kl / n;
  r.top1_agreement = static_cast<double>(agree) / n;
  return r;
}

}  // namespace kvq::llama2c
