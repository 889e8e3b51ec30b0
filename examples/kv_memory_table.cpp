// Prints the KV bytes per token of a Llama-3-8B-shaped cache (32 layers, 8 KV heads, head_dim 128,
// 8192 tokens) for each codec, computed by kvq::plan_memory without allocating (the README table).
#include <kvq/kvq.hpp>

#include <cstdio>
/// One table row for codec choice C with KIVI residual r.
template <class C>
void row(const char* name, int r = 128) {
  auto m = kvq::plan_memory<C>({32, 8, 128, 8192}, r);
  std::printf("| `%s` | %.0f | %.2f | %.3f |\n", name, m.bytes_per_token, m.bits_per_element,
              m.bits_per_element / 16.0);
}
int main() {
  std::printf("| codec (K/V) | bytes per token | bits per element | vs f16 |\n|---|---:|---:|---:|\n");
  row<kvq::f32_codec>("f32");
  row<kvq::f16_codec>("f16");
  row<kvq::q8_0>("q8_0");
  row<kvq::int8_sym>("int8");
  row<kvq::fp8_e4m3>("fp8_e4m3");
  row<kvq::fp8_e5m2>("fp8_e5m2");
  row<kvq::q4_0>("q4_0");
  row<kvq::kv_codecs<kvq::q8_0, kvq::q4_0>>("q8_0 / q4_0");
  row<kvq::kivi<8>>("kivi8 (R = 128)");
  row<kvq::kivi<4>>("kivi4 (R = 128)");
  row<kvq::kivi<2>>("kivi2 (R = 128)");
  row<kvq::kivi<4>>("kivi4 (R = 0)", 0);
  row<kvq::kivi<2>>("kivi2 (R = 0)", 0);
}
