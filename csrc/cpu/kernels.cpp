// CPU kernels: the protocol of protocol.h on host memory (see kernels.h).
//
// Memory ordering: payload rows, EPLB rows and receive counts are written with
// plain stores; the flag that announces them is written with a release store
// after them, and readers acquire-load the flag before reading. at::parallel_for
// joins its workers before returning, so the workers' copies happen before the
// calling thread's release store. The __atomic builtins act on the workspace
// words themselves, which is what makes a shared-memory mapping between
// processes work as well as threads of one process.
#include "kernels.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <sstream>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "../ops.h"

namespace moe_a2a {
namespace cpu {
namespace {

// Bytes a parallel_for chunk should move at least: smaller inputs run on the
// calling thread, where a thread hand-off would cost more than the copy.
constexpr int64_t kParallelGrainBytes = 64 * 1024;

// Backoff of a wait: spin (peers usually arrive within microseconds), then
// yield, then sleep with a doubling interval so that many simulated ranks on
// few cores leave the CPU to the peers they wait for.
constexpr int kSpinRounds = 256;
constexpr int kYieldRounds = 64;
constexpr std::chrono::microseconds kFirstSleep{20};
constexpr std::chrono::microseconds kMaxSleep{1000};
// How often a sleeping wait asks InterruptHooks::pending: Ctrl-C ends it
// within about this long, at the cost of taking the GIL that often.
constexpr std::chrono::milliseconds kInterruptCheckInterval{20};

std::atomic<bool (*)()> g_interrupt_pending{nullptr};
std::atomic<void (*)(const std::string&)> g_interrupt_raise{nullptr};

template <typename T>
T load(const uint8_t* row, int64_t offset) {
  T value;
  std::memcpy(&value, row + offset, sizeof(T));
  return value;
}

template <typename T>
void store(uint8_t* row, int64_t offset, T value) {
  std::memcpy(row + offset, &value, sizeof(T));
}

uint32_t* flag_word(uint8_t* row, int64_t flags_offset, int rank) {
  return reinterpret_cast<uint32_t*>(row + flags_offset + int64_t(sizeof(uint32_t)) * rank);
}

int64_t grain_for(int64_t bytes_per_item) {
  return std::max<int64_t>(1, kParallelGrainBytes / std::max<int64_t>(1, bytes_per_item));
}

// The combines' staging: rows [0, count) of the block at byte `offset`, from
// src to dst, `row_bytes` each.
void copy_rows(uint8_t* dst, const uint8_t* src, int64_t offset, int64_t count, int64_t row_bytes) {
  at::parallel_for(0, count, grain_for(row_bytes), [&](int64_t begin, int64_t end) {
    std::memcpy(dst + offset + begin * row_bytes, src + offset + begin * row_bytes,
                static_cast<size_t>((end - begin) * row_bytes));
  });
}

// Rank config the header must hold for this call; `eplb_n` < 0: not checked.
RowStatus check_config(const WorkspaceView& ws, int64_t max_num_tokens, int64_t eplb_n) {
  RowStatus st;
  const uint8_t* row = ws.row(ws.ep_rank);
  if (!row_initialized(load<uint64_t>(row, kHdrMagic))) {
    st.kind = RowStatus::kRuntimeError;
    st.message =
        "rank " + std::to_string(ws.ep_rank) + "'s row is not initialized: call moe_a2a_initialize on every rank first";
    return st;
  }
  const int32_t hdr_rank = load<int32_t>(row, kHdrEpRank);
  const int32_t hdr_size = load<int32_t>(row, kHdrEpSize);
  const int32_t hdr_max = load<int32_t>(row, kHdrMaxNumTokens);
  const int32_t hdr_eplb = load<int32_t>(row, kHdrEplbN);
  const bool same = hdr_rank == ws.ep_rank && hdr_size == ws.ep_size &&
                    (max_num_tokens < 0 || hdr_max == max_num_tokens) && (eplb_n < 0 || hdr_eplb == eplb_n);
  if (!same) {
    std::ostringstream os;
    os << "metainfo does not match the workspace: the call says (ep_rank=" << ws.ep_rank << ", ep_size=" << ws.ep_size;
    if (max_num_tokens >= 0) os << ", max_num_tokens=" << max_num_tokens;
    if (eplb_n >= 0) os << ", eplb_stats_num_experts=" << eplb_n;
    os << "), row " << ws.ep_rank << " was initialized with (ep_rank=" << hdr_rank << ", ep_size=" << hdr_size;
    if (max_num_tokens >= 0) os << ", max_num_tokens=" << hdr_max;
    if (eplb_n >= 0) os << ", eplb_stats_num_experts=" << hdr_eplb;
    os << ")";
    st.kind = RowStatus::kValueError;
    st.message = os.str();
    return st;
  }
  const uint32_t code = __atomic_load_n(reinterpret_cast<const uint32_t*>(row + kHdrErrorCode), __ATOMIC_ACQUIRE);
  if (code != kErrorNone) {
    st.kind = RowStatus::kFailed;
    st.record.code = code;
    for (int w = 0; w < kRankMaskWords; ++w) {
      st.record.missing[w] = load<uint64_t>(row, kHdrErrorMissing + int64_t(sizeof(uint64_t)) * w);
    }
    st.record.detail = load<uint32_t>(row, kHdrErrorDetail);
  }
  return st;
}

RowStatus runtime_error(const std::string& message) {
  RowStatus st;
  st.kind = RowStatus::kRuntimeError;
  st.message = message;
  return st;
}

// Sets the in-use bit of the own init word (protocol.h, dispatch step 0a).
void mark_in_use(uint8_t* own) {
  const uint64_t word = load<uint64_t>(own, kHdrMagic);
  __atomic_store_n(reinterpret_cast<uint64_t*>(own + kHdrMagic), word | kInitWordInUse, __ATOMIC_RELAXED);
}

// Records an error in the own header (code last, so a reader that sees the
// code sees the rest) and returns it: `peers` (kRankMaskWords words) and
// `detail` as kHdrErrorMissing and kHdrErrorDetail say. The row is in use
// from then on.
WaitResult record_error(const WorkspaceView& ws, ErrorCode code, const uint64_t* peers, uint32_t detail) {
  uint8_t* row = ws.row(ws.ep_rank);
  mark_in_use(row);
  WaitResult result{};
  result.code = code;
  result.detail = detail;
  for (int w = 0; w < kRankMaskWords; ++w) {
    result.missing[w] = peers[w];
    store<uint64_t>(row, kHdrErrorMissing + int64_t(sizeof(uint64_t)) * w, peers[w]);
  }
  store<uint32_t>(row, kHdrErrorDetail, detail);
  __atomic_store_n(reinterpret_cast<uint32_t*>(row + kHdrErrorCode), uint32_t(code), __ATOMIC_RELEASE);
  return result;
}

// Whether peer p's row holds an error record (a failed rank: protocol.h, kErrorPeerFailed).
bool peer_error_recorded(const WorkspaceView& ws, int p) {
  return __atomic_load_n(reinterpret_cast<const uint32_t*>(ws.row(p) + kHdrErrorCode), __ATOMIC_ACQUIRE) != kErrorNone;
}

// Waits until ready(p) holds for every active rank p, at most sync.timeout_s;
// once it has waited kPeerErrorCheckNs, a peer p != ep_rank not ready for
// which failed(p) holds ends it (kErrorPeerFailed; protocol.h).
template <typename Ready, typename Failed>
WaitResult wait_for_peers(const WorkspaceView& ws, const SyncParams& sync, Ready ready, ErrorCode code_on_timeout,
                          Failed failed_peer) {
  uint64_t pending[kRankMaskWords] = {};
  for (int p = 0; p < ws.ep_size; ++p) {
    if (rank_active(sync, p)) pending[p / 64] |= uint64_t(1) << (p % 64);
  }
  const auto start = std::chrono::steady_clock::now();
  auto sleep = kFirstSleep;
  auto next_interrupt_check = start + kInterruptCheckInterval;
  for (int round = 0;; ++round) {
    const auto now = std::chrono::steady_clock::now();
    const std::chrono::duration<double> waited = now - start;
    const bool look = waited.count() * 1e9 >= double(kPeerErrorCheckNs);
    bool any_pending = false;
    uint64_t failed[kRankMaskWords] = {};
    bool any_failed = false;
    for (int p = 0; p < ws.ep_size; ++p) {
      const uint64_t bit = uint64_t(1) << (p % 64);
      if (!(pending[p / 64] & bit)) continue;
      if (ready(p)) {
        pending[p / 64] &= ~bit;
      } else {
        any_pending = true;
        if (look && p != ws.ep_rank && failed_peer(p)) {
          failed[p / 64] |= bit;
          any_failed = true;
        }
      }
    }
    if (!any_pending) return WaitResult{};
    if (any_failed) return record_error(ws, kErrorPeerFailed, failed, code_on_timeout);
    if (waited.count() >= sync.timeout_s) {
      return record_error(ws, code_on_timeout, pending, timeout_ms(sync.timeout_s));
    }
    if (now >= next_interrupt_check) {
      next_interrupt_check = now + kInterruptCheckInterval;
      bool (*interrupt_pending)() = g_interrupt_pending.load(std::memory_order_acquire);
      if (interrupt_pending != nullptr && interrupt_pending()) {
        return record_error(ws, kErrorInterrupted, pending, code_on_timeout);
      }
    }
    if (round < kSpinRounds) continue;
    if (round < kSpinRounds + kYieldRounds) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, kMaxSleep);
  }
}

// Waits until the uint32 *word_of(p) reached `target` (wrap-safe) for every active rank p.
template <typename WordOf>
WaitResult wait_for_words(const WorkspaceView& ws, const SyncParams& sync, WordOf word_of, uint32_t target,
                          ErrorCode code_on_timeout) {
  return wait_for_peers(
      ws, sync, [&](int p) { return epoch_reached(__atomic_load_n(word_of(p), __ATOMIC_ACQUIRE), target); },
      code_on_timeout, [&](int p) { return peer_error_recorded(ws, p); });
}

// Waits for the flags[p] (at flags_offset) of the own header: call `epoch` of every peer complete.
WaitResult wait_for_own_flags(const WorkspaceView& ws, const SyncParams& sync, int64_t flags_offset, uint32_t epoch,
                              ErrorCode code_on_timeout) {
  uint8_t* own = ws.row(ws.ep_rank);
  return wait_for_words(
      ws, sync, [&](int p) { return flag_word(own, flags_offset, p); }, flag_target(epoch), code_on_timeout);
}

// The equal-T and equal-payloads checks (protocol.h) after dispatch step 4:
// every active peer's dispatch had this rank's T, and then its payloads (the
// acquired flags make their words visible); else the error of the first
// check that fails, naming the peers.
WaitResult check_peer_calls(const WorkspaceView& ws, const SyncParams& sync, const DispatchParams& p) {
  const uint8_t* own = ws.row(ws.ep_rank);
  uint64_t other_t[kRankMaskWords] = {}, other_payloads[kRankMaskWords] = {};
  bool any_t = false, any_payloads = false, any_round = false;
  for (int q = 0; q < ws.ep_size; ++q) {
    if (!rank_active(sync, q)) continue;
    if (load<int32_t>(own, peer_runtime_max_offset(q)) != p.runtime_max_tokens) {
      other_t[q / 64] |= uint64_t(1) << (q % 64);
      any_t = true;
    }
    const bool other_round = round_tags_differ(load<uint32_t>(own, peer_round_tag_offset(q)), p.round_tag);
    if (load<uint32_t>(own, peer_payloads_offset(q)) != p.payload_signature || other_round) {
      other_payloads[q / 64] |= uint64_t(1) << (q % 64);
      any_payloads = true;
      any_round = any_round || other_round;
    }
  }
  if (any_t) return record_error(ws, kErrorRuntimeMaxMismatch, other_t, static_cast<uint32_t>(p.runtime_max_tokens));
  if (any_payloads) {
    return record_error(ws, kErrorPayloadMismatch, other_payloads, any_round ? kPayloadMismatchBackwardRound : 0);
  }
  return WaitResult{};
}

// Publishes call `epoch` in flags[ep_rank] of every active rank's header: the
// whole call's shares at once (protocol.h: flags count shares), one writer.
void release_to_peers(const WorkspaceView& ws, const SyncParams& sync, int64_t flags_offset, uint32_t epoch) {
  for (int d = 0; d < ws.ep_size; ++d) {
    if (!rank_active(sync, d)) continue;
    __atomic_store_n(flag_word(ws.row(d), flags_offset, ws.ep_rank), flag_target(epoch), __ATOMIC_RELEASE);
  }
}

// Combine step 2 (protocol.h): the call's combine_signature into
// signatures[count & 1][own rank] of every active rank's header, then the
// release of the combine flags, which orders those stores.
void release_combine(const CombineParams& p, uint32_t count) {
  const WorkspaceView& ws = p.ws;
  for (int d = 0; d < ws.ep_size; ++d) {
    if (rank_active(p.sync, d)) store<uint32_t>(ws.row(d), combine_signature_offset(count, ws.ep_rank), p.signature);
  }
  release_to_peers(ws, p.sync, kHdrCombineFlags, count);
}

// The equal-rows check (protocol.h) after combine step 3: every active
// peer's combine `count` had this call's rows (the acquired flags make
// their words visible); else kErrorCombineRowsMismatch naming the peers.
WaitResult check_peer_combines(const CombineParams& p, uint32_t count) {
  const WorkspaceView& ws = p.ws;
  const uint8_t* own = ws.row(ws.ep_rank);
  uint64_t other[kRankMaskWords] = {};
  bool any = false;
  for (int q = 0; q < ws.ep_size; ++q) {
    if (rank_active(p.sync, q) && load<uint32_t>(own, combine_signature_offset(count, q)) != p.signature) {
      other[q / 64] |= uint64_t(1) << (q % 64);
      any = true;
    }
  }
  return any ? record_error(ws, kErrorCombineRowsMismatch, other, 0) : WaitResult{};
}

// Waits until every active rank finished pulling its combine `count` (its
// pull_done, advanced with a release store after its pull): dispatch step
// 0b and combine step 0, each with its own code on a timeout.
WaitResult wait_for_peer_pulls(const WorkspaceView& ws, const SyncParams& sync, uint32_t count,
                               ErrorCode code_on_timeout) {
  return wait_for_words(
      ws, sync, [&](int q) { return reinterpret_cast<const uint32_t*>(ws.row(q) + kHdrPullDone); }, flag_target(count),
      code_on_timeout);
}

// Combine step 0 (protocol.h), for a combine that writes into the own
// combine region (stages or converts): a repeated combine of the round waits
// until every active peer finished pulling the combine before it; the
// round's first needs not. Then the region is marked staged (step 1), so
// that a later combine of the round does not read it as its payload.
WaitResult begin_staging(const CombineParams& p, uint32_t count) {
  uint8_t* own = p.ws.row(p.ws.ep_rank);
  if (load<uint32_t>(own, kHdrDispatchEpoch) == load<uint32_t>(own, kHdrCombineEpoch)) {
    const WaitResult pulled = wait_for_peer_pulls(p.ws, p.sync, count - 1, kErrorCombineTimeout);
    if (pulled.code != kErrorNone) return pulled;
  }
  store<uint32_t>(own, kHdrRegionStaged, 1);
  return WaitResult{};
}

// The refusal of a combine that reads as its payload a combine region an
// earlier combine of the round staged into (region_staged_mismatch).
RowStatus region_staged_refusal() {
  RowStatus st;
  st.kind = RowStatus::kValueError;
  st.message = std::string("payload_in_workspace after a combine of the same dispatch that staged its payload ") +
               kRegionStagedReason;
  return st;
}

// Combine step 5: own combine_epoch := the dispatch's, combine_count := count,
// and (release) pull_done: peers' next dispatch, and their next combine of
// the round when it stages, wait on it before overwriting anything this pull read.
void finish_combine(uint8_t* own, uint32_t count) {
  store<uint32_t>(own, kHdrCombineEpoch, load<uint32_t>(own, kHdrDispatchEpoch));
  store<uint32_t>(own, kHdrCombineCount, count);
  __atomic_store_n(reinterpret_cast<uint32_t*>(own + kHdrPullDone), flag_target(count), __ATOMIC_RELEASE);
}

const int32_t* route_of(const uint8_t* own_row, int64_t route_offset, int64_t token) {
  return reinterpret_cast<const int32_t*>(own_row + route_offset) + token * kMaxTopK;
}

template <typename Out>
Out from_float(float v) {
  // c10::Half / c10::BFloat16 round to nearest even, as torch's .to() does.
  return Out(v);
}

int64_t dtype_bytes(DType d) {
  switch (d) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
  }
  return 0;
}

// Row readers of the pull: add a source row's elements to acc.
template <typename In>
struct PayloadRows {
  static void add(const CombineParams& p, const uint8_t* row, float* acc) {
    const In* src = reinterpret_cast<const In*>(row);
    for (int64_t e = 0; e < p.row_elems; ++e) acc[e] += static_cast<float>(src[e]);
  }
};
// e4m3 rows (protocol.h's low-precision rows): plain, or each block times its
// power-of-two scale (an exact product).
struct E4m3Rows {
  static void add(const CombineParams& p, const uint8_t* row, float* acc) {
    if (p.low_precision != LowPrecision::kE4m3BlockScaled) {
      for (int64_t e = 0; e < p.row_elems; ++e) acc[e] += e4m3_to_float(row[e]);
      return;
    }
    for (int64_t c = 0; c * kLowPrecisionBlock < p.row_elems; ++c) {
      const float scale = ue8m0_to_float(row[low_precision_scale_offset(p.row_elems, c)]);
      const int64_t first = c * kLowPrecisionBlock;
      const uint8_t* block = row + low_precision_element_offset(p.low_precision, first);
      const int64_t n = std::min(kLowPrecisionBlock, p.row_elems - first);
      for (int64_t e = 0; e < n; ++e) acc[first + e] += mul_rn(e4m3_to_float(block[e]), scale);
    }
  }
};

// Row writers of the pull: token t's output from its fp32 sums.
template <typename Out>
struct CastRows {
  static void store(const CombineParams& p, int64_t t, const float* acc) {
    Out* dst = reinterpret_cast<Out*>(p.output) + t * p.row_elems;
    for (int64_t e = 0; e < p.row_elems; ++e) dst[e] = from_float<Out>(acc[e]);
  }
};
// Quantized outputs (quantize.h): the sums rounded to Round (the payload
// dtype), then per block its scale and the elements.
template <typename Round>
struct QuantRows {
  static void store(const CombineParams& p, int64_t t, const float* acc) {
    const int64_t block = quant_block(p.quant);
    const int64_t cols = p.row_elems / block;
    const bool fp8 = p.quant == QuantFormat::kMxfp8;
    uint8_t* dst = p.output + t * (fp8 ? p.row_elems : p.row_elems / 2);
    float v[kMxBlock];
    for (int64_t c = 0; c < cols; ++c) {
      float amax = 0.0f;
      for (int64_t e = 0; e < block; ++e) {
        v[e] = static_cast<float>(Round(acc[c * block + e]));
        amax = abs_max(amax, v[e]);
      }
      const BlockScale s = block_scale(p.quant, amax, p.global_scale);
      p.output_scales[sf_offset(p.sf_layout, t, c, cols)] = s.code;
      for (int64_t e = 0; e < block; ++e) {
        const uint8_t q = quantize_element(p.quant, mul_rn(v[e], s.inverse));
        const int64_t i = c * block + e;
        if (fp8) {
          dst[i] = q;
        } else if (i % 2 == 0) {
          dst[i / 2] = q;
        } else {
          dst[i / 2] = uint8_t(dst[i / 2] | (q << 4));
        }
      }
    }
  }
};

// out[t] = sum over route[t] of the peers' combine rows, in fp32, then
// written once by Writer.
template <typename Reader, typename Writer>
void pull_reduce(const CombineParams& p) {
  const WorkspaceView& ws = p.ws;
  const uint8_t* own = ws.row(ws.ep_rank);
  const int64_t elems = p.row_elems;
  const int64_t row_bytes = elems * dtype_bytes(p.payload_dtype);
  const int64_t source_row_offset = int64_t(ws.ep_rank) * p.runtime_max_tokens;
  const bool own_from_payload = combine_own_rows_from_payload(p);
  at::parallel_for(0, p.local_num_tokens, grain_for(row_bytes * 2), [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(elems));
    for (int64_t t = begin; t < end; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      const int32_t* route = route_of(own, p.route_offset, t);
      for (int k = 0; k < kMaxTopK && route_in_call(route[k], ws.ep_size, p.runtime_max_tokens); ++k) {
        const int dest = route_rank(route[k]);
        // A rank masked off since the dispatch was not waited for: its rows are not final.
        if (!rank_active(p.sync, dest)) continue;
        const int64_t row = (source_row_offset + route_slot(route[k])) * row_bytes;
        Reader::add(p, dest == ws.ep_rank && own_from_payload ? p.payload + row : ws.row(dest) + p.combine_offset + row,
                    acc.data());
      }
      Writer::store(p, t, acc.data());
    }
  });
}

template <typename Reader>
void pull_reduce_to(const CombineParams& p) {
  if (p.quant != QuantFormat::kNone) {
    if (p.output_dtype == DType::kFloat16) return pull_reduce<Reader, QuantRows<c10::Half>>(p);
    return pull_reduce<Reader, QuantRows<c10::BFloat16>>(p);
  }
  switch (p.output_dtype) {
    case DType::kFloat32:
      return pull_reduce<Reader, CastRows<float>>(p);
    case DType::kFloat16:
      return pull_reduce<Reader, CastRows<c10::Half>>(p);
    case DType::kBFloat16:
      return pull_reduce<Reader, CastRows<c10::BFloat16>>(p);
  }
}

// Low-precision staging of one received row: `src` (the payload row, or the
// staged row itself when in place) read whole before `dst` is written.
template <typename In>
void stage_row_e4m3(const CombineParams& p, const uint8_t* src, uint8_t* dst, std::vector<float>& values) {
  const In* row = reinterpret_cast<const In*>(src);
  for (int64_t e = 0; e < p.row_elems; ++e) values[e] = static_cast<float>(row[e]);
  if (p.low_precision != LowPrecision::kE4m3BlockScaled) {
    for (int64_t e = 0; e < p.row_elems; ++e) dst[e] = e4m3_from_float(values[e]);
    return;
  }
  for (int64_t c = 0; c * kLowPrecisionBlock < p.row_elems; ++c) {
    const int64_t first = c * kLowPrecisionBlock;
    const int64_t n = std::min(kLowPrecisionBlock, p.row_elems - first);
    float amax = 0.0f;
    for (int64_t e = 0; e < n; ++e) amax = abs_max(amax, values[first + e]);
    const uint8_t code = low_precision_scale_code(amax);
    const float inverse = ue8m0_inverse(code);
    uint8_t* block = dst + low_precision_element_offset(p.low_precision, first);
    for (int64_t e = 0; e < n; ++e) block[e] = e4m3_from_float(mul_rn(values[first + e], inverse));
    dst[low_precision_scale_offset(p.row_elems, c)] = code;
  }
}

template <typename In>
void stage_e4m3(const CombineParams& p, const uint8_t* source, uint8_t* region, int64_t plane, int64_t count,
                int64_t row_bytes) {
  at::parallel_for(0, count, grain_for(row_bytes), [&](int64_t begin, int64_t end) {
    std::vector<float> values(static_cast<size_t>(p.row_elems));
    for (int64_t j = begin; j < end; ++j) {
      const int64_t offset = plane + j * row_bytes;
      stage_row_e4m3<In>(p, source + offset, region + offset, values);
    }
  });
}

// The padding entries of a swizzled scale layout (quantize.h) get zeros.
void zero_scale_padding(const CombineParams& p) {
  const int64_t cols = p.row_elems / quant_block(p.quant);
  const int64_t n = sf_padding_count(p.sf_layout, p.local_num_tokens, cols);
  for (int64_t i = 0; i < n; ++i) p.output_scales[sf_padding_offset(p.sf_layout, p.local_num_tokens, cols, i)] = 0;
}

}  // namespace

// ---- header checks --------------------------------------------------------------

RowStatus check_row_for_dispatch(const WorkspaceView& ws, int64_t max_num_tokens, int64_t eplb_n) {
  RowStatus st = check_config(ws, max_num_tokens, eplb_n);
  if (st.kind != RowStatus::kOk) return st;
  const uint8_t* row = ws.row(ws.ep_rank);
  const uint32_t dispatch_epoch = load<uint32_t>(row, kHdrDispatchEpoch);
  const uint32_t combine_epoch = load<uint32_t>(row, kHdrCombineEpoch);
  if (dispatch_epoch != combine_epoch) {
    return runtime_error("rank " + std::to_string(ws.ep_rank) +
                         ": dispatch called twice without a combine in between (dispatch and "
                         "combine must alternate on every rank); call the combine that closes the open round "
                         "(with its dispatch's sizes and combine_payload_offset; a refused combine changed "
                         "nothing), or moe_a2a_initialize on every rank to start over; " +
                         std::string(kRecomputedDispatchHint));
  }
  return st;
}

// The checks of a combine's row against its dispatch's words, shared by the
// rank-major combine (rank_major: its layout must be the dispatch's too) and
// the expert-major one (its own layout checks follow).
static RowStatus check_combine_row(const CombineParams& p, int64_t max_num_tokens, bool rank_major) {
  const WorkspaceView& ws = p.ws;
  RowStatus st = check_config(ws, max_num_tokens, /*eplb_n=*/-1);
  if (st.kind != RowStatus::kOk) return st;
  const uint8_t* row = ws.row(ws.ep_rank);
  const uint32_t dispatch_epoch = load<uint32_t>(row, kHdrDispatchEpoch);
  const uint32_t combine_epoch = load<uint32_t>(row, kHdrCombineEpoch);
  if (!combine_sequence_ok(dispatch_epoch, combine_epoch, load<uint64_t>(row, kHdrMagic))) {
    return runtime_error("rank " + std::to_string(ws.ep_rank) +
                         ": combine called without a preceding dispatch (every combine combines the rows of the "
                         "last dispatch); call moe_a2a_dispatch first");
  }
  if (rank_major && rank_major_after_expert_major(load<uint32_t>(row, kHdrExpertMajorEpoch), dispatch_epoch) != 0) {
    st.kind = RowStatus::kValueError;
    st.message = "rank " + std::to_string(ws.ep_rank) + ": moe_a2a_combine: " + kRankMajorAfterExpertMajorReason;
    return st;
  }
  const int32_t last_tokens = load<int32_t>(row, kHdrLastLocalTokens);
  const int32_t last_max = load<int32_t>(row, kHdrLastRuntimeMax);
  const int32_t last_top_k = load<int32_t>(row, kHdrLastTopK);
  const int64_t region = load<int64_t>(row, kHdrLastDispatchEnd);
  const uint32_t mismatch = combine_mismatch(last_tokens, last_max, last_top_k, region, p.local_num_tokens,
                                             p.runtime_max_tokens, p.top_k, p.combine_offset);
  if (mismatch & ~uint32_t(kMismatchOffset)) {
    std::ostringstream os;
    os << "combine must use the dispatch's sizes: the dispatch had (local_num_tokens=" << last_tokens
       << ", runtime_max_tokens_per_rank=" << last_max << ", top_k=" << last_top_k
       << "), the combine got (local_num_tokens=" << p.local_num_tokens
       << ", runtime_max_tokens_per_rank=" << p.runtime_max_tokens << ", top_k=" << p.top_k << ")";
    st.kind = RowStatus::kValueError;
    st.message = os.str();
  } else if (mismatch != 0) {
    // The peers pull this rank's combine region n where the layout of
    // dispatch n puts it (protocol.h): staged anywhere else, they would sum
    // stale rows.
    st.kind = RowStatus::kValueError;
    st.message = "combine_payload_offset must be the one the dispatch returned (" + std::to_string(region) + "), got " +
                 std::to_string(p.combine_offset);
  } else if (region_staged_mismatch(load<uint32_t>(row, kHdrRegionStaged),
                                    p.payload == nullptr || p.payload == row + p.combine_offset) != 0) {
    st = region_staged_refusal();
  }
  return st;
}

RowStatus check_row_for_combine(const CombineParams& p, int64_t max_num_tokens) {
  return check_combine_row(p, max_num_tokens, /*rank_major=*/true);
}

RowStatus check_row_for_sanitize(const SanitizeParams& p, int64_t max_num_tokens) {
  RowStatus st = check_config(p.ws, max_num_tokens, /*eplb_n=*/-1);
  if (st.kind != RowStatus::kOk) return st;
  const uint8_t* row = p.ws.row(p.ws.ep_rank);
  const uint64_t init_word = load<uint64_t>(row, kHdrMagic);
  const int32_t last_max = load<int32_t>(row, kHdrLastRuntimeMax);
  const int64_t last_end = load<int64_t>(row, kHdrLastDispatchEnd);
  if (!sanitize_plane_fits(init_word, last_max, last_end, p.runtime_max_tokens, p.offset, p.plane_end)) {
    st.kind = RowStatus::kValueError;
    st.message = "moe_a2a_sanitize_expert_ids: " + sanitize_mismatch_text(first_dispatch(init_word) ? 0 : last_max);
  }
  return st;
}

// ---- kernels ----------------------------------------------------------------------

void initialize(const InitParams& p) {
  uint8_t* row = p.ws.row(p.ws.ep_rank);
  // What survives the zeroing (protocol.h, dispatch step 0a): the peers' tags
  // that the last first dispatch saw, and the count in the init word.
  const uint64_t old_word = load<uint64_t>(row, kHdrMagic);
  uint16_t seen[kMaxRanks] = {};
  if (row_initialized(old_word)) std::memcpy(seen, row + kHdrInitSeen, sizeof(seen));
  at::parallel_for(0, p.ws.size_per_rank, kParallelGrainBytes,
                   [&](int64_t begin, int64_t end) { std::memset(row + begin, 0, static_cast<size_t>(end - begin)); });
  std::memcpy(row + kHdrInitStale, seen, sizeof(seen));
  std::memcpy(row + kHdrInitSeen, seen, sizeof(seen));
  store<int32_t>(row, kHdrEpRank, p.ws.ep_rank);
  store<int32_t>(row, kHdrEpSize, p.ws.ep_size);
  store<int32_t>(row, kHdrMaxNumTokens, static_cast<int32_t>(p.max_num_tokens));
  store<int32_t>(row, kHdrEplbN, static_cast<int32_t>(p.eplb_n));
  // The init word last: a row that shows it is fully set up.
  __atomic_store_n(reinterpret_cast<uint64_t*>(row + kHdrMagic), next_init_word(old_word), __ATOMIC_RELEASE);
}

WaitResult dispatch(const DispatchParams& p) {
  const WorkspaceView& ws = p.ws;
  uint8_t* own = ws.row(ws.ep_rank);
  const uint32_t epoch = load<uint32_t>(own, kHdrDispatchEpoch) + 1;
  const bool first = first_dispatch(load<uint64_t>(own, kHdrMagic));

  // 0a. The first dispatch since initialize writes into no row before its
  // owner has zeroed it since its last use (the init word, stored last with
  // release by initialize), then notes which initialization it saw.
  if (first) {
    auto init_word_of = [&](int q) {
      return __atomic_load_n(reinterpret_cast<const uint64_t*>(ws.row(q) + kHdrMagic), __ATOMIC_ACQUIRE);
    };
    const uint16_t own_count = init_count(load<uint64_t>(own, kHdrMagic));
    const WaitResult zeroed = wait_for_peers(
        ws, p.sync,
        [&](int q) { return fresh_peer(init_word_of(q), load<uint16_t>(own, init_stale_offset(q)), own_count); },
        kErrorDispatchTimeout,
        [&](int q) {
          // The error read after the init word (acquire): it is the current initialization's.
          return current_peer(init_word_of(q), load<uint16_t>(own, init_stale_offset(q)), own_count) &&
                 peer_error_recorded(ws, q);
        });
    for (int q = 0; q < ws.ep_size; ++q) {
      if (rank_active(p.sync, q)) store<uint16_t>(own, init_seen_offset(q), init_tag(init_word_of(q)));
    }
    if (zeroed.code != kErrorNone) return zeroed;
  }
  // 0b. When this call's regions may cover what slower ranks still read of
  // call n-1 (their combine regions, or their own routes: protocol.h), write
  // nothing before every active rank finished combine n-1 (its own
  // pull_done, advanced with a release store after its pull).
  if (previous_call_overlap(p.layout.dispatch_end, load<int64_t>(own, kHdrLastDispatchEnd), p.runtime_max_tokens,
                            load<int32_t>(own, kHdrLastRuntimeMax))) {
    const WaitResult previous =
        wait_for_peer_pulls(ws, p.sync, load<uint32_t>(own, kHdrCombineCount), kErrorDispatchTimeout);
    if (previous.code != kErrorNone) return previous;
  }
  store<int64_t>(own, kHdrLastDispatchEnd, p.layout.dispatch_end);

  // 1. Routing, in increasing token index: deterministic slots.
  int64_t recv_count[kMaxRanks] = {};
  int64_t invalid = 0;
  int32_t* routes = reinterpret_cast<int32_t*>(own + p.layout.route_offset);
  for (int64_t t = 0; t < p.local_num_tokens; ++t) {
    uint64_t dests = 0;  // ep_size <= 64: one bit per rank, read back in ascending order
    for (int64_t k = 0; k < p.top_k; ++k) {
      const int64_t e = expert_id(p, t * p.top_k + k);
      if (e < 0) continue;
      if (e >= p.num_experts) {
        ++invalid;
        continue;
      }
      const int r = expert_to_rank(e, p.num_experts, ws.ep_size);
      if (rank_active(p.sync, r)) dests |= uint64_t(1) << r;
    }
    int32_t* route = routes + t * kMaxTopK;
    int n = 0;
    for (int r = 0; dests != 0; ++r, dests >>= 1) {
      if (dests & 1u) route[n++] = route_entry(r, recv_count[r]++);
    }
    if (n < kMaxTopK) route[n] = kRouteEnd;
  }

  // 2. Payload rows to every destination's planes at [ep_rank, slot].
  int64_t token_bytes = 0;
  for (int i = 0; i < p.num_payloads; ++i) token_bytes += p.payload_row_bytes[i];
  const int64_t source_row_offset = int64_t(ws.ep_rank) * p.runtime_max_tokens;
  at::parallel_for(0, p.local_num_tokens, grain_for(token_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int32_t* route = routes + t * kMaxTopK;
      for (int k = 0; k < kMaxTopK && route_in_call(route[k], ws.ep_size, p.runtime_max_tokens); ++k) {
        uint8_t* dest = ws.row(route_rank(route[k]));
        const int64_t row_index = source_row_offset + route_slot(route[k]);
        for (int i = 0; i < p.num_payloads; ++i) {
          const int64_t bytes = p.payload_row_bytes[i];
          if (bytes == 0) continue;  // an empty payload's data pointer may be null
          std::memcpy(dest + p.layout.payload_offset[i] + row_index * bytes, p.payload[i] + t * bytes,
                      static_cast<size_t>(bytes));
        }
      }
    }
  });

  // EPLB row and receive count into every active destination. A masked-off
  // rank writes nothing into this row this call: its own count here is
  // zeroed, so none of the rows an earlier call left from it counts.
  for (int d = 0; d < ws.ep_size; ++d) {
    if (!rank_active(p.sync, d)) {
      store<int32_t>(own, recv_count_offset(d), 0);
      continue;
    }
    uint8_t* dest = ws.row(d);
    if (p.eplb_local_stats != nullptr) {
      std::memcpy(dest + p.layout.eplb_offset + int64_t(ws.ep_rank) * p.eplb_n * int64_t(sizeof(int32_t)),
                  p.eplb_local_stats, static_cast<size_t>(p.eplb_n) * sizeof(int32_t));
    }
    store<int32_t>(dest, recv_count_offset(ws.ep_rank), static_cast<int32_t>(recv_count[d]));
    store<int32_t>(dest, peer_runtime_max_offset(ws.ep_rank), static_cast<int32_t>(p.runtime_max_tokens));
    store<uint32_t>(dest, peer_payloads_offset(ws.ep_rank), p.payload_signature);
    store<uint32_t>(dest, peer_round_tag_offset(ws.ep_rank), p.round_tag);
  }

  // What the matching combine must agree with, and the invalid-id tally.
  store<int32_t>(own, kHdrLastLocalTokens, static_cast<int32_t>(p.local_num_tokens));
  store<int32_t>(own, kHdrLastRuntimeMax, static_cast<int32_t>(p.runtime_max_tokens));
  store<int32_t>(own, kHdrLastTopK, static_cast<int32_t>(p.top_k));
  store<int64_t>(own, kHdrInvalidExpertCount, load<int64_t>(own, kHdrInvalidExpertCount) + invalid);

  // 3. Release, 4. acquire, 5. advance.
  release_to_peers(ws, p.sync, kHdrDispatchFlags, epoch);
  const WaitResult result = wait_for_own_flags(ws, p.sync, kHdrDispatchFlags, epoch, kErrorDispatchTimeout);
  if (result.code != kErrorNone) return result;
  const WaitResult agreed = check_peer_calls(ws, p.sync, p);
  if (agreed.code != kErrorNone) return agreed;
  store<uint32_t>(own, kHdrDispatchEpoch, epoch);
  store<uint32_t>(own, kHdrRegionStaged, 0);
  // Not (yet) an expert-major dispatch: its build writes epoch afterwards.
  store<uint32_t>(own, kHdrExpertMajorEpoch, stale_expert_major_epoch(epoch));
  if (first) mark_in_use(own);
  return result;
}

WaitResult combine(const CombineParams& p) {
  const WorkspaceView& ws = p.ws;
  uint8_t* own = ws.row(ws.ep_rank);
  const uint32_t count = load<uint32_t>(own, kHdrCombineCount) + 1;
  const int64_t row_bytes = p.row_elems * dtype_bytes(p.payload_dtype);
  const int64_t T = p.runtime_max_tokens;

  // 0. Wait, 1. stage the valid rows of every active source (a payload that
  // already is the own combine region needs no copy).
  uint8_t* region = own + p.combine_offset;
  const bool low_precision = p.low_precision != LowPrecision::kOff;
  const bool stages = combine_stages(p);
  if (stages) {
    const WaitResult staging = begin_staging(p, count);
    if (staging.code != kErrorNone) return staging;
  }
  if (low_precision) {
    // Staged as e4m3 rows (protocol.h), from the payload or in place.
    const uint8_t* source = p.payload != nullptr ? p.payload : region;
    for (int s = 0; s < ws.ep_size; ++s) {
      if (!rank_active(p.sync, s)) continue;
      const int64_t count = received_rows(load<int32_t>(own, recv_count_offset(s)), T);
      const int64_t plane = int64_t(s) * T * row_bytes;
      switch (p.payload_dtype) {
        case DType::kFloat32:
          stage_e4m3<float>(p, source, region, plane, count, row_bytes);
          break;
        case DType::kFloat16:
          stage_e4m3<c10::Half>(p, source, region, plane, count, row_bytes);
          break;
        case DType::kBFloat16:
          stage_e4m3<c10::BFloat16>(p, source, region, plane, count, row_bytes);
          break;
      }
    }
  } else if (stages) {
    // Not the own source's rows where this rank's pull, their only reader,
    // reads them from the payload.
    const bool own_from_payload = combine_own_rows_from_payload(p);
    for (int s = 0; s < ws.ep_size; ++s) {
      if ((s == ws.ep_rank && own_from_payload) || !rank_active(p.sync, s)) continue;
      const int64_t rows = received_rows(load<int32_t>(own, recv_count_offset(s)), T);
      copy_rows(region, p.payload, int64_t(s) * T * row_bytes, rows, row_bytes);
    }
  }

  // 2. Release, 3. acquire, the equal-rows check.
  release_combine(p, count);
  const WaitResult result = wait_for_own_flags(ws, p.sync, kHdrCombineFlags, count, kErrorCombineTimeout);
  if (result.code != kErrorNone) return result;
  const WaitResult agreed = check_peer_combines(p, count);
  if (agreed.code != kErrorNone) return agreed;

  // 4. Pull and reduce, 5. advance.
  if (p.quant != QuantFormat::kNone) zero_scale_padding(p);
  if (p.low_precision != LowPrecision::kOff) {
    pull_reduce_to<E4m3Rows>(p);
  } else {
    switch (p.payload_dtype) {
      case DType::kFloat32:
        pull_reduce_to<PayloadRows<float>>(p);
        break;
      case DType::kFloat16:
        pull_reduce_to<PayloadRows<c10::Half>>(p);
        break;
      case DType::kBFloat16:
        pull_reduce_to<PayloadRows<c10::BFloat16>>(p);
        break;
    }
  }
  finish_combine(own, count);
  return result;
}

void sanitize_expert_ids(const SanitizeParams& p) {
  const WorkspaceView& ws = p.ws;
  uint8_t* own = ws.row(ws.ep_rank);
  const int64_t T = p.runtime_max_tokens;
  for (int s = 0; s < ws.ep_size; ++s) {
    const int64_t count = received_rows(load<int32_t>(own, recv_count_offset(s)), T);
    const int64_t first = (int64_t(s) * T + count) * p.width;
    const int64_t n = (T - count) * p.width;
    if (p.ids_int64) {
      std::fill_n(reinterpret_cast<int64_t*>(own + p.offset) + first, n, p.invalid_expert_id);
    } else {
      std::fill_n(reinterpret_cast<int32_t*>(own + p.offset) + first, n, static_cast<int32_t>(p.invalid_expert_id));
    }
  }
}

// ---- expert-major layout ------------------------------------------------------------

RowStatus check_row_for_expert_major_build(const ExpertMajorBuildParams& p, int64_t max_num_tokens) {
  const WorkspaceView& ws = p.ws;
  RowStatus st = check_config(ws, max_num_tokens, /*eplb_n=*/-1);
  if (st.kind != RowStatus::kOk) return st;
  const uint8_t* row = ws.row(ws.ep_rank);
  if (load<uint32_t>(row, kHdrDispatchEpoch) != load<uint32_t>(row, kHdrCombineEpoch) + 1) {
    return runtime_error("rank " + std::to_string(ws.ep_rank) +
                         ": expert_major_build called without a preceding dispatch (it regroups the rows of the "
                         "dispatch before the combine); call moe_a2a_dispatch with expert_major=True, which "
                         "builds the layout itself");
  }
  const int32_t last_max = load<int32_t>(row, kHdrLastRuntimeMax);
  const int32_t last_top_k = load<int32_t>(row, kHdrLastTopK);
  const int64_t last_end = load<int64_t>(row, kHdrLastDispatchEnd);
  if (last_max != p.runtime_max_tokens || last_top_k != p.top_k || last_end != p.dispatch_end) {
    std::ostringstream os;
    os << "expert_major_build must describe its dispatch: the dispatch had (runtime_max_tokens_per_rank=" << last_max
       << ", top_k=" << last_top_k << ", payloads ending at " << last_end
       << "), the build got (runtime_max_tokens_per_rank=" << p.runtime_max_tokens << ", top_k=" << p.top_k
       << ", payloads ending at " << p.dispatch_end << ")";
    st.kind = RowStatus::kValueError;
    st.message = os.str();
  }
  return st;
}

RowStatus check_row_for_combine_expert_major(const ExpertMajorCombineParams& p, int64_t max_num_tokens) {
  CombineParams c = p.c;
  c.combine_offset = p.dispatch_end;  // what combine_mismatch compares with kHdrLastDispatchEnd
  RowStatus st = check_combine_row(c, max_num_tokens, /*rank_major=*/false);
  if (st.kind != RowStatus::kOk && st.kind != RowStatus::kValueError) return st;
  const uint8_t* row = p.c.ws.row(p.c.ws.ep_rank);
  const uint32_t build_epoch = load<uint32_t>(row, kHdrExpertMajorEpoch);
  const int32_t build_tokens = load<int32_t>(row, kHdrExpertMajorTokens);
  const int64_t build_end = load<int64_t>(row, kHdrExpertMajorEnd);
  // The rank-major checks compare the ExpertMajorDispatch's sizes with the
  // last dispatch's. Where that dispatch was not expert-major, that is what
  // to say (below); else the caller, who passed neither sizes nor a
  // combine_payload_offset, holds an earlier dispatch's result.
  const uint32_t dispatch_epoch = load<uint32_t>(row, kHdrDispatchEpoch);
  // The rank-major checks looked for a payload in the rank-major region; an
  // expert-major combine's in-place payload is its own region. Checked
  // first: the rank-major checks refuse it too, and their refusal is not
  // about which dispatch the ExpertMajorDispatch came from.
  if (build_epoch == dispatch_epoch &&
      region_staged_mismatch(load<uint32_t>(row, kHdrRegionStaged), !em_combine_own_from_payload(p.c)) != 0) {
    return region_staged_refusal();
  }
  if (st.kind == RowStatus::kValueError && build_epoch == dispatch_epoch) {
    const int64_t region = load<int64_t>(row, kHdrLastDispatchEnd);
    if (combine_mismatch(load<int32_t>(row, kHdrLastLocalTokens), load<int32_t>(row, kHdrLastRuntimeMax),
                         load<int32_t>(row, kHdrLastTopK), region, c.local_num_tokens, c.runtime_max_tokens, c.top_k,
                         c.combine_offset) == uint32_t(kMismatchOffset)) {
      st.message =
          "the expert-major combine must be given the last dispatch's ExpertMajorDispatch: the one given "
          "is laid out for another dispatch (dispatch_end " +
          std::to_string(p.dispatch_end) + ", the last dispatch's " + std::to_string(region) + ")";
    } else {
      st.message =
          "the expert-major combine must be given the last dispatch's ExpertMajorDispatch, not an earlier "
          "one (" +
          st.message + ")";
    }
    return st;
  }
  if (expert_major_mismatch(build_epoch, build_tokens, build_end, dispatch_epoch, p.layout.tokens_per_expert,
                            p.c.combine_offset) != 0) {
    std::ostringstream os;
    if (build_epoch != dispatch_epoch) {
      os << "the expert-major combine needs an expert-major dispatch before it (its expert_major_build); "
            "close this round with moe_a2a_combine, the rank-major combine of its dispatch, or dispatch "
            "with expert_major=True next time";
    } else {
      os << "the expert-major combine must be given the last dispatch's ExpertMajorDispatch: the last dispatch "
            "had (max_tokens_per_expert="
         << build_tokens << ", combine_payload_offset=" << build_end
         << "), the one given has (max_tokens_per_expert=" << p.layout.tokens_per_expert
         << ", combine_payload_offset=" << p.c.combine_offset << ")";
    }
    st.kind = RowStatus::kValueError;
    st.message = os.str();
  }
  return st;
}

void expert_major_build(const ExpertMajorBuildParams& p) {
  const WorkspaceView& ws = p.ws;
  uint8_t* own = ws.row(ws.ep_rank);
  const ExpertMajorLayout& l = p.layout;
  const int64_t T = p.runtime_max_tokens, K = p.top_k, M = l.tokens_per_expert;
  int32_t* counts = reinterpret_cast<int32_t*>(own + l.counts_offset);
  int32_t* pair_map = reinterpret_cast<int32_t*>(own + l.pair_map_offset);
  int32_t* pair_src = reinterpret_cast<int32_t*>(own + l.pair_src_offset);
  int32_t* ids = reinterpret_cast<int32_t*>(own + l.ids_offset);
  float* weights = reinterpret_cast<float*>(own + l.weights_offset);
  const uint8_t* id_plane = own + p.ids_offset;
  const float* weight_plane = p.weights_offset >= 0 ? reinterpret_cast<const float*>(own + p.weights_offset) : nullptr;

  // Pairs in (s, j, k) order: each expert's rows in the contract's order.
  std::vector<int64_t> pairs(static_cast<size_t>(p.num_local), 0);
  int64_t dropped = 0;
  for (int s = 0; s < ws.ep_size; ++s) {
    const int64_t rows = received_rows(load<int32_t>(own, recv_count_offset(s)), T);
    for (int64_t j = 0; j < rows; ++j) {
      const int64_t r = int64_t(s) * T + j;
      // The row's local pairs, ascending (e, k): an insertion sort by e that
      // keeps ascending k among equal e.
      int64_t pe[kMaxTopK];
      int64_t pk[kMaxTopK];
      int n = 0;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t id =
            p.ids_int64 ? load<int64_t>(id_plane, (r * K + k) * 8) : load<int32_t>(id_plane, (r * K + k) * 4);
        const int64_t e = id - p.first_expert;
        if (e < 0 || e >= p.num_local) continue;
        int at = n++;
        for (; at > 0 && pe[at - 1] > e; --at) {
          pe[at] = pe[at - 1];
          pk[at] = pk[at - 1];
        }
        pe[at] = e;
        pk[at] = k;
      }
      int32_t* entries = pair_map + r * K;
      for (int q = 0; q < n; ++q) {
        const int64_t i = pairs[pe[q]]++;
        if (i >= M) {
          entries[q] = kNoPair;
          ++dropped;
          continue;
        }
        const int64_t at = pe[q] * M + i;
        pair_src[at] = static_cast<int32_t>(r);
        ids[at] = static_cast<int32_t>(pe[q]);
        weights[at] = weight_plane != nullptr ? weight_plane[r * K + pk[q]] : 1.0f;
        entries[q] = static_cast<int32_t>(at);
      }
      for (int64_t q = n; q < K; ++q) entries[q] = kNoPair;
    }
  }
  for (int64_t e = 0; e < p.num_local; ++e) {
    const int64_t count = std::min(pairs[e], M);
    counts[e] = static_cast<int32_t>(count);
    std::fill(ids + e * M + count, ids + (e + 1) * M, kNoPair);
    std::fill(weights + e * M + count, weights + (e + 1) * M, 0.0f);
  }

  // The payloads' rows, from the rank-major planes.
  for (int i = 0; i < p.num_payloads; ++i) {
    const int64_t bytes = p.payload_row_bytes[i];
    if (bytes == 0) continue;
    const uint8_t* from = own + p.payload_offset[i];
    uint8_t* to = own + l.payload_offset[i];
    for (int64_t e = 0; e < p.num_local; ++e) {
      at::parallel_for(0, counts[e], grain_for(bytes), [&](int64_t begin, int64_t end) {
        for (int64_t k = begin; k < end; ++k) {
          const int64_t at = e * M + k;
          std::memcpy(to + at * bytes, from + int64_t(pair_src[at]) * bytes, static_cast<size_t>(bytes));
        }
      });
    }
  }

  store<int64_t>(own, kHdrDroppedPairCount, load<int64_t>(own, kHdrDroppedPairCount) + dropped);
  store<int64_t>(own, kHdrExpertMajorEnd, l.combine_offset);
  store<int32_t>(own, kHdrExpertMajorTokens, static_cast<int32_t>(M));
  store<uint32_t>(own, kHdrExpertMajorEpoch, load<uint32_t>(own, kHdrDispatchEpoch));
}

namespace {

// out[t] = sum over route[t] (ascending rank), then over the pair map's
// entries of that rank's row for t, of weight * row, in fp32. The product is
// rounded to fp32 before it is added (no fused multiply-add: the build
// passes -ffp-contract=off), as in the reference and the CUDA kernel.
template <typename In, typename Out>
void pull_reduce_expert_major(const ExpertMajorCombineParams& ep) {
  const CombineParams& p = ep.c;
  const WorkspaceView& ws = p.ws;
  const ExpertMajorLayout& l = ep.layout;
  const uint8_t* own = ws.row(ws.ep_rank);
  const int64_t elems = p.row_elems;
  const int64_t K = p.top_k;
  const int64_t rows = l.local_experts * l.tokens_per_expert;
  const int64_t source_row_offset = int64_t(ws.ep_rank) * p.runtime_max_tokens;
  Out* out = reinterpret_cast<Out*>(p.output);
  const bool own_from_payload = em_combine_own_from_payload(p);
  at::parallel_for(0, p.local_num_tokens, grain_for(elems * int64_t(sizeof(In)) * 2), [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(elems));
    for (int64_t t = begin; t < end; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      const int32_t* route = route_of(own, p.route_offset, t);
      for (int k = 0; k < kMaxTopK && route_in_call(route[k], ws.ep_size, p.runtime_max_tokens); ++k) {
        const int dest = route_rank(route[k]);
        if (!rank_active(p.sync, dest)) continue;
        const uint8_t* peer = ws.row(dest);
        const int32_t* entries =
            reinterpret_cast<const int32_t*>(peer + l.pair_map_offset) + (source_row_offset + route_slot(route[k])) * K;
        const float* weights = reinterpret_cast<const float*>(peer + l.weights_offset);
        const In* x =
            reinterpret_cast<const In*>(dest == ws.ep_rank && own_from_payload ? p.payload : peer + l.combine_offset);
        for (int64_t q = 0; q < K; ++q) {
          const int32_t at = entries[q];
          if (at < 0 || at >= rows) continue;  // no pair there (dropped, or past the row's pairs)
          const float w = weights[at];
          const In* src = x + int64_t(at) * elems;
          for (int64_t e = 0; e < elems; ++e) acc[e] += w * static_cast<float>(src[e]);
        }
      }
      Out* dst = out + t * elems;
      for (int64_t e = 0; e < elems; ++e) dst[e] = from_float<Out>(acc[e]);
    }
  });
}

template <typename In>
void pull_reduce_expert_major_to(const ExpertMajorCombineParams& p) {
  switch (p.c.output_dtype) {
    case DType::kFloat32:
      return pull_reduce_expert_major<In, float>(p);
    case DType::kFloat16:
      return pull_reduce_expert_major<In, c10::Half>(p);
    case DType::kBFloat16:
      return pull_reduce_expert_major<In, c10::BFloat16>(p);
  }
}

}  // namespace

WaitResult combine_expert_major(const ExpertMajorCombineParams& ep) {
  const CombineParams& p = ep.c;
  const WorkspaceView& ws = p.ws;
  const ExpertMajorLayout& l = ep.layout;
  uint8_t* own = ws.row(ws.ep_rank);
  const uint32_t count = load<uint32_t>(own, kHdrCombineCount) + 1;
  const int64_t row_bytes = p.row_elems * dtype_bytes(p.payload_dtype);
  const int64_t M = l.tokens_per_expert;

  // 0. Wait (as in combine), 1. stage each local expert's valid rows where a
  // peer pulls them (em_combine_stages); rows [e, i] keep their index. A
  // payload tensor marks the region staged whether or not a peer pulls (at
  // ep 1 or with every peer masked off nothing is copied), as the rank-major
  // combine's does: a later in-place combine of the round is refused
  // whatever the ranks and the masks, not read from a region that holds no
  // payload of this round.
  uint8_t* region = own + p.combine_offset;
  if (em_combine_own_from_payload(p)) {
    const WaitResult staging = begin_staging(p, count);
    if (staging.code != kErrorNone) return staging;
  }
  if (em_combine_stages(p)) {
    const int32_t* counts = reinterpret_cast<const int32_t*>(own + l.counts_offset);
    for (int64_t e = 0; e < ep.num_local; ++e) {
      const int64_t rows = std::min<int64_t>(std::max<int32_t>(counts[e], 0), M);
      copy_rows(region, p.payload, e * M * row_bytes, rows, row_bytes);
    }
  }

  // 2. Release, 3. acquire, the equal-rows check.
  release_combine(p, count);
  const WaitResult result = wait_for_own_flags(ws, p.sync, kHdrCombineFlags, count, kErrorCombineTimeout);
  if (result.code != kErrorNone) return result;
  const WaitResult agreed = check_peer_combines(p, count);
  if (agreed.code != kErrorNone) return agreed;

  // 4. Pull, 5. advance (release: as in combine).
  switch (p.payload_dtype) {
    case DType::kFloat32:
      pull_reduce_expert_major_to<float>(ep);
      break;
    case DType::kFloat16:
      pull_reduce_expert_major_to<c10::Half>(ep);
      break;
    case DType::kBFloat16:
      pull_reduce_expert_major_to<c10::BFloat16>(ep);
      break;
  }
  finish_combine(own, count);
  return result;
}

void set_interrupt_hooks(InterruptHooks hooks) {
  g_interrupt_raise.store(hooks.raise, std::memory_order_release);
  g_interrupt_pending.store(hooks.pending, std::memory_order_release);
}

void raise_interrupted(const std::string& record) {
  void (*raise)(const std::string&) = g_interrupt_raise.load(std::memory_order_acquire);
  if (raise != nullptr) raise(record);
}

void record_interrupted_rows(const WorkspaceView& ws) {
  const uint64_t none[kRankMaskWords] = {};
  for (int r = 0; r < ws.ep_size; ++r) {
    uint32_t* code = reinterpret_cast<uint32_t*>(ws.row(r) + kHdrErrorCode);
    if (!row_initialized(load<uint64_t>(ws.row(r), kHdrMagic))) continue;  // no rank uses it
    if (__atomic_load_n(code, __ATOMIC_ACQUIRE) != kErrorNone) continue;   // its own record says more
    WorkspaceView own = ws;
    own.ep_rank = r;
    record_error(own, kErrorInterrupted, none, 0);
  }
}

}  // namespace cpu
}  // namespace moe_a2a
