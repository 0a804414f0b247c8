// quant_linear's path without AVX-512 VNNI: a weight row's codes widened to int16 and dotted with x rounded
// to int16 (madd, or dpwssd where the CPU has AVX-VNNI), accumulated in float32.
#pragma once

#include <c10/util/Half.h>

#include "../../quant_format.h"
#include "../x86.h"

namespace lmport {
namespace quant_detail {

using x86::dot_s16;
using x86::hsum;

// The int32 sums of one run's 32 weight codes times its 32 int16 activations.
template <int BITS>
inline __m256i dot_run(const uint8_t* w, const int16_t* x) {
  __m128i lo, hi;  // codes of inputs 0..15 and 16..31, a byte each
  if constexpr (BITS == 4) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    const __m128i mask = _mm_set1_epi8(0x0F);
    lo = _mm_and_si128(raw, mask);
    hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  } else {
    lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16));
  }
  const __m256i wlo = BITS == 4 ? _mm256_cvtepu8_epi16(lo) : _mm256_cvtepi8_epi16(lo);
  const __m256i whi = BITS == 4 ? _mm256_cvtepu8_epi16(hi) : _mm256_cvtepi8_epi16(hi);
  const __m256i d = dot_s16(_mm256_setzero_si256(), wlo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return dot_s16(d, whi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16)));
}

// One output: weight row (its codes, scales and mins) against one quantized row of x.
// ``sd`` is scratch for one float per run: the weight scale times the activation scale.
template <int BITS>
inline float dot_row(const uint8_t* w, const at::Half* scales, const at::Half* mins, int64_t runs,
                     int64_t runs_per_group, const int16_t* xq, const float* xd, const float* xs, float* sd) {
  // The mins (null: none) meet the sum of x over each run; the scales fold into the activation scales.
  float offset = 0.f;
  int64_t b = 0;
  if (runs_per_group == 1) {
    __m256 off = _mm256_setzero_ps();
    for (; b + 8 <= runs; b += 8) {
      const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b)));
      _mm256_storeu_ps(sd + b, _mm256_mul_ps(s, _mm256_loadu_ps(xd + b)));
      if (mins) {
        const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + b)));
        off = _mm256_fmadd_ps(mn, _mm256_loadu_ps(xs + b), off);
      }
    }
    offset = hsum(off);
  }
  for (; b < runs; ++b) {
    const int64_t g = b / runs_per_group;
    sd[b] = _cvtsh_ss(scales[g].x) * xd[b];
    if (mins) offset += _cvtsh_ss(mins[g].x) * xs[b];
  }
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (b = 0; b < runs; ++b) {
    const __m256i d = dot_run<BITS>(w + b * kRun * BITS / 8, xq + b * kRun);
    // Two accumulators: consecutive runs do not wait on each other's FMA.
    if (b & 1) acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_broadcast_ss(sd + b), acc1);
    else acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_broadcast_ss(sd + b), acc0);
  }
  return hsum(_mm256_add_ps(acc0, acc1)) + offset;
}

}  // namespace quant_detail
}  // namespace lmport
