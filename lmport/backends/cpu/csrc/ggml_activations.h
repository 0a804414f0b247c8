// x as ggml_linear's integer path holds it: rounded to int16 per run of 32 inputs (ggml_linear.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "isa/x86.h"

namespace lmport {
namespace ggml_detail {

// ---- The integer path (decode). ----

constexpr int kRun = 32;               // inputs per activation step
constexpr int64_t kIntegerRows = 8;    // rows of x up to which the integer path runs
constexpr int64_t kAhead = 16;         // weight rows fetched ahead (into L2), as in quant_linear.h

// x [M, K] rounded to int16 per run of 32 (step max|x_run| / 32767, rounded to nearest even as
// std::nearbyint does); per sub-block of 16 and of 32 inputs the step of its run and the sum of x.
struct Activations {
  std::vector<int16_t> codes;
  std::vector<float> step16, step32, sum16, sum32;
  int64_t K;
  template <int SUB> const float* step(int64_t m) const {
    return SUB == 16 ? step16.data() + m * K / 16 : step32.data() + m * K / 32;
  }
  template <int SUB> const float* sum(int64_t m) const {
    return SUB == 16 ? sum16.data() + m * K / 16 : sum32.data() + m * K / 32;
  }
};

using x86::hmax;

inline Activations quantize(const float* x, int64_t M, int64_t K) {
  const int64_t runs = M * K / kRun;
  Activations a{std::vector<int16_t>(M * K), std::vector<float>(2 * runs), std::vector<float>(runs),
                std::vector<float>(2 * runs), std::vector<float>(runs), K};
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t r = 0; r < runs; ++r) {
    const float* v = x + r * kRun;
    __m256 p[4];
    for (int i = 0; i < 4; ++i) p[i] = _mm256_loadu_ps(v + 8 * i);
    const float amax = hmax(_mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, p[0]), _mm256_andnot_ps(sign, p[1])),
                                          _mm256_max_ps(_mm256_andnot_ps(sign, p[2]), _mm256_andnot_ps(sign, p[3]))));
    const float lo = x86::hsum(_mm256_add_ps(p[0], p[1])), hi = x86::hsum(_mm256_add_ps(p[2], p[3]));
    const float d = amax / 32767.f, inv = d > 0.f ? 1.f / d : 0.f;
    const __m256 scale = _mm256_set1_ps(inv);
    for (int i = 0; i < 4; i += 2) {
      const __m256i c = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(p[i], scale)),
                                           _mm256_cvtps_epi32(_mm256_mul_ps(p[i + 1], scale)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.codes.data() + r * kRun + 8 * i),
                          _mm256_permute4x64_epi64(c, _MM_SHUFFLE(3, 1, 2, 0)));
    }
    a.step16[2 * r] = a.step16[2 * r + 1] = a.step32[r] = d;
    a.sum16[2 * r] = lo;
    a.sum16[2 * r + 1] = hi;
    a.sum32[r] = lo + hi;
  }
  return a;
}

}  // namespace ggml_detail
}  // namespace lmport
