// Up to 8 rows of x (decode) against quantized weights in int8 arithmetic (GGUF blocks here and in
// ggml_linear.h; lmport's int4 / int8 format in quant_linear.h, which shares x's codes): AVX-512
// VNNI's vpdpbusd multiplies 64 unsigned weight bytes by 64 signed activation bytes and adds each
// lane's four products into an int32.
//
// x is held as two int8 codes per input, per run of 32 (step d = max|x_run| / 127): hi = x / d rounded to
// nearest even, as llama.cpp rounds x for its own dot products (q8_0 / q8_K), and lo, what hi leaves
// (x - hi d) in steps of d / 256. x = d (256 hi + lo) / 256 is then as fine as int16 (a step of about
// max|x_run| / 32512): rounded to int8 alone, x changed greedy tokens of a single stream. Each weight
// code meets both with one unpacking: vpdpbusd over hi, the int32 sums shifted left by 8, vpdpbusd over
// lo. A weight type supplies, per pair of runs, its 64 codes in input order as unsigned bytes
// u = q + offset (Q5_0's q - 16 as 0..31, Q6_K's q - 32 as 0..63); each dot product then adds -offset
// times the sums of x's codes over each lane, so the int32 result is that of the signed codes, exactly.
// The int32 sums are scaled in float32 per sub-block (the weight's scale times x's step d / 256) and
// summed; a type's mins meet the float sums of x per run (``extra`` below).
#pragma once

#include <ATen/Parallel.h>

#include "../isa.h"

#include <algorithm>
#include <vector>

namespace lmport {
namespace int8_rows {

constexpr int kRun = 32;
// Weight rows a block: x's pair is loaded once for them and their sums do not wait on each other.
constexpr int kRowBlock = 8;
// Weight rows fetched ahead into L2, as quant_linear.h does.
constexpr int64_t kAhead = 16;

// x as int8 ``hi`` and ``lo`` codes in input order (an odd last run paired with zeros), ``lane_sums``
// each int32 lane's four codes (256 hi + lo) summed (16 a pair), ``run_steps`` (d / 256) and
// ``run_sums`` (float32 sum of x) per run.
struct Activations {
  std::vector<int8_t> hi, lo;
  std::vector<int32_t> lane_sums;
  std::vector<float> run_steps, run_sums;
  int64_t K, runs, pairs;
};

// A run of 32 inputs ``x`` as hi and lo codes: inputs 0..15 to hi[first..] and lo[first..], 16..31 to
// hi[second..] and lo[second..] (each caller lays the runs out as its weights unpack). Returns the run's
// step d / 256 and the float32 sum of x.
struct Run {
  float step, sum;
};

inline Run split_run(const float* x, int8_t* hi, int8_t* lo, int64_t first, int64_t second) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  const __m512 scale = _mm512_set1_ps(inv), fine = _mm512_set1_ps(256.f * inv), step = _mm512_set1_ps(d);
  const auto store = [&](__m512 v, int64_t at) {
    const __m512i h = _mm512_cvtps_epi32(_mm512_mul_ps(v, scale));   // |x / d| <= 127
    // what hi leaves, at most d / 2, in steps of d / 256 (saturated: 128 becomes 127)
    const __m512 rest = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(h), step, v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + at), _mm512_cvtsepi32_epi8(h));
    const __m512i l = _mm512_cvtps_epi32(_mm512_mul_ps(rest, fine));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + at), _mm512_cvtsepi32_epi8(l));
  };
  store(a, first);
  store(b, second);
  return {d / 256.f, _mm512_reduce_add_ps(_mm512_add_ps(a, b))};
}

// Each int32 lane's four codes (256 hi + lo) summed, for 64 codes of hi and lo.
inline __m512i lane_sums(const int8_t* hi, const int8_t* lo) {
  const __m512i ones = _mm512_set1_epi8(1);
  const __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(hi));
  return _mm512_dpbusd_epi32(_mm512_slli_epi32(h, 8), ones, _mm512_loadu_si512(lo));
}

// The int32 sums of 64 unsigned weight codes ``u`` with x's hi and lo codes as one (256 hi + lo).
inline __m512i dot(__m512i u, __m512i hi, __m512i lo) {
  return _mm512_dpbusd_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, hi), 8), u, lo);
}

inline Activations quantize(const float* x, int64_t K) {
  const int64_t runs = K / kRun, pairs = (runs + 1) / 2;
  Activations a{std::vector<int8_t>(pairs * 64, 0), std::vector<int8_t>(pairs * 64, 0), std::vector<int32_t>(pairs * 16),
                std::vector<float>(2 * pairs, 0.f), std::vector<float>(2 * pairs, 0.f), K, runs, pairs};
  for (int64_t b = 0; b < runs; ++b) {
    const Run r = split_run(x + b * kRun, a.hi.data(), a.lo.data(), b * kRun, b * kRun + 16);
    a.run_steps[b] = r.step;
    a.run_sums[b] = r.sum;
  }
  for (int64_t p = 0; p < pairs; ++p)
    _mm512_storeu_si512(a.lane_sums.data() + 16 * p, lane_sums(a.hi.data() + 64 * p, a.lo.data() + 64 * p));
  return a;
}

// The sums over lanes of 4 vectors together: 128-bit quarters first, then the four lanes left in each.
inline __m128 sum4(const __m512* acc) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(acc[0], acc[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(acc[0], acc[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2], acc[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(acc[2], acc[3], _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));  // quarter r: row r's
  q = _mm512_add_ps(q, _mm512_permute_ps(q, _MM_SHUFFLE(1, 0, 3, 2)));
  q = _mm512_add_ps(q, _mm512_permute_ps(q, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, q));
}

// kRowBlock weight rows (``rows``) against x. A type ``Codes`` gives:
// - kOffset: what its unsigned codes add to the signed ones;
// - kSubs: sub-blocks (scales) per run pair; lanes(): for each int32 lane, its sub-block in the pair;
// - pair(row, p, runs): the 64 unsigned codes of run pair p;
// - kInlineScales: whether scales(row, p, runs, steps) gives run pair p's scales times x's steps (its
//   ``steps``) per lane, read from the row's blocks here rather than folded beforehand.
// ``folded`` holds each row's sub-block scales times x's step (pairs * kSubs a row) where the type does
// not give them inline; ``starts`` -offset times x's lane sums.
template <class Codes>
inline void dot_rows(const uint8_t* const* rows, const float* folded, const Activations& a, const int32_t* starts,
                     const uint8_t* prefetch, int64_t slice, float* out) {
  const int64_t subs = a.pairs * Codes::kSubs;
  const __m512i lanes = Codes::lanes();
  __m512 acc[kRowBlock];
  for (auto& v : acc) v = _mm512_setzero_ps();
  for (int64_t p = 0; p < a.pairs; ++p) {
    for (int64_t line = 0; line < slice; line += 64)   // the block ahead, a slice a pair
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + p * slice + line), _MM_HINT_T1);
    const __m512i hi = _mm512_loadu_si512(a.hi.data() + 64 * p), lo = _mm512_loadu_si512(a.lo.data() + 64 * p);
    const __m512i start = Codes::kOffset ? _mm512_loadu_si512(starts + 16 * p) : _mm512_setzero_si512();
    // the pair's two steps (8 bytes: the last pair's are the vector's end)
    const __m128 steps = Codes::kInlineScales
        ? _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(a.run_steps.data() + 2 * p))) : _mm_setzero_ps();
#pragma GCC unroll 8   // the accumulators stay in registers only with the rows unrolled
    for (int r = 0; r < kRowBlock; ++r) {
      const __m512i sums = dot(Codes::pair(rows[r], p, a.runs), hi, lo);
      const __m512i d = Codes::kOffset ? _mm512_add_epi32(sums, start) : sums;
      const __m128 scales = Codes::kInlineScales ? Codes::scales(rows[r], p, a.runs, steps)
                                                 : _mm_loadu_ps(folded + r * subs + p * Codes::kSubs);
      const __m512 s = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(scales));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, acc[r]);
    }
  }
  for (int r = 0; r < kRowBlock; r += 4) _mm_storeu_ps(out + r, sum4(acc + r));
}

// y [M, N] = x W^T (+ bias) for a few rows of x (``xs``, each quantized on its own), W's rows
// ``row_bytes`` apart: threads take blocks of kRowBlock rows, each block dotted with every row of x in
// turn while its bytes are in L1, so a row's result is the one it has alone, bit for bit.
// ``fold(a, n, valid, folded, extra)`` writes rows n .. n + valid's folded scales for x's row ``a``
// (zeros past the weight's end) and what each row adds besides its dot product (its mins times x's
// run sums; 0 for none).
template <class Codes, class Fold>
inline void linear(const std::vector<Activations>& xs, const uint8_t* w, int64_t row_bytes, int64_t N, Fold fold,
                   const float* bias, float* y) {
  static_assert(kRowBlock % 4 == 0, "dot_rows sums its rows' lanes 4 at a time (sum4)");
  const int64_t pairs = xs[0].pairs;
  std::vector<std::vector<int32_t>> starts;
  for (const auto& a : xs) {
    starts.emplace_back(Codes::kOffset ? pairs * 16 : 0);
    for (size_t i = 0; i < starts.back().size(); ++i) starts.back()[i] = -Codes::kOffset * a.lane_sums[i];
  }
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
  const int64_t slice = (kRowBlock * row_bytes + pairs - 1) / pairs;   // a block's bytes fetched a pair
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    // The first rows are asked for at once rather than missed one after another.
    const int64_t first = begin * kRowBlock, burst = std::min(N, first + kAhead) - first;
    for (int64_t off = 0; off < burst * row_bytes; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + first * row_bytes + off), _MM_HINT_T1);
    std::vector<float> folded(kRowBlock * pairs * Codes::kSubs + 16);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * kRowBlock;
      const int valid = static_cast<int>(std::min<int64_t>(kRowBlock, N - n));
      const uint8_t* rows[kRowBlock];
      for (int r = 0; r < kRowBlock; ++r) rows[r] = w + (n + std::min(r, valid - 1)) * row_bytes;
      const int64_t later = std::max<int64_t>(0, std::min(n + kAhead, N - kRowBlock));   // the block ahead
      for (size_t m = 0; m < xs.size(); ++m) {
        float extra[kRowBlock] = {};
        fold(xs[m], n, valid, folded.data(), extra);
        float out[kRowBlock];
        dot_rows<Codes>(rows, folded.data(), xs[m], starts[m].data(), w + later * row_bytes, slice, out);
        for (int r = 0; r < valid; ++r) y[m * N + n + r] = out[r] + extra[r] + (bias ? bias[n + r] : 0.f);
      }
    }
  });
}

}  // namespace int8_rows
}  // namespace lmport
