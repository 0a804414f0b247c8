// Paged attention over a float32 or float16 block pool, or one of 8- or 4-bit codes (paged_attention.h).
#include <ATen/Parallel.h>

#include "kernels.h"
#include "paged_attention.h"

namespace lmport {
namespace kernels {

namespace {

template <int kBits>
void attention_over(const float* qp, int64_t T, int64_t Hq, int64_t D, const Pool<kBits>& pool, const StepTables& step,
                    double scale, int64_t window, int64_t chunk, double softcap, const float* sinks, float* op) {
  AttentionWork work(step.tables, step.starts, step.lens, step.sequences, step.width, T, Hq, D, at::get_num_threads());
  at::parallel_for(0, work.workers, 1, [&](int64_t first_worker, int64_t last_worker) {
    Scratch scratch;
    for (int64_t w = first_worker; w < last_worker; ++w)
      attend_items(work, w, qp, Hq * D, pool, op, scale, window, softcap, scratch, chunk, sinks);
  });
  merge_parts(work, op, sinks);
}

}  // namespace

void paged_attention(const float* q, int64_t T, int64_t Hq, int64_t D, const AttentionPool& p, const StepTables& step,
                     double scale, int64_t window, int64_t chunk, double softcap, const float* sinks, float* out) {
  const auto over = [&](auto pool) {
    attention_over(q, T, Hq, D, pool, step, scale, window, chunk, softcap, sinks, out);
  };
  switch (p.bits) {
    case 32: return over(Pool<32>{p.k, p.v, nullptr, nullptr, p.block_size, p.kv_heads, D});
    case 16: return over(Pool<16>{p.k, p.v, nullptr, nullptr, p.block_size, p.kv_heads, D});
    case 8: return over(Pool<8>{p.k, p.v, p.k_params, p.v_params, p.block_size, p.kv_heads, D, p.k_new, p.v_new});
    default: return over(Pool<4>{p.k, p.v, p.k_params, p.v_params, p.block_size, p.kv_heads, D, p.k_new, p.v_new});
  }
}

}  // namespace kernels
}  // namespace lmport
