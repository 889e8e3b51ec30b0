// kvq: the vector type of kvq's host code.
//
// kvq::detail::vector<T> is std::vector<T> with an allocator declared in kvq's per-ISA inline
// namespace, so the vector's member functions (growth, assign, copy), which the compiler may emit
// out of line, are distinct symbols for each instruction set (config.h): a translation unit built
// without AVX never links the std::vector<float>::assign of one built with it.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "config.h"

KVQ_NAMESPACE_BEGIN
namespace detail {

/// std::allocator's behaviour under a type private to this instruction set.
template <class T>
struct allocator {
  using value_type = T;

  allocator() noexcept = default;
  template <class U>
  allocator(allocator<U> const&) noexcept {}  // NOLINT(google-explicit-constructor): allocator rebinding

  /// Storage for n objects of T (std::bad_alloc on failure).
  [[nodiscard]] auto allocate(std::size_t n) -> T* { return std::allocator<T>{}.allocate(n); }
  /// Frees storage from allocate(n).
  void deallocate(T* p, std::size_t n) noexcept { std::allocator<T>{}.deallocate(p, n); }

  template <class U>
  friend auto operator==(allocator const&, allocator<U> const&) noexcept -> bool {
    return true;
  }
};

/// The vector of kvq's host code (see the file comment).
template <class T>
using vector = std::vector<T, allocator<T>>;

}  // namespace detail
KVQ_NAMESPACE_END
