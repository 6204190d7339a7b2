// A dtype tag shared by handlers (host C++) and kernels (nvcc), so kernels need no FFI headers.
#pragma once

namespace jaxops {

enum class Dtype : int { kF32, kF64, kBF16, kF16, kInvalid };

inline const char* dtype_name(Dtype d) {
  switch (d) {
    case Dtype::kF32: return "float32";
    case Dtype::kF64: return "float64";
    case Dtype::kBF16: return "bfloat16";
    case Dtype::kF16: return "float16";
    default: return "unsupported";
  }
}

}  // namespace jaxops
