// The loops over rows interleaved in groups of 16 (interleaved_layout.h describes the layout): a group's 16
// rows against the rows of x by this build's group kernels (isa/avx512/ or isa/avx2/interleaved_groups.h).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "interleaved_layout.h"
#if defined(LMPORT_ISA_AVX512)
#include "isa/avx512/interleaved_groups.h"
#elif defined(LMPORT_INTERLEAVED_AVX2)
#include "isa/avx2/interleaved_groups.h"
#endif
#if defined(LMPORT_ISA_AMX)
#include "isa/amx/bf16_groups.h"
#endif

namespace lmport {
namespace interleaved {

#ifdef LMPORT_INTERLEAVED

// Up to MT rows of x (``n`` left) through the kernel that takes as many at once as there are: how many it took.
template <int MT, class L>
inline int64_t dot_rows(L at, const uint8_t* group, int64_t blocks, const BlockCodes* const* x, int64_t n,
                        const uint8_t* next, Lanes* out) {
  if constexpr (MT > 1)
    if (n < MT) return dot_rows<MT - 1>(at, group, blocks, x, n, next, out);
  dot_group<MT>(at, group, blocks, x, next, out);
  return MT;
}

constexpr int64_t kCodeBytesInCache = 128 * 1024;

// Groups [begin, end) of W (``group_bytes`` apart from ``w``; ``layout`` a kernel's type, or QuantRows with the
// int4 / int8 format's scales and mins) against the M rows of x (``x``, their codes; K inputs): each group
// against the rows of x, kRowsAtOnce at a time, into y [M, groups * 16] (rows ``y_stride`` apart).
template <class L>
inline void groups_range(L layout, const BlockCodes* const* x, int64_t M, int64_t K, const uint8_t* w,
                         int64_t begin, int64_t end, int64_t group_bytes, int64_t blocks, const float* bias, float* y,
                         int64_t y_stride) {
  constexpr int kAtOnce = kRowsAtOnce<L>;
  // A prefill's rows go a chunk at a time whose codes (2 bytes an input) stay in L2 while they meet every
  // group of the thread; a decode step's are one chunk.
  const int64_t chunk = std::max<int64_t>(kAtOnce, kCodeBytesInCache / (2 * K) / kAtOnce * kAtOnce);
  for (int64_t first = 0; first < M; first += chunk) {
    const int64_t last = std::min(M, first + chunk);
    for (int64_t g = begin; g < end; ++g) {
      const L at = layout.group(g);
      const uint8_t* group = w + g * group_bytes;
      Lanes out[kAtOnce];
      for (int64_t m = first; m < last;) {
        const uint8_t* next = m == first && g + 1 < end ? group + group_bytes : nullptr;
        const int64_t done = dot_rows<kAtOnce>(at, group, blocks, x + m, last - m, next, out);
        for (int64_t r = 0; r < done; ++r)
          store(y + (m + r) * y_stride + kGroup * g, out[r], bias ? bias + kGroup * g : nullptr);
        m += done;
      }
    }
  }
}

// Up to this many rows of x (a decode step's, lmport.backends.cpu.SMALL_BATCH_TOKENS) each row's result is the
// one it has alone; more (a prefill) go to the AMX tiles where asked for and the machine has them.
constexpr int64_t kDecodeRows = 128;

// y [M, N] (rows ``y_stride`` apart) = x W^T (+ bias) over the whole groups of W (``groups`` of them): the
// threads share the groups (groups_range).
template <class L>
inline void linear_groups(L layout, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t groups,
                          int64_t group_bytes, int64_t blocks, const float* bias, float* y, int64_t y_stride) {
#if defined(LMPORT_ISA_AMX)
  if (M > kDecodeRows && amx::enabled())
    return amx::linear_groups(layout, x, M, K, w, groups, group_bytes, blocks, bias, y, y_stride);
#endif
  std::vector<BlockCodes> xs;
  for (int64_t m = 0; m < M; ++m) xs.push_back(block_codes(x + m * K, K));
  std::vector<const BlockCodes*> rows;
  for (const auto& a : xs) rows.push_back(&a);
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    groups_range(layout, rows.data(), M, K, w, begin, end, group_bytes, blocks, bias, y, y_stride);
  });
}

// The rows of y [M, N] after the weight's last whole group: ``rows(first, count, out)`` computes them into
// out [M, count] by a row-by-row path, copied into their columns.
template <class Rows>
inline void rows_after_groups(int64_t M, int64_t N, float* y, Rows rows) {
  const int64_t whole = N / kGroup * kGroup, count = N - whole;
  if (count == 0) return;
  std::vector<float> out(M * count);
  rows(whole, count, out.data());
  for (int64_t m = 0; m < M; ++m) std::copy(out.begin() + m * count, out.begin() + (m + 1) * count, y + m * N + whole);
}
#endif

}  // namespace interleaved
}  // namespace lmport
