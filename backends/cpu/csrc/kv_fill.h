// Writes a step's new K and V rows into the paged float32 cache (bshd: [blocks, block_size,
// kv_heads, head_dim]) at their slots: one call instead of the reference's views and two index
// copies, which at batch 1 cost more in dispatch than the copy itself.
#pragma once

#include <torch/extension.h>

#include <cstring>

namespace lmport {

inline void fill_kv_cache(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                          torch::Tensor slot_mapping) {
  TORCH_CHECK(k.scalar_type() == torch::kFloat && v.scalar_type() == torch::kFloat &&
                  k_cache.scalar_type() == torch::kFloat && v_cache.scalar_type() == torch::kFloat,
              "fill_kv_cache takes float32 k, v and caches");
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
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < slots, "fill_kv_cache: slot ", sp[t], " of token ", t, " is outside the ",
                slots, " slots of the cache");
  const auto kc = k.contiguous(), vc = v.contiguous();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  float* kd = k_cache.data_ptr<float>();
  float* vd = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(kd + sp[t] * row, kp + t * row, row * sizeof(float));
    std::memcpy(vd + sp[t] * row, vp + t * row, row * sizeof(float));
  }
}

}  // namespace lmport
