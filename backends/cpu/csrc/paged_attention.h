// Paged attention for the cpu backend. It reads K/V straight from the block
// pool (no gathered copy); each query token is one work item over all its heads.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "vec8.h"

namespace lmport {

constexpr int64_t kMaxHeadDim = 256;

struct Pool {
  const float* k;
  const float* v;
  int64_t block_size, kv_heads, head_dim;
  int64_t row() const { return kv_heads * head_dim; }  // floats between neighbouring tokens of a block
};

// Query token with heads q[Hq, D] at position n - 1 of a sequence whose blocks are
// ``blocks``: out[Hq, D]. kD is the head dim when known at compile time (then the
// output accumulators live in registers), 0 to read it from the pool.
template <int64_t kD>
void attend(const float* q, float* out, const int64_t* blocks, int64_t n, int64_t q_heads,
            const Pool& pool, float scale, std::vector<float>& scores) {
  const int64_t D = kD ? kD : pool.head_dim, bs = pool.block_size, row = pool.row();
  const int64_t group = q_heads / pool.kv_heads;
  scores.resize(q_heads * n);

  // Scores: each K row (every kv head) is read once, in block order.
  for (int64_t j0 = 0; j0 < n; j0 += bs) {
    const float* kb = pool.k + blocks[j0 / bs] * bs * row;
    for (int64_t j = j0; j < std::min(n, j0 + bs); ++j) {
      const float* kj = kb + (j - j0) * row;
      for (int64_t h = 0; h < q_heads; ++h) {
        const float* qh = q + h * D;
        const float* kh = kj + h / group * D;
        vec8 acc = load(qh) * load(kh);
        for (int64_t d = 8; d < D; d += 8) acc += load(qh + d) * load(kh + d);
        scores[h * n + j] = sum(acc) * scale;
      }
    }
  }
  // Softmax, then V per head so its accumulators stay in registers across keys.
  for (int64_t h = 0; h < q_heads; ++h) {
    float* s = scores.data() + h * n;
    const float m = *std::max_element(s, s + n);
    float total = 0.f;
    for (int64_t j = 0; j < n; ++j) total += (s[j] = std::exp(s[j] - m));
    const float inv = 1.f / total;

    vec8 acc[(kD ? kD : kMaxHeadDim) / 8] = {};
    const int64_t offset = h / group * D;
    for (int64_t j0 = 0; j0 < n; j0 += bs) {
      const float* vb = pool.v + blocks[j0 / bs] * bs * row + offset;
      for (int64_t j = j0; j < std::min(n, j0 + bs); ++j) {
        const float* vj = vb + (j - j0) * row;
        const float p = s[j];
        for (int64_t i = 0; i < D / 8; ++i) acc[i] += p * load(vj + 8 * i);
      }
    }
    for (int64_t i = 0; i < D / 8; ++i) store(out + h * D + 8 * i, acc[i] * inv);
  }
}

// q [T, Hq, D]; k_cache, v_cache [blocks, block_size, Hkv, D]; block_tables [B, max_blocks];
// q_start_loc [B + 1]; kv_lens [B]. Token t of sequence b sits at position
// kv_lens[b] - q_len + (t - q_start_loc[b]) and attends to positions <= that.
inline torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor q_start_loc,
                              torch::Tensor kv_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kFloat &&
              v_cache.scalar_type() == torch::kFloat, "paged_attention takes float32 q and caches");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention takes contiguous q and caches");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const Pool pool{k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), k_cache.size(1), k_cache.size(2), D};
  TORCH_CHECK(D % 8 == 0 && D <= kMaxHeadDim && Hq % pool.kv_heads == 0,
              "paged_attention needs head_dim % 8 == 0, head_dim <= 256 and whole GQA groups");
  auto tables = block_tables.to(torch::kLong).contiguous();
  auto starts = q_start_loc.to(torch::kLong).contiguous();
  auto lens = kv_lens.to(torch::kLong).contiguous();
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* kl = lens.data_ptr<int64_t>();
  const int64_t width = tables.size(1), B = lens.size(0);

  std::vector<int64_t> seq_of(T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = st[b]; t < st[b + 1]; ++t) seq_of[t] = b;

  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const auto run = D == 64 ? attend<64> : D == 128 ? attend<128> : attend<0>;

  // Tokens go round-robin to the workers, so prefill rows, whose cost grows
  // with position, are shared evenly.
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), T);
  at::parallel_for(0, workers, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores;
    for (int64_t w = first; w < last; ++w)
      for (int64_t t = w; t < T; t += workers) {
        const int64_t b = seq_of[t];
        const int64_t n = kl[b] - (st[b + 1] - t) + 1;  // keys visible to token t
        run(qp + t * Hq * D, op + t * Hq * D, tab + b * width, n, Hq, pool, static_cast<float>(scale), scores);
      }
  });
  return out;
}

}  // namespace lmport
