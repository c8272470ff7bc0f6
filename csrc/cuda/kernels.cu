// The small CUDA kernels (initialize, sanitize_expert_ids) and the launch
// geometry shared by the spinning ones (dispatch.cu, combine.cu).
#include <algorithm>

#include "device.cuh"

namespace moe_a2a {
namespace gpu {
namespace {

// sanitize_expert_ids neither waits nor publishes: a plain grid-stride kernel,
// after its check of the view.
constexpr int kSanitizeThreads = 256;
constexpr int kSanitizeCtasPerSm = 4;

// initialize, before the row is zeroed around the init word and the stale
// tags (launch_initialize): the tags the last first dispatch saw become the
// stale ones, and the init word holds only the next initialization's tag (no
// magic, so no peer writes here until write_header_kernel).
__global__ void init_carry_kernel(const __grid_constant__ InitParams p) {
  uint8_t* row = p.ws.row(p.ws.ep_rank);
  const uint64_t old_word = *header_word<uint64_t>(row, kHdrMagic);
  const int q = threadIdx.x;
  const uint16_t seen = row_initialized(old_word) ? *header_word<uint16_t>(row, init_seen_offset(q)) : 0;
  *header_word<uint16_t>(row, init_stale_offset(q)) = seen;
  __syncthreads();
  if (q == 0) *header_word<uint64_t>(row, kHdrMagic) = uint64_t(init_tag(next_init_word(old_word))) << kInitTagShift;
}

// The header config after the row was zeroed; the init word last, as on the
// CPU, so that a row showing it is fully set up.
__global__ void write_header_kernel(const __grid_constant__ InitParams p) {
  uint8_t* row = p.ws.row(p.ws.ep_rank);
  const int q = threadIdx.x;
  *header_word<uint16_t>(row, init_seen_offset(q)) = *header_word<uint16_t>(row, init_stale_offset(q));
  if (q == 0) {
    *header_word<int32_t>(row, kHdrEpRank) = p.ws.ep_rank;
    *header_word<int32_t>(row, kHdrEpSize) = p.ws.ep_size;
    *header_word<int32_t>(row, kHdrMaxNumTokens) = static_cast<int32_t>(p.max_num_tokens);
    *header_word<int32_t>(row, kHdrEplbN) = static_cast<int32_t>(p.eplb_n);
  }
  __syncthreads();
  if (q == 0) {
    __threadfence_system();
    *header_word<uint64_t>(row, kHdrMagic) = init_word(init_tag(*header_word<uint64_t>(row, kHdrMagic)));
  }
}

__global__ void sanitize_kernel(const __grid_constant__ SanitizeParams p) {
  wait_for_previous_grid();
  const WorkspaceView& ws = p.ws;
  uint8_t* own = ws.row(ws.ep_rank);
  const int64_t T = p.runtime_max_tokens;
  __shared__ int64_t valid_rows[kMaxRanks];
  __shared__ bool proceed;
  if (threadIdx.x == 0) {
    // Thread 0 decides for its CTA: CTA 0 may record an error while another
    // CTA's threads read the error word. A failed rank does nothing until
    // initialize (the CPU refuses the call). The view must be a plane of
    // the last dispatch (protocol.h, sanitize_plane_fits), as the header
    // words of that dispatch, an earlier kernel of this stream, tell.
    proceed = false;
    if (*header_word<volatile uint32_t>(own, kHdrErrorCode) == kErrorNone) {
      const uint64_t init_word = *header_word<uint64_t>(own, kHdrMagic);
      const int32_t last_max = *header_word<int32_t>(own, kHdrLastRuntimeMax);
      proceed = sanitize_plane_fits(init_word, last_max, *header_word<int64_t>(own, kHdrLastDispatchEnd), T, p.offset,
                                    p.plane_end);
      if (!proceed && blockIdx.x == 0) {
        record_error(own, p.mailbox, kErrorSanitizeMismatch, 0,
                     first_dispatch(init_word) ? 0u : static_cast<uint32_t>(last_max));
      }
    }
  }
  if (threadIdx.x < ws.ep_size) {
    const int32_t count = *header_word<int32_t>(own, recv_count_offset(threadIdx.x));
    valid_rows[threadIdx.x] = received_rows(count, T);
  }
  __syncthreads();
  if (!proceed) return;
  const int64_t per_source = T * p.width;
  const int64_t total = int64_t(ws.ep_size) * per_source;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t s = idx / per_source;
    const int64_t j = (idx % per_source) / p.width;
    if (j >= valid_rows[s]) {
      if (p.ids_int64) {
        reinterpret_cast<int64_t*>(own + p.offset)[idx] = p.invalid_expert_id;
      } else {
        reinterpret_cast<int32_t*>(own + p.offset)[idx] = static_cast<int32_t>(p.invalid_expert_id);
      }
    }
  }
}

}  // namespace

cudaError_t query_ctas_per_sm(int* ctas_per_sm) {
  int dispatch = 0, combine = 0, expert_major = 0;
  cudaError_t err = dispatch_ctas_per_sm(&dispatch);
  if (err == cudaSuccess) err = combine_ctas_per_sm(&combine);
  if (err == cudaSuccess) err = expert_major_combine_ctas_per_sm(&expert_major);
  if (err == cudaSuccess) *ctas_per_sm = std::min({dispatch, combine, expert_major});
  return err;
}

int spinning_grid_size(const LaunchConfig& config, int64_t work_bytes) {
  const int ranks = config.co_resident_ranks > 0 ? config.co_resident_ranks : 1;
  const int resident = std::max(1, (config.num_sms * config.ctas_per_sm - 1) / ranks);
  const int64_t wanted = (std::max<int64_t>(work_bytes, 0) + kMinBytesPerCta - 1) / kMinBytesPerCta;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, resident)));
}

cudaError_t launch_initialize(const InitParams& p, cudaStream_t stream) {
  uint8_t* row = p.ws.row(p.ws.ep_rank);
  // Zeroed: all but the init word [0, 8) and the stale tags, which
  // init_carry_kernel wrote and write_header_kernel reads.
  constexpr int64_t kStaleEnd = init_stale_offset(kMaxRanks);
  static_assert(kHdrMagic == 0 && kHdrInitStale > 8, "the init word leads the header");
  cudaError_t err = launch_kernel(init_carry_kernel, 1, kMaxRanks, stream, /*pdl=*/false, p);
  if (err == cudaSuccess) err = cudaMemsetAsync(row + 8, 0, static_cast<size_t>(kHdrInitStale - 8), stream);
  if (err == cudaSuccess) {
    err = cudaMemsetAsync(row + kStaleEnd, 0, static_cast<size_t>(p.ws.size_per_rank - kStaleEnd), stream);
  }
  if (err != cudaSuccess) return err;
  return launch_kernel(write_header_kernel, 1, kMaxRanks, stream, /*pdl=*/false, p);
}

cudaError_t launch_sanitize(const SanitizeParams& p, const LaunchConfig& config, cudaStream_t stream) {
  const int64_t total = int64_t(p.ws.ep_size) * p.runtime_max_tokens * p.width;
  const int64_t needed = (total + kSanitizeThreads - 1) / kSanitizeThreads;
  const int64_t most = int64_t(config.num_sms) * kSanitizeCtasPerSm;
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min(needed, most)));
  return launch_kernel(sanitize_kernel, grid, kSanitizeThreads, stream, p.enable_pdl && config.pdl_supported, p);
}

}  // namespace gpu
}  // namespace moe_a2a
