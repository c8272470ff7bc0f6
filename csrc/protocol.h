// torch-moe-a2a: the one source of truth for limits, the workspace layout and
// the synchronization protocol. Included by the operator glue (ops.cpp), the
// CPU kernels and the CUDA kernels alike; it includes no torch header so that
// nvcc compiles it alone. torch_moe_a2a/layout.py mirrors every number here
// and tests/test_layout.py proves the two agree.
//
// ---------------------------------------------------------------------------
// Workspace
// ---------------------------------------------------------------------------
// The workspace is [ep_size, size_per_rank] bytes; row r is rank r's memory and
// every rank can read and write every row. A row is:
//
//   [0, kHeaderBytes)            RankHeader: config, own epochs, error record,
//                                flags and receive counts written by peers,
//                                the own CUDA kernels' scratch words
//   [kHeaderBytes, ...)          the per-call region, laid out for each call
//                                from (ep_size, T = runtime_max_tokens_per_rank,
//                                eplb_n, payload row sizes) by CallLayout below:
//       route   int32 [T][kMaxTopK]  this rank's own routing of its tokens
//                                    (written by its dispatch, read by its
//                                    combine): entry = dest_rank << kRouteRankShift
//                                    | slot, ascending dest_rank, distinct ranks
//                                    only, terminated by kRouteEnd
//       eplb    int32 [ep_size][eplb_n]   (only when the call gathers EPLB
//                                    stats) row s written by rank s
//       plane i  [ep_size][T][row_bytes_i]  payload i received from each
//                                    source rank (row [s, j] = j-th token
//                                    received from rank s)
//       combine  [ep_size][T][combine_row_bytes]  at combine_payload_offset:
//                                    this rank's expert outputs, read by the
//                                    source ranks during combine
//   Every region starts kAlign-aligned, the planes and the combine region
//   kPlaneAlign-aligned (relative to the row start; workspace_size_per_rank
//   returns multiples of kPlaneAlign, so with such a row stride every rank's
//   planes have the same alignment, absolute too when the allocation's is);
//   rows inside a plane are packed.
//
// ---------------------------------------------------------------------------
// Protocol (dispatch -> combine -> dispatch ..., on every rank)
// ---------------------------------------------------------------------------
// Epochs are per-rank counters in the rank's own header, advanced by the
// kernels themselves (no host state, so CUDA-graph replay needs no reset):
// dispatch n of every rank carries epoch n = 1, 2, ... (uint32, compared
// wrap-safe), and so do the combines of its round: between two dispatches a
// rank may combine any number of times (FlashInfer's repeated combines),
// every rank the same number, each a full collective over the round's
// routes. The own combine_count counts every combine since initialize:
// combine c = 1, 2, ... of a rank is its c-th, whichever round it belongs to.
//
// Flags count shares: a flag word (dispatch_flag[s] and combine_flag[s] in a
// rank's header, own pull_done) grows by kFlagShares for every call of its
// writer, so call n is complete once the word reached flag_target(n) =
// n * kFlagShares (uint32, compared wrap-safe): n the dispatch epoch for the
// dispatch flags, the combine count c for the combine flags and pull_done. A writer that is one thread
// (the CPU) adds the whole kFlagShares with one release store; a CUDA grid
// of G CTAs adds it in shares, each CTA releasing its own (cta_share: CTA 0
// kFlagShares - (G - 1), the others 1) once its part is written, so no CTA
// waits for another before a peer may read, and the reader needs not know G.
//
// dispatch n on rank s (n = own dispatch_epoch + 1; requires own
// dispatch_epoch == own combine_epoch, else "two dispatches in a row"):
//   0. a. the first dispatch since initialize (first_dispatch: the own init
//      word not yet in use, which n == 1 is not once the uint32 epoch has
//      wrapped after 2^32 dispatches): acquire-wait until
//      every active peer p's init word is fresh_peer (p zeroed its row
//      since its last use) before writing anything into it; then
//      own init_seen[p] := p's tag (kept by the next initialize as stale)
//      b. only when this call's regions may cover something a rank still
//      reads of call n - 1 (previous_call_overlap below: dispatch_end >
//      own kHdrLastDispatchEnd, or T < own kHdrLastRuntimeMax):
//      acquire-wait until pull_done >= flag_target(own combine_count) in
//      every active peer p's own header (p finished pulling the last
//      combine of round n - 1) before writing anything; then own
//      kHdrLastDispatchEnd := dispatch_end
//   1. route every local token (skip ids < 0, count and skip ids >= num_experts,
//      drop masked-off ranks), slots = per-destination running count in
//      increasing token index (deterministic, no atomics order)
//   2. write payload rows into dest d's planes at [s, slot], eplb row s into
//      d's eplb region, recv_count[s], runtime_max[s] := T and payloads[s] :=
//      the call's payload_signature into d's header; own recv_count[q] := 0
//      for every masked-off q (it writes nothing here this call)
//   3. release: add this call's shares to dispatch_flag[s] in every active
//      dest d's header (each CTA its own, after its rows of steps 2)
//   4. acquire: wait until own dispatch_flag[p] >= flag_target(n) for every
//      active peer p (the own rank's included: on CUDA one CTA waits, and the
//      own flag tells it that every CTA of its grid has read what it reads
//      of the own header and released)
//   5. own kHdrLast* words and dispatch_epoch := n, own region_staged
//      := 0, own expert-major epoch := n - 1 (stale_expert_major_epoch; an
//      expert-major call's build then writes n); the first dispatch: own
//      init word marked in use (also by every recorded error)
//   The equal-T check: own runtime_max[p] == own runtime_max[s] for every
//   active peer p, else kErrorRuntimeMaxMismatch with the mask of those
//   peers (the contract wants T equal on all ranks for one call: a peer with
//   another T wrote at other offsets, so the call's rows are not to be
//   trusted; when the T differ, every rank has such a peer, so every rank
//   fails and none waits for another). Then, likewise, the equal-payloads
//   check: own payloads[p] == own payloads[s] (payload_signature: the
//   payloads' row sizes and where the layout puts them, EPLB region
//   included, and num_experts; the host mixes in the active rank mask; an
//   expert-major dispatch mixes in max_tokens_per_expert, whose planes'
//   offsets follow from it), and own round_tags[p] against own
//   round_tags[s] (round_tags_differ: a backward round against a call that
//   is none, or the backward rounds of two exchanges, whose rows' sizes
//   may agree), else
//   kErrorPayloadMismatch. The CPU dispatch checks after
//   step 4 and raises at once; the CUDA combine n checks before its step 1,
//   with its first loads, so that the dispatch, whose end the combine waits
//   for, spends no memory latency on it.
// combine c of round n on rank r (c = own combine_count + 1; requires
// combine_sequence_ok: own dispatch_epoch == own combine_epoch + 1, the
// round's first combine, or the two equal once a dispatch finished, a
// repeated one, else kErrorSequence; and its local_num_tokens, T, top_k and
// combine_payload_offset equal to own kHdrLastLocalTokens, kHdrLastRuntimeMax,
// kHdrLastTopK, kHdrLastDispatchEnd, and no payload read from a region that
// an earlier combine of the round staged into (region_staged_mismatch): else
// kErrorCombineMismatch; the routes, counts and regions it reads are laid out
// for dispatch n's sizes, and the peers pull its combine region n from
// dispatch_end n):
//   0. a repeated combine that writes into its combine region (step 1):
//      acquire-wait until pull_done >= flag_target(c - 1) in every active
//      peer p's own header (p finished pulling combine c - 1 from it)
//   1. stage: copy the first recv_count[s] rows of payload[s] of every
//      active source s != r into own combine region (skipped when the
//      payload already lives there); own region_staged := 1. Not source r's
//      rows: only r's own pull reads them, and it reads them from the
//      payload, which saves their copy and the wait for it (at ep 1 the
//      whole stage), unless the payload tensor lies in the workspace (a
//      receive view passed back) and a peer is active: that peer's dispatch
//      n+1 may write there as soon as it saw this combine's flags (buffer
//      reuse chain, below), so such a payload's r rows are staged too and
//      pulled from the region.
//      The expert-major combine stages its valid rows [e, i] only when an
//      active peer exists, and its pull reads the own pairs' rows from the
//      payload (params.h, em_combine_stages; no peer writes them before its
//      pull_done: the expert-major dispatch); either combine of a payload
//      tensor sets region_staged when it copies nothing. A low-precision
//      combine converts every source's rows to e4m3 (from the payload or in
//      place), r's included but on CUDA for plain e4m3 rows of a 16-bit
//      payload outside the workspace (launch_combine), whose r rows the pull
//      reads unconverted and converts as step 1 would.
//   2. release: add this call's shares to combine_flag[r] in every active
//      peer p's header (each CTA its own, after its staged rows); the CPU
//      combine first sets signatures[c & 1][r] := the call's
//      combine_signature in every active peer p's header
//   3. acquire: wait until own combine_flag[p] >= flag_target(c) for every
//      active peer p; own combine_epoch := n, combine_count := c (on CUDA by
//      CTA 0, once the own flag tells it that every CTA of its grid has read
//      the epochs and the count)
//   4. pull: out[t] = sum over route[t] (ascending rank) of
//      combine_region_of(rank)[r][slot] (payload[r][slot], or the region's
//      unconverted row, for rank == r when step 1 left r's rows out),
//      accumulated in fp32, zeros when empty
//   5. release: add this call's shares to own pull_done (each CTA its own,
//      after its pulls' loads, which the sums consumed: dispatch step 0b and
//      combine step 0 of the peers read it; the output stores may follow,
//      no peer reads them)
//   The equal-rows check (CPU): own signatures[c & 1][p] == the call's
//   combine_signature for every active peer p, after step 3 and before the
//   pull, else kErrorCombineRowsMismatch with the mask of those peers. Each
//   rank pulls its peers' combine regions as its own call lays them out
//   (transport, dtype, row size, rank- or expert-major planes): where two
//   ranks' calls differ, each reads the other's rows wrongly, so both fail,
//   and neither waits for the other. Slot [c & 1]: rank p writes
//   signatures[c & 1] next in its combine c + 2, after this rank's combine
//   flag of combine c + 1, which this rank raises only once combine c has
//   finished. The CUDA combine does not check: the store before the flag's
//   release and the check cost its small calls 0.2-1 us (docs/DESIGN.md).
//
// Why no extra barrier is needed between calls (buffer reuse chain):
//   * rank s's dispatch n+1 writes into peer d's planes only after s's last
//     combine of round n saw d's flag of that combine (step 3 of combine). d
//     raised that flag after staging, which on d's stream follows d's MoE n,
//     the reader of the planes, and d's earlier combines of the round, the
//     readers of its receive counts. d's pull reads no plane: a payload that
//     is a receive view (or lies elsewhere in the workspace) has its own
//     rows staged too (step 1), since a layout of round n+1 (another T,
//     other payload rows) puts s's rows over d's own ones of round n.
//   * rank r writes its combine region n+1 (staging, or the MoE writing in
//     place) only after r's dispatch n+1 saw every peer p's dispatch-(n+1)
//     flag, which p raised after its last combine of round n finished
//     pulling from r.
//   * a repeated combine c of round n stages into a region that the peers
//     may still pull combine c - 1 from: step 0 waits for their pull_done.
//     One that reads its payload in place writes nothing there and waits for
//     nothing (rows that the caller rewrote in place between two combines
//     race with the peers' pulls of the earlier one: documented, not
//     detected).
//   * recv_count / eplb rows follow the same chain as the planes.
//   * the layout moves with T and the payload sizes, so round n+1's regions
//     in d's row may cover what a rank still reads there of round n: d's
//     combine region n, which every source rank pulls from during its
//     combine n, and d's route region n, which d's own combine n reads
//     while it pulls (after its flags, so a peer's dispatch n+1 can already
//     run): hence dispatch step 0. Every region a dispatch writes lies in
//     [kHeaderBytes, dispatch_end) and combine region n starts at
//     dispatch_end of round n (equal on all ranks: same T and payload rows),
//     so the two overlap only when dispatch_end grew. Peers write d's row
//     from the end of round n+1's route region, which starts at kHeaderBytes
//     and grows with T, so they reach d's route region n only when T shrank.
//     The steady state (same shapes every round) never waits there.
//   * initialize zeroes the row (local, as in FlashInfer): a peer's first
//     dispatch waits for the row's init word (step 0a), so no zeroing can
//     wipe what a peer wrote, whichever order the ranks initialize in, also
//     when the workspace is initialized again after use or after a failure
//     (no barrier needed after the initializes; before them, no rank may
//     still be inside a call: its late flags would land in a zeroed row and
//     count for the new epoch 1, and its pulls would read a row being
//     zeroed). A row's earlier initialization is told from the
//     new one because it was in use (it finished a dispatch or recorded an
//     error: bit kInitInUse), because the peer saw its tag at its own first
//     dispatch then (init_seen, kept as init_stale), or, when the peer saw
//     none, because its count is not the peer's own (each rank counts its
//     initializations; collective ones keep the counts equal). The count
//     makes every initialization's tag differ from the one before. Still
//     racy, so a barrier is still needed, in two cases: a row that its owner
//     initialized again after the peer's last look and did not use before
//     this round (initialize twice with no call in between), and, for a
//     peer that never looked, a row whose count ran ahead of the peer's.
// Misuse that breaks the chain (two dispatches in a row, combine without
// dispatch) is detected from the own epochs and refused with a clear error.
//
// Waits are bounded: on expiry the waiter records kError* and the mask of
// peers that did not arrive in its own header (and, on CUDA, the host
// mailbox inside metainfo) and returns; the workspace then stays failed
// (every later call raises) until it is initialized again.
// Masked-off ranks are neither written nor waited for; their epochs lag, so
// a rank that rejoins needs a collective re-initialization.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define MOE_A2A_HD __host__ __device__ __forceinline__
#else
#define MOE_A2A_HD inline
#endif

namespace moe_a2a {

// ---- limits (contract: DESIGN.md section 3) --------------------------------
constexpr int kMaxRanks = 64;
constexpr int kRankMaskWords = (kMaxRanks + 63) / 64;
constexpr int kMaxTopK = 22;
constexpr int kMaxPayloads = 8;
// The planes of one call: the user's payloads and, in an expert-major call,
// the expert ids and the router weights, which travel as payloads too.
constexpr int kMaxCallPayloads = kMaxPayloads + 2;
constexpr int64_t kMaxNumTokens = (int64_t(1) << 24) - 1;  // slot fits the route entry
constexpr int64_t kAlign = 128;
// The payload planes' and combine region's start, and workspace_size_per_rank's
// multiple. Rows at 128 mod 256 bytes take stores 7% slower on an H200 (the
// bare dispatch pattern: 0.804 of copy against 0.866 at any multiple of 256,
// docs/performance.md, 'Design decisions and their measured effect'); planes
// only 128-byte aligned, with a row stride that moved each rank's planes by
// 128 bytes, had made half the destinations of the ep 8 x 4096-token dispatch
// such rows (859 -> 806 us).
constexpr int64_t kPlaneAlign = 256;
constexpr double kDefaultTimeoutS = 30.0;
// The longest bound on a wait, in seconds (about 31 years): the metainfo
// holds a call's in microseconds in an int64, the kernels in nanoseconds.
constexpr int64_t kMaxTimeoutS = 1000000000;

// ---- route entries ----------------------------------------------------------
constexpr int kRouteRankShift = 24;
constexpr int32_t kRouteSlotMask = (int32_t(1) << kRouteRankShift) - 1;
constexpr int32_t kRouteEnd = -1;

MOE_A2A_HD int32_t route_entry(int rank, int64_t slot) { return (int32_t(rank) << kRouteRankShift) | int32_t(slot); }
MOE_A2A_HD int route_rank(int32_t e) { return int(uint32_t(e) >> kRouteRankShift); }
MOE_A2A_HD int64_t route_slot(int32_t e) { return int64_t(e & kRouteSlotMask); }
// Whether entry e (kRouteEnd: no) names a row of a call's planes. Routes are
// read back from the workspace, where only a peer that broke the equal-T
// contract (the equal-T check reports it) can have written over them: the
// copies and pulls stop at an entry outside the call rather than touch
// memory beyond the workspace.
MOE_A2A_HD bool route_in_call(int32_t e, int ep_size, int64_t runtime_max_tokens) {
  return e != kRouteEnd && route_rank(e) < ep_size && route_slot(e) < runtime_max_tokens;
}

// ---- metainfo (CPU int64 tensor returned by initialize) ---------------------
// The mailbox words are written by CUDA kernels on an error (metainfo is pinned
// host memory for a CUDA workspace) and read by the host before each call.
enum MetaIndex : int {
  kMetaMagic = 0,
  kMetaVersion,
  kMetaEpRank,
  kMetaEpSize,
  kMetaMaxNumTokens,
  kMetaEplbN,
  kMetaSizePerRank,
  kMetaHeaderBytes,
  kMetaMailboxCode,                                           // kError* (0: none)
  kMetaMailboxMissing,                                        // kRankMaskWords words: as kHdrErrorMissing
  kMetaMailboxDetail = kMetaMailboxMissing + kRankMaskWords,  // as kHdrErrorDetail
  kMetaMailboxAddr,                                           // address of the pinned host mailbox (CUDA), 0 on the CPU
  kMetaTimeoutUs,  // initialize's timeout_s in microseconds (0: none); the Python layer passes it to the ops
  kMetaCount
};
constexpr int64_t kMagic = 0x4d6f65413241LL;  // "MoeA2A" (48 bits)
constexpr int64_t kVersion = 1;

// ---- error codes (header and mailbox) ---------------------------------------
enum ErrorCode : uint32_t {
  kErrorNone = 0,
  kErrorDispatchTimeout = 1,
  kErrorCombineTimeout = 2,
  kErrorSequence = 3,  // dispatch/combine alternation broken (CUDA detects on device)
  // A peer's dispatch had another runtime_max_tokens_per_rank than this
  // rank's (the equal-T check below; detail: this rank's).
  kErrorRuntimeMaxMismatch = 4,
  // A combine whose sizes or combine_payload_offset are not its dispatch's
  // (combine_mismatch below; detail: its CombineMismatch bits). The CPU
  // combine refuses such a call before it starts; the CUDA kernel records it.
  kErrorCombineMismatch = 5,
  // A peer's dispatch, with this rank's T, had other payloads or the round
  // tag of another exchange (the equal-payloads check below; detail:
  // kPayloadMismatchBackwardRound where the round tags differ, else 0).
  kErrorPayloadMismatch = 6,
  // A peer's combine, the same combine of the round as this rank's, had other
  // rows (the equal-rows check below; detail unused).
  kErrorCombineRowsMismatch = 7,
  // Peers this rank waited for have an error recorded in their own rows (a
  // failed rank calls nothing until it is initialized again, so it would
  // never arrive): the wait ends then instead of at its timeout (detail: the
  // timeout code of the wait, kErrorDispatchTimeout or kErrorCombineTimeout).
  // Looked at once a wait has lasted kPeerErrorCheckNs, by the waits for
  // flags and pull_done, and by dispatch step 0a's wait for the peers' init
  // words in the rows of current peers only (current_peer): an older
  // initialization's error stays in a row until the initialization that wait
  // is for.
  kErrorPeerFailed = 8,
  // The call was interrupted while it waited for the peers in its mask (a
  // signal whose Python handler raised, KeyboardInterrupt at Ctrl-C: the
  // CPU waits of a Python process's main thread look for one; detail: the
  // timeout code of the wait), or, with no peers named, SimulatedEP.run was
  // and recorded it in every row so that every rank's wait ends. The peers
  // see a failed rank (kErrorPeerFailed).
  kErrorInterrupted = 9,
  // sanitize_expert_ids was given a view that is not among the last
  // dispatch's planes (sanitize_plane_fits below; detail: the last dispatch's
  // runtime_max_tokens_per_rank, 0 before any dispatch). The CPU refuses the
  // call; the CUDA kernel writes nothing and records it.
  kErrorSanitizeMismatch = 10,
};
// A healthy round's waits end within microseconds: only a longer wait reads
// the peers' error words, in their rows (remote memory on other GPUs).
constexpr uint64_t kPeerErrorCheckNs = 1000000;

// ---- rank header: byte offsets inside each row -----------------------------
constexpr int64_t kHdrMagic = 0;                // uint64, the init word (init_word below) once initialized
constexpr int64_t kHdrEpRank = 8;               // int32
constexpr int64_t kHdrEpSize = 12;              // int32
constexpr int64_t kHdrMaxNumTokens = 16;        // int32
constexpr int64_t kHdrEplbN = 20;               // int32
constexpr int64_t kHdrDispatchEpoch = 24;       // uint32, own
constexpr int64_t kHdrCombineEpoch = 28;        // uint32, own
constexpr int64_t kHdrErrorCode = 32;           // uint32, own
constexpr int64_t kHdrErrorDetail = 36;         // uint32, own: the timeout (ms) of a timed-out wait;
                                                // this rank's T for kErrorRuntimeMaxMismatch;
                                                // the CombineMismatch bits for kErrorCombineMismatch
constexpr int64_t kHdrErrorMissing = 40;        // uint64 [kRankMaskWords], own: the peers the error names
constexpr int64_t kHdrInvalidExpertCount = 48;  // int64, own, cumulative since initialize
constexpr int64_t kHdrLastLocalTokens = 56;     // int32, own: last dispatch's local_num_tokens
constexpr int64_t kHdrLastRuntimeMax = 60;      // int32, own: last dispatch's T
constexpr int64_t kHdrLastTopK = 64;            // int32, own: last dispatch's top_k
// uint32, own: flag_target(n) once combine n finished pulling (protocol
// step 5 of combine; read by the peers' dispatch step 0b).
constexpr int64_t kHdrPullDone = 68;
// CUDA scratch, own: the pull tasks a combine's warps claimed beyond their
// first (csrc/cuda/combine.cu; small grids only), word [n & 1] for combine
// n. Combine n zeroes word [(n + 1) & 1], which combine n - 1 used and
// combine n + 1 uses: the kernels of one rank run in stream order, so no CTA
// of either is running, and no CTA needs to wait for the others to reset it.
constexpr int64_t kHdrCombineClaims = 72;    // uint32 [2]
constexpr int64_t kHdrLastDispatchEnd = 80;  // int64, own: CallLayout::dispatch_end of the last dispatch
// CUDA scratch, own, zero between calls: claim counter 0 of a large dispatch
// (below), the only one where a grid has few warps (ep 8 on an H200). In this
// line it measured 0.5% faster than in a line of its own (ep 8 x 4096 tokens,
// docs/performance.md, 'Design decisions and their measured effect').
constexpr int64_t kHdrDispatchClaim0 = 88;  // uint32
// Expert-major receive layout (ExpertMajorLayout below), own: written by
// expert_major_build, read by the expert-major combine.
//   dropped  int64, cumulative since initialize: (token, local expert) pairs
//            beyond max_tokens_per_expert, dropped (as ids >= num_experts are)
//   end      int64: the ExpertMajorLayout::combine_offset of the last build
//   epoch    uint32: the dispatch epoch of the last build, or the last
//            dispatch's minus one after a rank-major dispatch (a combine of
//            another round finds no build of its own, and a rank-major
//            combine of an expert-major round is told apart)
//   tokens   int32: the max_tokens_per_expert of the last build
constexpr int64_t kHdrDroppedPairCount = 96;    // int64
constexpr int64_t kHdrExpertMajorEnd = 104;     // int64
constexpr int64_t kHdrExpertMajorEpoch = 112;   // uint32
constexpr int64_t kHdrExpertMajorTokens = 116;  // int32
// uint32, own: the combines this rank finished since initialize (combine
// step 3), every combine of a round counted (repeated combines): the number
// whose flag_target the combine flags and pull_done reach.
constexpr int64_t kHdrCombineCount = 120;
// uint32, own: 1 once a combine staged into the own combine region (combine
// step 1: a payload tensor's rows for the peers, or e4m3 rows from a tensor
// or in place) since the last dispatch, which clears it. The region then
// holds no payload: the own source's plane is not staged, e4m3 rows are not
// the payload's dtype. A combine that reads the region as its payload is
// refused then (kMismatchRegionStaged).
constexpr int64_t kHdrRegionStaged = 124;
constexpr int64_t kHdrDispatchFlags = 128;                               // uint32 [kMaxRanks], [s] written by rank s
constexpr int64_t kHdrCombineFlags = kHdrDispatchFlags + 4 * kMaxRanks;  // uint32 [kMaxRanks]
constexpr int64_t kHdrRecvCounts = kHdrCombineFlags + 4 * kMaxRanks;     // int32 [kMaxRanks]
// int32 [kMaxRanks], [s] written by rank s: the T of its latest dispatch
constexpr int64_t kHdrPeerRuntimeMax = kHdrRecvCounts + 4 * kMaxRanks;
// uint32 [kMaxRanks][2], [s] written by rank s: the payload_signature of its
// latest dispatch, and beside it (in the same cache sector, so that the
// combine's check loads no other line) that dispatch's round tag
// (round_tag_word: a differentiable function's backward round, the number of
// the exchange it belongs to; 0 for any other call), compared with the own
// one (round_tags_differ)
constexpr int64_t kHdrPeerPayloads = kHdrPeerRuntimeMax + 4 * kMaxRanks;
// uint32 [2][kMaxRanks], [c & 1][s] written by rank s (CPU): the
// combine_signature of its combine c (combine step 2)
constexpr int64_t kHdrCombineSignatures = kHdrPeerPayloads + 2 * 4 * kMaxRanks;
// uint16 [kMaxRanks], own, kept by initialize (dispatch step 0a): [q] = the
// init tag of peer q's row that a first dispatch saw before this row's latest
// initialize (stale: not to be trusted), and the one that the first dispatch
// since then saw (seen: the next initialize's stale).
constexpr int64_t kHdrInitStale = kHdrCombineSignatures + 2 * 4 * kMaxRanks;
constexpr int64_t kHdrInitSeen = kHdrInitStale + 2 * kMaxRanks;
// CUDA dispatch scratch of large calls, own, per CTA b of the grid (grids have
// at most kMaxDispatchCtas CTAs; see csrc/cuda/dispatch.cu, steps 1a and 3).
// Never reset: the epoch tells this call's words from older ones. A small
// expert-major dispatch's sources write their pair counts here (the
// expert-major receive layout below).
//   counts[b * ep_size + d]  (epoch << 32) | the tokens of chunk b that go to
//              rank d, written by CTA b once it has counted them; a later CTA
//              sums those of the chunks before its own for its first slots
//   routed[b]  the dispatch epoch once CTA b's route entries are written
//              (every CTA copies tokens of any chunk, after all are routed)
constexpr int kMaxDispatchCtas = 1024;
constexpr int64_t kHdrDispatchCounts = kHdrInitSeen + 2 * kMaxRanks;  // uint64 [kMaxDispatchCtas * kMaxRanks]
constexpr int64_t kHdrDispatchRouted =
    kHdrDispatchCounts + 8 * kMaxDispatchCtas * kMaxRanks;  // uint32 [kMaxDispatchCtas]
// CUDA scratch, own, zero between calls: copy tasks of the running large
// dispatch claimed beyond each warp's first, from kClaimCounters counters
// (the launch picks how many are used; see csrc/cuda/dispatch.cu, step 3):
// counter 0 at kHdrDispatchClaim0, counters 1.. each in its own 128-byte
// line. The CTA that waits in step 4 resets them (every CTA has claimed its
// last task before it released its share).
constexpr int kClaimCounters = 16;
constexpr int64_t kClaimStride = 128;
constexpr int64_t kHdrDispatchClaims =
    kHdrDispatchRouted + 4 * kMaxDispatchCtas;  // uint32, counter c at (c - 1) * kClaimStride
constexpr int64_t kHeaderBytes = kHdrDispatchClaims + kClaimStride * (kClaimCounters - 1);  // 532736
static_assert(kHdrDispatchCounts % 8 == 0 && kHeaderBytes % kAlign == 0, "header words aligned, regions too");

// Header offset of claim counter c (uint32), 0 <= c < kClaimCounters.
MOE_A2A_HD constexpr int64_t claim_counter_offset(int c) {
  return c == 0 ? kHdrDispatchClaim0 : kHdrDispatchClaims + kClaimStride * (c - 1);
}

// Header offset of recv_count[s] (int32): rows of this call that rank s sent here.
MOE_A2A_HD constexpr int64_t recv_count_offset(int64_t s) { return kHdrRecvCounts + int64_t(sizeof(int32_t)) * s; }

// Header offset of runtime_max[s] (int32): the T of rank s's latest dispatch.
MOE_A2A_HD constexpr int64_t peer_runtime_max_offset(int64_t s) {
  return kHdrPeerRuntimeMax + int64_t(sizeof(int32_t)) * s;
}

// Header offset of payloads[s] (uint32): the payload_signature of rank s's latest dispatch.
MOE_A2A_HD constexpr int64_t peer_payloads_offset(int64_t s) {
  return kHdrPeerPayloads + 2 * int64_t(sizeof(uint32_t)) * s;
}

// Header offset of round_tags[s] (uint32, beside payloads[s]): the round tag of rank s's latest dispatch.
MOE_A2A_HD constexpr int64_t peer_round_tag_offset(int64_t s) {
  return peer_payloads_offset(s) + int64_t(sizeof(uint32_t));
}

// Round tags of a dispatch (the op's round_tag): 0 for a call that is no
// backward round; -1 for a backward round of an exchange not known (a traced
// backward's); else the number of the exchange whose backward round it is.
// Its header word (round_tag_word): 0, kRoundTagAny, or the number folded
// to 32 bits, which is neither.
constexpr uint32_t kRoundTagAny = 0xffffffffu;
MOE_A2A_HD constexpr uint32_t fold_round_tag(uint64_t t) { return uint32_t(t ^ (t >> 32)); }
MOE_A2A_HD constexpr uint32_t round_tag_word(int64_t round_tag) {
  if (round_tag == 0) return 0u;
  if (round_tag == -1) return kRoundTagAny;
  const uint32_t folded = fold_round_tag(uint64_t(round_tag));
  return folded == 0u || folded == kRoundTagAny ? 1u : folded;
}

// Whether two dispatches' round tags say they are not the same exchange's
// round: a backward round against a call that is none (a rank that skipped a
// backward), or the backward rounds of two exchanges. A round of an
// unknown exchange (kRoundTagAny) pairs with any backward round by its
// rows' sizes.
MOE_A2A_HD constexpr bool round_tags_differ(uint32_t a, uint32_t b) {
  return (a == 0u) != (b == 0u) || (a != kRoundTagAny && b != kRoundTagAny && a != b);
}

// Header offset of signatures[c & 1][s] (uint32): the combine_signature of rank s's combine c.
MOE_A2A_HD constexpr int64_t combine_signature_offset(uint32_t c, int64_t s) {
  return kHdrCombineSignatures + int64_t(sizeof(uint32_t)) * (int64_t(c & 1u) * kMaxRanks + s);
}

// Header offsets of init_stale[q] and init_seen[q] (uint16): peer q's init tags.
MOE_A2A_HD constexpr int64_t init_stale_offset(int64_t q) { return kHdrInitStale + int64_t(sizeof(uint16_t)) * q; }
MOE_A2A_HD constexpr int64_t init_seen_offset(int64_t q) { return kHdrInitSeen + int64_t(sizeof(uint16_t)) * q; }

// ---- the init word (kHdrMagic) ----------------------------------------------
// kMagic in the low 48 bits and a 16-bit tag above them: bits 0-14 count the
// row's initializations (1, 2, ..., 32767, 1, ...: each differs from the one
// before), bit 15 is set once the rank has finished a dispatch or recorded an
// error since. A first dispatch writes into a peer's row only when it shows
// an initialization that has not been in use and that is not the stale one
// (kHdrInitStale), so a re-initialization after use needs no barrier
// between the initializes and the first dispatch.
constexpr int kInitTagShift = 48;
constexpr uint16_t kInitInUse = 0x8000;
constexpr uint16_t kInitCountMax = 0x7fff;
// kInitInUse where it lies in the init word (the bit mark_in_use sets).
constexpr uint64_t kInitWordInUse = uint64_t(kInitInUse) << kInitTagShift;

MOE_A2A_HD constexpr bool row_initialized(uint64_t word) {
  return (word & ((uint64_t(1) << kInitTagShift) - 1)) == uint64_t(kMagic);
}
MOE_A2A_HD constexpr uint16_t init_tag(uint64_t word) { return uint16_t(word >> kInitTagShift); }
MOE_A2A_HD constexpr uint16_t init_count(uint64_t word) { return uint16_t(init_tag(word) & kInitCountMax); }
MOE_A2A_HD constexpr uint64_t init_word(uint16_t tag) { return uint64_t(kMagic) | (uint64_t(tag) << kInitTagShift); }
// The word initialize writes over `old` (what the row held before).
MOE_A2A_HD constexpr uint64_t next_init_word(uint64_t old) {
  return init_word(row_initialized(old) ? uint16_t(init_count(old) % kInitCountMax + 1) : uint16_t(1));
}
// Dispatch step 0a: whether the peer row whose init word is `word` holds the
// peer's initialization that goes with this rank's own: the row is
// initialized and its tag is not `stale` (the peer's tag this rank saw at its
// previous first dispatch) or, when this rank saw none, its count equals
// `own_count`, this rank's own (every rank initializes once per collective
// initialization).
MOE_A2A_HD constexpr bool current_peer(uint64_t word, uint16_t stale, uint16_t own_count) {
  return row_initialized(word) && (stale != 0 ? init_tag(word) != stale : init_count(word) == own_count);
}
// Dispatch step 0a: whether that row may be written by this rank's first
// dispatch since its initialize: current_peer and not yet in use. A current
// peer's row that is in use with an error recorded is a failed peer: it calls
// nothing until it is initialized again, and that initialization is not the
// one this wait is for (its count or tag moves on), so the wait ends
// (kErrorPeerFailed).
MOE_A2A_HD constexpr bool fresh_peer(uint64_t word, uint16_t stale, uint16_t own_count) {
  return current_peer(word, stale, own_count) && (word & kInitWordInUse) == 0;
}
// Whether a dispatch on the row whose own init word is `own_word` is the
// first since its initialize (dispatch step 0a): no dispatch finished and no
// error was recorded since. Not "n == 1": the uint32 epoch comes back to 1
// after 2^32 calls, when the peers' rows are long in use.
MOE_A2A_HD constexpr bool first_dispatch(uint64_t own_word) { return (own_word & kInitWordInUse) == 0; }

MOE_A2A_HD constexpr int64_t align_up(int64_t x, int64_t a = kAlign) { return (x + a - 1) / a * a; }

// Rows of source s's plane that a combine stages or reads: recv_count[s]
// clamped to [0, T], so that a peer that broke the equal-T contract cannot
// make a rank read or write past the plane.
MOE_A2A_HD int64_t received_rows(int32_t recv_count, int64_t runtime_max_tokens) {
  const int64_t rows = recv_count > 0 ? int64_t(recv_count) : 0;
  return rows < runtime_max_tokens ? rows : runtime_max_tokens;
}

// Wrap-safe "epoch a has reached b".
MOE_A2A_HD bool epoch_reached(uint32_t a, uint32_t b) { return int32_t(a - b) >= 0; }

// ---- flags (the Protocol section's shares) ---------------------------------
// A flag word grows by kFlagShares per call of its writer; more than any grid
// has CTAs, so that every CTA's share is at least 1.
constexpr uint32_t kFlagShares = uint32_t(1) << 16;
// The value of a flag word once calls 1..n of its writer are complete.
MOE_A2A_HD uint32_t flag_target(uint32_t epoch) { return epoch * kFlagShares; }
// What CTA `cta` of a grid of `ctas` CTAs adds to a flag word per call.
MOE_A2A_HD uint32_t cta_share(uint32_t cta, uint32_t ctas) { return cta == 0 ? kFlagShares - (ctas - 1) : 1u; }
static_assert(kMaxDispatchCtas < kFlagShares, "every CTA of a grid has a share of at least 1");

// ---- expert -> rank (contract: contiguous ranges, the first E % R ranks own
// E / R + 1 experts, the rest E / R) -----------------------------------------
// In any integer type I that holds num_experts: the CUDA dispatch fills its
// table of at most 4096 experts with 32-bit divisions, where a 64-bit one is
// a subroutine call.
template <typename I>
MOE_A2A_HD int expert_to_rank_in(I expert, I num_experts, I ep_size) {
  const I base = num_experts / ep_size, extra = num_experts % ep_size;
  const I boundary = extra * (base + 1);
  return expert < boundary ? int(expert / (base + 1)) : int(extra + (expert - boundary) / base);
}
MOE_A2A_HD int expert_to_rank(int64_t expert, int64_t num_experts, int64_t ep_size) {
  return expert_to_rank_in<int64_t>(expert, num_experts, ep_size);
}

// ---- per-call layout --------------------------------------------------------
// One function computes every offset of a call; the Python mirror is
// torch_moe_a2a.layout.call_layout.
struct CallLayout {
  int64_t route_offset;
  int64_t eplb_offset;  // -1 when the call gathers no EPLB stats
  int num_payloads;
  int64_t payload_offset[kMaxCallPayloads];
  int64_t combine_offset;  // combine_payload_offset
  int64_t dispatch_end;    // == combine_offset
};

MOE_A2A_HD CallLayout call_layout(int64_t ep_size, int64_t runtime_max_tokens, int64_t eplb_n, int num_payloads,
                                  const int64_t* payload_row_bytes) {
  CallLayout l{};
  int64_t off = kHeaderBytes;
  l.route_offset = off;
  off = align_up(off + runtime_max_tokens * kMaxTopK * 4);
  l.eplb_offset = -1;
  if (eplb_n > 0) {
    l.eplb_offset = off;
    off = align_up(off + ep_size * eplb_n * 4);
  }
  l.num_payloads = num_payloads;
  for (int i = 0; i < num_payloads; ++i) {
    l.payload_offset[i] = align_up(off, kPlaneAlign);
    off = l.payload_offset[i] + ep_size * runtime_max_tokens * payload_row_bytes[i];
  }
  off = align_up(off, kPlaneAlign);
  l.combine_offset = off;
  l.dispatch_end = off;
  return l;
}

// sanitize_expert_ids's view, [ep_size, T, width] ids from byte `offset` of
// the own row to byte `plane_end`, must lie where the last dispatch put its
// planes: that dispatch's T, past its routes, before its dispatch_end, and a
// dispatch since initialize (first_dispatch of the own init word: the epochs
// wrap). A view kept from a round of another T would cover other planes of
// the current one (a received payload, the routes), which its writes would
// overwrite. (Not checked: which plane of the dispatch the view is.)
MOE_A2A_HD bool sanitize_plane_fits(uint64_t own_init_word, int32_t last_runtime_max, int64_t last_dispatch_end,
                                    int64_t T, int64_t offset, int64_t plane_end) {
  return !first_dispatch(own_init_word) && last_runtime_max == T &&
         offset >= call_layout(1, T, 0, 0, nullptr).dispatch_end && plane_end <= last_dispatch_end;
}

// The equal-payloads check's word of a call (dispatch step 2): where its
// bytes land, as a hash (FNV-1a) of its payloads' row sizes and of the
// layout's EPLB and plane offsets and end, and which rank owns each expert
// (num_experts: another count maps the ids to other ranks, and the rows
// reach ranks that do not own their experts). Ranks whose calls share T but
// not this word sent other payloads (their number, row sizes, or EPLB stats)
// or passed another num_experts. The host mixes in the call's active rank
// mask too (ops.cpp, check_dispatch). A backward round's identity travels
// beside it, in round_tags, not in it: a round of an unknown exchange (a
// compiled backward's) must still pair with one of a known exchange.
MOE_A2A_HD uint32_t fnv1a_mix(uint32_t hash, int64_t value) {
  for (int b = 0; b < 8; ++b) hash = (hash ^ uint32_t((uint64_t(value) >> (8 * b)) & 0xff)) * 16777619u;
  return hash;
}
MOE_A2A_HD uint32_t payload_signature(const CallLayout& l, const int64_t* payload_row_bytes, int64_t num_experts) {
  uint32_t hash = fnv1a_mix(fnv1a_mix(2166136261u, num_experts), l.num_payloads);
  hash = fnv1a_mix(hash, l.eplb_offset);
  for (int i = 0; i < l.num_payloads; ++i) {
    hash = fnv1a_mix(fnv1a_mix(hash, payload_row_bytes[i]), l.payload_offset[i]);
  }
  return fnv1a_mix(hash, l.dispatch_end);
}

// The equal-rows check's word of a combine (combine step 2, CPU): how its peers
// read its combine region, as a hash (FNV-1a) of the rows' transport (its
// LowPrecision), the payload's dtype and elements a row, and the planes of
// an expert-major combine (its local experts and max_tokens_per_expert; 0
// and 0 for a rank-major combine).
MOE_A2A_HD uint32_t combine_signature(int64_t transport, int64_t dtype, int64_t row_elems, int64_t local_experts,
                                      int64_t tokens_per_expert) {
  uint32_t hash = fnv1a_mix(fnv1a_mix(2166136261u, transport), dtype);
  hash = fnv1a_mix(fnv1a_mix(hash, row_elems), local_experts);
  return fnv1a_mix(hash, tokens_per_expert);
}

// Dispatch step 0b: whether call n+1 (dispatch_end, T) may write over a
// region that a rank still reads of call n (last_dispatch_end, last_T, from
// the own header: equal on every rank, as the layouts are): the combine region
// n (dispatch_end grew) or the route region n (T shrank).
MOE_A2A_HD bool previous_call_overlap(int64_t dispatch_end, int64_t last_dispatch_end, int64_t runtime_max_tokens,
                                      int64_t last_runtime_max_tokens) {
  return dispatch_end > last_dispatch_end || runtime_max_tokens < last_runtime_max_tokens;
}

// kErrorPayloadMismatch's detail where the round tags differ
// (round_tags_differ): its message names that cause, ranks whose backwards
// ran the rounds of different exchanges, or a backward round against a
// forward call.
constexpr uint32_t kPayloadMismatchBackwardRound = 1;

// What of a combine's call differs from its dispatch's (the own header's
// kHdrLast* words, written by that dispatch): kErrorCombineMismatch's detail.
enum CombineMismatch : uint32_t {
  kMismatchLocalTokens = 1,
  kMismatchRuntimeMax = 2,
  kMismatchTopK = 4,
  kMismatchOffset = 8,  // combine_payload_offset != the dispatch's dispatch_end
  // An expert-major combine (or build) whose expert-major layout is not its
  // build's: no build since the dispatch, another max_tokens_per_expert, or a
  // combine_payload_offset that is not the build's (kHdrExpertMajor*).
  kMismatchExpertMajor = 16,
  // A combine whose payload is the own combine region while the region holds
  // the rows an earlier combine of the round staged (kHdrRegionStaged), not a
  // payload.
  kMismatchRegionStaged = 32,
  // A rank-major combine after an expert-major dispatch (kHdrExpertMajorEpoch
  // is the pending dispatch's): its staging would write the expert-major
  // regions that begin at dispatch_end, which the round's expert-major
  // combines read.
  kMismatchRankMajorAfterExpertMajor = 64,
};

// Why kMismatchRankMajorAfterExpertMajor refuses a combine, for the errors of both backends.
constexpr const char* kRankMajorAfterExpertMajorReason =
    "the last dispatch's rows are laid out expert-major (moe_a2a_dispatch_expert_major, or an "
    "expert_major_build after the dispatch): close its round with moe_a2a_combine_expert_major (a rank-major "
    "combine would stage or read rows where the expert-major regions begin, at the dispatch's dispatch_end, "
    "which the round's expert-major combines read)";

// What a rank-major dispatch n writes into kHdrExpertMajorEpoch (the build of
// an expert-major one then writes n): a value no build of call n wrote, so
// that the word names the last dispatch's layout also once the epochs wrap
// (a word left from 2^32 dispatches before, or 0 from initialize, would
// otherwise read as this call's).
MOE_A2A_HD constexpr uint32_t stale_expert_major_epoch(uint32_t dispatch_epoch) { return dispatch_epoch - 1u; }

// kMismatchRankMajorAfterExpertMajor of a rank-major combine, from the own
// header's kHdrExpertMajorEpoch and the dispatch epoch pending.
MOE_A2A_HD uint32_t rank_major_after_expert_major(uint32_t expert_major_epoch, uint32_t dispatch_epoch) {
  return expert_major_epoch == dispatch_epoch ? uint32_t(kMismatchRankMajorAfterExpertMajor) : 0u;
}

// Why kMismatchRegionStaged refuses a combine, for the errors of both
// backends (after "... that staged its payload ").
constexpr const char* kRegionStagedReason =
    "(a payload tensor, or use_low_precision): such a combine stages into the combine region the rows its "
    "peers pull (e4m3 rows with use_low_precision), so after it the region holds no payload of this round, "
    "whatever the ranks and masks; pass the payload as a tensor";

// The end of both backends' errors for a dispatch that finds its round open:
// a recomputation re-runs the forward ops of a checkpointed region in the
// backward, and where the backward needs a dispatch's received rows but not
// its combine's output it re-runs the dispatch alone.
constexpr const char* kRecomputedDispatchHint =
    "a recomputation that re-runs a dispatch without its combine does this too (activation checkpointing of a "
    "region that holds a dispatch, under torch.compile or around a dispatch without its combine): checkpoint "
    "with context_fn=torch_moe_a2a.checkpoint_context, which saves the exchanges instead";

// kMismatchExpertMajor of an expert-major combine from the own header's words
// of the last build (kHdrExpertMajorEpoch, kHdrExpertMajorTokens,
// kHdrExpertMajorEnd) and the dispatch epoch pending.
MOE_A2A_HD uint32_t expert_major_mismatch(uint32_t build_epoch, int64_t build_tokens, int64_t build_end,
                                          uint32_t dispatch_epoch, int64_t tokens_per_expert, int64_t combine_offset) {
  return build_epoch != dispatch_epoch || build_tokens != tokens_per_expert || build_end != combine_offset
             ? uint32_t(kMismatchExpertMajor)
             : 0u;
}
// The combine's sequence check (protocol.h, combine): the round's first
// combine follows its dispatch (dispatch_epoch == combine_epoch + 1); a
// repeated one follows a combine of the same round (equal epochs, and a
// dispatch finished since initialize: the own init word in use, which tells
// a fresh row's 0 == 0 from a round whose epochs wrapped).
MOE_A2A_HD bool combine_sequence_ok(uint32_t dispatch_epoch, uint32_t combine_epoch, uint64_t own_init_word) {
  return dispatch_epoch == combine_epoch + 1 || (dispatch_epoch == combine_epoch && !first_dispatch(own_init_word));
}

// kMismatchRegionStaged of a combine: it reads the own combine region as its
// payload (payload_in_workspace, plain or e4m3 in place) after a combine of
// the round staged into it (kHdrRegionStaged).
MOE_A2A_HD uint32_t region_staged_mismatch(uint32_t region_staged, bool reads_region) {
  return region_staged != 0 && reads_region ? uint32_t(kMismatchRegionStaged) : 0u;
}

MOE_A2A_HD uint32_t combine_mismatch(int64_t dispatch_tokens, int64_t dispatch_runtime_max, int64_t dispatch_top_k,
                                     int64_t dispatch_end, int64_t local_num_tokens, int64_t runtime_max_tokens,
                                     int64_t top_k, int64_t combine_offset) {
  return (local_num_tokens != dispatch_tokens ? kMismatchLocalTokens : 0u) |
         (runtime_max_tokens != dispatch_runtime_max ? kMismatchRuntimeMax : 0u) |
         (top_k != dispatch_top_k ? kMismatchTopK : 0u) | (combine_offset != dispatch_end ? kMismatchOffset : 0u);
}

// End of the combine region for a call: must stay <= size_per_rank.
MOE_A2A_HD int64_t combine_end(int64_t combine_offset, int64_t ep_size, int64_t runtime_max_tokens,
                               int64_t combine_row_bytes) {
  return combine_offset + ep_size * runtime_max_tokens * combine_row_bytes;
}

// ---- Low-precision combine rows (combine's use_low_precision) ----
// The combine stages every received row as e4m3 bytes into the combine region
// at the payload's row stride (payload_in_workspace: in place, over the row
// it converts), and the peers pull those (the own source's plain e4m3 rows
// the CUDA combine may leave out: combine step 1). Plain (FlashInfer's): element i at
// byte i. Block-scaled (ours): blocks of kLowPrecisionBlock elements, each
// with a ue8m0 scale code (one byte: the power-of-two scale's exponent), in
// groups of kLowPrecisionGroupBlocks blocks: group g's elements from byte
// g * kLowPrecisionGroupPitch, then its blocks' codes in block order at its
// elements' end rounded up to 16 bytes. So the codes stay 16-byte aligned
// and a row carries a byte a block beside them, 1/128 of a byte an element
// (a float scale a block, kept aligned, would take 16 bytes a block: 1.125
// bytes an element for the staging to write and the pull to read). In
// place, a row is converted front to back, and a step of the conversion
// loads its payload bytes before it stores any: element i's code lies at
// byte i + 16 (i / 2048) < 2 (i + 1), and group g's codes, stored once its
// last element is loaded, at bytes below 2064 (g + 1) <= 2 * 2048 (g + 1)
// (the last group's once the whole row is loaded); so no write lands on
// payload bytes (of elements of >= 2 bytes) not read yet. Nothing
// beyond the payload's rows is needed: workspace_size_per_rank covers them
// as it is.
constexpr int64_t kLowPrecisionBlock = 128;
constexpr int64_t kLowPrecisionGroupBlocks = 16;
constexpr int64_t kLowPrecisionGroup = kLowPrecisionBlock * kLowPrecisionGroupBlocks;
constexpr int64_t kLowPrecisionGroupPitch = kLowPrecisionGroup + kLowPrecisionGroupBlocks;
enum class LowPrecision : int32_t { kOff = 0, kE4m3 = 1, kE4m3BlockScaled = 2 };

// Byte of element i of a staged row. `I`: int64_t, or int where the row is
// known to be below 2^30 bytes (the CUDA kernels' rows: 32-bit arithmetic).
template <typename I>
MOE_A2A_HD I low_precision_element_offset(LowPrecision mode, I i) {
  if (mode != LowPrecision::kE4m3BlockScaled) return i;
  return (i / I(kLowPrecisionGroup)) * I(kLowPrecisionGroupPitch) + i % I(kLowPrecisionGroup);
}
// Byte of the scale code of block c of a staged row of row_elems elements
// (block-scaled): after its group's elements rounded up to 16 bytes. `I` as above.
template <typename I>
MOE_A2A_HD I low_precision_scale_offset(I row_elems, I c) {
  const I g = c / I(kLowPrecisionGroupBlocks);
  const I rest = row_elems - g * I(kLowPrecisionGroup);
  const I elems = rest < I(kLowPrecisionGroup) ? rest : I(kLowPrecisionGroup);
  return g * I(kLowPrecisionGroupPitch) + ((elems + 15) & ~I(15)) + c % I(kLowPrecisionGroupBlocks);
}
// Bytes of a staged row; must fit in the payload row it replaces.
MOE_A2A_HD int64_t low_precision_row_bytes(LowPrecision mode, int64_t row_elems) {
  if (mode != LowPrecision::kE4m3BlockScaled || row_elems == 0) return row_elems;
  const int64_t blocks = (row_elems + kLowPrecisionBlock - 1) / kLowPrecisionBlock;
  return low_precision_scale_offset(row_elems, blocks - 1) + 1;
}

// Bytes per rank that hold any call with runtime_max_tokens <= max_num_tokens,
// any payload list whose rows add up to total_dispatch_bytes (the planes'
// alignment pads included) and a combine row of combine_bytes; a multiple of
// kPlaneAlign.
MOE_A2A_HD int64_t workspace_size_per_rank(int64_t ep_size, int64_t max_num_tokens, int64_t total_dispatch_bytes,
                                           int64_t combine_bytes, int64_t eplb_n) {
  // Every term a multiple of kPlaneAlign, so that each region's bytes count whole.
  int64_t size = align_up(kHeaderBytes + max_num_tokens * kMaxTopK * 4, kPlaneAlign);
  if (eplb_n > 0) size += align_up(ep_size * eplb_n * 4, kPlaneAlign);
  // Each plane's start and the combine region's round up by less than kPlaneAlign.
  size += align_up(ep_size * max_num_tokens * total_dispatch_bytes, kPlaneAlign) + (kMaxPayloads + 1) * kPlaneAlign;
  size += align_up(ep_size * max_num_tokens * combine_bytes, kPlaneAlign);
  return size;
}

// ---- expert-major receive layout -------------------------------------------
// An option of dispatch (docs/DESIGN.md, 'Expert-major layout'): after the
// rank-major dispatch n completed on rank r, expert_major_build n groups the
// received rows by local expert into the regions below, which follow the
// call's dispatch_end (so dispatch step 0b's overlap test covers them: they
// lie beyond dispatch_end n, where a dispatch n+1 writes only when its
// dispatch_end grew). The planes are [local_experts, M] for every rank, with
// local_experts the most experts any rank owns, so that the offsets are the
// same on every rank and a source rank pulls from rank r's regions with its
// own layout. Pair (token, top-k slot k) of received row [s, j] whose expert
// is local expert e is row i of expert e, where i counts the pairs of e
// before it in (s, j, k) order; pairs with i >= M are dropped and counted
// (kHdrDroppedPairCount).
//   counts    int32 [local_experts]: min(pairs of e, M)
//   pair_map  int32 [ep_size][T][top_k]: for received row [s, j], its pairs'
//             rows e * M + i in ascending (e, k) order, -1 for a dropped pair
//             and after the last pair (what the combine of source s pulls)
//   pair_src  int32 [local_experts][M]: s * T + j of row [e, i] (the CPU
//             build's scratch: which received row to copy; the CUDA build
//             copies each received row to its pairs' rows instead)
//   ids       int32 [local_experts][M]: e for i < counts[e], else -1
//   weights   fp32 [local_experts][M]: the pair's router weight (1 when the
//             dispatch sent none), 0 for i >= counts[e]
//   plane p   [local_experts][M][row_bytes_p]: the user payloads' rows
//   combine   [local_experts][M][combine_row_bytes]: the expert outputs,
//             staged by the expert-major combine (or written in place)
//
// The expert-major dispatch (op dispatch_expert_major) is that rank-major
// dispatch followed by expert_major_build, except for a CUDA call whose T
// the small rank-major call takes (T <= a warp's tokens per CTA of the
// largest grid: every rank runs the same protocol where the ranks' devices
// hold as many CTAs, as one GPU's simulated ranks and GPUs of one model do)
// and whose E <= 1024: there one grid writes each pair's row,
// pair map entry, id and weight straight into the destination's regions
// above, with the same rows i (csrc/cuda/dispatch.cu,
// em_dispatch_small_kernel). Dispatch n on rank s, small:
//   0. as dispatch step 0a; then
//   1. the CTA that counts every token writes, for every active rank r and
//      expert e, the pairs of e it sends into r's count scratch word
//      [s * E + e] (the large calls' kHdrDispatchCounts words), then, after
//      a barrier, releases word [R * E + s] := n << 32 in r's (a store: one
//      writer), with r's recv_count[s], runtime_max[s] and payloads[s] as
//      dispatch step 2. Nothing reads the count scratch but this dispatch,
//      so this precedes step 0b's wait; a large call's words there hold an
//      older epoch in their high half, so no stale word reads as n;
//   2. acquire-wait until pull_done >= flag_target(own combine_count) in
//      every active peer, always (not only where regions overlap): the
//      round's last combine pulls through the destinations' weights planes,
//      which this call rewrites, where the rank-major dispatch writes only
//      rows of planes that combine does not read. Then the own route
//      entries (d, t) (slot t: the pair map's row of a token is its index)
//      and, at each destination d, the pair map row [s, t] past the token's
//      pairs there (kNoPair);
//   3. acquire-wait until word [R * E + p] >> 32 == n for every active p;
//      row i of pair (t, k) of expert e at d = the counts of e of the
//      active sources below s + the own pairs of e before (t, k) in (t, k)
//      order (the CPU's i); write the pair map entry, id and weight of every
//      pair at d, then its rows (dropped pairs, i >= M, only kNoPair);
//   4. the own counts (min(pairs of e over every active source, M)), drops
//      and padding from the own count scratch;
//   5. as dispatch steps 3-5 (the flags are the rank-major dispatch's), and
//      the build's record (kHdrExpertMajor*).
// Why this is safe: a peer reads d's pair map row [s, t] only in its own
// combine, after this call's flags; the weights planes and the regions a
// grown layout covers are rewritten only after step 2's wait, as the
// rank-major dispatch's step 0b; counts, ids, weights and padding of d's own
// experts are written by d itself before its own flag, and by the sources
// into rows i < the counts (disjoint from the padding); the count scratch is
// written by dispatch n of the sources only after their combine n - 1,
// which followed every rank's dispatch n - 1 (so d had read it). Ranks whose
// T or E differ (which the contract rules out) may take the two paths: the
// one-kernel ranks then wait for counts that do not come and time out, and
// so do the others for their flags, where the dispatch + build path alone
// reports the mismatch without waiting; the count words carry no epoch, so a
// large call's CTAs never read one as theirs.
constexpr int64_t kMaxLocalExperts = 1024;
// Pair rows e * M + i and received rows s * T + j are int32 entries.
constexpr int64_t kMaxExpertMajorRows = (int64_t(1) << 31) - 1;
constexpr int32_t kNoPair = -1;

// The most experts one rank owns (contiguous ranges: the first E % R ranks own one more).
MOE_A2A_HD constexpr int64_t max_local_experts(int64_t num_experts, int64_t ep_size) {
  return (num_experts + ep_size - 1) / ep_size;
}

// [first, last) experts of `rank`.
MOE_A2A_HD int64_t first_expert_of(int64_t rank, int64_t num_experts, int64_t ep_size) {
  const int64_t base = num_experts / ep_size, extra = num_experts % ep_size;
  return rank * base + (rank < extra ? rank : extra);
}
MOE_A2A_HD int64_t local_experts_of(int64_t rank, int64_t num_experts, int64_t ep_size) {
  return num_experts / ep_size + (rank < num_experts % ep_size ? 1 : 0);
}

struct ExpertMajorLayout {
  int64_t local_experts;      // leading size of every plane: max_local_experts
  int64_t tokens_per_expert;  // M
  int64_t counts_offset;
  int64_t pair_map_offset;
  int64_t pair_src_offset;
  int64_t ids_offset;
  int64_t weights_offset;
  int num_payloads;
  int64_t payload_offset[kMaxPayloads];
  int64_t combine_offset;  // the expert-major combine_payload_offset
};

MOE_A2A_HD ExpertMajorLayout expert_major_layout(int64_t dispatch_end, int64_t ep_size, int64_t runtime_max_tokens,
                                                 int64_t top_k, int64_t local_experts, int64_t tokens_per_expert,
                                                 int num_payloads, const int64_t* payload_row_bytes) {
  ExpertMajorLayout l{};
  const int64_t rows = local_experts * tokens_per_expert;
  l.local_experts = local_experts;
  l.tokens_per_expert = tokens_per_expert;
  int64_t off = dispatch_end;
  l.counts_offset = off;
  off = align_up(off + local_experts * 4);
  l.pair_map_offset = off;
  off = align_up(off + ep_size * runtime_max_tokens * top_k * 4);
  l.pair_src_offset = off;
  off = align_up(off + rows * 4);
  l.ids_offset = off;
  off = align_up(off + rows * 4);
  l.weights_offset = off;
  off = align_up(off + rows * 4);
  l.num_payloads = num_payloads;
  for (int i = 0; i < num_payloads; ++i) {
    l.payload_offset[i] = align_up(off, kPlaneAlign);
    off = l.payload_offset[i] + rows * payload_row_bytes[i];
  }
  l.combine_offset = align_up(off, kPlaneAlign);
  return l;
}

// workspace_size_per_rank for expert-major calls: the rank-major call of the
// user payloads (total_dispatch_bytes) plus int64 expert ids and fp32 router
// weights (top_k each), no rank-major combine region, then the expert-major
// regions for tokens_per_expert rows per expert (the combine rows included);
// a rank-major call of the same payloads fits as well.
MOE_A2A_HD int64_t expert_major_workspace_size_per_rank(int64_t ep_size, int64_t max_num_tokens,
                                                        int64_t total_dispatch_bytes, int64_t combine_bytes,
                                                        int64_t eplb_n, int64_t num_experts, int64_t top_k,
                                                        int64_t tokens_per_expert) {
  const int64_t routed_bytes = total_dispatch_bytes + top_k * (8 + 4);
  // workspace_size_per_rank pads kMaxPayloads planes; the ids' and the weights' two more.
  int64_t size = workspace_size_per_rank(ep_size, max_num_tokens, routed_bytes, 0, eplb_n) +
                 (kMaxCallPayloads - kMaxPayloads) * kPlaneAlign;
  const int64_t rows = max_local_experts(num_experts, ep_size) * tokens_per_expert;
  size += align_up(max_local_experts(num_experts, ep_size) * 4, kPlaneAlign);
  size += align_up(ep_size * max_num_tokens * top_k * 4, kPlaneAlign);
  size += 3 * align_up(rows * 4, kPlaneAlign);
  size += align_up(rows * total_dispatch_bytes, kPlaneAlign) + (kMaxPayloads + 1) * kPlaneAlign;
  // The combine region of either layout: a rank-major call of the same payloads fits too.
  const int64_t combine_rows = rows > ep_size * max_num_tokens ? rows : ep_size * max_num_tokens;
  size += align_up(combine_rows * combine_bytes, kPlaneAlign);
  return size;
}

}  // namespace moe_a2a
