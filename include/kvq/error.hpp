// kvq: typed errors. Every check that fails throws one of these (or aborts with the same message
// under KVQ_NO_EXCEPTIONS), and the object it was called on is left unchanged.
//
// Unlike the rest of kvq, these types live directly in namespace kvq (not in the per-ISA inline
// namespace), so an error thrown by code built for one instruction set is caught as the same type
// by code built for another.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "detail/config.h"  // first, so kvq::detail below is the ISA namespace's detail

namespace kvq {

/// Base class of every error kvq reports.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// An append would exceed the cache's capacity.
class capacity_error : public error {
 public:
  using error::error;
};

/// A layer, head or token range is out of bounds.
class index_error : public error {
 public:
  using error::error;
};

/// Input or output shapes or strides do not match the cache.
class shape_error : public error {
 public:
  using error::error;
};

/// A parameter is invalid (non-positive size, bad scale, residual not a multiple of G, ...).
class invalid_argument_error : public error {
 public:
  using error::error;
};

/// The operation is not supported for this codec or configuration (e.g. a KIVI shift that is not
/// a multiple of G, an unknown codec name).
class unsupported_error : public error {
 public:
  using error::error;
};

/// Serialized data is malformed, damaged or does not match its destination (kvq::load,
/// kvq::import_sequence); the message says what, and the destination is unchanged.
class format_error : public error {
 public:
  using error::error;
};

/// A GPU runtime call failed (allocation, launch, or a device fault surfacing at synchronisation);
/// the message names the call, and the cache it happened on is unusable from then on.
class device_error : public error {
 public:
  using error::error;
};

namespace detail {

/// Throws `E(message)`, or prints the message and aborts when exceptions are disabled.
template <class E>
[[noreturn]] inline void raise(std::string const& message) {
#if defined(KVQ_NO_EXCEPTIONS) || !(defined(__cpp_exceptions) || defined(__EXCEPTIONS))
  std::fprintf(stderr, "kvq: %s\n", message.c_str());
  std::abort();
#else
  throw E(message);
#endif
}

/// Raises `E` with `message` unless `ok` holds.
template <class E>
inline void check(bool ok, std::string const& message) {
  if (!ok) raise<E>(message);
}

/// Raises `E` with the message `make_message()` unless `ok` holds: the message is only built on
/// failure (for checks on every call of a hot path).
template <class E, class F>
requires std::is_invocable_r_v<std::string, F&>
inline void check(bool ok, F&& make_message) {
  if (!ok) raise<E>(make_message());
}

}  // namespace detail
}  // namespace kvq
