// Turns a CUDA runtime status into an FFI error that names the op (host code only).
#pragma once
#include <cuda_runtime_api.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxops {

inline xla::ffi::Error cuda_status(cudaError_t err, const char* op) {
  if (err == cudaSuccess) return xla::ffi::Error::Success();
  return xla::ffi::Error::Internal(std::string("jaxops.") + op + ": CUDA error: " +
                                   cudaGetErrorString(err));
}

}  // namespace jaxops
