// lmport's int4 / int8 weight format as the kernels read it (docs/weight-quantization.md).
#pragma once

namespace lmport {
namespace quant_detail {

constexpr int kRun = 32;  // inputs per packing run (and per activation scale)

}  // namespace quant_detail
}  // namespace lmport
