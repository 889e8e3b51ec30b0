// kvq-eval: the built-in synthetic KV workload, seeded, with the statistics of real models' caches.
//
// Keys: per-channel scales where a few "outlier" channels are 5–20× larger than the rest (as in
// Llama-family keys), rotated in adjacent pairs by a position-dependent angle (RoPE-like), plus a
// slowly varying per-channel offset. Values: small, per token, without outlier channels.
// Queries: noise plus a few past keys whose logits they raise by a few units (so attention is
// peaked but not one-hot, as in real decoding).
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace kvq_eval {

/// Shape and seed of the synthetic workload.
struct synthetic_shape {
  int layers = 4;
  int kv_heads = 8;
  int q_heads = 32;
  int head_dim = 128;
  std::int64_t context = 4096;
  int queries_per_layer = 4;
  std::uint32_t seed = 20261130;
};

/// One layer's data: keys and values (context, kv_heads, head_dim), queries (queries, q_heads, head_dim).
struct synthetic_layer {
  std::vector<float> keys;
  std::vector<float> values;
  std::vector<float> queries;
};

/// Generates the layer `layer` of the workload (deterministic for a given shape and seed).
inline auto make_synthetic_layer(synthetic_shape const& s, int layer) -> synthetic_layer {
  std::mt19937_64 rng(s.seed + 7919u * static_cast<std::uint32_t>(layer));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  int const d = s.head_dim, h = s.kv_heads;
  std::size_t const n = static_cast<std::size_t>(s.context) * static_cast<std::size_t>(h) * static_cast<std::size_t>(d);
  synthetic_layer out;
  out.keys.resize(n);
  out.values.resize(n);

  // Per (head, channel) scale and offset; about 1 channel in 16 is an outlier, 5–20x larger.
  std::vector<float> scale(static_cast<std::size_t>(h) * static_cast<std::size_t>(d));
  std::vector<float> offset(scale.size());
  for (std::size_t i = 0; i < scale.size(); ++i) {
    bool const outlier = uniform(rng) < 1.0f / 16.0f;
    scale[i] = (outlier ? 5.0f + 15.0f * uniform(rng) : 1.0f) * (0.5f + 0.5f * uniform(rng));
    offset[i] = 0.3f * normal(rng) * scale[i];
  }
  for (std::int64_t t = 0; t < s.context; ++t) {
    for (int kh = 0; kh < h; ++kh) {
      std::size_t const base =
          (static_cast<std::size_t>(t) * static_cast<std::size_t>(h) + static_cast<std::size_t>(kh)) *
          static_cast<std::size_t>(d);
      for (int c = 0; c < d; c += 2) {
        std::size_t const i0 = static_cast<std::size_t>(kh) * static_cast<std::size_t>(d) + static_cast<std::size_t>(c);
        float const a = offset[i0] + scale[i0] * normal(rng);
        float const b = c + 1 < d ? offset[i0 + 1] + scale[i0 + 1] * normal(rng) : 0.0f;
        // Interleaved-pair rotation by pos * 10000^(-c/d), as RoPE does.
        double const angle = static_cast<double>(t) * std::pow(10000.0, -static_cast<double>(c) / d);
        float const cs = static_cast<float>(std::cos(angle)), sn = static_cast<float>(std::sin(angle));
        out.keys[base + static_cast<std::size_t>(c)] = a * cs - b * sn;
        if (c + 1 < d) out.keys[base + static_cast<std::size_t>(c) + 1] = a * sn + b * cs;
      }
      for (int c = 0; c < d; ++c) out.values[base + static_cast<std::size_t>(c)] = 0.25f * normal(rng);
    }
  }
  // Queries: each q head looks mostly at a few past keys of its kv head.
  int const group = s.q_heads / s.kv_heads;
  out.queries.resize(static_cast<std::size_t>(s.queries_per_layer) * static_cast<std::size_t>(s.q_heads) *
                     static_cast<std::size_t>(d));
  std::uniform_int_distribution<std::int64_t> pick(0, s.context - 1);
  for (int qi = 0; qi < s.queries_per_layer; ++qi) {
    for (int qh = 0; qh < s.q_heads; ++qh) {
      int const kh = qh / group;
      float* q = out.queries.data() +
                 (static_cast<std::size_t>(qi) * static_cast<std::size_t>(s.q_heads) + static_cast<std::size_t>(qh)) *
                     static_cast<std::size_t>(d);
      for (int c = 0; c < d; ++c) q[c] = 0.5f * normal(rng);
      for (int j = 0; j < 3; ++j) {
        std::int64_t const t = pick(rng);
        float const* k = out.keys.data() + (static_cast<std::size_t>(t) * static_cast<std::size_t>(h) +
                                            static_cast<std::size_t>(kh)) *
                                               static_cast<std::size_t>(d);
        // Raise this key's logit q·k/sqrt(d) by about 6/(j+1) over the background.
        double norm2 = 0.0;
        for (int c = 0; c < d; ++c) norm2 += static_cast<double>(k[c]) * k[c];
        float const w = static_cast<float>(6.0 * std::sqrt(static_cast<double>(d)) / ((j + 1) * norm2));
        for (int c = 0; c < d; ++c) q[c] += w * k[c];
      }
    }
  }
  return out;
}

}  // namespace kvq_eval
