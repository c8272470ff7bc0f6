// The small CUDA kernels (initialize, sanitize_expert_ids) and the launch
// geometry shared by the spinning ones (dispatch.cu, combine.cu).
#include <algorithm>

#include "device.cuh"

namespace moe_a2a {
namespace gpu {
namespace {

// sanitize_expert_ids neither waits nor publishes: a plain grid-stride kernel.
constexpr int kSanitizeThreads = 256;
constexpr int kSanitizeCtasPerSm = 4;

// The header config after the row was zeroed; the magic last, as on the CPU,
// so that a row showing it is fully set up.
__global__ void write_header_kernel(const __grid_constant__ InitParams p) {
  uint8_t* row = p.ws.row(p.ws.ep_rank);
  *header_word<int32_t>(row, kHdrEpRank) = p.ws.ep_rank;
  *header_word<int32_t>(row, kHdrEpSize) = p.ws.ep_size;
  *header_word<int32_t>(row, kHdrMaxNumTokens) = static_cast<int32_t>(p.max_num_tokens);
  *header_word<int32_t>(row, kHdrEplbN) = static_cast<int32_t>(p.eplb_n);
  __threadfence_system();
  *header_word<int64_t>(row, kHdrMagic) = kMagic;
}

__global__ void sanitize_kernel(const __grid_constant__ SanitizeParams p) {
  wait_for_previous_grid();
  const WorkspaceView& ws = p.ws;
  uint8_t* own = ws.row(ws.ep_rank);
  // A failed rank does nothing until initialize (the CPU refuses the call).
  if (*header_word<volatile uint32_t>(own, kHdrErrorCode) != kErrorNone) return;
  const int64_t T = p.runtime_max_tokens;
  __shared__ int64_t valid_rows[kMaxRanks];
  if (threadIdx.x < ws.ep_size) {
    const int32_t count = *header_word<int32_t>(own, recv_count_offset(threadIdx.x));
    valid_rows[threadIdx.x] = received_rows(count, T);
  }
  __syncthreads();
  int32_t* plane = reinterpret_cast<int32_t*>(own + p.offset);
  const int64_t per_source = T * p.top_k;
  const int64_t total = int64_t(ws.ep_size) * per_source;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t s = idx / per_source;
    const int64_t j = (idx % per_source) / p.top_k;
    if (j >= valid_rows[s]) plane[idx] = p.invalid_expert_id;
  }
}

}  // namespace

cudaError_t query_ctas_per_sm(int* ctas_per_sm) {
  int dispatch = 0, combine = 0;
  cudaError_t err = dispatch_ctas_per_sm(&dispatch);
  if (err == cudaSuccess) err = combine_ctas_per_sm(&combine);
  if (err == cudaSuccess) *ctas_per_sm = std::min(dispatch, combine);
  return err;
}

int spinning_grid_size(const LaunchConfig& config, int64_t work_bytes) {
  const int ranks = config.co_resident_ranks > 0 ? config.co_resident_ranks : 1;
  const int resident = std::max(1, (config.num_sms * config.ctas_per_sm - 1) / ranks);
  const int64_t wanted = (std::max<int64_t>(work_bytes, 0) + kMinBytesPerCta - 1) / kMinBytesPerCta;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, resident)));
}

cudaError_t launch_initialize(const InitParams& p, cudaStream_t stream) {
  const cudaError_t err = cudaMemsetAsync(p.ws.row(p.ws.ep_rank), 0, static_cast<size_t>(p.ws.size_per_rank), stream);
  if (err != cudaSuccess) return err;
  return launch_kernel(write_header_kernel, 1, 1, stream, /*pdl=*/false, p);
}

cudaError_t launch_sanitize(const SanitizeParams& p, const LaunchConfig& config, cudaStream_t stream) {
  const int64_t total = int64_t(p.ws.ep_size) * p.runtime_max_tokens * p.top_k;
  const int64_t needed = (total + kSanitizeThreads - 1) / kSanitizeThreads;
  const int64_t most = int64_t(config.num_sms) * kSanitizeCtasPerSm;
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min(needed, most)));
  return launch_kernel(sanitize_kernel, grid, kSanitizeThreads, stream, p.enable_pdl && config.pdl_supported, p);
}

}  // namespace gpu
}  // namespace moe_a2a
