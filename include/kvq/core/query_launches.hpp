// kvq: the host side of a multi-token attention on a GPU cache (CUDA, Metal): the CPU
// kvq::attention's checks, and the cut of its query tokens into kernel launches.
//
// A GPU backend runs the n_q query tokens of one sequence as launches of the partial-attention
// kernel (core/kernel_bodies.h, attention_block) over rows (query token, query head), each with
// the union of its rows' token ranges split as plan_attention says, and the combine kernel with
// the sinks. A batch of query chunks over a paged cache (kvq::paged_attention) runs as the
// launches of each chunk in turn, over its sequence's pages. The helpers here are shared by
// backend/cuda and backend/metal.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>

#include "../attention.hpp"
#include "../detail/host_vector.hpp"
#include "../error.hpp"
#include "../paged_attention.hpp"
#include "paged_core.hpp"
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

/// One launch of a batched multi-token attention over a paged cache: query tokens [row0, row0 +
/// tokens) of the call (rows of q and out), one sequence (z = 1), its arguments and plan, and its
/// first custom mask row (the chunk's mask_data advanced; null without a custom mask). With
/// plan.splits == 0 its rows attend nothing: the output rows are zeros.
struct paged_query_launch {
  std::int64_t row0 = 0;
  std::int64_t tokens = 0;
  void const* mask = nullptr;
  attention_plan plan;
  kvq_attention_args args{};
  kvq_attention_seq seq{};
};

/// The launches of a batched multi-token paged attention, the page-table buffer their sequences
/// index (one table per chunk, concatenated), the query rows in all, and the largest partial
/// state of a launch in floats.
struct paged_query_plan {
  detail::vector<paged_query_launch> launches;
  detail::vector<std::int32_t> pages;
  std::int64_t rows = 0;
  std::size_t scratch_floats = 0;
};

/// Checks a batched multi-token attention of `chunks` (kvq::query_chunk) over `layer` of the paged
/// core `core` as the CPU kvq::paged_attention does (plus the kernels' 32-bit positions), then cuts
/// each chunk into launches (plan_query_launches) planned for `dev`. q and out are only checked
/// for null. Raises as kvq::paged_attention; invalid_argument_error when a launch does not fit the
/// device's block memory.
template <class Core, class Chunk>
auto plan_paged_query_chunks(Core const& core, int layer, std::span<Chunk const> chunks, void const* q, int q_heads,
                             void const* out, attention_options const& opt, attention_device const& dev)
    -> paged_query_plan {
  auto const& shape = core.shape();
  int const kv = shape.kv_heads;
  int const d = shape.head_dim;
  auto const checked = check_paged_chunks(core, layer, chunks, q, q_heads, out, opt);
  paged_query_plan out_plan;
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    std::int64_t const first = checked[c].first, n_q = chunks[c].n_q;
    check<invalid_argument_error>(first + n_q <= std::numeric_limits<std::int32_t>::max(), [&] {
      return "attention: query positions [" + std::to_string(first) + ", " + std::to_string(first + n_q) +
             ") exceed the GPU kernels' 32-bit positions";
    });
    out_plan.rows += n_q;
  }
  bool const q8 = opt.query == query_precision::q8_0;
  float const scale = opt.scale > 0.0f ? opt.scale : 1.0f / std::sqrt(static_cast<float>(d));
  bool const custom = opt.mask == mask_kind::additive || opt.mask == mask_kind::boolean;
  std::size_t const elem = opt.mask == mask_kind::additive ? sizeof(float) : 1;
  std::int64_t row0 = 0;
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    Chunk const& ch = chunks[c];
    checked_chunk const& k = checked[c];
    if (ch.n_q == 0) continue;
    attention_options kopt = opt;
    kopt.first_pos = k.first;
    kopt.mask_data = ch.mask_data;
    kopt.mask_stride = k.stride;
    if (kopt.window >= k.first + ch.n_q) kopt.window = 0;  // every query's window starts at or before 0
    auto const launches =
        plan_query_launches(kopt, ch.n_q, k.first, k.len, kv, d, [&](int tokens, std::int64_t span, attention_plan& p) {
          return plan_attention(d, kv, q_heads, 1, span, q8, dev, p, tokens);
        });
    std::int32_t pages_first = -1;
    for (auto const& l : launches) {
      paged_query_launch pl;
      pl.row0 = row0 + l.first;
      pl.tokens = l.tokens;
      pl.plan = l.plan;
      if (l.plan.splits > 0) {
        pl.args = attention_arguments(core.key_side(), core.value_side(), d, kv, q_heads, l.plan, scale, opt.softcap,
                                      q8, detail::device_probabilities_f16(opt));
        set_paged_regions(core, layer, pl.args);
        set_query_tokens(pl.args, static_cast<int>(l.tokens), kopt, k.stride);
        if (pages_first < 0) {  // the chunk's page table, once
          pl.seq = paged_attention_sequence(core, layer, ch.seq, l.begin, l.end, out_plan.pages);
          pages_first = pl.seq.pages_first;
        } else {
          detail::vector<std::int32_t> unused;
          pl.seq = paged_attention_sequence(core, layer, ch.seq, l.begin, l.end, unused);
          pl.seq.pages_first = pages_first;
        }
        pl.seq.first_pos = static_cast<std::int32_t>(k.first + l.first);
        if (custom)
          pl.mask = static_cast<unsigned char const*>(ch.mask_data) +
                    static_cast<std::size_t>(l.first) * static_cast<std::size_t>(k.stride) * elem;
        out_plan.scratch_floats = std::max(out_plan.scratch_floats, l.plan.scratch_floats);
      }
      out_plan.launches.push_back(pl);
    }
    row0 += ch.n_q;
  }
  return out_plan;
}

}  // namespace detail
KVQ_NAMESPACE_END
