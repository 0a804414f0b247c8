// The AVX2 (FMA, F16C) group kernels over rows interleaved in groups of 16 (interleaved_rows.h runs them):
// x rounded to int16, each group as two halves of 8 rows, the codes widened to int16 and vpmaddwd.
#pragma once

#include <cstring>
#include <type_traits>
#include <vector>

#include "../../interleaved_layout.h"

namespace lmport {
namespace interleaved {

// x as the kernels read it: int16 codes in input order, rounded as the AVX2 path's row-by-row kernels round x
// (ggml_linear.h's quantize: per run of 32, d = max|x_run| / 32767, to nearest even); per run the step d and
// the float sum of x, per 16 inputs the codes summed.
struct BlockCodes {
  std::vector<int16_t> codes;
  std::vector<float> steps, sums;
  std::vector<int32_t> code_sums;
  // x's four codes from input k (a multiple of 4), in each 64-bit lane: vpmaddwd's operand
  __m256i four(int64_t k) const {
    int64_t v;
    std::memcpy(&v, codes.data() + k, 8);
    return _mm256_set1_epi64x(v);
  }
};

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline BlockCodes block_codes(const float* x, int64_t K) {
  const int64_t runs = K / 32;
  BlockCodes c{std::vector<int16_t>(K), std::vector<float>(runs), std::vector<float>(runs),
               std::vector<int32_t>(2 * runs)};
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t i = 0; i < runs; ++i) {
    __m256 p[4], amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      p[j] = _mm256_loadu_ps(x + 32 * i + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, p[j]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float d = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m))) / 32767.f, inv = d > 0.f ? 1.f / d : 0.f;
    for (int j = 0; j < 4; j += 2) {
      const __m256i v = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(p[j], _mm256_set1_ps(inv))),
                                           _mm256_cvtps_epi32(_mm256_mul_ps(p[j + 1], _mm256_set1_ps(inv))));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c.codes.data() + 32 * i + 8 * j),
                          _mm256_permute4x64_epi64(v, _MM_SHUFFLE(3, 1, 2, 0)));
    }
    c.steps[i] = d;
    c.sums[i] = hsum8(_mm256_add_ps(p[0], p[1])) + hsum8(_mm256_add_ps(p[2], p[3]));
  }
  for (int64_t s = 0; s < 2 * runs; ++s) {
    int32_t sum = 0;
    for (int64_t k = 16 * s; k < 16 * s + 16; ++k) sum += c.codes[k];
    c.code_sums[s] = sum;
  }
  return c;
}

// Without VNNI there is no byte dot product to take x's codes whole: vpmaddubsw's int16 pair sums of unsigned
// weight codes times int8 x codes would saturate for int8 weights (q + 128 up to 255, times -128, twice), and
// int8 x alone is too coarse. So each
// kernel takes a group's 16 rows as two halves of 8 (lane r: row 8 h + r, the bytes at 32 h of each 64-byte
// vector), widens their codes to int16 (zero-extended: every code is unsigned, as the AVX-512 kernels take
// them) and vpmaddwd sums them with x's int16 codes, a pair of inputs a lane: a product is at most
// 255 x 32767, so a run's int32 sums are exact and nothing saturates.

// 8 rows' codes (lane r: row r's 4 bytes) as int16, in the order unpacking leaves them: rows 0, 1, 4, 5
// (``a``) and rows 2, 3, 6, 7 (``b``), 4 inputs each.
struct Wide {
  __m256i a, b;
};

inline Wide widen(__m256i codes) {
  const __m256i zero = _mm256_setzero_si256();
  return {_mm256_unpacklo_epi8(codes, zero), _mm256_unpackhi_epi8(codes, zero)};
}

// A row of x's int32 sums over 8 rows, as ``Wide`` orders them, two lanes a row (inputs 4 k, 4 k + 1 and
// 4 k + 2, 4 k + 3).
struct Sums {
  __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
};

inline __m256i madd(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, w, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
}

// The sums of 8 rows' 4 codes (``w``) with x's four codes from input k, added to ``s``.
inline void dot4(const Wide& w, const BlockCodes& x, int64_t k, Sums& s) {
  const __m256i v = x.four(k);
  s.a = madd(s.a, w.a, v);
  s.b = madd(s.b, w.b, v);
}

template <int MT>
inline void dot4(const Wide& w, const BlockCodes* const* x, int64_t k, Sums* s) {
  for (int m = 0; m < MT; ++m) dot4(w, *x[m], k, s[m]);
}

// The 8 rows' int32 sums, in row order (vphaddd pairs lanes 0, 1 of ``a``, then 2, 3, then ``b``'s, per 128 bits).
inline __m256i total(const Sums& s) { return _mm256_hadd_epi32(s.a, s.b); }

// The 8 rows' int32 sums less ``offset_sum`` (a type's code offset times x's codes summed), as float32.
inline __m256 floats(const Sums& s, int32_t offset_sum) {
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(total(s), _mm256_set1_epi32(offset_sum)));
}

inline __m256i load8(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 8 float16s (a half of a vector of 16 rows' halves) as float32.
inline __m256 halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// 8 rows' bytes (a half of a vector of 16 rows' bytes) as int32.
inline __m256i bytes_u(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline __m256i bytes_s(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }

// A group's 16 results for a row of x: rows 0..7, 8..15.
struct Lanes {
  __m256 half[2];
};

inline void store(float* y, const Lanes& v, const float* bias) {
  for (int h = 0; h < 2; ++h)
    _mm256_storeu_ps(y + 8 * h, bias ? _mm256_add_ps(v.half[h], _mm256_loadu_ps(bias + 8 * h)) : v.half[h]);
}

// Byte i 16 where bit i of ``bits`` is set, else 0: Q5_0's fifth bits of 8 rows (4 a row).
inline __m256i sixteens(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                             _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

// Each kernel as the AVX-512 one: a group's 16 rows (``group``: its ``blocks`` blocks) dotted with MT rows of x
// at once, the codes widened once for all of them, each half of the rows in turn a block at a time; out[m] is
// the 16 rows' results for x[m]. Each row of x meets the same operations whatever MT is.

template <int MT>
inline void dot_group(Q5_0Rows, const uint8_t* group, int64_t blocks, const BlockCodes* const* x, const uint8_t* next,
                      Lanes* out) {
  constexpr int64_t kBlock = kGroup * Q5_0Rows::kBytes;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[2][MT];
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < MT; ++m) acc[h][m] = _mm256_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* c = group + i * kBlock;
    const uint8_t* later = next ? next + i * kBlock : nullptr;
    for (int h = 0; h < 2; ++h) {
      prefetch_part(later, kBlock, h, 2);
      Sums s[MT];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {   // inputs 4 j .. 4 j + 3 (low nibbles) and 16 + 4 j .. (high)
        const __m256i v = load8(c + Q5_0Rows::kNibbles + 64 * j + 32 * h);
        uint32_t first, second;
        std::memcpy(&first, c + Q5_0Rows::kMasks + 8 * j + 4 * h, 4);
        std::memcpy(&second, c + Q5_0Rows::kMasks + 8 * (4 + j) + 4 * h, 4);
        dot4<MT>(widen(_mm256_or_si256(_mm256_and_si256(v, low4), sixteens(first))), x, 32 * i + 4 * j, s);
        dot4<MT>(widen(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), sixteens(second))), x,
                 32 * i + 16 + 4 * j, s);
      }
      const __m256 d = halves(c + 16 * h);
      for (int m = 0; m < MT; ++m)
        acc[h][m] = _mm256_fmadd_ps(floats(s[m], 16 * (x[m]->code_sums[2 * i] + x[m]->code_sums[2 * i + 1])),
                                    _mm256_mul_ps(d, _mm256_set1_ps(x[m]->steps[i])), acc[h][m]);
    }
  }
  for (int m = 0; m < MT; ++m) out[m] = {{acc[0][m], acc[1][m]}};
}

// A Q4_K or Q5_K block's (``c``: the group's) unsigned codes of half h of qs vector 8 q + j: inputs
// 64 q + 4 j .. 64 q + 4 j + 3 (``low``, sub-block 2 q) and 64 q + 32 + 4 j .. (``high``, 2 q + 1) of rows 8 h ..
// 8 h + 7. Q4_K: the nibbles.
inline void k_codes(Q4_KRows, const uint8_t* c, int h, int q, int j, __m256i& low, __m256i& high) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i v = load8(c + Q4_KRows::kNibbles + 64 * (8 * q + j) + 32 * h);
  low = _mm256_and_si256(v, low4), high = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
}

// Q5_K: the nibbles with qh vector j's bits 2 q (low) and 2 q + 1 (high) on top, 0..31.
inline void k_codes(Q5_KRows, const uint8_t* c, int h, int q, int j, __m256i& low, __m256i& high) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
  const __m256i v = load8(c + Q5_KRows::kNibbles + 64 * (8 * q + j) + 32 * h);
  // bits 2 q, 2 q + 1 of each byte to bits 0, 1 (the bits a 16-bit shift brings down land above them)
  const __m256i qh = _mm256_srli_epi16(load8(c + Q5_KRows::kHigh + 64 * j + 32 * h), 2 * q);
  low = _mm256_or_si256(_mm256_and_si256(v, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), bit4));
  high = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4),
                         _mm256_and_si256(_mm256_slli_epi16(qh, 3), bit4));
}

// Q4_K and Q5_K (the same scales and mins): 8 sub-blocks of 32 inputs, w = d sc q - dmin m, the codes by k_codes.
template <int MT, class L, std::enable_if_t<kLikeQ4_K<L>, int> = 0>
inline void dot_group(L, const uint8_t* group, int64_t blocks, const BlockCodes* const* x, const uint8_t* next,
                      Lanes* out) {
  constexpr int64_t kBlock = kGroup * L::kBytes;
  const __m256i low6 = _mm256_set1_epi32(63);
  __m256 acc[2][MT], mins[2][MT];
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < MT; ++m) acc[h][m] = mins[h][m] = _mm256_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* c = group + i * kBlock;
    const uint8_t* later = next ? next + i * kBlock : nullptr;
    for (int h = 0; h < 2; ++h) {
      // Sub-block s's 6-bit scale and min from the 12 scale bytes, as llama.cpp's get_scale_min_k4.
      const auto byte = [&](int q) { return bytes_u(c + L::kScales + 16 * q + 8 * h); };
      const auto scale_min = [&](int s, __m256& sc, __m256& mn) {
        if (s < 4) {
          sc = _mm256_cvtepi32_ps(_mm256_and_si256(byte(s), low6));
          mn = _mm256_cvtepi32_ps(_mm256_and_si256(byte(s + 4), low6));
        } else {
          const __m256i e = byte(s + 4);
          sc = _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_and_si256(e, _mm256_set1_epi32(0xF)),
                                                  _mm256_slli_epi32(_mm256_srli_epi32(byte(s - 4), 6), 4)));
          mn = _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_srli_epi32(e, 4), _mm256_slli_epi32(_mm256_srli_epi32(byte(s), 6), 4)));
        }
      };
      __m256 block[MT], block_mins[MT];
      for (int m = 0; m < MT; ++m) block[m] = block_mins[m] = _mm256_setzero_ps();
      for (int q = 0; q < 4; ++q) {   // sub-blocks 2 q (low nibbles of qs bytes 32 q ..) and 2 q + 1 (high)
        prefetch_part(later, kBlock, 4 * h + q, 8);
        Sums s[2][MT];
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          __m256i low, high;
          k_codes(L{}, c, h, q, j, low, high);
          const int64_t k = 256 * i + 64 * q + 4 * j;
          dot4<MT>(widen(low), x, k, s[0]);
          dot4<MT>(widen(high), x, k + 32, s[1]);
        }
        for (int t = 0; t < 2; ++t) {
          const int64_t run = 8 * i + 2 * q + t;
          __m256 sc, mn;
          scale_min(2 * q + t, sc, mn);
          for (int m = 0; m < MT; ++m) {
            block[m] = _mm256_fmadd_ps(floats(s[t][m], 0), _mm256_mul_ps(sc, _mm256_set1_ps(x[m]->steps[run])), block[m]);
            block_mins[m] = _mm256_fmadd_ps(mn, _mm256_set1_ps(x[m]->sums[run]), block_mins[m]);
          }
        }
      }
      const __m256 d = halves(c + 16 * h), dmin = halves(c + L::kMin + 16 * h);
      for (int m = 0; m < MT; ++m) {
        acc[h][m] = _mm256_fmadd_ps(block[m], d, acc[h][m]);
        mins[h][m] = _mm256_fmadd_ps(block_mins[m], dmin, mins[h][m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    out[m] = {{_mm256_sub_ps(acc[0][m], mins[0][m]), _mm256_sub_ps(acc[1][m], mins[1][m])}};
}

// Q6_K: each 64-byte vector's two halves of the rows in one pass (x's four codes broadcast once for all 16
// rows, the block's bytes read in order), each sub-block of 16 inputs scaled as it ends.
template <int MT>
inline void dot_group(Q6_KRows, const uint8_t* group, int64_t blocks, const BlockCodes* const* x, const uint8_t* next,
                      Lanes* out) {
  constexpr int64_t kBlock = kGroup * Q6_KRows::kBytes;
  const __m256i low4 = _mm256_set1_epi8(0x0F), high2 = _mm256_set1_epi8(0x30);
  __m256 acc[2][MT];
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < MT; ++m) acc[h][m] = _mm256_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* c = group + i * kBlock;
    const uint8_t* later = next ? next + i * kBlock : nullptr;
    __m256 block[2][MT];
    for (int h = 0; h < 2; ++h)
      for (int m = 0; m < MT; ++m) block[h][m] = _mm256_setzero_ps();
#pragma GCC unroll 2
    for (int top = 0; top < 2; ++top)
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half)   // inputs 128 top + 32 t + 16 half + .., sub-block 8 top + 2 t + half
#pragma GCC unroll 2
        for (int u = 0; u < 2; ++u) {   // t = u (ql's low nibbles) and u + 2 (high): ql vectors 16 top + 8 u + j
          prefetch_part(later, kBlock, 4 * top + 2 * half + u, 8);
          Sums s[2][2][MT];   // [half of the rows h][t = u + 2 v]
#pragma GCC unroll 4
          for (int j = 4 * half; j < 4 * half + 4; ++j) {
            const int64_t k = 256 * i + 128 * top + 32 * u + 4 * j;
            for (int h = 0; h < 2; ++h) {
              const __m256i q = load8(c + 64 * (16 * top + 8 * u + j) + 32 * h);
              const __m256i qh = load8(c + Q6_KRows::kHigh + 64 * (8 * top + j) + 32 * h);
              // qh's bits 2 t, 2 t + 1 to bits 4, 5
              const __m256i high_low = u ? _mm256_slli_epi16(qh, 2) : _mm256_slli_epi16(qh, 4);
              const __m256i high_high = u ? _mm256_srli_epi16(qh, 2) : qh;
              dot4<MT>(widen(_mm256_or_si256(_mm256_and_si256(q, low4), _mm256_and_si256(high_low, high2))), x, k,
                       s[h][0]);
              dot4<MT>(widen(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), low4),
                                             _mm256_and_si256(high_high, high2))), x, k + 64, s[h][1]);
            }
          }
          for (int h = 0; h < 2; ++h)
            for (int v = 0; v < 2; ++v) {
              const int t = u + 2 * v, sub = 8 * top + 2 * t + half;
              const __m256 sc = _mm256_cvtepi32_ps(bytes_s(c + Q6_KRows::kScales + 16 * sub + 8 * h));
              for (int m = 0; m < MT; ++m)
                block[h][m] = _mm256_fmadd_ps(floats(s[h][v][m], 32 * x[m]->code_sums[16 * i + sub]),
                                              _mm256_mul_ps(sc, _mm256_set1_ps(x[m]->steps[8 * i + 4 * top + t])),
                                              block[h][m]);
            }
        }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = halves(c + Q6_KRows::kScale + 16 * h);
      for (int m = 0; m < MT; ++m) acc[h][m] = _mm256_fmadd_ps(block[h][m], d, acc[h][m]);
    }
  }
  for (int m = 0; m < MT; ++m) out[m] = {{acc[0][m], acc[1][m]}};
}

// lmport's int4 / int8 format (QuantRows), as the AVX-512 kernel takes it.
template <int MT, int BITS>
inline void dot_group(QuantRows<BITS> w, const uint8_t* q, int64_t, const BlockCodes* const* x, const uint8_t* next,
                      Lanes* out) {
  constexpr int kVectors = BITS == 4 ? 4 : 8;   // 64-byte vectors of codes a run of 32 inputs
  const __m256i low4 = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const int64_t runs_per_group = w.group_size / 32;
  __m256 acc[2][MT], acc_mins[2][MT];
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < MT; ++m) acc[h][m] = acc_mins[h][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < w.K / 32; ++b) {
    const uint8_t* c = q + 64 * kVectors * b;
    const uint8_t* later = next ? next + 64 * kVectors * b : nullptr;
    const int64_t g = b / runs_per_group;
    for (int h = 0; h < 2; ++h) {
      prefetch_part(later, 64 * kVectors, h, 2);
      Sums s[MT];
#pragma GCC unroll 8
      for (int j = 0; j < kVectors; ++j) {
        const __m256i v = load8(c + 64 * j + 32 * h);
        if constexpr (BITS == 4) {   // inputs 4 j .. 4 j + 3 (low nibbles) and 16 + 4 j .. (high)
          dot4<MT>(widen(_mm256_and_si256(v, low4)), x, 32 * b + 4 * j, s);
          dot4<MT>(widen(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4)), x, 32 * b + 16 + 4 * j, s);
        } else {
          dot4<MT>(widen(_mm256_xor_si256(v, flip)), x, 32 * b + 4 * j, s);
        }
      }
      const __m256 scale = halves(reinterpret_cast<const uint8_t*>(w.scales + kGroup * g + 8 * h));
      const __m256 min = w.mins ? halves(reinterpret_cast<const uint8_t*>(w.mins + kGroup * g + 8 * h)) : _mm256_setzero_ps();
      for (int m = 0; m < MT; ++m) {
        const int32_t offset = BITS == 8 ? 128 * (x[m]->code_sums[2 * b] + x[m]->code_sums[2 * b + 1]) : 0;
        acc[h][m] = _mm256_fmadd_ps(floats(s[m], offset), _mm256_mul_ps(scale, _mm256_set1_ps(x[m]->steps[b])), acc[h][m]);
        if (w.mins) acc_mins[h][m] = _mm256_fmadd_ps(min, _mm256_set1_ps(x[m]->sums[b]), acc_mins[h][m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    out[m] = {{_mm256_add_ps(acc[0][m], acc_mins[0][m]), _mm256_add_ps(acc[1][m], acc_mins[1][m])}};
}

// Rows of x a kernel takes at once: as many as keep their sums in AVX2's 16 registers.
template <class L> constexpr int kRowsAtOnce = std::is_same_v<L, Q6_KRows> ? 1 : kLikeQ4_K<L> ? 2 : 3;

}  // namespace interleaved
}  // namespace lmport
