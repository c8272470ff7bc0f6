// Host-side glue shared by the CPU registration (ops.cpp) and the CUDA
// registration (cuda/register.cpp): one validating builder per operator, the
// timeout resolution and the error reporting.
//
// Every check_* builder checks EVERY argument of its operator before anything
// touches memory and returns the params struct of params.h that the kernels
// consume. Bad values, shapes, dtypes, devices and sizes raise c10::ValueError
// (Python ValueError); options we do not implement raise
// c10::NotImplementedError. The builders do not read the workspace's contents
// (on CUDA they cannot without a sync): the CPU kernels check the rank header
// separately (cpu/kernels.h), the CUDA kernels on the device.
//
// The builders take the values the Python layer unpacked from metainfo
// (schemas.h explains why ops take ints, not the metainfo tensor). SymInt
// schema arguments arrive here as concrete ints: real kernels only ever see
// concrete sizes.
#pragma once

#include <stdint.h>

#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include "params.h"
#include "protocol.h"

namespace moe_a2a {

// ---- dtypes -----------------------------------------------------------------
// Combine sums fp32, fp16 and bf16 rows only. `arg` names the argument in the
// error message (ValueError for any other dtype).
DType to_dtype(at::ScalarType t, const char* arg);
at::ScalarType to_scalar_type(DType d);

// ---- checks of a traced call ------------------------------------------------
// The Meta kernels (meta_kernels/meta.cpp: torch.compile, FakeTensorMode)
// run the same builders, so that a traced call refuses what the real one
// would, when it is traced instead of when its graph first runs. While a
// TracedChecks lives on this thread, the builders leave out what a meta
// tensor cannot tell: where a tensor lies (its data pointer is 0: inside the
// workspace or not, overlaps) and autograd's state (the tracer's, not the
// run's). The real kernels check those when the graph runs.
struct TracedChecks {
  TracedChecks();
  ~TracedChecks();
  TracedChecks(const TracedChecks&) = delete;
  TracedChecks& operator=(const TracedChecks&) = delete;

 private:
  bool outer_;
};

// ---- validating builders ----------------------------------------------------
// initialize: workspace [ep_size, size_per_rank] uint8 contiguous with
// size_per_rank a multiple of kAlign and >= kHeaderBytes; ranks and
// max_num_tokens within the limits; eplb_n >= 0.
InitParams check_initialize(const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                            int64_t eplb_n);

// dispatch: the arguments of kSchemaDispatch, in order. The returned
// params.layout is the call's CallLayout (eplb region only when
// eplb_local_stats is given) and is known to fit in size_per_rank.
// timeout_s is resolved (resolve_timeout); `mailbox` (0 or the address
// initialize returned) becomes params.sync.mailbox; a nonzero `round_tag`
// joins params.payload_signature. `max_payloads`: kMaxPayloads, or
// kMaxCallPayloads for an expert-major call (whose ids and weights are
// payloads too).
DispatchParams check_dispatch(const at::Tensor& token_selected_experts, at::TensorList input_payloads,
                              const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                              int64_t runtime_max_tokens_per_rank, int64_t top_k, int64_t num_experts,
                              const std::optional<at::Tensor>& eplb_local_stats, int64_t eplb_stats_num_experts,
                              at::IntArrayRef active_rank_mask, double timeout_s, int64_t mailbox, bool enable_pdl,
                              int64_t round_tag, int max_payloads = kMaxPayloads);

// combine / combine_into: the arguments of the combine schemas, in order;
// `output` is nullptr for combine (the caller allocates the output after the
// check and sets params.output) and the destination tensor for combine_into.
// `payload` absent means the payload already sits in the workspace at
// combine_payload_offset (params.payload == nullptr).
CombineParams check_combine(const std::optional<at::Tensor>& payload, int64_t local_num_tokens,
                            const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                            int64_t runtime_max_tokens_per_rank, int64_t top_k, int64_t combine_payload_offset,
                            at::IntArrayRef row_shape, at::ScalarType payload_dtype, at::ScalarType output_dtype,
                            at::IntArrayRef active_rank_mask, double timeout_s, int64_t mailbox, bool enable_pdl,
                            int64_t low_precision, const std::optional<at::Tensor>& output_scales,
                            double output_scalar_scale, int64_t sf_layout, const at::Tensor* output);

// The shape of a combine's output: [local_num_tokens, *row_shape], with the
// last size halved for a packed fp4 (torch.uint8) output.
std::vector<int64_t> combine_output_shape(int64_t local_num_tokens, at::IntArrayRef row_shape,
                                          at::ScalarType output_dtype);
// The shape of an expert-major combine's output: [local_num_tokens, *row_shape].
std::vector<int64_t> expert_major_output_shape(int64_t local_num_tokens, at::IntArrayRef row_shape);

// sanitize_expert_ids: the arguments of kSchemaSanitize, in order.
SanitizeParams check_sanitize(const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                              int64_t runtime_max_tokens_per_rank, int64_t offset, int64_t width,
                              int64_t invalid_expert_id, int64_t id_bytes, int64_t mailbox, bool enable_pdl);

// expert_major_build: the arguments of kSchemaExpertMajorBuild, in order.
// params.layout is the call's ExpertMajorLayout, known to fit the workspace
// up to its combine region.
ExpertMajorBuildParams check_expert_major_build(const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size,
                                                int64_t max_num_tokens, int64_t runtime_max_tokens_per_rank,
                                                int64_t top_k, int64_t num_experts, int64_t max_tokens_per_expert,
                                                int64_t eplb_n, at::IntArrayRef payload_row_bytes, int64_t id_bytes,
                                                bool has_weights, int64_t mailbox, bool enable_pdl);

// dispatch_expert_major: the arguments of kSchemaDispatchExpertMajor, in
// order, as the dispatch's params and the build's, checked against each
// other: input_payloads are the user payloads of payload_row_bytes, the
// expert ids (token_selected_experts itself) and with has_weights the fp32
// [local_num_tokens, top_k] weights. The dispatch's payload_signature covers
// max_tokens_per_expert too: ranks whose M differ lay out and write their
// expert-major rows at other offsets, which the combine's peer check
// reports like any other payload mismatch.
struct ExpertMajorDispatchParams {
  DispatchParams dispatch;
  ExpertMajorBuildParams build;
};
ExpertMajorDispatchParams check_dispatch_expert_major(
    const at::Tensor& token_selected_experts, at::TensorList input_payloads, const at::Tensor& workspace,
    int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens, int64_t runtime_max_tokens_per_rank, int64_t top_k,
    int64_t num_experts, const std::optional<at::Tensor>& eplb_local_stats, int64_t eplb_stats_num_experts,
    at::IntArrayRef active_rank_mask, double timeout_s, int64_t mailbox, bool enable_pdl, int64_t max_tokens_per_expert,
    at::IntArrayRef payload_row_bytes, bool has_weights, int64_t round_tag);

// combine_expert_major / combine_expert_major_into: the arguments of
// kSchemaCombineExpertMajor, in order, and the destination tensor of the
// _into op (nullptr for the other: params.c.output is then set by the caller
// after the check).
ExpertMajorCombineParams check_combine_expert_major(
    const std::optional<at::Tensor>& payload, int64_t local_num_tokens, const at::Tensor& workspace, int64_t ep_rank,
    int64_t ep_size, int64_t max_num_tokens, int64_t runtime_max_tokens_per_rank, int64_t top_k, int64_t num_experts,
    int64_t max_tokens_per_expert, int64_t dispatch_end, int64_t combine_payload_offset, at::IntArrayRef row_shape,
    at::ScalarType payload_dtype, at::ScalarType output_dtype, at::IntArrayRef active_rank_mask, double timeout_s,
    int64_t mailbox, bool enable_pdl, const at::Tensor* output);

// ---- timeouts ---------------------------------------------------------------
// timeout_s > 0 is used as given; <= 0 means "the default": the environment
// variable MOE_A2A_TIMEOUT_S (read on every call, so a test or a job can change
// it between calls), else kDefaultTimeoutS. Raises ValueError for a
// non-finite timeout or an unparsable / non-positive environment value.
double resolve_timeout(double timeout_s);

// Milliseconds recorded in an error record for a timeout (saturating uint32).
uint32_t timeout_ms(double timeout_s);

// ---- errors -----------------------------------------------------------------
// The message of an error record, e.g.
//   "rank 0: peers [1] did not arrive within 2.0 s (dispatch); ..."
// `missing` points to kRankMaskWords words (bit p: peer p did not arrive, or
// disagreed); `detail` as kHdrErrorDetail.
std::string describe_error(int64_t ep_rank, uint32_t code, const uint64_t* missing, uint32_t detail);

// Why sanitize_expert_ids refuses a view (protocol.h, sanitize_plane_fits),
// for both backends' errors; `last_runtime_max` 0: no dispatch since initialize.
std::string sanitize_mismatch_text(int32_t last_runtime_max);

// `mailbox` is 0 (CPU workspace: nothing to do) or the address initialize
// returned: pinned host int64 words laid out like metainfo's mailbox words
// (word i of the mailbox = metainfo word kMetaMailboxCode + i): the error
// code, kRankMaskWords words of peer mask, the detail (kHdrErrorDetail). A
// CUDA kernel that recorded an error wrote them, the code last; raises
// RuntimeError(describe_error(...)) when the code is set.
// The mailbox is not cleared: the workspace stays failed until initialize.
void raise_if_mailbox_error(int64_t mailbox, int64_t ep_rank);

// Raises RuntimeError(describe_error(...)) when `result`, the outcome of a
// CPU call on `ws`, carries an error. A timeout's message adds what the
// missing peers' rows tell: rows never initialized; or, where every one was
// initialized in this process and the caller is not a SimulatedEP.run rank
// thread, how ranks in one process must be driven (a thread each).
void raise_if_wait_failed(const WaitResult& result, const WorkspaceView& ws);

// ---- exchange counts --------------------------------------------------------
// How many dispatches and combines each rank has made on each workspace of
// this process, by (workspace data pointer, rank): the numbers that a
// differentiable exchange's backward rounds carry as their round tag
// (torch_moe_a2a/fastpath.py, round_tag_of_last_exchange). Every rank makes
// the same exchanges in the same order (they are collectives), so the n-th
// is the same exchange on every rank; counting them here, where every call
// passes, counts plain and differentiable, eager and compiled calls alike.
// Thread-safe (simulated ranks are threads of one process); host state only.
//
// The CPU and CUDA operators count a dispatch or combine (an expert-major
// one, the _into forms alike; the expert-major dispatch's build is part of
// its dispatch) once its checks passed and its work ran (CPU) or was
// launched (CUDA); CUDA graph replays count nothing. A call refused
// before it exchanged anything counts nothing, and so does a CPU call whose
// wait failed (the row stays failed until it is initialized again, where
// moe_a2a_initialize starts the count again: forget_exchange_count).
void count_exchange(const WorkspaceView& ws);
// The count of rank `ep_rank` on the workspace whose data starts at
// `workspace_data` (0 where it made none since it was forgotten).
int64_t exchange_count(const void* workspace_data, int64_t ep_rank);
// Starts that count again.
void forget_exchange_count(const void* workspace_data, int64_t ep_rank);

// Marks the calling thread as one of SimulatedEP.run's rank threads (which
// already give each rank a thread), for raise_if_wait_failed's message.
void mark_simulated_rank_thread();

// The kernel of check_expert_ids (schemas.h) on any device: the first id >=
// num_experts, read on the host, raises a ValueError that names its index.
void check_expert_ids_host(const at::Tensor& token_selected_experts, int64_t num_experts);

}  // namespace moe_a2a
