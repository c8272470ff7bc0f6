// torch_moe_a2a._C: importing it loads this shared library, whose static
// TORCH_LIBRARY / TORCH_LIBRARY_IMPL registrations define torch.ops.moe_a2a.*
// (the operators need no Python binding). It also holds the eager entry
// points of the Python wrapper, which are cheaper in C++:
//   * receive_views: dispatch's receive views, which an uncached call
//     rebuilds every time (two view ops per payload from C++: 4 us for
//     three payloads on the CI machine, where the Python chain of three
//     view ops per payload took about two thirds of the wrapper's host time);
//   * dispatch / combine: the same operators called through the C++
//     dispatcher (so every backend, dispatch mode and the profiler see them as
//     usual), without the per-argument schema matching of a torch.ops call
//     from Python (several microseconds for their sixteen arguments).
//     Python takes this path only where no __torch_function__ override
//     could want to see the call, and torch.compile always traces torch.ops.
#include <optional>
#include <tuple>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include "ops.h"
#include "protocol.h"
#include "schemas.h"

namespace moe_a2a {
namespace {

// Views of the [ep_size, size_per_rank] uint8 `workspace` (rows at its
// stride, which may exceed size_per_rank) as `dtype`, built with ordinary
// view ops (DESIGN.md section 4): aten::view.dtype of the whole workspace,
// once per dtype a call needs, then aten::as_strided per region. Real views:
// they share the workspace's version counter (which the ops bump), and every
// dispatch mode (FakeTensorMode, make_fx) sees and traces the ops. The
// dispatch op has already checked the workspace's strides and that every
// region is aligned for its dtype.
class RegionViews {
 public:
  explicit RegionViews(const at::Tensor& workspace) : workspace_(workspace) {}

  // The contiguous view `shape` at byte `offset` of rank `ep_rank`'s row.
  at::Tensor view(int64_t ep_rank, int64_t offset, at::IntArrayRef shape, at::ScalarType dtype) {
    const int64_t itemsize = static_cast<int64_t>(c10::elementSize(dtype));
    // The workspace is uint8: its storage offset and strides are in bytes.
    const int64_t start = (workspace_.storage_offset() + ep_rank * workspace_.stride(0) + offset) / itemsize;
    std::vector<int64_t> strides(shape.size());
    int64_t step = 1;
    for (size_t i = shape.size(); i-- > 0;) {
      strides[i] = step;
      step *= shape[i];
    }
    return typed(dtype).as_strided(shape, strides, start);
  }

 private:
  const at::Tensor& typed(at::ScalarType dtype) {
    for (const at::Tensor& t : typed_) {
      if (t.scalar_type() == dtype) return t;
    }
    typed_.push_back(workspace_.view(dtype));
    return typed_.back();
  }

  const at::Tensor& workspace_;
  std::vector<at::Tensor> typed_;  // the workspace as each dtype asked for so far
};

// Dispatch's return values for an eager call that already ran: the receive
// view of each payload ([ep_size, runtime_max, *payload.shape[1:]], its
// dtype), combine_payload_offset, and the gathered EPLB view ([ep_size,
// eplb_n] int32) when eplb_n > 0. The offsets come from protocol.h's
// call_layout, the one the kernels used.
using ReceiveViews = std::tuple<std::vector<at::Tensor>, int64_t, std::optional<at::Tensor>>;

ReceiveViews receive_views(const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t runtime_max_tokens,
                           int64_t eplb_n, const std::vector<at::Tensor>& payloads) {
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
  RegionViews regions(workspace);
  std::vector<at::Tensor> views;
  views.reserve(payloads.size());
  for (size_t i = 0; i < payloads.size(); ++i) {
    std::vector<int64_t> shape{ep_size, runtime_max_tokens};
    const at::IntArrayRef trailing = payloads[i].sizes();
    shape.insert(shape.end(), trailing.begin() + std::min<size_t>(1, trailing.size()), trailing.end());
    views.push_back(regions.view(ep_rank, call.payload_offset[i], shape, payloads[i].scalar_type()));
  }
  std::optional<at::Tensor> eplb;
  if (call.eplb_offset >= 0) {
    eplb = regions.view(ep_rank, call.eplb_offset, {ep_size, eplb_n}, at::kInt);
  }
  return {std::move(views), call.combine_offset, std::move(eplb)};
}

// torch.ops.moe_a2a.dispatch, then, when `views`, receive_views of the call
// (else nothing: the caller has them cached).
std::optional<ReceiveViews> dispatch(const at::Tensor& token_selected_experts,
                                     const std::vector<at::Tensor>& input_payloads, const at::Tensor& workspace,
                                     int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                                     int64_t runtime_max_tokens, int64_t top_k, int64_t num_experts,
                                     const std::optional<at::Tensor>& eplb_local_stats, int64_t eplb_stats_num_experts,
                                     const std::vector<int64_t>& active_rank_mask, double timeout_s, int64_t mailbox,
                                     bool enable_pdl, bool views) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("moe_a2a::dispatch", "").typed<DispatchSignature>();
  op.call(token_selected_experts, input_payloads, workspace, ep_rank, ep_size, max_num_tokens, runtime_max_tokens,
          top_k, num_experts, eplb_local_stats, eplb_stats_num_experts, active_rank_mask, timeout_s, mailbox,
          enable_pdl);
  if (!views) return std::nullopt;
  const int64_t call_eplb_n = eplb_local_stats.has_value() ? eplb_stats_num_experts : 0;
  return receive_views(workspace, ep_rank, ep_size, runtime_max_tokens, call_eplb_n, input_payloads);
}

// torch.ops.moe_a2a.combine, or combine_into when `output` is given (then
// returned).
at::Tensor combine(const std::optional<at::Tensor>& payload, int64_t local_num_tokens, const at::Tensor& workspace,
                   int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens, int64_t runtime_max_tokens, int64_t top_k,
                   int64_t combine_payload_offset, const std::vector<int64_t>& row_shape, at::ScalarType payload_dtype,
                   at::ScalarType output_dtype, const std::vector<int64_t>& active_rank_mask, double timeout_s,
                   int64_t mailbox, bool enable_pdl, int64_t low_precision,
                   const std::optional<at::Tensor>& output_scales, double output_scalar_scale, int64_t sf_layout,
                   const std::optional<at::Tensor>& output) {
  auto& dispatcher = c10::Dispatcher::singleton();
  const c10::SymIntArrayRef shape = c10::fromIntArrayRefSlow(row_shape);
  if (!output.has_value()) {
    static const auto op = dispatcher.findSchemaOrThrow("moe_a2a::combine", "").typed<CombineSignature>();
    return op.call(payload, c10::SymInt(local_num_tokens), workspace, ep_rank, ep_size, max_num_tokens,
                   runtime_max_tokens, top_k, combine_payload_offset, shape, payload_dtype, output_dtype,
                   active_rank_mask, timeout_s, mailbox, enable_pdl, low_precision, output_scales, output_scalar_scale,
                   sf_layout);
  }
  static const auto op_into = dispatcher.findSchemaOrThrow("moe_a2a::combine_into", "").typed<CombineIntoSignature>();
  op_into.call(payload, c10::SymInt(local_num_tokens), workspace, ep_rank, ep_size, max_num_tokens, runtime_max_tokens,
               top_k, combine_payload_offset, shape, payload_dtype, output_dtype, active_rank_mask, timeout_s, mailbox,
               enable_pdl, low_precision, output_scales, output_scalar_scale, sf_layout, *output);
  return *output;
}

}  // namespace
}  // namespace moe_a2a

PYBIND11_MODULE(_C, m) {
  namespace py = pybind11;
  m.doc() = "Loads the torch.ops.moe_a2a operator library; eager entry points of the Python wrapper.";
  // The text of an error record (csrc/ops.cpp), for check_errors: one source
  // for the messages the ops raise and those read back from a header.
  m.def(
      "describe_error",
      [](int64_t ep_rank, uint32_t code, const std::vector<uint64_t>& missing, uint32_t detail) {
        TORCH_CHECK_VALUE(missing.size() == static_cast<size_t>(moe_a2a::kRankMaskWords),
                          "describe_error: ", moe_a2a::kRankMaskWords, " mask words expected, got ", missing.size());
        return moe_a2a::describe_error(ep_rank, code, missing.data(), detail);
      },
      py::arg("ep_rank"), py::arg("code"), py::arg("missing"), py::arg("detail"));
  // The shape of a combine's output (ops.cpp): for callers that allocate it
  // before launching (simulated ranks on CUDA), one rule with the op's.
  m.def(
      "combine_output_shape",
      [](int64_t local_num_tokens, const std::vector<int64_t>& row_shape, at::ScalarType output_dtype) {
        return moe_a2a::combine_output_shape(local_num_tokens, row_shape, output_dtype);
      },
      py::arg("local_num_tokens"), py::arg("row_shape"), py::arg("output_dtype"));
  m.def("receive_views", &moe_a2a::receive_views, py::arg("workspace"), py::arg("ep_rank"), py::arg("ep_size"),
        py::arg("runtime_max_tokens"), py::arg("eplb_n"), py::arg("payloads"));
  // Positional arguments in the order of the operators' schemas (schemas.h).
  // Without the GIL, as a torch.ops call: a CPU rank waits for peers that
  // other Python threads (simulated ranks) drive.
  m.def("dispatch", &moe_a2a::dispatch, py::call_guard<py::gil_scoped_release>());
  m.def("combine", &moe_a2a::combine, py::call_guard<py::gil_scoped_release>());
}
