// Handlers register themselves at load time, so each op family adds targets without editing
// a central list; the nanobind module of each library hands the list to Python.
#pragma once
#include <vector>

#include "xla/ffi/api/c_api.h"

namespace jaxops {

using HandlerFn = XLA_FFI_Error* (*)(XLA_FFI_CallFrame*);

struct Registration {
  const char* name;
  HandlerFn fn;
};

std::vector<Registration>& registry();

struct Registrar {
  Registrar(const char* name, HandlerFn fn) { registry().push_back({name, fn}); }
};

}  // namespace jaxops

// Registers `symbol` (an XLA_FFI_DEFINE_HANDLER_SYMBOL) as custom-call target `target_name`
// of the library this file is linked into (CPU or CUDA).
#define JAXOPS_REGISTER(target_name, symbol) \
  static ::jaxops::Registrar symbol##_registrar(target_name, symbol)
