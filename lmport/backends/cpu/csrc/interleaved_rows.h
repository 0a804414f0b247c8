// GGUF blocks with output rows interleaved in groups of 16 (lmport.weights.interleaved lays them out and
// documents the layout): vector lane r is row r, so a block's codes of 16 rows meet x's codes for those
// inputs broadcast to every lane, the 16 rows' scales are one load and their results one store.
//
// Every row of x of a step, a decode step's or a prefill's (each row on its own, while the group's bytes
// stay in L1; a prefill's a chunk of rows at a time whose codes stay in L2). With AVX-512 VNNI, x held as
// two int8 codes per input as int8_rows.h holds it (hi and lo, as fine as int16): vpdpbusd over the rows'
// unsigned codes and hi, and again over lo, gives each lane's exact int32 sums 256 hi + lo per sub-block.
// On the AVX2 path, x rounded to int16 as its row-by-row kernels round it, a group's rows taken as two
// halves of 8: the codes widened to int16 and vpmaddwd gives the exact int32 sums (see its kernels). Either
// way a type whose codes are offset (Q5_0's q + 16, Q6_K's q + 32, int8's q + 128) takes the offset times
// x's codes summed back off. The sums are scaled in float32 by the rows' scales times x's step; Q4_K's mins
// meet the float sums of x. The dequantize kernels (an embedding lookup in a tied LM head's table) read a
// row back in the file's layout (file_row).
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

// Whether this build has the kernels that read interleaved rows: AVX-512 VNNI's, or AVX2's (with FMA and F16C).
#if defined(LMPORT_QUANT_AVX512)
#define LMPORT_INTERLEAVED 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LMPORT_INTERLEAVED 1
#define LMPORT_INTERLEAVED_AVX2 1
#endif
#ifdef LMPORT_INTERLEAVED
constexpr bool kKernels = true;
#else
constexpr bool kKernels = false;
#endif

// Whether a prefill's rows (more than a decode step's) are best run by these kernels rather than by the weight
// expanded to float32 for a GEMM: with AVX-512 VNNI (vpdpbusd, 64 products an instruction, the codes as they
// are), not on the AVX2 path (vpmaddwd, 16, the codes widened first), where the GEMM is faster.
#ifdef LMPORT_QUANT_AVX512
constexpr bool kPrefill = true;
#else
constexpr bool kPrefill = false;
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

// The next group's block, fetched into L2 while this one is worked on (none: ``next`` null). Not for int8
// codes with AVX-512: that kernel does the least work a byte, the hardware prefetchers keep ahead of it
// alone, and the prefetches only cost it load slots (docs/weight-quantization.md, "Prefetching int8 codes").
inline void prefetch(const uint8_t* next, int64_t bytes) {
  if (next != nullptr)
    for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(next + line), _MM_HINT_T1);
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

template <int MT>
inline void dot_group(Q5_0Rows, const uint8_t* group, int64_t blocks, const BlockCodes* const* x, const uint8_t* next,
                      Lanes* out) {
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
                      Lanes* out) {
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
                      Lanes* out) {
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

// Rows of x a kernel takes at once: as many as keep their sums in registers (Q4_K keeps two sub-blocks'
// sums a row, Q6_K four). Five: a speculative verification's step (four proposals and the last token).
template <class L> constexpr int kRowsAtOnce = std::is_same_v<L, Q6_KRows> ? 2 : std::is_same_v<L, Q4_KRows> ? 4 : 5;
#elif defined(LMPORT_INTERLEAVED_AVX2)
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
    prefetch(next ? next + i * kBlock : nullptr, kBlock);
    for (int h = 0; h < 2; ++h) {
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

template <int MT>
inline void dot_group(Q4_KRows, const uint8_t* group, int64_t blocks, const BlockCodes* const* x, const uint8_t* next,
                      Lanes* out) {
  constexpr int64_t kBlock = kGroup * Q4_KRows::kBytes;
  const __m256i low4 = _mm256_set1_epi8(0x0F), low6 = _mm256_set1_epi32(63);
  __m256 acc[2][MT], mins[2][MT];
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < MT; ++m) acc[h][m] = mins[h][m] = _mm256_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* c = group + i * kBlock;
    prefetch(next ? next + i * kBlock : nullptr, kBlock);
    for (int h = 0; h < 2; ++h) {
      // Sub-block s's 6-bit scale and min from the 12 scale bytes, as llama.cpp's get_scale_min_k4.
      const auto byte = [&](int q) { return bytes_u(c + Q4_KRows::kScales + 16 * q + 8 * h); };
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
        Sums s[2][MT];
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          const __m256i v = load8(c + Q4_KRows::kNibbles + 64 * (8 * q + j) + 32 * h);
          const int64_t k = 256 * i + 64 * q + 4 * j;
          dot4<MT>(widen(_mm256_and_si256(v, low4)), x, k, s[0]);
          dot4<MT>(widen(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4)), x, k + 32, s[1]);
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
      const __m256 d = halves(c + 16 * h), dmin = halves(c + Q4_KRows::kMin + 16 * h);
      for (int m = 0; m < MT; ++m) {
        acc[h][m] = _mm256_fmadd_ps(block[m], d, acc[h][m]);
        mins[h][m] = _mm256_fmadd_ps(block_mins[m], dmin, mins[h][m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    out[m] = {{_mm256_sub_ps(acc[0][m], mins[0][m]), _mm256_sub_ps(acc[1][m], mins[1][m])}};
}

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
    prefetch(next ? next + i * kBlock : nullptr, kBlock);
    for (int h = 0; h < 2; ++h) {
      __m256 block[MT];
      for (auto& b : block) b = _mm256_setzero_ps();
      for (int top = 0; top < 2; ++top)
        for (int half = 0; half < 2; ++half)   // inputs 128 top + 32 t + 16 half + .., sub-block 8 top + 2 t + half
          for (int u = 0; u < 2; ++u) {   // t = u (ql's low nibbles) and u + 2 (high): ql vectors 16 top + 8 u + j
          Sums s[2][MT];
#pragma GCC unroll 4
          for (int j = 4 * half; j < 4 * half + 4; ++j) {
            const __m256i q = load8(c + 64 * (16 * top + 8 * u + j) + 32 * h);
            const __m256i qh = load8(c + Q6_KRows::kHigh + 64 * (8 * top + j) + 32 * h);
            // qh's bits 2 t, 2 t + 1 to bits 4, 5
            const __m256i high_low = u ? _mm256_slli_epi16(qh, 2) : _mm256_slli_epi16(qh, 4);
            const __m256i high_high = u ? _mm256_srli_epi16(qh, 2) : qh;
            const int64_t k = 256 * i + 128 * top + 32 * u + 4 * j;
            dot4<MT>(widen(_mm256_or_si256(_mm256_and_si256(q, low4), _mm256_and_si256(high_low, high2))), x, k, s[0]);
            dot4<MT>(widen(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), low4),
                                           _mm256_and_si256(high_high, high2))), x, k + 64, s[1]);
          }
          for (int v = 0; v < 2; ++v) {
            const int t = u + 2 * v, sub = 8 * top + 2 * t + half;
            const __m256 sc = _mm256_cvtepi32_ps(bytes_s(c + Q6_KRows::kScales + 16 * sub + 8 * h));
            for (int m = 0; m < MT; ++m)
              block[m] = _mm256_fmadd_ps(floats(s[v][m], 32 * x[m]->code_sums[16 * i + sub]),
                                         _mm256_mul_ps(sc, _mm256_set1_ps(x[m]->steps[8 * i + 4 * top + t])), block[m]);
          }
        }
      const __m256 d = halves(c + Q6_KRows::kScale + 16 * h);
      for (int m = 0; m < MT; ++m) acc[h][m] = _mm256_fmadd_ps(block[m], d, acc[h][m]);
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
    prefetch(next ? next + 64 * kVectors * b : nullptr, 64 * kVectors);
    const int64_t g = b / runs_per_group;
    for (int h = 0; h < 2; ++h) {
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
template <class L> constexpr int kRowsAtOnce = std::is_same_v<L, Q6_KRows> ? 1 : std::is_same_v<L, Q4_KRows> ? 2 : 3;
#endif

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
