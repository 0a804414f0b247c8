// ggml_linear's integer path with AVX-512: a tile of rows of x against RT weight rows, 512 bits wide.
#pragma once

#include <cstdint>

#include "../../ggml_activations.h"
#include "../../ggml_blocks.h"
#include "quant_int8.h"

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
  // A run's 32 codes widened to int16 in one register; the products summed in pairs leave inputs 0..15
  // in lanes 0..7 and 16..31 in lanes 8..15, the halves of a run that 16-input sub-blocks scale apart.
  __m512 acc0[kAcc], acc1[kAcc];   // even and odd runs: consecutive runs do not wait on each other's FMA
  for (int i = 0; i < kAcc; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  constexpr int runs_per_block = T::kElements / kRun;
  const auto run = [&](int64_t b, __m512* acc) {
    __m512i wq[RT];
    for (int r = 0; r < RT; ++r) {
      if constexpr (T::kCodes512)
        wq[r] = T::codes512(rows[r] + b / runs_per_block * T::kBytes, static_cast<int>(b % runs_per_block));
      else
        wq[r] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r].codes.data() + b * kRun)));
    }
    for (int j = 0; j < MT; ++j) {
      const __m512i xq = _mm512_loadu_si512(a.codes.data() + (m0 + j) * K + b * kRun);
      for (int r = 0; r < RT; ++r) {
        const __m512 d = _mm512_cvtepi32_ps(_mm512_madd_epi16(wq[r], xq));   // a run's sums, nothing to add to
        const float* f = folded + (j * RT + r) * subs;
        __m512& sum = acc[j * RT + r];
        if constexpr (SUB == 32) {
          sum = _mm512_fmadd_ps(d, _mm512_set1_ps(f[b]), sum);
        } else {   // each half of the lanes with its sub-block's scale
          sum = _mm512_mask3_fmadd_ps(d, _mm512_set1_ps(f[2 * b]), sum, 0x00FF);
          sum = _mm512_mask3_fmadd_ps(d, _mm512_set1_ps(f[2 * b + 1]), sum, 0xFF00);
        }
      }
    }
  };
  int64_t b = 0;
  for (; b + 1 < runs; b += 2) {
    run(b, acc0);
    run(b + 1, acc1);
  }
  if (b < runs) run(b, acc0);
  for (int j = 0; j < MT; ++j)
    for (int r = 0; r < RT; ++r) {
      __m512 v = _mm512_add_ps(acc0[j * RT + r], acc1[j * RT + r]);
      if constexpr (T::kMin) {   // the mins meet the sums of x over their sub-blocks
        const float* xs = a.sum<SUB>(m0 + j);
        for (int64_t s = 0; s < subs; s += 16) {
          const __mmask16 k = quant512::tail_mask(subs - s);
          v = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, w[r].mins.data() + s), _mm512_maskz_loadu_ps(k, xs + s), v);
        }
      }
      out[j * RT + r] = _mm512_reduce_add_ps(v);
    }
}

// One row of x (single-stream decode) takes the weight rows kRowBlock at a time: x's runs are loaded
// once for them and their sums are independent. More rows of x take one weight row at a time against
// up to kTile rows of x.
constexpr int kRowBlock = 4;

}  // namespace ggml_detail
}  // namespace lmport
