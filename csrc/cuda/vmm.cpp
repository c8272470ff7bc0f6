// The multi-process CUDA workspace (DESIGN.md section 5) on CUDA virtual
// memory. Every process creates its own row (cuMemCreate), exports it as a
// shareable handle, imports its peers' rows and maps all rows contiguously;
// torch_moe_a2a/workspace.py carries the handles between the processes and
// orders the steps (docs/internals.md, "The multi-process CUDA workspace").
//
// libcuda is not linked: the driver functions come from the CUDA runtime
// (cudaGetDriverEntryPoint*), so the extension links like the rest of torch;
// <cuda.h> and <cudaTypedefs.h> supply the types only.
#include "vmm.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <c10/util/string_view.h>
#include <torch/library.h>

#include "../protocol.h"
#include "../schemas.h"

namespace moe_a2a {
namespace {

// The driver ABI the function pointer types below are written for: asking
// for CUDA 12.0 yields the newest variant of each function up to 12.0
// (cuMemCreate_v10020, ...), whatever driver and toolkit are newer.
constexpr unsigned int kDriverAbiVersion = 12000;
// The names of the handle types (torch_moe_a2a/workspace.py uses the same).
constexpr const char* kPosixFd = "posix_fd";
constexpr const char* kFabric = "fabric";
// Fabric handles exist from CUDA 12.3 on; with older headers only descriptors work.
#if CUDA_VERSION >= 12030
#define MOE_A2A_HAS_FABRIC 1
constexpr size_t kFabricHandleBytes = sizeof(CUmemFabricHandle);
#else
#define MOE_A2A_HAS_FABRIC 0
#endif

// ---- driver entry points ---------------------------------------------------------

struct Driver {
  PFN_cuGetErrorName_v6000 get_error_name = nullptr;
  PFN_cuGetErrorString_v6000 get_error_string = nullptr;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetAttribute_v2000 device_get_attribute = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 get_granularity = nullptr;
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 export_handle = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 import_handle = nullptr;
  PFN_cuMemAddressReserve_v10020 address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 address_free = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
};

template <typename Fn>
void load(Fn& fn, const char* symbol) {
  void* address = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  const cudaError_t err =
      cudaGetDriverEntryPointByVersion(symbol, &address, kDriverAbiVersion, cudaEnableDefault, &found);
#else
  const cudaError_t err = cudaGetDriverEntryPoint(symbol, &address, cudaEnableDefault, &found);
#endif
  if (err != cudaSuccess) (void)cudaGetLastError();  // not sticky, but keep later checks clean
  TORCH_CHECK(err == cudaSuccess && found == cudaDriverEntryPointSuccess && address != nullptr,
              "moe_a2a: the CUDA driver has no usable ", symbol, " (", cudaGetErrorString(err), ", query result ",
              static_cast<int>(found), "); the multi-process CUDA workspace needs a driver for CUDA 12.0 or newer");
  fn = reinterpret_cast<Fn>(address);
}

// Loaded on first use (a failure is retried on the next call).
const Driver& driver() {
  static const Driver loaded = [] {
    Driver d;
    load(d.get_error_name, "cuGetErrorName");
    load(d.get_error_string, "cuGetErrorString");
    load(d.device_get, "cuDeviceGet");
    load(d.device_get_attribute, "cuDeviceGetAttribute");
    load(d.get_granularity, "cuMemGetAllocationGranularity");
    load(d.create, "cuMemCreate");
    load(d.release, "cuMemRelease");
    load(d.export_handle, "cuMemExportToShareableHandle");
    load(d.import_handle, "cuMemImportFromShareableHandle");
    load(d.address_reserve, "cuMemAddressReserve");
    load(d.address_free, "cuMemAddressFree");
    load(d.map, "cuMemMap");
    load(d.unmap, "cuMemUnmap");
    load(d.set_access, "cuMemSetAccess");
    return d;
  }();
  return loaded;
}

std::string describe(CUresult result) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (driver().get_error_name(result, &name) != CUDA_SUCCESS) name = nullptr;
  if (driver().get_error_string(result, &text) != CUDA_SUCCESS) text = nullptr;
  return std::string(name ? name : "CUresult " + std::to_string(static_cast<int>(result))) + ": " +
         (text ? text : "unknown error");
}

void check(CUresult result, const char* call) {
  TORCH_CHECK(result == CUDA_SUCCESS, call, " failed: ", describe(result));
}

// ---- arguments ------------------------------------------------------------------------

CUmemAllocationHandleType handle_type(c10::string_view name) {
  if (name == kPosixFd) return CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
#if MOE_A2A_HAS_FABRIC
  if (name == kFabric) return CU_MEM_HANDLE_TYPE_FABRIC;
  C10_THROW_ERROR(ValueError, c10::str("unknown handle type '", std::string(name), "': expected '", kPosixFd, "' or '",
                                       kFabric, "'"));
#else
  C10_THROW_ERROR(ValueError, c10::str("unknown or unsupported handle type '", std::string(name), "': this build's ",
                                       "CUDA headers (", CUDA_VERSION, ") know only '", kPosixFd,
                                       "' (fabric handles need CUDA 12.3)"));
#endif
}

int checked_device(int64_t device) {
  const int64_t count = c10::cuda::device_count();
  TORCH_CHECK_VALUE(device >= 0 && device < count, "CUDA device index ", device, " out of range [0, ", count, ")");
  return static_cast<int>(device);
}

// With a guard on `device` held by the caller: creates the runtime's primary
// context there if needed, which also makes it the driver's current context
// for the cuMem* calls that follow.
void activate_primary_context() { C10_CUDA_CHECK(cudaFree(nullptr)); }

CUmemAllocationProp allocation_prop(int device, CUmemAllocationHandleType type) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = type;
  return prop;
}

size_t granularity(int device, CUmemAllocationHandleType type) {
  const CUmemAllocationProp prop = allocation_prop(device, type);
  size_t bytes = 0;
  check(driver().get_granularity(&bytes, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity");
  return bytes;
}

// Allocation handles cross the op boundary as the int64 with the same bits.
int64_t to_int(CUmemGenericAllocationHandle handle) { return static_cast<int64_t>(handle); }
CUmemGenericAllocationHandle to_handle(int64_t value) { return static_cast<CUmemGenericAllocationHandle>(value); }

// ---- the registry of live workspaces ------------------------------------------------

// Deliberately never destroyed: a workspace's deleter may run during static
// destruction at process exit, after a static set would be gone.
std::mutex& registry_mutex() {
  static auto* mutex = new std::mutex();
  return *mutex;
}

class Mapping;

// Base address -> the mapping that owns it (vmm_unmap / vmm_remap find it here).
std::unordered_map<const void*, Mapping*>& registry() {
  static auto* bases = new std::unordered_map<const void*, Mapping*>();
  return *bases;
}

// ---- one mapped workspace ---------------------------------------------------------------

// Teardown runs in a deleter, which must not throw. At process exit the
// driver may already be shut down; anything else is worth a warning.
void report_teardown(CUresult result, const char* call) {
  if (result == CUDA_SUCCESS || result == CUDA_ERROR_DEINITIALIZED) return;
  try {
    TORCH_WARN("moe_a2a: freeing a CUDA workspace: ", call, " failed: ", describe(result));
  } catch (...) {  // a warning filter that raises must not escape a destructor
  }
}

// Owns a reserved address range, the rows mapped into it and the allocation
// handle of every row. Destroyed by the workspace tensor's deleter, or by
// vmm_map when mapping fails part way; either way it undoes exactly what was
// done. The physical memory of a row lives on until every process that
// imported it has released its handle, so a peer may still write into a row
// whose owner has already let go.
class Mapping {
 public:
  Mapping(int64_t device, int64_t row_bytes, at::IntArrayRef handles)
      : device_(static_cast<int>(device)), row_bytes_(static_cast<size_t>(row_bytes)), rows_(handles.size()) {
    handles_.reserve(handles.size());
    for (const int64_t h : handles) handles_.push_back(to_handle(h));
  }

  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  // A destructor must not throw; a failure here can only be warned about.
  ~Mapping() {
    try {
      teardown();
    } catch (...) {
    }
  }

  // Reserves one range, maps row r at base + r * row_bytes, gives device_
  // read/write access to all of it and registers the base. The caller holds
  // a guard on device_.
  void map();

  // Unmaps every row and releases its handle, keeping the reserved range
  // (and so every address handed out). The caller holds a guard on device_.
  void unmap_rows();

  // Maps new handles (one per row, taken over also on failure) into the
  // range unmap_rows left. On failure the rows are unmapped again.
  void remap_rows(at::IntArrayRef handles);

  bool rows_mapped() const { return mapped_rows_ == handles_.size() && !handles_.empty(); }

  void* base() const { return reinterpret_cast<void*>(base_); }

 private:
  size_t total_bytes() const { return rows_ * row_bytes_; }
  void teardown();
  void map_rows();
  void release_rows();

  int device_;
  size_t row_bytes_;
  size_t rows_;
  std::vector<CUmemGenericAllocationHandle> handles_;
  CUdeviceptr base_ = 0;
  size_t mapped_rows_ = 0;
  bool registered_ = false;
};

void Mapping::teardown() {
  int previous = -1;
  const bool switched = cudaGetDevice(&previous) == cudaSuccess && cudaSetDevice(device_) == cudaSuccess;
  if (registered_) {
    {
      const std::lock_guard<std::mutex> lock(registry_mutex());
      registry().erase(base());
    }
    // Unmapping memory that queued kernels still use is undefined, and the
    // last reference may go while they run. (Not allowed during a stream
    // capture, which the workspace's owner must not overlap with its end.)
    const cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      if (err != cudaErrorCudartUnloading) {
        try {
          TORCH_WARN("moe_a2a: freeing a CUDA workspace: cudaDeviceSynchronize failed: ", cudaGetErrorString(err));
        } catch (...) {
        }
      }
    }
  }
  release_rows();
  if (base_ != 0) report_teardown(driver().address_free(base_, total_bytes()), "cuMemAddressFree");
  if (switched) (void)cudaSetDevice(previous);
}

// Never throws: teardown and the failure paths of remap_rows use it.
void Mapping::release_rows() {
  for (size_t r = 0; r < mapped_rows_; ++r) {
    report_teardown(driver().unmap(base_ + r * row_bytes_, row_bytes_), "cuMemUnmap");
  }
  mapped_rows_ = 0;
  for (const CUmemGenericAllocationHandle h : handles_) report_teardown(driver().release(h), "cuMemRelease");
  handles_.clear();
}

void Mapping::map() {
  const Driver& d = driver();
  const size_t alignment = granularity(device_, CU_MEM_HANDLE_TYPE_NONE);
  TORCH_CHECK_VALUE(row_bytes_ % alignment == 0, "size_per_rank ", row_bytes_,
                    " is not a multiple of the allocation granularity ", alignment, " of CUDA device ", device_);
  check(d.address_reserve(&base_, total_bytes(), alignment, 0, 0), "cuMemAddressReserve");
  map_rows();
  const std::lock_guard<std::mutex> lock(registry_mutex());
  registry().emplace(base(), this);
  registered_ = true;
}

void Mapping::map_rows() {
  const Driver& d = driver();
  for (size_t r = 0; r < handles_.size(); ++r) {
    const CUresult result = d.map(base_ + r * row_bytes_, row_bytes_, 0, handles_[r], 0);
    TORCH_CHECK(result == CUDA_SUCCESS, "cuMemMap of rank ", r, "'s row (", row_bytes_,
                " bytes) failed: ", describe(result));
    ++mapped_rows_;
  }
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  // Row by row, so an error names the row (the rank) this device cannot reach.
  for (size_t r = 0; r < handles_.size(); ++r) {
    const CUresult result = d.set_access(base_ + r * row_bytes_, row_bytes_, &access, 1);
    TORCH_CHECK(result == CUDA_SUCCESS, "cuMemSetAccess: CUDA device ", device_, " cannot map rank ", r,
                "'s row for reading and writing: ", describe(result),
                " (is there peer access between the GPUs of these ranks?)");
  }
}

void Mapping::unmap_rows() {
  TORCH_CHECK(rows_mapped(), "vmm_unmap: the workspace's memory is already released");
  // Unmapping memory that queued kernels still use is undefined.
  C10_CUDA_CHECK(cudaDeviceSynchronize());
  release_rows();
}

void Mapping::remap_rows(at::IntArrayRef handles) {
  if (!handles_.empty() || mapped_rows_ != 0) {
    for (const int64_t h : handles) report_teardown(driver().release(to_handle(h)), "cuMemRelease");
    TORCH_CHECK(false, "vmm_remap: the workspace's memory is mapped; release it first");
  }
  for (const int64_t h : handles) handles_.push_back(to_handle(h));
  TORCH_CHECK_VALUE(handles_.size() == rows_, "vmm_remap: one handle per row (", rows_, ") expected, got ",
                    handles_.size());
  try {
    map_rows();
  } catch (...) {
    release_rows();
    throw;
  }
}

// ---- operators -----------------------------------------------------------------------

int64_t vmm_granularity_op(int64_t device, c10::string_view type) {
  const int d = checked_device(device);
  const CUmemAllocationHandleType t = handle_type(type);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(d));
  activate_primary_context();
  return static_cast<int64_t>(granularity(d, t));
}

bool vmm_fabric_supported_op(int64_t device) {
  const int d = checked_device(device);
#if MOE_A2A_HAS_FABRIC
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(d));
  activate_primary_context();
  CUdevice cu_device = 0;
  check(driver().device_get(&cu_device, d), "cuDeviceGet");
  int supported = 0;
  const CUresult result =
      driver().device_get_attribute(&supported, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, cu_device);
  // A driver older than the attribute does not know it: no fabric handles there.
  if (result == CUDA_ERROR_INVALID_VALUE) return false;
  check(result, "cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED)");
  return supported != 0;
#else
  (void)d;
  return false;
#endif
}

int64_t vmm_create_op(int64_t device, int64_t size, c10::string_view type) {
  const int d = checked_device(device);
  const CUmemAllocationHandleType t = handle_type(type);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(d));
  activate_primary_context();
  const size_t unit = granularity(d, t);
  TORCH_CHECK_VALUE(size > 0 && static_cast<size_t>(size) % unit == 0, "vmm_create: size must be a positive ",
                    "multiple of the allocation granularity ", unit, " of CUDA device ", d, ", got ", size);
  const CUmemAllocationProp prop = allocation_prop(d, t);
  CUmemGenericAllocationHandle handle = 0;
  const CUresult result = driver().create(&handle, static_cast<size_t>(size), &prop, 0);
  TORCH_CHECK(result == CUDA_SUCCESS, "cuMemCreate of ", size, " bytes on CUDA device ", d, " (", std::string(type),
              " handles) failed: ", describe(result));
  return to_int(handle);
}

std::vector<int64_t> vmm_export_op(int64_t handle, c10::string_view type) {
  const CUmemAllocationHandleType t = handle_type(type);
#if MOE_A2A_HAS_FABRIC
  if (t == CU_MEM_HANDLE_TYPE_FABRIC) {
    CUmemFabricHandle fabric{};
    check(driver().export_handle(&fabric, to_handle(handle), t, 0), "cuMemExportToShareableHandle (fabric)");
    return std::vector<int64_t>(fabric.data, fabric.data + kFabricHandleBytes);
  }
#endif
  int fd = -1;
  check(driver().export_handle(&fd, to_handle(handle), t, 0), "cuMemExportToShareableHandle (posix_fd)");
  return {fd};
}

int64_t vmm_import_op(int64_t device, at::IntArrayRef shareable, c10::string_view type) {
  const int d = checked_device(device);
  const CUmemAllocationHandleType t = handle_type(type);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(d));
  activate_primary_context();
  CUmemGenericAllocationHandle handle = 0;
#if MOE_A2A_HAS_FABRIC
  if (t == CU_MEM_HANDLE_TYPE_FABRIC) {
    TORCH_CHECK_VALUE(shareable.size() == kFabricHandleBytes, "a fabric handle is ", kFabricHandleBytes, " bytes, got ",
                      shareable.size());
    CUmemFabricHandle fabric{};
    for (size_t i = 0; i < kFabricHandleBytes; ++i) {
      TORCH_CHECK_VALUE(shareable[i] >= 0 && shareable[i] <= 255, "fabric handle byte ", i,
                        " out of range: ", shareable[i]);
      fabric.data[i] = static_cast<unsigned char>(shareable[i]);
    }
    check(driver().import_handle(&handle, &fabric, t), "cuMemImportFromShareableHandle (fabric)");
    return to_int(handle);
  }
#endif
  TORCH_CHECK_VALUE(shareable.size() == 1 && shareable[0] >= 0, "a posix_fd handle is one file descriptor, got ",
                    shareable);
  // The driver takes a descriptor as the pointer-sized value of the int.
  void* fd = reinterpret_cast<void*>(static_cast<uintptr_t>(shareable[0]));
  check(driver().import_handle(&handle, fd, t), "cuMemImportFromShareableHandle (posix_fd)");
  return to_int(handle);
}

void vmm_release_op(int64_t handle) { check(driver().release(to_handle(handle)), "cuMemRelease"); }

at::Tensor vmm_map_op(int64_t device, int64_t size_per_rank, at::IntArrayRef handles) {
  // Ownership first: from here on, whatever fails releases every handle.
  auto mapping = std::make_unique<Mapping>(device, std::max<int64_t>(size_per_rank, 0), handles);
  TORCH_CHECK_VALUE(!handles.empty() && handles.size() <= static_cast<size_t>(kMaxRanks), "vmm_map: 1 to ", kMaxRanks,
                    " row handles, got ", handles.size());
  TORCH_CHECK_VALUE(size_per_rank > 0, "vmm_map: size_per_rank must be positive, got ", size_per_rank);
  const int d = checked_device(device);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(d));
  activate_primary_context();
  mapping->map();
  void* base = mapping->base();
  // The deleter owns the mapping from here on (if from_blob throws after
  // building its DataPtr, that DataPtr runs the deleter: never a double free).
  Mapping* owned = mapping.release();
  const at::Device where(at::kCUDA, static_cast<c10::DeviceIndex>(d));
  // The device is given, not looked up from the pointer: row 0 may live on
  // another GPU (the peer that created it), and the tensor belongs to `d`.
  return at::from_blob(
      base, {static_cast<int64_t>(handles.size()), size_per_rank}, [owned](void*) { delete owned; },
      at::TensorOptions().dtype(at::kByte).device(where), where);
}

// The registered mapping at `base` (a workspace's storage address); the caller holds registry_mutex().
Mapping& registered(int64_t base) {
  const auto found = registry().find(reinterpret_cast<const void*>(base));
  TORCH_CHECK_VALUE(found != registry().end(), "no multi-process CUDA workspace of this process starts at ",
                    reinterpret_cast<const void*>(base));
  return *found->second;
}

void vmm_unmap_op(int64_t device, int64_t base) {
  const int d = checked_device(device);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(d));
  const std::lock_guard<std::mutex> lock(registry_mutex());
  registered(base).unmap_rows();
}

void vmm_remap_op(int64_t device, int64_t base, at::IntArrayRef handles) {
  const int d = checked_device(device);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(d));
  activate_primary_context();
  const std::lock_guard<std::mutex> lock(registry_mutex());
  const auto found = registry().find(reinterpret_cast<const void*>(base));
  if (found == registry().end()) {
    // Taken over also on failure (the schema's promise).
    for (const int64_t h : handles) report_teardown(driver().release(to_handle(h)), "cuMemRelease");
    C10_THROW_ERROR(ValueError, c10::str("no multi-process CUDA workspace of this process starts at ",
                                         reinterpret_cast<const void*>(base)));
  }
  found->second->remap_rows(handles);
}

bool vmm_is_workspace_op(int64_t base) {
  const std::lock_guard<std::mutex> lock(registry_mutex());
  return registry().count(reinterpret_cast<const void*>(base)) != 0;
}

int64_t vmm_live_workspaces_op() {
  const std::lock_guard<std::mutex> lock(registry_mutex());
  return static_cast<int64_t>(registry().size());
}

}  // namespace

bool is_vmm_workspace(const void* base) {
  const std::lock_guard<std::mutex> lock(registry_mutex());
  return registry().count(base) != 0;
}

}  // namespace moe_a2a

// A fragment of the moe_a2a library: these ops exist only in builds with
// CUDA, which is how the Python layer tells whether it can map a workspace.
// No op takes a tensor, so each is one catch-all kernel.
TORCH_LIBRARY_FRAGMENT(moe_a2a, m) {
  using namespace moe_a2a;
  m.def(kSchemaVmmGranularity, &vmm_granularity_op);
  m.def(kSchemaVmmFabricSupported, &vmm_fabric_supported_op);
  m.def(kSchemaVmmCreate, &vmm_create_op);
  m.def(kSchemaVmmExport, &vmm_export_op);
  m.def(kSchemaVmmImport, &vmm_import_op);
  m.def(kSchemaVmmRelease, &vmm_release_op);
  m.def(kSchemaVmmMap, &vmm_map_op);
  m.def(kSchemaVmmLiveWorkspaces, &vmm_live_workspaces_op);
  m.def(kSchemaVmmUnmap, &vmm_unmap_op);
  m.def(kSchemaVmmRemap, &vmm_remap_op);
  m.def(kSchemaVmmIsWorkspace, &vmm_is_workspace_op);
}
