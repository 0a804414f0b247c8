// Linear layers over weights in lmport's quantized format (docs/weight-quantization.md):
// per group of inputs w = scale * q + min, 4-bit codes (0..15) two a byte with byte j of each
// 32-input run holding inputs j (low nibble) and j + 16 (high), or signed 8-bit codes.
//
// quant_linear, up to kIntegerRows (8) rows of x (a decode step), in integer arithmetic. With AVX-512
// VNNI (quant512, isa/avx512/quant_int8.h) x is held as two int8 codes per input, as fine as int16, and the weight codes are
// dotted with each as bytes (vpdpbusd), 8 weight rows at a time. Otherwise (AVX2) x is rounded once
// per call to int16 in runs of 32 (scale = max|x| / 32767, a relative step of 3e-5), each weight run
// widened to int16 and dotted with it (isa/avx2/quant_int16.h: madd, or dpwssd where the CPU has AVX-VNNI), accumulated in
// float32. Either way every packed weight byte is read once a call, which is what bounds a decode
// step. More rows (a batched decode step): tiles of weight rows expanded to float32 in cache
// (linear_by_tiles). quant_dequantize (prefill) expands the whole weight to float32 for the BLAS.
// A weight whose rows are interleaved in groups of 16 (``row_group``: a model's linears as the cpu
// backend holds them) runs every row of x a step passes through interleaved_rows.h's kernel instead
// (x as two int8 codes with AVX-512 VNNI, int16 on the AVX2 path); quant_dequantize reads its rows
// back in order.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cmath>
#include <vector>

#include "interleaved_rows.h"   // rows interleaved in groups of 16
#include "isa/avx2/quant_int16.h"
#include "isa/isa.h"
#include "linear.h"
#include "quant_format.h"
#ifdef LMPORT_ISA_AVX512
#include "isa/avx512/quant_int8.h"   // the path for up to kInt8Rows rows of x in int8 arithmetic
#endif

namespace lmport {

namespace quant_detail {

// x [M, K] -> int16 codes, one scale and the float sum of x per run of 32.
struct QuantizedRows {
  std::vector<int16_t> codes;
  std::vector<float> scales, sums;
};

inline QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t runs = K / kRun;
  QuantizedRows q{std::vector<int16_t>(M * K), std::vector<float>(M * runs), std::vector<float>(M * runs)};
  for (int64_t r = 0; r < M * runs; ++r) {
    const float* v = x + r * kRun;
    float amax = 0.f, sum = 0.f;
    for (int i = 0; i < kRun; ++i) {
      amax = std::max(amax, std::fabs(v[i]));
      sum += v[i];
    }
    const float d = amax / 32767.f, inv = d > 0.f ? 1.f / d : 0.f;
    for (int i = 0; i < kRun; ++i) q.codes[r * kRun + i] = static_cast<int16_t>(std::nearbyint(v[i] * inv));
    q.scales[r] = d;
    q.sums[r] = sum;
  }
  return q;
}

// Weight row w (its K codes, scales and mins, null for none) as float32: out[k] = s * q + min.
inline void dequantize_row(const uint8_t* w, const at::Half* scales, const at::Half* mins, int64_t K,
                           int64_t group_size, int64_t bits, float* out) {
#ifdef LMPORT_ISA_AVX512
  if (bits == 4) {   // a run's 16 possible values s * q + min, looked up by its codes (vpermps reads 4 bits)
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t k = 0; k < K; k += kRun) {
      const float s = static_cast<float>(scales[k / group_size]);
      const float mn = mins ? static_cast<float>(mins[k / group_size]) : 0.f;
      const __m512 values = _mm512_add_ps(_mm512_mul_ps(codes, _mm512_set1_ps(s)), _mm512_set1_ps(mn));
      const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k / 2)));
      _mm512_storeu_ps(out + k, _mm512_permutexvar_ps(bytes, values));   // low nibbles: inputs 0..15
      _mm512_storeu_ps(out + k + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), values));   // 16..31
    }
    return;
  }
#endif
  for (int64_t k = 0; k < K; k += kRun) {
    const float s = static_cast<float>(scales[k / group_size]);
    const float mn = mins ? static_cast<float>(mins[k / group_size]) : 0.f;
    // The run's 32 codes as bytes in input order, widened 8 at a time to float.
    __m128i lo, hi;
    if (bits == 4) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k / 2));
      lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
      hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
    } else {
      lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k));
      hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k + 16));
    }
    const __m256 sv = _mm256_set1_ps(s), mv = _mm256_set1_ps(mn);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; ++i) {
      const __m256i q = bits == 4 ? _mm256_cvtepu8_epi32(parts[i]) : _mm256_cvtepi8_epi32(parts[i]);
      // q * s + min as the reference computes it (a fused multiply-add may round once less).
      _mm256_storeu_ps(out + k + 8 * i, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), sv), mv));
    }
  }
}

// Rows of x beyond kIntegerRows: each tile of weight rows is expanded to float32 in a buffer that
// stays in cache and dotted with every row of x as small_linear does (linear.h); the integer path's
// cost grows faster with the rows of x than this expansion's, which is paid once per weight row.
constexpr int64_t kIntegerRows = 8;

inline void linear_by_tiles(const float* x, int64_t M, int64_t K, const uint8_t* w, const at::Half* sp,
                            const at::Half* mp, int64_t N, int64_t group_size, int64_t bits, const float* bias,
                            float* y) {
  using linear_detail::kRows;
  const int64_t row_bytes = K * bits / 8, groups = K / group_size;
  at::parallel_for(0, (N + kRows - 1) / kRows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(kRows * K);
    const float* next[kRows] = {tile.data(), tile.data(), tile.data(), tile.data()};
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * kRows, rows = std::min<int64_t>(kRows, N - n);
      for (int64_t r = 0; r < rows; ++r)
        dequantize_row(w + (n + r) * row_bytes, sp + (n + r) * groups, mp ? mp + (n + r) * groups : nullptr, K,
                       group_size, bits, tile.data() + r * K);
      linear_detail::rows_times_x(tile.data(), rows, K, x, M, y + n, N, bias ? bias + n : nullptr, next);
    }
  });
}

}  // namespace quant_detail

}  // namespace lmport
