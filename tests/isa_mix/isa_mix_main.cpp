// The mixed-flags test: links copies of isa_variant.cpp built for several instruction sets into one
// program. `isa_mix baseline` runs only the copy built without instruction-set flags (run under an
// emulated CPU without AVX, it must not meet an AVX instruction: SIGILL otherwise); without an
// argument every copy runs and each must reproduce the baseline (decoded keys bit for bit; the
// attention output bit for bit for the copies without FMA, within fp32 rounding for the others).
#include <cmath>
#include <cstdio>
#include <cstring>

#include "isa_mix.hpp"

namespace {

isa_mix_result results[5];

bool agrees(char const* name, isa_mix_result const& base, isa_mix_result const& r, bool exact) {
  if (std::memcmp(base.keys, r.keys, sizeof base.keys) != 0) {
    std::printf("FAIL %s: decoded keys differ from the baseline's\n", name);
    return false;
  }
  float worst = 0.0f;
  for (int i = 0; i < 4 * 64; ++i) worst = std::fmax(worst, std::fabs(base.attention[i] - r.attention[i]));
  bool const ok = exact ? std::memcmp(base.attention, r.attention, sizeof base.attention) == 0 : worst <= 1e-5f;
  std::printf("%s %s (kernels %s): attention max |diff| %.3g vs baseline (%s)\n", ok ? "ok  " : "FAIL", name, r.level,
              static_cast<double>(worst), exact ? "bit-exact" : "<= 1e-5");
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  isa_mix_baseline(&results[0]);
  std::printf("baseline (kernels %s) ran\n", results[0].level);
  if (argc > 1 && std::strcmp(argv[1], "baseline") == 0) return 0;
  isa_mix_x86_64_v2(&results[1]);
  isa_mix_avx2_no_f16c(&results[2]);
  isa_mix_avx2(&results[3]);
  isa_mix_native(&results[4]);
  bool ok = agrees("x86-64-v2", results[0], results[1], true);
  ok = agrees("-mavx2 -mfma (no f16c)", results[0], results[2], false) && ok;
  ok = agrees("-mavx2 -mfma -mf16c", results[0], results[3], false) && ok;
  ok = agrees("-march=native", results[0], results[4], false) && ok;
  return ok ? 0 : 1;
}
