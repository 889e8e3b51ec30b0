// kvq-eval: the real-model workload (a llama2.c-format model scored on a text).
//
// The reference is the f32 cache. Each configuration's engine runs the same positions; per scored
// position kvq-eval compares its log-probabilities with the reference's: perplexity, mean
// KL(P_ref ‖ P_quant) in nats and top-1 agreement. The KV metrics (SNR, attention error) use the
// model's own K/V: the f32 cache after the longest story, with queries taken from real keys.
// With a prefill chunk > 1 (--chunk), the reference and every configuration prefill each story in
// chunks of that many tokens (llama2c::perplexity's chunk: one append and one multi-token
// attention per layer and chunk), so every comparison is like for like.
#pragma once

#include <cmath>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "configs.hpp"
#include "llama2c/llama2c.hpp"
#include "report.hpp"
#include "synthetic.hpp"

namespace kvq_eval {

/// An unreadable or invalid input file (exit status 2).
struct input_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// The model, tokenizer and text of a model run.
struct model_inputs {
  kvq::llama2c::model model;
  kvq::llama2c::tokenizer tokenizer;
  std::string text;
};

/// Loads and validates the inputs; raises input_error with the loader's message on any problem.
inline auto load_model_inputs(std::string const& model_path, std::string const& tokenizer_path,
                              std::string const& text_path) -> model_inputs {
  try {
    model_inputs in{kvq::llama2c::load_model(model_path), {}, {}};
    in.tokenizer = kvq::llama2c::load_tokenizer(tokenizer_path, in.model.config().vocab_size);
    std::ifstream f(text_path, std::ios::binary);
    if (!f) throw input_error("text file '" + text_path + "' cannot be opened for reading");
    std::stringstream ss;
    ss << f.rdbuf();
    in.text = ss.str();
    if (in.text.empty()) throw input_error("text file '" + text_path + "' is empty");
    return in;
  } catch (kvq::error const& e) {
    throw input_error(e.what());
  }
}

/// The reference (f32 cache) run: per scored position, its log-probabilities; and the K/V workload.
struct reference_run {
  double ppl = 0;
  std::int64_t positions = 0;
  int vocab = 0;
  std::vector<double> logp;  // (positions, vocab)
  std::vector<int> argmax;   // (positions)
  std::vector<synthetic_layer> kv_layers;
  std::int64_t kv_context = 0;
  int queries_per_layer = 4;
};

/// The f32 cache's run over the text, prefilling each story in chunks of `chunk` tokens.
inline auto run_reference(model_inputs const& in, int chunk) -> reference_run {
  auto const& cfg = in.model.config();
  reference_run r;
  r.vocab = cfg.vocab_size;
  kvq::llama2c::engine e(in.model, "f32", "f32");
  // Remember the story that fills the cache most: its K/V become the KV workload (with chunk > 1 the
  // cache holds the whole chunk when its positions are observed; the longest story still ends full).
  std::int64_t best_len = 0;
  auto const observe = [&](kvq::llama2c::scored_position const& p) {
    r.logp.insert(r.logp.end(), p.logp.begin(), p.logp.end());
    r.argmax.push_back(kvq::llama2c::argmax(p.logits));
    ++r.positions;
    std::int64_t const len = e.cache().size(0);
    if (len > best_len) {
      best_len = len;
      r.kv_context = len;
      r.kv_layers.assign(static_cast<std::size_t>(cfg.n_layers), {});
      int const d = cfg.head_dim(), h = cfg.n_kv_heads;
      std::vector<float> row(static_cast<std::size_t>(len) * static_cast<std::size_t>(d));
      for (int l = 0; l < cfg.n_layers; ++l) {
        auto& L = r.kv_layers[static_cast<std::size_t>(l)];
        L.keys.assign(static_cast<std::size_t>(len) * static_cast<std::size_t>(h) * static_cast<std::size_t>(d), 0.0f);
        L.values = L.keys;
        for (int kh = 0; kh < h; ++kh) {
          for (int pass = 0; pass < 2; ++pass) {
            if (pass == 0)
              e.cache().read_keys(l, kh, 0, len, row.data());
            else
              e.cache().read_values(l, kh, 0, len, row.data());
            auto& dst = pass == 0 ? L.keys : L.values;
            for (std::int64_t t = 0; t < len; ++t)
              std::copy_n(row.data() + t * d, d,
                          dst.data() + (static_cast<std::size_t>(t) * static_cast<std::size_t>(h) +
                                        static_cast<std::size_t>(kh)) *
                                           static_cast<std::size_t>(d));
          }
        }
      }
    }
  };
  r.ppl = kvq::llama2c::perplexity(e, in.tokenizer, in.text, observe, chunk).ppl;
  // Queries from real keys: query head qh looks like the key of its kv head at a late position.
  int const d = cfg.head_dim(), h = cfg.n_kv_heads, qh_n = cfg.n_heads, group = qh_n / h;
  for (auto& L : r.kv_layers) {
    L.queries.resize(static_cast<std::size_t>(r.queries_per_layer) * static_cast<std::size_t>(qh_n) *
                     static_cast<std::size_t>(d));
    for (int qi = 0; qi < r.queries_per_layer; ++qi) {
      std::int64_t const t = r.kv_context - 1 - 37 * qi;
      for (int qh = 0; qh < qh_n; ++qh) {
        float const* k = L.keys.data() + (static_cast<std::size_t>(std::max<std::int64_t>(t, 0)) * h +
                                          static_cast<std::size_t>(qh / group)) *
                                             static_cast<std::size_t>(d);
        float* q = L.queries.data() +
                   (static_cast<std::size_t>(qi) * qh_n + static_cast<std::size_t>(qh)) * static_cast<std::size_t>(d);
        for (int c = 0; c < d; ++c) q[c] = k[c] * (qh % group == 0 ? 1.0f : -0.5f);
      }
    }
  }
  return r;
}

/// Quality of one configuration against the reference.
struct model_quality {
  double ppl = 0, kld = 0, top1 = 0;
};

/// Runs configuration `c` over the text with the reference's prefill chunk (`chunk`).
inline auto score_config(model_inputs const& in, reference_run const& ref, config const& c, int chunk)
    -> model_quality {
  kvq::any_cache_options opt;
  opt.residual = c.residual.value_or(128);
  kvq::llama2c::engine e(in.model, c.k_codec, c.v_codec, opt);
  std::int64_t i = 0;
  double kl = 0;
  std::int64_t agree = 0;
  auto const observe = [&](kvq::llama2c::scored_position const& p) {
    double const* lr = ref.logp.data() + i * ref.vocab;
    double k = 0;
    for (int v = 0; v < ref.vocab; ++v) {
      double const a = lr[v];
      k += std::exp(a) * (a - p.logp[static_cast<std::size_t>(v)]);
    }
    kl += k;
    agree += kvq::llama2c::argmax(p.logits) == ref.argmax[static_cast<std::size_t>(i)] ? 1 : 0;
    ++i;
  };
  auto const res = kvq::llama2c::perplexity(e, in.tokenizer, in.text, observe, chunk);
  model_quality q;
  q.ppl = res.ppl;
  q.kld = kl / static_cast<double>(std::max<std::int64_t>(i, 1));
  q.top1 = static_cast<double>(agree) / static_cast<double>(std::max<std::int64_t>(i, 1));
  return q;
}

}  // namespace kvq_eval
