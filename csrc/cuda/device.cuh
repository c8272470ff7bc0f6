// Device-side building blocks shared by the CUDA kernels (internal header of
// csrc/cuda: memory ordering, bounded waits, error records, the release of a
// CTA's share, vector copies). No torch header.
//
// ---------------------------------------------------------------------------
// Memory ordering: why each flag is correct
// ---------------------------------------------------------------------------
// Peers may be other GPUs (NVLink mappings) or other processes: then every
// flag that another rank reads is written with st.release.sys and read with
// ld.acquire.sys, and the fences are fence.acq_rel.sys (SyncSettings::system).
// When every rank of the workspace runs on this device in this process
// (simulated ranks), gpu scope covers all of them, and the launchers pick it:
// a system-scope fence costs about a microsecond on an H200, and a round trip
// makes about a dozen of them. Below, "sys" stands for the scope in use.
// Payload rows, receive counts and EPLB rows are ordinary stores: the flag
// that follows them is what publishes them.
//
// * Publishing the work of a grid (flags count shares, protocol.h): every
//   CTA publishes its own part. The rows are written by every thread of the
//   CTA; after a barrier, thread d adds the CTA's share to the flag word of
//   rank d with red.release.sys. The chain, for a thread X of the CTA:
//     X stores rows -> __syncthreads (bar.sync: X's stores are ordered
//     before every later operation of the CTA's threads) -> thread d:
//     red.release.sys (a release: cumulative, it carries what its thread has
//     observed, X's stores included) -> the peer's ld.acquire.sys reads a
//     value that this add is part of (the adds of one word form a chain of
//     read-modify-writes, and a later add in it carries the earlier ones
//     along) -> the peer reads the rows.
//   A peer that sees flag_target(n) has seen every CTA's add, so it sees
//   every row of every CTA of the grid. No CTA waits for another before it
//   releases, and no counter is read back: each CTA's part is published as
//   soon as it is written.
// * A release also orders earlier LOADS: when rank r releases its combine
//   shares, r's own reads of the data a peer will overwrite next (recv_count
//   rows read by the staging, the receive planes read by r's MoE before this
//   kernel) are complete, and so, when it releases its pull_done shares, are
//   its pull's reads of the peers' combine regions. That is the buffer-reuse
//   chain of protocol.h.
// * Consuming: one thread per peer acquire-loads the peer's flag in the own
//   header, then __syncthreads hands what it observed to the whole CTA; loads
//   after the barrier see the published rows. Data read by LATER kernels
//   (the MoE reading the receive planes) is ordered by the kernel boundary
//   after the acquire, or by griddepcontrol.wait under PDL.
// * Own epochs and own scratch are read and written only by this rank's
//   kernels, which its stream serializes (griddepcontrol.wait under PDL waits
//   for the previous grid's completion and memory flush). Inside one kernel,
//   every CTA reads the epochs before it releases its share of the own
//   rank's flag, and only CTA 0 writes them, after its acquire of that flag
//   saw every CTA's share, so no CTA reads a half-advanced epoch.
// * Error records: the first error of a rank claims kHdrErrorCode by CAS, so
//   exactly one thread fills the record. Other CTAs poll the code with relaxed
//   loads only to stop waiting; no data depends on it. The host mailbox gets
//   the missing mask and milliseconds first, __threadfence_system, then the
//   code with a release store: raise_if_mailbox_error acquire-loads the code
//   and only then reads the rest.
#pragma once

#include <stdint.h>

#include <utility>

#include <cuda_runtime.h>

#include "../params.h"
#include "../protocol.h"
#include "kernels.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
#error "torch-moe-a2a's CUDA kernels need sm_70 or newer (acquire/release PTX, __nanosleep)"
#endif

namespace moe_a2a {
namespace gpu {

// ---- launch shape -------------------------------------------------------------
// One block size for every spinning kernel and a register cap that guarantees
// kMinCtasPerSm CTAs per multiprocessor: CTAs of different spinning kernels
// (rank A in combine while rank B is still in dispatch) then have the same
// footprint and any mix of them fits the residency the grids are sized for.
constexpr int kThreads = 512;
constexpr int kWarpSize = 32;
constexpr int kLog2WarpSize = 5;
static_assert(kWarpSize == 1 << kLog2WarpSize, "kLog2WarpSize is log2(kWarpSize)");
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kMinCtasPerSm = 2;
constexpr unsigned kFullWarp = 0xffffffffu;

static_assert(kMaxRanks <= 64, "destination sets are one uint64_t bit mask");
static_assert(kRankMaskWords == 1, "the kernels read the active mask as one word");
static_assert(kThreads >= kMaxRanks, "one thread per peer raises and waits for flags");

// Vectors of a copy or a sum in flight per lane before the stores begin.
constexpr int kCopyUnroll = 4;
// Destination rows of a copy whose addresses are looked up together.
constexpr int kDestBatch = 4;

// Warps of a grid that claim tasks from one counter in memory at most: every
// claim is an atomic on that one word. With the 4208 warps of one rank's grid
// at ep 1 the dispatch's claims took 224 us against 131 with 16 counters
// (16384 tokens on an H200; docs/performance.md, 'Design decisions and their
// measured effect'); the combine's pull claims only where one counter serves
// the whole grid.
constexpr int64_t kWarpsPerClaimCounter = 512;

// Spin-wait backoff: tight first (peers usually arrive within microseconds),
// then __nanosleep doubling up to the cap so that many pollers of many
// simulated ranks do not crowd the L2 slice that holds the flags.
constexpr unsigned kPollFirstSleepNs = 32;
constexpr unsigned kPollMaxSleepNs = 1024;

// How a launch synchronizes with its peers, resolved on the host.
struct SyncSettings {
  uint64_t timeout_ns;  // %globaltimer budget of one wait
  uint32_t timeout_ms;  // what the error record says
  bool system;          // system scope (peers on other devices or processes), else gpu scope
};

// ---- memory-model primitives (generic addresses: workspace rows, peer
// mappings and the pinned host mailbox alike) ------------------------------------

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(int64_t* p, int64_t v) {
  asm volatile("st.release.sys.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t ld_acquire_gpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_gpu(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// A flag's share (no value returned: the adding thread does not wait for it).
__device__ __forceinline__ void red_release_add(uint32_t* p, uint32_t v, bool system) {
  if (system) {
    asm volatile("red.release.sys.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  } else {
    asm volatile("red.release.gpu.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  }
}

// The same at the scope of a launch (SyncSettings::system).
__device__ __forceinline__ uint32_t ld_acquire(const uint32_t* p, bool system) {
  return system ? ld_acquire_sys(p) : ld_acquire_gpu(p);
}

__device__ __forceinline__ uint64_t ld_acquire(const uint64_t* p, bool system) {
  return system ? ld_acquire_sys(p) : ld_acquire_gpu(p);
}

// A release pattern on one side and an acquire pattern on the other (a large
// dispatch's routed words) need fence.acq_rel; __threadfence() would be fence.sc,
// which also orders every sc fence of the scope globally (not needed here) and
// costs more.
__device__ __forceinline__ void fence(bool system) {
  if (system) {
    asm volatile("fence.acq_rel.sys;" ::: "memory");
  } else {
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
  }
}

// Own-grid word another CTA may write (the error code): no ordering needed.
__device__ __forceinline__ uint32_t ld_relaxed_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Own-grid 64-bit word that carries its own epoch (the dispatch's counts):
// single-copy atomic, so a reader sees the epoch and the value of one store.
__device__ __forceinline__ uint64_t ld_relaxed_gpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.gpu.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_relaxed_gpu(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.gpu.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Programmatic dependent launch. The wait returns at once for a grid launched
// without the attribute, so every kernel calls it before its first access to
// memory a previous kernel may have written.
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel of the stream (if launched with PDL) start its CTAs.
// Called only once the calling CTA will never spin again: a dependent's CTAs
// occupy slots while they wait for this grid, and they must not take the
// slots a peer's spinning grid needs to become resident.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---- header words -------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ T* header_word(uint8_t* row, int64_t offset) {
  return reinterpret_cast<T*>(row + offset);
}

__device__ __forceinline__ uint32_t* flag_of(uint8_t* row, int64_t flags_offset, int rank) {
  return header_word<uint32_t>(row, flags_offset + int64_t(sizeof(uint32_t)) * rank);
}

// ---- warp helpers ---------------------------------------------------------------------

__device__ __forceinline__ int lane_id() { return int(threadIdx.x) % kWarpSize; }
__device__ __forceinline__ int warp_id() { return int(threadIdx.x) / kWarpSize; }

__device__ __forceinline__ uint32_t lanes_below() { return (1u << lane_id()) - 1u; }

__device__ __forceinline__ uint64_t warp_or(uint64_t v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v |= __shfl_xor_sync(kFullWarp, v, offset);
  return v;
}

__device__ __forceinline__ uint32_t warp_sum(uint32_t v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullWarp, v, offset);
  return v;
}

__device__ __forceinline__ int lowest_rank(uint64_t set) { return __ffsll(static_cast<long long>(set)) - 1; }

// ---- error records ----------------------------------------------------------------------

// Sets the in-use bit of the own init word (protocol.h, dispatch step 0a).
__device__ inline void mark_in_use(uint8_t* own) {
  atomicOr(header_word<unsigned long long>(own, kHdrMagic), static_cast<unsigned long long>(kInitWordInUse));
}

// Records `code` as this rank's error unless one is already recorded (the row
// is in use from then on). One thread calls it. See "Error records" at the
// top for the ordering.
static __device__ __noinline__ void record_error(uint8_t* own, int64_t* mailbox, uint32_t code, uint64_t peers,
                                                 uint32_t detail) {
  if (atomicCAS(header_word<unsigned>(own, kHdrErrorCode), 0u, code) != 0u) return;
  mark_in_use(own);
  *header_word<uint64_t>(own, kHdrErrorMissing) = peers;
  *header_word<uint32_t>(own, kHdrErrorDetail) = detail;
  if (mailbox == nullptr) return;
  volatile int64_t* words = mailbox;
  words[kMetaMailboxMissing - kMetaMailboxCode] = static_cast<int64_t>(peers);
  words[kMetaMailboxDetail - kMetaMailboxCode] = detail;
  __threadfence_system();
  st_release_sys(mailbox + (kMetaMailboxCode - kMetaMailboxCode), static_cast<int64_t>(code));
}

// What every kernel checks first, in every CTA, before it touches anything:
// a recorded error leaves the rank failed (nothing runs until initialize);
// an epoch pair that breaks the dispatch/combine alternation is recorded as
// kErrorSequence (by CTA 0) and nothing else happens. All CTAs read the same
// epochs, written by earlier kernels, so all of them take the same decision.
// Thread 0 decides for its CTA, on `error_code` as thread 0 loaded it
// (load_error_code, issued together with the epochs so that the two cost one
// memory latency): a CTA that starts late may see an error that a waiting
// CTA of this grid recorded meanwhile, and its threads must not split on it
// around a barrier. The other threads' `error_code` is not used; nor is
// their `mismatch`: a combine's protocol.h combine_mismatch bits as thread 0
// computed them, recorded as kErrorCombineMismatch (by CTA 0) like a broken
// sequence, which is checked first. `vote`: a condition of each thread whose
// OR over the CTA the same barrier hands to every thread in *any_vote (when
// given): a second check costs no barrier.
__device__ inline bool may_proceed(uint8_t* own, int64_t* mailbox, uint32_t error_code, bool sequence_ok,
                                   uint32_t mismatch = 0, bool vote = false, bool* any_vote = nullptr) {
  __shared__ bool proceed;
  if (threadIdx.x == 0) {
    proceed = false;
    if (error_code == kErrorNone) {
      if (sequence_ok && mismatch == 0) {
        proceed = true;
      } else if (blockIdx.x == 0) {
        record_error(own, mailbox, sequence_ok ? kErrorCombineMismatch : kErrorSequence, 0, sequence_ok ? mismatch : 0);
      }
    }
  }
  if (any_vote != nullptr) {
    *any_vote = __syncthreads_or(vote);
  } else {
    __syncthreads();
  }
  return proceed;
}

// Thread 0's view of the own error code for may_proceed (0 in other threads).
__device__ __forceinline__ uint32_t load_error_code(uint8_t* own) {
  return threadIdx.x == 0 ? ld_relaxed_gpu(header_word<uint32_t>(own, kHdrErrorCode)) : kErrorNone;
}

// ---- releasing a share -------------------------------------------------------------------

// Adds this CTA's share (cta_share) of the running call to flags[own rank]
// of every active rank's header (thread d adds to rank d's). Call it after
// a barrier that follows every write and read of the CTA that the flag
// publishes (the ordering is at the top of this file).
__device__ inline void release_share(const WorkspaceView& ws, const SyncParams& sync, int64_t flags_offset,
                                     bool system) {
  const int d = threadIdx.x;
  if (d < ws.ep_size && rank_active(sync, d)) {
    red_release_add(flag_of(ws.row(d), flags_offset, ws.ep_rank), cta_share(blockIdx.x, gridDim.x), system);
  }
}

// How a bounded wait ended.
enum class PollResult { kReady, kAborted, kTimedOut, kPeerFailed };

// The one spin-wait of the kernels: calls ready() until it returns true,
// backing off as kPollFirstSleepNs/kPollMaxSleepNs say; stops early when an
// error is recorded in the own header (by any CTA of any kernel of this rank:
// the rank has failed, nothing it waits for may come), when one is recorded
// by the waited-for peer (peer_failed(), called every kPeerErrorCheckNs of
// the wait: protocol.h's kErrorPeerFailed) or
// when timeout_ns have passed. The caller records the timeout, with what it
// was waiting for.
template <typename Ready, typename PeerFailed>
__device__ inline PollResult poll_until(uint8_t* own, uint64_t timeout_ns, Ready&& ready, PeerFailed&& peer_failed) {
  const uint32_t* error = header_word<uint32_t>(own, kHdrErrorCode);
  const uint64_t start = global_timer_ns();
  // One comparison a poll, as with the timeout alone: the next look at the
  // peer's error word (every kPeerErrorCheckNs), or the timeout.
  uint64_t look_at = min(timeout_ns, kPeerErrorCheckNs);
  unsigned sleep_ns = 0;
  while (!ready()) {
    if (ld_relaxed_gpu(error) != kErrorNone) return PollResult::kAborted;
    const uint64_t waited = global_timer_ns() - start;
    if (waited >= look_at) {
      if (waited >= timeout_ns) return PollResult::kTimedOut;
      if (peer_failed()) return PollResult::kPeerFailed;
      look_at = min(timeout_ns, waited + kPeerErrorCheckNs);
    }
    if (sleep_ns != 0) __nanosleep(sleep_ns);
    sleep_ns = sleep_ns == 0 ? kPollFirstSleepNs : min(2 * sleep_ns, kPollMaxSleepNs);
  }
  return PollResult::kReady;
}

// Whether peer p's row holds an error record (a failed rank: protocol.h, kErrorPeerFailed).
__device__ inline bool peer_error_recorded(const WorkspaceView& ws, int p, const SyncSettings& settings) {
  return ld_acquire(header_word<uint32_t>(ws.row(p), kHdrErrorCode), settings.system) != kErrorNone;
}

// Waits until ready(p) holds for every active rank p (thread p polls rank
// p), at most limits.timeout_ns. Every thread of the CTA calls it; returns
// true in all of them when every rank was ready. On expiry the CTA records
// code_on_timeout with the mask of the missing ranks; where peers p !=
// ep_rank not ready are failed (failed_peer(p), looked at once a wait has
// lasted kPeerErrorCheckNs; protocol.h, kErrorPeerFailed), it records that
// instead; a CTA that sees an error recorded by another CTA of the grid
// stops too.
template <typename Ready, typename Failed>
__device__ inline bool wait_for_peers(const WorkspaceView& ws, const SyncParams& sync, Ready ready,
                                      uint32_t code_on_timeout, const SyncSettings& settings, Failed failed_peer) {
  __shared__ unsigned long long missing, failed;
  __shared__ int aborted;
  uint8_t* own = ws.row(ws.ep_rank);
  if (threadIdx.x == 0) {
    missing = 0;
    failed = 0;
    aborted = 0;
  }
  __syncthreads();
  const int p = threadIdx.x;
  if (p < ws.ep_size && rank_active(sync, p)) {
    const PollResult result = poll_until(
        own, settings.timeout_ns, [&] { return ready(p); }, [&] { return p != ws.ep_rank && failed_peer(p); });
    if (result == PollResult::kAborted) aborted = 1;
    if (result == PollResult::kTimedOut) atomicOr(&missing, 1ull << p);
    if (result == PollResult::kPeerFailed) atomicOr(&failed, 1ull << p);
  }
  __syncthreads();
  const uint64_t missed = missing, peers_failed = failed;
  if (threadIdx.x == 0 && peers_failed != 0) {
    record_error(own, sync.mailbox, kErrorPeerFailed, peers_failed, code_on_timeout);
  } else if (threadIdx.x == 0 && missed != 0) {
    record_error(own, sync.mailbox, code_on_timeout, missed, settings.timeout_ms);
  }
  return missed == 0 && peers_failed == 0 && aborted == 0;
}

// wait_for_peers until the word word_of(p) reached `target` (wrap-safe) for
// every active rank p; with kExact, until it equals `target`: scratch words
// that are never reset and hold their writer's epoch, where a word written
// 2^31 or more calls ago (or 0 since initialize) reads as reached.
template <bool kExact = false, typename WordOf>
__device__ inline bool wait_for_words(const WorkspaceView& ws, const SyncParams& sync, WordOf word_of, uint32_t target,
                                      uint32_t code_on_timeout, const SyncSettings& settings) {
  return wait_for_peers(
      ws, sync,
      [&](int p) {
        const uint32_t word = ld_acquire(word_of(p), settings.system);
        return kExact ? word == target : epoch_reached(word, target);
      },
      code_on_timeout, settings, [&](int p) { return peer_error_recorded(ws, p, settings); });
}

// wait_for_words on flags[p] of the own header: every share of call `epoch`.
__device__ inline bool wait_for_flags(const WorkspaceView& ws, const SyncParams& sync, int64_t flags_offset,
                                      uint32_t epoch, uint32_t code_on_timeout, const SyncSettings& settings) {
  uint8_t* own = ws.row(ws.ep_rank);
  return wait_for_words(
      ws, sync, [&](int p) { return flag_of(own, flags_offset, p); }, flag_target(epoch), code_on_timeout, settings);
}

// Dispatch step 0b and combine step 0 (protocol.h), by every thread: waits
// until every active rank finished pulling combine `count` (its pull_done),
// recording `code_on_timeout` if one does not. The dispatch waits where its
// regions overlap what the round's last combine read; a repeated combine
// that stages (rank-major and expert-major) waits for the combine before it.
// Out of line: the common calls never run it.
static __device__ __noinline__ bool wait_for_peer_pulls(const WorkspaceView& ws, const SyncParams& sync, uint32_t count,
                                                        uint32_t code_on_timeout, const SyncSettings& settings) {
  return wait_for_words(
      ws, sync, [&](int q) { return header_word<uint32_t>(ws.row(q), kHdrPullDone); }, flag_target(count),
      code_on_timeout, settings);
}

// Combine step 3 (protocol.h), by every CTA of combine `count` of the round
// of `dispatch_epoch` (rank-major and expert-major): waits for every active
// rank's combine flag, then lets the next kernel launch. The own rank's flag
// tells CTA 0 that every CTA of this grid has read the own header's words:
// it advances the own combine_epoch and combine_count, and sets
// region_staged when the combine staged (protocol.h, combine step 1).
__device__ inline bool acquire_combine_flags(const WorkspaceView& ws, const SyncParams& sync, uint32_t dispatch_epoch,
                                             uint32_t count, bool staged, const SyncSettings& settings) {
  if (!wait_for_flags(ws, sync, kHdrCombineFlags, count, kErrorCombineTimeout, settings)) return false;
  allow_dependent_launch();
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    uint8_t* own = ws.row(ws.ep_rank);
    *header_word<uint32_t>(own, kHdrCombineEpoch) = dispatch_epoch;
    *header_word<uint32_t>(own, kHdrCombineCount) = count;
    if (staged) *header_word<uint32_t>(own, kHdrRegionStaged) = 1;
  }
  return true;
}

// Combine step 5 (protocol.h): this CTA's share of own pull_done, once its
// pulls are read (every thread calls it).
__device__ inline void release_pull_done(uint8_t* own, bool system) {
  __syncthreads();
  if (threadIdx.x == 0) {
    red_release_add(header_word<uint32_t>(own, kHdrPullDone), cta_share(blockIdx.x, gridDim.x), system);
  }
}

// The equal-T and equal-payloads checks (protocol.h, "runtime_max[p]" and
// "payloads[p]"), once a CTA found a peer whose dispatch had another T or
// other payloads than this rank's: CTA 0 records the error of the first
// check that fails, with the mask of the peers that fail it (thread q
// compares peer q). Every thread of the CTA calls it; the rank-major and the
// expert-major combine kernels share it.
static __device__ __noinline__ void record_peer_call_mismatch(const CombineParams& p, bool other_t, bool other_payloads,
                                                              bool other_round, int32_t own_t) {
  __shared__ unsigned long long peers_t, peers_payloads;
  uint8_t* own = p.ws.row(p.ws.ep_rank);
  if (threadIdx.x == 0) peers_t = peers_payloads = 0;
  __syncthreads();
  if (other_t) atomicOr(&peers_t, 1ull << threadIdx.x);
  if (other_payloads) atomicOr(&peers_payloads, 1ull << threadIdx.x);
  const bool any_round = __syncthreads_or(other_round);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    if (peers_t != 0) {
      record_error(own, p.sync.mailbox, kErrorRuntimeMaxMismatch, peers_t, static_cast<uint32_t>(own_t));
    } else {
      record_error(own, p.sync.mailbox, kErrorPayloadMismatch, peers_payloads,
                   any_round ? kPayloadMismatchBackwardRound : 0u);
    }
  }
}

// first_row[s]: the rows a combine stages of the active sources before s
// (rows[s]: recv_count[s]; none of source `skipped`, -1 for none);
// first_row[ep_size]: all of them. Every thread calls it; warp 0 writes,
// the barrier hands the array to the CTA. Lane l takes sources l and l + 32
// and a warp scan sums them: the staging waits for this on its critical
// path, where thread 0 summing the sources one after another cost it 0.4-0.8
// us (docs/performance.md, 'What limits the decode latency').
__device__ inline void staged_row_starts(const CombineParams& p, const int32_t* rows, int skipped, int64_t* first_row) {
  if (warp_id() == 0) {
    const int lane = lane_id();
    int64_t before = 0;  // rows of the sources of the earlier rounds of 32
    for (int base = 0; base < p.ws.ep_size; base += kWarpSize) {
      const int s = base + lane;
      const int64_t own =
          s < p.ws.ep_size && s != skipped && rank_active(p.sync, s) ? received_rows(rows[s], p.runtime_max_tokens) : 0;
      int64_t inclusive = own;
#pragma unroll
      for (int offset = 1; offset < kWarpSize; offset *= 2) {
        const int64_t below = __shfl_up_sync(kFullWarp, inclusive, offset);
        if (lane >= offset) inclusive += below;
      }
      if (s < p.ws.ep_size) first_row[s] = before + inclusive - own;
      before += __shfl_sync(kFullWarp, inclusive, kWarpSize - 1);
    }
    if (lane == 0) first_row[p.ws.ep_size] = before;
  }
  __syncthreads();
}

// ---- vector copies ------------------------------------------------------------------------

// The unsigned type of a kBytes-wide load or store.
template <int kBytes>
struct VecOf;
// Two 16-byte vectors, 16-byte aligned: the bf16 output of a 16-element
// e4m3 pull vector.
struct alignas(16) Vec32 {
  uint4 lo, hi;
};
template <>
struct VecOf<32> {
  using T = Vec32;
};
template <>
struct VecOf<16> {
  using T = uint4;
};
template <>
struct VecOf<8> {
  using T = uint2;
};
template <>
struct VecOf<4> {
  using T = uint32_t;
};
template <>
struct VecOf<2> {
  using T = uint16_t;
};
template <>
struct VecOf<1> {
  using T = uint8_t;
};

// How a group of lanes copies rows of one size: rows of `vectors` vectors of
// vec_bytes each, handled by groups of `lanes` lanes (a power of two <= 32,
// so several short rows share a warp), each group moving one segment of
// lanes * kCopyUnroll vectors of a row per step.
struct CopyPlan {
  int vec_bytes;
  int lanes;
  int lane_bits;  // log2(lanes): group and lane-in-group indices are shifts and masks
  int vectors;    // per row (rows are below 2^31 bytes: launchers check)
  int segments;   // per row
};

// L2 eviction priorities for the copies of large dispatches (kL2Hints below).
__device__ __forceinline__ uint64_t l2_policy_evict_first() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ uint64_t l2_policy_evict_last() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ uint4 ld_global_l2_hint(const uint4* p, uint64_t policy) {
  uint4 v;
  asm("ld.global.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p), "l"(policy));
  return v;
}
__device__ __forceinline__ void st_global_l2_hint(uint4* p, const uint4& v, uint64_t policy) {
  asm volatile("st.global.L1::no_allocate.L2::cache_hint.v4.u32 [%0], {%1,%2,%3,%4}, %5;" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w), "l"(policy)
               : "memory");
}

// Fills the L2 line that holds p: no register, no ordering, no write.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Copies segment `segment` of the row at `src` to the destination rows
// row_of(key(0)), row_of(key(1)), ... up to the first key that is kRouteEnd
// (keys are route entries in dispatch). The loads of the segment are all
// issued before the first store, and each byte is read once however many
// destinations there are. key(k) is called for a batch of kDestBatch values
// of k before the batch's stores, so its loads are in flight together rather
// than one per destination; it may be called past the end (k < kMaxTopK
// always), and what it returns there is not used. Called by the `lanes` lanes
// of one group with their lane index in the group.
//
// kL2Hints (16-byte vectors only): loads marked evict-last and stores
// evict-first in L2. For copies whose rows are not read again from L2 soon
// (a large dispatch writes more than L2 holds): same-call A/B on an H200, ep
// 8 x 4096 tokens, 820 -> 804 us; the bare pattern gains the same (0.866 ->
// 0.887 of copy; docs/performance.md, 'Design decisions and their measured
// effect'). Why the loads' priority helps as well is not separated.
template <int kBytes, bool kL2Hints = false, typename Key, typename RowOf>
__device__ __forceinline__ void copy_segment(const uint8_t* src, const CopyPlan& plan, int segment, int lane_in_group,
                                             Key&& key, RowOf&& row_of) {
  using V = typename VecOf<kBytes>::T;
  constexpr bool kHinted = kL2Hints && kBytes == 16;
  const V* from = reinterpret_cast<const V*>(src);
  const int first = segment * plan.lanes * kCopyUnroll + lane_in_group;
  V buf[kCopyUnroll];
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u) {
    const int v = first + u * plan.lanes;
    if constexpr (kHinted) {
      buf[u] = v < plan.vectors ? ld_global_l2_hint(from + v, l2_policy_evict_last()) : V{};
    } else {
      buf[u] = v < plan.vectors ? from[v] : V{};
    }
  }
  for (int batch = 0; batch < kMaxTopK; batch += kDestBatch) {
    int32_t keys[kDestBatch];
#pragma unroll
    for (int j = 0; j < kDestBatch; ++j) keys[j] = batch + j < kMaxTopK ? key(batch + j) : kRouteEnd;
#pragma unroll
    for (int j = 0; j < kDestBatch; ++j) {
      if (keys[j] == kRouteEnd) return;
      V* to = reinterpret_cast<V*>(row_of(keys[j]));
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) {
        const int v = first + u * plan.lanes;
        if (v >= plan.vectors) continue;
        if constexpr (kHinted) {
          st_global_l2_hint(to + v, buf[u], l2_policy_evict_first());
        } else {
          to[v] = buf[u];
        }
      }
    }
  }
}

// copy_segment with the plan's vector width picked at run time.
template <bool kL2Hints = false, typename Key, typename RowOf>
__device__ __forceinline__ void copy_segment_any(const uint8_t* src, const CopyPlan& plan, int segment,
                                                 int lane_in_group, Key&& key, RowOf&& row_of) {
  switch (plan.vec_bytes) {
    case 16:
      return copy_segment<16, kL2Hints>(src, plan, segment, lane_in_group, key, row_of);
    case 8:
      return copy_segment<8>(src, plan, segment, lane_in_group, key, row_of);
    case 4:
      return copy_segment<4>(src, plan, segment, lane_in_group, key, row_of);
    case 2:
      return copy_segment<2>(src, plan, segment, lane_in_group, key, row_of);
    default:
      return copy_segment<1>(src, plan, segment, lane_in_group, key, row_of);
  }
}

// ---- host helpers ------------------------------------------------------------------------------

// Widest of 16/8/4/2/1 bytes that divides `bits`, the OR of every address,
// stride and size a vector access must be aligned to.
inline int widest_vector_bytes(uint64_t bits) {
  for (int bytes = 16; bytes > 1; bytes /= 2) {
    if (bits % uint64_t(bytes) == 0) return bytes;
  }
  return 1;
}

// Lanes per row: the smallest power of two whose lanes cover a row of
// `vectors` vectors in one step of `unroll` vectors each, at most a warp.
inline int lanes_per_row(int64_t vectors, int unroll) {
  int lanes = 1;
  while (lanes < kWarpSize && int64_t(lanes) * unroll < vectors) lanes *= 2;
  return lanes;
}

// log2 of a power of two.
inline int log2_exact(int power_of_two) {
  int bits = 0;
  while ((1 << bits) < power_of_two) ++bits;
  return bits;
}

// Rows of at most this many bytes: vector and segment indices stay 32-bit
// (ops.cpp admits rows of up to 2^28 bytes).
constexpr int64_t kMaxKernelRowBytes = int64_t(1) << 30;

inline CopyPlan make_copy_plan(int64_t row_bytes, uint64_t alignment_bits) {
  CopyPlan plan;
  plan.vec_bytes = widest_vector_bytes(alignment_bits | uint64_t(row_bytes));
  plan.vectors = static_cast<int>(row_bytes / plan.vec_bytes);
  plan.lanes = lanes_per_row(plan.vectors, kCopyUnroll);
  plan.lane_bits = log2_exact(plan.lanes);
  const int per_segment = plan.lanes * kCopyUnroll;
  plan.segments = (plan.vectors + per_segment - 1) / per_segment;
  return plan;
}

inline SyncSettings make_sync_settings(double timeout_s, const LaunchConfig& config) {
  SyncSettings settings;
  const double ns = timeout_s * 1e9;
  constexpr double kMaxNs = 1.8e19;  // below 2^64
  settings.timeout_ns = ns >= kMaxNs ? UINT64_MAX : static_cast<uint64_t>(ns);
  settings.timeout_ms = config.timeout_ms;
  settings.system = config.system_scope;
  return settings;
}

inline uint64_t address_bits(const void* p) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)); }

// Launches `kernel` on `stream`, with programmatic stream serialization when
// `pdl` (the kernel then overlaps the previous kernel's tail and calls
// wait_for_previous_grid() before touching memory).
template <typename... KernelArgs, typename... Args>
cudaError_t launch_kernel(void (*kernel)(KernelArgs...), int grid, int block, cudaStream_t stream, bool pdl,
                          Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(grid));
  config.blockDim = dim3(static_cast<unsigned>(block));
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// Lowers *ctas_per_sm to the occupancy of `kernel` in kThreads-thread CTAs
// (the spinning kernels' grids must be resident whole, so each instance counts).
template <typename... KernelArgs>
cudaError_t lower_to_occupancy(void (*kernel)(KernelArgs...), int* ctas_per_sm) {
  int n = 0;
  const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0);
  if (err == cudaSuccess && n < *ctas_per_sm) *ctas_per_sm = n;
  return err;
}

// Occupancy of each spinning kernel (defined next to it), for query_ctas_per_sm.
cudaError_t dispatch_ctas_per_sm(int* ctas_per_sm);
cudaError_t combine_ctas_per_sm(int* ctas_per_sm);
cudaError_t expert_major_combine_ctas_per_sm(int* ctas_per_sm);  // and the build's grids

}  // namespace gpu
}  // namespace moe_a2a
