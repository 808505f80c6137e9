// A CUDA device guard and CUDA hooks for a CPU-only torch build, so that FakeTensorMode can run
// autograd on fake CUDA tensors (capture-megatron's GPU kernel set). Registers c10's own
// FakeGuardImpl<CUDA> as CUDA's device guard and CUDA hooks that report one device.
// With torch's CUDA build (Python 3.12's torch from the package registry: a machine without a
// GPU or its driver) torch's own CUDA guard and hooks would answer instead, and fail without a
// device: the shim loads torch's CUDA library first, so that torch registers them before the shim
// replaces them (the guard by registering after it, the hooks by a higher priority).
#include <dlfcn.h>

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

#ifdef CAPTURE_MEGATRON_TORCH_CUDA
static void* capture_megatron_torch_cuda =
    dlopen(CAPTURE_MEGATRON_TORCH_CUDA, RTLD_NOW | RTLD_GLOBAL);
#define CAPTURE_MEGATRON_HOOKS_PRIORITY c10::REGISTRY_PREFERRED
#else
#define CAPTURE_MEGATRON_HOOKS_PRIORITY c10::REGISTRY_DEFAULT
#endif

namespace c10::impl {
C10_REGISTER_GUARD_IMPL(CUDA, FakeGuardImpl<DeviceType::CUDA>);
}  // namespace c10::impl

namespace at {
struct CaptureMegatronFakeCUDAHooks final : CUDAHooksInterface {
  explicit CaptureMegatronFakeCUDAHooks(CUDAHooksArgs) {}
  void init() const override {}
  bool hasCUDA() const override { return true; }
  bool hasCUDART() const override { return true; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  int getNumGPUs() const override { return 1; }
  DeviceIndex current_device() const override { return 0; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
};
C10_REGISTER_TYPED_CLASS_WITH_PRIORITY(
    CUDAHooksRegistry, "CUDAHooks", CAPTURE_MEGATRON_HOOKS_PRIORITY, CaptureMegatronFakeCUDAHooks);
}  // namespace at
