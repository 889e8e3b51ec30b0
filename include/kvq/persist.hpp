// kvq: saving, loading and shipping caches (the format: docs/formats.md).
//
//   kvq::save(cache, writer)                  a flat cache, every layer and every codec state
//   kvq::load_into(cache, reader)             replaces a flat cache's contents (strong guarantee)
//   kvq::load<Cache>(reader, options)         a new CPU cache of the saved shape
//   kvq::export_sequence(paged, seq, first, count, writer)   tokens [first, first + count) of a
//                                             paged sequence (first a multiple of page_tokens)
//   kvq::import_sequence(paged, reader)       a new sequence holding the saved tokens
//   kvq::import_sequence(paged, seq, reader)  appends an export that continues `seq`
//
// The caches of every backend (CPU, CUDA, Metal) save and load through their cache core. A saved
// flat cache and an exported sequence share one format: either loads into a flat cache or imports
// into a paged one whose codecs, options and head shape match. The loader reads and validates the
// whole input (magic, version, fingerprint, shape, every record and checksum) before it changes
// anything, raising kvq::format_error with a message; it allocates no more than the input holds.
#pragma once

#include <algorithm>
#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <istream>
#include <ostream>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/paged_core.hpp"
#include "core/saved_format.hpp"
#include "error.hpp"
#include "memory_resource.hpp"

KVQ_NAMESPACE_BEGIN

/// A destination of bytes: `w.write(bytes)` takes them all or raises.
template <class W>
concept byte_writer = requires(W& w, std::span<std::byte const> b) {
  w.write(b);
};

/// A source of bytes: `r.read(buffer)` fills a prefix of `buffer` and returns its length, which is
/// less than buffer.size() only at the end of the input.
template <class R>
concept byte_reader = requires(R& r, std::span<std::byte> b) {
  { r.read(b) } -> std::convertible_to<std::size_t>;
};

/// Writes into a caller's buffer; raises capacity_error when it is full (nothing is written then).
class span_writer {
 public:
  explicit span_writer(std::span<std::byte> out) noexcept : out_(out) {}
  void write(std::span<std::byte const> b) {
    detail::check<capacity_error>(b.size() <= out_.size() - used_, [&] {
      return "save: the buffer of " + std::to_string(out_.size()) + " bytes is full";
    });
    if (!b.empty()) std::memcpy(out_.data() + used_, b.data(), b.size());
    used_ += b.size();
  }
  /// Bytes written so far.
  auto written() const noexcept -> std::size_t { return used_; }

 private:
  std::span<std::byte> out_;
  std::size_t used_ = 0;
};

/// Appends to a std::vector<std::byte>.
class vector_writer {
 public:
  explicit vector_writer(std::vector<std::byte>& out) noexcept : out_(&out) {}
  void write(std::span<std::byte const> b) { out_->insert(out_->end(), b.begin(), b.end()); }

 private:
  std::vector<std::byte>* out_;
};

/// Writes to a std::ostream; raises kvq::error when the stream fails.
class ostream_writer {
 public:
  explicit ostream_writer(std::ostream& os) noexcept : os_(&os) {}
  void write(std::span<std::byte const> b) {
    os_->write(reinterpret_cast<char const*>(b.data()), static_cast<std::streamsize>(b.size()));
    detail::check<error>(static_cast<bool>(*os_), "save: writing to the stream failed");
  }

 private:
  std::ostream* os_;
};

/// Writes a file (created or truncated); raises kvq::error when it cannot be opened or written.
class file_writer {
 public:
  explicit file_writer(std::string const& path) : f_(std::fopen(path.c_str(), "wb")), path_(path) {
    detail::check<error>(f_ != nullptr, [&] { return "save: cannot open " + path_ + " for writing"; });
  }
  file_writer(file_writer const&) = delete;
  file_writer& operator=(file_writer const&) = delete;
  ~file_writer() {
    if (f_ != nullptr) std::fclose(f_);
  }
  void write(std::span<std::byte const> b) {
    detail::check<error>(std::fwrite(b.data(), 1, b.size(), f_) == b.size(),
                         [&] { return "save: writing " + path_ + " failed"; });
  }
  /// Flushes and closes the file; raises kvq::error when that fails.
  void close() {
    std::FILE* f = f_;
    f_ = nullptr;
    detail::check<error>(f != nullptr && std::fclose(f) == 0, [&] { return "save: closing " + path_ + " failed"; });
  }

 private:
  std::FILE* f_;
  std::string path_;
};

/// Reads from a caller's buffer in place (the loader validates the bytes where they are).
class span_reader {
 public:
  explicit span_reader(std::span<std::byte const> in) noexcept : in_(in) {}
  auto read(std::span<std::byte> b) noexcept -> std::size_t {
    std::span<std::byte const> const t = take(b.size());
    if (!t.empty()) std::memcpy(b.data(), t.data(), t.size());
    return t.size();
  }
  /// The next min(n, remaining) bytes, consumed.
  auto take(std::size_t n) noexcept -> std::span<std::byte const> {
    std::size_t const w = std::min(n, in_.size() - used_);
    std::span<std::byte const> const t = in_.subspan(used_, w);
    used_ += w;
    return t;
  }
  /// Bytes consumed so far.
  auto consumed() const noexcept -> std::size_t { return used_; }

 private:
  std::span<std::byte const> in_;
  std::size_t used_ = 0;
};

/// Reads from a std::istream.
class istream_reader {
 public:
  explicit istream_reader(std::istream& is) noexcept : is_(&is) {}
  auto read(std::span<std::byte> b) -> std::size_t {
    is_->read(reinterpret_cast<char*>(b.data()), static_cast<std::streamsize>(b.size()));
    return static_cast<std::size_t>(is_->gcount());
  }

 private:
  std::istream* is_;
};

/// Reads a file; raises kvq::error when it cannot be opened.
class file_reader {
 public:
  explicit file_reader(std::string const& path) : f_(std::fopen(path.c_str(), "rb")) {
    detail::check<error>(f_ != nullptr, [&] { return "load: cannot open " + path + " for reading"; });
  }
  file_reader(file_reader const&) = delete;
  file_reader& operator=(file_reader const&) = delete;
  ~file_reader() { std::fclose(f_); }
  auto read(std::span<std::byte> b) noexcept -> std::size_t { return std::fread(b.data(), 1, b.size(), f_); }

 private:
  std::FILE* f_;
};

/// Options of kvq::load.
struct load_options {
  std::int64_t capacity = 0;                     ///< tokens per layer; 0: the saved cache's (an export's tokens)
  std::size_t max_bytes = std::size_t{1} << 32;  ///< the new cache's memory at most (capacity_error beyond)
  kvq::memory_resource* memory = nullptr;        ///< the new cache's allocator; nullptr: the default resource
};

namespace detail {

/// Reads one whole image from `r` into `buffer` (or in place from a span_reader): the header
/// first, then as many bytes as it declares, the buffer growing only as bytes arrive.
template <class R>
auto read_saved_bytes(R& r, vector<std::byte>& buffer) -> std::span<std::byte const> {
  auto const truncated = [](std::size_t got, std::size_t want) {
    raise<format_error>("load: truncated input: " + std::to_string(got) + " of " + std::to_string(want) + " bytes");
  };
  if constexpr (requires { r.take(std::size_t{}); }) {
    std::span<std::byte const> const head = r.take(saved_header_bytes);
    saved_header const h = parse_saved_header(head);
    std::span<std::byte const> const rest = r.take(static_cast<std::size_t>(h.file_bytes) - saved_header_bytes);
    if (rest.size() != h.file_bytes - saved_header_bytes)
      truncated(saved_header_bytes + rest.size(), static_cast<std::size_t>(h.file_bytes));
    return {head.data(), static_cast<std::size_t>(h.file_bytes)};
  } else {
    buffer.resize(saved_header_bytes);
    std::size_t got = 0;
    while (got < saved_header_bytes) {
      std::size_t const n = r.read(std::span<std::byte>(buffer.data() + got, saved_header_bytes - got));
      if (n == 0) break;
      got += n;
    }
    saved_header const h = parse_saved_header(std::span<std::byte const>(buffer.data(), got));
    std::size_t const want = static_cast<std::size_t>(h.file_bytes);
    constexpr std::size_t chunk = std::size_t{4} << 20;
    while (got < want) {
      buffer.resize(std::min(want, got + chunk));
      std::size_t const n = r.read(std::span<std::byte>(buffer.data() + got, buffer.size() - got));
      if (n == 0) truncated(got, want);
      got += n;
    }
    return {buffer.data(), want};
  }
}

/// The header of an image of kind `kind` written from `core` (a flat or paged core) whose
/// fingerprints are `e`'s; capacity, page_tokens and first are the caller's to set.
template <class Core>
auto saved_header_of(saved_kind kind, Core const& core, saved_expect const& e) -> saved_header {
  auto const& s = core.shape();
  saved_header h;
  h.kind = kind;
  h.layers = static_cast<std::uint32_t>(s.layers);
  h.kv_heads = static_cast<std::uint32_t>(s.kv_heads);
  h.head_dim = static_cast<std::uint32_t>(s.head_dim);
  h.residual = static_cast<std::uint32_t>(core.residual());
  h.key = e.key;
  h.value = e.value;
  return h;
}

/// What `core` (a flat cache core) expects of an image it loads.
template <class Core>
auto flat_expect(Core const& core) -> saved_expect {
  auto const& s = core.shape();
  return make_saved_expect<typename Core::key_codec, typename Core::value_codec>(
      s.layers, s.kv_heads, s.head_dim, core.residual(), core.key_options(), core.value_options(), s.capacity);
}

/// The unit and residual locators of a flat cache core (see write_saved_image).
template <class Core>
struct flat_storage {
  Core& core;
  void operator()(int l, bool keys, int h, std::int64_t u0, std::int64_t u1, auto&& fn) const {
    cache_side const& side = keys ? core.key_side() : core.value_side();
    std::size_t const unit = side.region.unit_bytes;
    fn(core.layer(l),
       side.region.head0 + static_cast<std::size_t>(h) * side.region.head_stride + static_cast<std::size_t>(u0) * unit,
       static_cast<std::size_t>(u1 - u0) * unit);
  }
  auto residual(int l, bool keys, int h) const -> std::pair<typename Core::layer_type, std::size_t> {
    cache_side const& side = keys ? core.key_side() : core.value_side();
    return {core.layer(l), side.region.residual0 + static_cast<std::size_t>(h) * side.region.residual_stride};
  }
};

/// Copies an image starting at token 0, validated but for its section checksums, into flat
/// cache core `core` and takes its states; on any problem nothing live changed. A layer holding
/// no tokens has no live storage, so its section is checked while it is copied (one pass over
/// the image, as memcpy); the other sections are checked before anything is copied.
template <class Core>
void load_validated(Core& core, saved_image const& img, saved_geometry const& g) {
  check<format_error>(img.header.first == 0, [&] {
    return "load: the data starts at token " + std::to_string(img.header.first) +
           "; a flat cache loads data from token 0 (import it into the paged sequence it continues)";
  });
  using device_type = std::remove_cvref_t<decltype(core.device())>;
  std::size_t const layers = img.states.size();
  vector<saved_copy> first(layers, saved_copy::skip), then(layers, saved_copy::skip);
  for (std::size_t l = 0; l < layers; ++l) {
    // GPU memory is copied in one piece per array (each copy waits for the device), so checked first.
    if (device_type::host_memory && core.state(static_cast<int>(l)).length == 0) {
      first[l] = saved_copy::verify;
    } else {
      check_saved_section(img, l);
      then[l] = saved_copy::copy;
    }
  }
  flat_storage<Core> const at{core};
  auto const rows = [&](int l, bool keys, int h) { return at.residual(l, keys, h); };
  copy_saved_image(core, img, g, at, rows, first);
  copy_saved_image(core, img, g, at, rows, then);
  for (std::size_t l = 0; l < layers; ++l) core.restore_state(static_cast<int>(l), img.states[l]);
}

/// The unit and residual locators of a sequence (in slot `slot`, layer states `states`) of a paged core.
template <class Core>
struct paged_storage {
  Core& core;
  int slot = 0;
  vector<std::int32_t> const* table = nullptr;
  std::int64_t unit_tokens(bool keys) const { return keys && core.key_side().tiles ? core.key_side().region.group : 1; }
  void operator()(int l, bool keys, int h, std::int64_t u0, std::int64_t u1, auto&& fn) const {
    std::int64_t const per = unit_tokens(keys);
    std::int64_t const page_units = core.shape().page_tokens / per;
    std::size_t const unit = (keys ? core.key_side() : core.value_side()).region.unit_bytes;
    layer_state const none{};
    for (std::int64_t u = u0; u < u1;) {
      std::int64_t const p = u / page_units;
      std::int64_t const e = std::min(u1, (p + 1) * page_units);
      kvq_region const r = core.page_region(keys, none, l, slot, (*table)[static_cast<std::size_t>(p)], p);
      fn(core.pool(),
         r.head0 + static_cast<std::size_t>(h) * r.head_stride + static_cast<std::size_t>(u - p * page_units) * unit,
         static_cast<std::size_t>(e - u) * unit);
      u = e;
    }
  }
  auto residual(int l, bool keys, int h) const -> std::pair<typename Core::layer_type, std::size_t> {
    kvq_region const r = core.page_region(keys, layer_state{}, l, slot, 0, 0);
    return {core.pool(), r.residual0 + static_cast<std::size_t>(h) * r.residual_stride};
  }
};

/// Copies the key means of (seq, layer) of a paged cache with centered keys (kv_heads × head_dim
/// floats; a GPU cache's from the device) into `out`.
template <class Paged>
void paged_key_means(Paged& cache, sequence_id seq, int layer, float* out) {
  auto& core = cache.core();
  if constexpr (std::remove_cvref_t<decltype(core)>::device_means) {
    core.read_key_means(seq, layer, out);
  } else {
    float const* mu = cache.key_mean(seq, layer, 0);
    std::copy(mu,
              mu + static_cast<std::size_t>(core.shape().kv_heads) * static_cast<std::size_t>(core.shape().head_dim),
              out);
  }
}

/// The key means of every layer of a flat cache (layers × kv_heads × head_dim floats) where its key
/// codec is centered (a GPU cache's copied from the device), else empty.
template <class Cache>
auto flat_key_means(Cache const& cache) -> vector<float> {
  if constexpr (centered_codec<typename Cache::key_codec>) {
    auto& core = const_cast<std::remove_cvref_t<decltype(cache.core())>&>(cache.core());
    auto const& s = core.shape();
    std::size_t const per = static_cast<std::size_t>(s.kv_heads) * static_cast<std::size_t>(s.head_dim);
    if constexpr (std::remove_cvref_t<decltype(core)>::device_means) {
      vector<float> mu(static_cast<std::size_t>(s.layers) * per);
      for (int l = 0; l < s.layers; ++l) core.read_key_means(l, mu.data() + static_cast<std::size_t>(l) * per);
      return mu;
    } else {
      float const* mu = cache.key_means().layer(0);
      return vector<float>(mu, mu + static_cast<std::size_t>(s.layers) * per);
    }
  } else {
    (void)cache;
    return {};
  }
}

/// Sets the key means of a flat cache with centered keys from a loaded image (every layer: fixed
/// where it holds tokens, cleared elsewhere; a GPU cache's written to the device).
template <class Cache>
void restore_flat_key_means(Cache& cache, saved_image const& img, saved_geometry const& g) {
  if constexpr (centered_codec<typename Cache::key_codec>) {
    vector<float> mu(g.key_means / 4);
    for (std::size_t l = 0; l < img.states.size(); ++l) {
      int const layer = static_cast<int>(l);
      if constexpr (std::remove_cvref_t<decltype(cache.core())>::device_means) {
        if (img.states[l].length == 0) continue;  // an empty layer's mean is fixed by its next append
        saved_key_means(img, g, l, mu.data());
        cache.core().write_key_means(layer, mu.data());
      } else {
        if (img.states[l].length == 0) {
          cache.key_means().clear(layer);
          continue;
        }
        saved_key_means(img, g, l, mu.data());
        cache.key_means().fix(layer, mu.data());
      }
    }
  } else {
    (void)cache;
    (void)img;
    (void)g;
  }
}

}  // namespace detail

/// Bytes kvq::save writes for `cache`.
template <class Cache>
auto saved_bytes(Cache const& cache) -> std::size_t {
  auto const& core = cache.core();
  auto const e = detail::flat_expect(core);
  detail::vector<detail::layer_state> states;
  for (int l = 0; l < core.shape().layers; ++l) states.push_back(core.state(l));
  return static_cast<std::size_t>(detail::saved_image_bytes(e.geo, states, 0));
}

/// Writes `cache` (any backend's QuantizedKVCache) to `w`: every layer's tokens, KIVI residual
/// and window rows included. Loading it gives a bit-identical cache (storage, reads, attention).
/// Raises device_error when a device copy fails, and what `w` raises.
template <class Cache, byte_writer W>
void save(Cache const& cache, W&& w) {
  // Saving reads the device only; the core's device calls are non-const where they wait for it.
  auto& core = const_cast<std::remove_cvref_t<decltype(cache.core())>&>(cache.core());
  [[maybe_unused]] detail::operation_scope<decltype(core)> const scope;
  core.check_usable();
  using core_type = std::remove_cvref_t<decltype(core)>;
  auto const& s = core.shape();
  detail::saved_expect const e = detail::flat_expect(core);
  detail::saved_header h = detail::saved_header_of(detail::saved_kind::cache, core, e);
  h.capacity = static_cast<std::uint64_t>(s.capacity);
  detail::vector<detail::layer_state> states;
  for (int l = 0; l < s.layers; ++l) states.push_back(core.state(l));
  detail::flat_storage<core_type> const at{core};
  detail::vector<float> const means = detail::flat_key_means(cache);  // centered keys
  detail::write_saved_image(
      core, h, e.geo, states, at, [&](int l, bool keys, int hd) { return at.residual(l, keys, hd); },
      [&](std::span<std::byte const> b) { w.write(b); }, means.empty() ? nullptr : means.data());
}

/// Replaces the contents of `cache` with a saved cache (or an export from token 0) read from `r`.
/// Everything is read and validated before any token changes (the sections of layers that hold
/// no tokens are checked as they are copied into storage that holds nothing); on any problem
/// the cache's contents are unchanged and format_error says what (bad magic or version, codecs or shape that differ
/// from the cache's, naming both, truncation, checksums, token counts beyond the cache's capacity, residual state out
/// of range). Raises device_error when a device copy fails, and what `r` raises.
template <class Cache, byte_reader R>
void load_into(Cache& cache, R&& r) {
  auto& core = cache.core();
  [[maybe_unused]] detail::operation_scope<decltype(core)> const scope;
  core.check_usable();
  detail::vector<std::byte> buffer;
  std::span<std::byte const> const bytes = detail::read_saved_bytes(r, buffer);
  detail::saved_expect const e = detail::flat_expect(core);
  detail::saved_image const img = detail::parse_saved_image(bytes, e, /*check_sections=*/false);
  detail::load_validated(core, img, e.geo);
  detail::restore_flat_key_means(cache, img, e.geo);
}

/// A new CPU cache (QuantizedKVCache<Choice>) of the saved shape, codec options and contents read
/// from `r`: the capacity is the saved cache's (an export's tokens) unless opt.capacity is set.
/// Raises format_error as load_into, and capacity_error when the cache would exceed opt.max_bytes.
template <class Cache, byte_reader R>
auto load(R&& r, load_options const& opt = {}) -> Cache {
  using K = typename Cache::key_codec;
  using V = typename Cache::value_codec;
  detail::vector<std::byte> buffer;
  std::span<std::byte const> const bytes = detail::read_saved_bytes(r, buffer);
  detail::saved_header const h = detail::parse_saved_header(bytes);
  int const residual = static_cast<int>(std::min<std::uint32_t>(h.residual, 1u << 30));
  typename Cache::options o;
  o.residual = residual;
  o.key = detail::saved_params<K>(h.key);
  o.value = detail::saved_params<V>(h.value);
  o.memory = opt.memory;
  std::int64_t const limit = std::int64_t{1} << 40;
  detail::saved_expect e = detail::make_saved_expect<K, V>(
      0, static_cast<int>(h.kv_heads), static_cast<int>(h.head_dim), residual, o.key, o.value,
      opt.capacity > 0                      ? opt.capacity
      : h.kind == detail::saved_kind::cache ? static_cast<std::int64_t>(h.capacity)
                                            : limit);
  detail::saved_image const img = detail::parse_saved_image(bytes, e, /*check_sections=*/false);
  std::int64_t capacity = opt.capacity > 0 ? opt.capacity : static_cast<std::int64_t>(h.capacity);
  if (h.kind == detail::saved_kind::sequence && opt.capacity <= 0) {
    capacity = 1;
    for (auto const& st : img.states) capacity = std::max(capacity, st.length);
    if (e.geo.key_tiles) capacity = (capacity + e.geo.key_tokens - 1) / e.geo.key_tokens * e.geo.key_tokens;
  }
  cache_shape const shape{static_cast<int>(h.layers), static_cast<int>(h.kv_heads), static_cast<int>(h.head_dim),
                          capacity};
  detail::check_cache_options<K, V>(shape, residual, o.key, o.value);
  std::size_t const need = detail::plan_memory_unchecked<K, V>(shape, residual).total_bytes;
  detail::check<capacity_error>(need <= opt.max_bytes, [&] {
    return "load: the saved cache needs " + std::to_string(need) +
           " bytes, more than max_bytes = " + std::to_string(opt.max_bytes);
  });
  Cache cache(shape, o);
  detail::load_validated(cache.core(), img, e.geo);
  detail::restore_flat_key_means(cache, img, e.geo);
  return cache;
}

/// Writes tokens [first, first + count) of sequence `seq` of the paged cache `cache` to `w` (all
/// layers; a layer shorter than first + count gives what it holds): the tokens' units, and the
/// KIVI residual and window rows as they are after truncate(first + count). `first` must be a
/// multiple of page_tokens with every token before it in encoded units (the continuation of an
/// export of [0, first), imported with import_sequence(cache, seq, r)). Raises index_error for an
/// unknown sequence, invalid_argument_error for a bad range, capacity_error when a KIVI cut needs
/// a free sequence slot (the cut is made on a temporary fork), and what `w` raises.
template <class Paged, byte_writer W>
void export_sequence(Paged& cache, sequence_id seq, std::int64_t first, std::int64_t count, W&& w) {
  auto& core = cache.core();
  [[maybe_unused]] detail::operation_scope<decltype(core)> const scope;
  core.check_usable();
  using core_type = std::remove_cvref_t<decltype(core)>;
  std::int64_t const size = core.size(seq);
  auto const& s = core.shape();
  detail::check<invalid_argument_error>(
      first >= 0 && count >= 0 && first <= size && count <= size - first && first % s.page_tokens == 0, [&] {
        return "export_sequence: tokens [" + std::to_string(first) + ", " + std::to_string(first) + " + " +
               std::to_string(count) + ") of a sequence of " + std::to_string(size) +
               " tokens (first must be a multiple of page_tokens = " + std::to_string(s.page_tokens) + ")";
      });
  std::int64_t const end = first + count;
  // A cut inside a quantized KIVI key tile changes the residual: make it on a temporary fork.
  bool untile = false;
  for (int l = 0; l < s.layers; ++l)
    untile =
        untile || detail::plan_truncate(core.key_side(), core.value_side(), core.state(seq, l), end).untile_count > 0;
  sequence_id src = seq;
  struct release_fork {
    core_type* core;
    sequence_id id;
    ~release_fork() {
      if (core != nullptr) core->release(id);
    }
  } guard{nullptr, -1};
  if (untile) {
    src = core.fork(seq, {});
    guard.core = &core;
    guard.id = src;
    core.truncate(src, end, {});
  }
  detail::saved_expect const e =
      detail::make_saved_expect<typename core_type::key_codec, typename core_type::value_codec>(
          s.layers, s.kv_heads, s.head_dim, core.residual(), core.key_options(), core.value_options(), 0);
  detail::vector<detail::layer_state> states;
  for (int l = 0; l < s.layers; ++l)
    states.push_back(detail::plan_truncate(core.key_side(), core.value_side(), core.state(src, l), end).next);
  for (std::size_t l = 0; l < states.size(); ++l) {
    auto const q = detail::quantized_tokens(e.geo, states[l]);
    detail::check<invalid_argument_error>(q.first >= first && q.second >= first, [&] {
      return "export_sequence: layer " + std::to_string(l) + " keeps tokens before " + std::to_string(first) +
             " in its f16 residual; export from token 0";
    });
  }
  detail::saved_header h = detail::saved_header_of(detail::saved_kind::sequence, core, e);
  h.page_tokens = static_cast<std::uint32_t>(s.page_tokens);
  h.first = static_cast<std::uint64_t>(first);
  detail::paged_storage<core_type> const at{core, core.slot_index_of(src), &core.page_table(src)};
  detail::vector<float> means;  // centered keys: the sequence's μ, layer after layer
  if constexpr (centered_codec<typename core_type::key_codec>) {
    std::size_t const per = static_cast<std::size_t>(s.kv_heads) * static_cast<std::size_t>(s.head_dim);
    means.resize(static_cast<std::size_t>(s.layers) * per);
    for (int l = 0; l < s.layers; ++l)
      detail::paged_key_means(cache, seq, l, means.data() + static_cast<std::size_t>(l) * per);
  }
  detail::write_saved_image(
      core, h, e.geo, states, at, [&](int l, bool keys, int hd) { return at.residual(l, keys, hd); },
      [&](std::span<std::byte const> b) { w.write(b); }, means.empty() ? nullptr : means.data());
}

/// Writes the whole sequence `seq` (export_sequence from token 0 to its size).
template <class Paged, byte_writer W>
void export_sequence(Paged& cache, sequence_id seq, W&& w) {
  export_sequence(cache, seq, 0, cache.core().size(seq), w);
}

namespace detail {

/// import_sequence into `seq` (seq < 0: a new sequence) of paged cache `cache`; returns the
/// sequence's id. Centered keys: the image's μ (every layer) becomes the sequence's; appended to a
/// sequence, the image's μ must equal the sequence's where its layer holds tokens.
template <class Paged, class R>
auto import_saved(Paged& cache, sequence_id seq, R& r) -> sequence_id {
  auto& core = cache.core();
  using Core = std::remove_cvref_t<decltype(core)>;
  [[maybe_unused]] operation_scope<Core> const scope;
  core.check_usable();
  if (seq >= 0) core.check_sequence(seq, "import_sequence");
  using device_type = std::remove_cvref_t<decltype(core.device())>;
  auto const& s = core.shape();
  vector<std::byte> buffer;
  std::span<std::byte const> const bytes = read_saved_bytes(r, buffer);
  saved_expect const e = make_saved_expect<typename Core::key_codec, typename Core::value_codec>(
      s.layers, s.kv_heads, s.head_dim, core.residual(), core.key_options(), core.value_options(),
      device_type::max_capacity);
  saved_image const img = parse_saved_image(bytes, e);
  std::int64_t const first = static_cast<std::int64_t>(img.header.first);
  core.check_adopt(seq, first, img.states);
  vector<float> means(img.states.size() * (e.geo.key_means / 4));
  if constexpr (centered_codec<typename Core::key_codec>) {
    std::size_t const per = e.geo.key_means / 4;
    for (std::size_t l = 0; l < img.states.size(); ++l) {
      saved_key_means(img, e.geo, l, means.data() + l * per);
      int const layer = static_cast<int>(l);
      if (seq < 0 || core.size(seq, layer) == 0) continue;
      vector<float> mine(per);
      paged_key_means(cache, seq, layer, mine.data());
      for (std::size_t i = 0; i < per; ++i)
        if (std::bit_cast<std::uint32_t>(mine[i]) != std::bit_cast<std::uint32_t>(means[l * per + i]))
          saved_fail("layer " + std::to_string(l) + ": the saved key means differ from the sequence's");
    }
  }
  sequence_id const id = core.adopt(seq, first, img.states);
  paged_storage<Core> const at{core, core.slot_index_of(id), &core.page_table(id)};
  vector<saved_copy> const all(img.states.size(), saved_copy::copy);
  copy_saved_image(
      core, img, e.geo, at, [&](int l, bool keys, int hd) { return at.residual(l, keys, hd); }, all);
  if constexpr (Core::device_means) {
    std::size_t const per = e.geo.key_means / 4;
    for (std::size_t l = 0; l < img.states.size(); ++l)
      if (core.size(id, static_cast<int>(l)) > 0) core.write_key_means(id, static_cast<int>(l), means.data() + l * per);
  } else if constexpr (centered_codec<typename Core::key_codec>) {
    cache.restore_key_means(id, means.data());
  }
  return id;
}

}  // namespace detail

/// Appends the tokens of an export read from `r` to sequence `seq` of `cache`, which must hold
/// exactly the tokens before the export's first one, all in encoded units. Validates everything
/// first (format_error as load_into; index_error, invalid_argument_error, capacity_error for the
/// sequence and the pool): on any problem nothing changes.
template <class Paged, byte_reader R>
void import_sequence(Paged& cache, sequence_id seq, R&& r) {
  detail::check<index_error>(seq >= 0,
                             [&] { return "import_sequence: sequence " + std::to_string(seq) + " is unknown"; });
  (void)detail::import_saved(cache, seq, r);
}

/// A new sequence of `cache` holding the tokens of an export from token 0 (or of a saved flat
/// cache) read from `r`; validates as import_sequence(cache, seq, r). Returns its id.
template <class Paged, byte_reader R>
auto import_sequence(Paged& cache, R&& r) -> sequence_id {
  return detail::import_saved(cache, -1, r);
}

KVQ_NAMESPACE_END
