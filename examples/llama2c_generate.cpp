// llama2c_generate: greedy text generation with a llama2.c model whose KV cache is a kvq cache.
//
//   llama2c_generate stories260K.bin tok512.bin --cache-type-k kivi4 --cache-type-v kivi4 --residual 32
//
// Prints the generated text on stdout, and the cache's codecs, memory use and speed on stderr.
// Any error prints one line "llama2c_generate: error: ..." and exits non-zero (2 for bad arguments,
// 1 for anything else).
#include <charconv>
#include <chrono>
#include <cstdio>
#include <exception>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <llama2c/llama2c.hpp>

namespace {

constexpr char const* usage =
    "usage: llama2c_generate MODEL.bin TOKENIZER.bin [--steps N] [--prompt TEXT]\n"
    "                        [--cache-type-k CODEC] [--cache-type-v CODEC] [--residual R] [--list-codecs]\n"
    "  --steps N           forward passes, prompt included (default 256, at most seq_len)\n"
    "  --prompt TEXT       text to continue (default: generate from BOS)\n"
    "  --cache-type-k/-v   key/value cache codecs (default f16): f32 f16 q4_0 q8_0 int8 fp8_e4m3 fp8_e5m2\n"
    "                      kivi2 kivi4 kivi8, and some mixed pairs (--list-codecs)\n"
    "  --residual R        KIVI residual length, a multiple of 32 (default 128)\n";

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

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string_view> positional;
  std::string key = "f16", value = "f16", prompt;
  int steps = 256;
  kvq::any_cache_options opt;
  try {
    for (int i = 1; i < argc; ++i) {
      std::string_view const a = argv[i];
      auto next = [&]() -> std::string_view {
        if (i + 1 >= argc) throw usage_error{std::string(a) + " needs a value"};
        return argv[++i];
      };
      if (a == "-h" || a == "--help") {
        std::fputs(usage, stdout);
        return 0;
      } else if (a == "--list-codecs") {
        for (auto const& [k, v] : kvq::supported_codec_pairs())
          std::printf("%.*s %.*s\n", static_cast<int>(k.size()), k.data(), static_cast<int>(v.size()), v.data());
        return 0;
      } else if (a == "--steps") {
        steps = parse_int(a, next());
        if (steps < 1) throw usage_error{"--steps must be >= 1"};
      } else if (a == "--prompt") {
        prompt = next();
      } else if (a == "--cache-type-k") {
        key = next();
      } else if (a == "--cache-type-v") {
        value = next();
      } else if (a == "--residual") {
        opt.residual = parse_int(a, next());
      } else if (a.starts_with("-") && a.size() > 1) {
        throw usage_error{"unknown option '" + std::string(a) + "'"};
      } else {
        positional.push_back(a);
      }
    }
    if (positional.size() != 2)
      throw usage_error{"expected MODEL.bin and TOKENIZER.bin, got " + std::to_string(positional.size()) +
                        " file argument(s)"};
  } catch (usage_error const& e) {
    std::fprintf(stderr, "llama2c_generate: error: %s (see --help)\n", e.message.c_str());
    return 2;
  }

  try {
    namespace l2 = kvq::llama2c;
    l2::model const m = l2::load_model(std::string(positional[0]));
    l2::tokenizer const tok = l2::load_tokenizer(std::string(positional[1]), m.config().vocab_size);
    l2::engine e(m, key, value, opt);
    std::vector<int> const prompt_ids = tok.encode(prompt, true);

    auto const t0 = std::chrono::steady_clock::now();
    std::vector<int> const out = l2::greedy(e, steps, prompt_ids);
    double const secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    std::string const text = tok.decode(out);
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fputc('\n', stdout);

    auto const& c = m.config();
    auto const mem = e.cache().memory();
    std::fprintf(stderr,
                 "model: dim %d, %d layers, %d/%d heads, head_dim %d, vocab %d, seq_len %d (%zu parameters)\n"
                 "kv cache: keys %s, values %s: %zu bytes for %d tokens (%.1f bytes/token, %.2f bits/element; "
                 "f32 would be %zu bytes)\n"
                 "%d forward passes in %.3f s (%.0f tokens/s)\n",
                 c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim(), c.vocab_size, c.seq_len,
                 m.parameter_count(), key.c_str(), value.c_str(), mem.total_bytes, c.seq_len, mem.bytes_per_token,
                 mem.bits_per_element,
                 static_cast<std::size_t>(c.n_layers) * static_cast<std::size_t>(c.seq_len) *
                     static_cast<std::size_t>(c.kv_dim()) * 2 * sizeof(float),
                 e.position(), secs, secs > 0 ? e.position() / secs : 0.0);
    return 0;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "llama2c_generate: error: %s\n", e.what());
    return 1;
  }
}
