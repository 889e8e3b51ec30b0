// kvq benchmarks: the summariser behind bench/run.sh. It reads the Google Benchmark JSON of the
// codec, attention, multi-token attention and persist suites and turns it into encode/decode
// percentages of memcpy, attention times against this machine's roofline and the f16 cache,
// multi-token attention rates against memcpy and the f32 / int8 peaks, save/load percentages of
// memcpy, target checks, the --json document and bench/README.md. Everything here is a pure
// function of the benchmark JSON.
#pragma once

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <ostream>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvq_bench::summary {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;  // output documents keep their keys in schema order

/// Codec names (DESIGN §8, then the FP4 blocks of FORMATS.md §7 and the rotated codecs of §6) in
/// the order every table uses.
inline std::vector<std::string> const codec_names = {"f32",      "f16",   "q4_0",  "q8_0",  "int8",  "fp8_e4m3",
                                                     "fp8_e5m2", "kivi2", "kivi4", "kivi8", "mxfp4", "nvfp4",
                                                     "rot-q4_0", "tq4",   "tq3",   "tq2"};

/// The 4-bit-or-less codecs of FORMATS.md (the FP4 blocks of §7, the rotated codecs of §6): their
/// attention cells are also set against q4_0.
inline std::vector<std::string> const low_bit_codec_names = {"mxfp4", "nvfp4", "rot-q4_0", "tq4", "tq3", "tq2"};

/// The size whose encode/decode figures feed the JSON and the targets.
inline constexpr std::string_view target_size = "256MiB";

/// One benchmark's median repetition: real time per iteration and every numeric counter.
struct run {
  double seconds = 0;
  std::map<std::string, double> counters;

  /// The counter `key`, if the benchmark reported it.
  auto counter(std::string const& key) const -> std::optional<double> {
    auto const it = counters.find(key);
    return it == counters.end() ? std::nullopt : std::optional<double>(it->second);
  }
};

/// One suite's output: medians by benchmark name (without "/real_time") and its context.
struct suite {
  std::map<std::string, run> runs;
  json context = json::object();
};

/// Seconds per unit of a Google Benchmark time_unit ("ns", "us", "ms", "s").
inline auto unit_seconds(std::string const& unit) -> double {
  if (unit == "ns") return 1e-9;
  if (unit == "us") return 1e-6;
  if (unit == "ms") return 1e-3;
  return 1.0;
}

namespace detail {

inline auto median(std::vector<double> v) -> double {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  std::size_t const n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

inline auto strip_real_time(std::string name) -> std::string {
  constexpr std::string_view suffix = "/real_time";
  if (name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
    name.resize(name.size() - suffix.size());
  return name;
}

/// A benchmark entry's time and numeric counters (the fields Google Benchmark itself writes
/// are not counters).
inline auto parse_entry(json const& e) -> run {
  static std::set<std::string> const fixed = {"family_index", "per_family_instance_index",
                                              "repetitions",  "repetition_index",
                                              "threads",      "iterations",
                                              "real_time",    "cpu_time"};
  run r;
  r.seconds = e.value("real_time", 0.0) * unit_seconds(e.value("time_unit", std::string("ns")));
  for (auto const& [key, value] : e.items())
    if (value.is_number() && fixed.count(key) == 0) r.counters[key] = value.get<double>();
  return r;
}

}  // namespace detail

/// Parses Google Benchmark JSON, reading the bare NaN / Inf it writes for some statistics (the
/// coefficient of variation of a zero counter) as null.
inline auto parse_benchmark_json(std::string const& text) -> json {
  std::string clean;
  clean.reserve(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) {
    clean += text[i];
    if (text[i] != ':') continue;
    std::size_t j = i + 1;
    while (j < text.size() && (text[j] == ' ' || text[j] == '\t')) ++j;
    std::size_t k = j < text.size() && (text[j] == '-' || text[j] == '+') ? j + 1 : j;
    std::size_t end = k;
    while (end < text.size() && std::isalpha(static_cast<unsigned char>(text[end]))) ++end;
    std::string word = text.substr(k, end - k);
    for (auto& ch : word) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (word == "nan" || word == "inf" || word == "infinity") {
      clean += " null";
      i = end - 1;
    }
  }
  return json::parse(clean);
}

/// Reads one suite's JSON: the "median" aggregate of each benchmark when repetitions were run,
/// else the median of its plain runs; failed runs are skipped.
inline auto load_suite(json const& j) -> suite {
  suite s;
  if (j.contains("context") && j["context"].is_object()) s.context = j["context"];
  std::map<std::string, run> medians;
  std::map<std::string, std::vector<run>> plain;
  for (auto const& e : j.value("benchmarks", json::array())) {
    if (e.value("error_occurred", false)) continue;
    std::string const name = detail::strip_real_time(e.value("run_name", e.value("name", std::string())));
    if (e.value("run_type", std::string("iteration")) == "aggregate") {
      if (e.value("aggregate_name", std::string()) == "median") medians[name] = detail::parse_entry(e);
    } else {
      plain[name].push_back(detail::parse_entry(e));
    }
  }
  for (auto const& [name, runs] : plain) {
    if (medians.count(name) != 0) continue;
    run m;
    std::vector<double> times;
    std::map<std::string, std::vector<double>> counters;
    for (auto const& r : runs) {
      times.push_back(r.seconds);
      for (auto const& [k, v] : r.counters) counters[k].push_back(v);
    }
    m.seconds = detail::median(times);
    for (auto const& [k, v] : counters) m.counters[k] = detail::median(v);
    medians[name] = m;
  }
  s.runs = std::move(medians);
  return s;
}

/// The machine figures of the roofline, by thread count: read-only and memcpy bandwidth (bytes/s;
/// memcpy counts bytes read + written) and the f32 FMA and int8 dot-product peaks (multiply-adds/s).
struct machine {
  std::map<int, double> read_bytes_per_s;
  std::map<int, double> memcpy_bytes_per_s;
  std::map<int, double> fma_macs_per_s;
  std::map<int, double> int8_macs_per_s;
};

/// Reads machine/read, machine/memcpy, machine/fma and machine/int8dot (threads:N, measured more
/// than once when names differ after N, e.g. ".../again") from a suite, keeping the highest figure
/// of each: other load on the machine can only lower them.
inline auto machine_of(suite const& s) -> machine {
  machine m;
  auto const keep = [](std::map<int, double>& figures, int threads, std::optional<double> v) {
    if (v && *v > figures[threads]) figures[threads] = *v;
  };
  for (auto const& [name, r] : s.runs) {
    auto const at = name.find("/threads:");
    if (name.rfind("machine/", 0) != 0 || at == std::string::npos) continue;
    int const threads = std::atoi(name.c_str() + at + 9);
    std::string const what = name.substr(8, at - 8);
    if (threads <= 0) continue;
    if (what == "read") keep(m.read_bytes_per_s, threads, r.counter("bytes_per_second"));
    if (what == "memcpy") keep(m.memcpy_bytes_per_s, threads, r.counter("bytes_per_second"));
    if (what == "fma") keep(m.fma_macs_per_s, threads, r.counter("macs_per_second"));
    if (what == "int8dot") keep(m.int8_macs_per_s, threads, r.counter("macs_per_second"));
  }
  return m;
}

/// What one attention call reads and computes.
struct attention_work {
  double kv_bytes = 0;   ///< K and V bytes stored for the attended tokens
  double qk_macs = 0;    ///< multiply-adds of q·K
  double pv_macs = 0;    ///< multiply-adds of p·V
  bool qk_int8 = false;  ///< q·K as int8 dot products (else f32 FMAs)
  bool pv_int8 = false;  ///< p·V as int8 dot products (else f32 FMAs)
};

/// Roofline time of one call in seconds: max(bytes / read bandwidth, q·K ops / their peak + p·V
/// FMAs / the FMA peak); nullopt when a figure of the machine is missing or zero.
inline auto roofline_seconds(attention_work const& w, double read_bytes_per_s, double fma_macs_per_s,
                             double int8_macs_per_s) -> std::optional<double> {
  double const qk_peak = w.qk_int8 ? int8_macs_per_s : fma_macs_per_s;
  double const pv_peak = w.pv_int8 ? int8_macs_per_s : fma_macs_per_s;
  if (!(read_bytes_per_s > 0) || !(qk_peak > 0) || !(pv_peak > 0)) return std::nullopt;
  double const memory = w.kv_bytes / read_bytes_per_s;
  double const compute = w.qk_macs / qk_peak + w.pv_macs / pv_peak;
  return std::max(memory, compute);
}

/// A percentage clamped to [0, 100].
inline auto percent(double part, double whole) -> double {
  if (!(whole > 0) || !(part >= 0)) return 0.0;
  return std::clamp(100.0 * part / whole, 0.0, 100.0);
}

/// Encode/decode figures of one entry (a codec, or KIVI keys "kivi4.k" / values "kivi4.v") at one size.
struct codec_rate {
  std::string entry;
  std::string size;
  double bytes = 0;  ///< f32 bytes + encoded bytes per pass
  std::optional<double> encode_s, decode_s, memcpy_s, read_s;
};

/// The JSON figures of one codec: encode and decode at 256 MiB as % of memcpy over the same bytes.
struct codec_summary {
  std::string codec;
  std::optional<double> encode_pct, decode_pct;
};

/// One attention benchmark against its roofline and the f16 cache.
struct attention_row {
  std::string codec;              ///< DESIGN §8 name
  bool q8_query = false;          ///< run with query_precision::q8_0 ("<codec>+q8q")
  bool i8_probabilities = false;  ///< run with probability_precision::i8 ("<codec>[+q8q]+i8p")
  std::string shape;              ///< "gqa" or "mha"
  int context = 0;
  int threads = 0;
  double seconds = 0;  ///< median time per call
  attention_work work;
  std::optional<double> roofline_s;
  bool memory_bound = false;
  std::optional<double> speedup_vs_f16;
  std::optional<double> speedup_vs_q4_0;  ///< time of the q4_0 row (f32 query) of the same cell / time

  auto label() const -> std::string { return codec + (q8_query ? "+q8q" : "") + (i8_probabilities ? "+i8p" : ""); }
  /// True for a run with the default attention options.
  auto default_options() const -> bool { return !q8_query && !i8_probabilities; }
  auto pct_roofline() const -> std::optional<double> {
    if (!roofline_s) return std::nullopt;
    return percent(*roofline_s, seconds);
  }
};

/// One multi-token attention cell (kvq_bench_multi_query): n_q causal query tokens over the last
/// n_q of `context` tokens, against the machine figures of its thread count and the f16 cache.
struct multi_query_row {
  std::string codec;      ///< DESIGN §8 name
  bool q8_query = false;  ///< run with query_precision::q8_0 ("<codec>+q8q")
  std::string shape;      ///< "gqa" or "mha"
  int context = 0;
  int n_q = 0;
  int threads = 0;
  double seconds = 0;   ///< median time per call
  double kv_bytes = 0;  ///< K and V bytes of the attended range, read once
  double flops = 0;     ///< 4 · q_heads · head_dim · attended query-token × token pairs
  bool qk_int8 = false;
  std::optional<double> memcpy_bytes_per_s;  ///< machine figures at the row's thread count
  std::optional<double> fma_flops_per_s;     ///< f32 FMA peak, 2 FLOPs per multiply-add
  std::optional<double> int8_flops_per_s;    ///< int8 dot-product peak, 2 ops per multiply-add
  std::optional<double> speedup_vs_f16;      ///< f16 time / time, same shape, context, n_q and threads
  std::optional<double> time_vs_nq1;         ///< time / time of n_q = 1 of the same codec, shape, context, threads

  auto label() const -> std::string { return q8_query ? codec + "+q8q" : codec; }
  auto bytes_per_s() const -> double { return seconds > 0 ? kv_bytes / seconds : 0.0; }
  auto flops_per_s() const -> double { return seconds > 0 ? flops / seconds : 0.0; }
  /// K+V bytes per second as % of memcpy's bandwidth (clamped to [0, 100]).
  auto pct_memcpy() const -> std::optional<double> {
    if (!memcpy_bytes_per_s || !(seconds > 0)) return std::nullopt;
    return percent(bytes_per_s(), *memcpy_bytes_per_s);
  }
  /// FLOP/s as % of the f32 FMA peak (clamped to [0, 100]).
  auto pct_fma_peak() const -> std::optional<double> {
    if (!fma_flops_per_s || !(seconds > 0)) return std::nullopt;
    return percent(flops_per_s(), *fma_flops_per_s);
  }
  /// FLOP/s as % of the int8 dot-product peak, for the rows whose q·K runs as int8 dot products.
  auto pct_int8_peak() const -> std::optional<double> {
    if (!qk_int8 || !int8_flops_per_s || !(seconds > 0)) return std::nullopt;
    return percent(flops_per_s(), *int8_flops_per_s);
  }
};

/// Operations of the persist suite (persist/<codec>/<op>), in table order; memcpy is their reference.
inline std::vector<std::string> const persist_ops = {"save", "load_into", "replace", "load", "export", "import"};

/// The persist operations held to the target of ≥ 80 % of memcpy.
inline std::vector<std::string> const persist_target_ops = {"save", "load_into", "load"};

/// Save / load figures of one codec: each operation's median time and image bytes.
struct persist_rate {
  std::string codec;
  std::map<std::string, std::pair<double, double>> ops;  ///< op (memcpy included) -> (seconds, bytes)

  /// Image bytes per second of `op`, if it ran.
  auto bytes_per_s(std::string const& op) const -> std::optional<double> {
    auto const it = ops.find(op);
    if (it == ops.end() || !(it->second.first > 0)) return std::nullopt;
    return it->second.second / it->second.first;
  }
  /// GB/s of `op` as % of memcpy's over the same image (clamped to [0, 100]), if both ran.
  auto pct(std::string const& op) const -> std::optional<double> {
    auto const rate = bytes_per_s(op), copy = bytes_per_s("memcpy");
    if (!rate || !copy) return std::nullopt;
    return percent(*rate, *copy);
  }
  /// Image bytes (of memcpy, else of the first operation that ran).
  auto image_bytes() const -> double {
    auto const it = ops.find("memcpy");
    if (it != ops.end()) return it->second.second;
    return ops.empty() ? 0.0 : ops.begin()->second.second;
  }
};

/// Operations of the append suite (append/<codec>/<op>), in table order; memcpy/<codec>/<op> is the
/// reference of each (as many bytes in as many pieces).
inline std::vector<std::string> const append_ops = {"f32/prefill",       "f16/prefill",     "bf16/prefill",
                                                    "f32/decode",        "f16/decode",      "bf16/decode",
                                                    "f32/paged_prefill", "f32/paged_decode"};

/// Append figures of one codec: the median seconds of each operation and of its memcpy twin.
struct append_rate {
  std::string codec;
  std::map<std::string, double> append_s, memcpy_s;  ///< op -> seconds

  /// % of memcpy of `op` = memcpy time / append time over the same bytes (clamped to [0, 100]).
  auto pct(std::string const& op) const -> std::optional<double> {
    auto const a = append_s.find(op), m = memcpy_s.find(op);
    if (a == append_s.end() || m == memcpy_s.end() || !(a->second > 0) || !(m->second > 0)) return std::nullopt;
    return percent(m->second, a->second);
  }
};

/// The kinds of target (DESIGN §7 and the benchmark issue).
enum class target_kind {
  memcpy,      ///< encode / decode at 256 MiB ≥ 80 % of memcpy
  persist,     ///< save, load_into and load ≥ 80 % of memcpy over the same image
  append,      ///< QuantizedKVCache / PagedKVCache append ≥ 80 % of memcpy over the same bytes
  roofline,    ///< attention at 16k and 32k ≥ 70 % of the roofline
  not_slower,  ///< quantized codecs not slower than the f16 cache at any context
  mha16k,      ///< mha, 16k, 1 thread: a codec's minimum speed-up over f16
};

/// One target check.
struct target_result {
  target_kind kind = target_kind::memcpy;
  std::string subject;      ///< e.g. "encode q4_0 256 MiB", "attention q4_0 mha 16384 1t"
  std::string requirement;  ///< e.g. "≥ 3× f16"
  std::string measured;     ///< e.g. "2.41×"
  bool met = false;

  auto what() const -> std::string { return subject + ": " + requirement; }
};

/// Everything the outputs print.
struct summary {
  machine mach;
  json codecs_context = json::object();
  json attention_context = json::object();
  json persist_context = json::object();
  json multi_query_context = json::object();
  json append_context = json::object();
  machine multi_query_mach;  ///< the multi-token suite's own figures (its rows are rated against these)
  std::vector<codec_rate> rates;
  std::vector<codec_summary> codecs;
  std::vector<attention_row> attention;
  std::vector<persist_rate> persist;
  std::vector<multi_query_row> multi_query;
  std::vector<append_rate> append;
  std::vector<target_result> targets;
};

namespace detail {

/// The context that names the machine: the attention suite's, else the codec suite's, else the
/// multi-token suite's, else the persist suite's, else the append suite's.
inline auto machine_context(summary const& s) -> json const& {
  if (!s.attention_context.empty()) return s.attention_context;
  if (!s.codecs_context.empty()) return s.codecs_context;
  if (!s.multi_query_context.empty()) return s.multi_query_context;
  return s.persist_context.empty() ? s.append_context : s.persist_context;
}

inline auto format(char const* spec, double x) -> std::string {
  char buf[64];
  std::snprintf(buf, sizeof buf, spec, x);
  return buf;
}

/// "q4_0" for "q4_0", "kivi4" for "kivi4.k".
inline auto codec_of_entry(std::string const& entry) -> std::string { return entry.substr(0, entry.find('.')); }

inline auto codec_rank(std::string const& codec) -> std::size_t {
  auto const it = std::find(codec_names.begin(), codec_names.end(), codec);
  return static_cast<std::size_t>(it - codec_names.begin());
}

/// Parses "attention/<codec>[+q8q][+i8p]/<shape>/ctx:<n>/threads:<t>".
inline auto parse_attention_name(std::string const& name, attention_row& row) -> bool {
  std::vector<std::string> parts;
  std::stringstream in(name);
  for (std::string p; std::getline(in, p, '/');) parts.push_back(p);
  if (parts.size() != 5 || parts[0] != "attention" || parts[3].rfind("ctx:", 0) != 0 ||
      parts[4].rfind("threads:", 0) != 0)
    return false;
  row.codec = parts[1];
  if (row.codec.size() > 4 && row.codec.compare(row.codec.size() - 4, 4, "+i8p") == 0) {
    row.i8_probabilities = true;
    row.codec.resize(row.codec.size() - 4);
  }
  if (row.codec.size() > 4 && row.codec.compare(row.codec.size() - 4, 4, "+q8q") == 0) {
    row.q8_query = true;
    row.codec.resize(row.codec.size() - 4);
  }
  row.shape = parts[2];
  row.context = std::stoi(parts[3].substr(4));
  row.threads = std::stoi(parts[4].substr(8));
  return true;
}

/// Parses "multi_query/<codec>[+q8q]/<shape>/ctx:<n>/nq:<n>/threads:<t>", with or without the
/// "/iterations:<n>" Google Benchmark adds to a cell of fixed iterations.
inline auto parse_multi_query_name(std::string const& name, multi_query_row& row) -> bool {
  std::vector<std::string> parts;
  std::stringstream in(name);
  for (std::string p; std::getline(in, p, '/');)
    if (p.rfind("iterations:", 0) != 0) parts.push_back(p);
  if (parts.size() != 6 || parts[0] != "multi_query" || parts[3].rfind("ctx:", 0) != 0 ||
      parts[4].rfind("nq:", 0) != 0 || parts[5].rfind("threads:", 0) != 0)
    return false;
  row.codec = parts[1];
  if (row.codec.size() > 4 && row.codec.compare(row.codec.size() - 4, 4, "+q8q") == 0) {
    row.q8_query = true;
    row.codec.resize(row.codec.size() - 4);
  }
  row.shape = parts[2];
  row.context = std::stoi(parts[3].substr(4));
  row.n_q = std::stoi(parts[4].substr(3));
  row.threads = std::stoi(parts[5].substr(8));
  return true;
}

/// The figure of `threads` threads, if measured.
inline auto at_threads(std::map<int, double> const& m, int threads, double scale) -> std::optional<double> {
  auto const it = m.find(threads);
  if (it == m.end() || !(it->second > 0)) return std::nullopt;
  return it->second * scale;
}

/// The minimum speed-up over the f16 cache at mha, 16k, 1 thread, where one is set.
inline auto mha16k_speedup_target(std::string const& codec) -> std::optional<double> {
  if (codec == "kivi2") return 4.0;
  if (codec == "q4_0" || codec == "kivi4") return 3.0;
  if (codec == "q8_0" || codec == "int8" || codec == "fp8_e4m3" || codec == "fp8_e5m2") return 1.8;
  return std::nullopt;
}

}  // namespace detail

/// The targets one attention row is checked against, with their outcome.
inline auto attention_targets(attention_row const& r) -> std::vector<target_result> {
  std::vector<target_result> out;
  std::string const where = "attention " + r.label() + " " + r.shape + " " + std::to_string(r.context) + " " +
                            std::to_string(r.threads) + "t";
  if (r.context >= 16384) {
    auto const pct = r.pct_roofline();
    out.push_back({target_kind::roofline, where, "≥ 70 % of roofline", pct ? detail::format("%.1f %%", *pct) : "n/a",
                   pct && *pct >= 70.0});
  }
  bool const baseline = r.codec == "f16" || r.codec == "f32";
  if (!baseline && r.speedup_vs_f16) {
    out.push_back({target_kind::not_slower, where, "not slower than f16", detail::format("%.2f×", *r.speedup_vs_f16),
                   *r.speedup_vs_f16 >= 1.0});
  }
  if (r.shape == "mha" && r.context == 16384 && r.threads == 1) {
    if (auto const need = detail::mha16k_speedup_target(r.codec)) {
      double const got = r.speedup_vs_f16.value_or(0.0);
      out.push_back({target_kind::mha16k, where, "≥ " + detail::format("%g", *need) + "× f16",
                     r.speedup_vs_f16 ? detail::format("%.2f×", got) : "n/a", got >= *need});
    }
  }
  return out;
}

/// The multi-token attention rows of a kvq_bench_multi_query suite, rated against its own machine
/// figures, with speed-ups over f16 and times over n_q = 1, in codec order.
inline auto multi_query_rows(suite const& mq, machine const& m) -> std::vector<multi_query_row> {
  std::vector<multi_query_row> rows;
  for (auto const& [name, r] : mq.runs) {
    multi_query_row row;
    if (!detail::parse_multi_query_name(name, row)) continue;
    row.seconds = r.seconds;
    row.kv_bytes = r.counter("kv_bytes").value_or(0.0);
    row.flops = r.counter("flops").value_or(0.0);
    row.qk_int8 = r.counter("qk_int8").value_or(0.0) > 0.5;
    row.memcpy_bytes_per_s = detail::at_threads(m.memcpy_bytes_per_s, row.threads, 1.0);
    row.fma_flops_per_s = detail::at_threads(m.fma_macs_per_s, row.threads, 2.0);
    row.int8_flops_per_s = detail::at_threads(m.int8_macs_per_s, row.threads, 2.0);
    rows.push_back(row);
  }
  for (auto& row : rows) {
    for (auto const& other : rows) {
      bool const same_cell = other.shape == row.shape && other.context == row.context && other.threads == row.threads;
      if (!same_cell || !(row.seconds > 0) || !(other.seconds > 0)) continue;
      if (other.codec == "f16" && !other.q8_query && other.n_q == row.n_q)
        row.speedup_vs_f16 = other.seconds / row.seconds;
      if (other.label() == row.label() && other.n_q == 1) row.time_vs_nq1 = row.seconds / other.seconds;
    }
  }
  std::stable_sort(rows.begin(), rows.end(), [](multi_query_row const& x, multi_query_row const& y) {
    return std::make_tuple(detail::codec_rank(x.codec), x.q8_query, x.shape, x.context, x.n_q, x.threads) <
           std::make_tuple(detail::codec_rank(y.codec), y.q8_query, y.shape, y.context, y.n_q, y.threads);
  });
  return rows;
}

/// Summarises the suites (any may be empty).
inline auto summarise(suite const& codecs, suite const& attention, suite const& persist = {},
                      suite const& multi_query = {}, suite const& append = {}) -> summary {
  summary s;
  s.codecs_context = codecs.context;
  s.attention_context = attention.context;
  s.persist_context = persist.context;
  s.multi_query_context = multi_query.context;
  s.append_context = append.context;
  s.mach = machine_of(attention);
  s.multi_query_mach = machine_of(multi_query);
  s.multi_query = multi_query_rows(multi_query, s.multi_query_mach);

  // Encode/decode: one rate per (entry, size), in codec order, 256 MiB first.
  std::map<std::pair<std::string, std::string>, codec_rate> rates;
  for (auto const& [name, r] : codecs.runs) {
    auto const a = name.find('/'), b = name.rfind('/');
    if (a == std::string::npos || b == a) continue;
    std::string const op = name.substr(0, a), entry = name.substr(a + 1, b - a - 1), size = name.substr(b + 1);
    auto& rate = rates[{entry, size}];
    rate.entry = entry;
    rate.size = size;
    if (auto bytes = r.counter("bytes")) rate.bytes = *bytes;
    if (op == "encode") rate.encode_s = r.seconds;
    if (op == "decode") rate.decode_s = r.seconds;
    if (op == "memcpy") rate.memcpy_s = r.seconds;
    if (op == "read") rate.read_s = r.seconds;
  }
  for (auto& [key, rate] : rates) s.rates.push_back(rate);
  std::stable_sort(s.rates.begin(), s.rates.end(), [](codec_rate const& x, codec_rate const& y) {
    auto const rx = detail::codec_rank(detail::codec_of_entry(x.entry)),
               ry = detail::codec_rank(detail::codec_of_entry(y.entry));
    if (rx != ry) return rx < ry;
    if (x.size != y.size) return x.size == target_size;
    return x.entry < y.entry;
  });

  // Attention rows, then speed-ups against the f16 row of the same shape, context and threads.
  for (auto const& [name, r] : attention.runs) {
    attention_row row;
    if (!detail::parse_attention_name(name, row)) continue;
    row.seconds = r.seconds;
    row.work.kv_bytes = r.counter("kv_bytes").value_or(0.0);
    row.work.qk_macs = r.counter("qk_macs").value_or(0.0);
    row.work.pv_macs = r.counter("pv_macs").value_or(0.0);
    row.work.qk_int8 = r.counter("qk_int8").value_or(0.0) > 0.5;
    row.work.pv_int8 = r.counter("pv_int8").value_or(0.0) > 0.5;
    auto const find = [](std::map<int, double> const& m, int t) { return m.count(t) ? m.at(t) : 0.0; };
    row.roofline_s =
        roofline_seconds(row.work, find(s.mach.read_bytes_per_s, row.threads), find(s.mach.fma_macs_per_s, row.threads),
                         find(s.mach.int8_macs_per_s, row.threads));
    if (row.roofline_s) {
      double const memory = row.work.kv_bytes / find(s.mach.read_bytes_per_s, row.threads);
      row.memory_bound = memory >= *row.roofline_s;
    }
    s.attention.push_back(row);
  }
  for (auto& row : s.attention) {
    for (auto const& other : s.attention) {
      bool const same_cell = other.default_options() && other.shape == row.shape && other.context == row.context &&
                             other.threads == row.threads && row.seconds > 0;
      if (same_cell && other.codec == "f16") row.speedup_vs_f16 = other.seconds / row.seconds;
      if (same_cell && other.codec == "q4_0") row.speedup_vs_q4_0 = other.seconds / row.seconds;
    }
  }
  std::stable_sort(s.attention.begin(), s.attention.end(), [](attention_row const& x, attention_row const& y) {
    auto const kx =
        std::make_tuple(detail::codec_rank(x.codec), x.i8_probabilities, x.q8_query, x.shape, x.context, x.threads);
    auto const ky =
        std::make_tuple(detail::codec_rank(y.codec), y.i8_probabilities, y.q8_query, y.shape, y.context, y.threads);
    return kx < ky;
  });

  // Per codec: encode/decode % of memcpy at 256 MiB (KIVI: keys and values together, as the time
  // memcpy needs for both byte counts over the time the codec needs for both).
  for (auto const& codec : codec_names) {
    codec_summary c;
    c.codec = codec;
    double enc = 0, dec = 0, copy = 0;
    bool complete_enc = true, complete_dec = true, any = false;
    for (auto const& rate : s.rates) {
      if (detail::codec_of_entry(rate.entry) != codec || rate.size != target_size) continue;
      any = true;
      complete_enc = complete_enc && rate.encode_s && rate.memcpy_s;
      complete_dec = complete_dec && rate.decode_s && rate.memcpy_s;
      enc += rate.encode_s.value_or(0.0);
      dec += rate.decode_s.value_or(0.0);
      copy += rate.memcpy_s.value_or(0.0);
    }
    if (any && complete_enc) c.encode_pct = percent(copy, enc);
    if (any && complete_dec) c.decode_pct = percent(copy, dec);
    bool const has_attention =
        std::any_of(s.attention.begin(), s.attention.end(), [&](attention_row const& r) { return r.codec == codec; });
    if (any || has_attention) s.codecs.push_back(c);
  }

  // Targets.
  for (auto const& c : s.codecs) {
    for (auto const& [op, pct] : {std::pair{"encode", c.encode_pct}, std::pair{"decode", c.decode_pct}}) {
      if (!pct) continue;
      s.targets.push_back({target_kind::memcpy, std::string(op) + " " + c.codec + " 256 MiB", "≥ 80 % of memcpy",
                           detail::format("%.1f %%", *pct), *pct >= 80.0});
    }
  }
  for (auto const& row : s.attention)
    for (auto& t : attention_targets(row)) s.targets.push_back(std::move(t));

  // Save / load: persist/<codec>/<op>, one rate per codec in codec order.
  std::map<std::string, persist_rate> persisted;
  for (auto const& [name, r] : persist.runs) {
    auto const a = name.find('/'), b = name.rfind('/');
    if (a == std::string::npos || b == a || name.substr(0, a) != "persist") continue;
    std::string const codec = name.substr(a + 1, b - a - 1), op = name.substr(b + 1);
    auto& rate = persisted[codec];
    rate.codec = codec;
    rate.ops[op] = {r.seconds, r.counter("bytes").value_or(0.0)};
  }
  for (auto& [codec, rate] : persisted) s.persist.push_back(rate);
  std::stable_sort(s.persist.begin(), s.persist.end(), [](persist_rate const& x, persist_rate const& y) {
    return detail::codec_rank(x.codec) < detail::codec_rank(y.codec);
  });
  for (auto const& rate : s.persist)
    for (auto const& op : persist_target_ops)
      if (auto const pct = rate.pct(op))
        s.targets.push_back({target_kind::persist, op + " " + rate.codec, "≥ 80 % of memcpy",
                             detail::format("%.1f %%", *pct), *pct >= 80.0});

  // Append: append/<codec>/<input>/<mode> against memcpy/<codec>/<input>/<mode>, codecs in codec order.
  std::map<std::string, append_rate> appended;
  for (auto const& [name, r] : append.runs) {
    auto const a = name.find('/');
    auto const b = a == std::string::npos ? a : name.find('/', a + 1);
    if (b == std::string::npos) continue;
    std::string const kind = name.substr(0, a), codec = name.substr(a + 1, b - a - 1), op = name.substr(b + 1);
    if (kind != "append" && kind != "memcpy") continue;
    auto& rate = appended[codec];
    rate.codec = codec;
    (kind == "append" ? rate.append_s : rate.memcpy_s)[op] = r.seconds;
  }
  for (auto& [codec, rate] : appended) s.append.push_back(rate);
  std::stable_sort(s.append.begin(), s.append.end(), [](append_rate const& x, append_rate const& y) {
    return detail::codec_rank(x.codec) < detail::codec_rank(y.codec);
  });
  for (auto const& rate : s.append)
    for (auto const& op : append_ops)
      if (auto const pct = rate.pct(op))
        s.targets.push_back({target_kind::append, "append " + op + " " + rate.codec, "≥ 80 % of memcpy",
                             detail::format("%.1f %%", *pct), *pct >= 80.0});
  return s;
}

namespace detail {

/// The JSON key of an append op: "f32/prefill" -> "f32_prefill_pct_memcpy".
inline auto append_key(std::string op) -> std::string {
  std::replace(op.begin(), op.end(), '/', '_');
  return op + "_pct_memcpy";
}

/// x rounded to `digits` significant digits (compact JSON numbers).
inline auto round_sig(double x, int digits) -> double {
  if (x == 0 || !std::isfinite(x)) return x;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*g", digits, x);
  return std::strtod(buf, nullptr);
}

inline auto optional_number(std::optional<double> x, int digits) -> ordered_json {
  return x ? ordered_json(round_sig(*x, digits)) : ordered_json(nullptr);
}

inline auto attention_json(attention_row const& r) -> ordered_json {
  return {{"shape", r.shape},
          {"context", r.context},
          {"threads", r.threads},
          {"time_ms", round_sig(r.seconds * 1e3, 5)},
          {"roofline_ms", optional_number(r.roofline_s ? std::optional(*r.roofline_s * 1e3) : std::nullopt, 5)},
          {"pct_roofline", optional_number(r.pct_roofline(), 4)},
          {"speedup_vs_f16", optional_number(r.speedup_vs_f16, 4)}};
}

inline auto per_threads(std::map<int, double> const& m, double scale) -> ordered_json {
  ordered_json out = ordered_json::object();
  for (auto const& [t, v] : m) out[std::to_string(t)] = round_sig(v * scale, 4);
  return out;
}

inline auto multi_query_json(multi_query_row const& r) -> ordered_json {
  return {{"codec", r.codec},
          {"q8_query", r.q8_query},
          {"shape", r.shape},
          {"context", r.context},
          {"n_q", r.n_q},
          {"threads", r.threads},
          {"time_ms", round_sig(r.seconds * 1e3, 5)},
          {"gb_per_s", round_sig(r.bytes_per_s() * 1e-9, 4)},
          {"pct_memcpy", optional_number(r.pct_memcpy(), 4)},
          {"gflop_per_s", round_sig(r.flops_per_s() * 1e-9, 4)},
          {"pct_fma_peak", optional_number(r.pct_fma_peak(), 4)},
          {"pct_int8_peak", optional_number(r.pct_int8_peak(), 4)},
          {"speedup_vs_f16", optional_number(r.speedup_vs_f16, 4)},
          {"time_vs_nq1", optional_number(r.time_vs_nq1, 4)}};
}

}  // namespace detail

/// The --json document: {"codecs": [{"codec", "encode_pct_memcpy", "decode_pct_memcpy",
/// "attention": [{"shape", "context", "threads", "time_ms", "roofline_ms", "pct_roofline",
/// "speedup_vs_f16"}]}]}, plus "attention_q8_query", "attention_i8_probabilities" and
/// "attention_q8_query_i8_probabilities" (the +q8q, +i8p and +q8q+i8p runs, same layout), "persist"
/// ([{"codec", "image_bytes", "<op>_pct_memcpy" for each persist op}]), "multi_query" ([{"codec",
/// "q8_query", "shape", "context", "n_q", "threads", "time_ms", "gb_per_s", "pct_memcpy",
/// "gflop_per_s", "pct_fma_peak", "pct_int8_peak", "speedup_vs_f16", "time_vs_nq1"}]),
/// "multi_query_machine" (that suite's own bandwidths and peaks), "append" ([{"codec",
/// "<input>_<mode>_pct_memcpy" for each append op}]), "machine" and "targets" at top level.
inline auto to_json(summary const& s) -> ordered_json {
  ordered_json codecs = ordered_json::array(), q8 = ordered_json::array(), i8 = ordered_json::array(),
               q8_i8 = ordered_json::array();
  for (auto const& c : s.codecs) {
    ordered_json rows = ordered_json::array(), q8_rows = ordered_json::array(), i8_rows = ordered_json::array(),
                 q8_i8_rows = ordered_json::array();
    for (auto const& r : s.attention) {
      if (r.codec != c.codec) continue;
      (r.i8_probabilities ? (r.q8_query ? q8_i8_rows : i8_rows) : (r.q8_query ? q8_rows : rows))
          .push_back(detail::attention_json(r));
    }
    if (!i8_rows.empty()) i8.push_back({{"codec", c.codec}, {"attention", i8_rows}});
    if (!q8_i8_rows.empty()) q8_i8.push_back({{"codec", c.codec}, {"attention", q8_i8_rows}});
    codecs.push_back({{"codec", c.codec},
                      {"encode_pct_memcpy", detail::optional_number(c.encode_pct, 4)},
                      {"decode_pct_memcpy", detail::optional_number(c.decode_pct, 4)},
                      {"attention", rows}});
    if (!q8_rows.empty()) q8.push_back({{"codec", c.codec}, {"attention", q8_rows}});
  }
  ordered_json failed = ordered_json::array();
  std::size_t met = 0;
  for (auto const& t : s.targets) {
    if (t.met) {
      ++met;
    } else {
      failed.push_back(t.what() + " (measured " + t.measured + ")");
    }
  }
  ordered_json persist = ordered_json::array();
  for (auto const& rate : s.persist) {
    ordered_json row = {{"codec", rate.codec}, {"image_bytes", rate.image_bytes()}};
    for (auto const& op : persist_ops) row[op + "_pct_memcpy"] = detail::optional_number(rate.pct(op), 4);
    persist.push_back(row);
  }
  ordered_json multi_query = ordered_json::array();
  for (auto const& r : s.multi_query) multi_query.push_back(detail::multi_query_json(r));
  ordered_json append = ordered_json::array();
  for (auto const& rate : s.append) {
    ordered_json row = {{"codec", rate.codec}};
    for (auto const& op : append_ops) row[detail::append_key(op)] = detail::optional_number(rate.pct(op), 4);
    append.push_back(row);
  }
  ordered_json const mq_mach = {{"read_gb_per_s", detail::per_threads(s.multi_query_mach.read_bytes_per_s, 1e-9)},
                                {"memcpy_gb_per_s", detail::per_threads(s.multi_query_mach.memcpy_bytes_per_s, 1e-9)},
                                {"fma_gmacs_per_s", detail::per_threads(s.multi_query_mach.fma_macs_per_s, 1e-9)},
                                {"int8_gmacs_per_s", detail::per_threads(s.multi_query_mach.int8_macs_per_s, 1e-9)}};
  json const& ctx = detail::machine_context(s);
  ordered_json mach = {{"cpu_model", ctx.value("cpu_model", std::string("unknown"))},
                       {"cpu_flags", ctx.value("cpu_flags", std::string("unknown"))},
                       {"num_cpus", ctx.value("num_cpus", 0)},
                       {"llc_bytes", ctx.value("llc_bytes", std::string())},
                       {"compiler", ctx.value("compiler", std::string())},
                       {"kvq_simd_level", ctx.value("kvq_simd_level", std::string())},
                       {"date", ctx.value("date", std::string())},
                       {"read_gb_per_s", detail::per_threads(s.mach.read_bytes_per_s, 1e-9)},
                       {"fma_gmacs_per_s", detail::per_threads(s.mach.fma_macs_per_s, 1e-9)},
                       {"int8_gmacs_per_s", detail::per_threads(s.mach.int8_macs_per_s, 1e-9)}};
  return {{"codecs", codecs},
          {"attention_q8_query", q8},
          {"attention_i8_probabilities", i8},
          {"attention_q8_query_i8_probabilities", q8_i8},
          {"persist", persist},
          {"multi_query", multi_query},
          {"multi_query_machine", mq_mach},
          {"append", append},
          {"machine", mach},
          {"targets", {{"met", met}, {"total", s.targets.size()}, {"missed", failed}}}};
}

namespace detail {

/// Bytes per second as GB/s text, "—" when absent.
inline auto rate_text(std::optional<double> bytes_per_s) -> std::string {
  return bytes_per_s ? format("%.1f", *bytes_per_s / 1e9) : "—";
}

/// A percentage as text, "—" when absent.
inline auto pct_or_dash(std::optional<double> pct) -> std::string { return pct ? format("%.1f", *pct) : "—"; }

/// "<cache>; <cpu>, last-level cache <n> bytes, <date>": what the persist rows measured, from their context.
inline auto persist_line(summary const& s) -> std::string {
  json const& c = s.persist_context;
  return c.value("persist_cache", std::string("cache of unknown shape")) + "; " +
         c.value("cpu_model", std::string("unknown CPU")) + ", last-level cache " +
         c.value("llc_bytes", std::string("?")) + " bytes, " + c.value("date", std::string("?"));
}

inline auto gbps(std::optional<double> seconds, double bytes) -> std::string {
  return seconds && *seconds > 0 ? format("%.1f", bytes / *seconds / 1e9) : "—";
}
inline auto pct_text(std::optional<double> part, std::optional<double> whole) -> std::string {
  return part && whole ? format("%.1f", percent(*part, *whole)) : "—";
}
inline auto ms_text(double seconds) -> std::string {
  double const ms = seconds * 1e3;
  return format(ms < 1 ? "%.3f" : ms < 100 ? "%.2f" : "%.1f", ms);
}
inline auto check_text(std::vector<target_result> const& checks) -> std::string {
  if (checks.empty()) return "";
  std::string out;
  for (auto const& c : checks) {
    if (c.met) continue;
    out += out.empty() ? "✗ " : ", ";
    out += c.requirement;
  }
  return out.empty() ? "✓" : out;
}
/// "read 17.4 / 32.0 GB/s (1 / 2 threads); ..." for every figure of `mach` that was measured.
inline auto machine_line(machine const& mach) -> std::string {
  std::string line;
  auto const add = [&](char const* what, std::map<int, double> const& m, char const* unit) {
    if (m.empty()) return;
    line += line.empty() ? "" : "; ";
    line += what;
    for (auto const& [t, v] : m) line += " " + format("%.1f", v / 1e9) + (t == m.rbegin()->first ? "" : " /");
    line += std::string(" ") + unit + " (";
    for (auto const& [t, v] : m) line += std::to_string(t) + (t == m.rbegin()->first ? "" : " / ");
    line += m.size() == 1 && m.begin()->first == 1 ? " thread)" : " threads)";
  };
  add("read", mach.read_bytes_per_s, "GB/s");
  add("memcpy", mach.memcpy_bytes_per_s, "GB/s read + written");
  add("f32 FMA", mach.fma_macs_per_s, "GMAC/s");
  add("int8 dot", mach.int8_macs_per_s, "GMAC/s");
  return line;
}
inline auto machine_line(summary const& s) -> std::string { return machine_line(s.mach); }

/// "16k" for 16384, "512" for 512.
inline auto context_text(int context) -> std::string {
  return context >= 1024 && context % 1024 == 0 ? std::to_string(context / 1024) + "k" : std::to_string(context);
}

/// The attention cells of the FP4 and rotated codecs, one line per (shape, context, threads): "gqa
/// 4k, 1 thread: f16 2.13 ms, q4_0 1.38 ms, rot-q4_0 1.50 ms (1.42× f16, 0.92× q4_0), ...".
inline auto low_bit_lines(summary const& s) -> std::vector<std::string> {
  auto const low_bit = [](std::string const& codec) {
    return std::find(low_bit_codec_names.begin(), low_bit_codec_names.end(), codec) != low_bit_codec_names.end();
  };
  std::vector<std::string> lines;
  std::set<std::tuple<int, std::string, int, int>> cells;  // shape rank (gqa first), shape, context, threads
  for (auto const& r : s.attention)
    if (low_bit(r.codec) && r.default_options())
      cells.insert({r.shape == "gqa" ? 0 : 1, r.shape, r.context, r.threads});
  for (auto const& [rank, shape, context, t] : cells) {
    std::string line =
        shape + " " + context_text(context) + ", " + std::to_string(t) + (t == 1 ? " thread:" : " threads:");
    for (auto const& r : s.attention) {
      if (!r.default_options() || r.shape != shape || r.context != context || r.threads != t) continue;
      if (r.codec != "f16" && r.codec != "q4_0" && !low_bit(r.codec)) continue;
      line += " " + r.label() + " " + ms_text(r.seconds) + " ms";
      if (low_bit(r.codec))
        line += " (" + (r.speedup_vs_f16 ? format("%.2f×", *r.speedup_vs_f16) : std::string("—")) + " f16, " +
                (r.speedup_vs_q4_0 ? format("%.2f×", *r.speedup_vs_q4_0) : std::string("—")) + " q4_0)";
      line += ",";
    }
    line.pop_back();
    lines.push_back(line);
  }
  return lines;
}

/// The multi-token figures the issue's targets read, one line each: the n_q = 8 time over the
/// n_q = 1 time at gqa 16k per codec (per thread count), and n_q = 512 GFLOP/s as % of the f32
/// peak per codec (per shape, context and thread count; the int8 peak too for +q8q rows).
inline auto multi_query_lines(summary const& s) -> std::vector<std::string> {
  std::vector<std::string> lines;
  auto const threads_text = [](int t) { return std::to_string(t) + (t == 1 ? " thread" : " threads"); };
  std::set<int> threads;
  for (auto const& r : s.multi_query)
    if (r.shape == "gqa" && r.context == 16384 && r.n_q == 8 && r.time_vs_nq1) threads.insert(r.threads);
  for (int t : threads) {
    std::string line = "n_q 8 time / n_q 1 time, gqa 16k, " + threads_text(t) + ":";
    for (auto const& r : s.multi_query)
      if (r.shape == "gqa" && r.context == 16384 && r.n_q == 8 && r.threads == t && r.time_vs_nq1)
        line += " " + r.label() + " " + format("%.2f×", *r.time_vs_nq1) + ",";
    line.pop_back();
    lines.push_back(line);
  }
  std::set<std::tuple<std::string, int, int>> cells;
  for (auto const& r : s.multi_query)
    if (r.n_q == 512 && r.pct_fma_peak()) cells.insert({r.shape, r.context, r.threads});
  for (auto const& [shape, context, t] : cells) {
    std::string line =
        "n_q 512 GFLOP/s as % of the f32 peak, " + shape + " " + context_text(context) + ", " + threads_text(t) + ":";
    for (auto const& r : s.multi_query) {
      if (r.n_q != 512 || r.shape != shape || r.context != context || r.threads != t || !r.pct_fma_peak()) continue;
      line += " " + r.label() + " " + format("%.1f %%", *r.pct_fma_peak());
      if (auto const int8 = r.pct_int8_peak()) line += " (int8 peak " + format("%.1f %%", *int8) + ")";
      line += ",";
    }
    line.pop_back();
    lines.push_back(line);
  }
  return lines;
}

/// "memcpy 21.3 GB/s, read-only pass 19.8 GB/s" at one size: medians over the codecs' runs, bytes
/// read + written (memcpy) or read (pass); empty when the codec suite did not run at that size.
inline auto memcpy_line(summary const& s, std::string_view size) -> std::string {
  std::vector<double> copy, read;
  for (auto const& r : s.rates) {
    if (r.size != size || !(r.bytes > 0)) continue;
    if (r.memcpy_s && *r.memcpy_s > 0) copy.push_back(r.bytes / *r.memcpy_s);
    if (r.read_s && *r.read_s > 0) read.push_back(r.bytes / *r.read_s);
  }
  if (copy.empty() || read.empty()) return "";
  return "memcpy " + format("%.1f", median(copy) / 1e9) + " GB/s, read-only pass " +
         format("%.1f", median(read) / 1e9) + " GB/s";
}

/// The target checks grouped by kind: how many were met, the misses of encode/decode and every
/// mha-16k speed-up (the table rows mark the other misses). Lines start with `bullet`.
inline void print_targets(summary const& s, std::ostream& os, std::string const& bullet) {
  std::size_t met = 0;
  for (auto const& t : s.targets) met += t.met ? 1 : 0;
  os << "Targets: " << met << " of " << s.targets.size() << " checks met.\n";
  struct group {
    target_kind kind;
    char const* title;
    bool list_met;   // list every check, met or not
    bool list_miss;  // list the missed checks
  };
  constexpr group groups[] = {
      {target_kind::memcpy, "encode/decode at 256 MiB ≥ 80 % of memcpy", false, true},
      {target_kind::persist, "save / load_into / load ≥ 80 % of memcpy", false, true},
      {target_kind::append, "append ≥ 80 % of memcpy (✗ in the append rows)", false, false},
      {target_kind::roofline, "attention at 16k and 32k ≥ 70 % of the roofline (✗ in the attention rows)", false,
       false},
      {target_kind::not_slower, "quantized codecs not slower than f16, every context (✗ in the attention rows)", false,
       false},
      {target_kind::mha16k, "mha, 16k, 1 thread: speed-up over f16", true, true},
  };
  if (!s.targets.empty() && bullet == "- ") os << "\n";
  for (auto const& g : groups) {
    std::size_t n = 0, ok = 0;
    std::string list;
    for (auto const& t : s.targets) {
      if (t.kind != g.kind) continue;
      ++n;
      ok += t.met ? 1 : 0;
      if ((t.met && g.list_met) || (!t.met && g.list_miss)) {
        list += list.empty() ? "" : ", ";
        std::string subject = t.subject;
        if (g.kind == target_kind::mha16k) subject = subject.substr(10, subject.find(' ', 10) - 10);  // the codec
        list += subject + " " + t.measured + " (" + t.requirement + ") " + (t.met ? "✓" : "✗");
      }
    }
    if (n == 0) continue;
    os << bullet << g.title << ": " << ok << " of " << n << " met" << (list.empty() ? "" : "; " + list) << "\n";
  }
}

/// A plain-text table: columns padded to their widest cell (UTF-8 aware), numbers right-aligned.
class text_table {
 public:
  explicit text_table(std::vector<std::string> header) : rows_{std::move(header)} {}
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void print(std::ostream& os, std::size_t left_columns) const {
    std::vector<std::size_t> width;
    for (auto const& r : rows_)
      for (std::size_t i = 0; i < r.size(); ++i) {
        if (width.size() <= i) width.push_back(0);
        width[i] = std::max(width[i], display_width(r[i]));
      }
    for (auto const& r : rows_) {
      std::string line;
      for (std::size_t i = 0; i < r.size(); ++i) {
        std::string const pad(width[i] - display_width(r[i]), ' ');
        line += i == 0 ? "" : "  ";
        line += i < left_columns || i + 1 == r.size() ? r[i] + pad : pad + r[i];
      }
      while (!line.empty() && line.back() == ' ') line.pop_back();
      os << line << '\n';
    }
  }

 private:
  static auto display_width(std::string const& s) -> std::size_t {
    std::size_t n = 0;
    for (char ch : s) n += (static_cast<unsigned char>(ch) & 0xc0) != 0x80 ? 1 : 0;  // count UTF-8 lead bytes
    return n;
  }
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace detail

/// The text summary bench/run.sh prints.
inline void print_text(summary const& s, std::ostream& os) {
  json const& ctx = detail::machine_context(s);
  os << "kvq CPU benchmarks: " << ctx.value("cpu_model", std::string("unknown CPU")) << ", " << ctx.value("num_cpus", 0)
     << " CPUs, kvq " << ctx.value("kvq_simd_level", std::string("?")) << ", "
     << ctx.value("compiler", std::string("?")) << ", " << ctx.value("date", std::string()) << "\n";
  if (!s.mach.read_bytes_per_s.empty()) os << "machine: " << detail::machine_line(s) << "\n";
  if (auto const line = detail::memcpy_line(s, target_size); !line.empty())
    os << "memory at 256 MiB, 1 thread: " << line << "\n";

  if (!s.rates.empty()) {
    os << "\nEncode / decode (single thread): GB/s of bytes read + written; % = memcpy time / codec time over "
          "the same bytes\n";
    detail::text_table t({"codec", "size", "encode", "decode", "memcpy", "read", "enc %", "dec %", "target"});
    for (auto const& r : s.rates) {
      std::string check;
      if (r.size == target_size && r.encode_s && r.decode_s && r.memcpy_s) {
        bool const ok = percent(*r.memcpy_s, *r.encode_s) >= 80 && percent(*r.memcpy_s, *r.decode_s) >= 80;
        check = ok ? "✓" : "✗ ≥ 80 %";
      }
      t.add({r.entry, r.size, detail::gbps(r.encode_s, r.bytes), detail::gbps(r.decode_s, r.bytes),
             detail::gbps(r.memcpy_s, r.bytes), detail::gbps(r.read_s, r.bytes),
             detail::pct_text(r.memcpy_s, r.encode_s), detail::pct_text(r.memcpy_s, r.decode_s), check});
    }
    t.print(os, 2);
  }

  if (!s.attention.empty()) {
    os << "\nDecode attention (median time per call; roofline = max(K+V bytes / read bandwidth, ops / peak); "
          "× f16 = f16 time / time)\n";
    detail::text_table t(
        {"codec", "shape", "context", "threads", "time ms", "roofline ms", "bound", "% roofline", "× f16", "target"});
    for (auto const& r : s.attention) {
      auto const pct = r.pct_roofline();
      t.add({r.label(), r.shape, std::to_string(r.context), std::to_string(r.threads), detail::ms_text(r.seconds),
             r.roofline_s ? detail::ms_text(*r.roofline_s) : "—",
             r.roofline_s ? (r.memory_bound ? "memory" : "compute") : "—", pct ? detail::format("%.1f", *pct) : "—",
             r.speedup_vs_f16 ? detail::format("%.2f", *r.speedup_vs_f16) : "—",
             detail::check_text(attention_targets(r))});
    }
    t.print(os, 3);
    auto const low_bit = detail::low_bit_lines(s);
    if (!low_bit.empty()) os << "FP4 and rotated codecs against f16 and q4_0 (× = their time / time):\n";
    for (auto const& line : low_bit) os << "  " << line << "\n";
  }

  if (!s.multi_query.empty()) {
    os << "\nMulti-token attention (kvq::attention, n_q causal queries over the last n_q tokens; median time per "
          "call; GB/s = K+V bytes read once / time, % of memcpy; GFLOP/s = 4 · q_heads · head_dim · attended pairs / "
          "time, % of the f32 FMA peak (int8 peak for +q8q); × f16 = f16 time / time; / n_q 1 = time / n_q = 1 "
          "time)\n";
    if (auto const line = detail::machine_line(s.multi_query_mach); !line.empty()) os << "machine: " << line << "\n";
    detail::text_table t({"codec", "shape", "context", "n_q", "threads", "time ms", "GB/s", "% memcpy", "GFLOP/s",
                          "% f32 peak", "% int8 peak", "× f16", "/ n_q 1"});
    for (auto const& r : s.multi_query) {
      t.add({r.label(), r.shape, std::to_string(r.context), std::to_string(r.n_q), std::to_string(r.threads),
             detail::ms_text(r.seconds), detail::format("%.2f", r.bytes_per_s() / 1e9),
             detail::pct_or_dash(r.pct_memcpy()), detail::format("%.1f", r.flops_per_s() / 1e9),
             detail::pct_or_dash(r.pct_fma_peak()), detail::pct_or_dash(r.pct_int8_peak()),
             r.speedup_vs_f16 ? detail::format("%.2f", *r.speedup_vs_f16) : "—",
             r.time_vs_nq1 ? detail::format("%.2f", *r.time_vs_nq1) : "—"});
    }
    t.print(os, 2);
    for (auto const& line : detail::multi_query_lines(s)) os << line << "\n";
  }

  if (!s.persist.empty()) {
    os << "\nSave / load (single thread, in memory; " << detail::persist_line(s)
       << "): GB/s of image bytes; % = GB/s / memcpy GB/s over the same bytes\n";
    std::vector<std::string> head = {"codec", "image MiB"};
    for (auto const& op : persist_ops) head.push_back(op);
    head.push_back("memcpy");
    for (auto const& op : persist_ops) head.push_back(op + " %");
    head.push_back("target");
    detail::text_table t(head);
    for (auto const& r : s.persist) {
      std::vector<std::string> row = {r.codec, detail::format("%.1f", r.image_bytes() / 1048576.0)};
      for (auto const& op : persist_ops) row.push_back(detail::rate_text(r.bytes_per_s(op)));
      row.push_back(detail::rate_text(r.bytes_per_s("memcpy")));
      for (auto const& op : persist_ops) row.push_back(detail::pct_or_dash(r.pct(op)));
      std::string check;
      bool any = false, ok = true;
      for (auto const& op : persist_target_ops)
        if (auto const pct = r.pct(op)) any = true, ok = ok && *pct >= 80.0;
      if (any) check = ok ? "✓" : "✗ ≥ 80 %";
      row.push_back(check);
      t.add(row);
    }
    t.print(os, 1);
  }

  if (!s.append.empty()) {
    os << "\nAppend (single thread; " << s.append_context.value("append_cache", std::string("cache of unknown shape"))
       << "): % of memcpy over the same bytes in the same pieces\n";
    std::vector<std::string> head = {"codec"};
    for (auto const& op : append_ops) head.push_back(op);
    head.push_back("target");
    detail::text_table t(head);
    for (auto const& r : s.append) {
      std::vector<std::string> row = {r.codec};
      bool any = false, ok = true;
      for (auto const& op : append_ops) {
        auto const pct = r.pct(op);
        row.push_back(detail::pct_or_dash(pct));
        if (pct) any = true, ok = ok && *pct >= 80.0;
      }
      row.push_back(any ? (ok ? "✓" : "✗ ≥ 80 %") : "");
      t.add(row);
    }
    t.print(os, 1);
  }

  os << "\n";
  detail::print_targets(s, os, "  ");
}

/// bench/README.md: what the suites measure, the machine, and the result tables.
inline void write_readme(summary const& s, std::ostream& os, double wall_seconds) {
  json const& ctx = detail::machine_context(s);
  auto const str = [&](char const* key) { return ctx.value(key, std::string("unknown")); };
  os << R"(# kvq benchmarks

<!-- Generated by bench/run.sh (kvq_bench_summary --readme). Edit bench/summary.hpp, not this file. -->

```sh
bash bench/run.sh [--json FILE]   # builds the suites (Release, -march=native), runs them, prints the summary
```

`run.sh` builds in `build/bench` (or `$KVQ_BUILD_DIR`), runs the five Google Benchmark suites with
real time, 3 repetitions and their medians (the multi-token suite once), prints the tables below
and rewrites this file; with `--json FILE` it also writes `{"codecs": [{"codec",
"encode_pct_memcpy", "decode_pct_memcpy", "attention": [{"shape", "context", "threads", "time_ms",
"roofline_ms", "pct_roofline", "speedup_vs_f16"}]}]}` (percentages 0–100; extra top-level keys:
`attention_q8_query`, `persist` (`[{"codec", "image_bytes", "save_pct_memcpy",
"load_into_pct_memcpy", "replace_pct_memcpy", "load_pct_memcpy", "export_pct_memcpy",
"import_pct_memcpy"}]`), `multi_query` (`[{"codec", "q8_query", "shape", "context", "n_q",
"threads", "time_ms", "gb_per_s", "pct_memcpy", "gflop_per_s", "pct_fma_peak", "pct_int8_peak",
"speedup_vs_f16", "time_vs_nq1"}]`), `multi_query_machine`, `append` (`[{"codec",
"f32_prefill_pct_memcpy", …, "f32_paged_decode_pct_memcpy"}]`), `machine`, `targets`). `--quick` is a
short check of the script (contexts up to 4k, one short repetition, a small working set; this file
is left alone).

## What is measured

**Encode / decode** (`kvq_bench_codecs`, one thread): `kvq::cpu_kernels::encode_rows` /
`decode_rows` (row codecs) and `encode_tile` / `decode_tile_tokens` (KIVI keys, G = 32) over rows
of head_dim 128 holding N(0, 1) values with four outlier channels, at 256 MiB of f32 (far beyond the
last-level cache) and 1 MiB (inside it). KIVI keys (`kivi4.k`) and values (`kivi4.v`) are measured
apart; the codec's figure combines them. The rotated codecs `rot-q4_0` and `tq4` / `tq3` / `tq2`
(FORMATS.md §6) run as the CPU cache runs them: chunks of 16 rows rotated by R in an L1 scratch,
then `encode_rows` of the stored codec (`kvq::stored_codec_t`: q4_0, the tq codebook); `decode_rows`
of the stored codec, then the inverse rotation. **Bytes** of one pass = f32 bytes + encoded bytes (an
encode reads the first and writes the second, a decode the reverse). In the same binary and next to
each codec: `memcpy` of half that many bytes (so it too reads and writes that many) and a read-only
pass over the f32 and encoded bytes. **% of memcpy** = memcpy time / codec time over the same
bytes, i.e. the ratio of their GB/s.

**Decode attention** (`kvq_bench_attention`): one query token through the public entries,
`kvq::decode_attention` (1 thread) and `kvq::decode_attention_parallel` (2 threads), for every
codec with the default options (f32 query) and, as extra rows, q8_0 / q4_0 / int8 with
`query_precision::q8_0` (integer q·K, `<codec>+q8q`), with `probability_precision::i8` (integer
p·V, `<codec>+i8p`) and with both (`<codec>+q8q+i8p`). Shapes gqa (32 query / 8 KV heads) and mha (32 / 32),
head_dim 128, contexts 512, 4k, 16k, 32k; KIVI at G = 32, R = 128. The FP4 codecs `mxfp4` and `nvfp4`
and the rotated codecs `rot-q4_0` and `tq4` / `tq3` / `tq2` run gqa at 4k only (1 and 2 threads), listed
against f16 and q4_0 there. Keys are N(0, 1)
with four outlier channels ×10, values N(0, 1). Each (codec, shape, context) fills enough layers
that the K and V bytes attended over all of them are at least twice the last-level cache, and
iteration i attends layer i mod L, so no result comes from cache. **× f16** = time of the f16 cache
/ time; **× q4_0** = time of the q4_0 cache / time.

**Roofline** of one call = max(K+V bytes / read bandwidth, q·K ops / their peak + p·V ops / the
f32 FMA peak), with every figure measured in the same run and thread count: K+V bytes = the bytes
stored for the attended tokens (codec bytes with their scales; KIVI's f16 residual rows as f16);
ops = q_heads × context × head_dim multiply-adds for q·K and as many for p·V; q·K counts against the
int8 dot-product peak for the `+q8q` rows and against the f32 FMA peak otherwise, p·V likewise
for the `+i8p` rows. The read
bandwidth is a read-only pass over a buffer of at least 8× the last-level cache; the peaks are
independent accumulator chains (f32 FMA; int8 dot product). Each is measured before and again
after the attention runs, and the higher figure is used (other load can only lower it).
**% roofline** = roofline / time, at most 100.

**Multi-token attention** (`kvq_bench_multi_query`): `kvq::attention` of n_q = 1, 4, 8, 16 and
512 query tokens with the default options (f32 query, causal mask over the last n_q tokens of the
layer, as for a prefill chunk or a speculative verification), threads 1 and 2, shapes gqa and mha,
contexts 4k and 16k, codecs f32 and f16 (the baselines), q4_0, q8_0, int8, fp8_e4m3, kivi2 and
kivi4; layers, data and working sets as for decode attention. The default run leaves out n_q = 512
at 16k except gqa on 1 thread; `kvq_bench_multi_query --kvq_full` runs the whole grid and adds
`<codec>+q8q` rows for q4_0, q8_0 and int8. **GB/s** = K+V bytes stored for the attended tokens
(read once; the causal rows over the last n_q tokens attend the whole layer) / time, as % of the
memcpy bandwidth (bytes read + written per second over a buffer of at least 4× the last-level
cache). **GFLOP/s** = 4 · q_heads · head_dim · Σ attended tokens (n_q · context − n_q (n_q − 1) / 2
query-token × token pairs; a multiply and an add for each of q·K and p·V) / time, as % of the f32
FMA peak (2 FLOPs per multiply-add) and, for `+q8q` rows, of the int8 dot-product peak. Both
bandwidths and peaks are measured by this suite, before and after its cells, the higher figure
used. **× f16** = time of the f16 cache at the same shape, context, n_q and threads / time;
**/ n_q 1** = time / time of n_q = 1.

**Save / load** (`kvq_bench_persist`, one thread, buffers in memory): the entries of
`<kvq/persist.hpp>` on a flat cache of 8 layers × 8 kv_heads × head_dim 128 × 8192 tokens (filled;
keys N(0, 1) with four outlier channels ×10, values N(0, 1); KIVI at G = 32, R = 128), whose image
is 70–140 MiB: `save` (`kvq::save` into a preallocated `span_writer` buffer), `load_into`
(`kvq::load_into` an existing cache from a `span_reader`: the whole image validated, checksums
included, before the cache changes), `load` (`kvq::load` of a new cache: its allocation, zeroing
and release included), and on a paged cache (pages of 64 tokens) `export` (`kvq::export_sequence`
of one 8192-token sequence into a preallocated buffer) and `import` (`kvq::import_sequence` of such
an export as a new sequence). In the same binary and next to them: `memcpy` of the image's bytes
(`kvq::saved_bytes`) from one buffer to another. Every row rotates over enough copies (caches,
images, buffers, sequences) that one cycle touches at least twice the last-level cache. **% of
memcpy** = GB/s of image bytes / memcpy's GB/s over the same bytes.

**Append** (`kvq_bench_append`, one thread): the write path engines call, `QuantizedKVCache::append`
of token-major keys and values (one layer, 8 kv_heads, head_dim 128; keys N(0, 1) with four
outlier channels ×10, values N(0, 1)) in f32, f16 and bf16: `prefill` appends 512-token chunks
until the layer holds 16384 tokens, `decode` appends one token at a time up to 4096 tokens;
`paged_prefill` / `paged_decode` do the same through `PagedKVCache::append` (pages of 64 tokens,
f32 input). Each pass starts from an emptied layer whose memory an untimed pass touched first (an
engine's steady state). **Bytes** = input bytes read + encoded bytes written. Next to each row:
`memcpy` of half that many bytes in as many pieces, from a source as large as the input to a
destination as large as the cache. **% of memcpy** = memcpy time / append time.

## Machine

| | |
|---|---|
)";
  os << "| CPU | " << str("cpu_model") << " |\n";
  os << "| instruction sets | " << ctx.value("cpu_flags", std::string("unknown")) << " |\n";
  os << "| CPUs | " << ctx.value("num_cpus", 0) << " at " << ctx.value("mhz_per_cpu", 0) << " MHz |\n";
  std::string caches;
  for (auto const& c : ctx.value("caches", json::array())) {
    caches += caches.empty() ? "" : ", ";
    caches += "L" + std::to_string(c.value("level", 0)) + " " + c.value("type", std::string()) + " " +
              std::to_string(c.value("size", 0) / 1024) + " KiB";
    if (c.value("num_sharing", 0) > 1) caches += " (shared by " + std::to_string(c.value("num_sharing", 0)) + ")";
  }
  os << "| caches | " << (caches.empty() ? "unknown" : caches) << " |\n";
  os << "| last-level cache used for the working sets | " << str("llc_bytes") << " bytes |\n";
  os << "| compiler | " << str("compiler") << " |\n";
  os << "| kvq::simd_level() | `" << str("kvq_simd_level") << "` |\n";
  os << "| peak loops | f32: " << str("fma_kind") << "; int8: " << str("int8_kind") << " |\n";
  os << "| measured | " << detail::machine_line(s) << " |\n";
  if (auto const line = detail::memcpy_line(s, target_size); !line.empty())
    os << "| 256 MiB, 1 thread (medians over the codec runs) | " << line << " |\n";
  os << "| date | " << str("date") << " |\n";
  if (wall_seconds > 0)
    os << "| run.sh wall time (benchmarks, build excluded) | " << detail::format("%.0f", wall_seconds) << " s |\n";

  if (!s.rates.empty()) {
    os << "\n## Encode / decode\n\nGB/s of bytes read + written, one thread; % of memcpy over the same bytes.\n\n"
          "| codec | size | encode GB/s | decode GB/s | memcpy GB/s | read GB/s | encode % | decode % |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|\n";
    for (auto const& r : s.rates)
      os << "| " << r.entry << " | " << r.size << " | " << detail::gbps(r.encode_s, r.bytes) << " | "
         << detail::gbps(r.decode_s, r.bytes) << " | " << detail::gbps(r.memcpy_s, r.bytes) << " | "
         << detail::gbps(r.read_s, r.bytes) << " | " << detail::pct_text(r.memcpy_s, r.encode_s) << " | "
         << detail::pct_text(r.memcpy_s, r.decode_s) << " |\n";
  }

  if (!s.attention.empty()) {
    os << "\n## Decode attention\n\nPer cell: median time per call in ms · % of roofline · × f16; ✗ where a target "
          "is missed.\n";
    std::set<int> contexts;
    for (auto const& r : s.attention) contexts.insert(r.context);
    for (std::string const shape : {"gqa", "mha"}) {
      for (int threads : {1, 2}) {
        std::vector<attention_row const*> rows;
        for (auto const& r : s.attention)
          if (r.shape == shape && r.threads == threads) rows.push_back(&r);
        if (rows.empty()) continue;
        os << "\n### " << shape << (shape == "gqa" ? " (32 query / 8 KV heads)" : " (32 / 32 heads)") << ", " << threads
           << (threads == 1 ? " thread" : " threads") << "\n\n| codec |";
        for (int c : contexts) os << " " << (c >= 1024 ? std::to_string(c / 1024) + "k" : std::to_string(c)) << " |";
        os << "\n|---|";
        for (std::size_t i = 0; i < contexts.size(); ++i) os << "---:|";
        os << "\n";
        std::vector<std::string> labels;
        for (auto const* r : rows)
          if (std::find(labels.begin(), labels.end(), r->label()) == labels.end()) labels.push_back(r->label());
        for (auto const& label : labels) {
          os << "| " << label << " |";
          for (int c : contexts) {
            auto const it = std::find_if(rows.begin(), rows.end(), [&](attention_row const* r) {
              return r->label() == label && r->context == c;
            });
            if (it == rows.end()) {
              os << " — |";
              continue;
            }
            auto const pct = (*it)->pct_roofline();
            os << " " << detail::ms_text((*it)->seconds) << " · " << (pct ? detail::format("%.0f %%", *pct) : "—")
               << " · " << ((*it)->speedup_vs_f16 ? detail::format("%.2f×", *(*it)->speedup_vs_f16) : "—")
               << (detail::check_text(attention_targets(**it)).rfind("✗", 0) == 0 ? " ✗" : "") << " |";
          }
          os << "\n";
        }
      }
    }
    if (auto const low_bit = detail::low_bit_lines(s); !low_bit.empty()) {
      os << "\n### FP4 and rotated codecs against f16 and q4_0\n\nMedian time per call; × = f16's or q4_0's time / "
            "time (same shape, context and threads).\n\n";
      for (auto const& line : low_bit) os << "- " << line << "\n";
    }
  }

  if (!s.multi_query.empty()) {
    os << "\n## Multi-token attention\n\nPer cell: median time per call in ms · K+V GB/s as % of memcpy / GFLOP/s as % "
          "of the f32 FMA peak · × f16 (f16 time / time at the same n_q).";
    if (auto const line = detail::machine_line(s.multi_query_mach); !line.empty())
      os << " Measured in the same run: " << line << ".";
    os << "\n\n";
    for (auto const& line : detail::multi_query_lines(s)) os << "- " << line << "\n";
    std::set<std::tuple<std::string, int, int>> tables;
    for (auto const& r : s.multi_query) tables.insert({r.shape, r.context, r.threads});
    for (std::string const shape : {"gqa", "mha"}) {
      for (auto const& [table_shape, context, threads] : tables) {
        if (table_shape != shape) continue;
        std::vector<multi_query_row const*> rows;
        std::set<int> counts;
        for (auto const& r : s.multi_query)
          if (r.shape == shape && r.context == context && r.threads == threads)
            rows.push_back(&r), counts.insert(r.n_q);
        os << "\n### " << shape << (shape == "gqa" ? " (32 query / 8 KV heads)" : " (32 / 32 heads)") << ", "
           << detail::context_text(context) << ", " << threads << (threads == 1 ? " thread" : " threads")
           << "\n\n| codec |";
        for (int n : counts) os << " n_q " << n << " |";
        os << "\n|---|";
        for (std::size_t i = 0; i < counts.size(); ++i) os << "---:|";
        os << "\n";
        std::vector<std::string> labels;
        for (auto const* r : rows)
          if (std::find(labels.begin(), labels.end(), r->label()) == labels.end()) labels.push_back(r->label());
        for (auto const& label : labels) {
          os << "| " << label << " |";
          for (int n : counts) {
            auto const it = std::find_if(rows.begin(), rows.end(),
                                         [&](multi_query_row const* r) { return r->label() == label && r->n_q == n; });
            if (it == rows.end()) {
              os << " — |";
              continue;
            }
            auto const& r = **it;
            os << " " << detail::ms_text(r.seconds) << " · " << detail::pct_or_dash(r.pct_memcpy()) << " / "
               << detail::pct_or_dash(r.pct_fma_peak()) << " · "
               << (r.speedup_vs_f16 ? detail::format("%.2f×", *r.speedup_vs_f16) : "—") << " |";
          }
          os << "\n";
        }
      }
    }
  }

  if (!s.persist.empty()) {
    os << "\n## Save / load\n\nGB/s of image bytes, one thread; % of memcpy over the same bytes ("
       << detail::persist_line(s) << ").\n\n| codec | image MiB |";
    for (auto const& op : persist_ops) os << " " << op << " GB/s |";
    os << " memcpy GB/s |";
    for (auto const& op : persist_ops) os << " " << op << " % |";
    os << "\n|---|---:|";
    for (std::size_t i = 0; i < 2 * persist_ops.size() + 1; ++i) os << "---:|";
    os << "\n";
    for (auto const& r : s.persist) {
      os << "| " << r.codec << " | " << detail::format("%.1f", r.image_bytes() / 1048576.0) << " |";
      for (auto const& op : persist_ops) os << " " << detail::rate_text(r.bytes_per_s(op)) << " |";
      os << " " << detail::rate_text(r.bytes_per_s("memcpy")) << " |";
      for (auto const& op : persist_ops) os << " " << detail::pct_or_dash(r.pct(op)) << " |";
      os << "\n";
    }
  }

  if (!s.append.empty()) {
    os << "\n## Append\n\n% of memcpy over the same bytes in the same pieces, one thread ("
       << s.append_context.value("append_cache", std::string("cache of unknown shape")) << ").\n\n| codec |";
    for (auto const& op : append_ops) os << " " << op << " |";
    os << "\n|---|";
    for (std::size_t i = 0; i < append_ops.size(); ++i) os << "---:|";
    os << "\n";
    for (auto const& r : s.append) {
      os << "| " << r.codec << " |";
      for (auto const& op : append_ops) os << " " << detail::pct_or_dash(r.pct(op)) << " |";
      os << "\n";
    }
  }

  os << "\n## Targets\n\nEncode and decode at 256 MiB ≥ 80 % of memcpy; save, load_into and load ≥ 80 % of memcpy; "
        "append (every codec, input type and mode) ≥ 80 % of memcpy; "
        "attention at 16k and 32k (both shapes, 1 and 2 threads) ≥ 70 % of the roofline; no quantized codec slower "
        "than the f16 cache at any context; mha, 16k, 1 thread: ≥ 3× f16 for q4_0 and KIVI-4, ≥ 4× for KIVI-2, ≥ 1.8× "
        "for q8_0, int8 and fp8 (the `+q8q` rows are checked like their codec). For scale: llama.cpp's CPU flash "
        "attention at 16k, gqa, 1 thread takes 16.5 ms on f16, 26.6 ms on q8_0 and 49.0 ms on q4_0.\n\n";
  detail::print_targets(s, os, "- ");
}

}  // namespace kvq_bench::summary
