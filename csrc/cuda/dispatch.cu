// The dispatch kernels: protocol.h's dispatch n on rank s, in one persistent
// grid per rank; a small call (chunks of at most a warp's tokens) runs
// dispatch_small_kernel, every other call dispatch_kernel.
//
// Design (why it is deterministic and why few CTAs spin):
//   * CTA b owns the contiguous token chunk [b * c, (b + 1) * c). A token's
//     slot at destination d is the number of earlier tokens that also go to
//     d, so CTA b first counts, per destination, the tokens before its chunk
//     (a sum: the order in which warps add does not matter; in a large call
//     the sum of the counts that CTAs 0 .. b-1 publish of their chunks), then
//     ranks its own tokens in index order with warp ballots (and a scan over
//     warps in a long chunk). The slots are exactly the CPU's running counts;
//     no atomic decides an order.
//   * Each CTA writes its tokens' route entries to the own route region. A
//     small call's CTA then copies its own tokens' payload rows to their
//     destinations (a segment of a row is loaded once, then stored to every
//     destination). In a large call every CTA waits until all chunks are
//     routed, then the copy tasks of all of the rank's tokens are claimed in
//     token order (from one counter, or from a few where a large grid would
//     queue on one word): chunks of equal token counts do not get equal
//     shares of the memory system, and the rank's concurrent writes stay
//     near each other in every destination plane.
//   * The CTA that owns the last chunk holds the per-destination totals and
//     writes the receive counts. Every CTA publishes its part with its share
//     of each destination's flag (protocol.h: flags count shares), so no CTA
//     waits for another before a peer may read its rows; CTA 0 is the only
//     one that waits for the peers.
#include <algorithm>
#include <limits>

#include "device.cuh"

namespace moe_a2a {
namespace gpu {
namespace {

// Dispatch step 5's own header words (protocol.h), written by thread 0 of
// CTA 0 once every active rank's flag arrived: the sizes the matching combine
// checks, the epoch, and the expert-major epoch (`expert_major_epoch`: the
// epoch where this kernel wrote the call's expert-major rows, else
// stale_expert_major_epoch's).
__device__ inline void write_dispatch_record(uint8_t* own, const DispatchParams& p, int64_t n, uint32_t epoch,
                                             uint32_t expert_major_epoch, uint64_t own_init) {
  *header_word<int32_t>(own, kHdrLastLocalTokens) = static_cast<int32_t>(n);
  *header_word<int32_t>(own, kHdrLastRuntimeMax) = static_cast<int32_t>(p.runtime_max_tokens);
  *header_word<int32_t>(own, kHdrLastTopK) = static_cast<int32_t>(p.top_k);
  *header_word<int64_t>(own, kHdrLastDispatchEnd) = p.layout.dispatch_end;
  *header_word<uint32_t>(own, kHdrDispatchEpoch) = epoch;
  *header_word<uint32_t>(own, kHdrRegionStaged) = 0;
  *header_word<uint32_t>(own, kHdrExpertMajorEpoch) = expert_major_epoch;
  if (first_dispatch(own_init)) mark_in_use(own);
}

// Up to this many experts, each CTA of a large call maps expert -> rank
// through a shared-memory table filled with expert_to_rank (protocol.h: the
// one definition of the map) instead of a 64-bit division per id.
constexpr int kRankTableExperts = 4096;
static_assert(kMaxRanks <= 256, "the rank table stores ranks as uint8_t");

// expert_to_rank out of line: the slow path of experts beyond the shared table
// (64-bit divisions), which every inlined copy of Router::dests would otherwise carry.
__device__ __noinline__ int expert_to_rank_slow(int64_t expert, int64_t num_experts, int ep_size) {
  return expert_to_rank(expert, num_experts, ep_size);
}

// Expert ids of a token loaded together (top_k <= 8, the common case, is one batch).
constexpr int kIdsPerBatch = 8;

// Copy items (token, segment) of all payloads that a large call's copy loop
// covers at most (all of the rank's tokens): the loop's task indices are
// 32-bit ints (fewer registers under the 64-register cap), and a claimed task
// is grid * kWarps + counter + claim * counters, where every warp overshoots
// its counter once. A call beyond it would hold terabytes.
constexpr int64_t kMaxLoopItems = int64_t(1) << 30;
static_assert(kMaxLoopItems + 2 * int64_t(kMaxDispatchCtas) * kWarps <= int64_t(INT32_MAX),
              "claimed task indices fit an int");

// A large call's grid claims from one counter per kWarpsPerClaimCounter
// warps (device.cuh). One counter keeps the tasks in flight a narrow window of
// tokens (ep 8 on an H200: 512 warps a rank, 843 us against 853 with 16
// counters at 4096 tokens).
static_assert(kWarps % kClaimCounters == 0, "counter c serves the warps w = c mod counters of every CTA");

// expert -> rank (protocol.h's expert_to_rank_in) by two multiplications
// instead of divisions, for calls of at most kRankMapExperts experts: with
// magic(d) = ceil(2^32 / d), (n * magic(d)) >> 32 == n / d whenever n * d <
// 2^32 (n = qd + r: n * magic(d) / 2^32 = q + r/d + e with 0 <= e < n/2^32 <
// 1/d, so below q + 1).
constexpr int64_t kRankMapExperts = 65535;

struct RankMap {
  uint32_t boundary;  // experts below it: extra ranks of base + 1 experts each
  uint32_t extra;
  uint64_t wide_magic;    // magic(base + 1)
  uint64_t narrow_magic;  // magic(base)

  __device__ __forceinline__ int rank(uint32_t e) const {
    return e < boundary ? int((uint64_t(e) * wide_magic) >> 32)
                        : int(extra + ((uint64_t(e - boundary) * narrow_magic) >> 32));
  }
};

inline RankMap make_rank_map(int64_t num_experts, int64_t ep_size) {
  const int64_t base = num_experts / ep_size, extra = num_experts % ep_size;  // base >= 1: ops.cpp checks
  const auto magic = [](int64_t d) { return ((uint64_t(1) << 32) + uint64_t(d) - 1) / uint64_t(d); };
  return RankMap{uint32_t(extra * (base + 1)), uint32_t(extra), magic(base + 1), magic(base)};
}

struct DispatchArgs {
  DispatchParams p;
  RankMap rank_map;  // dispatch_small_kernel's
  SyncSettings sync_settings;
  int64_t tokens_per_cta;
  int claim_bits;  // dispatch_kernel: log2 of the claim counters used
  CopyPlan plan[kMaxCallPayloads];

  // Warp tasks of payload i for `count` tokens (step 3): a task is
  // kWarpSize / lanes items, a power of two.
  __device__ int warp_tasks(int i, int count) const {
    const int task_bits = kLog2WarpSize - plan[i].lane_bits;
    return int((int64_t(count) * plan[i].segments + (int64_t(1) << task_bits) - 1) >> task_bits);
  }
};

// Scratch words of the large calls in the own header (protocol.h).
__device__ __forceinline__ uint32_t* claim_word(uint8_t* own, int c) {
  return header_word<uint32_t>(own, claim_counter_offset(c));
}

__device__ __forceinline__ uint32_t* routed_word(uint8_t* own, int c) {
  return header_word<uint32_t>(own, kHdrDispatchRouted + int64_t(sizeof(uint32_t)) * c);
}

// Tokens of chunk c that go to rank d, tagged with the epoch of the call that
// counted them (protocol.h).
__device__ __forceinline__ uint64_t* count_word(uint8_t* own, int ep_size, int c, int d) {
  return header_word<uint64_t>(own, kHdrDispatchCounts + int64_t(sizeof(uint64_t)) * (int64_t(c) * ep_size + d));
}

// The calling thread waits for a word that another CTA of this grid writes
// (ready() tells). Every CTA writes its words unless it returned early, and
// each early return follows an error recorded in the own header, which stops
// the wait; the timeout only bounds the wait should that ever fail, and
// names the own rank.
template <typename Ready>
__device__ bool wait_for_grid(uint8_t* own, const DispatchArgs& a, Ready&& ready) {
  const PollResult result = poll_until(own, a.sync_settings.timeout_ns, ready, [] { return false; });
  if (result == PollResult::kTimedOut) {
    record_error(own, a.p.sync.mailbox, kErrorDispatchTimeout, uint64_t(1) << a.p.ws.ep_rank,
                 a.sync_settings.timeout_ms);
  }
  return result == PollResult::kReady;
}

// Step 1a of a large call's CTA: publishes its chunk's counts, then adds those
// of the chunks before it to next_slot (every thread calls it; a failed wait
// sets *failed). Out of line: the copy loop then keeps the registers it has
// without it.
__device__ __noinline__ void publish_and_sum_counts(uint8_t* own, const DispatchArgs& a, uint32_t epoch,
                                                    const uint32_t* chunk_count, uint32_t* next_slot, int* failed) {
  const int ep_size = a.p.ws.ep_size;
  if (int(threadIdx.x) < ep_size) {
    st_relaxed_gpu(count_word(own, ep_size, blockIdx.x, threadIdx.x),
                   (uint64_t(epoch) << 32) | chunk_count[threadIdx.x]);
  }
  const uint64_t* before = count_word(own, ep_size, 0, 0);
  for (int i = threadIdx.x; i < int(blockIdx.x) * ep_size; i += kThreads) {
    uint64_t word = 0;
    if (!wait_for_grid(own, a, [&] {
          word = ld_relaxed_gpu(before + i);
          return uint32_t(word >> 32) == epoch;
        })) {
      *failed = 1;
      return;
    }
    atomicAdd(&next_slot[i % ep_size], static_cast<uint32_t>(word));
  }
}

// Step 3 of a large call's CTA: thread c acquires CTA c's routed word (a
// failed wait sets *failed). Out of line, as publish_and_sum_counts.
__device__ __noinline__ void wait_all_routed(uint8_t* own, const DispatchArgs& a, uint32_t epoch, int* failed) {
  for (int c = threadIdx.x; c < int(gridDim.x); c += kThreads) {
    const uint32_t* routed = routed_word(own, c);
    // Equal, not reached: the word is never reset (protocol.h, routed[b]).
    if (!wait_for_grid(own, a, [&] { return ld_acquire_gpu(routed) == epoch; })) {
      *failed = 1;
      return;
    }
  }
}

// Step 0a (protocol.h), by every thread of the first dispatch since
// initialize: it writes into no row before its owner zeroed it since its last
// use (the init word, stored last); CTA 0 then notes the tags it saw, for the
// next initialize. Out of line: it runs once per initialize, and inlined it
// would cost the copy loops registers.
__device__ __noinline__ bool first_dispatch_wait(const DispatchArgs& a, uint64_t own_init) {
  const WorkspaceView& ws = a.p.ws;
  uint8_t* own = ws.row(ws.ep_rank);
  const uint16_t own_count = init_count(own_init);
  auto init_word_of = [&](int q) {
    return ld_acquire(header_word<uint64_t>(ws.row(q), kHdrMagic), a.sync_settings.system);
  };
  const bool zeroed = wait_for_peers(
      ws, a.p.sync,
      [&](int q) { return fresh_peer(init_word_of(q), *header_word<uint16_t>(own, init_stale_offset(q)), own_count); },
      kErrorDispatchTimeout, a.sync_settings,
      [&](int q) {
        // The error read after the init word (acquire): it is the current initialization's.
        return current_peer(init_word_of(q), *header_word<uint16_t>(own, init_stale_offset(q)), own_count) &&
               peer_error_recorded(ws, q, a.sync_settings);
      });
  const int q = threadIdx.x;
  if (blockIdx.x == 0 && q < ws.ep_size && rank_active(a.p.sync, q)) {
    *header_word<uint16_t>(own, init_seen_offset(q)) = init_tag(init_word_of(q));
  }
  return zeroed;
}

// Step 0b's wait (wait_before_writing) for the round's last combine, out of
// line: it runs only where regions overlap, and its load of the own combine
// count inlined into the kernels cost them spills.
__device__ __noinline__ bool wait_for_pulls(const DispatchArgs& a) {
  const WorkspaceView& ws = a.p.ws;
  const uint32_t combines = *header_word<uint32_t>(ws.row(ws.ep_rank), kHdrCombineCount);
  return wait_for_peer_pulls(ws, a.p.sync, combines, kErrorDispatchTimeout, a.sync_settings);
}

// Step 0 of a dispatch (protocol.h), by every thread: false when a wait
// failed (recorded). 0a: first_dispatch_wait, when the own init word
// (`own_init`, loaded with the other header words) is not yet in use. 0b:
// when this call's regions may cover what a rank still reads of the
// previous round (its combine region or its own routes), nothing is written
// before every active rank finished pulling the round's last combine (its
// pull_done, which every CTA of its combines adds its share to once its
// pull's loads are done). A call of the previous call's sizes waits for
// neither: the check is all it costs.
__device__ __forceinline__ bool wait_before_writing(const DispatchArgs& a, uint64_t own_init, int64_t last_dispatch_end,
                                                    int32_t last_runtime_max) {
  if (first_dispatch(own_init) && !first_dispatch_wait(a, own_init)) return false;
  if (previous_call_overlap(a.p.layout.dispatch_end, last_dispatch_end, a.p.runtime_max_tokens, last_runtime_max)) {
    return wait_for_pulls(a);
  }
  return true;
}

// Dispatch step 4, by every thread of the grid: the own EPLB row into every
// active rank's EPLB region. Out of line: the calls that gather EPLB stats are
// few, and its divisions would otherwise sit in the copy kernels' code.
__device__ __noinline__ void write_eplb_rows(const DispatchParams& p) {
  const WorkspaceView& ws = p.ws;
  const int64_t total = int64_t(ws.ep_size) * p.eplb_n;
  for (int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x; idx < total; idx += int64_t(gridDim.x) * kThreads) {
    const int d = static_cast<int>(idx / p.eplb_n);
    const int64_t e = idx % p.eplb_n;
    if (!rank_active(p.sync, d)) continue;
    int32_t* gathered = reinterpret_cast<int32_t*>(ws.row(d) + p.layout.eplb_offset);
    gathered[int64_t(ws.ep_rank) * p.eplb_n + e] = p.eplb_local_stats[e];
  }
}

// The destination set of a token: bit r is set when an active rank r owns one
// of its experts. Negative ids are skipped; ids >= num_experts are skipped and
// counted in `invalid`.
struct Router {
  const void* ids;  // [local_num_tokens, top_k], int32 or (ids_int64) int64
  bool ids_int64;
  int64_t top_k;
  int64_t num_experts;
  int ep_size;
  uint64_t active;
  const uint8_t* rank_of;  // shared table, or nullptr: call expert_to_rank

  __device__ __forceinline__ uint64_t dests(int64_t t, uint32_t& invalid) const {
    // One branch for the call (uniform across the grid): the loads stay the caller's width.
    return ids_int64 ? dests_of(static_cast<const int64_t*>(ids) + t * top_k, invalid)
                     : dests_of(static_cast<const int32_t*>(ids) + t * top_k, invalid);
  }

  template <typename Id>
  __device__ __forceinline__ uint64_t dests_of(const Id* row, uint32_t& invalid) const {
    uint64_t set = 0;
    // Ids in batches whose loads are all issued before the first is used: few
    // memory latencies per token without holding kMaxTopK ids in registers.
    for (int first = 0; first < top_k; first += kIdsPerBatch) {
      Id expert[kIdsPerBatch];
#pragma unroll
      for (int k = 0; k < kIdsPerBatch; ++k) expert[k] = first + k < top_k ? row[first + k] : Id(-1);
#pragma unroll
      for (int k = 0; k < kIdsPerBatch; ++k) {
        const Id e = expert[k];
        if (e < 0) continue;
        if (e >= num_experts) {
          ++invalid;
          continue;
        }
        const int rank = rank_of != nullptr ? int(rank_of[e]) : expert_to_rank_slow(e, num_experts, ep_size);
        set |= uint64_t(1) << rank;
      }
    }
    return set & active;
  }
};

// A large call (every call that dispatch_small_kernel does not take): CTAs
// count and route their chunks through the words they publish to each other
// and copy the tasks of all of the rank's tokens. kSpreadClaims: the claims
// spread over several counters; a grid with one counter runs the simpler
// claim loop (same-call A/B, ep 8 x 4096 tokens on an H200: 863 against 871
// us; docs/performance.md, 'Design decisions and their measured effect').
template <bool kSpreadClaims>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm) dispatch_kernel(const __grid_constant__ DispatchArgs a) {
  const DispatchParams& p = a.p;
  const WorkspaceView& ws = p.ws;
  __shared__ uint8_t rank_table[kRankTableExperts];
  __shared__ uint32_t next_slot[kMaxRanks];                // per destination: first slot not yet given
  __shared__ uint32_t warp_first_slot[kWarps][kMaxRanks];  // per round: a warp's first slot per destination
  __shared__ uint32_t chunk_count[kMaxRanks];              // the own chunk's tokens per destination
  __shared__ unsigned long long invalid_in_cta;
  __shared__ int grid_wait_failed;

  // Prologue from the params alone: under PDL it overlaps the previous kernel.
  const int ep_size = ws.ep_size;
  const int lane = lane_id();
  const int warp = warp_id();
  const bool use_table = p.num_experts <= kRankTableExperts;
  if (use_table) {
    for (int e = threadIdx.x; e < p.num_experts; e += kThreads) {
      rank_table[e] = static_cast<uint8_t>(expert_to_rank_in<int32_t>(e, int32_t(p.num_experts), ep_size));
    }
  }
  if (threadIdx.x < kMaxRanks) {
    next_slot[threadIdx.x] = 0;
    chunk_count[threadIdx.x] = 0;
  }
  if (threadIdx.x == 0) {
    invalid_in_cta = 0;
    grid_wait_failed = 0;
  }
  __syncthreads();

  wait_for_previous_grid();
  uint8_t* own = ws.row(ws.ep_rank);
  const Router router{
      p.token_selected_experts,        p.ids_int64, p.top_k, p.num_experts, ep_size, p.sync.active_mask[0],
      use_table ? rank_table : nullptr};
  const int64_t n = p.local_num_tokens;
  const int64_t begin = min(n, int64_t(blockIdx.x) * a.tokens_per_cta);
  const int64_t end = min(n, begin + a.tokens_per_cta);
  // The CTA of the last chunk ends up holding the per-destination totals.
  const bool owns_last_chunk = blockIdx.x == gridDim.x - 1;

  // Everything the first steps decide on is loaded before any of it is
  // used, so that its loads share one memory latency: the own header words,
  // then the expert ids of this thread's first token of the chunk. Reading
  // the ids before step 0 is fine: step 0 only keeps this call from writing.
  const uint32_t dispatch_epoch = *header_word<uint32_t>(own, kHdrDispatchEpoch);
  const uint32_t combine_epoch = *header_word<uint32_t>(own, kHdrCombineEpoch);
  const int64_t last_dispatch_end = *header_word<int64_t>(own, kHdrLastDispatchEnd);
  const int32_t last_runtime_max = *header_word<int32_t>(own, kHdrLastRuntimeMax);
  const uint64_t own_init = *header_word<uint64_t>(own, kHdrMagic);
  const uint32_t error_code = load_error_code(own);
  uint32_t not_counted_here = 0;  // invalid ids are counted where step 1b routes them
  uint32_t invalid = 0;
  const int64_t own_token = begin + threadIdx.x;  // the first round of steps 1a and 1b
  const uint64_t own_set = own_token < end ? router.dests(own_token, invalid) : 0;

  if (!may_proceed(own, p.sync.mailbox, error_code, dispatch_epoch == combine_epoch)) return;
  const uint32_t epoch = dispatch_epoch + 1;

  // 0. protocol.h dispatch step 0 (every CTA reads kHdrLastDispatchEnd and
  // kHdrLastRuntimeMax before it releases its share; CTA 0 rewrites them
  // once it saw every share, step 5).
  if (!wait_before_writing(a, own_init, last_dispatch_end, last_runtime_max)) return;

  // 1a. The first slot per destination. CTA b counts only its own chunk,
  // publishes the counts, and sums those of the chunks before it (every CTA
  // publishes before it waits, and all of them are resident): counting b
  // long chunks itself, each round would wait long for its loads while the
  // other CTAs copy. Rounds of kThreads tokens, the first one's sets loaded
  // already; lane l keeps the counts of destinations l and l + 32 for its
  // warp. Invalid ids are counted where step 1b routes them.
  {
    uint32_t count_low = 0, count_high = 0;
    for (int64_t first = begin + int64_t(warp) * kWarpSize; first < end; first += kThreads) {
      const int64_t t = first + lane;
      const uint64_t set = t == own_token ? own_set : t < end ? router.dests(t, not_counted_here) : 0;
      for (uint64_t present = warp_or(set); present != 0; present &= present - 1) {
        const int d = lowest_rank(present);
        const uint32_t count = __popc(__ballot_sync(kFullWarp, (set >> d) & 1));
        if (lane == d % kWarpSize) {
          if (d < kWarpSize) {
            count_low += count;
          } else {
            count_high += count;
          }
        }
      }
    }
    if (lane < ep_size) atomicAdd(&chunk_count[lane], count_low);
    if (lane + kWarpSize < ep_size) atomicAdd(&chunk_count[lane + kWarpSize], count_high);
  }
  __syncthreads();
  publish_and_sum_counts(own, a, epoch, chunk_count, next_slot, &grid_wait_failed);
  __syncthreads();
  // Without the counts the slots would be wrong: this CTA stops, so its share
  // is never released and no flag publishes the call.
  if (grid_wait_failed) return;

  // 1b. The chunk, kThreads tokens per round in index order: a token's slot
  // is next_slot + the tokens of earlier warps of the round + the earlier
  // lanes of its warp that go to the same destination. A chunk of at most
  // kWarpSize tokens is warp 0's alone: its ballots give the slots without
  // the scan over warps and its barriers.
  int32_t* routes = reinterpret_cast<int32_t*>(own + p.layout.route_offset);
  if (end - begin <= kWarpSize) {
    if (warp == 0) {
      int32_t* route = routes + own_token * kMaxTopK;
      int entries = 0;
      for (uint64_t rest = warp_or(own_set); rest != 0; rest &= rest - 1) {
        const int d = lowest_rank(rest);
        const uint32_t going = __ballot_sync(kFullWarp, (own_set >> d) & 1);
        if ((own_set >> d) & 1) route[entries++] = route_entry(d, next_slot[d] + __popc(going & lanes_below()));
        __syncwarp();  // every lane read next_slot[d] before lane 0 advances it
        if (lane == 0) next_slot[d] += __popc(going);
      }
      if (own_token < end && entries < kMaxTopK) route[entries] = kRouteEnd;
    }
  } else {
    for (int64_t round = begin; round < end; round += kThreads) {
      const int64_t t = round + threadIdx.x;
      const bool mine = t < end;
      const uint64_t set = t == own_token ? own_set : mine ? router.dests(t, invalid) : 0;
      const uint64_t present = warp_or(set);
      for (int d = lane; d < ep_size; d += kWarpSize) warp_first_slot[warp][d] = 0;
      __syncwarp();
      for (uint64_t rest = present; rest != 0; rest &= rest - 1) {
        const int d = lowest_rank(rest);
        const uint32_t count = __popc(__ballot_sync(kFullWarp, (set >> d) & 1));
        if (lane == 0) warp_first_slot[warp][d] = count;
      }
      __syncthreads();
      if (threadIdx.x < ep_size) {
        const int d = threadIdx.x;
        uint32_t next = next_slot[d];
        for (int w = 0; w < kWarps; ++w) {
          const uint32_t count = warp_first_slot[w][d];
          warp_first_slot[w][d] = next;
          next += count;
        }
        next_slot[d] = next;
      }
      __syncthreads();
      int32_t* route = routes + t * kMaxTopK;
      int entries = 0;
      for (uint64_t rest = present; rest != 0; rest &= rest - 1) {
        const int d = lowest_rank(rest);
        const uint32_t earlier = __ballot_sync(kFullWarp, (set >> d) & 1) & lanes_below();
        if ((set >> d) & 1) route[entries++] = route_entry(d, warp_first_slot[warp][d] + __popc(earlier));
      }
      if (mine && entries < kMaxTopK) route[entries] = kRouteEnd;
      __syncthreads();  // warp_first_slot is reused by the next round
    }
  }

  invalid = warp_sum(invalid);
  if (lane == 0 && invalid != 0) atomicAdd(&invalid_in_cta, static_cast<unsigned long long>(invalid));
  // Also makes this CTA's route entries visible to all of its threads for the copies.
  __syncthreads();
  if (threadIdx.x == 0 && invalid_in_cta != 0) {
    atomicAdd(header_word<unsigned long long>(own, kHdrInvalidExpertCount), invalid_in_cta);
  }
  // The route entries of the chunk, for the CTAs that copy some of its tokens (step 3).
  if (threadIdx.x == 0) {
    fence(/*system=*/false);
    st_release_gpu(routed_word(own, blockIdx.x), epoch);
  }

  // 2. Receive counts: the totals, known to the CTA of the last chunk, which
  // also zeroes the own count of every masked-off source (it writes nothing
  // here this call: none of the rows an earlier call left from it counts).
  if (owns_last_chunk && threadIdx.x < ep_size) {
    const int d = threadIdx.x;
    if (rank_active(p.sync, d)) {
      *header_word<int32_t>(ws.row(d), recv_count_offset(ws.ep_rank)) = static_cast<int32_t>(next_slot[d]);
      *header_word<int32_t>(ws.row(d), peer_runtime_max_offset(ws.ep_rank)) =
          static_cast<int32_t>(p.runtime_max_tokens);
      *header_word<uint32_t>(ws.row(d), peer_payloads_offset(ws.ep_rank)) = p.payload_signature;
      *header_word<uint32_t>(ws.row(d), peer_round_tag_offset(ws.ep_rank)) = p.round_tag;
    } else {
      *header_word<int32_t>(own, recv_count_offset(d)) = 0;
    }
  }

  // 3. Payload rows. Work items are (token, segment of its row) of every
  // payload, handed out by warp: a warp task is the kWarpSize / lanes items
  // the groups of one warp copy together, and the tasks of all payloads of
  // the rank's tokens form one sequence. A warp's tasks only increase, so its
  // payload index only moves forward. Each warp of the grid takes its first
  // task by index and claims later ones from one of the rank's counters
  // (claim_counter_offset, the claim for the next task issued before the
  // current copy), once every chunk's route entries are visible: thread c
  // acquires CTA c's routed word, and the barrier hands what it saw to the
  // CTA. The rows land where the routes say whoever copies them: the result
  // is the same bytes whatever the order of claims.
  const int64_t source_row = int64_t(ws.ep_rank) * p.runtime_max_tokens;
  wait_all_routed(own, a, epoch, &grid_wait_failed);
  __syncthreads();
  if (grid_wait_failed) return;
  const int count = int(n);
  int task = int(blockIdx.x) * kWarps + warp;
  // The tasks after the first round, grid * kWarps + i, go in turn to
  // the claims of counter i mod counters; warp w claims from counter w mod
  // counters (counters divide kWarps, so its first task is of that residue too).
  const int counter = kSpreadClaims ? warp & ((1 << a.claim_bits) - 1) : 0;
  {
    int i = 0;
    int first_task = 0;                                           // of payload i
    int tasks = p.num_payloads > 0 ? a.warp_tasks(0, count) : 0;  // of payload i
    for (;;) {
      while (i < p.num_payloads && task >= first_task + tasks) {
        first_task += tasks;
        ++i;
        tasks = i < p.num_payloads ? a.warp_tasks(i, count) : 0;
      }
      if (i == p.num_payloads) break;
      uint32_t claimed = 0;
      if (lane == 0) claimed = atomicAdd(claim_word(own, counter), 1u);
      const CopyPlan& plan = a.plan[i];
      const int item = ((task - first_task) << (kLog2WarpSize - plan.lane_bits)) + (lane >> plan.lane_bits);
      if (item < count * plan.segments) {  // else past the end of payload i's last task
        const int64_t t = plan.segments == 1 ? item : item / plan.segments;
        const int segment = plan.segments == 1 ? 0 : static_cast<int>(item % plan.segments);
        const int32_t* route = routes + t * kMaxTopK;
        const int64_t row_bytes = p.payload_row_bytes[i];
        const int64_t plane_offset = p.layout.payload_offset[i];
        // A token with no destination finds kRouteEnd first (its segment's loads are wasted).
        copy_segment_any</*kL2Hints=*/true>(
            p.payload[i] + t * row_bytes, plan, segment, lane & (plan.lanes - 1),
            [&](int k) {
              const int32_t entry = route[k];
              return route_in_call(entry, ep_size, p.runtime_max_tokens) ? entry : kRouteEnd;
            },
            [&](int32_t entry) {
              return ws.row(route_rank(entry)) + plane_offset + (source_row + route_slot(entry)) * row_bytes;
            });
      }
      if (kSpreadClaims) {
        task = int(gridDim.x) * kWarps + counter + (int(__shfl_sync(kFullWarp, claimed, 0)) << a.claim_bits);
      } else {
        task = int(gridDim.x) * kWarps + int(__shfl_sync(kFullWarp, claimed, 0));
      }
    }
  }

  // 4. EPLB row s into every active destination, spread over the grid.
  if (p.eplb_local_stats != nullptr) write_eplb_rows(p);

  // 5. Every CTA publishes its own part (steps 2 to 4: device.cuh explains
  // the chain) with its share of each destination's flag; CTA 0 alone then
  // waits for every active rank's shares. The own rank's tell it that every
  // CTA of this grid has read the header words it reads, claimed its last
  // task and released: only then does it write them for the next call.
  const bool system = a.sync_settings.system;
  __syncthreads();
  release_share(ws, p.sync, kHdrDispatchFlags, system);
  if (blockIdx.x != 0) return;
  const bool arrived = wait_for_flags(ws, p.sync, kHdrDispatchFlags, epoch, kErrorDispatchTimeout, a.sync_settings);
  allow_dependent_launch();
  if (!arrived) return;
  if (threadIdx.x < kClaimCounters) *claim_word(own, threadIdx.x) = 0;
  // Not (yet) an expert-major dispatch: its build writes epoch afterwards.
  if (threadIdx.x == 0) write_dispatch_record(own, p, n, epoch, stale_expert_major_epoch(epoch), own_init);
}

// ---- small calls ---------------------------------------------------------------

// Loads / stores the `kCopyUnroll` vectors of one lane's part of a segment
// (copy_segment's pattern), held in uint4 registers whatever the width.
template <int kBytes>
__device__ __forceinline__ void load_vectors(const uint8_t* src, const CopyPlan& plan, int first,
                                             uint4 (&buf)[kCopyUnroll]) {
  using V = typename VecOf<kBytes>::T;
  const V* from = reinterpret_cast<const V*>(src);
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u) {
    const int v = first + u * plan.lanes;
    if (v >= plan.vectors) continue;
    if constexpr (kBytes == 16) {
      buf[u] = from[v];
    } else if constexpr (kBytes == 8) {
      const uint2 x = from[v];
      buf[u].x = x.x;
      buf[u].y = x.y;
    } else {
      buf[u].x = from[v];  // 4, 2 or 1 bytes, zero-extended
    }
  }
}

template <int kBytes>
__device__ __forceinline__ void store_vectors(uint8_t* dst, const CopyPlan& plan, int first,
                                              const uint4 (&buf)[kCopyUnroll]) {
  using V = typename VecOf<kBytes>::T;
  V* to = reinterpret_cast<V*>(dst);
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u) {
    const int v = first + u * plan.lanes;
    if (v >= plan.vectors) continue;
    if constexpr (kBytes == 16) {
      to[v] = buf[u];
    } else if constexpr (kBytes == 8) {
      to[v] = make_uint2(buf[u].x, buf[u].y);
    } else {
      to[v] = static_cast<V>(buf[u].x);
    }
  }
}

// One warp task of a small call's copy (step 3): its payload, its token's
// index in the chunk and the first vector of its lane (valid: the lane has
// an item in the task).
struct SmallTask {
  int payload;
  int token;
  int first;
  bool valid;
};

__device__ __forceinline__ SmallTask locate_task(const DispatchArgs& a, int task, int count, int lane) {
  SmallTask s{a.p.num_payloads, 0, 0, false};
  int first_task = 0;
  for (int i = 0; i < a.p.num_payloads; ++i) {
    const int tasks = a.warp_tasks(i, count);
    if (task < first_task + tasks) {
      const CopyPlan& plan = a.plan[i];
      const int item = ((task - first_task) << (kLog2WarpSize - plan.lane_bits)) + (lane >> plan.lane_bits);
      s.payload = i;
      s.valid = item < count * plan.segments;
      s.token = plan.segments == 1 ? item : item / plan.segments;
      const int segment = plan.segments == 1 ? 0 : item % plan.segments;
      s.first = segment * plan.lanes * kCopyUnroll + (lane & (plan.lanes - 1));
      return s;
    }
    first_task += tasks;
  }
  return s;
}

// Loads a task's vectors when its payload moves in 16-byte vectors (the
// common case, whose code the kernel keeps inline); store_task copies the
// other widths itself, out of line.
__device__ __forceinline__ void load_task(const DispatchArgs& a, const SmallTask& s, int64_t begin,
                                          uint4 (&buf)[kCopyUnroll]) {
  if (!s.valid || a.plan[s.payload].vec_bytes != 16) return;
  const uint8_t* src = a.p.payload[s.payload] + (begin + s.token) * a.p.payload_row_bytes[s.payload];
  load_vectors<16>(src, a.plan[s.payload], s.first, buf);
}

// The destination row of a route entry in payload i's plane.
__device__ __forceinline__ uint8_t* small_row(const DispatchArgs& a, int i, int64_t source_row, int32_t entry) {
  return a.p.ws.row(route_rank(entry)) + a.p.layout.payload_offset[i] +
         (source_row + route_slot(entry)) * a.p.payload_row_bytes[i];
}

// A task of a payload narrower than 16-byte vectors, loaded and stored.
template <int kBytes>
__device__ __forceinline__ void copy_narrow(const DispatchArgs& a, const SmallTask& s, int64_t begin,
                                            const int32_t* route, int64_t source_row) {
  const CopyPlan& plan = a.plan[s.payload];
  uint4 buf[kCopyUnroll];
  load_vectors<kBytes>(a.p.payload[s.payload] + (begin + s.token) * a.p.payload_row_bytes[s.payload], plan, s.first,
                       buf);
#pragma unroll 1
  for (int k = 0; k < kMaxTopK && route[k] != kRouteEnd; ++k) {
    store_vectors<kBytes>(small_row(a, s.payload, source_row, route[k]), plan, s.first, buf);
  }
}

__device__ __noinline__ void copy_narrow_task(const DispatchArgs& a, const SmallTask& s, int64_t begin,
                                              const int32_t* route, int64_t source_row) {
  switch (a.plan[s.payload].vec_bytes) {
    case 8:
      return copy_narrow<8>(a, s, begin, route, source_row);
    case 4:
      return copy_narrow<4>(a, s, begin, route, source_row);
    case 2:
      return copy_narrow<2>(a, s, begin, route, source_row);
    default:
      return copy_narrow<1>(a, s, begin, route, source_row);
  }
}

// Stores a task's vectors to every destination row of its token (`route`:
// the token's entries in shared memory, kRouteEnd-terminated).
__device__ __forceinline__ void store_task(const DispatchArgs& a, const SmallTask& s, int64_t begin,
                                           const int32_t* route, int64_t source_row, const uint4 (&buf)[kCopyUnroll]) {
  if (!s.valid) return;
  if (a.plan[s.payload].vec_bytes != 16) return copy_narrow_task(a, s, begin, route, source_row);
#pragma unroll 1
  for (int k = 0; k < kMaxTopK && route[k] != kRouteEnd; ++k) {
    store_vectors<16>(small_row(a, s.payload, source_row, route[k]), a.plan[s.payload], s.first, buf);
  }
}

// The destination set of a small call's token (Router::dests without the
// shared table: RankMap divides by multiplication).
template <typename Id>
__device__ __forceinline__ uint64_t small_dests(const DispatchArgs& a, int64_t t, uint32_t& invalid) {
  const Id* row = static_cast<const Id*>(a.p.token_selected_experts) + t * a.p.top_k;
  const int top_k = int(a.p.top_k);
  uint64_t set = 0;
#pragma unroll 1
  for (int first = 0; first < top_k; first += kIdsPerBatch) {
    Id expert[kIdsPerBatch];
#pragma unroll
    for (int k = 0; k < kIdsPerBatch; ++k) expert[k] = first + k < top_k ? row[first + k] : Id(-1);
#pragma unroll
    for (int k = 0; k < kIdsPerBatch; ++k) {
      const Id e = expert[k];
      if (e < 0) continue;
      if (e >= a.p.num_experts) {
        ++invalid;
        continue;
      }
      set |= uint64_t(1) << a.rank_map.rank(uint32_t(e));
    }
  }
  return set & a.p.sync.active_mask[0];
}

// A small call: chunks of at most kWarpSize tokens, one CTA each
// (launch_dispatch decides). Its fixed cost is the point, so:
//   * every load the first steps need is issued before the first barrier,
//     this warp's first copy task's payload vectors included (they do not
//     depend on the routing, only their destinations do);
//   * one pass over the ids of tokens [0, end) in rounds of kThreads, each
//     thread one token: a token before the chunk is counted per warp with
//     ballots (no atomics, no zeroing), a token of the chunk keeps its
//     destination set in shared memory; may_proceed's barrier publishes both;
//   * warp 0 routes the chunk: lane d sums the warps' counts of destination
//     d, then the ballots give each token its slots, handed to the copies in
//     shared memory (and to the combine in the route region);
//   * one id-to-rank path (RankMap), ids of one width per instance, the rare
//     paths (first dispatch, overlap wait, errors, EPLB) out of line: the
//     code a CTA runs cold on its multiprocessor stays short.
template <typename Id>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm)
    dispatch_small_kernel(const __grid_constant__ DispatchArgs a) {
  const DispatchParams& p = a.p;
  const WorkspaceView& ws = p.ws;
  __shared__ uint32_t warp_count[kWarps][kMaxRanks];  // tokens before the chunk per (warp, destination)
  __shared__ uint64_t chunk_set[kWarpSize];           // destination set of each token of the chunk
  __shared__ int32_t chunk_routes[kWarpSize][kMaxTopK];
  const int ep_size = ws.ep_size;
  const int lane = lane_id();
  const int warp = warp_id();

  wait_for_previous_grid();
  uint8_t* own = ws.row(ws.ep_rank);
  const int64_t n = p.local_num_tokens;
  const int64_t begin = min(n, int64_t(blockIdx.x) * a.tokens_per_cta);
  const int64_t end = min(n, begin + a.tokens_per_cta);
  const int count = int(end - begin);
  const bool owns_last_chunk = blockIdx.x == gridDim.x - 1;

  const uint32_t dispatch_epoch = *header_word<uint32_t>(own, kHdrDispatchEpoch);
  const uint32_t combine_epoch = *header_word<uint32_t>(own, kHdrCombineEpoch);
  const int64_t last_dispatch_end = *header_word<int64_t>(own, kHdrLastDispatchEnd);
  const int32_t last_runtime_max = *header_word<int32_t>(own, kHdrLastRuntimeMax);
  const uint64_t own_init = *header_word<uint64_t>(own, kHdrMagic);
  const uint32_t error_code = load_error_code(own);
  uint4 buf[kCopyUnroll];
  SmallTask task = locate_task(a, warp, count, lane);
  load_task(a, task, begin, buf);

  // 1a. Counts of the tokens before the chunk, per warp; the chunk's sets.
  uint32_t count_low = 0, count_high = 0;  // lane l: destinations l and l + 32
  uint32_t invalid = 0;                    // of the chunk's tokens (the CTA that owns a token counts it)
  for (int64_t first = 0; first < end; first += kThreads) {
    const int64_t t = first + threadIdx.x;
    uint32_t invalid_here = 0;
    const uint64_t set = t < end ? small_dests<Id>(a, t, invalid_here) : 0;
    if (t >= begin && t < end) {
      chunk_set[t - begin] = set;
      invalid += invalid_here;
    }
    const uint64_t before = t < begin ? set : 0;
    for (uint64_t present = warp_or(before); present != 0; present &= present - 1) {
      const int d = lowest_rank(present);
      const uint32_t going = __popc(__ballot_sync(kFullWarp, (before >> d) & 1));
      if (lane == d % kWarpSize) {
        if (d < kWarpSize) {
          count_low += going;
        } else {
          count_high += going;
        }
      }
    }
  }
  if (lane < ep_size) warp_count[warp][lane] = count_low;
  if (lane + kWarpSize < ep_size) warp_count[warp][lane + kWarpSize] = count_high;

  if (!may_proceed(own, p.sync.mailbox, error_code, dispatch_epoch == combine_epoch)) return;
  const uint32_t epoch = dispatch_epoch + 1;
  if (!wait_before_writing(a, own_init, last_dispatch_end, last_runtime_max)) return;
  if (invalid != 0) {
    atomicAdd(header_word<unsigned long long>(own, kHdrInvalidExpertCount), static_cast<unsigned long long>(invalid));
  }

  // 1b. Warp 0 routes the chunk: lane d's next slot of destination d (and
  // d + 32) in registers, handed to the lanes by a shuffle per destination.
  if (warp == 0) {
    uint32_t next_low = 0, next_high = 0;
    for (int w = 0; w < kWarps; ++w) {
      if (lane < ep_size) next_low += warp_count[w][lane];
      if (lane + kWarpSize < ep_size) next_high += warp_count[w][lane + kWarpSize];
    }
    const int64_t t = begin + lane;
    const uint64_t own_set = lane < count ? chunk_set[lane] : 0;
    int32_t* route = reinterpret_cast<int32_t*>(own + p.layout.route_offset) + t * kMaxTopK;
    int entries = 0;
    for (uint64_t rest = warp_or(own_set); rest != 0; rest &= rest - 1) {
      const int d = lowest_rank(rest);
      const uint32_t going = __ballot_sync(kFullWarp, (own_set >> d) & 1);
      const uint32_t next = __shfl_sync(kFullWarp, d < kWarpSize ? next_low : next_high, d % kWarpSize);
      if ((own_set >> d) & 1) {
        const int32_t entry = route_entry(d, next + __popc(going & lanes_below()));
        route[entries] = entry;
        chunk_routes[lane][entries] = entry;
        ++entries;
      }
      if (lane == d % kWarpSize) {
        if (d < kWarpSize) {
          next_low += __popc(going);
        } else {
          next_high += __popc(going);
        }
      }
    }
    if (entries < kMaxTopK) {
      chunk_routes[lane][entries] = kRouteEnd;
      if (lane < count) route[entries] = kRouteEnd;
    }
    // 2. Receive counts: the last chunk's next slots are the totals
    // (dispatch_kernel, step 2).
    if (owns_last_chunk) {
      for (int d = lane; d < ep_size; d += kWarpSize) {
        const uint32_t total = d < kWarpSize ? next_low : next_high;
        if (rank_active(p.sync, d)) {
          *header_word<int32_t>(ws.row(d), recv_count_offset(ws.ep_rank)) = static_cast<int32_t>(total);
          *header_word<int32_t>(ws.row(d), peer_runtime_max_offset(ws.ep_rank)) =
              static_cast<int32_t>(p.runtime_max_tokens);
          *header_word<uint32_t>(ws.row(d), peer_payloads_offset(ws.ep_rank)) = p.payload_signature;
          *header_word<uint32_t>(ws.row(d), peer_round_tag_offset(ws.ep_rank)) = p.round_tag;
        } else {
          *header_word<int32_t>(own, recv_count_offset(d)) = 0;
        }
      }
    }
  }
  __syncthreads();

  // 3. Payload rows: the preloaded task, then the warp's later ones.
  const int64_t source_row = int64_t(ws.ep_rank) * p.runtime_max_tokens;
  for (int t = warp;;) {
    store_task(a, task, begin, chunk_routes[task.valid ? task.token : 0], source_row, buf);
    t += kWarps;
    task = locate_task(a, t, count, lane);
    if (task.payload == p.num_payloads) break;
    load_task(a, task, begin, buf);
  }

  // 4. EPLB row s into every active destination, spread over the grid.
  if (p.eplb_local_stats != nullptr) write_eplb_rows(p);

  // 5. Release this CTA's shares; CTA 0 waits and writes the header words
  // (dispatch_kernel, step 5).
  const bool system = a.sync_settings.system;
  __syncthreads();
  release_share(ws, p.sync, kHdrDispatchFlags, system);
  if (blockIdx.x != 0) return;
  const bool arrived = wait_for_flags(ws, p.sync, kHdrDispatchFlags, epoch, kErrorDispatchTimeout, a.sync_settings);
  allow_dependent_launch();
  if (!arrived) return;
  // Not (yet) an expert-major dispatch: its build writes epoch afterwards.
  if (threadIdx.x == 0) write_dispatch_record(own, p, n, epoch, stale_expert_major_epoch(epoch), own_init);
}

// ---- expert-major small calls: each pair's row straight into its slot ---------------------

// A small expert-major call (protocol.h, "the expert-major dispatch"; the
// launcher decides) in one grid: the rank-major small call's chunks of at
// most a warp's tokens, each routed by a group of CTAs that share its rows'
// copies (a token has up to top_k pairs' rows to write), with each pair's
// row written into the destination's expert-major plane instead of a
// rank-major row, so that no build kernel follows. A pair's row counts the
// pairs of every lower source, so every rank publishes its per-expert pair
// counts before any row (the last CTA, which counts every token); a thread
// per pair finds its destination, route entry and pair map index while the
// counts travel; then warp 0 gives the chunk's pairs their rows in (token,
// slot) order (__match_any_sync over the experts, as the build), the first
// CTA of the group writes the pairs' entries, ids and weights, and the
// group copies each token's rows to its kept pairs' rows, every segment
// loaded once. The last CTA writes the own counts, drops and padding.
//
// Experts of a call that the small expert-major dispatch takes (two shared
// int32 counters each).
constexpr int64_t kEmSmallExperts = 1024;

struct EmSmallArgs {
  DispatchArgs d;  // d.plan[i]: user payload i's copy to the expert-major planes
  ExpertMajorLayout l;
  int num_user;          // user payloads: the first num_user of d.p.payload
  const float* weights;  // [n, top_k] fp32, or nullptr (weights 1)
  int64_t first_expert;  // the own rank's experts [first_expert, first_expert + num_local)
  int64_t num_local;
  int32_t expert_base, expert_extra;  // num_experts / ep_size and % ep_size: rank d's first expert
  // CTAs per chunk: each routes the chunk, the first writes its routes, pair
  // map entries, ids and weights, and they share its rows' copies (a chunk's
  // pairs' rows are top_k times its tokens' bytes: a CTA per chunk alone
  // would copy them on the grid of the rank-major call).
  int copy_ctas;
};

// Rank r's count scratch (the large calls' kHdrDispatchCounts words, which
// a small call does not use): word [s * E + e] = the pairs of expert e that
// rank s sends, then word [R * E + s] = s's epoch << 32 once they are written
// (released). The large calls' words there hold an older epoch in their high
// half, so no stale word reads as this call's.
__device__ __forceinline__ uint64_t* em_count_word(uint8_t* row, int64_t num_experts, int s, int64_t e) {
  return header_word<uint64_t>(row, kHdrDispatchCounts + int64_t(sizeof(uint64_t)) * (int64_t(s) * num_experts + e));
}
__device__ __forceinline__ uint64_t* em_counted_word(uint8_t* row, int ep_size, int64_t num_experts, int s) {
  return em_count_word(row, num_experts, ep_size, s);  // [R * E + s]
}
__device__ __forceinline__ void st_release_word(uint64_t* p, uint64_t v, bool system) {
  if (system) {
    asm volatile("st.release.sys.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
  } else {
    asm volatile("st.release.gpu.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
  }
}

// The first expert of rank d (the contract's contiguous ranges).
__device__ __forceinline__ int32_t em_first_expert(const EmSmallArgs& a, int d) {
  return d * a.expert_base + min(d, a.expert_extra);
}

template <typename Id>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm)
    em_dispatch_small_kernel(const __grid_constant__ EmSmallArgs a) {
  const DispatchParams& p = a.d.p;
  const WorkspaceView& ws = p.ws;
  const ExpertMajorLayout& l = a.l;
  __shared__ int32_t next[kEmSmallExperts];         // own pairs of e before the chunk, then its next row
  __shared__ int32_t total[kEmSmallExperts];        // own pairs of e (the last CTA's count is every token's)
  __shared__ uint32_t dest_tokens[kMaxRanks];       // tokens that go to rank d (the last CTA's: receive counts)
  __shared__ int32_t chunk_e[kWarpSize][kMaxTopK];  // expert of (token, slot), -1: no pair
  __shared__ int32_t pair_at[kWarpSize][kMaxTopK];  // kept pairs of each token: row e * M + i at pair_rank
  __shared__ uint8_t pair_rank[kWarpSize][kMaxTopK];
  __shared__ uint8_t pair_q[kWarpSize][kMaxTopK];  // the pair's index in the token's pair map row at its rank
  const int ep_size = ws.ep_size;
  const int lane = lane_id();
  const int warp = warp_id();
  const int64_t E = p.num_experts, K = p.top_k, M = l.tokens_per_expert, T = p.runtime_max_tokens;

  wait_for_previous_grid();
  uint8_t* own = ws.row(ws.ep_rank);
  const int64_t n = p.local_num_tokens;
  const int copy_rank = int(blockIdx.x) % a.copy_ctas;
  const int64_t begin = min(n, int64_t(blockIdx.x / a.copy_ctas) * a.d.tokens_per_cta);
  const int64_t end = min(n, begin + a.d.tokens_per_cta);
  const int count = int(end - begin);
  const bool owns_last_chunk = blockIdx.x == gridDim.x - 1;  // counts every token: end == n
  const bool writes_chunk = copy_rank == 0;                  // the chunk's routes, pair maps, ids, weights
  const uint32_t dispatch_epoch = *header_word<uint32_t>(own, kHdrDispatchEpoch);
  const uint32_t combine_epoch = *header_word<uint32_t>(own, kHdrCombineEpoch);
  const uint64_t own_init = *header_word<uint64_t>(own, kHdrMagic);
  const uint32_t error_code = load_error_code(own);

  // 1. Counts per expert (and the last CTA's tokens per destination).
  for (int64_t e = threadIdx.x; e < E; e += kThreads) {
    next[e] = 0;
    total[e] = 0;
  }
  if (threadIdx.x < kMaxRanks) dest_tokens[threadIdx.x] = 0;
  __syncthreads();
  // A thread an id, all loads at once (T * top_k < 2^31: 32-bit indices).
  uint32_t invalid = 0;
  const Id* ids = static_cast<const Id*>(p.token_selected_experts);
  const uint64_t active = p.sync.active_mask[0];
  const uint32_t k_width = uint32_t(K), id_count = uint32_t(end) * k_width;
  for (uint32_t x = threadIdx.x; x < id_count; x += kThreads) {
    const uint32_t t = x / k_width, k = x - t * k_width;
    const Id e = ids[x];
    int32_t kept = -1;
    if (e >= 0 && e < E) {
      const int d = a.d.rank_map.rank(uint32_t(e));
      if ((active >> d) & 1) {
        kept = int32_t(e);
        atomicAdd(&total[e], 1);
        if (t < begin) atomicAdd(&next[e], 1);
        if (owns_last_chunk) {
          // The token's first pair at d counts it once (d's receive count).
          bool first = true;
          for (uint32_t k2 = 0; k2 < k && first; ++k2) {
            const Id e2 = ids[t * k_width + k2];
            first = !(e2 >= 0 && e2 < E && a.d.rank_map.rank(uint32_t(e2)) == d);
          }
          if (first) atomicAdd(&dest_tokens[d], 1u);
        }
      }
    } else if (e >= E && t >= begin && writes_chunk) {
      ++invalid;
    }
    if (t >= begin) chunk_e[t - begin][k] = kept;
  }

  if (!may_proceed(own, p.sync.mailbox, error_code, dispatch_epoch == combine_epoch)) return;
  const uint32_t epoch = dispatch_epoch + 1;
  // Step 0a before anything goes into a peer's row; the counts go before
  // the pulls' wait (no combine reads the count scratch), so that their
  // exchange overlaps it.
  if (first_dispatch(own_init) && !first_dispatch_wait(a.d, own_init)) return;
  if (invalid != 0) {
    atomicAdd(header_word<unsigned long long>(own, kHdrInvalidExpertCount), static_cast<unsigned long long>(invalid));
  }

  // The last CTA publishes the counts (then, after a barrier, one released
  // word a rank), the receive counts and the call's header words.
  if (owns_last_chunk) {
    const uint32_t words = uint32_t(ep_size) * uint32_t(E);
    for (uint32_t x = threadIdx.x; x < words; x += kThreads) {
      const int r = int(x / uint32_t(E));
      const uint32_t e = x - uint32_t(r) * uint32_t(E);
      if (rank_active(p.sync, r)) *em_count_word(ws.row(r), E, ws.ep_rank, e) = uint32_t(total[e]);
    }
    if (threadIdx.x < ep_size) {
      const int d = threadIdx.x;
      if (rank_active(p.sync, d)) {
        *header_word<int32_t>(ws.row(d), recv_count_offset(ws.ep_rank)) = static_cast<int32_t>(dest_tokens[d]);
        *header_word<int32_t>(ws.row(d), peer_runtime_max_offset(ws.ep_rank)) = static_cast<int32_t>(T);
        *header_word<uint32_t>(ws.row(d), peer_payloads_offset(ws.ep_rank)) = p.payload_signature;
        *header_word<uint32_t>(ws.row(d), peer_round_tag_offset(ws.ep_rank)) = p.round_tag;
      } else {
        *header_word<int32_t>(own, recv_count_offset(d)) = 0;
      }
    }
    __syncthreads();
    if (threadIdx.x < ep_size && rank_active(p.sync, threadIdx.x)) {
      st_release_word(em_counted_word(ws.row(threadIdx.x), ep_size, E, ws.ep_rank), uint64_t(epoch) << 32,
                      a.d.sync_settings.system);
    }
  }

  // Before any row of a peer: the peers' pulls of the round's last combine
  // read the destinations' weights planes (and, where this call's regions
  // cover that combine's, those).
  if (!wait_for_pulls(a.d)) return;

  // 1b. A thread a pair of the chunk: its destination, its index q among the
  // token's pairs there in ascending (expert, slot) order, and, for the
  // token's first pair at each destination, the route entry and the pair map
  // past the token's pairs there.
  const int64_t source_row = int64_t(ws.ep_rank) * T;
  const int pairs = count * int(K);
  int32_t* route = reinterpret_cast<int32_t*>(own + p.layout.route_offset);
  for (int x = threadIdx.x; x < pairs; x += kThreads) {
    const int c = x / int(K), k = x - c * int(K);
    const int32_t e = chunk_e[c][k];
    if (e < 0) {
      if (k == 0 && writes_chunk) {
        // A token without a pair still ends its route; so does the lowest slot's thread of every token.
        int dests = 0;
        for (int k2 = 0; k2 < K; ++k2) {
          const int32_t e2 = chunk_e[c][k2];
          if (e2 < 0) continue;
          const int d2 = a.d.rank_map.rank(uint32_t(e2));
          bool first = true;
          for (int k3 = 0; k3 < k2 && first; ++k3) {
            first = !(chunk_e[c][k3] >= 0 && a.d.rank_map.rank(uint32_t(chunk_e[c][k3])) == d2);
          }
          dests += first;
        }
        if (dests < kMaxTopK) route[(begin + c) * kMaxTopK + dests] = kRouteEnd;
      }
      continue;
    }
    const int d = a.d.rank_map.rank(uint32_t(e));
    int q = 0, at_d = 0, lower_dests = 0, dests = 0;
    bool first_at_d = true;
    for (int k2 = 0; k2 < K; ++k2) {
      const int32_t e2 = chunk_e[c][k2];
      if (e2 < 0) continue;
      const int d2 = a.d.rank_map.rank(uint32_t(e2));
      if (d2 == d) {
        ++at_d;
        q += (e2 < e || (e2 == e && k2 < k)) ? 1 : 0;
        if (k2 < k) first_at_d = false;
      }
      bool first = true;  // k2 is the token's first slot at d2
      for (int k3 = 0; k3 < k2 && first; ++k3) {
        first = !(chunk_e[c][k3] >= 0 && a.d.rank_map.rank(uint32_t(chunk_e[c][k3])) == d2);
      }
      dests += first;
      lower_dests += first && d2 < d;
    }
    pair_rank[c][k] = static_cast<uint8_t>(d);
    pair_q[c][k] = static_cast<uint8_t>(q);
    if (writes_chunk && first_at_d) {
      route[(begin + c) * kMaxTopK + lower_dests] = route_entry(d, begin + c);
      int32_t* entries = reinterpret_cast<int32_t*>(ws.row(d) + l.pair_map_offset) + (source_row + begin + c) * K;
      for (int q2 = at_d; q2 < K; ++q2) entries[q2] = kNoPair;
    }
    if (writes_chunk && k == 0 && dests < kMaxTopK) route[(begin + c) * kMaxTopK + dests] = kRouteEnd;
  }

  // 2. Every rank's counts of this epoch, then next[e] := the chunk's first row of e.
  const bool counted = wait_for_words</*kExact=*/true>(
      ws, p.sync, [&](int q) { return reinterpret_cast<uint32_t*>(em_counted_word(own, ep_size, E, q)) + 1; }, epoch,
      kErrorDispatchTimeout, a.d.sync_settings);
  if (!counted) return;
  // One independent load a thread and a shared add: the lower sources' counts in one memory latency.
  for (uint32_t x = threadIdx.x; x < uint32_t(ws.ep_rank) * uint32_t(E); x += kThreads) {
    const int q = int(x / uint32_t(E));
    const uint32_t e = x - uint32_t(q) * uint32_t(E);
    const int32_t c = rank_active(p.sync, q) ? int32_t(uint32_t(*em_count_word(own, E, q, e))) : 0;
    if (c != 0) atomicAdd(&next[e], c);
  }
  __syncthreads();

  // 3a. Warp 0: each pair's row i, in (token, slot) order (the CPU's running count).
  if (warp == 0) {
    for (int x0 = 0; x0 < pairs; x0 += kWarpSize) {
      const int x = x0 + lane;
      const int c = x / int(K), k = x - c * int(K);
      const int32_t e = x < pairs ? chunk_e[c][k] : -2;
      const uint32_t peers = __match_any_sync(kFullWarp, e);
      if (e >= 0) {
        const int64_t i = int64_t(next[e]) + __popc(peers & lanes_below());
        const int64_t le = e - em_first_expert(a, pair_rank[c][k]);
        pair_at[c][k] = i < M ? static_cast<int32_t>(le * M + i) : kNoPair;
      }
      __syncwarp();
      if (e >= 0 && (peers >> lane) == 1u) next[e] += __popc(peers);  // the group's highest lane
      __syncwarp();
    }
  }
  __syncthreads();
  // 3b. A thread a pair: its pair map entry, id and weight at the destination.
  if (writes_chunk) {
    for (int x = threadIdx.x; x < pairs; x += kThreads) {
      const int c = x / int(K), k = x - c * int(K);
      const int32_t e = chunk_e[c][k];
      if (e < 0) continue;
      const int d = pair_rank[c][k];
      uint8_t* dest = ws.row(d);
      const int32_t at = pair_at[c][k];
      if (at >= 0) {
        reinterpret_cast<int32_t*>(dest + l.ids_offset)[at] = static_cast<int32_t>(e - em_first_expert(a, d));
        reinterpret_cast<float*>(dest + l.weights_offset)[at] =
            a.weights != nullptr ? a.weights[(begin + c) * K + k] : 1.0f;
      }
      reinterpret_cast<int32_t*>(dest + l.pair_map_offset)[(source_row + begin + c) * K + pair_q[c][k]] = at;
    }
  }
  // 3c. Each token's kept pairs first (slot order), kRouteEnd after them.
  __syncthreads();
  if (threadIdx.x < count) {
    const int c = threadIdx.x;
    int kept = 0;
    for (int k = 0; k < K; ++k) {
      if (chunk_e[c][k] >= 0 && pair_at[c][k] >= 0) {
        pair_at[c][kept] = pair_at[c][k];
        pair_rank[c][kept] = pair_rank[c][k];
        ++kept;
      }
    }
    if (kept < kMaxTopK) pair_at[c][kept] = kRouteEnd;
  }
  __syncthreads();
  // 3d. The chunk's rows to their pairs' rows, payload by payload, a segment loaded once.
  for (int i = 0; i < a.num_user; ++i) {
    const int64_t bytes = p.payload_row_bytes[i];
    if (bytes == 0) continue;
    const CopyPlan& plan = a.d.plan[i];
    const int groups = kThreads >> plan.lane_bits;
    const int lane_in_group = threadIdx.x & (plan.lanes - 1);
    const int first = copy_rank * groups + (threadIdx.x >> plan.lane_bits);
    const int stride = a.copy_ctas * groups;
    for (int item = first; item < count * plan.segments; item += stride) {
      const int c = plan.segments == 1 ? item : item / plan.segments;
      const int segment = plan.segments == 1 ? 0 : item % plan.segments;
      copy_segment_any(
          p.payload[i] + (begin + c) * bytes, plan, segment, lane_in_group,
          [&](int q) { return pair_at[c][q] == kRouteEnd ? kRouteEnd : q; },
          [&](int32_t q) { return ws.row(pair_rank[c][q]) + l.payload_offset[i] + int64_t(pair_at[c][q]) * bytes; });
    }
  }

  // 4. The last CTA (whose total[] is published, so free): the own counts,
  // padding and drops from every source's counts, one load a thread, then a
  // thread per expert and a warp per expert's padding.
  if (owns_last_chunk) {
    int32_t* counts = reinterpret_cast<int32_t*>(own + l.counts_offset);
    int32_t* own_ids = reinterpret_cast<int32_t*>(own + l.ids_offset);
    float* own_weights = reinterpret_cast<float*>(own + l.weights_offset);
    for (int64_t le = threadIdx.x; le < a.num_local; le += kThreads) total[le] = 0;
    __syncthreads();
    const uint32_t local = uint32_t(a.num_local);
    for (uint32_t x = threadIdx.x; x < uint32_t(ep_size) * local; x += kThreads) {
      const int q = int(x / local);
      const uint32_t le = x - uint32_t(q) * local;
      const int32_t c = rank_active(p.sync, q) ? int32_t(uint32_t(*em_count_word(own, E, q, a.first_expert + le))) : 0;
      if (c != 0) atomicAdd(&total[le], c);
    }
    __syncthreads();
    for (int64_t le = threadIdx.x; le < a.num_local; le += kThreads) {
      const int64_t pairs_e = total[le];
      counts[le] = static_cast<int32_t>(min(pairs_e, M));
      if (pairs_e > M) {
        atomicAdd(header_word<unsigned long long>(own, kHdrDroppedPairCount),
                  static_cast<unsigned long long>(pairs_e - M));
      }
    }
    for (int64_t le = warp; le < a.num_local; le += kWarps) {
      for (int64_t i = min(int64_t(total[le]), M) + lane; i < M; i += kWarpSize) {
        own_ids[le * M + i] = kNoPair;
        own_weights[le * M + i] = 0.0f;
      }
    }
  }

  // EPLB row s into every active destination, spread over the grid.
  if (p.eplb_local_stats != nullptr) write_eplb_rows(p);

  // 5. Release this CTA's shares; CTA 0 waits and writes the header words.
  const bool system = a.d.sync_settings.system;
  __syncthreads();
  release_share(ws, p.sync, kHdrDispatchFlags, system);
  if (blockIdx.x != 0) return;
  const bool arrived = wait_for_flags(ws, p.sync, kHdrDispatchFlags, epoch, kErrorDispatchTimeout, a.d.sync_settings);
  allow_dependent_launch();
  if (!arrived) return;
  if (threadIdx.x == 0) {
    *header_word<int64_t>(own, kHdrExpertMajorEnd) = l.combine_offset;
    *header_word<int32_t>(own, kHdrExpertMajorTokens) = static_cast<int32_t>(M);
    write_dispatch_record(own, p, n, epoch, epoch, own_init);
  }
}

}  // namespace

cudaError_t dispatch_ctas_per_sm(int* ctas_per_sm) {
  *ctas_per_sm = std::numeric_limits<int>::max();
  cudaError_t err = lower_to_occupancy(dispatch_small_kernel<int32_t>, ctas_per_sm);
  if (err == cudaSuccess) err = lower_to_occupancy(dispatch_small_kernel<int64_t>, ctas_per_sm);
  if (err == cudaSuccess) err = lower_to_occupancy(dispatch_kernel<false>, ctas_per_sm);
  if (err == cudaSuccess) err = lower_to_occupancy(dispatch_kernel<true>, ctas_per_sm);
  if (err == cudaSuccess) err = lower_to_occupancy(em_dispatch_small_kernel<int32_t>, ctas_per_sm);
  if (err == cudaSuccess) err = lower_to_occupancy(em_dispatch_small_kernel<int64_t>, ctas_per_sm);
  return err;
}

cudaError_t launch_dispatch(const DispatchParams& p, const LaunchConfig& config, cudaStream_t stream) {
  DispatchArgs a{};
  a.p = p;
  a.sync_settings = make_sync_settings(p.sync.timeout_s, config);
  for (int i = 0; i < p.num_payloads; ++i) {
    if (p.payload_row_bytes[i] > kMaxKernelRowBytes) return cudaErrorInvalidValue;
  }
  int64_t token_bytes = 0;
  for (int i = 0; i < p.num_payloads; ++i) token_bytes += p.payload_row_bytes[i];
  // A destination row starts at base + d * row_stride + plane offset + row * row_bytes.
  const uint64_t rows_bits = address_bits(p.ws.base) | uint64_t(p.ws.row_stride);
  for (int i = 0; i < p.num_payloads; ++i) {
    a.plan[i] = make_copy_plan(p.payload_row_bytes[i],
                               rows_bits | uint64_t(p.layout.payload_offset[i]) | address_bits(p.payload[i]));
  }
  const int64_t n = p.local_num_tokens;
  const bool pdl = p.sync.enable_pdl && config.pdl_supported;

  // A small call: one CTA per chunk of at most a warp's tokens, a CTA per
  // kMinBytesPerCta of rows as far as the residency allows. The grid-wide
  // waits of the large calls' kernel would only add their latency.
  const int64_t warp_chunks = (n + kWarpSize - 1) / kWarpSize;
  const int small_grid =
      std::min(spinning_grid_size(config, std::max(n * token_bytes, warp_chunks * kMinBytesPerCta)), kMaxDispatchCtas);
  const int64_t small_chunk = (n + small_grid - 1) / small_grid;
  if (small_chunk <= kWarpSize && p.num_experts <= kRankMapExperts) {
    a.tokens_per_cta = small_chunk;
    a.rank_map = make_rank_map(p.num_experts, p.ws.ep_size);
    const int grid = n > 0 ? static_cast<int>((n + small_chunk - 1) / small_chunk) : 1;  // no CTA without tokens
    return p.ids_int64 ? launch_kernel(dispatch_small_kernel<int64_t>, grid, kThreads, stream, pdl, a)
                       : launch_kernel(dispatch_small_kernel<int32_t>, grid, kThreads, stream, pdl, a);
  }

  const int grid = std::min(spinning_grid_size(config, n * token_bytes), kMaxDispatchCtas);
  a.tokens_per_cta = (n + grid - 1) / grid;
  int64_t token_segments = 0;  // copy items of a token, all payloads
  for (int i = 0; i < p.num_payloads; ++i) token_segments += a.plan[i].segments;
  if (n * token_segments > kMaxLoopItems) return cudaErrorInvalidValue;
  while ((1 << a.claim_bits) < kClaimCounters && (kWarpsPerClaimCounter << a.claim_bits) < int64_t(grid) * kWarps) {
    ++a.claim_bits;
  }
  return a.claim_bits > 0 ? launch_kernel(dispatch_kernel<true>, grid, kThreads, stream, pdl, a)
                          : launch_kernel(dispatch_kernel<false>, grid, kThreads, stream, pdl, a);
}

cudaError_t launch_dispatch_expert_major(const DispatchParams& p, const ExpertMajorBuildParams& b,
                                         const LaunchConfig& config, cudaStream_t stream) {
  const int64_t n = p.local_num_tokens, E = p.num_experts, ep = p.ws.ep_size;
  const ExpertMajorLayout& l = b.layout;
  int64_t token_bytes = 0;
  for (int i = 0; i < b.num_payloads; ++i) token_bytes += p.payload_row_bytes[i];
  const int64_t warp_chunks = (n + kWarpSize - 1) / kWarpSize;
  const int small_grid =
      std::min(spinning_grid_size(config, std::max(n * token_bytes, warp_chunks * kMinBytesPerCta)), kMaxDispatchCtas);
  const int64_t chunk = (n + small_grid - 1) / small_grid;
  // The small path: chunks of at most a warp's tokens, the experts' counters
  // in shared memory, every rank's counts and flags in the count scratch.
  // Every rank takes the same path (the counts are an exchange), so it is
  // chosen by what all ranks share: T, the payloads' sizes, E and the
  // device's residency (one GPU's simulated ranks, or GPUs of one model);
  // n <= T tokens then never need chunks of more than a warp's.
  const int64_t most_ctas =
      std::min(spinning_grid_size(config, std::numeric_limits<int64_t>::max() / 2), kMaxDispatchCtas);
  const bool small = p.runtime_max_tokens <= kWarpSize * most_ctas && E <= kEmSmallExperts &&
                     ep * (E + 1) <= int64_t(kMaxDispatchCtas) * kMaxRanks;
  if (!small) {
    cudaError_t err = launch_dispatch(p, config, stream);
    return err != cudaSuccess ? err : launch_expert_major_build(b, config, stream);
  }
  if (chunk > kWarpSize) return cudaErrorInvalidValue;  // n <= T: not reached
  EmSmallArgs a{};
  a.d.p = p;
  a.d.sync_settings = make_sync_settings(p.sync.timeout_s, config);
  a.d.tokens_per_cta = chunk;
  a.d.rank_map = make_rank_map(E, ep);
  const uint64_t rows_bits = address_bits(p.ws.base) | uint64_t(p.ws.row_stride);
  for (int i = 0; i < b.num_payloads; ++i) {
    if (p.payload_row_bytes[i] > kMaxKernelRowBytes) return cudaErrorInvalidValue;
    a.d.plan[i] =
        make_copy_plan(p.payload_row_bytes[i], rows_bits | uint64_t(l.payload_offset[i]) | address_bits(p.payload[i]));
  }
  a.l = l;
  a.num_user = b.num_payloads;
  a.weights = b.weights_offset >= 0 ? reinterpret_cast<const float*>(p.payload[b.num_payloads + 1]) : nullptr;
  a.first_expert = b.first_expert;
  a.num_local = b.num_local;
  a.expert_base = static_cast<int32_t>(E / ep);
  a.expert_extra = static_cast<int32_t>(E % ep);
  // The rank-major call's chunks, each copied by as many CTAs as a grid
  // sized by the pairs' rows gives it.
  const int chunks = n > 0 ? static_cast<int>((n + chunk - 1) / chunk) : 1;
  const int pair_grid = std::min(spinning_grid_size(config, n * token_bytes * p.top_k), kMaxDispatchCtas);
  a.copy_ctas = std::max(1, pair_grid / chunks);
  const int grid = chunks * a.copy_ctas;
  const bool pdl = p.sync.enable_pdl && config.pdl_supported;
  return p.ids_int64 ? launch_kernel(em_dispatch_small_kernel<int64_t>, grid, kThreads, stream, pdl, a)
                     : launch_kernel(em_dispatch_small_kernel<int32_t>, grid, kThreads, stream, pdl, a);
}

}  // namespace gpu
}  // namespace moe_a2a
