// TORCH_LIBRARY_IMPL(moe_a2a, CUDA): the CUDA kernels behind the schemas of
// schemas.h. Each operator validates its arguments with the ops.h builder
// (the same one the CPU kernels use), raises an error a previous kernel
// recorded in the host mailbox, and launches on the current stream of the
// workspace's device. No host-device sync, no allocation besides combine's
// output (and initialize's mailbox slot). Each dispatch and combine counts
// itself once launched (count_exchange, ops.h); a CUDA graph that captured
// it replays it without the host, uncounted.
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include "../ops.h"
#include "kernels.cuh"
#include "vmm.h"

namespace moe_a2a {
namespace {

// ---- device facts, cached per device --------------------------------------------

struct DeviceInfo {
  int num_sms;
  int ctas_per_sm;  // gpu::query_ctas_per_sm
  bool pdl_supported;
};

// Must be called with `device` current (the ops hold a CUDAGuard): the
// occupancy query works on the current device.
DeviceInfo device_info(c10::DeviceIndex device) {
  static std::mutex mutex;
  static std::vector<std::unique_ptr<DeviceInfo>> cache;  // by device index
  const std::lock_guard<std::mutex> lock(mutex);
  const size_t index = static_cast<size_t>(device);
  if (cache.size() <= index) cache.resize(index + 1);
  if (!cache[index]) {
    auto info = std::make_unique<DeviceInfo>();
    int major = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&info->num_sms, cudaDevAttrMultiProcessorCount, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    info->pdl_supported = major >= 9;
    C10_CUDA_CHECK(gpu::query_ctas_per_sm(&info->ctas_per_sm));
    cache[index] = std::move(info);
  }
  return *cache[index];
}

// Every rank of a plain workspace tensor may run its spinning kernels on this
// device at once (one process holds all simulated ranks), so the grids are
// sized for ep_size co-resident ranks; a VMM workspace (vmm.cpp) holds one
// rank per process, the only one this process runs. `timeout_s`: the
// resolved timeout of a waiting kernel (sync.timeout_s), 0 for one that never waits.
gpu::LaunchConfig launch_config(const at::Tensor& workspace, int64_t ep_size, double timeout_s) {
  const DeviceInfo info = device_info(workspace.device().index());
  gpu::LaunchConfig config{};
  config.num_sms = info.num_sms;
  config.ctas_per_sm = info.ctas_per_sm;
  const bool one_rank_per_process = is_vmm_workspace(workspace.storage().data());
  config.co_resident_ranks = one_rank_per_process ? 1 : static_cast<int>(ep_size);
  // A plain tensor holds every rank on this device in this process: gpu scope suffices.
  config.system_scope = one_rank_per_process;
  // PDL with simulated ranks too. A dependent grid's CTAs take SM slots
  // while they wait for the grid before it, so a rank may hold more than its
  // share for a while; but it never blocks a peer: the kernels let their
  // dependents launch only after their last wait (device.cuh,
  // allow_dependent_launch), so the grid before a dependent finishes without
  // any peer's progress and frees the slots.
  config.pdl_supported = info.pdl_supported;
  config.timeout_ms = timeout_ms(timeout_s);
  return config;
}

// ---- host mailboxes ---------------------------------------------------------------

// A mailbox is a slot of pinned, mapped host memory that the kernels write
// through its host pointer (unified addressing) and raise_if_mailbox_error
// reads without a sync. Slots come from chunks that are never freed: a kernel
// still running (or a graph replayed) after its workspace is gone can never
// write into memory that was handed to someone else.
constexpr size_t kMailboxSlotBytes = 64;
constexpr size_t kMailboxChunkBytes = 4096;
static_assert((kMetaMailboxDetail - kMetaMailboxCode + 1) * sizeof(int64_t) <= kMailboxSlotBytes,
              "the mailbox words fit in a slot");
static_assert(kMailboxChunkBytes % kMailboxSlotBytes == 0, "chunks hold whole slots");

int64_t* allocate_mailbox() {
  static std::mutex mutex;
  static uint8_t* chunk = nullptr;
  static size_t used = kMailboxChunkBytes;
  const std::lock_guard<std::mutex> lock(mutex);
  if (used == kMailboxChunkBytes) {
    void* fresh = nullptr;
    C10_CUDA_CHECK(cudaHostAlloc(&fresh, kMailboxChunkBytes, cudaHostAllocMapped | cudaHostAllocPortable));
    void* device_view = nullptr;
    C10_CUDA_CHECK(cudaHostGetDevicePointer(&device_view, fresh, 0));
    TORCH_CHECK(device_view == fresh,
                "moe_a2a needs unified addressing: the device address of pinned host memory differs "
                "from its host address");
    chunk = static_cast<uint8_t*>(fresh);
    used = 0;
  }
  uint8_t* slot = chunk + used;
  used += kMailboxSlotBytes;
  std::memset(slot, 0, kMailboxSlotBytes);
  return reinterpret_cast<int64_t*>(slot);
}

// ---- operators -----------------------------------------------------------------------

int64_t alloc_mailbox_cuda(const at::Tensor& workspace) {
  const c10::cuda::CUDAGuard guard(workspace.device());
  return reinterpret_cast<int64_t>(allocate_mailbox());
}

void initialize_cuda(const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                     int64_t eplb_stats_num_experts, int64_t mailbox) {
  const InitParams p = check_initialize(workspace, ep_rank, ep_size, max_num_tokens, eplb_stats_num_experts);
  const c10::cuda::CUDAGuard guard(workspace.device());
  // A re-initialization clears the error a timed-out kernel left for this rank.
  if (mailbox != 0) std::memset(reinterpret_cast<void*>(mailbox), 0, kMailboxSlotBytes);
  C10_CUDA_CHECK(gpu::launch_initialize(p, c10::cuda::getCurrentCUDAStream()));
}

void dispatch_cuda(const at::Tensor& token_selected_experts, at::TensorList input_payloads, const at::Tensor& workspace,
                   int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens, int64_t runtime_max_tokens_per_rank,
                   int64_t top_k, int64_t num_experts, const std::optional<at::Tensor>& eplb_local_stats,
                   int64_t eplb_stats_num_experts, at::IntArrayRef active_rank_mask, double timeout_s, int64_t mailbox,
                   bool enable_pdl, int64_t round_tag) {
  // Arguments first, then the mailbox: the order of the CPU operators.
  const DispatchParams p =
      check_dispatch(token_selected_experts, input_payloads, workspace, ep_rank, ep_size, max_num_tokens,
                     runtime_max_tokens_per_rank, top_k, num_experts, eplb_local_stats, eplb_stats_num_experts,
                     active_rank_mask, timeout_s, mailbox, enable_pdl, round_tag);
  raise_if_mailbox_error(mailbox, ep_rank);
  const c10::cuda::CUDAGuard guard(workspace.device());
  C10_CUDA_CHECK(
      gpu::launch_dispatch(p, launch_config(workspace, ep_size, p.sync.timeout_s), c10::cuda::getCurrentCUDAStream()));
  count_exchange(p.ws);
}

// Called with the workspace's device current and params.output set.
void enqueue_combine(const CombineParams& p, const at::Tensor& workspace) {
  C10_CUDA_CHECK(gpu::launch_combine(p, launch_config(workspace, p.ws.ep_size, p.sync.timeout_s),
                                     c10::cuda::getCurrentCUDAStream()));
  count_exchange(p.ws);
}

at::Tensor combine_cuda(const std::optional<at::Tensor>& payload, int64_t local_num_tokens, const at::Tensor& workspace,
                        int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens, int64_t runtime_max_tokens_per_rank,
                        int64_t top_k, int64_t combine_payload_offset, at::IntArrayRef row_shape,
                        at::ScalarType payload_dtype, at::ScalarType output_dtype, at::IntArrayRef active_rank_mask,
                        double timeout_s, int64_t mailbox, bool enable_pdl, int64_t low_precision,
                        const std::optional<at::Tensor>& output_scales, double output_scalar_scale, int64_t sf_layout) {
  CombineParams p =
      check_combine(payload, local_num_tokens, workspace, ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank,
                    top_k, combine_payload_offset, row_shape, payload_dtype, output_dtype, active_rank_mask, timeout_s,
                    mailbox, enable_pdl, low_precision, output_scales, output_scalar_scale, sf_layout, nullptr);
  raise_if_mailbox_error(mailbox, ep_rank);
  const c10::cuda::CUDAGuard guard(workspace.device());
  at::Tensor out = at::empty(combine_output_shape(local_num_tokens, row_shape, output_dtype),
                             workspace.options().dtype(output_dtype));
  p.output = static_cast<uint8_t*>(out.data_ptr());
  enqueue_combine(p, workspace);
  return out;
}

void combine_into_cuda(const std::optional<at::Tensor>& payload, int64_t local_num_tokens, const at::Tensor& workspace,
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
  raise_if_mailbox_error(mailbox, ep_rank);
  const c10::cuda::CUDAGuard guard(workspace.device());
  enqueue_combine(p, workspace);
}

void sanitize_expert_ids_cuda(const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                              int64_t runtime_max_tokens_per_rank, int64_t offset, int64_t width,
                              int64_t invalid_expert_id, int64_t id_bytes, int64_t mailbox, bool enable_pdl) {
  const SanitizeParams p = check_sanitize(workspace, ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank,
                                          offset, width, invalid_expert_id, id_bytes, mailbox, enable_pdl);
  raise_if_mailbox_error(mailbox, ep_rank);
  const c10::cuda::CUDAGuard guard(workspace.device());
  C10_CUDA_CHECK(
      gpu::launch_sanitize(p, launch_config(workspace, ep_size, /*timeout_s=*/0), c10::cuda::getCurrentCUDAStream()));
}

void expert_major_build_cuda(const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                             int64_t runtime_max_tokens_per_rank, int64_t top_k, int64_t num_experts,
                             int64_t max_tokens_per_expert, int64_t eplb_n, at::IntArrayRef payload_row_bytes,
                             int64_t id_bytes, bool has_weights, int64_t mailbox, bool enable_pdl) {
  const ExpertMajorBuildParams p = check_expert_major_build(
      workspace, ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank, top_k, num_experts,
      max_tokens_per_expert, eplb_n, payload_row_bytes, id_bytes, has_weights, mailbox, enable_pdl);
  raise_if_mailbox_error(mailbox, ep_rank);
  const c10::cuda::CUDAGuard guard(workspace.device());
  C10_CUDA_CHECK(gpu::launch_expert_major_build(p, launch_config(workspace, ep_size, /*timeout_s=*/0),
                                                c10::cuda::getCurrentCUDAStream()));
}

void dispatch_expert_major_cuda(const at::Tensor& token_selected_experts, at::TensorList input_payloads,
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
  raise_if_mailbox_error(mailbox, ep_rank);
  const c10::cuda::CUDAGuard guard(workspace.device());
  C10_CUDA_CHECK(gpu::launch_dispatch_expert_major(p.dispatch, p.build,
                                                   launch_config(workspace, ep_size, p.dispatch.sync.timeout_s),
                                                   c10::cuda::getCurrentCUDAStream()));
  count_exchange(p.dispatch.ws);
}

// Called with the workspace's device current and params.c.output set.
void enqueue_combine_expert_major(const ExpertMajorCombineParams& p, const at::Tensor& workspace) {
  C10_CUDA_CHECK(gpu::launch_combine_expert_major(p, launch_config(workspace, p.c.ws.ep_size, p.c.sync.timeout_s),
                                                  c10::cuda::getCurrentCUDAStream()));
  count_exchange(p.c.ws);
}

at::Tensor combine_expert_major_cuda(const std::optional<at::Tensor>& payload, int64_t local_num_tokens,
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
  raise_if_mailbox_error(mailbox, ep_rank);
  const c10::cuda::CUDAGuard guard(workspace.device());
  at::Tensor out =
      at::empty(expert_major_output_shape(local_num_tokens, row_shape), workspace.options().dtype(output_dtype));
  p.c.output = static_cast<uint8_t*>(out.data_ptr());
  enqueue_combine_expert_major(p, workspace);
  return out;
}

void combine_expert_major_into_cuda(const std::optional<at::Tensor>& payload, int64_t local_num_tokens,
                                    const at::Tensor& workspace, int64_t ep_rank, int64_t ep_size,
                                    int64_t max_num_tokens, int64_t runtime_max_tokens_per_rank, int64_t top_k,
                                    int64_t num_experts, int64_t max_tokens_per_expert, int64_t dispatch_end,
                                    int64_t combine_payload_offset, at::IntArrayRef row_shape,
                                    at::ScalarType payload_dtype, at::ScalarType output_dtype,
                                    at::IntArrayRef active_rank_mask, double timeout_s, int64_t mailbox,
                                    bool enable_pdl, const at::Tensor& output) {
  const ExpertMajorCombineParams p = check_combine_expert_major(
      payload, local_num_tokens, workspace, ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank, top_k,
      num_experts, max_tokens_per_expert, dispatch_end, combine_payload_offset, row_shape, payload_dtype, output_dtype,
      active_rank_mask, timeout_s, mailbox, enable_pdl, &output);
  raise_if_mailbox_error(mailbox, ep_rank);
  const c10::cuda::CUDAGuard guard(workspace.device());
  enqueue_combine_expert_major(p, workspace);
}

void check_expert_ids_cuda(const at::Tensor& token_selected_experts, int64_t num_experts) {
  const c10::cuda::CUDAGuard guard(token_selected_experts.device());
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(), &status));
  // A captured graph replays without the host, which then reads no ids.
  if (status != cudaStreamCaptureStatusNone) return;
  check_expert_ids_host(token_selected_experts, num_experts);
}

}  // namespace
}  // namespace moe_a2a

TORCH_LIBRARY_IMPL(moe_a2a, CUDA, m) {
  using namespace moe_a2a;
  m.impl("alloc_mailbox", &alloc_mailbox_cuda);
  m.impl("initialize", &initialize_cuda);
  m.impl("dispatch", &dispatch_cuda);
  m.impl("combine", &combine_cuda);
  m.impl("combine_into", &combine_into_cuda);
  m.impl("sanitize_expert_ids", &sanitize_expert_ids_cuda);
  m.impl("check_expert_ids", &check_expert_ids_cuda);
  m.impl("expert_major_build", &expert_major_build_cuda);
  m.impl("dispatch_expert_major", &dispatch_expert_major_cuda);
  m.impl("combine_expert_major", &combine_expert_major_cuda);
  m.impl("combine_expert_major_into", &combine_expert_major_into_cuda);
}
