// The AVX-512 (BW, VL, VNNI) group kernels over rows interleaved in groups of 16 (interleaved_rows.h runs
// them): x as two int8 codes an input, vpdpbusd over the rows' unsigned codes and each.
#pragma once

#include <cstring>
#include <type_traits>
#include <vector>

#include "../../interleaved_layout.h"
#include "int8_rows.h"

namespace lmport {
namespace interleaved {

// x as the kernels read it: hi and lo codes in input order (int8_rows::split_run), per run of 32 inputs
// the step d / 256 and the float sum of x, per 16 inputs the codes (256 hi + lo) summed.
struct BlockCodes {
  std::vector<int8_t> hi, lo;
  std::vector<float> steps, sums;
  std::vector<int32_t> code_sums;
  // x's four hi or lo codes from input k (a multiple of 4), as vpdpbusd's broadcast operand
  static __m512i four(const std::vector<int8_t>& codes, int64_t k) {
    int32_t v;
    std::memcpy(&v, codes.data() + k, 4);
    return _mm512_set1_epi32(v);
  }
};

inline BlockCodes block_codes(const float* x, int64_t K) {
  const int64_t runs = K / 32;
  BlockCodes c{std::vector<int8_t>(K), std::vector<int8_t>(K), std::vector<float>(runs), std::vector<float>(runs),
               std::vector<int32_t>(2 * runs)};
  for (int64_t i = 0; i < runs; ++i) {
    const int8_rows::Run run = int8_rows::split_run(x + 32 * i, c.hi.data(), c.lo.data(), 32 * i, 32 * i + 16);
    c.steps[i] = run.step;
    c.sums[i] = run.sum;
  }
  for (int64_t s = 0; s < 2 * runs; ++s) {
    int32_t sum = 0;
    for (int64_t k = 16 * s; k < 16 * s + 16; ++k) sum += 256 * c.hi[k] + c.lo[k];
    c.code_sums[s] = sum;
  }
  return c;
}

// The int32 sums of 64 unsigned codes (4 a lane) with x's four codes from input k, hi then lo, added to
// ``hi`` and ``lo``.
inline void dot4(__m512i codes, const BlockCodes& x, int64_t k, __m512i& hi, __m512i& lo) {
  hi = _mm512_dpbusd_epi32(hi, codes, BlockCodes::four(x.hi, k));
  lo = _mm512_dpbusd_epi32(lo, codes, BlockCodes::four(x.lo, k));
}

inline __m512i combined(__m512i hi, __m512i lo) { return _mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo); }

inline __m512 halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// A group's 16 results for a row of x.
using Lanes = __m512;

inline void store(float* y, Lanes v, const float* bias) {
  _mm512_storeu_ps(y, bias ? _mm512_add_ps(v, _mm512_loadu_ps(bias)) : v);
}

// Each kernel: a group's 16 rows (``group``: its ``blocks`` blocks) dotted with MT rows of x (``x``) at once,
// each code vector unpacked once for all of them: out[m], lane r, is row r's result for x[m]. Each row of
// x meets the same operations in the same order whatever MT is, so its result is the one it has alone.
// ``next``: the next group's bytes, fetched into L2 a block at a time.

template <int MT>
inline void dot4(__m512i codes, const BlockCodes* const* x, int64_t k, __m512i* hi, __m512i* lo) {
  for (int m = 0; m < MT; ++m) dot4(codes, *x[m], k, hi[m], lo[m]);
}

// Chains of vpdpbusd sums a row of x keeps (then added): two for one or two rows, so that each chain is half
// as long; more rows give enough chains of their own. Integer sums: the result is the same either way.
template <int MT> constexpr int kChains = MT <= 2 ? 2 : 1;

template <int C, int MT>
inline __m512i chained(const __m512i (&sums)[C][MT], int m) {
  if constexpr (C == 2) return _mm512_add_epi32(sums[0][m], sums[1][m]);
  else return sums[0][m];
}

template <int T, int MT>
inline void clear(__m512i (&hi)[T][MT], __m512i (&lo)[T][MT]) {
  for (int t = 0; t < T; ++t)
    for (int m = 0; m < MT; ++m) hi[t][m] = lo[t][m] = _mm512_setzero_si512();
}

// A Q5_0 block's (``c``: the group's) unsigned 5-bit codes of vector j: inputs 4 j .. 4 j + 3 (``low``) and
// 16 + 4 j .. (``high``) of the 16 rows.
inline void q5_0_codes(const uint8_t* c, int j, __m512i& low, __m512i& high) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
  const __m512i v = _mm512_loadu_si512(c + Q5_0Rows::kNibbles + 64 * j);
  uint64_t first, second;
  std::memcpy(&first, c + Q5_0Rows::kMasks + 8 * j, 8);
  std::memcpy(&second, c + Q5_0Rows::kMasks + 8 * (4 + j), 8);
  low = _mm512_and_si512(v, low4), high = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  low = _mm512_mask_add_epi8(low, _cvtu64_mask64(first), low, sixteen);
  high = _mm512_mask_add_epi8(high, _cvtu64_mask64(second), high, sixteen);
}

template <int MT>
inline void dot_group(Q5_0Rows, const uint8_t* group, int64_t blocks, const BlockCodes* const* x, const uint8_t* next,
                      Lanes* out) {
  constexpr int64_t kBlock = kGroup * Q5_0Rows::kBytes;
  __m512 acc[MT];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* c = group + i * kBlock;
    prefetch(next ? next + i * kBlock : nullptr, kBlock);
    constexpr int C = kChains<MT>;
    __m512i hi[C][MT], lo[C][MT];
    clear(hi, lo);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {   // inputs 4 j .. 4 j + 3 (low nibbles) and 16 + 4 j .. (high)
      __m512i low, high;
      q5_0_codes(c, j, low, high);
      dot4<MT>(low, x, 32 * i + 4 * j, hi[j % C], lo[j % C]);
      dot4<MT>(high, x, 32 * i + 16 + 4 * j, hi[j % C], lo[j % C]);
    }
    const __m512 d = halves(c);
    for (int m = 0; m < MT; ++m) {
      const __m512i sums = _mm512_sub_epi32(
          combined(chained(hi, m), chained(lo, m)),
          _mm512_set1_epi32(16 * (x[m]->code_sums[2 * i] + x[m]->code_sums[2 * i + 1])));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(d, _mm512_set1_ps(x[m]->steps[i])), acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) out[m] = acc[m];
}

// A Q4_K (or Q5_K: the same first 16 bytes) block's 8 sub-blocks' 6-bit scales and mins (lanes: the group's rows)
// from its 12 scale bytes, as llama.cpp's get_scale_min_k4.
inline void q4_k_scales(const uint8_t* c, __m512 (&sc)[8], __m512 (&mn)[8]) {
  const __m512i low6 = _mm512_set1_epi32(63);
  const auto byte = [&](int q) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + Q4_KRows::kScales + 16 * q)));
  };
  for (int q = 0; q < 4; ++q) {
    const __m512i a = byte(q), b = byte(q + 4), e = byte(q + 8);
    sc[q] = _mm512_cvtepi32_ps(_mm512_and_si512(a, low6));
    mn[q] = _mm512_cvtepi32_ps(_mm512_and_si512(b, low6));
    sc[q + 4] = _mm512_cvtepi32_ps(_mm512_or_si512(_mm512_and_si512(e, _mm512_set1_epi32(0xF)),
                                                   _mm512_slli_epi32(_mm512_srli_epi32(a, 6), 4)));
    mn[q + 4] = _mm512_cvtepi32_ps(_mm512_or_si512(_mm512_srli_epi32(e, 4), _mm512_slli_epi32(_mm512_srli_epi32(b, 6), 4)));
  }
}

// A Q4_K or Q5_K block's (``c``: the group's) unsigned codes of qs vector 8 q + j: inputs 64 q + 4 j .. 64 q + 4 j + 3
// (``low``, sub-block 2 q) and 64 q + 32 + 4 j .. (``high``, sub-block 2 q + 1) of the 16 rows. Q4_K: the nibbles.
inline void k_codes(Q4_KRows, const uint8_t* c, int q, int j, __m512i& low, __m512i& high) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i v = _mm512_loadu_si512(c + Q4_KRows::kNibbles + 64 * (8 * q + j));
  low = _mm512_and_si512(v, low4), high = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
}

// Q5_K: the nibbles with qh vector j's bits 2 q (low) and 2 q + 1 (high) on top, 0..31.
inline void k_codes(Q5_KRows, const uint8_t* c, int q, int j, __m512i& low, __m512i& high) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  const __m512i v = _mm512_loadu_si512(c + Q5_KRows::kNibbles + 64 * (8 * q + j));
  // bits 2 q, 2 q + 1 of each byte to bits 0, 1 (the bits a 16-bit shift brings down land above them)
  const __m512i qh = _mm512_srli_epi16(_mm512_loadu_si512(c + Q5_KRows::kHigh + 64 * j), 2 * q);
  low = _mm512_or_si512(_mm512_and_si512(v, low4), _mm512_and_si512(_mm512_slli_epi16(qh, 4), bit4));
  high = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4),
                         _mm512_and_si512(_mm512_slli_epi16(qh, 3), bit4));
}

// Q4_K and Q5_K: 8 sub-blocks of 32 inputs, w = d sc q - dmin m, the codes by k_codes.
template <int MT, class L, std::enable_if_t<kLikeQ4_K<L>, int> = 0>
inline void dot_group(L, const uint8_t* group, int64_t blocks, const BlockCodes* const* x, const uint8_t* next,
                      Lanes* out) {
  constexpr int64_t kBlock = kGroup * L::kBytes;
  __m512 acc[MT], mins[MT];
  for (int m = 0; m < MT; ++m) acc[m] = mins[m] = _mm512_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* c = group + i * kBlock;
    prefetch(next ? next + i * kBlock : nullptr, kBlock);
    __m512 sc[8], mn[8];
    q4_k_scales(c, sc, mn);
    __m512 block[MT], block_mins[MT];
    for (int m = 0; m < MT; ++m) block[m] = block_mins[m] = _mm512_setzero_ps();
    for (int q = 0; q < 4; ++q) {   // sub-blocks 2 q (low nibbles of qs bytes 32 q ..) and 2 q + 1 (high)
      __m512i hi[2][MT], lo[2][MT];
      clear(hi, lo);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        __m512i low, high;
        k_codes(L{}, c, q, j, low, high);
        const int64_t k = 256 * i + 64 * q + 4 * j;
        dot4<MT>(low, x, k, hi[0], lo[0]);
        dot4<MT>(high, x, k + 32, hi[1], lo[1]);
      }
      for (int t = 0; t < 2; ++t) {
        const int s = 2 * q + t;
        const int64_t run = 8 * i + s;
        for (int m = 0; m < MT; ++m) {
          block[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(combined(hi[t][m], lo[t][m])),
                                     _mm512_mul_ps(sc[s], _mm512_set1_ps(x[m]->steps[run])), block[m]);
          block_mins[m] = _mm512_fmadd_ps(mn[s], _mm512_set1_ps(x[m]->sums[run]), block_mins[m]);
        }
      }
    }
    const __m512 d = halves(c), dmin = halves(c + L::kMin);
    for (int m = 0; m < MT; ++m) {
      acc[m] = _mm512_fmadd_ps(block[m], d, acc[m]);
      mins[m] = _mm512_fmadd_ps(block_mins[m], dmin, mins[m]);
    }
  }
  for (int m = 0; m < MT; ++m) out[m] = _mm512_sub_ps(acc[m], mins[m]);
}

// A Q6_K block's (``c``: the group's) unsigned 6-bit codes (q + 32) from bytes 4 j .. of each 32-byte run of ql
// and qh in half h: codes[t] holds inputs 128 h + 32 t + 4 j .. 128 h + 32 t + 4 j + 3 of the 16 rows.
inline void q6_k_codes(const uint8_t* c, int h, int j, __m512i (&codes)[4]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), high2 = _mm512_set1_epi8(0x30);
  const __m512i q0 = _mm512_loadu_si512(c + 64 * (16 * h + j)), q1 = _mm512_loadu_si512(c + 64 * (16 * h + 8 + j));
  const __m512i qh = _mm512_loadu_si512(c + Q6_KRows::kHigh + 64 * (8 * h + j));
  codes[0] = _mm512_or_si512(_mm512_and_si512(q0, low4), _mm512_and_si512(_mm512_slli_epi16(qh, 4), high2));
  codes[1] = _mm512_or_si512(_mm512_and_si512(q1, low4), _mm512_and_si512(_mm512_slli_epi16(qh, 2), high2));
  codes[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q0, 4), low4), _mm512_and_si512(qh, high2));
  codes[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q1, 4), low4),
                             _mm512_and_si512(_mm512_srli_epi16(qh, 2), high2));
}

template <int MT>
inline void dot_group(Q6_KRows, const uint8_t* group, int64_t blocks, const BlockCodes* const* x, const uint8_t* next,
                      Lanes* out) {
  constexpr int64_t kBlock = kGroup * Q6_KRows::kBytes;
  __m512 acc[MT];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* c = group + i * kBlock;
    prefetch(next ? next + i * kBlock : nullptr, kBlock);
    __m512 block[MT];
    for (auto& b : block) b = _mm512_setzero_ps();
    for (int h = 0; h < 2; ++h)
      for (int half = 0; half < 2; ++half) {   // inputs 128 h + 32 t + 16 half + .., sub-block 8 h + 2 t + half
        __m512i hi[4][MT], lo[4][MT];
        clear(hi, lo);
#pragma GCC unroll 4
        for (int jj = 0; jj < 4; ++jj) {
          const int j = 4 * half + jj;   // bytes 4 j .. of each 32-byte run of ql and of qh
          __m512i codes[4];
          q6_k_codes(c, h, j, codes);
          for (int t = 0; t < 4; ++t) dot4<MT>(codes[t], x, 256 * i + 128 * h + 32 * t + 4 * j, hi[t], lo[t]);
        }
        for (int t = 0; t < 4; ++t) {
          const int s = 8 * h + 2 * t + half;
          const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + Q6_KRows::kScales + 16 * s))));
          for (int m = 0; m < MT; ++m) {
            const __m512i sums = _mm512_sub_epi32(combined(hi[t][m], lo[t][m]), _mm512_set1_epi32(32 * x[m]->code_sums[16 * i + s]));
            block[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(sc, _mm512_set1_ps(x[m]->steps[8 * i + 4 * h + t])),
                                       block[m]);
          }
        }
      }
    const __m512 d = halves(c + Q6_KRows::kScale);
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_fmadd_ps(block[m], d, acc[m]);
  }
  for (int m = 0; m < MT; ++m) out[m] = acc[m];
}

// lmport's int4 / int8 format (QuantRows).
template <int MT, int BITS>
inline void dot_group(QuantRows<BITS> w, const uint8_t* q, int64_t, const BlockCodes* const* x, const uint8_t* next,
                      Lanes* out) {
  constexpr int kVectors = BITS == 4 ? 4 : 8;   // 64-byte vectors of codes a run of 32 inputs
  const __m512i low4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t runs_per_group = w.group_size / 32;
  __m512 acc[MT], acc_mins[MT];
  for (int m = 0; m < MT; ++m) acc[m] = acc_mins[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.K / 32; ++b) {
    const uint8_t* c = q + 64 * kVectors * b;
    if constexpr (BITS == 4) prefetch(next ? next + 64 * kVectors * b : nullptr, 64 * kVectors);   // see prefetch()
    constexpr int C = kChains<MT>;
    __m512i hi[C][MT], lo[C][MT];
    clear(hi, lo);
#pragma GCC unroll 8
    for (int j = 0; j < kVectors; ++j) {
      const __m512i v = _mm512_loadu_si512(c + 64 * j);
      if constexpr (BITS == 4) {   // inputs 4 j .. 4 j + 3 (low nibbles) and 16 + 4 j .. (high)
        dot4<MT>(_mm512_and_si512(v, low4), x, 32 * b + 4 * j, hi[0], lo[0]);
        dot4<MT>(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), x, 32 * b + 16 + 4 * j, hi[1 % C], lo[1 % C]);
      } else {
        dot4<MT>(_mm512_xor_si512(v, flip), x, 32 * b + 4 * j, hi[j % C], lo[j % C]);
      }
    }
    const int64_t g = b / runs_per_group;
    const __m512 scale = halves(reinterpret_cast<const uint8_t*>(w.scales + kGroup * g));
    const __m512 min = w.mins ? halves(reinterpret_cast<const uint8_t*>(w.mins + kGroup * g)) : _mm512_setzero_ps();
    for (int m = 0; m < MT; ++m) {
      __m512i sums = combined(chained(hi, m), chained(lo, m));
      if constexpr (BITS == 8)
        sums = _mm512_sub_epi32(sums, _mm512_set1_epi32(128 * (x[m]->code_sums[2 * b] + x[m]->code_sums[2 * b + 1])));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(scale, _mm512_set1_ps(x[m]->steps[b])), acc[m]);
      if (w.mins)   // the group's mins meet x's float sum over it, its runs' sums in turn
        acc_mins[m] = _mm512_fmadd_ps(min, _mm512_set1_ps(x[m]->sums[b]), acc_mins[m]);
    }
  }
  for (int m = 0; m < MT; ++m) out[m] = _mm512_add_ps(acc[m], acc_mins[m]);
}

// Rows of x a kernel takes at once: as many as keep their sums in registers (Q4_K and Q5_K keep two sub-blocks'
// sums a row, Q6_K four). Five: a speculative verification's step (four proposals and the last token).
template <class L> constexpr int kRowsAtOnce = std::is_same_v<L, Q6_KRows> ? 2 : kLikeQ4_K<L> ? 4 : 5;

}  // namespace interleaved
}  // namespace lmport
