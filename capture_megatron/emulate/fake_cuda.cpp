// A CUDA device guard and CUDA hooks for a CPU-only torch build, so that FakeTensorMode can run
// autograd on fake CUDA tensors (capture-megatron's GPU kernel set). Registers c10's own
// FakeGuardImpl<CUDA> as CUDA's device guard and CUDA hooks that report one device.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

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
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", CaptureMegatronFakeCUDAHooks);
}  // namespace at
