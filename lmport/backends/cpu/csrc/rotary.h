// Rotary position embedding, "rotate half" convention (Llama, Mistral, Qwen), for
// q and k in one call: x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1].
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <tuple>

namespace lmport {

// One head's row of D at a position whose table rows are cos, sin: out may be x.
inline void rotate_row(const float* x, float* out, const float* cos, const float* sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    out[i] = a * cos[i] - b * sin[i];
    out[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

namespace detail {

// x, out [T, H, D]; cos, sin [T, D].
inline void rotate(const float* x, float* out, const float* cos, const float* sin, int64_t T, int64_t H,
                   int64_t D) {
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + t * D;
      const float* s = sin + t * D;
      for (int64_t h = 0; h < H; ++h) rotate_row(x + (t * H + h) * D, out + (t * H + h) * D, c, s, D);
    }
  });
}

}  // namespace detail

// q [T, Hq, D], k [T, Hkv, D], cos/sin [T, D] -> new contiguous (q, k).
inline std::tuple<torch::Tensor, torch::Tensor> apply_rotary(torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                                                             torch::Tensor sin) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k.scalar_type() == torch::kFloat &&
              cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat,
              "apply_rotary takes float32 tensors");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.size(0) == q.size(0) && k.size(2) == q.size(2),
              "apply_rotary: q is [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim]; got ", q.sizes(),
              " and ", k.sizes());
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.numel() == q.size(0) * q.size(2),
              "apply_rotary: cos and sin are [tokens, head_dim]; got ", cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(q.size(-1) % 2 == 0, "apply_rotary needs an even head dim");
  auto qc = q.contiguous(), kc = k.contiguous(), c = cos.contiguous(), s = sin.contiguous();
  auto q_out = torch::empty_like(qc), k_out = torch::empty_like(kc);
  const int64_t T = q.size(0), D = q.size(2);
  detail::rotate(qc.data_ptr<float>(), q_out.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(), T,
                 q.size(1), D);
  detail::rotate(kc.data_ptr<float>(), k_out.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(), T,
                 k.size(1), D);
  return {q_out, k_out};
}

}  // namespace lmport
