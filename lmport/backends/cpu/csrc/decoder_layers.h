// A step's decoder layers in one call, for the cpu backend's decoder runner (decoder_runner.py): the
// kernels the runner's Python loop calls (lmport.ops.decoder describes one layer), in the same order with
// the same arguments, and between them the norms, rotary and residual adds done in place on the step's
// rows by the row functions those kernels use, so the hidden states are the same bit for bit. What goes
// is the Python between the kernels (about 25 calls a layer through pybind11 and torch's Python
// bindings, which at batch 1 cost as much as a good share of the weight reads) and torch's dispatch and
// allocation for the ops between them. A step of a few tokens over interleaved weights goes further: one
// parallel region for all the layers (DecoderLayers' team).
#pragma once

#include <torch/extension.h>

#include <memory>
#include <string>
#include <vector>

namespace lmport {

// One linear as the runner binds it: float32 ("float": weight), lmport's int4 / int8 format ("quant":
// weight = qweight, scales, mins (none where all are zero), bits, group_size) or GGUF blocks ("ggml":
// weight = blocks, type, in_features).
struct BoundLinear {
  std::string kind, type;
  torch::Tensor weight, scales;
  c10::optional<torch::Tensor> mins, bias;
  int64_t bits = 0, group_size = 0, in_features = 0, row_group = 1;

  int64_t input_width() const {
    return kind == "quant" ? weight.size(1) * 8 / bits : kind == "ggml" ? in_features : weight.size(1);
  }

  torch::Tensor operator()(const torch::Tensor& x) const;   // x W^T (+ bias) by the linear's kernel
};

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

// The layers, bound once; ``run`` takes a step's hidden states through all of them (decoder_layers.cpp).
class DecoderLayers {
 public:
  explicit DecoderLayers(std::vector<BoundLayer> layers);

  // x [T, hidden]; each layer's rotary cos / sin, cache and attention window / soft cap (0 for none);
  // the metadata tensors every layer shares (lmport.ops.AttentionMetadata).
  torch::Tensor run(torch::Tensor x, const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& sin,
                    const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                    const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                    const torch::Tensor& q_start_loc, const torch::Tensor& kv_lens, const std::vector<int64_t>& windows,
                    const std::vector<double>& softcaps) const;

  // The same over caches of 8- or 4-bit codes (``bits``) with their float32 params; bits 0: float32 or float16
  // caches (no params), as ``run``.
  torch::Tensor run_codes(torch::Tensor x, const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& sin,
                          const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                          const std::vector<torch::Tensor>& k_params, const std::vector<torch::Tensor>& v_params,
                          int64_t bits, const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                          const torch::Tensor& q_start_loc, const torch::Tensor& kv_lens,
                          const std::vector<int64_t>& windows, const std::vector<double>& softcaps) const;

  // Whether steps of a few tokens over a float32 or float16 cache run as one parallel region.
  bool runs_as_team() const;

 private:
  class Impl;
  std::shared_ptr<const Impl> impl_;
};

}  // namespace lmport
