// kvq's CUDA benchmarks (Google Benchmark, manual time from CUDA events):
//   cuda/memcpy                 device-to-device cudaMemcpyAsync, read + write bytes: the bandwidth reference
//   cuda/read                   a read-only pass over a large buffer: the HBM read bandwidth reference
//   cuda/encode/<codec>         append of 64k f16 tokens x 8 kv heads x 128 (K and V) into a cache
//   cuda/decode/<codec>         read of those tokens back to f16, every head
//   cuda/attention/<codec>/ctx:<n>/batch:<b>   decode attention, 32 query / 8 kv heads, head_dim 128
//   cuda/multi/<codec>/n_q:<n>  kvq::attention of n_q query tokens (causal, the last n_q positions)
//                               over 16k tokens: speculative verification (n_q 8) and a prefill chunk
// Every working set is at least twice the GPU's L2 (attention rotates over layers to get there).
// GB/s counts the bytes each kernel must move: encode and decode read their input and write their
// output; attention reads the quantized K and V of the attended tokens. After the run a summary
// prints GB/s as % of memcpy, attention as % of the read bandwidth, and the speed-up over the f16
// cache. Without a CUDA device the program prints a message and exits 0.
#include <kvq/backend/cuda/cuda_cache.cuh>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

namespace {

/// Exits with a message when a CUDA call fails (benchmarks have no way to recover).
void cuda_ok(cudaError_t e, char const* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "kvq bench: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

struct gpu_context {
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  std::size_t l2 = 0;
};

gpu_context& gpu() {
  static gpu_context g = [] {
    gpu_context c;
    cuda_ok(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking), "cudaStreamCreate");
    cuda_ok(cudaEventCreate(&c.start), "cudaEventCreate");
    cuda_ok(cudaEventCreate(&c.stop), "cudaEventCreate");
    int dev = 0, l2 = 0;
    cuda_ok(cudaGetDevice(&dev), "cudaGetDevice");
    cuda_ok(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev), "L2 size");
    c.l2 = static_cast<std::size_t>(l2);
    return c;
  }();
  return g;
}

/// Seconds taken on the stream by f().
template <class F>
double timed(F&& f) {
  auto& g = gpu();
  cuda_ok(cudaEventRecord(g.start, g.stream), "cudaEventRecord");
  f();
  cuda_ok(cudaEventRecord(g.stop, g.stream), "cudaEventRecord");
  cuda_ok(cudaEventSynchronize(g.stop), "cudaEventSynchronize");
  float ms = 0;
  cuda_ok(cudaEventElapsedTime(&ms, g.start, g.stop), "cudaEventElapsedTime");
  return ms * 1e-3;
}

/// A device allocation.
struct device_bytes {
  void* p = nullptr;
  explicit device_bytes(std::size_t n) { cuda_ok(cudaMalloc(&p, std::max<std::size_t>(n, 1)), "cudaMalloc"); }
  device_bytes(device_bytes const&) = delete;
  device_bytes& operator=(device_bytes const&) = delete;
  ~device_bytes() { cudaFree(p); }
};

/// Fills n f16 values with a hash of their index, uniform in about [-4, 4).
__global__ void fill_f16(unsigned short* x, long long n, unsigned seed) {
  long long const i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  unsigned h = static_cast<unsigned>(i) * 2654435761u ^ seed;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  float const v = static_cast<float>(h & 0xffffu) * (8.0f / 65536.0f) - 4.0f;
  x[i] = kvq::detail::f32_to_f16_bits(v);
}

/// Sums a buffer (the result is discarded): a read-only bandwidth probe.
__global__ void read_all(float4 const* x, long long n, float* sink) {
  float acc = 0;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    float4 const v = x[i];
    acc += v.x + v.y + v.z + v.w;
  }
  if (acc == 1234.5f) *sink = acc;
}

/// Random f16 data of n elements on the device.
auto random_f16(long long n, unsigned seed) -> std::unique_ptr<device_bytes> {
  auto b = std::make_unique<device_bytes>(static_cast<std::size_t>(n) * 2);
  fill_f16<<<static_cast<unsigned>((n + 255) / 256), 256, 0, gpu().stream>>>(static_cast<unsigned short*>(b->p), n,
                                                                             seed);
  cuda_ok(cudaGetLastError(), "fill_f16");
  return b;
}

constexpr int kv_heads = 8;
constexpr int q_heads = 32;
constexpr int head_dim = 128;

/// Results for the summary: name -> (seconds per iteration, bytes per iteration).
std::map<std::string, std::pair<double, double>>& results() {
  static std::map<std::string, std::pair<double, double>> r;
  return r;
}

void finish(benchmark::State& state, std::string const& name, double seconds, double bytes) {
  double const per_iter = seconds / static_cast<double>(std::max<benchmark::IterationCount>(state.iterations(), 1));
  state.counters["GB/s"] =
      benchmark::Counter(bytes * static_cast<double>(state.iterations()) / 1e9, benchmark::Counter::kIsRate);
  state.counters["ms"] = per_iter * 1e3;
  results()[name] = {per_iter, bytes};
}

void bm_memcpy(benchmark::State& state) {
  std::size_t const n = std::max<std::size_t>(std::size_t{1} << 30, 4 * gpu().l2);
  device_bytes a(n), b(n);
  cuda_ok(cudaMemsetAsync(a.p, 1, n, gpu().stream), "cudaMemset");
  double total = 0;
  for (auto _ : state) {
    double const s =
        timed([&] { cuda_ok(cudaMemcpyAsync(b.p, a.p, n, cudaMemcpyDeviceToDevice, gpu().stream), "memcpy"); });
    state.SetIterationTime(s);
    total += s;
  }
  finish(state, "memcpy", total, 2.0 * static_cast<double>(n));
}

void bm_read(benchmark::State& state) {
  std::size_t const n = std::max<std::size_t>(std::size_t{1} << 30, 4 * gpu().l2);
  device_bytes a(n), sink(4);
  cuda_ok(cudaMemsetAsync(a.p, 0, n, gpu().stream), "cudaMemset");
  int sms = 1;
  cuda_ok(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "SM count");
  double total = 0;
  for (auto _ : state) {
    double const s = timed([&] {
      read_all<<<sms * 8, 256, 0, gpu().stream>>>(static_cast<float4 const*>(a.p), static_cast<long long>(n / 16),
                                                  static_cast<float*>(sink.p));
    });
    state.SetIterationTime(s);
    total += s;
  }
  finish(state, "read", total, static_cast<double>(n));
}

/// Bytes of K and V per token of one layer (all kv heads), as stored (KIVI: quantized form).
template <class Choice>
double stored_bytes_per_token() {
  using K = typename kvq::codec_pair<Choice>::key;
  using V = typename kvq::codec_pair<Choice>::value;
  auto const kg = K::geometry(head_dim);
  auto const vg = V::geometry(head_dim);
  return kv_heads * (static_cast<double>(kg.bytes()) / kg.tokens + static_cast<double>(vg.bytes()) / vg.tokens);
}

template <class Choice>
auto make_options(int residual = 128) -> typename kvq::QuantizedKVCache<Choice, kvq::cuda>::options {
  typename kvq::QuantizedKVCache<Choice, kvq::cuda>::options o;
  o.residual = residual;
  return o;
}

/// Tokens of the encode/decode benchmarks: an f16 input of at least 2x L2 (and 256 MiB).
std::int64_t codec_tokens() {
  std::int64_t const bytes_per_token = 2LL * kv_heads * head_dim * 2;
  std::int64_t const want = std::max<std::int64_t>(256LL << 20, 2 * static_cast<std::int64_t>(gpu().l2));
  return (want / bytes_per_token + 127) / 128 * 128;
}

template <class Choice>
void bm_encode(benchmark::State& state, std::string const& name) {
  std::int64_t const t = codec_tokens();
  kvq::QuantizedKVCache<Choice, kvq::cuda> cache({1, kv_heads, head_dim, t}, make_options<Choice>());
  auto const k = random_f16(t * kv_heads * head_dim, 1);
  auto const v = random_f16(t * kv_heads * head_dim, 2);
  auto const kt = kvq::token_major(static_cast<kvq::f16 const*>(k->p), t, kv_heads, head_dim);
  auto const vt = kvq::token_major(static_cast<kvq::f16 const*>(v->p), t, kv_heads, head_dim);
  double total = 0;
  for (auto _ : state) {
    cache.reset();
    double const s = timed([&] { cache.append(0, kt, vt, gpu().stream); });
    state.SetIterationTime(s);
    total += s;
  }
  cache.synchronize(gpu().stream);
  finish(state, "encode/" + name, total,
         static_cast<double>(t) * (2.0 * kv_heads * head_dim * 2 + stored_bytes_per_token<Choice>()));
}

template <class Choice>
void bm_decode(benchmark::State& state, std::string const& name) {
  std::int64_t const t = codec_tokens();
  kvq::QuantizedKVCache<Choice, kvq::cuda> cache({1, kv_heads, head_dim, t}, make_options<Choice>());
  {
    auto const k = random_f16(t * kv_heads * head_dim, 3);
    auto const v = random_f16(t * kv_heads * head_dim, 4);
    cache.append(0, kvq::token_major(static_cast<kvq::f16 const*>(k->p), t, kv_heads, head_dim),
                 kvq::token_major(static_cast<kvq::f16 const*>(v->p), t, kv_heads, head_dim), gpu().stream);
    cache.synchronize(gpu().stream);
  }
  device_bytes out(static_cast<std::size_t>(t) * kv_heads * head_dim * 2 * 2);
  auto* o = static_cast<kvq::f16*>(out.p);
  std::int64_t const plane = t * head_dim;
  double total = 0;
  for (auto _ : state) {
    double const s = timed([&] {
      for (int h = 0; h < kv_heads; ++h) {
        cache.read_keys(0, h, 0, t, o + (2 * h) * plane, 0, gpu().stream);
        cache.read_values(0, h, 0, t, o + (2 * h + 1) * plane, 0, gpu().stream);
      }
    });
    state.SetIterationTime(s);
    total += s;
  }
  cache.synchronize(gpu().stream);
  finish(state, "decode/" + name, total,
         static_cast<double>(t) * (2.0 * kv_heads * head_dim * 2 + stored_bytes_per_token<Choice>()));
}

template <class Choice>
void bm_attention(benchmark::State& state, std::string const& name) {
  std::int64_t const ctx = state.range(0);
  int const batch = static_cast<int>(state.range(1));
  double const layer_bytes = stored_bytes_per_token<Choice>() * static_cast<double>(ctx) * batch;
  int const layers = std::max(1, static_cast<int>(2.0 * static_cast<double>(gpu().l2) / layer_bytes) + 1);
  using cache_type = kvq::QuantizedKVCache<Choice, kvq::cuda>;
  std::vector<std::unique_ptr<cache_type>> caches;
  std::int64_t const chunk = std::min<std::int64_t>(ctx, 4096);
  auto const data = random_f16(chunk * kv_heads * head_dim, 5);
  auto const src = kvq::token_major(static_cast<kvq::f16 const*>(data->p), chunk, kv_heads, head_dim);
  for (int b = 0; b < batch; ++b) {
    caches.push_back(
        std::make_unique<cache_type>(kvq::cache_shape{layers, kv_heads, head_dim, ctx}, make_options<Choice>()));
    for (int l = 0; l < layers; ++l)
      for (std::int64_t t = 0; t < ctx; t += chunk) {
        auto part = src;
        part.tokens = std::min(chunk, ctx - t);
        caches.back()->append(l, part, part, gpu().stream);
      }
  }
  std::vector<cache_type*> ptrs;
  for (auto& c : caches) ptrs.push_back(c.get());
  auto const q = random_f16(static_cast<long long>(batch) * q_heads * head_dim * 2, 6);  // reused as f32 bits
  device_bytes out(static_cast<std::size_t>(batch) * q_heads * head_dim * 4);
  kvq::cuda_workspace ws;
  auto* qf = static_cast<float const*>(q->p);
  auto* of = static_cast<float*>(out.p);
  cuda_ok(cudaMemsetAsync(q->p, 0, static_cast<std::size_t>(batch) * q_heads * head_dim * 4, gpu().stream), "q");
  // Warm-up (sizes the scratch: the one allocation of the path).
  kvq::decode_attention_batched<Choice>(std::span<cache_type* const>(ptrs), 0, qf, q_heads, of, {}, ws, gpu().stream);
  caches.front()->synchronize(gpu().stream);
  double total = 0;
  int layer = 0;
  for (auto _ : state) {
    double const s = timed([&] {
      kvq::decode_attention_batched<Choice>(std::span<cache_type* const>(ptrs), layer, qf, q_heads, of, {}, ws,
                                            gpu().stream);
    });
    layer = (layer + 1) % layers;
    state.SetIterationTime(s);
    total += s;
  }
  caches.front()->synchronize(gpu().stream);
  finish(state, "attention/" + name + "/ctx:" + std::to_string(ctx) + "/batch:" + std::to_string(batch), total,
         layer_bytes);
}

template <class Choice>
void bm_multi(benchmark::State& state, std::string const& name) {
  std::int64_t const ctx = 16384;
  std::int64_t const n_q = state.range(0);
  double const layer_bytes = stored_bytes_per_token<Choice>() * static_cast<double>(ctx);
  int const layers = std::max(1, static_cast<int>(2.0 * static_cast<double>(gpu().l2) / layer_bytes) + 1);
  kvq::QuantizedKVCache<Choice, kvq::cuda> cache({layers, kv_heads, head_dim, ctx}, make_options<Choice>());
  std::int64_t const chunk = 4096;
  auto const data = random_f16(chunk * kv_heads * head_dim, 7);
  auto const src = kvq::token_major(static_cast<kvq::f16 const*>(data->p), chunk, kv_heads, head_dim);
  for (int l = 0; l < layers; ++l)
    for (std::int64_t t = 0; t < ctx; t += chunk) cache.append(l, src, src, gpu().stream);
  // (n_q, q_heads, head_dim) f32 queries: f16 hash bits reinterpreted, then zeroed (finite either way).
  auto const q = random_f16(n_q * q_heads * head_dim * 2, 8);
  cuda_ok(cudaMemsetAsync(q->p, 0, static_cast<std::size_t>(n_q) * q_heads * head_dim * 4, gpu().stream), "q");
  device_bytes out(static_cast<std::size_t>(n_q) * q_heads * head_dim * 4);
  auto* qf = static_cast<float const*>(q->p);
  auto* of = static_cast<float*>(out.p);
  kvq::attention_options opt;  // causal, first_pos = ctx - n_q
  kvq::attention(cache, 0, qf, n_q, q_heads, of, opt, gpu().stream);
  cache.synchronize(gpu().stream);
  double total = 0;
  int layer = 0;
  for (auto _ : state) {
    double const s = timed([&] { kvq::attention(cache, layer, qf, n_q, q_heads, of, opt, gpu().stream); });
    layer = (layer + 1) % layers;
    state.SetIterationTime(s);
    total += s;
  }
  cache.synchronize(gpu().stream);
  finish(state, "multi/" + name + "/n_q:" + std::to_string(n_q), total, layer_bytes);
}

template <class Choice>
void register_codec(std::string const& name, bool attention) {
  benchmark::RegisterBenchmark(("cuda/encode/" + name).c_str(),
                               [name](benchmark::State& s) { bm_encode<Choice>(s, name); })
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark(("cuda/decode/" + name).c_str(),
                               [name](benchmark::State& s) { bm_decode<Choice>(s, name); })
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  if (!attention) return;
  auto* b = benchmark::RegisterBenchmark(("cuda/attention/" + name).c_str(),
                                         [name](benchmark::State& s) { bm_attention<Choice>(s, name); });
  b->UseManualTime()->Unit(benchmark::kMillisecond)->ArgNames({"ctx", "batch"});
  for (std::int64_t ctx : {4096, 32768, 131072})
    for (int batch : {1, 16}) b->Args({ctx, batch});
  auto* m = benchmark::RegisterBenchmark(("cuda/multi/" + name).c_str(),
                                         [name](benchmark::State& s) { bm_multi<Choice>(s, name); });
  m->UseManualTime()->Unit(benchmark::kMillisecond)->ArgNames({"n_q"});
  for (int n_q : {1, 8, 512}) m->Arg(n_q);
}

void print_summary() {
  auto const& r = results();
  auto bw = [&](std::string const& k) {
    auto it = r.find(k);
    return it == r.end() ? 0.0 : it->second.second / it->second.first / 1e9;
  };
  double const memcpy_gbs = bw("memcpy");
  double const read_gbs = bw("read");
  std::printf("\n=== kvq CUDA summary (memcpy %.0f GB/s read+write, read-only pass %.0f GB/s)\n", memcpy_gbs, read_gbs);
  std::printf("%-34s %10s %10s\n", "encode / decode", "GB/s", "% memcpy");
  for (auto const& [k, v] : r) {
    if (k.rfind("encode/", 0) != 0 && k.rfind("decode/", 0) != 0) continue;
    double const g = v.second / v.first / 1e9;
    std::printf("%-34s %10.0f %9.0f%%\n", k.c_str(), g, memcpy_gbs > 0 ? 100 * g / memcpy_gbs : 0.0);
  }
  std::printf("%-42s %9s %9s %9s %9s\n", "attention (32 q / 8 kv heads, d 128)", "ms", "GB/s", "% read", "vs f16");
  for (auto const& [k, v] : r) {
    if (k.rfind("attention/", 0) != 0) continue;
    double const g = v.second / v.first / 1e9;
    std::string const rest = k.substr(k.find('/', 10));  // "/ctx:.../batch:..."
    auto const f16 = r.find("attention/f16" + rest);
    double const speedup = f16 == r.end() ? 0.0 : f16->second.first / v.first;
    std::printf("%-42s %9.3f %9.0f %8.0f%% %8.2fx\n", k.c_str(), v.first * 1e3, g,
                read_gbs > 0 ? 100 * g / read_gbs : 0.0, speedup);
  }
  std::printf("%-42s %9s %9s %9s %9s\n", "multi-token (16k tokens, causal)", "ms", "vs n_q 1", "vs f16", "");
  for (auto const& [k, v] : r) {
    if (k.rfind("multi/", 0) != 0) continue;
    std::string const codec = k.substr(6, k.find('/', 6) - 6);
    std::string const rest = k.substr(k.find('/', 6));  // "/n_q:..."
    auto const one = r.find("multi/" + codec + "/n_q:1");
    auto const f16 = r.find("multi/f16" + rest);
    std::printf("%-42s %9.3f %8.2fx %8.2fx\n", k.c_str(), v.first * 1e3,
                one == r.end() ? 0.0 : v.first / one->second.first, f16 == r.end() ? 0.0 : f16->second.first / v.first);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("kvq CUDA benchmarks: no CUDA device, nothing to measure\n");
    return 0;
  }
  cudaDeviceProp prop{};
  cuda_ok(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("kvq CUDA benchmarks on %s (sm_%d%d, %d SMs, L2 %zu MiB)\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount, gpu().l2 >> 20);
  benchmark::RegisterBenchmark("cuda/memcpy", bm_memcpy)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("cuda/read", bm_read)->UseManualTime()->Unit(benchmark::kMillisecond);
  register_codec<kvq::f16_codec>("f16", true);
  register_codec<kvq::f32_codec>("f32", false);
  register_codec<kvq::q8_0>("q8_0", true);
  register_codec<kvq::q4_0>("q4_0", true);
  register_codec<kvq::int8_sym>("int8", true);
  register_codec<kvq::fp8_e4m3>("fp8_e4m3", true);
  register_codec<kvq::fp8_e5m2>("fp8_e5m2", false);
  register_codec<kvq::kivi<2>>("kivi2", true);
  register_codec<kvq::kivi<4>>("kivi4", true);
  register_codec<kvq::kivi<8>>("kivi8", false);
  register_codec<kvq::rotated<kvq::q4_0>>("rot-q4_0", true);
  register_codec<kvq::kv_codecs<kvq::centered<kvq::q4_0>, kvq::q4_0>>("ctr-q4_0", false);
  register_codec<kvq::tq2>("tq2", false);
  register_codec<kvq::tq3>("tq3", true);
  register_codec<kvq::tq4>("tq4", true);
  register_codec<kvq::mxfp4>("mxfp4", true);
  register_codec<kvq::nvfp4>("nvfp4", true);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  print_summary();
  return 0;
}
