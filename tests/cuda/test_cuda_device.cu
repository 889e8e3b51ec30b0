// kvq's CUDA cache on a GPU against the CPU scalar reference (label `cuda`): the scenarios of
// cuda_scenario.hpp (the same ones test_cuda_host.cpp runs with the kernel bodies on the CPU) with
// the real kernels, plus the fp8 hardware conversions against the shared software path over every
// f32 bit pattern. Without a GPU, main (cuda_main.cpp) exits with 4, which CTest reports as skipped.
#include <kvq/backend/cuda/cuda_cache.cuh>
#include <kvq/codec/rotated.hpp>
#include <kvq/codec/tq.hpp>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/cuda_scenario.hpp"
#include "cuda/paged_scenario.hpp"
#include "persist_support.hpp"

namespace {

namespace kt = kvq_cuda_test;

/// Raises std::runtime_error naming the call unless it succeeded.
void cuda_ok(cudaError_t e, char const* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

/// The stream every test works on (non-blocking: nothing is ordered by the legacy default stream).
cudaStream_t test_stream() {
  static cudaStream_t s = [] {
    cudaStream_t st = nullptr;
    cuda_ok(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    return st;
  }();
  return s;
}

/// A device buffer of n elements of T.
template <class T>
class device_buffer {
 public:
  explicit device_buffer(std::size_t n) : n_(n) {
    cuda_ok(cudaMalloc(&p_, std::max<std::size_t>(n, 1) * sizeof(T)), "cudaMalloc");
  }
  explicit device_buffer(std::vector<T> const& v) : device_buffer(v.size()) {
    cuda_ok(cudaMemcpy(p_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  }
  device_buffer(device_buffer const&) = delete;
  device_buffer& operator=(device_buffer const&) = delete;
  ~device_buffer() { cudaFree(p_); }
  auto get() const -> T* { return p_; }
  auto host() const -> std::vector<T> {
    std::vector<T> v(n_);
    cuda_ok(cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
    return v;
  }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

/// The harness of cuda_scenario.hpp over QuantizedKVCache<Choice, kvq::cuda>: host data is copied
/// to the device, every operation runs on test_stream(), results are copied back after a
/// synchronize (which also reports device faults).
template <class Choice>
class device_harness {
 public:
  using cache_type = kvq::QuantizedKVCache<Choice, kvq::cuda>;

  device_harness(kvq::cache_shape const& s, kt::cpu_options<Choice> const& o, kt::launch const& lo)
      : cache_(s, cache_options(o, lo)) {}

  static auto cache_options(kt::cpu_options<Choice> const& o, kt::launch const& lo) -> typename cache_type::options {
    typename cache_type::options c;
    c.residual = o.residual;
    c.key = o.key;
    c.value = o.value;
    c.threads = lo.threads;
    c.split_tokens = lo.split_tokens;
    return c;
  }

  template <class T>
  void append(int l, std::vector<T> const& k, std::vector<T> const& v, std::int64_t n) {
    auto const& s = cache_.shape();
    device_buffer<T> dk(k), dv(v);
    cache_.append(l, kvq::token_major<T>(dk.get(), n, s.kv_heads, s.head_dim),
                  kvq::token_major<T>(dv.get(), n, s.kv_heads, s.head_dim), test_stream());
    cache_.synchronize(test_stream());  // before the input buffers go away
  }
  auto layer_bytes(int l) -> std::vector<std::uint8_t> {
    cache_.synchronize(test_stream());
    std::vector<std::uint8_t> v(cache_.layer_bytes());
    cuda_ok(cudaMemcpy(v.data(), cache_.layer_data(l), v.size(), cudaMemcpyDeviceToHost), "cudaMemcpy layer");
    return v;
  }
  auto view(bool keys, int l, int h) const -> kvq::storage_view {
    return keys ? cache_.key_storage(l, h) : cache_.value_storage(l, h);
  }
  auto layer_base(int l) const -> std::byte const* { return cache_.layer_data(l); }
  template <class T>
  auto read(bool keys, int l, int h, std::int64_t first, std::int64_t count) -> std::vector<T> {
    device_buffer<T> out(static_cast<std::size_t>(count * cache_.shape().head_dim));
    if (keys) {
      cache_.read_keys(l, h, first, count, out.get(), 0, test_stream());
    } else {
      cache_.read_values(l, h, first, count, out.get(), 0, test_stream());
    }
    cache_.synchronize(test_stream());
    return out.host();
  }
  void truncate(std::int64_t n) { cache_.truncate(n, test_stream()); }
  void shift_left(std::int64_t n) { cache_.shift_left(n, test_stream()); }
  void reset() { cache_.reset(); }
  auto size(int l) const -> std::int64_t { return cache_.size(l); }
  auto memory() const -> kvq::memory_report { return cache_.memory(); }
  auto attention(int l, std::vector<float> const& q, int q_heads, kvq::attention_options const& opt)
      -> std::vector<float> {
    device_buffer<float> dq(q), out(q.size());
    kvq::decode_attention(cache_, l, dq.get(), q_heads, out.get(), opt, test_stream());
    cache_.synchronize(test_stream());
    return out.host();
  }
  auto attention_tokens(int l, std::vector<float> const& q, std::int64_t n_q, int q_heads,
                        kvq::attention_options const& opt, std::size_t mask_bytes) -> std::vector<float> {
    device_buffer<float> dq(q), out(q.size());
    auto const* m = static_cast<unsigned char const*>(opt.mask_data);
    device_buffer<unsigned char> dmask(m != nullptr ? std::vector<unsigned char>(m, m + mask_bytes)
                                                    : std::vector<unsigned char>());
    kvq::attention_options o = opt;
    if (o.mask_data != nullptr) o.mask_data = dmask.get();  // the mask rows on the device; sinks stay on the host
    kvq::attention(cache_, l, dq.get(), n_q, q_heads, out.get(), o, test_stream());
    cache_.synchronize(test_stream());
    return out.host();
  }
  static auto batched(std::vector<device_harness*> const& hs, int l, std::vector<float> const& q, int q_heads,
                      kvq::attention_options const& opt) -> std::vector<float> {
    std::vector<cache_type*> caches;
    for (auto* h : hs) caches.push_back(&h->cache_);
    kvq::cuda_workspace ws;
    device_buffer<float> dq(q), out(q.size());
    kvq::decode_attention_batched<Choice>(std::span<cache_type* const>(caches), l, dq.get(), q_heads, out.get(), opt,
                                          ws, test_stream());
    hs.front()->cache_.synchronize(test_stream());
    return out.host();
  }
  auto core() -> cache_type& { return cache_; }
  auto stream() const -> cudaStream_t { return test_stream(); }

 private:
  cache_type cache_;
};

/// The harness of paged_scenario.hpp over PagedKVCache<Choice, kvq::cuda> (host data copied to the
/// device, results copied back after a synchronize).
template <class Choice>
class device_paged_harness {
 public:
  using cache_type = kvq::PagedKVCache<Choice, kvq::cuda>;

  device_paged_harness(kvq::paged_shape const& s, int residual, kt::launch const& lo)
      : cache_(s, options(residual, lo)) {}

  static auto options(int residual, kt::launch const& lo) -> typename cache_type::options {
    typename cache_type::options o;
    o.residual = residual;
    o.threads = lo.threads;
    o.split_tokens = lo.split_tokens;
    return o;
  }
  auto add_sequence() -> kvq::sequence_id { return cache_.add_sequence(); }
  auto fork(kvq::sequence_id s) -> kvq::sequence_id { return cache_.fork(s, test_stream()); }
  void release(kvq::sequence_id s) { cache_.release(s); }
  void truncate(kvq::sequence_id s, std::int64_t n) { cache_.truncate(s, n, test_stream()); }
  void append(kvq::sequence_id s, int l, std::vector<float> const& k, std::vector<float> const& v, std::int64_t n) {
    auto const& sh = cache_.shape();
    device_buffer<float> dk(k), dv(v);
    cache_.append(s, l, kvq::token_major<float>(dk.get(), n, sh.kv_heads, sh.head_dim),
                  kvq::token_major<float>(dv.get(), n, sh.kv_heads, sh.head_dim), test_stream());
    cache_.synchronize(test_stream());  // before the input buffers go away
  }
  auto read(bool keys, kvq::sequence_id s, int l, int h, std::int64_t first, std::int64_t count) -> std::vector<float> {
    device_buffer<float> out(static_cast<std::size_t>(count * cache_.shape().head_dim));
    if (keys)
      cache_.read_keys(s, l, h, first, count, out.get(), 0, test_stream());
    else
      cache_.read_values(s, l, h, first, count, out.get(), 0, test_stream());
    cache_.synchronize(test_stream());
    return out.host();
  }
  auto attention(int l, std::vector<kvq::sequence_id> const& ids, std::vector<float> const& q, int q_heads,
                 kvq::attention_options const& opt) -> std::vector<float> {
    device_buffer<float> dq(q), out(q.size());
    kvq::paged_decode_attention(cache_, l, std::span<kvq::sequence_id const>(ids), dq.get(), q_heads, out.get(), opt,
                                test_stream());
    cache_.synchronize(test_stream());
    return out.host();
  }
  auto attention_chunks(int l, std::vector<kvq::query_chunk> const& chunks, std::vector<float> const& q, int q_heads,
                        kvq::attention_options const& opt, std::vector<std::size_t> const& mask_bytes)
      -> std::vector<float> {
    device_buffer<float> dq(q), out(q.size());
    std::vector<std::unique_ptr<device_buffer<unsigned char>>> masks;  // each chunk's mask rows on the device
    std::vector<kvq::query_chunk> dchunks = chunks;
    for (std::size_t i = 0; i < chunks.size(); ++i) {
      auto const* m = static_cast<unsigned char const*>(chunks[i].mask_data);
      std::size_t const n = i < mask_bytes.size() ? mask_bytes[i] : 0;
      if (m == nullptr || n == 0) continue;
      masks.push_back(std::make_unique<device_buffer<unsigned char>>(std::vector<unsigned char>(m, m + n)));
      dchunks[i].mask_data = masks.back()->get();
    }
    kvq::paged_attention(cache_, l, std::span<kvq::query_chunk const>(dchunks), q.empty() ? nullptr : dq.get(), q_heads,
                         q.empty() ? nullptr : out.get(), opt, test_stream());
    cache_.synchronize(test_stream());
    return out.host();
  }
  auto pool() -> std::vector<std::uint8_t> {
    cache_.synchronize(test_stream());
    std::vector<std::uint8_t> v(cache_.pool_bytes());
    cuda_ok(cudaMemcpy(v.data(), cache_.pool_data(), v.size(), cudaMemcpyDeviceToHost), "cudaMemcpy pool");
    return v;
  }
  auto pages() const -> kvq::page_report { return cache_.pages(); }

 private:
  cache_type cache_;
};

template <class Choice>
auto options_with(int residual) -> kt::cpu_options<Choice> {
  kt::cpu_options<Choice> o;
  o.residual = residual;
  return o;
}

/// Counts the f32 bit patterns [first, first + n) whose fp8 code (scale 1, saturating) from the
/// backend's conversion (hardware on sm_89+) differs from the shared software path.
__global__ void fp8_mismatches(unsigned long long first, unsigned long long n, unsigned long long* count) {
  unsigned long long const i = blockIdx.x * static_cast<unsigned long long>(blockDim.x) + threadIdx.x;
  unsigned long long const stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  unsigned long long bad = 0;
  for (unsigned long long k = i; k < n; k += stride) {
    float const x = kvq::detail::f32_from_bits(static_cast<unsigned>(first + k));
    bad += kvq::kernels::fp8_e4m3_encode(x, 1.0f, true) != kvq::detail::f32_to_e4m3(x, true);
    bad += kvq::kernels::fp8_e5m2_encode(x, 1.0f, true) != kvq::detail::f32_to_e5m2(x, true);
    bad += kvq::kernels::fp8_e4m3_encode(x, 1.0f, false) != kvq::detail::f32_to_e4m3(x, false);
  }
  if (bad != 0) atomicAdd(count, bad);
}

/// Counts the fp8 codes whose decoded value (backend path) differs in bits from the software path.
__global__ void fp8_decode_mismatches(unsigned long long* count) {
  unsigned const c = threadIdx.x;
  unsigned long long bad = 0;
  bad += kvq::detail::f32_bits(kvq::kernels::fp8_e4m3_decode(static_cast<unsigned char>(c), 1.0f)) !=
         kvq::detail::f32_bits(kvq::detail::e4m3_to_f32_scaled(static_cast<unsigned char>(c), 1.0f));
  bad += kvq::detail::f32_bits(kvq::kernels::fp8_e5m2_decode(static_cast<unsigned char>(c), 0.5f)) !=
         kvq::detail::f32_bits(kvq::detail::e5m2_to_f32_scaled(static_cast<unsigned char>(c), 0.5f));
  if (bad != 0) atomicAdd(count, bad);
}

}  // namespace

TEMPLATE_TEST_CASE("cuda: bytes, reads and attention match the CPU reference", "[codecs]", kvq::f32_codec,
                   kvq::f16_codec, kvq::q8_0, kvq::q4_0, kvq::int8_sym, kvq::fp8_e4m3, kvq::fp8_e5m2, kvq::mxfp4,
                   kvq::nvfp4, (kvq::kv_codecs<kvq::q8_0, kvq::q4_0>)) {
  for (int d : {64, 128, 80, 8}) {
    INFO("head_dim " << d);
    kt::run_scenario<TestType, device_harness>(d, 0, {}, {}, d != 8);
  }
}

TEMPLATE_TEST_CASE("cuda: KIVI residual semantics match the CPU cache", "[kivi]", kvq::kivi<2>, kvq::kivi<4>,
                   kvq::kivi<8>) {
  for (int r : {0, 32, 128}) {
    for (int d : {64, 128, 80}) {
      INFO("head_dim " << d << " R " << r);
      kt::run_scenario<TestType, device_harness>(d, r, {}, {}, d == 128);
    }
  }
}

TEST_CASE("cuda: fp8 parameters (scale, no saturation)", "[fp8]") {
  kt::cpu_options<kvq::fp8_e4m3> o;
  o.key = {0.05f, kvq::fp8_overflow::no_saturate};
  o.value = {4.0f, kvq::fp8_overflow::saturate};
  kt::run_scenario<kvq::fp8_e4m3, device_harness>(64, 0, o);
  kt::cpu_options<kvq::fp8_e5m2> o2;
  o2.key = {1e-4f, kvq::fp8_overflow::no_saturate};
  o2.value = {1e-5f, kvq::fp8_overflow::saturate};
  kt::run_scenario<kvq::fp8_e5m2, device_harness>(80, 0, o2);
}

TEST_CASE("cuda: fp8 conversions equal the software path for every f32", "[fp8]") {
  unsigned long long* count = nullptr;
  cuda_ok(cudaMalloc(&count, sizeof *count), "cudaMalloc");
  cuda_ok(cudaMemset(count, 0, sizeof *count), "cudaMemset");
  fp8_mismatches<<<4096, 256>>>(0, 1ull << 32, count);
  fp8_decode_mismatches<<<1, 256>>>(count);
  cuda_ok(cudaDeviceSynchronize(), "fp8 kernels");
  unsigned long long bad = 1;
  cuda_ok(cudaMemcpy(&bad, count, sizeof bad, cudaMemcpyDeviceToHost), "cudaMemcpy");
  cudaFree(count);
  CHECK(bad == 0);
}

TEST_CASE("cuda: GQA 32/8 and MHA 8/8 with the planner's splits", "[gqa]") {
  kt::run_gqa<kvq::q4_0, device_harness>(128, 5000);
  kt::run_gqa<kvq::f16_codec, device_harness>(64, 700);
  kt::run_gqa<kvq::int8_sym, device_harness>(80, 700);
  kt::run_gqa<kvq::kivi<4>, device_harness>(128, 3000, options_with<kvq::kivi<4>>(128));
}

TEMPLATE_TEST_CASE("cuda: NaN and Inf inputs", "[special]", kvq::f32_codec, kvq::f16_codec, kvq::q8_0, kvq::q4_0,
                   kvq::int8_sym, kvq::fp8_e4m3, kvq::fp8_e5m2, kvq::kivi<4>, kvq::mxfp4, kvq::nvfp4) {
  kt::run_special_values<TestType, device_harness>(64);
}

TEMPLATE_TEST_CASE("cuda: batched multi-token paged attention matches the CPU kvq::paged_attention",
                   "[paged][multi_token]", kvq::q4_0, kvq::q8_0, kvq::f16_codec, kvq::kivi<4>,
                   (kvq::kv_codecs<kvq::q8_0, kvq::kivi_value<2>>)) {
  kt::run_paged_chunks<TestType, device_paged_harness>(64, 32, {128, 64});
  kt::run_paged_chunks<TestType, device_paged_harness>(128, 0);  // the planner's splits
}

TEST_CASE("cuda: batched attention over caches of one shape", "[batched]") {
  kt::run_batched<kvq::q8_0, device_harness>(64, 5);
  kt::run_batched<kvq::kivi<2>, device_harness>(128, 4, options_with<kvq::kivi<2>>(32));
  kt::run_batched<kvq::f16_codec, device_harness>(8, 70);
}

TEMPLATE_TEST_CASE("cuda: the paged cache matches the CPU paged cache", "[paged]", kvq::f16_codec, kvq::q8_0, kvq::q4_0,
                   kvq::fp8_e4m3, kvq::nvfp4, (kvq::kv_codecs<kvq::q8_0, kvq::q4_0>), kvq::kivi<2>, kvq::kivi<4>) {
  for (int residual : {0, 32}) {
    INFO("R " << residual);
    kt::run_paged<TestType, device_paged_harness>(128, residual);
  }
}

TEMPLATE_TEST_CASE("cuda: caches save the CPU cache's bytes and load them", "[persist]", kvq::q8_0, kvq::q4_0,
                   kvq::nvfp4, (kvq::kv_codecs<kvq::int8_sym, kvq::kivi_value<4>>), kvq::kivi<2>) {
  using flat_t = kvq::QuantizedKVCache<TestType, kvq::cuda>;
  using paged_t = kvq::PagedKVCache<TestType, kvq::cuda>;
  typename flat_t::options o;
  o.residual = 32;
  typename paged_t::options po;
  po.residual = 32;
  flat_t a({2, 2, 64, 256}, o), b({2, 2, 64, 256}, o);
  paged_t p({2, 2, 64, 32, 16, 4}, po), q({2, 2, 64, 32, 16, 4}, po);
  auto upload = [](float const* x, std::int64_t n) { return std::vector<float>(x, x + n * 2 * 64); };
  auto const failures = kvq_test::persist_failures<TestType>(
      2, 2, 64, 32, a, b, p, q,
      [&](flat_t& c, int l, float const* k, float const* v, std::int64_t n) {
        device_buffer<float> dk(upload(k, n)), dv(upload(v, n));
        c.append(l, kvq::token_major<float>(dk.get(), n, 2, 64), kvq::token_major<float>(dv.get(), n, 2, 64),
                 test_stream());
        c.synchronize(test_stream());
      },
      [](flat_t& c, bool keys, int l, int h, std::int64_t n, float* out) {
        device_buffer<float> d(static_cast<std::size_t>(n * 64));
        if (keys) {
          c.read_keys(l, h, 0, n, d.get(), 0, test_stream());
        } else {
          c.read_values(l, h, 0, n, d.get(), 0, test_stream());
        }
        c.synchronize(test_stream());
        auto const host = d.host();
        std::memcpy(out, host.data(), host.size() * sizeof(float));
      },
      [&](paged_t& c, kvq::sequence_id s, int l, float const* k, float const* v, std::int64_t n) {
        device_buffer<float> dk(upload(k, n)), dv(upload(v, n));
        c.append(s, l, kvq::token_major<float>(dk.get(), n, 2, 64), kvq::token_major<float>(dv.get(), n, 2, 64),
                 test_stream());
        c.synchronize(test_stream());
      },
      [](paged_t& c, kvq::sequence_id s, bool keys, int l, int h, std::int64_t n, float* out) {
        device_buffer<float> d(static_cast<std::size_t>(n * 64));
        if (keys) {
          c.read_keys(s, l, h, 0, n, d.get(), 0, test_stream());
        } else {
          c.read_values(s, l, h, 0, n, d.get(), 0, test_stream());
        }
        c.synchronize(test_stream());
        auto const host = d.host();
        std::memcpy(out, host.data(), host.size() * sizeof(float));
      });
  for (auto const& f : failures) FAIL_CHECK(f);
  REQUIRE(failures.empty());
}

TEMPLATE_TEST_CASE("cuda: multi-token attention matches the CPU kvq::attention", "[multi_token]", kvq::q4_0, kvq::q8_0,
                   kvq::fp8_e4m3, kvq::kivi<4>, kvq::f16_codec, (kvq::kv_codecs<kvq::q8_0, kvq::kivi_value<2>>)) {
  kt::run_multi_token<TestType, device_harness>(64, 32, {128, 64});
  kt::run_multi_token<TestType, device_harness>(128, 128);
}

TEMPLATE_TEST_CASE("cuda: rotated codecs match the CPU caches", "[rotated]", kvq::rotated<kvq::q4_0>,
                   (kvq::kv_codecs<kvq::rotated<kvq::q8_0>, kvq::tq4>),
                   (kvq::kv_codecs<kvq::rotated<kvq::kivi_key<4>>, kvq::rotated<kvq::kivi_value<4>>>)) {
  int const r = kvq::codec_pair<TestType>::key::layout == kvq::codec_layout::token_group ? 32 : 0;
  for (int d : {128, 80}) {
    INFO("head_dim " << d);
    kt::run_scenario<TestType, device_harness>(d, r, {}, {}, d == 128);
  }
  kt::run_multi_token<TestType, device_harness>(128, r);
  kt::run_paged<TestType, device_paged_harness>(128, r);
  // Rows wider than KVQ_ROTATED_ROW_MAX (256 + 64): the write kernels rotate coordinate by coordinate.
  kt::run_special_values<TestType, device_harness>(320);
}

TEMPLATE_TEST_CASE("cuda: centered keys match the CPU caches", "[centered]",
                   (kvq::kv_codecs<kvq::centered<kvq::q4_0>, kvq::q8_0>),
                   (kvq::kv_codecs<kvq::centered<kvq::rotated<kvq::q4_0>>, kvq::q4_0>)) {
  kt::run_scenario<TestType, device_harness>(128, 0, {}, {}, true);
  kt::run_multi_token<TestType, device_harness>(128, 0);
  kt::run_paged<TestType, device_paged_harness>(128, 0);
}

TEMPLATE_TEST_CASE("cuda: bad arguments raise typed errors, cache unchanged", "[errors]", kvq::q4_0, kvq::kivi<4>,
                   kvq::fp8_e4m3) {
  kt::run_errors<TestType, device_harness>(64);
}
