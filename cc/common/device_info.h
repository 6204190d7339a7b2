// Cached properties of the current CUDA device (host code only: the nanobind module includes it
// too, to report which plans the device takes).
#pragma once
#include <cuda_runtime_api.h>

namespace jaxops::cuda {

// Properties of the current device, read once per device.
struct DeviceInfo {
  int device = 0;
  int sm_count = 0;
  int cc_major = 0;
  int max_smem_optin = 0;   // bytes of dynamic shared memory a block may opt into
  int max_smem_per_sm = 0;
  // Peak DRAM bytes a cycle of one SM (both at their peak clocks): H100 SXM ~12.8, H200 ~18.8.
  double dram_bytes_per_sm_cycle = 0.0;
};
cudaError_t device_info(DeviceInfo* out);

// Whether DRAM outruns the SMs as on the H200: there the kernels that keep more bytes in flight
// (a cp.async ring or a second row buffer, more shared memory and instructions a row) win, on the
// H100 they lose (session 61, same-run A/B of the layer_norm plans chosen on H200s in sessions
// 37-46). The threshold, kFastDramBytesPerSmCycle, sits between the two chips. JAXOPS_FAST_DRAM=0/1
// (a test hook, read at every call) forces either answer, so either machine runs both plans.
constexpr double kFastDramBytesPerSmCycle = 15.5;
bool dram_outruns_sms(const DeviceInfo& info);

}  // namespace jaxops::cuda
