// y = x W^T (+ b) for a small batch of rows x (a decode step). BLAS libraries tune
// for large batches; here each weight row is streamed from memory once and dotted
// against every row of x, which stays in cache, so the cost is one pass over W.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>

#include "isa/vec8.h"

namespace lmport {

namespace linear_detail {

typedef float vec4 __attribute__((vector_size(16), aligned(4)));

// Keeps a loaded vector in a register: left alone, the compiler folds the load into
// every FMA that uses it, and the extra loads, not the FMAs, then set the pace.
inline vec8 in_register(vec8 v) {
#if defined(__x86_64__)
  asm("" : "+x"(v));
#endif
  return v;
}

// Four weight rows against MR rows of x: 4 * MR dot products kept in registers
// (with MR = 3: 12 accumulators, 3 x vectors and 1 weight vector fill AVX2's 16).
template <int MR>
inline void dot_tile(const float* w, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy,
                     const float* bias, const float* prefetch) {
  vec8 acc[MR][4] = {};
  for (int64_t k = 0; k < K; k += 8) {
    __builtin_prefetch(prefetch + k);
    vec8 xv[MR];
    for (int j = 0; j < MR; ++j) xv[j] = in_register(load(x + j * ldx + k));
    for (int i = 0; i < 4; ++i) {
      const vec8 wv = in_register(load(w + i * K + k));
      for (int j = 0; j < MR; ++j) acc[j][i] += wv * xv[j];
    }
  }
  const vec4 b = bias ? *reinterpret_cast<const vec4*>(bias) : vec4{};
  for (int j = 0; j < MR; ++j) {
    // Lane i of each 128-bit half holds half of dot product i; the halves then add up.
    const vec8 h = hadd(hadd(acc[j][0], acc[j][1]), hadd(acc[j][2], acc[j][3]));
    *reinterpret_cast<vec4*>(y + j * ldy) = __builtin_shufflevector(h, h, 0, 1, 2, 3) +
                                            __builtin_shufflevector(h, h, 4, 5, 6, 7) + b;
  }
}

// One weight row against every row of x (the last rows when N % 4 != 0).
inline void dot_row(const float* w, int64_t K, const float* x, int64_t M, float* y, int64_t ldy, float bias) {
  for (int64_t m = 0; m < M; ++m) {
    vec8 acc = {};
    for (int64_t k = 0; k < K; k += 8) acc += load(w + k) * load(x + m * K + k);
    y[m * ldy] = sum(acc) + bias;
  }
}

constexpr int kRows = 4;  // weight rows per tile
constexpr int kCols = 3;  // rows of x per tile

// y[:, 0:rows] (+ bias) of ``rows`` <= kRows weight rows w [rows, K] against every row of x [M, K];
// ``next`` is the memory the next tile reads (fetched meanwhile, a row per pass over x).
inline void rows_times_x(const float* w, int64_t rows, int64_t K, const float* x, int64_t M, float* y, int64_t ldy,
                         const float* bias, const float* const next[kRows]) {
  if (rows < kRows) {
    for (int64_t r = 0; r < rows; ++r) dot_row(w + r * K, K, x, M, y + r, ldy, bias ? bias[r] : 0.f);
    return;
  }
  int64_t m = 0, pass = 0;
  for (; m + kCols <= M; m += kCols, ++pass)
    dot_tile<kCols>(w, K, x + m * K, K, y + m * ldy, ldy, bias, next[pass % kRows]);
  if (M - m == 2) dot_tile<2>(w, K, x + m * K, K, y + m * ldy, ldy, bias, next[pass % kRows]);
  if (M - m == 1) dot_tile<1>(w, K, x + m * K, K, y + m * ldy, ldy, bias, next[pass % kRows]);
}

}  // namespace linear_detail

}  // namespace lmport
