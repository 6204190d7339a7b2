#include "common/cuda_util.cuh"

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
  if (dev < kMaxDevices) {
    cache[dev] = info;
    filled[dev] = true;
  }
  *out = info;
  return cudaSuccess;
}

}  // namespace jaxops::cuda
