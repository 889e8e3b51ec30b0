// kvq_bench_summary: reads the JSON of kvq_bench_codecs, kvq_bench_attention, kvq_bench_persist,
// kvq_bench_multi_query and kvq_bench_append, prints the summary tables and target checks, and
// optionally writes the --json document and bench/README.md.
//
// Usage: kvq_bench_summary [--codecs FILE] [--attention FILE] [--persist FILE] [--multi-query FILE]
//                          [--append FILE] [--json FILE] [--readme FILE] [--wall-seconds S]
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include "summary.hpp"

namespace {

/// Reads a Google Benchmark JSON file; an empty path gives an empty suite.
auto read_suite(std::string const& path) -> kvq_bench::summary::suite {
  if (path.empty()) return {};
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::ostringstream text;
  text << in.rdbuf();
  return kvq_bench::summary::load_suite(kvq_bench::summary::parse_benchmark_json(text.str()));
}

/// Writes `text` to `path`, raising when the file cannot be written.
void write_file(std::string const& path, std::string const& text) {
  std::ofstream out(path);
  if (!out || !(out << text)) throw std::runtime_error("cannot write " + path);
}

}  // namespace

int main(int argc, char** argv) {
  std::string codecs, attention, persist, multi_query, append, json_path, readme;
  double wall = 0;
  for (int i = 1; i < argc; ++i) {
    std::string const arg = argv[i];
    bool const has_value = i + 1 < argc;
    if (arg == "--codecs" && has_value) {
      codecs = argv[++i];
    } else if (arg == "--attention" && has_value) {
      attention = argv[++i];
    } else if (arg == "--persist" && has_value) {
      persist = argv[++i];
    } else if (arg == "--multi-query" && has_value) {
      multi_query = argv[++i];
    } else if (arg == "--append" && has_value) {
      append = argv[++i];
    } else if (arg == "--json" && has_value) {
      json_path = argv[++i];
    } else if (arg == "--readme" && has_value) {
      readme = argv[++i];
    } else if (arg == "--wall-seconds" && has_value) {
      wall = std::atof(argv[++i]);
    } else {
      std::fprintf(stderr,
                   "usage: kvq_bench_summary [--codecs FILE] [--attention FILE] [--persist FILE] "
                   "[--multi-query FILE] [--append FILE] [--json FILE] [--readme FILE] [--wall-seconds S]\n");
      return 2;
    }
  }
  try {
    auto const s = kvq_bench::summary::summarise(read_suite(codecs), read_suite(attention), read_suite(persist),
                                                 read_suite(multi_query), read_suite(append));
    kvq_bench::summary::print_text(s, std::cout);
    if (!json_path.empty()) write_file(json_path, kvq_bench::summary::to_json(s).dump(2) + "\n");
    if (!readme.empty()) {
      std::ostringstream md;
      kvq_bench::summary::write_readme(s, md, wall);
      write_file(readme, md.str());
    }
  } catch (std::exception const& e) {
    std::fprintf(stderr, "kvq_bench_summary: %s\n", e.what());
    return 1;
  }
  return 0;
}
