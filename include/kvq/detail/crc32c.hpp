// kvq: CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, as in iSCSI, ext4 and SSE4.2), the
// checksum of the saved-cache format (docs/formats.md), written here: a portable slicing-by-8
// implementation, and on x86-64 the SSE4.2 instruction over three interleaved streams, chosen at
// run time. Both give the same value for every input.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "config.h"

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#  include <nmmintrin.h>
#  define KVQ_CRC32C_X86 1
#endif

KVQ_NAMESPACE_BEGIN
namespace detail {

inline constexpr std::uint32_t crc32c_polynomial = 0x82F63B78u;

/// The slicing-by-8 tables: t[0] is the byte-wise table, t[k][b] advances t[k-1][b] by a zero byte.
constexpr auto make_crc32c_tables() -> std::array<std::array<std::uint32_t, 256>, 8> {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t c = b;
    for (int i = 0; i < 8; ++i) c = (c >> 1) ^ ((c & 1u) != 0 ? crc32c_polynomial : 0u);
    t[0][b] = c;
  }
  for (std::size_t k = 1; k < 8; ++k)
    for (std::size_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFFu];
  return t;
}
inline constexpr auto crc32c_tables = make_crc32c_tables();

/// Advances the raw CRC register `r` (no pre/post inversion) over `n` bytes at `p`, portably.
inline auto crc32c_raw_portable(std::uint32_t r, unsigned char const* p, std::size_t n) noexcept -> std::uint32_t {
  auto const& t = crc32c_tables;
  for (; n >= 8; n -= 8, p += 8) {
    std::uint32_t const lo = r ^ (static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8 |
                                  static_cast<std::uint32_t>(p[2]) << 16 | static_cast<std::uint32_t>(p[3]) << 24);
    r = t[7][lo & 0xFFu] ^ t[6][(lo >> 8) & 0xFFu] ^ t[5][(lo >> 16) & 0xFFu] ^ t[4][lo >> 24] ^ t[3][p[4]] ^
        t[2][p[5]] ^ t[1][p[6]] ^ t[0][p[7]];
  }
  for (; n > 0; --n, ++p) r = (r >> 8) ^ t[0][(r ^ *p) & 0xFFu];
  return r;
}

#if defined(KVQ_CRC32C_X86)

/// Bytes of each of the three interleaved streams of the SSE4.2 path: long stripes for bulk data,
/// short ones for what remains (runs of a few KiB, such as one page of one kv_head).
inline constexpr std::size_t crc32c_stripe = 4096;
inline constexpr std::size_t crc32c_short_stripe = 256;

/// A linear map "advance the raw register over a stripe of zero bytes", as four byte tables.
struct crc32c_shift {
  std::array<std::array<std::uint32_t, 256>, 4> t{};
  auto operator()(std::uint32_t r) const noexcept -> std::uint32_t {
    return t[0][r & 0xFFu] ^ t[1][(r >> 8) & 0xFFu] ^ t[2][(r >> 16) & 0xFFu] ^ t[3][r >> 24];
  }
};

/// The zero-shift map of a stripe of `bytes` bytes (at most crc32c_stripe).
inline auto make_crc32c_shift(std::size_t bytes) -> crc32c_shift {
  static unsigned char const zeros[crc32c_stripe] = {};
  std::uint32_t basis[32];
  for (int i = 0; i < 32; ++i) basis[i] = crc32c_raw_portable(std::uint32_t{1} << i, zeros, bytes);
  crc32c_shift s;
  for (int k = 0; k < 4; ++k)
    for (std::uint32_t b = 0; b < 256; ++b) {
      std::uint32_t v = 0;
      for (int i = 0; i < 8; ++i)
        if ((b >> i) & 1u) v ^= basis[8 * k + i];
      s.t[static_cast<std::size_t>(k)][b] = v;
    }
  return s;
}

/// Three streams of `Stripe` bytes at a time over the longest prefix of [p, p + n) they cover,
/// joined by the zero-shift map; advances p and n past it.
template <std::size_t Stripe>
__attribute__((target("sse4.2"))) inline auto crc32c_three_streams(std::uint64_t a, unsigned char const*& p,
                                                                   std::size_t& n, crc32c_shift const& shift) noexcept
    -> std::uint64_t {
  while (n >= 3 * Stripe) {
    std::uint64_t b = 0, c = 0;
    for (std::size_t i = 0; i < Stripe; i += 8) {
      std::uint64_t x, y, z;
      std::memcpy(&x, p + i, 8);
      std::memcpy(&y, p + Stripe + i, 8);
      std::memcpy(&z, p + 2 * Stripe + i, 8);
      a = _mm_crc32_u64(a, x);
      b = _mm_crc32_u64(b, y);
      c = _mm_crc32_u64(c, z);
    }
    std::uint32_t const ab = shift(static_cast<std::uint32_t>(a)) ^ static_cast<std::uint32_t>(b);
    a = shift(ab) ^ static_cast<std::uint32_t>(c);
    p += 3 * Stripe;
    n -= 3 * Stripe;
  }
  return a;
}

/// The SSE4.2 path: long stripes, then short ones, then one stream.
__attribute__((target("sse4.2"))) inline auto crc32c_raw_sse42(std::uint32_t r, unsigned char const* p,
                                                               std::size_t n) noexcept -> std::uint32_t {
  static crc32c_shift const long_shift = make_crc32c_shift(crc32c_stripe);
  static crc32c_shift const short_shift = make_crc32c_shift(crc32c_short_stripe);
  std::uint64_t a = crc32c_three_streams<crc32c_stripe>(r, p, n, long_shift);
  a = crc32c_three_streams<crc32c_short_stripe>(a, p, n, short_shift);
  for (; n >= 8; n -= 8, p += 8) {
    std::uint64_t x;
    std::memcpy(&x, p, 8);
    a = _mm_crc32_u64(a, x);
  }
  std::uint32_t s = static_cast<std::uint32_t>(a);
  for (; n > 0; --n, ++p) s = _mm_crc32_u8(s, *p);
  return s;
}

inline auto crc32c_has_sse42() noexcept -> bool {
  static bool const yes = __builtin_cpu_supports("sse4.2") != 0;
  return yes;
}

#endif

/// Streaming CRC-32C: update() with any split of the input gives the checksum of the concatenation.
class crc32c {
 public:
  /// Adds `bytes` to the input.
  void update(std::span<std::byte const> bytes) noexcept {
    auto const* p = reinterpret_cast<unsigned char const*>(bytes.data());
#if defined(KVQ_CRC32C_X86)
    if (std::endian::native == std::endian::little && crc32c_has_sse42()) {
      raw_ = crc32c_raw_sse42(raw_, p, bytes.size());
      return;
    }
#endif
    raw_ = crc32c_raw_portable(raw_, p, bytes.size());
  }
  /// The checksum of everything added so far.
  auto value() const noexcept -> std::uint32_t { return ~raw_; }

  /// CRC-32C of `bytes`.
  static auto of(std::span<std::byte const> bytes) noexcept -> std::uint32_t {
    crc32c c;
    c.update(bytes);
    return c.value();
  }
  /// CRC-32C of `bytes` by the portable implementation alone (tests compare both paths).
  static auto portable(std::span<std::byte const> bytes) noexcept -> std::uint32_t {
    return ~crc32c_raw_portable(~0u, reinterpret_cast<unsigned char const*>(bytes.data()), bytes.size());
  }

 private:
  std::uint32_t raw_ = ~0u;
};

}  // namespace detail
KVQ_NAMESPACE_END
