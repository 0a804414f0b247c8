// The extension's torch glue: each op's tensors checked, made contiguous and allocated here, then handed to its
// kernel (kernels.h) as arrays; and the module's registrations with Python. The kernels live one family a file
// (linear.cpp, quant_linear.cpp, ggml_linear.cpp, ggml_experts.cpp, paged_attention.cpp, kv_fill.cpp,
// elementwise.cpp, decoder_layers.cpp), the instruction sets' code under isa/.
#include <torch/extension.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "decoder_layers.h"
#include "kernels.h"
#include "ops.h"
#include "quant_format.h"

namespace lmport {

StepMetadata step_metadata(const torch::Tensor& block_tables, const torch::Tensor& q_start_loc,
                           const torch::Tensor& kv_lens, int64_t T) {
  // The step metadata is int32 (AttentionMetadata): .to() is then a no-op, not a copy per layer.
  StepMetadata m{block_tables.to(torch::kInt).contiguous(), q_start_loc.to(torch::kInt).contiguous(),
                 kv_lens.to(torch::kInt).contiguous()};
  const int64_t B = m.lens.size(0);
  TORCH_CHECK(m.tables.dim() == 2 && m.tables.size(0) == B && m.starts.numel() == B + 1 &&
                  m.starts.data_ptr<int32_t>()[B] == T,
              "paged_attention: block_tables [B, max_blocks], q_start_loc [B + 1] ending at the ", T,
              " query tokens, kv_lens [B]; got ", m.tables.sizes(), ", ", m.starts.sizes(), " and ", m.lens.sizes());
  return m;
}

namespace {

// q [T, Hq, D] over ``pool``; the metadata as step_metadata takes it; sinks [Hq] (any float dtype) or None.
torch::Tensor attention_over(const torch::Tensor& q, const kernels::AttentionPool& pool,
                             const torch::Tensor& block_tables, const torch::Tensor& q_start_loc,
                             const torch::Tensor& kv_lens, double scale, int64_t window, double softcap,
                             const c10::optional<torch::Tensor>& sinks, int64_t chunk) {
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  TORCH_CHECK(D % 8 == 0 && D <= kernels::kMaxHeadDim && Hq % pool.kv_heads == 0,
              "paged_attention needs head_dim % 8 == 0, head_dim <= 256 and whole GQA groups");
  TORCH_CHECK(window >= 0 && chunk >= 0, "paged_attention: window and chunk are >= 0 (0: none); got ", window,
              " and ", chunk);
  torch::Tensor head_sinks;
  if (sinks.has_value()) {
    head_sinks = sinks->to(torch::kFloat).contiguous();
    TORCH_CHECK(head_sinks.numel() == Hq, "paged_attention: sinks are one logit a query head (", Hq, "); got ",
                sinks->sizes());
  }
  const StepMetadata meta = step_metadata(block_tables, q_start_loc, kv_lens, T);
  auto out = torch::empty_like(q);
  kernels::paged_attention(q.data_ptr<float>(), T, Hq, D, pool, meta.view(), scale, window, chunk, softcap,
                           head_sinks.defined() ? head_sinks.data_ptr<float>() : nullptr, out.data_ptr<float>());
  return out;
}

// ``rows`` as contiguous int64, each checked to be a row of the N a weight has (an undefined tensor: none).
torch::Tensor checked_rows(const c10::optional<torch::Tensor>& rows, int64_t N, const char* kernel) {
  if (!rows) return torch::Tensor();
  TORCH_CHECK(rows->dim() == 1, kernel, ": rows must be 1-d indices, got ", rows->sizes());
  const torch::Tensor index = rows->to(torch::kLong).contiguous();
  const int64_t* p = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < index.numel(); ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < N, kernel, ": row ", p[i], " of a weight with ", N, " rows");
  return index;
}

}  // namespace

torch::Tensor small_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat,
              "small_linear takes float32 tensors");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "small_linear: x is [tokens, in], weight [out, in]; got ", x.sizes(), " and ", weight.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(K % 8 == 0, "small_linear: in_features must be a multiple of 8, got ", K);
  if (bias) TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == N,
                        "small_linear: bias must be float32 with ", N, " elements");
  x = x.contiguous();
  weight = weight.contiguous();
  const torch::Tensor b = bias ? bias->contiguous() : torch::Tensor();
  auto y = torch::empty({M, N}, x.options());
  kernels::small_linear(x.data_ptr<float>(), M, K, weight.data_ptr<float>(), N, bias ? b.data_ptr<float>() : nullptr,
                        y.data_ptr<float>());
  return y;
}

// ``mins`` may be left out (quant_linear): a weight whose mins are all zero (GGUF's Q8_0, w = scale * q).
static void check_quantized(const torch::Tensor& qweight, const torch::Tensor& scales,
                            const c10::optional<torch::Tensor>& mins, int64_t bits, int64_t group_size) {
  TORCH_CHECK(bits == 4 || bits == 8, "quantized weights are 4- or 8-bit, got ", bits);
  TORCH_CHECK(qweight.scalar_type() == (bits == 4 ? torch::kByte : torch::kChar) && qweight.dim() == 2,
              bits, "-bit codes must be a 2-d ", bits == 4 ? "uint8" : "int8", " tensor, got ", qweight.sizes());
  const int64_t K = qweight.size(1) * 8 / bits;
  const int64_t runs_per_group = group_size / quant_detail::kRun;
  TORCH_CHECK(group_size > 0 && group_size % quant_detail::kRun == 0 && K % group_size == 0 &&
                  (runs_per_group & (runs_per_group - 1)) == 0,
              "group size ", group_size, " must be 32 times a power of two and divide ", K);
  for (const torch::Tensor* t : {&scales, mins ? &*mins : &scales})
    TORCH_CHECK(t->scalar_type() == torch::kHalf && t->dim() == 2 && t->size(0) == qweight.size(0) &&
                    t->size(1) == K / group_size,
                "scales and mins must be float16 [", qweight.size(0), ", ", K / group_size, "], got ", t->sizes());
}

static void check_quant_row_group(int64_t row_group) {
  TORCH_CHECK(row_group == 1 || (row_group == kernels::interleaved_group() && kernels::interleaved_kernels()),
              "quant: rows interleaved in groups of ", row_group, ": this build reads ",
              kernels::interleaved_kernels() ? "groups of 16" : "none (neither AVX-512 VNNI nor AVX2 with FMA and F16C)",
              " (lmport.weights.interleaved.file_layout gives the rows back in order)");
}

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                           c10::optional<torch::Tensor> mins, int64_t bits, int64_t group_size,
                           c10::optional<torch::Tensor> bias, int64_t row_group) {
  check_quantized(qweight, scales, mins, bits, group_size);
  check_quant_row_group(row_group);
  const int64_t N = qweight.size(0), K = qweight.size(1) * 8 / bits;
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.size(1) == K,
              "quant_linear: x must be float32 [tokens, ", K, "], got ", x.sizes());
  if (bias) TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == N,
                        "quant_linear: bias must be float32 with ", N, " elements");
  x = x.contiguous();
  qweight = qweight.contiguous();
  scales = scales.contiguous();
  const torch::Tensor mn = mins ? mins->contiguous() : torch::Tensor();
  const torch::Tensor b = bias ? bias->contiguous() : torch::Tensor();
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;   // e.g. an expert no token was routed to
  kernels::quant_linear(x.data_ptr<float>(), M, K, reinterpret_cast<const uint8_t*>(qweight.data_ptr()),
                        scales.data_ptr<at::Half>(), mins ? mn.data_ptr<at::Half>() : nullptr, N, bits, group_size,
                        row_group, bias ? b.data_ptr<float>() : nullptr, y.data_ptr<float>());
  return y;
}

// W in float32; with ``rows`` (int64 indices) only those rows, in that order (an embedding lookup).
torch::Tensor quant_dequantize(torch::Tensor qweight, torch::Tensor scales, torch::Tensor mins, int64_t bits,
                               int64_t group_size, int64_t row_group,
                               c10::optional<torch::Tensor> rows) {
  check_quantized(qweight, scales, mins, bits, group_size);
  check_quant_row_group(row_group);
  qweight = qweight.contiguous();
  scales = scales.contiguous();
  mins = mins.contiguous();
  const int64_t N = qweight.size(0), K = qweight.size(1) * 8 / bits;
  const torch::Tensor picked = checked_rows(rows, N, "quant_dequantize");
  const int64_t* index = rows ? picked.data_ptr<int64_t>() : nullptr;
  const int64_t count = rows ? picked.numel() : N;
  auto out = torch::empty({count, K}, scales.options().dtype(torch::kFloat));
  kernels::quant_dequantize(reinterpret_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr<at::Half>(),
                            mins.data_ptr<at::Half>(), N, K, bits, group_size, row_group, index, count,
                            out.data_ptr<float>());
  return out;
}

static int64_t checked_inputs(const torch::Tensor& blocks, const std::string& type, int64_t in_features) {
  TORCH_CHECK(blocks.scalar_type() == torch::kByte && blocks.dim() == 2, "ggml blocks must be a 2-d uint8 tensor, got ",
              blocks.scalar_type(), " ", blocks.sizes());
  int64_t elements = 0, bytes = 0;
  TORCH_CHECK(kernels::ggml_block_shape(type, elements, bytes), "ggml_linear: no kernel for GGML type '", type, "'");
  TORCH_CHECK(in_features > 0 && in_features % elements == 0 && blocks.size(1) == in_features / elements * bytes,
              type, " blocks of ", in_features, " inputs must be [out, ", in_features / elements * bytes, "] (",
              elements, " inputs a block of ", bytes, " bytes), got ", blocks.sizes());
  return in_features;
}

static void check_ggml_row_group(const std::string& type, int64_t row_group) {
  const auto types = kernels::ggml_row_group_types();
  TORCH_CHECK(row_group == 1 || (row_group == kernels::interleaved_group() && kernels::interleaved_kernels() &&
                                 std::find(types.begin(), types.end(), type) != types.end()),
              "ggml: ", type, " rows interleaved in groups of ", row_group, ": this build reads groups of ",
              kernels::interleaved_group(), " of ", kernels::interleaved_kernels() ? c10::Join(", ", types) : std::string("no type"),
              " (lmport.weights.interleaved.file_layout gives the file's rows back)");
}

torch::Tensor ggml_linear(torch::Tensor x, torch::Tensor blocks, const std::string& type, int64_t in_features,
                          c10::optional<torch::Tensor> bias, int64_t row_group) {
  const int64_t K = checked_inputs(blocks, type, in_features), N = blocks.size(0);
  check_ggml_row_group(type, row_group);
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.size(1) == K,
              "ggml_linear: x must be float32 [tokens, ", K, "], got ", x.scalar_type(), " ", x.sizes());
  if (bias) TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == N,
                        "ggml_linear: bias must be float32 with ", N, " elements");
  x = x.contiguous();
  blocks = blocks.contiguous();
  const torch::Tensor b = bias ? bias->contiguous() : torch::Tensor();
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;   // e.g. an expert no token was routed to
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const float* bp = bias ? b.data_ptr<float>() : nullptr;
  kernels::ggml_linear(x.data_ptr<float>(), M, K, w, N, type, row_group, bp, y.data_ptr<float>());
  return y;
}

// x [heads, T, in_features] through each head's own rows of ``blocks`` ([heads x rows, ...], each head's rows whole
// groups of ``row_group``): [heads, T, rows] (MLA's absorbed projections).
torch::Tensor ggml_head_linear(torch::Tensor x, torch::Tensor blocks, const std::string& type, int64_t in_features,
                               int64_t row_group) {
  const int64_t K = checked_inputs(blocks, type, in_features);
  check_ggml_row_group(type, row_group);
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 3 && x.size(2) == K && x.size(0) > 0,
              "ggml_head_linear: x must be float32 [heads, tokens, ", K, "], got ", x.scalar_type(), " ", x.sizes());
  const int64_t heads = x.size(0), T = x.size(1), rows = blocks.size(0) / heads;
  TORCH_CHECK(blocks.is_contiguous() && rows * heads == blocks.size(0) && rows % row_group == 0,
              "ggml_head_linear: the weight must be ", heads, " heads' contiguous rows, each head's whole groups of ",
              row_group, "; got ", blocks.sizes());
  x = x.contiguous();
  auto y = torch::empty({heads, T, rows}, x.options());
  if (T == 0) return y;
  kernels::ggml_head_linear(x.data_ptr<float>(), heads, T, K, blocks.data_ptr<uint8_t>(), rows, type, row_group,
                            y.data_ptr<float>());
  return y;
}

// One of an experts block's stacked weights (GGUF blocks, rows interleaved in groups of ``row_group``) checked for
// ``experts`` of ``rows`` rows and ``in_features`` inputs each; ``bias`` [experts, rows] float32 or None.
static kernels::ExpertStack expert_stack(const char* name, const torch::Tensor& blocks, const std::string& type,
                                         int64_t row_group, int64_t experts, int64_t rows, int64_t in_features,
                                         const c10::optional<torch::Tensor>& bias) {
  checked_inputs(blocks, type, in_features);
  check_ggml_row_group(type, row_group);
  TORCH_CHECK(blocks.is_contiguous() && blocks.size(0) == experts * rows && rows % row_group == 0, "ggml_experts: ",
              name, " must be ", experts, " experts x ", rows, " contiguous rows, each expert's whole groups of ",
              row_group, "; got ", blocks.sizes());
  if (bias)
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == experts * rows,
                "ggml_experts: the ", name, " bias must be contiguous float32 [", experts, ", ", rows, "]");
  return {blocks.data_ptr<uint8_t>(), type, rows, in_features, row_group, bias ? bias->data_ptr<float>() : nullptr};
}

torch::Tensor ggml_experts(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, int64_t experts,
                           torch::Tensor gate, const std::string& gate_type, int64_t gate_row_group,
                           torch::Tensor up, const std::string& up_type, int64_t up_row_group, torch::Tensor down,
                           const std::string& down_type, int64_t down_row_group,
                           c10::optional<std::vector<torch::Tensor>> biases, c10::optional<double> alpha,
                           c10::optional<double> limit, bool scale_inputs) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2, "ggml_experts: x must be float32 [tokens, hidden]");
  TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.dim() == 2 && ids.size(0) == x.size(0) &&
                  weights.scalar_type() == torch::kFloat && weights.sizes() == ids.sizes(),
              "ggml_experts: ids int64 and weights float32 [tokens, k]; got ", ids.scalar_type(), " ", ids.sizes(),
              " and ", weights.scalar_type(), " ", weights.sizes());
  TORCH_CHECK(experts > 0 && gate.dim() == 2 && gate.size(0) % experts == 0, "ggml_experts: gate must stack ",
              experts, " experts' rows");
  TORCH_CHECK(!biases || biases->size() == 3, "ggml_experts: biases are gate's, up's and down's");
  TORCH_CHECK(alpha.has_value() == limit.has_value(), "ggml_experts: the clamped SwiGLU takes alpha and limit");
  const int64_t T = x.size(0), H = x.size(1), k = ids.size(1), inter = gate.size(0) / experts;
  auto bias = [&](int i) { return biases ? c10::optional<torch::Tensor>((*biases)[i]) : c10::nullopt; };
  const auto g = expert_stack("gate", gate, gate_type, gate_row_group, experts, inter, H, bias(0));
  const auto u = expert_stack("up", up, up_type, up_row_group, experts, inter, H, bias(1));
  const auto d = expert_stack("down", down, down_type, down_row_group, experts, H, inter, bias(2));
  x = x.contiguous(), ids = ids.contiguous(), weights = weights.contiguous();
  const int64_t* idp = ids.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(idp, idp + ids.numel(), [&](int64_t e) { return e >= 0 && e < experts; }),
              "ggml_experts: expert ids must be in [0, ", experts, ")");
  kernels::ExpertActivation act;
  act.clamped = alpha.has_value(), act.scale_inputs = scale_inputs;
  act.alpha = static_cast<float>(alpha.value_or(0)), act.limit = static_cast<float>(limit.value_or(0));
  auto out = torch::empty({T, H}, x.options());
  kernels::ggml_experts(x.data_ptr<float>(), T, H, idp, weights.data_ptr<float>(), k, experts, g, u, d, act,
                        out.data_ptr<float>());
  return out;
}

// W in float32; with ``rows`` (int64 indices) only those rows, in that order (an embedding lookup).
torch::Tensor ggml_dequantize(torch::Tensor blocks, const std::string& type, int64_t in_features,
                              int64_t row_group, c10::optional<torch::Tensor> rows) {
  const int64_t K = checked_inputs(blocks, type, in_features), N = blocks.size(0);
  check_ggml_row_group(type, row_group);
  blocks = blocks.contiguous();
  const torch::Tensor picked = checked_rows(rows, N, "ggml_dequantize");
  const int64_t* index = rows ? picked.data_ptr<int64_t>() : nullptr;
  const int64_t count = rows ? picked.numel() : N;
  auto out = torch::empty({count, K}, blocks.options().dtype(torch::kFloat));
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  kernels::ggml_dequantize(w, N, K, type, row_group, index, count, op);
  return out;
}

// Every token's slot (``slot``, T of them) within the cache's ``slots``; ``op`` names the caller in the error.
void check_slots(const char* op, const int64_t* slot, int64_t T, int64_t slots) {
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, op, ": slot ", slot[t], " of token ", t, " is outside the ", slots,
                " slots of the cache");
}

void interleave_groups(torch::Tensor src, torch::Tensor dst,
                       const std::vector<std::tuple<int64_t, int64_t, int64_t>>& segments, int64_t block_bytes) {
  TORCH_CHECK(src.scalar_type() == torch::kUInt8 && dst.scalar_type() == torch::kUInt8 && src.dim() == 2 &&
                  src.sizes() == dst.sizes() && src.is_contiguous() && dst.is_contiguous(),
              "interleave_groups takes contiguous uint8 src and dst of one shape [rows, row_bytes]; got ",
              src.sizes(), " and ", dst.sizes());
  const int64_t rows = src.size(0), row_bytes = src.size(1), group = kernels::interleaved_group();
  TORCH_CHECK(rows % group == 0 && block_bytes > 0 && row_bytes % block_bytes == 0,
              "interleave_groups: rows in whole groups of ", group, " and rows of whole ", block_bytes,
              "-byte blocks; got ", src.sizes());
  std::vector<int64_t> flat;
  for (auto [start, length, unit] : segments) {
    const int64_t at = flat.empty() ? 0 : flat[flat.size() - 3] + flat[flat.size() - 2];
    TORCH_CHECK(start == at && length > 0 && (unit == 0 || unit == 1 || unit == 2 || unit == 4) &&
                    length % std::max<int64_t>(unit, 1) == 0,
                "interleave_groups: segments follow each other from 0, each a whole number of units of 0 (half a "
                "byte), 1, 2 or 4 bytes; got (", start, ", ", length, ", ", unit, ")");
    flat.insert(flat.end(), {start, length, unit});
  }
  TORCH_CHECK(!flat.empty() && flat[flat.size() - 3] + flat[flat.size() - 2] == block_bytes,
              "interleave_groups: the segments make up the ", block_bytes, "-byte block");
  const auto* s = src.data_ptr<uint8_t>();
  auto* d = dst.data_ptr<uint8_t>();
  TORCH_CHECK(s == d || s + src.numel() <= d || d + dst.numel() <= s,
              "interleave_groups: dst is src itself or apart from it");
  kernels::interleave_groups(s, d, rows / group, row_bytes, flat.data(), static_cast<int64_t>(segments.size()),
                             block_bytes);
}

void fill_kv_cache(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor slot_mapping) {
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(k.scalar_type() == torch::kFloat && v.scalar_type() == torch::kFloat &&
                  (dtype == torch::kFloat || dtype == torch::kHalf) && v_cache.scalar_type() == dtype,
              "fill_kv_cache takes float32 k and v, and float32 or float16 caches alike");
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
  check_slots("fill_kv_cache", sp, T, slots);
  const auto kc = k.contiguous(), vc = v.contiguous();
  kernels::fill_kv_cache(kc.data_ptr<float>(), vc.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(),
                         dtype == torch::kHalf, T, row, sp);
}

// The same for a pool of 8- or 4-bit codes ([blocks, block_size, kv_heads, head_dim * bits / 8] uint8) and
// its params ([blocks, block_size, kv_heads, 2] float32): each new row quantized as the reference does.
void fill_kv_cache_codes(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                         torch::Tensor k_params, torch::Tensor v_params, int64_t bits,
                         torch::Tensor slot_mapping) {
  TORCH_CHECK(bits == 8 || bits == 4, "fill_kv_cache_codes takes 8- or 4-bit codes, got ", bits);
  TORCH_CHECK(k.scalar_type() == torch::kFloat && v.scalar_type() == torch::kFloat &&
                  k_cache.scalar_type() == torch::kByte && v_cache.scalar_type() == torch::kByte &&
                  k_params.scalar_type() == torch::kFloat && v_params.scalar_type() == torch::kFloat,
              "fill_kv_cache_codes takes float32 k, v and params and uint8 caches");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_params.is_contiguous() &&
                  v_params.is_contiguous() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  k_params.dim() == 4 && k_params.size(3) == 2 && v_params.sizes() == k_params.sizes() &&
                  k_params.size(0) * k_params.size(1) * k_params.size(2) ==
                      k_cache.size(0) * k_cache.size(1) * k_cache.size(2),
              "fill_kv_cache_codes: the caches are contiguous [blocks, block_size, kv_heads, head_dim * bits / 8] "
              "and their params [blocks, block_size, kv_heads, 2]; got ", k_cache.sizes(), ", ", v_cache.sizes(),
              ", ", k_params.sizes(), " and ", v_params.sizes());
  const int64_t T = slot_mapping.numel(), H = k_cache.size(2), stored = k_cache.size(3);
  const int64_t D = stored * 8 / bits, slots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(k.dim() == 3 && k.size(0) == T && k.size(1) == H && k.size(2) == D && v.sizes() == k.sizes(),
              "fill_kv_cache_codes: k and v are [", T, " tokens, ", H, " kv_heads, ", D, "]; got ", k.sizes(),
              " and ", v.sizes());
  const auto slot = slot_mapping.to(torch::kLong).contiguous();
  const int64_t* sp = slot.data_ptr<int64_t>();
  check_slots("fill_kv_cache_codes", sp, T, slots);
  const auto kc = k.contiguous(), vc = v.contiguous();
  kernels::fill_kv_cache_codes(kc.data_ptr<float>(), vc.data_ptr<float>(), k_cache.data_ptr<uint8_t>(),
                               v_cache.data_ptr<uint8_t>(), k_params.data_ptr<float>(), v_params.data_ptr<float>(),
                               bits, T, H, D, sp);
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat,
              "rms_norm takes float32 x and weight");
  const int64_t N = x.size(-1);
  TORCH_CHECK(weight.numel() == N, "rms_norm: weight has ", weight.numel(), " elements for rows of ", N);
  auto input = x.contiguous();
  auto w = weight.contiguous();
  auto out = torch::empty_like(input);
  kernels::rms_norm(input.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), input.numel() / N, N, eps);
  return out;
}

torch::Tensor silu_and_mul(torch::Tensor gate, torch::Tensor up) {
  TORCH_CHECK(gate.scalar_type() == torch::kFloat && up.scalar_type() == torch::kFloat,
              "silu_and_mul takes float32 tensors");
  TORCH_CHECK(gate.sizes() == up.sizes(), "silu_and_mul: gate and up differ in shape");
  if (!(gate.strides() == up.strides() && gate.is_non_overlapping_and_dense())) {
    gate = gate.contiguous();
    up = up.contiguous();
  }
  auto out = torch::empty_like(gate);  // same strides as gate
  kernels::silu_and_mul(gate.data_ptr<float>(), up.data_ptr<float>(), out.data_ptr<float>(), gate.numel());
  return out;
}

// q [T, Hq, D], k [T, Hkv, D], cos/sin [T, D] -> new contiguous (q, k).
std::tuple<torch::Tensor, torch::Tensor> apply_rotary(torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                                                      torch::Tensor sin) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k.scalar_type() == torch::kFloat &&
              cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat,
              "apply_rotary takes float32 tensors");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.size(0) == q.size(0) && k.size(2) == q.size(2),
              "apply_rotary: q is [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim]; got ", q.sizes(),
              " and ", k.sizes());
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.numel() == q.size(0) * q.size(2),
              "apply_rotary: cos and sin are [tokens, head_dim]; got ", cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(q.size(-1) % 2 == 0, "apply_rotary needs an even head dim");
  auto qc = q.contiguous(), kc = k.contiguous(), c = cos.contiguous(), s = sin.contiguous();
  auto q_out = torch::empty_like(qc), k_out = torch::empty_like(kc);
  const int64_t T = q.size(0), D = q.size(2);
  kernels::apply_rotary(qc.data_ptr<float>(), q_out.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(), T,
                 q.size(1), D);
  kernels::apply_rotary(kc.data_ptr<float>(), k_out.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(), T,
                 k.size(1), D);
  return {q_out, k_out};
}

// q, k [B, H, T, Dk], v [B, H, T, Dv], g, beta [B, H, T] float32; each sequence's state the row rows[b] (int64 [B],
// distinct) of ``states`` [N, H, Dk, Dv] (float32, contiguous), updated there -> out [B, H, T, Dv].
torch::Tensor recurrent_gated_delta_rule(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g,
                                         torch::Tensor beta, torch::Tensor states, torch::Tensor rows) {
  for (const auto* t : {&q, &k, &v, &g, &beta, &states})
    TORCH_CHECK(t->scalar_type() == torch::kFloat, "recurrent_gated_delta_rule takes float32 tensors");
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4 && v.sizes().slice(0, 3) == q.sizes().slice(0, 3),
              "recurrent_gated_delta_rule: q, k [B, H, T, Dk] and v [B, H, T, Dv]");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), Dk = q.size(3), Dv = v.size(3);
  TORCH_CHECK(g.sizes() == q.sizes().slice(0, 3) && beta.sizes() == g.sizes(),
              "recurrent_gated_delta_rule: g and beta [B, H, T]");
  TORCH_CHECK(Dv <= kernels::kMaxStateColumns, "recurrent_gated_delta_rule: value heads of up to ",
              kernels::kMaxStateColumns, ", got ", Dv);
  TORCH_CHECK(states.dim() == 4 && states.size(1) == H && states.size(2) == Dk && states.size(3) == Dv &&
                  states.is_contiguous(),
              "recurrent_gated_delta_rule: a contiguous float32 state pool [rows, H, Dk, Dv]");
  TORCH_CHECK(rows.scalar_type() == torch::kLong && rows.dim() == 1 && rows.size(0) == B,
              "recurrent_gated_delta_rule: one int64 row of the pool per sequence");
  auto r = rows.contiguous();
  const int64_t* rp = r.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(rp[b] >= 0 && rp[b] < states.size(0), "recurrent_gated_delta_rule: row ", rp[b], " of a pool of ",
                states.size(0));
  std::vector<int64_t> sorted(rp, rp + B);   // two sequences updating one row would race
  std::sort(sorted.begin(), sorted.end());
  TORCH_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
              "recurrent_gated_delta_rule: each sequence needs a row of its own");
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), gc = g.contiguous(), bc = beta.contiguous();
  auto out = torch::empty_like(vc);
  kernels::recurrent_gated_delta_rule(qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(),
                                      gc.data_ptr<float>(), bc.data_ptr<float>(), states.data_ptr<float>(), rp, B, H,
                                      T, Dk, Dv, out.data_ptr<float>());
  return out;
}

// Over a pool of values: k_cache, v_cache [blocks, block_size, Hkv, D], float32 or float16 alike.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor q_start_loc,
                              torch::Tensor kv_lens, double scale, int64_t window, double softcap,
                              c10::optional<torch::Tensor> sinks, int64_t chunk) {
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == torch::kFloat && (dtype == torch::kFloat || dtype == torch::kHalf) &&
              v_cache.scalar_type() == dtype, "paged_attention takes float32 q and float32 or float16 caches alike");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention takes contiguous q and caches");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.size(3) == q.size(2) &&
              v_cache.sizes() == k_cache.sizes(),
              "paged_attention: q is [tokens, heads, head_dim], the caches [blocks, block_size, kv_heads, "
              "head_dim] alike; got ", q.sizes(), ", ", k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t bs = k_cache.size(1), kv_heads = k_cache.size(2);
  return attention_over(q, {k_cache.data_ptr(), v_cache.data_ptr(), nullptr, nullptr, bs, kv_heads,
                            dtype == torch::kHalf ? 16 : 32},
                        block_tables, q_start_loc, kv_lens, scale, window, softcap, sinks, chunk);
}

// Over a pool of 8- or 4-bit codes: k_cache, v_cache [blocks, block_size, Hkv, D * bits / 8] uint8, their
// params [blocks, block_size, Hkv, 2] float32 (scale, zero).
// k_new, v_new: the step's own K and V [T, kv_heads, head_dim] float32, attended to in place of their codes
// (None: their codes are read, as any other row's).
torch::Tensor paged_attention_codes(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                    torch::Tensor k_params, torch::Tensor v_params, int64_t bits,
                                    torch::Tensor block_tables, torch::Tensor q_start_loc,
                                    torch::Tensor kv_lens, double scale, int64_t window, double softcap,
                                    c10::optional<torch::Tensor> k_new,
                                    c10::optional<torch::Tensor> v_new, c10::optional<torch::Tensor> sinks,
                                    int64_t chunk) {
  TORCH_CHECK(bits == 8 || bits == 4, "paged_attention_codes takes 8- or 4-bit codes, got ", bits);
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kByte &&
              v_cache.scalar_type() == torch::kByte && k_params.scalar_type() == torch::kFloat &&
              v_params.scalar_type() == torch::kFloat,
              "paged_attention_codes takes float32 q and params and uint8 caches");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && k_params.is_contiguous() &&
              v_params.is_contiguous(), "paged_attention_codes takes contiguous q, caches and params");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.size(3) * 8 == q.size(2) * bits &&
              v_cache.sizes() == k_cache.sizes() && k_params.dim() == 4 && k_params.size(0) == k_cache.size(0) &&
              k_params.size(1) == k_cache.size(1) && k_params.size(2) == k_cache.size(2) && k_params.size(3) == 2 &&
              v_params.sizes() == k_params.sizes(),
              "paged_attention_codes: q is [tokens, heads, head_dim], the caches [blocks, block_size, kv_heads, "
              "head_dim * bits / 8] and their params [blocks, block_size, kv_heads, 2]; got ", q.sizes(), ", ",
              k_cache.sizes(), ", ", v_cache.sizes(), ", ", k_params.sizes(), " and ", v_params.sizes());
  const int64_t bs = k_cache.size(1), kv_heads = k_cache.size(2), D = q.size(2);
  TORCH_CHECK(k_new.has_value() == v_new.has_value(), "paged_attention_codes takes k_new and v_new together");
  torch::Tensor kn, vn;
  if (k_new.has_value()) {
    kn = k_new->contiguous(), vn = v_new->contiguous();
    TORCH_CHECK(kn.scalar_type() == torch::kFloat && vn.scalar_type() == torch::kFloat && kn.dim() == 3 &&
                    kn.size(0) == q.size(0) && kn.size(1) == kv_heads && kn.size(2) == D && vn.sizes() == kn.sizes(),
                "paged_attention_codes: k_new and v_new are float32 [tokens, kv_heads, head_dim]; got ", kn.sizes(),
                " and ", vn.sizes());
  }
  const float* kp = kn.defined() ? kn.data_ptr<float>() : nullptr;
  const float* vp = vn.defined() ? vn.data_ptr<float>() : nullptr;
  return attention_over(q, {k_cache.data_ptr(), v_cache.data_ptr(), k_params.data_ptr<float>(),
                            v_params.data_ptr<float>(), bs, kv_heads, static_cast<int>(bits), kp, vp},
                        block_tables, q_start_loc, kv_lens, scale, window, softcap, sinks, chunk);
}

}  // namespace lmport

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &lmport::paged_attention, "paged attention over a float32 or float16 block pool",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("q_start_loc"),
        py::arg("kv_lens"), py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0,
        py::arg("sinks") = py::none(), py::arg("chunk") = 0);
  m.def("paged_attention_codes", &lmport::paged_attention_codes,
        "paged attention over a block pool of 8- or 4-bit codes with a float32 scale and zero per row",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_params"), py::arg("v_params"),
        py::arg("bits"), py::arg("block_tables"), py::arg("q_start_loc"), py::arg("kv_lens"), py::arg("scale"),
        py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("k_new") = py::none(), py::arg("v_new") = py::none(),
        py::arg("sinks") = py::none(), py::arg("chunk") = 0);
  m.def("interleave_groups", &lmport::interleave_groups,
        "whole groups of 16 rows of src (uint8 [rows, row_bytes], blocks of block_bytes made of segments (start, "
        "length, unit)) relaid into dst (src itself, or apart from it) as lmport.weights.interleaved lays them out",
        py::arg("src"), py::arg("dst"), py::arg("segments"), py::arg("block_bytes"));
  m.def("fill_kv_cache", &lmport::fill_kv_cache, "write new K/V rows into a float32 or float16 bshd block pool",
        py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"));
  m.def("fill_kv_cache_codes", &lmport::fill_kv_cache_codes,
        "quantize new K/V rows into a bshd pool of 8- or 4-bit codes and their float32 params",
        py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_params"),
        py::arg("v_params"), py::arg("bits"), py::arg("slot_mapping"));
  m.def("small_linear", &lmport::small_linear, "x W^T (+ b) for a few rows of x (float32)",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("quant_linear", &lmport::quant_linear,
        "x W^T (+ b), W in lmport's int4/int8 format (mins None: all zero), x float32 rows",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("bits"),
        py::arg("group_size"), py::arg("bias") = py::none(), py::arg("row_group") = 1);
  m.def("quant_int8_rows", &lmport::kernels::quant_int8_rows, "rows of x up to which quant_linear holds x as two int8 codes (0: none)");
  m.def("quant_dequantize", &lmport::quant_dequantize, "W in lmport's int4/int8 format -> float32 (rows: only those, in that order)",
        py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("bits"), py::arg("group_size"),
        py::arg("row_group") = 1, py::arg("rows") = py::none());
  m.def("quant_interleaved_bits", &lmport::kernels::quant_interleaved_bits,
        "the int4/int8 widths quant_linear and quant_dequantize read with rows interleaved in groups of 16");
  m.def("interleaved_prefill", &lmport::kernels::interleaved_prefill,
        "whether a prefill over interleaved rows is best run by quant_linear / ggml_linear, not a GEMM on the dequantized weight");
  m.def("set_bf16_prefill", &lmport::kernels::set_bf16_prefill,
        "run a prefill over interleaved rows on AMX tiles in bfloat16 (on: where the CPU has them) or exactly; whether it now does");
  m.def("interleaved_bf16_rows", &lmport::kernels::interleaved_bf16_rows,
        "rows of x from which quant_linear / ggml_linear over interleaved rows take bfloat16 products on AMX tiles (0: never)");
  m.def("ggml_linear", &lmport::ggml_linear, "x W^T (+ b), W in GGUF blocks of the named type, x float32 rows",
        py::arg("x"), py::arg("blocks"), py::arg("type"), py::arg("in_features"), py::arg("bias") = py::none(),
        py::arg("row_group") = 1);
  m.def("ggml_experts", &lmport::ggml_experts,
        "a mixture of experts' routed experts over GGUF blocks stacked over the experts (float32 x): [tokens, hidden]",
        py::arg("x"), py::arg("ids"), py::arg("weights"), py::arg("experts"), py::arg("gate"), py::arg("gate_type"),
        py::arg("gate_row_group"), py::arg("up"), py::arg("up_type"), py::arg("up_row_group"), py::arg("down"),
        py::arg("down_type"), py::arg("down_row_group"), py::arg("biases") = py::none(),
        py::arg("alpha") = py::none(), py::arg("limit") = py::none(), py::arg("scale_inputs") = false);
  m.def("ggml_head_linear", &lmport::ggml_head_linear,
        "each head's float32 x [heads, tokens, in] through its own rows of GGUF blocks: [heads, tokens, rows]",
        py::arg("x"), py::arg("blocks"), py::arg("type"), py::arg("in_features"), py::arg("row_group") = 1);
  m.def("ggml_dequantize", &lmport::ggml_dequantize, "W in GGUF blocks of the named type -> float32 (rows: only those, in that order)",
        py::arg("blocks"), py::arg("type"), py::arg("in_features"), py::arg("row_group") = 1,
        py::arg("rows") = py::none());
  m.def("ggml_types", &lmport::kernels::ggml_types, "the GGUF block types ggml_linear runs");
  m.def("ggml_interleaved_types", &lmport::kernels::ggml_interleaved_types,
        "the GGUF block types ggml_linear and ggml_dequantize read with rows interleaved in groups of 16");
  m.def("ggml_int8_types", &lmport::kernels::ggml_int8_types, "the GGUF block types whose path for up to quant_int8_rows() rows holds x as two int8 codes");
  m.def("rms_norm", &lmport::rms_norm, "RMSNorm over the last axis (float32)");
  m.def("silu_and_mul", &lmport::silu_and_mul, "silu(gate) * up (float32)");
  m.def("apply_rotary", &lmport::apply_rotary, "rotate-half rotary embedding of q and k (float32)");
  m.def("recurrent_gated_delta_rule", &lmport::recurrent_gated_delta_rule,
        "the gated delta rule token by token over [B, H, T, D] heads (float32), each sequence's state updated in its "
        "row of the pool: out");

  // module_local: the classes are this module's alone. Every build registers the same C++ types, and pybind11
  // refuses a type another loaded module registered globally; a process that loads a second build (another
  // instruction set, other sources: kernels.build_name) would fail on it.
  py::class_<lmport::BoundLinear>(m, "BoundLinear", "one linear of a layer, bound for DecoderLayers",
                                  py::module_local())
      .def(py::init([](std::string kind, torch::Tensor weight, c10::optional<torch::Tensor> bias,
                       c10::optional<torch::Tensor> scales, c10::optional<torch::Tensor> mins, int64_t bits,
                       int64_t group_size, std::string type, int64_t in_features, int64_t row_group) {
             TORCH_CHECK(kind == "float" || kind == "quant" || kind == "ggml", "BoundLinear: unknown kind '", kind,
                         "' (float, quant or ggml)");
             TORCH_CHECK(kind != "quant" || scales, "BoundLinear: a quant linear needs scales");
             lmport::BoundLinear l;
             l.kind = kind, l.type = type, l.weight = weight, l.bias = bias;
             l.scales = scales ? *scales : torch::Tensor(), l.mins = mins;
             l.bits = bits, l.group_size = group_size, l.in_features = in_features, l.row_group = row_group;
             return l;
           }),
           py::arg("kind"), py::arg("weight"), py::arg("bias") = py::none(), py::arg("scales") = py::none(),
           py::arg("mins") = py::none(), py::arg("bits") = 0, py::arg("group_size") = 0, py::arg("type") = "",
           py::arg("in_features") = 0, py::arg("row_group") = 1);
  py::class_<lmport::BoundNorm>(m, "BoundNorm", "an RMSNorm's scale and epsilon, bound for DecoderLayers",
                                py::module_local())
      .def(py::init([](torch::Tensor weight, double eps) { return lmport::BoundNorm{weight, eps}; }),
           py::arg("weight"), py::arg("eps"));
  py::class_<lmport::BoundLayer>(m, "BoundLayer", "one decoder layer's weights and shape (lmport.ops.decoder)",
                                 py::module_local())
      .def(py::init([](std::vector<c10::optional<lmport::BoundNorm>> norms, std::vector<lmport::BoundLinear> qkv,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
                       std::vector<lmport::BoundLinear> o, std::vector<lmport::BoundLinear> gate_up,
                       std::vector<lmport::BoundLinear> down, bool gelu_tanh) {
             // norms: attention, q, k, attention output, MLP, MLP output (decoder_runner.py's _norms)
             TORCH_CHECK(norms.size() == 6 && norms[0] && norms[4], "BoundLayer: six norms, the attention's and "
                         "the MLP's given");
             lmport::BoundLayer l;
             l.attention_norm = *norms[0], l.q_norm = norms[1], l.k_norm = norms[2];
             l.attention_output_norm = norms[3], l.mlp_norm = *norms[4], l.mlp_output_norm = norms[5];
             l.qkv = qkv, l.o = o, l.gate_up = gate_up, l.down = down;
             l.num_heads = num_heads, l.num_kv_heads = num_kv_heads, l.head_dim = head_dim, l.scale = scale;
             l.gelu_tanh = gelu_tanh;
             return l;
           }));
  py::class_<lmport::DecoderLayers>(m, "DecoderLayers", "a step's decoder layers in one call", py::module_local())
      .def(py::init<std::vector<lmport::BoundLayer>>())
      .def("run", &lmport::DecoderLayers::run, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("k_caches"),
           py::arg("v_caches"), py::arg("slot_mapping"), py::arg("block_tables"), py::arg("q_start_loc"),
           py::arg("kv_lens"), py::arg("windows"), py::arg("softcaps"))
      .def("run_codes", &lmport::DecoderLayers::run_codes, py::arg("x"), py::arg("cos"), py::arg("sin"),
           py::arg("k_caches"), py::arg("v_caches"), py::arg("k_params"), py::arg("v_params"), py::arg("bits"),
           py::arg("slot_mapping"), py::arg("block_tables"), py::arg("q_start_loc"), py::arg("kv_lens"),
           py::arg("windows"), py::arg("softcaps"))
      .def("runs_as_team", &lmport::DecoderLayers::runs_as_team,
           "whether steps of a few tokens over a float32 cache run as one parallel region (interleaved weights)");
}
