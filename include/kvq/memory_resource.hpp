// kvq: the allocator hook of a cache (`cache_options::memory`), a polymorphic memory resource.
//
// With a standard library that has <memory_resource> (libstdc++, MSVC, libc++ 16 and later),
// kvq::memory_resource is std::pmr::memory_resource and the default resource is the standard
// one: an engine passes any std::pmr resource it already has. Without it (libc++ 14 and 15),
// kvq::memory_resource is kvq's own class with the same interface (allocate / deallocate /
// is_equal over do_allocate / do_deallocate / do_is_equal), and the default resource is kvq's
// new/delete resource. Code written against the names below builds with both.
//
// Like the error types, these live directly in namespace kvq (not in the per-ISA inline
// namespace), so a resource made by code built for one instruction set serves code built for
// another.
#pragma once

#include <cstddef>

#include "detail/config.h"  // first: the C++20 and floating-point checks

#if __has_include(<memory_resource>)
#  include <memory_resource>
#  define KVQ_HAS_STD_MEMORY_RESOURCE 1
#else
#  include <atomic>
#  include <new>
#  define KVQ_HAS_STD_MEMORY_RESOURCE 0
#endif

namespace kvq {

#if KVQ_HAS_STD_MEMORY_RESOURCE

/// The polymorphic allocator interface of the cache: std::pmr::memory_resource.
using memory_resource = std::pmr::memory_resource;

/// The resource a cache uses when its options name none: std::pmr::get_default_resource().
inline auto get_default_memory_resource() noexcept -> memory_resource* { return std::pmr::get_default_resource(); }

/// Replaces the default resource (nullptr restores new/delete); returns the previous one.
inline auto set_default_memory_resource(memory_resource* r) noexcept -> memory_resource* {
  return std::pmr::set_default_resource(r);
}

/// A resource that allocates with aligned operator new and frees with operator delete.
inline auto new_delete_memory_resource() noexcept -> memory_resource* { return std::pmr::new_delete_resource(); }

#else

/// The polymorphic allocator interface of the cache (this standard library has no
/// std::pmr::memory_resource): the same members as the standard class.
class memory_resource {
 public:
  virtual ~memory_resource() = default;

  /// Returns `bytes` bytes aligned to `alignment` (a power of two), or throws std::bad_alloc.
  [[nodiscard]] auto allocate(std::size_t bytes, std::size_t alignment = alignof(std::max_align_t)) -> void* {
    return do_allocate(bytes, alignment);
  }
  /// Frees memory from allocate(bytes, alignment) of this resource (or one equal to it).
  void deallocate(void* p, std::size_t bytes, std::size_t alignment = alignof(std::max_align_t)) {
    do_deallocate(p, bytes, alignment);
  }
  /// True when memory allocated by one of the two may be freed by the other.
  [[nodiscard]] auto is_equal(memory_resource const& other) const noexcept -> bool { return do_is_equal(other); }

 private:
  virtual auto do_allocate(std::size_t bytes, std::size_t alignment) -> void* = 0;
  virtual void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) = 0;
  virtual auto do_is_equal(memory_resource const& other) const noexcept -> bool = 0;
};

namespace detail {

/// kvq's new/delete resource (one object for the program).
class new_delete_resource final : public memory_resource {
  auto do_allocate(std::size_t bytes, std::size_t alignment) -> void* override {
    return ::operator new (bytes, std::align_val_t{alignment});
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) override {
    ::operator delete (p, bytes, std::align_val_t{alignment});
  }
  auto do_is_equal(memory_resource const& other) const noexcept -> bool override { return this == &other; }
};

inline auto new_delete_instance() noexcept -> memory_resource* {
  static new_delete_resource r;
  return &r;
}

inline auto default_resource_slot() noexcept -> std::atomic<memory_resource*>& {
  static std::atomic<memory_resource*> slot{new_delete_instance()};
  return slot;
}

}  // namespace detail

/// A resource that allocates with aligned operator new and frees with operator delete.
inline auto new_delete_memory_resource() noexcept -> memory_resource* { return detail::new_delete_instance(); }

/// The resource a cache uses when its options name none (initially new_delete_memory_resource()).
inline auto get_default_memory_resource() noexcept -> memory_resource* {
  return detail::default_resource_slot().load();
}

/// Replaces the default resource (nullptr restores new/delete); returns the previous one.
inline auto set_default_memory_resource(memory_resource* r) noexcept -> memory_resource* {
  return detail::default_resource_slot().exchange(r ? r : detail::new_delete_instance());
}

#endif

}  // namespace kvq
