// kvq's CUDA backend without a GPU: cuda_cache_core (the CUDA cache's host logic: checks, layer
// bookkeeping, launch plans, attention splits) driven over a runtime that runs the kernel bodies of
// core/kernel_bodies.h on the CPU, thread by thread, in place of the CUDA runtime. Compared
// with the CPU scalar reference: encoded bytes identical, decoded values bit-identical, attention
// within fp32 rounding of kvq::decode_attention with the same options; every codec, head_dims 8,
// 64, 80 and 128, KIVI R = 0, 32 and 128, GQA 32/8 and MHA, batched attention, errors with the
// cache unchanged, and a failing runtime call making the cache unusable.
//
// The attention blocks run their threads in a configurable order with shared memory filled with
// NaN first, so a phase that read another thread's result of the same phase (a missing barrier on
// the GPU) or an uninitialised shared value would show up as a difference.
#include <kvq/backend/cuda/cuda_cache_core.hpp>
#include <kvq/backend/cuda/cuda_paged_cache.hpp>
#include <kvq/codec/rotated.hpp>
#include <kvq/codec/tq.hpp>
#include <kvq/core/kernel_bodies.h>
#include <kvq/paged_attention.hpp>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "catch_compat.hpp"
#include "cuda/cuda_scenario.hpp"
#include "cuda/paged_scenario.hpp"
#include "persist_support.hpp"
#include "test_support.hpp"

namespace {

namespace kt = kvq_cuda_test;

/// Knobs shared by every host runtime of a test: thread order, fault injection, counters.
struct host_control {
  bool reverse_threads = false;  ///< run the threads of a block from the last to the first
  int fail_in = -1;              ///< > 0: the fail_in-th kernel launch from now fails
  int launches = 0;
};

/// The threads of one emulated block: the caller runs the work of every thread of a phase in
/// turn (in order or reversed), so the barrier between phases has nothing left to wait for.
struct host_threads {
  int n;
  bool reverse;
  int count() const { return n; }
  int lanes() const { return n; }
  int tid(int k) const { return reverse ? n - 1 - k : k; }
  void barrier() const {}
};

/// cuda_cache_core's runtime on host memory: "kernels" run their bodies on the CPU.
struct host_runtime {
  using stream_type = int;
  std::shared_ptr<host_control> control = std::make_shared<host_control>();
  int sms = 4;
  std::size_t smem = 48 * 1024;

  auto sm_count() const -> int { return sms; }
  auto smem_per_block() const -> std::size_t { return smem; }
  auto allocate(void** p, std::size_t bytes) const -> kvq::device_status {
    *p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (*p == nullptr) return {"aligned_alloc", "out of memory"};
    std::memset(*p, 0, bytes);
    return {};
  }
  void deallocate(void* p) const noexcept { std::free(p); }
  auto copy_2d(void* dst, std::size_t dpitch, void const* src, std::size_t spitch, std::size_t width,
               std::size_t height, int) const -> kvq::device_status {
    for (std::size_t r = 0; r < height; ++r)
      std::memcpy(static_cast<char*>(dst) + r * dpitch, static_cast<char const*>(src) + r * spitch, width);
    return {};
  }
  auto upload(void* dst, void const* src, std::size_t bytes, int) const -> kvq::device_status {
    std::memcpy(dst, src, bytes);
    return {};
  }
  auto download(void* dst, void const* src, std::size_t bytes, int) const -> kvq::device_status {
    std::memcpy(dst, src, bytes);
    return {};
  }
  auto zero(void* p, std::size_t bytes, int) const -> kvq::device_status {
    std::memset(p, 0, bytes);
    return {};
  }
  auto synchronize(int) const -> kvq::device_status { return {}; }
  auto synchronize_device() const -> kvq::device_status { return {}; }

  /// Counts a launch; the injected failure, if due.
  auto launch() const -> kvq::device_status {
    ++control->launches;
    if (control->fail_in > 0 && --control->fail_in == 0) return {"test kernel launch", "injected failure"};
    return {};
  }
  template <class F>
  auto elementwise(long long n, F&& f) const -> kvq::device_status {
    auto const s = launch();
    if (!s.ok()) return s;
    for (long long i = 0; i < n; ++i) f(i);
    return {};
  }
  template <int C>
  auto encode_rows(kvq_write_args const& a, unsigned char* layer, void const* in, long long n, int) const
      -> kvq::device_status {
    return elementwise(n, [&](long long i) { kvq::kernels::encode_rows_thread(C, a, layer, bytes(in), i); });
  }
  template <int C>
  auto encode_key_tiles(kvq_write_args const& a, unsigned char* layer, void const* in, long long n, int) const
      -> kvq::device_status {
    return elementwise(n, [&](long long i) { kvq::kernels::encode_key_tiles_thread(C, a, layer, bytes(in), i); });
  }
  auto store_f16_rows(kvq_write_args const& a, unsigned char* layer, void const* in, long long n, int) const
      -> kvq::device_status {
    return elementwise(n, [&](long long i) { kvq::kernels::store_f16_rows_thread(a, layer, bytes(in), i); });
  }
  template <int C>
  auto decode(kvq_decode_args const& a, unsigned char const* layer, void* out, long long n, int) const
      -> kvq::device_status {
    return elementwise(
        n, [&](long long i) { kvq::kernels::decode_thread(C, a, layer, static_cast<unsigned char*>(out), i); });
  }
  template <int KC, int VC>
  auto attention(kvq_attention_args const& a, kvq_cuda::attention_batch const& b, unsigned gx, unsigned gy, unsigned gz,
                 int threads, std::size_t smem_bytes, int) const -> kvq::device_status {
    auto const s = launch();
    if (!s.ok()) return s;
    REQUIRE(smem_bytes <= smem);
    std::vector<float> sm(smem_bytes / 4);
    host_threads th{threads, control->reverse_threads};
    long long const qd = static_cast<long long>(a.q_heads) * a.head_dim;
    for (unsigned z = 0; z < gz; ++z)
      for (unsigned y = 0; y < gy; ++y)
        for (unsigned x = 0; x < gx; ++x) {
          std::fill(sm.begin(), sm.end(), std::numeric_limits<float>::quiet_NaN());
          long long const part = static_cast<long long>(z) * a.splits;
          kvq::kernels::attention_block(KC, VC, a, b.seqs != nullptr ? b.seqs[z] : b.seq[z],
                                        b.seqs != nullptr ? b.layer[0] : b.layer[z],
                                        b.seqs != nullptr ? b.layer[0] : b.layer[z], b.pages, b.q + z * qd * a.n_q,
                                        static_cast<unsigned char const*>(b.mask), b.part_out + part * qd * a.n_q,
                                        b.part_max + part * a.q_heads * a.n_q, b.part_sum + part * a.q_heads * a.n_q,
                                        sm.data(), static_cast<int>(x), static_cast<int>(y), th);
        }
    return {};
  }
  auto combine(kvq_combine_args const& a, float const* po, float const* pm, float const* ps, float const* sinks,
               float* out, long long n, int) const -> kvq::device_status {
    return elementwise(n, [&](long long i) { kvq::kernels::combine_thread(a, po, pm, ps, sinks, out, i); });
  }
  static auto bytes(void const* p) -> unsigned char const* { return static_cast<unsigned char const*>(p); }
};

/// The harness of cuda_scenario.hpp over cuda_cache_core<Choice, host_runtime> (host pointers).
template <class Choice>
class host_harness {
 public:
  using core_type = kvq::cuda_cache_core<Choice, host_runtime>;

  host_harness(kvq::cache_shape const& s, kt::cpu_options<Choice> const& o, kt::launch const& lo, host_runtime rt = {})
      : core_(s, core_options(o, lo), rt) {}

  static auto core_options(kt::cpu_options<Choice> const& o, kt::launch const& lo) -> typename core_type::options {
    typename core_type::options c;
    c.residual = o.residual;
    c.key = o.key;
    c.value = o.value;
    c.threads = lo.threads;
    c.split_tokens = lo.split_tokens;
    return c;
  }

  template <class T>
  void append(int l, std::vector<T> const& k, std::vector<T> const& v, std::int64_t n) {
    auto const& s = core_.shape();
    core_.append(l, kvq::token_major(k.data(), n, s.kv_heads, s.head_dim),
                 kvq::token_major(v.data(), n, s.kv_heads, s.head_dim), 0);
  }
  auto layer_bytes(int l) -> std::vector<std::uint8_t> {
    auto const* p = reinterpret_cast<std::uint8_t const*>(core_.layer_data(l));
    return {p, p + core_.layer_bytes()};
  }
  auto view(bool keys, int l, int h) const -> kvq::storage_view {
    return keys ? core_.key_storage(l, h) : core_.value_storage(l, h);
  }
  auto layer_base(int l) const -> std::byte const* { return core_.layer_data(l); }
  template <class T>
  auto read(bool keys, int l, int h, std::int64_t first, std::int64_t count) -> std::vector<T> {
    std::vector<T> out(static_cast<std::size_t>(count * core_.shape().head_dim));
    if (keys) {
      core_.read_keys(l, h, first, count, out.data(), 0, 0);
    } else {
      core_.read_values(l, h, first, count, out.data(), 0, 0);
    }
    return out;
  }
  void truncate(std::int64_t n) { core_.truncate(n, 0); }
  void shift_left(std::int64_t n) { core_.shift_left(n, 0); }
  void reset() { core_.reset(); }
  auto size(int l) const -> std::int64_t { return core_.size(l); }
  auto memory() const -> kvq::memory_report { return core_.memory(); }
  auto attention(int l, std::vector<float> const& q, int q_heads, kvq::attention_options const& opt)
      -> std::vector<float> {
    std::vector<float> out(q.size(), -7.0f);
    core_.attention(l, q.data(), q_heads, out.data(), opt, 0);
    return out;
  }
  auto attention_tokens(int l, std::vector<float> const& q, std::int64_t n_q, int q_heads,
                        kvq::attention_options const& opt, std::size_t) -> std::vector<float> {
    std::vector<float> out(q.size(), -7.0f);
    core_.attention(l, q.data(), n_q, q_heads, out.data(), opt, 0);
    return out;
  }
  static auto batched(std::vector<host_harness*> const& hs, int l, std::vector<float> const& q, int q_heads,
                      kvq::attention_options const& opt) -> std::vector<float> {
    std::vector<core_type*> cores;
    for (auto* h : hs) cores.push_back(&h->core_);
    kvq::basic_cuda_workspace<host_runtime> ws(hs.front()->core_.runtime());
    std::vector<float> out(q.size(), -7.0f);
    kvq::detail::cuda_attention_batch<Choice, host_runtime>(std::span<core_type* const>(cores), l, q.data(), q_heads,
                                                            out.data(), opt, ws, 0);
    return out;
  }
  auto core() -> core_type& { return core_; }
  auto stream() const -> int { return 0; }

 private:
  core_type core_;
};

/// The harness of paged_scenario.hpp over cuda_paged_cache_core<Choice, host_runtime>.
template <class Choice>
class host_paged_harness {
 public:
  using core_type = kvq::cuda_paged_cache_core<Choice, host_runtime>;

  host_paged_harness(kvq::paged_shape const& s, int residual, kt::launch const& lo, host_runtime rt = {})
      : core_(s, options(residual, lo), rt) {}

  static auto options(int residual, kt::launch const& lo) -> typename core_type::options {
    typename core_type::options o;
    o.residual = residual;
    o.threads = lo.threads;
    o.split_tokens = lo.split_tokens;
    return o;
  }
  auto add_sequence() -> kvq::sequence_id { return core_.add_sequence(); }
  auto fork(kvq::sequence_id s) -> kvq::sequence_id { return core_.fork(s, 0); }
  void release(kvq::sequence_id s) { core_.release(s); }
  void truncate(kvq::sequence_id s, std::int64_t n) { core_.truncate(s, n, 0); }
  void append(kvq::sequence_id s, int l, std::vector<float> const& k, std::vector<float> const& v, std::int64_t n) {
    auto const& sh = core_.shape();
    core_.append(s, l, kvq::token_major(k.data(), n, sh.kv_heads, sh.head_dim),
                 kvq::token_major(v.data(), n, sh.kv_heads, sh.head_dim), 0);
  }
  auto read(bool keys, kvq::sequence_id s, int l, int h, std::int64_t first, std::int64_t count) -> std::vector<float> {
    std::vector<float> out(static_cast<std::size_t>(count * core_.shape().head_dim), -7.0f);
    if (keys)
      core_.read_keys(s, l, h, first, count, out.data(), 0, 0);
    else
      core_.read_values(s, l, h, first, count, out.data(), 0, 0);
    return out;
  }
  auto attention(int l, std::vector<kvq::sequence_id> const& ids, std::vector<float> const& q, int q_heads,
                 kvq::attention_options const& opt) -> std::vector<float> {
    std::vector<float> out(q.size(), -7.0f);
    core_.attention(l, std::span<kvq::sequence_id const>(ids), q.data(), q_heads, out.data(), opt, 0);
    return out;
  }
  auto attention_chunks(int l, std::vector<kvq::query_chunk> const& chunks, std::vector<float> const& q, int q_heads,
                        kvq::attention_options const& opt, std::vector<std::size_t> const&) -> std::vector<float> {
    std::vector<float> out(q.size(), -7.0f);
    core_.attention(l, std::span<kvq::query_chunk const>(chunks), q.empty() ? nullptr : q.data(), q_heads,
                    out.empty() ? nullptr : out.data(), opt, 0);
    return out;
  }
  auto pool() const -> std::vector<std::uint8_t> {
    auto const* p = reinterpret_cast<std::uint8_t const*>(core_.pool_data());
    return {p, p + core_.pool_bytes()};
  }
  auto pages() const -> kvq::page_report { return core_.pages(); }
  auto core() -> core_type& { return core_; }

 private:
  core_type core_;
};

template <class Choice>
auto options_with(int residual) -> kt::cpu_options<Choice> {
  kt::cpu_options<Choice> o;
  o.residual = residual;
  return o;
}

}  // namespace

// Every codec as keys and values, and mixed pairs (the facade's list).
TEMPLATE_TEST_CASE("cuda host: bytes, reads and attention match the CPU reference", "[cuda_host]", kvq::f32_codec,
                   kvq::f16_codec, kvq::q8_0, kvq::q4_0, kvq::int8_sym, kvq::fp8_e4m3, kvq::fp8_e5m2, kvq::mxfp4,
                   kvq::nvfp4, (kvq::kv_codecs<kvq::q8_0, kvq::q4_0>), (kvq::kv_codecs<kvq::f16_codec, kvq::q8_0>),
                   (kvq::kv_codecs<kvq::int8_sym, kvq::fp8_e5m2>), (kvq::kv_codecs<kvq::mxfp4, kvq::nvfp4>)) {
  for (int d : {64, 128, 80, 8}) {
    INFO("head_dim " << d);
    kt::run_scenario<TestType, host_harness>(d, 0, {}, {}, d != 128);
  }
}

TEMPLATE_TEST_CASE("cuda host: KIVI residual semantics match the CPU cache", "[cuda_host]", kvq::kivi<2>, kvq::kivi<4>,
                   kvq::kivi<8>, (kvq::kv_codecs<kvq::kivi_key<4>, kvq::q8_0>),
                   (kvq::kv_codecs<kvq::q4_0, kvq::kivi_value<2>>)) {
  for (int r : {0, 32, 128}) {
    for (int d : {64, 128, 80, 8}) {
      INFO("head_dim " << d << " R " << r);
      kt::run_scenario<TestType, host_harness>(d, r, {}, {}, d == 64);
    }
  }
}

// Rotated codecs: the stored codec's kernel bodies with R at the edges (inputs rotated by the
// write kernels, reads un-rotated, queries rotated and outputs un-rotated by the attention); both
// sides, keys or values alone, two seeds, the tq codebooks and a KIVI residual of rotated rows.
TEMPLATE_TEST_CASE("cuda host: rotated codecs match the CPU caches", "[cuda_host][rotated]", kvq::rotated<kvq::q4_0>,
                   (kvq::kv_codecs<kvq::rotated<kvq::q8_0>, kvq::q4_0>), (kvq::kv_codecs<kvq::q4_0, kvq::tq3>),
                   kvq::tq4, (kvq::kv_codecs<kvq::tq2, kvq::rotated<kvq::q8_0, 7>>),
                   (kvq::kv_codecs<kvq::rotated<kvq::kivi_key<4>>, kvq::rotated<kvq::kivi_value<4>>>)) {
  STATIC_REQUIRE(kvq::implements<typename kvq::codec_pair<TestType>::key, kvq::cuda>::value);
  STATIC_REQUIRE(kvq::implements<typename kvq::codec_pair<TestType>::value, kvq::cuda>::value);
  int const r = kvq::codec_pair<TestType>::key::layout == kvq::codec_layout::token_group ? 32 : 0;
  for (int d : {64, 80}) {
    INFO("head_dim " << d);
    kt::run_scenario<TestType, host_harness>(d, r, {}, {}, d == 64);
  }
  // Multi-token and paged for three of them (compile time): both sides rotated, two seeds with
  // tq values, a KIVI residual.
  using rot_q4_0 = kvq::rotated<kvq::q4_0>;
  if constexpr (std::is_same_v<TestType, rot_q4_0> ||
                kvq::codec_pair<TestType>::key::layout == kvq::codec_layout::token_group ||
                std::is_same_v<TestType, kvq::kv_codecs<kvq::tq2, kvq::rotated<kvq::q8_0, 7>>>) {
    kt::run_multi_token<TestType, host_harness>(80, r, {64, 0});
    kt::run_paged<TestType, host_paged_harness>(64, r);
    kt::run_paged_chunks<TestType, host_paged_harness>(40, r, {64, 40});
  }
  if constexpr (std::is_same_v<TestType, kvq::tq4> || std::is_same_v<TestType, rot_q4_0>) {
    kt::run_special_values<TestType, host_harness>(40);
    // Rows wider than KVQ_ROTATED_ROW_MAX (256 + 64): the write kernels rotate coordinate by coordinate.
    kt::run_special_values<TestType, host_harness>(320);
  }
}

// Centered keys: the key means μ computed on the device from the first chunk by the CPU's rule
// (so the same μ, stored bytes and reads as the CPU caches), subtracted before the rotation, added
// to reads, and the logit offset scale · (q·μ) in the attention (soft-cap and sinks included);
// paged with forks (the child takes the parent's μ).
TEMPLATE_TEST_CASE("cuda host: centered keys match the CPU caches", "[cuda_host][centered]",
                   (kvq::kv_codecs<kvq::centered<kvq::q4_0>, kvq::q8_0>),
                   (kvq::kv_codecs<kvq::centered<kvq::rotated<kvq::q4_0>>, kvq::q4_0>),
                   (kvq::kv_codecs<kvq::centered<kvq::kivi_key<4>>, kvq::kivi_value<4>>)) {
  using key = typename kvq::codec_pair<TestType>::key;
  STATIC_REQUIRE(kvq::implements<key, kvq::cuda>::value);
  constexpr bool kivi = key::layout == kvq::codec_layout::token_group;
  int const r = kivi ? 32 : 0;
  kt::run_scenario<TestType, host_harness>(kivi ? 64 : 80, r, options_with<TestType>(r), {}, !kivi);
  {  // μ itself: the CPU's, bit for bit; zeros for an empty layer; a new one after emptying
    int const kv = 2, d = 40;
    kt::pair_of_caches<TestType, host_harness> c({2, kv, d, 128}, options_with<TestType>(r));
    auto k = kt::kv_data(19, kv, d, 5);
    for (float& x : k) x += 3.0f;  // a common offset, which centering removes
    k[7] = std::numeric_limits<float>::quiet_NaN();
    c.append(0, k, kt::kv_data(19, kv, d, 6), 19);
    c.append(0, kt::kv_data(5, kv, d, 7), kt::kv_data(5, kv, d, 8), 5);
    std::vector<float> mu(static_cast<std::size_t>(kv * d));
    auto same_means = [&](int l) {
      c.gpu.core().read_key_means(l, mu.data());
      for (int h = 0; h < kv; ++h)
        CHECK(std::memcmp(mu.data() + h * d, c.cpu.key_mean(l, h), static_cast<std::size_t>(d) * 4) == 0);
    };
    same_means(0);
    same_means(1);
    CHECK(mu[3] == 0.0f);
    c.truncate(0);
    c.append(0, kt::kv_data(3, kv, d, 9), kt::kv_data(3, kv, d, 10), 3);
    same_means(0);
    kt::require_same_bytes(c, 0);
    kt::require_same_reads(c, 0);
  }
  if constexpr (!kivi) {
    kt::run_multi_token<TestType, host_harness>(64, r, {64, 0});
    kt::run_paged<TestType, host_paged_harness>(64, r);
  }
}

TEST_CASE("cuda host: fp8 parameters (scale, no saturation)", "[cuda_host]") {
  kt::cpu_options<kvq::fp8_e4m3> o;
  o.key = {0.05f, kvq::fp8_overflow::no_saturate};
  o.value = {4.0f, kvq::fp8_overflow::saturate};
  kt::run_scenario<kvq::fp8_e4m3, host_harness>(64, 0, o);
  kt::cpu_options<kvq::fp8_e5m2> o2;
  o2.key = {1e-4f, kvq::fp8_overflow::no_saturate};
  o2.value = {1e-5f, kvq::fp8_overflow::saturate};
  kt::run_scenario<kvq::fp8_e5m2, host_harness>(80, 0, o2);
}

TEST_CASE("cuda host: GQA 32/8 and MHA 8/8, planner's splits", "[cuda_host]") {
  kt::run_gqa<kvq::q4_0, host_harness>(128, 700);
  kt::run_gqa<kvq::f16_codec, host_harness>(64, 300);
  kt::run_gqa<kvq::kivi<4>, host_harness>(128, 300, options_with<kvq::kivi<4>>(32));
}

TEMPLATE_TEST_CASE("cuda host: NaN and Inf inputs", "[cuda_host]", kvq::f32_codec, kvq::f16_codec, kvq::q8_0, kvq::q4_0,
                   kvq::int8_sym, kvq::fp8_e4m3, kvq::fp8_e5m2, kvq::kivi<4>, kvq::mxfp4, kvq::nvfp4) {
  kt::run_special_values<TestType, host_harness>(64);
  kt::run_special_values<TestType, host_harness>(40);
}

TEST_CASE("cuda host: batched attention over caches of one shape", "[cuda_host]") {
  kt::run_batched<kvq::q8_0, host_harness>(64, 5);
  kt::run_batched<kvq::kivi<2>, host_harness>(32, 4, options_with<kvq::kivi<2>>(32));
  kt::run_batched<kvq::f16_codec, host_harness>(8, 70);  // two launches (64 sequences per launch)
}

TEMPLATE_TEST_CASE("cuda host: multi-token attention matches the CPU kvq::attention", "[cuda_host][multi_token]",
                   kvq::q4_0, kvq::q8_0, kvq::fp8_e4m3, kvq::kivi<4>, kvq::f16_codec,
                   (kvq::kv_codecs<kvq::q8_0, kvq::kivi_value<2>>)) {
  kt::run_multi_token<TestType, host_harness>(64, 32, {128, 64});
  if constexpr (std::is_same_v<TestType, kvq::kivi<4>> || std::is_same_v<TestType, kvq::q4_0>) {
    kt::run_multi_token<TestType, host_harness>(80, 128, {64, 0});  // the planner's splits; KIVI R = 128
  }
}

TEST_CASE("cuda host: multi-token attention does not depend on the order of a block's threads", "[cuda_host]") {
  std::vector<float> results[2];
  for (int rev = 0; rev < 2; ++rev) {
    host_runtime rt;
    rt.control->reverse_threads = rev == 1;
    host_harness<kvq::kv_codecs<kvq::q4_0, kvq::kivi_value<4>>> g({1, 2, 80, 256}, {}, {64, 64}, rt);
    g.append(0, kt::kv_data(200, 2, 80, 11), kt::kv_data(200, 2, 80, 12), 200);
    kvq::attention_options opt;
    opt.query = kvq::query_precision::q8_0;
    opt.window = 70;
    results[rev] = g.attention_tokens(0, kvq_test::normal_data(9 * 8 * 80, 3), 9, 8, opt, 0);
  }
  CHECK(std::memcmp(results[0].data(), results[1].data(), results[0].size() * 4) == 0);
}

TEMPLATE_TEST_CASE("cuda host: bad arguments raise typed errors, cache unchanged", "[cuda_host]", kvq::q4_0,
                   kvq::kivi<4>, kvq::fp8_e4m3) {
  kt::run_errors<TestType, host_harness>(64);
}

TEMPLATE_TEST_CASE("cuda host: the paged cache matches the CPU paged cache", "[cuda_host][paged]", kvq::f32_codec,
                   kvq::f16_codec, kvq::q8_0, kvq::q4_0, kvq::int8_sym, kvq::fp8_e4m3, kvq::mxfp4, kvq::nvfp4,
                   (kvq::kv_codecs<kvq::q8_0, kvq::q4_0>), (kvq::kv_codecs<kvq::int8_sym, kvq::kivi_value<4>>),
                   kvq::kivi<2>, kvq::kivi<4>, (kvq::kivi<8, 16>)) {
  for (int residual : {0, 32}) {
    INFO("R " << residual);
    kt::run_paged<TestType, host_paged_harness>(64, residual);
  }
  kt::run_paged<TestType, host_paged_harness>(80, 32, {64, 40});  // split_tokens off the page grid
}

TEMPLATE_TEST_CASE("cuda host: batched multi-token paged attention matches the CPU kvq::paged_attention",
                   "[cuda_host][paged][multi_token]", kvq::q4_0, kvq::q8_0, kvq::f16_codec, kvq::kivi<4>,
                   (kvq::kv_codecs<kvq::q8_0, kvq::kivi_value<2>>)) {
  kt::run_paged_chunks<TestType, host_paged_harness>(64, 32, {128, 64});
  if constexpr (std::is_same_v<TestType, kvq::q4_0> || std::is_same_v<TestType, kvq::kivi<4>>) {
    kt::run_paged_chunks<TestType, host_paged_harness>(80, 0, {64, 40});  // split_tokens off the page grid
    kt::run_paged_chunks<TestType, host_paged_harness>(64, 32);           // the planner's splits
  }
}

TEST_CASE("cuda host: the paged cache checks before it changes anything", "[cuda_host][paged]") {
  host_runtime rt;
  host_paged_harness<kvq::q8_0> g({1, 2, 64, 32, 3, 2}, 0, {}, rt);
  auto const a = g.add_sequence();
  auto const k = kt::kv_data(100, 2, 64, 5);
  CHECK_THROWS_AS(g.append(a, 0, k, k, 100), kvq::capacity_error);  // 4 pages
  REQUIRE(g.core().size(a) == 0);
  REQUIRE(g.pages().used_pages == 0);
  g.append(a, 0, k, k, 90);
  std::vector<kvq::sequence_id> ids{a, a + 1};
  std::vector<float> q(2 * 4 * 64), out(q.size());
  CHECK_THROWS_AS(g.core().attention(0, ids, q.data(), 4, out.data(), {}, 0), kvq::index_error);
  CHECK_THROWS_AS(
      g.core().attention(0, std::span<kvq::sequence_id const>(ids.data(), 1), q.data(), 3, out.data(), {}, 0),
      kvq::shape_error);
  kvq::attention_options i8;  // integer P·V: CPU only
  i8.probabilities = kvq::probability_precision::i8;
  CHECK_THROWS_AS(
      g.core().attention(0, std::span<kvq::sequence_id const>(ids.data(), 1), q.data(), 4, out.data(), i8, 0),
      kvq::unsupported_error);
  rt.control->fail_in = 1;
  CHECK_THROWS_AS(g.append(a, 0, k, k, 1), kvq::device_error);
  CHECK_FALSE(g.core().usable());
  CHECK_THROWS_AS(g.read(true, a, 0, 0, 0, 1), kvq::device_error);
}

TEMPLATE_TEST_CASE("cuda host: caches save the CPU cache's bytes and load them", "[cuda_host][persist]", kvq::q8_0,
                   kvq::q4_0, kvq::fp8_e5m2, kvq::nvfp4, (kvq::kv_codecs<kvq::int8_sym, kvq::kivi_value<4>>),
                   kvq::kivi<2>, (kvq::kv_codecs<kvq::centered<kvq::q4_0>, kvq::q8_0>)) {
  using flat_t = kvq::cuda_cache_core<TestType, host_runtime>;
  using paged_t = kvq::cuda_paged_cache_core<TestType, host_runtime>;
  typename flat_t::options o;
  o.residual = 32;
  typename paged_t::options po;
  po.residual = 32;
  flat_t a({2, 2, 64, 256}, o, host_runtime{}), b({2, 2, 64, 256}, o, host_runtime{});
  paged_t p({2, 2, 64, 32, 16, 4}, po, host_runtime{}), q({2, 2, 64, 32, 16, 4}, po, host_runtime{});
  auto const failures = kvq_test::persist_failures<TestType>(
      2, 2, 64, 32, a, b, p, q,
      [](flat_t& c, int l, float const* k, float const* v, std::int64_t n) {
        c.append(l, kvq::token_major(k, n, 2, 64), kvq::token_major(v, n, 2, 64), 0);
      },
      [](flat_t& c, bool keys, int l, int h, std::int64_t n, float* out) {
        if (keys) {
          c.read_keys(l, h, 0, n, out, 0, 0);
        } else {
          c.read_values(l, h, 0, n, out, 0, 0);
        }
      },
      [](paged_t& c, kvq::sequence_id s, int l, float const* k, float const* v, std::int64_t n) {
        c.append(s, l, kvq::token_major(k, n, 2, 64), kvq::token_major(v, n, 2, 64), 0);
      },
      [](paged_t& c, kvq::sequence_id s, bool keys, int l, int h, std::int64_t n, float* out) {
        if (keys) {
          c.read_keys(s, l, h, 0, n, out, 0, 0);
        } else {
          c.read_values(s, l, h, 0, n, out, 0, 0);
        }
      });
  for (auto const& f : failures) FAIL_CHECK(f);
  REQUIRE(failures.empty());
}

TEST_CASE("cuda host: a failing runtime call makes the cache unusable", "[cuda_host]") {
  host_runtime rt;
  host_harness<kvq::q8_0> g({1, 2, 64, 64}, {}, {}, rt);
  auto const k = kt::kv_data(4, 2, 64, 5);
  g.append(0, k, k, 4);
  rt.control->fail_in = 2;  // the value kernel of the next append
  CHECK_THROWS_AS(g.append(0, k, k, 4), kvq::device_error);
  CHECK_FALSE(g.core().usable());
  CHECK_THROWS_AS(g.append(0, k, k, 1), kvq::device_error);
  CHECK_THROWS_AS(g.read<float>(true, 0, 0, 0, 1), kvq::device_error);
  CHECK_THROWS_AS(g.attention(0, std::vector<float>(128), 2, {}), kvq::device_error);
  try {
    g.truncate(1);
    FAIL("truncate on an unusable cache must raise");
  } catch (kvq::device_error const& e) {
    CHECK(std::string(e.what()).find("test kernel launch: injected failure") != std::string::npos);
  }
}

TEST_CASE("cuda host: attention does not depend on the order of a block's threads", "[cuda_host]") {
  for (int threads : {32, 128, 256}) {
    std::vector<float> results[2];
    for (int rev = 0; rev < 2; ++rev) {
      host_runtime rt;
      rt.control->reverse_threads = rev == 1;
      host_harness<kvq::kv_codecs<kvq::q4_0, kvq::kivi_value<4>>> g({1, 2, 80, 256}, {}, {threads, 64}, rt);
      g.append(0, kt::kv_data(200, 2, 80, 11), kt::kv_data(200, 2, 80, 12), 200);
      kvq::attention_options opt;
      opt.query = kvq::query_precision::q8_0;
      opt.probabilities = kvq::probability_precision::f16;
      results[rev] = g.attention(0, kvq_test::normal_data(8 * 80, 3), 8, opt);
    }
    INFO("threads " << threads);
    CHECK(std::memcmp(results[0].data(), results[1].data(), results[0].size() * 4) == 0);
  }
  host_harness<kvq::q8_0> g({1, 2, 64, 64}, {}, {128, 64}, host_runtime{});
  g.append(0, kt::kv_data(40, 2, 64, 11), kt::kv_data(40, 2, 64, 12), 40);
  kvq::attention_options i8;  // integer P·V: CPU only
  i8.probabilities = kvq::probability_precision::i8;
  CHECK_THROWS_AS(g.attention(0, kvq_test::normal_data(4 * 64, 3), 4, i8), kvq::unsupported_error);
}

TEST_CASE("cuda host: attention plan", "[cuda_host]") {
  kvq::detail::attention_plan p;
  // H200-like: 132 SMs; 32/8 heads, head_dim 128, 32k tokens, batch 16.
  auto const dev = [](int sms) {
    kvq::detail::attention_device d;
    d.smem_limit = 48 * 1024;
    d.threads = 128;
    d.max_tile = 32;
    d.target_blocks = 4 * sms;
    return d;
  };
  REQUIRE(kvq::detail::plan_attention(128, 8, 32, 16, 32768, false, dev(132), p));
  CHECK(p.tile == 32);
  CHECK(p.heads == 4);
  CHECK(p.chunks == 1);
  CHECK(p.split_tokens % p.tile == 0);
  CHECK(p.splits * p.split_tokens >= 32768);
  CHECK(p.splits * 8 * 16 >= 4 * 132);
  CHECK(p.smem_bytes <= 48 * 1024);
  // MQA with many query heads: the heads are chunked to fit shared memory.
  REQUIRE(kvq::detail::plan_attention(256, 1, 64, 1, 1000, true, dev(132), p));
  CHECK(p.heads * p.chunks >= 64);
  CHECK(p.smem_bytes <= 48 * 1024);
  // Nothing to attend: no split.
  REQUIRE(kvq::detail::plan_attention(64, 2, 4, 1, 0, false, dev(132), p));
  CHECK(p.splits == 0);
  // A head_dim far too large for a block's shared memory.
  CHECK_FALSE(kvq::detail::plan_attention(65536, 1, 1, 1, 10, false, dev(132), p));
  STATIC_REQUIRE(kvq::implements<kvq::q4_0, kvq::cuda>::value);
  STATIC_REQUIRE(kvq::implements<kvq::kivi_key<2, 64>, kvq::cuda>::value);
}
