// Tests of the paged cache (paged_cache.hpp, core/paged_core.hpp) and its batched attention
// (paged_attention.hpp): a continuous-batching simulation against flat caches fed the same tokens
// (bytes, reads and attention), copy-on-write, reference counts, the engine-facing views, the
// budget helper, and misuse with typed errors and nothing changed.
#include <kvq/attention.hpp>
#include <kvq/cache.hpp>
#include <kvq/codec/fp4.hpp>
#include <kvq/codec/fp8.hpp>
#include <kvq/codec/int8.hpp>
#include <kvq/codec/kivi.hpp>
#include <kvq/codec/passthrough.hpp>
#include <kvq/codec/q4_0.hpp>
#include <kvq/codec/q8_0.hpp>
#include <kvq/codec/rotated.hpp>
#include <kvq/codec/tq.hpp>
#include <kvq/paged_attention.hpp>
#include <kvq/paged_cache.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <tuple>
#include <vector>

#include "catch_compat.hpp"
#include "test_support.hpp"

namespace {

using q8k_q4v = kvq::kv_codecs<kvq::q8_0, kvq::q4_0>;
using int8k_kivi4v = kvq::kv_codecs<kvq::int8_sym, kvq::kivi_value<4>>;
using rot_kivi4 = kvq::kv_codecs<kvq::rotated<kvq::kivi_key<4>>, kvq::rotated<kvq::kivi_value<4>>>;
using all_choices = std::tuple<kvq::f32_codec, kvq::f16_codec, kvq::q8_0, kvq::q4_0, kvq::int8_sym, kvq::fp8_e4m3,
                               kvq::fp8_e5m2, kvq::mxfp4, kvq::nvfp4, q8k_q4v, int8k_kivi4v, kvq::kivi<2>, kvq::kivi<4>,
                               kvq::kivi<8, 16>, kvq::rotated<kvq::q4_0>, rot_kivi4, kvq::tq4>;

template <class Choice>
constexpr bool uses_residual = kvq::detail::has_value_window<typename kvq::codec_pair<Choice>::value>::value ||
                               kvq::codec_pair<Choice>::key::layout == kvq::codec_layout::token_group;

constexpr int layers = 2;
constexpr int kv_heads = 2;
constexpr int head_dim = 64;
constexpr int page_tokens = 32;
constexpr int q_heads = 4;

/// Tokens of one sequence: keys and values (tokens, kv_heads, head_dim), token-major.
struct tokens {
  std::vector<float> k, v;
  auto count() const -> std::int64_t { return static_cast<std::int64_t>(k.size()) / (kv_heads * head_dim); }
};

auto random_tokens(std::mt19937& rng, std::int64_t n) -> tokens {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  tokens t;
  t.k.resize(static_cast<std::size_t>(n) * kv_heads * head_dim);
  t.v.resize(t.k.size());
  for (auto& x : t.k) x = nd(rng);
  for (auto& x : t.v) x = nd(rng);
  // An outlier channel, as real keys have.
  for (std::int64_t i = 0; i < n * kv_heads; ++i) t.k[static_cast<std::size_t>(i) * head_dim + 3] *= 8.0f;
  return t;
}

/// A paged cache and, per sequence, a flat cache fed the same tokens.
template <class Choice>
struct twin {
  using paged_t = kvq::PagedKVCache<Choice>;
  using flat_t = kvq::QuantizedKVCache<Choice>;
  struct seq {
    kvq::sequence_id id = -1;
    std::unique_ptr<flat_t> flat;
    std::int64_t target = 0;
    std::int64_t shared = 0;  // tokens shared with the root at fork
  };
  int residual;
  paged_t paged;
  std::int64_t flat_capacity;
  explicit twin(int r, std::int64_t pages, int max_sequences, std::int64_t capacity)
      : residual(r),
        paged(kvq::paged_shape{layers, kv_heads, head_dim, page_tokens, pages, max_sequences},
              typename paged_t::options{r}),
        flat_capacity(capacity) {}

  auto make_flat() const -> std::unique_ptr<flat_t> {
    return std::make_unique<flat_t>(kvq::cache_shape{layers, kv_heads, head_dim, flat_capacity},
                                    typename flat_t::options{residual});
  }

  void append(seq& s, tokens const& t, int layer) {
    auto const n = t.count();
    paged.append(s.id, layer, kvq::token_major(t.k.data(), n, kv_heads, head_dim),
                 kvq::token_major(t.v.data(), n, kv_heads, head_dim));
    s.flat->append(layer, kvq::token_major(t.k.data(), n, kv_heads, head_dim),
                   kvq::token_major(t.v.data(), n, kv_heads, head_dim));
  }
  void append_all(seq& s, tokens const& t) {
    for (int l = 0; l < layers; ++l) append(s, t, l);
  }
};

/// The live bytes of (layer, head) of a paged sequence equal the flat cache's: every quantized unit
/// and every residual row holding a token.
template <class Choice>
void require_same_bytes(kvq::PagedKVCache<Choice> const& paged, kvq::sequence_id id,
                        kvq::QuantizedKVCache<Choice> const& flat) {
  for (int l = 0; l < layers; ++l)
    for (int h = 0; h < kv_heads; ++h)
      for (bool keys : {true, false}) {
        kvq::paged_storage_view const p = keys ? paged.key_storage(id, l, h) : paged.value_storage(id, l, h);
        kvq::storage_view const f = keys ? flat.key_storage(l, h) : flat.value_storage(l, h);
        INFO("layer " << l << " head " << h << (keys ? " keys" : " values"));
        REQUIRE(p.quantized_tokens == f.quantized_tokens);
        REQUIRE(p.unit_bytes == f.unit_bytes);
        std::int64_t first_diff = -1;
        for (std::int64_t t = 0; t < p.quantized_tokens && first_diff < 0; t += p.tokens_per_unit) {
          auto const page = p.pages[static_cast<std::size_t>(t / p.page_tokens)];
          std::byte const* pu = p.pool + static_cast<std::size_t>(page) * p.page_bytes + p.head_offset +
                                static_cast<std::size_t>((t % p.page_tokens) / p.tokens_per_unit) * p.unit_bytes;
          std::byte const* fu = f.units + static_cast<std::size_t>(t / f.tokens_per_unit) * f.unit_bytes;
          if (std::memcmp(pu, fu, p.unit_bytes) != 0) first_diff = t;
        }
        REQUIRE(first_diff == -1);
        REQUIRE(p.residual_capacity == f.residual_capacity);
        REQUIRE(p.residual_first == f.residual_first);
        std::int64_t const rows = p.length - p.quantized_tokens;
        for (std::int64_t i = 0; i < rows && first_diff < 0; ++i) {
          std::int64_t const row = (p.residual_first + i) % std::max<std::int64_t>(p.residual_capacity, 1);
          if (std::memcmp(p.residual + row * head_dim, f.residual + row * head_dim, head_dim * 2) != 0) first_diff = i;
        }
        REQUIRE(first_diff == -1);
      }
}

/// True when a and b hold the same values bit for bit (NaN as NaN).
auto same_values(std::vector<float> const& a, std::vector<float> const& b) -> bool {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!kvq_test::same_value(a[i], b[i])) return false;
  return true;
}

/// Reads of every token of a paged sequence equal the flat cache's, bit for bit.
template <class Choice>
void require_same_reads(kvq::PagedKVCache<Choice> const& paged, kvq::sequence_id id,
                        kvq::QuantizedKVCache<Choice> const& flat) {
  for (int l = 0; l < layers; ++l) {
    std::int64_t const n = flat.size(l);
    REQUIRE(paged.size(id, l) == n);
    std::vector<float> a(static_cast<std::size_t>(n) * head_dim), b(a.size());
    for (int h = 0; h < kv_heads; ++h) {
      paged.read_keys(id, l, h, 0, n, a.data());
      flat.read_keys(l, h, 0, n, b.data());
      REQUIRE(same_values(a, b));
      paged.read_values(id, l, h, 0, n, a.data());
      flat.read_values(l, h, 0, n, b.data());
      REQUIRE(same_values(a, b));
    }
  }
}

/// |a - b| <= tol * max(1, max |b|) elementwise.
void require_close(std::vector<float> const& a, std::vector<float> const& b, double tol) {
  REQUIRE(a.size() == b.size());
  double scale = 1.0;
  for (float x : b) scale = std::max(scale, static_cast<double>(std::fabs(x)));
  double worst = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  INFO("max difference " << worst << " against scale " << scale);
  REQUIRE(worst <= tol * scale);
}

/// Batched paged attention over `ids` equals each flat cache's decode_attention within 1e-6.
template <class Choice>
void require_same_attention(twin<Choice>& tw, std::vector<typename twin<Choice>::seq*> const& live, std::mt19937& rng,
                            kvq::attention_options const& opt, int threads) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<kvq::sequence_id> ids;
  for (auto* s : live) ids.push_back(s->id);
  std::size_t const per = static_cast<std::size_t>(q_heads) * head_dim;
  std::vector<float> q(ids.size() * per);
  for (auto& x : q) x = nd(rng);
  for (int l = 0; l < layers; ++l) {
    std::vector<float> got(q.size(), -1.0f), want(q.size());
    kvq::paged_decode_attention(tw.paged, l, std::span<kvq::sequence_id const>(ids), q.data(), q_heads, got.data(), opt,
                                threads);
    for (std::size_t i = 0; i < ids.size(); ++i)
      kvq::decode_attention(*live[i]->flat, l, q.data() + i * per, q_heads, want.data() + i * per, opt);
    INFO("layer " << l << " threads " << threads << " sequences " << ids.size());
    require_close(got, want, 1e-6);
  }
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("paged: continuous batching equals flat caches fed the same tokens", "[paged][batching]",
                        all_choices) {
  using Choice = TestType;
  std::vector<int> residuals = uses_residual<Choice> ? std::vector<int>{0, 32} : std::vector<int>{128};
  for (int residual : residuals) {
    INFO("residual " << residual);
    std::mt19937 rng(1234u + static_cast<unsigned>(residual));
    constexpr std::int64_t pool_pages = 400;
    twin<Choice> tw(residual, pool_pages, 24, 512);
    using seq_t = typename twin<Choice>::seq;

    // A shared system prompt (not a whole number of pages), forked to every child.
    seq_t root;
    root.id = tw.paged.add_sequence();
    root.flat = tw.make_flat();
    tokens const prompt = random_tokens(rng, 70);
    tw.append_all(root, prompt);
    std::int64_t const root_len = prompt.count();

    std::vector<std::unique_ptr<seq_t>> live;
    int admitted = 0;
    int finished = 0;
    std::uniform_int_distribution<int> coin(0, 99);
    auto admit = [&] {
      auto s = std::make_unique<seq_t>();
      bool const forked = coin(rng) < 85;
      s->id = forked ? tw.paged.fork(root.id) : tw.paged.add_sequence();
      s->flat = tw.make_flat();
      if (forked) {
        for (int l = 0; l < layers; ++l)
          s->flat->append(l, kvq::token_major(prompt.k.data(), root_len, kv_heads, head_dim),
                          kvq::token_major(prompt.v.data(), root_len, kv_heads, head_dim));
        s->shared = root_len;
      }
      tokens const own = random_tokens(rng, std::uniform_int_distribution<int>(1, 60)(rng));
      // A prefill in chunks of random sizes, layer by layer.
      for (std::int64_t t = 0; t < own.count();) {
        std::int64_t const n = std::min<std::int64_t>(own.count() - t, std::uniform_int_distribution<int>(1, 25)(rng));
        tokens chunk;
        std::size_t const a = static_cast<std::size_t>(t) * kv_heads * head_dim;
        std::size_t const b = static_cast<std::size_t>(t + n) * kv_heads * head_dim;
        chunk.k.assign(own.k.begin() + static_cast<std::ptrdiff_t>(a), own.k.begin() + static_cast<std::ptrdiff_t>(b));
        chunk.v.assign(own.v.begin() + static_cast<std::ptrdiff_t>(a), own.v.begin() + static_cast<std::ptrdiff_t>(b));
        tw.append_all(*s, chunk);
        t += n;
      }
      s->target = s->flat->size(0) + std::uniform_int_distribution<int>(5, 120)(rng);
      live.push_back(std::move(s));
      ++admitted;
    };

    std::int64_t const kivi_slack =
        residual > 0 && uses_residual<Choice> ? (std::max(residual, 32) + page_tokens - 1) / page_tokens : 0;
    int step = 0;
    while (admitted < 64 || !live.empty()) {
      while (admitted < 64 && live.size() < 12 && coin(rng) < 70) admit();
      if (live.empty()) continue;
      // One decode step: a token per live sequence, every layer.
      for (auto& s : live) {
        tokens const t = random_tokens(rng, 1);
        tw.append_all(*s, t);
      }
      // A speculative rollback now and then.
      if (coin(rng) < 10) {
        auto& s = live[static_cast<std::size_t>(coin(rng)) % live.size()];
        std::int64_t const len = s->flat->size(0);
        std::int64_t const n = std::max(s->shared, len - std::uniform_int_distribution<int>(1, 8)(rng));
        tw.paged.truncate(s->id, n);
        s->flat->truncate(n);
        s->target = std::max(s->target, n + 1);
      }
      // Page use: unique tokens / page_tokens, plus one page per live sequence (a copy of the page
      // where it left the shared prompt), plus, for KIVI with R > 0, the pages of tokens the root
      // still held in f16 when the child forked (written again, so copied).
      std::int64_t unique = root_len;
      for (auto& s : live) unique += s->flat->size(0) - s->shared;
      std::int64_t const sequences = static_cast<std::int64_t>(live.size()) + 1;
      REQUIRE(tw.paged.used_pages() <= (unique + page_tokens - 1) / page_tokens + sequences * (1 + kivi_slack));
      REQUIRE(tw.paged.used_pages() + tw.paged.free_pages() == pool_pages);

      if (step % 7 == 0) {
        std::vector<seq_t*> all;
        for (auto& s : live) all.push_back(s.get());
        all.push_back(&root);
        for (auto* s : all) {
          require_same_bytes(tw.paged, s->id, *s->flat);
          require_same_reads(tw.paged, s->id, *s->flat);
        }
        kvq::attention_options opt;
        require_same_attention(tw, all, rng, opt, 1);
        opt.window = 45;
        opt.softcap = 30.0f;
        require_same_attention(tw, all, rng, opt, 2);
        opt = {};
        opt.query = kvq::query_precision::q8_0;
        opt.probabilities = kvq::probability_precision::f16;
        require_same_attention(tw, all, rng, opt, 3);
      }
      // Finished sequences leave; their pages return unless shared.
      for (std::size_t i = 0; i < live.size();) {
        if (live[i]->flat->size(0) >= live[i]->target) {
          tw.paged.release(live[i]->id);
          CHECK_THROWS_AS(tw.paged.size(live[i]->id), kvq::index_error);
          live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
          ++finished;
        } else {
          ++i;
        }
      }
      ++step;
    }
    REQUIRE(finished == 64);
    require_same_bytes(tw.paged, root.id, *root.flat);
    REQUIRE(tw.paged.pages().sequences == 1);
    tw.paged.release(root.id);
    // Reference counts never leak: every page is back.
    REQUIRE(tw.paged.free_pages() == pool_pages);
    REQUIRE(tw.paged.pages().shared_pages == 0);
  }
}

TEMPLATE_LIST_TEST_CASE("paged: a fork shares pages and copies one before writing into it", "[paged][fork]",
                        all_choices) {
  using Choice = TestType;
  std::mt19937 rng(7);
  twin<Choice> tw(0, 64, 8, 256);
  typename twin<Choice>::seq parent, child;
  parent.id = tw.paged.add_sequence();
  parent.flat = tw.make_flat();
  tokens const prompt = random_tokens(rng, 80);  // 2.5 pages
  tw.append_all(parent, prompt);
  REQUIRE(tw.paged.used_pages() == 3);
  child.id = tw.paged.fork(parent.id);
  child.flat = tw.make_flat();
  for (int l = 0; l < layers; ++l)
    child.flat->append(l, kvq::token_major(prompt.k.data(), prompt.count(), kv_heads, head_dim),
                       kvq::token_major(prompt.v.data(), prompt.count(), kv_heads, head_dim));
  auto const before =
      std::vector<std::int32_t>(tw.paged.page_table(parent.id).begin(), tw.paged.page_table(parent.id).end());
  REQUIRE(std::equal(before.begin(), before.end(), tw.paged.page_table(child.id).begin()));
  REQUIRE(tw.paged.used_pages() == 3);
  REQUIRE(tw.paged.pages().shared_pages == 3);

  // Both go on: the child's first write copies the last (shared, partial) page, then the parent's
  // write finds it unshared.
  tw.append_all(child, random_tokens(rng, 5));
  REQUIRE(tw.paged.used_pages() == 4);
  REQUIRE(tw.paged.page_table(child.id)[2] != before[2]);
  REQUIRE(tw.paged.page_table(child.id)[0] == before[0]);
  tw.append_all(parent, random_tokens(rng, 20));
  REQUIRE(tw.paged.used_pages() == 5);  // the parent's 100 tokens: a new 4th page
  REQUIRE(std::equal(before.begin(), before.end(), tw.paged.page_table(parent.id).begin()));
  require_same_bytes(tw.paged, parent.id, *parent.flat);
  require_same_bytes(tw.paged, child.id, *child.flat);
  require_same_reads(tw.paged, child.id, *child.flat);
  require_same_reads(tw.paged, parent.id, *parent.flat);

  // Releasing the parent keeps the pages the child holds.
  tw.paged.release(parent.id);
  REQUIRE(tw.paged.used_pages() == 3);
  require_same_reads(tw.paged, child.id, *child.flat);
  tw.paged.release(child.id);
  REQUIRE(tw.paged.free_pages() == 64);
}

TEST_CASE("paged: a forked 4k-token prompt shared by 64 sequences costs its pages once", "[paged][memory]") {
  std::mt19937 rng(3);
  constexpr std::int64_t pages = 200;
  constexpr std::int64_t prompt_pages = 4096 / page_tokens;  // 128
  kvq::PagedKVCache<kvq::q4_0> c({layers, kv_heads, head_dim, page_tokens, pages, 65});
  auto const root = c.add_sequence();
  tokens const prompt = random_tokens(rng, 4096);
  for (int l = 0; l < layers; ++l)
    c.append(root, l, kvq::token_major(prompt.k.data(), prompt.count(), kv_heads, head_dim),
             kvq::token_major(prompt.v.data(), prompt.count(), kv_heads, head_dim));
  std::vector<kvq::sequence_id> kids;
  for (int i = 0; i < 64; ++i) kids.push_back(c.fork(root));
  auto const r = c.pages();
  REQUIRE(r.used_pages == prompt_pages);
  REQUIRE(r.shared_pages == prompt_pages);
  REQUIRE(r.page_refs == 65 * prompt_pages);
  REQUIRE(r.used_bytes == static_cast<std::size_t>(prompt_pages) * r.page_bytes);
  // One token each: one new page per child.
  for (auto k : kids) {
    tokens const t = random_tokens(rng, 1);
    for (int l = 0; l < layers; ++l)
      c.append(k, l, kvq::token_major(t.k.data(), 1, kv_heads, head_dim),
               kvq::token_major(t.v.data(), 1, kv_heads, head_dim));
  }
  REQUIRE(c.used_pages() == prompt_pages + 64);
  // Budget: the pool's bytes, every byte accounted.
  auto const m = c.memory();
  REQUIRE(m.total_bytes == m.key_bytes + m.value_bytes + m.residual_bytes + m.alignment_bytes);
  REQUIRE(m.total_bytes == static_cast<std::size_t>(pages) * r.page_bytes);
  REQUIRE(m.key_bytes == static_cast<std::size_t>(pages) * layers * kv_heads * page_tokens * 36);
}

TEST_CASE("paged: pages_for_budget sizes the pool", "[paged][memory]") {
  kvq::paged_shape s{4, 2, 128, 64, 0, 8};
  std::size_t const budget = std::size_t{64} << 20;
  auto const n = kvq::pages_for_budget<kvq::kivi<4>>(s, budget, 64);
  s.pages = n;
  kvq::PagedKVCache<kvq::kivi<4>> c(s, {64});
  REQUIRE(c.memory().total_bytes <= budget);
  REQUIRE(c.memory().total_bytes + c.pages().page_bytes > budget);
  REQUIRE(c.memory().residual_bytes == 8u * 4 * 2 * (64 + 64) * 128 * 2);
  CHECK_THROWS_AS(kvq::pages_for_budget<kvq::q8_0>(s, 100), kvq::invalid_argument_error);
}

TEMPLATE_LIST_TEST_CASE("paged: the storage views address a sequence's units as documented", "[paged][views]",
                        all_choices) {
  using Choice = TestType;
  using K = typename kvq::codec_pair<Choice>::key;
  using V = typename kvq::codec_pair<Choice>::value;
  std::mt19937 rng(11);
  kvq::PagedKVCache<Choice> c({layers, kv_heads, head_dim, page_tokens, 16, 4}, {32});
  auto const s = c.add_sequence();
  tokens const t = random_tokens(rng, 150);
  for (int l = 0; l < layers; ++l)
    c.append(s, l, kvq::token_major(t.k.data(), t.count(), kv_heads, head_dim),
             kvq::token_major(t.v.data(), t.count(), kv_heads, head_dim));
  std::vector<float> got(head_dim), want(head_dim);
  for (int l = 0; l < layers; ++l)
    for (int h = 0; h < kv_heads; ++h) {
      auto const kview = c.key_storage(s, l, h);
      auto const vview = c.value_storage(s, l, h);
      REQUIRE(kview.length == 150);
      REQUIRE(kview.pages.size() == 5);
      for (std::int64_t tok = 0; tok < 150; ++tok) {
        for (int side = 0; side < 2; ++side) {
          auto const& v = side == 0 ? kview : vview;
          if (tok < v.quantized_tokens) {
            auto const* unit = reinterpret_cast<std::uint8_t const*>(
                v.pool +
                static_cast<std::size_t>(v.pages[static_cast<std::size_t>(tok / v.page_tokens)]) * v.page_bytes +
                v.head_offset + static_cast<std::size_t>((tok % v.page_tokens) / v.tokens_per_unit) * v.unit_bytes);
            if (side == 0) {
              if constexpr (K::layout == kvq::codec_layout::token_group)
                K::decode_token(unit, head_dim, static_cast<int>(tok % K::group), got.data());
              else
                K::decode_row(unit, head_dim, got.data(), c.get_options().key);
            } else {
              V::decode_row(unit, head_dim, got.data(), c.get_options().value);
            }
          } else {
            std::int64_t const row = (v.residual_first + tok - v.quantized_tokens) % v.residual_capacity;
            for (int i = 0; i < head_dim; ++i)
              got[static_cast<std::size_t>(i)] = kvq::to_f32(v.residual[row * head_dim + i]);
            // A rotated side's residual rows hold R x: reads un-rotate them.
            if (side == 0)
              kvq::detail::side_rotation<K>(head_dim).inverse_rows(got.data(), 1, head_dim);
            else
              kvq::detail::side_rotation<V>(head_dim).inverse_rows(got.data(), 1, head_dim);
          }
          if (side == 0)
            c.read_keys(s, l, h, tok, 1, want.data());
          else
            c.read_values(s, l, h, tok, 1, want.data());
          INFO("layer " << l << " head " << h << " token " << tok << " side " << side);
          REQUIRE(same_values(got, want));
        }
      }
    }
}

TEMPLATE_LIST_TEST_CASE("paged: the scalar reference and the SIMD kernel agree over pages", "[paged][attention]",
                        all_choices) {
  using Choice = TestType;
  std::mt19937 rng(5);
  twin<Choice> tw(32, 64, 8, 512);
  std::vector<std::unique_ptr<typename twin<Choice>::seq>> seqs;
  std::vector<kvq::sequence_id> ids;
  for (int i = 0; i < 3; ++i) {
    seqs.push_back(std::make_unique<typename twin<Choice>::seq>());
    seqs.back()->id = tw.paged.add_sequence();
    seqs.back()->flat = tw.make_flat();
    tw.append_all(*seqs.back(), random_tokens(rng, 40 + 77 * i));
    ids.push_back(seqs.back()->id);
  }
  ids.push_back(ids[0]);  // a sequence may repeat
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::size_t const per = static_cast<std::size_t>(q_heads) * head_dim;
  std::vector<float> q(ids.size() * per);
  for (auto& x : q) x = nd(rng);
  std::vector<float> simd(q.size()), ref(q.size()), flat(q.size());
  kvq::attention_options opt;
  kvq::detail::paged_attention_with<kvq::detail::default_attention>(tw.paged, 1, ids, q.data(), q_heads, simd.data(),
                                                                    opt, 2);
  kvq::detail::paged_attention_with<kvq::detail::reference_attention>(tw.paged, 1, ids, q.data(), q_heads, ref.data(),
                                                                      opt, 1);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    auto const& f = *seqs[i % 3]->flat;
    auto part = kvq::detail::attend_range_with<kvq::detail::reference_attention>(f, 1, q.data() + i * per, q_heads, 0,
                                                                                 f.size(1), opt);
    kvq::finalize(part, flat.data() + i * per);
  }
  require_close(ref, flat, 1e-6);
  require_close(simd, ref, 1e-5);
}

TEST_CASE("paged: misuse raises typed errors and changes nothing", "[paged][errors]") {
  std::mt19937 rng(9);
  kvq::PagedKVCache<kvq::q8_0> c({layers, kv_heads, head_dim, page_tokens, 4, 2});
  auto const a = c.add_sequence();
  tokens const t = random_tokens(rng, 100);
  auto k = kvq::token_major(t.k.data(), 100, kv_heads, head_dim);
  auto v = kvq::token_major(t.v.data(), 100, kv_heads, head_dim);
  c.append(a, 0, k, v);
  REQUIRE(c.used_pages() == 4);
  std::vector<float> before(static_cast<std::size_t>(100) * head_dim), after(before.size());
  c.read_keys(a, 0, 1, 0, 100, before.data());
  auto const unchanged = [&] {
    REQUIRE(c.size(a) == 100);
    REQUIRE(c.size(a, 1) == 0);
    REQUIRE(c.used_pages() == 4);
    c.read_keys(a, 0, 1, 0, 100, after.data());
    REQUIRE(std::memcmp(before.data(), after.data(), before.size() * 4) == 0);
  };

  // Out of pages: a second sequence cannot take a page; reserve takes none.
  auto const b = c.add_sequence();
  auto k1 = kvq::token_major(t.k.data(), 1, kv_heads, head_dim);
  auto v1 = kvq::token_major(t.v.data(), 1, kv_heads, head_dim);
  CHECK_THROWS_AS(c.append(b, 0, k1, v1), kvq::capacity_error);
  CHECK_THROWS_AS(c.reserve(b, 1), kvq::capacity_error);
  CHECK_THROWS_AS(c.append(a, 0, k, v), kvq::capacity_error);  // 200 tokens need 7 pages
  REQUIRE(c.size(b) == 0);
  unchanged();
  // Unknown and released sequences.
  CHECK_THROWS_AS(c.append(b + 12345, 0, k1, v1), kvq::index_error);
  CHECK_THROWS_AS(c.fork(-1), kvq::index_error);
  c.release(b);
  CHECK_THROWS_AS(c.append(b, 0, k1, v1), kvq::index_error);
  CHECK_THROWS_AS(c.release(b), kvq::index_error);
  CHECK_THROWS_AS(c.read_keys(b, 0, 0, 0, 1, after.data()), kvq::index_error);
  CHECK_THROWS_AS(c.page_table(b), kvq::index_error);
  CHECK_THROWS_AS(c.truncate(b, 0), kvq::index_error);
  // Sequence slots: at most max_sequences live, ids never reused.
  auto const d = c.fork(a);
  REQUIRE(d != b);
  CHECK_THROWS_AS(c.add_sequence(), kvq::capacity_error);
  CHECK_THROWS_AS(c.fork(a), kvq::capacity_error);
  c.release(d);
  // Shapes, layers, heads, ranges, options.
  auto bad = kvq::token_major(t.k.data(), 1, kv_heads + 1, head_dim);
  CHECK_THROWS_AS(c.append(a, 0, bad, bad), kvq::shape_error);
  CHECK_THROWS_AS(c.append(a, 0, k1, kvq::token_major(t.v.data(), 2, kv_heads, head_dim)), kvq::shape_error);
  CHECK_THROWS_AS(c.append(a, layers, k1, v1), kvq::index_error);
  CHECK_THROWS_AS(c.read_keys(a, 0, kv_heads, 0, 1, after.data()), kvq::index_error);
  CHECK_THROWS_AS(c.read_keys(a, 0, 0, 90, 11, after.data()), kvq::index_error);
  CHECK_THROWS_AS(c.truncate(a, -1), kvq::invalid_argument_error);
  CHECK_THROWS_AS(c.reserve(a, -1), kvq::invalid_argument_error);
  std::vector<float> q(q_heads * head_dim), out(q.size());
  std::vector<kvq::sequence_id> ids{a};
  CHECK_THROWS_AS(kvq::paged_decode_attention(c, 0, ids, q.data(), 3, out.data()), kvq::shape_error);
  CHECK_THROWS_AS(kvq::paged_decode_attention(c, 0, ids, q.data(), q_heads, out.data(), {}, 0),
                  kvq::invalid_argument_error);
  ids.push_back(b);
  CHECK_THROWS_AS(kvq::paged_decode_attention(c, 0, ids, q.data(), q_heads, out.data()), kvq::index_error);
  unchanged();
  // Construction.
  using kivi = kvq::PagedKVCache<kvq::kivi<4>>;
  CHECK_THROWS_AS(kivi({1, 1, 64, 48, 4, 1}), kvq::invalid_argument_error);  // 48 is not a multiple of G = 32
  CHECK_THROWS_AS(kivi({1, 1, 64, 32, 0, 1}), kvq::invalid_argument_error);
  CHECK_THROWS_AS(kivi({1, 1, 64, 32, 4, 0}), kvq::invalid_argument_error);
  CHECK_THROWS_AS(kivi({0, 1, 64, 32, 4, 1}), kvq::invalid_argument_error);
  CHECK_THROWS_AS(kivi({1, 1, 64, 32, 4, 1}, {30}), kvq::invalid_argument_error);
  // Truncation returns pages.
  c.truncate(a, 33);
  REQUIRE(c.used_pages() == 2);
  c.truncate(a, 0);
  REQUIRE(c.used_pages() == 0);
  REQUIRE(c.size(a) == 0);
}
