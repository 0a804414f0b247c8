// The ops as torch sees them: tensors checked, made contiguous and handed to the kernels (kernels.h).
// bindings.cpp defines them and registers them with Python; decoder_layers.cpp calls them for the steps
// it runs one op at a time.
#pragma once

#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace lmport {

torch::Tensor small_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                           c10::optional<torch::Tensor> mins, int64_t bits, int64_t group_size,
                           c10::optional<torch::Tensor> bias, int64_t row_group = 1);
torch::Tensor quant_dequantize(torch::Tensor qweight, torch::Tensor scales, torch::Tensor mins, int64_t bits,
                               int64_t group_size, int64_t row_group = 1,
                               c10::optional<torch::Tensor> rows = c10::nullopt);
torch::Tensor ggml_linear(torch::Tensor x, torch::Tensor blocks, const std::string& type, int64_t in_features,
                          c10::optional<torch::Tensor> bias, int64_t row_group);
torch::Tensor ggml_dequantize(torch::Tensor blocks, const std::string& type, int64_t in_features, int64_t row_group,
                              c10::optional<torch::Tensor> rows = c10::nullopt);
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor q_start_loc, torch::Tensor kv_lens,
                              double scale, int64_t window, double softcap,
                              c10::optional<torch::Tensor> sinks = c10::nullopt, int64_t chunk = 0);
torch::Tensor paged_attention_codes(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                    torch::Tensor k_params, torch::Tensor v_params, int64_t bits,
                                    torch::Tensor block_tables, torch::Tensor q_start_loc, torch::Tensor kv_lens,
                                    double scale, int64_t window, double softcap,
                                    c10::optional<torch::Tensor> k_new = c10::nullopt,
                                    c10::optional<torch::Tensor> v_new = c10::nullopt,
                                    c10::optional<torch::Tensor> sinks = c10::nullopt, int64_t chunk = 0);
void interleave_groups(torch::Tensor src, torch::Tensor dst,
                       const std::vector<std::tuple<int64_t, int64_t, int64_t>>& segments, int64_t block_bytes);
void fill_kv_cache(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor slot_mapping);
void fill_kv_cache_codes(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                         torch::Tensor k_params, torch::Tensor v_params, int64_t bits, torch::Tensor slot_mapping);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate, torch::Tensor up);
std::tuple<torch::Tensor, torch::Tensor> apply_rotary(torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                                                      torch::Tensor sin);

// Every token's slot (``slot``, T of them) within the cache's ``slots``; ``op`` names the caller in the error.
void check_slots(const char* op, const int64_t* slot, int64_t T, int64_t slots);

// A step's metadata (lmport.ops.AttentionMetadata) as contiguous int32 tensors, checked for T query tokens.
struct StepMetadata {
  torch::Tensor tables, starts, lens;
  kernels::StepTables view() const {
    return {tables.data_ptr<int32_t>(), starts.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), lens.size(0),
            tables.size(1)};
  }
};
StepMetadata step_metadata(const torch::Tensor& block_tables, const torch::Tensor& q_start_loc,
                           const torch::Tensor& kv_lens, int64_t T);

}  // namespace lmport
