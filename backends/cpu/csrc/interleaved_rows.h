// GGUF blocks with output rows interleaved in groups of 16 (lmport.weights.interleaved lays them out and
// documents the layout): vector lane r is row r, so a block's codes of 16 rows meet x's codes for those
// inputs broadcast to every lane, the 16 rows' scales are one load and their results one store.
//
// Every row of x of a step, a decode step's or a prefill's (each row on its own, while the group's bytes
// stay in L1; a prefill's a chunk of rows at a time whose codes stay in L2) with AVX-512 VNNI, x held as
// two int8 codes per input as int8_rows.h holds it (hi and lo, as fine as int16): vpdpbusd over the rows'
// unsigned codes and hi, and again over lo,
// gives each lane's exact int32 sums 256 hi + lo per sub-block; a type whose codes are offset (Q5_0's
// q + 16, Q6_K's q + 32) takes the offset times x's codes summed back off. The sums are scaled in
// float32 by the rows' scales times x's step; Q4_K's mins meet the float sums of x. The dequantize
// kernels (an embedding lookup in a tied LM head's table) read a row back in the file's layout (file_row).
#pragma once

#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <string>
#include <vector>

#ifdef LMPORT_QUANT_AVX512
#include "int8_rows.h"
#endif

namespace lmport {
namespace interleaved {

constexpr int kGroup = 16;

// A block's segment as lmport.weights.interleaved.SEGMENTS gives it: in a group's block it is
// length / unit vectors of 16 units, unit k of rows 0..15. A unit of 0: half a byte.
struct Segment {
  int start, length, unit;
};

// The types, their segments, and where a group's block holds what the kernels read (bytes from its start).
struct Q5_0Rows {   // d, qh (4 bits a unit: vector k masks inputs 4 k .. 4 k + 3), qs
  static constexpr int kElements = 32, kBytes = 22;
  static constexpr Segment kSegments[] = {{0, 2, 2}, {2, 4, 0}, {6, 16, 4}};
  static constexpr int kMasks = 32, kNibbles = 96;
  Q5_0Rows group(int64_t) const { return *this; }   // what group g reads besides its bytes: nothing
};

struct Q4_KRows {   // d, dmin, scales (bytes 0..11 a vector each), qs (vector 8 c + j: bytes 32 c + 4 j ..)
  static constexpr int kElements = 256, kBytes = 144;
  static constexpr Segment kSegments[] = {{0, 2, 2}, {2, 2, 2}, {4, 12, 1}, {16, 128, 4}};
  static constexpr int kMin = 32, kScales = 64, kNibbles = 256;
  Q4_KRows group(int64_t) const { return *this; }   // what group g reads besides its bytes: nothing
};

struct Q6_KRows {   // ql (vector k: bytes 4 k ..), qh (likewise), scales (sub-block s a vector), d
  static constexpr int kElements = 256, kBytes = 210;
  static constexpr Segment kSegments[] = {{0, 128, 4}, {128, 64, 4}, {192, 16, 1}, {208, 2, 2}};
  static constexpr int kHigh = 2048, kScales = 3072, kScale = 3328;
  Q6_KRows group(int64_t) const { return *this; }   // what group g reads besides its bytes: nothing
};

// The GGUF block types with an interleaved layout (lmport.weights.interleaved.SEGMENTS).
inline const std::vector<std::string>& type_names() {
  static const std::vector<std::string> names{"q5_0", "q4_k", "q6_k"};
  return names;
}

// Whether this build has the kernels that read interleaved rows (AVX-512 VNNI's).
#ifdef LMPORT_QUANT_AVX512
constexpr bool kKernels = true;
#else
constexpr bool kKernels = false;
#endif

// Row r's units of a segment of ``length`` bytes (UNIT bytes each) from its vectors ``c``, to ``out``.
template <int UNIT>
inline void unpack_units(const uint8_t* c, int r, int length, uint8_t* out) {
  for (int k = 0; k < length / UNIT; ++k) std::memcpy(out + k * UNIT, c + (k * kGroup + r) * UNIT, UNIT);
}

// Row r's block as the file lays it out (L::kBytes) from its group's block ``c``.
template <class L>
inline void unpack(const uint8_t* c, int r, uint8_t* out) {
  for (const Segment& s : L::kSegments) {
    uint8_t* o = out + s.start;
    switch (s.unit) {
      case 0:   // unit k is bits 4 r .. 4 r + 3 of vector k (8 bytes): two a byte
        for (int k = 0; k < 2 * s.length; k += 2) {
          uint64_t even, odd;
          std::memcpy(&even, c + 8 * k, 8);
          std::memcpy(&odd, c + 8 * k + 8, 8);
          o[k / 2] = static_cast<uint8_t>(((even >> (4 * r)) & 0xF) | ((odd >> (4 * r)) & 0xF) << 4);
        }
        break;
      case 1: unpack_units<1>(c, r, s.length, o); break;
      case 2: unpack_units<2>(c, r, s.length, o); break;
      default: unpack_units<4>(c, r, s.length, o); break;
    }
    c += kGroup * s.length;
  }
}

// Row n of a weight of N rows whose whole groups are interleaved (the rows after them as the file lays
// them out), in the file's layout: unpacked into ``scratch`` (row_bytes) where interleaved.
template <class L>
inline const uint8_t* file_row(const uint8_t* w, int64_t N, int64_t row_bytes, int64_t n, uint8_t* scratch) {
  if (n >= N / kGroup * kGroup) return w + n * row_bytes;
  const uint8_t* group = w + n / kGroup * kGroup * row_bytes;
  for (int64_t i = 0; i < row_bytes / L::kBytes; ++i)
    unpack<L>(group + i * kGroup * L::kBytes, static_cast<int>(n % kGroup), scratch + i * L::kBytes);
  return scratch;
}

#ifdef LMPORT_QUANT_AVX512
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

inline void prefetch(const uint8_t* next, int64_t bytes) {
  if (next != nullptr)
    for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(next + line), _MM_HINT_T1);
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

template <int MT>
inline void dot_group(Q5_0Rows, const uint8_t* group, int64_t blocks, const BlockCodes* const* x, const uint8_t* next,
                      __m512* out) {
  constexpr int64_t kBlock = kGroup * Q5_0Rows::kBytes;
  const __m512i low4 = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
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
      const __m512i v = _mm512_loadu_si512(c + Q5_0Rows::kNibbles + 64 * j);
      uint64_t first, second;
      std::memcpy(&first, c + Q5_0Rows::kMasks + 8 * j, 8);
      std::memcpy(&second, c + Q5_0Rows::kMasks + 8 * (4 + j), 8);
      __m512i low = _mm512_and_si512(v, low4), high = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      low = _mm512_mask_add_epi8(low, _cvtu64_mask64(first), low, sixteen);
      high = _mm512_mask_add_epi8(high, _cvtu64_mask64(second), high, sixteen);
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

template <int MT>
inline void dot_group(Q4_KRows, const uint8_t* group, int64_t blocks, const BlockCodes* const* x, const uint8_t* next,
                      __m512* out) {
  constexpr int64_t kBlock = kGroup * Q4_KRows::kBytes;
  const __m512i low4 = _mm512_set1_epi8(0x0F), low6 = _mm512_set1_epi32(63);
  __m512 acc[MT], mins[MT];
  for (int m = 0; m < MT; ++m) acc[m] = mins[m] = _mm512_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* c = group + i * kBlock;
    prefetch(next ? next + i * kBlock : nullptr, kBlock);
    // The 8 sub-blocks' 6-bit scales and mins from the 12 scale bytes, as llama.cpp's get_scale_min_k4.
    const auto byte = [&](int q) {
      return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + Q4_KRows::kScales + 16 * q)));
    };
    __m512 sc[8], mn[8];
    for (int q = 0; q < 4; ++q) {
      const __m512i a = byte(q), b = byte(q + 4), e = byte(q + 8);
      sc[q] = _mm512_cvtepi32_ps(_mm512_and_si512(a, low6));
      mn[q] = _mm512_cvtepi32_ps(_mm512_and_si512(b, low6));
      sc[q + 4] = _mm512_cvtepi32_ps(_mm512_or_si512(_mm512_and_si512(e, _mm512_set1_epi32(0xF)),
                                                     _mm512_slli_epi32(_mm512_srli_epi32(a, 6), 4)));
      mn[q + 4] = _mm512_cvtepi32_ps(_mm512_or_si512(_mm512_srli_epi32(e, 4), _mm512_slli_epi32(_mm512_srli_epi32(b, 6), 4)));
    }
    __m512 block[MT], block_mins[MT];
    for (int m = 0; m < MT; ++m) block[m] = block_mins[m] = _mm512_setzero_ps();
    for (int q = 0; q < 4; ++q) {   // sub-blocks 2 q (low nibbles of qs bytes 32 q ..) and 2 q + 1 (high)
      __m512i hi[2][MT], lo[2][MT];
      clear(hi, lo);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m512i v = _mm512_loadu_si512(c + Q4_KRows::kNibbles + 64 * (8 * q + j));
        const int64_t k = 256 * i + 64 * q + 4 * j;
        dot4<MT>(_mm512_and_si512(v, low4), x, k, hi[0], lo[0]);
        dot4<MT>(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), x, k + 32, hi[1], lo[1]);
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
    const __m512 d = halves(c), dmin = halves(c + Q4_KRows::kMin);
    for (int m = 0; m < MT; ++m) {
      acc[m] = _mm512_fmadd_ps(block[m], d, acc[m]);
      mins[m] = _mm512_fmadd_ps(block_mins[m], dmin, mins[m]);
    }
  }
  for (int m = 0; m < MT; ++m) out[m] = _mm512_sub_ps(acc[m], mins[m]);
}

template <int MT>
inline void dot_group(Q6_KRows, const uint8_t* group, int64_t blocks, const BlockCodes* const* x, const uint8_t* next,
                      __m512* out) {
  constexpr int64_t kBlock = kGroup * Q6_KRows::kBytes;
  const __m512i low4 = _mm512_set1_epi8(0x0F), high2 = _mm512_set1_epi8(0x30);
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
          const __m512i q0 = _mm512_loadu_si512(c + 64 * (16 * h + j)), q1 = _mm512_loadu_si512(c + 64 * (16 * h + 8 + j));
          const __m512i qh = _mm512_loadu_si512(c + Q6_KRows::kHigh + 64 * (8 * h + j));
          const __m512i codes[4] = {
              _mm512_or_si512(_mm512_and_si512(q0, low4), _mm512_and_si512(_mm512_slli_epi16(qh, 4), high2)),
              _mm512_or_si512(_mm512_and_si512(q1, low4), _mm512_and_si512(_mm512_slli_epi16(qh, 2), high2)),
              _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q0, 4), low4), _mm512_and_si512(qh, high2)),
              _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q1, 4), low4), _mm512_and_si512(_mm512_srli_epi16(qh, 2), high2))};
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

// lmport's int4 / int8 format (lmport.weights.format), each tensor interleaved over its whole row: a group
// of 16 rows' codes (``q``: vector k, lane r, is row r's bytes 4 k .. 4 k + 3), scales and mins (``scales``,
// ``mins``: vector g is the 16 rows' group g; mins null where all are zero); w = scale q + min per group of
// ``group_size`` inputs. int4 codes are 0..15, a run's 16 bytes holding inputs j (low nibble) and j + 16;
// int8 codes are signed, taken as q + 128 (less 128 times x's codes summed).
template <int BITS>
struct QuantRows {
  const at::Half *scales, *mins;
  int64_t K, group_size;
  QuantRows group(int64_t g) const {   // group g's scales and mins
    const int64_t at = kGroup * (K / group_size) * g;
    return {scales + at, mins ? mins + at : nullptr, K, group_size};
  }
};

template <int MT, int BITS>
inline void dot_group(QuantRows<BITS> w, const uint8_t* q, int64_t, const BlockCodes* const* x, const uint8_t* next,
                      __m512* out) {
  constexpr int kVectors = BITS == 4 ? 4 : 8;   // 64-byte vectors of codes a run of 32 inputs
  const __m512i low4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t runs_per_group = w.group_size / 32;
  __m512 acc[MT], acc_mins[MT];
  for (int m = 0; m < MT; ++m) acc[m] = acc_mins[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.K / 32; ++b) {
    const uint8_t* c = q + 64 * kVectors * b;
    prefetch(next ? next + 64 * kVectors * b : nullptr, 64 * kVectors);
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

// Rows of x a kernel takes at once: as many as keep their sums in registers (Q4_K keeps two sub-blocks'
// sums a row, Q6_K four). Five: a speculative verification's step (four proposals and the last token).
template <class L> constexpr int kRowsAtOnce = std::is_same_v<L, Q6_KRows> ? 2 : std::is_same_v<L, Q4_KRows> ? 4 : 5;

// Up to MT rows of x (``n`` left) through the kernel that takes as many at once as there are: how many it took.
template <int MT, class L>
inline int64_t dot_rows(L at, const uint8_t* group, int64_t blocks, const BlockCodes* const* x, int64_t n,
                        const uint8_t* next, __m512* out) {
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
      const __m512 b = bias ? _mm512_loadu_ps(bias + kGroup * g) : _mm512_setzero_ps();
      __m512 out[kAtOnce];
      for (int64_t m = first; m < last;) {
        const uint8_t* next = m == first && g + 1 < end ? group + group_bytes : nullptr;
        const int64_t done = dot_rows<kAtOnce>(at, group, blocks, x + m, last - m, next, out);
        for (int64_t r = 0; r < done; ++r)
          _mm512_storeu_ps(y + (m + r) * y_stride + kGroup * g, _mm512_add_ps(out[r], b));
        m += done;
      }
    }
  }
}

// y [M, N] (rows ``y_stride`` apart) = x W^T (+ bias) over the whole groups of W (``groups`` of them): the
// threads share the groups (groups_range).
template <class L>
inline void linear_groups(L layout, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t groups,
                          int64_t group_bytes, int64_t blocks, const float* bias, float* y, int64_t y_stride) {
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
