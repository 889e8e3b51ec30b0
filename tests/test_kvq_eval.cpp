// Tests of the kvq-eval tool: its JSON output against the JSON Schema in the repository, SVG output,
// its handling of bad arguments, and --paged and --chunk on the real model (when the model files are
// present).
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "catch_compat.hpp"
#include "test_support.hpp"

namespace {

using json = nlohmann::json;

/// Validates `v` against the subset of JSON Schema the kvq-eval schema uses; appends errors.
void validate(json const& schema, json const& v, std::string const& path, std::vector<std::string>& errors) {
  auto type_ok = [&](std::string const& t) {
    if (t == "object") return v.is_object();
    if (t == "array") return v.is_array();
    if (t == "string") return v.is_string();
    if (t == "integer") return v.is_number_integer();
    if (t == "number") return v.is_number();
    if (t == "null") return v.is_null();
    if (t == "boolean") return v.is_boolean();
    return false;
  };
  if (schema.contains("type")) {
    bool ok = false;
    if (schema["type"].is_array()) {
      for (auto const& t : schema["type"]) ok = ok || type_ok(t.get<std::string>());
    } else {
      ok = type_ok(schema["type"].get<std::string>());
    }
    if (!ok) {
      errors.push_back(path + ": wrong type");
      return;
    }
  }
  if (schema.contains("enum")) {
    bool found = false;
    for (auto const& e : schema["enum"]) found = found || e == v;
    if (!found) errors.push_back(path + ": not one of the allowed values");
  }
  if (v.is_number()) {
    double const x = v.get<double>();
    if (schema.contains("minimum") && x < schema["minimum"].get<double>()) errors.push_back(path + ": below minimum");
    if (schema.contains("maximum") && x > schema["maximum"].get<double>()) errors.push_back(path + ": above maximum");
    if (schema.contains("exclusiveMinimum") && x <= schema["exclusiveMinimum"].get<double>())
      errors.push_back(path + ": not above exclusiveMinimum");
  }
  if (v.is_string() && schema.contains("minLength") &&
      v.get<std::string>().size() < schema["minLength"].get<std::size_t>())
    errors.push_back(path + ": too short");
  if (v.is_object()) {
    if (schema.contains("required"))
      for (auto const& r : schema["required"])
        if (!v.contains(r.get<std::string>())) errors.push_back(path + ": missing " + r.get<std::string>());
    json const props = schema.value("properties", json::object());
    for (auto const& [k, x] : v.items()) {
      if (props.contains(k)) {
        validate(props[k], x, path + "." + k, errors);
      } else if (schema.contains("additionalProperties") && schema["additionalProperties"] == false) {
        errors.push_back(path + ": unexpected property " + k);
      }
    }
  }
  if (v.is_array()) {
    if (schema.contains("minItems") && v.size() < schema["minItems"].get<std::size_t>())
      errors.push_back(path + ": too few items");
    if (schema.contains("items"))
      for (std::size_t i = 0; i < v.size(); ++i)
        validate(schema["items"], v[i], path + "[" + std::to_string(i) + "]", errors);
  }
}

auto errors_of(json const& schema, json const& doc) -> std::vector<std::string> {
  std::vector<std::string> e;
  validate(schema, doc, "$", e);
  return e;
}

auto load(std::filesystem::path const& p) -> json {
  std::ifstream in(p);
  REQUIRE(in.good());
  return json::parse(in);
}

auto read_text(std::filesystem::path const& p) -> std::string {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

/// Runs kvq-eval with `args`, stdout and stderr to files in `dir`; returns the exit status.
int run_eval(std::string const& args, std::filesystem::path const& dir) {
  std::string const cmd = std::string("\"") + KVQ_EVAL_PATH + "\" " + args + " >\"" + (dir / "out.txt").string() +
                          "\" 2>\"" + (dir / "err.txt").string() + "\"";
  int const rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

auto temp_dir(char const* name) -> std::filesystem::path {
  auto const d = std::filesystem::temp_directory_path() / (std::string("kvq-eval-test-") + name);
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

}  // namespace

TEST_CASE("kvq-eval writes JSON that follows the repository's JSON Schema", "[kvq-eval]") {
  auto const dir = temp_dir("json");
  int const rc = run_eval("--context 256 --layers 1 --configs f16,q8_0,q4_0,kivi4/R32,int8-K/kivi4-V,f32 --json \"" +
                              (dir / "r.json").string() + "\" --svg \"" + (dir / "r.svg").string() + "\"",
                          dir);
  INFO(read_text(dir / "err.txt"));
  REQUIRE(rc == 0);
  json const schema = load(KVQ_EVAL_SCHEMA);
  json const doc = load(dir / "r.json");
  auto const errs = errors_of(schema, doc);
  for (auto const& e : errs) INFO(e);
  CHECK(errs.empty());
  CHECK(doc["workload"] == "synthetic");
  CHECK(doc["context"] == 256);
  REQUIRE(doc["results"].size() == 6);
  for (auto const& r : doc["results"]) {
    bool const kivi =
        r["k_codec"].get<std::string>().starts_with("kivi") || r["v_codec"].get<std::string>().starts_with("kivi");
    CHECK(r["group"].is_null() == !kivi);
    CHECK(r["residual"].is_null() == !kivi);
    CHECK(r["nonfinite_blocks"] == 0);  // the synthetic workload never overflows a scale
  }
  // Exact numbers that do not depend on timing: bits per element at the full context.
  auto const& res = doc["results"];
  CHECK(res[0]["label"] == "f16");
  CHECK(res[0]["bits_per_element"].get<double>() == 16.0);
  CHECK(res[1]["bits_per_element"].get<double>() == 8.5);
  CHECK(res[2]["bits_per_element"].get<double>() == 4.5);
  CHECK(res[5]["k_snr_db"].is_null());  // f32 is lossless
  CHECK(res[5]["attn_rel_error"].get<double>() < 1e-5);
  CHECK(res[1]["attn_cosine"].get<double>() > 0.99);
  // The table lists every configuration; the SVG draws a labelled point per configuration.
  std::string const table = read_text(dir / "out.txt");
  std::string const svg = read_text(dir / "r.svg");
  CHECK(svg.starts_with("<svg"));
  for (auto const& r : res) {
    CHECK(table.find(r["label"].get<std::string>()) != std::string::npos);
    CHECK(svg.find(">" + r["label"].get<std::string>() + "<") != std::string::npos);
  }
}

TEST_CASE("the schema validator rejects documents that break the schema", "[kvq-eval]") {
  json const schema = load(KVQ_EVAL_SCHEMA);
  json good = {{"schema_version", 1},
               {"workload", "synthetic"},
               {"context", 16},
               {"results",
                {{{"label", "q8_0"},
                  {"k_codec", "q8_0"},
                  {"v_codec", "q8_0"},
                  {"group", nullptr},
                  {"residual", nullptr},
                  {"bits_per_element", 8.5},
                  {"k_snr_db", 40.0},
                  {"v_snr_db", 41.0},
                  {"attn_rel_error", 0.01},
                  {"attn_cosine", 0.999},
                  {"encode_gbps", 1.0},
                  {"decode_gbps", 2.0},
                  {"attn_speedup_vs_f16", 1.5},
                  {"nonfinite_blocks", 0}}}}};
  CHECK(errors_of(schema, good).empty());
  json bad = good;
  bad["results"][0].erase("k_snr_db");
  CHECK(!errors_of(schema, bad).empty());
  bad = good;
  bad["results"][0]["k_codec"] = "q3_k";
  CHECK(!errors_of(schema, bad).empty());
  bad = good;
  bad["workload"] = "other";
  CHECK(!errors_of(schema, bad).empty());
  bad = good;
  bad["results"][0]["extra"] = 1;
  CHECK(!errors_of(schema, bad).empty());
  bad = good;
  bad["results"][0]["top1_agreement"] = 1.5;
  CHECK(!errors_of(schema, bad).empty());
  bad = good;
  bad["results"][0].erase("nonfinite_blocks");
  CHECK(!errors_of(schema, bad).empty());
  bad = good;
  bad["results"][0]["nonfinite_blocks"] = -1;
  CHECK(!errors_of(schema, bad).empty());
  // Version 3: a model document with its prefill chunk (a positive integer).
  json v3 = good;
  v3["schema_version"] = 3;
  v3["workload"] = "model";
  v3["chunk"] = 64;
  CHECK(errors_of(schema, v3).empty());
  bad = v3;
  bad["chunk"] = 0;
  CHECK(!errors_of(schema, bad).empty());
  bad = v3;
  bad["chunk"] = 1.5;
  CHECK(!errors_of(schema, bad).empty());
  bad = v3;
  bad["schema_version"] = 4;
  CHECK(!errors_of(schema, bad).empty());
}

TEST_CASE("kvq-eval reports bad arguments and unreadable files in one line with a non-zero exit", "[kvq-eval]") {
  auto const dir = temp_dir("args");
  for (std::string const args :
       {"--bogus", "--context", "--context -5", "--configs nope", "--model missing.bin",
        "--model missing.bin --tokenizer missing.tok --text missing.txt",
        "--json /nonexistent-dir/x.json --context 64 --layers 1 --configs f16", "--paged",
        "--page-tokens 32 --configs f16",
        "--model m.bin --tokenizer t.bin --text x.txt --paged --configs q8_0-K/q4_0-V",
        "--model m.bin --tokenizer t.bin --text x.txt --paged --page-tokens 16 --configs kivi4/R32",
        "--model m.bin --tokenizer t.bin --text x.txt --paged --page-tokens 0", "--chunk 64 --configs f16",
        "--model m.bin --tokenizer t.bin --text x.txt --chunk 0",
        "--model m.bin --tokenizer t.bin --text x.txt --chunk",
        "--model m.bin --tokenizer t.bin --text x.txt --chunk 8x",
        "--model m.bin --tokenizer t.bin --text x.txt --paged --chunk 2"}) {
    INFO(args);
    int const rc = run_eval(args, dir);
    CHECK(rc == 2);
    std::string const err = read_text(dir / "err.txt");
    CHECK(err.starts_with("kvq-eval: "));
    CHECK(std::count(err.begin(), err.end(), '\n') == 1);
  }
}

TEST_CASE("kvq-eval --paged batches every story through one paged cache at the flat perplexity", "[kvq-eval][paged]") {
  std::filesystem::path const models = KVQ_MODELS_DIR;
  auto const model = models / "stories260K" / "stories260K.bin";
  auto const tok = models / "stories260K" / "tok512.bin";
  auto const text = models / "tinystories_valid" / "sample.txt";
  if (!std::filesystem::exists(model) || !std::filesystem::exists(tok) || !std::filesystem::exists(text)) {
    WARN("model files absent under " << models << ": --paged not run");
    return;
  }
  auto const dir = temp_dir("paged");
  std::string const files =
      "--model \"" + model.string() + "\" --tokenizer \"" + tok.string() + "\" --text \"" + text.string() + "\"";
  int const rc = run_eval(files + " --paged --page-tokens 32 --configs f32,q8_0,kivi4/R32,nvfp4 --quiet --json \"" +
                              (dir / "r.json").string() + "\"",
                          dir);
  INFO(read_text(dir / "err.txt"));
  REQUIRE(rc == 0);
  CHECK(read_text(dir / "err.txt").empty());  // no warning: the perplexities agree
  json const doc = load(dir / "r.json");
  auto const errs = errors_of(load(KVQ_EVAL_SCHEMA), doc);
  for (auto const& e : errs) INFO(e);
  CHECK(errs.empty());
  CHECK(doc["schema_version"] == 3);  // a model document: version 2's "paged" objects plus "chunk"
  CHECK(doc["chunk"] == 1);           // --paged runs the flat perplexities token by token
  REQUIRE(doc["results"].size() == 4);
  for (auto const& r : doc["results"]) {
    INFO(r["label"].get<std::string>());
    REQUIRE(r.contains("paged"));
    auto const& p = r["paged"];
    // The pages hold the flat cache's bytes: the perplexities differ by float summation order only.
    double const flat = r["ppl"].get<double>(), paged = p["ppl"].get<double>();
    CHECK(std::abs(paged - flat) / flat < 1e-6);
    CHECK(p["ppl_flat"].get<double>() == flat);
    CHECK(p["ppl_rel_diff"].get<double>() < 1e-6);
    // Page use: every story a sequence, forked from the shared prefix, all released at the end.
    auto const pages = p["pages"].get<std::int64_t>();
    auto const used = p["peak_used_pages"].get<std::int64_t>();
    auto const stories = p["stories"].get<std::int64_t>();
    CHECK(p["page_tokens"] == 32);
    CHECK(stories > 1);
    CHECK(used > 0);
    CHECK(used < pages);                                 // the pool is sized for no sharing and all stories at once
    CHECK(used * 32 >= p["steps"].get<std::int64_t>());  // the longest story's tokens fit in the pages held
    CHECK(p["final_used_pages"] == 0);
    CHECK(p["forks"].get<std::int64_t>() >= 1);
    CHECK(p["forks"].get<std::int64_t>() <= stories - 1);
    CHECK(p["peak_sequences"].get<std::int64_t>() > 1);
    CHECK(p["peak_sequences"].get<std::int64_t>() <= stories);
    CHECK(p["peak_shared_pages"].get<std::int64_t>() >= 1);  // a fork shares its parent's pages
    CHECK(p["peak_saved_pages"].get<std::int64_t>() >= p["peak_shared_pages"].get<std::int64_t>());
    CHECK(p["steps"].get<std::int64_t>() >= 1);
    CHECK(p["tokens"].get<std::int64_t>() >= p["steps"].get<std::int64_t>());
    auto const& m = p["memory"];
    auto const page_bytes = p["page_bytes"].get<std::int64_t>();
    CHECK(m["total_bytes"].get<std::int64_t>() >= pages * page_bytes);
    CHECK(m["key_bytes"].get<std::int64_t>() + m["value_bytes"].get<std::int64_t>() +
              m["residual_bytes"].get<std::int64_t>() + m["alignment_bytes"].get<std::int64_t>() ==
          m["total_bytes"].get<std::int64_t>());
    CHECK((m["residual_bytes"].get<std::int64_t>() > 0) == r["label"].get<std::string>().starts_with("kivi"));
  }
  // Every configuration reports the same stories and tokens; 4-bit pages are smaller than f32's.
  auto const& res = doc["results"];
  for (auto const& r : res) {
    CHECK(r["paged"]["tokens"] == res[0]["paged"]["tokens"]);
    CHECK(r["paged"]["stories"] == res[0]["paged"]["stories"]);
    CHECK(r["paged"]["peak_used_pages"] == res[0]["paged"]["peak_used_pages"]);  // same tokens, same page size
  }
  CHECK(res[2]["paged"]["page_bytes"].get<std::int64_t>() < res[0]["paged"]["page_bytes"].get<std::int64_t>());
  std::string const table = read_text(dir / "out.txt");
  CHECK(table.find("--paged") != std::string::npos);

  // 16-token pages: the paged attention merges its softmax at other boundaries than the flat
  // cache's, so the perplexities agree to float rounding only (about 1e-7 here).
  REQUIRE(run_eval(files + " --paged --page-tokens 16 --configs f32,q4_0 --quiet --json \"" +
                       (dir / "r16.json").string() + "\"",
                   dir) == 0);
  json const doc16 = load(dir / "r16.json");
  CHECK(errors_of(load(KVQ_EVAL_SCHEMA), doc16).empty());
  for (auto const& r : doc16["results"]) {
    INFO(r["label"].get<std::string>());
    CHECK(r["paged"]["page_tokens"] == 16);
    CHECK(r["paged"]["ppl_rel_diff"].get<double>() < 1e-5);
    // Half-size pages: at least as many of them, at most twice as many.
    CHECK(r["paged"]["peak_used_pages"].get<std::int64_t>() >= res[0]["paged"]["peak_used_pages"].get<std::int64_t>());
    CHECK(r["paged"]["peak_used_pages"].get<std::int64_t>() <=
          2 * res[0]["paged"]["peak_used_pages"].get<std::int64_t>());
  }
  CHECK(doc16["results"][0]["paged"]["page_bytes"].get<std::int64_t>() * 2 ==
        res[0]["paged"]["page_bytes"].get<std::int64_t>());  // f32: bytes scale with page_tokens

  // A configuration whose codec pair --paged does not compile is a usage error naming it.
  CHECK(run_eval(files + " --paged --configs q8_0-K/q4_0-V", dir) == 2);
  CHECK(read_text(dir / "err.txt").find("--paged does not support configuration 'q8_0-K/q4_0-V'") != std::string::npos);
}

TEST_CASE("kvq-eval --chunk prefills every story in chunks, the f32 reference too", "[kvq-eval][chunk]") {
  std::filesystem::path const models = KVQ_MODELS_DIR;
  auto const model = models / "stories260K" / "stories260K.bin";
  auto const tok = models / "stories260K" / "tok512.bin";
  auto const sample = models / "tinystories_valid" / "sample.txt";
  if (!std::filesystem::exists(model) || !std::filesystem::exists(tok) || !std::filesystem::exists(sample)) {
    WARN("model files absent under " << models << ": --chunk not run");
    return;
  }
  auto const dir = temp_dir("chunk");
  // A short text: the sample's first six stories (several chunks of 64 tokens each, KIVI flushes inside them).
  std::string const sep = "\n<|endoftext|>\n";
  std::string const all = read_text(sample);
  std::size_t end = 0;
  for (int s = 0; s < 6; ++s) {
    std::size_t const at = all.find(sep, end);
    REQUIRE(at != std::string::npos);
    end = at + sep.size();
  }
  auto const text = dir / "first-stories.txt";
  std::ofstream(text, std::ios::binary) << all.substr(0, end);
  std::string const files =
      "--model \"" + model.string() + "\" --tokenizer \"" + tok.string() + "\" --text \"" + text.string() + "\"";
  std::string const configs = " --configs f32,q8_0,kivi4/R32 --quiet";
  json const schema = load(KVQ_EVAL_SCHEMA);
  auto run = [&](std::string const& chunk_args, std::string const& name) {
    int const rc = run_eval(files + configs + chunk_args + " --json \"" + (dir / name).string() + "\"", dir);
    INFO(read_text(dir / "err.txt"));
    REQUIRE(rc == 0);
    json doc = load(dir / name);
    auto const errs = errors_of(schema, doc);
    for (auto const& e : errs) INFO(e);
    CHECK(errs.empty());
    CHECK(doc["schema_version"] == 3);
    CHECK(doc["workload"] == "model");
    REQUIRE(doc["results"].size() == 3);
    return doc;
  };
  json const tokenwise = run("", "c1.json");  // the default: token by token
  CHECK(tokenwise["chunk"] == 1);
  CHECK(read_text(dir / "out.txt").find("prefill: chunk 1 (token by token") != std::string::npos);
  json const chunked = run(" --chunk 64", "c64.json");
  CHECK(chunked["chunk"] == 64);
  CHECK(read_text(dir / "out.txt").find("prefill: chunk 64 ") != std::string::npos);

  auto const& t = tokenwise["results"];
  auto const& c = chunked["results"];
  auto ppl = [](json const& r) { return r["ppl"].get<double>(); };
  // f32: the chunked run is scored against the chunked reference (the same computation), and
  // reproduces the token-by-token perplexity up to fp32 rounding.
  REQUIRE(c[0]["label"] == "f32");
  CHECK(ppl(c[0]) == c[0]["ppl_ref"].get<double>());
  CHECK(c[0]["kld"].get<double>() == 0.0);
  CHECK(c[0]["top1_agreement"].get<double>() == 1.0);
  CHECK(std::abs(ppl(c[0]) - ppl(t[0])) / ppl(t[0]) < 1e-6);
  CHECK(std::abs(c[0]["ppl_ref"].get<double>() - t[0]["ppl_ref"].get<double>()) / ppl(t[0]) < 1e-6);
  // q8_0 stores the same bytes whenever a token is attended: fp32 rounding again.
  REQUIRE(c[1]["label"] == "q8_0");
  CHECK(std::abs(ppl(c[1]) - ppl(t[1])) / ppl(t[1]) < 1e-4);
  // kivi4/R32: its key residual is flushed inside a chunk, so the chunk's earlier queries see
  // quantized keys the token-by-token run saw in f16 (docs/architecture.md, "Multi-token
  // attention"): the perplexity moves, and only away from the reference.
  REQUIRE(c[2]["label"] == "kivi4/R32");
  CHECK(ppl(c[2]) != ppl(t[2]));
  CHECK(ppl(c[2]) > ppl(c[0]));
  // --chunk 1 is the default.
  json const explicit1 = run(" --chunk 1", "c1b.json");
  CHECK(explicit1["chunk"] == 1);
  for (std::size_t i = 0; i < 3; ++i) CHECK(ppl(explicit1["results"][i]) == ppl(t[i]));
  // --paged is batched decode, one token per sequence and step: a usage error with N > 1.
  CHECK(run_eval(files + " --paged --chunk 64", dir) == 2);
  CHECK(read_text(dir / "err.txt").find("--chunk 64 does not go with --paged") != std::string::npos);
}
