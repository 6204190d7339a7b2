#include "relu/relu_cpu.h"

#include "common/cpu_bits.h"
#include "common/cpu_vec.h"

namespace jaxops::relu {
namespace {

// Relu of n <= 32 elements on their raw bits; returns their mask word. Positive (x > 0): sign
// clear, not zero, not NaN; kept: positive or NaN (NaN propagates like jax.nn.relu); everything
// else becomes +0 (all bits 0). Integer masks, not branches: the loop vectorizes (cpu_bits.h).
template <class T, int N>
uint32_t forward_word(const typename cpu::Raw<T>::type* __restrict x, typename cpu::Raw<T>::type* __restrict y,
                      int n) {
  using R = typename cpu::Raw<T>::type;
  using cpu::ones_if;
  uint32_t bits = 0;
  for (int j = 0; j < (N == 32 ? 32 : n); ++j) {
    const R r = x[j];
    const R gt0 = ones_if<R>(r > 0);  // sign clear and not zero: positive, +inf or +NaN
    const R nan = ones_if<R>((r & cpu::Raw<T>::kMag) > cpu::Raw<T>::kInf);
    y[j] = r & (gt0 | nan);
    bits |= cpu::kBit[j] & ones_if<uint32_t>((r > 0) & (r <= cpu::Raw<T>::kInf));
  }
  return bits;
}

template <class T, int N>
void backward_word(const typename cpu::Raw<T>::type* __restrict dy, uint32_t word,
                   typename cpu::Raw<T>::type* __restrict dx, int n) {
  using R = typename cpu::Raw<T>::type;
  for (int j = 0; j < (N == 32 ? 32 : n); ++j) dx[j] = dy[j] & cpu::ones_if<R>((word & cpu::kBit[j]) != 0);
}

template <class T>
void forward_rows(const T* x, T* y, uint32_t* mask, int64_t rows, int64_t cols, int64_t wpr) {
  using R = typename cpu::Raw<T>::type;
  for (int64_t r = 0; r < rows; ++r) {
    const R* xr = reinterpret_cast<const R*>(x + r * cols);
    R* yr = reinterpret_cast<R*>(y + r * cols);
    uint32_t* mr = mask ? mask + r * wpr : nullptr;
    int64_t w = 0;
    for (; 32 * (w + 1) <= cols; ++w) {
      const uint32_t bits = forward_word<T, 32>(xr + 32 * w, yr + 32 * w, 32);
      if (mr) mr[w] = bits;
    }
    if (32 * w < cols) {
      const uint32_t bits = forward_word<T, 0>(xr + 32 * w, yr + 32 * w, static_cast<int>(cols - 32 * w));
      if (mr) mr[w++] = bits;
    }
    for (; mr && w < wpr; ++w) mr[w] = 0;
  }
}

template <class T>
void backward_rows(const T* dy, const uint32_t* mask, T* dx, int64_t rows, int64_t cols, int64_t wpr) {
  using R = typename cpu::Raw<T>::type;
  for (int64_t r = 0; r < rows; ++r) {
    const R* dyr = reinterpret_cast<const R*>(dy + r * cols);
    R* dxr = reinterpret_cast<R*>(dx + r * cols);
    const uint32_t* mr = mask + r * wpr;
    int64_t w = 0;
    for (; 32 * (w + 1) <= cols; ++w) backward_word<T, 32>(dyr + 32 * w, mr[w], dxr + 32 * w, 32);
    if (32 * w < cols) backward_word<T, 0>(dyr + 32 * w, mr[w], dxr + 32 * w, static_cast<int>(cols - 32 * w));
  }
}

}  // namespace

bool forward_cpu(Dtype dtype, const void* x, void* y, uint32_t* mask, int64_t rows, int64_t cols,
                 int64_t words_per_row) {
  return cpu::run_isa<8>([&](auto) {  // auto-vectorized loops: 32-byte vectors in the AVX2 clone
    return cpu::dispatch_float(dtype, [&](auto tag) {
      using T = decltype(tag);
      forward_rows(static_cast<const T*>(x), static_cast<T*>(y), words_per_row ? mask : nullptr, rows,
                   cols, words_per_row);
    });
  });
}

bool backward_cpu(Dtype dtype, const void* dy, const uint32_t* mask, void* dx, int64_t rows,
                  int64_t cols, int64_t words_per_row) {
  return cpu::run_isa<8>([&](auto) {
    return cpu::dispatch_float(dtype, [&](auto tag) {
      using T = decltype(tag);
      backward_rows(static_cast<const T*>(dy), mask, static_cast<T*>(dx), rows, cols, words_per_row);
    });
  });
}

}  // namespace jaxops::relu
