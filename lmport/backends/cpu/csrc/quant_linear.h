// Linear layers over weights in lmport's quantized format (docs/weight-quantization.md):
// per group of inputs w = scale * q + min, 4-bit codes (0..15) two a byte with byte j of each
// 32-input run holding inputs j (low nibble) and j + 16 (high), or signed 8-bit codes.
//
// quant_linear, up to kIntegerRows (8) rows of x (a decode step), in integer arithmetic. With AVX-512
// VNNI (quant512) x is held as two int8 codes per input, as fine as int16, and the weight codes are
// dotted with each as bytes (vpdpbusd), 8 weight rows at a time. Otherwise (AVX2) x is rounded once
// per call to int16 in runs of 32 (scale = max|x| / 32767, a relative step of 3e-5), each weight run
// widened to int16 and dotted with it (madd, or dpwssd where the CPU has AVX-VNNI), accumulated in
// float32. Either way every packed weight byte is read once a call, which is what bounds a decode
// step. More rows (a batched decode step): tiles of weight rows expanded to float32 in cache
// (linear_by_tiles). quant_dequantize (prefill) expands the whole weight to float32 for the BLAS.
// A weight whose rows are interleaved in groups of 16 (``row_group``: a model's linears as the cpu
// backend holds them) runs every row of x a step passes through interleaved_rows.h's kernel instead
// (x as two int8 codes with AVX-512 VNNI, int16 on the AVX2 path); quant_dequantize reads its rows
// back in order.
#pragma once

#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "linear.h"
#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define LMPORT_QUANT_AVX512 1
#include "int8_rows.h"   // the path for up to kInt8Rows rows of x in int8 arithmetic
#endif
#include "interleaved_rows.h"   // rows interleaved in groups of 16
#include "row_index.h"

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

// ``mins`` may be left out (quant_linear): a weight whose mins are all zero (GGUF's Q8_0, w = scale * q).
inline void check_quantized(const torch::Tensor& qweight, const torch::Tensor& scales,
                            const c10::optional<torch::Tensor>& mins, int64_t bits, int64_t group_size) {
  TORCH_CHECK(bits == 4 || bits == 8, "quantized weights are 4- or 8-bit, got ", bits);
  TORCH_CHECK(qweight.scalar_type() == (bits == 4 ? torch::kByte : torch::kChar) && qweight.dim() == 2,
              bits, "-bit codes must be a 2-d ", bits == 4 ? "uint8" : "int8", " tensor, got ", qweight.sizes());
  const int64_t K = qweight.size(1) * 8 / bits;
  const int64_t runs_per_group = group_size / quant_detail::kRun;
  TORCH_CHECK(group_size > 0 && group_size % quant_detail::kRun == 0 && K % group_size == 0 &&
                  (runs_per_group & (runs_per_group - 1)) == 0,
              "group size ", group_size, " must be 32 times a power of two and divide ", K);
  for (const torch::Tensor* t : {&scales, mins ? &*mins : &scales})
    TORCH_CHECK(t->scalar_type() == torch::kHalf && t->dim() == 2 && t->size(0) == qweight.size(0) &&
                    t->size(1) == K / group_size,
                "scales and mins must be float16 [", qweight.size(0), ", ", K / group_size, "], got ", t->sizes());
}

#ifdef LMPORT_QUANT_AVX512

// Up to 8 rows of x (decode) in int8 arithmetic, as int8_rows.h does for GGUF blocks: x held per run
// of 32 as two int8 codes an input (d = max|x_run| / 127: hi = x / d rounded to nearest even, as
// llama.cpp rounds x for its own Q4_1 and Q8_0 dot products, and lo, what hi leaves in steps of
// d / 256), x = d (256 hi + lo) / 256: as fine as int16, where int8 alone changed greedy tokens.
// vpdpbusd multiplies 64 unsigned weight codes by 64 signed codes of hi, four products summed into
// each int32 lane; the lanes shifted left by 8, again by lo's. The weight codes go in as bytes, never
// widened. The mins meet the float32 sums of x per group, not the rounded x's.
namespace quant512 {

using quant_detail::kRun;

// The first min(left, 16) lanes (none when left <= 0).
inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
}

// Weight rows fetched ahead of the one in use: the weights come from memory, not cache, and
// a distance of a few KB keeps enough of them in flight (4 rows were measurably slower). They
// are fetched into L2, not L1, which is left to x and the row in use (decode measured faster so).
constexpr int64_t kAhead = 16;

// A row's weight codes go to vpdpbusd 64 bytes at a time (a unit): 4 runs of 4-bit codes, 2 of 8-bit.
template <int BITS>
constexpr int64_t kUnitRuns = BITS == 4 ? 4 : 2;

// x's hi and lo codes, a unit at a time in the order its weight bytes unpack. 4-bit: the low nibbles of
// the unit's 64 bytes are inputs 0..15 of its 4 runs, the high ones inputs 16..31, so x's 128 codes
// are [run 0..3's inputs 0..15, run 0..3's inputs 16..31] and two vpdpbusd leave each run's sums in
// its own 4 lanes. 8-bit: input order, run b in lanes 0..7 and b + 1 in 8..15; the codes go to
// vpdpbusd as unsigned q + 128, so each lane's dot product ends by adding -128 times x's four codes
// (256 hi + lo) summed (``starts``): the int32 result is the signed codes' exactly. Runs past the end
// are zeros. ``run_steps`` are d / 256.
struct Int8Activations {
  std::vector<int8_t> hi, lo;
  std::vector<int32_t> starts;   // 16 a unit, 8-bit only
  std::vector<float> run_steps, group_sums;
  int64_t K, units, groups;
};

template <int BITS>
inline Int8Activations quantize_int8(const float* x, int64_t K, int64_t group_size) {
  constexpr int64_t unit_runs = kUnitRuns<BITS>, unit_codes = unit_runs * kRun;
  const int64_t runs = K / kRun, units = (runs + unit_runs - 1) / unit_runs, groups = K / group_size;
  Int8Activations a{std::vector<int8_t>(units * unit_codes, 0), std::vector<int8_t>(units * unit_codes, 0),
                    std::vector<int32_t>(BITS == 8 ? units * 16 : 0),
                    std::vector<float>(runs), std::vector<float>(groups, 0.f), K, units, groups};
  for (int64_t b = 0; b < runs; ++b) {
    const int64_t at = b / unit_runs * unit_codes, j = b % unit_runs;
    const int8_rows::Run r = int8_rows::split_run(x + b * kRun, a.hi.data(), a.lo.data(), at + (BITS == 4 ? 16 * j : 32 * j),
                                                  at + (BITS == 4 ? 64 + 16 * j : 32 * j + 16));
    a.run_steps[b] = r.step;
    a.group_sums[b * kRun / group_size] += r.sum;
  }
  if constexpr (BITS == 8) {
    for (int64_t u = 0; u < units; ++u) {   // -128 times x's lane sums
      const __m512i sums = int8_rows::lane_sums(a.hi.data() + 64 * u, a.lo.data() + 64 * u);
      _mm512_storeu_si512(a.starts.data() + 16 * u, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sums, 7)));
    }
  }
  return a;
}

// Weight rows kRowBlock at a time against the one row of x: each pair of x's runs is loaded once for
// all of them, their sums do not wait on each other, and the per-row work (scales, mins, the final sum
// over lanes) is done for the block at once. 8 decoded the Q8_0 file measurably faster than 4.
constexpr int kRowBlock = 8;
// Rows of x up to which the int8 path runs: all the integer path's (kIntegerRows), so a row's result does
// not depend on how many rows share its step, and a prefix-cached or speculative run decodes the tokens of
// a plain one. Each row costs its own dot products (docs/weight-quantization.md).
constexpr int64_t kInt8Rows = 8;
static_assert(kRowBlock % 4 == 0, "dot_rows sums its rows' lanes 4 at a time (sum4)");

// What every block of one call shares: x's run steps repeated once per row of a block, so a block's
// scales (kRowBlock rows, contiguous) meet them in whole vectors.
struct BlockPlan {
  std::vector<float> steps;   // [kRowBlock * runs], zero padded
};

inline BlockPlan plan_blocks(const Int8Activations& a) {
  const int64_t runs = a.K / kRun;
  BlockPlan plan{std::vector<float>(kRowBlock * runs + 16, 0.f)};
  for (int r = 0; r < kRowBlock; ++r)
    std::copy(a.run_steps.begin(), a.run_steps.begin() + runs, plan.steps.begin() + r * runs);
  return plan;
}

using int8_rows::sum4;

// The end of a block's dot products: each row's mins meet x's group sums in the row's own lanes, 16 groups
// a multiply-add (none for a weight without mins, ``mins`` null), then each row's lanes are summed into
// ``out``.
inline void finish_rows(__m512* acc, const at::Half* mins, int valid, int64_t groups, const float* sums, float* out) {
  if (mins != nullptr) {
#pragma GCC unroll 8   // the accumulators stay in registers only with the rows unrolled
    for (int r = 0; r < kRowBlock; ++r) {
      if (r >= valid) break;
      for (int64_t g = 0; g < groups; g += 16) {
        const __mmask16 k = tail_mask(groups - g);
        const __m512 m = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mins + r * groups + g));
        acc[r] = _mm512_fmadd_ps(m, _mm512_maskz_loadu_ps(k, sums + g), acc[r]);
      }
    }
  }
  for (int r = 0; r < kRowBlock; r += 4) _mm_storeu_ps(out + r, sum4(acc + r));
}

// ``rows`` points at each weight row; ``folded`` holds each row's run scales already multiplied by
// x's step for the run; ``mins`` the block's mins (null: none), ``valid`` rows of them (past the weight's
// end the rows repeat the last one and their mins are not read). Per row and unit: the int32 sums of each
// run in its lanes, scaled by the run's folded scale (a run past the end meets zeros in x, so the
// scale it reads, another row's or padding, adds nothing).
template <int BITS>
inline void dot_rows(const uint8_t* const* rows, const float* folded, const at::Half* mins, int valid,
                     const Int8Activations& a, const uint8_t* prefetch, float* out) {
  constexpr int64_t unit_runs = kUnitRuns<BITS>;
  const int64_t runs = a.K / kRun, row_bytes = a.K * BITS / 8;
  // Each lane's run within the unit.
  const __m512i lanes = BITS == 4 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                                  : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i nibble = _mm512_set1_epi8(0x0F), offset = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[kRowBlock];
  for (auto& v : acc) v = _mm512_setzero_ps();
  for (int64_t u = 0; u < a.units; ++u) {
    const __mmask64 bytes = row_bytes - 64 * u >= 64 ? ~__mmask64{0} : (__mmask64{1} << (row_bytes - 64 * u)) - 1;
    for (int64_t line = 0; line < kRowBlock * 64; line += 64)  // the block ahead, a slice a unit
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + u * kRowBlock * 64 + line), _MM_HINT_T1);
    const int8_t* hi = a.hi.data() + u * unit_runs * kRun;
    const int8_t* lo = a.lo.data() + u * unit_runs * kRun;
    const __m512i hi0 = _mm512_loadu_si512(hi), lo0 = _mm512_loadu_si512(lo);
    const __m512i hi1 = BITS == 4 ? _mm512_loadu_si512(hi + 64) : hi0, lo1 = BITS == 4 ? _mm512_loadu_si512(lo + 64) : lo0;
    const __m512i start = BITS == 8 ? _mm512_loadu_si512(a.starts.data() + 16 * u) : _mm512_setzero_si512();
    const __m512i zero = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int r = 0; r < kRowBlock; ++r) {
      const __m512i raw = _mm512_maskz_loadu_epi8(bytes, rows[r] + 64 * u);
      __m512i d;
      if constexpr (BITS == 4) {   // int8_rows::dot over both nibbles, one shift for the two
        const __m512i w0 = _mm512_and_si512(raw, nibble), w1 = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
        const __m512i coarse = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, w0, hi0), w1, hi1);
        d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_slli_epi32(coarse, 8), w0, lo0), w1, lo1);
      } else {
        d = _mm512_add_epi32(int8_rows::dot(_mm512_xor_si512(raw, offset), hi0, lo0), start);
      }
      const __m512 scale = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(_mm_loadu_ps(folded + r * runs + unit_runs * u)));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, acc[r]);
    }
  }
  finish_rows(acc, mins, valid, a.groups, a.group_sums.data(), out);
}

// y [M, N] for a few rows of x (``xs``, each quantized on its own): blocks of kRowBlock weight rows
// (dot_rows), each block dotted with every row of x in turn while its bytes are in L1. A row's result
// is the one it has alone, bit for bit.
template <int BITS>
inline void linear_int8_rows(const std::vector<Int8Activations>& xs, const uint8_t* w, const at::Half* sp,
                             const at::Half* mp, int64_t N, int rpg_shift, const float* bias, float* y) {
  const int64_t K = xs[0].K, row_bytes = K * BITS / 8, runs = K / kRun, groups = xs[0].groups;
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
  std::vector<BlockPlan> plans;
  for (const auto& a : xs) plans.push_back(plan_blocks(a));
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    // The first blocks are asked for at once rather than missed one after another.
    const int64_t first = begin * kRowBlock, burst = std::min(N, first + kAhead) - first;
    for (int64_t off = 0; off < burst * row_bytes; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + first * row_bytes + off), _MM_HINT_T1);
    std::vector<float> folded(kRowBlock * runs + 16);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * kRowBlock;
      const int valid = static_cast<int>(std::min<int64_t>(kRowBlock, N - n));
      const uint8_t* rows[kRowBlock];
      for (int r = 0; r < kRowBlock; ++r) rows[r] = w + (n + std::min(r, valid - 1)) * row_bytes;
      const int64_t later = std::max<int64_t>(0, std::min(n + kAhead, N - kRowBlock));   // the block ahead
      for (int64_t off = 0; off < kRowBlock * groups * 2; off += 64) {   // the scales and mins ahead, too
        _mm_prefetch(reinterpret_cast<const char*>(sp + later * groups) + off, _MM_HINT_T1);
        if (mp) _mm_prefetch(reinterpret_cast<const char*>(mp + later * groups) + off, _MM_HINT_T1);
      }
      for (size_t m = 0; m < xs.size(); ++m) {
        const Int8Activations& a = xs[m];
        const BlockPlan& plan = plans[m];
        // Each run's weight scale times x's step (zeros for the rows past the weight's end).
        const at::Half* bs = sp + n * groups;
        if (rpg_shift == 0)   // a scale a run (GGUF's blocks of 32): the block's scales in whole vectors
          for (int64_t i = 0; i < kRowBlock * runs; i += 16)
            _mm512_storeu_ps(folded.data() + i,
                             _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(tail_mask(valid * runs - i), bs + i)),
                                           _mm512_loadu_ps(plan.steps.data() + i)));
        else
          for (int r = 0; r < kRowBlock; ++r)
            for (int64_t i = 0; i < runs; ++i)
              folded[r * runs + i] = r < valid ? _cvtsh_ss(bs[r * groups + (i >> rpg_shift)].x) * a.run_steps[i] : 0.f;
        float out[kRowBlock];
        dot_rows<BITS>(rows, folded.data(), mp ? mp + n * groups : nullptr, valid, a, w + later * row_bytes, out);
        for (int r = 0; r < valid; ++r) y[m * N + n + r] = out[r] + (bias ? bias[n + r] : 0.f);
      }
    }
  });
}

}  // namespace quant512
#endif

namespace quant_detail {

// Weight row w (its K codes, scales and mins, null for none) as float32: out[k] = s * q + min.
inline void dequantize_row(const uint8_t* w, const at::Half* scales, const at::Half* mins, int64_t K,
                           int64_t group_size, int64_t bits, float* out) {
#ifdef LMPORT_QUANT_AVX512
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

// Rows interleaved in groups of 16 (``row_group``, lmport.weights.interleaved) where this build reads them
// so (interleaved::kKernels).
inline std::vector<int64_t> quant_interleaved_bits() {
  return interleaved::kKernels ? std::vector<int64_t>{4, 8} : std::vector<int64_t>{};
}

// Whether the cpu backend runs a prefill over interleaved rows through quant_linear / ggml_linear (their group
// kernels) rather than through the weight dequantized for a GEMM; both take it.
inline bool interleaved_prefill() { return interleaved::kPrefill; }

inline void check_row_group(int64_t row_group) {
  TORCH_CHECK(row_group == 1 || (row_group == interleaved::kGroup && interleaved::kKernels),
              "quant: rows interleaved in groups of ", row_group, ": this build reads ",
              interleaved::kKernels ? "groups of 16" : "none (neither AVX-512 VNNI nor AVX2 with FMA and F16C)",
              " (lmport.weights.interleaved.file_layout gives the rows back in order)");
}

inline torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                                  c10::optional<torch::Tensor> mins, int64_t bits, int64_t group_size,
                                  c10::optional<torch::Tensor> bias, int64_t row_group = 1) {
  using namespace quant_detail;
  check_quantized(qweight, scales, mins, bits, group_size);
  check_row_group(row_group);
  const int64_t N = qweight.size(0), K = qweight.size(1) * 8 / bits;
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.size(1) == K,
              "quant_linear: x must be float32 [tokens, ", K, "], got ", x.sizes());
  if (bias) TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == N,
                        "quant_linear: bias must be float32 with ", N, " elements");
  x = x.contiguous();
  qweight = qweight.contiguous();
  scales = scales.contiguous();
  const torch::Tensor mn = mins ? mins->contiguous() : torch::Tensor();
  const torch::Tensor b = bias ? bias->contiguous() : torch::Tensor();
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;   // e.g. an expert no token was routed to
  const uint8_t* w = reinterpret_cast<const uint8_t*>(qweight.data_ptr());
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* mp = mins ? mn.data_ptr<at::Half>() : nullptr;
  const float* bp = bias ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
#ifdef LMPORT_QUANT_AVX512
  // This build's integer path: rows n0 .. n0 + rows of W against every row of x, into ``out`` [M, rows]. With
  // AVX-512 VNNI in int8 arithmetic:
  const auto integer_rows = [&](int64_t n0, int64_t rows, float* out) {
    const int rpg_shift = __builtin_ctzll(group_size / kRun), groups = K / group_size;
    std::vector<quant512::Int8Activations> xs;
    for (int64_t m = 0; m < M; ++m)
      xs.push_back(bits == 4 ? quant512::quantize_int8<4>(x.data_ptr<float>() + m * K, K, group_size)
                             : quant512::quantize_int8<8>(x.data_ptr<float>() + m * K, K, group_size));
    const uint8_t* wn = w + n0 * (K * bits / 8);
    const at::Half *sn = sp + n0 * groups, *mn0 = mp ? mp + n0 * groups : nullptr;
    const float* bn = bp ? bp + n0 : nullptr;
    if (bits == 4) quant512::linear_int8_rows<4>(xs, wn, sn, mn0, rows, rpg_shift, bn, out);
    else quant512::linear_int8_rows<8>(xs, wn, sn, mn0, rows, rpg_shift, bn, out);
  };
#else
  // on the AVX2 path each row of x on its own, rounded to int16:
  const auto integer_rows = [&](int64_t n0, int64_t rows, float* out) {
    const int64_t runs = K / kRun, groups = K / group_size, row_bytes = K * bits / 8;
    const QuantizedRows xq = quantize_rows(x.data_ptr<float>(), M, K);
    // Threads split the output rows, so the packed weight is read once in all.
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      std::vector<float> sd(runs);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t n = n0 + i;
        for (int64_t m = 0; m < M; ++m) {
          const int16_t* xc = xq.codes.data() + m * K;
          const float* xd = xq.scales.data() + m * runs;
          const float* xs = xq.sums.data() + m * runs;
          const at::Half* mins_n = mp ? mp + n * groups : nullptr;
          const float v = bits == 4
              ? dot_row<4>(w + n * row_bytes, sp + n * groups, mins_n, runs, group_size / kRun, xc, xd, xs, sd.data())
              : dot_row<8>(w + n * row_bytes, sp + n * groups, mins_n, runs, group_size / kRun, xc, xd, xs, sd.data());
          out[m * rows + i] = v + (bp ? bp[n] : 0.f);
        }
      }
    });
  };
#endif
  if (row_group != 1) {   // every row of x over the whole groups, and over the rows after them as they are
    const int64_t whole = N / interleaved::kGroup * interleaved::kGroup;
    const auto groups = [&](auto layout) {
      interleaved::linear_groups(layout, x.data_ptr<float>(), M, K, w, whole / interleaved::kGroup,
                                 interleaved::kGroup * K * bits / 8, 0, bp, yp, N);
    };
    if (bits == 4) groups(interleaved::QuantRows<4>{sp, mp, K, group_size});
    else groups(interleaved::QuantRows<8>{sp, mp, K, group_size});
    // each row of x on its own, as in the groups: a row's result does not depend on the rows beside it
    interleaved::rows_after_groups(M, N, yp, integer_rows);
    return y;
  }
  if (M > kIntegerRows) {
    linear_by_tiles(x.data_ptr<float>(), M, K, w, sp, mp, N, group_size, bits, bp, yp);
    return y;
  }
#ifdef LMPORT_QUANT_AVX512
  static_assert(quant512::kInt8Rows == kIntegerRows, "the int8 path is the only integer path with AVX-512 VNNI");
#endif
  integer_rows(0, N, yp);
  return y;
}

// The rows of x up to which quant_linear holds x as two int8 codes rather than int16 (0: none, the AVX2
// path): the tolerance a test of the kernel allows depends on it.
inline int64_t quant_int8_rows() {
#ifdef LMPORT_QUANT_AVX512
  return quant512::kInt8Rows;
#else
  return 0;
#endif
}

// W in float32; with ``rows`` (int64 indices) only those rows, in that order (an embedding lookup).
inline torch::Tensor quant_dequantize(torch::Tensor qweight, torch::Tensor scales, torch::Tensor mins, int64_t bits,
                                      int64_t group_size, int64_t row_group = 1,
                                      c10::optional<torch::Tensor> rows = c10::nullopt) {
  using namespace quant_detail;
  check_quantized(qweight, scales, mins, bits, group_size);
  check_row_group(row_group);
  qweight = qweight.contiguous();
  scales = scales.contiguous();
  mins = mins.contiguous();
  const int64_t N = qweight.size(0), K = qweight.size(1) * 8 / bits, groups = K / group_size;
  const int64_t row_bytes = K * bits / 8;
  const torch::Tensor picked = checked_rows(rows, N, "quant_dequantize");
  const int64_t* index = rows ? picked.data_ptr<int64_t>() : nullptr;
  const int64_t count = rows ? picked.numel() : N;
  auto out = torch::empty({count, K}, scales.options().dtype(torch::kFloat));
  const uint8_t* w = reinterpret_cast<const uint8_t*>(qweight.data_ptr());
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* mp = mins.data_ptr<at::Half>();
  float* op = out.data_ptr<float>();
  const int64_t whole = row_group == 1 ? 0 : N / interleaved::kGroup * interleaved::kGroup;
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> row(row_bytes);
    std::vector<at::Half> row_scales(groups), row_mins(groups);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = index ? index[i] : i;
      float* out_row = op + i * K;
      if (n >= whole) {
        dequantize_row(w + n * row_bytes, sp + n * groups, mp + n * groups, K, group_size, bits, out_row);
        continue;
      }
      // an interleaved row back in order: its units out of its group's vectors
      const int64_t first = n / interleaved::kGroup * interleaved::kGroup;
      const int r = static_cast<int>(n - first);
      interleaved::unpack_units<4>(w + first * row_bytes, r, static_cast<int>(row_bytes), row.data());
      interleaved::unpack_units<2>(reinterpret_cast<const uint8_t*>(sp + first * groups), r, static_cast<int>(2 * groups),
                                   reinterpret_cast<uint8_t*>(row_scales.data()));
      interleaved::unpack_units<2>(reinterpret_cast<const uint8_t*>(mp + first * groups), r, static_cast<int>(2 * groups),
                                   reinterpret_cast<uint8_t*>(row_mins.data()));
      dequantize_row(row.data(), row_scales.data(), row_mins.data(), K, group_size, bits, out_row);
    }
  });
  return out;
}

}  // namespace lmport
