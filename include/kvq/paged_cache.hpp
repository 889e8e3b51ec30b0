// kvq: the paged quantized KV cache: many sequences in one pool of quantized pages.
//
// A pool of `pages` pages, each holding `page_tokens` tokens of every layer, serves every sequence
// through a page table (token t of a sequence is in page page_table[t / page_tokens]). Sequences
// are added, forked (the child shares every page of its parent; a write into a shared page copies
// it first), truncated and released; pages go back to the pool when no sequence holds them.
// Bytes are the flat QuantizedKVCache's: the same plans (core/plans.hpp) run per sequence and
// layer, their writes cut at page boundaries, so a sequence's pages hold exactly the units a flat
// cache fed the same tokens holds, and its reads and attention give the same values.
//
// KIVI: every sequence keeps its own f16 key residual and value window (a residual slot of the
// pool; max_sequences slots); a page whose key tiles are all quantized is shared as is.
//
// Pool layout, for engines with their own kernels (see core/paged_core.hpp): page p starts at
// byte p * page_bytes of the pool; inside a page, layer l's kv_head h keys start at byte
// l * layer_bytes + h * key_head_bytes and its values at l * layer_bytes + kv_heads *
// key_head_bytes + h * value_head_bytes (all in `paged_storage_view`); the units are laid out as
// in a flat cache (rows of unit_bytes, or KIVI key tiles of G tokens).
//
// Threads: const member functions (reads, views, attention) may run concurrently; anything else
// needs external synchronisation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

#include "backend/backend.hpp"
#include "backend/cpu/cpu_device.hpp"
#include "codec/centered.hpp"
#include "core/paged_core.hpp"
#include "error.hpp"
#include "memory_resource.hpp"

KVQ_NAMESPACE_BEGIN

/// A non-owning view of the keys or values of one (sequence, layer, kv_head) of a paged cache: token
/// t < quantized_tokens is unit (t % page_tokens) / tokens_per_unit of page pages[t / page_tokens],
/// at pool + page * page_bytes + head_offset; later tokens are f16 rows of `residual` (KIVI), token t
/// at ring row (residual_first + t - quantized_tokens) % residual_capacity. Pointers stay valid
/// until the cache is destroyed, the page table and counters until the next non-const call.
struct paged_storage_view {
  std::byte const* pool = nullptr;      ///< the pool allocation, 64-byte aligned
  std::size_t page_bytes = 0;           ///< bytes between consecutive pages
  std::size_t head_offset = 0;          ///< bytes from a page's start to this (layer, kv_head)'s units
  std::size_t unit_bytes = 0;           ///< bytes per row (row codecs) or per tile (KIVI keys)
  int tokens_per_unit = 1;              ///< 1 for rows, G for tiles
  int page_tokens = 0;                  ///< tokens per page
  std::span<std::int32_t const> pages;  ///< the sequence's page table
  std::int64_t length = 0;              ///< tokens of the layer
  std::int64_t quantized_tokens = 0;    ///< tokens [0, quantized_tokens) live in pages
  f16 const* residual = nullptr;        ///< f16 rows of the residual (KIVI), else nullptr
  std::int64_t residual_capacity = 0;   ///< rows of the residual buffer
  std::int64_t residual_first = 0;      ///< ring row of token `quantized_tokens` (values window)
};

/// The largest page count whose pool fits in `bytes` for a paged cache of codec choice `Choice` with
/// `shape` (its `pages` ignored) and KIVI residual `residual`. Raises invalid_argument_error for a
/// bad shape or residual, or when not even one page fits.
template <codec_choice Choice>
auto pages_for_budget(paged_shape shape, std::size_t bytes, int residual = 128) -> std::int64_t {
  using K = typename codec_pair<Choice>::key;
  using V = typename codec_pair<Choice>::value;
  shape.pages = 1;
  detail::check_paged_options<K, V>(shape, residual, typename K::params_type{}, typename V::params_type{},
                                    std::int64_t{1} << 40, "pages_for_budget");
  auto const g = detail::make_paged_geometry<K, V>(shape, residual);
  std::size_t const fixed = static_cast<std::size_t>(shape.max_sequences) * g.slot_bytes;
  std::size_t const pages = bytes > fixed ? (bytes - fixed) / g.page_bytes : 0;
  detail::check<invalid_argument_error>(pages >= 1, [&] {
    return "pages_for_budget: " + std::to_string(bytes) + " bytes hold no page of " + std::to_string(g.page_bytes) +
           " bytes beside " + std::to_string(fixed) + " bytes of residual slots";
  });
  return static_cast<std::int64_t>(std::min<std::size_t>(pages, static_cast<std::size_t>(INT32_MAX)));
}

/// The paged quantized key/value cache of many sequences (see the file comment).
///
/// **Example**:
/// ```
/// kvq::PagedKVCache<kvq::q8_0> cache({32, 8, 128, /*page_tokens*/ 64, /*pages*/ 4096});
/// auto s = cache.add_sequence();
/// cache.append(s, layer, kvq::token_major(k, n, 8, 128), kvq::token_major(v, n, 8, 128));
/// auto child = cache.fork(s);  // shares every page of s
/// ```
template <codec_choice Choice, backend Backend = cpu>
class PagedKVCache : public cache_codecs<Choice> {
  using core_type = paged_core<Choice, detail::cpu_device>;

 public:
  static_assert(std::is_same_v<Backend, cpu>, "kvq: PagedKVCache for this backend lives in its own header");
  using key_codec = typename core_type::key_codec;
  using value_codec = typename core_type::value_codec;
  static_assert(!centered_codec<value_codec>, "kvq: centered<C> is a key codec (values are not centered)");

  /// Run-time options of a paged cache (those of QuantizedKVCache).
  struct options {
    int residual = 128;                        ///< KIVI residual length R (a multiple of G; 0 allowed)
    typename core_type::key_params key{};      ///< run-time parameters of the key codec
    typename core_type::value_params value{};  ///< run-time parameters of the value codec
    kvq::memory_resource* memory = nullptr;    ///< allocator hook; nullptr = the default resource
  };

  /// Allocates the pool; raises invalid_argument_error on a bad shape or option (the flat cache's
  /// rules; 1 <= pages < 2^31; 1 <= max_sequences <= 2^20; page_tokens in [1, 2^20] and a multiple
  /// of every KIVI group in use), and propagates what the memory resource throws.
  explicit PagedKVCache(paged_shape const& shape, options const& opt = options{})
      : opt_(opt),
        core_(shape, opt.residual, opt.key, opt.value, detail::cpu_device(opt.memory)),
        means_(shape.max_sequences * shape.layers, shape.kv_heads, shape.head_dim) {}

  PagedKVCache(PagedKVCache const&) = delete;
  PagedKVCache& operator=(PagedKVCache const&) = delete;

  auto shape() const noexcept -> paged_shape const& { return core_.shape(); }
  auto get_options() const noexcept -> options const& { return opt_; }

  /// Starts an empty sequence. Raises capacity_error when max_sequences are live.
  auto add_sequence() -> sequence_id {
    sequence_id const s = core_.add_sequence();
    clear_empty_means(s);
    return s;
  }
  /// Starts a sequence sharing every page and token of `parent` (copy-on-write), and its key means
  /// (centered key codecs). Raises index_error for an unknown or released parent, capacity_error
  /// when max_sequences are live.
  auto fork(sequence_id parent) -> sequence_id {
    sequence_id const s = core_.fork(parent, {});
    if constexpr (centered_codec<key_codec>) {
      int const from = core_.slot_index_of(parent) * shape().layers, to = core_.slot_index_of(s) * shape().layers;
      for (int l = 0; l < shape().layers; ++l) {
        if (means_.fixed(from + l)) {
          means_.fix(to + l, means_.layer(from + l));
        } else {
          means_.clear(to + l);
        }
      }
    }
    return s;
  }
  /// Ends `seq`, returning the pages no other sequence holds. Raises index_error for an unknown or
  /// released sequence.
  void release(sequence_id seq) { core_.release(seq); }
  /// Takes the pages n more tokens of `seq` need, or raises capacity_error having taken none (so an
  /// engine can preempt). Raises index_error, invalid_argument_error for n < 0.
  void reserve(sequence_id seq, std::int64_t n) { core_.reserve(seq, n); }
  /// True when `seq` is live.
  auto contains(sequence_id seq) const noexcept -> bool { return core_.contains(seq); }

  /// Tokens of the longest layer of `seq`. Raises index_error.
  auto size(sequence_id seq) const -> std::int64_t { return core_.size(seq); }
  /// Tokens of `layer` of `seq`. Raises index_error.
  auto size(sequence_id seq, int layer) const -> std::int64_t { return core_.size(seq, layer); }

  /// Appends `keys` and `values` (same token count) to `layer` of `seq`, taking pages as needed
  /// (and copying a shared page before writing into it). Errors as QuantizedKVCache::append, plus
  /// index_error for an unknown sequence and capacity_error when the pool lacks free pages; on
  /// error nothing changes.
  template <element T>
  void append(sequence_id seq, int layer, kv_tensor<T> const& keys, kv_tensor<T> const& values) {
    core_.check_append(seq, layer, detail::describe(keys), detail::describe(values));
    int const type = detail::kernel_elem<T>();
    if constexpr (centered_codec<key_codec>) {
      if (keys.tokens == 0) return;
      // The first append into an empty layer of the sequence fixes μ; the stored keys are C(k − μ).
      int const ml = mean_layer(seq, layer);
      bool const first = core_.size(seq, layer) == 0;
      detail::vector<float> mu(means_.layer(ml), means_.layer(ml) + means_.per_layer());
      if (first) detail::chunk_key_mean(keys, mu.data());
      detail::vector<float> centered;
      detail::centered_keys(keys, mu.data(), centered);
      std::int64_t const row = static_cast<std::int64_t>(shape().kv_heads) * shape().head_dim;
      core_.append_checked(seq, layer, keys.tokens, centered.data(),
                           detail::kernel_source(kvq_elem_f32, row, shape().head_dim), values.data,
                           detail::kernel_source(type, values.token_stride, values.head_stride), {});
      if (first) means_.fix(ml, mu.data());
    } else {
      core_.append_checked(seq, layer, keys.tokens, keys.data,
                           detail::kernel_source(type, keys.token_stride, keys.head_stride), values.data,
                           detail::kernel_source(type, values.token_stride, values.head_stride), {});
    }
  }

  /// Reads keys [first, first + count) of (seq, layer, head) into out, rows `out_stride` elements
  /// apart (0 = head_dim); preconditions and errors as QuantizedKVCache::read_keys, plus
  /// index_error for an unknown sequence.
  template <element T>
  void read_keys(sequence_id seq, int layer, int head, std::int64_t first, std::int64_t count, T* out,
                 std::int64_t out_stride = 0) const {
    read_impl(true, seq, layer, head, first, count, out, out_stride);
  }
  /// Reads values [first, first + count) of (seq, layer, head); as read_keys.
  template <element T>
  void read_values(sequence_id seq, int layer, int head, std::int64_t first, std::int64_t count, T* out,
                   std::int64_t out_stride = 0) const {
    read_impl(false, seq, layer, head, first, count, out, out_stride);
  }

  /// Keeps the first n tokens of every layer of `seq` (speculative-decoding rollback), returning the
  /// pages past the tokens it keeps (pages taken by `reserve` included). Raises index_error,
  /// invalid_argument_error for n < 0.
  void truncate(sequence_id seq, std::int64_t n) {
    core_.truncate(seq, n, {});
    clear_empty_means(seq);
  }

  /// The key mean μ of (seq, layer, head) of a centered key codec (head_dim floats; zeros while the
  /// layer is empty), nullptr for other key codecs. Raises index_error.
  auto key_mean(sequence_id seq, int layer, int head) const -> float const* {
    core_.check_sequence(seq, "key_mean");
    core_.check_layer(layer);
    core_.check_head(head);
    if constexpr (centered_codec<key_codec>) {
      return means_.of(mean_layer(seq, layer), head);
    } else {
      return nullptr;
    }
  }

  /// Sets the key means of the layers of `seq` from `mu` (layers × kv_heads × head_dim floats),
  /// fixed where the layer holds tokens, cleared elsewhere (importing a saved sequence).
  void restore_key_means(sequence_id seq, float const* mu) {
    if constexpr (centered_codec<key_codec>) {
      for (int l = 0; l < shape().layers; ++l) {
        int const ml = mean_layer(seq, l);
        if (core_.size(seq, l) > 0) {
          means_.fix(ml, mu + static_cast<std::size_t>(l) * means_.per_layer());
        } else {
          means_.clear(ml);
        }
      }
    } else {
      (void)seq;
      (void)mu;
    }
  }

  /// The page ids of `seq` in token order (valid until the next non-const call). Raises index_error.
  auto page_table(sequence_id seq) const -> std::span<std::int32_t const> {
    auto const& t = core_.page_table(seq);
    return {t.data(), t.size()};
  }
  /// Ids of the live sequences.
  auto sequences() const -> detail::vector<sequence_id> { return core_.sequences(); }
  /// Pages no sequence holds.
  auto free_pages() const noexcept -> std::int64_t { return core_.pages().free_pages; }
  /// Pages held by at least one sequence.
  auto used_pages() const noexcept -> std::int64_t { return core_.pages().used_pages; }
  /// Page use of the pool.
  auto pages() const noexcept -> page_report { return core_.pages(); }
  /// Memory of the pool, every byte accounted for.
  auto memory() const noexcept -> memory_report { return core_.memory(); }

  /// View of the keys of (seq, layer, head) (see paged_storage_view). Raises index_error.
  auto key_storage(sequence_id seq, int layer, int head) const -> paged_storage_view {
    return storage(true, seq, layer, head);
  }
  /// View of the values of (seq, layer, head). Raises index_error.
  auto value_storage(sequence_id seq, int layer, int head) const -> paged_storage_view {
    return storage(false, seq, layer, head);
  }

  /// The cache core (page tables, regions, storage) that kvq's free functions (attention,
  /// export_sequence, import_sequence) use.
  auto core() noexcept -> core_type& { return core_; }
  auto core() const noexcept -> core_type const& { return core_; }

 private:
  template <element T>
  void read_impl(bool keys, sequence_id seq, int layer, int head, std::int64_t first, std::int64_t count, T* out,
                 std::int64_t out_stride) const {
    char const* what = keys ? "read_keys" : "read_values";
    core_.check_read(what, seq, layer, head, first, count);
    std::int64_t const stride = detail::check_read_output(what, shape().head_dim, count, out, out_stride);
    // Reads change nothing: the core's read runs on the CPU device, which holds no state.
    if constexpr (centered_codec<key_codec>) {
      if (keys && count > 0) {  // decode + μ in f32, then one rounding to T
        int const d = shape().head_dim;
        detail::vector<float> rows(static_cast<std::size_t>(count) * static_cast<std::size_t>(d));
        const_cast<core_type&>(core_).read_checked(true, seq, layer, head, first, count,
                                                   static_cast<void*>(rows.data()), kvq_elem_f32, d, {});
        detail::add_key_mean(rows.data(), count, d, d, means_.of(mean_layer(seq, layer), head));
        for (std::int64_t i = 0; i < count; ++i)
          cpu_kernels::convert_from_f32(rows.data() + i * d, out + i * stride, d);
        return;
      }
    }
    const_cast<core_type&>(core_).read_checked(keys, seq, layer, head, first, count, static_cast<void*>(out),
                                               detail::kernel_elem<T>(), stride, {});
  }

  /// The row of `means_` holding (seq, layer): slot-major.
  auto mean_layer(sequence_id seq, int layer) const -> int { return core_.slot_index_of(seq) * shape().layers + layer; }

  /// Clears μ of the layers of `seq` that hold no token.
  void clear_empty_means(sequence_id seq) {
    if constexpr (centered_codec<key_codec>) {
      for (int l = 0; l < shape().layers; ++l)
        if (core_.size(seq, l) == 0) means_.clear(mean_layer(seq, l));
    } else {
      (void)seq;
    }
  }

  auto storage(bool keys, sequence_id seq, int layer, int head) const -> paged_storage_view {
    auto const& st = core_.state(seq, layer);
    core_.check_head(head);
    int const slot = core_.slot_index_of(seq);
    kvq_region const r = core_.page_region(keys, st, layer, slot, 0, 0);
    detail::cache_side const& side = keys ? core_.key_side() : core_.value_side();
    paged_storage_view v;
    v.pool = core_.pool();
    v.page_bytes = core_.geometry().page_bytes;
    v.head_offset = r.head0 + static_cast<std::size_t>(head) * r.head_stride;
    v.unit_bytes = r.unit_bytes;
    v.tokens_per_unit = side.tiles ? r.group : 1;
    v.page_tokens = shape().page_tokens;
    v.pages = page_table(seq);
    v.length = st.length;
    v.quantized_tokens = r.quantized;
    if (side.tiles || side.kivi_value) {
      v.residual =
          reinterpret_cast<f16 const*>(core_.pool() + r.residual0 + static_cast<std::size_t>(head) * r.residual_stride);
      v.residual_capacity = side.residual;
      v.residual_first = r.residual_first;
    }
    return v;
  }

  options opt_;
  core_type core_;
  [[no_unique_address]] detail::key_means_for<key_codec> means_;  // (max_sequences × layers) rows
};

KVQ_NAMESPACE_END
