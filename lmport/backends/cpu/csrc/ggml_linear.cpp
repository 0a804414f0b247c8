// ggml_linear and ggml_dequantize over GGUF blocks (ggml_linear.h describes the paths).
#include <ATen/Parallel.h>

#include <string>
#include <vector>

#include "ggml_linear.h"
#include "kernels.h"

namespace lmport {
namespace kernels {

using namespace ggml_detail;

bool ggml_block_shape(const std::string& type, int64_t& elements, int64_t& bytes) {
  return with_type(type, [&](auto t) {
    using T = decltype(t);
    elements = T::kElements, bytes = T::kBytes;
  });
}

void ggml_linear(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, const std::string& type,
                 int64_t row_group, const float* bp, float* y) {
  with_type(type, [&](auto t) {
    using T = decltype(t);
#ifdef LMPORT_INTERLEAVED
    if (row_group != 1) {   // a type with a layout (the binding checked the row group)
      if constexpr (!std::is_void_v<typename RowsOf<T>::type>)
        linear_interleaved<T>(x, M, K, w, N, bp, y);
      return;
    }
#endif
    if (M > kIntegerRows) {
      linear_by_tiles<T>(x, M, K, w, N, bp, y);
#ifdef LMPORT_ISA_AVX512
    } else if (kInt8<T> && M <= quant512::kInt8Rows) {
      linear_int8<T>(x, M, K, w, N, bp, y);
#endif
    } else {
      const Activations a = quantize(x, M, K);
      linear_integer<T>(a, M, w, N, bp, y);
    }
  });
}

void ggml_head_linear(const float* x, int64_t heads, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                      const std::string& type, int64_t row_group, float* y) {
  int64_t elements = 0, bytes = 0;
  ggml_block_shape(type, elements, bytes);
  const int64_t row_bytes = K / elements * bytes;
  for (int64_t h = 0; h < heads; ++h)
    ggml_linear(x + h * M * K, M, K, w + h * N * row_bytes, N, type, row_group, nullptr, y + h * M * N);
}

void ggml_dequantize(const uint8_t* w, int64_t N, int64_t K, const std::string& type, int64_t row_group,
                     const int64_t* index, int64_t count, float* op) {
  with_type(type, [&](auto t) {
    using T = decltype(t);
    const int64_t row_bytes = K / T::kElements * T::kBytes;
    at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
      RowBuffer buf(K);
      std::vector<uint8_t> scratch(row_bytes);
      for (int64_t i = begin; i < end; ++i) {
        decode_row<T>(file_row<T>(w, N, row_bytes, row_group, index ? index[i] : i, scratch.data()), K, buf);
        expand_row<T>(buf, K, op + i * K);
      }
    });
  });
}

std::vector<std::string> ggml_types() { return type_names(); }

std::vector<std::string> ggml_interleaved_types() { return interleaved_types(); }

std::vector<std::string> ggml_row_group_types() { return interleaved::type_names(); }

std::vector<std::string> ggml_int8_types() {
#ifdef LMPORT_ISA_AVX512
  return {"q5_0", "q4_k", "q5_k", "q6_k"};
#else
  return {};
#endif
}

}  // namespace kernels
}  // namespace lmport
