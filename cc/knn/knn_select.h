// The one KNN kernel entry point, for the CPU twin and the CUDA launcher alike: merge one tile of
// reference columns into each query's running top-k list (see knn_key.h for the order).
#pragma once
#include <cstdint>

#include "knn/knn_view.h"

namespace jaxops::knn {

// CPU twin: blocked threshold filter + nth_element, identical order and tie rules; query rows
// [row0, row1) of the batch * rows flattened.
void select_cpu(const SelectView& v, const SelectBuffers& b, int64_t row0, int64_t row1);

}  // namespace jaxops::knn
