// kv_transfer: disaggregated serving in one program. It forks a prefill process and a decode process
// joined by a pipe: prefill runs the prompt of a llama2.c model (stories260K) into a sequence of a
// kvq::PagedKVCache, ships it with kvq::export_sequence, and decode imports it with
// kvq::import_sequence into its own paged cache and generates greedily. The parent generates the
// same tokens unsplit (prefill and decode in one cache) and checks that both runs agree.
//
//   kv_transfer [MODELS_DIR] [--codec kivi4|q8_0] [--residual R] [--prompt-tokens P] [--tokens N]
//
// MODELS_DIR holds stories260K/{stories260K.bin,tok512.bin} and tinystories_valid/sample.txt
// (default: the environment variable KVQ_MODELS_DIR, else the directory compiled in); the prompt is
// the first P tokens of the sample's first story. Exits with 0 when the token sequences agree, 1 when
// they differ or anything fails, 2 for bad arguments and 4 when the model files are absent.
#include <kvq/codec/kivi.hpp>
#include <kvq/codec/q8_0.hpp>
#include <kvq/paged_attention.hpp>
#include <kvq/paged_cache.hpp>
#include <kvq/persist.hpp>

#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "llama2c/llama2c.hpp"

#ifndef KVQ_MODELS_DIR
#  define KVQ_MODELS_DIR "models"
#endif

namespace {

namespace l2 = kvq::llama2c;

constexpr char const* usage =
    "usage: kv_transfer [MODELS_DIR] [--codec kivi4|q8_0] [--residual R] [--prompt-tokens P] [--tokens N]\n"
    "  MODELS_DIR         holds stories260K/ and tinystories_valid/ (default: $KVQ_MODELS_DIR, else the\n"
    "                     directory compiled in)\n"
    "  --codec C          the paged cache's codec, kivi4 or q8_0 (default kivi4)\n"
    "  --residual R       KIVI residual length, a multiple of 32 (default 32)\n"
    "  --prompt-tokens P  prompt tokens prefilled and shipped (default 100)\n"
    "  --tokens N         tokens generated after the prompt (default 64)\n";

constexpr int page_tokens = 32;
constexpr int exit_skip = 4;

struct usage_error {
  std::string message;
};

auto parse_int(std::string_view flag, std::string_view s) -> int {
  int v = 0;
  auto const [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || s.empty())
    throw usage_error{std::string(flag) + " expects an integer, got '" + std::string(s) + "'"};
  return v;
}

/// Writes every byte to a file descriptor (kvq::byte_writer); raises std::system_error when write fails.
class fd_writer {
 public:
  explicit fd_writer(int fd) noexcept : fd_(fd) {}
  void write(std::span<std::byte const> b) {
    while (!b.empty()) {
      ssize_t const n = ::write(fd_, b.data(), b.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw std::system_error(errno, std::generic_category(), "write to the pipe");
      b = b.subspan(static_cast<std::size_t>(n));
      written_ += static_cast<std::size_t>(n);
    }
  }
  /// Bytes written so far.
  auto written() const noexcept -> std::size_t { return written_; }

 private:
  int fd_;
  std::size_t written_ = 0;
};

/// Reads from a file descriptor (kvq::byte_reader): fills the whole buffer unless the writer closed
/// its end first; raises std::system_error when read fails.
class fd_reader {
 public:
  explicit fd_reader(int fd) noexcept : fd_(fd) {}
  auto read(std::span<std::byte> b) -> std::size_t {
    std::size_t got = 0;
    while (got < b.size()) {
      ssize_t const n = ::read(fd_, b.data() + got, b.size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw std::system_error(errno, std::generic_category(), "read from the pipe");
      if (n == 0) break;
      got += static_cast<std::size_t>(n);
    }
    consumed_ += got;
    return got;
  }
  /// Bytes read so far.
  auto consumed() const noexcept -> std::size_t { return consumed_; }

 private:
  int fd_;
  std::size_t consumed_ = 0;
};

/// Writes the bytes of a trivially copyable value.
template <class T>
void put(fd_writer& w, T const& v) {
  w.write(std::as_bytes(std::span<T const>(&v, 1)));
}

/// Reads a trivially copyable value; raises std::runtime_error when the input ends first.
template <class T>
auto get(fd_reader& r) -> T {
  T v{};
  if (r.read(std::as_writable_bytes(std::span<T>(&v, 1))) != sizeof(T))
    throw std::runtime_error("the pipe closed early");
  return v;
}

/// What prefill sends ahead of the exported sequence.
struct transfer_header {
  std::uint32_t magic = 0x3158564bu;  ///< "KVX1"
  std::int32_t prompt_tokens = 0;     ///< tokens in the sequence (positions 0 .. prompt_tokens - 1)
  std::int32_t next_token = 0;        ///< the token prefill predicted after the prompt (fed at prompt_tokens)
};

struct settings {
  std::string models_dir;
  std::string codec = "kivi4";
  int residual = 32;
  int prompt_tokens = 100;
  int tokens = 64;
};

/// A llama2.c model whose KV cache is one PagedKVCache<Choice>, driven one token at a time.
template <kvq::codec_choice Choice>
class paged_model {
 public:
  /// A pool for one sequence of up to seq_len tokens (plus a free slot for a temporary fork).
  paged_model(l2::model const& m, int residual) : model_(&m), pass_(m), cache_(shape_of(m), options_of(residual)) {
    attention_.scale = 1.0f / std::sqrt(static_cast<float>(m.config().head_dim()));
  }

  auto cache() noexcept -> kvq::PagedKVCache<Choice>& { return cache_; }

  /// Runs `token` at position `pos` of `seq` (which holds exactly pos tokens); returns the argmax of the logits.
  auto step(kvq::sequence_id seq, int token, int pos) -> int {
    auto const& c = model_->config();
    int const hd = c.head_dim();
    pass_.begin(token, pos);
    for (int l = 0; l < c.n_layers; ++l) {
      pass_.qkv(l);
      cache_.append(seq, l, kvq::token_major(pass_.k().data(), 1, c.n_kv_heads, hd),
                    kvq::token_major(pass_.v().data(), 1, c.n_kv_heads, hd));
      kvq::paged_decode_attention(cache_, l, std::span<kvq::sequence_id const>(&seq, 1), pass_.q().data(), c.n_heads,
                                  pass_.att().data(), attention_, 1);
      pass_.finish_layer(l);
    }
    return l2::argmax(pass_.logits());
  }

  /// Feeds `prompt` at positions 0, 1, ... of the empty sequence `seq`; returns the token predicted after it.
  auto prefill(kvq::sequence_id seq, std::vector<int> const& prompt) -> int {
    int next = 0;
    for (std::size_t p = 0; p < prompt.size(); ++p) next = step(seq, prompt[p], static_cast<int>(p));
    return next;
  }

  /// Greedy decoding of `seq` (holding `pos` tokens) from `first`, the token predicted after them:
  /// returns `first` and the tokens predicted after it, `count` in all, stopping before a BOS.
  auto decode(kvq::sequence_id seq, int first, int pos, int count) -> std::vector<int> {
    std::vector<int> out;
    int token = first;
    while (static_cast<int>(out.size()) < count && token != l2::token_bos) {
      out.push_back(token);
      if (static_cast<int>(out.size()) < count) token = step(seq, token, pos++);
    }
    return out;
  }

 private:
  static auto shape_of(l2::model const& m) -> kvq::paged_shape {
    auto const& c = m.config();
    return {c.n_layers, c.n_kv_heads, c.head_dim(), page_tokens, (c.seq_len + page_tokens - 1) / page_tokens, 2};
  }
  static auto options_of(int residual) -> typename kvq::PagedKVCache<Choice>::options {
    typename kvq::PagedKVCache<Choice>::options o;
    o.residual = residual;
    return o;
  }

  l2::model const* model_;
  l2::forward_pass pass_;
  kvq::PagedKVCache<Choice> cache_;
  kvq::attention_options attention_;
};

/// The prefill process: runs the prompt, then writes a transfer_header and the exported sequence to `fd`.
template <kvq::codec_choice Choice>
auto run_prefill(l2::model const& m, settings const& s, std::vector<int> const& prompt, int fd) -> int {
  paged_model<Choice> pm(m, s.residual);
  kvq::sequence_id const seq = pm.cache().add_sequence();
  transfer_header h;
  h.prompt_tokens = static_cast<std::int32_t>(prompt.size());
  h.next_token = pm.prefill(seq, prompt);
  fd_writer w(fd);
  put(w, h);
  kvq::export_sequence(pm.cache(), seq, w);
  std::size_t const shipped = w.written() - sizeof h;
  auto const& c = m.config();
  std::size_t const f16_bytes = static_cast<std::size_t>(c.n_layers) * prompt.size() *
                                static_cast<std::size_t>(c.kv_dim()) * 2 * sizeof(std::uint16_t);
  std::printf(
      "prefill: %zu prompt tokens in %zu pages; shipped %zu bytes of KV (+%zu bytes of header) for next token %d\n",
      prompt.size(), pm.cache().page_table(seq).size(), shipped, sizeof h, h.next_token);
  std::printf("         f16 K/V of the same tokens (%d layers, kv_dim %d): %zu bytes (shipped / f16 = %.3f)\n",
              c.n_layers, c.kv_dim(), f16_bytes, static_cast<double>(shipped) / static_cast<double>(f16_bytes));
  std::fflush(stdout);
  return 0;
}

/// The decode process: imports the sequence read from `in`, generates, and writes the token count and
/// tokens to `out`.
template <kvq::codec_choice Choice>
auto run_decode(l2::model const& m, settings const& s, int in, int out) -> int {
  paged_model<Choice> pm(m, s.residual);
  fd_reader r(in);
  auto const h = get<transfer_header>(r);
  if (h.magic != transfer_header{}.magic) throw std::runtime_error("bad transfer header");
  kvq::sequence_id const seq = kvq::import_sequence(pm.cache(), r);
  std::size_t const imported = r.consumed() - sizeof h;
  if (pm.cache().size(seq) != h.prompt_tokens)
    throw std::runtime_error("imported " + std::to_string(pm.cache().size(seq)) + " tokens, expected " +
                             std::to_string(h.prompt_tokens));
  std::byte extra{};
  if (r.read(std::span<std::byte>(&extra, 1)) != 0) throw std::runtime_error("bytes follow the exported sequence");
  std::vector<int> const tokens = pm.decode(seq, h.next_token, h.prompt_tokens, s.tokens);
  std::printf("decode:  imported %zu bytes as a sequence of %d tokens; generated %zu tokens\n", imported,
              h.prompt_tokens, tokens.size());
  std::fflush(stdout);
  fd_writer w(out);
  put(w, static_cast<std::uint32_t>(tokens.size()));
  for (int t : tokens) put(w, static_cast<std::int32_t>(t));
  return 0;
}

/// Runs `fn` in a child process, which exits with its result (1 and a message when it throws).
template <class Fn>
auto spawn(char const* name, Fn&& fn) -> pid_t {
  std::fflush(stdout);
  std::fflush(stderr);
  pid_t const pid = ::fork();
  if (pid < 0) throw std::system_error(errno, std::generic_category(), "fork");
  if (pid > 0) return pid;
  int rc = 1;
  try {
    rc = fn();
  } catch (std::exception const& e) {
    std::fprintf(stderr, "kv_transfer: %s: error: %s\n", name, e.what());
  }
  std::fflush(stdout);
  std::fflush(stderr);
  ::_exit(rc);
}

/// Waits for child `pid`; true when it exited with 0.
auto wait_ok(pid_t pid, char const* name) -> bool {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) throw std::system_error(errno, std::generic_category(), "waitpid");
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return true;
  if (WIFEXITED(status))
    std::fprintf(stderr, "kv_transfer: the %s process exited with %d\n", name, WEXITSTATUS(status));
  else
    std::fprintf(stderr, "kv_transfer: the %s process ended abnormally (status %d)\n", name, status);
  return false;
}

auto join(std::vector<int> const& v) -> std::string {
  std::string s;
  for (int t : v) s += (s.empty() ? "" : " ") + std::to_string(t);
  return s;
}

/// The whole demonstration for codec choice `Choice`; returns the exit code.
template <kvq::codec_choice Choice>
auto transfer(l2::model const& m, l2::tokenizer const& tok, settings const& s, std::vector<int> const& prompt) -> int {
  int kv[2] = {-1, -1}, result[2] = {-1, -1};
  if (::pipe(kv) != 0 || ::pipe(result) != 0) throw std::system_error(errno, std::generic_category(), "pipe");
  pid_t const prefill = spawn("prefill", [&] {
    ::close(kv[0]);
    ::close(result[0]);
    ::close(result[1]);
    int const rc = run_prefill<Choice>(m, s, prompt, kv[1]);
    ::close(kv[1]);
    return rc;
  });
  pid_t const decode = spawn("decode", [&] {
    ::close(kv[1]);
    ::close(result[0]);
    return run_decode<Choice>(m, s, kv[0], result[1]);
  });
  ::close(kv[0]);
  ::close(kv[1]);
  ::close(result[1]);

  // The same generation unsplit, meanwhile.
  paged_model<Choice> pm(m, s.residual);
  kvq::sequence_id const seq = pm.cache().add_sequence();
  int const first = pm.prefill(seq, prompt);
  std::vector<int> const unsplit = pm.decode(seq, first, static_cast<int>(prompt.size()), s.tokens);

  std::vector<int> split;
  bool ok = true;
  try {
    fd_reader r(result[0]);
    auto const n = get<std::uint32_t>(r);
    for (std::uint32_t i = 0; i < n; ++i) split.push_back(get<std::int32_t>(r));
  } catch (std::exception const& e) {
    std::fprintf(stderr, "kv_transfer: error: reading the decode process's tokens: %s\n", e.what());
    ok = false;
  }
  ::close(result[0]);
  ok = wait_ok(prefill, "prefill") && ok;
  ok = wait_ok(decode, "decode") && ok;

  std::printf("prompt:    %s\n", tok.decode(std::span<int const>(prompt).subspan(1)).c_str());
  std::printf("unsplit:   %s\n", join(unsplit).c_str());
  std::printf("split:     %s\n", join(split).c_str());
  std::printf("text:      ...%s\n", tok.decode(unsplit, prompt.back()).c_str());
  bool const equal = ok && split == unsplit;
  std::printf("tokens %s (%zu generated)\n", equal ? "equal" : "DIFFER", unsplit.size());
  return equal ? 0 : 1;
}

auto models_dir_default() -> std::string {
  char const* env = std::getenv("KVQ_MODELS_DIR");
  return env != nullptr && *env != '\0' ? env : KVQ_MODELS_DIR;
}

}  // namespace

int main(int argc, char** argv) {
  settings s;
  try {
    std::vector<std::string_view> positional;
    for (int i = 1; i < argc; ++i) {
      std::string_view const a = argv[i];
      auto next = [&]() -> std::string_view {
        if (i + 1 >= argc) throw usage_error{std::string(a) + " needs a value"};
        return argv[++i];
      };
      if (a == "-h" || a == "--help") {
        std::fputs(usage, stdout);
        return 0;
      } else if (a == "--codec") {
        s.codec = next();
        if (s.codec != "kivi4" && s.codec != "q8_0") throw usage_error{"--codec must be kivi4 or q8_0"};
      } else if (a == "--residual") {
        s.residual = parse_int(a, next());
      } else if (a == "--prompt-tokens") {
        s.prompt_tokens = parse_int(a, next());
        if (s.prompt_tokens < 1) throw usage_error{"--prompt-tokens must be >= 1"};
      } else if (a == "--tokens") {
        s.tokens = parse_int(a, next());
        if (s.tokens < 1) throw usage_error{"--tokens must be >= 1"};
      } else if (a.starts_with("-") && a.size() > 1) {
        throw usage_error{"unknown option '" + std::string(a) + "'"};
      } else {
        positional.push_back(a);
      }
    }
    if (positional.size() > 1) throw usage_error{"expected at most one MODELS_DIR"};
    s.models_dir = positional.empty() ? models_dir_default() : std::string(positional[0]);
  } catch (usage_error const& e) {
    std::fprintf(stderr, "kv_transfer: error: %s (see --help)\n", e.message.c_str());
    return 2;
  }

  std::string const model_path = s.models_dir + "/stories260K/stories260K.bin";
  std::string const tokenizer_path = s.models_dir + "/stories260K/tok512.bin";
  std::string const text_path = s.models_dir + "/tinystories_valid/sample.txt";
  for (auto const& p : {model_path, tokenizer_path, text_path})
    if (!std::filesystem::is_regular_file(p)) {
      std::printf("SKIPPED: model file not found: %s (set KVQ_MODELS_DIR or pass MODELS_DIR)\n", p.c_str());
      return exit_skip;
    }

  try {
    // A reader that has gone away is reported as a failed write, not by SIGPIPE.
    std::signal(SIGPIPE, SIG_IGN);
    l2::model const m = l2::load_model(model_path);
    l2::tokenizer const tok = l2::load_tokenizer(tokenizer_path, m.config().vocab_size);
    auto const stories = l2::story_tokens(m, tok, l2::read_text_file(text_path));
    if (stories.empty()) throw std::runtime_error("the sample has no story");
    std::vector<int> prompt = stories.front();
    if (prompt.size() > static_cast<std::size_t>(s.prompt_tokens))
      prompt.resize(static_cast<std::size_t>(s.prompt_tokens));
    int const seq_len = m.config().seq_len;
    if (static_cast<int>(prompt.size()) + s.tokens > seq_len) {
      std::fprintf(stderr, "kv_transfer: error: %zu prompt tokens + %d generated exceed seq_len %d\n", prompt.size(),
                   s.tokens, seq_len);
      return 2;
    }
    std::printf("kv_transfer: stories260K, codec %s", s.codec.c_str());
    if (s.codec == "kivi4") std::printf(" (residual %d)", s.residual);
    std::printf(", pages of %d tokens, %zu prompt tokens, %d to generate\n", page_tokens, prompt.size(), s.tokens);
    return s.codec == "kivi4" ? transfer<kvq::kivi<4>>(m, tok, s, prompt) : transfer<kvq::q8_0>(m, tok, s, prompt);
  } catch (std::exception const& e) {
    std::fprintf(stderr, "kv_transfer: error: %s\n", e.what());
    return 1;
  }
}
