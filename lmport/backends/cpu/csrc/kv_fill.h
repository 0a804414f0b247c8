// Writes a step's new K and V rows into the paged float32 or float16 cache (bshd: [blocks, block_size,
// kv_heads, head_dim]) at their slots: one call instead of the reference's views and two index
// copies, which at batch 1 cost more in dispatch than the copy itself.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "vec8.h"

namespace lmport {

// Every token's slot (``slot``, T of them) within the cache's ``slots``; ``op`` names the caller in the error.
inline void check_slots(const char* op, const int64_t* slot, int64_t T, int64_t slots) {
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, op, ": slot ", slot[t], " of token ", t, " is outside the ", slots,
                " slots of the cache");
}

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

inline void fill_kv_cache(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                          torch::Tensor slot_mapping) {
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(k.scalar_type() == torch::kFloat && v.scalar_type() == torch::kFloat &&
                  (dtype == torch::kFloat || dtype == torch::kHalf) && v_cache.scalar_type() == dtype,
              "fill_kv_cache takes float32 k and v, and float32 or float16 caches alike");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes(),
              "fill_kv_cache: the caches are contiguous [blocks, block_size, kv_heads, head_dim] alike; got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t T = slot_mapping.numel(), row = k_cache.size(2) * k_cache.size(3);
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(k.dim() == 3 && k.size(0) == T && k.size(1) * k.size(2) == row && v.sizes() == k.sizes(),
              "fill_kv_cache: k and v are [", T, " tokens, kv_heads, head_dim] matching the cache; got ", k.sizes(),
              " and ", v.sizes());
  const auto slot = slot_mapping.to(torch::kLong).contiguous();
  const int64_t* sp = slot.data_ptr<int64_t>();
  check_slots("fill_kv_cache", sp, T, slots);
  const auto kc = k.contiguous(), vc = v.contiguous();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  const auto fill = [&](auto* kd, auto* vd) {
    for (int64_t t = 0; t < T; ++t) fill_kv_row(kp + t * row, vp + t * row, kd, vd, row, sp[t]);
  };
  if (dtype == torch::kHalf)
    fill(static_cast<uint16_t*>(k_cache.data_ptr()), static_cast<uint16_t*>(v_cache.data_ptr()));
  else
    fill(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
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

// The same for a pool of 8- or 4-bit codes ([blocks, block_size, kv_heads, head_dim * bits / 8] uint8) and
// its params ([blocks, block_size, kv_heads, 2] float32): each new row quantized as the reference does.
inline void fill_kv_cache_codes(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                                torch::Tensor k_params, torch::Tensor v_params, int64_t bits,
                                torch::Tensor slot_mapping) {
  TORCH_CHECK(bits == 8 || bits == 4, "fill_kv_cache_codes takes 8- or 4-bit codes, got ", bits);
  TORCH_CHECK(k.scalar_type() == torch::kFloat && v.scalar_type() == torch::kFloat &&
                  k_cache.scalar_type() == torch::kByte && v_cache.scalar_type() == torch::kByte &&
                  k_params.scalar_type() == torch::kFloat && v_params.scalar_type() == torch::kFloat,
              "fill_kv_cache_codes takes float32 k, v and params and uint8 caches");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_params.is_contiguous() &&
                  v_params.is_contiguous() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  k_params.dim() == 4 && k_params.size(3) == 2 && v_params.sizes() == k_params.sizes() &&
                  k_params.size(0) * k_params.size(1) * k_params.size(2) ==
                      k_cache.size(0) * k_cache.size(1) * k_cache.size(2),
              "fill_kv_cache_codes: the caches are contiguous [blocks, block_size, kv_heads, head_dim * bits / 8] "
              "and their params [blocks, block_size, kv_heads, 2]; got ", k_cache.sizes(), ", ", v_cache.sizes(),
              ", ", k_params.sizes(), " and ", v_params.sizes());
  const int64_t T = slot_mapping.numel(), H = k_cache.size(2), stored = k_cache.size(3);
  const int64_t D = stored * 8 / bits, slots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(k.dim() == 3 && k.size(0) == T && k.size(1) == H && k.size(2) == D && v.sizes() == k.sizes(),
              "fill_kv_cache_codes: k and v are [", T, " tokens, ", H, " kv_heads, ", D, "]; got ", k.sizes(),
              " and ", v.sizes());
  const auto slot = slot_mapping.to(torch::kLong).contiguous();
  const int64_t* sp = slot.data_ptr<int64_t>();
  check_slots("fill_kv_cache_codes", sp, T, slots);
  const auto kc = k.contiguous(), vc = v.contiguous();
  for (auto [x, cache, params] : {std::tuple{kc.data_ptr<float>(), k_cache.data_ptr<uint8_t>(), k_params.data_ptr<float>()},
                                  std::tuple{vc.data_ptr<float>(), v_cache.data_ptr<uint8_t>(), v_params.data_ptr<float>()}})
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        quantize_row(x + (t * H + h) * D, D, static_cast<int>(bits), cache + (sp[t] * H + h) * stored,
                     params + (sp[t] * H + h) * 2);
}

}  // namespace lmport
