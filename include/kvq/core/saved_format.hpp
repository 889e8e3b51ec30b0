// kvq: the saved-cache format (docs/formats.md), for every backend: the header and its codec
// fingerprint, the per-layer sections, the directory of section checksums, the validation of a
// saved image before anything is changed, and the writer and reader of images over a cache core's
// storage (flat caches and paged sequences alike).
//
// File layout (all integers little-endian, every section 64-byte aligned):
//   [0, 256)            header: magic, version, endian marker, kind, sizes, shape, token range,
//                       the key and value codec fingerprints, the header's CRC-32C
//   [256, directory)    one section per layer: a 64-byte record (the layer's token counts), then
//                       for each kv_head the key units, for each kv_head the f16 key residual
//                       (KIVI), for each kv_head the value units, for each kv_head the f16 value
//                       window (KIVI, R > 0); every array padded with zeros to 64 bytes
//   [directory, end)    one 32-byte entry per section (offset, bytes, CRC-32C), zero padding to
//                       64 bytes, and a 64-byte trailer whose last word but one is the CRC-32C of
//                       the header and of the directory and trailer before it
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "../codec/centered.hpp"
#include "../detail/crc32c.hpp"
#include "../detail/host_vector.hpp"
#include "../error.hpp"
#include "cache_core.hpp"

KVQ_NAMESPACE_BEGIN
namespace detail {

inline constexpr char saved_magic[8] = {'K', 'V', 'Q', 'C', 'A', 'C', 'H', 'E'};
inline constexpr char saved_end_magic[8] = {'K', 'V', 'Q', 'E', 'N', 'D', '\0', '\0'};
inline constexpr std::uint32_t saved_version = 1;
inline constexpr std::uint32_t saved_endian_marker = 0x01020304u;
inline constexpr std::size_t saved_header_bytes = 256;
inline constexpr std::size_t saved_record_bytes = 64;
inline constexpr std::size_t saved_entry_bytes = 32;
inline constexpr std::size_t saved_trailer_bytes = 64;
inline constexpr std::size_t saved_codec_bytes = 48;
/// Bytes hashed and written at a time (three CRC stripes: the chunk is still in cache when copied).
inline constexpr std::size_t saved_chunk = 12288;

/// What a saved image holds: a flat cache, or a token range of one paged sequence.
enum class saved_kind : std::uint32_t { cache = 1, sequence = 2 };

inline void put_u32(std::byte* p, std::uint32_t v) noexcept {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xFFu);
}
inline void put_u64(std::byte* p, std::uint64_t v) noexcept {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xFFu);
}
inline auto get_u32(std::byte const* p) noexcept -> std::uint32_t {
  std::uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<std::uint32_t>(p[i]);
  return v;
}
inline auto get_u64(std::byte const* p) noexcept -> std::uint64_t {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<std::uint64_t>(p[i]);
  return v;
}

/// The fingerprint of a codec as used by a cache (48 bytes in the header): what decides whether
/// saved bytes mean the same thing to a destination.
struct saved_codec {
  char name[16] = {};
  std::uint32_t bits = 0;           ///< KIVI bits, else 0
  std::uint32_t group = 0;          ///< KIVI group G, else 0
  std::uint32_t unit_bytes = 0;     ///< bytes of one encoded row or tile
  std::uint32_t unit_tokens = 1;    ///< tokens per unit (G for KIVI keys)
  std::uint32_t residual_rows = 0;  ///< f16 rows of the KIVI key residual (F) or value window (R)
  float scale = 1.0f;               ///< fp8 / fp4 scale, else 1
  std::uint32_t overflow = 0;       ///< fp8 overflow mode (0 saturate, 1 no_saturate), else 0
  std::uint32_t reserved = 0;       ///< rotation seed of a rotated codec, else 0
  friend auto operator==(saved_codec const& a, saved_codec const& b) noexcept -> bool {
    return std::memcmp(a.name, b.name, sizeof a.name) == 0 && a.bits == b.bits && a.group == b.group &&
           a.unit_bytes == b.unit_bytes && a.unit_tokens == b.unit_tokens && a.residual_rows == b.residual_rows &&
           std::bit_cast<std::uint32_t>(a.scale) == std::bit_cast<std::uint32_t>(b.scale) && a.overflow == b.overflow &&
           a.reserved == b.reserved;
  }
};

/// The fingerprint of codec C with parameters `p` on the side described by `side`.
template <codec C>
auto make_saved_codec(cache_side const& side, typename C::params_type const& p) -> saved_codec {
  saved_codec c;
  std::string_view const n = C::name;
  std::memcpy(c.name, n.data(), std::min(n.size(), sizeof c.name - 1));
  if constexpr (requires { C::bits; }) c.bits = static_cast<std::uint32_t>(C::bits);
  if constexpr (requires { C::group; }) c.group = static_cast<std::uint32_t>(C::group);
  c.unit_bytes = side.region.unit_bytes;
  c.unit_tokens = side.tiles ? static_cast<std::uint32_t>(side.region.group) : 1u;
  c.residual_rows = side.tiles || side.window ? static_cast<std::uint32_t>(side.residual) : 0u;
  if constexpr (rotated_codec<C>) c.reserved = static_cast<std::uint32_t>(C::rotation_seed);
  if constexpr (std::is_same_v<typename C::params_type, fp8_params>) {
    c.scale = p.scale;
    c.overflow = p.overflow == fp8_overflow::saturate ? 0u : 1u;
  } else if constexpr (std::is_same_v<typename C::params_type, fp4_params>) {
    c.scale = p.scale;
  } else {
    (void)p;
  }
  return c;
}

/// The parameters of codec C that fingerprint `c` records.
template <codec C>
auto saved_params(saved_codec const& c) -> typename C::params_type {
  typename C::params_type p{};
  if constexpr (std::is_same_v<typename C::params_type, fp8_params>) {
    p.scale = c.scale;
    p.overflow = c.overflow == 0 ? fp8_overflow::saturate : fp8_overflow::no_saturate;
  } else if constexpr (std::is_same_v<typename C::params_type, fp4_params>) {
    p.scale = c.scale;
  } else {
    (void)c;
  }
  return p;
}

/// A codec fingerprint in words, for error messages.
inline auto describe(saved_codec const& c) -> std::string {
  std::string s(c.name, ::strnlen(c.name, sizeof c.name));
  if (c.bits != 0) s += " " + std::to_string(c.bits) + "-bit";
  if (c.group != 0) s += " G=" + std::to_string(c.group);
  s += " (" + std::to_string(c.unit_bytes) + "-byte units of " + std::to_string(c.unit_tokens) + " token" +
       (c.unit_tokens == 1 ? "" : "s");
  if (c.residual_rows != 0) s += ", " + std::to_string(c.residual_rows) + " f16 residual rows";
  if (std::bit_cast<std::uint32_t>(c.scale) != std::bit_cast<std::uint32_t>(1.0f))
    s += ", scale " + format_float(c.scale);
  if (c.overflow != 0) s += ", no_saturate";
  if (c.reserved != 0) s += ", seed " + std::to_string(c.reserved);
  return s + ")";
}

inline void put_codec(std::byte* p, saved_codec const& c) {
  std::memcpy(p, c.name, sizeof c.name);
  put_u32(p + 16, c.bits);
  put_u32(p + 20, c.group);
  put_u32(p + 24, c.unit_bytes);
  put_u32(p + 28, c.unit_tokens);
  put_u32(p + 32, c.residual_rows);
  put_u32(p + 36, std::bit_cast<std::uint32_t>(c.scale));
  put_u32(p + 40, c.overflow);
  put_u32(p + 44, c.reserved);
}
inline auto get_codec(std::byte const* p) -> saved_codec {
  saved_codec c;
  std::memcpy(c.name, p, sizeof c.name);
  c.bits = get_u32(p + 16);
  c.group = get_u32(p + 20);
  c.unit_bytes = get_u32(p + 24);
  c.unit_tokens = get_u32(p + 28);
  c.residual_rows = get_u32(p + 32);
  c.scale = std::bit_cast<float>(get_u32(p + 36));
  c.overflow = get_u32(p + 40);
  c.reserved = get_u32(p + 44);
  return c;
}

/// The header of a saved image.
struct saved_header {
  saved_kind kind = saved_kind::cache;
  std::uint64_t file_bytes = 0;
  std::uint32_t layers = 0;
  std::uint32_t kv_heads = 0;
  std::uint32_t head_dim = 0;
  std::uint32_t page_tokens = 0;  ///< sequences: the exporting pool's page size; caches: 0
  std::uint64_t capacity = 0;     ///< caches: tokens per layer; sequences: 0
  std::uint64_t first = 0;        ///< the first token whose units the sections hold
  std::uint64_t directory = 0;    ///< byte offset of the directory
  std::uint32_t residual = 0;     ///< the KIVI residual option R of the saved cache
  saved_codec key;
  saved_codec value;
};

inline void put_header(std::byte* p, saved_header const& h) {
  std::memset(p, 0, saved_header_bytes);
  std::memcpy(p, saved_magic, 8);
  put_u32(p + 8, saved_version);
  put_u32(p + 12, saved_endian_marker);
  put_u32(p + 16, static_cast<std::uint32_t>(saved_header_bytes));
  put_u32(p + 20, static_cast<std::uint32_t>(h.kind));
  put_u64(p + 24, h.file_bytes);
  put_u32(p + 32, h.layers);
  put_u32(p + 36, h.kv_heads);
  put_u32(p + 40, h.head_dim);
  put_u32(p + 44, h.page_tokens);
  put_u64(p + 48, h.capacity);
  put_u64(p + 56, h.first);
  put_u64(p + 64, h.directory);
  put_u32(p + 72, h.residual);
  put_codec(p + 80, h.key);
  put_codec(p + 128, h.value);
  put_u32(p + 248, crc32c::of(std::span<std::byte const>(p, 248)));
}

/// The token counts of one layer, as a section's 64-byte record holds them.
inline void put_record(std::byte* p, layer_state const& st) {
  std::memset(p, 0, saved_record_bytes);
  put_u64(p, static_cast<std::uint64_t>(st.length));
  put_u64(p + 8, static_cast<std::uint64_t>(st.key_quantized));
  put_u64(p + 16, static_cast<std::uint64_t>(st.value_quantized));
  put_u64(p + 24, static_cast<std::uint64_t>(st.window_tokens));
  put_u64(p + 32, static_cast<std::uint64_t>(st.window_first));
}

/// The geometry of the sections of caches with sides `k` and `v`.
struct saved_geometry {
  int kv_heads = 0;
  int head_dim = 0;
  bool key_tiles = false;
  bool value_kivi = false;
  std::size_t key_unit = 0;
  std::size_t value_unit = 0;
  std::int64_t key_tokens = 1;     ///< tokens per key unit
  std::size_t key_residual = 0;    ///< f16 key residual bytes of one kv_head (KIVI), else 0
  std::size_t value_residual = 0;  ///< f16 value window bytes of one kv_head (KIVI, R > 0), else 0
  std::int64_t key_rows = 0;       ///< F
  std::int64_t value_rows = 0;     ///< R
  std::size_t key_means = 0;       ///< f32 key means of one layer (centered keys: kv_heads × head_dim × 4), else 0
};

inline auto make_saved_geometry(cache_side const& k, cache_side const& v, int kv_heads, int head_dim)
    -> saved_geometry {
  saved_geometry g;
  g.kv_heads = kv_heads;
  g.head_dim = head_dim;
  g.key_tiles = k.tiles;
  g.value_kivi = v.kivi_value;
  g.key_unit = k.region.unit_bytes;
  g.value_unit = v.region.unit_bytes;
  g.key_tokens = k.tiles ? k.region.group : 1;
  std::size_t const row = static_cast<std::size_t>(head_dim) * 2;
  if (k.tiles) {
    g.key_rows = k.residual;
    g.key_residual = static_cast<std::size_t>(k.residual) * row;
  }
  if (v.window) {
    g.value_rows = v.residual;
    g.value_residual = static_cast<std::size_t>(v.residual) * row;
  }
  return g;
}

/// Where the arrays of one layer's section lie, for a layer in state `st` saved from token `first`.
struct saved_section {
  std::int64_t key_u0 = 0, key_u1 = 0;      ///< key units [key_u0, key_u1)
  std::int64_t value_u0 = 0, value_u1 = 0;  ///< value rows [value_u0, value_u1)
  std::size_t key_units = 0;                ///< aligned bytes of one kv_head's key units
  std::size_t key_residual = 0;             ///< aligned bytes of one kv_head's key residual
  std::size_t value_units = 0;
  std::size_t value_residual = 0;
  std::size_t keys_at = saved_record_bytes;  ///< offsets inside the section
  std::size_t key_residual_at = 0;
  std::size_t values_at = 0;
  std::size_t value_residual_at = 0;
  std::size_t bytes = 0;
};

/// Key and value tokens held in encoded units by a layer in state `st` (the rest is f16 residual).
inline auto quantized_tokens(saved_geometry const& g, layer_state const& st) -> std::pair<std::int64_t, std::int64_t> {
  return {g.key_tiles ? st.key_quantized : st.length, g.value_kivi ? st.value_quantized : st.length};
}

/// The section of a (validated) layer state `st` saved from token `first`.
inline auto make_saved_section(saved_geometry const& g, layer_state const& st, std::int64_t first) -> saved_section {
  saved_section s;
  auto const q = quantized_tokens(g, st);
  s.key_u0 = first / g.key_tokens;
  s.key_u1 = q.first / g.key_tokens;
  s.value_u0 = first;
  s.value_u1 = q.second;
  s.keys_at = saved_record_bytes + align_up(g.key_means);  // centered keys: the layer's μ first
  std::size_t const kv = static_cast<std::size_t>(g.kv_heads);
  s.key_units = align_up(static_cast<std::size_t>(s.key_u1 - s.key_u0) * g.key_unit);
  s.key_residual = align_up(g.key_residual);
  s.value_units = align_up(static_cast<std::size_t>(s.value_u1 - s.value_u0) * g.value_unit);
  s.value_residual = align_up(g.value_residual);
  s.key_residual_at = s.keys_at + kv * s.key_units;
  s.values_at = s.key_residual_at + kv * s.key_residual;
  s.value_residual_at = s.values_at + kv * s.value_units;
  s.bytes = s.value_residual_at + kv * s.value_residual;
  return s;
}

/// True when row `r` of the f16 key residual (keys) or value window of a layer in state `st`
/// holds a token: key rows [0, length - key_quantized), the window's ring rows from window_first.
inline auto residual_row_live(saved_geometry const& g, layer_state const& st, bool keys, std::int64_t r) -> bool {
  if (keys) return r < st.length - st.key_quantized;
  std::int64_t const from_first = (r - st.window_first + g.value_rows) % std::max<std::int64_t>(g.value_rows, 1);
  return from_first < st.window_tokens;
}

/// Bytes of the image of layer states `states` saved from token `first`.
inline auto saved_image_bytes(saved_geometry const& g, std::span<layer_state const> states, std::int64_t first)
    -> std::uint64_t {
  std::uint64_t n =
      saved_header_bytes + align_up(std::uint64_t{states.size()} * saved_entry_bytes) + saved_trailer_bytes;
  for (auto const& st : states) n += make_saved_section(g, st, first).bytes;
  return n;
}

/// A saved image's problem in words, raised as format_error.
[[noreturn]] inline void saved_fail(std::string const& what) { raise<format_error>("load: " + what); }

/// Raises format_error unless `st` is a state a layer of geometry `g` can be in, holding at most
/// `max_tokens` tokens, with every token before `first` in encoded units.
inline void check_saved_state(saved_geometry const& g, layer_state const& st, std::int64_t first,
                              std::int64_t max_tokens, std::size_t layer) {
  auto const fail = [&](char const* why) {
    saved_fail("layer " + std::to_string(layer) + " record (length " + std::to_string(st.length) + ", keys quantized " +
               std::to_string(st.key_quantized) + ", values quantized " + std::to_string(st.value_quantized) +
               ", window " + std::to_string(st.window_tokens) + " from " + std::to_string(st.window_first) +
               ") is invalid: " + why);
  };
  if (st.length < 0 || st.length > max_tokens)
    fail(("the length must be in [0, " + std::to_string(max_tokens) + "]").c_str());
  if (g.key_tiles) {
    if (st.key_quantized < 0 || st.key_quantized > st.length || st.key_quantized % g.key_tokens != 0)
      fail("quantized keys must be a multiple of G within the length");
    if (st.length - st.key_quantized >= g.key_rows) fail("the key residual holds more rows than it has");
  } else if (st.key_quantized != 0) {
    fail("only KIVI keys have a quantized count");
  }
  if (g.value_kivi) {
    if (st.value_quantized < 0 || st.window_tokens < 0 || st.value_quantized > st.length ||
        st.window_tokens != st.length - st.value_quantized)
      fail("quantized values and window tokens must add up to the length");
    if (st.window_tokens > g.value_rows) fail("the value window holds more rows than it has");
    if (st.window_first < 0 || st.window_first >= std::max<std::int64_t>(g.value_rows, 1))
      fail("the window's first row is out of range");
  } else if (st.value_quantized != 0 || st.window_tokens != 0 || st.window_first != 0) {
    fail("only KIVI values have a window");
  }
  auto const q = quantized_tokens(g, st);
  if (first > 0 && (q.first < first || q.second < first))
    fail("tokens before the first saved one are not all in encoded units");
}

/// A parsed, fully validated image: its header, and per layer the state and the section.
struct saved_image {
  std::span<std::byte const> bytes;
  saved_header header;
  vector<layer_state> states;
  vector<std::size_t> offsets;  ///< section offsets
  vector<saved_section> sections;
  vector<std::uint32_t> crcs;  ///< the directory's section checksums
};

/// What a destination expects of an image: its shape and codec fingerprints.
struct saved_expect {
  std::uint32_t kv_heads = 0;
  std::uint32_t head_dim = 0;
  std::uint32_t layers = 0;  ///< 0: any (a fresh cache takes the image's)
  saved_codec key;
  saved_codec value;
  saved_geometry geo;
  std::int64_t max_tokens = 0;  ///< tokens a layer may hold (0: the image's capacity)
};

/// What a destination with key codec K and value codec V (these parameters, residual option R)
/// of `kv_heads` x `head_dim` expects of an image; `layers` 0 accepts any layer count.
template <codec K, codec V>
auto make_saved_expect(int layers, int kv_heads, int head_dim, int residual, typename K::params_type const& kp,
                       typename V::params_type const& vp, std::int64_t max_tokens) -> saved_expect {
  int unit = 1;
  if constexpr (K::layout == codec_layout::token_group) unit = K::group;
  cache_shape const one{1, kv_heads, head_dim, unit};
  cache_side const k = make_cache_side<K, false>(one, residual, kp, 0, 0);
  cache_side const v = make_cache_side<V, true>(one, residual, vp, 0, 0);
  saved_expect e;
  e.layers = static_cast<std::uint32_t>(layers);
  e.kv_heads = static_cast<std::uint32_t>(kv_heads);
  e.head_dim = static_cast<std::uint32_t>(head_dim);
  e.key = make_saved_codec<K>(k, kp);
  e.value = make_saved_codec<V>(v, vp);
  e.geo = make_saved_geometry(k, v, kv_heads, head_dim);
  if constexpr (centered_codec<K>)
    e.geo.key_means = static_cast<std::size_t>(kv_heads) * static_cast<std::size_t>(head_dim) * sizeof(float);
  e.max_tokens = max_tokens;
  return e;
}

/// Reads the header of an image of at least saved_header_bytes bytes, checking what the header
/// alone can: magic, version, endianness, size field, checksum, kind and shape limits.
inline auto parse_saved_header(std::span<std::byte const> b) -> saved_header {
  if (b.size() < saved_header_bytes)
    saved_fail("truncated input: " + std::to_string(b.size()) + " bytes, the header alone is " +
               std::to_string(saved_header_bytes));
  std::byte const* p = b.data();
  if (std::memcmp(p, saved_magic, 8) != 0) saved_fail("not a kvq saved cache (bad magic)");
  std::uint32_t const version = get_u32(p + 8);
  if (version != saved_version)
    saved_fail("unknown format version " + std::to_string(version) + " (this kvq reads version " +
               std::to_string(saved_version) + ")");
  if (get_u32(p + 12) != saved_endian_marker) saved_fail("bad endianness marker (the format is little-endian)");
  if (get_u32(p + 16) != saved_header_bytes) saved_fail("bad header size " + std::to_string(get_u32(p + 16)));
  if (get_u32(p + 248) != crc32c::of(b.first(248)) || get_u32(p + 252) != 0) saved_fail("header checksum mismatch");
  saved_header h;
  std::uint32_t const kind = get_u32(p + 20);
  if (kind != 1 && kind != 2) saved_fail("unknown image kind " + std::to_string(kind));
  h.kind = static_cast<saved_kind>(kind);
  h.file_bytes = get_u64(p + 24);
  h.layers = get_u32(p + 32);
  h.kv_heads = get_u32(p + 36);
  h.head_dim = get_u32(p + 40);
  h.page_tokens = get_u32(p + 44);
  h.capacity = get_u64(p + 48);
  h.first = get_u64(p + 56);
  h.directory = get_u64(p + 64);
  h.residual = get_u32(p + 72);
  h.key = get_codec(p + 80);
  h.value = get_codec(p + 128);
  for (std::size_t i = 176; i < 248; ++i)
    if (p[i] != std::byte{0}) saved_fail("non-zero reserved header bytes");
  if (get_u32(p + 76) != 0) saved_fail("non-zero reserved header bytes");
  if (h.layers < 1 || h.layers > (1u << 16) || h.kv_heads < 1 || h.kv_heads > (1u << 16) || h.head_dim < 1 ||
      h.head_dim > 65536)
    saved_fail("shape out of range: " + std::to_string(h.layers) + " layers, " + std::to_string(h.kv_heads) +
               " kv_heads, head_dim " + std::to_string(h.head_dim));
  if (h.capacity > (std::uint64_t{1} << 40) || h.first > (std::uint64_t{1} << 40))
    saved_fail("token counts out of range");
  if (h.kind == saved_kind::cache && (h.first != 0 || h.capacity < 1))
    saved_fail("a saved cache must start at token 0 and have a capacity");
  std::uint64_t const dir_bytes = align_up(std::uint64_t{h.layers} * saved_entry_bytes) + saved_trailer_bytes;
  if (h.directory < saved_header_bytes || h.directory % storage_alignment != 0 || h.file_bytes < h.directory ||
      h.file_bytes - h.directory != dir_bytes)
    saved_fail("inconsistent directory offset " + std::to_string(h.directory) + " and file size " +
               std::to_string(h.file_bytes));
  return h;
}

/// Parses and validates a whole image `b` (exactly header.file_bytes bytes) for a destination
/// expecting `e`: fingerprints, shape, directory, every record and every checksum (the sections'
/// ones only with `check_sections`; else copy_saved_image checks them while it copies).
inline auto parse_saved_image(std::span<std::byte const> b, saved_expect const& e, bool check_sections = true)
    -> saved_image {
  saved_image img;
  img.header = parse_saved_header(b);
  saved_header const& h = img.header;
  if (b.size() != h.file_bytes)
    saved_fail("the input holds " + std::to_string(b.size()) + " bytes, the header says " +
               std::to_string(h.file_bytes) + (b.size() < h.file_bytes ? " (truncated)" : ""));
  if (!(h.key == e.key) || !(h.value == e.value))
    saved_fail("the saved codecs (keys " + describe(h.key) + ", values " + describe(h.value) +
               ") do not match the destination's (keys " + describe(e.key) + ", values " + describe(e.value) + ")");
  if (h.head_dim != e.head_dim || h.kv_heads != e.kv_heads || (e.layers != 0 && h.layers != e.layers))
    saved_fail("the saved shape (" + std::to_string(h.layers) + " layers, " + std::to_string(h.kv_heads) +
               " kv_heads, head_dim " + std::to_string(h.head_dim) + ") does not match the destination's (" +
               (e.layers != 0 ? std::to_string(e.layers) : std::string("any")) + " layers, " +
               std::to_string(e.kv_heads) + " kv_heads, head_dim " + std::to_string(e.head_dim) + ")");
  // Directory and file checksum: the header, then the directory and trailer up to the checksum.
  std::byte const* dir = b.data() + h.directory;
  std::byte const* trailer = b.data() + h.file_bytes - saved_trailer_bytes;
  crc32c file_crc;
  file_crc.update(b.first(saved_header_bytes));
  file_crc.update(b.subspan(h.directory, h.file_bytes - h.directory - 8));
  if (std::memcmp(trailer, saved_end_magic, 8) != 0 || get_u32(trailer + 8) != h.layers ||
      get_u32(trailer + 56) != file_crc.value())
    saved_fail("file checksum mismatch (directory or trailer damaged)");
  for (std::byte const* q = dir + std::size_t{h.layers} * saved_entry_bytes; q < trailer; ++q)
    if (*q != std::byte{0}) saved_fail("non-zero directory padding");
  for (std::size_t i = 12; i < 56; ++i)
    if (trailer[i] != std::byte{0}) saved_fail("non-zero trailer padding");
  if (get_u32(trailer + 60) != 0) saved_fail("non-zero trailer padding");

  saved_geometry const& g = e.geo;
  std::int64_t const max_tokens =
      e.max_tokens > 0 ? e.max_tokens : static_cast<std::int64_t>(h.kind == saved_kind::cache ? h.capacity : 0);
  std::int64_t const first = static_cast<std::int64_t>(h.first);
  if (g.key_tokens < 1 || first % g.key_tokens != 0)
    saved_fail("the first saved token " + std::to_string(first) + " is not on a key unit boundary");

  std::uint64_t at = saved_header_bytes;
  img.bytes = b;
  img.states.resize(h.layers);
  img.offsets.resize(h.layers);
  img.sections.resize(h.layers);
  img.crcs.resize(h.layers);
  for (std::size_t l = 0; l < h.layers; ++l) {
    std::byte const* entry = dir + l * saved_entry_bytes;
    std::uint64_t const off = get_u64(entry);
    std::uint64_t const bytes = get_u64(entry + 8);
    if (off != at || bytes < saved_record_bytes || bytes > h.directory - off || bytes % storage_alignment != 0 ||
        get_u32(entry + 20) != 0 || get_u64(entry + 24) != 0)
      saved_fail("directory entry of layer " + std::to_string(l) + " (offset " + std::to_string(off) + ", " +
                 std::to_string(bytes) + " bytes) is out of place");
    std::byte const* rec = b.data() + off;
    layer_state st;
    st.length = static_cast<std::int64_t>(get_u64(rec));
    st.key_quantized = static_cast<std::int64_t>(get_u64(rec + 8));
    st.value_quantized = static_cast<std::int64_t>(get_u64(rec + 16));
    st.window_tokens = static_cast<std::int64_t>(get_u64(rec + 24));
    st.window_first = static_cast<std::int64_t>(get_u64(rec + 32));
    std::uint32_t const crc = get_u32(entry + 16);
    if (check_sections && crc != crc32c::of(b.subspan(off, bytes)))
      saved_fail("section checksum mismatch in layer " + std::to_string(l));
    for (std::size_t i = 40; i < saved_record_bytes; ++i)
      if (rec[i] != std::byte{0}) saved_fail("non-zero record padding in layer " + std::to_string(l));
    check_saved_state(g, st, first, max_tokens, l);
    saved_section const s = make_saved_section(g, st, first);
    if (s.bytes != bytes)
      saved_fail("section of layer " + std::to_string(l) + " has " + std::to_string(bytes) +
                 " bytes, its record needs " + std::to_string(s.bytes));
    // Centered keys: μ finite where the layer holds tokens, zero where it holds none; zero padding.
    for (std::size_t i = 0; i < align_up(g.key_means); i += 4) {
      std::uint32_t const bits = get_u32(rec + saved_record_bytes + i);
      bool const ok = i >= g.key_means || st.length == 0 ? bits == 0 : (bits & 0x7f800000u) != 0x7f800000u;
      if (!ok)
        saved_fail("layer " + std::to_string(l) + ": a key mean is " +
                   (i >= g.key_means ? "padding, not zero"
                    : st.length == 0 ? "set in an empty layer"
                                     : "not finite"));
    }
    std::size_t const row = static_cast<std::size_t>(g.head_dim) * 2;
    for (int side = 0; side < 2; ++side) {
      bool const keys = side == 0;
      std::int64_t const n = keys ? g.key_rows : g.value_rows;
      std::size_t const rows_at = keys ? s.key_residual_at : s.value_residual_at;
      std::size_t const stride = keys ? s.key_residual : s.value_residual;
      for (std::int64_t r = 0; r < n; ++r) {
        if (residual_row_live(g, st, keys, r)) continue;
        for (int hd = 0; hd < g.kv_heads; ++hd) {
          std::byte const* q =
              rec + rows_at + static_cast<std::size_t>(hd) * stride + static_cast<std::size_t>(r) * row;
          for (std::size_t i = 0; i < row; ++i)
            if (q[i] != std::byte{0})
              saved_fail("layer " + std::to_string(l) + ": an unused " + (keys ? "key residual" : "value window") +
                         " row is not zero");
        }
      }
    }
    img.states[l] = st;
    img.crcs[l] = crc;
    img.offsets[l] = static_cast<std::size_t>(off);
    img.sections[l] = s;
    at += bytes;
  }
  if (at != h.directory)
    saved_fail("sections end at " + std::to_string(at) + ", the directory starts at " + std::to_string(h.directory));
  return img;
}

/// Writes bytes to `write` while computing their CRC-32C, `saved_chunk` bytes at a time.
template <class Write>
struct saved_emitter {
  Write& write;
  crc32c crc;
  std::uint64_t written = 0;
  void operator()(std::span<std::byte const> b) {
    for (std::size_t i = 0; i < b.size(); i += saved_chunk) {
      auto const c = b.subspan(i, std::min(saved_chunk, b.size() - i));
      crc.update(c);
      write(c);
    }
    written += b.size();
  }
  void zeros(std::size_t n) {
    static constexpr std::byte z[storage_alignment] = {};
    while (n > 0) {
      std::size_t const w = std::min(n, sizeof z);
      (*this)(std::span<std::byte const>(z, w));
      n -= w;
    }
  }
};

/// What an operation on a core of device type Device holds while it runs: the device's
/// `operation_scope` where it has one (Metal: an autorelease pool), else nothing.
template <class Device>
struct operation_scope_of {
  struct type {};
};
template <class Device>
requires requires { typename Device::operation_scope; }
struct operation_scope_of<Device> {
  using type = typename Device::operation_scope;
};
template <class Core>
using operation_scope =
    typename operation_scope_of<std::remove_cvref_t<decltype(std::declval<Core&>().device())>>::type;

/// Copies `bytes` bytes at `offset` of device allocation `a` to the host and hands them to `emit`:
/// in place where the device's memory is the host's, through `stage` otherwise.
template <class Core, class Emit>
void read_device_bytes(Core& core, typename Core::layer_type a, std::size_t offset, std::size_t bytes,
                       vector<std::byte>& stage, Emit&& emit) {
  using Device = std::remove_reference_t<decltype(core.device())>;
  auto& dev = core.device();
  if (bytes == 0) return;
  if constexpr (Device::host_memory) {
    emit(std::span<std::byte const>(dev.address(a) + offset, bytes));
  } else {
    constexpr std::size_t chunk = std::size_t{1} << 20;
    if (stage.size() < std::min(bytes, chunk)) stage.resize(std::min(bytes, chunk));
    for (std::size_t i = 0; i < bytes; i += chunk) {
      std::size_t const w = std::min(chunk, bytes - i);
      core.succeed(dev.copy_out(a, offset + i, stage.data(), w));
      emit(std::span<std::byte const>(stage.data(), w));
    }
  }
}

/// Where the bytes of a layer live on a device: the callbacks below run over a flat cache's
/// layer or a paged sequence's pages and residual slot.
///   units(l, keys, h, u0, u1, fn): calls fn(allocation, offset, bytes) for contiguous runs of
///     units [u0, u1) of (layer l, keys or values, kv_head h), in order;
///   residual(l, keys, h) -> (allocation, offset) of the f16 residual rows of (l, side, h).
/// write_saved_image writes a whole image of the layers' states `states` from token `first`.
template <class Core, class Units, class Residual, class Write>
void write_saved_image(Core& core, saved_header h, saved_geometry const& g, std::span<layer_state const> states,
                       Units&& units, Residual&& residual, Write&& write, float const* key_means = nullptr) {
  std::size_t const layers = states.size();
  std::int64_t const first = static_cast<std::int64_t>(h.first);
  vector<saved_section> sections(layers);
  std::uint64_t at = saved_header_bytes;
  for (std::size_t l = 0; l < layers; ++l) {
    sections[l] = make_saved_section(g, states[l], first);
    at += sections[l].bytes;
  }
  h.directory = at;
  h.file_bytes = at + align_up(std::uint64_t{layers} * saved_entry_bytes) + saved_trailer_bytes;
  std::array<std::byte, saved_header_bytes> head{};
  put_header(head.data(), h);
  crc32c file_crc;
  file_crc.update(head);
  write(std::span<std::byte const>(head));

  vector<std::byte> dir(static_cast<std::size_t>(h.file_bytes - h.directory), std::byte{0});
  vector<std::byte> stage;
  std::uint64_t off = saved_header_bytes;
  for (std::size_t l = 0; l < layers; ++l) {
    saved_section const& s = sections[l];
    saved_emitter<std::remove_reference_t<Write>> out{write, {}, 0};
    std::array<std::byte, saved_record_bytes> rec{};
    put_record(rec.data(), states[l]);
    out(rec);
    if (g.key_means > 0) {  // centered keys: the layer's μ (zeros for an empty layer), padded
      vector<std::byte> mu(align_up(g.key_means), std::byte{0});
      if (states[l].length > 0)
        for (std::size_t i = 0; i < g.key_means / 4; ++i)
          put_u32(mu.data() + 4 * i, std::bit_cast<std::uint32_t>(key_means[l * (g.key_means / 4) + i]));
      out(mu);
    }
    auto const side = [&](bool keys, std::int64_t u0, std::int64_t u1, std::size_t unit, std::size_t aligned) {
      for (int hd = 0; hd < g.kv_heads; ++hd) {
        units(static_cast<int>(l), keys, hd, u0, u1, [&](auto alloc, std::size_t o, std::size_t bytes) {
          read_device_bytes(core, alloc, o, bytes, stage, out);
        });
        out.zeros(aligned - static_cast<std::size_t>(u1 - u0) * unit);
      }
    };
    auto const rows = [&](bool keys, std::size_t raw, std::size_t aligned) {
      if (raw == 0) return;
      std::size_t const row = static_cast<std::size_t>(g.head_dim) * 2;
      std::int64_t const n = keys ? g.key_rows : g.value_rows;
      for (int hd = 0; hd < g.kv_heads; ++hd) {
        auto const where = residual(static_cast<int>(l), keys, hd);
        // Live rows as they are, the others as zeros (they may hold tokens of an earlier use).
        for (std::int64_t r = 0; r < n;) {
          bool const live = residual_row_live(g, states[l], keys, r);
          std::int64_t e = r + 1;
          while (e < n && residual_row_live(g, states[l], keys, e) == live) ++e;
          std::size_t const bytes = static_cast<std::size_t>(e - r) * row;
          if (live) {
            read_device_bytes(core, where.first, where.second + static_cast<std::size_t>(r) * row, bytes, stage, out);
          } else {
            out.zeros(bytes);
          }
          r = e;
        }
        out.zeros(aligned - raw);
      }
    };
    side(true, s.key_u0, s.key_u1, g.key_unit, s.key_units);
    rows(true, g.key_residual, s.key_residual);
    side(false, s.value_u0, s.value_u1, g.value_unit, s.value_units);
    rows(false, g.value_residual, s.value_residual);
    std::byte* e = dir.data() + l * saved_entry_bytes;
    put_u64(e, off);
    put_u64(e + 8, s.bytes);
    put_u32(e + 16, out.crc.value());
    off += s.bytes;
  }
  std::byte* trailer = dir.data() + dir.size() - saved_trailer_bytes;
  std::memcpy(trailer, saved_end_magic, 8);
  put_u32(trailer + 8, static_cast<std::uint32_t>(layers));
  file_crc.update(std::span<std::byte const>(dir.data(), dir.size() - 8));
  put_u32(trailer + 56, file_crc.value());
  write(std::span<std::byte const>(dir.data(), dir.size()));
}

/// The key means of layer `l` of a validated image of centered keys: g.key_means / 4 floats into `out`.
inline void saved_key_means(saved_image const& img, saved_geometry const& g, std::size_t l, float* out) {
  std::byte const* p = img.bytes.data() + img.offsets[l] + saved_record_bytes;
  for (std::size_t i = 0; i < g.key_means / 4; ++i) out[i] = std::bit_cast<float>(get_u32(p + 4 * i));
}

/// Raises format_error unless the section of `layer` of an image parsed without its section
/// checksums has the directory's checksum.
inline void check_saved_section(saved_image const& img, std::size_t layer) {
  if (crc32c::of(img.bytes.subspan(img.offsets[layer], img.sections[layer].bytes)) != img.crcs[layer])
    saved_fail("section checksum mismatch in layer " + std::to_string(layer));
}

/// How copy_saved_image treats one layer's section.
enum class saved_copy : unsigned char {
  skip,    ///< not copied
  copy,    ///< copied (its checksum was checked before)
  verify,  ///< copied while its checksum is computed, saved_chunk bytes at a time; a mismatch raises
           ///< format_error, so only for storage that holds nothing live
};

/// Copies the arrays of the sections of a validated image into the storage of `core`, located by
/// `units` and `residual` as for write_saved_image, each layer as `modes[layer]` says.
template <class Core, class Units, class Residual>
void copy_saved_image(Core& core, saved_image const& img, saved_geometry const& g, Units&& units, Residual&& residual,
                      std::span<saved_copy const> modes) {
  for (std::size_t l = 0; l < img.states.size(); ++l) {
    if (modes[l] == saved_copy::skip) continue;
    bool const verify = modes[l] == saved_copy::verify;
    saved_section const& s = img.sections[l];
    std::byte const* base = img.bytes.data() + img.offsets[l];
    crc32c crc;
    std::byte const* hashed = base;  // verify: the section's bytes before this are in `crc`
    auto const absorb = [&](std::byte const* end) {
      if (end > hashed) crc.update(std::span<std::byte const>(hashed, static_cast<std::size_t>(end - hashed)));
      hashed = std::max(hashed, end);
    };
    auto const put = [&](typename Core::layer_type a, std::size_t o, std::byte const* src, std::size_t bytes) {
      if (bytes == 0) return;
      if (!verify) {
        core.succeed(core.device().copy_in(a, o, src, bytes));
        return;
      }
      absorb(src);
      for (std::size_t i = 0; i < bytes; i += saved_chunk) {
        std::size_t const w = std::min(saved_chunk, bytes - i);
        absorb(src + i + w);
        core.succeed(core.device().copy_in(a, o + i, src + i, w));
      }
    };
    auto const side = [&](bool keys, std::int64_t u0, std::int64_t u1, std::size_t aligned, std::size_t at) {
      for (int hd = 0; hd < g.kv_heads; ++hd) {
        std::byte const* src = base + at + static_cast<std::size_t>(hd) * aligned;
        units(static_cast<int>(l), keys, hd, u0, u1, [&](auto alloc, std::size_t o, std::size_t bytes) {
          put(alloc, o, src, bytes);
          src += bytes;
        });
      }
    };
    auto const rows = [&](bool keys, std::size_t raw, std::size_t aligned, std::size_t at) {
      if (raw == 0) return;
      for (int hd = 0; hd < g.kv_heads; ++hd) {
        auto const where = residual(static_cast<int>(l), keys, hd);
        put(where.first, where.second, base + at + static_cast<std::size_t>(hd) * aligned, raw);
      }
    };
    side(true, s.key_u0, s.key_u1, s.key_units, s.keys_at);
    rows(true, g.key_residual, s.key_residual, s.key_residual_at);
    side(false, s.value_u0, s.value_u1, s.value_units, s.values_at);
    rows(false, g.value_residual, s.value_residual, s.value_residual_at);
    if (verify) {
      absorb(base + s.bytes);
      if (crc.value() != img.crcs[l]) saved_fail("section checksum mismatch in layer " + std::to_string(l));
    }
  }
}

}  // namespace detail
KVQ_NAMESPACE_END
