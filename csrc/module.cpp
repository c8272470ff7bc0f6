// torch_moe_a2a._C: importing it loads this shared library, whose static
// TORCH_LIBRARY / TORCH_LIBRARY_IMPL registrations define torch.ops.moe_a2a.*
// (the operators need no Python binding). It also holds the one eager helper
// of the Python wrapper that is cheaper in C++: building dispatch's receive
// views, which an uncached call rebuilds every time (about two thirds of the
// wrapper's host time when done with Python view ops).
#include <optional>
#include <tuple>
#include <vector>

#include <torch/extension.h>

#include "protocol.h"

namespace moe_a2a {
namespace {

// A view `shape` of `dtype` at byte `offset` of rank `ep_rank`'s row of the
// [ep_size, size_per_rank] uint8 `workspace` (rows at its stride, which may
// exceed size_per_rank): one typed view and one as_strided, sharing (and
// keeping alive) the workspace's storage. The dispatch op has already checked
// the workspace's strides and that every region is aligned for its dtype.
at::Tensor region_view(const at::Tensor& workspace, int64_t ep_rank, int64_t offset, at::IntArrayRef shape,
                       at::ScalarType dtype) {
  const at::Tensor typed = workspace.view(dtype);
  const int64_t itemsize = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t start = typed.storage_offset() + (ep_rank * workspace.stride(0) + offset) / itemsize;
  std::vector<int64_t> strides(shape.size());
  int64_t step = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = step;
    step *= shape[i];
  }
  return typed.as_strided(shape, strides, start);
}

// Dispatch's return values for an eager call that already ran: the receive
// view of each payload ([ep_size, runtime_max, *payload.shape[1:]], its
// dtype), combine_payload_offset, and the gathered EPLB view ([ep_size,
// eplb_n] int32) when eplb_n > 0. The offsets come from protocol.h's
// call_layout, the one the kernels used.
std::tuple<std::vector<at::Tensor>, int64_t, std::optional<at::Tensor>> receive_views(
    const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t runtime_max_tokens, int64_t eplb_n,
    const std::vector<at::Tensor>& payloads) {
  TORCH_CHECK_VALUE(payloads.size() <= static_cast<size_t>(kMaxPayloads), "receive_views: at most ", kMaxPayloads,
                    " payloads, got ", payloads.size());
  int64_t row_bytes[kMaxPayloads] = {};
  for (size_t i = 0; i < payloads.size(); ++i) {
    int64_t elems = 1;  // of a row: the trailing sizes (also with zero tokens)
    for (int64_t d = 1; d < payloads[i].dim(); ++d) elems *= payloads[i].size(d);
    row_bytes[i] = elems * static_cast<int64_t>(payloads[i].element_size());
  }
  const CallLayout call =
      call_layout(ep_size, runtime_max_tokens, eplb_n, static_cast<int>(payloads.size()), row_bytes);
  std::vector<at::Tensor> views;
  views.reserve(payloads.size());
  for (size_t i = 0; i < payloads.size(); ++i) {
    std::vector<int64_t> shape{ep_size, runtime_max_tokens};
    const at::IntArrayRef trailing = payloads[i].sizes();
    shape.insert(shape.end(), trailing.begin() + std::min<size_t>(1, trailing.size()), trailing.end());
    views.push_back(region_view(workspace, ep_rank, call.payload_offset[i], shape, payloads[i].scalar_type()));
  }
  std::optional<at::Tensor> eplb;
  if (call.eplb_offset >= 0) {
    eplb = region_view(workspace, ep_rank, call.eplb_offset, {ep_size, eplb_n}, at::kInt);
  }
  return {std::move(views), call.combine_offset, std::move(eplb)};
}

}  // namespace
}  // namespace moe_a2a

PYBIND11_MODULE(_C, m) {
  m.doc() = "Loads the torch.ops.moe_a2a operator library; receive_views for the eager dispatch wrapper.";
  m.def("receive_views", &moe_a2a::receive_views, pybind11::arg("workspace"), pybind11::arg("ep_rank"),
        pybind11::arg("ep_size"), pybind11::arg("runtime_max_tokens"), pybind11::arg("eplb_n"),
        pybind11::arg("payloads"));
}
