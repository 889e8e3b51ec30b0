// The mixed-flags test: what each variant of isa_variant.cpp reports.
#pragma once

extern "C" {

/// The results of one variant: decoded keys of head 1 and the attention output.
struct isa_mix_result {
  float keys[70 * 64];
  float attention[4 * 64];
  char level[32];
};

void isa_mix_baseline(isa_mix_result* r);
void isa_mix_x86_64_v2(isa_mix_result* r);
void isa_mix_avx2_no_f16c(isa_mix_result* r);
void isa_mix_avx2(isa_mix_result* r);
void isa_mix_native(isa_mix_result* r);
}
