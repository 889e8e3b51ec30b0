// kvq: the instruction-set tag of a host translation unit (included by config.h).
//
// Everything kvq defines lives in the inline namespace `kvq::isa_<level>_<mask>`: <level> names
// the kernel level (avx512_vnni, avx2, neon, scalar, ...) and <mask> is a hexadecimal bit mask of
// every instruction-set extension macro below that the compiler defined for this translation unit
// (x86 SSE .. AVX-512 / AVX10, BMI, FMA, F16C, GFNI, ...; AArch64 NEON, FP16, dot product, SVE,
// LSE, ...; RISC-V V, POWER VSX, LoongArch SX): the macros that can change which instructions the
// compiler emits. Two translation units therefore share an inline function of kvq only when they
// were compiled for the same instruction set, and the linker can never hand code built for a
// larger set to a translation unit built for a smaller one (no SIGILL from an ODR merge). Tuning
// flags (-mtune) do not take part: they change speed, not which instructions are legal.
// Bit i of the mask is KVQ_ISA_Bi; the mask is written most significant digit first.
#pragma once

#if defined(__SSE__)
#  define KVQ_ISA_B00 1
#else
#  define KVQ_ISA_B00 0
#endif
#if defined(__SSE2__)
#  define KVQ_ISA_B01 1
#else
#  define KVQ_ISA_B01 0
#endif
#if defined(__SSE3__)
#  define KVQ_ISA_B02 1
#else
#  define KVQ_ISA_B02 0
#endif
#if defined(__SSSE3__)
#  define KVQ_ISA_B03 1
#else
#  define KVQ_ISA_B03 0
#endif
#if defined(__SSE4_1__)
#  define KVQ_ISA_B04 1
#else
#  define KVQ_ISA_B04 0
#endif
#if defined(__SSE4_2__)
#  define KVQ_ISA_B05 1
#else
#  define KVQ_ISA_B05 0
#endif
#if defined(__SSE4A__)
#  define KVQ_ISA_B06 1
#else
#  define KVQ_ISA_B06 0
#endif
#if defined(__POPCNT__)
#  define KVQ_ISA_B07 1
#else
#  define KVQ_ISA_B07 0
#endif
#if defined(__LZCNT__)
#  define KVQ_ISA_B08 1
#else
#  define KVQ_ISA_B08 0
#endif
#if defined(__BMI__)
#  define KVQ_ISA_B09 1
#else
#  define KVQ_ISA_B09 0
#endif
#if defined(__BMI2__)
#  define KVQ_ISA_B10 1
#else
#  define KVQ_ISA_B10 0
#endif
#if defined(__TBM__)
#  define KVQ_ISA_B11 1
#else
#  define KVQ_ISA_B11 0
#endif
#if defined(__MOVBE__)
#  define KVQ_ISA_B12 1
#else
#  define KVQ_ISA_B12 0
#endif
#if defined(__ADX__)
#  define KVQ_ISA_B13 1
#else
#  define KVQ_ISA_B13 0
#endif
#if defined(__AVX__)
#  define KVQ_ISA_B14 1
#else
#  define KVQ_ISA_B14 0
#endif
#if defined(__AVX2__)
#  define KVQ_ISA_B15 1
#else
#  define KVQ_ISA_B15 0
#endif
#if defined(__FMA__)
#  define KVQ_ISA_B16 1
#else
#  define KVQ_ISA_B16 0
#endif
#if defined(__FMA4__)
#  define KVQ_ISA_B17 1
#else
#  define KVQ_ISA_B17 0
#endif
#if defined(__XOP__)
#  define KVQ_ISA_B18 1
#else
#  define KVQ_ISA_B18 0
#endif
#if defined(__F16C__)
#  define KVQ_ISA_B19 1
#else
#  define KVQ_ISA_B19 0
#endif
#if defined(__AVX512F__)
#  define KVQ_ISA_B20 1
#else
#  define KVQ_ISA_B20 0
#endif
#if defined(__AVX512CD__)
#  define KVQ_ISA_B21 1
#else
#  define KVQ_ISA_B21 0
#endif
#if defined(__AVX512BW__)
#  define KVQ_ISA_B22 1
#else
#  define KVQ_ISA_B22 0
#endif
#if defined(__AVX512DQ__)
#  define KVQ_ISA_B23 1
#else
#  define KVQ_ISA_B23 0
#endif
#if defined(__AVX512VL__)
#  define KVQ_ISA_B24 1
#else
#  define KVQ_ISA_B24 0
#endif
#if defined(__AVX512IFMA__)
#  define KVQ_ISA_B25 1
#else
#  define KVQ_ISA_B25 0
#endif
#if defined(__AVX512VBMI__)
#  define KVQ_ISA_B26 1
#else
#  define KVQ_ISA_B26 0
#endif
#if defined(__AVX512VBMI2__)
#  define KVQ_ISA_B27 1
#else
#  define KVQ_ISA_B27 0
#endif
#if defined(__AVX512VNNI__)
#  define KVQ_ISA_B28 1
#else
#  define KVQ_ISA_B28 0
#endif
#if defined(__AVX512BITALG__)
#  define KVQ_ISA_B29 1
#else
#  define KVQ_ISA_B29 0
#endif
#if defined(__AVX512VPOPCNTDQ__)
#  define KVQ_ISA_B30 1
#else
#  define KVQ_ISA_B30 0
#endif
#if defined(__AVX512BF16__)
#  define KVQ_ISA_B31 1
#else
#  define KVQ_ISA_B31 0
#endif
#if defined(__AVX512FP16__)
#  define KVQ_ISA_B32 1
#else
#  define KVQ_ISA_B32 0
#endif
#if defined(__AVX512ER__)
#  define KVQ_ISA_B33 1
#else
#  define KVQ_ISA_B33 0
#endif
#if defined(__AVX512PF__)
#  define KVQ_ISA_B34 1
#else
#  define KVQ_ISA_B34 0
#endif
#if defined(__AVX10_1__)
#  define KVQ_ISA_B35 1
#else
#  define KVQ_ISA_B35 0
#endif
#if defined(__AVXVNNI__)
#  define KVQ_ISA_B36 1
#else
#  define KVQ_ISA_B36 0
#endif
#if defined(__AVXIFMA__)
#  define KVQ_ISA_B37 1
#else
#  define KVQ_ISA_B37 0
#endif
#if defined(__AVXVNNIINT8__)
#  define KVQ_ISA_B38 1
#else
#  define KVQ_ISA_B38 0
#endif
#if defined(__AVXNECONVERT__)
#  define KVQ_ISA_B39 1
#else
#  define KVQ_ISA_B39 0
#endif
#if defined(__GFNI__)
#  define KVQ_ISA_B40 1
#else
#  define KVQ_ISA_B40 0
#endif
#if defined(__VAES__)
#  define KVQ_ISA_B41 1
#else
#  define KVQ_ISA_B41 0
#endif
#if defined(__VPCLMULQDQ__)
#  define KVQ_ISA_B42 1
#else
#  define KVQ_ISA_B42 0
#endif
#if defined(__AES__)
#  define KVQ_ISA_B43 1
#else
#  define KVQ_ISA_B43 0
#endif
#if defined(__PCLMUL__)
#  define KVQ_ISA_B44 1
#else
#  define KVQ_ISA_B44 0
#endif
#if defined(__SHA__)
#  define KVQ_ISA_B45 1
#else
#  define KVQ_ISA_B45 0
#endif
#if defined(__ARM_NEON)
#  define KVQ_ISA_B46 1
#else
#  define KVQ_ISA_B46 0
#endif
#if defined(__ARM_FEATURE_FMA)
#  define KVQ_ISA_B47 1
#else
#  define KVQ_ISA_B47 0
#endif
#if defined(__ARM_FEATURE_FP16_SCALAR_ARITHMETIC)
#  define KVQ_ISA_B48 1
#else
#  define KVQ_ISA_B48 0
#endif
#if defined(__ARM_FEATURE_FP16_VECTOR_ARITHMETIC)
#  define KVQ_ISA_B49 1
#else
#  define KVQ_ISA_B49 0
#endif
#if defined(__ARM_FEATURE_DOTPROD)
#  define KVQ_ISA_B50 1
#else
#  define KVQ_ISA_B50 0
#endif
#if defined(__ARM_FEATURE_MATMUL_INT8)
#  define KVQ_ISA_B51 1
#else
#  define KVQ_ISA_B51 0
#endif
#if defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
#  define KVQ_ISA_B52 1
#else
#  define KVQ_ISA_B52 0
#endif
#if defined(__ARM_FEATURE_SVE)
#  define KVQ_ISA_B53 1
#else
#  define KVQ_ISA_B53 0
#endif
#if defined(__ARM_FEATURE_SVE2)
#  define KVQ_ISA_B54 1
#else
#  define KVQ_ISA_B54 0
#endif
#if defined(__ARM_FEATURE_SME)
#  define KVQ_ISA_B55 1
#else
#  define KVQ_ISA_B55 0
#endif
#if defined(__ARM_FEATURE_ATOMICS)
#  define KVQ_ISA_B56 1
#else
#  define KVQ_ISA_B56 0
#endif
#if defined(__ARM_FEATURE_CRC32)
#  define KVQ_ISA_B57 1
#else
#  define KVQ_ISA_B57 0
#endif
#if defined(__ARM_FEATURE_RCPC)
#  define KVQ_ISA_B58 1
#else
#  define KVQ_ISA_B58 0
#endif
#if defined(__riscv_vector)
#  define KVQ_ISA_B59 1
#else
#  define KVQ_ISA_B59 0
#endif
#if defined(__riscv_zfh)
#  define KVQ_ISA_B60 1
#else
#  define KVQ_ISA_B60 0
#endif
#if defined(__ALTIVEC__)
#  define KVQ_ISA_B61 1
#else
#  define KVQ_ISA_B61 0
#endif
#if defined(__VSX__)
#  define KVQ_ISA_B62 1
#else
#  define KVQ_ISA_B62 0
#endif
#if defined(__POWER9_VECTOR__)
#  define KVQ_ISA_B63 1
#else
#  define KVQ_ISA_B63 0
#endif
#if defined(__loongarch_sx)
#  define KVQ_ISA_B64 1
#else
#  define KVQ_ISA_B64 0
#endif
#if defined(__loongarch_asx)
#  define KVQ_ISA_B65 1
#else
#  define KVQ_ISA_B65 0
#endif

// One hexadecimal digit from four bits (most significant first), by pasting them into a name.
#define KVQ_ISA_HEX_0000 0
#define KVQ_ISA_HEX_0001 1
#define KVQ_ISA_HEX_0010 2
#define KVQ_ISA_HEX_0011 3
#define KVQ_ISA_HEX_0100 4
#define KVQ_ISA_HEX_0101 5
#define KVQ_ISA_HEX_0110 6
#define KVQ_ISA_HEX_0111 7
#define KVQ_ISA_HEX_1000 8
#define KVQ_ISA_HEX_1001 9
#define KVQ_ISA_HEX_1010 a
#define KVQ_ISA_HEX_1011 b
#define KVQ_ISA_HEX_1100 c
#define KVQ_ISA_HEX_1101 d
#define KVQ_ISA_HEX_1110 e
#define KVQ_ISA_HEX_1111 f
#define KVQ_ISA_HEX_(b3, b2, b1, b0) KVQ_ISA_HEX_##b3##b2##b1##b0
#define KVQ_ISA_HEX(b3, b2, b1, b0) KVQ_ISA_HEX_(b3, b2, b1, b0)
#define KVQ_ISA_D00 KVQ_ISA_HEX(KVQ_ISA_B03, KVQ_ISA_B02, KVQ_ISA_B01, KVQ_ISA_B00)
#define KVQ_ISA_D01 KVQ_ISA_HEX(KVQ_ISA_B07, KVQ_ISA_B06, KVQ_ISA_B05, KVQ_ISA_B04)
#define KVQ_ISA_D02 KVQ_ISA_HEX(KVQ_ISA_B11, KVQ_ISA_B10, KVQ_ISA_B09, KVQ_ISA_B08)
#define KVQ_ISA_D03 KVQ_ISA_HEX(KVQ_ISA_B15, KVQ_ISA_B14, KVQ_ISA_B13, KVQ_ISA_B12)
#define KVQ_ISA_D04 KVQ_ISA_HEX(KVQ_ISA_B19, KVQ_ISA_B18, KVQ_ISA_B17, KVQ_ISA_B16)
#define KVQ_ISA_D05 KVQ_ISA_HEX(KVQ_ISA_B23, KVQ_ISA_B22, KVQ_ISA_B21, KVQ_ISA_B20)
#define KVQ_ISA_D06 KVQ_ISA_HEX(KVQ_ISA_B27, KVQ_ISA_B26, KVQ_ISA_B25, KVQ_ISA_B24)
#define KVQ_ISA_D07 KVQ_ISA_HEX(KVQ_ISA_B31, KVQ_ISA_B30, KVQ_ISA_B29, KVQ_ISA_B28)
#define KVQ_ISA_D08 KVQ_ISA_HEX(KVQ_ISA_B35, KVQ_ISA_B34, KVQ_ISA_B33, KVQ_ISA_B32)
#define KVQ_ISA_D09 KVQ_ISA_HEX(KVQ_ISA_B39, KVQ_ISA_B38, KVQ_ISA_B37, KVQ_ISA_B36)
#define KVQ_ISA_D10 KVQ_ISA_HEX(KVQ_ISA_B43, KVQ_ISA_B42, KVQ_ISA_B41, KVQ_ISA_B40)
#define KVQ_ISA_D11 KVQ_ISA_HEX(KVQ_ISA_B47, KVQ_ISA_B46, KVQ_ISA_B45, KVQ_ISA_B44)
#define KVQ_ISA_D12 KVQ_ISA_HEX(KVQ_ISA_B51, KVQ_ISA_B50, KVQ_ISA_B49, KVQ_ISA_B48)
#define KVQ_ISA_D13 KVQ_ISA_HEX(KVQ_ISA_B55, KVQ_ISA_B54, KVQ_ISA_B53, KVQ_ISA_B52)
#define KVQ_ISA_D14 KVQ_ISA_HEX(KVQ_ISA_B59, KVQ_ISA_B58, KVQ_ISA_B57, KVQ_ISA_B56)
#define KVQ_ISA_D15 KVQ_ISA_HEX(KVQ_ISA_B63, KVQ_ISA_B62, KVQ_ISA_B61, KVQ_ISA_B60)
#define KVQ_ISA_D16 KVQ_ISA_HEX(0, 0, KVQ_ISA_B65, KVQ_ISA_B64)

// Pastes the level and the digits into one identifier.
#define KVQ_ISA_PASTE_(level, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15, d16) \
  level##_##d0##d1##d2##d3##d4##d5##d6##d7##d8##d9##d10##d11##d12##d13##d14##d15##d16
#define KVQ_ISA_PASTE(...) KVQ_ISA_PASTE_(__VA_ARGS__)

/// The inline namespace's name without the `isa_` prefix: the level, then the mask.
#define KVQ_ISA_NAME                                                                                              \
  KVQ_ISA_PASTE(KVQ_ISA_LEVEL_NAME, KVQ_ISA_D16, KVQ_ISA_D15, KVQ_ISA_D14, KVQ_ISA_D13, KVQ_ISA_D12, KVQ_ISA_D11, \
                KVQ_ISA_D10, KVQ_ISA_D09, KVQ_ISA_D08, KVQ_ISA_D07, KVQ_ISA_D06, KVQ_ISA_D05, KVQ_ISA_D04,        \
                KVQ_ISA_D03, KVQ_ISA_D02, KVQ_ISA_D01, KVQ_ISA_D00)
