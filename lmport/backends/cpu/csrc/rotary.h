// Rotary position embedding, "rotate half" convention (Llama, Mistral, Qwen), for
// q and k in one call: x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1].
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

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

}  // namespace lmport
