// kvq-eval: the evaluated configurations (key codec, value codec, KIVI group and residual).
#pragma once

#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvq_eval {

/// One (key codec, value codec) configuration; group/residual are set when a KIVI codec is used.
struct config {
  std::string label;
  std::string k_codec;
  std::string v_codec;
  std::optional<int> group;
  std::optional<int> residual;
};

/// Every codec for K and V alike (KIVI with R = 0, 32, 128), rotated and codebook codecs, mixed
/// pairs, and the baselines.
inline auto default_configs() -> std::vector<config> {
  std::vector<config> c;
  for (char const* name : {"f32", "f16", "q8_0", "int8", "fp8_e4m3", "fp8_e5m2", "q4_0", "nvfp4", "mxfp4"})
    c.push_back({name, name, name, std::nullopt, std::nullopt});
  for (char const* name : {"kivi8", "kivi4", "kivi2"})
    for (int r : {0, 32, 128}) c.push_back({std::string(name) + "/R" + std::to_string(r), name, name, 32, r});
  // Rotated forms (FORMATS.md §6.1) beside their plain forms, and the codebook codecs (§6.2).
  for (char const* name : {"rot-q8_0", "rot-q4_0", "tq4", "tq3", "tq2"})
    c.push_back({name, name, name, std::nullopt, std::nullopt});
  c.push_back({"rot-kivi4/R128", "rot-kivi4", "rot-kivi4", 32, 128});
  auto mixed = [&](std::string const& k, std::string const& v) {
    bool const kivi = k.find("kivi") != std::string::npos || v.find("kivi") != std::string::npos;
    c.push_back({k + "-K/" + v + "-V", k, v, kivi ? std::optional<int>(32) : std::nullopt,
                 kivi ? std::optional<int>(128) : std::nullopt});
  };
  mixed("q8_0", "q4_0");
  mixed("f16", "q4_0");
  mixed("int8", "kivi4");
  mixed("q8_0", "kivi4");
  mixed("kivi8", "kivi4");
  mixed("kivi4", "kivi2");
  mixed("rot-q4_0", "q4_0");
  mixed("rot-q8_0", "rot-q4_0");
  mixed("rot-kivi4", "kivi4");
  // Centered keys (codec/centered.hpp) beside the plain and rotated q4_0 keys.
  mixed("ctr-q4_0", "q4_0");
  mixed("ctr-rot-q4_0", "q4_0");
  mixed("ctr-rot-q4_0", "rot-q4_0");
  return c;
}

/// The configurations named in a comma-separated list of labels, in list order.
inline auto select_configs(std::vector<config> const& all, std::string const& labels) -> std::vector<config> {
  std::vector<config> out;
  std::stringstream ss(labels);
  std::string item;
  while (std::getline(ss, item, ',')) {
    bool found = false;
    for (auto const& c : all)
      if (c.label == item) {
        out.push_back(c);
        found = true;
      }
    if (!found) throw std::invalid_argument("unknown configuration '" + item + "' (see --list)");
  }
  if (out.empty()) throw std::invalid_argument("--configs selects no configuration");
  return out;
}

}  // namespace kvq_eval
