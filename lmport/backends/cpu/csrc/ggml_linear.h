// Linear layers over GGUF block weights as the file stores them (lmport.weights.ggml: each weight
// row is in / elements blocks laid out as llama.cpp's block_q4_K and friends, ggml-common.h):
// y = x W^T (+ b) for float32 rows x.
//
// Each block type is one small struct whose decode() turns a block into int8 codes in input order
// and, per sub-block of 16 or 32 inputs, a float scale and min, with w = scale * q + min computed as
// gguf's reference dequantizer does (gguf.quants, llama.cpp's dequantize_row_*). scale * q is exact in
// float32 for every type here (a float16 times integers of 23 bits at most in all), so only the min's
// add rounds, as in the reference: the weights expand bit for bit. Everything else is shared:
//
// - Q5_0, Q4_K, Q5_K and Q6_K rows interleaved in groups of 16 (a model's linears, as the cpu backend holds
//   them): every row of x a step passes, by interleaved_rows.h's kernels.
// - Up to 8 rows of x (decode) over Q5_0, Q4_K, Q5_K and Q6_K with AVX-512 VNNI: x held as two int8
//   codes per input (as fine as int16), the blocks' codes unpacked to bytes a run pair at a time and
//   dotted with each by vpdpbusd (isa/avx512/int8_rows.h, isa/avx512/ggml_int8.h), 8 weight rows at a time.
// - Otherwise up to kIntegerRows rows of x (decode): x is rounded to int16 per run of 32 inputs, as in
//   quant_linear.h; threads split the output rows, each weight row is decoded into a buffer that stays in L1 and
//   dotted with every row of x in integer arithmetic (512 bits wide with AVX-512 VNNI, else AVX2),
//   accumulated in float32 per run with the sub-block's scale times x's step. Each weight byte is
//   read once a call, and rows are fetched ahead into L2 as they are in quant_linear.h.
// - More rows (a batched decode step): tiles of 4 weight rows expanded to float32 in cache and run
//   by linear.h's small-batch kernel.
// - ggml_dequantize: the whole weight as float32, for the BLAS (prefill).
// The row-by-row paths read interleaved rows back in the file's layout (file_row).
#pragma once

#include <ATen/Parallel.h>

#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "ggml_blocks.h"   // the block types
#include "interleaved_rows.h"
#include "isa/isa.h"
#include "isa/x86.h"
#include "linear.h"
#include "quant_linear.h"
#ifdef LMPORT_ISA_AVX512
#include "isa/avx512/ggml_int8.h"   // up to 8 rows of x over Q5_0, Q4_K, Q5_K and Q6_K in int8 arithmetic
#endif
#include "ggml_activations.h"   // x rounded to int16 (the integer path)
#ifdef LMPORT_ISA_AVX512
#include "isa/avx512/ggml_tile.h"   // dot_tile, kRowBlock
#else
#include "isa/avx2/ggml_tile.h"
#endif

namespace lmport {
namespace ggml_detail {

constexpr int kTile = 4;

template <class T>
inline void linear_integer(const Activations& a, int64_t M, const uint8_t* w, int64_t N, const float* bias, float* y) {
  const int64_t K = a.K, row_bytes = K / T::kElements * T::kBytes;
  const int RT = M == 1 ? kRowBlock : 1;
  at::parallel_for(0, (N + RT - 1) / RT, 16 / RT, [&](int64_t begin, int64_t end) {
    const int64_t first = begin * RT, last = std::min(N, end * RT);   // this thread's weight rows
    // The first rows are asked for at once rather than missed one after another.
    for (int64_t off = 0; off < std::min(last - first, kAhead) * row_bytes; off += 64)
      isa::prefetch_l2(w + first * row_bytes + off);
    std::vector<RowBuffer> bufs(RT, RowBuffer(K));
    std::vector<float> folded(kTile * kRowBlock * K / 16 + 16);
    float out[kTile * kRowBlock];
    for (int64_t n = first; n < last; n += RT) {
      const int64_t ahead = n + RT + kAhead - 1;   // the rows kAhead ahead of this block's
      for (int64_t off = 0; ahead < last && off < RT * row_bytes; off += 64)
        isa::prefetch_l2(w + (ahead - RT + 1) * row_bytes + off);
      const int valid = static_cast<int>(std::min<int64_t>(RT, N - n));
      const uint8_t* rows[kRowBlock];
      for (int r = 0; r < RT; ++r) {   // past the weight's end the last row again, its sums not stored
        rows[r] = w + (n + std::min(r, valid - 1)) * row_bytes;
#ifdef LMPORT_ISA_AVX512
        if constexpr (T::kCodes512)   // the codes are unpacked from the blocks as the dot products need them
          decode_row_scales<T>(rows[r], K, bufs[r]);
        else
#endif
          decode_row<T>(rows[r], K, bufs[r]);
      }
      if (RT > 1) {
        dot_tile<T, 1, kRowBlock>(rows, bufs.data(), a, 0, folded.data(), out);
        for (int r = 0; r < valid; ++r) y[n + r] = out[r] + (bias ? bias[n + r] : 0.f);
        continue;
      }
      for (int64_t m0 = 0; m0 < M; m0 += kTile) {
        const int64_t mt = std::min<int64_t>(kTile, M - m0);
        switch (mt) {
          case 4: dot_tile<T, 4, 1>(rows, bufs.data(), a, m0, folded.data(), out); break;
          case 3: dot_tile<T, 3, 1>(rows, bufs.data(), a, m0, folded.data(), out); break;
          case 2: dot_tile<T, 2, 1>(rows, bufs.data(), a, m0, folded.data(), out); break;
          default: dot_tile<T, 1, 1>(rows, bufs.data(), a, m0, folded.data(), out); break;
        }
        for (int64_t j = 0; j < mt; ++j) y[(m0 + j) * N + n] = out[j] + (bias ? bias[n] : 0.f);
      }
    }
  });
}


// Rows of x beyond kIntegerRows: tiles of weight rows expanded to float32 in cache, as quant_linear.h's
// linear_by_tiles does.
template <class T>
inline void linear_by_tiles(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, const float* bias,
                            float* y) {
  using linear_detail::kRows;
  const int64_t row_bytes = K / T::kElements * T::kBytes;
  at::parallel_for(0, (N + kRows - 1) / kRows, 4, [&](int64_t begin, int64_t end) {
    RowBuffer buf(K);
    std::vector<float> tile(kRows * K);
    const float* next[kRows] = {tile.data(), tile.data(), tile.data(), tile.data()};
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * kRows, rows = std::min<int64_t>(kRows, N - n);
      for (int64_t r = 0; r < rows; ++r) {
        decode_row<T>(w + (n + r) * row_bytes, K, buf);
        expand_row<T>(buf, K, tile.data() + r * K);
      }
      linear_detail::rows_times_x(tile.data(), rows, K, x, M, y + n, N, bias ? bias + n : nullptr, next);
    }
  });
}

// The types whose rows this build reads interleaved (interleaved_rows.h).
inline std::vector<std::string> interleaved_types() {
  return interleaved::kKernels ? interleaved::type_names() : std::vector<std::string>{};
}

#ifdef LMPORT_INTERLEAVED
// Rows of x over a weight whose whole groups are interleaved: the groups by the interleaved kernel, the rows
// after them (as the file lays them out) row by row, x held alike by both (each row of x on its own): by
// linear_int8 with AVX-512 VNNI, by the int16 integer path on the AVX2 path.
template <class T>
inline void linear_interleaved(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, const float* bias,
                               float* y) {
  const int64_t row_bytes = K / T::kElements * T::kBytes, whole = N / interleaved::kGroup * interleaved::kGroup;
  interleaved::linear_groups(typename RowsOf<T>::type{}, x, M, K, w, whole / interleaved::kGroup,
                             interleaved::kGroup * row_bytes, K / T::kElements, bias, y, N);
  interleaved::rows_after_groups(M, N, y, [&](int64_t first, int64_t count, float* out) {
#ifdef LMPORT_ISA_AVX512
    linear_int8<T>(x, M, K, w + first * row_bytes, count, bias ? bias + first : nullptr, out);
#else
    linear_integer<T>(quantize(x, M, K), M, w + first * row_bytes, count, bias ? bias + first : nullptr, out);
#endif
  });
}
#endif

}  // namespace ggml_detail
}  // namespace lmport
