// kvq: the paged cache on the CUDA backend, independent of the CUDA runtime.
//
// `cuda_paged_cache_core<Choice, Runtime>` is PagedKVCache<Choice, kvq::cuda> (cuda_cache.cuh) on
// the host: the paged core (core/paged_core.hpp: sequences, page tables, copy-on-write, the flat
// cache's plans cut at page boundaries) over the CUDA device of cuda_cache_core.hpp, plus the
// batched decode attention: one partial-attention launch for the whole batch over the pages (the
// sequences and their page tables uploaded to the workspace) and one combine launch; and the
// batched multi-token attention of query chunks (kvq::paged_attention): the launches of each
// chunk in turn (core/query_launches.hpp) over its sequence's pages. The pool is one device
// allocation laid out as the CPU paged cache's (paged_cache.hpp), so bytes are the CPU's. Besides
// cuda_cache_core.hpp's Runtime interface it needs
//   auto upload(void* dst, void const* src, std::size_t bytes, stream_type) -> device_status;  // host to device
// Every call only enqueues work on the caller's stream (fork and truncate included); checks come
// first, so a call that raises a check changes nothing.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "../../core/paged_core.hpp"
#include "../../core/query_launches.hpp"
#include "../../paged_attention.hpp"
#include "../../paged_cache.hpp"
#include "cuda_cache_core.hpp"

KVQ_NAMESPACE_BEGIN

/// The host logic of the CUDA paged cache over a runtime (see the file comment).
template <codec_choice Choice, class Runtime>
class cuda_paged_cache_core : public cache_codecs<Choice> {
  using core_type = paged_core<Choice, detail::cuda_device<Runtime>>;
  using flat_type = cuda_cache_core<Choice, Runtime>;

 public:
  using stream_type = typename Runtime::stream_type;
  using options = typename flat_type::options;
  static constexpr int key_id = detail::kernel_codec<typename core_type::key_codec>::value;
  static constexpr int value_id = detail::kernel_codec<typename core_type::value_codec>::value;

  /// Allocates the zero-filled pool. Raises invalid_argument_error on a bad shape or option (the CPU
  /// paged cache's checks and the CUDA cache's launch settings), device_error when the allocation
  /// fails.
  cuda_paged_cache_core(paged_shape const& shape, options const& opt, Runtime rt)
      : opt_(checked(shape, opt, rt)),
        core_(shape, opt.residual, opt.key, opt.value, detail::cuda_device<Runtime>(std::move(rt))) {}

  cuda_paged_cache_core(cuda_paged_cache_core const&) = delete;
  cuda_paged_cache_core& operator=(cuda_paged_cache_core const&) = delete;

  auto shape() const noexcept -> paged_shape const& { return core_.shape(); }
  auto get_options() const noexcept -> options const& { return opt_; }
  auto runtime() const noexcept -> Runtime const& { return core_.device().runtime(); }
  auto usable() const noexcept -> bool { return core_.usable(); }

  /// Starts an empty sequence (see PagedKVCache::add_sequence).
  auto add_sequence() -> sequence_id { return core_.add_sequence(); }
  /// Starts a sequence sharing every page of `parent`; its residual rows are copied on `stream`.
  auto fork(sequence_id parent, stream_type stream) -> sequence_id { return core_.fork(parent, stream); }
  /// Ends `seq` (see PagedKVCache::release).
  void release(sequence_id seq) { core_.release(seq); }
  /// Takes the pages n more tokens of `seq` need (see PagedKVCache::reserve).
  void reserve(sequence_id seq, std::int64_t n) { core_.reserve(seq, n); }
  auto contains(sequence_id seq) const noexcept -> bool { return core_.contains(seq); }
  auto size(sequence_id seq) const -> std::int64_t { return core_.size(seq); }
  auto size(sequence_id seq, int layer) const -> std::int64_t { return core_.size(seq, layer); }
  /// The page ids of `seq` in token order (host memory; valid until the next non-const call).
  auto page_table(sequence_id seq) const -> std::span<std::int32_t const> {
    auto const& t = core_.page_table(seq);
    return {t.data(), t.size()};
  }
  auto pages() const noexcept -> page_report { return core_.pages(); }
  auto memory() const noexcept -> memory_report { return core_.memory(); }
  /// Device pointer to the pool (page p at byte p * pages().page_bytes; see paged_cache.hpp).
  auto pool_data() const noexcept -> std::byte const* { return reinterpret_cast<std::byte const*>(core_.pool()); }
  /// Bytes of the pool allocation.
  auto pool_bytes() const noexcept -> std::size_t { return core_.memory().total_bytes; }

  /// Appends `keys` and `values` (device pointers) to `layer` of `seq` on `stream` (see
  /// PagedKVCache::append).
  template <element T>
  void append(sequence_id seq, int layer, kv_tensor<T> const& keys, kv_tensor<T> const& values, stream_type stream) {
    core_.check_append(seq, layer, detail::describe(keys), detail::describe(values));
    int const type = detail::kernel_elem<T>();
    core_.append_checked(seq, layer, keys.tokens, keys.data,
                         detail::kernel_source(type, keys.token_stride, keys.head_stride), values.data,
                         detail::kernel_source(type, values.token_stride, values.head_stride), stream);
  }

  /// Decodes keys [first, first + count) of (seq, layer, head) into device memory `out`, rows
  /// `out_stride` elements apart (0: head_dim), on `stream`.
  template <element T>
  void read_keys(sequence_id seq, int layer, int head, std::int64_t first, std::int64_t count, T* out,
                 std::int64_t out_stride, stream_type stream) {
    read_impl(true, seq, layer, head, first, count, out, out_stride, stream);
  }
  /// Decodes values [first, first + count) of (seq, layer, head) into device memory (see read_keys).
  template <element T>
  void read_values(sequence_id seq, int layer, int head, std::int64_t first, std::int64_t count, T* out,
                   std::int64_t out_stride, stream_type stream) {
    read_impl(false, seq, layer, head, first, count, out, out_stride, stream);
  }

  /// Keeps the first n tokens of every layer of `seq` (see PagedKVCache::truncate), on `stream`.
  void truncate(sequence_id seq, std::int64_t n, stream_type stream) { core_.truncate(seq, n, stream); }

  /// Decode attention of one query token per sequence of `seqs` (at most 65535) over `layer`: q and
  /// out are (seqs.size(), q_heads, head_dim) f32 on the device. One partial-attention launch for
  /// the batch plus its combine, on `stream`, without waiting. Options, results (to fp32 rounding)
  /// and NaN/Inf rules as kvq::paged_decode_attention; checks everything first.
  void attention(int layer, std::span<sequence_id const> seqs, float const* q, int q_heads, float* out,
                 attention_options const& opt, stream_type stream) {
    using namespace detail;
    core_.check_usable();
    core_.check_layer(layer);
    for (sequence_id s : seqs) core_.check_sequence(s, "attention");
    paged_shape const& sh = shape();
    check<shape_error>(q_heads > 0 && q_heads % sh.kv_heads == 0, [&] {
      return "attention: " + std::to_string(q_heads) + " query heads is not a positive multiple of " +
             std::to_string(sh.kv_heads) + " kv heads";
    });
    check<shape_error>(seqs.empty() || (q != nullptr && out != nullptr), "attention: the query or the output is null");
    check_attention_options(opt);
    check_sinks(opt.sinks, q_heads);
    check<shape_error>(seqs.size() <= 65535, [&] {
      return "attention: " + std::to_string(seqs.size()) + " sequences exceed one launch's 65535";
    });
    if (seqs.empty()) return;
    int const d = sh.head_dim;
    float const scale = opt.scale > 0.0f ? opt.scale : 1.0f / std::sqrt(static_cast<float>(d));
    paged_attention_launch L;
    check<invalid_argument_error>(
        plan_paged_attention(core_, layer, seqs, q_heads, opt.window, scale, opt.softcap,
                             opt.query == query_precision::q8_0, detail::device_probabilities_f16(opt),
                             flat_type::attention_device(runtime(), opt_), L),
        [&] { return "attention: the shared memory of a block is too small for head_dim " + std::to_string(d); });
    std::size_t const batch = seqs.size();
    std::size_t const qd = static_cast<std::size_t>(q_heads) * static_cast<std::size_t>(d);
    if (L.plan.splits == 0) {  // nothing attended: zeros
      core_.succeed(runtime().zero(out, batch * qd * sizeof(float), stream));
      return;
    }
    paged_workspace const w = stage_workspace(L.plan.scratch_floats, L.seqs, L.pages, opt.sinks, q_heads, stream);
    kvq_cuda::attention_batch b{};
    b.seqs = w.seqs;
    b.pages = w.pages;
    b.layer[0] = core_.pool();
    b.q = q;
    cuda_attend_rows<key_id, value_id>(runtime(), core_, {sh.kv_heads, d, q_heads, w.scratch, w.sinks}, L.args, L.plan,
                                       b, static_cast<std::size_t>(q_heads), batch, out, stream);
  }

  /// Multi-token attention of a batch of query chunks (kvq::query_chunk: a prefill chunk, a draft,
  /// a decode token, each over its own sequence) over `layer`: q and out (Σ n_q, q_heads, head_dim)
  /// f32 and every chunk's mask_data on the device, opt.sinks (q_heads floats) on the host. Per
  /// chunk, one partial-attention launch and its combine per launch of plan_query_launches, on
  /// `stream`, without waiting. Options, masks, errors and results (to fp32 rounding) as the CPU
  /// kvq::paged_attention (opt.first_pos, mask_data and mask_stride must stay unset); checks
  /// everything first.
  void attention(int layer, std::span<query_chunk const> chunks, float const* q, int q_heads, float* out,
                 attention_options const& opt, stream_type stream) {
    using namespace detail;
    core_.check_usable();
    int const d = shape().head_dim;
    paged_query_plan const P = plan_paged_query_chunks(core_, layer, chunks, q, q_heads, out, opt,
                                                       flat_type::attention_device(runtime(), opt_));
    if (P.rows == 0) return;
    std::size_t const qd = static_cast<std::size_t>(q_heads) * static_cast<std::size_t>(d);
    std::size_t runs = 0;
    for (auto const& l : P.launches) runs += l.plan.splits > 0 ? 1 : 0;
    if (runs == 0) {  // nothing attended: zeros
      core_.succeed(runtime().zero(out, static_cast<std::size_t>(P.rows) * qd * sizeof(float), stream));
      return;
    }
    detail::vector<kvq_attention_seq> seqs;
    seqs.reserve(runs);
    for (auto const& l : P.launches)
      if (l.plan.splits > 0) seqs.push_back(l.seq);
    paged_workspace const w = stage_workspace(P.scratch_floats, seqs, P.pages, opt.sinks, q_heads, stream);
    cuda_attention_call const call{shape().kv_heads, d, q_heads, w.scratch, w.sinks};
    std::size_t run = 0;
    for (auto const& l : P.launches) {
      std::size_t const i0 = static_cast<std::size_t>(l.row0);
      kvq_cuda::attention_batch b{};
      if (l.plan.splits > 0) b.seqs = w.seqs + run++;  // else no query of the launch attends anything: zeros
      b.pages = w.pages;
      b.layer[0] = core_.pool();
      b.q = q + i0 * qd;
      b.mask = l.mask;
      cuda_attend_rows<key_id, value_id>(runtime(), core_, call, l.args, l.plan, b,
                                         static_cast<std::size_t>(l.tokens) * static_cast<std::size_t>(q_heads), 1,
                                         out + i0 * qd, stream);
    }
  }

  /// Waits for `stream`; a failure of the work queued so far raises device_error and marks the cache
  /// unusable.
  void synchronize(stream_type stream) {
    core_.check_usable();
    core_.succeed(runtime().synchronize(stream));
  }

  /// The paged core.
  /// Centered keys (`centered<C>`): copies the key means μ of `layer` of `seq` (kv_heads × head_dim
  /// f32) to host memory `out`, once the device's work is done; zeros while the layer is empty.
  /// Raises index_error, device_error.
  void read_key_means(sequence_id seq, int layer, float* out) requires core_type::device_means {
    core_.read_key_means(seq, layer, out);
  }

  auto core() noexcept -> core_type& { return core_; }
  auto core() const noexcept -> core_type const& { return core_; }

 private:
  static auto checked(paged_shape const& s, options const& o, Runtime const& rt) -> options const& {
    detail::check_paged_options<typename core_type::key_codec, typename core_type::value_codec>(
        s, o.residual, o.key, o.value, detail::cuda_device<Runtime>::max_capacity, "CUDA paged cache");
    flat_type::check_launch(s.head_dim, s.kv_heads, o, rt, "CUDA paged cache");
    return o;
  }

  /// Where a paged attention's launches find their data in the workspace (device pointers).
  struct paged_workspace {
    float* scratch = nullptr;
    kvq_attention_seq const* seqs = nullptr;
    std::int32_t const* pages = nullptr;
    float const* sinks = nullptr;  ///< null without sinks
  };

  /// Lays out the workspace as the partial states (`scratch_floats`), `seqs`, the page-table
  /// buffer `pages` and the sinks (q_heads host floats, or null), and uploads all but the first on
  /// `stream`.
  auto stage_workspace(std::size_t scratch_floats, std::span<kvq_attention_seq const> seqs,
                       std::span<std::int32_t const> pages, float const* sinks, int q_heads, stream_type stream)
      -> paged_workspace {
    using detail::workspace_align;
    auto& ws = core_.device().workspace();
    std::size_t const scratch_bytes = workspace_align(scratch_floats * sizeof(float));
    std::size_t const seq_bytes = workspace_align(seqs.size() * sizeof(kvq_attention_seq));
    std::size_t const page_bytes = workspace_align(std::max<std::size_t>(pages.size(), 1) * sizeof(std::int32_t));
    ws.reserve(scratch_bytes + seq_bytes + page_bytes + static_cast<std::size_t>(q_heads) * sizeof(float));
    auto* base = static_cast<unsigned char*>(ws.data());
    auto* seqs_dev = reinterpret_cast<kvq_attention_seq*>(base + scratch_bytes);
    auto* pages_dev = reinterpret_cast<std::int32_t*>(base + scratch_bytes + seq_bytes);
    paged_workspace w;
    w.scratch = reinterpret_cast<float*>(base);
    w.seqs = seqs_dev;
    w.pages = pages_dev;
    w.sinks =
        detail::upload_sinks(runtime(), core_, sinks, q_heads, base + scratch_bytes + seq_bytes + page_bytes, stream);
    core_.succeed(runtime().upload(seqs_dev, seqs.data(), seqs.size() * sizeof(kvq_attention_seq), stream));
    if (!pages.empty())
      core_.succeed(runtime().upload(pages_dev, pages.data(), pages.size() * sizeof(std::int32_t), stream));
    return w;
  }

  template <element T>
  void read_impl(bool keys, sequence_id seq, int layer, int head, std::int64_t first, std::int64_t count, T* out,
                 std::int64_t out_stride, stream_type stream) {
    char const* what = keys ? "read_keys" : "read_values";
    core_.check_read(what, seq, layer, head, first, count);
    std::int64_t const stride = detail::check_read_output(what, shape().head_dim, count, out, out_stride);
    core_.read_checked(keys, seq, layer, head, first, count, static_cast<void*>(out), detail::kernel_elem<T>(), stride,
                       stream);
  }

  options opt_;
  core_type core_;
};

KVQ_NAMESPACE_END
