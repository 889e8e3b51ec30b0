// kvq-eval --paged: the real-model workload run as continuous batching through one paged cache.
//
// Every story of the text is a sequence of ONE kvq::PagedKVCache<Choice> per configuration. The
// sequences advance together, one token per step: per layer every live sequence appends its
// token's K/V, one kvq::paged_decode_attention call serves the whole batch, then each sequence runs
// the rest of its layer (llama2c::forward_pass, the arithmetic of llama2c::engine). Stories that
// share a prefix share a sequence (and so its pages) until they diverge: the sequence then forks,
// one child per next token (every story starts with BOS, so at least that token is shared). A
// sequence is released when its last story has been scored, so sequences finish at different
// steps. The perplexity is scored exactly as llama2c::perplexity scores the flat cache, so the two
// agree up to float rounding.
#pragma once

#include <kvq/codec/fp4.hpp>
#include <kvq/codec/fp8.hpp>
#include <kvq/codec/int8.hpp>
#include <kvq/codec/kivi.hpp>
#include <kvq/codec/passthrough.hpp>
#include <kvq/codec/q4_0.hpp>
#include <kvq/codec/q8_0.hpp>
#include <kvq/codec/rotated.hpp>
#include <kvq/codec/tq.hpp>
#include <kvq/paged_attention.hpp>
#include <kvq/paged_cache.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "configs.hpp"
#include "llama2c/llama2c.hpp"
#include "model_eval.hpp"
#include "report.hpp"

namespace kvq_eval {

/// Run-time settings of --paged.
struct paged_settings {
  int page_tokens = 32;  ///< tokens per page (a multiple of the KIVI group G = 32 where KIVI is used)
};

namespace detail {

/// One live sequence of the batch: the stories (indices) that agree on their tokens [0, pos], and
/// the position whose token it feeds next.
struct live_sequence {
  kvq::sequence_id id = 0;
  int pos = 0;
  std::vector<std::size_t> stories;
};

/// `stories` grouped by their token at index `at`, groups in order of first appearance.
inline auto group_by_token(std::vector<std::vector<int>> const& tokens, std::vector<std::size_t> const& stories,
                           std::size_t at) -> std::vector<std::vector<std::size_t>> {
  std::vector<std::vector<std::size_t>> groups;
  std::vector<int> keys;
  for (std::size_t s : stories) {
    int const t = tokens[s][at];
    auto const it = std::find(keys.begin(), keys.end(), t);
    if (it == keys.end()) {
      keys.push_back(t);
      groups.push_back({s});
    } else {
      groups[static_cast<std::size_t>(it - keys.begin())].push_back(s);
    }
  }
  return groups;
}

}  // namespace detail

/// Runs the stories of `in` as continuous batching through one PagedKVCache<Choice> with
/// configuration `c` (its KIVI residual) and `settings`; returns the perplexity, page use and wall
/// time. Raises what the cache raises (e.g. invalid_argument_error for a page size that is not a
/// multiple of the KIVI group) and invalid_argument_error when the text has nothing to score.
template <kvq::codec_choice Choice>
auto run_paged(model_inputs const& in, config const& c, paged_settings const& settings) -> paged_stats {
  using clock = std::chrono::steady_clock;
  auto const t0 = clock::now();
  auto const& cfg = in.model.config();
  int const hd = cfg.head_dim();
  std::size_t const dim = static_cast<std::size_t>(cfg.dim);
  auto const tokens = kvq::llama2c::story_tokens(in.model, in.tokenizer, in.text);

  // The pool holds every story's pages as if nothing were shared, plus one for a copy in flight;
  // a story of n tokens feeds n - 1 of them (the last is only predicted).
  std::vector<std::size_t> scored;
  std::int64_t pages = 1;
  for (std::size_t s = 0; s < tokens.size(); ++s)
    if (tokens[s].size() >= 2) {
      scored.push_back(s);
      pages += (static_cast<std::int64_t>(tokens[s].size()) - 1 + settings.page_tokens - 1) / settings.page_tokens;
    }
  kvq::detail::check<kvq::invalid_argument_error>(!scored.empty(), "kvq-eval --paged: the text has no token to score");
  kvq::paged_shape const shape{cfg.n_layers,         cfg.n_kv_heads, hd,
                               settings.page_tokens, pages,          static_cast<int>(scored.size())};
  typename kvq::PagedKVCache<Choice>::options opt;
  opt.residual = c.residual.value_or(128);
  kvq::PagedKVCache<Choice> cache(shape, opt);
  kvq::attention_options attention;
  attention.scale = 1.0f / std::sqrt(static_cast<float>(hd));

  paged_stats r;
  r.page_tokens = settings.page_tokens;
  r.pages = pages;
  r.max_sequences = shape.max_sequences;
  r.page_bytes = cache.pages().page_bytes;
  r.memory = cache.memory();
  r.stories = static_cast<int>(tokens.size());
  auto sample = [&](std::int64_t live) {
    auto const p = cache.pages();
    r.peak_used_pages = std::max(r.peak_used_pages, p.used_pages);
    r.peak_shared_pages = std::max(r.peak_shared_pages, p.shared_pages);
    r.peak_saved_pages = std::max(r.peak_saved_pages, p.page_refs - p.used_pages);
    r.peak_sequences = std::max(r.peak_sequences, live);
  };

  // One sequence per distinct first token (every story starts with BOS: one sequence).
  std::vector<detail::live_sequence> live;
  for (auto& g : detail::group_by_token(tokens, scored, 0)) live.push_back({cache.add_sequence(), 0, std::move(g)});

  std::vector<kvq::llama2c::forward_pass> passes;
  std::vector<kvq::sequence_id> ids;
  std::vector<float> q, out;
  std::vector<double> logp;
  double nll = 0.0;
  while (!live.empty()) {
    std::size_t const batch = live.size();
    while (passes.size() < batch) passes.emplace_back(in.model);
    ids.resize(batch);
    q.resize(batch * dim);
    out.resize(batch * dim);
    for (std::size_t b = 0; b < batch; ++b) {
      auto const& seq = live[b];
      ids[b] = seq.id;
      passes[b].begin(tokens[seq.stories.front()][static_cast<std::size_t>(seq.pos)], seq.pos);
    }
    for (int l = 0; l < cfg.n_layers; ++l) {
      for (std::size_t b = 0; b < batch; ++b) {
        auto& p = passes[b];
        p.qkv(l);
        cache.append(ids[b], l, kvq::token_major(p.k().data(), 1, cfg.n_kv_heads, hd),
                     kvq::token_major(p.v().data(), 1, cfg.n_kv_heads, hd));
        std::copy(p.q().begin(), p.q().end(), q.begin() + static_cast<std::ptrdiff_t>(b * dim));
      }
      kvq::paged_decode_attention(cache, l, std::span<kvq::sequence_id const>(ids), q.data(), cfg.n_heads, out.data(),
                                  attention, 1);
      for (std::size_t b = 0; b < batch; ++b) {
        auto& p = passes[b];
        std::copy_n(out.begin() + static_cast<std::ptrdiff_t>(b * dim), dim, p.att().begin());
        p.finish_layer(l);
      }
    }
    sample(static_cast<std::int64_t>(batch));
    ++r.steps;

    // Score every story of every sequence; continue, fork at a divergence, or release.
    std::vector<detail::live_sequence> next;
    for (std::size_t b = 0; b < batch; ++b) {
      auto& seq = live[b];
      auto const pos = static_cast<std::size_t>(seq.pos);
      kvq::llama2c::log_softmax(passes[b].logits(), logp);
      std::vector<std::size_t> more;
      for (std::size_t s : seq.stories) {
        nll -= logp[static_cast<std::size_t>(tokens[s][pos + 1])];
        ++r.tokens;
        if (pos + 2 < tokens[s].size()) more.push_back(s);
      }
      auto groups = detail::group_by_token(tokens, more, pos + 1);
      if (groups.empty()) {
        cache.release(seq.id);
        continue;
      }
      for (std::size_t g = 1; g < groups.size(); ++g) {
        next.push_back({cache.fork(seq.id), seq.pos + 1, std::move(groups[g])});
        ++r.forks;
      }
      next.push_back({seq.id, seq.pos + 1, std::move(groups.front())});
    }
    live = std::move(next);
    sample(static_cast<std::int64_t>(live.size()));
  }
  r.final_used_pages = cache.used_pages();
  r.ppl = std::exp(nll / static_cast<double>(r.tokens));
  r.seconds = std::chrono::duration<double>(clock::now() - t0).count();
  return r;
}

/// A codec choice --paged runs: the configuration's key and value codec names and its runner.
struct paged_entry {
  std::string_view key;
  std::string_view value;
  paged_stats (*run)(model_inputs const&, config const&, paged_settings const&);
};

/// The codec choices --paged supports (each compiled as a PagedKVCache<Choice>).
inline constexpr std::array<paged_entry, 18> paged_table = {{
    {"f32", "f32", &run_paged<kvq::f32_codec>},
    {"f16", "f16", &run_paged<kvq::f16_codec>},
    {"q8_0", "q8_0", &run_paged<kvq::q8_0>},
    {"q4_0", "q4_0", &run_paged<kvq::q4_0>},
    {"int8", "int8", &run_paged<kvq::int8_sym>},
    {"fp8_e4m3", "fp8_e4m3", &run_paged<kvq::fp8_e4m3>},
    {"fp8_e5m2", "fp8_e5m2", &run_paged<kvq::fp8_e5m2>},
    {"mxfp4", "mxfp4", &run_paged<kvq::mxfp4>},
    {"nvfp4", "nvfp4", &run_paged<kvq::nvfp4>},
    {"kivi2", "kivi2", &run_paged<kvq::kivi<2>>},
    {"kivi4", "kivi4", &run_paged<kvq::kivi<4>>},
    {"kivi8", "kivi8", &run_paged<kvq::kivi<8>>},
    {"rot-q8_0", "rot-q8_0", &run_paged<kvq::rotated<kvq::q8_0>>},
    {"rot-q4_0", "rot-q4_0", &run_paged<kvq::rotated<kvq::q4_0>>},
    {"rot-kivi4", "rot-kivi4",
     &run_paged<kvq::kv_codecs<kvq::rotated<kvq::kivi_key<4>>, kvq::rotated<kvq::kivi_value<4>>>>},
    {"tq4", "tq4", &run_paged<kvq::tq4>},
    {"tq3", "tq3", &run_paged<kvq::tq3>},
    {"tq2", "tq2", &run_paged<kvq::tq2>},
}};

/// The runner of configuration `c`, or nullptr when --paged does not support its codec pair.
inline auto find_paged(config const& c) -> paged_entry const* {
  for (auto const& e : paged_table)
    if (e.key == c.k_codec && e.value == c.v_codec) return &e;
  return nullptr;
}

/// The codec names --paged supports, comma-separated (for usage errors).
inline auto paged_codec_names() -> std::string {
  std::string s;
  for (auto const& e : paged_table) s += (s.empty() ? "" : ", ") + std::string(e.key);
  return s;
}

}  // namespace kvq_eval
