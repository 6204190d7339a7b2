// CPU twin of the KNN selection kernel: for each query row, the k smallest keys among its
// running list and the tile's valid columns. A threshold filter (the current k-th key) keeps
// the candidate buffer small; nth_element compacts it when it grows past 2k.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "knn/knn_key.h"
#include "knn/knn_select.h"

namespace jaxops::knn {

void select_cpu(const SelectView& v, const SelectBuffers& b, int64_t row0, int64_t row1) {
  const int64_t k = v.k, cols = v.cols;
  std::vector<uint64_t> cand;
  cand.reserve(static_cast<size_t>(3 * k + 16));
  for (int64_t row = row0; row < row1; ++row) {
    const int64_t bt = row / v.rows;
    const int64_t base = b.base[v.base_per_batch ? bt : 0];
    // Columns at or beyond n are padding; a negative base (never produced) selects nothing below 0.
    const int64_t begin = std::max<int64_t>(0, -base);
    const int64_t limit = std::max<int64_t>(0, std::min<int64_t>(cols, v.n - base));
    const float* rn = b.rn + bt * cols;
    const float* tile = b.tile + row * cols;
    const float qn = v.distances ? 0.0f : b.qn[row];
    cand.clear();
    for (int64_t j = 0; j < k; ++j) {
      const float d = b.prev_d[row * k + j];
      const int32_t i = b.prev_i[row * k + j];
      cand.push_back(i < 0 ? kEmptyKey : make_key(clamp_distance(d), static_cast<uint32_t>(i)));
    }
    // The k-th smallest of k keys is their largest: no sort (it cost k log k a row a tile, the
    // most of a tile's time at large k), and no assumption that the list arrives sorted.
    uint64_t thr = *std::max_element(cand.begin(), cand.end());
    for (int64_t c = begin; c < limit; ++c) {
      const float d = v.distances ? tile[c] : (qn + rn[c]) - 2.0f * tile[c];
      const uint64_t key = make_key(clamp_distance(d), static_cast<uint32_t>(base + c));
      if (key >= thr) continue;
      cand.push_back(key);
      if (static_cast<int64_t>(cand.size()) >= 3 * k) {
        std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end());
        cand.resize(k);
        thr = *std::max_element(cand.begin(), cand.end());
      }
    }
    std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end());
    std::sort(cand.begin(), cand.begin() + k);
    for (int64_t j = 0; j < k; ++j) {
      b.out_d[row * k + j] = key_distance(cand[j]);
      b.out_i[row * k + j] = key_index(cand[j]);
    }
  }
}

}  // namespace jaxops::knn
