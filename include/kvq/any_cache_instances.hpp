// kvq: the compiled instances of the any_cache facade, for programs that build it once.
//
// Including any_cache.hpp compiles every cache behind the facade in each translation unit that
// includes it (minutes at -O3). A program with several such translation units may instead define
// KVQ_ANY_CACHE_SEPARATE in all of them (then any_cache.hpp only declares the factories) and include
// this header in exactly one translation unit, or in three, each with KVQ_ANY_CACHE_INSTANCES_GROUP
// defined as 0, 1 or 2 (the groups of KVQ_ANY_CACHE_PAIRS), to compile them in parallel. All of
// them must be built with the same compiler flags (the per-ISA namespace of config.h turns a
// mismatch of instruction sets into a link error).
#pragma once

#include "any_cache.hpp"
#include "detail/any_cache_model.hpp"

#define KVQ_DETAIL_ANY_CACHE_INSTANCE(...)                                                              \
  template auto make_model<__VA_ARGS__>(cache_shape const&, any_cache_options const&, std::string_view, \
                                        std::string_view)                                               \
      ->std::unique_ptr<any_cache>;

#if !defined(KVQ_ANY_CACHE_INSTANCES_GROUP) || KVQ_ANY_CACHE_INSTANCES_GROUP == 0
#  define KVQ_DETAIL_ANY_CACHE_GROUP_0(...) KVQ_DETAIL_ANY_CACHE_INSTANCE(__VA_ARGS__)
#else
#  define KVQ_DETAIL_ANY_CACHE_GROUP_0(...)
#endif
#if !defined(KVQ_ANY_CACHE_INSTANCES_GROUP) || KVQ_ANY_CACHE_INSTANCES_GROUP == 1
#  define KVQ_DETAIL_ANY_CACHE_GROUP_1(...) KVQ_DETAIL_ANY_CACHE_INSTANCE(__VA_ARGS__)
#else
#  define KVQ_DETAIL_ANY_CACHE_GROUP_1(...)
#endif
#if !defined(KVQ_ANY_CACHE_INSTANCES_GROUP) || KVQ_ANY_CACHE_INSTANCES_GROUP == 2
#  define KVQ_DETAIL_ANY_CACHE_GROUP_2(...) KVQ_DETAIL_ANY_CACHE_INSTANCE(__VA_ARGS__)
#else
#  define KVQ_DETAIL_ANY_CACHE_GROUP_2(...)
#endif
#define KVQ_DETAIL_ANY_CACHE_IN_GROUP(GROUP, KNAME, VNAME, ...) KVQ_DETAIL_ANY_CACHE_GROUP_##GROUP(__VA_ARGS__)

KVQ_NAMESPACE_BEGIN
namespace detail {

KVQ_ANY_CACHE_PAIRS(KVQ_DETAIL_ANY_CACHE_IN_GROUP)

}  // namespace detail
KVQ_NAMESPACE_END

#undef KVQ_DETAIL_ANY_CACHE_IN_GROUP
#undef KVQ_DETAIL_ANY_CACHE_GROUP_2
#undef KVQ_DETAIL_ANY_CACHE_GROUP_1
#undef KVQ_DETAIL_ANY_CACHE_GROUP_0
#undef KVQ_DETAIL_ANY_CACHE_INSTANCE
