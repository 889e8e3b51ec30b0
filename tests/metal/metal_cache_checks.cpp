// kvq tests: checks of the Metal cache (include/kvq/backend/metal/metal_cache.hpp) against the CPU
// cache: same reads bit for bit, same layer bytes, attention (also through MTLBuffers, and the
// split form) within fp32 rounding, the same error types for the same misuse, for several codecs.
//
// Two builds of this file:
//   * KVQ_METAL_MOCK (on Linux, in test_metal_kernels): against a mock of metal-cpp
//     (mock_metal_cpp/) whose "GPU" runs kernels.metal on the CPU through the shim; adds checks
//     that only the mock can make: a GPU fault reported at synchronize() and making the cache
//     unusable, no leaked metal-cpp object, no misuse of the (mock) API.
//     metal_cache.hpp is guarded by __APPLE__ && KVQ_WITH_METAL, so this build defines both
//     after including every system header it needs (Catch2 and the C++ library react to
//     __APPLE__; kvq's headers do not). This file has no Catch2: its caller reports failures.
//   * otherwise (on a Mac, in test_metal_device, with KVQ_WITH_METAL and the user's metal-cpp):
//     against the system's default Metal device.
#include <kvq/attention.hpp>
#include <kvq/cache.hpp>
#include <kvq/codec/centered.hpp>
#include <kvq/codec/fp8.hpp>
#include <kvq/codec/int8.hpp>
#include <kvq/codec/kivi.hpp>
#include <kvq/codec/passthrough.hpp>
#include <kvq/codec/q4_0.hpp>
#include <kvq/codec/q8_0.hpp>
#include <kvq/codec/rotated.hpp>
#include <kvq/codec/tq.hpp>
#include <kvq/paged_attention.hpp>
#include <kvq/paged_cache.hpp>
#include <kvq/persist.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#if defined(KVQ_METAL_MOCK)
#  include "metal_shim.hpp"
#  if !defined(__APPLE__)
#    define __APPLE__ 1
#    define KVQ_UNDEF_APPLE 1
#  endif
#  define KVQ_WITH_METAL 1
#  include <kvq/backend/metal/metal_cache.hpp>
#  if defined(KVQ_UNDEF_APPLE)
#    undef __APPLE__
#  endif
#else
#  define NS_PRIVATE_IMPLEMENTATION
#  define MTL_PRIVATE_IMPLEMENTATION
#  include <kvq/backend/metal/metal_cache.hpp>

#  include <Foundation/Foundation.hpp>
#  include <Metal/Metal.hpp>
#endif

#include "../persist_support.hpp"
#include "metal_cache_checks.hpp"

namespace {

namespace kd = kvq::detail;

/// Collects failure messages.
struct report {
  std::vector<std::string> failures;
  std::string where;
  void fail(std::string const& what) { failures.push_back(where + ": " + what); }
  void expect(bool ok, std::string const& what) {
    if (!ok) fail(what);
  }
};

/// Seeded KV-like rows (tokens * kv_heads, d) with a few outlier channels.
auto data(std::int64_t rows, int d, std::uint32_t seed) -> std::vector<float> {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(rows) * static_cast<std::size_t>(d));
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = dist(rng) * ((i % static_cast<std::size_t>(d)) % 37 == 3 ? 9.0f : 1.0f);
  return v;
}

auto bits(float x) -> std::uint32_t {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

/// Largest |a - b| / (1 + max |a| of the head); NaN positions must agree (else returns +Inf).
auto rel_error(float const* want, float const* got, int heads, int d) -> double {
  double worst = 0.0;
  for (int h = 0; h < heads; ++h) {
    double scale = 1.0;
    for (int c = 0; c < d; ++c)
      if (std::isfinite(want[h * d + c]))
        scale = std::max(scale, 1.0 + std::fabs(static_cast<double>(want[h * d + c])));
    for (int c = 0; c < d; ++c) {
      float const w = want[h * d + c], g = got[h * d + c];
      if (std::isnan(w) != std::isnan(g)) return std::numeric_limits<double>::infinity();
      if (std::isnan(w)) continue;
      worst = std::max(worst, std::fabs(static_cast<double>(w) - g) / scale);
    }
  }
  return worst;
}

template <class Choice>
struct fixture {
  using gpu_cache = kvq::QuantizedKVCache<Choice, kvq::metal>;
  using cpu_cache = kvq::QuantizedKVCache<Choice>;
  using K = typename cpu_cache::key_codec;
  using V = typename cpu_cache::value_codec;
  report& r;
  MTL::Device* device;
  gpu_cache& g;
  cpu_cache& c;

  /// Reads of every (layer, head), keys and values, as f32 to host and as f16 into an MTLBuffer.
  void compare_reads(std::string const& step) {
    auto const& s = c.shape();
    for (int l = 0; l < s.layers; ++l) {
      std::int64_t const n = c.size(l);
      r.expect(g.size(l) == n, step + ": size differs");
      if (n == 0) continue;
      for (int h = 0; h < s.kv_heads; ++h)
        for (bool keys : {true, false}) {
          std::vector<float> want(static_cast<std::size_t>(n * s.head_dim)), got(want.size());
          std::vector<kvq::f16> want16(want.size());
          if (keys) {
            c.read_keys(l, h, 0, n, want.data());
            c.read_keys(l, h, 0, n, want16.data());
            g.read_keys(l, h, 0, n, got.data());
          } else {
            c.read_values(l, h, 0, n, want.data());
            c.read_values(l, h, 0, n, want16.data());
            g.read_values(l, h, 0, n, got.data());
          }
          bool same = true;
          for (std::size_t i = 0; i < want.size(); ++i) same = same && bits(want[i]) == bits(got[i]);
          r.expect(same, step + ": f32 read differs (layer " + std::to_string(l) + ", head " + std::to_string(h) +
                             (keys ? ", keys)" : ", values)"));
          kd::metal_ref<MTL::Buffer> out(device->newBuffer(want.size() * 2 + 64, MTL::ResourceStorageModeShared));
          g.read(keys, l, h, 0, n, out.get(), 64, kvq_metal_elem_f16, s.head_dim);
          g.synchronize();
          r.expect(std::memcmp(static_cast<std::uint8_t*>(out->contents()) + 64, want16.data(), want.size() * 2) == 0,
                   step + ": f16 read into a buffer differs");
        }
    }
  }

  /// Encoded units of every layer and head (and the live KIVI key residual rows) equal the CPU's.
  void compare_bytes(std::string const& step) {
    auto const& s = c.shape();
    auto const kl = kd::region_layout<K, false>::make(s, c.get_options().residual);
    auto const vl = kd::region_layout<V, true>::make(s, c.get_options().residual);
    for (int l = 0; l < s.layers; ++l) {
      auto const* cpu = reinterpret_cast<std::uint8_t const*>(c.key_storage(l, 0).units);
      auto const* gpu = static_cast<std::uint8_t const*>(g.layer_buffer(l)->contents());
      for (int h = 0; h < s.kv_heads; ++h) {
        std::size_t const ko = static_cast<std::size_t>(h) * kl.bytes();
        bool same = std::memcmp(cpu + ko, gpu + ko, kl.units_bytes) == 0;
        auto const kv = c.key_storage(l, h);
        same = same && std::memcmp(cpu + ko + kl.units_bytes, gpu + ko + kl.units_bytes,
                                   static_cast<std::size_t>(kv.residual_tokens) * s.head_dim * 2) == 0;
        std::size_t const vo =
            static_cast<std::size_t>(s.kv_heads) * kl.bytes() + static_cast<std::size_t>(h) * vl.bytes();
        same = same && std::memcmp(cpu + vo, gpu + vo, vl.bytes()) == 0;
        r.expect(same, step + ": bytes differ (layer " + std::to_string(l) + ", head " + std::to_string(h) + ")");
      }
    }
  }

  void compare_attention(std::string const& step, int l, kvq::attention_options const& opt, double tol) {
    int const d = c.shape().head_dim;
    int const qh = 2 * c.shape().kv_heads;
    auto const q = data(qh, d, 99);
    std::vector<float> want(q.size()), got(q.size(), -3.0f), got2(q.size(), -3.0f);
    kvq::decode_attention(c, l, q.data(), qh, want.data(), opt);
    g.attention(l, q.data(), qh, got.data(), opt);
    double const e = rel_error(want.data(), got.data(), qh, d);
    r.expect(e <= tol, step + ": attention error " + std::to_string(e));
    // The same through MTLBuffers (query at an offset).
    kd::metal_ref<MTL::Buffer> qb(device->newBuffer(q.size() * 4 + 16, MTL::ResourceStorageModeShared));
    kd::metal_ref<MTL::Buffer> ob(device->newBuffer(q.size() * 4, MTL::ResourceStorageModeShared));
    std::memcpy(static_cast<std::uint8_t*>(qb->contents()) + 16, q.data(), q.size() * 4);
    g.attention(l, qb.get(), 16, qh, ob.get(), 0, opt);
    g.synchronize();
    std::memcpy(got2.data(), ob->contents(), q.size() * 4);
    r.expect(std::memcmp(got.data(), got2.data(), q.size() * 4) == 0, step + ": attention through buffers differs");
    // The split form over a sub-range.
    std::int64_t const n = c.size(l);
    auto const pw = kvq::attend_range(c, l, q.data(), qh, n / 4, n - 3, opt);
    auto const pg = g.attend(l, q.data(), qh, n / 4, n - 3, opt);
    std::vector<float> fw(q.size()), fg(q.size());
    kvq::finalize(pw, fw.data());
    kvq::finalize(pg, fg.data());
    r.expect(rel_error(fw.data(), fg.data(), qh, d) <= tol, step + ": attend (split form) differs");
    bool max_ok = true;
    for (int h = 0; h < qh; ++h)
      max_ok = max_ok && (pw.max[static_cast<std::size_t>(h)] == pg.max[static_cast<std::size_t>(h)] ||
                          std::fabs(pw.max[static_cast<std::size_t>(h)] - pg.max[static_cast<std::size_t>(h)]) <=
                              1e-5f * (1.0f + std::fabs(pw.max[static_cast<std::size_t>(h)])));
    r.expect(max_ok, step + ": attend running max differs");
  }
};

/// Attention tolerance here: this test is about the cache's plumbing (ranges, heads, splits,
/// buffers), whose mistakes give O(1) errors; the kernels' fp32 agreement is tested, tighter, in
/// test_metal_kernels.cpp. (Its data has large logits, up to about 40, which scale rounding.)
constexpr double attention_tolerance = 1e-4;

/// Runs body(device, queue, library) on the default Metal device, then checks that it left no
/// metal-cpp object alive and made no misuse of the (mock) API; an exception is a failure.
template <class F>
void with_metal(report& r, F&& body) {
#if defined(KVQ_METAL_MOCK)
  long const live_before = kvq_mock::live_objects();
#endif
  MTL::Device* device = MTL::CreateSystemDefaultDevice();
  if (device == nullptr) {
    r.fail("no Metal device");
    return;
  }
  MTL::CommandQueue* queue = device->newCommandQueue();
  try {
    auto lib = std::make_shared<kvq::metal_library>(device);
    body(device, queue, lib);
  } catch (std::exception const& e) {
    r.fail(std::string("exception: ") + e.what());
  }
  queue->release();
  device->release();
#if defined(KVQ_METAL_MOCK)
  r.expect(kvq_mock::live_objects() == live_before,
           "metal-cpp objects leaked: " + std::to_string(kvq_mock::live_objects() - live_before));
  for (auto const& e : kvq_mock::errors()) r.fail("metal-cpp misuse: " + e);
  kvq_mock::errors().clear();
#endif
}

/// Runs body(g, c) on a Metal paged cache of `shape` (KIVI residual `residual`, 64 threads per
/// threadgroup) and a CPU paged cache of the same shape and residual, with the report at `where`.
template <class Choice, class F>
void with_paged_pair(report& r, std::string const& where, kvq::paged_shape const& shape, int residual, F&& body) {
  r.where = where;
  with_metal(r, [&](MTL::Device*, MTL::CommandQueue* queue, std::shared_ptr<kvq::metal_library> const& lib) {
    typename kvq::PagedKVCache<Choice, kvq::metal>::options go;
    go.residual = residual;
    go.threads = 64;
    kvq::PagedKVCache<Choice, kvq::metal> g(lib, queue, shape, go);
    kvq::PagedKVCache<Choice> c(shape, {residual});
    body(g, c);
  });
}

/// Appends n tokens of seeded keys and values (seeds key_seed, value_seed) to `layer` of `seq` in
/// the CPU paged cache `c`, then in the Metal paged cache `g`.
template <class Gpu, class Cpu>
void append_both(Gpu& g, Cpu& c, kvq::sequence_id seq, int layer, std::int64_t n, std::uint32_t key_seed,
                 std::uint32_t value_seed) {
  int const kv = c.shape().kv_heads, d = c.shape().head_dim;
  auto const k = data(n * kv, d, key_seed);
  auto const v = data(n * kv, d, value_seed);
  c.append(seq, layer, kvq::token_major(k.data(), n, kv, d), kvq::token_major(v.data(), n, kv, d));
  g.append(seq, layer, kvq::token_major(k.data(), n, kv, d), kvq::token_major(v.data(), n, kv, d));
}

template <class Choice>
void check_choice(report& r, std::string const& name, int d, int residual) {
  using gpu_cache = kvq::QuantizedKVCache<Choice, kvq::metal>;
  using cpu_cache = kvq::QuantizedKVCache<Choice>;
  r.where = name + " head_dim " + std::to_string(d) + " R " + std::to_string(residual);
  with_metal(r, [&](MTL::Device* device, MTL::CommandQueue* queue, std::shared_ptr<kvq::metal_library> const& lib) {
    kvq::cache_shape const shape{2, 2, d, 200};
    typename gpu_cache::options go;
    go.residual = residual;
    go.threads = 64;
    typename cpu_cache::options co;
    co.residual = residual;
    {
      gpu_cache g(lib, queue, shape, go);
      cpu_cache c(shape, co);
      fixture<Choice> f{r, device, g, c};
      int const kv = shape.kv_heads;
      std::uint32_t seed = static_cast<std::uint32_t>(d);
      // Layer 0: host f32 appends in chunks.
      for (std::int64_t n : {3, 40, 1, 30, 33}) {
        auto const k = data(n * kv, d, ++seed);
        auto const v = data(n * kv, d, ++seed);
        g.append(0, kvq::token_major(k.data(), n, kv, d), kvq::token_major(v.data(), n, kv, d));
        c.append(0, kvq::token_major(k.data(), n, kv, d), kvq::token_major(v.data(), n, kv, d));
      }
      // Layer 1: host f16, then bf16 from an MTLBuffer, head-major at an offset.
      {
        std::int64_t const n = 37;
        auto const k = data(n * kv, d, ++seed);
        auto const v = data(n * kv, d, ++seed);
        std::vector<kvq::f16> k16(k.size()), v16(v.size());
        for (std::size_t i = 0; i < k.size(); ++i) {
          k16[i] = kvq::to_f16(k[i]);
          v16[i] = kvq::to_f16(v[i]);
        }
        g.append(1, kvq::token_major(k16.data(), n, kv, d), kvq::token_major(v16.data(), n, kv, d));
        c.append(1, kvq::token_major(k16.data(), n, kv, d), kvq::token_major(v16.data(), n, kv, d));
        std::int64_t const m = 45;
        auto const k2 = data(m * kv, d, ++seed);
        auto const v2 = data(m * kv, d, ++seed);
        std::vector<kvq::bf16> kb(k2.size()), vb(v2.size());
        for (int h = 0; h < kv; ++h)
          for (std::int64_t t = 0; t < m; ++t)
            for (int e = 0; e < d; ++e) {
              std::size_t const src = static_cast<std::size_t>((t * kv + h) * d + e);
              std::size_t const dst = static_cast<std::size_t>((h * m + t) * d + e);
              kb[dst] = kvq::to_bf16(k2[src]);
              vb[dst] = kvq::to_bf16(v2[src]);
            }
        kd::metal_ref<MTL::Buffer> kbuf(device->newBuffer(kb.size() * 2 + 8, MTL::ResourceStorageModeShared));
        kd::metal_ref<MTL::Buffer> vbuf(device->newBuffer(vb.size() * 2 + 8, MTL::ResourceStorageModeShared));
        std::memcpy(static_cast<std::uint8_t*>(kbuf->contents()) + 8, kb.data(), kb.size() * 2);
        std::memcpy(static_cast<std::uint8_t*>(vbuf->contents()) + 8, vb.data(), vb.size() * 2);
        kvq::metal_tensor kt{kbuf.get(), 8, m, kv, d, d, m * d, kvq_metal_elem_bf16};
        kvq::metal_tensor vt{vbuf.get(), 8, m, kv, d, d, m * d, kvq_metal_elem_bf16};
        g.append(1, kt, vt);
        c.append(1, kvq::kv_tensor<kvq::bf16>{kb.data(), m, kv, d, d, m * d},
                 kvq::kv_tensor<kvq::bf16>{vb.data(), m, kv, d, d, m * d});
        g.synchronize();
      }
      f.compare_bytes("append");
      f.compare_reads("append");
      f.compare_attention("attention", 0, {}, attention_tolerance);
      kvq::attention_options o;
      o.window = 50;
      o.softcap = 10.0f;
      o.query = kvq::query_precision::q8_0;
      f.compare_attention("attention with options", 1, o, attention_tolerance);

      g.truncate(70);
      c.truncate(70);
      f.compare_bytes("truncate");
      f.compare_reads("truncate");
      for (int l = 0; l < 2; ++l) {
        auto const k = data(20 * kv, d, ++seed);
        auto const v = data(20 * kv, d, ++seed);
        g.append(l, kvq::token_major(k.data(), 20, kv, d), kvq::token_major(v.data(), 20, kv, d));
        c.append(l, kvq::token_major(k.data(), 20, kv, d), kvq::token_major(v.data(), 20, kv, d));
      }
      g.shift_left(32);
      c.shift_left(32);
      f.compare_bytes("shift_left");
      f.compare_reads("shift_left");
      f.compare_attention("attention after shift", 1, {}, attention_tolerance);
      r.expect(g.memory().total_bytes == c.memory().total_bytes, "memory accounting differs");

      // Misuse raises the CPU cache's error types and leaves the cache unchanged.
      std::int64_t const before = g.size(0);
      auto const big = data(200 * kv, d, 5);
      auto raises = [&](auto&& fn) -> std::string {
        try {
          fn();
        } catch (kvq::capacity_error const&) {
          return "capacity";
        } catch (kvq::index_error const&) {
          return "index";
        } catch (kvq::shape_error const&) {
          return "shape";
        } catch (kvq::invalid_argument_error const&) {
          return "argument";
        } catch (kvq::unsupported_error const&) {
          return "unsupported";
        } catch (kvq::error const&) {
          return "error";
        }
        return "none";
      };
      r.expect(raises([&] {
                 g.append(0, kvq::token_major(big.data(), 200, kv, d), kvq::token_major(big.data(), 200, kv, d));
               }) == "capacity",
               "append past capacity must raise capacity_error");
      r.expect(g.size(0) == before, "a failed append changed the cache");
      std::vector<float> out(static_cast<std::size_t>(d));
      r.expect(raises([&] { g.read_keys(0, kv, 0, 1, out.data()); }) == "index", "a bad head must raise index_error");
      r.expect(raises([&] { g.read_values(0, 0, before, 1, out.data()); }) == "index",
               "a bad range must raise index_error");
      r.expect(raises([&] { g.attention(0, big.data(), kv + 1, out.data()); }) == "shape",
               "q_heads not a multiple of kv_heads must raise shape_error");
      kvq::attention_options i8;
      i8.probabilities = kvq::probability_precision::i8;
      r.expect(raises([&] { g.attention(0, big.data(), kv, out.data(), i8); }) == "unsupported",
               "i8 probabilities must raise unsupported_error (CPU only)");
      r.expect(raises([&] { g.truncate(-1); }) == "argument", "truncate(-1) must raise invalid_argument_error");
      if constexpr (cpu_cache::key_codec::layout == kvq::codec_layout::token_group)
        r.expect(raises([&] { g.shift_left(5); }) == "unsupported", "a KIVI shift by 5 must raise unsupported_error");
      f.compare_reads("after misuse");

#if defined(KVQ_METAL_MOCK)
      // A GPU fault surfaces at the next synchronisation and makes the cache unusable.
      kvq_mock::fail_next_commit() = true;
      auto const k = data(kv, d, 7);
      kd::metal_ref<MTL::Buffer> one(device->newBuffer(k.size() * 4, MTL::ResourceStorageModeShared));
      std::memcpy(one->contents(), k.data(), k.size() * 4);
      kvq::metal_tensor const t{one.get(), 0, 1, kv, d, static_cast<std::int64_t>(kv) * d, d, kvq_metal_elem_f32};
      g.append(0, t, t);
      r.expect(raises([&] { g.synchronize(); }) == "error", "a GPU fault must raise kvq::error at synchronize()");
      r.expect(raises([&] { g.append(0, t, t); }) == "error", "a cache after a GPU fault must refuse work");
#endif
    }
    constexpr bool kivi_part = cpu_cache::key_codec::layout == kvq::codec_layout::token_group ||
                               cpu_cache::value_codec::name == std::string_view("kivi_value");
    if constexpr (kivi_part) {
      // Finite values beyond the f16 range: the KIVI residual and window store them saturated to
      // ±65504 (as the CPU cache does), also when a truncate puts a decoded key group back (a
      // group of {-65504, 65504} decodes to 65536).
      gpu_cache g(lib, queue, shape, go);
      cpu_cache c(shape, co);
      fixture<Choice> f{r, device, g, c};
      int const kv = shape.kv_heads;
      auto k = data(64 * kv, d, 91);
      auto v = data(64 * kv, d, 92);
      k[static_cast<std::size_t>(40 * kv * d)] = -3e38f;
      k[static_cast<std::size_t>(41 * kv * d)] = 3e38f;
      v[static_cast<std::size_t>(2 * kv * d + 1)] = 1e5f;
      g.append(0, kvq::token_major(k.data(), 64, kv, d), kvq::token_major(v.data(), 64, kv, d));
      c.append(0, kvq::token_major(k.data(), 64, kv, d), kvq::token_major(v.data(), 64, kv, d));
      f.compare_bytes("values beyond the f16 range");
      f.compare_reads("values beyond the f16 range");
      g.truncate(45);
      c.truncate(45);
      f.compare_bytes("truncate into a group beyond the f16 range");
      f.compare_reads("truncate into a group beyond the f16 range");
    }
  });
}

/// The Metal paged cache against the CPU paged cache: a prompt forked to children that diverge, a
/// rollback, a release and a fork of a fork; pool bytes, page use and reads equal, batched
/// attention within attention_tolerance, every page back at the end.
template <class Choice>
void check_paged_choice(report& r, std::string const& name, int d, int residual) {
  kvq::paged_shape const shape{2, 2, d, 32, 24, 6};
  std::string const where = "paged " + name + " head_dim " + std::to_string(d) + " R " + std::to_string(residual);
  with_paged_pair<Choice>(r, where, shape, residual, [&](auto& g, auto& c) {
    int const kv = shape.kv_heads;
    auto append = [&](kvq::sequence_id s, std::int64_t n, std::uint32_t seed) {
      for (int l = 0; l < shape.layers; ++l) {
        std::uint32_t const at = seed + 31u * static_cast<std::uint32_t>(l);
        append_both(g, c, s, l, n, at, at + 7u);
      }
    };
    auto compare = [&](std::vector<kvq::sequence_id> const& live, std::string const& step) {
      r.expect(c.pages().used_pages == g.pages().used_pages && c.pages().shared_pages == g.pages().shared_pages,
               step + ": page use differs");
      r.expect(
          std::memcmp(c.key_storage(live.front(), 0, 0).pool, g.pool_buffer()->contents(), c.memory().total_bytes) == 0,
          step + ": pool bytes differ");
      for (auto id : live)
        for (int l = 0; l < shape.layers; ++l)
          for (int h = 0; h < kv; ++h) {
            std::int64_t const n = c.size(id, l);
            std::vector<float> want(static_cast<std::size_t>(n * d)), got(want.size());
            c.read_values(id, l, h, 0, n, want.data());
            g.read_values(id, l, h, 0, n, got.data());
            r.expect(std::memcmp(want.data(), got.data(), want.size() * 4) == 0, step + ": value reads differ");
            c.read_keys(id, l, h, 0, n, want.data());
            g.read_keys(id, l, h, 0, n, got.data());
            r.expect(std::memcmp(want.data(), got.data(), want.size() * 4) == 0, step + ": key reads differ");
          }
      int const q_heads = 2 * kv;
      auto const q = data(static_cast<std::int64_t>(live.size()) * q_heads, d, 99);
      for (std::int64_t window : {0, 29}) {
        kvq::attention_options opt;
        opt.window = window;
        for (int l = 0; l < shape.layers; ++l) {
          std::vector<float> want(q.size()), got(q.size(), -1.0f);
          kvq::paged_decode_attention(c, l, std::span<kvq::sequence_id const>(live), q.data(), q_heads, want.data(),
                                      opt);
          g.attention(l, std::span<kvq::sequence_id const>(live), q.data(), q_heads, got.data(), opt);
          r.expect(
              rel_error(want.data(), got.data(), q_heads * static_cast<int>(live.size()), d) <= attention_tolerance,
              step + ": attention differs (window " + std::to_string(window) + ")");
        }
      }
    };
    auto const root = c.add_sequence();
    r.expect(g.add_sequence() == root, "sequence ids differ");
    append(root, 70, 1);
    std::vector<kvq::sequence_id> live{root};
    for (int i = 0; i < 3; ++i) {
      auto const a = c.fork(root);
      r.expect(g.fork(root) == a, "fork ids differ");
      live.push_back(a);
    }
    compare(live, "forked");
    for (std::size_t i = 1; i < live.size(); ++i)
      append(live[i], 5 + 29 * static_cast<std::int64_t>(i - 1), 100u * static_cast<std::uint32_t>(i));
    c.truncate(live[2], 72);
    g.truncate(live[2], 72);
    c.release(live[1]);
    g.release(live[1]);
    live.erase(live.begin() + 1);
    auto const b = c.fork(live[1]);
    r.expect(g.fork(live[1]) == b, "fork ids differ");
    live.push_back(b);
    append(b, 3, 600);
    compare(live, "diverged");
    for (auto id : live) {
      c.release(id);
      g.release(id);
    }
    r.expect(g.pages().free_pages == shape.pages, "pages leaked");
    // Misuse: typed errors, nothing changed.
    auto const a = g.add_sequence();
    std::int64_t const too_many = 32 * (shape.pages + 1);
    auto const k = data(too_many * kv, d, 5);
    bool raised = false;
    try {
      g.append(a, 0, kvq::token_major(k.data(), too_many, kv, d), kvq::token_major(k.data(), too_many, kv, d));
    } catch (kvq::capacity_error const&) {
      raised = true;
    }
    r.expect(raised && g.size(a) == 0 && g.pages().used_pages == 0, "out of pages: not a clean capacity_error");
    raised = false;
    try {
      float x = 0;
      g.read_keys(a + 1, 0, 0, 0, 1, &x);
    } catch (kvq::index_error const&) {
      raised = true;
    }
    r.expect(raised, "an unknown sequence: no index_error");
  });
}

/// Saving and loading through the Metal caches against the CPU caches (tests/persist_backend.hpp).
template <class Choice>
void check_persist_choice(report& r, std::string const& name, int d, int residual) {
  using gpu_cache = kvq::QuantizedKVCache<Choice, kvq::metal>;
  using gpu_paged = kvq::PagedKVCache<Choice, kvq::metal>;
  r.where = "persist " + name + " head_dim " + std::to_string(d) + " R " + std::to_string(residual);
  with_metal(r, [&](MTL::Device*, MTL::CommandQueue* queue, std::shared_ptr<kvq::metal_library> const& lib) {
    typename gpu_cache::options o;
    o.residual = residual;
    typename gpu_paged::options po;
    po.residual = residual;
    gpu_cache a(lib, queue, {2, 2, d, 256}, o), b(lib, queue, {2, 2, d, 256}, o);
    gpu_paged p(lib, queue, {2, 2, d, 32, 16, 4}, po), q(lib, queue, {2, 2, d, 32, 16, 4}, po);
    auto const failures = kvq_test::persist_failures<Choice>(
        2, 2, d, residual, a, b, p, q,
        [&](gpu_cache& c, int l, float const* k, float const* v, std::int64_t n) {
          c.append(l, kvq::token_major(k, n, 2, d), kvq::token_major(v, n, 2, d));
        },
        [](gpu_cache& c, bool keys, int l, int h, std::int64_t n, float* out) {
          if (keys) {
            c.read_keys(l, h, 0, n, out);
          } else {
            c.read_values(l, h, 0, n, out);
          }
        },
        [&](gpu_paged& c, kvq::sequence_id s, int l, float const* k, float const* v, std::int64_t n) {
          c.append(s, l, kvq::token_major(k, n, 2, d), kvq::token_major(v, n, 2, d));
        },
        [](gpu_paged& c, kvq::sequence_id s, bool keys, int l, int h, std::int64_t n, float* out) {
          if (keys) {
            c.read_keys(s, l, h, 0, n, out);
          } else {
            c.read_values(s, l, h, 0, n, out);
          }
        });
    for (auto const& f : failures) r.expect(false, f);
  });
}

/// The kvq error type `fn` raises, by name ("none" when it returns).
template <class F>
auto error_name(F&& fn) -> std::string {
  try {
    fn();
  } catch (kvq::index_error const&) {
    return "index";
  } catch (kvq::shape_error const&) {
    return "shape";
  } catch (kvq::invalid_argument_error const&) {
    return "argument";
  } catch (kvq::error const&) {
    return "error";
  }
  return "none";
}

/// Multi-token attention (the cache's attention over n_q query tokens) against the CPU
/// kvq::attention: a prefix and a chunk of 100 tokens (KIVI: partly in the residual), n_q in {1, 2,
/// 7, 16, 100} causally, no mask from a position off the tile grid, a window, an additive and a
/// boolean mask (with rows that attend nothing), sinks (also in decode attention), soft-cap with a
/// q8_0 query; n_q = 1 equals decode attention bit for bit; errors of the CPU's types.
template <class Choice>
void check_multi_token_choice(report& r, std::string const& name, int d, int residual) {
  using gpu_cache = kvq::QuantizedKVCache<Choice, kvq::metal>;
  using cpu_cache = kvq::QuantizedKVCache<Choice>;
  r.where = "multi-token " + name + " head_dim " + std::to_string(d) + " R " + std::to_string(residual);
  with_metal(r, [&](MTL::Device*, MTL::CommandQueue* queue, std::shared_ptr<kvq::metal_library> const& lib) {
    kvq::cache_shape const shape{1, 2, d, 300};
    typename gpu_cache::options go;
    go.residual = residual;
    go.threads = 64;
    typename cpu_cache::options co;
    co.residual = residual;
    gpu_cache g(lib, queue, shape, go);
    cpu_cache c(shape, co);
    int const kv = shape.kv_heads;
    std::uint32_t seed = static_cast<std::uint32_t>(d + residual);
    for (std::int64_t n : {137, 100}) {
      auto const k = data(n * kv, d, ++seed);
      auto const v = data(n * kv, d, ++seed);
      g.append(0, kvq::token_major(k.data(), n, kv, d), kvq::token_major(v.data(), n, kv, d));
      c.append(0, kvq::token_major(k.data(), n, kv, d), kvq::token_major(v.data(), n, kv, d));
    }
    std::int64_t const len = 237;
    auto compare = [&](std::string const& step, std::int64_t n_q, int qh, kvq::attention_options const& opt) {
      std::mt19937 rng(++seed);
      std::normal_distribution<float> dist(0.0f, 1.0f);
      std::vector<float> q(static_cast<std::size_t>(n_q * qh * d));
      for (auto& x : q) x = dist(rng);
      std::vector<float> want(q.size(), -3.0f), got(q.size(), -4.0f);
      kvq::attention(c, 0, q.data(), n_q, qh, want.data(), opt);
      g.attention(0, q.data(), n_q, qh, got.data(), opt);
      double const e = rel_error(want.data(), got.data(), static_cast<int>(n_q) * qh, d);
      r.expect(e <= attention_tolerance, step + " n_q " + std::to_string(n_q) + ": error " + std::to_string(e));
    };
    for (int qh : {2 * kv, kv})
      for (std::int64_t n_q : {1, 2, 7, 16, 100}) compare("causal q_heads " + std::to_string(qh), n_q, qh, {});
    int const qh = 2 * kv;
    {
      std::vector<float> q(static_cast<std::size_t>(qh * d), 0.25f), one(q.size()), dec(q.size());
      for (std::size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(i % 7) * 0.3f - 1.0f;
      g.attention(0, q.data(), std::int64_t{1}, qh, one.data());
      g.attention(0, q.data(), qh, dec.data());
      r.expect(std::memcmp(one.data(), dec.data(), q.size() * 4) == 0, "n_q = 1 differs from decode attention");
    }
    kvq::attention_options none;
    none.mask = kvq::mask_kind::none;
    none.first_pos = 13;
    compare("no mask", 16, qh, none);
    kvq::attention_options win;
    win.window = 40;
    win.first_pos = len - 109;
    compare("window", 100, qh, win);
    kvq::attention_options capped;
    capped.softcap = 8.0f;
    capped.query = kvq::query_precision::q8_0;
    compare("softcap, q8_0 query", 7, qh, capped);
    std::int64_t const stride = len + 3;
    std::vector<float> bias = data(16, static_cast<int>(stride), ++seed);
    for (std::size_t i = 0; i < bias.size(); ++i)
      if (i % 5 == 1 || i / static_cast<std::size_t>(stride) == 4) bias[i] = -std::numeric_limits<float>::infinity();
    kvq::attention_options add;
    add.mask = kvq::mask_kind::additive;
    add.mask_data = bias.data();
    add.mask_stride = stride;
    compare("additive mask", 16, qh, add);
    std::vector<std::uint8_t> allow(static_cast<std::size_t>(100 * len));
    for (std::size_t i = 0; i < allow.size(); ++i)
      allow[i] = static_cast<std::uint8_t>((i * 2654435761u >> 7) % 4 != 0 && i / static_cast<std::size_t>(len) != 3);
    kvq::attention_options boolean;
    boolean.mask = kvq::mask_kind::boolean;
    boolean.mask_data = allow.data();
    compare("boolean mask", 100, qh, boolean);
    std::vector<float> sinks = {1.0f, -std::numeric_limits<float>::infinity(), 2.5f, -1.0f};
    kvq::attention_options sk;
    sk.sinks = sinks.data();
    compare("sinks", 7, qh, sk);
    sk.window = 20;
    compare("sinks and window", 100, qh, sk);
    {
      std::vector<float> q(static_cast<std::size_t>(qh * d)), want(q.size()), got(q.size(), -3.0f);
      for (std::size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(i % 5) * 0.4f - 0.8f;
      kvq::decode_attention(c, 0, q.data(), qh, want.data(), sk);
      g.attention(0, q.data(), qh, got.data(), sk);
      r.expect(rel_error(want.data(), got.data(), qh, d) <= attention_tolerance, "decode attention with sinks differs");
    }
    std::vector<float> q(static_cast<std::size_t>(4 * qh * d)), out(q.size());
    auto same_error = [&](std::string const& what, std::int64_t n_q, int heads, kvq::attention_options const& o) {
      std::string const want = error_name([&] { kvq::attention(c, 0, q.data(), n_q, heads, out.data(), o); });
      std::string const got = error_name([&] { g.attention(0, q.data(), n_q, heads, out.data(), o); });
      r.expect(want != "none" && got == want, what + ": raises " + got + ", the CPU " + want);
    };
    same_error("n_q < 0", -1, qh, {});
    same_error("q_heads", 2, 3, {});
    kvq::attention_options past;
    past.first_pos = len - 1;
    same_error("causal past the end", 2, qh, past);
    kvq::attention_options no_mask;
    no_mask.mask = kvq::mask_kind::additive;
    same_error("no mask data", 2, qh, no_mask);
    float const nan_sinks[4] = {0.0f, std::numeric_limits<float>::quiet_NaN(), 0.0f, 0.0f};
    kvq::attention_options bad_sink;
    bad_sink.sinks = nan_sinks;
    same_error("NaN sink", 2, qh, bad_sink);
    r.expect(g.size(0) == len, "a failed attention changed the cache");
  });
}

/// Batched multi-token attention of the Metal paged cache (its attention over query chunks)
/// against the CPU kvq::paged_attention: three sequences of different lengths with interleaved
/// pages, one mixed batch (a prefill chunk of 64 tokens, a draft of 8, a decode token, crossing
/// pages), causal, no mask from given positions, a window, additive and boolean masks per chunk,
/// sinks; errors of the CPU's types with the cache unchanged.
template <class Choice>
void check_paged_chunks_choice(report& r, std::string const& name, int d, int residual) {
  kvq::paged_shape const shape{1, 2, d, 32, 24, 4};
  std::string const where =
      "paged chunks " + name + " head_dim " + std::to_string(d) + " R " + std::to_string(residual);
  with_paged_pair<Choice>(r, where, shape, residual, [&](auto& g, auto& c) {
    int const kv = shape.kv_heads;
    std::uint32_t seed = static_cast<std::uint32_t>(3 * d + residual);
    auto append = [&](kvq::sequence_id sq, std::int64_t n) {
      seed += 2;
      append_both(g, c, sq, 0, n, seed - 1, seed);
    };
    kvq::sequence_id ids[3];
    for (auto& id : ids) {
      id = c.add_sequence();
      r.expect(g.add_sequence() == id, "sequence ids differ");
    }
    auto const a = ids[0], b = ids[1], e = ids[2];
    append(a, 90);
    append(b, 40);
    append(e, 20);
    append(a, 64);
    append(b, 35);
    append(e, 45);
    std::int64_t const la = 154, lb = 75, le = 65;
    int const q_heads = 2 * kv;
    auto compare = [&](std::string const& step, std::vector<kvq::query_chunk> const& chunks,
                       kvq::attention_options const& opt) {
      std::int64_t rows = 0;
      for (auto const& ch : chunks) rows += ch.n_q;
      auto const q = data(rows * q_heads, d, ++seed);
      std::vector<float> want(q.size(), -5.0f), got(q.size(), -7.0f);
      kvq::paged_attention(c, 0, std::span<kvq::query_chunk const>(chunks), q.data(), q_heads, want.data(), opt);
      g.attention(0, std::span<kvq::query_chunk const>(chunks), q.data(), q_heads, got.data(), opt);
      double const err = rel_error(want.data(), got.data(), static_cast<int>(rows) * q_heads, d);
      r.expect(err <= attention_tolerance, step + ": error " + std::to_string(err));
    };
    std::vector<kvq::query_chunk> const mixed{{a, 64}, {b, 8}, {e, 1}};
    std::vector<kvq::query_chunk> const placed{{a, 64, 13}, {b, 8, 30}, {e, 1, 64}};
    compare("causal", mixed, {});
    kvq::attention_options none;
    none.mask = kvq::mask_kind::none;
    compare("no mask from given positions", placed, none);
    kvq::attention_options win;
    win.window = 40;
    win.softcap = 15.0f;
    win.query = kvq::query_precision::q8_0;
    compare("window", mixed, win);
    // Additive masks, each chunk its own stride, -Inf holes and one row all -Inf.
    {
      std::int64_t const lens[3] = {la, lb, le}, strides[3] = {la + 3, 0, le};
      std::vector<float> bias[3];
      std::vector<kvq::query_chunk> masked = mixed;
      for (std::size_t i = 0; i < 3; ++i) {
        std::int64_t const stride = strides[i] > 0 ? strides[i] : lens[i];
        bias[i] = data(masked[i].n_q, static_cast<int>(stride), ++seed);
        for (std::size_t j = 0; j < bias[i].size(); ++j)
          if (j % 5 == 2 || (i == 0 && j / static_cast<std::size_t>(stride) == 7))
            bias[i][j] = -std::numeric_limits<float>::infinity();
        masked[i].mask_data = bias[i].data();
        masked[i].mask_stride = strides[i];
      }
      kvq::attention_options add;
      add.mask = kvq::mask_kind::additive;
      compare("additive masks", masked, add);
    }
    // Boolean masks: a random pattern per chunk, one row that allows nothing.
    {
      std::int64_t const lens[3] = {la, lb, le};
      std::vector<std::uint8_t> allow[3];
      std::vector<kvq::query_chunk> masked = placed;
      for (std::size_t i = 0; i < 3; ++i) {
        std::size_t const len = static_cast<std::size_t>(lens[i]);
        auto const rnd = data(masked[i].n_q, static_cast<int>(lens[i]), ++seed);
        allow[i].resize(rnd.size());
        for (std::size_t j = 0; j < rnd.size(); ++j)
          allow[i][j] = static_cast<std::uint8_t>(rnd[j] > -0.5f && !(i == 0 && j / len == 9) ? 1 + j % 3 : 0);
        masked[i].mask_data = allow[i].data();
      }
      kvq::attention_options boolean;
      boolean.mask = kvq::mask_kind::boolean;
      compare("boolean masks", masked, boolean);
    }
    // Sinks, causal and with no mask; a repeated sequence and an empty chunk.
    std::vector<float> sinks = {0.5f, -std::numeric_limits<float>::infinity(), 3.0f, -2.0f};
    kvq::attention_options sk;
    sk.sinks = sinks.data();
    compare("sinks", mixed, sk);
    sk.mask = kvq::mask_kind::none;
    sk.window = 30;
    compare("sinks, no mask, odd batch", {{b, 8}, {e, 0}, {a, 1}, {a, 64, 20}, {b, 3, 10}}, sk);
    // Errors: the CPU's types, the cache unchanged.
    auto const q = data(80 * q_heads, d, ++seed);
    auto same_error = [&](std::string const& step, std::vector<kvq::query_chunk> const& chunks, int qh,
                          kvq::attention_options const& o) {
      std::vector<float> out(q.size());
      std::string const want = error_name(
          [&] { kvq::paged_attention(c, 0, std::span<kvq::query_chunk const>(chunks), q.data(), qh, out.data(), o); });
      std::string const got =
          error_name([&] { g.attention(0, std::span<kvq::query_chunk const>(chunks), q.data(), qh, out.data(), o); });
      r.expect(want != "none" && got == want, step + ": expected " + want + ", got " + got);
    };
    same_error("q_heads", mixed, 3, {});
    same_error("unknown sequence", {{a, 8}, {e + 7, 1}}, q_heads, {});
    same_error("past the sequence", {{b, 8, lb - 4}}, q_heads, {});
    kvq::attention_options own;
    own.first_pos = 3;
    same_error("first_pos in the options", mixed, q_heads, own);
    kvq::attention_options no_mask;
    no_mask.mask = kvq::mask_kind::boolean;
    same_error("no mask rows", mixed, q_heads, no_mask);
    float const nan_sinks[4] = {0.0f, std::numeric_limits<float>::quiet_NaN(), 0.0f, 0.0f};
    kvq::attention_options bad_sink;
    bad_sink.sinks = nan_sinks;
    same_error("NaN sink", mixed, q_heads, bad_sink);
    r.expect(g.size(a, 0) == la && g.pages().used_pages == c.pages().used_pages,
             "a failed attention changed the cache");
  });
}

}  // namespace

/// Centered keys (ctr-rot-q4_0) over q8_0 values: the checks above on the Metal caches.
using ctr_rot_q4_0 = kvq::kv_codecs<kvq::centered<kvq::rotated<kvq::q4_0>>, kvq::q8_0>;

auto run_metal_attention_checks(int head_dim) -> std::vector<std::string> {
  report r;
  NS::AutoreleasePool* pool = NS::AutoreleasePool::alloc()->init();
  check_multi_token_choice<kvq::q4_0>(r, "q4_0", head_dim, 0);
  check_multi_token_choice<kvq::q8_0>(r, "q8_0", head_dim, 0);
  check_multi_token_choice<kvq::fp8_e4m3>(r, "fp8_e4m3", head_dim, 0);
  check_multi_token_choice<kvq::kivi<4>>(r, "kivi4", head_dim, 32);
  check_multi_token_choice<kvq::f16_codec>(r, "f16", head_dim, 0);
  check_multi_token_choice<kvq::kv_codecs<kvq::q8_0, kvq::kivi_value<2>>>(r, "q8_0/kivi2", head_dim, 128);
  check_paged_chunks_choice<kvq::q4_0>(r, "q4_0", head_dim, 0);
  check_paged_chunks_choice<kvq::kivi<4>>(r, "kivi4", head_dim, 32);
  check_paged_chunks_choice<kvq::kv_codecs<kvq::q8_0, kvq::kivi_value<2>>>(r, "q8_0/kivi2", head_dim, 32);
  check_multi_token_choice<kvq::kv_codecs<kvq::rotated<kvq::q8_0>, kvq::tq4>>(r, "rot-q8_0/tq4", head_dim, 0);
  check_paged_chunks_choice<kvq::kv_codecs<kvq::rotated<kvq::q8_0>, kvq::tq4>>(r, "rot-q8_0/tq4", head_dim, 0);
  check_multi_token_choice<ctr_rot_q4_0>(r, "ctr-rot-q4_0/q8_0", head_dim, 0);
  pool->release();
  return r.failures;
}

auto run_metal_cache_checks(int head_dim) -> std::vector<std::string> {
  report r;
  NS::AutoreleasePool* pool = NS::AutoreleasePool::alloc()->init();
  check_choice<kvq::q8_0>(r, "q8_0", head_dim, 32);
  check_choice<kvq::q4_0>(r, "q4_0", head_dim, 32);
  check_choice<kvq::int8_sym>(r, "int8", head_dim, 32);
  check_choice<kvq::fp8_e4m3>(r, "fp8_e4m3", head_dim, 32);
  check_choice<kvq::nvfp4>(r, "nvfp4", head_dim, 32);
  check_choice<kvq::f16_codec>(r, "f16", head_dim, 32);
  check_choice<kvq::kivi<4>>(r, "kivi4", head_dim, 32);
  check_choice<kvq::kivi<2>>(r, "kivi2", head_dim, 0);
  check_choice<kvq::kv_codecs<kvq::kivi_key<8>, kvq::kivi_value<2>>>(r, "kivi8/kivi2", head_dim, 64);
  check_choice<kvq::kv_codecs<kvq::q8_0, kvq::kivi_value<4>>>(r, "q8_0/kivi4", head_dim, 32);
  check_paged_choice<kvq::q4_0>(r, "q4_0", head_dim, 0);
  check_paged_choice<kvq::nvfp4>(r, "nvfp4", head_dim, 0);
  check_paged_choice<kvq::kivi<4>>(r, "kivi4", head_dim, 32);
  check_paged_choice<kvq::kv_codecs<kvq::q8_0, kvq::kivi_value<2>>>(r, "q8_0/kivi2", head_dim, 0);
  check_persist_choice<kvq::q4_0>(r, "q4_0", head_dim, 0);
  check_persist_choice<kvq::fp8_e4m3>(r, "fp8_e4m3", head_dim, 0);
  check_persist_choice<kvq::kivi<4>>(r, "kivi4", head_dim, 32);
  check_persist_choice<kvq::kv_codecs<kvq::q8_0, kvq::kivi_value<2>>>(r, "q8_0/kivi2", head_dim, 32);
  check_persist_choice<ctr_rot_q4_0>(r, "ctr-rot-q4_0/q8_0", head_dim, 0);
  check_choice<kvq::kv_codecs<kvq::rotated<kvq::q8_0>, kvq::tq4>>(r, "rot-q8_0/tq4", head_dim, 0);
  check_paged_choice<kvq::kv_codecs<kvq::rotated<kvq::kivi_key<4>>, kvq::rotated<kvq::kivi_value<4>>>>(r, "rot-kivi4",
                                                                                                       head_dim, 32);
  check_choice<ctr_rot_q4_0>(r, "ctr-rot-q4_0/q8_0", head_dim, 0);
  check_paged_choice<kvq::kv_codecs<kvq::centered<kvq::q4_0>, kvq::q4_0>>(r, "ctr-q4_0/q4_0", head_dim, 0);
  pool->release();
  return r.failures;
}
