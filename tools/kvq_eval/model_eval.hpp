// kvq-eval: the real-model workload (llama2.c-format model, perplexity, KL and top-1 vs the f32 cache).
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "configs.hpp"
#include "report.hpp"

namespace kvq_eval {

/// An unreadable or invalid input file (exit status 2).
struct input_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline auto run_model(std::string const&, std::string const&, std::string const&, std::vector<config> const&, bool,
                      std::int64_t&) -> std::vector<result> {
  throw input_error("model workload not available yet");
}

}  // namespace kvq_eval
