// kvq tests: a mock of the subset of Apple's metal-cpp Metal API that kvq's Metal cache
// (backend/metal/metal_cache.hpp) uses, so that the cache compiles and runs on Linux. Signatures
// follow metal-cpp's headers; the "GPU" is the shim dispatcher of ../../metal_shim.hpp running
// the kernels of kernels.metal on the CPU, synchronously at commit().
//
// It also checks what the real API would reject or what kvq promises: a library compiled with
// fast math on, a kernel name the source does not define, a pipeline missing its function
// constants, threadgroup memory over 32 KiB or not a multiple of 16 bytes, threadgroups that are
// not whole SIMD-groups, buffer bindings out of bounds, encoders left open at commit or when the
// command buffer is released, waiting on a command buffer never committed. Such misuse is recorded in
// kvq_mock::errors(). kvq_mock::fail_next_commit() makes the next command buffer end in an error, as a GPU fault would.
//
// This proves nothing about Apple's real API beyond these names and signatures.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../../metal_shim.hpp"
#include "../Foundation/Foundation.hpp"

namespace kvq_mock {

/// When set, the next committed command buffer fails (status Error) instead of running.
inline bool& fail_next_commit() {
  static bool f = false;
  return f;
}

inline void misuse(std::string const& what) { errors().push_back(what); }

}  // namespace kvq_mock

namespace MTL {

enum ResourceOptions : NS::UInteger { ResourceStorageModeShared = 0, ResourceStorageModePrivate = 32 };
enum DataType : NS::UInteger { DataTypeInt = 29 };
enum CommandBufferStatus : NS::UInteger {
  CommandBufferStatusNotEnqueued = 0,
  CommandBufferStatusEnqueued = 1,
  CommandBufferStatusCommitted = 2,
  CommandBufferStatusScheduled = 3,
  CommandBufferStatusCompleted = 4,
  CommandBufferStatusError = 5,
};
enum MathMode : NS::Integer { MathModeSafe = 0, MathModeRelaxed = 1, MathModeFast = 2 };
enum MathFloatingPointFunctions : NS::Integer {
  MathFloatingPointFunctionsFast = 0,
  MathFloatingPointFunctionsPrecise = 1,
};

struct Size {
  Size(NS::UInteger w, NS::UInteger h, NS::UInteger d) : width(w), height(h), depth(d) {}
  NS::UInteger width, height, depth;
};

class Buffer : public NS::Referencing<Buffer> {
 public:
  explicit Buffer(NS::UInteger length) : length_(length), storage_((length + 15) / 16 + 1) {}
  void* contents() { return storage_.data(); }
  NS::UInteger length() const { return length_; }

 private:
  NS::UInteger length_;
  std::vector<std::array<std::uint64_t, 2>> storage_;  // 16-byte aligned
};

class CompileOptions : public NS::Referencing<CompileOptions> {
 public:
  static CompileOptions* alloc() { return new CompileOptions; }
  CompileOptions* init() { return this; }
  bool fastMathEnabled() const { return fast_; }
  void setFastMathEnabled(bool f) { fast_ = f; }
  MathMode mathMode() const { return mode_; }
  void setMathMode(MathMode m) { mode_ = m; }
  MathFloatingPointFunctions mathFloatingPointFunctions() const { return functions_; }
  void setMathFloatingPointFunctions(MathFloatingPointFunctions f) { functions_ = f; }

 private:
  bool fast_ = true;  // Metal's defaults: fast math on
  MathMode mode_ = MathModeFast;
  MathFloatingPointFunctions functions_ = MathFloatingPointFunctionsFast;
};

class FunctionConstantValues : public NS::Referencing<FunctionConstantValues> {
 public:
  static FunctionConstantValues* alloc() { return new FunctionConstantValues; }
  FunctionConstantValues* init() { return this; }
  void setConstantValue(void const* value, DataType type, NS::UInteger index) {
    if (type != DataTypeInt || index >= values.size()) {
      kvq_mock::misuse("setConstantValue: only int constants 0 and 1 exist");
      return;
    }
    std::memcpy(&values[index], value, sizeof(int));
    set[index] = true;
  }
  std::array<int, 2> values{};
  std::array<bool, 2> set{};
};

class Function : public NS::Referencing<Function> {
 public:
  Function(std::string n, std::array<int, 2> c) : name(std::move(n)), constants(c) {}
  std::string name;
  std::array<int, 2> constants;
};

class Library : public NS::Referencing<Library> {
 public:
  explicit Library(std::string src) : source_(std::move(src)) {}
  Function* newFunction(NS::String const* name, FunctionConstantValues const* c, NS::Error** error) {
    if (source_.find("kernel void " + name->str() + "(") == std::string::npos) {
      if (error != nullptr) *error = NS::Error::make("no kernel named " + name->str());
      return nullptr;
    }
    if (c == nullptr || !c->set[0] || !c->set[1]) {
      if (error != nullptr) *error = NS::Error::make("function constants 0 and 1 must be set");
      return nullptr;
    }
    return new Function(name->str(), c->values);
  }

 private:
  std::string source_;
};

class ComputePipelineState : public NS::Referencing<ComputePipelineState> {
 public:
  ComputePipelineState(std::string n, std::array<int, 2> c) : name(std::move(n)), constants(c) {}
  NS::UInteger threadExecutionWidth() const { return 32; }
  NS::UInteger maxTotalThreadsPerThreadgroup() const { return 1024; }
  NS::UInteger staticThreadgroupMemoryLength() const { return 0; }
  std::string name;
  std::array<int, 2> constants;
};

class CommandBuffer;

/// A binding of a compute encoder: bytes (setBytes) or a buffer and offset (setBuffer).
struct Binding {
  std::vector<std::uint64_t> bytes;
  Buffer* buffer = nullptr;
  NS::UInteger offset = 0;
  bool is_bytes = false;
};

/// One recorded command: a dispatch or a fill.
struct Command {
  ComputePipelineState const* pipeline = nullptr;
  std::array<Binding, 16> bindings;
  NS::UInteger threadgroup_bytes = 0;
  Size groups{0, 0, 0};
  Size threads{0, 0, 0};
  Buffer* fill = nullptr;
  NS::Range fill_range;
  std::uint8_t fill_value = 0;
};

class ComputeCommandEncoder : public NS::Referencing<ComputeCommandEncoder> {
 public:
  explicit ComputeCommandEncoder(CommandBuffer* cb) : cb_(cb) {}
  void setComputePipelineState(ComputePipelineState const* ps) { state_.pipeline = ps; }
  void setBytes(void const* bytes, NS::UInteger length, NS::UInteger index) {
    if (index >= 16 || length > 4096) return kvq_mock::misuse("setBytes: index >= 16 or more than 4 KiB");
    Binding& b = state_.bindings[index];
    b = Binding{};
    b.is_bytes = true;
    b.bytes.resize((length + 7) / 8);
    std::memcpy(b.bytes.data(), bytes, length);
  }
  void setBuffer(Buffer const* buffer, NS::UInteger offset, NS::UInteger index) {
    if (index >= 16) return kvq_mock::misuse("setBuffer: index >= 16");
    if (buffer != nullptr && offset > buffer->length()) kvq_mock::misuse("setBuffer: offset past the buffer's end");
    Binding& b = state_.bindings[index];
    b = Binding{};
    b.buffer = const_cast<Buffer*>(buffer);
    b.offset = offset;
  }
  void setThreadgroupMemoryLength(NS::UInteger length, NS::UInteger index) {
    if (index != 0 || length % 16 != 0 || length > 32768)
      kvq_mock::misuse("setThreadgroupMemoryLength: index 0, a multiple of 16, at most 32 KiB");
    state_.threadgroup_bytes = length;
  }
  void dispatchThreadgroups(Size groups, Size threads);
  void endEncoding();
  bool open() const { return open_; }

 private:
  CommandBuffer* cb_;
  Command state_;
  bool open_ = true;
};

class BlitCommandEncoder : public NS::Referencing<BlitCommandEncoder> {
 public:
  explicit BlitCommandEncoder(CommandBuffer* cb) : cb_(cb) {}
  void fillBuffer(Buffer const* buffer, NS::Range range, std::uint8_t value);
  void endEncoding() { open_ = false; }
  bool open() const { return open_; }

 private:
  CommandBuffer* cb_;
  bool open_ = true;
};

class CommandBuffer : public NS::Referencing<CommandBuffer> {
 public:
  ComputeCommandEncoder* computeCommandEncoder() {
    auto* e = NS::autoreleased(new ComputeCommandEncoder(this));
    compute_.push_back(e->retain());
    return e;
  }
  BlitCommandEncoder* blitCommandEncoder() {
    auto* e = NS::autoreleased(new BlitCommandEncoder(this));
    blit_.push_back(e->retain());
    return e;
  }
  void record(Command c) { commands_.push_back(std::move(c)); }
  void commit();
  void waitUntilCompleted() {
    if (status_ == CommandBufferStatusNotEnqueued)
      kvq_mock::misuse("waitUntilCompleted on a command buffer never committed");
  }
  CommandBufferStatus status() const { return status_; }
  NS::Error* error() const { return status_ == CommandBufferStatusError ? NS::Error::make("mock GPU fault") : nullptr; }
  ~CommandBuffer() override {
    for (auto* e : compute_) {
      if (e->open()) kvq_mock::misuse("command buffer released with a compute encoder not ended");
      e->release();
    }
    for (auto* e : blit_) {
      if (e->open()) kvq_mock::misuse("command buffer released with a blit encoder not ended");
      e->release();
    }
  }

 private:
  std::vector<Command> commands_;
  std::vector<ComputeCommandEncoder*> compute_;
  std::vector<BlitCommandEncoder*> blit_;
  CommandBufferStatus status_ = CommandBufferStatusNotEnqueued;
};

inline void ComputeCommandEncoder::dispatchThreadgroups(Size groups, Size threads) {
  if (!open_) return kvq_mock::misuse("dispatch on an ended encoder");
  if (state_.pipeline == nullptr) return kvq_mock::misuse("dispatch without a pipeline");
  if (groups.width * groups.height * groups.depth == 0) return kvq_mock::misuse("dispatch of zero threadgroups");
  NS::UInteger const n = threads.width * threads.height * threads.depth;
  if (n == 0 || n > 1024) return kvq_mock::misuse("threadgroup of 0 or more than 1024 threads");
  Command c = state_;
  c.groups = groups;
  c.threads = threads;
  cb_->record(std::move(c));
}

inline void ComputeCommandEncoder::endEncoding() {
  if (!open_) kvq_mock::misuse("endEncoding twice");
  open_ = false;
}

inline void BlitCommandEncoder::fillBuffer(Buffer const* buffer, NS::Range range, std::uint8_t value) {
  if (buffer == nullptr || range.location + range.length > buffer->length())
    return kvq_mock::misuse("fillBuffer out of bounds");
  Command c;
  c.fill = const_cast<Buffer*>(buffer);
  c.fill_range = range;
  c.fill_value = value;
  cb_->record(std::move(c));
}

inline void CommandBuffer::commit() {
  if (status_ != CommandBufferStatusNotEnqueued) return kvq_mock::misuse("commit twice");
  for (auto* e : compute_)
    if (e->open()) kvq_mock::misuse("commit with a compute encoder not ended");
  for (auto* e : blit_)
    if (e->open()) kvq_mock::misuse("commit with a blit encoder not ended");
  if (kvq_mock::fail_next_commit()) {
    kvq_mock::fail_next_commit() = false;
    status_ = CommandBufferStatusError;
    return;
  }
  for (auto& c : commands_) {
    if (c.fill != nullptr) {
      std::memset(static_cast<std::uint8_t*>(c.fill->contents()) + c.fill_range.location, c.fill_value,
                  c.fill_range.length);
      continue;
    }
    kvq_metal_shim::buffer_table table{};
    for (std::size_t i = 0; i < 16; ++i) {
      Binding& b = c.bindings[i];
      if (b.is_bytes) {
        table[i] = b.bytes.data();
      } else if (b.buffer != nullptr) {
        table[i] = static_cast<std::uint8_t*>(b.buffer->contents()) + b.offset;
      }
    }
    kvq_metal_shim::size3 const groups{static_cast<std::uint32_t>(c.groups.width),
                                       static_cast<std::uint32_t>(c.groups.height),
                                       static_cast<std::uint32_t>(c.groups.depth)};
    kvq_metal_shim::size3 const threads{static_cast<std::uint32_t>(c.threads.width),
                                        static_cast<std::uint32_t>(c.threads.height),
                                        static_cast<std::uint32_t>(c.threads.depth)};
    std::array<int, 2> const k = c.pipeline->constants;
    if (c.pipeline->name == "kvq_attention_partial") {
      if (threads.x % 32 != 0 || threads.y != 1 || threads.z != 1)
        kvq_mock::misuse("attention threadgroups must be whole SIMD-groups along x");
      kvq_metal_shim::dispatch_threadgroups(c.pipeline->name, k, groups, threads, c.threadgroup_bytes, 32, table);
    } else {
      // Every other kernel bounds-checks its grid: run the whole threadgroups, as the GPU would.
      kvq_metal_shim::dispatch_threads(c.pipeline->name, k,
                                       {groups.x * threads.x, groups.y * threads.y, groups.z * threads.z}, table);
    }
  }
  status_ = CommandBufferStatusCompleted;
}

class CommandQueue : public NS::Referencing<CommandQueue> {
 public:
  CommandBuffer* commandBuffer() { return NS::autoreleased(new CommandBuffer); }
};

class Device : public NS::Referencing<Device> {
 public:
  Buffer* newBuffer(NS::UInteger length, ResourceOptions) { return new Buffer(length); }
  Buffer* newBuffer(void const* pointer, NS::UInteger length, ResourceOptions) {
    auto* b = new Buffer(length);
    std::memcpy(b->contents(), pointer, length);
    return b;
  }
  Library* newLibrary(NS::String const* source, CompileOptions const* options, NS::Error** error) {
    bool const safe = options != nullptr && (options->mathMode() == MathModeSafe || !options->fastMathEnabled());
    if (!safe) {
      if (error != nullptr) *error = NS::Error::make("mock: kvq's kernels must be compiled with fast math off");
      return nullptr;
    }
    return new Library(source->str());
  }
  ComputePipelineState* newComputePipelineState(Function const* fn, NS::Error**) {
    return new ComputePipelineState(fn->name, fn->constants);
  }
  NS::UInteger maxThreadgroupMemoryLength() const { return 32768; }
  CommandQueue* newCommandQueue() { return new CommandQueue; }
};

inline Device* CreateSystemDefaultDevice() { return new Device; }

}  // namespace MTL
