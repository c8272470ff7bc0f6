// CPU kernels of torch.ops.moe_a2a: the protocol of protocol.h on host memory.
// They take the params structs of params.h (already validated by ops.cpp) and
// never see an at::Tensor. The workspace may be a plain tensor shared by
// simulated ranks on threads of one process or a shared-memory mapping shared
// by several processes: flags are published with release stores and observed
// with acquire loads on the words themselves, so both work.
#pragma once

#include <stdint.h>

#include <string>

#include "../params.h"

namespace moe_a2a {
namespace cpu {

// What the host-side header checks found in the calling rank's own row. The
// checks only read the row; ops.cpp turns a failed check into the exception
// type named by `kind`.
struct RowStatus {
  enum Kind {
    kOk,
    kValueError,    // the arguments do not match the row (message set)
    kRuntimeError,  // protocol misuse or an uninitialized row (message set)
    kFailed,        // an earlier call recorded an error (record below set)
  };
  Kind kind = kOk;
  std::string message;
  WaitResult record{};  // kFailed: code, peers and detail from the header
};

// Before dispatch: the row is initialized, its config equals the arguments,
// no error is recorded and the previous combine has finished
// (dispatch_epoch == combine_epoch).
RowStatus check_row_for_dispatch(const WorkspaceView& ws, int64_t max_num_tokens, int64_t eplb_n);

// Before combine: as for dispatch, but a dispatch must be pending
// (dispatch_epoch == combine_epoch + 1) and the call must match it
// (protocol.h's combine_mismatch: local_num_tokens, runtime_max_tokens, top_k
// and combine_payload_offset those the dispatch recorded, its dispatch_end
// for the offset).
RowStatus check_row_for_combine(const CombineParams& p, int64_t max_num_tokens);

// Before sanitize_expert_ids: the row is initialized for this rank, ep_size
// and max_num_tokens, no error is recorded, and the view lies among the last
// dispatch's planes (protocol.h, sanitize_plane_fits).
RowStatus check_row_for_sanitize(const SanitizeParams& p, int64_t max_num_tokens);

// Zeroes the own row and writes its header config; epochs start at 0.
void initialize(const InitParams& p);

// One dispatch / combine of the protocol. A non-zero WaitResult::code means
// some active peer did not arrive within p.sync.timeout_s; the record is then
// also in the own header (the workspace stays failed until initialize).
WaitResult dispatch(const DispatchParams& p);
WaitResult combine(const CombineParams& p);

// Writes invalid_expert_id into the padding rows (j >= recv_count[s]) of the
// received [ep_size, T, top_k] int32 plane at p.offset of the own row.
void sanitize_expert_ids(const SanitizeParams& p);

// Before expert_major_build: as for sanitize, and a dispatch pending whose
// T, top_k and dispatch_end are the build's (RuntimeError / ValueError).
RowStatus check_row_for_expert_major_build(const ExpertMajorBuildParams& p, int64_t max_num_tokens);

// Before combine_expert_major: check_row_for_combine with the dispatch's
// dispatch_end for the offset, and the own row's last build matching the
// call (protocol.h's expert_major_mismatch).
RowStatus check_row_for_combine_expert_major(const ExpertMajorCombineParams& p, int64_t max_num_tokens);

// Regroups the own row's received rows by local expert (protocol.h,
// ExpertMajorLayout): counts, pair map, ids, weights, the payloads' rows;
// adds the dropped pairs to kHdrDroppedPairCount and records the build in
// kHdrExpertMajor*. Touches no other row.
void expert_major_build(const ExpertMajorBuildParams& p);

// combine's protocol with the expert-major pull: out[t] = sum, ascending
// destination rank and then pair-map order, of weight * row in fp32 (the
// product rounded to fp32, then added), cast once.
WaitResult combine_expert_major(const ExpertMajorCombineParams& p);

// Interruption of the waits (Ctrl-C). A wait that has slept for a while asks
// `pending` about every kInterruptCheckInterval whether its caller wants to
// stop; on true it records kErrorInterrupted (the peers it waited for) in the
// own header, as a failure, and returns it; ops.cpp then calls `raise` with
// the record's text, which throws the exception that stopped the wait (and
// returns where it has none: the op then raises the record as a
// RuntimeError). Both null by default (the C++ library); the Python extension
// installs its own (csrc/module.cpp: the main thread's pending signals, whose
// handler's KeyboardInterrupt then leaves the op).
struct InterruptHooks {
  bool (*pending)();
  void (*raise)(const std::string& record);
};
void set_interrupt_hooks(InterruptHooks hooks);
void raise_interrupted(const std::string& record);

// Records kErrorInterrupted, naming no peer, in the header of every row of
// `ws` that holds no error yet: every wait of a rank inside a call ends
// within about kPeerErrorCheckNs (a failed peer), and every later call is
// refused until the rows are initialized again (SimulatedEP.run, interrupted
// while its ranks run).
void record_interrupted_rows(const WorkspaceView& ws);

}  // namespace cpu
}  // namespace moe_a2a
