// The one place that names every operator of torch.ops.moe_a2a: registers the
// schemas of schemas.h, validates every argument (the check_* builders of
// ops.h, shared with the CUDA registration), computes the tensor-free layout
// ops from protocol.h and registers the CPU kernels.
#include "ops.h"

#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>
#include <type_traits>
#include <unordered_set>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include "cpu/kernels.h"
#include "schemas.h"

namespace moe_a2a {
namespace {

// Largest payload / combine row (and EPLB row) accepted, in bytes. Keeps every
// layout sum (kMaxRanks * kMaxNumTokens * row bytes over kMaxCallPayloads + 1
// regions, i.e. below 2^6 * 2^24 * 2^28 * 11 < 2^62) free of int64 overflow, so
// the size checks below cannot be fooled by a wrapped product.
constexpr int64_t kMaxRowBytes = int64_t(1) << 28;

// The workspace base must allow the 8-byte header atomics and the 16-byte
// vector copies of the CUDA kernels; torch's allocators (CPU: 64 bytes, CUDA:
// 512 bytes) and page-aligned shared-memory mappings all satisfy it.
constexpr int64_t kWorkspaceBaseAlign = 16;

// combine_payload_offset alignment: the widest vector access of a combine row.
constexpr int64_t kCombineOffsetAlign = 16;

// Whether the builders run for a Meta kernel (TracedChecks in ops.h).
thread_local bool t_traced_checks = false;

// A tensor's data pointer, for the params; nullptr for a Meta kernel's
// checks, whose tensors have none (a fake tensor under torch.compile raises
// when asked for it).
void* data_address(const at::Tensor& t) { return t_traced_checks ? nullptr : t.data_ptr(); }

// torch's Python spelling ("torch.float32"), the one users wrote.
std::string dtype_name(at::ScalarType t) { return "torch." + std::string(c10::getDtypeNames(t).first); }

// ---- argument checks shared by the builders ----------------------------------

void check_ranks(int64_t ep_rank, int64_t ep_size) {
  // The order named: (ep_rank, ep_size) swapped is the common mistake.
  TORCH_CHECK_VALUE(ep_size >= 1 && ep_size <= kMaxRanks, "ep_size must be in [1, ", kMaxRanks, "], got ", ep_size,
                    " (the calls take ep_rank, then ep_size)");
  TORCH_CHECK_VALUE(ep_rank >= 0 && ep_rank < ep_size, "ep_rank must be in [0, ep_size=", ep_size, "), got ", ep_rank,
                    " (the calls take ep_rank, then ep_size)");
}

void check_max_num_tokens(int64_t max_num_tokens) {
  TORCH_CHECK_VALUE(max_num_tokens >= 1 && max_num_tokens <= kMaxNumTokens, "max_num_tokens must be in [1, ",
                    kMaxNumTokens, "], got ", max_num_tokens);
}

// A combine's local_num_tokens against its runtime_max_tokens_per_rank (T).
void check_local_num_tokens(int64_t local_num_tokens, int64_t T) {
  TORCH_CHECK_VALUE(local_num_tokens >= 0, "local_num_tokens must be >= 0, got ", local_num_tokens);
  // Either may be the wrong one: both must be the dispatch's.
  TORCH_CHECK_VALUE(local_num_tokens <= T, "local_num_tokens=", local_num_tokens,
                    " exceeds runtime_max_tokens_per_rank=", T,
                    ": a combine takes its dispatch's local_num_tokens and runtime_max_tokens_per_rank, and one of "
                    "them is not the dispatch's");
}

void check_runtime_max(int64_t runtime_max, int64_t max_num_tokens) {
  TORCH_CHECK_VALUE(runtime_max >= 1 && runtime_max <= max_num_tokens,
                    "runtime_max_tokens_per_rank must be in [1, max_num_tokens=", max_num_tokens, "], got ",
                    runtime_max);
}

void check_top_k(int64_t top_k) {
  TORCH_CHECK_VALUE(top_k >= 1 && top_k <= kMaxTopK, "top_k must be in [1, ", kMaxTopK, "], got ", top_k);
}

// Every rank owns at least one expert. Fewer experts than top_k is allowed
// (DESIGN.md section 3's limits): a token may name an expert in several
// slots, which the routing and the expert-major pairs already handle.
void check_num_experts(int64_t num_experts, int64_t ep_size) {
  TORCH_CHECK_VALUE(num_experts >= ep_size, "num_experts must be >= ep_size=", ep_size, ", got ", num_experts);
}

void check_eplb_n(int64_t eplb_n) {
  TORCH_CHECK_VALUE(eplb_n >= 0 && eplb_n <= kMaxRowBytes / int64_t(sizeof(int32_t)),
                    "eplb_stats_num_experts must be in [0, ", kMaxRowBytes / int64_t(sizeof(int32_t)), "], got ",
                    eplb_n);
}

// The workspace: [ep_size, size_per_rank] uint8 whose rows are contiguous and
// do not overlap (row stride >= size_per_rank; padding between rows is
// allowed), row size and stride multiples of kAlign, rows large enough for
// the header.
WorkspaceView check_workspace(const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size) {
  check_ranks(ep_rank, ep_size);
  TORCH_CHECK_VALUE(workspace.defined(), "workspace must be a tensor, got an undefined tensor");
  TORCH_CHECK_VALUE(workspace.dim() == 2, "workspace must be 2-D [ep_size, size_per_rank], got shape ",
                    workspace.sizes());
  TORCH_CHECK_VALUE(workspace.scalar_type() == at::kByte, "workspace must be torch.uint8, got ",
                    dtype_name(workspace.scalar_type()));
  TORCH_CHECK_VALUE(workspace.size(0) == ep_size, "workspace.shape[0] must equal ep_size=", ep_size, ", got shape ",
                    workspace.sizes());
  const int64_t size_per_rank = workspace.size(1);
  TORCH_CHECK_VALUE(size_per_rank % kAlign == 0 && size_per_rank >= kHeaderBytes,
                    "workspace.shape[1] (bytes per rank) must be a multiple of ", kAlign, " and at least ",
                    kHeaderBytes, ", got ", size_per_rank);
  // One row: the stride between rows matters only when there are several.
  const int64_t row_stride = ep_size > 1 ? workspace.stride(0) : size_per_rank;
  TORCH_CHECK_VALUE(workspace.stride(1) == 1 && row_stride >= size_per_rank && row_stride % kAlign == 0,
                    "workspace rows must be contiguous bytes (stride 1) that do not overlap, at a row stride "
                    "that is a multiple of ",
                    kAlign, ", got strides ", workspace.strides(), " for shape ", workspace.sizes());
  const auto address = reinterpret_cast<uintptr_t>(data_address(workspace));
  TORCH_CHECK_VALUE(address % kWorkspaceBaseAlign == 0, "workspace data must be ", kWorkspaceBaseAlign,
                    "-byte aligned, got address ", address);
  WorkspaceView view;
  view.base = static_cast<uint8_t*>(data_address(workspace));
  view.row_stride = row_stride;
  view.size_per_rank = size_per_rank;
  view.ep_rank = static_cast<int>(ep_rank);
  view.ep_size = static_cast<int>(ep_size);
  return view;
}

// The workspace ops have no backward (the differentiable ops of
// torch_moe_a2a/autograd.py call them under no_grad): a tensor that requires
// grad would lose its gradient without a word (torch only warns once a
// backward reaches the op).
void check_no_grad(const at::Tensor& t, const std::string& arg) {
  if (t_traced_checks) return;
  TORCH_CHECK_VALUE(!(t.requires_grad() && at::GradMode::is_enabled()), arg,
                    " requires grad, but dispatch and combine have no backward: for training use "
                    "moe_a2a_dispatch_differentiable and moe_a2a_combine_differentiable (or their _expert_major_ "
                    "twins); else call under "
                    "torch.no_grad() (or torch.inference_mode()), or pass a tensor that does not require grad "
                    "(.detach())");
}

void check_on_workspace_device(const at::Tensor& t, const at::Tensor& workspace, const std::string& arg) {
  TORCH_CHECK_VALUE(t.device() == workspace.device(), arg, " must be on the workspace's device ", workspace.device(),
                    ", got ", t.device());
}

// Whether `nbytes` bytes at `address` meet the workspace's memory (any rank's row).
bool in_workspace_memory(const void* address, size_t nbytes, const WorkspaceView& ws) {
  const auto begin = reinterpret_cast<uintptr_t>(address);
  const auto end = begin + nbytes;
  const auto ws_begin = reinterpret_cast<uintptr_t>(ws.base);
  const auto ws_end = ws_begin + uintptr_t(ws.ep_size - 1) * uintptr_t(ws.row_stride) + uintptr_t(ws.size_per_rank);
  return nbytes > 0 && end > ws_begin && begin < ws_end;
}

// A dispatch's inputs and a combine's output must lie outside the workspace:
// peers write into this rank's row while the call reads the inputs or writes
// the output, so a view of the workspace (a receive view of an earlier
// dispatch, say) would be overwritten halfway. `t` is contiguous.
void check_outside_workspace(const at::Tensor& t, const WorkspaceView& ws, const std::string& arg) {
  if (t.numel() == 0 || t_traced_checks) return;
  TORCH_CHECK_VALUE(!in_workspace_memory(t.data_ptr(), t.nbytes(), ws), arg,
                    " lies in the workspace (a view of it, such as a receive view of an earlier dispatch), which "
                    "the peers write during the call: pass a copy (.clone())");
}

// A combine's payload (staged from it): `payload_dtype`, on the workspace's
// device, contiguous, no grad, of shape [rows, per_row, *row_shape];
// `dims` names the two leading dimensions for the message; `per_row_hint`
// (or nullptr) is added where the payload differs in per_row alone: such a
// payload is most often the dispatch's own plane, combined with a per_row
// that is not the dispatch's.
const uint8_t* checked_combine_payload(const at::Tensor& t, at::ScalarType payload_dtype, const at::Tensor& workspace,
                                       int64_t rows, int64_t per_row, at::IntArrayRef row_shape, const char* dims,
                                       const char* per_row_hint, const char* name) {
  TORCH_CHECK_VALUE(t.scalar_type() == payload_dtype, name, " must be ", dtype_name(payload_dtype), ", got ",
                    dtype_name(t.scalar_type()));
  check_on_workspace_device(t, workspace, name);
  std::vector<int64_t> expected{rows, per_row};
  expected.insert(expected.end(), row_shape.begin(), row_shape.end());
  // A 2-D tensor is most often the combine's output shape, [tokens, hidden]:
  // its row_shape (the trailing dimensions past two) reads as [].
  const bool output_shaped = t.dim() == 2 && t.sizes() != at::IntArrayRef(expected);
  const bool per_row_alone = per_row_hint != nullptr && !output_shaped && t.dim() == int64_t(expected.size()) &&
                             t.size(0) == rows && t.size(1) != per_row && t.sizes().slice(2) == row_shape;
  TORCH_CHECK_VALUE(t.sizes() == at::IntArrayRef(expected), name, " must be [", dims, ", *row_shape] with ", dims,
                    " = ", rows, ", ", per_row, " and row_shape = ", row_shape, ", got shape ", t.sizes(),
                    per_row_alone ? " (" : "", per_row_alone ? per_row_hint : "", per_row_alone ? ")" : "",
                    output_shaped ? " (the combine takes its rows in the dispatch's receive layout, [" : "",
                    output_shaped ? dims : "",
                    output_shaped ? ", *row] as the dispatch's output_payloads, not as [local_num_tokens, *row], "
                                    "the shape of its own output)"
                                  : "");
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous, got strides ", t.strides(), " (pass ", name,
                    ".contiguous())");
  check_no_grad(t, name);
  // A payload of 0-byte rows (a size of 0 in row_shape) has no data pointer,
  // and a null payload means one already in the workspace (combine_stages):
  // such a tensor gets an address no kernel reads from (every row copies and
  // sums 0 elements), so that it combines as the tensor it is.
  alignas(kPlaneAlign) static const uint8_t no_bytes[1] = {};
  return t.numel() == 0 ? no_bytes : static_cast<const uint8_t*>(data_address(t));
}

// A payload the combine stages into this rank's combine region
// [region_begin, region_end) of its row: the region itself (FlashInfer's
// in-workspace buffer passed as a tensor) stages each row onto itself, but a
// payload overlapping it elsewhere would have rows overwritten by the staging
// before they are read (a wrong sum, no error).
void check_payload_apart_from_region(const at::Tensor& payload, const uint8_t* address, const WorkspaceView& ws,
                                     int64_t region_begin, int64_t region_end, const char* name) {
  if (payload.numel() == 0 || t_traced_checks) return;
  const auto begin = reinterpret_cast<uintptr_t>(address);
  const auto end = begin + payload.nbytes();
  const auto row = reinterpret_cast<uintptr_t>(ws.row(ws.ep_rank));
  const uintptr_t first = row + uintptr_t(region_begin), last = row + uintptr_t(region_end);
  TORCH_CHECK_VALUE(begin == first || end <= first || begin >= last, name,
                    " overlaps this rank's combine region, into which the combine stages it, at another place than "
                    "its start (",
                    int64_t(begin) - int64_t(first),
                    " bytes from it): staging would overwrite rows before they are read. Pass the region itself "
                    "(get_combine_payload_tensor_in_workspace, with payload_in_workspace=True), or a tensor outside "
                    "it (.clone())");
}

// CombineParams::payload_in_workspace_memory of a combine whose other
// parameters are set: a payload tensor that is not the own combine region
// but lies in the workspace, where an active peer's next dispatch may write.
// Not a check: traced calls need it too.
bool payload_in_workspace_memory(const CombineParams& p, const std::optional<at::Tensor>& payload) {
  return p.payload != nullptr && p.payload != p.ws.row(p.ws.ep_rank) + p.combine_offset &&
         in_workspace_memory(p.payload, payload->nbytes(), p.ws) && any_active_peer(p.sync, p.ws);
}

// Bytes of one row of `t` (all dimensions but the first), or -1 when it
// exceeds kMaxRowBytes (the product is stopped before it can overflow). A
// trailing size of 0 makes a row of 0 bytes, whatever the other sizes.
int64_t row_bytes_of(at::IntArrayRef trailing, int64_t element_size) {
  for (const int64_t d : trailing) {
    if (d == 0) return 0;
  }
  int64_t bytes = element_size;
  for (const int64_t d : trailing) {
    if (bytes > kMaxRowBytes / d) return -1;
    bytes *= d;
  }
  return bytes;
}

void check_fits(int64_t needed, int64_t size_per_rank) {
  TORCH_CHECK_VALUE(needed <= size_per_rank, "workspace too small: this call needs ", needed,
                    " bytes per rank, the workspace has ", size_per_rank,
                    " (nothing was written); moe_a2a_get_workspace_size_per_rank (expert-major: "
                    "moe_a2a_get_workspace_size_per_rank_expert_major) of the bytes per token of every payload the "
                    "workspace is for gives the size it needs (MoeAlltoAll: workspace_size_per_rank=)");
}

// A combine's region [offset, end) against the workspace's bytes per rank:
// the combine region follows the round's planes, so a workspace sized with
// too few bytes per token fits the dispatch and fails here; the message says
// which sizes meet (`rows`: the region's row count, `planes`: what precedes
// it), which call sizes both (`sizing`) and how to get out.
void check_combine_fits(int64_t offset, int64_t end, int64_t size_per_rank, const char* rows, int64_t row_bytes,
                        const char* planes, const char* sizing) {
  TORCH_CHECK_VALUE(end <= size_per_rank, "workspace too small: this combine's rows (", rows, " x ", row_bytes,
                    " bytes) start at byte ", offset, ", after this round's ", planes, ", and end at byte ", end,
                    "; the workspace has ", size_per_rank, " bytes per rank. ", sizing,
                    " gives the size both need. This combine changed nothing: close the round with a combine whose "
                    "rows fit (a payload of 0 columns always fits and only closes the round), or start over with "
                    "moe_a2a_initialize on every rank (MoeAlltoAll.reset(), SimulatedEP.reset())");
}

// active_rank_mask (empty: every rank), timeout, mailbox.
SyncParams check_sync(at::IntArrayRef active_rank_mask, const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size,
                      double timeout_s, int64_t mailbox, bool enable_pdl) {
  SyncParams sync{};
  if (active_rank_mask.empty()) {
    for (int64_t r = 0; r < ep_size; ++r) sync.active_mask[r / 64] |= uint64_t(1) << (r % 64);
  } else {
    TORCH_CHECK_VALUE(active_rank_mask.size() == size_t(kRankMaskWords),
                      "active_rank_mask must be empty (all ranks active) or hold exactly ", kRankMaskWords,
                      " words, got ", active_rank_mask.size());
    for (int w = 0; w < kRankMaskWords; ++w) sync.active_mask[w] = uint64_t(active_rank_mask[w]);
    TORCH_CHECK_VALUE(rank_active(sync, static_cast<int>(ep_rank)),
                      "active_rank_mask must have the own rank's bit set (ep_rank=", ep_rank, "), got mask ",
                      active_rank_mask);
    for (int64_t r = ep_size; r < kMaxRanks; ++r) {
      TORCH_CHECK_VALUE(!rank_active(sync, static_cast<int>(r)), "active_rank_mask has bit ", r, " set but ep_size is ",
                        ep_size, ", got mask ", active_rank_mask);
    }
  }
  sync.timeout_s = resolve_timeout(timeout_s);
  TORCH_CHECK_VALUE(!workspace.is_cpu() || mailbox == 0,
                    "mailbox must be 0 for a CPU workspace (initialize returned 0), got ", mailbox);
  sync.mailbox = reinterpret_cast<int64_t*>(mailbox);
  sync.enable_pdl = enable_pdl;
  return sync;
}

// The end of the route region: the lowest offset a combine region may start at.
int64_t route_region_end(int64_t ep_size, int64_t runtime_max) {
  return call_layout(ep_size, runtime_max, /*eplb_n=*/0, /*num_payloads=*/0, nullptr).combine_offset;
}

bool is_quantized_output(at::ScalarType t) {
  return at::isFloat8Type(t) || t == at::ScalarType::Float4_e2m1fn_x2 || t == at::kByte;
}

// The quantized format that output_dtype and output_scales' dtype ask for
// (FlashInfer's pairs), kNone for an unquantized output.
QuantFormat check_quantized_output(at::ScalarType output_dtype, at::ScalarType scales_dtype, bool has_scales) {
  if (!is_quantized_output(output_dtype)) {
    TORCH_CHECK_VALUE(!has_scales, "output_scales is given, but output_dtype ", dtype_name(output_dtype),
                      " is not a quantized output (torch.float8_e4m3fn: MXFP8; torch.uint8: MXFP4 or NVFP4)");
    return QuantFormat::kNone;
  }
  TORCH_CHECK_VALUE(output_dtype == at::ScalarType::Float8_e4m3fn || output_dtype == at::kByte,
                    "a quantized output_dtype must be torch.float8_e4m3fn (MXFP8) or torch.uint8 (packed fp4: MXFP4, "
                    "NVFP4), got ",
                    dtype_name(output_dtype));
  TORCH_CHECK_VALUE(has_scales, "output_dtype ", dtype_name(output_dtype),
                    " is a quantized output and needs output_scales (torch.uint8 ue8m0 scales for MXFP8 and MXFP4, "
                    "torch.float8_e4m3fn for NVFP4)");
  if (output_dtype == at::ScalarType::Float8_e4m3fn) {
    TORCH_CHECK_VALUE(scales_dtype == at::kByte, "an MXFP8 output (torch.float8_e4m3fn) needs torch.uint8 (ue8m0) ",
                      "output_scales, got ", dtype_name(scales_dtype));
    return QuantFormat::kMxfp8;
  }
  TORCH_CHECK_VALUE(scales_dtype == at::kByte || scales_dtype == at::ScalarType::Float8_e4m3fn,
                    "a packed fp4 output (torch.uint8) needs torch.uint8 (ue8m0: MXFP4) or torch.float8_e4m3fn "
                    "(NVFP4) output_scales, got ",
                    dtype_name(scales_dtype));
  return scales_dtype == at::kByte ? QuantFormat::kMxfp4 : QuantFormat::kNvfp4;
}

const char* sf_layout_name(SfLayout l) {
  return l == SfLayout::k128x4 ? "layout_128x4" : l == SfLayout::k8x4 ? "layout_8x4" : "layout_linear";
}

std::string rank_list(const uint64_t* mask) {
  std::ostringstream os;
  os << "[";
  bool first = true;
  for (int r = 0; r < kMaxRanks; ++r) {
    if ((mask[r / 64] >> (r % 64)) & 1u) {
      os << (first ? "" : ", ") << r;
      first = false;
    }
  }
  os << "]";
  return os.str();
}

// "2.0", "0.25", "1.005": as many decimals as the milliseconds need, at least one.
std::string seconds_text(uint32_t ms) {
  char buf[32];
  const double s = ms / 1000.0;
  if (ms % 100 == 0) {
    std::snprintf(buf, sizeof(buf), "%.1f", s);
  } else if (ms % 10 == 0) {
    std::snprintf(buf, sizeof(buf), "%.2f", s);
  } else {
    std::snprintf(buf, sizeof(buf), "%.3f", s);
  }
  return buf;
}

}  // namespace

TracedChecks::TracedChecks() : outer_(t_traced_checks) { t_traced_checks = true; }
TracedChecks::~TracedChecks() { t_traced_checks = outer_; }

// ---- dtypes -------------------------------------------------------------------

DType to_dtype(at::ScalarType t, const char* arg) {
  switch (t) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      TORCH_CHECK_VALUE(false, arg, " must be torch.float32, torch.float16 or torch.bfloat16, got ", dtype_name(t));
  }
}

at::ScalarType to_scalar_type(DType d) {
  switch (d) {
    case DType::kFloat32:
      return at::kFloat;
    case DType::kFloat16:
      return at::kHalf;
    case DType::kBFloat16:
      return at::kBFloat16;
  }
  TORCH_CHECK(false, "unknown DType ", static_cast<int>(d));
}

std::vector<int64_t> combine_output_shape(int64_t local_num_tokens, at::IntArrayRef row_shape,
                                          at::ScalarType output_dtype) {
  std::vector<int64_t> shape{local_num_tokens};
  shape.insert(shape.end(), row_shape.begin(), row_shape.end());
  if (output_dtype == at::kByte && shape.size() == 2) shape[1] /= 2;  // two e2m1 elements per byte
  return shape;
}

std::vector<int64_t> expert_major_output_shape(int64_t local_num_tokens, at::IntArrayRef row_shape) {
  std::vector<int64_t> shape{local_num_tokens};
  shape.insert(shape.end(), row_shape.begin(), row_shape.end());
  return shape;
}

// ---- builders -------------------------------------------------------------------

InitParams check_initialize(const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                            int64_t eplb_n) {
  InitParams p{};
  p.ws = check_workspace(workspace, ep_rank, ep_size);
  check_max_num_tokens(max_num_tokens);
  check_eplb_n(eplb_n);
  // What this initialization declares (calls of up to max_num_tokens tokens,
  // EPLB stats of eplb_n experts) must fit before payloads are counted: the
  // header, a full route region and the EPLB region of such a call.
  const int64_t least = call_layout(ep_size, max_num_tokens, eplb_n, 0, nullptr).dispatch_end;
  TORCH_CHECK_VALUE(least <= p.ws.size_per_rank, "workspace too small for max_num_tokens=", max_num_tokens,
                    " and eplb_stats_num_experts=", eplb_n, ": even a call without payloads needs ", least,
                    " bytes per rank, the workspace has ", p.ws.size_per_rank,
                    " (moe_a2a_get_workspace_size_per_rank gives the size for your payloads)");
  p.max_num_tokens = max_num_tokens;
  p.eplb_n = eplb_n;
  return p;
}

DispatchParams check_dispatch(const at::Tensor& token_selected_experts, at::TensorList input_payloads,
                              const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                              int64_t runtime_max_tokens_per_rank, int64_t top_k, int64_t num_experts,
                              const std::optional<at::Tensor>& eplb_local_stats, int64_t eplb_stats_num_experts,
                              at::IntArrayRef active_rank_mask, double timeout_s, int64_t mailbox, bool enable_pdl,
                              int64_t round_tag, int max_payloads) {
  DispatchParams p{};
  p.ws = check_workspace(workspace, ep_rank, ep_size);
  check_max_num_tokens(max_num_tokens);
  check_runtime_max(runtime_max_tokens_per_rank, max_num_tokens);
  check_top_k(top_k);
  check_num_experts(num_experts, ep_size);

  const at::Tensor& ids = token_selected_experts;
  TORCH_CHECK_VALUE(ids.defined(), "token_selected_experts must be a tensor, got an undefined tensor");
  // int64 too: torch.topk's indices, read as they are (no conversion copy).
  TORCH_CHECK_VALUE(ids.scalar_type() == at::kInt || ids.scalar_type() == at::kLong,
                    "token_selected_experts must be torch.int32 or torch.int64, got ", dtype_name(ids.scalar_type()));
  TORCH_CHECK_VALUE(ids.dim() == 2 && ids.size(1) == top_k,
                    "token_selected_experts must be 2-D [local_num_tokens, top_k=", top_k, "], got shape ",
                    ids.sizes());
  check_on_workspace_device(ids, workspace, "token_selected_experts");
  TORCH_CHECK_VALUE(ids.is_contiguous(), "token_selected_experts must be contiguous, got strides ", ids.strides(),
                    " (pass token_selected_experts.contiguous())");
  check_outside_workspace(ids, p.ws, "token_selected_experts");
  const int64_t n = ids.size(0);
  TORCH_CHECK_VALUE(n <= runtime_max_tokens_per_rank,
                    "token_selected_experts.shape[0] (local_num_tokens) must be <= "
                    "runtime_max_tokens_per_rank=",
                    runtime_max_tokens_per_rank, ", got ", n);

  const int64_t num_payloads = static_cast<int64_t>(input_payloads.size());
  TORCH_CHECK_VALUE(num_payloads >= 1 && num_payloads <= max_payloads, "input_payloads must hold 1 to ", max_payloads,
                    " tensors, got ", num_payloads);
  for (int64_t i = 0; i < num_payloads; ++i) {
    const at::Tensor& t = input_payloads[i];
    const std::string arg = "input_payloads[" + std::to_string(i) + "]";
    TORCH_CHECK_VALUE(t.defined(), arg, " must be a tensor, got an undefined tensor");
    check_on_workspace_device(t, workspace, arg);
    TORCH_CHECK_VALUE(t.dim() >= 1 && t.size(0) == n, arg, " must be [local_num_tokens=", n, ", *], got shape ",
                      t.sizes());
    TORCH_CHECK_VALUE(t.is_contiguous(), arg, " must be contiguous, got strides ", t.strides(), " for shape ",
                      t.sizes(), " (pass ", arg, ".contiguous())");
    check_outside_workspace(t, p.ws, arg);
    const int64_t row_bytes = row_bytes_of(t.sizes().slice(1), t.element_size());
    // A payload of 0 bytes per token ("any trailing shape", DESIGN section 3)
    // gets a plane of 0 bytes and no copy.
    TORCH_CHECK_VALUE(row_bytes >= 0 && row_bytes <= kMaxRowBytes, arg, " must have at most ", kMaxRowBytes,
                      " bytes per token, got shape ", t.sizes(), " of ", dtype_name(t.scalar_type()));
    check_no_grad(t, arg);
    p.payload[i] = static_cast<const uint8_t*>(data_address(t));
    p.payload_row_bytes[i] = row_bytes;
  }

  check_eplb_n(eplb_stats_num_experts);
  const bool gathers_eplb = eplb_local_stats.has_value() && eplb_local_stats->defined();
  if (gathers_eplb) {
    const at::Tensor& s = *eplb_local_stats;
    TORCH_CHECK_VALUE(eplb_stats_num_experts > 0,
                      "eplb_local_stats was given but the workspace was initialized with "
                      "eplb_stats_num_experts=0");
    TORCH_CHECK_VALUE(s.scalar_type() == at::kInt, "eplb_local_stats must be torch.int32, got ",
                      dtype_name(s.scalar_type()));
    TORCH_CHECK_VALUE(s.dim() == 1 && s.size(0) == eplb_stats_num_experts,
                      "eplb_local_stats must be 1-D [eplb_stats_num_experts=", eplb_stats_num_experts, "], got shape ",
                      s.sizes());
    check_on_workspace_device(s, workspace, "eplb_local_stats");
    TORCH_CHECK_VALUE(s.is_contiguous(), "eplb_local_stats must be contiguous, got strides ", s.strides());
    // As the payloads: the peers write the gathered stats (an earlier call's
    // view of them, say) while this call reads the local ones.
    check_outside_workspace(s, p.ws, "eplb_local_stats");
    p.eplb_local_stats = static_cast<const int32_t*>(data_address(s));
    p.eplb_n = eplb_stats_num_experts;
  }

  p.sync = check_sync(active_rank_mask, workspace, ep_rank, ep_size, timeout_s, mailbox, enable_pdl);

  p.layout =
      call_layout(ep_size, runtime_max_tokens_per_rank, p.eplb_n, static_cast<int>(num_payloads), p.payload_row_bytes);
  check_fits(p.layout.dispatch_end, p.ws.size_per_rank);
  // The active mask joins the equal-payloads check: every active rank passes
  // the same one for a call, and a rank with another mask writes into or
  // waits for other ranks, which then time out naming peers that did arrive.
  p.payload_signature = payload_signature(p.layout, p.payload_row_bytes, num_experts);
  for (int w = 0; w < kRankMaskWords; ++w) {
    p.payload_signature = fnv1a_mix(p.payload_signature, static_cast<int64_t>(p.sync.active_mask[w]));
  }
  // A backward round's tag travels beside it (protocol.h, round_tags): the
  // peers pair the rounds of two backwards by their rows' sizes, which the
  // rounds of other exchanges can share.
  TORCH_CHECK_VALUE(round_tag >= -1,
                    "round_tag must be 0 (no backward round), -1 (a backward round of an unknown "
                    "exchange) or an exchange's number >= 1, got ",
                    round_tag);
  p.round_tag = round_tag_word(round_tag);

  p.local_num_tokens = n;
  p.runtime_max_tokens = runtime_max_tokens_per_rank;
  p.top_k = top_k;
  p.num_experts = num_experts;
  p.token_selected_experts = data_address(ids);
  p.ids_int64 = ids.scalar_type() == at::kLong;
  p.num_payloads = static_cast<int>(num_payloads);
  return p;
}

// The `output` of combine_into and combine_expert_major_into: a contiguous
// tensor of the expected shape and dtype, on the workspace's device, outside
// the workspace (the peers write into it during the call), not requiring
// grad.
void check_combine_output(const at::Tensor& o, const at::Tensor& workspace, const WorkspaceView& ws,
                          const std::vector<int64_t>& expected, at::ScalarType output_dtype) {
  TORCH_CHECK_VALUE(o.defined(), "output must be a tensor, got an undefined tensor");
  TORCH_CHECK_VALUE(o.scalar_type() == output_dtype, "output must be ", dtype_name(output_dtype),
                    ", the dtype of the call's result (output_dtype where the call takes it), got ",
                    dtype_name(o.scalar_type()));
  check_on_workspace_device(o, workspace, "output");
  TORCH_CHECK_VALUE(o.sizes() == at::IntArrayRef(expected),
                    "output must be [local_num_tokens, *row_shape] = ", at::IntArrayRef(expected), ", got shape ",
                    o.sizes());
  TORCH_CHECK_VALUE(o.is_contiguous(), "output must be contiguous, got strides ", o.strides());
  check_outside_workspace(o, ws, "output");
  // combine writes into `output` and has no backward: autograd would keep
  // the tensor's old history (or, for a leaf, miss the write) and give
  // wrong gradients without a word.
  TORCH_CHECK_VALUE(t_traced_checks || !(o.requires_grad() && at::GradMode::is_enabled()),
                    "output must not require grad: combine writes into it and has no backward (pass one "
                    "that does not require grad, or call under torch.no_grad())");
}

// The bytes [first, last] that a tensor's elements span (numel > 0).
static std::pair<uintptr_t, uintptr_t> byte_span(const at::Tensor& t) {
  int64_t low = 0, high = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t reach = (t.size(d) - 1) * t.stride(d);
    (reach < 0 ? low : high) += reach;
  }
  const auto base = reinterpret_cast<uintptr_t>(t.data_ptr());
  const int64_t item = t.element_size();
  return {base + low * item, base + high * item + item - 1};
}

// A tensor the combine writes must share no memory with what it reads or
// writes besides: the pull reads payload rows (the own ones from the payload
// itself) after it stored the first outputs, and would sum what it wrote.
void check_apart(const at::Tensor& written, const std::optional<at::Tensor>& other, const char* written_name,
                 const char* other_name) {
  if (!other.has_value() || !other->defined() || t_traced_checks) return;
  at::MemOverlapStatus overlap = at::get_overlap_status(written, *other);
  // Two storage objects over the same memory (a tensor made from another's
  // through DLPack or NumPy) are no alias to get_overlap_status: then the
  // byte spans decide (exactly for contiguous tensors, as the combine takes).
  if (overlap == at::MemOverlapStatus::No && written.numel() > 0 && other->numel() > 0 &&
      written.device() == other->device() && !written.storage().is_alias_of(other->storage())) {
    const auto [a_first, a_last] = byte_span(written);
    const auto [b_first, b_last] = byte_span(*other);
    if (a_first <= b_last && b_first <= a_last) overlap = at::MemOverlapStatus::Partial;
  }
  TORCH_CHECK_VALUE(overlap != at::MemOverlapStatus::Full && overlap != at::MemOverlapStatus::Partial, written_name,
                    " must not share memory with ", other_name, ": the combine writes ", written_name,
                    " before it has read all of ", other_name, " (pass a tensor of its own)");
}

CombineParams check_combine(const std::optional<at::Tensor>& payload, int64_t local_num_tokens,
                            const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                            int64_t runtime_max_tokens_per_rank, int64_t top_k, int64_t combine_payload_offset,
                            at::IntArrayRef row_shape, at::ScalarType payload_dtype, at::ScalarType output_dtype,
                            at::IntArrayRef active_rank_mask, double timeout_s, int64_t mailbox, bool enable_pdl,
                            int64_t low_precision, const std::optional<at::Tensor>& output_scales,
                            double output_scalar_scale, int64_t sf_layout, const at::Tensor* output) {
  CombineParams p{};
  p.ws = check_workspace(workspace, ep_rank, ep_size);
  check_max_num_tokens(max_num_tokens);
  const int64_t T = runtime_max_tokens_per_rank;
  check_runtime_max(T, max_num_tokens);
  check_top_k(top_k);
  check_local_num_tokens(local_num_tokens, T);

  // The payload first: output_dtype defaults to it, so an fp8 payload must
  // not read as a request for a quantized output.
  p.payload_dtype = to_dtype(payload_dtype, "payload dtype");
  TORCH_CHECK_VALUE(low_precision >= 0 && low_precision <= int64_t(LowPrecision::kE4m3BlockScaled),
                    "low_precision must be 0 (off), 1 (e4m3) or 2 (e4m3 with block scales), got ", low_precision);
  p.low_precision = static_cast<LowPrecision>(low_precision);
  const bool lp = p.low_precision != LowPrecision::kOff;
  const bool has_scales = output_scales.has_value() && output_scales->defined();
  TORCH_CHECK_VALUE(sf_layout >= int64_t(SfLayout::k128x4) && sf_layout <= int64_t(SfLayout::kLinear),
                    "sf_layout must be 0 (layout_128x4), 1 (layout_8x4) or 2 (layout_linear), got ", sf_layout);
  p.sf_layout = static_cast<SfLayout>(sf_layout);
  p.quant = check_quantized_output(output_dtype, has_scales ? output_scales->scalar_type() : at::kByte, has_scales);
  if (p.quant != QuantFormat::kNone) {
    // The sum is rounded to the payload dtype (bf16 for e4m3 rows) and then
    // quantized, as FlashInfer's quantized combine does.
    TORCH_CHECK_VALUE(lp || payload_dtype == at::kBFloat16 || payload_dtype == at::kHalf,
                      "a quantized output needs a torch.bfloat16 or torch.float16 payload (or use_low_precision), got ",
                      dtype_name(payload_dtype));
    p.output_dtype = lp ? DType::kBFloat16 : p.payload_dtype;
  } else if (lp) {
    TORCH_CHECK_VALUE(output_dtype == at::kBFloat16,
                      "use_low_precision combines into torch.bfloat16 (or a quantized output), got output_dtype ",
                      dtype_name(output_dtype));
    p.output_dtype = DType::kBFloat16;
  } else {
    // The rule first: to_dtype's message would list dtypes this payload's combine refuses.
    TORCH_CHECK_VALUE(output_dtype == payload_dtype || output_dtype == at::kBFloat16, "output_dtype must be ",
                      payload_dtype == at::kBFloat16 ? "" : "torch.bfloat16 or ", "the payload dtype (",
                      dtype_name(payload_dtype), "), got ", dtype_name(output_dtype));
    p.output_dtype = to_dtype(output_dtype, "output_dtype");
  }

  const int64_t element_size = static_cast<int64_t>(c10::elementSize(payload_dtype));
  for (const int64_t d : row_shape) {
    TORCH_CHECK_VALUE(d >= 0, "row_shape (the payload's trailing shape) must have sizes >= 0, got ", row_shape);
  }
  // A row of 0 bytes: the combine only synchronizes, its output has no elements.
  const int64_t row_bytes = row_bytes_of(row_shape, element_size);
  TORCH_CHECK_VALUE(row_bytes >= 0 && row_bytes <= kMaxRowBytes, "a combine row must have at most ", kMaxRowBytes,
                    " bytes, got row_shape ", row_shape, " of ", dtype_name(payload_dtype));
  p.row_elems = row_bytes / element_size;
  p.signature = combine_signature(int64_t(p.low_precision), int64_t(p.payload_dtype), p.row_elems, 0, 0);
  if (lp) {
    const int64_t staged = low_precision_row_bytes(p.low_precision, p.row_elems);
    TORCH_CHECK_VALUE(staged <= row_bytes, "use_low_precision with block scales stages ", staged,
                      " bytes per row (e4m3 elements and a scale byte per block), more than the payload row's ",
                      row_bytes, " bytes it replaces (row_shape ", row_shape, " of ", dtype_name(payload_dtype), ")");
  }
  int64_t scale_cols = 0;
  if (p.quant != QuantFormat::kNone) {
    const int64_t block = quant_block(p.quant);
    TORCH_CHECK_VALUE(row_shape.size() == 1 && row_shape[0] % block == 0,
                      "a quantized output needs 1-D rows of a multiple of ", block, " elements (its scale block), got ",
                      "row_shape ", row_shape);
    scale_cols = p.row_elems / block;
    if (p.quant == QuantFormat::kNvfp4) {
      TORCH_CHECK_VALUE(std::isfinite(output_scalar_scale) && output_scalar_scale > 0 &&
                            std::isfinite(static_cast<float>(output_scalar_scale)),
                        "output_scalar_scale (NVFP4's global scale) must be a positive finite float, got ",
                        output_scalar_scale);
    }
    p.global_scale = static_cast<float>(output_scalar_scale);
    const at::Tensor& sc = *output_scales;
    check_on_workspace_device(sc, workspace, "output_scales");
    TORCH_CHECK_VALUE(sc.is_contiguous(), "output_scales must be contiguous, got strides ", sc.strides());
    check_no_grad(sc, "output_scales");
    // As for `output`: the peers write the workspace during the call, and
    // scales written into it would overwrite rows or header words they use.
    check_outside_workspace(sc, p.ws, "output_scales");
    check_apart(sc, payload, "output_scales", "the payload");
    const int64_t extent = sf_extent(p.sf_layout, local_num_tokens, scale_cols);
    TORCH_CHECK_VALUE(sc.numel() == extent, "output_scales must hold ", extent, " scales (", local_num_tokens,
                      " rows x ", scale_cols, " blocks of ", block, " in ", sf_layout_name(p.sf_layout),
                      ", padding included), got ", sc.numel(), " (shape ", sc.sizes(), ")");
    p.output_scales = static_cast<uint8_t*>(data_address(sc));
  }

  if (payload.has_value() && payload->defined()) {
    p.payload = checked_combine_payload(*payload, payload_dtype, workspace, ep_size, T, row_shape,
                                        "ep_size, runtime_max_tokens_per_rank",
                                        "runtime_max_tokens_per_rank must be the dispatch's: its receive planes, "
                                        "and so the expert outputs, have that many rows a rank",
                                        "payload");
  }

  const int64_t route_end = route_region_end(ep_size, T);
  // Named as what it is, the offset the dispatch returned: a combine with no
  // dispatch before it (offset 0, say) gets here before its sequence check.
  TORCH_CHECK_VALUE(combine_payload_offset >= route_end && combine_payload_offset % kCombineOffsetAlign == 0,
                    "combine_payload_offset must be the offset that this rank's preceding moe_a2a_dispatch returned "
                    "(a multiple of ",
                    kCombineOffsetAlign, ", >= ", route_end, ", the end of the route region), got ",
                    combine_payload_offset,
                    "; pass the offset the dispatch returned (a combine needs a preceding dispatch: without one, "
                    "call moe_a2a_dispatch first)");
  TORCH_CHECK_VALUE(combine_payload_offset <= p.ws.size_per_rank,
                    "combine_payload_offset must be <= ", p.ws.size_per_rank, " (bytes per rank), got ",
                    combine_payload_offset);
  // The combine region follows this round's dispatch planes: a workspace
  // sized with too few dispatch bytes per token fits the dispatch and fails
  // here, so the message says which sizes meet and how to get out.
  check_combine_fits(combine_payload_offset, combine_end(combine_payload_offset, ep_size, T, row_bytes),
                     p.ws.size_per_rank, "ep_size x runtime_max_tokens_per_rank", row_bytes, "dispatch planes",
                     "moe_a2a_get_workspace_size_per_rank(ep_size, max_num_tokens, the dispatch's bytes per token "
                     "over all its payloads, the expert ids and router weights among them (top_k x 4 bytes each as "
                     "int32 and fp32), the combine's bytes per token)");
  if (p.payload != nullptr) {
    check_payload_apart_from_region(*payload, p.payload, p.ws, combine_payload_offset,
                                    combine_end(combine_payload_offset, ep_size, T, row_bytes), "payload");
  }

  p.sync = check_sync(active_rank_mask, workspace, ep_rank, ep_size, timeout_s, mailbox, enable_pdl);

  if (output != nullptr) {
    check_combine_output(*output, workspace, p.ws, combine_output_shape(local_num_tokens, row_shape, output_dtype),
                         output_dtype);
    check_apart(*output, payload, "output", "the payload");
    check_apart(*output, output_scales, "output", "output_scales");
    TORCH_CHECK_VALUE(p.quant == QuantFormat::kNone || reinterpret_cast<uintptr_t>(data_address(*output)) % 16 == 0,
                      "a quantized output must be 16-byte aligned");
    p.output = static_cast<uint8_t*>(data_address(*output));
  }
  // A quantized output's pull reads the own rows from a payload it stages
  // (not one in the combine region) with the widest vectors, which its
  // epilogue assumes: such a payload must be 16-byte aligned too.
  TORCH_CHECK_VALUE(p.quant == QuantFormat::kNone || lp || p.payload == nullptr ||
                        p.payload == p.ws.row(p.ws.ep_rank) + combine_payload_offset ||
                        reinterpret_cast<uintptr_t>(p.payload) % 16 == 0,
                    "a quantized output needs a 16-byte aligned payload, got one at an address ",
                    reinterpret_cast<uintptr_t>(p.payload) % 16, " bytes past a multiple of 16 (pass payload.clone())");

  p.local_num_tokens = local_num_tokens;
  p.runtime_max_tokens = T;
  p.top_k = top_k;
  p.route_offset = call_layout(ep_size, T, 0, 0, nullptr).route_offset;
  p.combine_offset = combine_payload_offset;
  p.payload_in_workspace_memory = payload_in_workspace_memory(p, payload);
  return p;
}

SanitizeParams check_sanitize(const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                              int64_t runtime_max_tokens_per_rank, int64_t offset, int64_t width,
                              int64_t invalid_expert_id, int64_t id_bytes, int64_t mailbox, bool enable_pdl) {
  SanitizeParams p{};
  p.ws = check_workspace(workspace, ep_rank, ep_size);
  check_max_num_tokens(max_num_tokens);
  const int64_t T = runtime_max_tokens_per_rank;
  check_runtime_max(T, max_num_tokens);
  TORCH_CHECK_VALUE(id_bytes == int64_t(sizeof(int32_t)) || id_bytes == int64_t(sizeof(int64_t)),
                    "id_bytes must be 4 (int32 ids) or 8 (int64 ids), got ", id_bytes);
  // Any int32 or int64 payload is an expert-id payload to sanitize, whatever its width.
  TORCH_CHECK_VALUE(width >= 1 && width <= kMaxRowBytes / id_bytes, "width (ids per row) must be in [1, ",
                    kMaxRowBytes / id_bytes, "], got ", width);
  TORCH_CHECK_VALUE(id_bytes == int64_t(sizeof(int64_t)) || (invalid_expert_id >= std::numeric_limits<int32_t>::min() &&
                                                             invalid_expert_id <= std::numeric_limits<int32_t>::max()),
                    "invalid_expert_id must fit in int32, got ", invalid_expert_id);
  TORCH_CHECK_VALUE(offset >= kHeaderBytes && offset % id_bytes == 0,
                    "offset (of the received expert-id plane) must be a multiple of ", id_bytes,
                    " and >= ", kHeaderBytes, ", got ", offset);
  TORCH_CHECK_VALUE(offset <= p.ws.size_per_rank, "offset must be <= ", p.ws.size_per_rank, " (bytes per rank), got ",
                    offset);
  const int64_t end = offset + ep_size * T * width * id_bytes;
  TORCH_CHECK_VALUE(end <= p.ws.size_per_rank, "the expert-id plane (ep_size x runtime_max_tokens_per_rank x ", width,
                    " ids from offset ", offset, ") ends at byte ", end, ", past the workspace's ", p.ws.size_per_rank,
                    " bytes per rank");
  p.runtime_max_tokens = T;
  p.offset = offset;
  p.plane_end = end;
  p.width = width;
  p.invalid_expert_id = invalid_expert_id;
  p.ids_int64 = id_bytes == int64_t(sizeof(int64_t));
  TORCH_CHECK_VALUE(!workspace.is_cpu() || mailbox == 0,
                    "mailbox must be 0 for a CPU workspace (initialize returned 0), got ", mailbox);
  p.mailbox = reinterpret_cast<int64_t*>(mailbox);
  p.enable_pdl = enable_pdl;
  return p;
}

namespace {

// The expert-major arguments both expert-major ops share: num_experts (its
// local experts within kMaxLocalExperts) and M = max_tokens_per_expert (the
// planes' rows within kMaxExpertMajorRows).
void check_expert_major_sizes(int64_t ep_size, int64_t num_experts, int64_t max_tokens_per_expert) {
  check_num_experts(num_experts, ep_size);
  const int64_t local = max_local_experts(num_experts, ep_size);
  TORCH_CHECK_VALUE(local <= kMaxLocalExperts, "the expert-major layout takes at most ", kMaxLocalExperts,
                    " experts per rank, got num_experts=", num_experts, " over ep_size=", ep_size, " (", local,
                    " per rank)");
  TORCH_CHECK_VALUE(max_tokens_per_expert >= 1 && max_tokens_per_expert <= kMaxExpertMajorRows / local,
                    "max_tokens_per_expert must be in [1, ", kMaxExpertMajorRows / local, "] for ", local,
                    " experts per rank, got ", max_tokens_per_expert);
}

}  // namespace

ExpertMajorBuildParams check_expert_major_build(const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size,
                                                int64_t max_num_tokens, int64_t runtime_max_tokens_per_rank,
                                                int64_t top_k, int64_t num_experts, int64_t max_tokens_per_expert,
                                                int64_t eplb_n, at::IntArrayRef payload_row_bytes, int64_t id_bytes,
                                                bool has_weights, int64_t mailbox, bool enable_pdl) {
  ExpertMajorBuildParams p{};
  p.ws = check_workspace(workspace, ep_rank, ep_size);
  check_max_num_tokens(max_num_tokens);
  const int64_t T = runtime_max_tokens_per_rank;
  check_runtime_max(T, max_num_tokens);
  check_top_k(top_k);
  check_expert_major_sizes(ep_size, num_experts, max_tokens_per_expert);
  // The build counts a local expert's pairs of the call in 32 bits (up to
  // every source's T tokens with all top_k slots on it).
  TORCH_CHECK_VALUE(ep_size * T * top_k <= kMaxExpertMajorRows,
                    "an expert-major dispatch counts a local expert's pairs of the call in 32 bits: ep_size * "
                    "runtime_max_tokens_per_rank * top_k = ",
                    ep_size * T * top_k, " exceeds ", kMaxExpertMajorRows,
                    "; dispatch fewer tokens a call, or rank-major");
  check_eplb_n(eplb_n);
  TORCH_CHECK_VALUE(id_bytes == int64_t(sizeof(int32_t)) || id_bytes == int64_t(sizeof(int64_t)),
                    "id_bytes must be 4 (int32 ids) or 8 (int64 ids), got ", id_bytes);
  const int64_t routed = 1 + (has_weights ? 1 : 0);  // the ids and the weights travel as payloads too
  const int64_t n = static_cast<int64_t>(payload_row_bytes.size());
  TORCH_CHECK_VALUE(n <= kMaxPayloads, "an expert-major dispatch takes at most ", kMaxPayloads, " payloads, got ", n);
  int64_t rows[kMaxCallPayloads] = {};
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(payload_row_bytes[i] >= 0 && payload_row_bytes[i] <= kMaxRowBytes,
                      "payload_row_bytes must be in [0, ", kMaxRowBytes, "], got ", payload_row_bytes);
    rows[i] = payload_row_bytes[i];
  }
  rows[n] = top_k * id_bytes;
  if (has_weights) rows[n + 1] = top_k * int64_t(sizeof(float));
  TORCH_CHECK_VALUE(!workspace.is_cpu() || mailbox == 0,
                    "mailbox must be 0 for a CPU workspace (initialize returned 0), got ", mailbox);
  p.mailbox = reinterpret_cast<int64_t*>(mailbox);

  const CallLayout call = call_layout(ep_size, T, eplb_n, static_cast<int>(n + routed), rows);
  check_fits(call.dispatch_end, p.ws.size_per_rank);
  p.layout = expert_major_layout(call.dispatch_end, ep_size, T, top_k, max_local_experts(num_experts, ep_size),
                                 max_tokens_per_expert, static_cast<int>(n), rows);
  check_fits(p.layout.combine_offset, p.ws.size_per_rank);
  p.runtime_max_tokens = T;
  p.top_k = top_k;
  p.first_expert = first_expert_of(ep_rank, num_experts, ep_size);
  p.num_local = local_experts_of(ep_rank, num_experts, ep_size);
  p.dispatch_end = call.dispatch_end;
  p.ids_offset = call.payload_offset[n];
  p.ids_int64 = id_bytes == int64_t(sizeof(int64_t));
  p.weights_offset = has_weights ? call.payload_offset[n + 1] : -1;
  p.num_payloads = static_cast<int>(n);
  for (int64_t i = 0; i < n; ++i) {
    p.payload_offset[i] = call.payload_offset[i];
    p.payload_row_bytes[i] = rows[i];
  }
  p.enable_pdl = enable_pdl;
  return p;
}

ExpertMajorDispatchParams check_dispatch_expert_major(
    const at::Tensor& token_selected_experts, at::TensorList input_payloads, const at::Tensor& workspace,
    int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens, int64_t runtime_max_tokens_per_rank, int64_t top_k,
    int64_t num_experts, const std::optional<at::Tensor>& eplb_local_stats, int64_t eplb_stats_num_experts,
    at::IntArrayRef active_rank_mask, double timeout_s, int64_t mailbox, bool enable_pdl, int64_t max_tokens_per_expert,
    at::IntArrayRef payload_row_bytes, bool has_weights, int64_t round_tag) {
  ExpertMajorDispatchParams p{};
  p.dispatch = check_dispatch(token_selected_experts, input_payloads, workspace, ep_rank, ep_size, max_num_tokens,
                              runtime_max_tokens_per_rank, top_k, num_experts, eplb_local_stats, eplb_stats_num_experts,
                              active_rank_mask, timeout_s, mailbox, enable_pdl, round_tag, kMaxCallPayloads);
  p.build = check_expert_major_build(workspace, ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank, top_k,
                                     num_experts, max_tokens_per_expert,
                                     eplb_local_stats.has_value() ? eplb_stats_num_experts : 0, payload_row_bytes,
                                     token_selected_experts.element_size(), has_weights, mailbox, enable_pdl);
  // The build's layout (and on CUDA the one-kernel call's copies) take the
  // rows as payload_row_bytes says; the one-kernel call reads the ids and
  // the weights from their tensors, the build from their received planes.
  const int64_t users = p.build.num_payloads;
  const int64_t expected = users + 1 + (has_weights ? 1 : 0);
  TORCH_CHECK_VALUE(p.dispatch.num_payloads == expected, "dispatch_expert_major: input_payloads must be the ", users,
                    " user payloads of payload_row_bytes, the expert ids",
                    has_weights ? " and the fp32 router weights" : "", " (", expected, " tensors), got ",
                    p.dispatch.num_payloads);
  for (int64_t i = 0; i < users; ++i) {
    TORCH_CHECK_VALUE(p.dispatch.payload_row_bytes[i] == payload_row_bytes[i], "dispatch_expert_major: input_payloads[",
                      i, "] has rows of ", p.dispatch.payload_row_bytes[i], " bytes, payload_row_bytes[", i, "] says ",
                      payload_row_bytes[i]);
  }
  // The ids' payload is token_selected_experts (the one-kernel call routes by
  // the latter, the build by the former's received plane; its values are
  // not compared here, which would read them on the host).
  const at::Tensor& ids = input_payloads[users];
  TORCH_CHECK_VALUE(
      ids.sizes() == token_selected_experts.sizes() && ids.scalar_type() == token_selected_experts.scalar_type(),
      "dispatch_expert_major: input_payloads[", users, "] must be token_selected_experts (the expert ids), got ",
      dtype_name(ids.scalar_type()), " ", ids.sizes());
  if (has_weights) {
    const at::Tensor& w = input_payloads[users + 1];
    TORCH_CHECK_VALUE(w.scalar_type() == at::kFloat && w.dim() == 2 && w.size(0) == token_selected_experts.size(0) &&
                          w.size(1) == top_k,
                      "dispatch_expert_major: input_payloads[", users + 1,
                      "] must be the fp32 [local_num_tokens, top_k] router weights, got ", dtype_name(w.scalar_type()),
                      " ", w.sizes());
  }
  p.dispatch.payload_signature = fnv1a_mix(p.dispatch.payload_signature, max_tokens_per_expert);
  return p;
}

ExpertMajorCombineParams check_combine_expert_major(
    const std::optional<at::Tensor>& payload, int64_t local_num_tokens, const at::Tensor& workspace, int64_t ep_rank,
    int64_t ep_size, int64_t max_num_tokens, int64_t runtime_max_tokens_per_rank, int64_t top_k, int64_t num_experts,
    int64_t max_tokens_per_expert, int64_t dispatch_end, int64_t combine_payload_offset, at::IntArrayRef row_shape,
    at::ScalarType payload_dtype, at::ScalarType output_dtype, at::IntArrayRef active_rank_mask, double timeout_s,
    int64_t mailbox, bool enable_pdl, const at::Tensor* output) {
  ExpertMajorCombineParams p{};
  CombineParams& c = p.c;
  c.ws = check_workspace(workspace, ep_rank, ep_size);
  check_max_num_tokens(max_num_tokens);
  const int64_t T = runtime_max_tokens_per_rank;
  check_runtime_max(T, max_num_tokens);
  check_top_k(top_k);
  check_expert_major_sizes(ep_size, num_experts, max_tokens_per_expert);
  check_local_num_tokens(local_num_tokens, T);
  c.payload_dtype = to_dtype(payload_dtype, "expert_outputs dtype");
  // fp32 too: the weighted sum is fp32 before its one cast. The rule before
  // to_dtype, whose message would list dtypes this payload's combine refuses.
  TORCH_CHECK_VALUE(output_dtype == payload_dtype || output_dtype == at::kBFloat16 || output_dtype == at::kFloat,
                    "output_dtype must be the expert_outputs dtype (", dtype_name(payload_dtype),
                    "), torch.bfloat16 or torch.float32, got ", dtype_name(output_dtype));
  c.output_dtype = to_dtype(output_dtype, "output_dtype");
  const int64_t element_size = static_cast<int64_t>(c10::elementSize(payload_dtype));
  for (const int64_t d : row_shape) {
    TORCH_CHECK_VALUE(d >= 0, "row_shape (the expert_outputs' trailing shape) must have sizes >= 0, got ", row_shape);
  }
  const int64_t row_bytes = row_bytes_of(row_shape, element_size);
  TORCH_CHECK_VALUE(row_bytes >= 0 && row_bytes <= kMaxRowBytes, "a combine row must have at most ", kMaxRowBytes,
                    " bytes, got row_shape ", row_shape, " of ", dtype_name(payload_dtype));
  c.row_elems = row_bytes / element_size;
  p.num_local = local_experts_of(ep_rank, num_experts, ep_size);

  if (payload.has_value() && payload->defined()) {
    c.payload =
        checked_combine_payload(*payload, payload_dtype, workspace, p.num_local, max_tokens_per_expert, row_shape,
                                "num_local_experts, max_tokens_per_expert",
                                "max_tokens_per_expert is the ExpertMajorDispatch's given: where these are the "
                                "outputs of the last dispatch's experts, pass that dispatch's ExpertMajorDispatch",
                                "expert_outputs");
  }

  // The regions the pulls read follow dispatch_end, and the combine region
  // follows the expert-major planes: its offset is the build's (checked
  // against the header by the kernels), at least past the weights.
  const int64_t route_end = route_region_end(ep_size, T);
  TORCH_CHECK_VALUE(dispatch_end >= route_end && dispatch_end % kPlaneAlign == 0 && dispatch_end <= c.ws.size_per_rank,
                    "dispatch_end must be a multiple of ", kPlaneAlign, " in [", route_end, ", ", c.ws.size_per_rank,
                    "], got ", dispatch_end);
  p.layout = expert_major_layout(dispatch_end, ep_size, T, top_k, max_local_experts(num_experts, ep_size),
                                 max_tokens_per_expert, 0, nullptr);
  TORCH_CHECK_VALUE(combine_payload_offset >= p.layout.combine_offset && combine_payload_offset % kPlaneAlign == 0 &&
                        combine_payload_offset <= c.ws.size_per_rank,
                    "combine_payload_offset must be a multiple of ", kPlaneAlign, " in [", p.layout.combine_offset,
                    ", ", c.ws.size_per_rank, "] (the expert-major dispatch's), got ", combine_payload_offset);
  p.layout.combine_offset = combine_payload_offset;
  c.signature = combine_signature(int64_t(LowPrecision::kOff), int64_t(c.payload_dtype), c.row_elems,
                                  p.layout.local_experts, max_tokens_per_expert);
  check_combine_fits(combine_payload_offset,
                     combine_payload_offset + p.layout.local_experts * max_tokens_per_expert * row_bytes,
                     c.ws.size_per_rank, "num_local_experts x max_tokens_per_expert", row_bytes, "expert-major planes",
                     "moe_a2a_get_workspace_size_per_rank_expert_major(ep_size, max_num_tokens, the dispatch's bytes "
                     "per token over all its payloads, ids and router weights included, the combine's bytes per token, "
                     "num_experts, top_k, max_tokens_per_expert)");
  if (c.payload != nullptr) {
    check_payload_apart_from_region(*payload, c.payload, c.ws, combine_payload_offset,
                                    combine_payload_offset + p.layout.local_experts * max_tokens_per_expert * row_bytes,
                                    "expert_outputs");
  }

  c.sync = check_sync(active_rank_mask, workspace, ep_rank, ep_size, timeout_s, mailbox, enable_pdl);
  c.local_num_tokens = local_num_tokens;
  c.runtime_max_tokens = T;
  c.top_k = top_k;
  c.route_offset = call_layout(ep_size, T, 0, 0, nullptr).route_offset;
  c.combine_offset = combine_payload_offset;
  p.dispatch_end = dispatch_end;
  if (output != nullptr) {
    check_combine_output(*output, workspace, c.ws, expert_major_output_shape(local_num_tokens, row_shape),
                         output_dtype);
    check_apart(*output, payload, "output", "expert_outputs");
    c.output = static_cast<uint8_t*>(data_address(*output));
  }
  return p;
}

// ---- timeouts and errors --------------------------------------------------------

double resolve_timeout(double timeout_s) {
  TORCH_CHECK_VALUE(std::isfinite(timeout_s), "timeout_s must be finite, got ", timeout_s);
  if (timeout_s > 0) return timeout_s;
  const char* env = std::getenv("MOE_A2A_TIMEOUT_S");
  if (env == nullptr || *env == '\0') return kDefaultTimeoutS;
  // A plain decimal number: strtod alone also takes leading blanks, hex
  // ("0x1") and "inf".
  const std::string text(env);
  const bool plain = text.find_first_not_of("0123456789.eE+-") == std::string::npos;
  char* end = nullptr;
  errno = 0;
  const double value = std::strtod(env, &end);
  TORCH_CHECK_VALUE(plain && end != env && *end == '\0' && errno == 0 && value > 0 && value <= double(kMaxTimeoutS),
                    "MOE_A2A_TIMEOUT_S must be a positive number of seconds up to ", kMaxTimeoutS, ", got '", env, "'");
  return value;
}

uint32_t timeout_ms(double timeout_s) {
  // At least 1 ms for a timeout of under half a millisecond, which a record
  // of 0 ms would report as "within 0.0 s".
  const double ms = timeout_s > 0 ? std::max(1.0, std::round(timeout_s * 1000.0)) : 0.0;
  constexpr double kMax = static_cast<double>(std::numeric_limits<uint32_t>::max());
  return ms >= kMax ? std::numeric_limits<uint32_t>::max() : static_cast<uint32_t>(ms);
}

std::string sanitize_mismatch_text(int32_t last_runtime_max) {
  std::string text =
      "expert_ids must be a receive view of this rank's last dispatch (its [ep_size, "
      "runtime_max_tokens_per_rank, width] int32 or int64 plane), but ";
  if (last_runtime_max == 0) return text + "no dispatch ran since moe_a2a_initialize";
  return text + "the view is not one of that dispatch's planes (that dispatch's runtime_max_tokens_per_rank is " +
         std::to_string(last_runtime_max) +
         "; a view kept from an earlier dispatch may cover the current one's other planes, which the padding "
         "ids would overwrite)";
}

std::string describe_error(int64_t ep_rank, uint32_t code, const uint64_t* missing, uint32_t detail) {
  std::ostringstream os;
  os << "rank " << ep_rank << ": ";
  switch (code) {
    case kErrorDispatchTimeout:
    case kErrorCombineTimeout:
      os << "peers " << rank_list(missing) << " did not arrive within " << seconds_text(detail) << " s ("
         << (code == kErrorDispatchTimeout ? "dispatch" : "combine")
         << "); the bound is MOE_A2A_TIMEOUT_S, or a timeout_s= of the call, of moe_a2a_initialize or of "
            "MoeAlltoAll";
      break;
    case kErrorRuntimeMaxMismatch:
      os << "peers " << rank_list(missing) << " called dispatch with another runtime_max_tokens_per_rank than "
         << "this rank's " << detail << " (it must be equal on all ranks for one call)";
      break;
    case kErrorSequence:
      os << "every dispatch must be followed by a combine before the next dispatch, and every combine must "
            "follow a dispatch, but dispatch was called twice without a combine in between, or combine without "
            "a preceding dispatch; "
         << kRecomputedDispatchHint;
      break;
    case kErrorPayloadMismatch:
      if ((detail & kPayloadMismatchBackwardRound) != 0) {
        os << "peers " << rank_list(missing) << " called another exchange than this rank's backward exchange: "
           << "this rank ran the backward of a differentiable dispatch or combine, whose exchanges carry the "
           << "identity of the forward exchange they belong to, and the peers ran the backward of another exchange "
           << "(every rank must run the same backward sequence, the backward of the same exchanges in the same "
           << "order: a loss that leaves an exchange's output unused on some ranks only, or backward calls on "
           << "several outputs in another order on some ranks, such as loss_a.backward() then loss_b.backward() "
           << "on one rank and the reverse on another, breaks it), a forward exchange (a rank that skipped a "
           << "backward), or this one with other payloads, another num_experts, another active_rank_mask or "
           << "expert ids of another width";
        break;
      }
      os << "peers " << rank_list(missing) << " called dispatch with other payloads than this rank's (their "
         << "number, row sizes or eplb_local_stats differ), another num_experts, another active_rank_mask or, "
         << "expert-major, another max_tokens_per_expert, or, where the ids travel as a payload (the expert-major "
         << "dispatch, a differentiable function's backward), expert ids of another width (they must be the same "
         << "on all ranks for one call; "
         << "with the differentiable functions, a rank that skipped a backward, whose exchanges are collectives, "
         << "meets its peers' backward exchange here, and so do ranks that ran the backward of other exchanges, "
         << "or in another order: a backward's exchange carries the identity of its forward exchange)";
      break;
    case kErrorPeerFailed:
      os << "peers " << rank_list(missing) << " failed earlier (their own calls recorded an error, so they will not "
         << "arrive; seen while this rank waited for them in its "
         << (detail == kErrorDispatchTimeout ? "dispatch" : "combine") << ")";
      break;
    case kErrorInterrupted:
      if (std::all_of(missing, missing + kRankMaskWords, [](uint64_t word) { return word == 0; })) {
        os << "interrupted inside a call (SimulatedEP.run, stopped by KeyboardInterrupt, ended its ranks' calls)";
      } else {
        os << "interrupted (KeyboardInterrupt or another signal's exception) while it waited for peers "
           << rank_list(missing) << " in its " << (detail == kErrorDispatchTimeout ? "dispatch" : "combine");
      }
      break;
    case kErrorSanitizeMismatch:
      os << "moe_a2a_sanitize_expert_ids wrote nothing: " << sanitize_mismatch_text(static_cast<int32_t>(detail));
      break;
    case kErrorCombineRowsMismatch:
      os << "peers " << rank_list(missing) << " called the same combine with other rows than this rank's (their "
         << "payload dtype, row size or use_low_precision differ, or, expert-major, their max_tokens_per_expert or "
         << "num_experts; the ranks pull each other's rows, so "
         << "these must be the same on all ranks for one combine; with the differentiable functions, a dispatch's "
         << "backward combines the gradients of its payloads that require grad, so the ranks' payloads must "
         << "require grad alike)";
      break;
    case kErrorCombineMismatch: {
      if ((detail & kMismatchRankMajorAfterExpertMajor) != 0) {
        os << "moe_a2a_combine: " << kRankMajorAfterExpertMajorReason;
        break;
      }
      if (detail == kMismatchRegionStaged) {
        os << "combine read its payload from the combine region (payload_in_workspace) after a combine of the "
              "same dispatch that staged its payload "
           << kRegionStagedReason;
        break;
      }
      // In the order of the CombineMismatch bits.
      const char* names[] = {"local_num_tokens",
                             "runtime_max_tokens_per_rank",
                             "top_k",
                             "combine_payload_offset",
                             "expert-major layout (max_tokens_per_expert or combine_payload_offset, or no "
                             "expert-major dispatch)",
                             "payload (the combine region holds the e4m3 rows of a low-precision combine)"};
      os << "combine was called with another";
      const char* sep = " ";
      for (int bit = 0; bit < int(sizeof(names) / sizeof(names[0])); ++bit) {
        if ((detail >> bit) & 1) {
          os << sep << names[bit];
          sep = ", ";
        }
      }
      os << " than its dispatch (it must use the dispatch's sizes and the combine_payload_offset it returned)";
      break;
    }
    default:
      os << "unknown error code " << code;
      break;
  }
  // How to recover, in each API's words (MoeAlltoAll.reset() and SimulatedEP.reset() keep the metainfo).
  os << "; the workspace stays failed until every rank calls moe_a2a_initialize again (MoeAlltoAll.reset(), "
        "SimulatedEP.reset() for simulated ranks)";
  return os.str();
}

void raise_if_mailbox_error(int64_t mailbox, int64_t ep_rank) {
  if (mailbox == 0) return;
  // Written by a CUDA kernel through the pinned mapping; the code is written last.
  const int64_t* words = reinterpret_cast<const int64_t*>(mailbox);
  const int64_t code = __atomic_load_n(&words[kMetaMailboxCode - kMetaMailboxCode], __ATOMIC_ACQUIRE);
  if (code == kErrorNone) return;
  uint64_t missing[kRankMaskWords];
  for (int w = 0; w < kRankMaskWords; ++w) {
    missing[w] =
        static_cast<uint64_t>(__atomic_load_n(&words[kMetaMailboxMissing - kMetaMailboxCode + w], __ATOMIC_RELAXED));
  }
  const int64_t detail = __atomic_load_n(&words[kMetaMailboxDetail - kMetaMailboxCode], __ATOMIC_RELAXED);
  TORCH_CHECK(false, describe_error(ep_rank, static_cast<uint32_t>(code), missing, static_cast<uint32_t>(detail)));
}

namespace {

// The CPU workspace rows initialized in this process (their addresses), for
// the message of a timeout only: a peer row among them belongs to a rank
// simulated here, one not among them to a rank of another process. Bounded:
// workspaces come and go, and a forgotten row only costs the message's hint.
std::mutex g_rows_initialized_here_mutex;
std::unordered_set<const uint8_t*> g_rows_initialized_here;
constexpr size_t kMaxRowsRemembered = 4096;

void note_row_initialized_here(const WorkspaceView& ws) {
  std::lock_guard<std::mutex> lock(g_rows_initialized_here_mutex);
  if (g_rows_initialized_here.size() >= kMaxRowsRemembered) g_rows_initialized_here.clear();
  g_rows_initialized_here.insert(ws.row(ws.ep_rank));
}

bool row_initialized_here(const uint8_t* row) {
  std::lock_guard<std::mutex> lock(g_rows_initialized_here_mutex);
  return g_rows_initialized_here.count(row) != 0;
}

thread_local bool t_simulated_rank_thread = false;

// What a CPU timeout's missing peers' rows say about its cause, as a suffix
// of the message ("" when they say nothing).
std::string timeout_hint(const uint64_t* missing, const WorkspaceView& ws) {
  const uint8_t* own = ws.row(ws.ep_rank);
  const uint16_t own_count =
      init_count(__atomic_load_n(reinterpret_cast<const uint64_t*>(own + kHdrMagic), __ATOMIC_RELAXED));
  uint64_t uninitialized[kRankMaskWords] = {}, other_init[kRankMaskWords] = {};
  bool any_uninitialized = false, any_other_init = false, all_here = true;
  for (int q = 0; q < ws.ep_size; ++q) {
    if (!((missing[q >> 6] >> (q & 63)) & 1u)) continue;
    const uint64_t word = __atomic_load_n(reinterpret_cast<const uint64_t*>(ws.row(q) + kHdrMagic), __ATOMIC_ACQUIRE);
    uint16_t stale = 0, seen = 0;
    std::memcpy(&stale, own + init_stale_offset(q), sizeof(stale));
    std::memcpy(&seen, own + init_seen_offset(q), sizeof(seen));
    if (!row_initialized(word)) {
      uninitialized[q >> 6] |= uint64_t(1) << (q & 63);
      any_uninitialized = true;
    } else if (stale == 0 ? init_count(word) != own_count
                          : init_count(word) == (stale & kInitCountMax) ||
                                (seen != stale && init_count(word) != (seen & kInitCountMax))) {
      // The peer's row holds another initialization than the one this
      // rank's calls go with: still the one this rank's initialize
      // superseded (the stale tag), or, with no stale tag, another count;
      // or one newer than its first dispatch since then saw (the seen tag).
      other_init[q >> 6] |= uint64_t(1) << (q & 63);
      any_other_init = true;
    }
    all_here = all_here && row_initialized_here(ws.row(q));
  }
  std::ostringstream os;
  if (any_uninitialized) {
    os << "; peers " << rank_list(uninitialized)
       << " have not initialized their rows (moe_a2a_initialize, which MoeAlltoAll and SimulatedEP call): a rank "
          "that never does, or that exited before it did, keeps its peers' first dispatch waiting";
  } else if (any_other_init) {
    os << "; peers " << rank_list(other_init)
       << " hold another initialization of their rows than this rank's: moe_a2a_initialize is collective (every "
          "rank calls it, each after its last combine), and a rank that initializes alone, or that does not when "
          "its peers do, leaves its peers' calls and its own waiting";
  } else if (all_here && !t_simulated_rank_thread) {
    // A CPU call blocks its thread until the peers arrive (CUDA waits on the
    // device): a first program that calls rank after rank from one thread
    // meets this timeout, with the peers it has not reached yet as the
    // missing. Peers of other processes, or SimulatedEP.run's rank threads,
    // are driven otherwise: for them the hint would mislead.
    os << "; a rank's call on the CPU returns only once its active peers have made the same call, so ranks "
          "simulated in one process need a thread each (SimulatedEP.run gives them one): a loop calling rank "
          "after rank from one thread waits here";
  }
  return os.str();
}

}  // namespace

void mark_simulated_rank_thread() { t_simulated_rank_thread = true; }

namespace {

// The exchange counts (ops.h), by (workspace data pointer, rank).
std::mutex g_exchange_counts_mutex;
std::map<std::pair<const void*, int64_t>, int64_t> g_exchange_counts;

}  // namespace

void count_exchange(const WorkspaceView& ws) {
  const std::lock_guard<std::mutex> lock(g_exchange_counts_mutex);
  ++g_exchange_counts[{ws.base, ws.ep_rank}];
}

int64_t exchange_count(const void* workspace_data, int64_t ep_rank) {
  const std::lock_guard<std::mutex> lock(g_exchange_counts_mutex);
  const auto it = g_exchange_counts.find({workspace_data, ep_rank});
  return it == g_exchange_counts.end() ? 0 : it->second;
}

void forget_exchange_count(const void* workspace_data, int64_t ep_rank) {
  const std::lock_guard<std::mutex> lock(g_exchange_counts_mutex);
  g_exchange_counts.erase({workspace_data, ep_rank});
}

void raise_if_wait_failed(const WaitResult& result, const WorkspaceView& ws) {
  if (result.code == kErrorNone) return;
  const std::string record = describe_error(ws.ep_rank, result.code, result.missing, result.detail);
  if (result.code == kErrorInterrupted) {
    cpu::raise_interrupted(record);  // the Python exception that interrupted the wait, where there is one
  }
  const bool timeout = result.code == kErrorDispatchTimeout || result.code == kErrorCombineTimeout;
  TORCH_CHECK(false, record, timeout ? timeout_hint(result.missing, ws) : std::string());
}

void check_expert_ids_host(const at::Tensor& token_selected_experts, int64_t num_experts) {
  const at::Tensor bad = at::nonzero(token_selected_experts.ge(num_experts)).cpu();
  if (bad.size(0) == 0) return;
  const at::Tensor first = bad[0];
  std::ostringstream where;
  for (int64_t d = 0; d < first.size(0); ++d) where << (d ? ", " : "") << first[d].item<int64_t>();
  at::Tensor value = token_selected_experts;
  for (int64_t d = 0; d < first.size(0); ++d) value = value.select(0, first[d].item<int64_t>());
  TORCH_CHECK_VALUE(false, "MOE_A2A_DEBUG: token_selected_experts[", where.str(), "] = ", value.item<int64_t>(),
                    " is >= num_experts (", num_experts, ")");
}

namespace {

// ---- CPU operators ----------------------------------------------------------------

void raise_row_status(const cpu::RowStatus& status, int64_t ep_rank) {
  switch (status.kind) {
    case cpu::RowStatus::kOk:
      return;
    case cpu::RowStatus::kValueError:
      TORCH_CHECK_VALUE(false, status.message);
    case cpu::RowStatus::kRuntimeError:
      TORCH_CHECK(false, status.message);
    case cpu::RowStatus::kFailed:
      // Refused at once, before any wait: say that the record is an earlier call's.
      TORCH_CHECK(false, "an earlier call on this workspace failed, and its record stands: ",
                  describe_error(ep_rank, status.record.code, status.record.missing, status.record.detail));
  }
}

int64_t alloc_mailbox_cpu(const at::Tensor&) {
  return 0;  // CPU workspaces raise at once and need no host mailbox
}

// The rows inside a CPU call of this process (their addresses).
std::mutex g_rows_in_call_mutex;
std::unordered_set<const uint8_t*> g_rows_in_call;

// Holds the own row of `ws` for the length of a CPU call: two threads
// driving one rank at once would pass its sequence checks together (each
// reads the epochs before the other advances them) and return the same rows,
// one caller's tokens lost without a word. Raises RuntimeError when another
// call holds the row.
class RowCall {
 public:
  // `remedy`: what the message advises (a call's, by default).
  explicit RowCall(const WorkspaceView& ws, const char* remedy =
                                                "a rank's calls run one at a time, in order (each dispatch, then its "
                                                "combines): drive each rank from one thread")
      : row_(ws.row(ws.ep_rank)) {
    std::lock_guard<std::mutex> lock(g_rows_in_call_mutex);
    TORCH_CHECK(g_rows_in_call.insert(row_).second, "rank ", ws.ep_rank,
                ": another thread is inside a call on this rank's row of the workspace; ", remedy);
  }
  ~RowCall() {
    std::lock_guard<std::mutex> lock(g_rows_in_call_mutex);
    g_rows_in_call.erase(row_);
  }
  RowCall(const RowCall&) = delete;
  RowCall& operator=(const RowCall&) = delete;

 private:
  const uint8_t* row_;
};

void initialize_cpu(const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                    int64_t eplb_stats_num_experts, int64_t mailbox) {
  const InitParams p = check_initialize(workspace, ep_rank, ep_size, max_num_tokens, eplb_stats_num_experts);
  TORCH_CHECK_VALUE(mailbox == 0, "mailbox must be 0 for a CPU workspace (alloc_mailbox returned 0), got ", mailbox);
  // Not while a call of this process runs on the row: zeroing it under a
  // waiting dispatch would leave that call and its peers waiting out the timeout.
  const RowCall call(p.ws,
                     "initialize the row once that call has returned (it returns within its timeout, raising where "
                     "its peers do not come)");
  cpu::initialize(p);
  note_row_initialized_here(p.ws);
}

// The CPU dispatch of checked params (dispatch and dispatch_expert_major).
void run_dispatch_cpu(const DispatchParams& p, int64_t max_num_tokens, int64_t eplb_stats_num_experts,
                      int64_t mailbox) {
  const RowCall call(p.ws);
  raise_if_mailbox_error(mailbox, p.ws.ep_rank);
  // The header's EPLB length is checked where the call gathers stats, the
  // one thing it sizes (p.eplb_n is 0 otherwise): a call without them, the
  // differentiable ones' among them, runs on a workspace initialized with
  // EPLB statistics as on one without, as on CUDA.
  raise_row_status(cpu::check_row_for_dispatch(p.ws, max_num_tokens, p.eplb_n > 0 ? eplb_stats_num_experts : -1),
                   p.ws.ep_rank);
  raise_if_wait_failed(cpu::dispatch(p), p.ws);
  count_exchange(p.ws);
}

void dispatch_cpu(const at::Tensor& token_selected_experts, at::TensorList input_payloads, const at::Tensor& workspace,
                  int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens, int64_t runtime_max_tokens_per_rank,
                  int64_t top_k, int64_t num_experts, const std::optional<at::Tensor>& eplb_local_stats,
                  int64_t eplb_stats_num_experts, at::IntArrayRef active_rank_mask, double timeout_s, int64_t mailbox,
                  bool enable_pdl, int64_t round_tag) {
  run_dispatch_cpu(check_dispatch(token_selected_experts, input_payloads, workspace, ep_rank, ep_size, max_num_tokens,
                                  runtime_max_tokens_per_rank, top_k, num_experts, eplb_local_stats,
                                  eplb_stats_num_experts, active_rank_mask, timeout_s, mailbox, enable_pdl, round_tag),
                   max_num_tokens, eplb_stats_num_experts, mailbox);
}

void run_combine_cpu(const CombineParams& p, int64_t max_num_tokens, int64_t mailbox) {
  const RowCall call(p.ws);
  raise_if_mailbox_error(mailbox, p.ws.ep_rank);
  raise_row_status(cpu::check_row_for_combine(p, max_num_tokens), p.ws.ep_rank);
  raise_if_wait_failed(cpu::combine(p), p.ws);
  count_exchange(p.ws);
}

at::Tensor combine_cpu(const std::optional<at::Tensor>& payload, int64_t local_num_tokens, const at::Tensor& workspace,
                       int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens, int64_t runtime_max_tokens_per_rank,
                       int64_t top_k, int64_t combine_payload_offset, at::IntArrayRef row_shape,
                       at::ScalarType payload_dtype, at::ScalarType output_dtype, at::IntArrayRef active_rank_mask,
                       double timeout_s, int64_t mailbox, bool enable_pdl, int64_t low_precision,
                       const std::optional<at::Tensor>& output_scales, double output_scalar_scale, int64_t sf_layout) {
  CombineParams p =
      check_combine(payload, local_num_tokens, workspace, ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank,
                    top_k, combine_payload_offset, row_shape, payload_dtype, output_dtype, active_rank_mask, timeout_s,
                    mailbox, enable_pdl, low_precision, output_scales, output_scalar_scale, sf_layout, nullptr);
  at::Tensor out = at::empty(combine_output_shape(local_num_tokens, row_shape, output_dtype),
                             workspace.options().dtype(output_dtype));
  p.output = static_cast<uint8_t*>(out.data_ptr());
  run_combine_cpu(p, max_num_tokens, mailbox);
  return out;
}

void combine_into_cpu(const std::optional<at::Tensor>& payload, int64_t local_num_tokens, const at::Tensor& workspace,
                      int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens, int64_t runtime_max_tokens_per_rank,
                      int64_t top_k, int64_t combine_payload_offset, at::IntArrayRef row_shape,
                      at::ScalarType payload_dtype, at::ScalarType output_dtype, at::IntArrayRef active_rank_mask,
                      double timeout_s, int64_t mailbox, bool enable_pdl, int64_t low_precision,
                      const std::optional<at::Tensor>& output_scales, double output_scalar_scale, int64_t sf_layout,
                      const at::Tensor& output) {
  const CombineParams p =
      check_combine(payload, local_num_tokens, workspace, ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank,
                    top_k, combine_payload_offset, row_shape, payload_dtype, output_dtype, active_rank_mask, timeout_s,
                    mailbox, enable_pdl, low_precision, output_scales, output_scalar_scale, sf_layout, &output);
  run_combine_cpu(p, max_num_tokens, mailbox);
}

void sanitize_expert_ids_cpu(const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                             int64_t runtime_max_tokens_per_rank, int64_t offset, int64_t width,
                             int64_t invalid_expert_id, int64_t id_bytes, int64_t mailbox, bool enable_pdl) {
  const SanitizeParams p = check_sanitize(workspace, ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank,
                                          offset, width, invalid_expert_id, id_bytes, mailbox, enable_pdl);
  raise_row_status(cpu::check_row_for_sanitize(p, max_num_tokens), ep_rank);
  cpu::sanitize_expert_ids(p);
}

// The CPU build of checked params (expert_major_build and dispatch_expert_major).
void run_expert_major_build_cpu(const ExpertMajorBuildParams& p, int64_t max_num_tokens) {
  const RowCall call(p.ws);
  raise_row_status(cpu::check_row_for_expert_major_build(p, max_num_tokens), p.ws.ep_rank);
  cpu::expert_major_build(p);
}

void expert_major_build_cpu(const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                            int64_t runtime_max_tokens_per_rank, int64_t top_k, int64_t num_experts,
                            int64_t max_tokens_per_expert, int64_t eplb_n, at::IntArrayRef payload_row_bytes,
                            int64_t id_bytes, bool has_weights, int64_t mailbox, bool enable_pdl) {
  run_expert_major_build_cpu(
      check_expert_major_build(workspace, ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank, top_k,
                               num_experts, max_tokens_per_expert, eplb_n, payload_row_bytes, id_bytes, has_weights,
                               mailbox, enable_pdl),
      max_num_tokens);
}

void dispatch_expert_major_cpu(const at::Tensor& token_selected_experts, at::TensorList input_payloads,
                               const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                               int64_t runtime_max_tokens_per_rank, int64_t top_k, int64_t num_experts,
                               const std::optional<at::Tensor>& eplb_local_stats, int64_t eplb_stats_num_experts,
                               at::IntArrayRef active_rank_mask, double timeout_s, int64_t mailbox, bool enable_pdl,
                               int64_t max_tokens_per_expert, at::IntArrayRef payload_row_bytes, bool has_weights,
                               int64_t round_tag) {
  const ExpertMajorDispatchParams p = check_dispatch_expert_major(
      token_selected_experts, input_payloads, workspace, ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank,
      top_k, num_experts, eplb_local_stats, eplb_stats_num_experts, active_rank_mask, timeout_s, mailbox, enable_pdl,
      max_tokens_per_expert, payload_row_bytes, has_weights, round_tag);
  run_dispatch_cpu(p.dispatch, max_num_tokens, eplb_stats_num_experts, mailbox);
  run_expert_major_build_cpu(p.build, max_num_tokens);
}

// The CPU expert-major combine of checked params (their output set).
void run_combine_expert_major_cpu(const ExpertMajorCombineParams& p, int64_t max_num_tokens, int64_t mailbox) {
  const RowCall call(p.c.ws);
  const int64_t ep_rank = p.c.ws.ep_rank;
  raise_if_mailbox_error(mailbox, ep_rank);
  raise_row_status(cpu::check_row_for_combine_expert_major(p, max_num_tokens), ep_rank);
  raise_if_wait_failed(cpu::combine_expert_major(p), p.c.ws);
  count_exchange(p.c.ws);
}

at::Tensor combine_expert_major_cpu(const std::optional<at::Tensor>& payload, int64_t local_num_tokens,
                                    const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size,
                                    int64_t max_num_tokens, int64_t runtime_max_tokens_per_rank, int64_t top_k,
                                    int64_t num_experts, int64_t max_tokens_per_expert, int64_t dispatch_end,
                                    int64_t combine_payload_offset, at::IntArrayRef row_shape,
                                    at::ScalarType payload_dtype, at::ScalarType output_dtype,
                                    at::IntArrayRef active_rank_mask, double timeout_s, int64_t mailbox,
                                    bool enable_pdl) {
  ExpertMajorCombineParams p = check_combine_expert_major(
      payload, local_num_tokens, workspace, ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank, top_k,
      num_experts, max_tokens_per_expert, dispatch_end, combine_payload_offset, row_shape, payload_dtype, output_dtype,
      active_rank_mask, timeout_s, mailbox, enable_pdl, nullptr);
  at::Tensor out =
      at::empty(expert_major_output_shape(local_num_tokens, row_shape), workspace.options().dtype(output_dtype));
  p.c.output = static_cast<uint8_t*>(out.data_ptr());
  run_combine_expert_major_cpu(p, max_num_tokens, mailbox);
  return out;
}

void combine_expert_major_into_cpu(const std::optional<at::Tensor>& payload, int64_t local_num_tokens,
                                   const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size,
                                   int64_t max_num_tokens, int64_t runtime_max_tokens_per_rank, int64_t top_k,
                                   int64_t num_experts, int64_t max_tokens_per_expert, int64_t dispatch_end,
                                   int64_t combine_payload_offset, at::IntArrayRef row_shape,
                                   at::ScalarType payload_dtype, at::ScalarType output_dtype,
                                   at::IntArrayRef active_rank_mask, double timeout_s, int64_t mailbox, bool enable_pdl,
                                   const at::Tensor& output) {
  const ExpertMajorCombineParams p = check_combine_expert_major(
      payload, local_num_tokens, workspace, ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank, top_k,
      num_experts, max_tokens_per_expert, dispatch_end, combine_payload_offset, row_shape, payload_dtype, output_dtype,
      active_rank_mask, timeout_s, mailbox, enable_pdl, &output);
  run_combine_expert_major_cpu(p, max_num_tokens, mailbox);
}

// ---- tensor-free layout operators (the C++ side of tests/test_layout.py) -----------

int64_t workspace_size_per_rank_op(int64_t ep_size, int64_t max_num_tokens,
                                   int64_t total_dispatch_payload_size_per_token,
                                   int64_t combine_payload_size_per_token, int64_t eplb_stats_num_experts) {
  check_ranks(/*ep_rank=*/0, ep_size);
  check_max_num_tokens(max_num_tokens);
  TORCH_CHECK_VALUE(total_dispatch_payload_size_per_token >= 0 &&
                        total_dispatch_payload_size_per_token <= kMaxPayloads * kMaxRowBytes,
                    "total_dispatch_payload_size_per_token must be in [0, ", kMaxPayloads * kMaxRowBytes, "], got ",
                    total_dispatch_payload_size_per_token);
  TORCH_CHECK_VALUE(combine_payload_size_per_token >= 0 && combine_payload_size_per_token <= kMaxRowBytes,
                    "combine_payload_size_per_token must be in [0, ", kMaxRowBytes, "], got ",
                    combine_payload_size_per_token);
  check_eplb_n(eplb_stats_num_experts);
  return workspace_size_per_rank(ep_size, max_num_tokens, total_dispatch_payload_size_per_token,
                                 combine_payload_size_per_token, eplb_stats_num_experts);
}

// [route_offset, eplb_offset, payload_offset_0, ..., combine_offset]
std::vector<int64_t> call_layout_op(int64_t ep_size, int64_t runtime_max_tokens_per_rank, int64_t eplb_n,
                                    at::IntArrayRef payload_row_bytes) {
  check_ranks(/*ep_rank=*/0, ep_size);
  TORCH_CHECK_VALUE(runtime_max_tokens_per_rank >= 1 && runtime_max_tokens_per_rank <= kMaxNumTokens,
                    "runtime_max_tokens_per_rank must be in [1, ", kMaxNumTokens, "], got ",
                    runtime_max_tokens_per_rank);
  check_eplb_n(eplb_n);
  TORCH_CHECK_VALUE(payload_row_bytes.size() <= size_t(kMaxCallPayloads), "payload_row_bytes must hold at most ",
                    kMaxCallPayloads, " sizes, got ", payload_row_bytes.size());
  for (const int64_t b : payload_row_bytes) {
    TORCH_CHECK_VALUE(b >= 0 && b <= kMaxRowBytes, "payload_row_bytes must be in [0, ", kMaxRowBytes, "], got ",
                      payload_row_bytes);
  }
  const CallLayout l = call_layout(ep_size, runtime_max_tokens_per_rank, eplb_n,
                                   static_cast<int>(payload_row_bytes.size()), payload_row_bytes.data());
  std::vector<int64_t> out{l.route_offset, l.eplb_offset};
  out.insert(out.end(), l.payload_offset, l.payload_offset + l.num_payloads);
  out.push_back(l.combine_offset);
  return out;
}

// [counts, pair_map, pair_src, ids, weights, payload_0, ..., combine] offsets.
std::vector<int64_t> expert_major_layout_op(int64_t dispatch_end, int64_t ep_size, int64_t runtime_max_tokens_per_rank,
                                            int64_t top_k, int64_t local_experts, int64_t max_tokens_per_expert,
                                            at::IntArrayRef payload_row_bytes) {
  check_ranks(/*ep_rank=*/0, ep_size);
  check_top_k(top_k);
  TORCH_CHECK_VALUE(runtime_max_tokens_per_rank >= 1 && runtime_max_tokens_per_rank <= kMaxNumTokens,
                    "runtime_max_tokens_per_rank must be in [1, ", kMaxNumTokens, "], got ",
                    runtime_max_tokens_per_rank);
  TORCH_CHECK_VALUE(dispatch_end >= 0 && dispatch_end <= (int64_t(1) << 40),
                    "dispatch_end out of range: ", dispatch_end);
  TORCH_CHECK_VALUE(local_experts >= 1 && local_experts <= kMaxLocalExperts, "local_experts must be in [1, ",
                    kMaxLocalExperts, "], got ", local_experts);
  TORCH_CHECK_VALUE(max_tokens_per_expert >= 1 && max_tokens_per_expert <= kMaxExpertMajorRows / local_experts,
                    "max_tokens_per_expert must be in [1, ", kMaxExpertMajorRows / local_experts, "], got ",
                    max_tokens_per_expert);
  TORCH_CHECK_VALUE(payload_row_bytes.size() <= size_t(kMaxPayloads), "payload_row_bytes must hold at most ",
                    kMaxPayloads, " sizes, got ", payload_row_bytes.size());
  for (const int64_t b : payload_row_bytes) {
    TORCH_CHECK_VALUE(b >= 0 && b <= kMaxRowBytes, "payload_row_bytes must be in [0, ", kMaxRowBytes, "], got ",
                      payload_row_bytes);
  }
  const ExpertMajorLayout l =
      expert_major_layout(dispatch_end, ep_size, runtime_max_tokens_per_rank, top_k, local_experts,
                          max_tokens_per_expert, static_cast<int>(payload_row_bytes.size()), payload_row_bytes.data());
  std::vector<int64_t> out{l.counts_offset, l.pair_map_offset, l.pair_src_offset, l.ids_offset, l.weights_offset};
  out.insert(out.end(), l.payload_offset, l.payload_offset + l.num_payloads);
  out.push_back(l.combine_offset);
  return out;
}

int64_t expert_major_workspace_size_op(int64_t ep_size, int64_t max_num_tokens,
                                       int64_t total_dispatch_payload_size_per_token,
                                       int64_t combine_payload_size_per_token, int64_t eplb_stats_num_experts,
                                       int64_t num_experts, int64_t top_k, int64_t max_tokens_per_expert) {
  // The rank-major part's checks, on the user payloads.
  workspace_size_per_rank_op(ep_size, max_num_tokens, total_dispatch_payload_size_per_token,
                             combine_payload_size_per_token, eplb_stats_num_experts);
  check_top_k(top_k);
  check_expert_major_sizes(ep_size, num_experts, max_tokens_per_expert);
  return expert_major_workspace_size_per_rank(ep_size, max_num_tokens, total_dispatch_payload_size_per_token,
                                              combine_payload_size_per_token, eplb_stats_num_experts, num_experts,
                                              top_k, max_tokens_per_expert);
}

// The values of torch_moe_a2a.layout.CONSTANTS, in that dict's order.
std::vector<int64_t> constants_op() {
  return {
      kMaxRanks,
      kRankMaskWords,
      kMaxTopK,
      kMaxPayloads,
      kMaxCallPayloads,
      kMaxNumTokens,
      kAlign,
      kPlaneAlign,
      kRouteRankShift,
      kMetaCount,
      kMetaMailboxCode,
      kMetaMailboxMissing,
      kMetaMailboxDetail,
      kMetaMailboxAddr,
      kMagic,
      kInitTagShift,
      kVersion,
      kHdrDispatchEpoch,
      kHdrCombineEpoch,
      kHdrErrorCode,
      kHdrErrorDetail,
      kHdrErrorMissing,
      kHdrInvalidExpertCount,
      kHdrLastLocalTokens,
      kHdrDispatchFlags,
      kHdrCombineFlags,
      kHdrRecvCounts,
      kHdrPeerRuntimeMax,
      kHdrPeerPayloads,
      kHdrInitStale,
      kHdrInitSeen,
      kMaxDispatchCtas,
      kHdrDispatchCounts,
      kHdrDispatchRouted,
      kClaimCounters,
      kClaimStride,
      kHdrDispatchClaim0,
      kHdrDispatchClaims,
      kHeaderBytes,
      kLowPrecisionBlock,
      kLowPrecisionGroupBlocks,
      kLowPrecisionGroupPitch,
      kHdrDroppedPairCount,
      kHdrExpertMajorEnd,
      kHdrExpertMajorEpoch,
      kHdrExpertMajorTokens,
      kHdrCombineCount,
      kHdrRegionStaged,
      kMaxLocalExperts,
      kMaxExpertMajorRows,
      kHdrCombineSignatures,
      kMaxTimeoutS,
  };
}

// The ADInplaceOrView kernels of the ops that write a tensor argument (the
// workspace; combine_into's output): after the op, each written tensor's
// version counter goes up, as after ATen's in-place ops, so that autograd
// refuses a backward whose saved tensors (a receive view, say) a later call
// overwrote, instead of computing with the new bytes. Inference tensors have
// no version counter (and inference mode skips this key). Unboxed: a boxed
// kernel cost every eager call about 2 us of host time.
void bump_version(const at::Tensor& t) {
  if (!t.is_inference()) torch::autograd::impl::bump_version(t);
}
void bump_version(const std::optional<at::Tensor>& t) {
  if (t.has_value() && t->defined()) bump_version(*t);
}

template <const char* kOp, typename Signature, size_t... kWritten>
struct BumpWrittenVersions;

template <const char* kOp, typename Ret, typename... Args, size_t... kWritten>
struct BumpWrittenVersions<kOp, Ret(Args...), kWritten...> {
  static Ret call(c10::DispatchKeySet keys, Args... args) {
    static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(kOp, "").typed<Ret(Args...)>();
    const c10::DispatchKeySet below = keys & c10::after_ADInplaceOrView_keyset;
    if constexpr (std::is_void_v<Ret>) {
      op.redispatch(below, args...);
      (bump_version(std::get<kWritten>(std::forward_as_tuple(args...))), ...);
    } else {
      Ret result = op.redispatch(below, args...);
      (bump_version(std::get<kWritten>(std::forward_as_tuple(args...))), ...);
      return result;
    }
  }
};

constexpr char kOpInitialize[] = "moe_a2a::initialize";
constexpr char kOpDispatch[] = "moe_a2a::dispatch";
constexpr char kOpCombine[] = "moe_a2a::combine";
constexpr char kOpCombineInto[] = "moe_a2a::combine_into";
constexpr char kOpSanitize[] = "moe_a2a::sanitize_expert_ids";
constexpr char kOpExpertMajorBuild[] = "moe_a2a::expert_major_build";
constexpr char kOpDispatchExpertMajor[] = "moe_a2a::dispatch_expert_major";
constexpr char kOpCombineExpertMajor[] = "moe_a2a::combine_expert_major";
constexpr char kOpCombineExpertMajorInto[] = "moe_a2a::combine_expert_major_into";

}  // namespace
}  // namespace moe_a2a

TORCH_LIBRARY(moe_a2a, m) {
  using namespace moe_a2a;
  m.def(kSchemaWorkspaceSize, &workspace_size_per_rank_op, {at::Tag::pt2_compliant_tag});
  m.def(kSchemaCallLayout, &call_layout_op, {at::Tag::pt2_compliant_tag});
  m.def(kSchemaConstants, &constants_op, {at::Tag::pt2_compliant_tag});
  m.def(kSchemaAllocMailbox, {at::Tag::pt2_compliant_tag});
  m.def(kSchemaInitialize, {at::Tag::pt2_compliant_tag});
  m.def(kSchemaDispatch, {at::Tag::pt2_compliant_tag});
  m.def(kSchemaCombine, {at::Tag::pt2_compliant_tag});
  m.def(kSchemaCombineInto, {at::Tag::pt2_compliant_tag});
  m.def(kSchemaSanitize, {at::Tag::pt2_compliant_tag});
  m.def(kSchemaCheckExpertIds, {at::Tag::pt2_compliant_tag});
  m.def(kSchemaExpertMajorBuild, {at::Tag::pt2_compliant_tag});
  m.def(kSchemaDispatchExpertMajor, {at::Tag::pt2_compliant_tag});
  m.def(kSchemaCombineExpertMajor, {at::Tag::pt2_compliant_tag});
  m.def(kSchemaCombineExpertMajorInto, {at::Tag::pt2_compliant_tag});
  m.def(kSchemaExpertMajorLayout, &expert_major_layout_op, {at::Tag::pt2_compliant_tag});
  m.def(kSchemaExpertMajorWorkspaceSize, &expert_major_workspace_size_op, {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(moe_a2a, CPU, m) {
  using namespace moe_a2a;
  m.impl("alloc_mailbox", &alloc_mailbox_cpu);
  m.impl("initialize", &initialize_cpu);
  m.impl("dispatch", &dispatch_cpu);
  m.impl("combine", &combine_cpu);
  m.impl("combine_into", &combine_into_cpu);
  m.impl("sanitize_expert_ids", &sanitize_expert_ids_cpu);
  m.impl("check_expert_ids", &check_expert_ids_host);
  m.impl("expert_major_build", &expert_major_build_cpu);
  m.impl("dispatch_expert_major", &dispatch_expert_major_cpu);
  m.impl("combine_expert_major", &combine_expert_major_cpu);
  m.impl("combine_expert_major_into", &combine_expert_major_into_cpu);
}

TORCH_LIBRARY_IMPL(moe_a2a, ADInplaceOrView, m) {
  using namespace moe_a2a;
  // The indices: the written arguments (Tensor(a!) workspace, Tensor(b!) output, Tensor(c!)? output_scales).
  m.impl("initialize", TORCH_FN((BumpWrittenVersions<kOpInitialize, InitializeSignature, 0>::call)));
  m.impl("dispatch", TORCH_FN((BumpWrittenVersions<kOpDispatch, DispatchSignature, 2>::call)));
  m.impl("combine", TORCH_FN((BumpWrittenVersions<kOpCombine, CombineSignature, 2, 17>::call)));
  m.impl("combine_into", TORCH_FN((BumpWrittenVersions<kOpCombineInto, CombineIntoSignature, 2, 17, 20>::call)));
  m.impl("sanitize_expert_ids", TORCH_FN((BumpWrittenVersions<kOpSanitize, SanitizeSignature, 0>::call)));
  m.impl("expert_major_build",
         TORCH_FN((BumpWrittenVersions<kOpExpertMajorBuild, ExpertMajorBuildSignature, 0>::call)));
  m.impl("dispatch_expert_major",
         TORCH_FN((BumpWrittenVersions<kOpDispatchExpertMajor, DispatchExpertMajorSignature, 2>::call)));
  m.impl("combine_expert_major",
         TORCH_FN((BumpWrittenVersions<kOpCombineExpertMajor, CombineExpertMajorSignature, 2>::call)));
  m.impl("combine_expert_major_into",
         TORCH_FN((BumpWrittenVersions<kOpCombineExpertMajorInto, CombineExpertMajorIntoSignature, 2, 19>::call)));
}
