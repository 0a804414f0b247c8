// The cpu backend's compiled ops, one translation unit so the build stays short.
#include <torch/extension.h>

#include "activation.h"
#include "decoder_layers.h"
#include "ggml_linear.h"
#include "kv_fill.h"
#include "linear.h"
#include "paged_attention.h"
#include "quant_linear.h"
#include "rms_norm.h"
#include "rotary.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &lmport::paged_attention, "paged attention over a float32 or float16 block pool",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("q_start_loc"),
        py::arg("kv_lens"), py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("paged_attention_codes", &lmport::paged_attention_codes,
        "paged attention over a block pool of 8- or 4-bit codes with a float32 scale and zero per row",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_params"), py::arg("v_params"),
        py::arg("bits"), py::arg("block_tables"), py::arg("q_start_loc"), py::arg("kv_lens"), py::arg("scale"),
        py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("k_new") = py::none(), py::arg("v_new") = py::none());
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
  m.def("quant_int8_rows", &lmport::quant_int8_rows, "rows of x up to which quant_linear holds x as two int8 codes (0: none)");
  m.def("quant_dequantize", &lmport::quant_dequantize, "W in lmport's int4/int8 format -> float32 (rows: only those, in that order)",
        py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("bits"), py::arg("group_size"),
        py::arg("row_group") = 1, py::arg("rows") = py::none());
  m.def("quant_interleaved_bits", &lmport::quant_interleaved_bits,
        "the int4/int8 widths quant_linear and quant_dequantize read with rows interleaved in groups of 16");
  m.def("interleaved_prefill", &lmport::interleaved_prefill,
        "whether a prefill over interleaved rows is best run by quant_linear / ggml_linear, not a GEMM on the dequantized weight");
  m.def("ggml_linear", &lmport::ggml_linear, "x W^T (+ b), W in GGUF blocks of the named type, x float32 rows",
        py::arg("x"), py::arg("blocks"), py::arg("type"), py::arg("in_features"), py::arg("bias") = py::none(),
        py::arg("row_group") = 1);
  m.def("ggml_dequantize", &lmport::ggml_dequantize, "W in GGUF blocks of the named type -> float32 (rows: only those, in that order)",
        py::arg("blocks"), py::arg("type"), py::arg("in_features"), py::arg("row_group") = 1,
        py::arg("rows") = py::none());
  m.def("ggml_types", &lmport::ggml_kernel_types, "the GGUF block types ggml_linear runs");
  m.def("ggml_interleaved_types", &lmport::ggml_interleaved_types,
        "the GGUF block types ggml_linear and ggml_dequantize read with rows interleaved in groups of 16");
  m.def("ggml_int8_types", &lmport::ggml_int8_types, "the GGUF block types whose path for up to quant_int8_rows() rows holds x as two int8 codes");
  m.def("rms_norm", &lmport::rms_norm, "RMSNorm over the last axis (float32)");
  m.def("silu_and_mul", &lmport::silu_and_mul, "silu(gate) * up (float32)");
  m.def("apply_rotary", &lmport::apply_rotary, "rotate-half rotary embedding of q and k (float32)");

  // module_local: two builds of these kernels (another commit's, another instruction set) can be loaded
  // into one process side by side, as benchmarks that compare them do.
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
