// kvq: batched decode attention over a paged cache (CPU).
//
//   out[b][h] = softmax(scale · q[b][h] · K_b[kv(h)]ᵀ) · V_b[kv(h)]   for every sequence b of a batch
//
// One call serves a batch of sequences of different lengths, one query token each: q and out are
// (sequences, q_heads, head_dim). The work is cut into (sequence, kv_head, split) items, a split
// being a run of whole pages (flash decoding), spread over `threads` threads; the partial states
// of a (sequence, kv_head) are merged in split order. The CPU attention kernels read the pages in
// place, one call per page and kv_head, with the options, NaN/Inf semantics and precision of
// decode_attention (attention.hpp).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "attention.hpp"
#include "paged_cache.hpp"

KVQ_NAMESPACE_BEGIN
namespace detail {

/// The attention kernel's view of the keys (or values) of (layer, kv_head) in page `page_index` of
/// a sequence in slot `slot` at state `st`: tokens relative to the page.
template <class Core>
auto page_source(Core const& core, bool keys, layer_state const& st, int layer, int slot, std::int32_t page,
                 std::int64_t page_index, int head) -> cpu_kernels::token_source {
  kvq_region const r = core.page_region(keys, st, layer, slot, page, page_index);
  cpu_kernels::token_source s;
  auto const* base = reinterpret_cast<std::uint8_t const*>(core.pool());
  s.units = base + r.head0 + static_cast<std::size_t>(head) * r.head_stride;
  s.unit_bytes = r.unit_bytes;
  s.quantized = r.quantized;
  s.residual =
      reinterpret_cast<std::uint16_t const*>(base + r.residual0 + static_cast<std::size_t>(head) * r.residual_stride);
  s.residual_capacity = std::max<std::int32_t>(r.residual_rows, 1);
  s.residual_first = r.residual_first;
  return s;
}

/// Asks for the units of tokens [0, tokens) of a page (units of `per_unit` tokens) to be brought
/// into cache.
inline void prefetch_page(cpu_kernels::token_source const& s, int per_unit, std::int64_t tokens) noexcept {
  std::int64_t const n = std::min(tokens, s.quantized);
  if (n <= 0) return;
  std::size_t const bytes = static_cast<std::size_t>((n + per_unit - 1) / per_unit) * s.unit_bytes;
#if defined(__GNUC__)
  for (std::size_t b = 0; b < bytes; b += 64) __builtin_prefetch(s.units + b, 0, 3);
#else
  (void)bytes;
#endif
}

/// One work item of a batched attention: kv_head `head` of batch entry `entry` over tokens
/// [begin, end), its partial state at `state` of the result.
struct paged_item {
  int entry = 0;
  int head = 0;
  std::int64_t begin = 0;
  std::int64_t end = 0;
};

/// Batched paged attention with the kernel `Kernel` (reference_attention or an ISA's
/// attention_kernel); see paged_decode_attention.
template <class Kernel, class Cache>
void paged_attention_with(Cache const& cache, int layer, std::span<sequence_id const> seqs, float const* q, int q_heads,
                          float* out, attention_options const& opt, int threads) {
  using key_codec = typename Cache::key_codec;
  using value_codec = typename Cache::value_codec;
  auto const& core = cache.core();
  auto const& shape = cache.shape();
  int const d = shape.head_dim;
  int const kv = shape.kv_heads;
  check<shape_error>(q_heads > 0 && q_heads % kv == 0, [&] {
    return "attention: " + std::to_string(q_heads) + " query heads is not a positive multiple of " +
           std::to_string(kv) + " kv heads";
  });
  check<shape_error>(seqs.empty() || (q != nullptr && out != nullptr),
                     [] { return std::string("attention: the query or the output is null"); });
  check<invalid_argument_error>(threads >= 1,
                                [&] { return "attention: threads = " + std::to_string(threads) + " must be >= 1"; });
  check_attention_options(opt);
  core.check_layer(layer);
  for (sequence_id s : seqs) core.check_sequence(s, "attention");

  int const group = q_heads / kv;
  std::size_t const hd = static_cast<std::size_t>(d);
  std::int64_t const pt = shape.page_tokens;
  int const batch = static_cast<int>(seqs.size());

  // Work items: every (entry, kv_head), split into runs of whole pages when threads > 1.
  std::int64_t total = 0;
  detail::vector<std::int64_t> begins(seqs.size()), ends(seqs.size());
  for (int b = 0; b < batch; ++b) {
    std::int64_t const len = core.size(seqs[static_cast<std::size_t>(b)], layer);
    std::int64_t const begin = opt.window > 0 ? std::max<std::int64_t>(0, len - opt.window) : 0;
    begins[static_cast<std::size_t>(b)] = begin;
    ends[static_cast<std::size_t>(b)] = len;
    total += len - begin;
  }
  std::int64_t split = std::numeric_limits<std::int64_t>::max();
  if (threads > 1) {
    std::int64_t const want = static_cast<std::int64_t>(threads) * 4;  // items per thread, for balance
    std::int64_t const per = (total * kv + want - 1) / want / kv;
    split = std::max<std::int64_t>(pt, (std::max<std::int64_t>(per, 256) + pt - 1) / pt * pt);
  }
  detail::vector<paged_item> items;
  detail::vector<std::size_t> first_item(static_cast<std::size_t>(batch) * static_cast<std::size_t>(kv) + 1);
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < kv; ++h) {
      first_item[static_cast<std::size_t>(b) * static_cast<std::size_t>(kv) + static_cast<std::size_t>(h)] =
          items.size();
      std::int64_t const begin = begins[static_cast<std::size_t>(b)];
      std::int64_t const end = ends[static_cast<std::size_t>(b)];
      for (std::int64_t t = begin; t < end;) {
        std::int64_t const e =
            std::min(end, split == std::numeric_limits<std::int64_t>::max() ? end : (t / split + 1) * split);
        items.push_back({b, h, t, e});
        t = e;
      }
    }
  first_item.back() = items.size();

  // Queries, prepared once per entry.
  detail::vector<prepared_query> queries;
  queries.reserve(seqs.size());
  for (int b = 0; b < batch; ++b)
    queries.push_back(prepare_query<key_codec>(q + static_cast<std::size_t>(b) * static_cast<std::size_t>(q_heads) * hd,
                                               q_heads, d, opt));
  cpu_kernels::attention_call const call = attention_call_of(d, group, opt);

  // Partial states per item: out (group, d), max (group), sum (group).
  std::size_t const stride = static_cast<std::size_t>(group) * (hd + 2);
  detail::vector<float> states(items.size() * stride);
  auto run = [&](std::size_t i, cpu_kernels::attention_scratch& scratch) {
    paged_item const& it = items[i];
    sequence_id const seq = seqs[static_cast<std::size_t>(it.entry)];
    auto const& st = core.state(seq, layer);
    int const slot = core.slot_index_of(seq);
    auto const& table = core.page_table(seq);
    float* o = states.data() + i * stride;
    float* m = o + static_cast<std::size_t>(group) * hd;
    float* l = m + group;
    std::fill(o, o + static_cast<std::size_t>(group) * hd, 0.0f);
    std::fill(m, m + group, -std::numeric_limits<float>::infinity());
    std::fill(l, l + group, 0.0f);
    cpu_kernels::attention_state const state{o, m, l};
    std::size_t const h0 = static_cast<std::size_t>(it.head) * static_cast<std::size_t>(group);
    prepared_query const& pq = queries[static_cast<std::size_t>(it.entry)];
    // The next page's first tokens are prefetched before this page is attended: the kernel fetches
    // one tile ahead inside a page, and the jump between pages would otherwise miss.
    std::int64_t const ahead = std::min<std::int64_t>(pt, 2 * cpu_kernels::attention_kernel_tile);
    int const key_tokens_per_unit = key_codec::geometry(d).tokens;
    std::int64_t p = it.begin / pt;
    auto ks = page_source(core, true, st, layer, slot, table[static_cast<std::size_t>(p)], p, it.head);
    auto vs = page_source(core, false, st, layer, slot, table[static_cast<std::size_t>(p)], p, it.head);
    for (; p * pt < it.end; ++p) {
      std::int64_t const lb = std::max(it.begin, p * pt) - p * pt;
      std::int64_t const le = std::min(it.end, (p + 1) * pt) - p * pt;
      bool const more = (p + 1) * pt < it.end;
      cpu_kernels::token_source nks, nvs;
      if (more) {
        std::int32_t const np = table[static_cast<std::size_t>(p + 1)];
        nks = page_source(core, true, st, layer, slot, np, p + 1, it.head);
        nvs = page_source(core, false, st, layer, slot, np, p + 1, it.head);
        prefetch_page(nks, key_tokens_per_unit, ahead);
        prefetch_page(nvs, 1, ahead);
      }
      Kernel::template attend<key_codec, value_codec>(ks, core.key_options(), vs, core.value_options(), call,
                                                      pq.query(h0), pq.blocks(h0), lb, le, state, scratch);
      if (more) {
        ks = nks;
        vs = nvs;
      }
    }
  };

  int const workers = static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(threads), items.size()));
  if (workers <= 1) {
    cpu_kernels::attention_scratch scratch;
    scratch.reserve(d, group);
    for (std::size_t i = 0; i < items.size(); ++i) run(i, scratch);
  } else {
    std::atomic<std::size_t> next{0};
    detail::vector<std::exception_ptr> errors(static_cast<std::size_t>(workers));
    auto work = [&](int w) {
      try {
        cpu_kernels::attention_scratch scratch;
        scratch.reserve(d, group);
        for (std::size_t i = next++; i < items.size(); i = next++) run(i, scratch);
      } catch (...) {
        errors[static_cast<std::size_t>(w)] = std::current_exception();
      }
    };
    detail::vector<std::thread> pool;
    pool.reserve(static_cast<std::size_t>(workers - 1));
    try {
      for (int w = 1; w < workers; ++w) pool.emplace_back(work, w);
    } catch (...) {
      next = items.size();  // no more work for the running threads
      for (auto& t : pool) t.join();
      throw;
    }
    work(0);
    for (auto& t : pool) t.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  }

  // Merge the splits of every (entry, kv_head) in order, then normalise (as combine and finalize).
  attention_partial part = attention_partial::empty(group, d);  // a split's state, reused
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < kv; ++h) {
      std::size_t const k = static_cast<std::size_t>(b) * static_cast<std::size_t>(kv) + static_cast<std::size_t>(h);
      attention_partial acc = attention_partial::empty(group, d);
      for (std::size_t i = first_item[k]; i < first_item[k + 1]; ++i) {
        float const* o = states.data() + i * stride;
        float const* m = o + static_cast<std::size_t>(group) * hd;
        float const* l = m + group;
        attention_partial& into = i == first_item[k] ? acc : part;
        std::copy(o, o + static_cast<std::size_t>(group) * hd, into.out.begin());
        std::copy(m, m + group, into.max.begin());
        std::copy(l, l + group, into.sum.begin());
        if (i != first_item[k]) combine(acc, part);
      }
      finalize(acc, out + (static_cast<std::size_t>(b) * static_cast<std::size_t>(q_heads) +
                           static_cast<std::size_t>(h) * static_cast<std::size_t>(group)) *
                              hd);
    }
}

}  // namespace detail

/// Decode attention of one query token per sequence of `seqs` over `layer` of a paged cache:
/// q and out are (seqs.size(), q_heads, head_dim) floats. Sequences may have any lengths (an empty
/// one outputs zeros) and may repeat. Options as decode_attention; `threads` >= 1 threads share
/// the (sequence, kv_head, split) items. Raises index_error for a bad layer or an unknown
/// sequence, shape_error for a null q / out or q_heads not a positive multiple of kv_heads,
/// invalid_argument_error for bad options or threads < 1. Runs the best SIMD kernel compiled in,
/// else the scalar reference.
template <class Cache>
void paged_decode_attention(Cache const& cache, int layer, std::span<sequence_id const> seqs, float const* q,
                            int q_heads, float* out, attention_options const& opt = {}, int threads = 1) {
  detail::paged_attention_with<detail::default_attention>(cache, layer, seqs, q, q_heads, out, opt, threads);
}

KVQ_NAMESPACE_END
