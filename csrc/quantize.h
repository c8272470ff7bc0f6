// The number formats of the low-precision combine and of its quantized
// outputs, defined once for the CPU and the CUDA kernels (__host__ __device__
// under nvcc), so that both produce the same bits: every conversion here is
// integer arithmetic on float bits, comparisons, exact power-of-two scaling
// or an IEEE division (no approximate reciprocal, no fast-math intrinsic).
// docs/internals.md, 'Low precision and quantized outputs', states the
// recipes and where they differ from FlashInfer's.
//
// Formats (OCP Microscaling Formats v1.0; NVIDIA's NVFP4):
//   e4m3 (float8_e4m3fn): bias 7, max 448, subnormals down to 2^-9, no inf,
//     NaN = S.1111.111. Conversions round to nearest even and saturate.
//   e2m1 (fp4): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; two per byte, the
//     even element in the low nibble. Round to nearest even, saturating.
//   ue8m0: a power of two 2^(code - 127), code 255 = NaN.
//   MXFP8: e4m3 elements, a ue8m0 scale per 32. MXFP4: e2m1, ue8m0 per 32.
//   NVFP4: e2m1, an e4m3 scale per 16, and the tensor's global scale g:
//     element value = e2m1 * scale / g.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "protocol.h"

namespace moe_a2a {

// What the combine writes: the sum cast to the output dtype, or quantized.
enum class QuantFormat : int32_t { kNone = 0, kMxfp8 = 1, kMxfp4 = 2, kNvfp4 = 3 };

// Scale-factor layouts, with FlashInfer's SfLayout values.
enum class SfLayout : int32_t { k128x4 = 0, k8x4 = 1, kLinear = 2 };

constexpr float kE4m3Max = 448.0f;
constexpr float kE2m1Max = 6.0f;
// The scale recipes multiply the block maximum by these (the fp32 values
// nearest to 1/448 and 1/6; 448 * 2^k and 6 * 2^k map to exactly 2^k).
constexpr float kInvE4m3Max = 1.0f / 448.0f;
constexpr float kInvE2m1Max = 1.0f / 6.0f;
constexpr int64_t kMxBlock = 32;
constexpr int64_t kNvfp4Block = 16;

MOE_A2A_HD uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}
MOE_A2A_HD float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}
// IEEE round-to-nearest products and quotients: nvcc would otherwise be free
// to fuse or approximate where the host does not.
MOE_A2A_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
MOE_A2A_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
// max that drops a NaN operand, as fmaxf: the block maximum of a block with
// a NaN is that of its other elements, in any order of reduction.
MOE_A2A_HD float abs_max(float m, float x) { return fmaxf(m, fabsf(x)); }

// ---- element formats ----------------------------------------------------------

// On GPUs with e4m3 conversions (sm_89 and later) one instruction gives the
// same bytes as the arithmetic below (round to nearest even, saturation to
// +-448, subnormals): the low-precision combine converts every element it
// moves, and the arithmetic, about 20 instructions an element, made the e4m3
// combine slower than bf16 (compute-bound). NaN is pinned to 0x7f, as below.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define MOE_A2A_E4M3_CVT 1
#endif

MOE_A2A_HD uint8_t e4m3_from_float(float x) {
#if defined(MOE_A2A_E4M3_CVT)
  if (x != x) return 0x7f;
  uint16_t pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(x));  // x in the low byte
  return uint8_t(pair);
#endif
  const uint32_t u = float_bits(x);
  const uint8_t sign = uint8_t((u >> 24) & 0x80);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f;                                 // NaN
  if (a >= 0x43e00000u) return uint8_t(0x7e | sign);                // |x| >= 448 (inf included): saturate
  if (a < 0x3c800000u) {                                            // |x| < 2^-6: subnormal steps of 2^-9
    return uint8_t(uint8_t(rintf(bits_float(a) * 512.0f)) | sign);  // exact scaling; 8 is 2^-6
  }
  // Keep 3 of the 23 mantissa bits, ties to even; a carry moves into the exponent.
  const uint32_t r = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
  return uint8_t(uint8_t(r - (120u << 3)) | sign);  // exponent bias 127 -> 7
}

MOE_A2A_HD float e4m3_to_float(uint8_t b) {
#if defined(MOE_A2A_E4M3_CVT)
  if ((b & 0x7f) != 0x7f) {  // every e4m3 value but NaN is exact in fp16, and fp16 in fp32
    uint32_t halves;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(uint16_t(b)));
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(uint16_t(halves)));
    return f;
  }
#endif
  const uint32_t sign = uint32_t(b & 0x80) << 24;
  const uint32_t e = (b >> 3) & 0xf, m = b & 0x7;
  if (e == 0xf && m == 0x7) return bits_float(sign | 0x7fc00000u);
  if (e == 0) return bits_float(sign | float_bits(float(m) * 0.001953125f));  // m * 2^-9, exact
  return bits_float(sign | ((e + 120u) << 23) | (m << 20));
}

// Two elements at once, `lo` in the low byte: the bytes of e4m3_from_float
// of each (one instruction for the pair where the GPU converts).
MOE_A2A_HD uint16_t e4m3x2_from_float(float lo, float hi) {
#if defined(MOE_A2A_E4M3_CVT)
  if (lo == lo && hi == hi) {  // NaN: the arithmetic's 0x7f below
    uint16_t pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
    return pair;
  }
#endif
  return uint16_t(e4m3_from_float(lo) | (uint16_t(e4m3_from_float(hi)) << 8));
}

// The two elements of a pair (the low byte in `lo`): the values of
// e4m3_to_float of each, a NaN as some NaN (its bits are not specified: a
// sum that holds one is NaN whatever they are).
MOE_A2A_HD void e4m3x2_to_float(uint16_t pair, float& lo, float& hi) {
#if defined(MOE_A2A_E4M3_CVT)
  uint32_t halves;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(pair));
  asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"(uint16_t(halves)));
  asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"(uint16_t(halves >> 16)));
#else
  lo = e4m3_to_float(uint8_t(pair));
  hi = e4m3_to_float(uint8_t(pair >> 8));
#endif
}

// The four e4m3 codes of a word (the lowest byte first) as floats: the
// hardware's conversions, two codes to two halves per instruction, where it
// has them (every e4m3 value is exact in fp16, and fp16 in fp32), else
// e4m3_to_float of each. A NaN code gives some NaN.
MOE_A2A_HD void e4m3x4_to_float(uint32_t word, float (&out)[4]) {
#if defined(MOE_A2A_E4M3_CVT)
  uint32_t lo, hi;
  asm("{\n\t.reg .b16 a, b;\n\tmov.b32 {a, b}, %2;\n\tcvt.rn.f16x2.e4m3x2 %0, a;\n\tcvt.rn.f16x2.e4m3x2 %1, b;\n\t}"
      : "=r"(lo), "=r"(hi)
      : "r"(word));
  asm("{\n\t.reg .b16 a, b;\n\tmov.b32 {a, b}, %2;\n\tcvt.f32.f16 %0, a;\n\tcvt.f32.f16 %1, b;\n\t}"
      : "=f"(out[0]), "=f"(out[1])
      : "r"(lo));
  asm("{\n\t.reg .b16 a, b;\n\tmov.b32 {a, b}, %2;\n\tcvt.f32.f16 %0, a;\n\tcvt.f32.f16 %1, b;\n\t}"
      : "=f"(out[2]), "=f"(out[3])
      : "r"(hi));
#else
  for (int i = 0; i < 4; ++i) out[i] = e4m3_to_float(uint8_t(word >> (8 * i)));
#endif
}

// The e4m3 codes of x0 .. x3 (x0 in the lowest byte): e4m3_from_float's
// bytes, NaN pinned to 0x7f. Where the hardware converts, two instructions
// for the four and no test per element: its NaN codes (0x7f, or 0xff for a
// negative NaN; no finite input gives either under satfinite) lose their
// sign bit after it, found with one add per word: the low seven bits plus
// one carry into bit 7 exactly where they are all ones.
MOE_A2A_HD uint32_t e4m3x4_from_float(float x0, float x1, float x2, float x3) {
#if defined(MOE_A2A_E4M3_CVT)
  uint32_t word;
  asm("{\n\t.reg .b16 a, b;\n\tcvt.rn.satfinite.e4m3x2.f32 a, %2, %1;\n\tcvt.rn.satfinite.e4m3x2.f32 b, %4, %3;"
      "\n\tmov.b32 %0, {a, b};\n\t}"
      : "=r"(word)
      : "f"(x0), "f"(x1), "f"(x2), "f"(x3));
  const uint32_t nan = ((word & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u;
  return word & ~nan;
#else
  return uint32_t(e4m3x2_from_float(x0, x1)) | uint32_t(e4m3x2_from_float(x2, x3)) << 16;
#endif
}

// The 4-bit code, rounded to nearest, ties to even, saturating at 6; a NaN
// gives the largest magnitude of its sign. Below 1 the magnitudes are 0, 0.5
// and 1: the code is 2|x| rounded to an integer. From 1 on, the code is
// (exponent, one mantissa bit) of |x| rounded to one mantissa bit on its
// bits (1.0 is 254 << 22, code 2), which carries into the exponent, and
// infinities and NaNs saturate with the rest. The same codes as comparing
// |x| with the seven midpoints, for all 2^32 inputs, in half the
// instructions, the fused outputs' conversion being software before
// Blackwell.
MOE_A2A_HD uint8_t e2m1_from_float(float x) {
  const uint32_t u = float_bits(x);
  const uint32_t bits = u & 0x7fffffffu;
  uint32_t code;
  if (bits < 0x3f800000u) {
    code = uint32_t(rintf(bits_float(bits) * 2.0f));
  } else {
    const uint32_t r = (bits + 0x1fffffu + ((bits >> 22) & 1u)) >> 22;
    code = r - 252u < 7u ? r - 252u : 7u;
  }
  return uint8_t(code | ((u >> 28) & 0x8));
}

MOE_A2A_HD float e2m1_to_float(uint8_t code) {
  const float magnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float v = magnitudes[code & 0x7];
  return (code & 0x8) ? -v : v;
}

// The smallest power of two >= s (s >= 0), as a ue8m0 code, saturating at
// 2^127; NaN gives 255.
MOE_A2A_HD uint8_t ue8m0_round_up(float s) {
  const uint32_t u = float_bits(s);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0xff;
  if (u & 0x80000000u) return 0;
  const uint32_t e = u >> 23, m = u & 0x7fffffu;
  if (e == 0xff) return 254;
  // A subnormal s is at most 2^-127 (code 0) when its mantissa is <= 2^22.
  const uint32_t code = e + ((m != 0 && (e != 0 || m > 0x400000u)) ? 1u : 0u);
  return uint8_t(code > 254 ? 254 : code);
}

MOE_A2A_HD float pow2_bits(uint32_t biased) {  // 2^(biased - 127), biased in [0, 254]
  return bits_float(biased == 0 ? 0x00400000u : biased << 23);
}
MOE_A2A_HD float ue8m0_to_float(uint8_t code) { return code == 0xff ? bits_float(0x7fc00000u) : pow2_bits(code); }
// 2^(127 - code): what the elements of a block with this scale are multiplied by.
MOE_A2A_HD float ue8m0_inverse(uint8_t code) { return code == 0xff ? bits_float(0x7fc00000u) : pow2_bits(254u - code); }

// ---- block quantization of quantized outputs -----------------------------------

MOE_A2A_HD constexpr int64_t quant_block(QuantFormat f) { return f == QuantFormat::kNvfp4 ? kNvfp4Block : kMxBlock; }

struct BlockScale {
  uint8_t code;   // the stored scale (ue8m0, or e4m3 for NVFP4)
  float inverse;  // what the block's elements are multiplied by before conversion
};

// NVFP4: the e4m3 scale code of a block whose largest magnitude is amax,
// and the inverse that goes with a code. The inverse depends on the code
// alone (a block of zeros has code 0), so that the CUDA epilogue looks it up
// in a table of the 256 codes instead of two divisions a block.
MOE_A2A_HD uint8_t nvfp4_scale_code(float amax, float global) {
  return e4m3_from_float(mul_rn(global, mul_rn(amax, kInvE2m1Max)));
}
MOE_A2A_HD float nvfp4_inverse(uint8_t code, float global) {
  const float decoded = e4m3_to_float(code);
  // A block of zeros, or one whose scale underflows e4m3, encodes zeros.
  return decoded != 0.0f ? div_rn(1.0f, mul_rn(decoded, div_rn(1.0f, global))) : 0.0f;
}

// The scale of a block whose largest magnitude is amax (global: NVFP4's global scale, > 0).
MOE_A2A_HD BlockScale block_scale(QuantFormat f, float amax, float global) {
  BlockScale s{};
  if (f == QuantFormat::kNvfp4) {
    s.code = nvfp4_scale_code(amax, global);
    s.inverse = nvfp4_inverse(s.code, global);
    return s;
  }
  s.code = ue8m0_round_up(mul_rn(amax, f == QuantFormat::kMxfp8 ? kInvE4m3Max : kInvE2m1Max));
  s.inverse = ue8m0_inverse(s.code);
  return s;
}

// An element already multiplied by its block's inverse scale: the e4m3 byte
// (MXFP8) or the e2m1 code (MXFP4, NVFP4).
MOE_A2A_HD uint8_t quantize_element(QuantFormat f, float scaled) {
  return f == QuantFormat::kMxfp8 ? e4m3_from_float(scaled) : e2m1_from_float(scaled);
}

// ---- scale-factor layouts ---------------------------------------------------------
// rows x cols scales (cols = row elements / block). Linear: row-major. 128x4:
// tiles of 128 rows x 4 columns, 512 bytes each, row-major over tiles; inside
// a tile, row r sits at (r % 32) * 16 + (r / 32) * 4 and column c at c. 8x4:
// tiles of 8 x 4, 32 bytes, row r of a tile at r * 4. Swizzled extents pad
// rows to the tile height and columns to 4; the combine writes zeros there.

MOE_A2A_HD int64_t sf_padded_rows(SfLayout l, int64_t rows) {
  return l == SfLayout::k128x4 ? align_up(rows, 128) : l == SfLayout::k8x4 ? align_up(rows, 8) : rows;
}
MOE_A2A_HD int64_t sf_padded_cols(SfLayout l, int64_t cols) {
  return l == SfLayout::kLinear ? cols : align_up(cols, 4);
}
MOE_A2A_HD int64_t sf_extent(SfLayout l, int64_t rows, int64_t cols) {
  return sf_padded_rows(l, rows) * sf_padded_cols(l, cols);
}

MOE_A2A_HD int64_t sf_offset(SfLayout l, int64_t row, int64_t col, int64_t cols) {
  const int64_t col_tiles = (cols + 3) / 4;
  if (l == SfLayout::k128x4) {
    return (row / 128) * col_tiles * 512 + (col / 4) * 512 + (row % 32) * 16 + ((row % 128) / 32) * 4 + col % 4;
  }
  if (l == SfLayout::k8x4) return (row / 8) * col_tiles * 32 + (col / 4) * 32 + (row % 8) * 4 + col % 4;
  return row * cols + col;
}

// The padding entries of a swizzled extent: the padded rows (all columns),
// then the padded columns of the real rows. sf_padding_offset(i) for i in
// [0, sf_padding_count) is the offset of the i-th.
MOE_A2A_HD int64_t sf_padding_count(SfLayout l, int64_t rows, int64_t cols) {
  return sf_extent(l, rows, cols) - rows * cols;
}
MOE_A2A_HD int64_t sf_padding_offset(SfLayout l, int64_t rows, int64_t cols, int64_t i) {
  const int64_t padded_cols = sf_padded_cols(l, cols);
  const int64_t padding_rows_entries = (sf_padded_rows(l, rows) - rows) * padded_cols;
  if (i < padding_rows_entries) return sf_offset(l, rows + i / padded_cols, i % padded_cols, cols);
  const int64_t j = i - padding_rows_entries, extra = padded_cols - cols;
  return sf_offset(l, j / extra, cols + j % extra, cols);
}

// ---- the block-scaled low-precision transport (protocol.h's row layout) ----------
// A block's scale is the power of two 2^(code - 127) with the ue8m0 rounding
// above applied to amax / 448, so no element saturates and both the scaling
// and the pull's product with the e4m3 value are exact.
MOE_A2A_HD uint8_t low_precision_scale_code(float amax) { return ue8m0_round_up(mul_rn(amax, kInvE4m3Max)); }

}  // namespace moe_a2a
