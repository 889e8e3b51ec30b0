// kvq: the paged cache core, the one implementation of a paged quantized KV cache's host logic.
//
// `paged_core<Choice, Device>` keeps many sequences in one pool of fixed-size pages on a device of
// the cache core (core/cache_core.hpp): page tables, reference counts with copy-on-write, sequence
// ids, and per sequence and layer the same state machine and plans as the flat cache (plans.hpp),
// its write and decode steps cut at page boundaries. Bytes, KIVI residual rules and NaN semantics
// are therefore the flat cache's by construction.
//
// Pool layout (documented contract, see paged_cache.hpp): one device allocation holding `pages`
// pages of `page_bytes` each, then `max_sequences` residual slots of `slot_bytes` each.
//   page p, at byte p * page_bytes: for each layer l, for each kv_head h, the key units of the
//     page's page_tokens tokens (rows, or page_tokens / G KIVI key tiles), then for each kv_head h
//     the value rows; every array 64-byte aligned.
//   slot s (KIVI only; empty otherwise): for each layer, for each kv_head, the f16 key residual
//     (F rows of head_dim), then for each kv_head the f16 value window (R rows); each aligned.
// Token t of a sequence lives in page page_table[t / page_tokens] at index t % page_tokens.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <string>
#include <utility>

#include "cache_core.hpp"

KVQ_NAMESPACE_BEGIN

/// Shape of a paged cache: the pool of pages shared by every sequence.
struct paged_shape {
  int layers = 0;
  int kv_heads = 0;
  int head_dim = 0;
  int page_tokens = 0;     ///< tokens per page (of every layer); a multiple of every KIVI group in use
  std::int64_t pages = 0;  ///< pages in the pool
  int max_sequences = 64;  ///< live sequences at most (a KIVI sequence holds its f16 residual rows)
  friend constexpr bool operator==(paged_shape const&, paged_shape const&) = default;
};

/// Identifies a sequence of a paged cache; never reused, so a released id stays invalid.
using sequence_id = std::int64_t;

/// Page use of a paged cache.
struct page_report {
  std::int64_t pages = 0;         ///< pages in the pool
  std::int64_t free_pages = 0;    ///< pages no sequence holds
  std::int64_t used_pages = 0;    ///< pages held by at least one sequence
  std::int64_t shared_pages = 0;  ///< pages held by two sequences or more
  std::int64_t sequences = 0;     ///< live sequences
  std::int64_t page_refs = 0;     ///< sum over live sequences of their page-table lengths
  std::size_t page_bytes = 0;     ///< bytes of one page
  std::size_t used_bytes = 0;     ///< used_pages * page_bytes
};

namespace detail {

/// The byte geometry of a paged pool (see the file comment).
struct paged_geometry {
  std::size_t key_units = 0;    // aligned key bytes of one (page, layer, kv_head)
  std::size_t value_units = 0;  // aligned value bytes of one (page, layer, kv_head)
  std::size_t key_raw = 0;      // key bytes before alignment
  std::size_t value_raw = 0;    // value bytes before alignment
  std::size_t layer_bytes = 0;  // bytes of one layer inside a page
  std::size_t page_bytes = 0;
  std::size_t key_residual = 0;    // aligned f16 key residual bytes of one (slot, layer, kv_head)
  std::size_t value_residual = 0;  // aligned f16 value window bytes of one (slot, layer, kv_head)
  std::size_t key_residual_raw = 0;
  std::size_t value_residual_raw = 0;
  std::size_t slot_layer_bytes = 0;
  std::size_t slot_bytes = 0;
  std::size_t slots0 = 0;  // byte offset of slot 0
  std::size_t total = 0;   // bytes of the pool allocation
};

/// The pool geometry of key codec K and value codec V for a valid paged shape.
template <codec K, codec V>
auto make_paged_geometry(paged_shape const& s, int residual) -> paged_geometry {
  cache_shape const page{s.layers, s.kv_heads, s.head_dim, s.page_tokens};
  auto const k = region_layout<K, false>::make(page, residual);
  auto const v = region_layout<V, true>::make(page, residual);
  std::size_t const kv = static_cast<std::size_t>(s.kv_heads);
  paged_geometry g;
  g.key_raw = k.units_raw;
  g.value_raw = v.units_raw;
  g.key_units = k.units_bytes;
  g.value_units = v.units_bytes;
  g.layer_bytes = kv * (g.key_units + g.value_units);
  g.page_bytes = static_cast<std::size_t>(s.layers) * g.layer_bytes;
  if constexpr (K::layout == codec_layout::token_group) {
    g.key_residual_raw = k.residual_raw;
    g.key_residual = k.residual_bytes;
  }
  if constexpr (has_value_window<V>::value) {
    g.value_residual_raw = v.residual_raw;
    g.value_residual = v.residual_bytes;
  }
  g.slot_layer_bytes = kv * (g.key_residual + g.value_residual);
  g.slot_bytes = static_cast<std::size_t>(s.layers) * g.slot_layer_bytes;
  g.slots0 = static_cast<std::size_t>(s.pages) * g.page_bytes;
  g.total = g.slots0 + static_cast<std::size_t>(s.max_sequences) * g.slot_bytes;
  return g;
}

/// Raises invalid_argument_error unless a paged cache of key codec K and value codec V may have
/// `s` and these options: the flat cache's rules (check_cache_options) for a cache of one page,
/// 1 <= pages, 1 <= max_sequences <= 2^20, page_tokens a multiple of every KIVI group in use, and
/// the pool's byte size within size_t.
template <codec K, codec V>
void check_paged_options(paged_shape const& s, int residual, typename K::params_type const& key,
                         typename V::params_type const& value, std::int64_t max_capacity, char const* who) {
  check_cache_options<K, V>(cache_shape{s.layers, s.kv_heads, s.head_dim, std::max(s.page_tokens, 1)}, residual, key,
                            value, max_capacity, who);
  check<invalid_argument_error>(s.page_tokens >= 1 && s.page_tokens <= (1 << 20), [&] {
    return std::string(who) + ": page_tokens = " + std::to_string(s.page_tokens) + " must be in [1, 2^20]";
  });
  check<invalid_argument_error>(s.pages >= 1 && s.pages <= std::numeric_limits<std::int32_t>::max(), [&] {
    return std::string(who) + ": pages = " + std::to_string(s.pages) + " must be in [1, 2^31 - 1]";
  });
  check<invalid_argument_error>(s.max_sequences >= 1 && s.max_sequences <= (1 << 20), [&] {
    return std::string(who) + ": max_sequences = " + std::to_string(s.max_sequences) + " must be in [1, 2^20]";
  });
  int g = 1;
  if constexpr (K::layout == codec_layout::token_group) g = std::lcm(g, K::group);
  if constexpr (has_value_window<V>::value) g = std::lcm(g, V::group);
  check<invalid_argument_error>(s.page_tokens % g == 0, [&] {
    return std::string(who) + ": page_tokens = " + std::to_string(s.page_tokens) +
           " must be a multiple of the KIVI group G = " + std::to_string(g);
  });
  auto const one =
      make_paged_geometry<K, V>(paged_shape{s.layers, s.kv_heads, s.head_dim, s.page_tokens, 1, 1}, residual);
  double const bytes = static_cast<double>(s.pages) * static_cast<double>(one.page_bytes) +
                       static_cast<double>(s.max_sequences) * static_cast<double>(one.slot_bytes);
  check<invalid_argument_error>(bytes <= static_cast<double>(std::numeric_limits<std::size_t>::max()) / 2, [&] {
    return std::string(who) + ": " + std::to_string(s.pages) + " pages of " + std::to_string(one.page_bytes) +
           " bytes need more bytes than size_t can hold";
  });
}

/// Adjusts a write source so that batch row `skip` becomes row 0 (see kvq_source).
inline auto skip_rows(kvq_source s, std::int64_t skip, std::int32_t residual_rows) -> kvq_source {
  if (skip <= 0) return s;
  if (skip < s.from_residual) {
    s.from_residual -= static_cast<std::int32_t>(skip);
    s.residual_first = static_cast<std::int32_t>((s.residual_first + skip) % residual_rows);
  } else {
    s.first += static_cast<std::int32_t>(skip - s.from_residual);
    s.from_residual = 0;
    s.residual_first = 0;
  }
  return s;
}

}  // namespace detail

/// The host logic of a paged cache of codec choice `Choice` on `Device` (see the file comment).
template <codec_choice Choice, class Device>
class paged_core : public core_base<Choice, Device> {
  using base = core_base<Choice, Device>;

 public:
  using base::check_usable;
  using base::succeed;
  using typename base::input_type;
  using typename base::key_codec;
  using typename base::key_params;
  using typename base::layer_type;
  using typename base::output_type;
  using typename base::stream_type;
  using typename base::value_codec;
  using typename base::value_params;

  /// Validates shape and options (check_paged_options), then allocates the pool, zero-filled.
  /// Raises invalid_argument_error on a bad shape or option, and what the device raises when the
  /// allocation fails.
  paged_core(paged_shape const& shape, int residual, key_params const& key, value_params const& value, Device dev)
      : dev_(std::move(dev)),
        shape_(validated(shape, residual, key, value)),
        residual_(residual),
        key_(key),
        value_(value),
        geo_(detail::make_paged_geometry<key_codec, value_codec>(shape_, residual)) {
    cache_shape const page{shape_.layers, shape_.kv_heads, shape_.head_dim, shape_.page_tokens};
    key_side_ = detail::make_cache_side<key_codec, false>(page, residual, key, 0, geo_.key_units);
    value_side_ = detail::make_cache_side<value_codec, true>(page, residual, value, 0, geo_.value_units);
    refs_.assign(static_cast<std::size_t>(shape_.pages), 0);
    free_.reserve(static_cast<std::size_t>(shape_.pages));
    for (std::int64_t p = shape_.pages; p-- > 0;) free_.push_back(static_cast<std::int32_t>(p));
    slots_.resize(static_cast<std::size_t>(shape_.max_sequences));
    if constexpr (base::device_means) {  // per (slot, layer) the key means (kv_heads, head_dim) f32, after the slots
      key_side_.device_means = true;
      means0_ = (alloc_bytes() + storage_alignment - 1) / storage_alignment * storage_alignment;
      means_bytes_ =
          static_cast<std::size_t>(shape_.kv_heads) * static_cast<std::size_t>(shape_.head_dim) * sizeof(float);
    }
    pool_ = dev_.allocate(device_bytes());
  }

  paged_core(paged_core const&) = delete;
  paged_core& operator=(paged_core const&) = delete;
  paged_core& operator=(paged_core&&) = delete;
  ~paged_core() { dev_.deallocate(pool_, device_bytes()); }

  auto shape() const noexcept -> paged_shape const& { return shape_; }
  auto residual() const noexcept -> int { return residual_; }
  auto key_options() const noexcept -> key_params const& { return key_; }
  auto value_options() const noexcept -> value_params const& { return value_; }
  auto key_side() const noexcept -> detail::cache_side const& { return key_side_; }
  auto value_side() const noexcept -> detail::cache_side const& { return value_side_; }
  auto geometry() const noexcept -> detail::paged_geometry const& { return geo_; }
  auto device() noexcept -> Device& { return dev_; }
  auto device() const noexcept -> Device const& { return dev_; }
  /// The pool allocation.
  auto pool() const noexcept -> layer_type { return pool_; }

  // ---- sequences -------------------------------------------------------------------------------

  /// Starts an empty sequence. Raises capacity_error when max_sequences are live.
  auto add_sequence() -> sequence_id {
    check_usable();
    int const s = free_slot("add_sequence");
    slot& x = slots_[static_cast<std::size_t>(s)];
    x.live = true;
    x.pages.clear();
    x.layers.assign(static_cast<std::size_t>(shape_.layers), detail::layer_state{});
    ++live_;
    return id_of(s);
  }

  /// Starts a sequence that shares every page and token of `parent` (copy-on-write: a later write
  /// into a shared page copies it first). Raises index_error for an unknown or released parent,
  /// capacity_error when max_sequences are live.
  auto fork(sequence_id parent, stream_type stream) -> sequence_id {
    check_usable();
    int const ps = slot_of(parent, "fork");
    int const s = free_slot("fork");
    slot& x = slots_[static_cast<std::size_t>(s)];
    slot const& p = slots_[static_cast<std::size_t>(ps)];
    x.pages = p.pages;
    x.layers = p.layers;
    if (geo_.slot_bytes > 0) {
      succeed(dev_.move(pool_, 0, geo_.slot_bytes, 1,
                        detail::byte_move{slot_offset(ps), slot_offset(s), geo_.slot_bytes}, stream));
      succeed(dev_.finish(stream));
    }
    if (means_bytes_ > 0) {  // centered keys on a GPU: the child starts with the parent's key means
      std::size_t const bytes = static_cast<std::size_t>(shape_.layers) * means_bytes_;
      succeed(dev_.move(pool_, 0, bytes, 1, detail::byte_move{key_means_offset(ps, 0), key_means_offset(s, 0), bytes},
                        stream));
      succeed(dev_.finish(stream));
    }
    for (std::int32_t pg : x.pages) ++refs_[static_cast<std::size_t>(pg)];
    x.live = true;
    ++live_;
    return id_of(s);
  }

  /// Ends a sequence, returning the pages no other sequence holds. Raises index_error for an
  /// unknown or released sequence.
  void release(sequence_id seq) {
    int const s = slot_of(seq, "release");
    slot& x = slots_[static_cast<std::size_t>(s)];
    drop_pages(x, 0);
    x.layers.clear();
    x.live = false;
    ++x.generation;
    --live_;
  }

  /// Takes the pages that n more tokens (past size(seq)) need, or raises capacity_error having
  /// taken none. Raises index_error for an unknown or released sequence, invalid_argument_error
  /// for n < 0.
  void reserve(sequence_id seq, std::int64_t n) {
    check_usable();
    int const s = slot_of(seq, "reserve");
    detail::check<invalid_argument_error>(n >= 0, [&] { return "reserve: n = " + std::to_string(n) + " is negative"; });
    slot& x = slots_[static_cast<std::size_t>(s)];
    std::int64_t const want = pages_for(length_of(x) + n);
    std::int64_t const have = static_cast<std::int64_t>(x.pages.size());
    check_tokens("reserve", length_of(x), n);
    check_pages("reserve", want - have);
    while (static_cast<std::int64_t>(x.pages.size()) < want) x.pages.push_back(take_page());
  }

  /// Tokens of the longest layer of `seq` (the tokens its pages hold). Raises index_error.
  auto size(sequence_id seq) const -> std::int64_t { return length_of(slots_[slot_index(seq, "size")]); }
  /// Tokens of `layer` of `seq`. Raises index_error.
  auto size(sequence_id seq, int layer) const -> std::int64_t { return state(seq, layer).length; }
  /// The state of `layer` of `seq`. Raises index_error.
  auto state(sequence_id seq, int layer) const -> detail::layer_state const& {
    slot const& x = slots_[slot_index(seq, "size")];
    check_layer(layer);
    return x.layers[static_cast<std::size_t>(layer)];
  }
  /// The page ids of `seq` in token order (valid until the next non-const call). Raises index_error.
  auto page_table(sequence_id seq) const -> detail::vector<std::int32_t> const& {
    return slots_[slot_index(seq, "page_table")].pages;
  }
  /// The residual slot index of `seq`. Raises index_error.
  auto slot_index_of(sequence_id seq) const -> int { return static_cast<int>(slot_index(seq, "slot")); }
  /// True when `seq` names a live sequence.
  auto contains(sequence_id seq) const noexcept -> bool { return find_slot(seq) >= 0; }
  /// Ids of the live sequences, in slot order.
  auto sequences() const -> detail::vector<sequence_id> {
    detail::vector<sequence_id> ids;
    for (std::size_t s = 0; s < slots_.size(); ++s)
      if (slots_[s].live) ids.push_back(id_of(static_cast<int>(s)));
    return ids;
  }

  /// Page use of the pool.
  auto pages() const noexcept -> page_report {
    page_report r;
    r.pages = shape_.pages;
    r.free_pages = static_cast<std::int64_t>(free_.size());
    r.used_pages = r.pages - r.free_pages;
    for (std::int32_t c : refs_) r.shared_pages += c > 1 ? 1 : 0;
    r.sequences = live_;
    for (slot const& x : slots_)
      if (x.live) r.page_refs += static_cast<std::int64_t>(x.pages.size());
    r.page_bytes = geo_.page_bytes;
    r.used_bytes = static_cast<std::size_t>(r.used_pages) * geo_.page_bytes;
    return r;
  }

  /// Memory of the pool, every byte accounted for; bytes_per_token and bits_per_element are those
  /// of a full pool (pages * page_tokens tokens).
  auto memory() const noexcept -> memory_report {
    std::size_t const lh = static_cast<std::size_t>(shape_.layers) * static_cast<std::size_t>(shape_.kv_heads);
    std::size_t const np = static_cast<std::size_t>(shape_.pages);
    std::size_t const ns = static_cast<std::size_t>(shape_.max_sequences);
    memory_report m;
    m.total_bytes = alloc_bytes();
    m.key_bytes = np * lh * geo_.key_raw;
    m.value_bytes = np * lh * geo_.value_raw;
    m.residual_bytes = ns * lh * (geo_.key_residual_raw + geo_.value_residual_raw);
    m.alignment_bytes = m.total_bytes - m.key_bytes - m.value_bytes - m.residual_bytes;
    double const tokens = static_cast<double>(shape_.pages) * shape_.page_tokens;
    m.bytes_per_token = static_cast<double>(m.total_bytes) / tokens;
    m.bits_per_element = static_cast<double>(m.total_bytes) * 8.0 /
                         (tokens * static_cast<double>(lh) * static_cast<double>(shape_.head_dim) * 2.0);
    return m;
  }

  // ---- checks ----------------------------------------------------------------------------------

  void check_layer(int layer) const { detail::check_layer_index(layer, shape_.layers); }
  void check_head(int head) const { detail::check_head_index(head, shape_.kv_heads); }
  /// Raises index_error unless `seq` is live; `what` names the operation.
  void check_sequence(sequence_id seq, char const* what) const { (void)slot_index(seq, what); }

  // ---- append ----------------------------------------------------------------------------------

  /// Raises what an append of `keys` and `values` to `layer` of `seq` would violate: index_error
  /// (sequence, layer), shape_error (tensors), capacity_error (tokens past the device's limit, or
  /// more pages than the pool has free, copies of shared pages included).
  void check_append(sequence_id seq, int layer, detail::kv_tensor_desc const& keys,
                    detail::kv_tensor_desc const& values) const {
    check_usable();
    std::size_t const s = slot_index(seq, "append");
    check_layer(layer);
    detail::check_append_tensors(shape_.kv_heads, shape_.head_dim, keys, values);
    slot const& x = slots_[s];
    std::int64_t const length = x.layers[static_cast<std::size_t>(layer)].length;
    check_tokens("append", length, keys.tokens);
    check_pages("append", pages_needed(x, layer, keys.tokens));
  }

  /// Appends n checked tokens (check_append) to `layer` of `seq`: takes the new pages, copies the
  /// shared pages the writes touch, then runs the flat cache's plan cut at page boundaries.
  void append_checked(sequence_id seq, int layer, std::int64_t n, input_type keys, kvq_source ks, input_type values,
                      kvq_source vs, stream_type stream) {
    if (n == 0) return;
    int const s = slot_of(seq, "append");
    slot& x = slots_[static_cast<std::size_t>(s)];
    auto& st = x.layers[static_cast<std::size_t>(layer)];
    kvq_source kc = ks;  // centered keys on a GPU: input rows less the sequence's mu
    if constexpr (base::device_means) {
      kc.mean = 1;
      kc.mean0 = key_means_offset(s, layer);
    }
    auto const plan = detail::plan_append(key_side_, value_side_, shape_.head_dim, shape_.kv_heads, st, n, kc, vs);
    std::int64_t const want = pages_for(std::max(length_of(x), st.length + n));
    while (static_cast<std::int64_t>(x.pages.size()) < want) x.pages.push_back(take_page());
    for (int i = 0; i < plan.count; ++i) {
      auto const r = unit_tokens(plan.steps[i]);
      own_pages(x, r.first, r.second, stream);
    }
    if constexpr (base::device_means) {  // the first chunk into an empty layer fixes the sequence's mu
      if (st.length == 0)
        succeed(dev_.template write<key_codec>(
            detail::key_mean_step(shape_.head_dim, shape_.kv_heads, n, ks, key_means_offset(s, layer)), pool_, keys,
            stream));
    }
    for (int i = 0; i < plan.count; ++i) {
      detail::write_step const& step = plan.steps[i];
      if (step.kernel == detail::write_kernel::store_f16_rows) {
        write_piece(step, step.args.dst, layer, s, step.values, keys, values, stream);
        continue;
      }
      bool const tiles = step.kernel == detail::write_kernel::encode_key_tiles;
      std::int64_t const per = tiles ? step.args.dst.group : 1;  // tokens per unit
      std::int64_t const u_first = step.args.first;
      std::int64_t const u_end = u_first + (tiles ? step.args.count / per : step.args.count);
      std::int64_t const page_units = shape_.page_tokens / per;
      for (std::int64_t u = u_first; u < u_end;) {
        std::int64_t const p = u / page_units;
        std::int64_t const e = std::min(u_end, (p + 1) * page_units);
        detail::write_step piece = step;
        piece.args.first = static_cast<std::int32_t>(u - p * page_units);
        piece.args.count = static_cast<std::int32_t>((e - u) * per);
        piece.args.src = detail::skip_rows(step.args.src, (u - u_first) * per, step.args.dst.residual_rows);
        piece.threads = step.threads / (u_end - u_first) * (e - u);
        write_piece(piece, step.args.dst, layer, s, step.values, keys, values, stream,
                    x.pages[static_cast<std::size_t>(p)]);
        u = e;
      }
    }
    succeed(dev_.finish(stream));
    st = plan.next;
  }

  // ---- reads -----------------------------------------------------------------------------------

  /// Raises what a read of tokens [first, first + count) of (seq, layer, head) would violate
  /// (index_error).
  void check_read(char const* what, sequence_id seq, int layer, int head, std::int64_t first,
                  std::int64_t count) const {
    check_usable();
    std::size_t const s = slot_index(seq, what);
    check_layer(layer);
    check_head(head);
    detail::check_read_range(what, layer, slots_[s].layers[static_cast<std::size_t>(layer)].length, first, count);
  }

  /// Decodes checked tokens [first, first + count) of (seq, layer, head), keys or values, into
  /// `out` (rows of `out_type`, `stride` elements apart), one decode per page.
  void read_checked(bool keys, sequence_id seq, int layer, int head, std::int64_t first, std::int64_t count,
                    output_type out, int out_type, std::int64_t stride, stream_type stream) {
    if (count == 0) return;
    std::size_t const s = slot_index(seq, "read");
    slot const& x = slots_[s];
    auto const& st = x.layers[static_cast<std::size_t>(layer)];
    std::int64_t const pt = shape_.page_tokens;
    std::size_t const elem = detail::kernel_elem_bytes(out_type == kvq_elem_f16_sat ? kvq_elem_f16 : out_type);
    for (std::int64_t t = first; t < first + count;) {
      std::int64_t const p = t / pt;
      std::int64_t const e = std::min(first + count, (p + 1) * pt);
      kvq_region const r = page_region(keys, st, layer, static_cast<int>(s), x.pages[static_cast<std::size_t>(p)], p);
      kvq_decode_args a = decode_arguments(r, head, t - p * pt, e - t, out_type, stride);
      a.unrotate = keys ? rotated_codec<key_codec> : rotated_codec<value_codec>;  // reads return Rᵀ decode
      if (keys && key_side_.device_means) {  // centered keys: reads return decode + mu
        a.add_mean = 1;
        a.mean0 = key_means_offset(static_cast<int>(s), layer);
      }
      output_type const o =
          dev_.offset_output(out, static_cast<std::size_t>(t - first) * static_cast<std::size_t>(stride) * elem);
      if (keys) {
        succeed(dev_.template decode<key_codec>(a, pool_, o, stream));
      } else {
        succeed(dev_.template decode<value_codec>(a, pool_, o, stream));
      }
      t = e;
    }
    succeed(dev_.finish(stream));
  }

  // ---- truncate --------------------------------------------------------------------------------

  /// Keeps the first n tokens of every layer of `seq` and returns the pages past the tokens it keeps,
  /// reserved ones included (those no other sequence holds go back to the pool). Cutting into a quantized KIVI key tile
  /// decodes its kept tokens back into the f16 residual (lossy), as the flat cache. Raises index_error for an unknown
  /// sequence, invalid_argument_error for n < 0.
  void truncate(sequence_id seq, std::int64_t n, stream_type stream) {
    check_usable();
    int const s = static_cast<int>(slot_index(seq, "truncate"));
    detail::check<invalid_argument_error>(n >= 0,
                                          [&] { return "truncate: n = " + std::to_string(n) + " is negative"; });
    slot& x = slots_[static_cast<std::size_t>(s)];
    detail::vector<detail::layer_state> next = x.layers;
    bool queued = false;
    std::int64_t const pt = shape_.page_tokens;
    for (int l = 0; l < shape_.layers; ++l) {
      auto const& st = x.layers[static_cast<std::size_t>(l)];
      auto const p = detail::plan_truncate(key_side_, value_side_, st, n);
      if (p.untile_count > 0) {
        std::int64_t const page = p.untile_first / pt;
        kvq_region const r = page_region(true, st, l, s, x.pages[static_cast<std::size_t>(page)], page);
        for (int h = 0; h < shape_.kv_heads; ++h) {
          kvq_decode_args const a =
              decode_arguments(r, h, p.untile_first - page * pt, p.untile_count, kvq_elem_f16_sat, shape_.head_dim);
          std::size_t const residual = r.residual0 + static_cast<std::size_t>(h) * r.residual_stride;
          succeed(dev_.template decode<key_codec>(a, pool_, dev_.output_at(pool_, residual), stream));
          queued = true;
        }
      }
      next[static_cast<std::size_t>(l)] = p.next;
    }
    if (queued) succeed(dev_.finish(stream));
    x.layers = std::move(next);
    drop_pages(x, pages_for(length_of(x)));
  }

  // ---- import ----------------------------------------------------------------------------------

  /// Raises what adopting layer states `states` (valid for this layout, within the device's token
  /// limit) whose tokens from `first` on are new would violate, having changed nothing: with
  /// seq < 0 a new sequence (first must be 0; capacity_error when max_sequences are live), else
  /// `seq` (index_error when unknown), every layer of which must hold exactly `first` tokens, all
  /// in encoded units, first a multiple of page_tokens (invalid_argument_error); capacity_error
  /// when the pool lacks the pages.
  void check_adopt(sequence_id seq, std::int64_t first, std::span<detail::layer_state const> states) const {
    check_usable();
    std::int64_t end = 0;
    for (auto const& st : states) end = std::max(end, st.length);
    if (seq < 0) {
      detail::check<invalid_argument_error>(first == 0, [&] {
        return "import_sequence: the data starts at token " + std::to_string(first) +
               "; import it into the sequence that holds the tokens before it";
      });
      (void)free_slot("import_sequence");
      check_pages("import_sequence", pages_for(end));
      return;
    }
    slot const& x = slots_[slot_index(seq, "import_sequence")];
    detail::check<invalid_argument_error>(first % shape_.page_tokens == 0, [&] {
      return "import_sequence: the data starts at token " + std::to_string(first) +
             ", not a multiple of page_tokens = " + std::to_string(shape_.page_tokens);
    });
    for (std::size_t l = 0; l < x.layers.size(); ++l) {
      detail::layer_state const& st = x.layers[l];
      std::int64_t const kq = key_side_.tiles ? st.key_quantized : st.length;
      std::int64_t const vq = value_side_.kivi_value ? st.value_quantized : st.length;
      detail::check<invalid_argument_error>(st.length == first && kq == first && vq == first, [&] {
        return "import_sequence: the data continues at token " + std::to_string(first) + " but layer " +
               std::to_string(l) + " of sequence " + std::to_string(seq) + " holds " + std::to_string(st.length) +
               " tokens (" + std::to_string(std::min(kq, vq)) + " of them encoded)";
      });
    }
    std::int64_t const keep = first / shape_.page_tokens;
    std::int64_t freed = 0;
    for (std::size_t p = static_cast<std::size_t>(keep); p < x.pages.size(); ++p)
      freed += refs_[static_cast<std::size_t>(x.pages[p])] == 1 ? 1 : 0;
    check_pages("import_sequence", pages_for(end) - keep - freed);
  }

  /// Adopts checked (check_adopt) layer states: a new sequence (seq < 0) or `seq` takes fresh
  /// pages for tokens [first, end) and the states; returns its id. The caller then writes the
  /// units of those tokens (page_region) and the residual slot's rows.
  auto adopt(sequence_id seq, std::int64_t first, std::span<detail::layer_state const> states) -> sequence_id {
    if (seq < 0) seq = add_sequence();
    slot& x = slots_[slot_index(seq, "import_sequence")];
    drop_pages(x, first / shape_.page_tokens);
    std::int64_t end = 0;
    for (auto const& st : states) end = std::max(end, st.length);
    while (static_cast<std::int64_t>(x.pages.size()) < pages_for(end)) x.pages.push_back(take_page());
    x.layers.assign(states.begin(), states.end());
    return seq;
  }

  // ---- views -----------------------------------------------------------------------------------

  /// The region of keys (or values) of `layer` in page `page` (the page_index-th of its sequence,
  /// whose residual slot is `slot_index`), as of state `st`: token indices relative to the page.
  auto page_region(bool keys, detail::layer_state const& st, int layer, int slot_index, std::int32_t page,
                   std::int64_t page_index) const -> kvq_region {
    kvq_region r = keys ? detail::key_region(key_side_, st) : detail::value_region(value_side_, st);
    r.head0 = page_offset(page) + static_cast<std::size_t>(layer) * geo_.layer_bytes +
              (keys ? 0 : static_cast<std::size_t>(shape_.kv_heads) * geo_.key_units);
    r.head_stride = keys ? geo_.key_units : geo_.value_units;
    r.quantized = static_cast<std::int32_t>(r.quantized - page_index * shape_.page_tokens);
    std::size_t const slot0 = slot_offset(slot_index) + static_cast<std::size_t>(layer) * geo_.slot_layer_bytes;
    r.residual0 = keys ? slot0 : slot0 + static_cast<std::size_t>(shape_.kv_heads) * geo_.key_residual;
    r.residual_stride = keys ? geo_.key_residual : geo_.value_residual;
    return r;
  }

  /// Centered keys on a GPU: byte offset in the pool of the key means of `layer` of residual slot
  /// `s` (kv_heads x head_dim f32); 0 otherwise.
  auto key_means_offset(int s, int layer) const noexcept -> std::size_t {
    return means0_ +
           (static_cast<std::size_t>(s) * static_cast<std::size_t>(shape_.layers) + static_cast<std::size_t>(layer)) *
               means_bytes_;
  }

  /// Centered keys on a GPU: copies the key means of `layer` of `seq` (kv_heads x head_dim f32)
  /// into host memory `out` once the device's work is done; zeros while the layer is empty.
  /// Raises index_error, device_error.
  void read_key_means(sequence_id seq, int layer, float* out) {
    static_assert(base::device_means, "kvq: only centered keys of a GPU cache have device key means");
    check_usable();
    if (size(seq, layer) == 0) {
      for (std::size_t i = 0; i < means_bytes_ / sizeof(float); ++i) out[i] = 0.0f;
      return;
    }
    succeed(dev_.copy_out(pool_, key_means_offset(slot_index_of(seq), layer), out, means_bytes_));
  }

  /// Centered keys on a GPU: sets the key means of `layer` of `seq` from host memory `mu`
  /// (importing a saved sequence); waits.
  void write_key_means(sequence_id seq, int layer, float const* mu) {
    static_assert(base::device_means, "kvq: only centered keys of a GPU cache have device key means");
    succeed(dev_.copy_in(pool_, key_means_offset(slot_index_of(seq), layer), mu, means_bytes_));
  }

  /// Byte offset of page `page` in the pool.
  auto page_offset(std::int32_t page) const noexcept -> std::size_t {
    return static_cast<std::size_t>(page) * geo_.page_bytes;
  }
  /// Byte offset of residual slot `s` in the pool.
  auto slot_offset(int s) const noexcept -> std::size_t {
    return geo_.slots0 + static_cast<std::size_t>(s) * geo_.slot_bytes;
  }
  /// Reference count of page `page` (sequences holding it).
  auto page_refs(std::int32_t page) const noexcept -> int { return refs_[static_cast<std::size_t>(page)]; }

 private:
  struct slot {
    bool live = false;
    std::int64_t generation = 0;
    detail::vector<std::int32_t> pages;
    detail::vector<detail::layer_state> layers;
  };

  static auto validated(paged_shape const& s, int residual, key_params const& key, value_params const& value)
      -> paged_shape {
    detail::check_paged_options<key_codec, value_codec>(s, residual, key, value, Device::max_capacity, Device::name);
    return s;
  }

  auto alloc_bytes() const -> std::size_t { return std::max(geo_.total, storage_alignment); }
  /// Bytes of the pool's allocation: the layout's, then the device key means (not in memory(),
  /// as the CPU cache's host means are not).
  auto device_bytes() const -> std::size_t {
    return means_bytes_ > 0 ? means0_ + static_cast<std::size_t>(shape_.max_sequences) *
                                            static_cast<std::size_t>(shape_.layers) * means_bytes_
                            : alloc_bytes();
  }

  auto id_of(int s) const -> sequence_id {
    return slots_[static_cast<std::size_t>(s)].generation * shape_.max_sequences + s;
  }
  auto find_slot(sequence_id seq) const noexcept -> std::int64_t {
    if (seq < 0) return -1;
    std::int64_t const s = seq % shape_.max_sequences;
    slot const& x = slots_[static_cast<std::size_t>(s)];
    return x.live && x.generation == seq / shape_.max_sequences ? s : -1;
  }
  auto slot_index(sequence_id seq, char const* what) const -> std::size_t {
    std::int64_t const s = find_slot(seq);
    detail::check<index_error>(
        s >= 0, [&] { return std::string(what) + ": sequence " + std::to_string(seq) + " is unknown or released"; });
    return static_cast<std::size_t>(s);
  }
  auto slot_of(sequence_id seq, char const* what) const -> int { return static_cast<int>(slot_index(seq, what)); }
  auto free_slot(char const* what) const -> int {
    for (std::size_t s = 0; s < slots_.size(); ++s)
      if (!slots_[s].live) return static_cast<int>(s);
    detail::raise<capacity_error>(std::string(what) + ": " + std::to_string(shape_.max_sequences) +
                                  " sequences are live (max_sequences)");
    return -1;
  }

  static auto length_of(slot const& x) -> std::int64_t {
    std::int64_t n = 0;
    for (auto const& st : x.layers) n = std::max(n, st.length);
    return n;
  }
  auto pages_for(std::int64_t tokens) const -> std::int64_t {
    return (tokens + shape_.page_tokens - 1) / shape_.page_tokens;
  }

  void check_tokens(char const* what, std::int64_t length, std::int64_t n) const {
    detail::check<capacity_error>(n <= Device::max_capacity - length, [&] {
      return std::string(what) + ": a sequence of " + std::to_string(length) + " tokens cannot take " +
             std::to_string(n) + " more (" + Device::name + " limit " + std::to_string(Device::max_capacity) + ")";
    });
  }
  void check_pages(char const* what, std::int64_t need) const {
    detail::check<capacity_error>(need <= static_cast<std::int64_t>(free_.size()), [&] {
      return std::string(what) + ": needs " + std::to_string(need) + " free pages, the pool has " +
             std::to_string(free_.size()) + " of " + std::to_string(shape_.pages);
    });
  }

  /// Tokens [first, end) whose units a write step writes (empty for residual stores).
  static auto unit_tokens(detail::write_step const& s) -> std::pair<std::int64_t, std::int64_t> {
    if (s.kernel == detail::write_kernel::store_f16_rows) return {0, 0};
    if (s.kernel == detail::write_kernel::encode_key_tiles) {
      std::int64_t const g = s.args.dst.group;
      return {static_cast<std::int64_t>(s.args.first) * g, static_cast<std::int64_t>(s.args.first) * g + s.args.count};
    }
    return {s.args.first, static_cast<std::int64_t>(s.args.first) + s.args.count};
  }

  /// Pages an append of n tokens to `layer` of x takes: new pages, and a copy of every shared page
  /// its writes touch.
  auto pages_needed(slot const& x, int layer, std::int64_t n) const -> std::int64_t {
    if (n == 0) return 0;
    auto const& st = x.layers[static_cast<std::size_t>(layer)];
    kvq_source const none = detail::kernel_source(kvq_elem_f32, 0, 0);
    auto const plan = detail::plan_append(key_side_, value_side_, shape_.head_dim, shape_.kv_heads, st, n, none, none);
    std::int64_t const have = static_cast<std::int64_t>(x.pages.size());
    std::int64_t need = std::max<std::int64_t>(0, pages_for(std::max(length_of(x), st.length + n)) - have);
    detail::vector<std::int64_t> copied;
    for (int i = 0; i < plan.count; ++i) {
      auto const r = unit_tokens(plan.steps[i]);
      if (r.first >= r.second) continue;
      for (std::int64_t p = r.first / shape_.page_tokens; p <= (r.second - 1) / shape_.page_tokens && p < have; ++p)
        if (refs_[static_cast<std::size_t>(x.pages[static_cast<std::size_t>(p)])] > 1 &&
            std::find(copied.begin(), copied.end(), p) == copied.end())
          copied.push_back(p);
    }
    return need + static_cast<std::int64_t>(copied.size());
  }

  auto take_page() -> std::int32_t {
    std::int32_t const p = free_.back();
    free_.pop_back();
    refs_[static_cast<std::size_t>(p)] = 1;
    return p;
  }

  /// Gives x its own copy of every shared page holding tokens [first, end).
  void own_pages(slot& x, std::int64_t first, std::int64_t end, stream_type stream) {
    if (first >= end) return;
    for (std::int64_t i = first / shape_.page_tokens; i <= (end - 1) / shape_.page_tokens; ++i) {
      std::int32_t& pg = x.pages[static_cast<std::size_t>(i)];
      if (refs_[static_cast<std::size_t>(pg)] <= 1) continue;
      std::int32_t const copy = take_page();
      succeed(dev_.move(pool_, 0, geo_.page_bytes, 1,
                        detail::byte_move{page_offset(pg), page_offset(copy), geo_.page_bytes}, stream));
      --refs_[static_cast<std::size_t>(pg)];
      pg = copy;
    }
  }

  /// Drops the pages of x past its first `keep`.
  void drop_pages(slot& x, std::int64_t keep) {
    while (static_cast<std::int64_t>(x.pages.size()) > keep) {
      std::int32_t const p = x.pages.back();
      x.pages.pop_back();
      if (--refs_[static_cast<std::size_t>(p)] == 0) free_.push_back(p);
    }
  }

  /// Runs one write step (or piece of one) into page `page` (or only the residual when page < 0).
  void write_piece(detail::write_step const& piece, kvq_region const& dst, int layer, int s, bool values_side,
                   input_type keys, input_type values, stream_type stream, std::int32_t page = -1) {
    detail::write_step w = piece;
    detail::layer_state const none{};
    kvq_region r = page_region(!values_side, none, layer, s, page < 0 ? 0 : page, 0);
    w.args.dst = dst;
    w.args.dst.head0 = r.head0;
    w.args.dst.head_stride = r.head_stride;
    w.args.dst.residual0 = r.residual0;
    w.args.dst.residual_stride = r.residual_stride;
    if (values_side) {
      succeed(dev_.template write<value_codec>(w, pool_, values, stream));
    } else {
      succeed(dev_.template write<key_codec>(w, pool_, keys, stream));
    }
  }

  auto decode_arguments(kvq_region const& src, int head, std::int64_t first, std::int64_t count, int out_type,
                        std::int64_t stride) const -> kvq_decode_args {
    kvq_decode_args a{};
    a.src = src;
    a.out_stride = static_cast<std::uint64_t>(stride);
    a.head_dim = shape_.head_dim;
    a.head = head;
    a.first = static_cast<std::int32_t>(first);
    a.count = static_cast<std::int32_t>(count);
    a.out_type = out_type;
    return a;
  }

  Device dev_;
  paged_shape shape_;
  int residual_ = 0;
  key_params key_{};
  value_params value_{};
  detail::paged_geometry geo_;
  detail::cache_side key_side_;
  detail::cache_side value_side_;
  layer_type pool_{};
  std::size_t means0_ = 0;       // centered keys on a GPU: byte offset of the key means in the pool
  std::size_t means_bytes_ = 0;  // bytes of one (slot, layer)'s key means, else 0
  detail::vector<std::int32_t> refs_;
  detail::vector<std::int32_t> free_;
  detail::vector<slot> slots_;
  std::int64_t live_ = 0;
};

namespace detail {

/// A batched decode attention over sequences of a paged cache, as a GPU backend launches it: the
/// split plan, the kernel arguments, one kvq_attention_seq per sequence (batch order) and the
/// page-table buffer they index (every sequence's table, concatenated).
struct paged_attention_launch {
  attention_plan plan;
  kvq_attention_args args{};
  detail::vector<kvq_attention_seq> seqs;
  detail::vector<std::int32_t> pages;
};

/// Sets the paged fields of attention arguments for `layer` of `core`: the regions' offsets inside
/// a page, the page size in bytes and in tokens.
template <class Core>
void set_paged_regions(Core const& core, int layer, kvq_attention_args& a) {
  layer_state const empty{};
  kvq_region const k0 = core.page_region(true, empty, layer, 0, 0, 0);
  kvq_region const v0 = core.page_region(false, empty, layer, 0, 0, 0);
  a.key.head0 = k0.head0;
  a.key.head_stride = k0.head_stride;
  a.key.residual_stride = k0.residual_stride;
  a.value.head0 = v0.head0;
  a.value.head_stride = v0.head_stride;
  a.value.residual_stride = v0.residual_stride;
  a.page_bytes = core.geometry().page_bytes;
  a.page_tokens = core.shape().page_tokens;
}

/// The attention sequence of `layer` of sequence `s` (live) attending tokens [begin, end), its
/// page table appended to the page-table buffer `pages` (which the result indexes).
template <class Core>
auto paged_attention_sequence(Core const& core, int layer, sequence_id s, std::int64_t begin, std::int64_t end,
                              detail::vector<std::int32_t>& pages) -> kvq_attention_seq {
  layer_state const& st = core.state(s, layer);
  int const slot = core.slot_index_of(s);
  kvq_attention_seq q = attention_sequence(core.key_side(), core.value_side(), st, begin, end);
  q.pages_first = static_cast<std::int32_t>(pages.size());
  q.key_residual0 = core.page_region(true, st, layer, slot, 0, 0).residual0;
  q.value_residual0 = core.page_region(false, st, layer, slot, 0, 0).residual0;
  q.key_mean0 = core.key_means_offset(slot, layer);
  auto const& table = core.page_table(s);
  pages.insert(pages.end(), table.begin(), table.end());
  return q;
}

/// Plans the batched attention of `seqs` (checked live) over `layer` of `core` for `q_heads` query
/// heads: each sequence attends its last `window` tokens (0: all), scale resolved, softcap,
/// query and probability precision as the flags say, on a device `dev`. Returns false when the
/// attention does not fit dev.smem_limit.
template <class Core>
auto plan_paged_attention(Core const& core, int layer, std::span<sequence_id const> seqs, int q_heads,
                          std::int64_t window, float scale, float softcap, bool query_q8_0, bool probs_f16,
                          attention_device const& dev, paged_attention_launch& out) -> bool {
  auto const& shape = core.shape();
  std::int64_t span = 0;
  for (sequence_id s : seqs) {
    std::int64_t const len = core.size(s, layer);
    span = std::max(span, window > 0 ? std::min(len, window) : len);
  }
  int const batch = static_cast<int>(std::min<std::size_t>(std::max<std::size_t>(seqs.size(), 1), 1u << 30));
  if (!plan_attention(shape.head_dim, shape.kv_heads, q_heads, batch, span, query_q8_0, dev, out.plan)) return false;
  out.args = attention_arguments(core.key_side(), core.value_side(), shape.head_dim, shape.kv_heads, q_heads, out.plan,
                                 scale, softcap, query_q8_0, probs_f16);
  set_paged_regions(core, layer, out.args);
  out.seqs.clear();
  out.pages.clear();
  for (sequence_id s : seqs) {
    layer_state const& st = core.state(s, layer);
    std::int64_t const begin = window > 0 ? std::max<std::int64_t>(0, st.length - window) : 0;
    out.seqs.push_back(paged_attention_sequence(core, layer, s, begin, st.length, out.pages));
  }
  return true;
}

}  // namespace detail

KVQ_NAMESPACE_END
