// The kernels' entry points, on raw arrays: each is defined in its family's .cpp (linear.cpp,
// quant_linear.cpp, ggml_linear.cpp, ggml_experts.cpp, paged_attention.cpp, kv_fill.cpp, elementwise.cpp,
// gated_delta_net.cpp, interleave.cpp) and called by bindings.cpp, which checks the tensors, makes them contiguous
// and allocates the outputs. Nothing here knows torch's tensors; the threads are ATen's (at::parallel_for).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <string>
#include <vector>

namespace lmport {
namespace kernels {

// ---- interleave.cpp: the layout of rows interleaved in groups (interleaved_layout.h), made at load ----
// ``groups`` groups of 16 rows of ``row_bytes`` (blocks of ``block_bytes``, each ``count`` segments as (start,
// length, unit) triples as lmport.weights.interleaved.SEGMENTS gives them) from src relaid into dst; dst may be
// src itself, else the two do not overlap.
void interleave_groups(const uint8_t* src, uint8_t* dst, int64_t groups, int64_t row_bytes, const int64_t* segments,
                       int64_t count, int64_t block_bytes);

// ---- linear.cpp: float32 weights ----
// y [M, N] = x [M, K] W [N, K]^T (+ bias [N]; null: none), K a multiple of 8.
void small_linear(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias, float* y);

// ---- quant_linear.cpp: lmport's int4 / int8 format ----
// y [M, N] = x W^T (+ bias): W's codes (K * bits / 8 bytes a row), float16 scales and mins ([N, K / group_size];
// mins null: all zero), rows interleaved in groups of ``row_group`` (1 or interleaved_group()). M > 0.
void quant_linear(const float* x, int64_t M, int64_t K, const uint8_t* w, const at::Half* scales,
                  const at::Half* mins, int64_t N, int64_t bits, int64_t group_size, int64_t row_group,
                  const float* bias, float* y);
// W as float32 [count, K]: rows ``index`` (null: all N in order).
void quant_dequantize(const uint8_t* w, const at::Half* scales, const at::Half* mins, int64_t N, int64_t K,
                      int64_t bits, int64_t group_size, int64_t row_group, const int64_t* index, int64_t count,
                      float* out);
int64_t quant_int8_rows();   // rows of x up to which x is held as two int8 codes (0: none)
std::vector<int64_t> quant_interleaved_bits();   // the widths read with rows interleaved
bool interleaved_kernels();   // whether this build reads rows interleaved in groups
int64_t interleaved_group();   // the rows of such a group (16)
bool interleaved_prefill();   // whether a prefill over interleaved rows is best run by the group kernels
bool set_bf16_prefill(bool on);   // a prefill over interleaved rows on AMX tiles in bfloat16: whether it now is
int64_t interleaved_bf16_rows();   // rows of x from which those take bfloat16 products on AMX tiles (0: never)

// ---- ggml_linear.cpp: GGUF blocks ----
// The inputs and bytes of a block of ``type``; false for a type with no kernel.
bool ggml_block_shape(const std::string& type, int64_t& elements, int64_t& bytes);
// y [M, N] = x W^T (+ bias), W [N] rows of blocks of ``type`` (K inputs), rows interleaved in groups of
// ``row_group`` (1, or interleaved_group() for ggml_row_group_types()). M > 0.
void ggml_linear(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, const std::string& type,
                 int64_t row_group, const float* bias, float* y);
// y [heads, M, N] = each head's x [heads, M, K] through its own N rows of W ([heads x N] rows, each head's whole
// groups of ``row_group``): ggml_linear a head at a time (MLA's absorbed projections). M > 0.
void ggml_head_linear(const float* x, int64_t heads, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                      const std::string& type, int64_t row_group, float* y);
void ggml_dequantize(const uint8_t* w, int64_t N, int64_t K, const std::string& type, int64_t row_group,
                     const int64_t* index, int64_t count, float* out);
std::vector<std::string> ggml_types();   // the types ggml_linear runs
std::vector<std::string> ggml_interleaved_types();   // those this build reads interleaved
std::vector<std::string> ggml_row_group_types();   // those with an interleaved layout at all
std::vector<std::string> ggml_int8_types();   // those whose few-rows path holds x as two int8 codes

// ---- ggml_experts.cpp: a mixture of experts' routed experts over GGUF blocks ----
// One of gate, up and down stacked over the experts: each expert's ``rows`` output rows in turn, interleaved in
// groups of ``row_group`` as ggml_linear takes them (rows a multiple of it); its biases [experts, rows] or null.
struct ExpertStack {
  const uint8_t* blocks;
  std::string type;
  int64_t rows, in_features, row_group;
  const float* bias;
};
// Between gate and up: silu(g) * u, or (clamped) gpt-oss's clamped SwiGLU; scale_inputs: the routing weight
// scales the expert's input instead of its output (Llama 4).
struct ExpertActivation {
  bool clamped = false;
  float alpha = 0, limit = 0;
  bool scale_inputs = false;
};
// out [T, H] = sum over the k slots of each token of down_e(act(gate_e x_t, up_e x_t)) times the slot's routing
// weight, e = ids[t, k] (lmport.ops.moe.quantized_moe): ids [T, k] in [0, experts), weights [T, k].
void ggml_experts(const float* x, int64_t T, int64_t H, const int64_t* ids, const float* weights, int64_t k,
                  int64_t experts, const ExpertStack& gate, const ExpertStack& up, const ExpertStack& down,
                  const ExpertActivation& activation, float* out);

// ---- paged_attention.cpp ----
// A block pool [blocks, block_size, kv_heads, row]: ``bits`` 32 or 16 (float32 or float16 values), or 8 or 4
// (codes with float32 [.., 2] params: scale, zero; k_new, v_new [T, kv_heads, head_dim] the step's own rows,
// or null).
struct AttentionPool {
  const void* k;
  const void* v;
  const float* k_params;
  const float* v_params;
  int64_t block_size, kv_heads;
  int bits;
  const float* k_new = nullptr;
  const float* v_new = nullptr;
};
// A step's metadata (lmport.ops.AttentionMetadata) as int32: tables [sequences, width], starts
// [sequences + 1], lens [sequences].
struct StepTables {
  const int32_t* tables;
  const int32_t* starts;
  const int32_t* lens;
  int64_t sequences, width;
};
// out [T, Hq, D] = attention of q [T, Hq, D] over the pool (D % 8 == 0, D <= 256, whole GQA groups); window,
// chunk: 0 for none; sinks: [Hq] logits joining each softmax's denominator, or null.
void paged_attention(const float* q, int64_t T, int64_t Hq, int64_t D, const AttentionPool& pool,
                     const StepTables& step, double scale, int64_t window, int64_t chunk, double softcap,
                     const float* sinks, float* out);
constexpr int64_t kMaxHeadDim = 256;

// ---- kv_fill.cpp ----
// Token t's K and V rows (``row`` floats) into the caches' slot slots[t]: float32, or float16 (``half``).
void fill_kv_cache(const float* k, const float* v, void* k_cache, void* v_cache, bool half, int64_t T, int64_t row,
                   const int64_t* slots);
// The same quantized to ``bits`` (8 or 4) codes and float32 params, H heads of D a token.
void fill_kv_cache_codes(const float* k, const float* v, uint8_t* k_cache, uint8_t* v_cache, float* k_params,
                         float* v_params, int64_t bits, int64_t T, int64_t H, int64_t D, const int64_t* slots);

// ---- elementwise.cpp ----
// ``rows`` rows of N: out = w * (x * rsqrt(mean(x^2) + eps)).
void rms_norm(const float* x, const float* w, float* out, int64_t rows, int64_t N, double eps);
// out[i] = silu(gate[i]) * up[i] for n elements.
void silu_and_mul(const float* gate, const float* up, float* out, int64_t n);
// x, out [T, H, D] rotated by cos, sin [T, D] (rotate half).
void apply_rotary(const float* x, float* out, const float* cos, const float* sin, int64_t T, int64_t H, int64_t D);

// ---- gated_delta_net.cpp ----
// The gated delta rule token by token (lmport.ops.gated_delta_net.recurrent_gated_delta_rule) over H value heads of
// B sequences, T tokens each: q, k [B, H, T, Dk] (L2-normalized, q scaled, repeated to the value heads), v [B, H, T,
// Dv], g (log decay) and beta [B, H, T]; sequence b's state [H, Dk, Dv] is row rows[b] of ``states``, read and left
// there after the tokens (rows distinct); out [B, H, T, Dv]. Dv <= kMaxStateColumns.
constexpr int64_t kMaxStateColumns = 512;
void recurrent_gated_delta_rule(const float* q, const float* k, const float* v, const float* g, const float* beta,
                                float* states, const int64_t* rows, int64_t B, int64_t H, int64_t T, int64_t Dk,
                                int64_t Dv, float* out);

}  // namespace kernels
}  // namespace lmport
