// kvq tests: run Metal kernels on the CPU, compiled as C++ (no Apple toolchain is needed).
//
// Part 1 (always): a CPU dispatcher. `dispatch_threads` runs a kernel once per grid position, in
// order (kernels without threadgroup cooperation). `dispatch_threadgroups` runs each threadgroup in
// lockstep, every Metal thread on its own execution context: threadgroup_barrier waits for all of
// the threadgroup, and SIMD-group operations exchange values through per-SIMD-group scratch memory
// between two waits of that SIMD-group. Two interchangeable engines:
//   * fibers (the default, except on macOS where ucontext is deprecated): coroutines on the
//     calling thread, switched only at barriers, deterministic; the first SIMD-group (the last,
//     in every other threadgroup) runs as far as it can before the others start, so a missing
//     barrier shows up as a read of data not yet written, or already overwritten;
//   * threads (environment KVQ_METAL_SHIM_THREADS=1, and always on macOS): one std::thread per
//     Metal thread and std::barrier, truly concurrent (for ThreadSanitizer; slow on few cores).
// Threadgroup memory is filled with 0xff bytes (NaN) before each threadgroup, so a kernel that
// reads it before writing it shows NaNs.
//
// Part 2 (only with KVQ_METAL_SHIM_LANGUAGE defined, in the translation unit that includes a
// .metal file): the Metal Shading Language names the kernels use, mapped onto C++ —
//   qualifiers  kernel -> (nothing), device/threadgroup/thread -> (nothing), constant -> const;
//   attributes  [[buffer(n)]], [[thread_position_in_grid]], ... are left in place and ignored
//               (compile with -Wno-attributes on g++, -Wno-unknown-attributes on clang);
//   types       uint, ushort, uchar, ulong, uint2, uint3, half (_Float16 where the compiler has
//               it, a soft-float struct otherwise: clang 14 has no _Float16 on x86-64);
//   built-ins   as_type, threadgroup_barrier, simdgroup_barrier, simd_sum, simd_max, simd_min,
//               simd_shuffle, simd_shuffle_down, simd_broadcast, metal::precise::exp/sqrt/tanh;
//   function constants (KVQ_METAL_FUNCTION_CONSTANT) read the values given to the dispatcher.
// It also defines __METAL_VERSION__, so kvq's shared headers take their Metal branches.
//
// What this cannot check: address spaces (erased), real SIMD-group execution (emulated in
// lockstep), threadgroup memory limits, Metal's own float arithmetic (the host's is used).
#pragma once

#include <algorithm>
#include <array>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#if !defined(__APPLE__)  // ucontext is deprecated on macOS: the thread engine only
#  include <ucontext.h>
#  define KVQ_METAL_SHIM_FIBERS 1
#endif

namespace kvq_metal_shim {

/// A 3-D size or position, as MTL::Size.
struct size3 {
  std::uint32_t x = 1;
  std::uint32_t y = 1;
  std::uint32_t z = 1;
};

/// Up to 16 bound buffers, by index ([[buffer(i)]] receives buffers[i]).
using buffer_table = std::array<void*, 16>;

/// The positions a kernel may ask for, for one thread of one dispatch.
struct thread_ids {
  size3 thread_position_in_grid;
  size3 threadgroup_position_in_grid;
  size3 thread_position_in_threadgroup;
  size3 threads_per_threadgroup;
  std::uint32_t thread_index_in_threadgroup = 0;
  std::uint32_t thread_index_in_simdgroup = 0;
  std::uint32_t simdgroup_index_in_threadgroup = 0;
  std::uint32_t simdgroups_per_threadgroup = 1;
  std::uint32_t threads_per_simdgroup = 32;
  void* threadgroup_memory = nullptr;
};

/// Runs kernel `name` once per thread of `grid` (as dispatchThreads), with function constants
/// `constants`. Kernels that use barriers or SIMD-group functions must use dispatch_threadgroups.
void dispatch_threads(std::string const& name, std::array<int, 2> constants, size3 grid, buffer_table const& buffers);

/// Runs kernel `name` over `groups` threadgroups of `threads` threads (as dispatchThreadgroups),
/// each in lockstep, with `threadgroup_bytes` of threadgroup memory at [[threadgroup(0)]] and
/// SIMD-groups of `simd_width` threads.
void dispatch_threadgroups(std::string const& name, std::array<int, 2> constants, size3 groups, size3 threads,
                           std::size_t threadgroup_bytes, std::uint32_t simd_width, buffer_table const& buffers);

namespace detail {

[[noreturn]] inline void fail(char const* what) {
  std::fprintf(stderr, "metal shim: %s\n", what);
  std::abort();
}

/// How the threads of the running threadgroup wait for each other.
class group_sync {
 public:
  virtual ~group_sync() = default;
  /// Waits until every thread of the threadgroup has arrived.
  virtual void group_wait() = 0;
  /// Waits until every thread of SIMD-group `sg` has arrived.
  virtual void simd_wait(std::uint32_t sg) = 0;
};

/// The shared state of the threadgroup being run.
struct group_state {
  group_sync* sync = nullptr;
  std::vector<std::uint64_t>* scratch = nullptr;  // simd_width slots per SIMD-group
  std::uint32_t simd_width = 32;
};

/// What the calling emulated thread is: its threadgroup, SIMD-group and lane.
struct thread_state {
  group_state* group = nullptr;
  std::uint32_t simdgroup = 0;
  std::uint32_t lane = 0;
};

/// The emulated thread running now (the fiber engine switches it with the fiber).
inline thread_local thread_state current{};

/// The function-constant values of the running dispatch.
inline std::array<int, 8>& function_constants() {
  static std::array<int, 8> values{};
  return values;
}

inline void threadgroup_barrier() {
  if (current.group == nullptr) fail("threadgroup_barrier outside dispatch_threadgroups");
  current.group->sync->group_wait();
}

inline void simdgroup_barrier() {
  if (current.group == nullptr) fail("simdgroup_barrier outside dispatch_threadgroups");
  current.group->sync->simd_wait(current.simdgroup);
}

/// Publishes x in the SIMD-group's scratch, waits for every lane, applies `read` to the lane
/// values (slot reader, width), waits again so the scratch can be reused, and returns the result.
template <class T, class Read>
inline auto simd_exchange(T x, Read read) -> T {
  static_assert(sizeof(T) <= sizeof(std::uint64_t) && std::is_trivially_copyable_v<T>);
  if (current.group == nullptr) fail("SIMD-group function outside dispatch_threadgroups");
  group_state& g = *current.group;
  std::uint32_t const sg = current.simdgroup;
  std::uint64_t* slots = g.scratch->data() + static_cast<std::size_t>(sg) * g.simd_width;
  std::uint64_t bits = 0;
  std::memcpy(&bits, &x, sizeof x);
  slots[current.lane] = bits;
  g.sync->simd_wait(sg);
  auto value = [&](std::uint32_t lane) {
    T v;
    std::memcpy(&v, &slots[lane], sizeof v);
    return v;
  };
  T const r = read(value, g.simd_width);
  g.sync->simd_wait(sg);
  return r;
}

/// The thread engine: std::barrier objects.
class thread_sync final : public group_sync {
 public:
  thread_sync(std::uint32_t threads, std::uint32_t simdgroups, std::uint32_t width)
      : group_(static_cast<std::ptrdiff_t>(threads)) {
    for (std::uint32_t s = 0; s < simdgroups; ++s) simd_.emplace_back(static_cast<std::ptrdiff_t>(width));
  }
  void group_wait() override { group_.arrive_and_wait(); }
  void simd_wait(std::uint32_t sg) override { simd_[sg].arrive_and_wait(); }

 private:
  std::barrier<> group_;
  std::deque<std::barrier<>> simd_;
};

#if defined(KVQ_METAL_SHIM_FIBERS)
/// The fiber engine: one ucontext per Metal thread, all on the calling OS thread. The scheduler
/// always resumes the first runnable fiber in priority order (ascending thread index, or
/// descending), and releases a barrier as soon as its last fiber arrives: so the first SIMD-group
/// runs as far as it can (up to a threadgroup barrier) before the next one starts, and a read that
/// lacks a barrier sees data not written yet (ascending) or already overwritten (descending).
class fiber_sync final : public group_sync {
 public:
  fiber_sync(std::uint32_t threads, std::uint32_t width)
      : width_(width), fibers_(threads), simd_arrived_(threads / width, 0), stacks_(threads) {
    for (auto& st : stacks_) st.reset(new char[stack_bytes]);  // NOLINT: uninitialised on purpose
  }
  void group_wait() override { wait(kind::group); }
  void simd_wait(std::uint32_t) override { wait(kind::simd); }

  /// Runs body(k) for k = 0 .. threads - 1, each on its own fiber, to completion; `descending`
  /// gives the last thread the highest priority.
  void run(std::function<void(std::uint32_t)> const& body, bool descending) {
    body_ = &body;
    std::uint32_t const n = static_cast<std::uint32_t>(fibers_.size());
    for (std::uint32_t k = 0; k < n; ++k) prepare(k);
    group_arrived_ = 0;
    std::fill(simd_arrived_.begin(), simd_arrived_.end(), 0u);
    std::uint32_t finished = 0;
    while (finished < n) {
      std::uint32_t k = n;
      for (std::uint32_t i = 0; i < n; ++i) {
        std::uint32_t const c = descending ? n - 1 - i : i;
        if (!fibers_[c].done && fibers_[c].waiting == kind::none) {
          k = c;
          break;
        }
      }
      if (k == n) fail("deadlock: threads wait at different barriers (divergent barrier or SIMD-group call)");
      resume(k);
      if (fibers_[k].done) {
        ++finished;
        if (group_arrived_ > 0 || simd_arrived_[k / width_] > 0)
          fail("a thread finished while others of its threadgroup or SIMD-group wait at a barrier");
        continue;
      }
      // Release the barrier this fiber now waits at if it was the last to arrive.
      if (fibers_[k].waiting == kind::group && group_arrived_ == n) {
        for (auto& f : fibers_) f.waiting = kind::none;
        group_arrived_ = 0;
      } else if (fibers_[k].waiting == kind::simd && simd_arrived_[k / width_] == width_) {
        std::uint32_t const sg = k / width_;
        for (std::uint32_t l = 0; l < width_; ++l) fibers_[sg * width_ + l].waiting = kind::none;
        simd_arrived_[sg] = 0;
      }
    }
  }

 private:
  enum class kind { none, group, simd };
  struct fiber {
    ucontext_t context{};
    kind waiting = kind::none;
    bool done = false;
  };
  static constexpr std::size_t stack_bytes = 128 * 1024;

  static inline thread_local fiber_sync* running_ = nullptr;
  static inline thread_local std::uint32_t index_ = 0;

  // getcontext and swapcontext return twice: they live in functions of their own, so that no
  // caller's locals are live across them (-Wclobbered).
  [[gnu::noinline]] void prepare(std::uint32_t k) {
    fiber& f = fibers_[k];
    f = fiber{};
    if (getcontext(&f.context) != 0) fail("getcontext failed");
    f.context.uc_stack.ss_sp = stacks_[k].get();
    f.context.uc_stack.ss_size = stack_bytes;
    f.context.uc_link = &scheduler_;
    makecontext(&f.context, &fiber_sync::entry, 0);
  }

  [[gnu::noinline]] void resume(std::uint32_t k) {
    running_ = this;
    index_ = k;
    thread_state const saved = current;
    if (swapcontext(&scheduler_, &fibers_[k].context) != 0) fail("swapcontext failed");
    current = saved;
  }

  static void entry() {
    fiber_sync* self = running_;
    std::uint32_t const k = index_;
    (*self->body_)(k);
    self->fibers_[k].done = true;
    // Returning resumes uc_link, the scheduler.
  }

  [[gnu::noinline]] void wait(kind w) {
    std::uint32_t const k = index_;
    fiber& f = fibers_[k];
    f.waiting = w;
    if (w == kind::group) {
      ++group_arrived_;
    } else {
      ++simd_arrived_[k / width_];
    }
    thread_state const mine = current;
    if (swapcontext(&f.context, &scheduler_) != 0) fail("swapcontext failed");
    // Resumed by the scheduler.
    running_ = this;
    index_ = k;
    current = mine;
  }

  std::uint32_t width_;
  std::vector<fiber> fibers_;
  std::uint32_t group_arrived_ = 0;
  std::vector<std::uint32_t> simd_arrived_;
  std::vector<std::unique_ptr<char[]>> stacks_;
  ucontext_t scheduler_{};
  std::function<void(std::uint32_t)> const* body_ = nullptr;
};

#endif  // KVQ_METAL_SHIM_FIBERS

/// True when the thread engine was asked for (environment KVQ_METAL_SHIM_THREADS=1) or is the
/// only one (no ucontext).
inline auto use_threads() -> bool {
#if defined(KVQ_METAL_SHIM_FIBERS)
  char const* e = std::getenv("KVQ_METAL_SHIM_THREADS");
  return e != nullptr && e[0] == '1';
#else
  return true;
#endif
}

/// Runs `body` for every thread of `groups` threadgroups of `threads` threads, one threadgroup at
/// a time, each threadgroup in lockstep on the selected engine.
inline void run_threadgroups(size3 groups, size3 threads, std::size_t threadgroup_bytes, std::uint32_t simd_width,
                             std::function<void(thread_ids const&)> const& body) {
  std::uint32_t const n = threads.x * threads.y * threads.z;
  if (n == 0 || simd_width == 0 || n % simd_width != 0) fail("threadgroup size must be a multiple of the SIMD width");
  std::uint32_t const simdgroups = n / simd_width;
  std::vector<float> memory((threadgroup_bytes + sizeof(float) - 1) / sizeof(float) + 1);
  std::vector<std::uint64_t> scratch(static_cast<std::size_t>(n));
  std::uint64_t const total = std::uint64_t{groups.x} * groups.y * groups.z;

  auto ids_of = [&](std::uint32_t k, std::uint64_t gi) {
    thread_ids ids;
    ids.threads_per_threadgroup = threads;
    ids.thread_position_in_threadgroup = {k % threads.x, (k / threads.x) % threads.y, k / (threads.x * threads.y)};
    ids.thread_index_in_threadgroup = k;
    ids.thread_index_in_simdgroup = k % simd_width;
    ids.simdgroup_index_in_threadgroup = k / simd_width;
    ids.simdgroups_per_threadgroup = simdgroups;
    ids.threads_per_simdgroup = simd_width;
    ids.threadgroup_memory = memory.data();
    size3 const tg{static_cast<std::uint32_t>(gi % groups.x), static_cast<std::uint32_t>((gi / groups.x) % groups.y),
                   static_cast<std::uint32_t>(gi / (std::uint64_t{groups.x} * groups.y))};
    ids.threadgroup_position_in_grid = tg;
    auto const& p = ids.thread_position_in_threadgroup;
    ids.thread_position_in_grid = {tg.x * threads.x + p.x, tg.y * threads.y + p.y, tg.z * threads.z + p.z};
    return ids;
  };

#if defined(KVQ_METAL_SHIM_FIBERS)
  if (!use_threads()) {
    fiber_sync sync(n, simd_width);
    group_state state{&sync, &scratch, simd_width};
    for (std::uint64_t gi = 0; gi < total; ++gi) {
      std::memset(memory.data(), 0xff, memory.size() * sizeof(float));  // uninitialised: NaN
      sync.run(
          [&](std::uint32_t k) {
            current = thread_state{&state, k / simd_width, k % simd_width};
            body(ids_of(k, gi));
          },
          gi % 2 == 1);
    }
    current = thread_state{};
    return;
  }
#endif

  thread_sync sync(n, simdgroups, simd_width);
  group_state state{&sync, &scratch, simd_width};
  auto worker = [&](std::uint32_t k) {
    current = thread_state{&state, k / simd_width, k % simd_width};
    for (std::uint64_t gi = 0; gi < total; ++gi) {
      if (k == 0) std::memset(memory.data(), 0xff, memory.size() * sizeof(float));  // uninitialised: NaN
      sync.group_wait();
      body(ids_of(k, gi));
      sync.group_wait();  // every thread is done before the memory is reused
    }
    current = thread_state{};
  };
  std::vector<std::thread> pool;
  pool.reserve(n);
  for (std::uint32_t k = 0; k < n; ++k) pool.emplace_back(worker, k);
  for (auto& t : pool) t.join();
}

/// Runs `body` once per position of `grid`, x fastest.
inline void run_grid(size3 grid, std::function<void(thread_ids const&)> const& body) {
  thread_ids ids;
  for (std::uint32_t z = 0; z < grid.z; ++z)
    for (std::uint32_t y = 0; y < grid.y; ++y)
      for (std::uint32_t x = 0; x < grid.x; ++x) {
        ids.thread_position_in_grid = {x, y, z};
        body(ids);
      }
}

/// Converts a float to binary16 bits, round to nearest even (for the soft `half`).
inline auto float_to_half_bits(float f) -> std::uint16_t {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  std::uint32_t const sign = (u >> 16) & 0x8000u;
  std::uint32_t const a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);
  if (a >= 0x38800000u) {
    std::uint32_t const r = a - 0x38000000u;
    return static_cast<std::uint16_t>(sign | ((r + 0x0fffu + ((r >> 13) & 1u)) >> 13));
  }
  // Subnormal or zero: scale to units of 2^-24 and round to nearest even.
  float const q = std::nearbyint(std::ldexp(std::fabs(f), 24));
  return static_cast<std::uint16_t>(sign | static_cast<std::uint32_t>(q));
}

/// Converts binary16 bits to the exactly equal float (for the soft `half`).
inline auto half_bits_to_float(std::uint16_t h) -> float {
  std::uint32_t const e = (h >> 10) & 0x1fu;
  std::uint32_t const m = h & 0x3ffu;
  float v = e == 0    ? std::ldexp(static_cast<float>(m), -24)
            : e == 31 ? (m == 0 ? INFINITY : NAN)
                      : std::ldexp(static_cast<float>(m | 0x400u), static_cast<int>(e) - 25);
  return (h & 0x8000u) ? -v : v;
}

}  // namespace detail
}  // namespace kvq_metal_shim

// ------------------------------------------------------------------------------------------------
#if defined(KVQ_METAL_SHIM_LANGUAGE) && !defined(KVQ_METAL_SHIM_LANGUAGE_DONE)
#  define KVQ_METAL_SHIM_LANGUAGE_DONE 1

// kvq's shared headers select their Metal branches on this macro (Metal 3.1 reports 310).
#  define __METAL_VERSION__ 310

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;

struct uint2 {
  uint x, y;
};
struct uint3 {
  uint x, y, z;
};

#  if defined(__FLT16_MAX__)
using half = _Float16;
#  else
/// binary16 storage with float conversions (round to nearest even), for compilers without _Float16.
struct half {
  ushort bits = 0;
  half() = default;
  half(float f) : bits(kvq_metal_shim::detail::float_to_half_bits(f)) {}  // NOLINT: implicit, as in MSL
  operator float() const { return kvq_metal_shim::detail::half_bits_to_float(bits); }
};
#  endif

/// Reinterprets the bits of a value as another type of the same size.
template <class T, class U>
inline T as_type(U u) {
  static_assert(sizeof(T) == sizeof(U), "as_type: sizes differ");
  T t;
  std::memcpy(&t, &u, sizeof t);
  return t;
}

namespace metal {

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };

inline void threadgroup_barrier(mem_flags) { kvq_metal_shim::detail::threadgroup_barrier(); }
inline void simdgroup_barrier(mem_flags) { kvq_metal_shim::detail::simdgroup_barrier(); }

/// Sum over the SIMD-group's lanes, lane 0 first.
template <class T>
inline T simd_sum(T x) {
  return kvq_metal_shim::detail::simd_exchange(x, [](auto value, uint w) {
    T s = value(0);
    for (uint l = 1; l < w; ++l) s += value(l);
    return s;
  });
}

/// Maximum over the SIMD-group's lanes (NaN lanes are ignored unless all are NaN, as fmax).
template <class T>
inline T simd_max(T x) {
  return kvq_metal_shim::detail::simd_exchange(x, [](auto value, uint w) {
    T m = value(0);
    for (uint l = 1; l < w; ++l) {
      T const v = value(l);
      if (v > m || m != m) m = v;
    }
    return m;
  });
}

/// Minimum over the SIMD-group's lanes (NaN lanes are ignored unless all are NaN, as fmin).
template <class T>
inline T simd_min(T x) {
  return kvq_metal_shim::detail::simd_exchange(x, [](auto value, uint w) {
    T m = value(0);
    for (uint l = 1; l < w; ++l) {
      T const v = value(l);
      if (v < m || m != m) m = v;
    }
    return m;
  });
}

/// The value of lane `lane`.
template <class T>
inline T simd_shuffle(T x, ushort lane) {
  return kvq_metal_shim::detail::simd_exchange(x, [lane](auto value, uint) { return value(lane); });
}

/// The value of lane `lane`, for every lane.
template <class T>
inline T simd_broadcast(T x, ushort lane) {
  return simd_shuffle(x, lane);
}

/// The value of lane (this lane + delta); the top `delta` lanes keep their own value.
template <class T>
inline T simd_shuffle_down(T x, ushort delta) {
  uint const me = kvq_metal_shim::detail::current.lane;
  return kvq_metal_shim::detail::simd_exchange(
      x, [me, delta, x](auto value, uint w) { return me + delta < w ? value(me + delta) : x; });
}

using std::exp;
using std::fabs;
using std::tanh;

namespace precise {
using std::exp;
using std::sqrt;
using std::tanh;
}  // namespace precise

}  // namespace metal

// Address-space qualifiers and the kernel keyword. `constant` keeps const-ness so that writes
// through constant arguments still fail to compile.
#  define kernel
#  define device
#  define threadgroup
#  define thread
#  define constant const

// Function constants read the values passed to the dispatcher (ints only).
#  define KVQ_METAL_FUNCTION_CONSTANT(type, name, index)                                       \
    static_assert(std::is_same_v<type, int>, "the shim supports int function constants only"); \
    inline type const& name = ::kvq_metal_shim::detail::function_constants()[index];
// [[threadgroup(n)]] cannot be spelt once `threadgroup` is a macro; the dispatcher passes the
// threadgroup memory positionally instead.
#  define KVQ_METAL_THREADGROUP_BUFFER(index)

#endif  // KVQ_METAL_SHIM_LANGUAGE
