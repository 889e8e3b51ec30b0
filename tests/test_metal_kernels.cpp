// kvq's Metal kernels, run on the CPU through tests/metal (the .metal file compiled as C++), against
// the scalar reference: encoded cache bytes identical to the CPU cache's, decoded values
// bit-identical, decode attention within fp32 rounding of kvq::decode_attention with the same
// options; every codec, head_dims 8, 64, 80 and 128.
//
// `shim_cache` below drives the kernels as backend/metal/metal_cache.hpp does on a Mac: the cache
// core (core/cache_core.hpp) over a device whose memory is host memory and whose kernel launches
// go to the shim's dispatcher, with the same arguments and grids.
#include <kvq/attention.hpp>
#include <kvq/backend/metal/metal_cache.hpp>
#include <kvq/cache.hpp>
#include <kvq/codec/fp8.hpp>
#include <kvq/codec/int8.hpp>
#include <kvq/codec/kivi.hpp>
#include <kvq/codec/passthrough.hpp>
#include <kvq/codec/q4_0.hpp>
#include <kvq/codec/q8_0.hpp>
#include <kvq/codec/rotated.hpp>
#include <kvq/codec/tq.hpp>
#include <kvq/core/cache_core.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "catch_compat.hpp"
#include "metal/metal_cache_checks.hpp"
#include "metal/metal_shim.hpp"
#include "test_support.hpp"

namespace {

namespace shim = kvq_metal_shim;
namespace kd = kvq::detail;

/// How the attention kernels are launched.
struct launch_options {
  std::uint32_t threads = 64;      ///< threads per threadgroup
  std::uint32_t simd_width = 32;   ///< SIMD-group width
  std::int64_t split_tokens = 0;   ///< > 0: forced tokens per split
  std::size_t smem_limit = 32768;  ///< threadgroup memory limit in bytes
};

/// The names of kvq's Metal kernels (kernels.metal) for the write kernels of a plan.
constexpr char const* write_kernel_names[] = {"kvq_encode_rows", "kvq_encode_key_tiles", "kvq_store_f16_rows"};

/// A cache core device on host memory whose kernels run through the shim (1-D grids, as the Metal
/// device dispatches them).
struct shim_device {
  using backend_tag = kvq::metal;
  using stream_type = kd::no_stream;
  using layer_type = std::uint8_t*;
  using input_type = void const*;
  using output_type = void*;
  static constexpr char const* name = "Metal cache";
  static constexpr std::int64_t max_capacity = (std::int64_t{1} << 31) - 1;

  auto allocate(std::size_t bytes) -> std::uint8_t* {
    auto* p = static_cast<std::uint8_t*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
    std::memset(p, 0, bytes);
    return p;
  }
  void deallocate(std::uint8_t* p, std::size_t) noexcept { std::free(p); }
  auto address(std::uint8_t* p) const -> std::byte* { return reinterpret_cast<std::byte*>(p); }
  auto output_at(std::uint8_t* p, std::size_t offset) const -> void* { return p + offset; }
  auto offset_output(void* out, std::size_t bytes) const -> void* { return static_cast<std::uint8_t*>(out) + bytes; }
  auto finish(kd::no_stream) const -> kvq::device_status { return {}; }
  static auto grid(std::int64_t n) -> shim::size3 { return {static_cast<std::uint32_t>(n), 1, 1}; }

  template <class C>
  auto write(kd::write_step const& s, std::uint8_t* layer, void const* input, kd::no_stream) const
      -> kvq::device_status {
    shim::dispatch_threads(write_kernel_names[static_cast<int>(s.kernel)], {kd::kernel_codec<C>::value, 0},
                           grid(s.threads), {const_cast<kvq_write_args*>(&s.args), layer, const_cast<void*>(input)});
    return {};
  }
  template <class C>
  auto decode(kvq_decode_args const& a, std::uint8_t* layer, void* out, kd::no_stream) const -> kvq::device_status {
    shim::dispatch_threads("kvq_decode", {kd::kernel_codec<C>::value, 0},
                           grid(static_cast<std::int64_t>(a.count) * a.head_dim),
                           {const_cast<kvq_decode_args*>(&a), layer, out});
    return {};
  }
  auto copy_out(std::uint8_t* layer, std::size_t offset, void* dst, std::size_t bytes) const -> kvq::device_status {
    std::memcpy(dst, layer + offset, bytes);
    return {};
  }
  auto move(std::uint8_t* layer, std::size_t region0, std::size_t head_stride, int kv_heads, kd::byte_move const& m,
            kd::no_stream) const -> kvq::device_status {
    for (int h = 0; h < kv_heads; ++h) {
      std::uint8_t* r = layer + region0 + static_cast<std::size_t>(h) * head_stride;
      std::memmove(r + m.dst, r + m.src, m.bytes);
    }
    return {};
  }
};

/// The attention launch of the last call: plan and arguments.
struct launch_record {
  kd::attention_plan plan;
  kvq_attention_args args{};
};

/// The Metal cache's kernels driven on host memory through the shim (see the file comment).
template <class Choice>
class shim_cache {
 public:
  using cpu_cache = kvq::QuantizedKVCache<Choice>;
  using options = typename cpu_cache::options;

  shim_cache(kvq::cache_shape const& shape, options const& opt)
      : core_(shape, opt.residual, opt.key, opt.value, shim_device{}) {}

  auto layer_bytes() const -> std::size_t { return core_.layer_bytes(); }
  auto layer(int l) -> std::uint8_t* { return core_.layer(l); }
  auto state(int l) const -> kd::layer_state const& { return core_.state(l); }
  auto key_side() const -> kd::cache_side const& { return core_.key_side(); }
  auto value_side() const -> kd::cache_side const& { return core_.value_side(); }

  template <class T>
  void append(int l, kvq::kv_tensor<T> const& keys, kvq::kv_tensor<T> const& values) {
    core_.check_append(l, kd::describe(keys), kd::describe(values));
    int const type = kd::kernel_elem<T>();
    core_.append_checked(l, keys.tokens, keys.data, kd::kernel_source(type, keys.token_stride, keys.head_stride),
                         values.data, kd::kernel_source(type, values.token_stride, values.head_stride), {});
  }

  /// Decodes tokens [first, first + count) of (layer, head) into out (rows `stride` apart).
  template <class T>
  void read(bool keys, int l, int head, std::int64_t first, std::int64_t count, T* out, std::int64_t stride) {
    core_.check_read("read", l, head, first, count);
    core_.read_checked(keys, l, head, first, count, out, kd::kernel_elem<T>(), stride, {});
  }

  void truncate(std::int64_t n) { core_.truncate(n, {}); }
  void shift_left(std::int64_t n) { core_.shift_left(n, {}); }

  /// Decode attention of q (q_heads, head_dim) over `layer` into out, as the Metal cache runs it.
  void attention(int l, float const* q, int q_heads, float* out, kvq::attention_options const& opt,
                 launch_options const& lo = {}) {
    auto const& shape = core_.shape();
    std::int64_t const len = state(l).length;
    std::int64_t const begin = opt.window > 0 ? std::max<std::int64_t>(0, len - opt.window) : 0;
    float const scale = opt.scale > 0.0f ? opt.scale : 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
    kd::attention_device dev;
    dev.smem_limit = lo.smem_limit;
    dev.threads = static_cast<int>(lo.threads);
    dev.max_tile = std::clamp(4096 / shape.head_dim, 1, 32);
    dev.target_blocks = 64;
    dev.split_tokens = lo.split_tokens;
    launch_record& r = last_;
    REQUIRE(kd::plan_attention(shape.head_dim, shape.kv_heads, q_heads, 1, len - begin,
                               opt.query == kvq::query_precision::q8_0, dev, r.plan));
    r.args = kd::attention_arguments(key_side(), value_side(), shape.head_dim, shape.kv_heads, q_heads, r.plan, scale,
                                     opt.softcap, opt.query == kvq::query_precision::q8_0,
                                     opt.probabilities == kvq::probability_precision::f16);
    std::size_t const d = static_cast<std::size_t>(shape.head_dim);
    std::size_t const qh = static_cast<std::size_t>(q_heads);
    if (r.plan.splits == 0) {
      std::fill(out, out + qh * d, 0.0f);
      return;
    }
    kvq_attention_seq seq = kd::attention_sequence(key_side(), value_side(), state(l), begin, len);
    std::size_t const splits = static_cast<std::size_t>(r.plan.splits);
    std::vector<float> part_out(splits * qh * d), part_max(splits * qh), part_sum(splits * qh);
    std::int32_t no_pages = 0;
    shim::dispatch_threadgroups(
        "kvq_attention_partial", {key_side().codec, value_side().codec},
        {static_cast<std::uint32_t>(splits), static_cast<std::uint32_t>(shape.kv_heads * r.plan.chunks), 1},
        {lo.threads, 1, 1}, r.plan.smem_bytes, lo.simd_width,
        {&r.args, &seq, layer(l), const_cast<float*>(q), part_out.data(), part_max.data(), part_sum.data(), &no_pages});
    kvq_combine_args cb{q_heads, shape.head_dim, r.plan.splits, 1, 0, 0};
    shim::dispatch_threads("kvq_attention_combine", {0, 0}, grid(static_cast<std::int64_t>(qh * d)),
                           {&cb, part_out.data(), part_max.data(), part_sum.data(), out});
  }

  auto last_plan() const -> launch_record const& { return last_; }
  /// Centered keys: the key means of `l` (kv_heads x head_dim) in device memory.
  void key_means(int l, float* out) { core_.read_key_means(l, out); }

 private:
  static auto grid(std::int64_t n) -> shim::size3 { return shim_device::grid(n); }

  kvq::cache_core<Choice, shim_device> core_;
  launch_record last_;
};

/// The CPU cache and the shim cache side by side, fed the same data.
template <class Choice>
struct pair_of_caches {
  using cpu_cache = kvq::QuantizedKVCache<Choice>;
  cpu_cache cpu;
  shim_cache<Choice> gpu;
  pair_of_caches(kvq::cache_shape const& s, typename cpu_cache::options const& o) : cpu(s, o), gpu(s, o) {}

  template <class T>
  void append(int l, kvq::kv_tensor<T> const& k, kvq::kv_tensor<T> const& v) {
    cpu.append(l, k, v);
    gpu.append(l, k, v);
  }
  void truncate(std::int64_t n) {
    cpu.truncate(n);
    gpu.truncate(n);
  }
  void shift_left(std::int64_t n) {
    cpu.shift_left(n);
    gpu.shift_left(n);
  }
};

/// Requires the Metal cache's bytes to equal the CPU cache's: every encoded unit region and value
/// window in full, and the live rows of the KIVI key residual (the CPU also leaves already-flushed
/// rows there, which no read ever sees).
template <class Choice>
void require_same_bytes(pair_of_caches<Choice>& c, int l) {
  auto const& sh = c.cpu.shape();
  auto const& k = c.gpu.key_side();
  auto const& v = c.gpu.value_side();
  auto const* cpu = reinterpret_cast<std::uint8_t const*>(c.cpu.key_storage(l, 0).units);
  auto const* gpu = c.gpu.layer(l);
  auto const& st = c.gpu.state(l);
  REQUIRE(st.length == c.cpu.size(l));
  for (int h = 0; h < sh.kv_heads; ++h) {
    std::size_t const ko = k.region.head0 + static_cast<std::size_t>(h) * k.region.head_stride;
    INFO("layer " << l << " head " << h << " tokens " << st.length);
    REQUIRE(std::memcmp(cpu + ko, gpu + ko, k.units_bytes) == 0);
    if (k.tiles) {
      std::size_t const live = static_cast<std::size_t>(st.length - st.key_quantized) * sh.head_dim * 2;
      std::size_t const ro = k.region.residual0 + static_cast<std::size_t>(h) * k.region.residual_stride;
      REQUIRE(std::memcmp(cpu + ro, gpu + ro, live) == 0);
    }
    std::size_t const vo = v.region.head0 + static_cast<std::size_t>(h) * v.region.head_stride;
    REQUIRE(std::memcmp(cpu + vo, gpu + vo, v.region.head_stride) == 0);
  }
}

/// Requires decoded keys and values of every head of `l` (f32, f16 and bf16 outputs, a strided
/// read of a sub-range too) to be bit-identical to the CPU cache's reads.
template <class Choice>
void require_same_reads(pair_of_caches<Choice>& c, int l) {
  auto const& sh = c.cpu.shape();
  std::int64_t const len = c.cpu.size(l);
  std::int64_t const d = sh.head_dim;
  for (int h = 0; h < sh.kv_heads; ++h) {
    for (bool keys : {true, false}) {
      INFO("layer " << l << " head " << h << (keys ? " keys" : " values") << " tokens " << len);
      std::vector<float> want(static_cast<std::size_t>(len * d)), got(want.size(), -1.0f);
      if (keys) {
        c.cpu.read_keys(l, h, 0, len, want.data());
      } else {
        c.cpu.read_values(l, h, 0, len, want.data());
      }
      c.gpu.read(keys, l, h, 0, len, got.data(), d);
      for (std::size_t i = 0; i < want.size(); ++i) {
        INFO("element " << i);
        REQUIRE(kvq_test::bits(want[i]) == kvq_test::bits(got[i]));
      }
      // f16 and bf16 outputs of a sub-range, rows d + 3 elements apart.
      std::int64_t const first = len / 3;
      std::int64_t const count = len - first - len / 5;
      std::int64_t const stride = d + 3;
      std::vector<kvq::f16> wh(static_cast<std::size_t>(count * stride)), gh(wh.size());
      std::vector<kvq::bf16> wb(wh.size()), gb(wh.size());
      if (keys) {
        c.cpu.read_keys(l, h, first, count, wh.data(), stride);
        c.cpu.read_keys(l, h, first, count, wb.data(), stride);
      } else {
        c.cpu.read_values(l, h, first, count, wh.data(), stride);
        c.cpu.read_values(l, h, first, count, wb.data(), stride);
      }
      c.gpu.read(keys, l, h, first, count, gh.data(), stride);
      c.gpu.read(keys, l, h, first, count, gb.data(), stride);
      for (std::int64_t t = 0; t < count; ++t)
        for (std::int64_t e = 0; e < d; ++e) {
          auto const i = static_cast<std::size_t>(t * stride + e);
          REQUIRE(wh[i].bits == gh[i].bits);
          REQUIRE(wb[i].bits == gb[i].bits);
        }
    }
  }
}

/// Largest |a - b| / (1 + max |b| over the head), NaN positions required to agree.
auto attention_error(std::vector<float> const& want, std::vector<float> const& got, int q_heads, int d) -> double {
  double worst = 0.0;
  for (int h = 0; h < q_heads; ++h) {
    double scale = 1.0;
    for (int c = 0; c < d; ++c) {
      float const w = want[static_cast<std::size_t>(h * d + c)];
      if (std::isfinite(w)) scale = std::max(scale, 1.0 + std::fabs(static_cast<double>(w)));
    }
    for (int c = 0; c < d; ++c) {
      auto const i = static_cast<std::size_t>(h * d + c);
      INFO("head " << h << " channel " << c << " want " << want[i] << " got " << got[i]);
      REQUIRE(std::isnan(want[i]) == std::isnan(got[i]));
      if (std::isnan(want[i])) continue;
      REQUIRE(std::isinf(want[i]) == std::isinf(got[i]));
      if (std::isinf(want[i])) {
        REQUIRE(want[i] == got[i]);
        continue;
      }
      worst = std::max(worst, std::fabs(static_cast<double>(want[i]) - got[i]) / scale);
    }
  }
  return worst;
}

/// fp32 tolerance of the attention comparison (relative to 1 + the head's largest output).
constexpr double attention_tolerance = 2e-5;
/// Tolerance with f16 probabilities (f16 has 11 significant bits).
constexpr double f16_probability_tolerance = 1e-3;

/// Attention of the Metal kernels vs kvq::decode_attention on the CPU cache, same options.
///
/// With probabilities rounded to f16, agreement is to f16 precision only (`tolerance`): rounding to
/// 11 bits turns a 1-ulp difference of a probability (summation order, exp) into a 2^-11 one, and
/// a split starts its own running max (as decode_attention_parallel does on the CPU).
template <class Choice>
void require_same_attention(pair_of_caches<Choice>& c, int l, int q_heads, kvq::attention_options const& opt,
                            launch_options const& lo, std::uint32_t seed, double tolerance = attention_tolerance) {
  int const d = c.cpu.shape().head_dim;
  auto const q = kvq_test::normal_data(static_cast<std::size_t>(q_heads * d), seed, 1.5f);
  std::vector<float> want(q.size()), got(q.size(), -7.0f);
  kvq::decode_attention(c.cpu, l, q.data(), q_heads, want.data(), opt);
  c.gpu.attention(l, q.data(), q_heads, got.data(), opt, lo);
  INFO("q_heads " << q_heads << " scale " << opt.scale << " window " << opt.window << " softcap " << opt.softcap
                  << " q8_0 query " << (opt.query == kvq::query_precision::q8_0) << " f16 probabilities "
                  << (opt.probabilities == kvq::probability_precision::f16) << " threads " << lo.threads
                  << " simd width " << lo.simd_width << " splits " << c.gpu.last_plan().plan.splits << " tile "
                  << c.gpu.last_plan().plan.tile << " heads/threadgroup " << c.gpu.last_plan().plan.heads);
  double const err = attention_error(want, got, q_heads, d);
  CHECK(err <= tolerance);
}

/// Token-major data for n tokens of every kv_head; mostly N(0,1) with outlier channels.
auto kv_data(std::int64_t n, int kv_heads, int d, std::uint32_t seed) -> std::vector<float> {
  return kvq_test::outlier_rows(static_cast<int>(n) * kv_heads, d, seed);
}

template <class Choice>
auto make_options(int residual) -> typename kvq::QuantizedKVCache<Choice>::options {
  typename kvq::QuantizedKVCache<Choice>::options o;
  o.residual = residual;
  return o;
}

/// The scenario every codec runs: chunked appends across KIVI flushes and window wrap-arounds,
/// bytes and reads compared after each step, truncate into a tile, shift, more appends, attention.
template <class Choice>
void run_scenario(int d, int residual, typename kvq::QuantizedKVCache<Choice>::options opt,
                  bool full_attention = true) {
  int const kv = 2;
  int const layers = 2;
  opt.residual = residual;
  pair_of_caches<Choice> c({layers, kv, d, 320}, opt);
  std::uint32_t seed = static_cast<std::uint32_t>(d * 131 + residual);
  std::vector<std::int64_t> const chunks = {1, 5, 37, 1, 1, 20, 70, 3};
  for (int l = 0; l < layers; ++l) {
    for (std::int64_t n : chunks) {
      auto const k = kv_data(n, kv, d, ++seed);
      auto const v = kv_data(n, kv, d, ++seed);
      c.append(l, kvq::token_major(k.data(), n, kv, d), kvq::token_major(v.data(), n, kv, d));
      require_same_bytes(c, l);
    }
    require_same_reads(c, l);
  }
  // Truncate into the middle of a tile (KIVI: a lossy un-tiling), then keep appending.
  c.truncate(100);
  for (int l = 0; l < layers; ++l) {
    require_same_bytes(c, l);
    require_same_reads(c, l);
    auto const k = kv_data(45, kv, d, ++seed);
    auto const v = kv_data(45, kv, d, ++seed);
    c.append(l, kvq::token_major(k.data(), 45, kv, d), kvq::token_major(v.data(), 45, kv, d));
    require_same_bytes(c, l);
    require_same_reads(c, l);
  }
  // Sliding window: drop 64 tokens (a multiple of G for KIVI), append again.
  c.shift_left(64);
  for (int l = 0; l < layers; ++l) {
    require_same_bytes(c, l);
    require_same_reads(c, l);
    auto const k = kv_data(33, kv, d, ++seed);
    auto const v = kv_data(33, kv, d, ++seed);
    c.append(l, kvq::token_major(k.data(), 33, kv, d), kvq::token_major(v.data(), 33, kv, d));
    require_same_bytes(c, l);
    require_same_reads(c, l);
  }
  // Attention: GQA (2 query heads per kv head) over several splits; MHA in one split with scale,
  // window and soft-cap; the q8_0 query (integer dots for q8_0/q4_0 keys); f16 probabilities.
  launch_options lo;
  lo.split_tokens = 48;
  require_same_attention(c, 0, 2 * kv, {}, lo, ++seed);
  if (!full_attention) return;
  kvq::attention_options opt2;
  opt2.scale = 0.2f;
  opt2.window = 70;
  opt2.softcap = 8.0f;
  require_same_attention(c, 1, kv, opt2, launch_options{}, ++seed);
  kvq::attention_options opt3;
  opt3.query = kvq::query_precision::q8_0;
  require_same_attention(c, 1, 2 * kv, opt3, lo, ++seed);
  opt3.probabilities = kvq::probability_precision::f16;
  require_same_attention(c, 0, 2 * kv, opt3, lo, ++seed, f16_probability_tolerance);
}

// Every facade pair (any_cache.hpp's list), which covers every codec as keys and as values.
using all_pairs =
    std::tuple<kvq::f32_codec, kvq::f16_codec, kvq::q4_0, kvq::q8_0, kvq::int8_sym, kvq::fp8_e4m3, kvq::fp8_e5m2,
               kvq::mxfp4, kvq::nvfp4, kvq::kivi<2>, kvq::kivi<4>, kvq::kivi<8>, kvq::kv_codecs<kvq::q8_0, kvq::q4_0>,
               kvq::kv_codecs<kvq::q8_0, kvq::f16_codec>, kvq::kv_codecs<kvq::f16_codec, kvq::q8_0>,
               kvq::kv_codecs<kvq::f16_codec, kvq::q4_0>, kvq::kv_codecs<kvq::int8_sym, kvq::q4_0>,
               kvq::kv_codecs<kvq::fp8_e4m3, kvq::q4_0>, kvq::kv_codecs<kvq::q8_0, kvq::kivi_value<4>>,
               kvq::kv_codecs<kvq::int8_sym, kvq::kivi_value<4>>, kvq::kv_codecs<kvq::int8_sym, kvq::kivi_value<2>>,
               kvq::kv_codecs<kvq::kivi_key<8>, kvq::kivi_value<4>>,
               kvq::kv_codecs<kvq::kivi_key<4>, kvq::kivi_value<2>>,
               kvq::kv_codecs<kvq::kivi_key<8>, kvq::kivi_value<2>>>;

}  // namespace

TEMPLATE_LIST_TEST_CASE("metal kernels match the scalar reference", "[metal]", all_pairs) {
  for (int d : {8, 64, 80, 128}) {
    DYNAMIC_SECTION("head_dim " << d) {
      // R = 32 (flushes and window wrap-arounds within the scenario); KIVI also with R = 0 and 64.
      run_scenario<TestType>(d, 32, {});
      constexpr bool kivi = kvq::codec_pair<TestType>::key::layout == kvq::codec_layout::token_group ||
                            kd::has_value_window<typename kvq::codec_pair<TestType>::value>::value;
      if constexpr (kivi) {
        run_scenario<TestType>(d, 0, {}, false);
        run_scenario<TestType>(d, 64, {}, false);
      }
    }
  }
}

// Rotated codecs: the stored codec's kernels with R at the edges (kvq_source::rotate,
// kvq_decode_args::unrotate, kvq_attention_args::rotation); keys or values alone, two seeds, the
// tq codebooks, a KIVI residual of rotated rows.
TEMPLATE_TEST_CASE("metal kernels rotated codecs match the scalar reference", "[metal][rotated]",
                   kvq::rotated<kvq::q8_0>, (kvq::kv_codecs<kvq::rotated<kvq::q4_0>, kvq::f16_codec>),
                   (kvq::kv_codecs<kvq::q8_0, kvq::tq4>), kvq::tq3,
                   (kvq::kv_codecs<kvq::tq2, kvq::rotated<kvq::q4_0, 9>>),
                   (kvq::kv_codecs<kvq::rotated<kvq::kivi_key<4>>, kvq::rotated<kvq::kivi_value<4>>>)) {
  STATIC_REQUIRE(kvq::implements<typename kvq::codec_pair<TestType>::key, kvq::metal>::value);
  STATIC_REQUIRE(kvq::implements<typename kvq::codec_pair<TestType>::value, kvq::metal>::value);
  for (int d : {8, 80}) {
    DYNAMIC_SECTION("head_dim " << d) { run_scenario<TestType>(d, 32, {}, d == 80); }
  }
}

// Centered keys: the key means computed by the write kernel from a layer's first chunk (the CPU's
// rule, bit for bit), subtracted before the rotation, added to reads, and the logit offset
// scale * (q.mu) in the attention (soft-cap included).
TEMPLATE_TEST_CASE("metal kernels centered keys match the scalar reference", "[metal][centered]",
                   (kvq::kv_codecs<kvq::centered<kvq::q4_0>, kvq::q8_0>),
                   (kvq::kv_codecs<kvq::centered<kvq::rotated<kvq::q4_0>>, kvq::f16_codec>)) {
  STATIC_REQUIRE(kvq::implements<typename kvq::codec_pair<TestType>::key, kvq::metal>::value);
  run_scenario<TestType>(80, 0, {});
  int const kv = 2, d = 40;
  pair_of_caches<TestType> c({1, kv, d, 64}, {});
  auto k = kv_data(9, kv, d, 3);
  for (float& x : k) x -= 2.5f;
  c.append(0, kvq::token_major(k.data(), 9, kv, d), kvq::token_major(k.data(), 9, kv, d));
  std::vector<float> mu(static_cast<std::size_t>(kv * d));
  c.gpu.key_means(0, mu.data());
  for (int h = 0; h < kv; ++h)
    CHECK(std::memcmp(mu.data() + h * d, c.cpu.key_mean(0, h), static_cast<std::size_t>(d) * 4) == 0);
  require_same_reads(c, 0);
}

TEST_CASE("metal kernels fp8 scale and overflow modes", "[metal]") {
  for (auto overflow : {kvq::fp8_overflow::saturate, kvq::fp8_overflow::no_saturate}) {
    for (int d : {8, 80}) {
      kvq::QuantizedKVCache<kvq::fp8_e4m3>::options o;
      o.key = {0.05f, overflow};
      o.value = {3.0f, overflow};
      run_scenario<kvq::fp8_e4m3>(d, 0, o);
      kvq::QuantizedKVCache<kvq::fp8_e5m2>::options o2;
      o2.key = {0.001f, overflow};
      o2.value = {0.25f, overflow};
      run_scenario<kvq::fp8_e5m2>(d, 0, o2);
    }
  }
}

TEMPLATE_TEST_CASE("metal kernels f16 and bf16 input and head-major strides", "[metal]", kvq::q4_0, kvq::int8_sym,
                   kvq::kivi<4>, kvq::f32_codec) {
  int const d = 64;
  int const kv = 3;
  std::int64_t const n = 50;
  pair_of_caches<TestType> c({1, kv, d, 200}, make_options<TestType>(32));
  auto const kf = kv_data(n, kv, d, 11);
  auto const vf = kv_data(n, kv, d, 12);
  // f16, token-major.
  std::vector<kvq::f16> kh(kf.size()), vh(vf.size());
  for (std::size_t i = 0; i < kf.size(); ++i) {
    kh[i] = kvq::to_f16(kf[i]);
    vh[i] = kvq::to_f16(vf[i]);
  }
  c.append(0, kvq::token_major(kh.data(), n, kv, d), kvq::token_major(vh.data(), n, kv, d));
  // bf16, head-major: element (t, h, c) at h * n * d + t * d + c.
  std::vector<kvq::bf16> kb(kf.size()), vb(vf.size());
  for (int h = 0; h < kv; ++h)
    for (std::int64_t t = 0; t < n; ++t)
      for (int e = 0; e < d; ++e) {
        auto const src = static_cast<std::size_t>((t * kv + h) * d + e);
        auto const dst = static_cast<std::size_t>((h * n + t) * d + e);
        kb[dst] = kvq::to_bf16(vf[src] * 3.0f);
        vb[dst] = kvq::to_bf16(kf[src] - 1.0f);
      }
  kvq::kv_tensor<kvq::bf16> const kt{kb.data(), n, kv, d, d, n * d};
  kvq::kv_tensor<kvq::bf16> const vt{vb.data(), n, kv, d, d, n * d};
  c.append(0, kt, vt);
  require_same_bytes(c, 0);
  require_same_reads(c, 0);
  require_same_attention(c, 0, 2 * kv, {}, launch_options{}, 5);
}

TEMPLATE_TEST_CASE("metal kernels NaN and Inf in keys and values", "[metal]", kvq::f32_codec, kvq::f16_codec, kvq::q8_0,
                   kvq::q4_0, kvq::int8_sym, kvq::fp8_e4m3, kvq::fp8_e5m2, kvq::mxfp4, kvq::nvfp4, kvq::kivi<2>,
                   kvq::kivi<8>) {
  int const d = 64;
  int const kv = 2;
  std::int64_t const n = 96;
  float const inf = std::numeric_limits<float>::infinity();
  float const nan = std::numeric_limits<float>::quiet_NaN();
  pair_of_caches<TestType> c({2, kv, d, 128}, make_options<TestType>(32));
  auto k = kv_data(n, kv, d, 21);
  auto v = kv_data(n, kv, d, 22);
  auto at = [&](std::int64_t t, int h, int e) { return static_cast<std::size_t>((t * kv + h) * d + e); };
  // Layer 0: a NaN key in token 5 of head 0 and +Inf/-Inf values (head 0 attends to NaN).
  k[at(5, 0, 3)] = nan;
  v[at(7, 1, 4)] = inf;
  v[at(40, 1, 9)] = -inf;
  v[at(41, 0, 0)] = nan;
  c.append(0, kvq::token_major(k.data(), n, kv, d), kvq::token_major(v.data(), n, kv, d));
  require_same_bytes(c, 0);
  require_same_reads(c, 0);
  require_same_attention(c, 0, 2 * kv, {}, launch_options{}, 31);
  // Layer 1: -Inf and +Inf in keys (a -Inf logit weighs 0, a +Inf one makes the head NaN).
  auto k1 = kv_data(n, kv, d, 23);
  auto v1 = kv_data(n, kv, d, 24);
  for (int e = 0; e < d; ++e) k1[at(9, 1, e)] = 1e30f;
  k1[at(60, 0, 1)] = -inf;
  c.append(1, kvq::token_major(k1.data(), n, kv, d), kvq::token_major(v1.data(), n, kv, d));
  require_same_bytes(c, 1);
  require_same_reads(c, 1);
  require_same_attention(c, 1, 2 * kv, {}, launch_options{}, 32);
}

TEST_CASE("metal kernels attention launch shapes", "[metal]") {
  // MQA with many query heads per kv head and a small threadgroup memory limit: several
  // threadgroups per kv head along the query heads; SIMD width 16; 32 and 128 threads.
  int const d = 128;
  int const kv = 1;
  std::int64_t const n = 150;
  pair_of_caches<kvq::q8_0> c({1, kv, d, 256}, {});
  auto const k = kv_data(n, kv, d, 41);
  auto const v = kv_data(n, kv, d, 42);
  c.append(0, kvq::token_major(k.data(), n, kv, d), kvq::token_major(v.data(), n, kv, d));
  for (auto const& lo :
       {launch_options{64, 32, 40, 12288}, launch_options{32, 16, 0, 32768}, launch_options{128, 32, 64, 9000}}) {
    for (int q_heads : {8, 5}) {
      if (q_heads % kv != 0) continue;
      require_same_attention(c, 0, q_heads, {}, lo, 43);
      kvq::attention_options o;
      o.query = kvq::query_precision::q8_0;
      require_same_attention(c, 0, q_heads, o, lo, 44);
    }
  }
  CHECK(c.gpu.last_plan().plan.chunks > 1);
  // An empty layer and an empty window attend nothing: zeros.
  pair_of_caches<kvq::q4_0> e({1, 2, 64, 64}, {});
  std::vector<float> q(4 * 64, 1.0f), out(q.size(), 5.0f);
  e.gpu.attention(0, q.data(), 4, out.data(), {});
  CHECK(std::all_of(out.begin(), out.end(), [](float x) { return x == 0.0f; }));
}

TEST_CASE("metal kernels threadgroup memory layout and launch planning", "[metal]") {
  // The layout the kernel indexes must fit the bytes the planner reserves, for every option.
  for (int d : {8, 64, 80, 128, 256}) {
    for (int q8 : {0, 1}) {
      auto const s = kvq_attention_smem_layout(d, 32, 4, q8);
      CHECK(s.total % 4 == 0);
      CHECK(s.o == 4 * d);
      CHECK(s.total >= s.qcodes + (q8 ? 4 * ((d + 31) / 32) * 8 : 0));
    }
  }
  kd::attention_device dev;
  dev.smem_limit = 32768;
  dev.threads = 128;
  dev.max_tile = 16;
  kd::attention_plan p;
  REQUIRE(kd::plan_attention(256, 8, 64, 1, 0, false, dev, p));
  CHECK(p.smem_bytes <= 32768);
  CHECK(p.splits == 0);
  dev.smem_limit = 1024;
  CHECK_FALSE(kd::plan_attention(256, 8, 64, 1, 0, false, dev, p));
}

TEST_CASE("metal cache on a mock metal-cpp matches the CPU cache", "[metal]") {
  // backend/metal/metal_cache.hpp compiled against tests/metal/mock_metal_cpp (see
  // tests/metal/metal_cache_checks.cpp).
  for (int d : {8, 64, 80, 128}) {
    INFO("head_dim " << d);
    auto const failures = run_metal_cache_checks(d);
    for (auto const& f : failures) UNSCOPED_INFO(f);
    CHECK(failures.empty());
  }
}

TEST_CASE("metal cache multi-token attention matches the CPU kvq::attention", "[metal][multi_token]") {
  // n_q query tokens, masks, windows and sinks through metal_cache.hpp on the mock metal-cpp (see
  // tests/metal/metal_cache_checks.cpp).
  for (int d : {64, 80}) {
    INFO("head_dim " << d);
    auto const failures = run_metal_attention_checks(d);
    for (auto const& f : failures) UNSCOPED_INFO(f);
    CHECK(failures.empty());
  }
}
