// kvq: the paged cache on the CUDA backend, independent of the CUDA runtime.
//
// `cuda_paged_cache_core<Choice, Runtime>` is PagedKVCache<Choice, kvq::cuda> (cuda_cache.cuh) on
// the host: the paged core (core/paged_core.hpp: sequences, page tables, copy-on-write, the flat
// cache's plans cut at page boundaries) over the CUDA device of cuda_cache_core.hpp, plus the
// batched decode attention: one partial-attention launch for the whole batch over the pages (the
// sequences and their page tables uploaded to the workspace) and one combine launch. The pool is one device
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
                             opt.query == query_precision::q8_0, opt.probabilities == probability_precision::f16,
                             flat_type::attention_device(runtime(), opt_), L),
        [&] { return "attention: the shared memory of a block is too small for head_dim " + std::to_string(d); });
    std::size_t const batch = seqs.size();
    std::size_t const qd = static_cast<std::size_t>(q_heads) * static_cast<std::size_t>(d);
    if (L.plan.splits == 0) {  // nothing attended: zeros
      core_.succeed(runtime().zero(out, batch * qd * sizeof(float), stream));
      return;
    }
    // Workspace: partial states, then the sequences and the page tables (uploaded).
    auto& ws = core_.device().workspace();
    auto const align = [](std::size_t n) { return (n + 255) / 256 * 256; };
    std::size_t const scratch_bytes = align(L.plan.scratch_floats * sizeof(float));
    std::size_t const seq_bytes = align(L.seqs.size() * sizeof(kvq_attention_seq));
    std::size_t const page_bytes = align(std::max<std::size_t>(L.pages.size(), 1) * sizeof(std::int32_t));
    ws.reserve(scratch_bytes + seq_bytes + page_bytes + static_cast<std::size_t>(q_heads) * sizeof(float));
    auto* base = static_cast<unsigned char*>(ws.data());
    auto* scratch = reinterpret_cast<float*>(base);
    auto* seqs_dev = reinterpret_cast<kvq_attention_seq*>(base + scratch_bytes);
    auto* pages = reinterpret_cast<std::int32_t*>(base + scratch_bytes + seq_bytes);
    float const* sinks =
        upload_sinks(runtime(), core_, opt.sinks, q_heads, base + scratch_bytes + seq_bytes + page_bytes, stream);
    core_.succeed(runtime().upload(seqs_dev, L.seqs.data(), L.seqs.size() * sizeof(kvq_attention_seq), stream));
    if (!L.pages.empty())
      core_.succeed(runtime().upload(pages, L.pages.data(), L.pages.size() * sizeof(std::int32_t), stream));
    std::size_t const parts = batch * static_cast<std::size_t>(L.plan.splits);
    kvq_cuda::attention_batch b{};
    b.part_out = scratch;
    b.part_max = scratch + parts * qd;
    b.part_sum = b.part_max + parts * static_cast<std::size_t>(q_heads);
    b.seqs = seqs_dev;
    b.pages = pages;
    b.layer[0] = core_.pool();
    b.q = q;
    kvq_combine_args cb{};
    cb.q_heads = q_heads;
    cb.head_dim = d;
    cb.splits = L.plan.splits;
    cb.batch = static_cast<std::int32_t>(batch);
    cb.sinks = sinks != nullptr ? q_heads : 0;
    core_.succeed(runtime().template attention<key_id, value_id>(
        L.args, b, static_cast<unsigned>(L.plan.splits), static_cast<unsigned>(sh.kv_heads * L.plan.chunks),
        static_cast<unsigned>(batch), L.plan.threads, L.plan.smem_bytes, stream));
    core_.succeed(runtime().combine(cb, b.part_out, b.part_max, b.part_sum, sinks, out,
                                    static_cast<long long>(batch) * static_cast<long long>(qd), stream));
  }

  /// Waits for `stream`; a failure of the work queued so far raises device_error and marks the cache
  /// unusable.
  void synchronize(stream_type stream) {
    core_.check_usable();
    core_.succeed(runtime().synchronize(stream));
  }

  /// The paged core.
  auto core() noexcept -> core_type& { return core_; }
  auto core() const noexcept -> core_type const& { return core_; }

 private:
  static auto checked(paged_shape const& s, options const& o, Runtime const& rt) -> options const& {
    detail::check_paged_options<typename core_type::key_codec, typename core_type::value_codec>(
        s, o.residual, o.key, o.value, detail::cuda_device<Runtime>::max_capacity, "CUDA paged cache");
    flat_type::check_launch(s.head_dim, s.kv_heads, o, rt, "CUDA paged cache");
    return o;
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
