// The gated delta rule token by token (Gated DeltaNet's decode; lmport.ops.gated_delta_net states the rule): each
// value head's state matrix [Dk, Dv] read twice a token (what it predicts for k, then its update and the output),
// in cache and in its row of the state pool, instead of the reference's passes over the whole batch's state with a
// temporary each and the rows gathered and written back around them.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels.h"

namespace lmport {
namespace kernels {

void recurrent_gated_delta_rule(const float* q, const float* k, const float* v, const float* g, const float* beta,
                                float* states, const int64_t* rows, int64_t B, int64_t H, int64_t T, int64_t Dk,
                                int64_t Dv, float* out) {
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    float predicted[kMaxStateColumns], delta[kMaxStateColumns], o[kMaxStateColumns];
    for (int64_t head = begin; head < end; ++head) {
      float* s = states + (rows[head / H] * H + head % H) * Dk * Dv;   // updated where it lies
      for (int64_t t = 0; t < T; ++t) {
        const int64_t token = head * T + t;
        const float* kt = k + token * Dk;
        const float* qt = q + token * Dk;
        const float* vt = v + token * Dv;
        const float decay = std::exp(g[token]), b = beta[token];
        // What the decayed state predicts for k: sum_i decay S[i] k[i].
        std::fill(predicted, predicted + Dv, 0.0f);
        for (int64_t i = 0; i < Dk; ++i) {
          const float* row = s + i * Dv;
          const float ki = kt[i];
#pragma omp simd
          for (int64_t j = 0; j < Dv; ++j) predicted[j] += row[j] * decay * ki;
        }
#pragma omp simd
        for (int64_t j = 0; j < Dv; ++j) delta[j] = (vt[j] - predicted[j]) * b;
        // S = decay S + k delta^T, and o = S^T q from the updated rows.
        std::fill(o, o + Dv, 0.0f);
        for (int64_t i = 0; i < Dk; ++i) {
          float* row = s + i * Dv;
          const float ki = kt[i], qi = qt[i];
#pragma omp simd
          for (int64_t j = 0; j < Dv; ++j) {
            row[j] = row[j] * decay + ki * delta[j];
            o[j] += row[j] * qi;
          }
        }
        std::memcpy(out + token * Dv, o, sizeof(float) * Dv);
      }
    }
  });
}

}  // namespace kernels
}  // namespace lmport
