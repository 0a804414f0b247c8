// silu(gate) * up in one pass, over the tensors' storage in memory order, so a
// transposed (but dense) pair needs no copy.
#pragma once


#include <algorithm>
#include <cmath>

#include "isa/vec8.h"

namespace lmport {

// out[i] = silu(gate[i]) * up[i] for i in [begin, end) (begin a multiple of 8): eight at a time, the rest one by one.
inline void silu_and_mul_row(const float* g, const float* u, float* o, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += 8) {
    if (i + 8 <= end) {
      const vec8 x = load(g + i);
      store(o + i, x / (1.f + exp8(-x)) * load(u + i));
    } else {
      for (int64_t j = i; j < end; ++j) o[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
    }
  }
}

}  // namespace lmport
