// The elementwise kernels: RMSNorm (rms_norm.h), silu(gate) * up (activation.h), rotary (rotary.h).
#include <ATen/Parallel.h>

#include <algorithm>

#include "activation.h"
#include "kernels.h"
#include "rms_norm.h"
#include "rotary.h"

namespace lmport {
namespace kernels {

void rms_norm(const float* xp, const float* wp, float* op, int64_t rows, int64_t N, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * N, wp, op + r * N, N, eps);
  });
}

void silu_and_mul(const float* g, const float* u, float* o, int64_t n) {
  at::parallel_for(0, (n + 7) / 8, 2048, [&](int64_t begin, int64_t end) {
    silu_and_mul_row(g, u, o, begin * 8, std::min(end * 8, n));
  });
}

void apply_rotary(const float* x, float* out, const float* cos, const float* sin, int64_t T, int64_t H, int64_t D) {
  detail::rotate(x, out, cos, sin, T, H, D);
}

}  // namespace kernels
}  // namespace lmport
