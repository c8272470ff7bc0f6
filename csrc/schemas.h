// The operator schemas of torch.ops.moe_a2a, in one place. ops.cpp registers
// them with TORCH_LIBRARY(moe_a2a, m); docs/internals.md explains each one.
//
// Why plain ints instead of the metainfo tensor: metainfo is a CPU tensor.
// A CPU tensor beside CUDA tensors in an op's arguments breaks FakeTensor
// device propagation for ops that return tensors and moves the op out of
// Inductor's CUDA-graph partitions, so the Python layer unpacks metainfo
// (kMeta* in protocol.h) into ints. Every op mutates the workspace
// (Tensor(a!)) and returns nothing or fresh tensors, never a view.
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>

namespace moe_a2a {

constexpr const char* kSchemaWorkspaceSize =
    "workspace_size_per_rank(int ep_size, int max_num_tokens, int total_dispatch_payload_size_per_token, "
    "int combine_payload_size_per_token, int eplb_stats_num_experts) -> int";

constexpr const char* kSchemaCallLayout =
    "call_layout(int ep_size, int runtime_max_tokens_per_rank, int eplb_n, int[] payload_row_bytes) -> int[]";

constexpr const char* kSchemaConstants = "constants() -> int[]";

// A host error mailbox for a rank of this workspace: the address of pinned
// host memory on CUDA, 0 on the CPU (whose ops raise at once). Separate from
// initialize because a mutating op cannot return an int under functionalization.
constexpr const char* kSchemaAllocMailbox = "alloc_mailbox(Tensor workspace) -> int";

// Zeroes the own row and the mailbox, writes the row's header config.
constexpr const char* kSchemaInitialize =
    "initialize(Tensor(a!) workspace, int ep_rank, int ep_size, int max_num_tokens, "
    "int eplb_stats_num_experts, int mailbox) -> ()";

// round_tag: 0 for a call that is no backward round; else the identity of
// the forward exchange whose backward this dispatch runs
// (torch_moe_a2a/autograd.py), -1 where it is not known: written beside the
// payload signature for the peers to compare (protocol.h, round_tags_differ),
// so that ranks whose backwards run the rounds of different exchanges at the
// same place fail instead of pairing them.
constexpr const char* kSchemaDispatch =
    "dispatch(Tensor token_selected_experts, Tensor[] input_payloads, Tensor(a!) workspace, "
    "int ep_rank, int ep_size, int max_num_tokens, int runtime_max_tokens_per_rank, int top_k, "
    "int num_experts, Tensor? eplb_local_stats, int eplb_stats_num_experts, int[] active_rank_mask, "
    "float timeout_s, int mailbox, bool enable_pdl, int round_tag=0) -> ()";

// low_precision: 0 off, 1 e4m3 rows (FlashInfer's use_low_precision), 2 e4m3
// rows with a power-of-two scale per 128 elements (protocol.h, LowPrecision).
// output_scales (written) with output_dtype float8_e4m3fn or uint8: a
// quantized output (quantize.h) whose scales go there in sf_layout
// (SfLayout); output_scalar_scale: NVFP4's global scale.
#define MOE_A2A_COMBINE_ARGS                                                                        \
  "Tensor? payload, SymInt local_num_tokens, Tensor(a!) workspace, int ep_rank, int ep_size, "      \
  "int max_num_tokens, int runtime_max_tokens_per_rank, int top_k, int combine_payload_offset, "    \
  "SymInt[] row_shape, ScalarType payload_dtype, ScalarType output_dtype, int[] active_rank_mask, " \
  "float timeout_s, int mailbox, bool enable_pdl, int low_precision, Tensor(c!)? output_scales, "   \
  "float output_scalar_scale, int sf_layout"

constexpr const char* kSchemaCombine = "combine(" MOE_A2A_COMBINE_ARGS ") -> Tensor";
constexpr const char* kSchemaCombineInto = "combine_into(" MOE_A2A_COMBINE_ARGS ", Tensor(b!) output) -> ()";

#undef MOE_A2A_COMBINE_ARGS

// MOE_A2A_DEBUG=1 (torch_moe_a2a/api.py): raises when an expert id is >=
// num_experts, reading the ids on the host (a sync on CUDA; skipped while the
// stream is being captured). No output and no mutation: registered as a side
// effect so that traced graphs keep it.
constexpr const char* kSchemaCheckExpertIds = "check_expert_ids(Tensor token_selected_experts, int num_experts) -> ()";

constexpr const char* kSchemaSanitize =
    "sanitize_expert_ids(Tensor(a!) workspace, int ep_rank, int ep_size, int max_num_tokens, "
    "int runtime_max_tokens_per_rank, "
    "int offset, int width, int invalid_expert_id, int id_bytes, int mailbox, bool enable_pdl) -> ()";

// Expert-major layout (protocol.h, ExpertMajorLayout). After a dispatch
// whose payloads were the user payloads (row sizes payload_row_bytes), the
// int32/int64 expert ids (id_bytes each, top_k wide) and, when has_weights,
// fp32 router weights (top_k wide), in that order: regroups the own row's
// received rows by local expert. Local: reads and writes the own row only.
constexpr const char* kSchemaExpertMajorBuild =
    "expert_major_build(Tensor(a!) workspace, int ep_rank, int ep_size, int max_num_tokens, "
    "int runtime_max_tokens_per_rank, int top_k, int num_experts, int max_tokens_per_expert, int eplb_n, "
    "int[] payload_row_bytes, int id_bytes, bool has_weights, int mailbox, bool enable_pdl) -> ()";

// An expert-major dispatch in one op: dispatch's arguments (input_payloads:
// the user payloads, the ids, then with has_weights the fp32 weights) and
// the build's (max_tokens_per_expert, the user payloads' row sizes), then
// dispatch's round_tag. The result equals dispatch followed by
// expert_major_build; a small CUDA call writes each pair's row into its
// expert-major row in one grid.
constexpr const char* kSchemaDispatchExpertMajor =
    "dispatch_expert_major(Tensor token_selected_experts, Tensor[] input_payloads, Tensor(a!) workspace, "
    "int ep_rank, int ep_size, int max_num_tokens, int runtime_max_tokens_per_rank, int top_k, "
    "int num_experts, Tensor? eplb_local_stats, int eplb_stats_num_experts, int[] active_rank_mask, "
    "float timeout_s, int mailbox, bool enable_pdl, int max_tokens_per_expert, int[] payload_row_bytes, "
    "bool has_weights, int round_tag=0) -> ()";

// The expert-major combine: payload [num_local_experts, max_tokens_per_expert,
// *row_shape] (or None: already at combine_payload_offset, the build's
// ExpertMajorLayout::combine_offset); out[t] = the fp32 sum over the token's
// pairs, ascending (destination rank, local expert, top-k slot), of
// weight * row, cast once. dispatch_end: the dispatch's CallLayout::dispatch_end.
// combine_expert_major_into: the same into `output` ([local_num_tokens,
// *row_shape] of output_dtype, outside the workspace), which CUDA-graph and
// simulated-rank callers allocate beforehand.
#define MOE_A2A_COMBINE_EM_ARGS                                                                               \
  "Tensor? payload, SymInt local_num_tokens, Tensor(a!) workspace, int ep_rank, "                             \
  "int ep_size, int max_num_tokens, int runtime_max_tokens_per_rank, int top_k, int num_experts, "            \
  "int max_tokens_per_expert, int dispatch_end, int combine_payload_offset, SymInt[] row_shape, "             \
  "ScalarType payload_dtype, ScalarType output_dtype, int[] active_rank_mask, float timeout_s, int mailbox, " \
  "bool enable_pdl"
constexpr const char* kSchemaCombineExpertMajor = "combine_expert_major(" MOE_A2A_COMBINE_EM_ARGS ") -> Tensor";
constexpr const char* kSchemaCombineExpertMajorInto =
    "combine_expert_major_into(" MOE_A2A_COMBINE_EM_ARGS ", Tensor(b!) output) -> ()";
#undef MOE_A2A_COMBINE_EM_ARGS

// The C++ side of tests/test_layout.py for the expert-major layout:
// [counts, pair_map, pair_src, ids, weights, payload_0.., combine] offsets.
constexpr const char* kSchemaExpertMajorLayout =
    "expert_major_layout(int dispatch_end, int ep_size, int runtime_max_tokens_per_rank, int top_k, "
    "int local_experts, int max_tokens_per_expert, int[] payload_row_bytes) -> int[]";

constexpr const char* kSchemaExpertMajorWorkspaceSize =
    "expert_major_workspace_size_per_rank(int ep_size, int max_num_tokens, "
    "int total_dispatch_payload_size_per_token, int combine_payload_size_per_token, "
    "int eplb_stats_num_experts, int num_experts, int top_k, int max_tokens_per_expert) -> int";

// The C++ signatures the dispatcher gives the kernels of the ops that
// callers in C++ redispatch or call typed (ops.cpp's ADInplaceOrView
// kernels, module.cpp's eager entry points), argument for argument as above.
using InitializeSignature = void(const at::Tensor&, int64_t, int64_t, int64_t, int64_t, int64_t);
using DispatchSignature = void(const at::Tensor&, at::TensorList, const at::Tensor&, int64_t, int64_t, int64_t, int64_t,
                               int64_t, int64_t, const std::optional<at::Tensor>&, int64_t, at::IntArrayRef, double,
                               int64_t, bool, int64_t);
#define MOE_A2A_COMBINE_TYPES                                                                                        \
  const std::optional<at::Tensor>&, c10::SymInt, const at::Tensor&, int64_t, int64_t, int64_t, int64_t, int64_t,     \
      int64_t, c10::SymIntArrayRef, at::ScalarType, at::ScalarType, at::IntArrayRef, double, int64_t, bool, int64_t, \
      const std::optional<at::Tensor>&, double, int64_t
using CombineSignature = at::Tensor(MOE_A2A_COMBINE_TYPES);
using CombineIntoSignature = void(MOE_A2A_COMBINE_TYPES, const at::Tensor&);
#undef MOE_A2A_COMBINE_TYPES
using DispatchExpertMajorSignature = void(const at::Tensor&, at::TensorList, const at::Tensor&, int64_t, int64_t,
                                          int64_t, int64_t, int64_t, int64_t, const std::optional<at::Tensor>&, int64_t,
                                          at::IntArrayRef, double, int64_t, bool, int64_t, at::IntArrayRef, bool,
                                          int64_t);
using ExpertMajorBuildSignature = void(const at::Tensor&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                       int64_t, at::IntArrayRef, int64_t, bool, int64_t, bool);
#define MOE_A2A_COMBINE_EM_TYPES                                                                                 \
  const std::optional<at::Tensor>&, c10::SymInt, const at::Tensor&, int64_t, int64_t, int64_t, int64_t, int64_t, \
      int64_t, int64_t, int64_t, int64_t, c10::SymIntArrayRef, at::ScalarType, at::ScalarType, at::IntArrayRef,  \
      double, int64_t, bool
using CombineExpertMajorSignature = at::Tensor(MOE_A2A_COMBINE_EM_TYPES);
using CombineExpertMajorIntoSignature = void(MOE_A2A_COMBINE_EM_TYPES, const at::Tensor&);
#undef MOE_A2A_COMBINE_EM_TYPES
using SanitizeSignature = void(const at::Tensor&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                               int64_t, int64_t, bool);

// ---- CUDA virtual memory: the multi-process workspace (csrc/cuda/vmm.cpp) ----
// Defined by vmm.cpp (TORCH_LIBRARY_FRAGMENT), so they exist only in builds
// with CUDA; torch_moe_a2a/workspace.py drives them (docs/internals.md).
// `device` is a CUDA device index; `handle_type` is "posix_fd" or "fabric";
// allocation handles travel as ints (the CUmemGenericAllocationHandle bits).
// None takes a tensor, so none is traced by torch.compile.

// Bytes a row's size must be a multiple of (CU_MEM_ALLOC_GRANULARITY_RECOMMENDED).
constexpr const char* kSchemaVmmGranularity = "vmm_granularity(int device, str handle_type) -> int";

// CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED (false where the headers predate it).
constexpr const char* kSchemaVmmFabricSupported = "vmm_fabric_supported(int device) -> bool";

// cuMemCreate of `size` bytes on `device`, exportable as `handle_type`. The
// caller owns the returned handle: vmm_map takes it over, else vmm_release.
constexpr const char* kSchemaVmmCreate = "vmm_create(int device, int size, str handle_type) -> int";

// cuMemExportToShareableHandle: [fd] (a new descriptor the caller closes) or
// the 64 bytes of a CUmemFabricHandle.
constexpr const char* kSchemaVmmExport = "vmm_export(int handle, str handle_type) -> int[]";

// cuMemImportFromShareableHandle of what vmm_export returned in some process;
// a descriptor stays the caller's to close. Returns a handle the caller owns.
constexpr const char* kSchemaVmmImport = "vmm_import(int device, int[] shareable, str handle_type) -> int";

// cuMemRelease of a handle that vmm_map did not take.
constexpr const char* kSchemaVmmRelease = "vmm_release(int handle) -> ()";

// Maps handles[r] at base + r * size_per_rank (one reserved range), gives
// `device` read/write access and returns the [len(handles), size_per_rank]
// uint8 tensor over it. Takes over every handle, also when it fails; the
// tensor's storage unmaps and releases them when its last reference goes.
constexpr const char* kSchemaVmmMap = "vmm_map(int device, int size_per_rank, int[] handles) -> Tensor";

// Number of mapped workspaces alive in this process (leak checks).
constexpr const char* kSchemaVmmLiveWorkspaces = "vmm_live_workspaces() -> int";

// Checkpointing (torch_moe_a2a/workspace.py: release_workspace_memory,
// restore_workspace_memory). `base` is the storage address of a tensor
// vmm_map returned. vmm_unmap synchronizes `device`, unmaps every row and
// releases its handle, keeping the reserved addresses; vmm_remap maps new
// row handles (taken over, also on failure) at the same addresses.
constexpr const char* kSchemaVmmUnmap = "vmm_unmap(int device, int base) -> ()";
constexpr const char* kSchemaVmmRemap = "vmm_remap(int device, int base, int[] handles) -> ()";
// Whether `base` is the storage address of a live vmm_map workspace.
constexpr const char* kSchemaVmmIsWorkspace = "vmm_is_workspace(int base) -> bool";

}  // namespace moe_a2a
