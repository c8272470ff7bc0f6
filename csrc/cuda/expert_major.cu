// The expert-major kernels (protocol.h, ExpertMajorLayout): the build that
// regroups a dispatch's received rows by local expert, and the combine that
// pulls each (token, expert) pair's row through the expert rank's pair map.
//
// Build, one grid on the rank's stream (no peer is waited for, and nothing
// but the own row is touched): build_kernel below.
// Combine: combine.cu's protocol step for step (the same flags and shares,
// epochs and pull_done), staging the expert outputs' valid rows [e, i] to the
// same index of the own combine region where a peer pulls them (the own
// pairs' rows are read from the payload tensor: em_combine_stages) and
// pulling, per token and element,
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

// The valid rows before local expert e (prefix[e]; prefix[num_local] = all),
// in shared memory, from the own counts clamped to [0, M]: warp 0's lanes
// take consecutive experts each, a warp scan gives each lane its start.
// Every thread calls it.
__device__ void pair_starts(const uint8_t* own, int64_t counts_offset, int64_t num_local, int64_t M, int32_t* prefix) {
  if (warp_id() == 0) {
    const int32_t* counts = reinterpret_cast<const int32_t*>(own + counts_offset);
    const int lane = lane_id();
    const int64_t per_lane = (num_local + kWarpSize - 1) / kWarpSize;
    const int64_t lo = min(num_local, lane * per_lane), hi = min(num_local, lo + per_lane);
    const auto clamped = [&](int64_t e) {
      const int64_t count = counts[e] > 0 ? int64_t(counts[e]) : 0;
      return static_cast<int32_t>(count < M ? count : M);
    };
    int32_t sum = 0;
    for (int64_t e = lo; e < hi; ++e) sum += clamped(e);
    int32_t inclusive = sum;
#pragma unroll
    for (int offset = 1; offset < kWarpSize; offset *= 2) {
      const int32_t below = __shfl_up_sync(kFullWarp, inclusive, offset);
      if (lane >= offset) inclusive += below;
    }
    int32_t running = inclusive - sum;
    if (lane == 0) prefix[0] = 0;
    for (int64_t e = lo; e < hi; ++e) {
      running += clamped(e);
      prefix[e + 1] = running;
    }
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

// ---- the build in one pass ------------------------------------------------------------------

// Received rows per chunk: the chunk's pairs get their rows (warp 0), then
// the CTA copies the chunk's rows to them.
constexpr int kBuildChunkRows = 64;

struct BuildArgs {
  ExpertMajorBuildParams p;
  CopyPlan plan[kMaxPayloads];
};

// The local expert of pair (plane row r, slot k), or -1 for another rank's expert.
__device__ __forceinline__ int32_t local_expert(const ExpertMajorBuildParams& p, const uint8_t* id_plane, int64_t r,
                                                int64_t k) {
  const int64_t local = load_expert_id(id_plane, p.ids_int64, r * p.top_k + k) - p.first_expert;
  return local >= 0 && local < p.num_local ? static_cast<int32_t>(local) : -1;
}

// The build in one grid: CTA c owns a contiguous share of the
// flat received rows, the last CTA's share ending at the last row. Each CTA
//   1. counts the pairs of every local expert in the rows before its share
//      (shared-memory counters: next[e]);
//   2. walks its share in chunks of kBuildChunkRows rows: warp 0 takes the
//      chunk's pairs in (row, slot) order, 32 at a time, and gives each pair
//      of local expert e the row i = next[e] + (the batch's lanes below with
//      the same expert, __match_any_sync), writing the pair map, ids and
//      weights; then the CTA copies each row of the chunk, every
//      segment loaded once, to all of its pairs' rows;
//   3. the last CTA, whose next[e] then counts all pairs of e, writes the
//      counts, the padding of ids and weights, the drops and the build record.
// The rows i are those of the CPU's sequential loop, whatever the timing.
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm) build_kernel(const __grid_constant__ BuildArgs a) {
  wait_for_previous_grid();
  const ExpertMajorBuildParams& p = a.p;
  const WorkspaceView& ws = p.ws;
  uint8_t* own = ws.row(ws.ep_rank);
  const ExpertMajorLayout& l = p.layout;
  const int64_t T = p.runtime_max_tokens, K = p.top_k, M = l.tokens_per_expert;
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
  __shared__ int32_t next[kMaxLocalExperts];
  __shared__ int32_t keys[kBuildChunkRows][kMaxTopK];
  __shared__ int64_t chunk_row[kBuildChunkRows];  // plane row s * T + j of each row of the chunk
  received_row_starts(ws, T, first);
  const int64_t rows = first[ws.ep_size];
  const int64_t per_cta = (rows + gridDim.x - 1) / gridDim.x;
  const int64_t begin = min(rows, int64_t(blockIdx.x) * per_cta);
  const int64_t end = min(rows, begin + per_cta);
  const bool last = blockIdx.x == gridDim.x - 1;
  const uint8_t* id_plane = own + p.ids_offset;
  const int lane = lane_id(), warp = warp_id();

  // 1. next[e]: the pairs of e in the flat rows [0, begin), source by source.
  for (int64_t e = threadIdx.x; e < p.num_local; e += kThreads) next[e] = 0;
  __syncthreads();
  for (int s = 0; s < ws.ep_size && first[s] < begin; ++s) {
    // Ids [s, j, k] with j below the share: at most T * top_k < 2^31 of them, so 32-bit divisions.
    const uint32_t n = static_cast<uint32_t>((min(first[s + 1], begin) - first[s]) * K);
    const uint32_t k_width = static_cast<uint32_t>(K);
    const int64_t plane_first = int64_t(s) * T;
    // Every lane of a warp takes part in each step (the match below).
    for (uint32_t x0 = uint32_t(warp) * kWarpSize; x0 < n; x0 += kThreads) {
      const uint32_t x = x0 + lane;
      const int32_t e = x < n ? local_expert(p, id_plane, plane_first + x / k_width, x % k_width) : -1;
      const uint32_t peers = __match_any_sync(kFullWarp, e);
      if (e >= 0 && (peers & lanes_below()) == 0) atomicAdd(&next[e], __popc(peers));
    }
  }
  __syncthreads();

  int32_t* pair_map = reinterpret_cast<int32_t*>(own + l.pair_map_offset);
  int32_t* ids = reinterpret_cast<int32_t*>(own + l.ids_offset);
  float* weights = reinterpret_cast<float*>(own + l.weights_offset);
  const float* weight_plane = p.weights_offset >= 0 ? reinterpret_cast<const float*>(own + p.weights_offset) : nullptr;
  for (int64_t c0 = begin; c0 < end; c0 += kBuildChunkRows) {
    const int chunk = static_cast<int>(min(int64_t(kBuildChunkRows), end - c0));
    if (threadIdx.x < chunk) chunk_row[threadIdx.x] = plane_row(first, ws.ep_size, T, c0 + threadIdx.x);
    __syncthreads();
    // 2a. The chunk's pairs, in (row, slot) order: their rows i, the pair map and the planes' entries.
    if (warp == 0) {
      const int n = chunk * static_cast<int>(K);
      for (int x0 = 0; x0 < n; x0 += kWarpSize) {
        const int x = x0 + lane;
        const int c = x / static_cast<int>(K), k = x % static_cast<int>(K);
        const int64_t r = x < n ? chunk_row[c] : 0;
        const int32_t e = x < n ? local_expert(p, id_plane, r, k) : -2;
        const uint32_t peers = __match_any_sync(kFullWarp, e);
        if (x < n) {
          // q: the row's local pairs before (e, k) in ascending (expert, slot) order; n_local: all of them.
          int q = 0, n_local = 0;
          for (int k2 = 0; k2 < K; ++k2) {
            const int32_t e2 = local_expert(p, id_plane, r, k2);
            if (e2 < 0) continue;
            ++n_local;
            q += (e2 < e || (e2 == e && k2 < k)) ? 1 : 0;
          }
          if (e >= 0) {
            const int64_t i = int64_t(next[e]) + __popc(peers & lanes_below());
            int32_t at = kNoPair;
            if (i < M) {
              at = static_cast<int32_t>(e * M + i);
              ids[at] = e;
              weights[at] = weight_plane != nullptr ? weight_plane[r * K + k] : 1.0f;
            }
            pair_map[r * K + q] = at;
            keys[c][q] = at;
          }
          if (k >= n_local) {
            pair_map[r * K + k] = kNoPair;
            keys[c][k] = kNoPair;
          }
        }
        __syncwarp();
        if (e >= 0 && (peers >> lane) == 1u) next[e] += __popc(peers);  // the group's highest lane
        __syncwarp();
      }
    }
    __syncthreads();
    // 2b. Each row's kept pairs first, kRouteEnd after them (dropped pairs have no row).
    if (threadIdx.x < chunk) {
      int kept = 0;
      for (int q = 0; q < K; ++q) {
        const int32_t at = keys[threadIdx.x][q];
        if (at >= 0) keys[threadIdx.x][kept++] = at;
      }
      if (kept < kMaxTopK) keys[threadIdx.x][kept] = kRouteEnd;
    }
    __syncthreads();
    // 2c. The chunk's rows to their pairs' rows, payload by payload.
    for (int i = 0; i < p.num_payloads; ++i) {
      const int64_t bytes = p.payload_row_bytes[i];
      if (bytes == 0) continue;
      const CopyPlan& plan = a.plan[i];
      const int groups = kThreads >> plan.lane_bits;
      const int lane_in_group = threadIdx.x & (plan.lanes - 1);
      const uint8_t* from = own + p.payload_offset[i];
      uint8_t* to = own + l.payload_offset[i];
      for (int item = threadIdx.x >> plan.lane_bits; item < chunk * plan.segments; item += groups) {
        const int c = plan.segments == 1 ? item : item / plan.segments;
        const int segment = plan.segments == 1 ? 0 : item % plan.segments;
        copy_segment_any(
            from + chunk_row[c] * bytes, plan, segment, lane_in_group, [&](int q) { return keys[c][q]; },
            [&](int32_t at) { return to + int64_t(at) * bytes; });
      }
    }
    __syncthreads();
  }
  if (!last) return;

  // 3. Counts, padding, drops and the build record.
  int32_t* counts = reinterpret_cast<int32_t*>(own + l.counts_offset);
  for (int64_t e = threadIdx.x; e < p.num_local; e += kThreads) {
    const int64_t total = next[e];
    counts[e] = static_cast<int32_t>(min(total, M));
    if (total > M) {
      atomicAdd(header_word<unsigned long long>(own, kHdrDroppedPairCount), static_cast<unsigned long long>(total - M));
    }
  }
  // A warp per expert, its lanes along the rows (no division per entry: a
  // 64-bit one per entry made this loop the kernel's longest part).
  for (int64_t e = warp; e < p.num_local; e += kWarps) {
    for (int64_t i = next[e] + lane; i < M; i += kWarpSize) {
      ids[e * M + i] = kNoPair;
      weights[e * M + i] = 0.0f;
    }
  }
  if (threadIdx.x == 0) {
    *header_word<int64_t>(own, kHdrExpertMajorEnd) = l.combine_offset;
    *header_word<int32_t>(own, kHdrExpertMajorTokens) = static_cast<int32_t>(M);
    *header_word<uint32_t>(own, kHdrExpertMajorEpoch) = dispatch_epoch;
  }
}

// ---- combine ------------------------------------------------------------------------------

struct EmCombineArgs {
  ExpertMajorCombineParams p;
  SyncSettings sync_settings;
  int64_t row_bytes;
  bool stage;             // em_combine_stages
  bool own_from_payload;  // em_combine_own_from_payload
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
  // The group's lanes within the warp: bits [group_first, group_first + lanes).
  const int group_first = lane_id() & ~(lanes - 1);
  const uint32_t group_mask = (lanes == kWarpSize ? kFullWarp : (1u << lanes) - 1u) << group_first;
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
      const uint8_t* plane = d == ws.ep_rank && a.own_from_payload ? c.payload : peer + l.combine_offset;
      // The group's lanes load `lanes` entries and their weights at once; the
      // kept pairs are then summed in entry order, two pairs' rows in flight.
      for (int q0 = 0; q0 < K; q0 += lanes) {
        const int q = q0 + lane_in_group;
        const int32_t at_q = q < K ? entries[q] : kNoPair;
        const bool kept = at_q >= 0 && at_q < rows;  // else no pair there (dropped, or past the row's pairs)
        const float w_q = kept ? weights[at_q] : 0.0f;
        uint32_t pending = (__ballot_sync(group_mask, kept) & group_mask) >> group_first;
        while (pending != 0) {
          const int qa = __ffs(pending) - 1;
          pending &= pending - 1;
          const int qb = pending != 0 ? __ffs(pending) - 1 : qa;
          const bool two = pending != 0;
          pending &= pending - 1;
          const int32_t at_a = __shfl_sync(group_mask, at_q, qa, lanes);
          const int32_t at_b = __shfl_sync(group_mask, at_q, qb, lanes);
          const InRaw* src_a = reinterpret_cast<const InRaw*>(plane + int64_t(at_a) * a.row_bytes);
          const InRaw* src_b = reinterpret_cast<const InRaw*>(plane + int64_t(at_b) * a.row_bytes);
          InVec xa[kEmSumUnroll], xb[kEmSumUnroll];
#pragma unroll
          for (int u = 0; u < kEmSumUnroll; ++u) {
            const int v = first + u * lanes;
            xa[u].raw = v < vectors ? src_a[v] : InRaw{};
            xb[u].raw = two && v < vectors ? src_b[v] : InRaw{};
          }
          // The weights' shuffles after the rows' loads: a shuffle waits for
          // its value's load, so before them it kept the rows' loads behind
          // the weights' (three dependent loads per group instead of two).
          const float w_a = __shfl_sync(group_mask, w_q, qa, lanes);
          const float w_b = __shfl_sync(group_mask, w_q, qb, lanes);
#pragma unroll
          for (int u = 0; u < kEmSumUnroll; ++u) {
#pragma unroll
            for (int e = 0; e < kElems; ++e) acc[u][e] = __fadd_rn(acc[u][e], __fmul_rn(w_a, In::to_float(xa[u].v[e])));
          }
          if (two) {
#pragma unroll
            for (int u = 0; u < kEmSumUnroll; ++u) {
#pragma unroll
              for (int e = 0; e < kElems; ++e) {
                acc[u][e] = __fadd_rn(acc[u][e], __fmul_rn(w_b, In::to_float(xb[u].v[e])));
              }
            }
          }
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
                                      a.p.layout.tokens_per_expert, c.combine_offset) |
                region_staged_mismatch(*header_word<uint32_t>(own, kHdrRegionStaged), !a.own_from_payload)
          : 0u;
  const bool checks_peer = int(threadIdx.x) < ws.ep_size && rank_active(c.sync, threadIdx.x);
  const int32_t peer_t = checks_peer ? *header_word<int32_t>(own, peer_runtime_max_offset(threadIdx.x)) : 0;
  const int32_t own_t = checks_peer ? *header_word<int32_t>(own, peer_runtime_max_offset(ws.ep_rank)) : 0;
  const uint32_t peer_payloads = checks_peer ? *header_word<uint32_t>(own, peer_payloads_offset(threadIdx.x)) : 0;
  const uint32_t own_payloads = checks_peer ? *header_word<uint32_t>(own, peer_payloads_offset(ws.ep_rank)) : 0;
  const bool other_round =
      checks_peer && round_tags_differ(*header_word<uint32_t>(own, peer_round_tag_offset(threadIdx.x)),
                                       *header_word<uint32_t>(own, peer_round_tag_offset(ws.ep_rank)));
  const bool other_payloads = peer_payloads != own_payloads || other_round;
  bool other_call_seen = false;
  if (!may_proceed(own, c.sync.mailbox, error_code, combine_sequence_ok(dispatch_epoch, combine_epoch, own_init),
                   mismatch, peer_t != own_t || other_payloads, &other_call_seen)) {
    return;
  }
  if (other_call_seen) {
    record_peer_call_mismatch(c, peer_t != own_t, other_payloads, other_round, own_t);
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

  // 3. Acquire (as combine.cu). A payload tensor marks the region staged
  // whether or not a peer pulls (the CPU's begin_staging, as the rank-major
  // combine's): a later in-place combine of the round is refused.
  if (!acquire_combine_flags(ws, c.sync, dispatch_epoch, this_combine, a.own_from_payload, a.sync_settings)) return;

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
  if (err == cudaSuccess) err = lower_to_occupancy(build_kernel, ctas_per_sm);
  return err;
}

cudaError_t launch_expert_major_build(const ExpertMajorBuildParams& p, const LaunchConfig& config,
                                      cudaStream_t stream) {
  const bool pdl = p.enable_pdl && config.pdl_supported;
  BuildArgs a{};
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
  return launch_kernel(build_kernel, grid, kThreads, stream, pdl, a);
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
  a.own_from_payload = em_combine_own_from_payload(c);
  a.stage = em_combine_stages(c);
  if (a.stage) a.stage_plan = make_copy_plan(a.row_bytes, rows_bits | address_bits(c.payload));
  // The pull's rows: the combine regions', and the payload's own pairs.
  const uint64_t pull_bits = rows_bits | (a.own_from_payload ? address_bits(c.payload) : 0);
  int elems = int(16 / (in_bytes > out_bytes ? in_bytes : out_bytes));
  while (elems > 1 && (c.row_elems % elems != 0 || pull_bits % uint64_t(elems * in_bytes) != 0 ||
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
