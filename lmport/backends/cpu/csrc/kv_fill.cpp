// Writing a step's new K and V rows into the paged cache (kv_fill.h).
#include <tuple>

#include "kernels.h"
#include "kv_fill.h"

namespace lmport {
namespace kernels {

void fill_kv_cache(const float* kp, const float* vp, void* k_cache, void* v_cache, bool half, int64_t T, int64_t row,
                   const int64_t* sp) {
  const auto fill = [&](auto* kd, auto* vd) {
    for (int64_t t = 0; t < T; ++t) fill_kv_row(kp + t * row, vp + t * row, kd, vd, row, sp[t]);
  };
  if (half)
    fill(static_cast<uint16_t*>(k_cache), static_cast<uint16_t*>(v_cache));
  else
    fill(static_cast<float*>(k_cache), static_cast<float*>(v_cache));
}

void fill_kv_cache_codes(const float* k, const float* v, uint8_t* k_cache, uint8_t* v_cache, float* k_params,
                         float* v_params, int64_t bits, int64_t T, int64_t H, int64_t D, const int64_t* sp) {
  const int64_t stored = D * bits / 8;
  for (auto [x, cache, params] : {std::tuple{k, k_cache, k_params}, std::tuple{v, v_cache, v_params}})
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        quantize_row(x + (t * H + h) * D, D, static_cast<int>(bits), cache + (sp[t] * H + h) * stored,
                     params + (sp[t] * H + h) * 2);
}

}  // namespace kernels
}  // namespace lmport
