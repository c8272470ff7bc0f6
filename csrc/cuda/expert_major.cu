// The expert-major kernels (protocol.h, ExpertMajorLayout): the build that
// regroups a dispatch's received rows by local expert, and the combine that
// pulls each (token, expert) pair's row through the expert rank's pair map.
//
// Build, in two grids on the rank's stream (no peer is waited for, and
// nothing but the own row is touched):
//   A. index: CTA e handles local expert e. Each warp counts the pairs of e
//      in its slice of the received rows (rows in (source, slot) order, the
//      slices in that order), the CTA scans the warps' counts, and each warp
//      then walks its slice in rounds of 32 rows with a warp scan for the
//      rows' first positions: the pairs' rows i are those of the CPU's
//      sequential loop, whatever the timing. It writes the pair map entries
//      of e's pairs, pair_src, ids, weights, counts[e] and e's padding; the
//      pair map entries after a row's last pair are written by the CTA of the
//      row's smallest local expert (CTA 0 for a row without one).
//   B. copy: every (pair, segment) of every user payload, grid-strided,
//      from the rank-major plane row pair_src names to the pair's row.
// Combine: combine.cu's protocol step for step (the same flags and shares,
// epochs and pull_done), staging the expert outputs' valid rows [e, i] to the
// same index of the own combine region and pulling, per token and element,
// acc = acc + w * x with the product rounded to fp32 (__fmul_rn, __fadd_rn:
// no fused multiply-add), over the route's ranks ascending and each rank's
// pair map entries in order: the CPU's arithmetic, so the bits agree.
#include <limits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "combine_formats.cuh"
#include "device.cuh"

namespace moe_a2a {
namespace gpu {
namespace {

// Vectors of a pull in flight per lane.
constexpr int kEmSumUnroll = 2;

__device__ __forceinline__ int64_t load_expert_id(const uint8_t* plane, bool int64, int64_t index) {
  return int64 ? reinterpret_cast<const int64_t*>(plane)[index] : reinterpret_cast<const int32_t*>(plane)[index];
}

// The received rows of every source before source s (rows[s] clamped as
// received_rows says), in shared memory: row r of the flat order is row
// r - first[s] of source s. Every thread of the CTA calls it.
__device__ void received_row_starts(const WorkspaceView& ws, int64_t T, int64_t* first) {
  const uint8_t* own = ws.row(ws.ep_rank);
  if (threadIdx.x == 0) {
    int64_t total = 0;
    for (int s = 0; s < ws.ep_size; ++s) {
      first[s] = total;
      total += received_rows(*reinterpret_cast<const int32_t*>(own + recv_count_offset(s)), T);
    }
    first[ws.ep_size] = total;
  }
  __syncthreads();
}

// The plane row (s * T + j) of flat received row `row`.
__device__ __forceinline__ int64_t plane_row(const int64_t* first, int ep_size, int64_t T, int64_t row) {
  int s = 0;
  while (s + 1 < ep_size && first[s + 1] <= row) ++s;
  return int64_t(s) * T + (row - first[s]);
}

// A. index (see the top). Grid: one CTA per local expert.
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm)
    build_index_kernel(const __grid_constant__ ExpertMajorBuildParams p) {
  wait_for_previous_grid();
  const WorkspaceView& ws = p.ws;
  uint8_t* own = ws.row(ws.ep_rank);
  const ExpertMajorLayout& l = p.layout;
  const int64_t T = p.runtime_max_tokens, K = p.top_k, M = l.tokens_per_expert;
  const int64_t e = blockIdx.x;
  const uint32_t dispatch_epoch = *header_word<uint32_t>(own, kHdrDispatchEpoch);
  const uint32_t combine_epoch = *header_word<uint32_t>(own, kHdrCombineEpoch);
  const uint32_t error_code = load_error_code(own);
  const uint32_t mismatch =
      threadIdx.x == 0
          ? ((*header_word<int32_t>(own, kHdrLastRuntimeMax) != T ? uint32_t(kMismatchRuntimeMax) : 0u) |
             (*header_word<int32_t>(own, kHdrLastTopK) != K ? uint32_t(kMismatchTopK) : 0u) |
             (*header_word<int64_t>(own, kHdrLastDispatchEnd) != p.dispatch_end ? uint32_t(kMismatchOffset) : 0u))
          : 0u;
  if (!may_proceed(own, p.mailbox, error_code, dispatch_epoch == combine_epoch + 1, mismatch)) return;

  __shared__ int64_t first[kMaxRanks + 1];
  __shared__ int64_t warp_base[kWarps + 1];
  received_row_starts(ws, T, first);
  const int64_t rows = first[ws.ep_size];
  const int lane = lane_id(), warp = warp_id();
  const int64_t per_warp = (rows + kWarps - 1) / kWarps;
  const int64_t begin = min(rows, int64_t(warp) * per_warp);
  const int64_t end = min(rows, begin + per_warp);
  const uint8_t* id_plane = own + p.ids_offset;
  const int64_t expert = p.first_expert + e;

  // Pass 1: the pairs of e in each warp's slice.
  uint32_t mine = 0;
  for (int64_t row = begin + lane; row < end; row += kWarpSize) {
    const int64_t r = plane_row(first, ws.ep_size, T, row);
    for (int64_t k = 0; k < K; ++k) mine += load_expert_id(id_plane, p.ids_int64, r * K + k) == expert ? 1u : 0u;
  }
  mine = warp_sum(mine);
  if (lane == 0) warp_base[warp] = mine;
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t total = 0;
    for (int w = 0; w < kWarps; ++w) {
      const int64_t count = warp_base[w];
      warp_base[w] = total;
      total += count;
    }
    warp_base[kWarps] = total;
  }
  __syncthreads();

  // Pass 2: each pair's row, in (s, j, k) order.
  int32_t* pair_map = reinterpret_cast<int32_t*>(own + l.pair_map_offset);
  int32_t* pair_src = reinterpret_cast<int32_t*>(own + l.pair_src_offset);
  int32_t* ids = reinterpret_cast<int32_t*>(own + l.ids_offset);
  float* weights = reinterpret_cast<float*>(own + l.weights_offset);
  const float* weight_plane = p.weights_offset >= 0 ? reinterpret_cast<const float*>(own + p.weights_offset) : nullptr;
  int64_t base = warp_base[warp];
  for (int64_t round = begin; round < end; round += kWarpSize) {
    const int64_t row = round + lane;
    const bool valid = row < end;
    const int64_t r = valid ? plane_row(first, ws.ep_size, T, row) : 0;
    uint32_t matches = 0;
    int n_local = 0;
    int64_t smallest = p.num_local;
    if (valid) {
      for (int64_t k = 0; k < K; ++k) {
        const int64_t local = load_expert_id(id_plane, p.ids_int64, r * K + k) - p.first_expert;
        if (local < 0 || local >= p.num_local) continue;
        ++n_local;
        smallest = min(smallest, local);
        matches += local == e ? 1u : 0u;
      }
    }
    // Inclusive warp scan of the matches: this lane's first position follows the lanes below.
    uint32_t inclusive = matches;
#pragma unroll
    for (int offset = 1; offset < kWarpSize; offset *= 2) {
      const uint32_t below = __shfl_up_sync(kFullWarp, inclusive, offset);
      if (lane >= offset) inclusive += below;
    }
    const uint32_t round_total = __shfl_sync(kFullWarp, inclusive, kWarpSize - 1);
    int64_t i = base + (inclusive - matches);
    if (matches != 0) {
      for (int64_t k = 0; k < K; ++k) {
        const int64_t id = load_expert_id(id_plane, p.ids_int64, r * K + k);
        if (id != expert) continue;
        // q: the row's local pairs before (e, k) in ascending (expert, slot) order.
        int q = 0;
        for (int64_t k2 = 0; k2 < K; ++k2) {
          const int64_t local = load_expert_id(id_plane, p.ids_int64, r * K + k2) - p.first_expert;
          if (local < 0 || local >= p.num_local) continue;
          q += (local < e || (local == e && k2 < k)) ? 1 : 0;
        }
        if (i < M) {
          const int64_t at = e * M + i;
          pair_src[at] = static_cast<int32_t>(r);
          ids[at] = static_cast<int32_t>(e);
          weights[at] = weight_plane != nullptr ? weight_plane[r * K + k] : 1.0f;
          pair_map[r * K + q] = static_cast<int32_t>(at);
        } else {
          pair_map[r * K + q] = kNoPair;
        }
        ++i;
      }
    }
    if (valid && (n_local != 0 ? smallest == e : e == 0)) {
      for (int64_t q = n_local; q < K; ++q) pair_map[r * K + q] = kNoPair;
    }
    base += round_total;
  }

  // Counts, padding, drops; CTA 0 records the build.
  const int64_t total = warp_base[kWarps];
  const int64_t count = min(total, M);
  for (int64_t i = count + threadIdx.x; i < M; i += kThreads) {
    ids[e * M + i] = kNoPair;
    weights[e * M + i] = 0.0f;
  }
  if (threadIdx.x == 0) {
    reinterpret_cast<int32_t*>(own + l.counts_offset)[e] = static_cast<int32_t>(count);
    if (total > M) {
      atomicAdd(header_word<unsigned long long>(own, kHdrDroppedPairCount), static_cast<unsigned long long>(total - M));
    }
    if (e == 0) {
      *header_word<int64_t>(own, kHdrExpertMajorEnd) = l.combine_offset;
      *header_word<int32_t>(own, kHdrExpertMajorTokens) = static_cast<int32_t>(M);
      *header_word<uint32_t>(own, kHdrExpertMajorEpoch) = dispatch_epoch;
    }
  }
}

// The valid rows before local expert e (prefix[e]; prefix[num_local] = all),
// in shared memory, from the own counts clamped to [0, M]. Every thread calls it.
__device__ void pair_starts(const uint8_t* own, int64_t counts_offset, int64_t num_local, int64_t M, int32_t* prefix) {
  const int32_t* counts = reinterpret_cast<const int32_t*>(own + counts_offset);
  for (int64_t e = threadIdx.x; e < num_local; e += kThreads) {
    const int64_t count = counts[e] > 0 ? int64_t(counts[e]) : 0;
    prefix[e + 1] = static_cast<int32_t>(count < M ? count : M);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    prefix[0] = 0;
    for (int64_t e = 0; e < num_local; ++e) prefix[e + 1] += prefix[e];
  }
  __syncthreads();
}

// The expert of flat valid pair `pair`: the last e with prefix[e] <= pair.
__device__ __forceinline__ int64_t expert_of_pair(const int32_t* prefix, int64_t num_local, int64_t pair) {
  int64_t lo = 0, hi = num_local - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (prefix[mid] <= pair) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

struct BuildCopyArgs {
  ExpertMajorBuildParams p;
  CopyPlan plan[kMaxPayloads];
};

// B. copy (see the top). Runs only after its own index grid: the build
// record's epoch is this dispatch's.
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm) build_copy_kernel(const __grid_constant__ BuildCopyArgs a) {
  wait_for_previous_grid();
  const ExpertMajorBuildParams& p = a.p;
  const ExpertMajorLayout& l = p.layout;
  uint8_t* own = p.ws.row(p.ws.ep_rank);
  if (*header_word<volatile uint32_t>(own, kHdrErrorCode) != kErrorNone) return;
  const uint32_t dispatch_epoch = *header_word<uint32_t>(own, kHdrDispatchEpoch);
  if (*header_word<uint32_t>(own, kHdrExpertMajorEpoch) != dispatch_epoch ||
      *header_word<uint32_t>(own, kHdrCombineEpoch) + 1 != dispatch_epoch) {
    return;  // the index grid refused the call (and recorded why)
  }
  __shared__ int32_t prefix[kMaxLocalExperts + 1];
  const int64_t M = l.tokens_per_expert;
  pair_starts(own, l.counts_offset, p.num_local, M, prefix);
  const int64_t pairs = prefix[p.num_local];
  const int32_t* pair_src = reinterpret_cast<const int32_t*>(own + l.pair_src_offset);
  for (int i = 0; i < p.num_payloads; ++i) {
    const int64_t bytes = p.payload_row_bytes[i];
    if (bytes == 0) continue;
    const CopyPlan& plan = a.plan[i];
    const int groups_per_cta = kThreads >> plan.lane_bits;
    const int64_t groups = int64_t(gridDim.x) * groups_per_cta;
    const int lane_in_group = threadIdx.x & (plan.lanes - 1);
    const uint8_t* from = own + p.payload_offset[i];
    uint8_t* to = own + l.payload_offset[i];
    for (int64_t item = int64_t(blockIdx.x) * groups_per_cta + (threadIdx.x >> plan.lane_bits);
         item < pairs * plan.segments; item += groups) {
      const int64_t pair = plan.segments == 1 ? item : item / plan.segments;
      const int segment = plan.segments == 1 ? 0 : static_cast<int>(item % plan.segments);
      const int64_t e = expert_of_pair(prefix, p.num_local, pair);
      const int64_t at = e * M + (pair - prefix[e]);
      copy_segment_any(
          from + int64_t(pair_src[at]) * bytes, plan, segment, lane_in_group,
          [](int k) { return k == 0 ? 0 : kRouteEnd; }, [&](int32_t) { return to + at * bytes; });
    }
  }
}

// ---- combine ------------------------------------------------------------------------------

struct EmCombineArgs {
  ExpertMajorCombineParams p;
  SyncSettings sync_settings;
  int64_t row_bytes;
  bool stage;
  CopyPlan stage_plan;
  int pull_elems;
  int pull_lane_bits;
  int pull_segments;
};

// 1. Stage: rows [e, i < counts[e]] of the payload to the same index of the
// own combine region; items are (valid pair, segment), grid-strided.
__device__ void stage_expert_rows(const EmCombineArgs& a, const int32_t* prefix) {
  const CombineParams& c = a.p.c;
  const int64_t M = a.p.layout.tokens_per_expert;
  uint8_t* region = c.ws.row(c.ws.ep_rank) + c.combine_offset;
  const CopyPlan& plan = a.stage_plan;
  const int groups_per_cta = kThreads >> plan.lane_bits;
  const int64_t groups = int64_t(gridDim.x) * groups_per_cta;
  const int lane_in_group = threadIdx.x & (plan.lanes - 1);
  const int64_t items = int64_t(prefix[a.p.num_local]) * plan.segments;
  for (int64_t item = int64_t(blockIdx.x) * groups_per_cta + (threadIdx.x >> plan.lane_bits); item < items;
       item += groups) {
    const int64_t pair = plan.segments == 1 ? item : item / plan.segments;
    const int segment = plan.segments == 1 ? 0 : static_cast<int>(item % plan.segments);
    const int64_t e = expert_of_pair(prefix, a.p.num_local, pair);
    const int64_t offset = (e * M + pair - prefix[e]) * a.row_bytes;
    copy_segment_any(
        c.payload + offset, plan, segment, lane_in_group, [](int k) { return k == 0 ? 0 : kRouteEnd; },
        [&](int32_t) { return region + offset; });
  }
}

// 4. Pull: out[t] = sum over the route of t (ascending rank d) and over d's
// pair map entries for t (in order) of w * row. Items are (token, segment)
// pairs, one per group of 1 << pull_lane_bits lanes, grid-strided.
template <typename In, typename Out, int kElems>
__device__ void pull_expert_rows(const EmCombineArgs& a) {
  using InVec = Packed<typename In::Bits, kElems>;
  using OutVec = Packed<typename Out::Bits, kElems>;
  using InRaw = decltype(InVec::raw);
  using OutRaw = decltype(OutVec::raw);
  const CombineParams& c = a.p.c;
  const ExpertMajorLayout& l = a.p.layout;
  const WorkspaceView& ws = c.ws;
  const uint8_t* own = ws.row(ws.ep_rank);
  const int32_t* routes = reinterpret_cast<const int32_t*>(own + c.route_offset);
  const int64_t T = c.runtime_max_tokens, K = c.top_k;
  const int64_t rows = l.local_experts * l.tokens_per_expert;
  const int vectors = static_cast<int>(c.row_elems / kElems);
  const int64_t source_row = int64_t(ws.ep_rank) * T;
  const int lanes = 1 << a.pull_lane_bits;
  const int lane_in_group = threadIdx.x & (lanes - 1);
  const int segments = a.pull_segments;
  const int64_t items = c.local_num_tokens * segments;
  const int groups_per_cta = kThreads >> a.pull_lane_bits;
  const int64_t groups = int64_t(gridDim.x) * groups_per_cta;
  for (int64_t item = int64_t(blockIdx.x) * groups_per_cta + (threadIdx.x >> a.pull_lane_bits); item < items;
       item += groups) {
    const int64_t t = segments == 1 ? item : item / segments;
    const int segment = segments == 1 ? 0 : static_cast<int>(item % segments);
    const int first = segment * lanes * kEmSumUnroll + lane_in_group;
    float acc[kEmSumUnroll][kElems];
#pragma unroll
    for (int u = 0; u < kEmSumUnroll; ++u) {
#pragma unroll
      for (int e = 0; e < kElems; ++e) acc[u][e] = 0.0f;
    }
    const int32_t* route = routes + t * kMaxTopK;
    for (int k = 0; k < kMaxTopK && route_in_call(route[k], ws.ep_size, T); ++k) {
      const int d = route_rank(route[k]);
      // A rank masked off since the dispatch was not waited for: its rows are not final.
      if (!rank_active(c.sync, d)) continue;
      const uint8_t* peer = ws.row(d);
      const int32_t* entries =
          reinterpret_cast<const int32_t*>(peer + l.pair_map_offset) + (source_row + route_slot(route[k])) * K;
      const float* weights = reinterpret_cast<const float*>(peer + l.weights_offset);
      for (int64_t q = 0; q < K; ++q) {
        const int32_t at = entries[q];
        if (at < 0 || at >= rows) continue;  // no pair there (dropped, or past the row's pairs)
        const float w = weights[at];
        const InRaw* src = reinterpret_cast<const InRaw*>(peer + l.combine_offset + int64_t(at) * a.row_bytes);
        InVec x[kEmSumUnroll];
#pragma unroll
        for (int u = 0; u < kEmSumUnroll; ++u) {
          const int v = first + u * lanes;
          x[u].raw = v < vectors ? src[v] : InRaw{};
        }
#pragma unroll
        for (int u = 0; u < kEmSumUnroll; ++u) {
#pragma unroll
          for (int e = 0; e < kElems; ++e) acc[u][e] = __fadd_rn(acc[u][e], __fmul_rn(w, In::to_float(x[u].v[e])));
        }
      }
    }
    OutRaw* dst = reinterpret_cast<OutRaw*>(c.output) + t * vectors;
#pragma unroll
    for (int u = 0; u < kEmSumUnroll; ++u) {
      const int v = first + u * lanes;
      if (v >= vectors) continue;
      OutVec y;
#pragma unroll
      for (int e = 0; e < kElems; ++e) y.v[e] = Out::from_float(acc[u][e]);
      dst[v] = y.raw;
    }
  }
}

// The widest vector whose input and output accesses are at most 16 bytes.
template <typename In, typename Out>
constexpr int kWidestPull =
    16 / int(sizeof(typename In::Bits) > sizeof(typename Out::Bits) ? sizeof(typename In::Bits)
                                                                    : sizeof(typename Out::Bits));

template <typename In, typename Out, int kElems = kWidestPull<In, Out>>
__device__ void pull_expert_rows_any(const EmCombineArgs& a) {
  if constexpr (kElems > 1) {
    if (a.pull_elems != kElems) return pull_expert_rows_any<In, Out, kElems / 2>(a);
  }
  pull_expert_rows<In, Out, kElems>(a);
}

template <typename In, typename Out>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm) em_combine_kernel(const __grid_constant__ EmCombineArgs a) {
  wait_for_previous_grid();
  const CombineParams& c = a.p.c;
  const WorkspaceView& ws = c.ws;
  uint8_t* own = ws.row(ws.ep_rank);
  const uint32_t dispatch_epoch = *header_word<uint32_t>(own, kHdrDispatchEpoch);
  const uint32_t combine_epoch = *header_word<uint32_t>(own, kHdrCombineEpoch);
  const uint64_t own_init = *header_word<uint64_t>(own, kHdrMagic);
  const uint32_t this_combine = *header_word<uint32_t>(own, kHdrCombineCount) + 1;  // c of protocol.h
  const uint32_t error_code = load_error_code(own);
  const uint32_t mismatch =
      threadIdx.x == 0
          ? combine_mismatch(*header_word<int32_t>(own, kHdrLastLocalTokens),
                             *header_word<int32_t>(own, kHdrLastRuntimeMax), *header_word<int32_t>(own, kHdrLastTopK),
                             *header_word<int64_t>(own, kHdrLastDispatchEnd), c.local_num_tokens, c.runtime_max_tokens,
                             c.top_k, a.p.dispatch_end) |
                expert_major_mismatch(*header_word<uint32_t>(own, kHdrExpertMajorEpoch),
                                      *header_word<int32_t>(own, kHdrExpertMajorTokens),
                                      *header_word<int64_t>(own, kHdrExpertMajorEnd), dispatch_epoch,
                                      a.p.layout.tokens_per_expert, c.combine_offset)
          : 0u;
  const bool checks_peer = int(threadIdx.x) < ws.ep_size && rank_active(c.sync, threadIdx.x);
  const int32_t peer_t = checks_peer ? *header_word<int32_t>(own, peer_runtime_max_offset(threadIdx.x)) : 0;
  const int32_t own_t = checks_peer ? *header_word<int32_t>(own, peer_runtime_max_offset(ws.ep_rank)) : 0;
  const uint32_t peer_payloads = checks_peer ? *header_word<uint32_t>(own, peer_payloads_offset(threadIdx.x)) : 0;
  const uint32_t own_payloads = checks_peer ? *header_word<uint32_t>(own, peer_payloads_offset(ws.ep_rank)) : 0;
  bool other_call_seen = false;
  if (!may_proceed(own, c.sync.mailbox, error_code, combine_sequence_ok(dispatch_epoch, combine_epoch, own_init),
                   mismatch, peer_t != own_t || peer_payloads != own_payloads, &other_call_seen)) {
    return;
  }
  if (other_call_seen) {
    record_peer_call_mismatch(c, peer_t != own_t, peer_payloads != own_payloads, own_t);
    return;
  }

  // 0. Wait, 1. stage, 2. release (as combine.cu: every CTA its share, after its staged rows).
  const bool system = a.sync_settings.system;
  if (a.stage) {
    if (dispatch_epoch == combine_epoch &&
        !wait_for_peer_pulls(ws, c.sync, this_combine - 1, kErrorCombineTimeout, a.sync_settings)) {
      return;
    }
    __shared__ int32_t prefix[kMaxLocalExperts + 1];
    pair_starts(own, a.p.layout.counts_offset, a.p.num_local, a.p.layout.tokens_per_expert, prefix);
    stage_expert_rows(a, prefix);
    __syncthreads();
  }
  release_share(ws, c.sync, kHdrCombineFlags, system);

  // 3. Acquire (as combine.cu).
  if (!acquire_combine_flags(ws, c.sync, dispatch_epoch, this_combine, /*region_low_precision=*/-1, a.sync_settings))
    return;

  // 4. Pull, 5. this CTA's share of pull_done (as combine.cu).
  pull_expert_rows_any<In, Out>(a);
  release_pull_done(own, system);
}

int64_t em_dtype_bytes(DType d) { return d == DType::kFloat32 ? 4 : 2; }

}  // namespace

cudaError_t expert_major_combine_ctas_per_sm(int* ctas_per_sm) {
  *ctas_per_sm = std::numeric_limits<int>::max();
  cudaError_t err = lower_to_occupancy(em_combine_kernel<F32, F32>, ctas_per_sm);
  if (err == cudaSuccess) err = lower_to_occupancy(em_combine_kernel<F16, F16>, ctas_per_sm);
  if (err == cudaSuccess) err = lower_to_occupancy(em_combine_kernel<BF16, BF16>, ctas_per_sm);
  if (err == cudaSuccess) err = lower_to_occupancy(em_combine_kernel<F32, BF16>, ctas_per_sm);
  if (err == cudaSuccess) err = lower_to_occupancy(em_combine_kernel<F16, BF16>, ctas_per_sm);
  if (err == cudaSuccess) err = lower_to_occupancy(em_combine_kernel<F16, F32>, ctas_per_sm);
  if (err == cudaSuccess) err = lower_to_occupancy(em_combine_kernel<BF16, F32>, ctas_per_sm);
  if (err == cudaSuccess) err = lower_to_occupancy(build_index_kernel, ctas_per_sm);
  if (err == cudaSuccess) err = lower_to_occupancy(build_copy_kernel, ctas_per_sm);
  return err;
}

cudaError_t launch_expert_major_build(const ExpertMajorBuildParams& p, const LaunchConfig& config,
                                      cudaStream_t stream) {
  const bool pdl = p.enable_pdl && config.pdl_supported;
  cudaError_t err = launch_kernel(build_index_kernel, static_cast<int>(p.num_local), kThreads, stream, pdl, p);
  if (err != cudaSuccess) return err;
  BuildCopyArgs a{};
  a.p = p;
  const uint8_t* own = p.ws.row(p.ws.ep_rank);
  int64_t bytes = 0;
  for (int i = 0; i < p.num_payloads; ++i) {
    if (p.payload_row_bytes[i] > kMaxKernelRowBytes) return cudaErrorInvalidValue;
    const uint64_t bits = address_bits(own) | uint64_t(p.payload_offset[i]) | uint64_t(p.layout.payload_offset[i]);
    a.plan[i] = make_copy_plan(p.payload_row_bytes[i], bits);
    bytes += p.payload_row_bytes[i];
  }
  // The pairs are not known on the host: the grid is sized for every received row once per top-k slot.
  const int64_t rows = p.ws.ep_size * p.runtime_max_tokens * p.top_k;
  const int64_t most = p.layout.local_experts * p.layout.tokens_per_expert;
  const int grid = spinning_grid_size(config, (rows < most ? rows : most) * bytes);
  return launch_kernel(build_copy_kernel, grid, kThreads, stream, pdl, a);
}

cudaError_t launch_combine_expert_major(const ExpertMajorCombineParams& p, const LaunchConfig& config,
                                        cudaStream_t stream) {
  const CombineParams& c = p.c;
  EmCombineArgs a{};
  a.p = p;
  a.sync_settings = make_sync_settings(c.sync.timeout_s, config);
  const int64_t in_bytes = em_dtype_bytes(c.payload_dtype);
  const int64_t out_bytes = em_dtype_bytes(c.output_dtype);
  a.row_bytes = c.row_elems * in_bytes;
  if (a.row_bytes > kMaxKernelRowBytes) return cudaErrorInvalidValue;
  const uint64_t rows_bits = address_bits(c.ws.base) | uint64_t(c.ws.row_stride) | uint64_t(c.combine_offset);
  const uint8_t* region = c.ws.row(c.ws.ep_rank) + c.combine_offset;
  a.stage = c.payload != nullptr && c.payload != region;
  if (a.stage) a.stage_plan = make_copy_plan(a.row_bytes, rows_bits | address_bits(c.payload));
  int elems = int(16 / (in_bytes > out_bytes ? in_bytes : out_bytes));
  while (elems > 1 && (c.row_elems % elems != 0 || rows_bits % uint64_t(elems * in_bytes) != 0 ||
                       address_bits(c.output) % uint64_t(elems * out_bytes) != 0)) {
    elems /= 2;
  }
  a.pull_elems = elems;
  const int pull_lanes = lanes_per_row(c.row_elems / elems, kEmSumUnroll);
  a.pull_lane_bits = log2_exact(pull_lanes);
  const int64_t per_segment = int64_t(pull_lanes) * kEmSumUnroll;
  a.pull_segments = static_cast<int>((c.row_elems / elems + per_segment - 1) / per_segment);
  // Pull: a row written per token and one read per pair; staging copies the valid rows.
  const int grid = spinning_grid_size(config, c.local_num_tokens * a.row_bytes * (a.stage ? 2 : 1) * c.top_k);
  const bool pdl = c.sync.enable_pdl && config.pdl_supported;
  const DType in = c.payload_dtype, out = c.output_dtype;
  if (in == DType::kFloat32 && out == DType::kFloat32) {
    return launch_kernel(em_combine_kernel<F32, F32>, grid, kThreads, stream, pdl, a);
  }
  if (in == DType::kFloat16 && out == DType::kFloat16) {
    return launch_kernel(em_combine_kernel<F16, F16>, grid, kThreads, stream, pdl, a);
  }
  if (in == DType::kBFloat16 && out == DType::kBFloat16) {
    return launch_kernel(em_combine_kernel<BF16, BF16>, grid, kThreads, stream, pdl, a);
  }
  if (in == DType::kFloat32 && out == DType::kBFloat16) {
    return launch_kernel(em_combine_kernel<F32, BF16>, grid, kThreads, stream, pdl, a);
  }
  if (in == DType::kFloat16 && out == DType::kBFloat16) {
    return launch_kernel(em_combine_kernel<F16, BF16>, grid, kThreads, stream, pdl, a);
  }
  if (in == DType::kFloat16 && out == DType::kFloat32) {
    return launch_kernel(em_combine_kernel<F16, F32>, grid, kThreads, stream, pdl, a);
  }
  if (in == DType::kBFloat16 && out == DType::kFloat32) {
    return launch_kernel(em_combine_kernel<BF16, F32>, grid, kThreads, stream, pdl, a);
  }
  return cudaErrorInvalidValue;  // ops.cpp admits only the pairs above
}

}  // namespace gpu
}  // namespace moe_a2a
