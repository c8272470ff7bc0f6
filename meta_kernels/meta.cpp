// Meta (fake) kernels of torch.ops.moe_a2a: output shapes without touching
// memory, so FakeTensor tracing (torch.compile, opcheck) needs no Python fake
// registration. SymInt-aware: combine's output keeps symbolic sizes.
//
// The kernels do not validate sizes: the CPU and CUDA kernels check every
// argument when the op really runs, and a check here would have to guard on
// symbolic sizes for no safety gain. They check one thing the real kernels
// never see: that every tensor is a meta tensor. A meta tensor among real
// ones routes the whole call here, where it would otherwise move nothing and
// return as if it had (DESIGN.md section 6: bad devices raise).
#include <optional>
#include <vector>

#include <ATen/ATen.h>
#include <torch/library.h>

namespace moe_a2a {
namespace {

// Raises ValueError unless `t` is a meta tensor (see the top).
void check_meta(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.is_meta(), "moe_a2a.", op, ": tensors on different devices: ", name, " is on ", t.device(),
                    " while another argument is a meta tensor");
}

void check_meta(const char* op, const char* name, const std::optional<at::Tensor>& t) {
  if (t.has_value()) check_meta(op, name, *t);
}

int64_t alloc_mailbox_meta(const at::Tensor&) {
  return 0;  // no host mailbox exists for a meta workspace
}

void initialize_meta(const at::Tensor&, int64_t, int64_t, int64_t, int64_t, int64_t) {}

void dispatch_meta(const at::Tensor& token_selected_experts, at::TensorList input_payloads, const at::Tensor& workspace,
                   int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                   const std::optional<at::Tensor>& eplb_local_stats, int64_t, at::IntArrayRef, double, int64_t, bool) {
  check_meta("dispatch", "token_selected_experts", token_selected_experts);
  for (const at::Tensor& payload : input_payloads) check_meta("dispatch", "an input payload", payload);
  check_meta("dispatch", "workspace", workspace);
  check_meta("dispatch", "eplb_local_stats", eplb_local_stats);
}

at::Tensor combine_meta(const std::optional<at::Tensor>& payload, c10::SymInt local_num_tokens,
                        const at::Tensor& workspace, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                        c10::SymIntArrayRef row_shape, at::ScalarType, at::ScalarType output_dtype, at::IntArrayRef,
                        double, int64_t, bool, int64_t, const std::optional<at::Tensor>& output_scales, double,
                        int64_t) {
  check_meta("combine", "payload", payload);
  check_meta("combine", "workspace", workspace);
  check_meta("combine", "output_scales", output_scales);
  std::vector<c10::SymInt> shape{std::move(local_num_tokens)};
  shape.insert(shape.end(), row_shape.begin(), row_shape.end());
  // A packed fp4 output (ops.h, combine_output_shape): two elements per byte.
  if (output_dtype == at::kByte && shape.size() == 2) shape[1] = shape[1] / 2;
  return at::empty_symint(shape, workspace.options().dtype(output_dtype));
}

void combine_into_meta(const std::optional<at::Tensor>& payload, c10::SymInt, const at::Tensor& workspace, int64_t,
                       int64_t, int64_t, int64_t, int64_t, int64_t, c10::SymIntArrayRef, at::ScalarType, at::ScalarType,
                       at::IntArrayRef, double, int64_t, bool, int64_t, const std::optional<at::Tensor>& output_scales,
                       double, int64_t, const at::Tensor& output) {
  check_meta("combine_into", "payload", payload);
  check_meta("combine_into", "workspace", workspace);
  check_meta("combine_into", "output_scales", output_scales);
  check_meta("combine_into", "output", output);
}

void sanitize_expert_ids_meta(const at::Tensor&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                              bool) {}

// A traced check has no values to read: the real kernels do it when the graph runs.
void check_expert_ids_meta(const at::Tensor&, int64_t) {}

void expert_major_build_meta(const at::Tensor& workspace, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                             int64_t, at::IntArrayRef, int64_t, bool, int64_t, bool) {
  check_meta("expert_major_build", "workspace", workspace);
}

void dispatch_expert_major_meta(const at::Tensor& token_selected_experts, at::TensorList input_payloads,
                                const at::Tensor& workspace, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                const std::optional<at::Tensor>& eplb_local_stats, int64_t, at::IntArrayRef, double,
                                int64_t, bool, int64_t, at::IntArrayRef, bool) {
  dispatch_meta(token_selected_experts, input_payloads, workspace, 0, 0, 0, 0, 0, 0, eplb_local_stats, 0, {}, 0.0, 0,
                false);
}

at::Tensor combine_expert_major_meta(const std::optional<at::Tensor>& payload, c10::SymInt local_num_tokens,
                                     const at::Tensor& workspace, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                     int64_t, int64_t, int64_t, c10::SymIntArrayRef row_shape, at::ScalarType,
                                     at::ScalarType output_dtype, at::IntArrayRef, double, int64_t, bool) {
  check_meta("combine_expert_major", "payload", payload);
  check_meta("combine_expert_major", "workspace", workspace);
  std::vector<c10::SymInt> shape{std::move(local_num_tokens)};
  shape.insert(shape.end(), row_shape.begin(), row_shape.end());
  return at::empty_symint(shape, workspace.options().dtype(output_dtype));
}

void combine_expert_major_into_meta(const std::optional<at::Tensor>& payload, c10::SymInt, const at::Tensor& workspace,
                                    int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                    c10::SymIntArrayRef, at::ScalarType, at::ScalarType, at::IntArrayRef, double,
                                    int64_t, bool, const at::Tensor& output) {
  check_meta("combine_expert_major_into", "payload", payload);
  check_meta("combine_expert_major_into", "workspace", workspace);
  check_meta("combine_expert_major_into", "output", output);
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
