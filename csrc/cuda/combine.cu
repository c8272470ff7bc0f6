// The combine kernels: protocol.h's combine n on rank r, in one persistent
// grid per rank, one instantiation per (payload dtype, output dtype) pair.
//
// Design: every CTA stages a share of the received rows that the peers pull
// into the own combine region (the own source's rows stay where they are,
// only this grid reads them: plain rows, and e4m3 rows of a 16-bit payload,
// which the pull converts as it reads them) and adds its share to the combine
// flags of every active rank,
// including its own (protocol.h: flags count shares), whose completion is
// what tells this grid's CTAs that the whole region is staged; every CTA then
// waits for all active ranks' flags and pulls. The pull sums, per token and
// element, the destinations' rows in ascending rank order (the route order)
// in fp32 from 0.0f and rounds once to the output dtype with
// round-to-nearest-even: the CPU's arithmetic, so the results are bitwise
// identical.
#include <algorithm>
#include <limits>

#include "combine_formats.cuh"
#include "device.cuh"

namespace moe_a2a {
namespace gpu {
namespace {

// Vectors of a sum in flight per lane (each needs kElems fp32 accumulators).
constexpr int kSumUnroll = 2;
// Destination rows whose vectors a lane loads before it adds the first: the
// sum of a token is a chain of dependent loads otherwise, the latency bound
// of small calls. Each one holds kSumUnroll vectors in registers.
constexpr int kPullRowsInFlight = 2;
static_assert(kDestBatch % kPullRowsInFlight == 0, "a batch holds whole groups of rows");
// The pull's vectors a lane per destination row: kSumUnroll, or
// kE4m3PullUnroll for e4m3 rows (the kernel's template and launch_combine).
constexpr int pull_unroll(bool low_precision) { return low_precision ? kE4m3PullUnroll : kSumUnroll; }
// Rows of each source that a combine without staging prefetches into L2 from
// its own combine region while it waits for the peers' flags (step 3a): the
// rows the peers' first pull tasks read (a source's first slots are its first
// tokens'), loaded while the memory would otherwise idle. Only where a source
// has kPrefetchMinTokens slots or more: a prefetch of every row is worse
// than none. Same-call A/Bs on an H200, ep 8 round trips per step: 128
// tokens 65.1 -> 63.9 us with 16 rows (8 rows 64.3, 24 rows 64.5; every row
// 70.8 against 67.6 without, in a probe build); 16 tokens 22.1 -> 23.9 with
// all 16 (docs/performance.md, 'Design decisions and their measured effect').
constexpr int64_t kPrefetchRowsPerSource = 16;
constexpr int64_t kPrefetchMinTokens = 128;
constexpr int64_t kL2LineBytes = 128;

struct CombineArgs {
  CombineParams p;
  SyncSettings sync_settings;
  int64_t row_bytes;      // of a payload row
  bool stage;             // p.payload must be copied into the own combine region
  bool own_from_payload;  // the own source's rows pulled from p.payload (or in place), not staged:
                          // plain rows, or e4m3 rows of 16-bit payloads (OwnRowsUnstaged)
  CopyPlan stage_plan;
  int pull_elems;      // elements per vector access of the pull
  int pull_lane_bits;  // log2 of the lanes that sum one row
  int pull_segments;   // per row
  bool claim_pull;     // warps claim their tasks after the first from kHdrCombineClaims
  bool prefetch;       // step 3a
  bool stage_vectors;  // the low-precision staging by 4-element vectors (stage_rows_e4m3)
  bool one_task;       // no warp has a second pull task: step 5 before the output stores (not quantized)
  // item / pull_segments as (umulhi(item, magic) + item) >> shift where the
  // call's items are below 2^31 (launch_combine), else 0 (a 64-bit division).
  uint32_t segments_magic;
  int segments_shift;
};

// The own claim word of combine `count` (protocol.h, kHdrCombineClaims).
__device__ __forceinline__ uint32_t* combine_claim_word(uint8_t* own, uint32_t count) {
  return header_word<uint32_t>(own, kHdrCombineClaims + int64_t(sizeof(uint32_t)) * (count & 1u));
}

// The pull's row base for each value of a route entry's rank field (all 256
// of its 8 bits, kRouteEnd's 255 among them): the rank's combine region, or
// for the own rank with own_from_payload the payload tensor (both indexed by
// source_row + slot); nullptr for a rank outside the call or masked off since
// the dispatch. Every CTA fills it while it waits for the peers' flags
// (wait_for_peers' barrier publishes it), so that a destination row's
// address costs a pull item one shared load and a multiply-add instead of
// the route checks, the rank mask and the own-row branch. Same build, same
// call, ep 8 x 4096 tokens on an H200: e4m3 1440 -> 1381 us, block-scaled
// 1639 -> 1575 (docs/performance.md, 'Combine variants').
constexpr int kRouteRankValues = 256;
static_assert(uint32_t(kRouteEnd) >> kRouteRankShift == kRouteRankValues - 1 && kMaxRanks < kRouteRankValues,
              "a rank field of 8 bits, kRouteEnd's naming no rank");
__device__ __forceinline__ const uint8_t** pull_row_bases() {
  __shared__ const uint8_t* bases[kRouteRankValues];
  return bases;
}
__device__ inline void fill_pull_row_bases(const CombineArgs& a) {
  const CombineParams& p = a.p;
  const WorkspaceView& ws = p.ws;
  for (int d = threadIdx.x; d < kRouteRankValues; d += kThreads) {
    const uint8_t* base = nullptr;
    if (d < ws.ep_size && rank_active(p.sync, d)) {
      base = d == ws.ep_rank && a.own_from_payload && p.payload != nullptr ? p.payload : ws.row(d) + p.combine_offset;
    }
    pull_row_bases()[d] = base;
  }
}

// 1. Stage: the first rows[s] rows of payload[s] for every active source s
// (rows: recv_count[s], loaded with the epochs) into the own combine region,
// but for the own rank's source plane when own_from_payload: only this
// rank's pull reads those rows, and it reads them from the payload.
// Work items are (received row, segment) pairs spread over the grid.
__device__ void stage_rows(const CombineArgs& a, const int32_t* rows) {
  const CombineParams& p = a.p;
  const WorkspaceView& ws = p.ws;
  uint8_t* own = ws.row(ws.ep_rank);
  const int64_t T = p.runtime_max_tokens;
  __shared__ int64_t first_row[kMaxRanks + 1];  // staged rows before source s
  staged_row_starts(p, rows, a.own_from_payload ? ws.ep_rank : -1, first_row);
  const CopyPlan& plan = a.stage_plan;
  uint8_t* region = own + p.combine_offset;
  const int groups_per_cta = kThreads >> plan.lane_bits;
  const int64_t groups = int64_t(gridDim.x) * groups_per_cta;
  const int lane_in_group = threadIdx.x & (plan.lanes - 1);
  const int64_t items = first_row[ws.ep_size] * plan.segments;
  int s = 0;  // a group's rows only increase, so its source index only moves forward
  for (int64_t item = int64_t(blockIdx.x) * groups_per_cta + (threadIdx.x >> plan.lane_bits); item < items;
       item += groups) {
    const int64_t row = plan.segments == 1 ? item : item / plan.segments;
    const int segment = plan.segments == 1 ? 0 : static_cast<int>(item % plan.segments);
    while (first_row[s + 1] <= row) ++s;
    const int64_t offset = (int64_t(s) * T + row - first_row[s]) * a.row_bytes;
    copy_segment_any(
        p.payload + offset, plan, segment, lane_in_group, [](int k) { return k == 0 ? 0 : kRouteEnd; },
        [&](int32_t) { return region + offset; });
  }
}

// 4. Pull: out[t] = sum over the route of t of the destination's row [r, slot].
// Work items are (token, segment) pairs; a warp task is the items of the
// kWarpSize / lanes groups of one warp. Warp w of CTA b takes task b * kWarps
// + w first. Its later tasks: with claim_pull, the grid's warp count plus
// what its claim on the own kHdrCombineClaims word of this call returned (the claim for the
// next task issued before the current one is pulled), so that warps whose
// rows come early take more; otherwise by the grid's warp count. Claims
// serve only grids that one counter can serve (kWarpsPerClaimCounter): with
// one rank's grid of 263 CTAs (one rank per H200) every warp's claim on one
// word made the pull 1.7x slower (docs/performance.md, 'Design decisions and
// their measured effect'). The sums do not depend on which warp pulls an item.
// 5. Then the CTA's share of pull_done (release_pull_done), or, where no warp
// has a second task (one_task; not for a quantized output), once its loads
// are summed and before its output stores.
template <typename In, typename Out, int kElems, int kUnroll = kSumUnroll>
__device__ void pull_rows(const CombineArgs& a, uint32_t count) {
  using InVec = Packed<typename In::Bits, kElems>;
  using OutVec = Packed<typename Out::Bits, kElems>;
  using InRaw = decltype(InVec::raw);
  using OutRaw = decltype(OutVec::raw);
  // The own source's e4m3 rows pulled from their 16-bit payload (launch_combine
  // sets own_from_payload for them only with these vectors).
  constexpr bool kOwnUnstaged = OwnRowsUnstaged<In>::value && kElems == kE4m3PullElems && kUnroll == 1;
  const CombineParams& p = a.p;
  const WorkspaceView& ws = p.ws;
  uint8_t* own = ws.row(ws.ep_rank);
  const int32_t* routes = reinterpret_cast<const int32_t*>(own + p.route_offset);
  const int64_t T = p.runtime_max_tokens;
  // Vector indices inside a row stay 32-bit: rows are below kMaxKernelRowBytes.
  const int vectors = static_cast<int>(p.row_elems / kElems);
  const int64_t source_row = int64_t(ws.ep_rank) * T;
  const int lane = lane_id();
  const int lanes = 1 << a.pull_lane_bits;
  const int segments = a.pull_segments;
  const int task_bits = kLog2WarpSize - a.pull_lane_bits;  // items per warp task: 1 << task_bits
  const int lane_in_group = lane & (lanes - 1);
  const int64_t items = p.local_num_tokens * segments;
  // The row of a route entry (pull_row_bases: the own rank's rows from the
  // payload when own_from_payload, step 1 did not stage them; or, e4m3 rows
  // in place, unconverted in the own region); nullptr for a rank masked off
  // since the dispatch, which was not waited for: its rows are not final (as
  // on the CPU). An entry outside this call's planes (route_in_call's case:
  // a combine whose sizes differ from its dispatch's never gets here) is
  // skipped rather than read out of bounds.
  const uint8_t* const* bases = pull_row_bases();
  const auto row_of = [&](int32_t entry) -> const uint8_t* {
    const uint8_t* base = bases[route_rank(entry)];
    const int64_t slot = route_slot(entry);
    return base == nullptr || slot >= T ? nullptr : base + (source_row + slot) * a.row_bytes;
  };
  // An item is token t's segment: this lane's first vector of it is `first`.
  struct Item {
    int64_t t;
    int first;
  };
  const auto item_at = [&](int64_t item) {
    if (a.segments_magic != 0) {
      const uint32_t n = uint32_t(item);
      const uint32_t row = (__umulhi(n, a.segments_magic) + n) >> a.segments_shift;
      return Item{int64_t(row), int(n - row * uint32_t(segments)) * lanes * kUnroll + lane_in_group};
    }
    const int segment = segments == 1 ? 0 : static_cast<int>(item % segments);
    return Item{segments == 1 ? item : item / segments, segment * lanes * kUnroll + lane_in_group};
  };
  // An item's sum (acc), then its store into the output.
  const auto sum_item = [&](const Item& it, float (&acc)[kUnroll][kElems]) {
    const int64_t t = it.t;
    const int first = it.first;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int e = 0; e < kElems; ++e) acc[u][e] = 0.0f;
    }
    // Route entries in batches loaded together (one latency per batch, not
    // per destination); the rows of kPullRowsInFlight destinations are
    // loaded before the first of them is added (one latency per group), and
    // still summed in route order.
    const int32_t* route = routes + t * kMaxTopK;
    bool ended = false;
    for (int batch = 0; batch < kMaxTopK && !ended; batch += kDestBatch) {
      int32_t entries[kDestBatch];
#pragma unroll
      for (int j = 0; j < kDestBatch; ++j) entries[j] = batch + j < kMaxTopK ? route[batch + j] : kRouteEnd;
#pragma unroll
      for (int j = 0; j < kDestBatch; j += kPullRowsInFlight) {
        const uint8_t* src[kPullRowsInFlight];
        bool own[kPullRowsInFlight];
#pragma unroll
        for (int g = 0; g < kPullRowsInFlight; ++g) {
          ended = ended || entries[j + g] == kRouteEnd;
          src[g] = ended ? nullptr : row_of(entries[j + g]);
          // The own row from its unconverted payload (kOwnUnstaged's case).
          own[g] = kOwnUnstaged && src[g] != nullptr && a.own_from_payload && route_rank(entries[j + g]) == ws.ep_rank;
        }
        InVec x[kPullRowsInFlight][kUnroll];
        float scale[kPullRowsInFlight][kUnroll];  // block scales of e4m3 rows, else 1
        uint4 own_hi;  // kOwnUnstaged: elements 8-15 of the own row's vector (a route has one own row)
#pragma unroll
        for (int g = 0; g < kPullRowsInFlight; ++g) {
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int v = first + u * lanes;
            const bool loads = src[g] != nullptr && v < vectors;
            if constexpr (kOwnUnstaged) {
              if (own[g]) {
                const uint4* row = reinterpret_cast<const uint4*>(src[g]);
                x[g][u].raw = loads ? row[2 * v] : uint4{};
                own_hi = loads ? row[2 * v + 1] : uint4{};
                scale[g][u] = 1.0f;
                continue;
              }
            }
            x[g][u].raw = loads ? In::template load<InRaw>(src[g], v) : InRaw{};
            scale[g][u] = loads ? In::scale(src[g], int64_t(v) * kElems, p.row_elems) : 0.0f;
          }
        }
#pragma unroll
        for (int g = 0; g < kPullRowsInFlight; ++g) {
          if (src[g] == nullptr) continue;
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            if constexpr (kOwnUnstaged) {
              if (own[g]) {
                add_own_e4m3<typename In::Source>(x[g][u].raw, own_hi, acc[u]);
                continue;
              }
            }
            if constexpr (In::kLowPrecision && kElems >= 4) {
              // e4m3 codes, decoded a word (four codes) at a time.
#pragma unroll
              for (int e = 0; e < kElems; e += 4) {
                float f[4];
                e4m3x4_to_float(vector_word(x[g][u].raw, e / 4), f);
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[u][e + i] += In::kBlockScaled ? mul_rn(f[i], scale[g][u]) : f[i];
              }
            } else if constexpr (In::kLowPrecision && kElems % 2 == 0) {
              // e4m3 pairs, decoded two at a time (one conversion each).
#pragma unroll
              for (int e = 0; e < kElems; e += 2) {
                float lo, hi;
                e4m3x2_to_float(uint16_t(x[g][u].v[e] | (uint16_t(x[g][u].v[e + 1]) << 8)), lo, hi);
                acc[u][e] += In::kBlockScaled ? mul_rn(lo, scale[g][u]) : lo;
                acc[u][e + 1] += In::kBlockScaled ? mul_rn(hi, scale[g][u]) : hi;
              }
            } else {
#pragma unroll
              for (int e = 0; e < kElems; ++e) acc[u][e] += In::contribution(x[g][u].v[e], scale[g][u]);
            }
          }
        }
        if (ended) break;
      }
    }
  };
  const auto store_item = [&](const Item& it, const float (&acc)[kUnroll][kElems]) {
    const int64_t t = it.t;
    const int first = it.first;
    OutRaw* dst = reinterpret_cast<OutRaw*>(p.output) + t * vectors;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = first + u * lanes;
      if (v >= vectors) continue;
      if constexpr (IsQuantized<Out>::value) {
        store_quantized<typename Out::Round, kElems>(p, t, v, acc[u]);
        continue;
      }
      if constexpr (!IsQuantized<Out>::value) {
        OutVec y;
#pragma unroll
        for (int e = 0; e < kElems; ++e) y.v[e] = Out::from_float(acc[u][e]);
        dst[v] = y.raw;
      }
    }
  };
  const int64_t first_task = int64_t(blockIdx.x) * kWarps + warp_id();
  if (!IsQuantized<Out>::value && a.one_task) {
    // Every warp has at most this task: the CTA releases its share of
    // pull_done (step 5) once its loads are summed, before its output
    // stores, which no peer reads. The release's fence then waits for no
    // output store, and the stores drain while it is on its way (same-process
    // A/B: combine-ws 1.11x, staged combine 1.06x, geomean above the launch
    // floor below 64 tokens; docs/performance.md). Not for a quantized
    // output: its epilogue beside the held sums spilled registers.
    const int64_t item = (first_task << task_bits) + (lane >> a.pull_lane_bits);
    const Item it = item_at(item);
    float acc[kUnroll][kElems];
    if (item < items) sum_item(it, acc);
    release_pull_done(own, a.sync_settings.system);
    if (item < items) store_item(it, acc);
    return;
  }
  const int64_t grid_warps = int64_t(gridDim.x) * kWarps;
  uint32_t* claims = combine_claim_word(own, count);
  for (int64_t task = first_task; (task << task_bits) < items;) {
    uint32_t claimed = 0;
    if (a.claim_pull && lane == 0) claimed = atomicAdd(claims, 1u);
    const int64_t item = (task << task_bits) + (lane >> a.pull_lane_bits);
    if (item < items) {
      const Item it = item_at(item);
      float acc[kUnroll][kElems];
      sum_item(it, acc);
      store_item(it, acc);
    }
    task = grid_warps + (a.claim_pull ? int64_t(__shfl_sync(kFullWarp, claimed, 0)) : task);
  }
  release_pull_done(own, a.sync_settings.system);
}

// 3a. While the grid waits for the peers' flags, a combine whose payload is
// already in the own combine region (final: the kernel boundary ordered the
// writes) prefetches into L2 the first kPrefetchRowsPerSource rows of each
// active source s (rows[s]: recv_count[s], loaded with the epochs). A
// prefetch only fills the cache: it orders nothing and writes nothing. Out of
// line: the pull keeps its registers without it (inlined, it spilled).
__device__ __noinline__ void prefetch_own_rows(const CombineArgs& a, const int32_t* rows) {
  const CombineParams& p = a.p;
  const WorkspaceView& ws = p.ws;
  const int64_t T = p.runtime_max_tokens;
  const uint8_t* region = ws.row(ws.ep_rank) + p.combine_offset;
  const int64_t first = (int64_t(blockIdx.x) * kThreads + threadIdx.x) * kL2LineBytes;
  const int64_t stride = int64_t(gridDim.x) * kThreads * kL2LineBytes;
  for (int s = 0; s < ws.ep_size; ++s) {
    if (!rank_active(p.sync, s)) continue;
    const int64_t bytes = min(received_rows(rows[s], T), kPrefetchRowsPerSource) * a.row_bytes;
    const uint8_t* block = region + int64_t(s) * T * a.row_bytes;
    for (int64_t offset = first; offset < bytes; offset += stride) prefetch_l2(block + offset);
  }
}

// pull_rows with the vector width picked at run time, from the widest (a
// quantized output always has the widest: launch_combine).
template <typename In, typename Out, int kElems = In::kMaxElems>
__device__ void pull_rows_any(const CombineArgs& a, uint32_t count) {
  if constexpr (kElems > 1 && !IsQuantized<Out>::value) {
    if (a.pull_elems != kElems) return pull_rows_any<In, Out, kElems / 2>(a, count);
  }
  pull_rows<In, Out, kElems, pull_unroll(In::kLowPrecision)>(a, count);
}

template <typename In, typename Out>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm) combine_kernel(const __grid_constant__ CombineArgs a) {
  wait_for_previous_grid();
  const CombineParams& p = a.p;
  const WorkspaceView& ws = p.ws;
  uint8_t* own = ws.row(ws.ep_rank);
  // The receive counts that step 1 or step 3a needs: loaded with the epochs
  // (one memory latency, where thread 0 of the staging once loaded them one
  // after another), stored once all of those loads are issued (a shared
  // store waits for its value: 1.4 us more a 1-token round trip when it came
  // first), handed to the CTA by may_proceed's barrier.
  __shared__ int32_t recv_count[kMaxRanks];
  const bool loads_count = (a.stage || a.prefetch) && int(threadIdx.x) < ws.ep_size;
  const int32_t count = loads_count ? *header_word<int32_t>(own, recv_count_offset(threadIdx.x)) : 0;
  const uint32_t dispatch_epoch = *header_word<uint32_t>(own, kHdrDispatchEpoch);
  const uint32_t combine_epoch = *header_word<uint32_t>(own, kHdrCombineEpoch);
  const uint64_t own_init = *header_word<uint64_t>(own, kHdrMagic);
  const uint32_t this_combine = *header_word<uint32_t>(own, kHdrCombineCount) + 1;  // c of protocol.h
  const uint32_t error_code = load_error_code(own);
  // Thread 0: whether this call matches its dispatch (the own header's
  // words of it, in the line of the epochs).
  const uint32_t mismatch =
      threadIdx.x == 0
          ? combine_mismatch(*header_word<int32_t>(own, kHdrLastLocalTokens),
                             *header_word<int32_t>(own, kHdrLastRuntimeMax), *header_word<int32_t>(own, kHdrLastTopK),
                             *header_word<int64_t>(own, kHdrLastDispatchEnd), p.local_num_tokens, p.runtime_max_tokens,
                             p.top_k, p.combine_offset) |
                region_staged_mismatch(*header_word<uint32_t>(own, kHdrRegionStaged),
                                       p.payload == nullptr || p.payload == own + p.combine_offset) |
                rank_major_after_expert_major(*header_word<uint32_t>(own, kHdrExpertMajorEpoch), dispatch_epoch)
          : 0;
  // The T and the payload signature of every active peer's dispatch against
  // the own dispatch's (thread q: peer q), written before the dispatch flags
  // that the own dispatch acquired. Checked here rather than at the end of
  // the dispatch: these loads go with the ones above, where the dispatch
  // would have waited for one more memory latency before its dependents
  // could start.
  const bool checks_peer = int(threadIdx.x) < ws.ep_size && rank_active(p.sync, threadIdx.x);
  const int32_t peer_t = checks_peer ? *header_word<int32_t>(own, peer_runtime_max_offset(threadIdx.x)) : 0;
  const int32_t own_t = checks_peer ? *header_word<int32_t>(own, peer_runtime_max_offset(ws.ep_rank)) : 0;
  const uint32_t peer_payloads = checks_peer ? *header_word<uint32_t>(own, peer_payloads_offset(threadIdx.x)) : 0;
  const uint32_t own_payloads = checks_peer ? *header_word<uint32_t>(own, peer_payloads_offset(ws.ep_rank)) : 0;
  const bool other_round =
      checks_peer && round_tags_differ(*header_word<uint32_t>(own, peer_round_tag_offset(threadIdx.x)),
                                       *header_word<uint32_t>(own, peer_round_tag_offset(ws.ep_rank)));
  const bool other_payloads = peer_payloads != own_payloads || other_round;
  if (loads_count) recv_count[threadIdx.x] = count;
  bool other_call_seen = false;
  if (!may_proceed(own, p.sync.mailbox, error_code, combine_sequence_ok(dispatch_epoch, combine_epoch, own_init),
                   mismatch, peer_t != own_t || other_payloads, &other_call_seen)) {
    return;
  }
  if (other_call_seen) {
    record_peer_call_mismatch(p, peer_t != own_t, other_payloads, other_round, own_t);
    return;
  }

  // 0. A repeated combine of the round that stages waits for the peers' pulls
  // of the one before; 1. stage, and 2. release: every CTA publishes its staged rows with its
  // share of each peer's flag (device.cuh explains the chain), to the peers
  // and to this grid's own CTAs. Without staging (the payload already in the
  // combine region, written by earlier kernels, which the kernel boundary
  // orders) a CTA's share publishes nothing but its reads of the own header,
  // which may_proceed's barrier ordered before it.
  const bool system = a.sync_settings.system;
  if (a.stage) {
    if (dispatch_epoch == combine_epoch &&
        !wait_for_peer_pulls(ws, p.sync, this_combine - 1, kErrorCombineTimeout, a.sync_settings)) {
      return;
    }
    if constexpr (In::kLowPrecision) {
      stage_rows_e4m3<In>(p, a.row_bytes, recv_count, a.stage_vectors, a.own_from_payload ? ws.ep_rank : -1);
    } else {
      stage_rows(a, recv_count);
    }
    __syncthreads();
  }
  release_share(ws, p.sync, kHdrCombineFlags, system);
  if (blockIdx.x == 0 && threadIdx.x == 0) *combine_claim_word(own, this_combine + 1) = 0;
  if (a.prefetch) prefetch_own_rows(a, recv_count);
  if constexpr (IsQuantized<Out>::value) {
    zero_scale_padding(p);
    fill_nvfp4_inverse_table(p);  // acquire_combine_flags' barrier publishes it to the CTA
  }
  fill_pull_row_bases(a);  // published as the table above

  // 3. Acquire: every CTA, so that each one's pull loads follow its own
  // acquire of every flag (own rank's included).
  if (!acquire_combine_flags(ws, p.sync, dispatch_epoch, this_combine, a.stage, a.sync_settings)) return;

  // 4. Pull, 5. release this CTA's share of pull_done (in pull_rows): a
  // peer's dispatch step 0 reads it before it overwrites regions this pull read.
  pull_rows_any<In, Out>(a, this_combine);
}

int64_t dtype_bytes(DType d) { return d == DType::kFloat32 ? 4 : 2; }

// The low-precision instantiations: e4m3 rows staged from each payload dtype,
// into bf16 or a quantized output.
template <bool kScaled, typename F>
cudaError_t for_each_low_precision(F&& f) {
  cudaError_t err = f(combine_kernel<E4m3Rows<F32, kScaled>, BF16>);
  if (err == cudaSuccess) err = f(combine_kernel<E4m3Rows<F16, kScaled>, BF16>);
  if (err == cudaSuccess) err = f(combine_kernel<E4m3Rows<BF16, kScaled>, BF16>);
  if (err == cudaSuccess) err = f(combine_kernel<E4m3Rows<F32, kScaled>, QuantizedOut<BF16>>);
  if (err == cudaSuccess) err = f(combine_kernel<E4m3Rows<F16, kScaled>, QuantizedOut<BF16>>);
  if (err == cudaSuccess) err = f(combine_kernel<E4m3Rows<BF16, kScaled>, QuantizedOut<BF16>>);
  return err;
}

template <typename In, typename Out>
cudaError_t launch_as(const CombineArgs& a, int grid, cudaStream_t stream, bool pdl) {
  return launch_kernel(combine_kernel<In, Out>, grid, kThreads, stream, pdl, a);
}

template <typename Payload, bool kScaled>
cudaError_t launch_low_precision(const CombineArgs& a, int grid, cudaStream_t stream, bool pdl) {
  if (a.p.quant != QuantFormat::kNone)
    return launch_as<E4m3Rows<Payload, kScaled>, QuantizedOut<BF16>>(a, grid, stream, pdl);
  return launch_as<E4m3Rows<Payload, kScaled>, BF16>(a, grid, stream, pdl);
}

template <typename Payload>
cudaError_t launch_low_precision(const CombineArgs& a, int grid, cudaStream_t stream, bool pdl) {
  if (a.p.low_precision == LowPrecision::kE4m3BlockScaled)
    return launch_low_precision<Payload, true>(a, grid, stream, pdl);
  return launch_low_precision<Payload, false>(a, grid, stream, pdl);
}

// Every instantiation of combine_kernel that launch_combine may launch.
template <typename F>
cudaError_t for_each_combine_kernel(F&& f) {
  cudaError_t err = f(combine_kernel<F32, F32>);
  if (err == cudaSuccess) err = f(combine_kernel<F16, F16>);
  if (err == cudaSuccess) err = f(combine_kernel<BF16, BF16>);
  if (err == cudaSuccess) err = f(combine_kernel<F32, BF16>);
  if (err == cudaSuccess) err = f(combine_kernel<F16, BF16>);
  if (err == cudaSuccess) err = f(combine_kernel<F16, QuantizedOut<F16>>);
  if (err == cudaSuccess) err = f(combine_kernel<BF16, QuantizedOut<BF16>>);
  if (err == cudaSuccess) err = for_each_low_precision<false>(f);
  if (err == cudaSuccess) err = for_each_low_precision<true>(f);
  return err;
}

}  // namespace

cudaError_t combine_ctas_per_sm(int* ctas_per_sm) {
  *ctas_per_sm = std::numeric_limits<int>::max();
  return for_each_combine_kernel([&](auto kernel) { return lower_to_occupancy(kernel, ctas_per_sm); });
}

cudaError_t launch_combine(const CombineParams& p, const LaunchConfig& config, cudaStream_t stream) {
  CombineArgs a{};
  a.p = p;
  a.sync_settings = make_sync_settings(p.sync.timeout_s, config);
  const bool low_precision = p.low_precision != LowPrecision::kOff;
  const bool quantized = p.quant != QuantFormat::kNone;
  const int64_t in_bytes = dtype_bytes(p.payload_dtype);
  // Bytes of an element the pull reads (e4m3 rows: 1) and of one it writes.
  const int64_t pull_bytes = low_precision ? 1 : in_bytes;
  const int64_t out_bytes = dtype_bytes(p.output_dtype);
  a.row_bytes = p.row_elems * in_bytes;
  if (a.row_bytes > kMaxKernelRowBytes) return cudaErrorInvalidValue;
  // Combine rows start at base + d * row_stride + combine_offset + row * row_bytes.
  const uint64_t rows_bits = address_bits(p.ws.base) | uint64_t(p.ws.row_stride) | uint64_t(p.combine_offset);
  a.stage = combine_stages(p);
  a.own_from_payload = combine_own_rows_from_payload(p);
  if (a.stage && !low_precision) a.stage_plan = make_copy_plan(a.row_bytes, rows_bits | address_bits(p.payload));
  // A 16-byte vector of every staged row aligned in the payload and the
  // region (the rows' offsets are multiples of row_bytes).
  const int64_t stage_vec = 16 / in_bytes;
  a.stage_vectors = low_precision && p.row_elems % stage_vec == 0 &&
                    (rows_bits | address_bits(p.payload) | uint64_t(a.row_bytes)) % uint64_t(stage_vec * in_bytes) == 0;
  // The widest element count whose input and output vectors are aligned.
  const int unroll = pull_unroll(low_precision);
  const int widest = low_precision ? kE4m3PullElems : int(16 / in_bytes);
  int elems = widest;
  const auto out_vector_bytes = [&](int n) -> uint64_t {
    if (!quantized) return uint64_t(std::min<int64_t>(n * out_bytes, 16));  // VecOf<32>: 16-byte aligned
    return uint64_t(p.quant == QuantFormat::kMxfp8 ? n : n / 2);
  };
  // The pull's rows: the combine regions', and the payload's own plane.
  const uint64_t pull_bits = rows_bits | (a.own_from_payload ? address_bits(p.payload) : 0);
  while (elems > 1 &&
         (p.row_elems % elems != 0 || (pull_bits | uint64_t(a.row_bytes)) % uint64_t(elems * pull_bytes) != 0 ||
          address_bits(p.output) % out_vector_bytes(elems) != 0)) {
    elems /= 2;
  }
  // ops.cpp's checks (16-byte aligned output, rows of whole blocks) leave a
  // quantized output the widest vectors, which its epilogue assumes.
  if (quantized && elems != widest) return cudaErrorInvalidValue;
  a.pull_elems = elems;
  // e4m3 rows of a 16-bit payload with the widest pull vectors and every row
  // 16-byte aligned: the own source's rows are pulled unconverted from the
  // payload (or in place) rather than staged (OwnRowsUnstaged), as plain
  // rows are: the staging's read and write of them and the pull's e4m3 read
  // become one read of the payload row.
  // pull_rows' kOwnUnstaged holds for exactly these kernels: a kernel
  // without it would read the 16-bit rows as e4m3 codes.
  static_assert(kE4m3PullUnroll == 1, "pull_rows converts the own rows of one vector a lane");
  if (p.low_precision == LowPrecision::kE4m3 && in_bytes == 2 && a.stage_vectors && elems == kE4m3PullElems &&
      !p.payload_in_workspace_memory) {
    a.own_from_payload = true;
  }
  const int64_t vectors = p.row_elems / elems;
  int pull_lanes = lanes_per_row(vectors, unroll);
  // A quantized block's vectors lie in adjacent lanes of one row's group.
  if (quantized) pull_lanes = std::max(pull_lanes, int(quant_block(p.quant) / elems));
  a.pull_lane_bits = log2_exact(pull_lanes);
  const int64_t per_segment = int64_t(pull_lanes) * unroll;
  a.pull_segments = static_cast<int>((vectors + per_segment - 1) / per_segment);
  // The items' division by pull_segments as a multiply-high (the magic
  // number of a division by a constant; correct for dividends and divisors
  // below 2^31): a 64-bit division a pull item cost about 1% of the e4m3
  // combine at ep 8 x 4096 tokens on an H200 (same-build A/B: 1381 -> 1366 us).
  if (a.pull_segments > 0 && p.local_num_tokens * a.pull_segments < (int64_t(1) << 31)) {
    int shift = 0;
    while ((int64_t(1) << shift) < a.pull_segments) ++shift;
    const uint64_t d = uint64_t(a.pull_segments);
    a.segments_shift = shift;
    a.segments_magic = uint32_t((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d) / d + 1);
  }

  // Pull: a row written per token (and as many read per destination); staging
  // copies about as many rows again.
  const int grid = spinning_grid_size(config, p.local_num_tokens * a.row_bytes * (a.stage ? 2 : 1));
  // Claims pay where a warp has more than one task and one counter serves the grid.
  const int64_t grid_warps = int64_t(grid) * kWarps;
  const int64_t tasks = (p.local_num_tokens * a.pull_segments * pull_lanes + kWarpSize - 1) / kWarpSize;
  a.claim_pull = grid_warps <= kWarpsPerClaimCounter && tasks > grid_warps;
  a.one_task = tasks <= grid_warps;
  a.prefetch = !a.stage && p.runtime_max_tokens >= kPrefetchMinTokens;
  const bool pdl = p.sync.enable_pdl && config.pdl_supported;
  const DType in = p.payload_dtype, out = p.output_dtype;
  if (low_precision) {
    if (in == DType::kFloat32) return launch_low_precision<F32>(a, grid, stream, pdl);
    if (in == DType::kFloat16) return launch_low_precision<F16>(a, grid, stream, pdl);
    return launch_low_precision<BF16>(a, grid, stream, pdl);
  }
  if (quantized) {
    if (in == DType::kFloat16) return launch_as<F16, QuantizedOut<F16>>(a, grid, stream, pdl);
    if (in == DType::kBFloat16) return launch_as<BF16, QuantizedOut<BF16>>(a, grid, stream, pdl);
    return cudaErrorInvalidValue;  // ops.cpp admits bf16 and fp16 payloads only
  }
  if (in == DType::kFloat32 && out == DType::kFloat32) return launch_as<F32, F32>(a, grid, stream, pdl);
  if (in == DType::kFloat16 && out == DType::kFloat16) return launch_as<F16, F16>(a, grid, stream, pdl);
  if (in == DType::kBFloat16 && out == DType::kBFloat16) return launch_as<BF16, BF16>(a, grid, stream, pdl);
  if (in == DType::kFloat32 && out == DType::kBFloat16) return launch_as<F32, BF16>(a, grid, stream, pdl);
  if (in == DType::kFloat16 && out == DType::kBFloat16) return launch_as<F16, BF16>(a, grid, stream, pdl);
  return cudaErrorInvalidValue;  // ops.h admits only the pairs above
}

}  // namespace gpu
}  // namespace moe_a2a
