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

// Elements per vector of the pull of e4m3 rows: 8 (8-byte loads). With 16,
// the sums of a lane (kSumUnroll x 16 fp32) spilled under the kernels'
// 64-register bound (ptxas: about 400 bytes of spill stores).
constexpr int kE4m3PullElems = 8;

// kElems elements moved as one vector access.
template <typename Bits, int kElems>
union Packed {
  typename VecOf<int(sizeof(Bits)) * kElems>::T raw;
  Bits v[kElems];
};

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
// payload of Payload's dtype; block-scaled rows' blocks are
// kLowPrecisionBlockPitch bytes apart, with their scale after them.
template <typename Payload, bool kScaled>
struct E4m3Rows {
  using Bits = uint8_t;
  using Source = Payload;
  static constexpr bool kLowPrecision = true;
  static constexpr bool kBlockScaled = kScaled;
  static constexpr int kMaxElems = kE4m3PullElems;
  static constexpr LowPrecision kMode = kScaled ? LowPrecision::kE4m3BlockScaled : LowPrecision::kE4m3;
  // v * sizeof(Raw) elements in: Raw is at most kMaxElems bytes and divides a block.
  template <typename Raw>
  __device__ static Raw load(const uint8_t* row, int v) {
    return *reinterpret_cast<const Raw*>(row + low_precision_element_offset(kMode, int64_t(v) * int64_t(sizeof(Raw))));
  }
  __device__ static float scale(const uint8_t* row, int64_t element, int64_t row_elems) {
    if constexpr (!kScaled) return 1.0f;
    return *reinterpret_cast<const float*>(row + low_precision_scale_offset(row_elems, element / kLowPrecisionBlock));
  }
  // The product with a power-of-two scale is exact.
  __device__ static float contribution(Bits b, float s) {
    return kScaled ? mul_rn(e4m3_to_float(b), s) : e4m3_to_float(b);
  }
};

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

// Blocks of a row that a warp converts per step of the low-precision
// staging: every lane's loads of a step are issued before it converts any of
// them, so a row pays one memory latency per kStageBlocks blocks, not one
// per block.
constexpr int kStageBlocks = 4;

// Stage of a low-precision combine: every active source s's first rows[s]
// rows (from p.payload, or in place) as e4m3 rows. A warp converts one row
// front to back, kStageBlocks blocks of 128 elements a step, 4 elements of a
// block a lane: every lane's loads of a step come before any lane's stores
// of it (__syncwarp), and protocol.h's row layout keeps the stores of blocks
// up to c off the payload bytes of the blocks after c, so the conversion may
// run in place. `vectors` (launch_combine: 4-element vectors aligned, rows of
// whole vectors): a lane loads its 4 elements as one vector and stores their
// 4 bytes as one word; else one element at a time.
template <typename In>
__device__ void stage_rows_e4m3(const CombineParams& p, int64_t row_bytes, const int32_t* rows, bool vectors) {
  using Source = typename In::Source;
  using SrcBits = typename Source::Bits;
  using SrcVec = Packed<SrcBits, 4>;
  const WorkspaceView& ws = p.ws;
  const int64_t T = p.runtime_max_tokens;
  __shared__ int64_t first_row[kMaxRanks + 1];  // staged rows before source s
  staged_row_starts(p, rows, first_row);
  uint8_t* region = ws.row(ws.ep_rank) + p.combine_offset;
  const uint8_t* source = p.payload != nullptr ? p.payload : region;
  const int lane = lane_id();
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  const int64_t elems = p.row_elems;
  int s = 0;  // a warp's rows only increase
  for (int64_t row = int64_t(blockIdx.x) * kWarps + warp_id(); row < first_row[ws.ep_size]; row += warps) {
    while (first_row[s + 1] <= row) ++s;
    const int64_t offset = (int64_t(s) * T + row - first_row[s]) * row_bytes;
    const SrcBits* src = reinterpret_cast<const SrcBits*>(source + offset);
    uint8_t* dst = region + offset;
    for (int64_t step = 0; step < elems; step += kStageBlocks * kLowPrecisionBlock) {
      float v[kStageBlocks][4];
#pragma unroll
      for (int b = 0; b < kStageBlocks; ++b) {
        const int64_t e = step + b * kLowPrecisionBlock + lane * 4;
        if (vectors) {
          SrcVec x;
          x.raw = e < elems ? *reinterpret_cast<const decltype(x.raw)*>(src + e) : decltype(x.raw){};
#pragma unroll
          for (int i = 0; i < 4; ++i) v[b][i] = Source::to_float(x.v[i]);
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) v[b][i] = e + i < elems ? Source::to_float(src[e + i]) : 0.0f;
        }
      }
      __syncwarp();
#pragma unroll
      for (int b = 0; b < kStageBlocks; ++b) {
        const int64_t block_first = step + b * kLowPrecisionBlock;
        if (block_first >= elems) break;  // the same for the whole warp
        float inverse = 1.0f, scale = 1.0f;
        if constexpr (In::kBlockScaled) {
          float amax = 0.0f;
#pragma unroll
          for (int i = 0; i < 4; ++i) amax = abs_max(amax, v[b][i]);
#pragma unroll
          for (int o = kWarpSize / 2; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(kFullWarp, amax, o));
          const uint8_t code = low_precision_scale_code(amax);
          inverse = ue8m0_inverse(code);
          scale = ue8m0_to_float(code);
        }
        float x[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) x[i] = In::kBlockScaled ? mul_rn(v[b][i], inverse) : v[b][i];
        const uint32_t bytes = uint32_t(e4m3x2_from_float(x[0], x[1])) | uint32_t(e4m3x2_from_float(x[2], x[3])) << 16;
        const int64_t e = block_first + lane * 4;
        if (vectors) {
          if (e < elems) *reinterpret_cast<uint32_t*>(dst + low_precision_element_offset(In::kMode, e)) = bytes;
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            if (e + i < elems) dst[low_precision_element_offset(In::kMode, e + i)] = uint8_t(bytes >> (8 * i));
          }
        }
        if (In::kBlockScaled && lane == 0) {
          *reinterpret_cast<float*>(dst + low_precision_scale_offset(elems, block_first / kLowPrecisionBlock)) = scale;
        }
      }
      __syncwarp();
    }
  }
}

// The quantizing epilogue of one vector of a pull item: vector v (kElems
// sums) of token t's row. The lanes holding the vectors of one block (a
// power of two of them, adjacent: the launch makes a row's lane group at
// least that wide) share its maximum through shuffles among themselves; the
// first of them stores the scale.
template <typename Round, int kElems>
__device__ void store_quantized(const CombineParams& p, int64_t t, int v, const float (&acc)[kElems]) {
  const int64_t block = quant_block(p.quant);
  const int64_t cols = p.row_elems / block;
  const int group = block > kElems ? int(block / kElems) : 1;
  const int lane = lane_id();
  const unsigned mask = group == kWarpSize ? kFullWarp : ((1u << group) - 1u) << (lane & ~(group - 1));
  float r[kElems];
  float amax = 0.0f;
#pragma unroll
  for (int e = 0; e < kElems; ++e) {
    r[e] = Round::to_float(Round::from_float(acc[e]));
    amax = abs_max(amax, r[e]);
  }
  for (int o = 1; o < group; o *= 2) amax = fmaxf(amax, __shfl_xor_sync(mask, amax, o));
  const BlockScale s = block_scale(p.quant, amax, p.global_scale);
  const int64_t element = int64_t(v) * kElems;
  if (lane % group == 0) p.output_scales[sf_offset(p.sf_layout, t, element / block, cols)] = s.code;
  if (p.quant == QuantFormat::kMxfp8) {
    union {
      typename VecOf<kElems>::T raw;
      uint8_t b[kElems];
    } y;
#pragma unroll
    for (int e = 0; e < kElems; ++e) y.b[e] = quantize_element(p.quant, mul_rn(r[e], s.inverse));
    reinterpret_cast<typename VecOf<kElems>::T*>(p.output + t * p.row_elems)[v] = y.raw;
  } else {
    if constexpr (kElems >= 2) {
      union {
        typename VecOf<kElems / 2>::T raw;
        uint8_t b[kElems / 2];
      } y;
#pragma unroll
      for (int e = 0; e < kElems; e += 2) {
        const uint8_t lo = quantize_element(p.quant, mul_rn(r[e], s.inverse));
        const uint8_t hi = quantize_element(p.quant, mul_rn(r[e + 1], s.inverse));
        y.b[e / 2] = uint8_t(lo | (hi << 4));
      }
      reinterpret_cast<typename VecOf<kElems / 2>::T*>(p.output + t * (p.row_elems / 2))[v] = y.raw;
    }
  }
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
