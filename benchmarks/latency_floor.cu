// What one flag exchange between simulated ranks costs on this GPU, measured
// the way `bench --graph all-ranks` measures the ops: the floor under the
// decode latency of any one-sided all-to-all on one GPU
// (docs/performance.md, 'What limits the decode latency'). A standalone CUDA
// program (no torch, no protocol code; the flag accesses come from
// csrc/cuda/device.cuh): `nvcc -O3 -std=c++17 -arch=sm_90
// benchmarks/latency_floor.cu -o build/latency_floor`; scripts/gpu_check.sh
// builds and runs it in its bench stage.
//
// Per ep in {1, 2, 4, 8}: one CUDA graph whose root node forks a branch per
// rank (a stream each) and joins them, as the benchmark's graphs do; each
// replay is timed with events behind a spin kernel, median of kReplays. The
// branch of every rank runs one CTA of 512 threads (the kernels' shape) of:
//   empty  nothing: the launch floor of the graph shape;
//   flag   one release add to every rank's flag word, then an acquire spin
//          until every rank's flag for this call arrived: the least that a
//          call that waits for its peers pays;
//   row    one 14336-byte row (DeepSeek-V3's hidden state) loaded from a
//          buffer larger than the L2, a row per call, and stored into the
//          next rank's buffer, then the flag exchange: the least a one-token
//          dispatch to one destination pays;
//   pull   a one-token combine whose token every rank holds, as the library
//          combines: the own row loaded (as in `row`) and staged into the own
//          buffer, the flag exchange, then every rank's staged row loaded
//          (all in flight together), summed and stored;
//   ll     the same combine by flag-in-data words (NCCL's LL protocol): each
//          8-byte word carries 4 data bytes and the call number, stored
//          straight into every rank's receive slot; the receiver polls the
//          words themselves, sums and stores. No flag, no fence; two CTAs
//          (kLlCtas), as one CTA's loads in flight would spill;
// and the same shapes with two kernels per branch (a round trip's launch
// floor, two flag exchanges). Each kernel reads its call number from its
// rank's own word and writes it back, as the library's epochs do.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../csrc/cuda/device.cuh"
#include "cuda_check.h"

namespace {

using moe_a2a::gpu::ld_acquire_gpu;
using moe_a2a::gpu::red_release_add;

constexpr int kMaxRanks = 8;
constexpr int kThreads = 512;
constexpr int kRowBytes = 14336;
constexpr int kRowVectors = kRowBytes / 16;
// Rows the loads cycle through: 256 MiB, over twice the H200's 50 MB L2.
constexpr int64_t kSourceRows = (int64_t(256) << 20) / kRowBytes;
constexpr int kWarmup = 10;
constexpr int kReplays = 200;
constexpr int64_t kSpinNs = 50000;  // the head start of each timed replay

struct Ranks {
  uint32_t* flags;   // [rank][source]: calls of source that reached rank
  uint32_t* calls;   // [cta][rank]: the rank's own call count (the ll kernel's CTA 1: its own)
  const uint4* src;  // [kSourceRows][kRowVectors]
  uint4* dst;        // [rank][kRowVectors]
  uint4* out;        // [rank][kRowVectors]: the combines' sums
  // [call & 1][rank][source][kRowVectors * 2]: LL words, two a 16-byte store.
  // Two buffers: a rank writes call n + 2 only after it received every
  // rank's call n + 1, which each sent after it finished reading call n.
  ulonglong2* ll;
  int ep;
};

__global__ void spin_kernel(int64_t ns) {
  const uint64_t start = moe_a2a::gpu::global_timer_ns();
  while (moe_a2a::gpu::global_timer_ns() - start < uint64_t(ns)) {
  }
}

__global__ void empty_kernel() {}

// Thread q < ep adds this rank's call to rank q's flag word, then waits for
// rank q's call in the own one; thread 0 stores the call number last.
__device__ void exchange_flags(const Ranks& r, int rank, uint32_t call) {
  const int q = threadIdx.x;
  if (q < r.ep) {
    red_release_add(&r.flags[q * kMaxRanks + rank], 1u, false);
    const uint32_t* word = &r.flags[rank * kMaxRanks + q];
    while (int32_t(ld_acquire_gpu(word) - call) < 0) {
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) r.calls[rank] = call;
}

__global__ void flag_kernel(const Ranks r, int rank) { exchange_flags(r, rank, r.calls[rank] + 1); }

__global__ void row_kernel(const Ranks r, int rank) {
  const uint32_t call = r.calls[rank] + 1;
  const uint4* row = r.src + (int64_t(call) * r.ep + rank) % kSourceRows * kRowVectors;
  uint4* out = r.dst + int64_t((rank + 1) % r.ep) * kRowVectors;
  for (int v = threadIdx.x; v < kRowVectors; v += kThreads) out[v] = row[v];
  __syncthreads();
  exchange_flags(r, rank, call);
}

// Vectors of the row a thread handles in the combines: at most two.
constexpr int kVectorsPerThread = (kRowVectors + kThreads - 1) / kThreads;
static_assert(kVectorsPerThread == 2, "the combines' loops assume two vectors a thread");

__device__ __forceinline__ uint4 add4(uint4 a, uint4 b) { return {a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w}; }

__global__ void __launch_bounds__(kThreads, 1) pull_kernel(const Ranks r, int rank) {
  const uint32_t call = r.calls[rank] + 1;
  const uint4* row = r.src + (int64_t(call) * r.ep + rank) % kSourceRows * kRowVectors;
  for (int v = threadIdx.x; v < kRowVectors; v += kThreads) r.dst[int64_t(rank) * kRowVectors + v] = row[v];
  __syncthreads();
  exchange_flags(r, rank, call);
  uint4 x[kVectorsPerThread][kMaxRanks];
#pragma unroll
  for (int i = 0; i < kVectorsPerThread; ++i) {
    const int v = threadIdx.x + i * kThreads;
#pragma unroll
    for (int q = 0; q < kMaxRanks; ++q) {
      x[i][q] = q < r.ep && v < kRowVectors ? r.dst[int64_t(q) * kRowVectors + v] : uint4{0, 0, 0, 0};
    }
  }
#pragma unroll
  for (int i = 0; i < kVectorsPerThread; ++i) {
    const int v = threadIdx.x + i * kThreads;
    uint4 sum{0, 0, 0, 0};
#pragma unroll
    for (int q = 0; q < kMaxRanks; ++q) sum = add4(sum, x[i][q]);
    if (v < kRowVectors) r.out[int64_t(rank) * kRowVectors + v] = sum;
  }
}

__device__ __forceinline__ void st_volatile_v2(ulonglong2* p, uint64_t a, uint64_t b) {
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}

__device__ __forceinline__ ulonglong2 ld_volatile_v2(const ulonglong2* p) {
  ulonglong2 v;
  asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t ll_word(uint32_t data, uint32_t call) { return uint64_t(call) << 32 | data; }

// Two CTAs, a vector of the row a thread (one CTA's loads in flight would
// need more registers than a thread has); each CTA counts its calls in a word
// of its own.
constexpr int kLlCtas = 2;
static_assert(kLlCtas * kThreads >= kRowVectors, "a vector a thread");

__global__ void __launch_bounds__(kThreads, 1) ll_kernel(const Ranks r, int rank) {
  uint32_t* calls = r.calls + kMaxRanks * blockIdx.x + rank;
  const uint32_t call = *calls + 1;
  const uint4* row = r.src + (int64_t(call) * r.ep + rank) % kSourceRows * kRowVectors;
  const int v = blockIdx.x * kThreads + threadIdx.x;
  if (v < kRowVectors) {
    // Send: a 16-byte vector is two LL stores into every rank's slot of this rank.
    const uint4 x = row[v];
    for (int q = 0; q < r.ep; ++q) {
      ulonglong2* slot = r.ll + ((int64_t(call & 1) * kMaxRanks + q) * kMaxRanks + rank) * kRowVectors * 2;
      st_volatile_v2(slot + 2 * v, ll_word(x.x, call), ll_word(x.y, call));
      st_volatile_v2(slot + 2 * v + 1, ll_word(x.z, call), ll_word(x.w, call));
    }
    // Receive: every word of every source loaded, then those not yet of this
    // call loaded again, until all are.
    ulonglong2 w[kMaxRanks][2];
    uint32_t pending = 0;  // bit q * 2 + h
#pragma unroll
    for (int q = 0; q < kMaxRanks; ++q) pending |= q < r.ep ? 3u << (2 * q) : 0u;
    while (pending != 0) {
#pragma unroll
      for (int q = 0; q < kMaxRanks; ++q) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (pending >> (2 * q + h) & 1u) {
            w[q][h] = ld_volatile_v2(r.ll + ((int64_t(call & 1) * kMaxRanks + rank) * kMaxRanks + q) * kRowVectors * 2 +
                                     2 * v + h);
          }
        }
      }
#pragma unroll
      for (int q = 0; q < kMaxRanks; ++q) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (uint32_t(w[q][h].x >> 32) == call && uint32_t(w[q][h].y >> 32) == call) pending &= ~(1u << (2 * q + h));
        }
      }
    }
    uint4 sum{0, 0, 0, 0};
#pragma unroll
    for (int q = 0; q < kMaxRanks; ++q) {
      if (q < r.ep) {
        sum = add4(sum, uint4{uint32_t(w[q][0].x), uint32_t(w[q][0].y), uint32_t(w[q][1].x), uint32_t(w[q][1].y)});
      }
    }
    r.out[int64_t(rank) * kRowVectors + v] = sum;
  }
  __syncthreads();
  if (threadIdx.x == 0) *calls = call;
}

enum class Kind { kEmpty, kFlag, kRow, kPull, kLl };
const char* const kKindNames[] = {"empty", "flag", "row", "pull", "ll"};

void launch(Kind kind, const Ranks& r, int rank, cudaStream_t stream) {
  if (kind == Kind::kEmpty) empty_kernel<<<1, kThreads, 0, stream>>>();
  if (kind == Kind::kFlag) flag_kernel<<<1, kThreads, 0, stream>>>(r, rank);
  if (kind == Kind::kRow) row_kernel<<<1, kThreads, 0, stream>>>(r, rank);
  if (kind == Kind::kPull) pull_kernel<<<1, kThreads, 0, stream>>>(r, rank);
  if (kind == Kind::kLl) ll_kernel<<<kLlCtas, kThreads, 0, stream>>>(r, rank);
  CHECK(cudaGetLastError());
}

// The all-ranks graph: a root node, a branch per rank with `kernels`
// kernels of `kind`, joined back.
cudaGraphExec_t capture(Kind kind, int kernels, const Ranks& r, cudaStream_t main,
                        const std::vector<cudaStream_t>& streams, const std::vector<cudaEvent_t>& events) {
  cudaGraph_t graph;
  CHECK(cudaStreamBeginCapture(main, cudaStreamCaptureModeThreadLocal));
  empty_kernel<<<1, 1, 0, main>>>();
  CHECK(cudaEventRecord(events[0], main));
  for (int rank = 0; rank < r.ep; ++rank) {
    CHECK(cudaStreamWaitEvent(streams[rank], events[0]));
    for (int k = 0; k < kernels; ++k) launch(kind, r, rank, streams[rank]);
    CHECK(cudaEventRecord(events[1 + rank], streams[rank]));
    CHECK(cudaStreamWaitEvent(main, events[1 + rank]));
  }
  CHECK(cudaStreamEndCapture(main, &graph));
  cudaGraphExec_t exec;
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CHECK(cudaGraphDestroy(graph));
  return exec;
}

// Median us per replay of `exec`, each behind a head start.
double time_replays(cudaGraphExec_t exec, cudaStream_t main) {
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int i = 0; i < kWarmup + kReplays; ++i) {
    spin_kernel<<<1, 1, 0, main>>>(kSpinNs);
    CHECK(cudaEventRecord(start, main));
    CHECK(cudaGraphLaunch(exec, main));
    CHECK(cudaEventRecord(stop, main));
    CHECK(cudaEventSynchronize(stop));
    float t;
    CHECK(cudaEventElapsedTime(&t, start, stop));
    if (i >= kWarmup) ms.push_back(t);
  }
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return 1000.0 * ms[ms.size() / 2];
}

}  // namespace

int main() {
  int device;
  CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, device));
  std::printf("latency floor: %s, %d SMs; us per replay of an all-ranks graph, median of %d\n", prop.name,
              prop.multiProcessorCount, kReplays);
  Ranks r{};
  CHECK(cudaMalloc(&r.flags, sizeof(uint32_t) * kMaxRanks * kMaxRanks));
  CHECK(cudaMalloc(&r.calls, sizeof(uint32_t) * kMaxRanks * 2));
  uint4* src;
  CHECK(cudaMalloc(&src, size_t(kSourceRows) * kRowBytes));
  CHECK(cudaMemset(src, 1, size_t(kSourceRows) * kRowBytes));
  r.src = src;
  CHECK(cudaMalloc(&r.dst, size_t(kMaxRanks) * kRowBytes));
  CHECK(cudaMalloc(&r.out, size_t(kMaxRanks) * kRowBytes));
  const size_t ll_bytes = size_t(2) * kMaxRanks * kMaxRanks * kRowBytes * 2;
  CHECK(cudaMalloc(&r.ll, ll_bytes));
  cudaStream_t main;
  CHECK(cudaStreamCreateWithFlags(&main, cudaStreamNonBlocking));
  std::vector<cudaStream_t> streams(kMaxRanks);
  std::vector<cudaEvent_t> events(kMaxRanks + 1);
  for (auto& s : streams) CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (auto& e : events) CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));

  std::printf("%-4s %-8s %10s %10s %12s %12s\n", "ep", "kernel", "1 kernel", "above", "2 kernels", "above");
  for (int ep : {1, 2, 4, 8}) {
    r.ep = ep;
    double floor[2] = {0, 0};
    for (Kind kind : {Kind::kEmpty, Kind::kFlag, Kind::kRow, Kind::kPull, Kind::kLl}) {
      // Every graph starts from zeroed words: each counts its own calls (the
      // LL words' call numbers start above 0, so zeroed words are stale).
      CHECK(cudaMemset(r.flags, 0, sizeof(uint32_t) * kMaxRanks * kMaxRanks));
      CHECK(cudaMemset(r.calls, 0, sizeof(uint32_t) * kMaxRanks * 2));
      CHECK(cudaMemset(r.ll, 0, ll_bytes));
      double us[2];
      for (int kernels = 1; kernels <= 2; ++kernels) {
        cudaGraphExec_t exec = capture(kind, kernels, r, main, streams, events);
        us[kernels - 1] = time_replays(exec, main);
        CHECK(cudaGraphExecDestroy(exec));
      }
      if (kind == Kind::kEmpty) std::copy(us, us + 2, floor);
      std::printf("%-4d %-8s %10.2f %10.2f %12.2f %12.2f\n", ep, kKindNames[int(kind)], us[0], us[0] - floor[0], us[1],
                  us[1] - floor[1]);
    }
  }
  CHECK(cudaDeviceSynchronize());
  return 0;
}
