// A mixture of experts' routed experts over GGUF blocks in one call (lmport.ops.moe.quantized_moe, which the
// backend's Python loop runs): each expert that has tokens in turn, its gate, up and down by ggml_linear on its
// rows of the stacked weights, the activation between them, its results added into out in expert order: the same
// kernels on the same rows in the same order, without the dozen torch calls an expert costs in Python.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"

namespace lmport {
namespace kernels {

namespace {

// out [n, rows] = xs [n, in] W_e^T (+ W_e's bias) for expert e of ``stack``.
void expert_linear(const ExpertStack& stack, int64_t e, const float* xs, int64_t n, float* out) {
  int64_t elements = 0, bytes = 0;
  ggml_block_shape(stack.type, elements, bytes);
  const int64_t row_bytes = stack.in_features / elements * bytes;
  ggml_linear(xs, n, stack.in_features, stack.blocks + e * stack.rows * row_bytes, stack.rows, stack.type,
              stack.row_group, stack.bias ? stack.bias + e * stack.rows : nullptr, out);
}

// gpt-oss's clamped SwiGLU (lmport.ops.moe.clamped_swiglu) into gate.
void clamped_swiglu(float* gate, const float* up, int64_t count, float alpha, float limit) {
  for (int64_t i = 0; i < count; ++i) {
    const float g = std::min(gate[i], limit), u = std::clamp(up[i], -limit, limit);
    gate[i] = (u + 1.f) * (g * (1.f / (1.f + std::exp(-(g * alpha)))));
  }
}

}  // namespace

void ggml_experts(const float* x, int64_t T, int64_t H, const int64_t* ids, const float* weights, int64_t k,
                  int64_t experts, const ExpertStack& gate, const ExpertStack& up, const ExpertStack& down,
                  const ExpertActivation& activation, float* out) {
  // The (token, slot) pairs grouped by expert, in order within each (a stable sort by expert).
  std::vector<int64_t> starts(experts + 1, 0), pairs(T * k);
  for (int64_t p = 0; p < T * k; ++p) ++starts[ids[p] + 1];
  for (int64_t e = 0; e < experts; ++e) starts[e + 1] += starts[e];
  std::vector<int64_t> next(starts.begin(), starts.end() - 1);
  for (int64_t p = 0; p < T * k; ++p) pairs[next[ids[p]]++] = p;

  const int64_t inter = gate.rows;
  std::fill(out, out + T * H, 0.f);
  std::vector<float> xs, g, u, y;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t first = starts[e], n = starts[e + 1] - first;
    if (n == 0) continue;
    xs.resize(n * H), g.resize(n * inter), u.resize(n * inter), y.resize(n * H);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = pairs[first + i];
      const float* row = x + p / k * H;
      const float w = activation.scale_inputs ? weights[p] : 1.f;
      for (int64_t j = 0; j < H; ++j) xs[i * H + j] = activation.scale_inputs ? row[j] * w : row[j];
    }
    expert_linear(gate, e, xs.data(), n, g.data());
    expert_linear(up, e, xs.data(), n, u.data());
    if (activation.clamped)
      clamped_swiglu(g.data(), u.data(), n * inter, activation.alpha, activation.limit);
    else
      silu_and_mul(g.data(), u.data(), g.data(), n * inter);
    expert_linear(down, e, g.data(), n, y.data());
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = pairs[first + i];
      const float w = activation.scale_inputs ? 1.f : weights[p];
      float* o = out + p / k * H;
      for (int64_t j = 0; j < H; ++j) o[j] += activation.scale_inputs ? y[i * H + j] : y[i * H + j] * w;
    }
  }
}

}  // namespace kernels
}  // namespace lmport
