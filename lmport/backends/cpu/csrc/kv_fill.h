// Writes a step's new K and V rows into the paged float32 or float16 cache (bshd: [blocks, block_size,
// kv_heads, head_dim]) at their slots: one call instead of the reference's views and two index
// copies, which at batch 1 cost more in dispatch than the copy itself.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "isa/vec8.h"

namespace lmport {

// Token rows k and v (``row`` floats each) into the float32 caches' slot ``slot``.
inline void fill_kv_row(const float* k, const float* v, float* k_cache, float* v_cache, int64_t row, int64_t slot) {
  std::memcpy(k_cache + slot * row, k, row * sizeof(float));
  std::memcpy(v_cache + slot * row, v, row * sizeof(float));
}

// ``n`` floats as float16 (their bits), rounded to nearest even as torch's .half() rounds them.
inline void to_halves(const float* x, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store_half(out + i, load(x + i));
  for (; i < n; ++i) {
    const _Float16 h = static_cast<_Float16>(x[i]);
    std::memcpy(out + i, &h, sizeof(h));
  }
}

// The same into float16 caches.
inline void fill_kv_row(const float* k, const float* v, uint16_t* k_cache, uint16_t* v_cache, int64_t row,
                        int64_t slot) {
  to_halves(k, k_cache + slot * row, row);
  to_halves(v, v_cache + slot * row, row);
}

// One (token, KV head) row of D floats as lmport.kv.quant.quantize computes it, step for step (the same
// IEEE divisions, round-half-to-even, clamps), so the codes and params are its bits: ``bits`` 8 or 4
// (two codes a byte, element 2i in the low nibble), params scale and zero as float32.
inline void quantize_row(const float* x, int64_t D, int bits, uint8_t* codes, float* params) {
  const int levels = (1 << bits) - 1;
  constexpr int kZeroLimit = 2047;   // lmport.kv.quant.ZERO_LIMIT
  const float lo = *std::min_element(x, x + D), hi = *std::max_element(x, x + D);
  const float eps = static_cast<float>(static_cast<double>(FLT_MIN) * levels);
  float scale = std::max(std::max(hi - lo, eps) / static_cast<float>(levels), std::fabs(lo) / kZeroLimit);
  scale = std::min(scale * (1.f + 0x1p-9f), FLT_MAX);   // rounded up, so the range still fits the levels
  const float zero = std::clamp(std::nearbyint(-lo / scale), -float(kZeroLimit), float(kZeroLimit));
  const auto code = [&](float v) {
    return static_cast<uint8_t>(std::clamp(std::nearbyint(v / scale) + zero, 0.f, static_cast<float>(levels)));
  };
  if (bits == 8)
    for (int64_t d = 0; d < D; ++d) codes[d] = code(x[d]);
  else
    for (int64_t d = 0; d < D; d += 2) codes[d / 2] = code(x[d]) | code(x[d + 1]) << 4;
  params[0] = scale, params[1] = zero;
}

}  // namespace lmport
