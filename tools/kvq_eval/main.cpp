// kvq-eval: memory, speed and quality of every kvq codec on a KV workload.
//
//   kvq-eval                                   built-in synthetic workload (seeded)
//   kvq-eval --model M --tokenizer T --text F  a llama2.c-format model scored on a text
//   kvq-eval --model M ... --paged [--page-tokens N]
//                                              the same, plus continuous batching of every story
//                                              through one paged cache per configuration
//   kvq-eval --model M ... --chunk N             the same, every story prefilled in chunks of N tokens
//   options: --json FILE, --svg FILE, --configs L1,L2,..., --context N, --layers N, --list
//
// Results on stdout as an aligned table; progress on stderr. Exit status 0 on success, 1 on a
// runtime failure, 2 on bad arguments or unreadable input.
#include <kvq/kvq.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "configs.hpp"
#include "model_eval.hpp"
#include "paged_eval.hpp"
#include "report.hpp"
#include "synthetic.hpp"

namespace kvq_eval {
namespace {

using clock_type = std::chrono::steady_clock;

auto seconds_since(clock_type::time_point t0) -> double {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

/// Median of a non-empty vector.
auto median(std::vector<double> v) -> double {
  std::sort(v.begin(), v.end());
  std::size_t const n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// Exact attention (float64 over the original K/V) of every query of a layer: (queries, q_heads, head_dim).
auto exact_attention(synthetic_shape const& s, synthetic_layer const& L) -> std::vector<double> {
  int const d = s.head_dim, group = s.q_heads / s.kv_heads;
  std::vector<double> out(static_cast<std::size_t>(s.queries_per_layer) * static_cast<std::size_t>(s.q_heads) *
                          static_cast<std::size_t>(d));
  std::vector<double> w(static_cast<std::size_t>(s.context));
  double const scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int qi = 0; qi < s.queries_per_layer; ++qi) {
    for (int qh = 0; qh < s.q_heads; ++qh) {
      int const kh = qh / group;
      std::size_t const qo =
          (static_cast<std::size_t>(qi) * static_cast<std::size_t>(s.q_heads) + static_cast<std::size_t>(qh)) *
          static_cast<std::size_t>(d);
      double m = -1e300;
      for (std::int64_t t = 0; t < s.context; ++t) {
        std::size_t const ko =
            (static_cast<std::size_t>(t) * static_cast<std::size_t>(s.kv_heads) + static_cast<std::size_t>(kh)) *
            static_cast<std::size_t>(d);
        double dot = 0;
        for (int c = 0; c < d; ++c)
          dot += static_cast<double>(L.queries[qo + static_cast<std::size_t>(c)]) *
                 L.keys[ko + static_cast<std::size_t>(c)];
        w[static_cast<std::size_t>(t)] = dot * scale;
        m = std::max(m, dot * scale);
      }
      double z = 0;
      for (auto& x : w) z += (x = std::exp(x - m));
      for (std::int64_t t = 0; t < s.context; ++t) {
        std::size_t const vo =
            (static_cast<std::size_t>(t) * static_cast<std::size_t>(s.kv_heads) + static_cast<std::size_t>(kh)) *
            static_cast<std::size_t>(d);
        double const p = w[static_cast<std::size_t>(t)] / z;
        for (int c = 0; c < d; ++c)
          out[qo + static_cast<std::size_t>(c)] += p * L.values[vo + static_cast<std::size_t>(c)];
      }
    }
  }
  return out;
}

/// Evaluates every configuration on a KV workload: `layers` holds each layer's keys, values and queries.
auto evaluate(synthetic_shape const& s, std::vector<synthetic_layer> const& layers, std::vector<config> const& configs,
              bool progress) -> std::vector<result> {
  std::vector<std::vector<double>> exact;
  for (auto const& L : layers) exact.push_back(exact_attention(s, L));
  kvq::cache_shape const shape{s.layers, s.kv_heads, s.head_dim, s.context};
  int const d = s.head_dim;
  double const f32_bytes = static_cast<double>(s.layers) * static_cast<double>(s.context) * s.kv_heads * d * 4.0 * 2.0;
  std::size_t const f16_total = kvq::plan_memory<kvq::f16_codec>(shape).total_bytes;

  std::vector<result> rows;
  std::optional<double> f16_attn_time;
  // Measure f16 first so every speed-up comes from the same run.
  std::vector<std::size_t> order(configs.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_partition(order.begin(), order.end(), [&](std::size_t i) { return configs[i].label == "f16"; });
  std::vector<std::optional<result>> by_index(configs.size());
  std::size_t done = 0;
  for (std::size_t idx : order) {
    config const& c = configs[idx];
    if (progress) std::fprintf(stderr, "kvq-eval: [%zu/%zu] %s\n", ++done, configs.size(), c.label.c_str());
    kvq::any_cache_options opt;
    opt.residual = c.residual.value_or(128);
    auto cache = kvq::make_any_cache(shape, c.k_codec, c.v_codec, opt);
    result r;
    r.label = c.label;
    r.k_codec = c.k_codec;
    r.v_codec = c.v_codec;
    r.group = c.group;
    r.residual = c.residual;
    auto const mem = cache->memory();
    r.bits_per_element = mem.bits_per_element;
    r.memory_vs_f16 = static_cast<double>(mem.total_bytes) / static_cast<double>(f16_total);

    // Encode: the whole context of every layer as one prefill append, timed on the second pass
    // (the steady state of an engine: the first pass touches the cache's memory, then reset).
    auto const append_all = [&] {
      for (int l = 0; l < s.layers; ++l) {
        auto const& L = layers[static_cast<std::size_t>(l)];
        cache->append(l, kvq::token_major(L.keys.data(), s.context, s.kv_heads, d),
                      kvq::token_major(L.values.data(), s.context, s.kv_heads, d));
      }
    };
    append_all();
    cache->reset();
    auto t0 = clock_type::now();
    append_all();
    r.encode_gbps = f32_bytes / seconds_since(t0) / 1e9;
    // Blocks whose stored scale is NaN or Inf (e.g. q8_0/q4_0 fp16 scale overflow) decode to NaN/Inf.
    r.nonfinite_blocks = cache->nonfinite_blocks().total();
    if (r.nonfinite_blocks > 0)
      std::fprintf(stderr, "kvq-eval: warning: %s stores %lld blocks with a non-finite scale (decoding to NaN/Inf)\n",
                   c.label.c_str(), static_cast<long long>(r.nonfinite_blocks));

    // Decode: read everything back to f32, then measure reconstruction.
    std::vector<float> kb(static_cast<std::size_t>(s.context) * static_cast<std::size_t>(d)), vb(kb.size());
    double k_sig = 0, k_err = 0, v_sig = 0, v_err = 0, decode_time = 0;
    for (int l = 0; l < s.layers; ++l) {
      auto const& L = layers[static_cast<std::size_t>(l)];
      for (int h = 0; h < s.kv_heads; ++h) {
        t0 = clock_type::now();
        cache->read_keys(l, h, 0, s.context, kb.data());
        cache->read_values(l, h, 0, s.context, vb.data());
        decode_time += seconds_since(t0);
        for (std::int64_t t = 0; t < s.context; ++t) {
          std::size_t const o =
              (static_cast<std::size_t>(t) * static_cast<std::size_t>(s.kv_heads) + static_cast<std::size_t>(h)) *
              static_cast<std::size_t>(d);
          for (int ch = 0; ch < d; ++ch) {
            std::size_t const i =
                static_cast<std::size_t>(t) * static_cast<std::size_t>(d) + static_cast<std::size_t>(ch);
            double const k = L.keys[o + static_cast<std::size_t>(ch)], v = L.values[o + static_cast<std::size_t>(ch)];
            k_sig += k * k;
            v_sig += v * v;
            k_err += (k - kb[i]) * (k - kb[i]);
            v_err += (v - vb[i]) * (v - vb[i]);
          }
        }
      }
    }
    r.decode_gbps = f32_bytes / decode_time / 1e9;
    r.k_snr_db = k_err > 0 ? 10.0 * std::log10(k_sig / k_err) : INFINITY;
    r.v_snr_db = v_err > 0 ? 10.0 * std::log10(v_sig / v_err) : INFINITY;

    // Decode attention: every query of every layer against exact attention; median call time.
    std::vector<float> out(static_cast<std::size_t>(s.q_heads) * static_cast<std::size_t>(d));
    std::vector<double> times;
    double num = 0, den = 0, dot = 0, n_out = 0, n_ref = 0;
    for (int l = 0; l < s.layers; ++l) {
      auto const& L = layers[static_cast<std::size_t>(l)];
      for (int qi = 0; qi < s.queries_per_layer; ++qi) {
        float const* q = L.queries.data() + static_cast<std::size_t>(qi) * out.size();
        t0 = clock_type::now();
        cache->attention(l, q, s.q_heads, out.data());
        times.push_back(seconds_since(t0));
        double const* ref = exact[static_cast<std::size_t>(l)].data() + static_cast<std::size_t>(qi) * out.size();
        for (std::size_t i = 0; i < out.size(); ++i) {
          double const a = out[i], b = ref[i];
          num += (a - b) * (a - b);
          den += b * b;
          dot += a * b;
          n_out += a * a;
          n_ref += b * b;
        }
      }
    }
    r.attn_rel_error = std::sqrt(num / den);
    r.attn_cosine = dot / std::sqrt(n_out * n_ref);
    double const t_attn = median(times);
    if (c.label == "f16") f16_attn_time = t_attn;
    r.attn_speedup_vs_f16 = f16_attn_time ? *f16_attn_time / t_attn : 0.0;
    by_index[idx] = r;
  }
  for (auto& r : by_index) rows.push_back(*r);
  return rows;
}

/// Evaluates every configuration on the synthetic workload.
auto run_synthetic(synthetic_shape const& s, std::vector<config> const& configs, bool progress) -> std::vector<result> {
  if (progress)
    std::fprintf(stderr,
                 "kvq-eval: generating the synthetic workload (%d layers, %d kv heads, %d q heads, head_dim %d, "
                 "%lld tokens)\n",
                 s.layers, s.kv_heads, s.q_heads, s.head_dim, static_cast<long long>(s.context));
  std::vector<synthetic_layer> layers;
  for (int l = 0; l < s.layers; ++l) layers.push_back(make_synthetic_layer(s, l));
  return evaluate(s, layers, configs, progress);
}

/// Evaluates every configuration on a real model: the KV metrics on the model's own K/V (the f32
/// cache after its longest story), then perplexity, KL and top-1 against the f32 cache; with
/// `paged`, also the continuous-batching run of every configuration through one paged cache
/// (every configuration must have a paged_table entry). The reference and every configuration
/// prefill each story in chunks of `chunk` tokens (1: token by token).
auto run_model(std::string const& model_path, std::string const& tokenizer_path, std::string const& text_path,
               std::vector<config> const& configs, bool progress, std::optional<paged_settings> const& paged, int chunk,
               std::int64_t& context) -> std::vector<result> {
  model_inputs const in = load_model_inputs(model_path, tokenizer_path, text_path);
  auto const& cfg = in.model.config();
  if (progress)
    std::fprintf(stderr, "kvq-eval: reference run (f32 cache, prefill chunk %d) over %s\n", chunk, text_path.c_str());
  reference_run const ref = run_reference(in, chunk);
  synthetic_shape s;
  s.layers = cfg.n_layers;
  s.kv_heads = cfg.n_kv_heads;
  s.q_heads = cfg.n_heads;
  s.head_dim = cfg.head_dim();
  s.context = ref.kv_context;
  s.queries_per_layer = ref.queries_per_layer;
  context = s.context;
  auto rows = evaluate(s, ref.kv_layers, configs, progress);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    if (progress)
      std::fprintf(stderr, "kvq-eval: [%zu/%zu] %s: perplexity\n", i + 1, rows.size(), rows[i].label.c_str());
    auto const t0 = clock_type::now();
    auto const q = score_config(in, ref, configs[i], chunk);
    double const flat_seconds = seconds_since(t0);
    rows[i].ppl = q.ppl;
    rows[i].ppl_ref = ref.ppl;
    rows[i].kld = q.kld;
    rows[i].top1_agreement = q.top1;
    if (!paged) continue;
    if (progress)
      std::fprintf(stderr, "kvq-eval: [%zu/%zu] %s: paged continuous batching\n", i + 1, rows.size(),
                   rows[i].label.c_str());
    rows[i].paged = find_paged(configs[i])->run(in, configs[i], *paged);
    rows[i].paged->flat_seconds = flat_seconds;
    // The paged cache holds the flat cache's bytes: only the order of float sums may differ.
    if (paged_rel_diff(rows[i]) > 1e-5)
      std::fprintf(stderr, "kvq-eval: warning: %s: paged perplexity %.9g differs from the flat %.9g by %.2e\n",
                   rows[i].label.c_str(), rows[i].paged->ppl, q.ppl, paged_rel_diff(rows[i]));
  }
  return rows;
}

void usage(std::FILE* out) {
  std::fputs(
      "usage: kvq-eval [options]\n"
      "  (no options)          evaluate every configuration on the built-in synthetic KV workload\n"
      "  --model FILE          llama2.c-format model (.bin); needs --tokenizer and --text\n"
      "  --tokenizer FILE      llama2.c tokenizer (.bin)\n"
      "  --text FILE           text scored for perplexity (stories separated by <|endoftext|> lines)\n"
      "  --paged               with --model: also run every story as a sequence of one paged cache per\n"
      "                        configuration (continuous batching, batched paged attention; shared\n"
      "                        prefixes forked) and compare its perplexity with the flat cache's\n"
      "  --page-tokens N       tokens per page of --paged (default 32; a multiple of 32 for KIVI)\n"
      "  --chunk N             with --model: prefill every story in chunks of N tokens (one append and\n"
      "                        one multi-token attention per layer and chunk), the f32 reference too;\n"
      "                        default 1 (token by token). N > 1 does not go with --paged (batched\n"
      "                        decode, one token per sequence and step). KIVI's perplexity depends on\n"
      "                        N (its residual flushes inside a chunk); the others' matches N = 1 to\n"
      "                        fp32 rounding\n"
      "  --json FILE           write the results as JSON (schema_version 1 for the synthetic workload;\n"
      "                        3 with --model: version 2's --paged objects plus the prefill \"chunk\")\n"
      "  --svg FILE            draw error (or perplexity) against bits per element\n"
      "  --configs A,B,...     evaluate only these configuration labels (see --list)\n"
      "  --context N           synthetic context length in tokens (default 4096)\n"
      "  --layers N            synthetic layer count (default 4)\n"
      "  --list                print the configuration labels and exit\n"
      "  --quiet               no progress on stderr\n",
      out);
}

/// Raised for bad command-line arguments (exit status 2).
struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

auto parse_int(std::string const& flag, std::string const& v, long long lo, long long hi) -> long long {
  char* end = nullptr;
  errno = 0;
  long long const x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno != 0 || x < lo || x > hi)
    throw usage_error(flag + " expects an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" +
                      v + "'");
  return x;
}

/// Opens an output file up front, so a bad path fails before the evaluation runs.
auto open_output(std::optional<std::string> const& path) -> std::optional<std::ofstream> {
  if (!path) return std::nullopt;
  std::ofstream f(*path, std::ios::binary);
  if (!f) throw usage_error("cannot open '" + *path + "' for writing");
  return f;
}

void write_file(std::optional<std::ofstream>& f, std::string const& path, std::string const& text) {
  *f << text;
  f->flush();
  if (!*f) throw std::runtime_error("writing '" + path + "' failed");
}

int run(int argc, char** argv) {
  std::optional<std::string> model, tokenizer, text, json, svg, only;
  synthetic_shape shape;
  bool progress = true, list = false, paged = false;
  std::optional<int> page_tokens, chunk;
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw usage_error(a + " expects a value");
      return argv[++i];
    };
    if (a == "--model")
      model = value();
    else if (a == "--tokenizer")
      tokenizer = value();
    else if (a == "--text")
      text = value();
    else if (a == "--json")
      json = value();
    else if (a == "--svg")
      svg = value();
    else if (a == "--configs")
      only = value();
    else if (a == "--context")
      shape.context = parse_int(a, value(), 64, 1 << 20);
    else if (a == "--layers")
      shape.layers = static_cast<int>(parse_int(a, value(), 1, 64));
    else if (a == "--paged")
      paged = true;
    else if (a == "--page-tokens")
      page_tokens = static_cast<int>(parse_int(a, value(), 1, 1 << 16));
    else if (a == "--chunk")
      chunk = static_cast<int>(parse_int(a, value(), 1, 1 << 16));
    else if (a == "--list")
      list = true;
    else if (a == "--quiet")
      progress = false;
    else if (a == "--help" || a == "-h") {
      usage(stdout);
      return 0;
    } else
      throw usage_error("unknown argument '" + a + "' (see --help)");
  }
  auto configs = default_configs();
  if (list) {
    for (auto const& c : configs) std::printf("%s\n", c.label.c_str());
    return 0;
  }
  if (only) {
    try {
      configs = select_configs(configs, *only);
    } catch (std::invalid_argument const& e) {
      throw usage_error(e.what());
    }
  }
  bool const with_model = model || tokenizer || text;
  if (with_model && !(model && tokenizer && text)) throw usage_error("--model, --tokenizer and --text go together");
  std::optional<paged_settings> paged_run;
  if (page_tokens && !paged) throw usage_error("--page-tokens goes with --paged");
  if (chunk && !with_model) throw usage_error("--chunk needs --model, --tokenizer and --text");
  // --paged is batched decode (one token per sequence and step) compared with the flat
  // token-by-token perplexity: a chunked flat run would not be its like for like.
  if (chunk && *chunk > 1 && paged)
    throw usage_error("--chunk " + std::to_string(*chunk) +
                      " does not go with --paged: the paged run decodes one token per sequence and step and is "
                      "compared with the token-by-token flat run (--chunk 1)");
  if (paged) {
    if (!with_model) throw usage_error("--paged needs --model, --tokenizer and --text");
    paged_run = paged_settings{};
    if (page_tokens) paged_run->page_tokens = *page_tokens;
    // Without --configs, every configuration --paged supports; with it, each must be supported.
    if (!only) std::erase_if(configs, [](config const& c) { return find_paged(c) == nullptr; });
    for (auto const& c : configs) {
      if (!find_paged(c))
        throw usage_error("--paged does not support configuration '" + c.label + "' (key " + c.k_codec + ", value " +
                          c.v_codec + "); it supports one codec for K and V among: " + paged_codec_names());
      if (c.group && paged_run->page_tokens % *c.group != 0)
        throw usage_error("--page-tokens " + std::to_string(paged_run->page_tokens) + " is not a multiple of " +
                          c.label + "'s KIVI group G = " + std::to_string(*c.group));
    }
  }

  auto json_out = open_output(json);
  auto svg_out = open_output(svg);
  std::vector<result> rows;
  std::int64_t context = shape.context;
  if (with_model) {
    rows = run_model(*model, *tokenizer, *text, configs, progress, paged_run, chunk.value_or(1), context);
  } else {
    rows = run_synthetic(shape, configs, progress);
  }
  if (with_model) print_prefill(chunk.value_or(1), stdout);
  print_table(rows, with_model, stdout);
  print_paged_table(rows, stdout);
  if (json) write_file(json_out, *json, to_json(rows, with_model, context, chunk.value_or(1)).dump(2) + "\n");
  if (svg) write_file(svg_out, *svg, to_svg(rows, with_model, chunk.value_or(1)));
  return 0;
}

}  // namespace
}  // namespace kvq_eval

int main(int argc, char** argv) {
  try {
    return kvq_eval::run(argc, argv);
  } catch (kvq_eval::usage_error const& e) {
    std::fprintf(stderr, "kvq-eval: %s\n", e.what());
    return 2;
  } catch (kvq_eval::input_error const& e) {
    std::fprintf(stderr, "kvq-eval: %s\n", e.what());
    return 2;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "kvq-eval: error: %s\n", e.what());
    return 1;
  }
}
