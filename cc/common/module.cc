// The one nanobind module of a handler library (compiled twice: _jaxops_cpu and _jaxops_cuda).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "common/registry.h"
#ifdef JAXOPS_PLATFORM_CUDA
#include "common/device_info.h"
#endif
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace {

// Registered for the CUDA platform when the CUDA handlers were not built, so a GPU user gets
// this message instead of XLA's "no handler registered".
ffi::Error MissingCudaImpl() {
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "jaxops was built without its CUDA handlers (no CUDA compiler was found at "
                    "build time). Rebuild on a machine with nvcc: "
                    "JAXOPS_CUDA=ON pip install --no-build-isolation --force-reinstall jaxops");
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(MissingCuda, MissingCudaImpl, ffi::Ffi::Bind());

}  // namespace

#define JAXOPS_NB_MODULE(name, m) NB_MODULE(name, m)

JAXOPS_NB_MODULE(JAXOPS_MODULE_NAME, m) {
  m.def("registrations", []() {
    nb::dict targets;
    for (const auto& r : jaxops::registry()) {
      targets[r.name] = nb::capsule(reinterpret_cast<void*>(r.fn));
    }
    return targets;
  });
  m.def("missing_cuda_handler", []() { return nb::capsule(reinterpret_cast<void*>(MissingCuda)); });
  m.def("build_info", []() {
    nb::dict info;
    info["ffi_api_version"] = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
#ifdef JAXOPS_PLATFORM_CUDA
    info["platform"] = "cuda";
    info["cuda_architectures"] = std::string(JAXOPS_CUDA_ARCHS);
    info["cuda_version"] = std::string(JAXOPS_CUDA_VERSION);
#else
    info["platform"] = "cpu";
#endif
    info["targets"] = jaxops::registry().size();
    return info;
  });
#ifdef JAXOPS_PLATFORM_CUDA
  // The current device's DRAM rate and whether the kernels take its fast-DRAM plans
  // (cuda::dram_outruns_sms); None where no device answers (no GPU, no driver).
  m.def("device_plan", []() -> nb::object {
    jaxops::cuda::DeviceInfo info;
    if (jaxops::cuda::device_info(&info) != cudaSuccess) {
      cudaGetLastError();  // the failed query leaves no sticky error behind
      return nb::none();
    }
    nb::dict plan;
    plan["device"] = info.device;
    plan["dram_bytes_per_sm_cycle"] = info.dram_bytes_per_sm_cycle;
    plan["fast_dram"] = jaxops::cuda::dram_outruns_sms(info);
    return plan;
  });
#endif
}
