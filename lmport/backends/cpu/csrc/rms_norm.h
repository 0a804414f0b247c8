// RMSNorm over the last axis in one pass per row, computed as transformers'
// Llama/Qwen models do: weight * (x * rsqrt(mean(x^2) + eps)).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "vec8.h"

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

inline torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat,
              "rms_norm takes float32 x and weight");
  const int64_t N = x.size(-1);
  TORCH_CHECK(weight.numel() == N, "rms_norm: weight has ", weight.numel(), " elements for rows of ", N);
  auto input = x.contiguous();
  auto w = weight.contiguous();
  auto out = torch::empty_like(input);
  const float* xp = input.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t rows = input.numel() / N;

  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * N, wp, op + r * N, N, eps);
  });
  return out;
}

}  // namespace lmport
