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
//   * dispatch_owned / combine_owned / dispatch_round / combine_round: the
//     whole bodies of the training path's ops (torch_moe_a2a/autograd.py),
//     one call each: at small sizes their Python-level tensor calls (views,
//     the padding mask, clones, the tallies kept) cost more than the exchange.
#include <algorithm>
#include <numeric>
#include <optional>
#include <tuple>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/extension.h>

#include "cpu/kernels.h"
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

// A payload's row in bytes: its element size times its trailing sizes (also
// with zero tokens; 1 element for a 1-D payload), as the call layout counts it.
int64_t payload_row_bytes(const at::Tensor& payload) {
  int64_t elems = 1;
  for (int64_t d = 1; d < payload.dim(); ++d) elems *= payload.size(d);
  return elems * static_cast<int64_t>(payload.element_size());
}

// payload.shape[1:] after `leading` ([ep_size, runtime_max]): a receive plane's shape.
std::vector<int64_t> plane_shape(std::vector<int64_t> leading, const at::Tensor& payload) {
  const at::IntArrayRef trailing = payload.sizes();
  leading.insert(leading.end(), trailing.begin() + std::min<size_t>(1, trailing.size()), trailing.end());
  return leading;
}

// protocol.h's call_layout of a dispatch of `payloads` (the kernels' offsets);
// at most kMaxPayloads of them (the callers check or know it).
CallLayout payload_layout(int64_t ep_size, int64_t runtime_max_tokens, int64_t eplb_n,
                          const std::vector<at::Tensor>& payloads) {
  TORCH_INTERNAL_ASSERT(payloads.size() <= static_cast<size_t>(kMaxPayloads));
  int64_t row_bytes[kMaxPayloads] = {};
  for (size_t i = 0; i < payloads.size(); ++i) row_bytes[i] = payload_row_bytes(payloads[i]);
  return call_layout(ep_size, runtime_max_tokens, eplb_n, static_cast<int>(payloads.size()), row_bytes);
}

ReceiveViews receive_views(const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t runtime_max_tokens,
                           int64_t eplb_n, const std::vector<at::Tensor>& payloads) {
  TORCH_CHECK_VALUE(payloads.size() <= static_cast<size_t>(kMaxPayloads), "receive_views: at most ", kMaxPayloads,
                    " payloads, got ", payloads.size());
  const CallLayout call = payload_layout(ep_size, runtime_max_tokens, eplb_n, payloads);
  RegionViews regions(workspace);
  std::vector<at::Tensor> views;
  views.reserve(payloads.size());
  for (size_t i = 0; i < payloads.size(); ++i) {
    const std::vector<int64_t> shape = plane_shape({ep_size, runtime_max_tokens}, payloads[i]);
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
                                     bool enable_pdl, int64_t round_tag, bool views) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("moe_a2a::dispatch", "").typed<DispatchSignature>();
  op.call(token_selected_experts, input_payloads, workspace, ep_rank, ep_size, max_num_tokens, runtime_max_tokens,
          top_k, num_experts, eplb_local_stats, eplb_stats_num_experts, active_rank_mask, timeout_s, mailbox,
          enable_pdl, round_tag);
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

// ---- the training path's op bodies (torch_moe_a2a/autograd.py) --------------
// The bodies of the ops dispatch_owned, combine_owned, dispatch_round and
// combine_round, each one call: the same workspace ops (through the
// dispatcher, as dispatch and combine above) and the same tensor ops as the
// Python bodies there, which remain for tensors with __torch_function__
// overrides, and so bit for bit the same results.

// The ops' route arguments, in the schemas' order (autograd.py's `route`).
struct Route {
  int64_t ep_rank, ep_size, max_num_tokens, runtime_max_tokens, top_k, num_experts;
  std::vector<int64_t> active_rank_mask;
  double timeout_s;
  int64_t mailbox;
  bool enable_pdl;
};

// Where the bodies run (autograd.py's _Unrecorded): without grad mode (the
// workspace ops refuse payloads that require grad under it) and below
// ADInplaceOrView, so that the workspace's version counter stays put: to
// autograd the training ops mutate nothing, and a compiled graph that saved
// the workspace for its backward must not see it "modified by an inplace
// operation" by an exchange in between.
struct Unrecorded {
  c10::AutoGradMode grad_mode{false};
  at::AutoDispatchBelowADInplaceOrView below_ad_inplace_or_view;
};

// Where rank `rank`'s row starts in the uint8 workspace's storage (bytes).
int64_t row_start(const at::Tensor& workspace, int64_t rank) {
  return workspace.storage_offset() + rank * workspace.stride(0);
}

// The dispatch of `payloads` by `ids`; `round_tag`: a backward round's (the
// dispatch op's round_tag), 0 for the forward's.
void route_dispatch(const at::Tensor& ids, const std::vector<at::Tensor>& payloads, const at::Tensor& workspace,
                    const Route& r, int64_t round_tag) {
  dispatch(ids, payloads, workspace, r.ep_rank, r.ep_size, r.max_num_tokens, r.runtime_max_tokens, r.top_k,
           r.num_experts, std::nullopt, 0, r.active_rank_mask, r.timeout_s, r.mailbox, r.enable_pdl, round_tag, false);
}

// The combine of `payload` ([ep_size, runtime_max, *row]) in its own dtype.
at::Tensor route_combine(const at::Tensor& payload, int64_t local_num_tokens, const at::Tensor& workspace,
                         int64_t combine_payload_offset, const Route& r) {
  const at::IntArrayRef sizes = payload.sizes();
  const std::vector<int64_t> row_shape(sizes.begin() + std::min<size_t>(2, sizes.size()), sizes.end());
  return combine(payload, local_num_tokens, workspace, r.ep_rank, r.ep_size, r.max_num_tokens, r.runtime_max_tokens,
                 r.top_k, combine_payload_offset, row_shape, payload.scalar_type(), payload.scalar_type(),
                 r.active_rank_mask, r.timeout_s, r.mailbox, r.enable_pdl, 0, std::nullopt, 1.0, 2, std::nullopt);
}

// The integer dtype of each word width, for a plane zeroed as words.
at::ScalarType word_type(int64_t width) {
  switch (width) {
    case 2:
      return at::kShort;
    case 4:
      return at::kInt;
    case 8:
      return at::kLong;
    default:
      return at::kByte;
  }
}

// A new tensor with the plane of `payload`'s rows at byte `start` of the
// workspace's storage, plane_shape({ep_size, runtime_max}, payload), the rows
// where `valid` ([ep_size, runtime_max, 1] bool) is false zeroed (whatever
// bytes they held, so that an expert that multiplies them by a zero gradient
// gets no NaN).
at::Tensor zeroed_plane(const at::Tensor& workspace, int64_t start, int64_t ep_size, int64_t runtime_max,
                        const at::Tensor& valid, const at::Tensor& payload) {
  const std::vector<int64_t> shape = plane_shape({ep_size, runtime_max}, payload);
  const int64_t row_bytes = payload_row_bytes(payload);
  if (row_bytes == 0) {  // no bytes to view as the dtype (a size of 0 in the row's shape)
    return at::zeros(shape, at::TensorOptions().dtype(payload.scalar_type()).device(workspace.device()));
  }
  // Zeroed as words, one path for every dtype (all-zero bytes are a zero of
  // each): the widest integer words that divide the row and its start, for
  // on the CPU a where over bytes runs ten times slower than over int64s.
  const int64_t width = std::gcd(std::gcd(row_bytes, start), int64_t{8});
  at::Tensor plane =
      workspace.as_strided({ep_size, runtime_max, row_bytes}, {runtime_max * row_bytes, row_bytes, 1}, start);
  if (width > 1) plane = plane.view(word_type(width));
  return at::where(valid, plane, at::Scalar(int64_t{0})).view(payload.scalar_type()).view(shape);
}

// This rank's receive planes of the dispatch of `payloads` that just ran, as
// new tensors with their padding rows zeroed, the int32 [ep_size] receive
// counts (a view of the header, the round's combine its last reader) and the
// round's combine offset, from protocol.h's call_layout (the kernels').
struct OwnedPlanes {
  std::vector<at::Tensor> planes;
  at::Tensor counts;
  int64_t combine_offset;
};

OwnedPlanes owned_planes(const at::Tensor& workspace, const std::vector<at::Tensor>& payloads, const Route& r) {
  // The dispatch that ran has refused more payloads than a call lays out.
  const CallLayout call = payload_layout(r.ep_size, r.runtime_max_tokens, 0, payloads);
  const int64_t row = row_start(workspace, r.ep_rank);
  OwnedPlanes owned;
  owned.counts = workspace.as_strided({4 * r.ep_size}, {1}, row + kHdrRecvCounts).view(at::kInt);
  const at::Tensor valid =
      at::arange(r.runtime_max_tokens, at::TensorOptions().dtype(at::kLong).device(workspace.device()))
          .lt(owned.counts.unsqueeze(1))
          .unsqueeze(2);
  owned.planes.reserve(payloads.size() + 1);
  for (size_t i = 0; i < payloads.size(); ++i) {
    owned.planes.push_back(
        zeroed_plane(workspace, row + call.payload_offset[i], r.ep_size, r.runtime_max_tokens, valid, payloads[i]));
  }
  owned.combine_offset = call.combine_offset;
  return owned;
}

// `body()` with the header's two tallies put back as it found them
// (autograd.py's _TalliesKept): the forward's dispatch has counted its expert
// ids >= num_experts and its dropped pairs, and a backward's round dispatches
// the same ids again. Saved and restored on the stream (no host sync; only the
// rank's own kernels write them), also when `body` throws.
template <typename Body>
auto with_tallies_kept(const at::Tensor& workspace, int64_t rank, const Body& body) -> decltype(body()) {
  constexpr int64_t gap = kHdrDroppedPairCount - kHdrInvalidExpertCount;
  static_assert(gap >= 8, "the two int64 tallies do not overlap");
  // Both words as the rows of one [2, 8] byte view: one clone, one copy.
  const at::Tensor words = workspace.as_strided({2, 8}, {gap, 1}, row_start(workspace, rank) + kHdrInvalidExpertCount);
  const at::Tensor saved = words.clone();
  decltype(body()) result;
  try {
    result = body();
  } catch (...) {
    words.copy_(saved);
    throw;
  }
  words.copy_(saved);
  return result;
}

// dispatch_owned: the dispatch, then [*planes, counts] (new tensors).
std::vector<at::Tensor> dispatch_owned(const at::Tensor& token_selected_experts,
                                       const std::vector<at::Tensor>& input_payloads, const at::Tensor& workspace,
                                       int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                                       int64_t runtime_max_tokens, int64_t top_k, int64_t num_experts,
                                       std::vector<int64_t> active_rank_mask, double timeout_s, int64_t mailbox,
                                       bool enable_pdl) {
  const Route route{
      ep_rank,   ep_size, max_num_tokens, runtime_max_tokens, top_k, num_experts, std::move(active_rank_mask),
      timeout_s, mailbox, enable_pdl};
  const Unrecorded unrecorded;
  route_dispatch(token_selected_experts, input_payloads, workspace, route, 0);
  OwnedPlanes owned = owned_planes(workspace, input_payloads, route);
  owned.planes.push_back(owned.counts.clone());
  return std::move(owned.planes);
}

// combine_owned: the combine closing the round dispatch_owned opened.
at::Tensor combine_owned(const at::Tensor& payload, const at::Tensor& token_selected_experts,
                         const at::Tensor& workspace, int64_t combine_payload_offset, int64_t ep_rank, int64_t ep_size,
                         int64_t max_num_tokens, int64_t runtime_max_tokens, int64_t top_k, int64_t num_experts,
                         std::vector<int64_t> active_rank_mask, double timeout_s, int64_t mailbox, bool enable_pdl) {
  const Route route{
      ep_rank,   ep_size, max_num_tokens, runtime_max_tokens, top_k, num_experts, std::move(active_rank_mask),
      timeout_s, mailbox, enable_pdl};
  const Unrecorded unrecorded;
  return route_combine(payload, token_selected_experts.size(0), workspace, combine_payload_offset, route);
}

// dispatch_round: a dispatch of `rows` carrying `round_tag`, then a combine
// of one fp32 zero per received row (closing the round); the received
// plane, padding rows zero.
at::Tensor dispatch_round(const at::Tensor& rows, const at::Tensor& token_selected_experts, const at::Tensor& workspace,
                          int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens, int64_t runtime_max_tokens,
                          int64_t top_k, int64_t num_experts, std::vector<int64_t> active_rank_mask, double timeout_s,
                          int64_t mailbox, bool enable_pdl, int64_t round_tag) {
  const Route route{
      ep_rank,   ep_size, max_num_tokens, runtime_max_tokens, top_k, num_experts, std::move(active_rank_mask),
      timeout_s, mailbox, enable_pdl};
  const Unrecorded unrecorded;
  return with_tallies_kept(workspace, ep_rank, [&] {
    const std::vector<at::Tensor> payloads{rows};
    route_dispatch(token_selected_experts, payloads, workspace, route, round_tag);
    OwnedPlanes owned = owned_planes(workspace, payloads, route);
    const at::Tensor nothing =
        at::zeros({ep_size, runtime_max_tokens, 1}, at::TensorOptions().dtype(at::kFloat).device(rows.device()));
    route_combine(nothing, rows.size(0), workspace, owned.combine_offset, route);
    return owned.planes[0];
  });
}

// combine_round: a dispatch of the expert ids alone (their routes) carrying
// `round_tag`, then a combine of each of `payloads` (one or more: the
// round's repeated combines), their sums in order.
std::vector<at::Tensor> combine_round(const std::vector<at::Tensor>& payloads, const at::Tensor& token_selected_experts,
                                      const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size,
                                      int64_t max_num_tokens, int64_t runtime_max_tokens, int64_t top_k,
                                      int64_t num_experts, std::vector<int64_t> active_rank_mask, double timeout_s,
                                      int64_t mailbox, bool enable_pdl, int64_t round_tag) {
  // Without a combine the round would stay open.
  TORCH_CHECK_VALUE(!payloads.empty(), "combine_round needs at least one payload");
  const Route route{
      ep_rank,   ep_size, max_num_tokens, runtime_max_tokens, top_k, num_experts, std::move(active_rank_mask),
      timeout_s, mailbox, enable_pdl};
  const at::Tensor& ids = token_selected_experts;
  const int64_t ids_row = payload_row_bytes(ids);
  const int64_t offset = call_layout(ep_size, runtime_max_tokens, 0, 1, &ids_row).combine_offset;
  const Unrecorded unrecorded;
  return with_tallies_kept(workspace, ep_rank, [&] {
    route_dispatch(ids, {ids}, workspace, route, round_tag);
    std::vector<at::Tensor> sums;
    sums.reserve(payloads.size());
    for (const at::Tensor& payload : payloads) {
      sums.push_back(route_combine(payload, ids.size(0), workspace, offset, route));
    }
    return sums;
  });
}

// ---- Ctrl-C during a CPU wait (cpu::InterruptHooks) ----

// Python runs signal handlers in its main thread only: that thread's ident
// (threading.main_thread()), read at import.
unsigned long g_main_thread = 0;
// The exception a signal handler raised during a wait, until the op raises it
// (only the main thread sets and takes it).
PyObject* g_interrupt_type = nullptr;
PyObject* g_interrupt_value = nullptr;
PyObject* g_interrupt_traceback = nullptr;

// cpu::InterruptHooks::pending: runs the main thread's pending signal
// handlers (a wait of another thread answers false at once). A handler that
// raises (the default SIGINT one: KeyboardInterrupt) ends the wait; its
// exception is kept for raise_interrupted.
bool interrupt_pending() {
  if (PyThread_get_thread_ident() != g_main_thread || !Py_IsInitialized()) return false;
  pybind11::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return false;
  PyErr_Fetch(&g_interrupt_type, &g_interrupt_value, &g_interrupt_traceback);
  return true;
}

// cpu::InterruptHooks::raise: the kept exception leaves the op (through
// pybind11 and torch.ops alike, which pass a pybind11::error_already_set on),
// with the record as a note (Python 3.11+) that says what the workspace is now.
void raise_interrupted(const std::string& record) {
  if (PyThread_get_thread_ident() != g_main_thread) return;
  pybind11::gil_scoped_acquire gil;
  if (g_interrupt_type == nullptr) return;
  PyErr_Restore(g_interrupt_type, g_interrupt_value, g_interrupt_traceback);
  g_interrupt_type = g_interrupt_value = g_interrupt_traceback = nullptr;
  pybind11::error_already_set error;
  if (pybind11::hasattr(error.value(), "add_note")) error.value().attr("add_note")(record);
  throw error;
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
  // SimulatedEP.run's rank threads say so (a CPU timeout's message then
  // leaves out how to drive ranks from threads: they are).
  m.def("mark_simulated_rank_thread", &moe_a2a::mark_simulated_rank_thread);
  // Positional arguments in the order of the operators' schemas (schemas.h).
  // Without the GIL, as a torch.ops call: a CPU rank waits for peers that
  // other Python threads (simulated ranks) drive.
  m.def("dispatch", &moe_a2a::dispatch, py::call_guard<py::gil_scoped_release>());
  m.def("combine", &moe_a2a::combine, py::call_guard<py::gil_scoped_release>());
  // The training ops' bodies (torch_moe_a2a/autograd.py), their arguments in
  // the order of those ops' schemas; without the GIL for the same reason.
  m.def("dispatch_owned", &moe_a2a::dispatch_owned, py::call_guard<py::gil_scoped_release>());
  m.def("combine_owned", &moe_a2a::combine_owned, py::call_guard<py::gil_scoped_release>());
  m.def("dispatch_round", &moe_a2a::dispatch_round, py::call_guard<py::gil_scoped_release>());
  m.def("combine_round", &moe_a2a::combine_round, py::call_guard<py::gil_scoped_release>());
  // The count of the dispatches and combines that rank `ep_rank` has made on
  // `workspace` (ops.h, exchange_count), which the differentiable ops'
  // autograd nodes keep as their round tags; and its restart at the row's
  // initialization. For workspaces of this process (a real data pointer).
  m.def(
      "exchange_count",
      [](const at::Tensor& workspace, int64_t ep_rank) {
        return moe_a2a::exchange_count(workspace.data_ptr(), ep_rank);
      },
      py::arg("workspace"), py::arg("ep_rank"));
  m.def(
      "forget_exchange_count",
      [](const at::Tensor& workspace, int64_t ep_rank) {
        moe_a2a::forget_exchange_count(workspace.data_ptr(), ep_rank);
      },
      py::arg("workspace"), py::arg("ep_rank"));
  // Ctrl-C ends the CPU waits of the main thread (csrc/cpu/kernels.h).
  moe_a2a::g_main_thread = py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
  moe_a2a::cpu::set_interrupt_hooks({&moe_a2a::interrupt_pending, &moe_a2a::raise_interrupted});
  // SimulatedEP.run, interrupted: ends every rank's call (cpu::record_interrupted_rows).
  m.def(
      "record_interrupted_rows",
      [](const at::Tensor& workspace) {
        // The workspace SimulatedEP allocated: [ep_size, size_per_rank] uint8 CPU rows.
        TORCH_CHECK_VALUE(workspace.device().is_cpu() && workspace.dim() == 2 && workspace.scalar_type() == at::kByte &&
                              workspace.stride(1) == 1 && workspace.size(1) >= moe_a2a::kHeaderBytes,
                          "record_interrupted_rows: a CPU uint8 [ep_size, size_per_rank] workspace expected, got ",
                          workspace.scalar_type(), " ", workspace.sizes(), " on ", workspace.device());
        moe_a2a::WorkspaceView ws{};
        ws.base = static_cast<uint8_t*>(workspace.data_ptr());
        ws.row_stride = workspace.stride(0);
        ws.size_per_rank = workspace.size(1);
        ws.ep_size = static_cast<int>(workspace.size(0));
        moe_a2a::cpu::record_interrupted_rows(ws);
      },
      py::arg("workspace"));
}
