// kvq tests: a mock of the subset of Apple's metal-cpp Foundation API that kvq's Metal cache uses,
// so that backend/metal/metal_cache.hpp can be compiled and run on Linux (see ../Metal/Metal.hpp).
//
// Reference counting follows Cocoa: alloc/init, new* and retain give a reference the caller
// releases; other returned objects are autoreleased into the innermost NS::AutoreleasePool. Every
// live object is counted (kvq_mock::live_objects()) so a test can check that nothing leaks, and an
// autorelease with no pool is counted as an error (kvq_mock::errors()).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kvq_mock {

/// Objects alive now.
inline long& live_objects() {
  static long n = 0;
  return n;
}

/// Misuses of the API seen so far (descriptions).
inline std::vector<std::string>& errors() {
  static std::vector<std::string> e;
  return e;
}

}  // namespace kvq_mock

namespace NS {

using UInteger = unsigned long;
using Integer = long;

enum StringEncoding : UInteger { UTF8StringEncoding = 4 };

struct Range {
  UInteger location = 0;
  UInteger length = 0;
  static Range Make(UInteger loc, UInteger len) { return Range{loc, len}; }
};

/// A reference-counted object.
class Object {
 public:
  Object() { ++kvq_mock::live_objects(); }
  Object(Object const&) = delete;
  Object& operator=(Object const&) = delete;
  virtual ~Object() { --kvq_mock::live_objects(); }
  void release() {
    if (--refs_ == 0) delete this;
  }
  void add_ref() { ++refs_; }

 private:
  long refs_ = 1;
};

template <class T>
class Referencing : public Object {
 public:
  T* retain() {
    add_ref();
    return static_cast<T*>(this);
  }
};

/// A stack of pools; objects autoreleased while a pool is innermost are released with it.
class AutoreleasePool : public Referencing<AutoreleasePool> {
 public:
  static AutoreleasePool* alloc() { return new AutoreleasePool; }
  AutoreleasePool* init() {
    stack().push_back(this);
    return this;
  }
  ~AutoreleasePool() override {
    for (Object* o : objects_) o->release();
    if (!stack().empty() && stack().back() == this) {
      stack().pop_back();
    } else {
      kvq_mock::errors().push_back("autorelease pools released out of order");
    }
  }
  static void add(Object* o) {
    if (stack().empty()) {
      kvq_mock::errors().push_back("object autoreleased with no pool in place");
      return;
    }
    stack().back()->objects_.push_back(o);
  }

 private:
  static std::vector<AutoreleasePool*>& stack() {
    static std::vector<AutoreleasePool*> s;
    return s;
  }
  std::vector<Object*> objects_;
};

/// Autoreleases `o` into the innermost pool and returns it.
template <class T>
T* autoreleased(T* o) {
  AutoreleasePool::add(o);
  return o;
}

class String : public Referencing<String> {
 public:
  static String* string(char const* s, StringEncoding) { return autoreleased(new String(s)); }
  char const* utf8String() const { return text_.c_str(); }
  std::string const& str() const { return text_; }

 private:
  explicit String(char const* s) : text_(s) {}
  std::string text_;
};

class Error : public Referencing<Error> {
 public:
  static Error* make(std::string const& msg) { return autoreleased(new Error(msg)); }
  String* localizedDescription() const { return String::string(text_.c_str(), UTF8StringEncoding); }

 private:
  explicit Error(std::string m) : text_(std::move(m)) {}
  std::string text_;
};

}  // namespace NS
