// silu(gate) * up in one pass, over the tensors' storage in memory order, so a
// transposed (but dense) pair needs no copy.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "vec8.h"

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

inline torch::Tensor silu_and_mul(torch::Tensor gate, torch::Tensor up) {
  TORCH_CHECK(gate.scalar_type() == torch::kFloat && up.scalar_type() == torch::kFloat,
              "silu_and_mul takes float32 tensors");
  TORCH_CHECK(gate.sizes() == up.sizes(), "silu_and_mul: gate and up differ in shape");
  if (!(gate.strides() == up.strides() && gate.is_non_overlapping_and_dense())) {
    gate = gate.contiguous();
    up = up.contiguous();
  }
  auto out = torch::empty_like(gate);  // same strides as gate
  const float* g = gate.data_ptr<float>();
  const float* u = up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t n = gate.numel();
  at::parallel_for(0, (n + 7) / 8, 2048, [&](int64_t begin, int64_t end) {
    silu_and_mul_row(g, u, o, begin * 8, std::min(end * 8, n));
  });
  return out;
}

}  // namespace lmport
