// What a bare dispatch-shaped copy reaches on this GPU: the ceiling that the
// dispatch kernel's bandwidth is compared with (docs/performance.md, 'The
// dispatch pattern's own ceiling'). A standalone
// CUDA program (no torch, no protocol; the kernels' L2-hint accesses come from
// csrc/cuda/device.cuh): `nvcc -O3 -std=c++17 -arch=sm_90
// benchmarks/fanout_ceiling.cu -o build/fanout_ceiling`; scripts/gpu_check.sh
// builds and runs it in its bench stage.
//
// The pattern is dispatch's at ep 8 with DeepSeek-V3 rows: 8 ranks x 4096
// tokens of 14336 bytes, each token written to the distinct ranks owning 8 of
// 256 experts (about 5.29 destinations, drawn like the benchmark's routing),
// at destination slot [source rank][running count], as protocol.h lays the
// planes out. Every variant moves the same bytes (one read per token, one
// write per destination); the copy kernels' rates are the reference.
// Variants: register stores in 2 KB segments with each CTA owning a contiguous
// chunk of its rank's tokens (dispatch's order) or all tasks interleaved over
// the grid; the same order with only its writes or only its reads (which part
// of the pattern costs); one grid per rank on a stream per rank, as the
// simulated ranks run, with static chunks or with tasks claimed from a
// per-rank counter (the best balance a rank's own grid can reach), in CTAs of
// 512 threads two to an SM (the kernels' shape) or of 1024 threads one to an
// SM (no SM shared by two ranks); the claimed grids with the large dispatches'
// L2 policies (loads evict-last, stores evict-first: copy_segment's kL2Hints),
// and with every destination row at 128 mod 256 bytes (what 128-byte aligned
// planes gave half the ranks); TMA bulk loads into shared memory and bulk
// stores from it.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "../csrc/cuda/device.cuh"
#include "cuda_check.h"

namespace {

using moe_a2a::gpu::l2_policy_evict_first;
using moe_a2a::gpu::l2_policy_evict_last;
using moe_a2a::gpu::ld_global_l2_hint;
using moe_a2a::gpu::st_global_l2_hint;

constexpr int kRanks = 8;
constexpr int kTokens = 4096;  // per rank
constexpr int kExperts = 256;
constexpr int kTopK = 8;
constexpr int kRowBytes = 14336;  // 7168 bf16
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kCtasPerSm = 2;
constexpr int kUnroll = 4;                        // uint4 per lane per segment
constexpr int kSegmentBytes = 32 * 16 * kUnroll;  // 2 KB, as dispatch's copies
constexpr int kSegments = kRowBytes / kSegmentBytes;
static_assert(kRowBytes % kSegmentBytes == 0, "whole segments per row");
constexpr size_t kCeilingBytes = size_t(2) << 30;  // buffers of the copy and write-only rates
constexpr int kReps = 10;
constexpr size_t kMisalignBytes = 128;  // a row shift: 128-byte aligned, not 256

// Route entry: destination row index (rank * kRanks * kTokens + slot), -1 ends.
using Entry = int32_t;

__global__ void copy_kernel(uint4* dst, const uint4* src, size_t n) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    dst[i] = src[i];
  }
}

__global__ void fill_kernel(uint4* dst, size_t n) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    dst[i] = make_uint4(1, 2, 3, 4);
  }
}

// What a fan-out task moves: the row segment to every destination, or only
// the stores (of made-up data) or only the loads (kept alive by a store that
// depends on them and never happens for this data).
enum class Moves { kCopy, kWritesOnly, kReadsOnly };

// The stores of a fan-out task: vector v[u] of every lane to each destination
// (kL2Hints: with the large dispatches' evict-first policy).
template <bool kL2Hints>
__device__ __forceinline__ void fan_stores(uint8_t* dst, const Entry* routes, long token, int segment, int lane,
                                           const uint4 (&v)[kUnroll]) {
  Entry e[kRanks];
#pragma unroll
  for (int j = 0; j < kRanks; ++j) e[j] = routes[token * kRanks + j];
#pragma unroll
  for (int j = 0; j < kRanks; ++j) {
    if (e[j] < 0) break;
    uint4* to = reinterpret_cast<uint4*>(dst + size_t(e[j]) * kRowBytes + segment * kSegmentBytes);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if constexpr (kL2Hints) {
        st_global_l2_hint(to + lane + 32 * u, v[u], l2_policy_evict_first());
      } else {
        to[lane + 32 * u] = v[u];
      }
    }
  }
}

// Task `task` of the fan-out (token task / kSegments of all ranks' tokens,
// segment task % kSegments), by the 32 lanes of a warp. kL2Hints: loads and
// stores with the large dispatches' L2 policies.
template <Moves kMoves, bool kL2Hints = false>
__device__ __forceinline__ void fan_task(const uint8_t* src, uint8_t* dst, const Entry* routes, long task, int lane) {
  const long token = task / kSegments;
  const int segment = task % kSegments;
  const uint4* from = reinterpret_cast<const uint4*>(src + token * kRowBytes + segment * kSegmentBytes);
  uint4 v[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if constexpr (kMoves == Moves::kWritesOnly) {
      v[u] = make_uint4(uint32_t(token), segment, lane, u);
    } else if constexpr (kL2Hints) {
      v[u] = ld_global_l2_hint(from + lane + 32 * u, l2_policy_evict_last());
    } else {
      v[u] = from[lane + 32 * u];
    }
  }
  if constexpr (kMoves == Moves::kReadsOnly) {
    uint32_t x = 0;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    if (x == 0x9e3779b9u) dst[token] = 1;
  } else {
    fan_stores<kL2Hints>(dst, routes, token, segment, lane, v);
  }
}

// The contiguous chunk [begin, stop) of a rank's tokens that CTA `cta` of
// `ctas` owns, as the dispatch kernel splits them.
struct Chunk {
  long begin, stop;
};
__device__ __forceinline__ Chunk token_chunk(int cta, int ctas) {
  const long chunk = (kTokens + ctas - 1) / ctas;
  const long begin = cta * chunk < kTokens ? cta * chunk : kTokens;
  return {begin, begin + chunk < kTokens ? begin + chunk : kTokens};
}

// Register fan-out, one grid for all ranks. chunked: CTA c of rank r owns a
// contiguous chunk of r's tokens and its warps take the chunk's (token,
// segment) tasks in order (the dispatch kernel's step 3); else all tasks of
// all ranks interleave over all warps.
template <Moves kMoves>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    fanout_registers(const uint8_t* src, uint8_t* dst, const Entry* routes, bool chunked) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int ctas_per_rank = gridDim.x / kRanks;
  long first, stride, end, base = 0;
  if (chunked) {
    const int rank = blockIdx.x / ctas_per_rank;
    const Chunk c = token_chunk(blockIdx.x % ctas_per_rank, ctas_per_rank);
    base = (long(rank) * kTokens + c.begin) * kSegments;
    first = warp;
    stride = kWarps;
    end = (c.stop - c.begin) * kSegments;
  } else {
    first = long(blockIdx.x) * kWarps + warp;
    stride = long(gridDim.x) * kWarps;
    end = long(kRanks) * kTokens * kSegments;
  }
  for (long task = first; task < end; task += stride) {
    fan_task<kMoves>(src, dst, routes, base + task, lane);
  }
}

// One rank's grid (rank `rank`'s tokens only) of kRankThreads-thread CTAs,
// 1024 / kRankThreads of them per SM. claims == nullptr: CTA c owns chunk c,
// as the dispatch. Else a warp takes its first task by index and claims each
// later one from claims[rank], the claim issued before the copy.
template <int kRankThreads, bool kL2Hints = false>
__global__ void __launch_bounds__(kRankThreads, 1024 / kRankThreads)
    fanout_rank(const uint8_t* src, uint8_t* dst, const Entry* routes, int rank, unsigned* claims) {
  constexpr int kRankWarps = kRankThreads / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const long base = long(rank) * kTokens * kSegments;
  if (claims == nullptr) {
    const Chunk c = token_chunk(blockIdx.x, gridDim.x);
    for (long task = c.begin * kSegments + warp; task < c.stop * kSegments; task += kRankWarps) {
      fan_task<Moves::kCopy>(src, dst, routes, base + task, lane);
    }
    return;
  }
  const long first_round = long(gridDim.x) * kRankWarps;
  for (long task = long(blockIdx.x) * kRankWarps + warp; task < long(kTokens) * kSegments;) {
    unsigned claimed = 0;
    if (lane == 0) claimed = atomicAdd(claims + rank, 1u);
    fan_task<Moves::kCopy, kL2Hints>(src, dst, routes, base + task, lane);
    task = first_round + __shfl_sync(0xffffffffu, claimed, 0);
  }
}

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// TMA fan-out: lane 0 of each warp streams its tasks through kBuffers shared
// buffers of one segment: a bulk load (mbarrier completion), then one bulk
// store per destination; a buffer is refilled once the stores that read it
// are done reading (bulk_group accounting), keeping kBuffers - 1 loads in flight.
template <int kBuffers>
__global__ void fanout_tma(const uint8_t* src, uint8_t* dst, const Entry* routes) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t barriers[kWarps][kBuffers];
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 != 0) return;
  uint8_t* buffers = smem + size_t(warp) * kBuffers * kSegmentBytes;
  for (int b = 0; b < kBuffers; ++b) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_address(&barriers[warp][b])) : "memory");
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const long stride = long(gridDim.x) * kWarps;
  const long total = long(kRanks) * kTokens * kSegments;
  const long first = long(blockIdx.x) * kWarps + warp;
  const auto load = [&](long k) {
    const long task = first + k * stride;
    if (task >= total) return;
    const int b = k % kBuffers;
    const uint8_t* from = src + (task / kSegments) * kRowBytes + (task % kSegments) * kSegmentBytes;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(&barriers[warp][b])),
                 "n"(kSegmentBytes)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_address(buffers + b * kSegmentBytes)),
                 "l"(from), "n"(kSegmentBytes), "r"(smem_address(&barriers[warp][b]))
                 : "memory");
  };
  for (int k = 0; k < kBuffers; ++k) load(k);
  for (long k = 0; first + k * stride < total; ++k) {
    const long task = first + k * stride;
    const long token = task / kSegments;
    const int segment = task % kSegments;
    const int b = k % kBuffers;
    uint32_t ready = 0;
    while (!ready) {
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(ready)
                   : "r"(smem_address(&barriers[warp][b])), "r"(uint32_t(k / kBuffers) & 1)
                   : "memory");
    }
    for (int j = 0; j < kRanks; ++j) {
      const Entry e = routes[token * kRanks + j];
      if (e < 0) break;
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + size_t(e) * kRowBytes +
                                                                                       segment * kSegmentBytes),
                   "r"(smem_address(buffers + b * kSegmentBytes)), "n"(kSegmentBytes)
                   : "memory");
    }
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (k >= 1) {
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");  // task k - 1's stores read their buffer
      load(k - 1 + kBuffers);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

template <typename Launch>
float median_ms(Launch launch) {
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  launch();
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<float> ms(kReps);
  for (float& m : ms) {
    CHECK(cudaEventRecord(start));
    launch();
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    CHECK(cudaEventElapsedTime(&m, start, stop));
  }
  CHECK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  return ms[kReps / 2];
}

}  // namespace

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major < 9) {
    std::printf("fanout_ceiling: needs sm_90 or newer (TMA bulk copies); this is sm_%d%d\n", prop.major, prop.minor);
    return 0;
  }

  // Reference rates on large buffers.
  uint8_t *a = nullptr, *b = nullptr;
  CHECK(cudaMalloc(&a, kCeilingBytes));
  CHECK(cudaMalloc(&b, kCeilingBytes));
  CHECK(cudaMemset(a, 1, kCeilingBytes));
  const size_t vectors = kCeilingBytes / sizeof(uint4);
  const double memcpy_gbps = 2.0 * kCeilingBytes /
                             median_ms([&] { CHECK(cudaMemcpyAsync(b, a, kCeilingBytes, cudaMemcpyDeviceToDevice)); }) /
                             1e6;
  std::printf("%-48s %8.1f GB/s   1.000 x copy\n", "copy (cudaMemcpy D2D, read + write)", memcpy_gbps);
  const auto report = [&](const char* what, double gbps) {
    std::printf("%-48s %8.1f GB/s   %.3f x copy\n", what, gbps, gbps / memcpy_gbps);
  };
  report("copy kernel (uint4 per thread)", 2.0 * kCeilingBytes / median_ms([&] {
                                             copy_kernel<<<sms * 8, 256>>>((uint4*)b, (const uint4*)a, vectors);
                                           }) / 1e6);
  report("write only (uint4 stores)",
         1.0 * kCeilingBytes / median_ms([&] { fill_kernel<<<sms * 8, 256>>>((uint4*)b, vectors); }) / 1e6);
  report("write only (cudaMemset)",
         1.0 * kCeilingBytes / median_ms([&] { CHECK(cudaMemsetAsync(b, 3, kCeilingBytes)); }) / 1e6);
  CHECK(cudaFree(b));

  // Routing: top-8 of 256 experts per token, 32 experts per rank.
  std::mt19937 gen(0);
  std::vector<Entry> routes(size_t(kRanks) * kTokens * kRanks, -1);
  long entries = 0;
  for (int s = 0; s < kRanks; ++s) {
    std::vector<int> next(kRanks, 0);
    for (int t = 0; t < kTokens; ++t) {
      std::vector<int> experts(kExperts);
      for (int e = 0; e < kExperts; ++e) experts[e] = e;
      std::shuffle(experts.begin(), experts.end(), gen);
      bool to[kRanks] = {};
      for (int k = 0; k < kTopK; ++k) to[experts[k] / (kExperts / kRanks)] = true;
      int j = 0;
      for (int d = 0; d < kRanks; ++d) {
        if (!to[d]) continue;
        routes[(size_t(s) * kTokens + t) * kRanks + j++] = d * kRanks * kTokens + s * kTokens + next[d]++;
        ++entries;
      }
    }
  }
  const size_t tokens = size_t(kRanks) * kTokens;
  const size_t dst_rows = size_t(kRanks) * kRanks * kTokens;
  const double moved = double(tokens + entries) * kRowBytes;
  std::printf("dispatch pattern: %d ranks x %d tokens x %d B, %.3f destinations per token, %.2f GB per call\n", kRanks,
              kTokens, kRowBytes, double(entries) / tokens, moved / 1e9);
  Entry* d_routes = nullptr;
  uint8_t* dst = nullptr;
  CHECK(cudaMalloc(&d_routes, routes.size() * sizeof(Entry)));
  CHECK(cudaMemcpy(d_routes, routes.data(), routes.size() * sizeof(Entry), cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&dst, dst_rows * kRowBytes + kMisalignBytes));

  // Distinct source rows, so that a misplaced row fails the check below.
  std::vector<uint8_t> host(tokens * kRowBytes);
  for (size_t i = 0; i < host.size(); ++i) host[i] = uint8_t((i / 64) * 131 + i);
  CHECK(cudaMemcpy(a, host.data(), host.size(), cudaMemcpyHostToDevice));
  const auto check = [&](const char* what, size_t shift = 0) {
    std::vector<uint8_t> row(kRowBytes);
    for (int i = 0; i < 256; ++i) {
      const size_t t = gen() % tokens;
      const Entry e = routes[t * kRanks + gen() % 2];  // every token has one destination at least
      if (e < 0) continue;
      CHECK(cudaMemcpy(row.data(), dst + shift + size_t(e) * kRowBytes, kRowBytes, cudaMemcpyDeviceToHost));
      if (!std::equal(row.begin(), row.end(), host.begin() + t * kRowBytes)) {
        std::printf("%s: token %zu misplaced at destination row %d\n", what, t, e);
        std::exit(1);
      }
    }
    CHECK(cudaMemset(dst, 0, dst_rows * kRowBytes + kMisalignBytes));
  };

  const int grid = kRanks * (sms * kCtasPerSm / kRanks);  // whole CTAs per rank, as the resident grids
  for (const bool chunked : {true, false}) {
    const float ms = median_ms([&] { fanout_registers<Moves::kCopy><<<grid, kThreads>>>(a, dst, d_routes, chunked); });
    report(chunked ? "fan-out, registers, chunk per CTA (dispatch)" : "fan-out, registers, interleaved",
           moved / ms / 1e6);
    check("fan-out registers");
  }
  // The two halves of the chunked pattern alone (each rate counts only the bytes it moves).
  report("  its writes only (no loads)", double(entries) * kRowBytes / median_ms([&] {
                                           fanout_registers<Moves::kWritesOnly>
                                               <<<grid, kThreads>>>(a, dst, d_routes, true);
                                         }) / 1e6);
  report("  its reads only (no stores)",
         double(tokens) * kRowBytes /
             median_ms([&] { fanout_registers<Moves::kReadsOnly><<<grid, kThreads>>>(a, dst, d_routes, true); }) / 1e6);
  {
    // A grid per rank on a stream per rank, as many CTAs as the dispatch's
    // resident grids get (spinning_grid_size: (sms * ctas per SM - 1) / ranks):
    // CTAs of kThreads, kCtasPerSm to an SM (an SM then runs CTAs of two
    // ranks), or of 1024 threads, one to an SM (an SM runs one rank's warps).
    unsigned* claims = nullptr;
    CHECK(cudaMalloc(&claims, kRanks * sizeof(unsigned)));
    cudaStream_t streams[kRanks];
    cudaEvent_t fork, joins[kRanks];
    CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    for (int r = 0; r < kRanks; ++r) {
      CHECK(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
      CHECK(cudaEventCreateWithFlags(&joins[r], cudaEventDisableTiming));
    }
    const auto per_rank_grids = [&](bool claimed, bool whole_sm, size_t shift = 0, bool hints = false) {
      CHECK(cudaMemsetAsync(claims, 0, kRanks * sizeof(unsigned)));
      CHECK(cudaEventRecord(fork));
      for (int r = 0; r < kRanks; ++r) {
        CHECK(cudaStreamWaitEvent(streams[r], fork));
        unsigned* c = claimed ? claims : nullptr;
        if (whole_sm) {
          fanout_rank<1024><<<(sms - 1) / kRanks, 1024, 0, streams[r]>>>(a, dst + shift, d_routes, r, c);
        } else if (hints) {
          fanout_rank<kThreads, true>
              <<<(sms * kCtasPerSm - 1) / kRanks, kThreads, 0, streams[r]>>>(a, dst + shift, d_routes, r, c);
        } else {
          fanout_rank<kThreads>
              <<<(sms * kCtasPerSm - 1) / kRanks, kThreads, 0, streams[r]>>>(a, dst + shift, d_routes, r, c);
        }
        CHECK(cudaEventRecord(joins[r], streams[r]));
        CHECK(cudaStreamWaitEvent(0, joins[r]));
      }
    };
    for (const bool whole_sm : {false, true}) {
      for (const bool claimed : {false, true}) {
        const char* label = whole_sm ? (claimed ? "fan-out, a grid per rank, 1 CTA/SM, claimed per rank"
                                                : "fan-out, a grid per rank, 1 CTA/SM, chunk per CTA")
                                     : (claimed ? "fan-out, a grid per rank, tasks claimed per rank"
                                                : "fan-out, a grid per rank, chunk per CTA");
        report(label, moved / median_ms([&] { per_rank_grids(claimed, whole_sm); }) / 1e6);
        check("fan-out per rank");
      }
    }
    // The library's large dispatches copy with these policies (copy_segment's kL2Hints).
    report("fan-out, a grid per rank, claimed, L2 hints (dispatch)",
           moved / median_ms([&] { per_rank_grids(true, false, 0, true); }) / 1e6);
    check("fan-out per rank, L2 hints");
    // Every destination row at 128 mod 256 bytes (the library's planes start
    // kPlaneAlign-aligned because of this row).
    report("fan-out, a grid per rank, claimed, rows at 128 mod 256 B",
           moved / median_ms([&] { per_rank_grids(true, false, kMisalignBytes); }) / 1e6);
    check("fan-out per rank, shifted rows", kMisalignBytes);
    for (int r = 0; r < kRanks; ++r) {
      CHECK(cudaStreamDestroy(streams[r]));
      CHECK(cudaEventDestroy(joins[r]));
    }
    CHECK(cudaEventDestroy(fork));
    CHECK(cudaFree(claims));
  }
  {
    constexpr int kBuffers = 4;
    const int smem = kWarps * kBuffers * kSegmentBytes;
    CHECK(cudaFuncSetAttribute(fanout_tma<kBuffers>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const float ms = median_ms([&] { fanout_tma<kBuffers><<<sms, kThreads, smem>>>(a, dst, d_routes); });
    report("fan-out, TMA bulk load + bulk stores", moved / ms / 1e6);
    check("fan-out TMA");
  }
  CHECK(cudaFree(a));
  CHECK(cudaFree(dst));
  CHECK(cudaFree(d_routes));
  return 0;
}
