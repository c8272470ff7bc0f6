// Meta (fake) kernels of torch.ops.moe_a2a: output shapes without touching
// memory, so FakeTensor tracing (torch.compile, opcheck) needs no Python fake
// registration. SymInt-aware: combine's output keeps symbolic sizes.
//
// They refuse what the real kernels refuse, with the same errors: each runs
// its op's validating builder (ops.h) under TracedChecks, so that a traced
// call with a bad argument fails when it is traced, not when its compiled
// graph first runs. Left to the real kernels: where the tensors lie and
// autograd's state (TracedChecks), and every check of a call whose sizes are
// symbolic (dynamic shapes): checking those would guard, and so specialize,
// the sizes. They check one thing the real kernels never see: that every
// tensor is a meta tensor. A meta tensor among real ones routes the whole
// call here, where it would otherwise move nothing and return as if it had
// (DESIGN.md section 6: bad devices raise).
#include <algorithm>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"

namespace moe_a2a {
namespace {

// A tensor argument of a call, by name (tensor nullptr: an absent optional one).
struct Named {
  std::string name;
  const at::Tensor* tensor;
};

Named arg(std::string name, const at::Tensor& t) { return {std::move(name), &t}; }
Named arg(std::string name, const std::optional<at::Tensor>& t) {
  return {std::move(name), t.has_value() ? &*t : nullptr};
}

// Raises ValueError unless every tensor of `args` is a meta tensor (see the
// top), naming where each one lies.
void check_all_meta(const char* op, const std::vector<Named>& args) {
  if (std::all_of(args.begin(), args.end(),
                  [](const Named& a) { return a.tensor == nullptr || a.tensor->is_meta(); })) {
    return;
  }
  // The names grouped by device, the devices in the order they first appear.
  std::vector<std::pair<c10::Device, std::string>> groups;
  for (const Named& a : args) {
    if (a.tensor == nullptr) continue;
    auto group =
        std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == a.tensor->device(); });
    if (group == groups.end()) {
      groups.emplace_back(a.tensor->device(), a.name);
    } else {
      group->second += ", " + a.name;
    }
  }
  std::ostringstream os;
  os << "moe_a2a." << op << ": tensors on different devices (";
  for (size_t i = 0; i < groups.size(); ++i) os << (i ? "; " : "") << groups[i].second << " on " << groups[i].first;
  os << "): every tensor argument must be on the workspace's device";
  TORCH_CHECK_VALUE(false, os.str());
}

// Whether `t` has concrete sizes and strides (not those of a dynamic-shape trace).
bool concrete(const at::Tensor& t) { return !t.defined() || !t.unsafeGetTensorImpl()->has_symbolic_sizes_strides(); }
bool concrete(const std::optional<at::Tensor>& t) { return !t.has_value() || concrete(*t); }
bool concrete(at::TensorList ts) {
  for (const at::Tensor& t : ts) {
    if (!concrete(t)) return false;
  }
  return true;
}

// A dispatch's tensors all meta (check_all_meta); whether their sizes are
// concrete, so that the op's builder can check them.
bool dispatch_tensors_meta(const char* op, const at::Tensor& token_selected_experts, at::TensorList input_payloads,
                           const at::Tensor& workspace, const std::optional<at::Tensor>& eplb_local_stats) {
  std::vector<Named> args{arg("token_selected_experts", token_selected_experts)};
  for (size_t i = 0; i < input_payloads.size(); ++i) {
    args.push_back(arg("input_payloads[" + std::to_string(i) + "]", input_payloads[i]));
  }
  args.push_back(arg("workspace", workspace));
  args.push_back(arg("eplb_local_stats", eplb_local_stats));
  check_all_meta(op, args);
  return concrete(token_selected_experts) && concrete(input_payloads) && concrete(workspace) &&
         concrete(eplb_local_stats);
}

int64_t alloc_mailbox_meta(const at::Tensor&) {
  return 0;  // no host mailbox exists for a meta workspace
}

void initialize_meta(const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                     int64_t eplb_stats_num_experts, int64_t) {
  if (!concrete(workspace)) return;
  const TracedChecks traced;
  check_initialize(workspace, ep_rank, ep_size, max_num_tokens, eplb_stats_num_experts);
}

void dispatch_meta(const at::Tensor& token_selected_experts, at::TensorList input_payloads, const at::Tensor& workspace,
                   int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens, int64_t runtime_max_tokens_per_rank,
                   int64_t top_k, int64_t num_experts, const std::optional<at::Tensor>& eplb_local_stats,
                   int64_t eplb_stats_num_experts, at::IntArrayRef active_rank_mask, double timeout_s, int64_t mailbox,
                   bool enable_pdl, int64_t round_tag) {
  if (!dispatch_tensors_meta("dispatch", token_selected_experts, input_payloads, workspace, eplb_local_stats)) return;
  const TracedChecks traced;
  check_dispatch(token_selected_experts, input_payloads, workspace, ep_rank, ep_size, max_num_tokens,
                 runtime_max_tokens_per_rank, top_k, num_experts, eplb_local_stats, eplb_stats_num_experts,
                 active_rank_mask, timeout_s, mailbox, enable_pdl, round_tag);
}

// The checks of combine and combine_into (`output`: nullptr for combine).
void check_combine_meta(const std::optional<at::Tensor>& payload, const c10::SymInt& local_num_tokens,
                        const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                        int64_t runtime_max_tokens_per_rank, int64_t top_k, int64_t combine_payload_offset,
                        c10::SymIntArrayRef row_shape, at::ScalarType payload_dtype, at::ScalarType output_dtype,
                        at::IntArrayRef active_rank_mask, double timeout_s, int64_t mailbox, bool enable_pdl,
                        int64_t low_precision, const std::optional<at::Tensor>& output_scales,
                        double output_scalar_scale, int64_t sf_layout, const at::Tensor* output) {
  const std::optional<int64_t> tokens = local_num_tokens.maybe_as_int();
  const std::optional<at::IntArrayRef> shape = c10::asIntArrayRefSlowOpt(row_shape);
  if (!(tokens.has_value() && shape.has_value() && concrete(payload) && concrete(workspace) &&
        concrete(output_scales) && (output == nullptr || concrete(*output)))) {
    return;
  }
  const TracedChecks traced;
  check_combine(payload, *tokens, workspace, ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank, top_k,
                combine_payload_offset, *shape, payload_dtype, output_dtype, active_rank_mask, timeout_s, mailbox,
                enable_pdl, low_precision, output_scales, output_scalar_scale, sf_layout, output);
}

at::Tensor combine_meta(const std::optional<at::Tensor>& payload, c10::SymInt local_num_tokens,
                        const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                        int64_t runtime_max_tokens_per_rank, int64_t top_k, int64_t combine_payload_offset,
                        c10::SymIntArrayRef row_shape, at::ScalarType payload_dtype, at::ScalarType output_dtype,
                        at::IntArrayRef active_rank_mask, double timeout_s, int64_t mailbox, bool enable_pdl,
                        int64_t low_precision, const std::optional<at::Tensor>& output_scales,
                        double output_scalar_scale, int64_t sf_layout) {
  check_all_meta("combine",
                 {arg("payload", payload), arg("workspace", workspace), arg("output_scales", output_scales)});
  check_combine_meta(payload, local_num_tokens, workspace, ep_rank, ep_size, max_num_tokens,
                     runtime_max_tokens_per_rank, top_k, combine_payload_offset, row_shape, payload_dtype, output_dtype,
                     active_rank_mask, timeout_s, mailbox, enable_pdl, low_precision, output_scales,
                     output_scalar_scale, sf_layout, nullptr);
  std::vector<c10::SymInt> shape{std::move(local_num_tokens)};
  shape.insert(shape.end(), row_shape.begin(), row_shape.end());
  // A packed fp4 output (ops.h, combine_output_shape): two elements per byte.
  if (output_dtype == at::kByte && shape.size() == 2) shape[1] = shape[1] / 2;
  return at::empty_symint(shape, workspace.options().dtype(output_dtype));
}

void combine_into_meta(const std::optional<at::Tensor>& payload, c10::SymInt local_num_tokens,
                       const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                       int64_t runtime_max_tokens_per_rank, int64_t top_k, int64_t combine_payload_offset,
                       c10::SymIntArrayRef row_shape, at::ScalarType payload_dtype, at::ScalarType output_dtype,
                       at::IntArrayRef active_rank_mask, double timeout_s, int64_t mailbox, bool enable_pdl,
                       int64_t low_precision, const std::optional<at::Tensor>& output_scales,
                       double output_scalar_scale, int64_t sf_layout, const at::Tensor& output) {
  check_all_meta("combine_into", {arg("payload", payload), arg("workspace", workspace),
                                  arg("output_scales", output_scales), arg("output", output)});
  check_combine_meta(payload, local_num_tokens, workspace, ep_rank, ep_size, max_num_tokens,
                     runtime_max_tokens_per_rank, top_k, combine_payload_offset, row_shape, payload_dtype, output_dtype,
                     active_rank_mask, timeout_s, mailbox, enable_pdl, low_precision, output_scales,
                     output_scalar_scale, sf_layout, &output);
}

void sanitize_expert_ids_meta(const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                              int64_t runtime_max_tokens_per_rank, int64_t offset, int64_t width,
                              int64_t invalid_expert_id, int64_t id_bytes, int64_t mailbox, bool enable_pdl) {
  if (!concrete(workspace)) return;
  const TracedChecks traced;
  check_sanitize(workspace, ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank, offset, width,
                 invalid_expert_id, id_bytes, mailbox, enable_pdl);
}

// A traced check has no values to read: the real kernels do it when the graph runs.
void check_expert_ids_meta(const at::Tensor&, int64_t) {}

void expert_major_build_meta(const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                             int64_t runtime_max_tokens_per_rank, int64_t top_k, int64_t num_experts,
                             int64_t max_tokens_per_expert, int64_t eplb_n, at::IntArrayRef payload_row_bytes,
                             int64_t id_bytes, bool has_weights, int64_t mailbox, bool enable_pdl) {
  check_all_meta("expert_major_build", {arg("workspace", workspace)});
  if (!concrete(workspace)) return;
  const TracedChecks traced;
  check_expert_major_build(workspace, ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank, top_k, num_experts,
                           max_tokens_per_expert, eplb_n, payload_row_bytes, id_bytes, has_weights, mailbox,
                           enable_pdl);
}

void dispatch_expert_major_meta(const at::Tensor& token_selected_experts, at::TensorList input_payloads,
                                const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                                int64_t runtime_max_tokens_per_rank, int64_t top_k, int64_t num_experts,
                                const std::optional<at::Tensor>& eplb_local_stats, int64_t eplb_stats_num_experts,
                                at::IntArrayRef active_rank_mask, double timeout_s, int64_t mailbox, bool enable_pdl,
                                int64_t max_tokens_per_expert, at::IntArrayRef payload_row_bytes, bool has_weights,
                                int64_t round_tag) {
  if (!dispatch_tensors_meta("dispatch_expert_major", token_selected_experts, input_payloads, workspace,
                             eplb_local_stats)) {
    return;
  }
  const TracedChecks traced;
  check_dispatch_expert_major(token_selected_experts, input_payloads, workspace, ep_rank, ep_size, max_num_tokens,
                              runtime_max_tokens_per_rank, top_k, num_experts, eplb_local_stats, eplb_stats_num_experts,
                              active_rank_mask, timeout_s, mailbox, enable_pdl, max_tokens_per_expert,
                              payload_row_bytes, has_weights, round_tag);
}

// The checks of combine_expert_major and combine_expert_major_into (`output`: nullptr for the former).
void check_combine_expert_major_meta(const std::optional<at::Tensor>& payload, const c10::SymInt& local_num_tokens,
                                     const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size,
                                     int64_t max_num_tokens, int64_t runtime_max_tokens_per_rank, int64_t top_k,
                                     int64_t num_experts, int64_t max_tokens_per_expert, int64_t dispatch_end,
                                     int64_t combine_payload_offset, c10::SymIntArrayRef row_shape,
                                     at::ScalarType payload_dtype, at::ScalarType output_dtype,
                                     at::IntArrayRef active_rank_mask, double timeout_s, int64_t mailbox,
                                     bool enable_pdl, const at::Tensor* output) {
  const std::optional<int64_t> tokens = local_num_tokens.maybe_as_int();
  const std::optional<at::IntArrayRef> shape = c10::asIntArrayRefSlowOpt(row_shape);
  if (!(tokens.has_value() && shape.has_value() && concrete(payload) && concrete(workspace) &&
        (output == nullptr || concrete(*output)))) {
    return;
  }
  const TracedChecks traced;
  check_combine_expert_major(payload, *tokens, workspace, ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank,
                             top_k, num_experts, max_tokens_per_expert, dispatch_end, combine_payload_offset, *shape,
                             payload_dtype, output_dtype, active_rank_mask, timeout_s, mailbox, enable_pdl, output);
}

at::Tensor combine_expert_major_meta(const std::optional<at::Tensor>& payload, c10::SymInt local_num_tokens,
                                     const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size,
                                     int64_t max_num_tokens, int64_t runtime_max_tokens_per_rank, int64_t top_k,
                                     int64_t num_experts, int64_t max_tokens_per_expert, int64_t dispatch_end,
                                     int64_t combine_payload_offset, c10::SymIntArrayRef row_shape,
                                     at::ScalarType payload_dtype, at::ScalarType output_dtype,
                                     at::IntArrayRef active_rank_mask, double timeout_s, int64_t mailbox,
                                     bool enable_pdl) {
  check_all_meta("combine_expert_major", {arg("payload", payload), arg("workspace", workspace)});
  check_combine_expert_major_meta(payload, local_num_tokens, workspace, ep_rank, ep_size, max_num_tokens,
                                  runtime_max_tokens_per_rank, top_k, num_experts, max_tokens_per_expert, dispatch_end,
                                  combine_payload_offset, row_shape, payload_dtype, output_dtype, active_rank_mask,
                                  timeout_s, mailbox, enable_pdl, nullptr);
  std::vector<c10::SymInt> shape{std::move(local_num_tokens)};
  shape.insert(shape.end(), row_shape.begin(), row_shape.end());
  return at::empty_symint(shape, workspace.options().dtype(output_dtype));
}

void combine_expert_major_into_meta(const std::optional<at::Tensor>& payload, c10::SymInt local_num_tokens,
                                    const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size,
                                    int64_t max_num_tokens, int64_t runtime_max_tokens_per_rank, int64_t top_k,
                                    int64_t num_experts, int64_t max_tokens_per_expert, int64_t dispatch_end,
                                    int64_t combine_payload_offset, c10::SymIntArrayRef row_shape,
                                    at::ScalarType payload_dtype, at::ScalarType output_dtype,
                                    at::IntArrayRef active_rank_mask, double timeout_s, int64_t mailbox,
                                    bool enable_pdl, const at::Tensor& output) {
  check_all_meta("combine_expert_major_into",
                 {arg("payload", payload), arg("workspace", workspace), arg("output", output)});
  check_combine_expert_major_meta(payload, local_num_tokens, workspace, ep_rank, ep_size, max_num_tokens,
                                  runtime_max_tokens_per_rank, top_k, num_experts, max_tokens_per_expert, dispatch_end,
                                  combine_payload_offset, row_shape, payload_dtype, output_dtype, active_rank_mask,
                                  timeout_s, mailbox, enable_pdl, &output);
}

}  // namespace
}  // namespace moe_a2a

TORCH_LIBRARY_IMPL(moe_a2a, Meta, m) {
  using namespace moe_a2a;
  m.impl("alloc_mailbox", &alloc_mailbox_meta);
  m.impl("initialize", &initialize_meta);
  m.impl("dispatch", &dispatch_meta);
  m.impl("combine", &combine_meta);
  m.impl("combine_into", &combine_into_meta);
  m.impl("sanitize_expert_ids", &sanitize_expert_ids_meta);
  m.impl("check_expert_ids", &check_expert_ids_meta);
  m.impl("expert_major_build", &expert_major_build_meta);
  m.impl("dispatch_expert_major", &dispatch_expert_major_meta);
  m.impl("combine_expert_major", &combine_expert_major_meta);
  m.impl("combine_expert_major_into", &combine_expert_major_into_meta);
}
