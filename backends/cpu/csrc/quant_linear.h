// Linear layers over weights in lmport's quantized format (docs/weight-quantization.md):
// per group of inputs w = scale * q + min, 4-bit codes (0..15) two a byte with byte j of each
// 32-input run holding inputs j (low nibble) and j + 16 (high), or signed 8-bit codes.
//
// quant_linear (a few rows of x, i.e. decode): x is rounded once per call to int16 in runs of
// 32 (scale = max|x| / 32767, a relative step of 3e-5: float32 accuracy for all a greedy decode
// can tell, where int8 activations change tokens), each weight run widened to int16 and dotted
// with it in integer arithmetic (AVX2 madd, or VNNI's dpwssd where the CPU has it), accumulated
// in float32. Every packed weight byte is read once a call, which is what bounds a decode step.
// quant_dequantize (prefill) expands the weight to float32 for the BLAS.
#pragma once

#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace lmport {

namespace quant_detail {

constexpr int kRun = 32;  // inputs per packing run (and per activation scale)

// acc + the sums of the int16 products of each 2 adjacent lanes, as eight int32 lanes.
inline __m256i dot_s16(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

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

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

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

// One output: weight row (its codes, scales and mins) against one quantized row of x.
// ``sd`` is scratch for one float per run: the weight scale times the activation scale.
template <int BITS>
inline float dot_row(const uint8_t* w, const at::Half* scales, const at::Half* mins, int64_t runs,
                     int64_t runs_per_group, const int16_t* xq, const float* xd, const float* xs, float* sd) {
  // The mins meet the sum of x over each run; the scales fold into the activation scales.
  float offset = 0.f;
  int64_t b = 0;
  if (runs_per_group == 1) {
    __m256 off = _mm256_setzero_ps();
    for (; b + 8 <= runs; b += 8) {
      const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b)));
      const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + b)));
      _mm256_storeu_ps(sd + b, _mm256_mul_ps(s, _mm256_loadu_ps(xd + b)));
      off = _mm256_fmadd_ps(mn, _mm256_loadu_ps(xs + b), off);
    }
    offset = hsum(off);
  }
  for (; b < runs; ++b) {
    const int64_t g = b / runs_per_group;
    sd[b] = _cvtsh_ss(scales[g].x) * xd[b];
    offset += _cvtsh_ss(mins[g].x) * xs[b];
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

inline void check_quantized(const torch::Tensor& qweight, const torch::Tensor& scales, const torch::Tensor& mins,
                            int64_t bits, int64_t group_size) {
  TORCH_CHECK(bits == 4 || bits == 8, "quantized weights are 4- or 8-bit, got ", bits);
  TORCH_CHECK(qweight.scalar_type() == (bits == 4 ? torch::kByte : torch::kChar) && qweight.dim() == 2,
              bits, "-bit codes must be a 2-d ", bits == 4 ? "uint8" : "int8", " tensor, got ", qweight.sizes());
  const int64_t K = qweight.size(1) * 8 / bits;
  TORCH_CHECK(group_size > 0 && group_size % quant_detail::kRun == 0 && K % group_size == 0,
              "group size ", group_size, " must be a multiple of 32 dividing ", K);
  for (const auto* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == torch::kHalf && t->dim() == 2 && t->size(0) == qweight.size(0) &&
                    t->size(1) == K / group_size,
                "scales and mins must be float16 [", qweight.size(0), ", ", K / group_size, "], got ", t->sizes());
}

inline torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor mins,
                                  int64_t bits, int64_t group_size, c10::optional<torch::Tensor> bias) {
  using namespace quant_detail;
  check_quantized(qweight, scales, mins, bits, group_size);
  const int64_t N = qweight.size(0), K = qweight.size(1) * 8 / bits;
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.size(1) == K,
              "quant_linear: x must be float32 [tokens, ", K, "], got ", x.sizes());
  if (bias) TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == N,
                        "quant_linear: bias must be float32 with ", N, " elements");
  x = x.contiguous();
  qweight = qweight.contiguous();
  scales = scales.contiguous();
  mins = mins.contiguous();
  const torch::Tensor b = bias ? bias->contiguous() : torch::Tensor();
  const int64_t M = x.size(0), runs = K / kRun, groups = K / group_size, row_bytes = K * bits / 8;
  const QuantizedRows xq = quantize_rows(x.data_ptr<float>(), M, K);
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* w = reinterpret_cast<const uint8_t*>(qweight.data_ptr());
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* mp = mins.data_ptr<at::Half>();
  const float* bp = bias ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // Threads split the output rows, so the packed weight is read once in all.
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> sd(runs);
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t m = 0; m < M; ++m) {
        const int16_t* xc = xq.codes.data() + m * K;
        const float* xd = xq.scales.data() + m * runs;
        const float* xs = xq.sums.data() + m * runs;
        const float v = bits == 4
            ? dot_row<4>(w + n * row_bytes, sp + n * groups, mp + n * groups, runs, group_size / kRun, xc, xd, xs, sd.data())
            : dot_row<8>(w + n * row_bytes, sp + n * groups, mp + n * groups, runs, group_size / kRun, xc, xd, xs,
                         sd.data());
        yp[m * N + n] = v + (bp ? bp[n] : 0.f);
      }
    }
  });
  return y;
}

inline torch::Tensor quant_dequantize(torch::Tensor qweight, torch::Tensor scales, torch::Tensor mins, int64_t bits,
                                      int64_t group_size) {
  using namespace quant_detail;
  check_quantized(qweight, scales, mins, bits, group_size);
  qweight = qweight.contiguous();
  scales = scales.contiguous();
  mins = mins.contiguous();
  const int64_t N = qweight.size(0), K = qweight.size(1) * 8 / bits, groups = K / group_size;
  const int64_t row_bytes = K * bits / 8;
  auto out = torch::empty({N, K}, scales.options().dtype(torch::kFloat));
  const uint8_t* w = reinterpret_cast<const uint8_t*>(qweight.data_ptr());
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* mp = mins.data_ptr<at::Half>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t k = 0; k < K; k += kRun) {
        const int64_t g = n * groups + k / group_size;
        const float s = static_cast<float>(sp[g]), mn = static_cast<float>(mp[g]);
        // The run's 32 codes as bytes in input order, widened 8 at a time to float: w = s * q + min.
        __m128i lo, hi;
        if (bits == 4) {
          const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + n * row_bytes + k / 2));
          lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
          hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
        } else {
          lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + n * row_bytes + k));
          hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + n * row_bytes + k + 16));
        }
        const __m256 sv = _mm256_set1_ps(s), mv = _mm256_set1_ps(mn);
        float* o = op + n * K + k;
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int i = 0; i < 4; ++i) {
          const __m256i q = bits == 4 ? _mm256_cvtepu8_epi32(parts[i]) : _mm256_cvtepi8_epi32(parts[i]);
          // q * s + min as the reference computes it (a fused multiply-add may round once less).
          _mm256_storeu_ps(o + 8 * i, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), sv), mv));
        }
      }
    }
  });
  return out;
}

}  // namespace lmport
