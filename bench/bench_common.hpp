// kvq benchmarks: what the suites share — aligned buffers, synthetic N(0,1) data, the last-level
// cache size, a read-only pass, threads, and the machine details recorded in the JSON context.
#pragma once

#include <kvq/simd.hpp>
#include <kvq/version.hpp>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <new>
#include <numbers>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <benchmark/benchmark.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#  include <immintrin.h>
#endif
#if defined(__ARM_NEON)
#  include <arm_neon.h>
#endif

namespace kvq_bench {

inline constexpr std::size_t mib = std::size_t{1} << 20;

/// Head dimension of every benchmark (DESIGN §7).
inline constexpr int head_dim = 128;

/// A 64-byte aligned, zero-filled buffer of `size` bytes (every page touched before any timing).
class buffer {
 public:
  buffer() = default;
  explicit buffer(std::size_t size) : size_(size) {
    std::size_t const padded = (std::max<std::size_t>(size, 1) + 63) / 64 * 64;
    data_.reset(static_cast<std::byte*>(std::aligned_alloc(64, padded)));
    if (!data_) throw std::bad_alloc();
    std::memset(data_.get(), 0, padded);
  }
  auto data() noexcept -> std::byte* { return data_.get(); }
  auto data() const noexcept -> std::byte const* { return data_.get(); }
  auto size() const noexcept -> std::size_t { return size_; }
  template <class T>
  auto as() noexcept -> T* {
    return reinterpret_cast<T*>(data_.get());
  }

 private:
  struct free_deleter {
    void operator()(std::byte* p) const noexcept { std::free(p); }
  };
  std::size_t size_ = 0;
  std::unique_ptr<std::byte, free_deleter> data_;
};

/// The next value of the splitmix64 sequence (a small, fast, well-mixed generator).
inline auto splitmix64(std::uint64_t& state) noexcept -> std::uint64_t {
  std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/// 2^20 samples of N(0, 1) (Box–Muller over splitmix64), generated once.
inline auto normal_pool() -> std::vector<float> const& {
  static std::vector<float> const pool = [] {
    std::vector<float> p(std::size_t{1} << 20);
    std::uint64_t state = 0x6b7671u;
    for (std::size_t i = 0; i < p.size(); i += 2) {
      double const u1 = (static_cast<double>(splitmix64(state) >> 11) + 1.0) * 0x1p-53;  // (0, 1]
      double const u2 = static_cast<double>(splitmix64(state) >> 11) * 0x1p-53;
      double const r = std::sqrt(-2.0 * std::log(u1));
      p[i] = static_cast<float>(r * std::cos(2.0 * std::numbers::pi * u2));
      p[i + 1] = static_cast<float>(r * std::sin(2.0 * std::numbers::pi * u2));
    }
    return p;
  }();
  return pool;
}

/// Fills x[0, n) with N(0, 1) samples: rows of head_dim copied from random places of the pool.
inline void fill_normal(float* x, std::size_t n, std::uint64_t seed) {
  auto const& pool = normal_pool();
  std::size_t const rows = pool.size() / head_dim - 1;
  for (std::size_t i = 0; i < n; i += head_dim) {
    std::size_t const from = (splitmix64(seed) % rows) * head_dim + splitmix64(seed) % head_dim;
    std::memcpy(x + i, pool.data() + from, std::min<std::size_t>(head_dim, n - i) * sizeof(float));
  }
}

/// Scales channels 3, 37, 70 and 101 of every head_dim row of x[0, n) by `factor` (outlier channels
/// such as real keys have).
inline void add_outlier_channels(float* x, std::size_t n, float factor) {
  for (std::size_t i = 0; i + head_dim <= n; i += head_dim)
    for (std::size_t c : {3u, 37u, 70u, 101u}) x[i + c] *= factor;
}

/// Size of the last-level cache in bytes: the kernel's cache topology first (glibc's sysconf value
/// is wrong on some virtual machines), then sysconf, then 32 MiB.
inline auto llc_bytes() -> std::size_t {
  std::size_t best = 0;
  int best_level = 0;
  for (int i = 0; i < 8; ++i) {
    std::string const dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    std::ifstream level_file(dir + "level"), type_file(dir + "type"), size_file(dir + "size");
    int level = 0;
    std::string type, size;
    if (!(level_file >> level) || !(type_file >> type) || !(size_file >> size)) continue;
    if (type == "Instruction" || level < best_level) continue;
    std::size_t const factor = size.back() == 'K' ? 1024 : size.back() == 'M' ? mib : 1;
    std::size_t const bytes = std::strtoull(size.c_str(), nullptr, 10) * factor;
    if (bytes > 0) best = bytes, best_level = level;
  }
#if defined(_SC_LEVEL3_CACHE_SIZE)
  if (best == 0) {
    long const l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (l3 > 0) best = static_cast<std::size_t>(l3);
  }
#endif
  return best > 0 ? best : 32 * mib;
}

/// The working set of a suite's rotation: --kvq_working_set_mib=N, taken out of argv (Google
/// Benchmark rejects flags it does not know), or twice the last-level cache.
inline auto take_working_set_flag(int& argc, char** argv) -> std::size_t {
  constexpr std::string_view flag = "--kvq_working_set_mib=";
  std::size_t bytes = 2 * llc_bytes();
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    std::string_view const arg = argv[i];
    if (arg.substr(0, flag.size()) == flag) {
      bytes = static_cast<std::size_t>(std::strtoull(argv[i] + flag.size(), nullptr, 10)) * mib;
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  return bytes;
}

/// Reads the n bytes at p once (a sum of 64-bit words) and returns the sum, so no load can be
/// removed; the read-only bandwidth of the machine when n is far beyond the caches.
inline auto read_pass(std::byte const* p, std::size_t n) noexcept -> std::uint64_t {
  std::size_t i = 0;
  std::uint64_t sum = 0;
#if defined(__AVX512F__)
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (; i + 256 <= n; i += 256) {
    a0 = _mm512_add_epi64(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_add_epi64(a1, _mm512_loadu_si512(p + i + 64));
    a2 = _mm512_add_epi64(a2, _mm512_loadu_si512(p + i + 128));
    a3 = _mm512_add_epi64(a3, _mm512_loadu_si512(p + i + 192));
  }
  // Lanes summed through memory: GCC 12 warns inside its own _mm512_reduce_add_epi64.
  alignas(64) std::uint64_t lanes[8];
  _mm512_store_si512(lanes, _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
  for (std::uint64_t x : lanes) sum += x;
#elif defined(__AVX2__)
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (; i + 128 <= n; i += 128) {
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(reinterpret_cast<__m256i const*>(p + i)));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(reinterpret_cast<__m256i const*>(p + i + 32)));
    a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(reinterpret_cast<__m256i const*>(p + i + 64)));
    a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(reinterpret_cast<__m256i const*>(p + i + 96)));
  }
  alignas(32) std::uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                     _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
  sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
#elif defined(__ARM_NEON)
  uint64x2_t a0 = vdupq_n_u64(0), a1 = a0, a2 = a0, a3 = a0;
  for (; i + 64 <= n; i += 64) {
    a0 = vaddq_u64(a0, vreinterpretq_u64_u8(vld1q_u8(reinterpret_cast<std::uint8_t const*>(p + i))));
    a1 = vaddq_u64(a1, vreinterpretq_u64_u8(vld1q_u8(reinterpret_cast<std::uint8_t const*>(p + i + 16))));
    a2 = vaddq_u64(a2, vreinterpretq_u64_u8(vld1q_u8(reinterpret_cast<std::uint8_t const*>(p + i + 32))));
    a3 = vaddq_u64(a3, vreinterpretq_u64_u8(vld1q_u8(reinterpret_cast<std::uint8_t const*>(p + i + 48))));
  }
  sum = vaddvq_u64(vaddq_u64(vaddq_u64(a0, a1), vaddq_u64(a2, a3)));
#else
  std::uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (; i + 32 <= n; i += 32) {
    std::uint64_t w[4];
    std::memcpy(w, p + i, 32);
    s0 += w[0], s1 += w[1], s2 += w[2], s3 += w[3];
  }
  sum = s0 + s1 + s2 + s3;
#endif
  for (; i < n; ++i) sum += static_cast<std::uint64_t>(p[i]);
  return sum;
}

/// Runs f(0) .. f(threads - 1), f(0) on the calling thread and the others on new std::threads (as
/// kvq::decode_attention_parallel does), and returns when all have finished.
template <class F>
void run_threads(int threads, F const& f) {
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(threads > 1 ? threads - 1 : 0));
  for (int t = 1; t < threads; ++t) pool.emplace_back([&f, t] { f(t); });
  f(0);
  for (auto& t : pool) t.join();
}

/// The compiler that built this benchmark.
inline auto compiler_name() -> std::string {
#if defined(__clang__)
  return "clang " __clang_version__;
#elif defined(__GNUC__)
  return "gcc " __VERSION__;
#elif defined(_MSC_VER)
  return "msvc " + std::to_string(_MSC_FULL_VER);
#else
  return "unknown";
#endif
}

/// The CPU model as /proc/cpuinfo names it ("unknown" elsewhere).
inline auto cpu_model() -> std::string {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0 || line.rfind("Model", 0) == 0) {
      auto const colon = line.find(':');
      if (colon != std::string::npos && colon + 2 <= line.size()) return line.substr(colon + 2);
    }
  }
  return "unknown";
}

/// The instruction-set flags of the CPU that decide which kvq kernels can run, as /proc/cpuinfo lists
/// them (x86 "flags", AArch64 "Features"), space-separated in a fixed order; "unknown" elsewhere.
/// Runs on machines of different kinds are told apart by it (an AVX2-only Zen 3 and an AVX-512 Zen 4
/// both report "AMD EPYC" in a virtual machine).
inline auto cpu_simd_flags() -> std::string {
  static constexpr std::string_view known[] = {
      "sse4_2",   "avx",      "avx2",     "fma",         "f16c",        "bmi2",        "avx_vnni",    "avx512f",
      "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_vbmi", "avx512_bf16", "avx512_fp16", "gfni",
      "asimd",    "asimdhp",  "asimddp",  "fphp",        "i8mm",        "bf16",        "sve",         "sve2"};
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) != 0 && line.rfind("Features", 0) != 0) continue;
    auto const colon = line.find(':');
    if (colon == std::string::npos) break;
    std::string const words = " " + line.substr(colon + 1) + " ";
    std::string out;
    for (auto const flag : known)
      if (words.find(" " + std::string(flag) + " ") != std::string::npos)
        out += (out.empty() ? "" : " ") + std::string(flag);
    return out.empty() ? "none" : out;
  }
  return "unknown";
}

/// Records kvq's version and SIMD level, the compiler, the CPU model, its instruction-set flags and
/// the LLC size in the benchmark context (the "context" object of the JSON output).
inline void add_machine_context() {
  benchmark::AddCustomContext("kvq_version", std::to_string(KVQ_VERSION_MAJOR) + "." +
                                                 std::to_string(KVQ_VERSION_MINOR) + "." +
                                                 std::to_string(KVQ_VERSION_PATCH));
  benchmark::AddCustomContext("kvq_simd_level", std::string(kvq::simd_level()));
  benchmark::AddCustomContext("compiler", compiler_name());
  benchmark::AddCustomContext("cpu_model", cpu_model());
  benchmark::AddCustomContext("cpu_flags", cpu_simd_flags());
  benchmark::AddCustomContext("llc_bytes", std::to_string(llc_bytes()));
  benchmark::AddCustomContext("hardware_threads", std::to_string(std::thread::hardware_concurrency()));
}

}  // namespace kvq_bench
