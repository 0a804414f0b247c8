// ggml_linear's integer path on the AVX2 path: a tile of rows of x against one weight row.
#pragma once

#include <cstdint>

#include "../../ggml_activations.h"
#include "../../ggml_blocks.h"
#include "quant_int16.h"

namespace lmport {
namespace ggml_detail {

// A tile of MT rows of x (from m0) against RT weight rows (``rows``: their blocks; ``w``: their scales and
// mins, and their codes unless the type unpacks them from the blocks itself):
// out[j * RT + r] = sum_k x[m0 + j, k] w_r[k]. ``folded`` is scratch for MT * RT * K / kSub floats: each
// sub-block's scale times x's step there.
template <class T, int MT, int RT>
inline void dot_tile(const uint8_t* const* rows, const RowBuffer* w, const Activations& a, int64_t m0, float* folded,
                     float* out) {
  constexpr int SUB = T::kSub, kAcc = MT * RT;
  const int64_t K = a.K, runs = K / kRun, subs = K / SUB;
  for (int j = 0; j < MT; ++j)
    for (int r = 0; r < RT; ++r) {
      const float* step = a.step<SUB>(m0 + j);
      float* f = folded + (j * RT + r) * subs;
      for (int64_t s = 0; s < subs; ++s) f[s] = w[r].scales[s] * step[s];
    }
  static_assert(RT == 1, "the AVX2 path takes one weight row at a time (16 registers)");
  const int8_t* q = w[0].codes.data();
  __m256 acc0[MT], acc1[MT];
  for (int j = 0; j < MT; ++j) acc0[j] = acc1[j] = _mm256_setzero_ps();
  const auto run = [&](int64_t b, __m256* acc, __m256* other) {
    const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * kRun)));
    const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * kRun + 16)));
    for (int j = 0; j < MT; ++j) {
      const int16_t* x = a.codes.data() + (m0 + j) * K + b * kRun;
      const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
      const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
      const float* f = folded + j * subs;
      if constexpr (SUB == 32) {
        const __m256i d = quant_detail::dot_s16(quant_detail::dot_s16(_mm256_setzero_si256(), lo, xlo), hi, xhi);
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(f[b]), acc[j]);
      } else {   // a scale each half
        const __m256i d0 = quant_detail::dot_s16(_mm256_setzero_si256(), lo, xlo);
        const __m256i d1 = quant_detail::dot_s16(_mm256_setzero_si256(), hi, xhi);
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_set1_ps(f[2 * b]), acc[j]);
        other[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_set1_ps(f[2 * b + 1]), other[j]);
      }
    }
  };
  int64_t b = 0;
  for (; b + 1 < runs; b += 2) {
    run(b, acc0, acc1);
    run(b + 1, acc1, acc0);
  }
  if (b < runs) run(b, acc0, acc1);
  for (int j = 0; j < MT; ++j) {
    float v = x86::hsum(_mm256_add_ps(acc0[j], acc1[j]));
    if constexpr (T::kMin) {
      const float* xs = a.sum<SUB>(m0 + j);
      for (int64_t s = 0; s < subs; ++s) v += w[0].mins[s] * xs[s];
    }
    out[j] = v;
  }
}

// One row of x (single-stream decode) takes the weight rows kRowBlock at a time: x's runs are loaded
// once for them and their sums are independent. More rows of x take one weight row at a time against
// up to kTile rows of x.
constexpr int kRowBlock = 1;

}  // namespace ggml_detail
}  // namespace lmport
