// A prefill over rows interleaved in groups of 16 by AMX tiles, where asked for (LMPORT_CPU_PREFILL=bf16;
// interleaved_rows.h picks it for more rows of x than a decode step's): each group's weights expanded once to
// bfloat16, in the tiles' pair layout, meet every row of x rounded to bfloat16; the tiles sum the products in
// float32. The AVX-512 group kernels hold x to 16 bits and the weights exactly; this path trades that for the
// tiles' throughput, as llama.cpp's int8 paths do.
#pragma once

#include <ATen/Parallel.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "../../interleaved_layout.h"
#include "../avx512/interleaved_groups.h"

namespace lmport {
namespace interleaved {
namespace amx {

// Whether this process may use the tiles: Linux hands out their state only on request (once per process).
inline bool ready() {
  constexpr int kRequestPermission = 0x1023, kTileData = 18;   // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  static const bool granted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return granted;
}

// ldtilecfg's operand (palette 1): each tile's rows and bytes a row; a thread loads it before its tile work.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Whether a prefill is to take the tiles (set_bf16_prefill: the user's choice, once per process).
inline bool& asked() {
  static bool on = false;
  return on;
}

inline bool enabled() { return asked() && ready(); }

// A group's expanded weights: pair row p (64 bytes) holds inputs 2 p and 2 p + 1 of the 16 rows, row r's two
// bfloat16 in 32 bits (the B operand of tdpbf16ps); a tile is 16 pair rows, 32 inputs.
using Pairs = std::vector<uint32_t>;

// Inputs k .. k + 3 of the group's 16 rows (``codes``: lane r holds row r's four unsigned codes, input order)
// as scale * code + offset per lane, into their two pair rows.
inline void expand4(__m512i codes, __m512 scale, __m512 offset, int64_t k, uint32_t* pairs) {
  const __m512i byte = _mm512_set1_epi32(0xFF);
  // lanes 2 r and 2 r + 1 of the result: row r's first and second input of the pair
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512 v[4];
  for (int j = 0; j < 4; ++j)
    v[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(codes, 8 * j), byte)), scale, offset);
  for (int p = 0; p < 2; ++p) {
    const __m512i two = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v[2 * p + 1], v[2 * p]));
    _mm512_storeu_si512(pairs + (k / 2 + p) * kGroup, _mm512_permutexvar_epi16(interleave, two));
  }
}

// Each type's codes in the group kernels' order (isa/avx512/interleaved_groups.h reads the same bytes): a group's
// ``blocks`` blocks expanded into ``pairs``.
inline void expand(Q5_0Rows, const uint8_t* group, int64_t blocks, uint32_t* pairs) {
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* c = group + i * kGroup * Q5_0Rows::kBytes;
    const __m512 d = halves(c), offset = _mm512_mul_ps(d, _mm512_set1_ps(-16.f));
    for (int j = 0; j < 4; ++j) {
      __m512i low, high;
      q5_0_codes(c, j, low, high);
      expand4(low, d, offset, 32 * i + 4 * j, pairs);
      expand4(high, d, offset, 32 * i + 16 + 4 * j, pairs);
    }
  }
}

// Q4_K and Q5_K (k_codes gives each one's codes).
template <class L, std::enable_if_t<kLikeQ4_K<L>, int> = 0>
inline void expand(L, const uint8_t* group, int64_t blocks, uint32_t* pairs) {
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* c = group + i * kGroup * L::kBytes;
    const __m512 d = halves(c), dmin = halves(c + L::kMin);
    __m512 sc[8], mn[8], scale[8], offset[8];   // sub-block s: d sc_s and -dmin m_s
    q4_k_scales(c, sc, mn);
    for (int s = 0; s < 8; ++s)
      scale[s] = _mm512_mul_ps(d, sc[s]), offset[s] = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, mn[s]));
    for (int q = 0; q < 4; ++q)   // sub-blocks 2 q (low nibbles of qs bytes 32 q ..) and 2 q + 1 (high)
      for (int j = 0; j < 8; ++j) {
        __m512i low, high;
        k_codes(L{}, c, q, j, low, high);
        const int64_t k = 256 * i + 64 * q + 4 * j;
        expand4(low, scale[2 * q], offset[2 * q], k, pairs);
        expand4(high, scale[2 * q + 1], offset[2 * q + 1], k + 32, pairs);
      }
  }
}

inline void expand(Q6_KRows, const uint8_t* group, int64_t blocks, uint32_t* pairs) {
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* c = group + i * kGroup * Q6_KRows::kBytes;
    const __m512 d = halves(c + Q6_KRows::kScale);
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 8; ++j) {   // bytes 4 j .. of each 32-byte run of ql and of qh
        __m512i codes[4];
        q6_k_codes(c, h, j, codes);
        for (int t = 0; t < 4; ++t) {   // inputs 128 h + 32 t + 4 j .., sub-block 8 h + 2 t + j / 4; codes q + 32
          const int s = 8 * h + 2 * t + j / 4;
          const __m512 scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + Q6_KRows::kScales + 16 * s)))));
          expand4(codes[t], scale, _mm512_mul_ps(scale, _mm512_set1_ps(-32.f)), 256 * i + 128 * h + 32 * t + 4 * j,
                  pairs);
        }
      }
  }
}

template <int BITS>
inline void expand(QuantRows<BITS> w, const uint8_t* q, int64_t, uint32_t* pairs) {
  constexpr int kVectors = BITS == 4 ? 4 : 8;   // 64-byte vectors of codes a run of 32 inputs
  const __m512i low4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t runs_per_group = w.group_size / 32;
  for (int64_t b = 0; b < w.K / 32; ++b) {
    const uint8_t* c = q + 64 * kVectors * b;
    const int64_t g = b / runs_per_group;
    const __m512 scale = halves(reinterpret_cast<const uint8_t*>(w.scales + kGroup * g));
    const __m512 min = w.mins ? halves(reinterpret_cast<const uint8_t*>(w.mins + kGroup * g)) : _mm512_setzero_ps();
    for (int j = 0; j < kVectors; ++j) {
      const __m512i v = _mm512_loadu_si512(c + 64 * j);
      if constexpr (BITS == 4) {   // inputs 4 j .. (low nibbles) and 16 + 4 j .. (high): scale q + min
        expand4(_mm512_and_si512(v, low4), scale, min, 32 * b + 4 * j, pairs);
        expand4(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), scale, min, 32 * b + 16 + 4 * j, pairs);
      } else {   // signed codes taken as q + 128
        expand4(_mm512_xor_si512(v, flip), scale, _mm512_fnmadd_ps(scale, _mm512_set1_ps(128.f), min), 32 * b + 4 * j,
                pairs);
      }
    }
  }
}

// x [M, K] as bfloat16 rows, padded with zero rows to a multiple of 32 (two A tiles a step).
inline std::vector<uint16_t> bf16_rows(const float* x, int64_t M, int64_t K, int64_t padded) {
  std::vector<uint16_t> out(padded * K, 0);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t k = 0; k < K; k += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.data() + m * K + k),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(x + m * K + k))));
  });
  return out;
}

// Eight tiles of 16 rows of 64 bytes: 0-3 the sums (two blocks of x's rows by two groups), 4-5 x, 6-7 weights.
inline TileConfig bf16_config() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.bytes_per_row[t] = 64, c.rows[t] = 16;
  return c;
}

// A sums tile stored to ``scratch`` (16 rows of x by a group's 16 rows) into y's rows first .. (those below M)
// at column ``column``.
inline void store_sums(const float* scratch, int64_t first, int64_t M, float* y, int64_t y_stride, int64_t column,
                       const float* bias) {
  const __m512 b = bias ? _mm512_loadu_ps(bias + column) : _mm512_setzero_ps();
  for (int64_t r = 0; r < std::min<int64_t>(16, M - first); ++r)
    _mm512_storeu_ps(y + (first + r) * y_stride + column, _mm512_add_ps(_mm512_loadu_ps(scratch + 16 * r), b));
}

// Groups g and g + 1 (TWO) or g alone against every row of x (``xb``, padded rows): y's columns of those groups.
template <bool TWO>
inline void group_rows(const uint16_t* xb, int64_t M, int64_t padded, int64_t K, const uint32_t* p0, const uint32_t* p1,
                       int64_t g, const float* bias, float* y, int64_t y_stride) {
  alignas(64) float scratch[16 * 16];
  for (int64_t m = 0; m < padded; m += 32) {
    _tile_zero(0);
    _tile_zero(2);
    if constexpr (TWO) {
      _tile_zero(1);
      _tile_zero(3);
    }
    for (int64_t k = 0; k < K; k += 32) {
      _tile_loadd(4, xb + m * K + k, 2 * K);
      _tile_loadd(5, xb + (m + 16) * K + k, 2 * K);
      _tile_loadd(6, p0 + k / 2 * kGroup, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (TWO) {
        _tile_loadd(7, p1 + k / 2 * kGroup, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    // (the tile intrinsics take their tile numbers as literals)
    _tile_stored(0, scratch, 64);
    store_sums(scratch, m, M, y, y_stride, kGroup * g, bias);
    _tile_stored(2, scratch, 64);
    store_sums(scratch, m + 16, M, y, y_stride, kGroup * g, bias);
    if constexpr (TWO) {
      _tile_stored(1, scratch, 64);
      store_sums(scratch, m, M, y, y_stride, kGroup * (g + 1), bias);
      _tile_stored(3, scratch, 64);
      store_sums(scratch, m + 16, M, y, y_stride, kGroup * (g + 1), bias);
    }
  }
}

// y [M, groups * 16] (rows ``y_stride`` apart) = x W^T (+ bias) over the whole groups of W, as
// interleaved_rows.h's linear_groups: the threads share the groups two at a time.
template <class L>
inline void linear_groups(L layout, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t groups,
                          int64_t group_bytes, int64_t blocks, const float* bias, float* y, int64_t y_stride) {
  const int64_t padded = (M + 31) / 32 * 32;
  const std::vector<uint16_t> xb = bf16_rows(x, M, K, padded);
  at::parallel_for(0, (groups + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    const TileConfig config = bf16_config();
    _tile_loadconfig(&config);
    Pairs p0(K / 2 * kGroup), p1(K / 2 * kGroup);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t g = 2 * pair;
      expand(layout.group(g), w + g * group_bytes, blocks, p0.data());
      if (g + 1 < groups) {
        expand(layout.group(g + 1), w + (g + 1) * group_bytes, blocks, p1.data());
        group_rows<true>(xb.data(), M, padded, K, p0.data(), p1.data(), g, bias, y, y_stride);
      } else {
        group_rows<false>(xb.data(), M, padded, K, p0.data(), nullptr, g, bias, y, y_stride);
      }
    }
    _tile_release();
  });
}

}  // namespace amx
}  // namespace interleaved
}  // namespace lmport
