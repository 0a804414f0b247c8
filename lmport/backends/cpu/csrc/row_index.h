// Rows of a weight picked by index, as an embedding lookup asks for them (the dequantize kernels' ``rows``).
#pragma once

#include <torch/extension.h>

namespace lmport {

// ``rows`` as contiguous int64, each checked to be a row of the N a weight has (an undefined tensor: none).
inline torch::Tensor checked_rows(const c10::optional<torch::Tensor>& rows, int64_t N, const char* kernel) {
  if (!rows) return torch::Tensor();
  TORCH_CHECK(rows->dim() == 1, kernel, ": rows must be 1-d indices, got ", rows->sizes());
  const torch::Tensor index = rows->to(torch::kLong).contiguous();
  const int64_t* p = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < index.numel(); ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < N, kernel, ": row ", p[i], " of a weight with ", N, " rows");
  return index;
}

}  // namespace lmport
