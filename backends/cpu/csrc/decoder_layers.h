// A step's decoder layers in one call, for the cpu backend's decoder runner (decoder_runner.py): the
// kernels the runner's Python loop calls (lmport.ops.decoder describes one layer), in the same order with
// the same arguments, and between them the norms, rotary and residual adds done in place on the step's
// rows by the row functions those kernels use, so the hidden states are the same bit for bit. What goes
// is the Python between the kernels (about 25 calls a layer through pybind11 and torch's Python
// bindings, which at batch 1 cost as much as a good share of the weight reads) and torch's dispatch and
// allocation for the ops between them.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

#include "activation.h"
#include "ggml_linear.h"
#include "kv_fill.h"
#include "linear.h"
#include "paged_attention.h"
#include "quant_linear.h"
#include "rms_norm.h"
#include "rotary.h"

namespace lmport {

// One linear as the runner binds it: float32 ("float": weight), lmport's int4 / int8 format ("quant":
// weight = qweight, scales, mins (none where all are zero), bits, group_size) or GGUF blocks ("ggml":
// weight = blocks, type, in_features).
struct BoundLinear {
  std::string kind, type;
  torch::Tensor weight, scales;
  c10::optional<torch::Tensor> mins, bias;
  int64_t bits = 0, group_size = 0, in_features = 0, row_group = 1;

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (kind == "quant") return quant_linear(x, weight, scales, mins, bits, group_size, bias, row_group);
    if (kind == "ggml") return ggml_linear(x, weight, type, in_features, bias, row_group);
    return small_linear(x, weight, bias);
  }
};

// Parts of different formats reading one input: their outputs side by side.
inline torch::Tensor run_parts(const std::vector<BoundLinear>& parts, const torch::Tensor& x) {
  if (parts.size() == 1) return parts[0](x);
  std::vector<torch::Tensor> outs;
  outs.reserve(parts.size());
  for (const auto& part : parts) outs.push_back(part(x));
  return torch::cat(outs, -1);
}

// An RMSNorm: the scale it applies and its epsilon.
struct BoundNorm {
  torch::Tensor weight;
  double eps = 0;
};

struct BoundLayer {
  BoundNorm attention_norm, mlp_norm;
  c10::optional<BoundNorm> q_norm, k_norm, attention_output_norm, mlp_output_norm;
  std::vector<BoundLinear> qkv, o, gate_up, down;
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  double scale = 0;
  bool gelu_tanh = false;   // the MLP's activation: gelu with the tanh approximation, else silu
};

// The layers, bound once; ``run`` takes a step's hidden states through all of them.
class DecoderLayers {
 public:
  explicit DecoderLayers(std::vector<BoundLayer> layers) : layers_(std::move(layers)) {}

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

  // The same over caches of 8- or 4-bit codes (``bits``) with their float32 params; bits 0: float32 caches
  // (no params), as ``run``.
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
    const int64_t t = x.size(0), width = x.size(1);
    // The hidden states, updated in place (a copy: the caller's x stays as it is), and their norm; the
    // glue between the kernels (norms, rotary, residual adds) runs on these buffers' rows, with no torch
    // op of its own, and gives the same floats as the kernels it stands for.
    torch::Tensor hidden = x.contiguous().clone(), normed = torch::empty_like(hidden);
    float* h = hidden.data_ptr<float>();
    float* hn = normed.data_ptr<float>();
    // hidden += delta (after delta's own norm, where the layer has one); then ``next`` (if any) of it into normed.
    const auto add = [&](torch::Tensor delta, const c10::optional<BoundNorm>& own, const BoundNorm* next) {
      delta = delta.contiguous();
      float* d = delta.data_ptr<float>();
      at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          float *dr = d + r * width, *xr = h + r * width;
          if (own) rms_norm_row(dr, own->weight.data_ptr<float>(), dr, width, own->eps);
          for (int64_t e = 0; e < width; ++e) xr[e] += dr[e];
          if (next) rms_norm_row(xr, next->weight.data_ptr<float>(), hn + r * width, width, next->eps);
        }
      });
    };
    const auto slots = slot_mapping.to(torch::kLong).contiguous();   // converted once, not once a layer
    const BoundNorm& first = layers_[0].attention_norm;
    at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rms_norm_row(h + r * width, first.weight.data_ptr<float>(), hn + r * width, width, first.eps);
    });
    for (size_t i = 0; i < n; ++i) {
      const BoundLayer& l = layers_[i];
      const int64_t D = l.head_dim, heads = l.num_heads + l.num_kv_heads;
      torch::Tensor qkv = run_parts(l.qkv, normed).contiguous();
      // q and k heads in place: their norms (where the layer has them), then the rotation.
      const auto c = cos[i].contiguous(), s = sin[i].contiguous();
      float* qkv_rows = qkv.data_ptr<float>();
      at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
          for (int64_t head = 0; head < heads; ++head) {
            float* row = qkv_rows + r * qkv.size(1) + head * D;
            const auto& own = head < l.num_heads ? l.q_norm : l.k_norm;
            if (own) rms_norm_row(row, own->weight.data_ptr<float>(), row, D, own->eps);
            rotate_row(row, row, c.data_ptr<float>() + r * D, s.data_ptr<float>() + r * D, D);
          }
      });
      const auto parts = qkv.view({t, -1, D}).split_with_sizes({l.num_heads, l.num_kv_heads, l.num_kv_heads}, 1);
      const torch::Tensor q = parts[0].contiguous(), &k = parts[1], &v = parts[2];
      torch::Tensor out;
      if (bits) {
        fill_kv_cache_codes(k, v, k_caches[i], v_caches[i], k_params[i], v_params[i], bits, slots);
        out = paged_attention_codes(q, k_caches[i], v_caches[i], k_params[i], v_params[i], bits, block_tables,
                                    q_start_loc, kv_lens, l.scale, windows[i], softcaps[i]);
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

 private:
  std::vector<BoundLayer> layers_;
};

}  // namespace lmport
