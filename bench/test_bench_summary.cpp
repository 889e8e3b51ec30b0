// Tests of kvq_bench_summary (bench/summary.hpp): roofline arithmetic, percentage caps, speed-ups
// over f16, medians, save/load percentages of memcpy, multi-token attention rates against memcpy and
// the peaks, and the --json document produced from canned benchmark output (bench/testdata/*.json)
// checked against the documented schema.
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "catch_compat.hpp"
#include "summary.hpp"

namespace sm = kvq_bench::summary;
using Catch::Matchers::WithinRel;

namespace {

/// Reads a file as Google Benchmark JSON (bare NaN / Inf read as null).
auto read_json(std::string const& path) -> nlohmann::json {
  std::ifstream in(path);
  REQUIRE(in.good());
  std::string const text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return sm::parse_benchmark_json(text);
}

auto canned() -> sm::summary {
  return sm::summarise(sm::load_suite(read_json(KVQ_BENCH_TESTDATA "/codecs.json")),
                       sm::load_suite(read_json(KVQ_BENCH_TESTDATA "/attention.json")));
}

auto keys_of(nlohmann::json const& object) -> std::set<std::string> {
  std::set<std::string> keys;
  for (auto const& [k, v] : object.items()) keys.insert(k);
  return keys;
}

/// Checks a document against the --json schema: exact keys, codec names of DESIGN §8, ranges.
void check_schema(nlohmann::json const& doc) {
  std::set<std::string> const names(sm::codec_names.begin(), sm::codec_names.end());
  REQUIRE(doc.is_object());
  REQUIRE(doc.contains("codecs"));
  REQUIRE(doc["codecs"].is_array());
  auto const check_rows = [](nlohmann::json const& rows) {
    REQUIRE(rows.is_array());
    for (auto const& a : rows) {
      REQUIRE(keys_of(a) == std::set<std::string>{"shape", "context", "threads", "time_ms", "roofline_ms",
                                                  "pct_roofline", "speedup_vs_f16"});
      REQUIRE((a["shape"] == "gqa" || a["shape"] == "mha"));
      REQUIRE(a["context"].is_number_integer());
      REQUIRE(a["threads"].is_number_integer());
      REQUIRE(a["time_ms"].is_number());
      REQUIRE((a["roofline_ms"].is_number() || a["roofline_ms"].is_null()));
      if (a["pct_roofline"].is_number()) {
        REQUIRE(a["pct_roofline"].get<double>() >= 0.0);
        REQUIRE(a["pct_roofline"].get<double>() <= 100.0);
      }
      REQUIRE((a["speedup_vs_f16"].is_number() || a["speedup_vs_f16"].is_null()));
    }
  };
  for (auto const& c : doc["codecs"]) {
    REQUIRE(keys_of(c) == std::set<std::string>{"codec", "encode_pct_memcpy", "decode_pct_memcpy", "attention"});
    REQUIRE(names.count(c["codec"].get<std::string>()) == 1);
    for (char const* key : {"encode_pct_memcpy", "decode_pct_memcpy"}) {
      REQUIRE((c[key].is_number() || c[key].is_null()));
      if (c[key].is_number()) {
        REQUIRE(c[key].get<double>() >= 0.0);
        REQUIRE(c[key].get<double>() <= 100.0);
      }
    }
    check_rows(c["attention"]);
  }
  for (auto const& c : doc.value("attention_q8_query", nlohmann::json::array())) {
    REQUIRE(keys_of(c) == std::set<std::string>{"codec", "attention"});
    check_rows(c["attention"]);
  }
}

auto find_codec(nlohmann::json const& list, std::string const& name) -> nlohmann::json {
  for (auto const& c : list)
    if (c["codec"] == name) return c;
  FAIL("codec " << name << " missing");
  return {};
}

}  // namespace

TEST_CASE("roofline: max of memory and compute time, int8 q·K against the int8 peak", "[bench][summary]") {
  sm::attention_work w{268435456.0, 67108864.0, 67108864.0, false};
  // Memory-bound: 268435456 B / 20 GB/s = 13.42 ms > 134217728 FMAs / 50 G/s = 2.68 ms.
  REQUIRE_THAT(*sm::roofline_seconds(w, 20e9, 50e9, 200e9), WithinRel(0.0134217728, 1e-12));
  // Compute-bound: the same work against 1 TB/s.
  REQUIRE_THAT(*sm::roofline_seconds(w, 1e12, 50e9, 200e9), WithinRel(0.00268435456, 1e-12));
  // Integer q·K: q·K MACs at the int8 peak plus p·V FMAs at the FMA peak.
  w.qk_int8 = true;
  REQUIRE_THAT(*sm::roofline_seconds(w, 1e12, 50e9, 200e9), WithinRel(67108864.0 / 200e9 + 67108864.0 / 50e9, 1e-12));
  // A missing machine figure gives no roofline.
  REQUIRE_FALSE(sm::roofline_seconds(w, 0.0, 50e9, 200e9).has_value());
  REQUIRE_FALSE(sm::roofline_seconds(w, 20e9, 50e9, 0.0).has_value());
}

TEST_CASE("benchmark JSON: bare NaN and Inf values read as null, strings untouched", "[bench][summary]") {
  auto const j = sm::parse_benchmark_json(R"({"a": NaN, "b":-nan, "c": inf, "d": -Infinity, "e": 1.5, "f": "x: nan"})");
  REQUIRE(j["a"].is_null());
  REQUIRE(j["b"].is_null());
  REQUIRE(j["c"].is_null());
  REQUIRE(j["d"].is_null());
  REQUIRE(j["e"] == 1.5);
  REQUIRE(j["f"].is_string());
}

TEST_CASE("percentages are clamped to [0, 100]", "[bench][summary]") {
  REQUIRE(sm::percent(3.0, 4.0) == 75.0);
  REQUIRE(sm::percent(5.0, 4.0) == 100.0);
  REQUIRE(sm::percent(-1.0, 4.0) == 0.0);
  REQUIRE(sm::percent(1.0, 0.0) == 0.0);
}

TEST_CASE("summary of the canned benchmark output", "[bench][summary]") {
  auto const s = canned();

  SECTION("medians: the median aggregate, else the median of plain runs; failed runs skipped") {
    auto const codecs = sm::load_suite(read_json(KVQ_BENCH_TESTDATA "/codecs.json"));
    REQUIRE_THAT(codecs.runs.at("encode/q4_0/256MiB").seconds, WithinRel(0.010, 1e-12));
    REQUIRE_THAT(codecs.runs.at("encode/f16/256MiB").seconds, WithinRel(0.010, 1e-12));
    REQUIRE(codecs.runs.count("encode/kivi8.k/256MiB") == 0);
  }

  SECTION("machine figures by thread count, the higher of two measurements") {
    REQUIRE(s.mach.read_bytes_per_s.at(1) == 2.0e10);  // "again" measured 1e10
    REQUIRE(s.mach.read_bytes_per_s.at(2) == 2.5e10);
    REQUIRE(s.mach.fma_macs_per_s.at(2) == 1.0e11);
    REQUIRE(s.mach.int8_macs_per_s.at(1) == 2.5e11);  // "again" measured more than the first 2e11
  }

  SECTION("attention rows: roofline, % of roofline, bound, speed-up over f16") {
    REQUIRE(s.attention.size() == 4);
    auto const& f16 = s.attention[0];  // codec order of DESIGN §8: f16 before q4_0
    REQUIRE(f16.codec == "f16");
    REQUIRE_THAT(*f16.roofline_s, WithinRel(0.0134217728, 1e-9));
    REQUIRE_THAT(*f16.pct_roofline(), WithinRel(67.108864, 1e-9));
    REQUIRE(f16.memory_bound);
    REQUIRE_THAT(*f16.speedup_vs_f16, WithinRel(1.0, 1e-12));

    auto const& gqa = s.attention[1];  // q4_0 gqa 512, 2 threads: compute-bound, no f16 row to compare
    REQUIRE((gqa.codec == "q4_0" && gqa.shape == "gqa" && gqa.threads == 2));
    REQUIRE_THAT(*gqa.roofline_s, WithinRel(4194304.0 / 1e11, 1e-9));
    REQUIRE_FALSE(gqa.memory_bound);
    REQUIRE_FALSE(gqa.speedup_vs_f16.has_value());

    auto const& mha = s.attention[2];
    REQUIRE((mha.codec == "q4_0" && !mha.q8_query && mha.shape == "mha"));
    REQUIRE_THAT(*mha.pct_roofline(), WithinRel(75.497472, 1e-9));
    REQUIRE_THAT(*mha.speedup_vs_f16, WithinRel(4.0, 1e-12));

    auto const& q8q = s.attention[3];
    REQUIRE((q8q.codec == "q4_0" && q8q.q8_query && q8q.label() == "q4_0+q8q"));
    REQUIRE(*q8q.pct_roofline() == 100.0);  // faster than the roofline: capped
    REQUIRE_THAT(*q8q.speedup_vs_f16, WithinRel(20.0 / 3.0, 1e-12));
  }

  SECTION("targets") {
    std::size_t met = 0;
    for (auto const& t : s.targets) met += t.met ? 1 : 0;
    REQUIRE(s.targets.size() == 12);
    REQUIRE(met == 10);
  }
}

TEST_CASE("kvq_bench_summary --json writes the documented schema", "[bench][summary]") {
  auto const dir =
      std::filesystem::temp_directory_path() /
      ("kvq_bench_summary_test_" + std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
  std::filesystem::create_directories(dir);
  auto const out = (dir / "summary.json").string();
  auto const readme = (dir / "README.md").string();
  std::string const cmd = std::string("\"") + KVQ_BENCH_SUMMARY +
                          "\" --codecs \"" KVQ_BENCH_TESTDATA "/codecs.json\" --attention \"" KVQ_BENCH_TESTDATA
                          "/attention.json\" --json \"" +
                          out + "\" --readme \"" + readme + "\" --wall-seconds 42 > \"" +
                          (dir / "stdout.txt").string() + "\"";
  REQUIRE(std::system(cmd.c_str()) == 0);
  auto const doc = read_json(out);
  check_schema(doc);

  auto const& codecs = doc["codecs"];
  REQUIRE(codecs.size() == 3);  // f16, q4_0, kivi4 in the order of DESIGN §8
  REQUIRE(codecs[0]["codec"] == "f16");
  REQUIRE(codecs[1]["codec"] == "q4_0");
  REQUIRE(codecs[2]["codec"] == "kivi4");

  auto const f16 = find_codec(codecs, "f16");
  REQUIRE_THAT(f16["encode_pct_memcpy"].get<double>(), WithinRel(90.0, 1e-3));
  REQUIRE(f16["decode_pct_memcpy"].is_null());

  auto const q4 = find_codec(codecs, "q4_0");
  REQUIRE_THAT(q4["encode_pct_memcpy"].get<double>(), WithinRel(80.0, 1e-3));
  REQUIRE(q4["decode_pct_memcpy"].get<double>() == 100.0);  // 200 % of memcpy, capped
  REQUIRE(q4["attention"].size() == 2);                     // the +q8q row lives elsewhere
  auto const& mha = q4["attention"][1];
  REQUIRE((mha["shape"] == "mha" && mha["context"] == 16384 && mha["threads"] == 1));
  REQUIRE_THAT(mha["time_ms"].get<double>(), WithinRel(5.0, 1e-4));
  REQUIRE_THAT(mha["roofline_ms"].get<double>(), WithinRel(3.7748736, 1e-4));
  REQUIRE_THAT(mha["pct_roofline"].get<double>(), WithinRel(75.497472, 1e-3));
  REQUIRE_THAT(mha["speedup_vs_f16"].get<double>(), WithinRel(4.0, 1e-3));
  REQUIRE(q4["attention"][0]["speedup_vs_f16"].is_null());

  auto const kivi = find_codec(codecs, "kivi4");  // keys and values: (10 + 10) / (20 + 30) and / (10 + 15)
  REQUIRE_THAT(kivi["encode_pct_memcpy"].get<double>(), WithinRel(40.0, 1e-3));
  REQUIRE_THAT(kivi["decode_pct_memcpy"].get<double>(), WithinRel(80.0, 1e-3));
  REQUIRE(kivi["attention"].empty());

  auto const q8 = doc["attention_q8_query"];
  REQUIRE(q8.size() == 1);
  REQUIRE(q8[0]["codec"] == "q4_0");
  REQUIRE(q8[0]["attention"][0]["pct_roofline"].get<double>() == 100.0);
  REQUIRE_THAT(q8[0]["attention"][0]["speedup_vs_f16"].get<double>(), WithinRel(20.0 / 3.0, 1e-3));

  REQUIRE(doc["machine"]["cpu_model"] == "Test CPU");
  REQUIRE(doc["targets"]["met"] == 10);
  REQUIRE(doc["targets"]["total"] == 12);

  std::ifstream md(readme);
  std::string const text((std::istreambuf_iterator<char>(md)), std::istreambuf_iterator<char>());
  REQUIRE(text.find("# kvq benchmarks") == 0);
  REQUIRE(text.find("| CPU | Test CPU |") != std::string::npos);
  REQUIRE(text.find("42 s") != std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_CASE("save / load rows: % of memcpy over the same bytes, medians, targets, JSON", "[bench][summary]") {
  auto const persist = sm::load_suite(read_json(KVQ_BENCH_TESTDATA "/persist.json"));
  auto const s = sm::summarise({}, {}, persist);
  REQUIRE(s.persist.size() == 2);  // the failed fp8_e4m3 run is skipped; q4_0 before kivi4 (DESIGN §8)

  auto const& q4 = s.persist[0];
  REQUIRE(q4.codec == "q4_0");
  REQUIRE(q4.image_bytes() == 1e8);
  REQUIRE_THAT(*q4.bytes_per_s("memcpy"), WithinRel(1e10, 1e-12));  // the median aggregate, not the mean
  REQUIRE_THAT(*q4.pct("save"), WithinRel(80.0, 1e-12));
  REQUIRE_THAT(*q4.pct("load_into"), WithinRel(50.0, 1e-12));
  REQUIRE_THAT(*q4.pct("load"), WithinRel(25.0, 1e-12));
  REQUIRE_THAT(*q4.pct("export"), WithinRel(100.0, 1e-12));
  REQUIRE(*q4.pct("import") == 100.0);  // faster than memcpy: capped

  auto const& kivi = s.persist[1];  // plain runs: medians 10 ms (memcpy, save) and 12.5 ms (load_into)
  REQUIRE(kivi.codec == "kivi4");
  REQUIRE_THAT(*kivi.pct("save"), WithinRel(100.0, 1e-12));
  REQUIRE_THAT(*kivi.pct("load_into"), WithinRel(80.0, 1e-12));
  REQUIRE_FALSE(kivi.pct("load").has_value());

  std::size_t met = 0;
  for (auto const& t : s.targets) {
    REQUIRE(t.kind == sm::target_kind::persist);
    met += t.met ? 1 : 0;
  }
  REQUIRE(s.targets.size() == 5);  // q4_0 save, load_into, load; kivi4 save, load_into
  REQUIRE(met == 3);

  auto const doc = sm::to_json(s);
  REQUIRE(doc["persist"].size() == 2);
  auto const& row = doc["persist"][0];
  REQUIRE(keys_of(row) == std::set<std::string>{"codec", "image_bytes", "save_pct_memcpy", "load_into_pct_memcpy",
                                                "replace_pct_memcpy", "load_pct_memcpy", "export_pct_memcpy",
                                                "import_pct_memcpy"});
  REQUIRE(row["codec"] == "q4_0");
  REQUIRE_THAT(row["load_pct_memcpy"].get<double>(), WithinRel(25.0, 1e-3));
  REQUIRE(doc["persist"][1]["import_pct_memcpy"].is_null());
  REQUIRE(doc["machine"]["cpu_model"] == "Test CPU");  // from the persist suite when it ran alone

  std::ostringstream text, md;
  sm::print_text(s, text);
  sm::write_readme(s, md, 0);
  REQUIRE(text.str().find("Save / load") != std::string::npos);
  REQUIRE(md.str().find("## Save / load") != std::string::npos);
  REQUIRE(md.str().find(
              "| q4_0 | 95.4 | 8.0 | 5.0 | — | 2.5 | 10.0 | 12.5 | 10.0 | 80.0 | 50.0 | — | 25.0 | 100.0 | 100.0 |") !=
          std::string::npos);
}

TEST_CASE("append rows: % of memcpy against each op's twin, codec order, targets, JSON", "[bench][summary]") {
  auto const append = sm::load_suite(read_json(KVQ_BENCH_TESTDATA "/append.json"));
  auto const s = sm::summarise({}, {}, {}, {}, append);
  REQUIRE(s.append.size() == 2);  // machine/read is no append row; q4_0 before kivi4 (DESIGN §8)
  auto const& q4 = s.append[0];
  REQUIRE(q4.codec == "q4_0");
  REQUIRE_THAT(*q4.pct("f32/prefill"), WithinRel(50.0, 1e-12));  // medians: memcpy 10 ms, append 20 ms
  REQUIRE_THAT(*q4.pct("f32/decode"), WithinRel(90.0, 1e-12));
  REQUIRE_FALSE(q4.pct("f16/prefill").has_value());
  auto const& kivi = s.append[1];
  REQUIRE(kivi.codec == "kivi4");
  REQUIRE_THAT(*kivi.pct("f16/prefill"), WithinRel(100.0, 1e-12));
  REQUIRE_FALSE(kivi.pct("f32/decode").has_value());  // memcpy ran, append did not

  std::size_t met = 0;
  for (auto const& t : s.targets) {
    REQUIRE(t.kind == sm::target_kind::append);
    met += t.met ? 1 : 0;
  }
  REQUIRE(s.targets.size() == 3);
  REQUIRE(met == 2);

  auto const doc = sm::to_json(s);
  REQUIRE(doc["append"].size() == 2);
  auto const& row = doc["append"][0];
  REQUIRE(keys_of(row) == std::set<std::string>{"codec", "f32_prefill_pct_memcpy", "f16_prefill_pct_memcpy",
                                                "bf16_prefill_pct_memcpy", "f32_decode_pct_memcpy",
                                                "f16_decode_pct_memcpy", "bf16_decode_pct_memcpy",
                                                "f32_paged_prefill_pct_memcpy", "f32_paged_decode_pct_memcpy"});
  REQUIRE_THAT(row["f32_prefill_pct_memcpy"].get<double>(), WithinRel(50.0, 1e-3));
  REQUIRE(row["f16_prefill_pct_memcpy"].is_null());
  REQUIRE(doc["machine"]["cpu_model"] == "Test CPU");

  std::ostringstream text, md;
  sm::print_text(s, text);
  sm::write_readme(s, md, 0);
  REQUIRE(text.str().find("Append (single thread; 1 layer × 8 kv_heads") != std::string::npos);
  REQUIRE(md.str().find("## Append") != std::string::npos);
  REQUIRE(md.str().find("| q4_0 | 50.0 | — | — | 90.0 | — | — | — | — |") != std::string::npos);
}

TEST_CASE("kvq_bench_summary --persist reads the persist suite", "[bench][summary]") {
  auto const dir =
      std::filesystem::temp_directory_path() /
      ("kvq_bench_summary_persist_" + std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
  std::filesystem::create_directories(dir);
  auto const out = (dir / "summary.json").string();
  std::string const cmd = std::string("\"") + KVQ_BENCH_SUMMARY +
                          "\" --codecs \"" KVQ_BENCH_TESTDATA "/codecs.json\" --attention \"" KVQ_BENCH_TESTDATA
                          "/attention.json\" --persist \"" KVQ_BENCH_TESTDATA "/persist.json\" --json \"" +
                          out + "\" > \"" + (dir / "stdout.txt").string() + "\"";
  REQUIRE(std::system(cmd.c_str()) == 0);
  auto const doc = read_json(out);
  check_schema(doc);
  REQUIRE(doc["persist"].size() == 2);
  REQUIRE(doc["targets"]["total"] == 12 + 5);
  REQUIRE(doc["targets"]["met"] == 10 + 3);
  std::filesystem::remove_all(dir);
}

TEST_CASE("multi-token attention rows: % of memcpy and of the peaks, × f16, time over n_q = 1", "[bench][summary]") {
  auto const mq = sm::load_suite(read_json(KVQ_BENCH_TESTDATA "/multi_query.json"));
  auto const s = sm::summarise({}, {}, {}, mq);
  REQUIRE(s.mach.read_bytes_per_s.empty());                        // the attention suite's figures stay its own
  REQUIRE(s.multi_query_mach.memcpy_bytes_per_s.at(1) == 2.0e10);  // "again" measured less, the mean is ignored
  REQUIRE(s.multi_query_mach.memcpy_bytes_per_s.at(2) == 2.5e10);
  REQUIRE(s.multi_query_mach.fma_macs_per_s.at(1) == 6.0e10);  // "again" measured more
  REQUIRE(s.multi_query_mach.fma_macs_per_s.count(2) == 0);

  // Codec order of DESIGN §8, then the +q8q rows, then shape, context, n_q and threads; the failed run skipped.
  REQUIRE(s.multi_query.size() == 7);
  auto const& f16_8 = s.multi_query[1];
  REQUIRE((f16_8.codec == "f16" && f16_8.n_q == 8));
  REQUIRE_THAT(*f16_8.speedup_vs_f16, WithinRel(1.0, 1e-12));
  REQUIRE_THAT(*f16_8.time_vs_nq1, WithinRel(4.0, 1e-12));

  auto const& one = s.multi_query[2];  // q4_0 gqa 16k, n_q 1, 1 thread: 5 ms
  REQUIRE((one.codec == "q4_0" && one.shape == "gqa" && one.context == 16384 && one.n_q == 1 && one.threads == 1));
  REQUIRE_THAT(one.bytes_per_s(), WithinRel(18874368.0 / 0.005, 1e-12));
  REQUIRE_THAT(*one.pct_memcpy(), WithinRel(18.874368, 1e-9));
  // 4 · 32 heads · 128 · 16384 tokens FLOPs in 5 ms against 2 FLOPs × 6e10 multiply-adds per second.
  REQUIRE_THAT(*one.pct_fma_peak(), WithinRel(100.0 * 268435456.0 / 0.005 / 1.2e11, 1e-9));
  REQUIRE_FALSE(one.pct_int8_peak().has_value());  // f32 query: q·K does not run as int8 dot products
  REQUIRE_THAT(*one.speedup_vs_f16, WithinRel(2.0, 1e-12));
  REQUIRE_THAT(*one.time_vs_nq1, WithinRel(1.0, 1e-12));

  auto const& two = s.multi_query[3];  // 2 threads: its own memcpy figure, no FMA peak, no f16 row
  REQUIRE((two.codec == "q4_0" && two.n_q == 1 && two.threads == 2));
  REQUIRE_THAT(*two.pct_memcpy(), WithinRel(100.0 * 18874368.0 / 0.004 / 2.5e10, 1e-9));
  REQUIRE_FALSE(two.pct_fma_peak().has_value());
  REQUIRE_FALSE(two.speedup_vs_f16.has_value());

  auto const& eight = s.multi_query[4];  // causal pairs 8 · 16384 − 28
  REQUIRE(eight.n_q == 8);
  REQUIRE(eight.flops == 4.0 * 32 * 128 * (8 * 16384 - 28));
  REQUIRE_THAT(*eight.time_vs_nq1, WithinRel(4.0, 1e-12));
  REQUIRE_THAT(*eight.speedup_vs_f16, WithinRel(2.0, 1e-12));
  REQUIRE_THAT(*eight.pct_fma_peak(), WithinRel(100.0 * 2147024896.0 / 0.02 / 1.2e11, 1e-9));

  auto const& big = s.multi_query[5];  // ".../iterations:1", plain repetitions of 2, 3 and 2.5 s: their median
  REQUIRE(big.n_q == 512);
  REQUIRE_THAT(big.seconds, WithinRel(2.5, 1e-12));
  REQUIRE(big.flops == 4.0 * 32 * 128 * (512 * 16384 - 512 * 511 / 2));
  REQUIRE_THAT(*big.pct_fma_peak(), WithinRel(100.0 * big.flops / 2.5 / 1.2e11, 1e-9));
  REQUIRE_FALSE(big.speedup_vs_f16.has_value());
  REQUIRE_THAT(*big.time_vs_nq1, WithinRel(500.0, 1e-12));

  auto const& q8q = s.multi_query[6];
  REQUIRE((q8q.codec == "q4_0" && q8q.q8_query && q8q.label() == "q4_0+q8q" && q8q.qk_int8));
  REQUIRE(*q8q.pct_fma_peak() == 100.0);  // beyond the f32 peak: capped
  REQUIRE_THAT(*q8q.pct_int8_peak(), WithinRel(100.0 * 2147024896.0 / 0.016 / 4e11, 1e-9));
  REQUIRE_THAT(*q8q.speedup_vs_f16, WithinRel(2.5, 1e-12));
  REQUIRE_FALSE(q8q.time_vs_nq1.has_value());  // no q4_0+q8q row at n_q = 1
  REQUIRE(s.targets.empty());

  auto const lines = sm::detail::multi_query_lines(s);
  REQUIRE(lines.size() == 2);
  REQUIRE(lines[0] == "n_q 8 time / n_q 1 time, gqa 16k, 1 thread: f16 4.00×, q4_0 4.00×");
  REQUIRE(lines[1] == "n_q 512 GFLOP/s as % of the f32 peak, gqa 16k, 1 thread: q4_0 45.1 %");

  auto const doc = sm::to_json(s);
  REQUIRE(doc["multi_query"].size() == 7);
  auto const& row = doc["multi_query"][6];
  REQUIRE(keys_of(row) == std::set<std::string>{"codec", "q8_query", "shape", "context", "n_q", "threads", "time_ms",
                                                "gb_per_s", "pct_memcpy", "gflop_per_s", "pct_fma_peak",
                                                "pct_int8_peak", "speedup_vs_f16", "time_vs_nq1"});
  REQUIRE((row["codec"] == "q4_0" && row["q8_query"] == true && row["n_q"] == 8));
  REQUIRE_THAT(row["time_ms"].get<double>(), WithinRel(16.0, 1e-4));
  REQUIRE_THAT(row["gflop_per_s"].get<double>(), WithinRel(134.2, 1e-3));
  REQUIRE_THAT(row["pct_int8_peak"].get<double>(), WithinRel(33.55, 1e-3));
  REQUIRE(row["time_vs_nq1"].is_null());
  REQUIRE(doc["multi_query"][2]["pct_int8_peak"].is_null());
  REQUIRE(doc["multi_query_machine"]["memcpy_gb_per_s"]["1"] == 20.0);
  REQUIRE(doc["machine"]["cpu_model"] == "Test CPU MQ");  // from the multi-token suite when it ran alone

  std::ostringstream text, md;
  sm::print_text(s, text);
  sm::write_readme(s, md, 0);
  REQUIRE(text.str().find("Multi-token attention") != std::string::npos);
  REQUIRE(text.str().find("n_q 8 time / n_q 1 time, gqa 16k, 1 thread") != std::string::npos);
  REQUIRE(md.str().find("## Multi-token attention") != std::string::npos);
  REQUIRE(md.str().find("### gqa (32 query / 8 KV heads), 16k, 1 thread\n\n| codec | n_q 1 | n_q 8 | n_q 512 |") !=
          std::string::npos);
  REQUIRE(
      md.str().find("| q4_0 | 5.00 · 18.9 / 44.7 · 2.00× | 20.00 · 4.7 / 89.5 · 2.00× | 2500.0 · 0.0 / 45.1 · — |") !=
      std::string::npos);
}

TEST_CASE("kvq_bench_summary --multi-query reads the multi-token suite", "[bench][summary]") {
  auto const dir =
      std::filesystem::temp_directory_path() /
      ("kvq_bench_summary_mq_" + std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
  std::filesystem::create_directories(dir);
  auto const out = (dir / "summary.json").string();
  auto const stdout_path = (dir / "stdout.txt").string();
  std::string const cmd = std::string("\"") + KVQ_BENCH_SUMMARY +
                          "\" --codecs \"" KVQ_BENCH_TESTDATA "/codecs.json\" --attention \"" KVQ_BENCH_TESTDATA
                          "/attention.json\" --multi-query \"" KVQ_BENCH_TESTDATA "/multi_query.json\" --json \"" +
                          out + "\" > \"" + stdout_path + "\"";
  REQUIRE(std::system(cmd.c_str()) == 0);
  auto const doc = read_json(out);
  check_schema(doc);
  REQUIRE(doc["multi_query"].size() == 7);
  REQUIRE(doc["machine"]["cpu_model"] == "Test CPU");  // the attention suite names the machine
  REQUIRE(doc["machine"]["cpu_flags"] == "avx2 fma f16c avx512f avx512_vnni");
  REQUIRE(doc["targets"]["total"] == 12);  // no targets of its own
  std::ifstream in(stdout_path);
  std::string const text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  REQUIRE(text.find("Multi-token attention") != std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_CASE("FP4 and rotated codecs: table order after DESIGN §8, × q4_0, one line per cell", "[bench][summary]") {
  auto const entry = [](std::string const& name, double ms, double bytes) {
    return nlohmann::json{{"name", name + "/real_time"}, {"run_name", name + "/real_time"},
                          {"run_type", "iteration"},     {"real_time", ms},
                          {"time_unit", "ms"},           {"bytes", bytes}};
  };
  nlohmann::json attention = {{"benchmarks", nlohmann::json::array()}};
  for (auto const& [codec, ms] : {std::pair{"tq4", 4.0}, std::pair{"rot-q4_0", 1.25}, std::pair{"q4_0", 1.0},
                                  std::pair{"f16", 2.0}, std::pair{"q4_0+q8q", 0.5}, std::pair{"mxfp4", 0.8}})
    attention["benchmarks"].push_back(entry(std::string("attention/") + codec + "/gqa/ctx:4096/threads:1", ms, 0.0));
  nlohmann::json codecs = {{"benchmarks", nlohmann::json::array()}};
  for (auto const& [op, ms] : {std::pair{"encode", 20.0}, std::pair{"decode", 12.5}, std::pair{"memcpy", 10.0}})
    codecs["benchmarks"].push_back(entry(std::string(op) + "/rot-q4_0/256MiB", ms, 3.0e8));
  auto const s = sm::summarise(sm::load_suite(codecs), sm::load_suite(attention));

  REQUIRE(s.attention.size() == 6);  // f16, q4_0, q4_0+q8q, mxfp4, rot-q4_0, tq4
  REQUIRE(s.attention[3].codec == "mxfp4");
  REQUIRE(s.attention[4].codec == "rot-q4_0");
  REQUIRE(s.attention[5].codec == "tq4");
  REQUIRE_THAT(*s.attention[3].speedup_vs_q4_0, WithinRel(1.25, 1e-12));
  REQUIRE_THAT(*s.attention[4].speedup_vs_f16, WithinRel(1.6, 1e-12));
  REQUIRE_THAT(*s.attention[4].speedup_vs_q4_0, WithinRel(0.8, 1e-12));  // against q4_0's f32-query row
  REQUIRE_THAT(*s.attention[5].speedup_vs_q4_0, WithinRel(0.25, 1e-12));

  auto const lines = sm::detail::low_bit_lines(s);
  REQUIRE(lines.size() == 1);
  REQUIRE(lines[0] ==
          "gqa 4k, 1 thread: f16 2.00 ms, q4_0 1.00 ms, mxfp4 0.800 ms (2.50× f16, 1.25× q4_0), rot-q4_0 1.25 ms "
          "(1.60× f16, 0.80× q4_0), tq4 4.00 ms (0.50× f16, 0.25× q4_0)");

  REQUIRE(s.codecs.size() == 5);  // f16, q4_0, mxfp4, rot-q4_0, tq4
  REQUIRE(s.codecs[3].codec == "rot-q4_0");
  REQUIRE_THAT(*s.codecs[3].encode_pct, WithinRel(50.0, 1e-12));
  REQUIRE_THAT(*s.codecs[3].decode_pct, WithinRel(80.0, 1e-12));
  check_schema(sm::to_json(s));

  std::ostringstream md;
  sm::write_readme(s, md, 0);
  REQUIRE(md.str().find("### FP4 and rotated codecs against f16 and q4_0") != std::string::npos);
  REQUIRE(md.str().find("| rot-q4_0 | 256MiB | 15.0 | 24.0 | 30.0 | — | 50.0 | 80.0 |") != std::string::npos);
}
