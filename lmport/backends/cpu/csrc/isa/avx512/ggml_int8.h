// ggml_linear's AVX-512 VNNI path: up to 8 rows of x over Q5_0, Q4_K, Q5_K and Q6_K blocks in int8 arithmetic
// (int8_rows.h), each type's run pairs of codes unpacked to unsigned bytes.
#pragma once

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../../ggml_blocks.h"
#include "../x86.h"
#include "int8_rows.h"

namespace lmport {
namespace ggml_detail {

// ---- Up to 8 rows of x (decode) in int8 arithmetic (int8_rows.h) for the types of a Q4_K_M or Q5_K_M
// file: Q5_0 (its 576-wide rows), Q4_K, Q5_K and Q6_K. Each gives its run pairs' codes as unsigned bytes. ----

// Two Q5_0 blocks' 32 + 32 codes q (0..31, w = d (q - 16)) in input order: both blocks' 16 bytes side by
// side, their low nibbles (inputs 0..15) and high nibbles (16..31) interleaved 16 bytes at a time, the
// fifth bits (one 32-bit word a block, input order) adding 16. An odd last run is paired with itself
// against x's zeros.
struct Q5_0Int8 {
  static constexpr int kOffset = 16, kSubs = 2;
  static constexpr bool kInlineScales = true;
  // The two blocks' d times x's steps, from the blocks being dotted: folding them beforehand, a block at a
  // time, cost as much again as the dot products.
  static __m128 scales(const uint8_t* row, int64_t p, int64_t runs, __m128 steps) {
    const uint8_t* first = row + 2 * p * Q5_0::kBytes;
    const uint8_t* second = 2 * p + 1 < runs ? first + Q5_0::kBytes : first;
    uint16_t d0, d1;
    std::memcpy(&d0, first, 2);
    std::memcpy(&d1, second, 2);
    return _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(d0 | static_cast<int>(d1) << 16)), steps);
  }
  static __m512i lanes() { return _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1); }
  static __m512i pair(const uint8_t* row, int64_t p, int64_t runs) {
    const uint8_t* first = row + 2 * p * Q5_0::kBytes;
    const uint8_t* second = 2 * p + 1 < runs ? first + Q5_0::kBytes : first;
    const __m256i raw = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(second + 6),
                                            reinterpret_cast<const __m128i*>(first + 6));
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
    // [first lo, first hi, second lo, second hi] in 64-bit words of [lo, hi]
    const __m512i order = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i codes = _mm512_permutex2var_epi64(_mm512_castsi256_si512(lo), order, _mm512_castsi256_si512(hi));
    uint32_t h0, h1;
    std::memcpy(&h0, first + 2, 4);
    std::memcpy(&h1, second + 2, 4);
    return _mm512_mask_add_epi8(codes, _cvtu64_mask64(h0 | uint64_t{h1} << 32), codes, _mm512_set1_epi8(16));
  }
};

// Q4_K's runs 2c and 2c + 1 of a block are the low and high nibbles of its qs bytes 32 c .. 32 c + 31:
// input order as they are; no offset (the mins are the rows' extra).
struct Q4_KInt8 {
  static constexpr int kOffset = 0, kSubs = 2;
  static constexpr bool kInlineScales = false;
  static __m128 scales(const uint8_t*, int64_t, int64_t, __m128) { return _mm_setzero_ps(); }
  static __m512i lanes() { return _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1); }
  static __m512i pair(const uint8_t* row, int64_t p, int64_t) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + p / 4 * Q4_K::kBytes + 16 + 32 * (p % 4)));
    const __m256i mask = _mm256_set1_epi8(0x0F);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, mask)),
                              _mm256_and_si256(_mm256_srli_epi16(v, 4), mask), 1);
  }
};

// Q5_K's as Q4_K's, with bits 2 c (the low nibbles) and 2 c + 1 (the high) of qh bytes 0..31 on top: codes 0..31.
struct Q5_KInt8 {
  static constexpr int kOffset = 0, kSubs = 2;
  static constexpr bool kInlineScales = false;
  static __m128 scales(const uint8_t*, int64_t, int64_t, __m128) { return _mm_setzero_ps(); }
  static __m512i lanes() { return Q4_KInt8::lanes(); }
  static __m512i pair(const uint8_t* row, int64_t p, int64_t) {
    const uint8_t* b = row + p / 4 * Q5_K::kBytes;
    const int c = static_cast<int>(p % 4);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 48 + 32 * c));
    // bits 2 c, 2 c + 1 of each byte to bits 0, 1 (the bits a 16-bit shift brings down land above them)
    const __m256i qh = _mm256_srli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)), 2 * c);
    const __m256i mask = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
    const __m256i low = _mm256_or_si256(_mm256_and_si256(v, mask), _mm256_and_si256(_mm256_slli_epi16(qh, 4), bit4));
    const __m256i high = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), mask),
                                         _mm256_and_si256(_mm256_slli_epi16(qh, 3), bit4));
    return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
  }
};

// Q6_K's pair q of a block (half h = q / 2, t = q % 2): the low (t = 0) or high (t = 1) nibbles of ql
// bytes 64 h .. 64 h + 63, with bits 4 t, 4 t + 1 (first run) and 4 t + 2, 4 t + 3 (second) of qh bytes
// 32 h .. 32 h + 31 on top; codes 0..63 for w = d sc (q - 32), a scale every 16 inputs.
struct Q6_KInt8 {
  static constexpr int kOffset = 32, kSubs = 4;
  static constexpr bool kInlineScales = false;
  static __m128 scales(const uint8_t*, int64_t, int64_t, __m128) { return _mm_setzero_ps(); }
  static __m512i lanes() { return _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3); }
  static __m512i pair(const uint8_t* row, int64_t p, int64_t) {
    const uint8_t* b = row + p / 4 * Q6_K::kBytes;
    const int h = static_cast<int>(p % 4) / 2, t = static_cast<int>(p % 2);
    const __m512i ql = _mm512_loadu_si512(b + 64 * h);
    const __m512i low = _mm512_and_si512(t ? _mm512_srli_epi16(ql, 4) : ql, _mm512_set1_epi8(0x0F));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m512i shifts = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(4 * t)),
                                              _mm256_set1_epi16(static_cast<int16_t>(4 * t + 2)), 1);
    const __m512i two = _mm512_and_si512(_mm512_srlv_epi16(_mm512_inserti64x4(_mm512_castsi256_si512(qh), qh, 1), shifts),
                                         _mm512_set1_epi8(0x03));
    return _mm512_or_si512(low, _mm512_slli_epi16(two, 4));
  }
};

// y [M, N] for a few rows of x over T's blocks, T one of the four above's types.
template <class T>
inline void linear_int8(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, const float* bias, float* y) {
  using Codes = std::conditional_t<std::is_same_v<T, Q5_0>, Q5_0Int8,
                std::conditional_t<std::is_same_v<T, Q4_K>, Q4_KInt8,
                std::conditional_t<std::is_same_v<T, Q5_K>, Q5_KInt8, Q6_KInt8>>>;
  using int8_rows::kRowBlock;
  std::vector<int8_rows::Activations> xs;
  for (int64_t m = 0; m < M; ++m) xs.push_back(int8_rows::quantize(x + m * K, K));
  const int64_t blocks = K / T::kElements, row_bytes = blocks * T::kBytes, subs = xs[0].pairs * Codes::kSubs;
  // Per row of the K-quants: each sub-block's scale times x's step for its run, and the mins times x's run
  // sums, eight sub-blocks a vector (scalar, this costs as much as the dot products). Q5_0 gives its scales
  // inline (Q5_0Int8::scales).
  const auto fold = [&](const int8_rows::Activations& a, int64_t n, int valid, float* folded, float* extra) {
    if constexpr (Codes::kInlineScales) return;   // Q5_0: its scales are read as its blocks are dotted
    // steps and sums as locals: read through ``a``, every store to ``folded`` would reload them.
    const float* steps = a.run_steps.data();
    const float* sums = a.run_sums.data();
    for (int r = 0; r < kRowBlock; ++r) {
      float* f = folded + r * subs;
      if (r >= valid) {
        std::fill(f, f + subs, 0.f);
        continue;
      }
      const uint8_t* row = w + (n + r) * row_bytes;
      __m256 mins = _mm256_setzero_ps();
      for (int64_t i = 0; i < blocks; ++i) {
        const uint8_t* block = row + i * T::kBytes;
        if constexpr (std::is_same_v<T, Q4_K> || std::is_same_v<T, Q5_K>) {   // 8 sub-blocks of 32: a run each
          float scale[8], min[8];
          T::scales(block, scale, min);
          _mm256_storeu_ps(f + 8 * i, _mm256_mul_ps(_mm256_loadu_ps(scale), _mm256_loadu_ps(steps + 8 * i)));
          mins = _mm256_fmadd_ps(_mm256_loadu_ps(min), _mm256_loadu_ps(sums + 8 * i), mins);
        } else {   // Q6_K: 16 sub-blocks of 16, two a run
          float scale[16];
          const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
          scale_bytes(sc, f16(block + 208), scale);
          scale_bytes(sc + 8, f16(block + 208), scale + 8);
          const __m256 run = _mm256_loadu_ps(steps + 8 * i);
          const __m256 lo = _mm256_permutevar8x32_ps(run, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
          const __m256 hi = _mm256_permutevar8x32_ps(run, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
          _mm256_storeu_ps(f + 16 * i, _mm256_mul_ps(_mm256_loadu_ps(scale), lo));
          _mm256_storeu_ps(f + 16 * i + 8, _mm256_mul_ps(_mm256_loadu_ps(scale + 8), hi));
        }
      }
      if constexpr (T::kMin) extra[r] = x86::hsum(mins);
    }
  };
  int8_rows::linear<Codes>(xs, w, row_bytes, N, fold, bias, y);
}

// The types linear_int8 runs.
template <class T>
constexpr bool kInt8 =
    std::is_same_v<T, Q5_0> || std::is_same_v<T, Q4_K> || std::is_same_v<T, Q5_K> || std::is_same_v<T, Q6_K>;

}  // namespace ggml_detail
}  // namespace lmport
