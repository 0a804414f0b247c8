// Paged attention for the cpu backend. It reads K/V straight from the block
// pool (no gathered copy), one query token at a time over all its heads, so
// each cached row is read once, in order.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// Eight floats in one SIMD register (AVX on x86, two NEON registers on arm); head_dim % 8 == 0.
// The aligned(4) twin lets loads and stores touch rows that are only float-aligned.
typedef float vec8 __attribute__((vector_size(32)));
typedef float vec8_unaligned __attribute__((vector_size(32), aligned(4)));

inline vec8 load(const float* p) { return *reinterpret_cast<const vec8_unaligned*>(p); }

inline void store(float* p, vec8 v) { *reinterpret_cast<vec8_unaligned*>(p) = v; }

inline float sum(vec8 v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

inline float dot(const float* a, const float* b, int64_t n) {
  vec8 acc = load(a) * load(b);
  for (int64_t i = 8; i < n; i += 8) acc += load(a + i) * load(b + i);
  return sum(acc);
}

inline void axpy(float* y, float alpha, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) store(y + i, load(y + i) + alpha * load(x + i));
}

}  // namespace

// q [T, Hq, D]; k_cache, v_cache [blocks, block_size, Hkv, D]; block_tables [B, max_blocks];
// q_start_loc [B + 1]; kv_lens [B]. Token t of sequence b sits at position
// kv_lens[b] - q_len + (t - q_start_loc[b]) and attends to positions <= that.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor q_start_loc,
                              torch::Tensor kv_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kFloat &&
              v_cache.scalar_type() == torch::kFloat, "paged_attention takes float32 q and caches");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention takes contiguous q and caches");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(D % 8 == 0 && Hq % Hkv == 0, "paged_attention needs head_dim % 8 == 0 and whole GQA groups");
  const int64_t G = Hq / Hkv, B = kv_lens.size(0);
  auto tables = block_tables.to(torch::kLong).contiguous();
  auto starts = q_start_loc.to(torch::kLong).contiguous();
  auto lens = kv_lens.to(torch::kLong).contiguous();
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* kl = lens.data_ptr<int64_t>();
  const int64_t width = tables.size(1);

  std::vector<int64_t> seq_of(T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = st[b]; t < st[b + 1]; ++t) seq_of[t] = b;

  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const int64_t row = Hkv * D;  // floats between consecutive tokens of one block

  // Token-major so each block row (every kv head, contiguous) streams from memory
  // once; tokens go round-robin to the workers so prefill rows, whose cost
  // grows with position, are shared evenly.
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), T);
  at::parallel_for(0, workers, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores;
    for (int64_t w = first; w < last; ++w) {
      for (int64_t t = w; t < T; t += workers) {
        const int64_t b = seq_of[t];
        const int64_t n = kl[b] - (st[b + 1] - t) + 1;  // keys visible to token t
        const int64_t* blocks = tab + b * width;
        const float* qt = qp + t * Hq * D;
        float* ot = op + t * Hq * D;
        scores.resize(Hq * n);

        for (int64_t j0 = 0; j0 < n; j0 += block_size) {
          const float* kb = kp + blocks[j0 / block_size] * block_size * row;
          for (int64_t j = j0; j < std::min(n, j0 + block_size); ++j)
            for (int64_t hq = 0; hq < Hq; ++hq)
              scores[hq * n + j] = dot(qt + hq * D, kb + (j - j0) * row + hq / G * D, D) * fscale;
        }
        for (int64_t hq = 0; hq < Hq; ++hq) {
          float* s = scores.data() + hq * n;
          const float m = *std::max_element(s, s + n);
          float total = 0.f;
          for (int64_t j = 0; j < n; ++j) total += (s[j] = std::exp(s[j] - m));
          const float inv = 1.f / total;
          for (int64_t j = 0; j < n; ++j) s[j] *= inv;
        }
        std::fill(ot, ot + Hq * D, 0.f);
        for (int64_t j0 = 0; j0 < n; j0 += block_size) {
          const float* vb = vp + blocks[j0 / block_size] * block_size * row;
          for (int64_t j = j0; j < std::min(n, j0 + block_size); ++j)
            for (int64_t hq = 0; hq < Hq; ++hq)
              axpy(ot + hq * D, scores[hq * n + j], vb + (j - j0) * row + hq / G * D, D);
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over a float32 block pool");
}
