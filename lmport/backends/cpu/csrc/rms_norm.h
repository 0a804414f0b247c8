// RMSNorm over the last axis in one pass per row, computed as transformers'
// Llama/Qwen models do: weight * (x * rsqrt(mean(x^2) + eps)).
#pragma once


#include <cmath>

#include "isa/vec8.h"

namespace lmport {

// One row of N: out may be x (each element is read before it is written).
inline void rms_norm_row(const float* x, const float* w, float* out, int64_t N, double eps) {
  const int64_t body = N - N % 8;
  vec8 acc = {};
  for (int64_t i = 0; i < body; i += 8) acc += load(x + i) * load(x + i);
  float ss = sum(acc);
  for (int64_t i = body; i < N; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / N + static_cast<float>(eps));
  for (int64_t i = 0; i < N; ++i) out[i] = w[i] * (x[i] * inv);
}

}  // namespace lmport
