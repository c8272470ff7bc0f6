// CUDA kernels of torch.ops.moe_a2a: the launchers the registration glue
// (register.cpp) calls. No torch header here or in the .cu files: they take
// the params structs of params.h (already validated by ops.h's check_*
// builders), raw pointers and a cudaStream_t, so nvcc compiles them alone.
//
// Semantics are exactly those of the CPU kernels (cpu/kernels.h) and the
// protocol of protocol.h: same routing, same slots, same route entries, same
// header fields, and combine sums bitwise identical to the CPU's.
//
// Every launcher only enqueues work on `stream` (no host-device sync, no
// allocation) and returns the launch status. Errors found on the device
// (timeouts, dispatch/combine out of order) are recorded in the own header
// and the host mailbox (params.sync.mailbox), never raised here.
#pragma once

#include <stdint.h>

#include <cuda_runtime_api.h>

#include "../params.h"

namespace moe_a2a {
namespace gpu {

// Device facts and per-call values every launch needs beside the params.
struct LaunchConfig {
  int num_sms;      // multiprocessors of the workspace's device
  int ctas_per_sm;  // query_ctas_per_sm() for that device
  // Ranks whose spinning kernels may run on this device at the same time: the
  // spinning grids of all of them must be resident together or they deadlock.
  // ep_size when the workspace is a plain tensor of one process.
  int co_resident_ranks;
  bool pdl_supported;  // compute capability >= 9.0: programmatic dependent launch exists
  // Flags and fences at system scope: some peer runs on another device or in
  // another process. False only when every rank runs on this device in this
  // process (a plain workspace tensor: simulated ranks), where gpu scope is
  // enough and much cheaper.
  bool system_scope;
  uint32_t timeout_ms;  // what a timeout record says: ops.h timeout_ms(sync.timeout_s)
};

// CTAs of every spinning kernel (dispatch, combine) that one multiprocessor
// of the current device holds at once: the minimum over those kernels, so
// that any mix of them fits. Host-only query; cache it per device.
cudaError_t query_ctas_per_sm(int* ctas_per_sm);

// Bytes of payload rows a CTA of a spinning kernel is given at least: a
// smaller call runs on fewer CTAs, because every CTA pays the grid's fixed
// costs (launch, its prologue, the fence of its release, polling) while a few tokens' rows take a
// CTA only a microsecond or two.
constexpr int64_t kMinBytesPerCta = 16 * 1024;

// CTAs of a spinning kernel's grid for `work_bytes` bytes of rows: one per
// kMinBytesPerCta, at least 1, and at most max(1, (num_sms * ctas_per_sm - 1)
// / co_resident_ranks), so that the grids of all co-resident ranks are
// resident at once.
int spinning_grid_size(const LaunchConfig& config, int64_t work_bytes);

// Zeroes the own row (cudaMemsetAsync) and writes its header config; epochs
// start at 0. Stream-ordered like the other launchers.
cudaError_t launch_initialize(const InitParams& p, cudaStream_t stream);

// One dispatch of the protocol (protocol.h). Payload rows go to the peers'
// planes, routes to the own route region, counts and flags to the peers'
// headers.
cudaError_t launch_dispatch(const DispatchParams& p, const LaunchConfig& config, cudaStream_t stream);

// One combine: stages p.payload into the own combine region (unless it is
// nullptr or already that region), exchanges flags, and writes
// p.output[t] = sum over the token's route of the destinations' rows.
cudaError_t launch_combine(const CombineParams& p, const LaunchConfig& config, cudaStream_t stream);

// expert_major_build (protocol.h, ExpertMajorLayout): one grid on `stream`
// that read and write the own row only.
cudaError_t launch_expert_major_build(const ExpertMajorBuildParams& p, const LaunchConfig& config, cudaStream_t stream);

// An expert-major dispatch: the rank-major dispatch of the user payloads,
// the ids and the weights (p) followed by the build (b), or for a small call
// one grid that writes each pair's row into its expert-major row directly.
cudaError_t launch_dispatch_expert_major(const DispatchParams& p, const ExpertMajorBuildParams& b,
                                         const LaunchConfig& config, cudaStream_t stream);

// The expert-major combine: combine's protocol, staging p.c.payload's valid
// rows and pulling every pair's weighted row through its rank's pair map.
cudaError_t launch_combine_expert_major(const ExpertMajorCombineParams& p, const LaunchConfig& config,
                                        cudaStream_t stream);

// Writes p.invalid_expert_id into the padding rows of the received
// [ep_size, T, top_k] int32 plane at p.offset of the own row.
cudaError_t launch_sanitize(const SanitizeParams& p, const LaunchConfig& config, cudaStream_t stream);

}  // namespace gpu
}  // namespace moe_a2a
