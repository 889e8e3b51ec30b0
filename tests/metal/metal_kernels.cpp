// kvq tests: kvq's Metal kernels (include/kvq/backend/metal/kernels.metal) compiled as C++ through
// metal_shim.hpp, and the CPU dispatcher that binds them by name.
//
// This translation unit sees kvq's shared headers in their Metal form (__METAL_VERSION__ is
// defined by the shim); the tests, in other translation units, use the host form. The two only
// share the plain argument structs of core/kernel_args.h and untyped buffer pointers.

#define KVQ_METAL_SHIM_LANGUAGE 1
#include <kvq/backend/metal/kernels.metal>

#include "metal_shim.hpp"

#undef kernel
#undef device
#undef threadgroup
#undef thread
#undef constant

namespace kvq_metal_shim {
namespace {

auto xyz(size3 p) -> uint3 { return uint3{p.x, p.y, p.z}; }

template <class T>
auto arg(buffer_table const& b, int i) -> T {
  return static_cast<T>(b[static_cast<std::size_t>(i)]);
}

void set_constants(std::array<int, 2> c) {
  auto& fc = detail::function_constants();
  fc[0] = c[0];
  fc[1] = c[1];
}

}  // namespace

void dispatch_threads(std::string const& name, std::array<int, 2> constants, size3 grid, buffer_table const& b) {
  set_constants(constants);
  std::function<void(thread_ids const&)> body;
  if (name == "kvq_encode_rows") {
    body = [&](thread_ids const& t) {
      kvq_encode_rows(*arg<kvq_write_args const*>(b, 0), arg<uchar*>(b, 1), arg<uchar const*>(b, 2),
                      t.thread_position_in_grid.x);
    };
  } else if (name == "kvq_encode_key_tiles") {
    body = [&](thread_ids const& t) {
      kvq_encode_key_tiles(*arg<kvq_write_args const*>(b, 0), arg<uchar*>(b, 1), arg<uchar const*>(b, 2),
                           t.thread_position_in_grid.x);
    };
  } else if (name == "kvq_store_f16_rows") {
    body = [&](thread_ids const& t) {
      kvq_store_f16_rows(*arg<kvq_write_args const*>(b, 0), arg<uchar*>(b, 1), arg<uchar const*>(b, 2),
                         t.thread_position_in_grid.x);
    };
  } else if (name == "kvq_decode") {
    body = [&](thread_ids const& t) {
      kvq_decode(*arg<kvq_decode_args const*>(b, 0), arg<uchar const*>(b, 1), arg<uchar*>(b, 2),
                 t.thread_position_in_grid.x);
    };
  } else if (name == "kvq_attention_combine") {
    body = [&](thread_ids const& t) {
      kvq_attention_combine(*arg<kvq_combine_args const*>(b, 0), arg<float const*>(b, 1), arg<float const*>(b, 2),
                            arg<float const*>(b, 3), arg<float*>(b, 4), arg<float const*>(b, 5),
                            t.thread_position_in_grid.x);
    };
  } else {
    throw std::invalid_argument("metal shim: no grid kernel named " + name);
  }
  detail::run_grid(grid, body);
}

void dispatch_threadgroups(std::string const& name, std::array<int, 2> constants, size3 groups, size3 threads,
                           std::size_t threadgroup_bytes, std::uint32_t simd_width, buffer_table const& b) {
  set_constants(constants);
  if (name != "kvq_attention_partial") throw std::invalid_argument("metal shim: no threadgroup kernel named " + name);
  detail::run_threadgroups(groups, threads, threadgroup_bytes, simd_width, [&](thread_ids const& t) {
    kvq_attention_partial(*arg<kvq_attention_args const*>(b, 0), arg<kvq_attention_seq const*>(b, 1),
                          arg<uchar const*>(b, 2), arg<float const*>(b, 3), arg<float*>(b, 4), arg<float*>(b, 5),
                          arg<float*>(b, 6), arg<int const*>(b, 7), arg<uchar const*>(b, 8),
                          static_cast<float*>(t.threadgroup_memory), xyz(t.threadgroup_position_in_grid),
                          t.thread_index_in_threadgroup, t.threads_per_threadgroup.x);
  });
}

}  // namespace kvq_metal_shim
