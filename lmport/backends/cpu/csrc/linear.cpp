// small_linear: float32 weights against a few rows of x (linear.h).
#include <ATen/Parallel.h>

#include <algorithm>

#include "kernels.h"
#include "linear.h"

namespace lmport {
namespace kernels {

void small_linear(const float* xp, int64_t M, int64_t K, const float* wp, int64_t N, const float* bp, float* yp) {
  using namespace linear_detail;
  // Each thread takes a contiguous run of weight rows, so W is read once in all.
  at::parallel_for(0, (N + kRows - 1) / kRows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * kRows;
      const float* next[kRows];
      for (int r = 0; r < kRows; ++r) next[r] = wp + std::min(n + kRows + r, N - 1) * K;
      rows_times_x(wp + n * K, std::min<int64_t>(kRows, N - n), K, xp, M, yp + n, N, bp ? bp + n : nullptr, next);
    }
  });
}

}  // namespace kernels
}  // namespace lmport
