// The floating-point-flags test: one program, built several times with different floating-point
// flags (-ffp-contract=off, =fast; under clang also -funsafe-math-optimizations, -fno-honor-nans,
// -fno-honor-infinities and -freciprocal-math, which clang 14 does not announce through macros;
// -fno-honor-nans with -fno-honor-infinities is -ffinite-math-only, refused), prints every stored byte, read-back and
// attention output of a fixed workload as hex. The outputs must be identical: kvq's results may not
// depend on the consumer's floating-point flags. The workload holds NaN and ±Inf keys and values,
// values beyond the f16 range and tokens off the tile grid, so the special-value paths run too.
#include <kvq/kvq.hpp>

#include <bit>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

constexpr int kv_heads = 2, head_dim = 80, tokens = 77, q_heads = 6;

// Bits of a deterministic input (integer arithmetic only: the same under every flag).
std::uint32_t input_bits(std::uint32_t i, std::uint32_t salt) {
  std::uint32_t x = (i + salt * 7919u) * 2654435761u;
  x ^= x >> 15;
  x *= 0x2c1b3c6du;
  x ^= x >> 12;
  float const f = static_cast<float>(static_cast<std::int32_t>(x % 8192u) - 4096) / 1024.0f;  // [-4, 4)
  return std::bit_cast<std::uint32_t>(f);
}

std::vector<float> make_input(std::size_t n, std::uint32_t salt) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = std::bit_cast<float>(input_bits(static_cast<std::uint32_t>(i), salt));
  return v;
}

void print_floats(char const* what, std::vector<float> const& v) {
  std::printf("%s", what);
  for (float f : v) std::printf(" %08x", static_cast<unsigned>(std::bit_cast<std::uint32_t>(f)));
  std::printf("\n");
}

template <class Choice>
void run(char const* name, bool specials) {
  std::size_t const n = static_cast<std::size_t>(tokens) * kv_heads * head_dim;
  auto k = make_input(n, 1), v = make_input(n, 2);
  auto const q = make_input(static_cast<std::size_t>(q_heads) * head_dim, 3);
  if (specials) {
    float const inf = std::bit_cast<float>(0x7f800000u), nan = std::bit_cast<float>(0x7fc00000u);
    k[5 * kv_heads * head_dim + 3] = inf;               // token 5, head 0
    k[40 * kv_heads * head_dim + head_dim + 7] = -inf;  // token 40, head 1
    k[60 * kv_heads * head_dim + 1] = nan;              // token 60, head 0
    v[20 * kv_heads * head_dim + 2] = inf;
    v[70 * kv_heads * head_dim + head_dim] = 1e6f;  // beyond f16
  }
  typename kvq::QuantizedKVCache<Choice>::options opt;
  opt.residual = 32;
  kvq::QuantizedKVCache<Choice> cache({1, kv_heads, head_dim, 128}, opt);
  cache.append(0, kvq::token_major(k.data(), 50, kv_heads, head_dim),
               kvq::token_major(v.data(), 50, kv_heads, head_dim));
  cache.append(0, kvq::token_major(k.data() + 50 * kv_heads * head_dim, tokens - 50, kv_heads, head_dim),
               kvq::token_major(v.data() + 50 * kv_heads * head_dim, tokens - 50, kv_heads, head_dim));
  std::printf("== %s%s\n", name, specials ? " (NaN/Inf)" : "");
  std::vector<float> rows(static_cast<std::size_t>(tokens) * head_dim);
  for (int h = 0; h < kv_heads; ++h) {
    cache.read_keys(0, h, 0, tokens, rows.data());
    print_floats("keys", rows);
    cache.read_values(0, h, 0, tokens, rows.data());
    print_floats("values", rows);
  }
  std::vector<float> out(q.size());
  kvq::attention_options a;
  kvq::decode_attention(cache, 0, q.data(), q_heads, out.data(), a);
  print_floats("attention", out);
  a.softcap = 5.0f;
  a.probabilities = kvq::probability_precision::f16;
  a.window = 45;
  kvq::decode_attention(cache, 0, q.data(), q_heads, out.data(), a);
  print_floats("attention softcap f16p window", out);
  a = {};
  a.query = kvq::query_precision::q8_0;
  kvq::decode_attention(cache, 0, q.data(), q_heads, out.data(), a);
  print_floats("attention q8_0 query", out);
  // The scalar reference, split in two ranges and combined.
  auto part = kvq::detail::attend_range_with<kvq::detail::reference_attention>(cache, 0, q.data(), q_heads, 0, 33, {});
  kvq::combine(part, kvq::detail::attend_range_with<kvq::detail::reference_attention>(cache, 0, q.data(), q_heads, 33,
                                                                                      tokens, {}));
  kvq::finalize(part, out.data());
  print_floats("reference split", out);
}

}  // namespace

int main() {
  for (bool specials : {false, true}) {
    run<kvq::f16_codec>("f16", specials);
    run<kvq::f32_codec>("f32", specials);
    run<kvq::kv_codecs<kvq::q8_0, kvq::q4_0>>("q8_0/q4_0", specials);
    run<kvq::int8_sym>("int8", specials);
    run<kvq::fp8_e4m3>("fp8_e4m3", specials);
    run<kvq::kivi<4>>("kivi4", specials);
  }
  return 0;
}
