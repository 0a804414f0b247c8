// quant_linear and quant_dequantize over lmport's int4 / int8 format (quant_linear.h describes the paths).
#include <ATen/Parallel.h>

#include <vector>

#include "kernels.h"
#include "quant_linear.h"

namespace lmport {
namespace kernels {

using namespace quant_detail;

std::vector<int64_t> quant_interleaved_bits() {
  return interleaved::kKernels ? std::vector<int64_t>{4, 8} : std::vector<int64_t>{};
}

bool interleaved_kernels() { return interleaved::kKernels; }

bool interleaved_prefill() { return interleaved::kPrefill; }

bool set_bf16_prefill(bool on) {
#ifdef LMPORT_ISA_AMX
  interleaved::amx::asked() = on;
  return interleaved::amx::enabled();
#else
  return false;
#endif
}

int64_t interleaved_bf16_rows() {
#ifdef LMPORT_ISA_AMX
  return interleaved::amx::enabled() ? interleaved::kDecodeRows + 1 : 0;
#else
  return 0;
#endif
}

int64_t interleaved_group() { return interleaved::kGroup; }

int64_t quant_int8_rows() {
#ifdef LMPORT_ISA_AVX512
  return quant512::kInt8Rows;
#else
  return 0;
#endif
}

void quant_linear(const float* x, int64_t M, int64_t K, const uint8_t* w, const at::Half* sp, const at::Half* mp,
                  int64_t N, int64_t bits, int64_t group_size, int64_t row_group, const float* bp, float* yp) {
#ifdef LMPORT_ISA_AVX512
  // This build's integer path: rows n0 .. n0 + rows of W against every row of x, into ``out`` [M, rows]. With
  // AVX-512 VNNI in int8 arithmetic:
  const auto integer_rows = [&](int64_t n0, int64_t rows, float* out) {
    const int rpg_shift = __builtin_ctzll(group_size / kRun), groups = K / group_size;
    std::vector<quant512::Int8Activations> xs;
    for (int64_t m = 0; m < M; ++m)
      xs.push_back(bits == 4 ? quant512::quantize_int8<4>(x + m * K, K, group_size)
                             : quant512::quantize_int8<8>(x + m * K, K, group_size));
    const uint8_t* wn = w + n0 * (K * bits / 8);
    const at::Half *sn = sp + n0 * groups, *mn0 = mp ? mp + n0 * groups : nullptr;
    const float* bn = bp ? bp + n0 : nullptr;
    if (bits == 4) quant512::linear_int8_rows<4>(xs, wn, sn, mn0, rows, rpg_shift, bn, out);
    else quant512::linear_int8_rows<8>(xs, wn, sn, mn0, rows, rpg_shift, bn, out);
  };
#else
  // on the AVX2 path each row of x on its own, rounded to int16:
  const auto integer_rows = [&](int64_t n0, int64_t rows, float* out) {
    const int64_t runs = K / kRun, groups = K / group_size, row_bytes = K * bits / 8;
    const QuantizedRows xq = quantize_rows(x, M, K);
    // Threads split the output rows, so the packed weight is read once in all.
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      std::vector<float> sd(runs);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t n = n0 + i;
        for (int64_t m = 0; m < M; ++m) {
          const int16_t* xc = xq.codes.data() + m * K;
          const float* xd = xq.scales.data() + m * runs;
          const float* xs = xq.sums.data() + m * runs;
          const at::Half* mins_n = mp ? mp + n * groups : nullptr;
          const float v = bits == 4
              ? dot_row<4>(w + n * row_bytes, sp + n * groups, mins_n, runs, group_size / kRun, xc, xd, xs, sd.data())
              : dot_row<8>(w + n * row_bytes, sp + n * groups, mins_n, runs, group_size / kRun, xc, xd, xs, sd.data());
          out[m * rows + i] = v + (bp ? bp[n] : 0.f);
        }
      }
    });
  };
#endif
  if (row_group != 1) {   // every row of x over the whole groups, and over the rows after them as they are
    const int64_t whole = N / interleaved::kGroup * interleaved::kGroup;
    const auto groups = [&](auto layout) {
      interleaved::linear_groups(layout, x, M, K, w, whole / interleaved::kGroup,
                                 interleaved::kGroup * K * bits / 8, 0, bp, yp, N);
    };
    if (bits == 4) groups(interleaved::QuantRows<4>{sp, mp, K, group_size});
    else groups(interleaved::QuantRows<8>{sp, mp, K, group_size});
    // each row of x on its own, as in the groups: a row's result does not depend on the rows beside it
    interleaved::rows_after_groups(M, N, yp, integer_rows);
    return;
  }
  if (M > kIntegerRows) {
    linear_by_tiles(x, M, K, w, sp, mp, N, group_size, bits, bp, yp);
    return;
  }
#ifdef LMPORT_ISA_AVX512
  static_assert(quant512::kInt8Rows == kIntegerRows, "the int8 path is the only integer path with AVX-512 VNNI");
#endif
  integer_rows(0, N, yp);
}


void quant_dequantize(const uint8_t* w, const at::Half* sp, const at::Half* mp, int64_t N, int64_t K, int64_t bits,
                      int64_t group_size, int64_t row_group, const int64_t* index, int64_t count, float* op) {
  const int64_t groups = K / group_size, row_bytes = K * bits / 8;
  const int64_t whole = row_group == 1 ? 0 : N / interleaved::kGroup * interleaved::kGroup;
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> row(row_bytes);
    std::vector<at::Half> row_scales(groups), row_mins(groups);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = index ? index[i] : i;
      float* out_row = op + i * K;
      if (n >= whole) {
        dequantize_row(w + n * row_bytes, sp + n * groups, mp + n * groups, K, group_size, bits, out_row);
        continue;
      }
      // an interleaved row back in order: its units out of its group's vectors
      const int64_t first = n / interleaved::kGroup * interleaved::kGroup;
      const int r = static_cast<int>(n - first);
      interleaved::unpack_units<4>(w + first * row_bytes, r, static_cast<int>(row_bytes), row.data());
      interleaved::unpack_units<2>(reinterpret_cast<const uint8_t*>(sp + first * groups), r, static_cast<int>(2 * groups),
                                   reinterpret_cast<uint8_t*>(row_scales.data()));
      interleaved::unpack_units<2>(reinterpret_cast<const uint8_t*>(mp + first * groups), r, static_cast<int>(2 * groups),
                                   reinterpret_cast<uint8_t*>(row_mins.data()));
      dequantize_row(row.data(), row_scales.data(), row_mins.data(), K, group_size, bits, out_row);
    }
  });
}

}  // namespace kernels
}  // namespace lmport
