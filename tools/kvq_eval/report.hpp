// kvq-eval: result rows and their output as aligned tables, JSON (schema_version 1 for the synthetic
// workload, 3 for a model: version 2's --paged objects plus the prefill chunk) and SVG.
#pragma once

#include <kvq/cache.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvq_eval {

/// One configuration run by --paged: continuous batching through one paged cache (paged_eval.hpp).
struct paged_stats {
  int page_tokens = 0;                 ///< tokens per page
  std::int64_t pages = 0;              ///< pages in the pool
  int max_sequences = 0;               ///< live sequences the pool allows
  std::size_t page_bytes = 0;          ///< bytes of one page (every layer, K and V)
  kvq::memory_report memory{};         ///< the pool's memory report (the whole allocation)
  std::int64_t peak_used_pages = 0;    ///< most pages held at once
  std::int64_t peak_shared_pages = 0;  ///< most pages held by two sequences or more at once
  std::int64_t peak_saved_pages = 0;   ///< most pages sharing saved at once (page-table entries - pages held)
  std::int64_t peak_sequences = 0;     ///< most live sequences at once (the batch of a step)
  std::int64_t final_used_pages = 0;   ///< pages held after every sequence was released (0)
  std::int64_t forks = 0;              ///< sequences started by forking one that holds a shared prefix
  std::int64_t steps = 0;              ///< batched decode steps
  std::int64_t tokens = 0;             ///< tokens scored
  int stories = 0;                     ///< stories of the text
  double ppl = 0;                      ///< perplexity through the paged cache
  double seconds = 0;                  ///< wall time of the paged run
  double flat_seconds = 0;             ///< wall time of the flat run of the same configuration (KL included)
};

/// One evaluated configuration.
struct result {
  std::string label;
  std::string k_codec;
  std::string v_codec;
  std::optional<int> group;     // KIVI group size G, else null
  std::optional<int> residual;  // KIVI residual R, else null
  double bits_per_element = 0;
  double memory_vs_f16 = 0;
  double k_snr_db = 0;
  double v_snr_db = 0;
  double attn_rel_error = 0;
  double attn_cosine = 0;
  double encode_gbps = 0;
  double decode_gbps = 0;
  double attn_speedup_vs_f16 = 0;
  std::int64_t nonfinite_blocks = 0;  // stored blocks with a NaN/Inf scale after encoding the workload
  // Model workload only.
  std::optional<double> ppl, ppl_ref, kld, top1_agreement;
  std::optional<paged_stats> paged;  // --paged only
};

/// |paged - flat| / flat of a configuration's perplexities (0 without a paged run).
inline auto paged_rel_diff(result const& r) -> double {
  if (!r.paged || !r.ppl) return 0.0;
  return std::abs(r.paged->ppl - *r.ppl) / *r.ppl;
}

/// Formats a double with `digits` decimals; infinity as "inf".
inline auto fixed(double v, int digits) -> std::string {
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (std::isnan(v)) return "nan";
  std::ostringstream s;
  s << std::fixed << std::setprecision(digits) << v;
  return s.str();
}

/// Formats a double in scientific notation with 2 decimals.
inline auto sci(double v) -> std::string {
  std::ostringstream s;
  s << std::scientific << std::setprecision(2) << v;
  return s.str();
}

/// Prints `head` and `cells` as columns padded to their widest entry, two spaces apart, the first
/// `left` columns left-aligned and the others right-aligned, with a rule under the head.
inline void print_aligned(std::vector<std::string> const& head, std::vector<std::vector<std::string>> const& cells,
                          std::size_t left, std::FILE* out) {
  std::vector<std::size_t> w(head.size());
  for (std::size_t i = 0; i < head.size(); ++i) {
    w[i] = head[i].size();
    for (auto const& c : cells) w[i] = std::max(w[i], c[i].size());
  }
  auto line = [&](std::vector<std::string> const& c) {
    for (std::size_t i = 0; i < c.size(); ++i) {
      std::fprintf(out, i < left ? "%-*s" : "%*s", static_cast<int>(w[i]), c[i].c_str());
      std::fputs(i + 1 < c.size() ? "  " : "\n", out);
    }
  };
  line(head);
  std::size_t total = 0;
  for (auto x : w) total += x + 2;
  std::fprintf(out, "%s\n", std::string(total - 2, '-').c_str());
  for (auto const& c : cells) line(c);
}

/// States how the model runs prefilled each story (--chunk), above the results table.
inline void print_prefill(int chunk, std::FILE* out) {
  if (chunk == 1)
    std::fputs("prefill: chunk 1 (token by token; the f32 reference too)\n", out);
  else
    std::fprintf(out,
                 "prefill: chunk %d (each story in chunks of %d tokens, one multi-token attention per layer and "
                 "chunk; the f32 reference too)\n",
                 chunk, chunk);
}

/// Prints the results as an aligned table.
inline void print_table(std::vector<result> const& rows, bool model, std::FILE* out) {
  std::vector<std::string> head = {"config",   "K",        "V",        "bits/el",
                                   "mem/f16",  "K SNR dB", "V SNR dB", "attn rel err",
                                   "attn cos", "enc GB/s", "dec GB/s", "attn x f16"};
  if (model) {
    for (char const* h : {"PPL", "dPPL %", "KL nats", "top-1"}) head.emplace_back(h);
  }
  std::vector<std::vector<std::string>> cells;
  for (auto const& r : rows) {
    std::vector<std::string> c = {r.label,
                                  r.k_codec,
                                  r.v_codec,
                                  fixed(r.bits_per_element, 2),
                                  fixed(r.memory_vs_f16, 3),
                                  fixed(r.k_snr_db, 1),
                                  fixed(r.v_snr_db, 1),
                                  sci(r.attn_rel_error),
                                  fixed(r.attn_cosine, 6),
                                  fixed(r.encode_gbps, 2),
                                  fixed(r.decode_gbps, 2),
                                  fixed(r.attn_speedup_vs_f16, 2)};
    if (model) {
      c.push_back(fixed(r.ppl.value_or(0), 4));
      c.push_back(fixed(100.0 * (r.ppl.value_or(0) / r.ppl_ref.value_or(1) - 1.0), 2));
      c.push_back(sci(r.kld.value_or(0)));
      c.push_back(fixed(r.top1_agreement.value_or(0), 4));
    }
    cells.push_back(std::move(c));
  }
  print_aligned(head, cells, 3, out);
}

/// Prints the --paged results (rows with a paged run) as an aligned table.
inline void print_paged_table(std::vector<result> const& rows, std::FILE* out) {
  std::vector<std::string> const head = {"config",    "page tok",    "pool pages", "page KiB",  "pool MiB",
                                         "peak used", "peak shared", "peak saved", "peak seqs", "forks",
                                         "flat PPL",  "paged PPL",   "rel diff",   "flat s",    "paged s"};
  std::vector<std::vector<std::string>> cells;
  for (auto const& r : rows) {
    if (!r.paged) continue;
    auto const& p = *r.paged;
    cells.push_back({r.label, std::to_string(p.page_tokens), std::to_string(p.pages),
                     fixed(static_cast<double>(p.page_bytes) / 1024.0, 2),
                     fixed(static_cast<double>(p.memory.total_bytes) / (1024.0 * 1024.0), 2),
                     std::to_string(p.peak_used_pages), std::to_string(p.peak_shared_pages),
                     std::to_string(p.peak_saved_pages), std::to_string(p.peak_sequences), std::to_string(p.forks),
                     fixed(r.ppl.value_or(0), 6), fixed(p.ppl, 6), sci(paged_rel_diff(r)), fixed(p.flat_seconds, 2),
                     fixed(p.seconds, 2)});
  }
  if (cells.empty()) return;
  std::fputs("\n--paged: every story a sequence of one paged pool per configuration, continuous batching\n", out);
  print_aligned(head, cells, 1, out);
}

/// The JSON of a --paged run (the "paged" object of schema_version 2).
inline auto paged_json(result const& r) -> nlohmann::ordered_json {
  auto const& p = *r.paged;
  nlohmann::ordered_json j;
  j["page_tokens"] = p.page_tokens;
  j["pages"] = p.pages;
  j["max_sequences"] = p.max_sequences;
  j["page_bytes"] = p.page_bytes;
  j["memory"] = {{"total_bytes", p.memory.total_bytes},         {"key_bytes", p.memory.key_bytes},
                 {"value_bytes", p.memory.value_bytes},         {"residual_bytes", p.memory.residual_bytes},
                 {"alignment_bytes", p.memory.alignment_bytes}, {"bits_per_element", p.memory.bits_per_element}};
  j["peak_used_pages"] = p.peak_used_pages;
  j["peak_shared_pages"] = p.peak_shared_pages;
  j["peak_saved_pages"] = p.peak_saved_pages;
  j["peak_sequences"] = p.peak_sequences;
  j["final_used_pages"] = p.final_used_pages;
  j["forks"] = p.forks;
  j["steps"] = p.steps;
  j["tokens"] = p.tokens;
  j["stories"] = p.stories;
  j["ppl"] = p.ppl;
  j["ppl_flat"] = r.ppl.value_or(0);
  j["ppl_rel_diff"] = paged_rel_diff(r);
  j["seconds"] = p.seconds;
  j["flat_seconds"] = p.flat_seconds;
  return j;
}

/// The JSON document (see tools/kvq_eval/kvq-eval.schema.json): schema_version 1 for the synthetic
/// workload; 3 for a model, whose document carries the prefill `chunk` of its perplexities (version
/// 2 added the "paged" object of each result, which only model runs write: every model document is
/// version 3 now, with or without --paged).
inline auto to_json(std::vector<result> const& rows, bool model, std::int64_t context, int chunk)
    -> nlohmann::ordered_json {
  nlohmann::ordered_json doc;
  doc["schema_version"] = model ? 3 : 1;
  doc["workload"] = model ? "model" : "synthetic";
  doc["context"] = context;
  if (model) doc["chunk"] = chunk;
  doc["results"] = nlohmann::ordered_json::array();
  for (auto const& r : rows) {
    nlohmann::ordered_json j;
    j["label"] = r.label;
    j["k_codec"] = r.k_codec;
    j["v_codec"] = r.v_codec;
    j["group"] = r.group ? nlohmann::ordered_json(*r.group) : nlohmann::ordered_json(nullptr);
    j["residual"] = r.residual ? nlohmann::ordered_json(*r.residual) : nlohmann::ordered_json(nullptr);
    j["bits_per_element"] = r.bits_per_element;
    j["k_snr_db"] = std::isinf(r.k_snr_db) ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(r.k_snr_db);
    j["v_snr_db"] = std::isinf(r.v_snr_db) ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(r.v_snr_db);
    j["attn_rel_error"] = r.attn_rel_error;
    j["attn_cosine"] = r.attn_cosine;
    j["encode_gbps"] = r.encode_gbps;
    j["decode_gbps"] = r.decode_gbps;
    j["attn_speedup_vs_f16"] = r.attn_speedup_vs_f16;
    j["nonfinite_blocks"] = r.nonfinite_blocks;
    if (model) {
      j["ppl"] = r.ppl.value_or(0);
      j["ppl_ref"] = r.ppl_ref.value_or(0);
      j["kld"] = r.kld.value_or(0);
      j["top1_agreement"] = r.top1_agreement.value_or(0);
    }
    if (r.paged) j["paged"] = paged_json(r);
    doc["results"].push_back(std::move(j));
  }
  return doc;
}

/// Escapes text for SVG.
inline auto xml_escape(std::string const& s) -> std::string {
  std::string o;
  for (char c : s) {
    if (c == '<')
      o += "&lt;";
    else if (c == '>')
      o += "&gt;";
    else if (c == '&')
      o += "&amp;";
    else
      o += c;
  }
  return o;
}

/// The floor of the perplexity excess drawn by to_svg (0.001 %): the f32 reference and configurations
/// within it share the bottom of the chart.
inline constexpr double svg_excess_floor = 1e-5;

/// "0.0032 %", "2.2 %", "105 %": a perplexity excess (a ratio) as a percentage for an axis label.
inline auto excess_text(double ratio) -> std::string {
  double const pct = 100.0 * ratio;
  std::ostringstream s;
  if (pct >= 10.0)
    s << std::fixed << std::setprecision(0) << pct;
  else
    s << std::setprecision(2) << pct;
  return s.str() + " %";
}

/// Draws error against bits per element, one labelled point per configuration, on a log scale:
/// the synthetic workload's attention relative error, or a model's perplexity excess over the f32
/// reference (PPL / PPL_ref - 1, floored at svg_excess_floor), so that configurations within 0.01 %
/// and those at +1000 % share one chart; a model's title states its prefill chunk when > 1.
inline auto to_svg(std::vector<result> const& rows, bool model, int chunk) -> std::string {
  double const width = 900, height = 560, left = 80, right = 30, top = 50, bottom = 60;
  double xmin = 1e9, xmax = -1e9, ymin = 1e300, ymax = -1e300;
  auto yval = [&](result const& r) {
    if (!model) return std::log10(std::max(r.attn_rel_error, 1e-9));
    double const excess = r.ppl && r.ppl_ref && *r.ppl_ref > 0 ? *r.ppl / *r.ppl_ref - 1.0 : 0.0;
    return std::log10(std::max(excess, svg_excess_floor));
  };
  for (auto const& r : rows) {
    xmin = std::min(xmin, r.bits_per_element);
    xmax = std::max(xmax, r.bits_per_element);
    ymin = std::min(ymin, yval(r));
    ymax = std::max(ymax, yval(r));
  }
  if (rows.empty()) xmin = 0, xmax = 1, ymin = 0, ymax = 1;
  xmin = std::floor(xmin) - 0.5, xmax = std::ceil(xmax) + 0.5;
  double const ypad = std::max((ymax - ymin) * 0.08, 1e-3);
  ymin -= ypad, ymax += ypad;
  auto px = [&](double x) { return left + (x - xmin) / (xmax - xmin) * (width - left - right); };
  auto py = [&](double y) { return height - bottom - (y - ymin) / (ymax - ymin) * (height - top - bottom); };
  std::ostringstream s;
  s << std::fixed << std::setprecision(1);
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
    << "\" font-family=\"sans-serif\" font-size=\"11\">\n";
  s << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  s << "<text x=\"" << width / 2 << "\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">kvq-eval: "
    << (model ? "perplexity excess over the f32 cache" : "decode-attention relative error") << " vs bits per element"
    << (model && chunk > 1 ? " (prefill chunk " + std::to_string(chunk) + ")" : std::string()) << "</text>\n";
  // Axes and grid.
  s << "<line x1=\"" << left << "\" y1=\"" << height - bottom << "\" x2=\"" << width - right << "\" y2=\""
    << height - bottom << "\" stroke=\"black\"/>\n";
  s << "<line x1=\"" << left << "\" y1=\"" << top << "\" x2=\"" << left << "\" y2=\"" << height - bottom
    << "\" stroke=\"black\"/>\n";
  for (double x = std::ceil(xmin); x <= xmax; x += (xmax - xmin > 20 ? 4 : 2)) {
    s << "<line x1=\"" << px(x) << "\" y1=\"" << top << "\" x2=\"" << px(x) << "\" y2=\"" << height - bottom
      << "\" stroke=\"#ddd\"/>\n";
    s << "<text x=\"" << px(x) << "\" y=\"" << height - bottom + 16 << "\" text-anchor=\"middle\">" << x << "</text>\n";
  }
  int const yticks = 6;
  for (int i = 0; i <= yticks; ++i) {
    double const y = ymin + (ymax - ymin) * i / yticks;
    s << "<line x1=\"" << left << "\" y1=\"" << py(y) << "\" x2=\"" << width - right << "\" y2=\"" << py(y)
      << "\" stroke=\"#eee\"/>\n";
    s << "<text x=\"" << left - 6 << "\" y=\"" << py(y) + 4 << "\" text-anchor=\"end\">"
      << (model ? excess_text(std::pow(10.0, y)) : sci(std::pow(10.0, y))) << "</text>\n";
  }
  s << "<text x=\"" << (left + width - right) / 2 << "\" y=\"" << height - 18
    << "\" text-anchor=\"middle\">bits per element (scales, residual and padding included)</text>\n";
  s << "<text x=\"18\" y=\"" << (top + height - bottom) / 2 << "\" text-anchor=\"middle\" transform=\"rotate(-90 18 "
    << (top + height - bottom) / 2 << ")\">"
    << (model ? "PPL / PPL(f32) - 1 (log scale; 0.001 % and below at the floor)"
              : "attention output relative error (log scale)")
    << "</text>\n";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    auto const& r = rows[i];
    double const x = px(r.bits_per_element), y = py(yval(r));
    s << "<circle cx=\"" << x << "\" cy=\"" << y << "\" r=\"4\" fill=\"#2a6fdb\"/>\n";
    double const dy = (i % 2 == 0) ? -6 : 12;
    s << "<text x=\"" << x + 6 << "\" y=\"" << y + dy << "\">" << xml_escape(r.label) << "</text>\n";
  }
  s << "</svg>\n";
  return s.str();
}

}  // namespace kvq_eval
