// kvq: the host side of a multi-token attention on a GPU cache (CUDA, Metal): the CPU
// kvq::attention's checks, and the cut of its query tokens into kernel launches.
//
// A GPU backend runs the n_q query tokens of one sequence as launches of the partial-attention
// kernel (core/kernel_bodies.h, attention_block) over rows (query token, query head), each with
// the union of its rows' token ranges split as plan_attention says, and the combine kernel with
// the sinks. The helpers here are shared by backend/cuda and backend/metal.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "../attention.hpp"
#include "../detail/host_vector.hpp"
#include "../error.hpp"
#include "plans.hpp"

KVQ_NAMESPACE_BEGIN
namespace detail {

/// One launch of a multi-token attention: query tokens [first, first + tokens) of the call, whose
/// rows attend tokens [begin, end) at most, and its plan.
struct query_launch {
  std::int64_t first = 0;
  std::int64_t tokens = 0;
  std::int64_t begin = 0;
  std::int64_t end = 0;
  attention_plan plan;
};

/// Cuts a multi-token attention of n_q query tokens, token 0 at position `first` of a layer of
/// `len` tokens, into launches whose grid fits (at most 65535 blocks along the rows); plans each
/// with `plan(tokens, span, out)` (false: raises invalid_argument_error for head_dim d).
template <class Plan>
auto plan_query_launches(attention_options const& opt, std::int64_t n_q, std::int64_t first, std::int64_t len,
                         int kv_heads, int d, Plan&& plan) -> detail::vector<query_launch> {
  auto const fits = [&](std::int64_t tokens, std::int64_t span, attention_plan& p) {
    check<invalid_argument_error>(plan(static_cast<int>(tokens), span, p), [&] {
      return "attention: the shared memory of a block is too small for head_dim " + std::to_string(d);
    });
  };
  std::int64_t per = std::min<std::int64_t>(n_q, std::int64_t{1} << 20);
  attention_plan probe;
  fits(per, 0, probe);
  while (per > 1 && static_cast<std::int64_t>(kv_heads) * probe.chunks > 65535) {
    per = (per + 1) / 2;
    fits(per, 0, probe);
  }
  detail::vector<query_launch> launches;
  for (std::int64_t i0 = 0; i0 < n_q; i0 += per) {
    query_launch l;
    l.first = i0;
    l.tokens = std::min(per, n_q - i0);
    l.begin = std::numeric_limits<std::int64_t>::max();
    for (std::int64_t i = i0; i < i0 + l.tokens; ++i) {
      auto const [lo, hi] = query_token_range(opt, first + i, len);
      if (lo < hi) {
        l.begin = std::min(l.begin, lo);
        l.end = std::max(l.end, hi);
      }
    }
    if (l.end == 0) l.begin = 0;
    fits(l.tokens, l.end - l.begin, l.plan);
    launches.push_back(l);
  }
  return launches;
}

/// The checks of a multi-token attention of n_q query tokens over a layer of `len` tokens with
/// kv_heads kv heads, as the CPU kvq::attention's; returns the position of query token 0, and in
/// `kernel_opt` the options as the kernels take them (a window no query can reach is no window).
/// Raises invalid_argument_error for positions past the kernels' 32-bit range.
inline auto check_query_tokens(attention_options const& opt, std::int64_t n_q, int q_heads, int kv_heads,
                               std::int64_t len, void const* q, void const* out, attention_options& kernel_opt)
    -> std::int64_t {
  check<shape_error>(q_heads > 0 && q_heads % kv_heads == 0, [&] {
    return "attention: " + std::to_string(q_heads) + " query heads is not a positive multiple of " +
           std::to_string(kv_heads) + " kv heads";
  });
  check<shape_error>(n_q == 0 || (q != nullptr && out != nullptr),
                     [] { return std::string("attention: the query or the output is null"); });
  check_attention_options(opt);
  check_sinks(opt.sinks, q_heads);
  std::int64_t const first = opt.first_pos < 0 ? len - n_q : opt.first_pos;
  std::int64_t const stride = opt.mask_stride > 0 ? opt.mask_stride : len;
  check_query_chunk(opt, n_q, first, len, opt.mask_data, stride);
  check<invalid_argument_error>(first + n_q <= std::numeric_limits<std::int32_t>::max(), [&] {
    return "attention: query positions [" + std::to_string(first) + ", " + std::to_string(first + n_q) +
           ") exceed the GPU kernels' 32-bit positions";
  });
  kernel_opt = opt;
  kernel_opt.mask_stride = stride;
  if (kernel_opt.window >= first + n_q) kernel_opt.window = 0;  // every query's window starts at or before 0
  return first;
}

}  // namespace detail
KVQ_NAMESPACE_END
