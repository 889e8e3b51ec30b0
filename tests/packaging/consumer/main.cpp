// An engine-like use of kvq from a consumer project: encode one head_dim-32 row as a q8_0 block and decode it.
#include <kvq/kvq.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

static_assert(__cplusplus >= 202002L, "kvq::kvq must bring C++20 to its consumers");
static_assert(KVQ_VERSION == KVQ_VERSION_MAJOR * 10000 + KVQ_VERSION_MINOR * 100 + KVQ_VERSION_PATCH);

namespace {

auto fail(char const* what) -> int {
  std::fprintf(stderr, "kvq consumer: %s\n", what);
  return 1;
}

}  // namespace

int main() {
  constexpr int head_dim = 32;
  float x[head_dim];
  for (int i = 0; i < head_dim; ++i) x[i] = 0.25f * static_cast<float>(i - 16);  // -4 .. 3.75, amax 4

  auto const geometry = kvq::q8_0::geometry(head_dim);
  if (geometry.bytes() != 34) return fail("a q8_0 block is not 34 bytes (fp16 scale + 32 x int8)");
  std::vector<std::uint8_t> bytes(geometry.bytes());
  kvq::q8_0::encode_row(x, head_dim, bytes.data());
  // ggml block_q8_0: x[0] = -amax is code -127 (0x81), x[16] = 0 is code 0.
  if (bytes[2] != 0x81 || bytes[2 + 16] != 0) return fail("unexpected q8_0 codes");

  float y[head_dim];
  kvq::q8_0::decode_row(bytes.data(), head_dim, y);
  float const step = 4.0f / 127.0f;  // the scale, before its rounding to fp16
  for (int i = 0; i < head_dim; ++i) {
    if (!(std::fabs(y[i] - x[i]) <= 0.6f * step)) return fail("q8_0 round trip error above half a step");
  }
  std::printf("kvq %d.%d.%d: q8_0 round trip ok\n", KVQ_VERSION_MAJOR, KVQ_VERSION_MINOR, KVQ_VERSION_PATCH);
  return 0;
}
