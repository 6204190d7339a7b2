#include "common/registry.h"

namespace jaxops {

std::vector<Registration>& registry() {
  static std::vector<Registration> entries;
  return entries;
}

}  // namespace jaxops
