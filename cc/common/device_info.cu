#include "common/device_info.h"

#include <cstdlib>

namespace jaxops::cuda {

cudaError_t device_info(DeviceInfo* out) {
  constexpr int kMaxDevices = 64;
  static DeviceInfo cache[kMaxDevices];
  static bool filled[kMaxDevices] = {};
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < kMaxDevices && filled[dev]) {
    *out = cache[dev];
    return cudaSuccess;
  }
  DeviceInfo info;
  info.device = dev;
  if ((err = cudaDeviceGetAttribute(&info.sm_count, cudaDevAttrMultiProcessorCount, dev))) return err;
  if ((err = cudaDeviceGetAttribute(&info.cc_major, cudaDevAttrComputeCapabilityMajor, dev))) return err;
  if ((err = cudaDeviceGetAttribute(&info.max_smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev))) return err;
  if ((err = cudaDeviceGetAttribute(&info.max_smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev))) return err;
  int mem_khz = 0, bus_bits = 0, sm_khz = 0;
  if ((err = cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, dev))) return err;
  if ((err = cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, dev))) return err;
  if ((err = cudaDeviceGetAttribute(&sm_khz, cudaDevAttrClockRate, dev))) return err;
  if (sm_khz > 0 && info.sm_count > 0)  // double data rate: two transfers a memory clock
    info.dram_bytes_per_sm_cycle = 2.0 * mem_khz * (bus_bits / 8.0) / (static_cast<double>(sm_khz) * info.sm_count);
  if (dev < kMaxDevices) {
    cache[dev] = info;
    filled[dev] = true;
  }
  *out = info;
  return cudaSuccess;
}

bool dram_outruns_sms(const DeviceInfo& info) {
  if (const char* e = std::getenv("JAXOPS_FAST_DRAM"); e != nullptr && (e[0] == '0' || e[0] == '1'))
    return e[0] == '1';
  return info.dram_bytes_per_sm_cycle > kFastDramBytesPerSmCycle;
}

}  // namespace jaxops::cuda
