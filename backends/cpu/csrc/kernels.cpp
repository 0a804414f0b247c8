// The cpu backend's compiled ops, one translation unit so the build stays short.
#include <torch/extension.h>

#include "activation.h"
#include "ggml_linear.h"
#include "kv_fill.h"
#include "linear.h"
#include "paged_attention.h"
#include "quant_linear.h"
#include "rms_norm.h"
#include "rotary.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &lmport::paged_attention, "paged attention over a float32 block pool",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("q_start_loc"),
        py::arg("kv_lens"), py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("fill_kv_cache", &lmport::fill_kv_cache, "write new K/V rows into a float32 bshd block pool",
        py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"));
  m.def("small_linear", &lmport::small_linear, "x W^T (+ b) for a few rows of x (float32)",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("quant_linear", &lmport::quant_linear, "x W^T (+ b), W in lmport's int4/int8 format, x float32 rows",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("bits"),
        py::arg("group_size"), py::arg("bias") = py::none());
  m.def("quant_dequantize", &lmport::quant_dequantize, "W in lmport's int4/int8 format -> float32");
  m.def("ggml_linear", &lmport::ggml_linear, "x W^T (+ b), W in GGUF blocks of the named type, x float32 rows",
        py::arg("x"), py::arg("blocks"), py::arg("type"), py::arg("in_features"), py::arg("bias") = py::none());
  m.def("ggml_dequantize", &lmport::ggml_dequantize, "W in GGUF blocks of the named type -> float32",
        py::arg("blocks"), py::arg("type"), py::arg("in_features"));
  m.def("ggml_types", &lmport::ggml_kernel_types, "the GGUF block types ggml_linear runs");
  m.def("rms_norm", &lmport::rms_norm, "RMSNorm over the last axis (float32)");
  m.def("silu_and_mul", &lmport::silu_and_mul, "silu(gate) * up (float32)");
  m.def("apply_rotary", &lmport::apply_rotary, "rotate-half rotary embedding of q and k (float32)");
}
