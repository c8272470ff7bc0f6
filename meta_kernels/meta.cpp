// Meta (fake) kernels of torch.ops.moe_a2a: output shapes without touching
// memory, so FakeTensor tracing (torch.compile, opcheck) needs no Python fake
// registration. SymInt-aware: combine's output keeps symbolic sizes.
//
// The kernels do not validate: the CPU and CUDA kernels check every argument
// when the op really runs, and a check here would have to guard on symbolic
// sizes for no safety gain.
#include <optional>
#include <vector>

#include <ATen/ATen.h>
#include <torch/library.h>

namespace moe_a2a {
namespace {

int64_t alloc_mailbox_meta(const at::Tensor&) {
  return 0;  // no host mailbox exists for a meta workspace
}

void initialize_meta(const at::Tensor&, int64_t, int64_t, int64_t, int64_t, int64_t) {}

void dispatch_meta(const at::Tensor&, at::TensorList, const at::Tensor&, int64_t, int64_t, int64_t,
                   int64_t, int64_t, int64_t, const std::optional<at::Tensor>&, int64_t,
                   at::IntArrayRef, double, int64_t, bool) {}

at::Tensor combine_meta(const std::optional<at::Tensor>& /*payload*/, c10::SymInt local_num_tokens,
                        const at::Tensor& workspace, int64_t, int64_t, int64_t, int64_t, int64_t,
                        int64_t, c10::SymIntArrayRef row_shape, at::ScalarType,
                        at::ScalarType output_dtype, at::IntArrayRef, double, int64_t, bool) {
  std::vector<c10::SymInt> shape{std::move(local_num_tokens)};
  shape.insert(shape.end(), row_shape.begin(), row_shape.end());
  return at::empty_symint(shape, workspace.options().dtype(output_dtype));
}

void combine_into_meta(const std::optional<at::Tensor>&, c10::SymInt, const at::Tensor&, int64_t,
                       int64_t, int64_t, int64_t, int64_t, int64_t, c10::SymIntArrayRef,
                       at::ScalarType, at::ScalarType, at::IntArrayRef, double, int64_t, bool,
                       const at::Tensor&) {}

void sanitize_expert_ids_meta(const at::Tensor&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                              bool) {}

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
}
