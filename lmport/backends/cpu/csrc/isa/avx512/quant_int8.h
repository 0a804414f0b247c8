// quant_linear's AVX-512 VNNI path: up to 8 rows of x over lmport's int4 / int8 format in int8 arithmetic.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <vector>

#include "../../quant_format.h"
#include "int8_rows.h"

namespace lmport {


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

}  // namespace lmport
