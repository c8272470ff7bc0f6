// The combine's number formats on the device: the element policies of the
// pull (payload dtypes and the e4m3 rows of use_low_precision), the
// low-precision staging and the quantizing epilogue. The arithmetic is
// csrc/quantize.h's, shared with the CPU kernels, so both give the same bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../quantize.h"
#include "device.cuh"

namespace moe_a2a {
namespace gpu {

// Elements per vector of the pull of e4m3 rows (16-byte loads, the plain
// rows' width) and vectors a lane per destination row: one, where the plain
// rows take two (two 16-element vectors, 32 fp32 sums a lane, would spill
// under the kernels' 64-register bound). Against 8-byte loads two a lane:
// 2092 -> 2050 us at ep 8 x 4096 tokens on an H200 (same-run A/B; the
// staging's vectors made the larger gain, docs/performance.md).
constexpr int kE4m3PullElems = 16;
constexpr int kE4m3PullUnroll = 1;

// kElems elements moved as one vector access.
template <typename Bits, int kElems>
union Packed {
  typename VecOf<int(sizeof(Bits)) * kElems>::T raw;
  Bits v[kElems];
};

// Word i of a 4-, 8- or 16-byte vector.
__device__ __forceinline__ uint32_t vector_word(uint32_t raw, int) { return raw; }
__device__ __forceinline__ uint32_t vector_word(uint2 raw, int i) { return i == 0 ? raw.x : raw.y; }
__device__ __forceinline__ uint32_t vector_word(uint4 raw, int i) {
  return i == 0 ? raw.x : i == 1 ? raw.y : i == 2 ? raw.z : raw.w;
}

// Element types: bit storage plus the exact conversions (no implicit half
// conversions: torch builds with __CUDA_NO_HALF_CONVERSIONS__ and friends).
// The pull loads vector v of a row with load() and adds contribution() of
// each element (scale: the element's block scale, 1 where there is none).
template <typename Self, typename B>
struct PlainElements {
  using Bits = B;
  static constexpr bool kLowPrecision = false;
  static constexpr bool kBlockScaled = false;
  static constexpr int kMaxElems = 16 / int(sizeof(B));
  template <typename Raw>
  __device__ static Raw load(const uint8_t* row, int v) {
    return reinterpret_cast<const Raw*>(row)[v];
  }
  __device__ static float scale(const uint8_t*, int64_t, int64_t) { return 1.0f; }
  __device__ static float contribution(Bits b, float) { return Self::to_float(b); }
};
struct F32 : PlainElements<F32, float> {
  __device__ static float to_float(Bits b) { return b; }
  __device__ static Bits from_float(float f) { return f; }
};
struct F16 : PlainElements<F16, uint16_t> {
  __device__ static float to_float(Bits b) { return __half2float(__ushort_as_half(b)); }
  __device__ static Bits from_float(float f) { return __half_as_ushort(__float2half_rn(f)); }
};
struct BF16 : PlainElements<BF16, uint16_t> {
  __device__ static float to_float(Bits b) { return __bfloat162float(__ushort_as_bfloat16(b)); }
  __device__ static Bits from_float(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
};

// The e4m3 rows of a low-precision combine (protocol.h), staged from a
// payload of Payload's dtype; block-scaled rows' blocks in groups of
// kLowPrecisionGroupBlocks, each group's scale codes after its elements.
template <typename Payload, bool kScaled>
struct E4m3Rows {
  using Bits = uint8_t;
  using Source = Payload;
  static constexpr bool kLowPrecision = true;
  static constexpr bool kBlockScaled = kScaled;
  static constexpr int kMaxElems = kE4m3PullElems;
  static constexpr LowPrecision kMode = kScaled ? LowPrecision::kE4m3BlockScaled : LowPrecision::kE4m3;
  // Byte of element i, in 32 bits: rows are below kMaxKernelRowBytes.
  __device__ static int element_offset(int i) { return low_precision_element_offset(kMode, i); }
  // v * sizeof(Raw) elements in: Raw is at most kMaxElems bytes and divides a block.
  template <typename Raw>
  __device__ static Raw load(const uint8_t* row, int v) {
    return *reinterpret_cast<const Raw*>(row + element_offset(v * int(sizeof(Raw))));
  }
  // The scale of the block of `element`, in 32 bits.
  __device__ static float scale(const uint8_t* row, int64_t element, int64_t row_elems) {
    if constexpr (!kScaled) return 1.0f;
    return ue8m0_to_float(row[low_precision_scale_offset(int(row_elems), int(element) / int(kLowPrecisionBlock))]);
  }
  // The product with a power-of-two scale is exact.
  __device__ static float contribution(Bits b, float s) {
    return kScaled ? mul_rn(e4m3_to_float(b), s) : e4m3_to_float(b);
  }
};

// Whether a combine of In's rows may pull the own source's rows from its
// unconverted 16-bit payload (launch_combine: with 16-element pull vectors
// and 16-byte aligned rows) instead of staging them: plain e4m3 rows, whose
// element is the e4m3 value of the payload's, found per element (the block-
// scaled ones would need the block's maximum across lanes).
template <typename In>
struct OwnRowsUnstaged {
  static constexpr bool value = false;
};
template <typename Payload>
struct OwnRowsUnstaged<E4m3Rows<Payload, false>> {
  static constexpr bool value = sizeof(typename Payload::Bits) == 2;
};

// Adds to acc the 16 values of an own row's pull vector read from its 16-bit
// payload (lo: elements 0-7, hi: 8-15) as the staging and the pull of an
// e4m3 row give them: each converted to its e4m3 code (e4m3x4_from_float,
// NaN pinned) and back (e4m3x4_to_float), so the sums keep their bits. Four
// at a time: the 16 values at once held more registers (the kernels with
// bf16 outputs spilled 20 bytes instead of 12).
template <typename Payload>
__device__ __forceinline__ void add_own_e4m3(uint4 lo, uint4 hi, float (&acc)[16]) {
  Packed<typename Payload::Bits, 8> a, b;
  a.raw = lo;
  b.raw = hi;
#pragma unroll
  for (int e = 0; e < 16; e += 4) {
    const auto& src = e < 8 ? a : b;
    const int i = e % 8;
    float q[4];
    e4m3x4_to_float(e4m3x4_from_float(Payload::to_float(src.v[i]), Payload::to_float(src.v[i + 1]),
                                      Payload::to_float(src.v[i + 2]), Payload::to_float(src.v[i + 3])),
                    q);
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[e + j] += q[j];
  }
}

// A quantized output (p.quant): the sums rounded to Round's dtype, then
// block-quantized. Bits only sizes the unused plain-output vector.
template <typename R>
struct QuantizedOut {
  using Bits = uint16_t;
  using Round = R;
};
template <typename T>
struct IsQuantized {
  static constexpr bool value = false;
};
template <typename Round>
struct IsQuantized<QuantizedOut<Round>> {
  static constexpr bool value = true;
};

// Source chunks (a warp's 16-byte vectors, one a lane) that a warp converts
// per step of the low-precision staging: every lane's loads of a step are
// issued before it converts any of them, so a row pays one memory latency
// per step, not one per chunk.
constexpr int kStageChunks = 4;

// stage_rows_e4m3's loop over its items: rows, or with kByStep each step of
// a row (first_row: staged rows before source s, as staged_row_starts gives
// them). Two instances, so that the rows' loop pays nothing for the steps'.
template <typename In, bool kByStep>
__device__ void stage_items_e4m3(const CombineParams& p, int64_t row_bytes, const int64_t* first_row, bool vectors) {
  using Source = typename In::Source;
  using SrcBits = typename Source::Bits;
  constexpr int kLaneElems = 16 / int(sizeof(SrcBits));
  constexpr int kChunk = kWarpSize * kLaneElems;
  constexpr int kLanesPerBlock = int(kLowPrecisionBlock) / kLaneElems;
  constexpr int kBlocksPerChunk = kChunk / int(kLowPrecisionBlock);
  constexpr int kGroupBlocks = int(kLowPrecisionGroupBlocks);
  static_assert(kChunk % kLowPrecisionBlock == 0, "a lane's elements lie in one block");
  static_assert(kLowPrecisionGroup % kChunk == 0, "a chunk's blocks lie in one group");
  static_assert(kGroupBlocks <= kWarpSize, "a lane per block of a group");
  constexpr int kStep = kStageChunks * kChunk;
  static_assert(kLowPrecisionGroup % kStep == 0, "a step's blocks lie in one group");
  using SrcVec = Packed<SrcBits, kLaneElems>;
  using Codes = typename VecOf<kLaneElems>::T;
  const WorkspaceView& ws = p.ws;
  const int64_t T = p.runtime_max_tokens;
  uint8_t* region = ws.row(ws.ep_rank) + p.combine_offset;
  const uint8_t* source = p.payload != nullptr ? p.payload : region;
  const int lane = lane_id();
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  const int elems = static_cast<int>(p.row_elems);  // rows are below kMaxKernelRowBytes
  [[maybe_unused]] const int blocks = (elems + int(kLowPrecisionBlock) - 1) / int(kLowPrecisionBlock);
  const int items_per_row = kByStep ? (elems + kStep - 1) / kStep : 1;
  const int64_t items = first_row[ws.ep_size] * items_per_row;
  int s = 0;  // a warp's rows only increase
  for (int64_t item = int64_t(blockIdx.x) * kWarps + warp_id(); item < items; item += warps) {
    const int64_t row = kByStep ? item / items_per_row : item;
    const int first_step = kByStep ? int(item - row * items_per_row) * kStep : 0;
    const int end = kByStep ? min(elems, first_step + kStep) : elems;
    while (first_row[s + 1] <= row) ++s;
    const int64_t offset = (int64_t(s) * T + row - first_row[s]) * row_bytes;
    const SrcBits* src = reinterpret_cast<const SrcBits*>(source + offset);
    uint8_t* dst = region + offset;
    // Block-scaled: lane j's, the code of block j of the group being
    // converted; the item's codes not stored yet are those of its group's
    // blocks from store_from on.
    [[maybe_unused]] uint32_t held = 0;
    [[maybe_unused]] int store_from = kByStep ? (first_step / int(kLowPrecisionBlock)) % kGroupBlocks : 0;
    for (int step = first_step; step < end; step += kStep) {
      SrcVec x[kStageChunks];
#pragma unroll
      for (int c = 0; c < kStageChunks; ++c) {
        const int e = step + c * kChunk + lane * kLaneElems;
        if (vectors) {
          x[c].raw = e < elems ? *reinterpret_cast<const decltype(x[c].raw)*>(src + e) : decltype(x[c].raw){};
        } else {
#pragma unroll
          for (int i = 0; i < kLaneElems; ++i) x[c].v[i] = e + i < elems ? src[e + i] : SrcBits(0);
        }
      }
      __syncwarp();
#pragma unroll
      for (int c = 0; c < kStageChunks; ++c) {
        const int e = step + c * kChunk + lane * kLaneElems;
        if (step + c * kChunk >= end) break;  // the same for the whole warp
        float v[kLaneElems];
#pragma unroll
        for (int i = 0; i < kLaneElems; ++i) v[i] = Source::to_float(x[c].v[i]);
        if constexpr (In::kBlockScaled) {
          float amax = 0.0f;
#pragma unroll
          for (int i = 0; i < kLaneElems; ++i) amax = abs_max(amax, v[i]);
#pragma unroll
          for (int o = kLanesPerBlock / 2; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(kFullWarp, amax, o));
          const uint8_t code = low_precision_scale_code(amax);
          const float inverse = ue8m0_inverse(code);
#pragma unroll
          for (int i = 0; i < kLaneElems; ++i) v[i] = mul_rn(v[i], inverse);
          // The chunk's block b (its first lane's code) to lane in_group + b.
          const int first_block = (step + c * kChunk) / int(kLowPrecisionBlock);
          const int in_group = first_block % kGroupBlocks;
          const int b = lane - in_group;
          const bool mine = b >= 0 && b < kBlocksPerChunk;
          const uint32_t got = __shfl_sync(kFullWarp, uint32_t(code), mine ? b * kLanesPerBlock : 0);
          if (mine) held = got;
          // The group's last chunk, the row's or the item's: the codes of
          // the item's blocks of the group, after the group's elements.
          const int upto = in_group + kBlocksPerChunk;
          if (upto == kGroupBlocks || step + (c + 1) * kChunk >= end) {
            const int block = first_block - in_group + lane;
            if (lane >= store_from && lane < upto && block < blocks) {
              dst[low_precision_scale_offset(elems, block)] = uint8_t(held);
            }
            if constexpr (kByStep) store_from = upto % kGroupBlocks;
          }
        }
        union {
          Codes raw;
          uint32_t w[kLaneElems / 4];
        } y;
#pragma unroll
        for (int j = 0; j < kLaneElems / 4; ++j)
          y.w[j] = e4m3x4_from_float(v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3]);
        if (vectors) {
          if (e < elems) *reinterpret_cast<Codes*>(dst + In::element_offset(e)) = y.raw;
        } else {
#pragma unroll
          for (int i = 0; i < kLaneElems; ++i) {
            if (e + i < elems) dst[In::element_offset(e + i)] = uint8_t(y.w[i / 4] >> (8 * (i % 4)));
          }
        }
      }
      __syncwarp();
    }
  }
}

// Stage of a low-precision combine: every active source s's first rows[s]
// rows (from p.payload, or in place) as e4m3 rows, but for source `skipped`
// (the own one where the pull reads its rows unconverted: OwnRowsUnstaged;
// else -1). A step converts kStageChunks chunks of 32 source vectors of a
// row, a lane's vector 16 bytes of source elements (8 of 16 bits, 4 of 32),
// all in one 128-element block: every lane's loads of a step come before any
// lane's stores of it (__syncwarp). A warp converts a row front to back, so
// that protocol.h's row layout keeps the stores of elements and groups off
// the payload bytes not loaded yet when the conversion runs in place; from
// p.payload, in calls of at most two rows a warp, every step is a warp's
// item of its own instead (a 7168-element row of bf16: 7 steps on 7 warps
// at once, not 7 dependent steps of one warp). A block's lanes (16 or 32,
// adjacent) share its maximum through shuffles; lane j of the warp keeps the
// scale code of block j of the group, and at the group's end, or the item's,
// the lanes of the item's blocks store their codes, one byte each (a row's
// warp all 16 of a group at once, once its last chunk is loaded). `vectors`
// (launch_combine: rows of whole 16-byte vectors, aligned in the payload and
// the region): a lane loads its elements as one vector and stores their
// codes as one; else one element at a time.
template <typename In>
__device__ void stage_rows_e4m3(const CombineParams& p, int64_t row_bytes, const int32_t* rows, bool vectors,
                                int skipped) {
  __shared__ int64_t first_row[kMaxRanks + 1];  // staged rows before source s
  staged_row_starts(p, rows, skipped, first_row);
  // Steps as items only for few rows a warp: at ep 8 x 4096 tokens on an
  // H200 the block-scaled staging by steps took 1778 us against 1638 by rows
  // (two warps writing the halves of a group's codes and of the sectors
  // between groups); at 128 tokens (680 rows on 512 warps) 79.6 against 86.3.
  // Not where the payload is the combine region itself (converted in place,
  // as without a payload): a row's steps on other warps would store codes
  // over the elements of an earlier step before it loaded them.
  const uint8_t* region = p.ws.row(p.ws.ep_rank) + p.combine_offset;
  if (p.payload != nullptr && p.payload != region && first_row[p.ws.ep_size] <= 2 * int64_t(gridDim.x) * kWarps) {
    stage_items_e4m3<In, true>(p, row_bytes, first_row, vectors);
  } else {
    stage_items_e4m3<In, false>(p, row_bytes, first_row, vectors);
  }
}

// NVFP4's block inverse of each scale code (nvfp4_inverse) for this call's
// global scale, in the CTA's shared memory: the epilogue's two fp32
// divisions a block, each a dozen instructions, become one shared load.
// Filled by fill_nvfp4_inverse_table before a barrier that precedes the pull.
__device__ __forceinline__ float* nvfp4_inverse_table() {
  __shared__ float table[256];
  return table;
}
__device__ inline void fill_nvfp4_inverse_table(const CombineParams& p) {
  if (p.quant != QuantFormat::kNvfp4) return;
  for (int code = threadIdx.x; code < 256; code += kThreads) {
    nvfp4_inverse_table()[code] = nvfp4_inverse(uint8_t(code), p.global_scale);
  }
}

// The quantizing epilogue of one vector of a pull item in format kFormat:
// vector v (kElems sums) of token t's row. The lanes holding the vectors of
// one block (kGroup of them, adjacent: the launch makes a row's lane group
// at least that wide) share its maximum through shuffles among themselves;
// the first of them stores the scale. The format is a template argument so
// that the block size, the lane group and the scale recipe are constants:
// read from p.quant at run time, they cost two 64-bit divisions and a loop
// of shuffles per vector (Nsight Compute, ep 1 x 4096 tokens on an H200:
// the fused MXFP8 combine 46.2M warp instructions then, 35.5M now, the bf16
// combine 17.0M).
template <typename Round, int kElems, QuantFormat kFormat>
__device__ __forceinline__ void store_quantized_as(const CombineParams& p, int64_t t, int v,
                                                   const float (&acc)[kElems]) {
  constexpr int kBlock = int(quant_block(kFormat));
  constexpr int kGroup = kBlock > kElems ? kBlock / kElems : 1;
  static_assert(kBlock % kElems == 0 || kElems % kBlock == 0, "a vector holds whole blocks or part of one");
  static_assert(kElems <= kBlock, "one scale per vector");
  const int lane = lane_id();
  const unsigned mask = kGroup == kWarpSize ? kFullWarp : ((1u << kGroup) - 1u) << (lane & ~(kGroup - 1));
  float r[kElems];
  float amax = 0.0f;
#pragma unroll
  for (int e = 0; e < kElems; ++e) {
    r[e] = Round::to_float(Round::from_float(acc[e]));
    amax = abs_max(amax, r[e]);
  }
#pragma unroll
  for (int o = 1; o < kGroup; o *= 2) amax = fmaxf(amax, __shfl_xor_sync(mask, amax, o));
  BlockScale s;
  if constexpr (kFormat == QuantFormat::kNvfp4) {
    s.code = nvfp4_scale_code(amax, p.global_scale);
    s.inverse = nvfp4_inverse_table()[s.code];
  } else {
    s = block_scale(kFormat, amax, p.global_scale);
  }
  if (lane % kGroup == 0) {
    // Element and block indices in 32 bits: rows are below kMaxKernelRowBytes.
    const int cols = static_cast<int>(p.row_elems) / kBlock;
    p.output_scales[sf_offset(p.sf_layout, t, (v * kElems) / kBlock, cols)] = s.code;
  }
  if constexpr (kFormat == QuantFormat::kMxfp8) {
    static_assert(kElems % 4 == 0, "four codes a conversion");
    union {
      typename VecOf<kElems>::T raw;
      uint32_t w[kElems / 4];
    } y;
    // Four codes a conversion (e4m3x4_from_float: quantize_element's bytes).
#pragma unroll
    for (int e = 0; e < kElems; e += 4) {
      y.w[e / 4] = e4m3x4_from_float(mul_rn(r[e], s.inverse), mul_rn(r[e + 1], s.inverse), mul_rn(r[e + 2], s.inverse),
                                     mul_rn(r[e + 3], s.inverse));
    }
    reinterpret_cast<typename VecOf<kElems>::T*>(p.output + t * p.row_elems)[v] = y.raw;
  } else {
    static_assert(kElems % 2 == 0, "two codes a byte");
    union {
      typename VecOf<kElems / 2>::T raw;
      uint8_t b[kElems / 2];
    } y;
#pragma unroll
    for (int e = 0; e < kElems; e += 2) {
      const uint8_t lo = quantize_element(kFormat, mul_rn(r[e], s.inverse));
      const uint8_t hi = quantize_element(kFormat, mul_rn(r[e + 1], s.inverse));
      y.b[e / 2] = uint8_t(lo | (hi << 4));
    }
    reinterpret_cast<typename VecOf<kElems / 2>::T*>(p.output + t * (p.row_elems / 2))[v] = y.raw;
  }
}

// store_quantized_as for the call's format (the same for the whole grid).
template <typename Round, int kElems>
__device__ __forceinline__ void store_quantized(const CombineParams& p, int64_t t, int v, const float (&acc)[kElems]) {
  if (p.quant == QuantFormat::kMxfp8) return store_quantized_as<Round, kElems, QuantFormat::kMxfp8>(p, t, v, acc);
  if (p.quant == QuantFormat::kMxfp4) return store_quantized_as<Round, kElems, QuantFormat::kMxfp4>(p, t, v, acc);
  store_quantized_as<Round, kElems, QuantFormat::kNvfp4>(p, t, v, acc);
}

// The padding entries of a swizzled scale layout get zeros (grid-stride).
__device__ inline void zero_scale_padding(const CombineParams& p) {
  const int64_t cols = p.row_elems / quant_block(p.quant);
  const int64_t n = sf_padding_count(p.sf_layout, p.local_num_tokens, cols);
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads) {
    p.output_scales[sf_padding_offset(p.sf_layout, p.local_num_tokens, cols, i)] = 0;
  }
}

}  // namespace gpu
}  // namespace moe_a2a
