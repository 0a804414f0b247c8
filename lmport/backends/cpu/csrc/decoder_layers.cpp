// A step's decoder layers in one call (decoder_layers.h). The one kernel file that holds tensors: the layers'
// weights are bound as the runner passes them, and a step of many tokens calls the ops as tensors (ops.h).
#include <ATen/Parallel.h>
#include <omp.h>
#include <sched.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "activation.h"
#include "decoder_layers.h"
#include "ggml_linear.h"
#include "kv_fill.h"
#include "linear.h"
#include "ops.h"
#include "paged_attention.h"
#include "quant_linear.h"
#include "rms_norm.h"
#include "rotary.h"
#include "spin_barrier.h"
#include "team_linear.h"

namespace lmport {

torch::Tensor BoundLinear::operator()(const torch::Tensor& x) const {
  if (kind == "quant") return quant_linear(x, weight, scales, mins, bits, group_size, bias, row_group);
  if (kind == "ggml") return ggml_linear(x, weight, type, in_features, bias, row_group);
  return small_linear(x, weight, bias);
}

// Parts of different formats reading one input: their outputs side by side.
inline torch::Tensor run_parts(const std::vector<BoundLinear>& parts, const torch::Tensor& x) {
  if (parts.size() == 1) return parts[0](x);
  std::vector<torch::Tensor> outs;
  outs.reserve(parts.size());
  for (const auto& part : parts) outs.push_back(part(x));
  return torch::cat(outs, -1);
}

// The glue between the kernels, on rows of the step's buffers: each gives the same floats as the kernel it
// stands for (rms_norm, apply_rotary, the residual add).

// Rows [begin, end) of hidden (``h``) += delta (``d``; after delta's own norm, where the layer has one, in place);
// then ``next`` (if any) of them into ``hn``.
inline void add_rows(float* h, float* hn, float* d, int64_t begin, int64_t end, int64_t width,
                     const c10::optional<BoundNorm>& own, const BoundNorm* next) {
  for (int64_t r = begin; r < end; ++r) {
    float *dr = d + r * width, *xr = h + r * width;
    if (own) rms_norm_row(dr, own->weight.data_ptr<float>(), dr, width, own->eps);
    for (int64_t e = 0; e < width; ++e) xr[e] += dr[e];
    if (next) rms_norm_row(xr, next->weight.data_ptr<float>(), hn + r * width, width, next->eps);
  }
}

// Rows [begin, end) of qkv (rows ``stride`` apart): the q and k heads' norms (where the layer has them), then
// their rotation by row r's cos / sin (``c``, ``s``: head_dim a row).
inline void rotate_rows(const BoundLayer& l, float* qkv, int64_t stride, const float* c, const float* s,
                        int64_t begin, int64_t end) {
  const int64_t D = l.head_dim, heads = l.num_heads + l.num_kv_heads;
  for (int64_t r = begin; r < end; ++r)
    for (int64_t head = 0; head < heads; ++head) {
      float* row = qkv + r * stride + head * D;
      const auto& own = head < l.num_heads ? l.q_norm : l.k_norm;
      if (own) rms_norm_row(row, own->weight.data_ptr<float>(), row, D, own->eps);
      rotate_row(row, row, c + r * D, s + r * D, D);
    }
}

// The CPUs this process may run on. A team of more threads would have members waiting at a barrier for
// one that has no core to run on.
inline int usable_cpus() {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set)
                                                      : static_cast<int>(std::thread::hardware_concurrency());
}

// A layer's projections as a team runs them (team_linear.h).
struct TeamLayer {
#ifdef LMPORT_INTERLEAVED
  TeamLinear qkv, o, gate_up, down;
#endif
};

// The layers, bound once; ``run`` takes a step's hidden states through all of them.
//
// A step of a few tokens over interleaved weights (every layer's projections, a float32 or float16 cache), with no
// more threads than CPUs to run them, runs as one parallel region: its threads take every op together, each its share of a projection's rows
// or of attention's keys, the glue between on one of them, meeting at a spin barrier between ops. Other
// steps call the kernels one at a time, each opening its own region. The two give the same floats.
class DecoderLayers::Impl {
 public:
  explicit Impl(std::vector<BoundLayer> layers) : layers_(std::move(layers)), team_(bind_team(layers_)) {}

  // x [T, hidden]; each layer's rotary cos / sin, cache and attention window / soft cap (0 for none);
  // the metadata tensors every layer shares (lmport.ops.AttentionMetadata).
  torch::Tensor run(torch::Tensor x, const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& sin,
                    const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                    const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                    const torch::Tensor& q_start_loc, const torch::Tensor& kv_lens, const std::vector<int64_t>& windows,
                    const std::vector<double>& softcaps) const {
    return run_codes(x, cos, sin, k_caches, v_caches, {}, {}, 0, slot_mapping, block_tables, q_start_loc, kv_lens,
                     windows, softcaps);
  }

  // The same over caches of 8- or 4-bit codes (``bits``) with their float32 params; bits 0: float32 or float16
  // caches (no params), as ``run``.
  torch::Tensor run_codes(torch::Tensor x, const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& sin,
                          const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                          const std::vector<torch::Tensor>& k_params, const std::vector<torch::Tensor>& v_params,
                          int64_t bits, const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                          const torch::Tensor& q_start_loc, const torch::Tensor& kv_lens,
                          const std::vector<int64_t>& windows, const std::vector<double>& softcaps) const {
    TORCH_CHECK(bits == 0 || bits == 8 || bits == 4, "decoder layers: codes of 8 or 4 bits, got ", bits);
    TORCH_CHECK(bits == 0 || (k_params.size() == layers_.size() && v_params.size() == layers_.size()),
                "decoder layers: ", layers_.size(), " layers, got ", k_params.size(), " K params and ",
                v_params.size(), " V params");
    const size_t n = layers_.size();
    TORCH_CHECK(cos.size() == n && sin.size() == n && k_caches.size() == n && v_caches.size() == n &&
                    windows.size() == n && softcaps.size() == n,
                "decoder layers: ", n, " layers, got ", cos.size(), " cos, ", sin.size(), " sin, ", k_caches.size(),
                " K caches, ", v_caches.size(), " V caches, ", windows.size(), " windows and ", softcaps.size(),
                " soft caps");
    // The hidden states, updated in place (a copy: the caller's x stays as it is), and their norm; the
    // glue between the kernels (norms, rotary, residual adds) runs on these buffers' rows, with no torch
    // op of its own, and gives the same floats as the kernels it stands for.
    torch::Tensor hidden = x.contiguous().clone(), normed = torch::empty_like(hidden);
    const int64_t t = hidden.size(0), width = hidden.size(1);
    float* h = hidden.data_ptr<float>();
    float* hn = normed.data_ptr<float>();
    const auto slots = slot_mapping.to(torch::kLong).contiguous();   // converted once, not once a layer
    const BoundNorm& first = layers_[0].attention_norm;
    at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rms_norm_row(h + r * width, first.weight.data_ptr<float>(), hn + r * width, width, first.eps);
    });
    if (bits == 0 && !team_.empty() && t <= kTeamTokens && at::get_num_threads() <= usable_cpus() &&
        run_team(h, hn, t, width, cos, sin, k_caches, v_caches, slots, block_tables, q_start_loc, kv_lens, windows,
                 softcaps))
      return hidden;
    const auto add = [&](torch::Tensor delta, const c10::optional<BoundNorm>& own, const BoundNorm* next) {
      delta = delta.contiguous();
      at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
        add_rows(h, hn, delta.data_ptr<float>(), begin, end, width, own, next);
      });
    };
    for (size_t i = 0; i < n; ++i) {
      const BoundLayer& l = layers_[i];
      const int64_t D = l.head_dim;
      torch::Tensor qkv = run_parts(l.qkv, normed).contiguous();
      const auto c = cos[i].contiguous(), s = sin[i].contiguous();
      at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
        rotate_rows(l, qkv.data_ptr<float>(), qkv.size(1), c.data_ptr<float>(), s.data_ptr<float>(), begin, end);
      });
      const auto parts = qkv.view({t, -1, D}).split_with_sizes({l.num_heads, l.num_kv_heads, l.num_kv_heads}, 1);
      const torch::Tensor q = parts[0].contiguous(), &k = parts[1], &v = parts[2];
      torch::Tensor out;
      if (bits) {
        fill_kv_cache_codes(k, v, k_caches[i], v_caches[i], k_params[i], v_params[i], bits, slots);
        out = paged_attention_codes(q, k_caches[i], v_caches[i], k_params[i], v_params[i], bits, block_tables,
                                    q_start_loc, kv_lens, l.scale, windows[i], softcaps[i], k, v);
      } else {
        fill_kv_cache(k, v, k_caches[i], v_caches[i], slots);
        out = paged_attention(q, k_caches[i], v_caches[i], block_tables, q_start_loc, kv_lens, l.scale, windows[i],
                              softcaps[i]);
      }
      add(run_parts(l.o, out.view({t, -1})), l.attention_output_norm, &l.mlp_norm);
      auto gate_up = run_parts(l.gate_up, normed).chunk(2, -1);
      const torch::Tensor gated = l.gelu_tanh ? at::gelu(gate_up[0], "tanh") * gate_up[1]
                                              : silu_and_mul(gate_up[0], gate_up[1]);
      add(run_parts(l.down, gated), l.mlp_output_norm, i + 1 < n ? &layers_[i + 1].attention_norm : nullptr);
    }
    return hidden;
  }

  bool runs_as_team() const { return !team_.empty(); }

 private:
  // The most tokens a step runs as a team: a decode step of a few sequences, a verification of a few proposals.
  static constexpr int64_t kTeamTokens = 16;

  // Every layer's projections as a team runs them, or none where a layer does not fit: a projection not
  // interleaved, an MLP width the silu's eight-at-a-time rows would split differently, or layers of
  // different attention shapes.
  static std::vector<TeamLayer> bind_team(const std::vector<BoundLayer>& layers) {
    std::vector<TeamLayer> team;
#ifdef LMPORT_INTERLEAVED
    for (const BoundLayer& l : layers) {
      auto qkv = TeamLinear::of(l.qkv), o = TeamLinear::of(l.o), gate_up = TeamLinear::of(l.gate_up),
           down = TeamLinear::of(l.down);
      if (!qkv || !o || !gate_up || !down || gate_up->width() % 16 ||
          down->in_features() * 2 != gate_up->width() || l.num_heads != layers[0].num_heads ||
          l.head_dim != layers[0].head_dim || qkv->width() != (l.num_heads + 2 * l.num_kv_heads) * l.head_dim ||
          o->in_features() != l.num_heads * l.head_dim)
        return {};
      team.push_back({*qkv, *o, *gate_up, *down});
    }
#endif
    return team;
  }

  // The layers as a team (see the class): false, with nothing run, where the region gets fewer threads than asked.
  bool run_team(float* h, float* hn, int64_t t, int64_t width, const std::vector<torch::Tensor>& cos,
                const std::vector<torch::Tensor>& sin, const std::vector<torch::Tensor>& k_caches,
                const std::vector<torch::Tensor>& v_caches, const torch::Tensor& slots,
                const torch::Tensor& block_tables, const torch::Tensor& q_start_loc, const torch::Tensor& kv_lens,
                const std::vector<int64_t>& windows, const std::vector<double>& softcaps) const {
#ifdef LMPORT_INTERLEAVED
    const size_t n = layers_.size();
    const int64_t Hq = layers_[0].num_heads, D = layers_[0].head_dim;
    int64_t qkv_width = 0, gate_up_width = 0;
    for (const TeamLayer& l : team_)
      qkv_width = std::max(qkv_width, l.qkv.width()), gate_up_width = std::max(gate_up_width, l.gate_up.width());
    // Everything a member reads besides the weights, settled before the region (no torch op runs in it but a
    // gelu MLP's).
    std::vector<torch::Tensor> held;
    std::vector<const float*> c(n), s(n);
    // The caches: float32 or float16 (every layer's alike), as pools of one kind and the other.
    const bool half = k_caches[0].scalar_type() == torch::kHalf;
    std::vector<Pool<32>> pools;
    std::vector<Pool<16>> half_pools;
    std::vector<void*> k_data(n), v_data(n);
    for (size_t i = 0; i < n; ++i) {
      const auto& k = k_caches[i];
      const auto& v = v_caches[i];
      const auto dtype = half ? torch::kHalf : torch::kFloat;
      TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype && k.is_contiguous() &&
                      v.is_contiguous() && k.dim() == 4 && v.sizes() == k.sizes() && k.size(3) == D &&
                      k.size(2) == layers_[i].num_kv_heads,
                  "decoder layers: layer ", i, "'s caches are ", half ? "float16" : "float32", " [blocks, block_size, ",
                  layers_[i].num_kv_heads, ", ", D, "] alike, as the first layer's; got ", k.scalar_type(), " ",
                  k.sizes(), " and ", v.scalar_type(), " ", v.sizes());
      held.push_back(cos[i].contiguous()), c[i] = held.back().data_ptr<float>();
      held.push_back(sin[i].contiguous()), s[i] = held.back().data_ptr<float>();
      k_data[i] = k.data_ptr(), v_data[i] = v.data_ptr();
      if (half)
        half_pools.push_back({k_data[i], v_data[i], nullptr, nullptr, k.size(1), k.size(2), D});
      else
        pools.push_back({k_data[i], v_data[i], nullptr, nullptr, k.size(1), k.size(2), D});
    }
    const int64_t* slot = slots.data_ptr<int64_t>();
    check_slots("decoder layers", slot, t, k_caches[0].size(0) * k_caches[0].size(1));
    const int threads = at::get_num_threads();
    const StepMetadata meta = step_metadata(block_tables, q_start_loc, kv_lens, t);
    const kernels::StepTables step = meta.view();
    AttentionWork work(step.tables, step.starts, step.lens, step.sequences, step.width, t, Hq, D, threads);
    std::vector<float> qkv(t * qkv_width), attention(t * Hq * D), delta(t * width), gate_up(t * gate_up_width),
        gelu_gated(t * gate_up_width / 2);
    SpinBarrier barrier(threads);
    bool whole = true;
#pragma omp parallel num_threads(threads)
    {
      const int member = omp_get_thread_num();
#pragma omp single
      whole = omp_get_num_threads() == threads;
      if (whole) {
        Scratch scratch;
        std::vector<float> gated(t * gate_up_width / 2);
        for (size_t i = 0; i < n; ++i) {
          const BoundLayer& l = layers_[i];
          const TeamLayer& team = team_[i];
          const int64_t W = team.qkv.width(), kv_row = l.num_kv_heads * D, inner = team.gate_up.width() / 2;
          team.qkv.run_share(member, threads, hn, t, qkv.data());
          barrier.wait();
          if (member == 0) {   // q and k heads in place; the new K and V rows into the cache
            rotate_rows(l, qkv.data(), W, c[i], s[i], 0, t);
            for (int64_t r = 0; r < t; ++r) {
              const float* k = qkv.data() + r * W + Hq * D;
              if (half)
                fill_kv_row(k, k + kv_row, static_cast<uint16_t*>(k_data[i]), static_cast<uint16_t*>(v_data[i]),
                            kv_row, slot[r]);
              else
                fill_kv_row(k, k + kv_row, static_cast<float*>(k_data[i]), static_cast<float*>(v_data[i]), kv_row,
                            slot[r]);
            }
          }
          barrier.wait();
          if (member < work.workers && half)
            attend_items(work, member, qkv.data(), W, half_pools[i], attention.data(), l.scale, windows[i],
                         softcaps[i], scratch);
          else if (member < work.workers)
            attend_items(work, member, qkv.data(), W, pools[i], attention.data(), l.scale, windows[i], softcaps[i],
                         scratch);
          barrier.wait();
          if (work.parts > 1) {
            if (member == 0) merge_parts(work, attention.data());
            barrier.wait();
          }
          team.o.run_share(member, threads, attention.data(), t, delta.data());
          barrier.wait();
          if (member == 0) add_rows(h, hn, delta.data(), 0, t, width, l.attention_output_norm, &l.mlp_norm);
          barrier.wait();
          team.gate_up.run_share(member, threads, hn, t, gate_up.data());
          barrier.wait();
          if (l.gelu_tanh) {
            // torch's gelu, as a step of one kernel at a time runs it, on one member (inside a parallel region
            // torch runs it on the calling thread), for all
            if (member == 0) {
              const auto halves = torch::from_blob(gate_up.data(), {t, 2 * inner}, torch::kFloat).chunk(2, -1);
              const torch::Tensor g = at::gelu(halves[0], "tanh") * halves[1];
              std::memcpy(gelu_gated.data(), g.data_ptr<float>(), t * inner * sizeof(float));
            }
            barrier.wait();
            team.down.run_share(member, threads, gelu_gated.data(), t, delta.data());
          } else {
            // each member its own silu(gate) * up, the down projection's input
            for (int64_t r = 0; r < t; ++r)
              silu_and_mul_row(gate_up.data() + r * 2 * inner, gate_up.data() + r * 2 * inner + inner,
                               gated.data() + r * inner, 0, inner);
            team.down.run_share(member, threads, gated.data(), t, delta.data());
          }
          barrier.wait();
          if (member == 0)
            add_rows(h, hn, delta.data(), 0, t, width, l.mlp_output_norm,
                     i + 1 < n ? &layers_[i + 1].attention_norm : nullptr);
          barrier.wait();
        }
      }
    }
    return whole;
#else
    return false;
#endif
  }

  std::vector<BoundLayer> layers_;
  std::vector<TeamLayer> team_;
};


DecoderLayers::DecoderLayers(std::vector<BoundLayer> layers) : impl_(std::make_shared<const Impl>(std::move(layers))) {}

torch::Tensor DecoderLayers::run(torch::Tensor x, const std::vector<torch::Tensor>& cos,
                                 const std::vector<torch::Tensor>& sin, const std::vector<torch::Tensor>& k_caches,
                                 const std::vector<torch::Tensor>& v_caches, const torch::Tensor& slot_mapping,
                                 const torch::Tensor& block_tables, const torch::Tensor& q_start_loc,
                                 const torch::Tensor& kv_lens, const std::vector<int64_t>& windows,
                                 const std::vector<double>& softcaps) const {
  return impl_->run(x, cos, sin, k_caches, v_caches, slot_mapping, block_tables, q_start_loc, kv_lens, windows,
                    softcaps);
}

torch::Tensor DecoderLayers::run_codes(torch::Tensor x, const std::vector<torch::Tensor>& cos,
                                       const std::vector<torch::Tensor>& sin,
                                       const std::vector<torch::Tensor>& k_caches,
                                       const std::vector<torch::Tensor>& v_caches,
                                       const std::vector<torch::Tensor>& k_params,
                                       const std::vector<torch::Tensor>& v_params, int64_t bits,
                                       const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                                       const torch::Tensor& q_start_loc, const torch::Tensor& kv_lens,
                                       const std::vector<int64_t>& windows, const std::vector<double>& softcaps) const {
  return impl_->run_codes(x, cos, sin, k_caches, v_caches, k_params, v_params, bits, slot_mapping, block_tables,
                          q_start_loc, kv_lens, windows, softcaps);
}

bool DecoderLayers::runs_as_team() const { return impl_->runs_as_team(); }

}  // namespace lmport
