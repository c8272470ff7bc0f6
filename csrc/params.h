// Plain parameter structs handed from the validating entry points (ops.cpp)
// to the CPU and CUDA kernels. No torch types: raw pointers and sizes only, so
// the CUDA kernels compile with nvcc alone. Every pointer and size here has
// already been checked by ops.cpp.
#pragma once

#include <stdint.h>

#include "protocol.h"
#include "quantize.h"

namespace moe_a2a {

// Element type of combine payloads and outputs (the only dtypes combine sums).
enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// The shared workspace: row r starts at base + r * row_stride and holds
// size_per_rank bytes. The stride exceeds the size when rows are padded (a
// multi-process CUDA workspace maps whole allocations of the driver's
// granularity); the padding is never touched.
struct WorkspaceView {
  uint8_t* base;
  int64_t row_stride;     // bytes between rows, >= size_per_rank
  int64_t size_per_rank;  // usable bytes of a row: workspace.shape[1]
  int ep_rank;
  int ep_size;
  MOE_A2A_HD uint8_t* row(int r) const { return base + int64_t(r) * row_stride; }
};

// What every peer-synchronizing call shares.
struct SyncParams {
  uint64_t active_mask[kRankMaskWords];  // bit p: rank p participates (own bit set)
  double timeout_s;                      // > 0
  int64_t* mailbox;                      // metainfo data (pinned host memory) or nullptr: CUDA error record
  bool enable_pdl;
};

MOE_A2A_HD bool rank_active(const SyncParams& s, int r) { return (s.active_mask[r >> 6] >> (r & 63)) & 1u; }

// Whether a rank other than the own one takes part in the call.
MOE_A2A_HD bool any_active_peer(const SyncParams& s, const WorkspaceView& ws) {
  for (int r = 0; r < ws.ep_size; ++r) {
    if (r != ws.ep_rank && rank_active(s, r)) return true;
  }
  return false;
}

struct InitParams {
  WorkspaceView ws;
  int64_t max_num_tokens;
  int64_t eplb_n;
};

struct DispatchParams {
  WorkspaceView ws;
  SyncParams sync;
  int64_t local_num_tokens;    // may be 0
  int64_t runtime_max_tokens;  // T
  int64_t top_k;               // 1..kMaxTopK
  int64_t num_experts;         // >= ep_size
  // [local_num_tokens, top_k], contiguous: int32 ids, or int64 ids (torch.topk's) when ids_int64.
  const void* token_selected_experts;
  bool ids_int64;
  int num_payloads;  // 1..kMaxPayloads; kMaxCallPayloads with an expert-major call's ids and weights
  const uint8_t* payload[kMaxCallPayloads];  // [local_num_tokens, row_bytes], contiguous rows
  int64_t payload_row_bytes[kMaxCallPayloads];
  const int32_t* eplb_local_stats;  // [eplb_n] or nullptr
  int64_t eplb_n;                   // 0 when eplb_local_stats is nullptr
  CallLayout layout;                // offsets inside every row for this call
  uint32_t payload_signature;       // payload_signature(layout, payload_row_bytes), the mask mixed in
  uint32_t round_tag;               // round_tag_word of the op's round_tag: 0, or a backward round's exchange
};

// Expert id i (token i / top_k, column i % top_k) of a dispatch, whichever
// width the caller's ids have.
MOE_A2A_HD int64_t expert_id(const DispatchParams& p, int64_t i) {
  return p.ids_int64 ? static_cast<const int64_t*>(p.token_selected_experts)[i]
                     : static_cast<const int32_t*>(p.token_selected_experts)[i];
}

struct CombineParams {
  WorkspaceView ws;
  SyncParams sync;
  int64_t local_num_tokens;
  int64_t runtime_max_tokens;  // T, as in the matching dispatch
  int64_t top_k;               // as in the matching dispatch
  int64_t route_offset;        // CallLayout::route_offset
  int64_t combine_offset;      // combine_payload_offset
  int64_t row_elems;           // elements per combine row
  DType payload_dtype;
  // The output's dtype; with a quantized output, the dtype the fp32 sum is
  // rounded to before it is quantized (the payload's, bf16 with low_precision).
  DType output_dtype;
  const uint8_t* payload;  // [ep_size, T, row_elems] contiguous, or nullptr when in workspace
  // [local_num_tokens, row_elems] contiguous: of output_dtype; e4m3 bytes
  // (MXFP8); or row_elems / 2 bytes of e2m1 pairs (MXFP4, NVFP4). 16-byte
  // aligned when quantized.
  uint8_t* output;
  LowPrecision low_precision;  // rows staged as e4m3 (protocol.h) instead of the payload dtype
  QuantFormat quant;
  SfLayout sf_layout;      // of output_scales
  uint8_t* output_scales;  // quantized: [sf_extent(sf_layout, local_num_tokens, row_elems / block)]
  float global_scale;      // NVFP4's output_scalar_scale (> 0)
  uint32_t signature;      // combine_signature of the call's rows (protocol.h, the equal-rows check)
  // The payload tensor lies in the workspace, not at the own combine region
  // (a receive view passed back, or an expert's output written in place into
  // one), and an active peer exists: its next dispatch may write there as
  // soon as it saw this rank's combine flags, while this rank's pull still
  // reads, so the rank-major combine stages the own source's rows with the
  // others' (protocol.h, combine step 1). The expert-major combine needs not:
  // no peer writes the own expert-major planes before this rank's pull_done.
  bool payload_in_workspace_memory;
};

// Combine step 1 (protocol.h): whether it stages (a payload tensor; e4m3
// rows always, from the payload or in place), and whether the pull then reads
// the own source's rows from the payload (plain rows staged: step 1 leaves
// them out). The CUDA combine also leaves out the own source's e4m3 rows of a
// 16-bit payload where its pull vectors allow it (launch_combine) and
// converts them as it reads them: the same values, one read instead of the
// staging's read and write and the pull's read.
MOE_A2A_HD bool combine_stages(const CombineParams& p) {
  return p.low_precision != LowPrecision::kOff ||
         (p.payload != nullptr && p.payload != p.ws.row(p.ws.ep_rank) + p.combine_offset);
}
MOE_A2A_HD bool combine_own_rows_from_payload(const CombineParams& p) {
  return p.low_precision == LowPrecision::kOff && combine_stages(p) && !p.payload_in_workspace_memory;
}

struct SanitizeParams {
  WorkspaceView ws;
  int64_t runtime_max_tokens;  // T
  int64_t offset;              // byte offset of the [ep_size, T, width] int32 plane in the own row
  int64_t plane_end;           // byte offset of the plane's end
  int64_t width;               // ids per row (any expert-id payload, not only top_k wide)
  bool ids_int64;              // the plane holds int64 ids (else int32)
  int64_t invalid_expert_id;   // fits int32 for an int32 plane
  int64_t* mailbox;            // as SyncParams::mailbox: where the CUDA kernel reports a view that does not fit
  bool enable_pdl;
};

// expert_major_build: the own row's received rows of the pending dispatch
// regrouped by local expert (protocol.h, ExpertMajorLayout).
struct ExpertMajorBuildParams {
  WorkspaceView ws;
  int64_t* mailbox;            // as SyncParams::mailbox
  int64_t runtime_max_tokens;  // T of the dispatch
  int64_t top_k;
  int64_t first_expert;  // this rank's experts are [first_expert, first_expert + num_local)
  int64_t num_local;     // this rank's local experts (<= layout.local_experts)
  int64_t dispatch_end;  // the dispatch's CallLayout::dispatch_end
  int64_t ids_offset;    // the received [ep_size, T, top_k] expert-id plane (rank-major)
  bool ids_int64;
  int64_t weights_offset;                // the received [ep_size, T, top_k] fp32 router weights, or -1 (weights 1)
  int num_payloads;                      // user payloads: rank-major planes copied into expert-major planes
  int64_t payload_offset[kMaxPayloads];  // rank-major plane of each
  int64_t payload_row_bytes[kMaxPayloads];
  ExpertMajorLayout layout;
  bool enable_pdl;
};

// The expert-major combine: CombineParams (its payload [num_local, M,
// row_elems], its combine_offset the expert-major one) and the layout the
// pulls read in every rank's row.
struct ExpertMajorCombineParams {
  CombineParams c;
  int64_t num_local;     // this rank's local experts: the payload's leading size
  int64_t dispatch_end;  // checked against kHdrLastDispatchEnd like combine's offset
  ExpertMajorLayout layout;
};

// The expert-major combine's step 1 (protocol.h): the own pairs' rows the pull
// reads from a payload tensor itself (what staging would copy), so that a
// payload's valid rows are staged only where an active peer pulls them: at
// ep 1, or with every peer masked off, nothing is. With peers, the own
// pairs' rows are staged with the others: rows [e, i] of all sources are
// interleaved, and only the build knows which are the own source's.
MOE_A2A_HD bool em_combine_own_from_payload(const CombineParams& p) {
  return p.payload != nullptr && p.payload != p.ws.row(p.ws.ep_rank) + p.combine_offset;
}
MOE_A2A_HD bool em_combine_stages(const CombineParams& p) {
  return em_combine_own_from_payload(p) && any_active_peer(p.sync, p.ws);
}

// Outcome of a CPU call that waits for peers.
struct WaitResult {
  uint32_t code;  // ErrorCode
  uint64_t missing[kRankMaskWords];
  uint32_t detail;  // as kHdrErrorDetail
};

}  // namespace moe_a2a
