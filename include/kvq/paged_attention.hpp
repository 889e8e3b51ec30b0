// kvq: batched attention over a paged cache (CPU): decode and multi-token.
//
//   out[b][h] = softmax(scale · q[b][h] · K_b[kv(h)]ᵀ) · V_b[kv(h)]   for every sequence b of a batch
//
// paged_decode_attention serves a batch of sequences of different lengths, one query token each:
// q and out are (sequences, q_heads, head_dim). paged_attention serves a batch of query chunks
// (a prefill chunk, a speculative draft, a decode token), each over its own sequence, with the
// masks of kvq::attention. Both run attention.hpp's multi-token driver: the work is cut into
// (chunk block, kv_head, split) items, a split being a run of whole pages (flash decoding), spread
// over `threads` threads; the partial states of a (block, kv_head) are merged in split order. The
// CPU attention kernels read the pages in place, one call per page and kv_head, with the options,
// NaN/Inf semantics and precision of decode_attention (attention.hpp).
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

/// Attends the rows of `call` to tokens [begin, end) of kv head `head` of sequence `seq`, page by
/// page, with the kernel `Kernel` (the driver's attend callback of the paged caches).
template <class Kernel, class Cache>
void attend_pages(Cache const& cache, int layer, sequence_id seq, int head, cpu_kernels::attention_call call,
                  float const* q, block_q8_0 const* qb, std::int64_t begin, std::int64_t end,
                  cpu_kernels::attention_state const& state, cpu_kernels::attention_scratch& scratch) {
  using key_codec = typename Cache::key_codec;
  using value_codec = typename Cache::value_codec;
  auto const& core = cache.core();
  int const d = cache.shape().head_dim;
  std::int64_t const pt = cache.shape().page_tokens;
  auto const& st = core.state(seq, layer);
  int const slot = core.slot_index_of(seq);
  auto const& table = core.page_table(seq);
  // The next page's first tokens are prefetched before this page is attended: the kernel fetches
  // one tile ahead inside a page, and the jump between pages would otherwise miss.
  std::int64_t const ahead = std::min<std::int64_t>(pt, 2 * cpu_kernels::attention_kernel_tile);
  int const key_tokens_per_unit = key_codec::geometry(d).tokens;
  std::int64_t p = begin / pt;
  vector<float> offsets;  // a centered key codec's logit offsets
  auto ks = page_source(core, true, st, layer, slot, table[static_cast<std::size_t>(p)], p, head);
  auto vs = page_source(core, false, st, layer, slot, table[static_cast<std::size_t>(p)], p, head);
  for (; p * pt < end; ++p) {
    std::int64_t const lb = std::max(begin, p * pt) - p * pt;
    std::int64_t const le = std::min(end, (p + 1) * pt) - p * pt;
    bool const more = (p + 1) * pt < end;
    cpu_kernels::token_source nks, nvs;
    if (more) {
      std::int32_t const np = table[static_cast<std::size_t>(p + 1)];
      nks = page_source(core, true, st, layer, slot, np, p + 1, head);
      nvs = page_source(core, false, st, layer, slot, np, p + 1, head);
      prefetch_page(nks, key_tokens_per_unit, ahead);
      prefetch_page(nvs, 1, ahead);
    }
    call.token_offset = p * pt;
    if constexpr (centered_codec<key_codec>)  // the sequence's μ: the same offsets on every page
      if (offsets.empty()) call = centered_call<key_codec>(call, q, cache.key_mean(seq, layer, head), offsets);
    Kernel::template attend<stored_codec_t<key_codec>, stored_codec_t<value_codec>>(
        ks, core.key_options(), vs, core.value_options(), call, q, qb, lb, le, state, scratch);
    if (more) {
      ks = nks;
      vs = nvs;
    }
  }
}

}  // namespace detail

/// One chunk of query tokens of one sequence in a batched paged attention: n_q tokens at
/// positions first_pos + i (−1: the sequence's last n_q tokens), with its own custom mask rows
/// (attention_options::mask_data layout, stride 0: the sequence's size) when the mask is custom.
struct query_chunk {
  sequence_id seq{};
  std::int64_t n_q = 1;
  std::int64_t first_pos = -1;
  void const* mask_data = nullptr;
  std::int64_t mask_stride = 0;
};

namespace detail {

/// A query chunk of a batched paged attention after its checks: its sequence's length, its first
/// position and its mask stride (both resolved from their defaults).
struct checked_chunk {
  std::int64_t len = 0;
  std::int64_t first = 0;
  std::int64_t stride = 0;
};

/// The checks of kvq::paged_attention that every backend shares: query heads, options, sinks,
/// the options' per-chunk fields left unset, the layer, every chunk's sequence, positions and mask,
/// and q / out not null when some chunk has queries. Returns the chunks' resolved positions.
template <class Core, class Chunk>
auto check_paged_chunks(Core const& core, int layer, std::span<Chunk const> chunks, void const* q, int q_heads,
                        void const* out, attention_options const& opt) -> detail::vector<checked_chunk> {
  int const kv = core.shape().kv_heads;
  check_query_heads(q_heads, kv);
  check_attention_options(opt);
  check_sinks(opt.sinks, q_heads);
  check<invalid_argument_error>(opt.first_pos == -1 && opt.mask_data == nullptr && opt.mask_stride == 0, [] {
    return std::string(
        "paged attention: first_pos, mask_data and mask_stride belong to each query_chunk, not the options");
  });
  core.check_layer(layer);
  detail::vector<checked_chunk> checked;
  checked.reserve(chunks.size());
  std::int64_t rows = 0;
  for (Chunk const& ch : chunks) {
    core.check_sequence(ch.seq, "attention");
    std::int64_t const len = core.size(ch.seq, layer);
    std::int64_t const first = ch.first_pos < 0 ? len - ch.n_q : ch.first_pos;
    std::int64_t const stride = ch.mask_stride > 0 ? ch.mask_stride : len;
    check_query_chunk(opt, ch.n_q, first, len, ch.mask_data, stride);
    checked.push_back({len, first, stride});
    rows += ch.n_q;
  }
  check<shape_error>(rows == 0 || (q != nullptr && out != nullptr),
                     [] { return std::string("attention: the query or the output is null"); });
  return checked;
}

/// Batched multi-token paged attention with the kernel `Kernel`; see paged_attention.
template <class Kernel, class Cache>
void paged_chunks_with(Cache const& cache, int layer, std::span<query_chunk const> chunks, float const* q, int q_heads,
                       float* out, attention_options const& opt, int threads) {
  using key_codec = typename Cache::key_codec;
  using value_codec = typename Cache::value_codec;
  auto const& shape = cache.shape();
  check<invalid_argument_error>(threads >= 1,
                                [&] { return "attention: threads = " + std::to_string(threads) + " must be >= 1"; });
  auto const checked = check_paged_chunks(cache.core(), layer, chunks, q, q_heads, out, opt);
  detail::vector<query_chunk_plan> plans;
  plans.reserve(chunks.size());
  std::int64_t rows = 0;
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    query_chunk const& ch = chunks[c];
    plans.push_back(
        {static_cast<int>(c), checked[c].len, checked[c].first, ch.n_q, rows, ch.mask_data, checked[c].stride});
    rows += ch.n_q;
  }
  run_query_chunks<key_codec, value_codec>(
      std::span<query_chunk_plan const>(plans), q, q_heads, shape.kv_heads, shape.head_dim, out, opt, threads,
      shape.page_tokens,
      [&](int entry, int head, cpu_kernels::attention_call const& call, float const* qr, block_q8_0 const* qb,
          std::int64_t begin, std::int64_t end, cpu_kernels::attention_state const& state,
          cpu_kernels::attention_scratch& scratch) {
        attend_pages<Kernel>(cache, layer, chunks[static_cast<std::size_t>(entry)].seq, head, call, qr, qb, begin, end,
                             state, scratch);
      });
}

/// Batched paged decode attention with the kernel `Kernel` (reference_attention or an ISA's
/// attention_kernel): one query token per sequence at its last position; see paged_decode_attention.
template <class Kernel, class Cache>
void paged_attention_with(Cache const& cache, int layer, std::span<sequence_id const> seqs, float const* q, int q_heads,
                          float* out, attention_options const& opt, int threads) {
  check_attention_options(opt);
  auto const& core = cache.core();
  core.check_layer(layer);
  // Each query sits at its sequence's last position and attends every token (none of an empty one).
  detail::vector<query_chunk> chunks;
  chunks.reserve(seqs.size());
  for (sequence_id s : seqs) {
    core.check_sequence(s, "attention");
    chunks.push_back({s, 1, std::max<std::int64_t>(0, core.size(s, layer) - 1), nullptr, 0});
  }
  attention_options o = opt;
  o.mask = mask_kind::none;
  o.first_pos = -1;
  o.mask_data = nullptr;
  o.mask_stride = 0;
  paged_chunks_with<Kernel>(cache, layer, std::span<query_chunk const>(chunks), q, q_heads, out, o, threads);
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

/// Multi-token attention of a batch of query chunks over `layer` of a paged cache (chunked
/// prefill, speculative verification and decode of many sequences in one call): q and out are
/// (Σ n_q, q_heads, head_dim) floats, the chunks' rows one after another. Each chunk attends its
/// sequence as kvq::attention attends a flat cache (opt.mask, window, sinks, precision; a chunk's
/// own first_pos and custom mask rows replace the options' first_pos / mask_data / mask_stride,
/// which must stay unset). `threads` >= 1 threads share the (chunk block, kv_head, page run)
/// items. Raises index_error for a bad layer, an unknown sequence or bad positions, shape_error for
/// a null q / out or q_heads not a positive multiple of kv_heads, invalid_argument_error for bad
/// options, sinks, masks or threads < 1.
template <class Cache>
void paged_attention(Cache const& cache, int layer, std::span<query_chunk const> chunks, float const* q, int q_heads,
                     float* out, attention_options const& opt = {}, int threads = 1) {
  detail::paged_chunks_with<detail::default_attention>(cache, layer, chunks, q, q_heads, out, opt, threads);
}

KVQ_NAMESPACE_END
