// Relaying a weight's rows into groups of 16 at load (interleaved_layout.h): lmport.weights.interleaved lays the
// groups out in torch and documents the layout; this is the same relay as one pass over the bytes, the groups
// split over the threads.
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "interleaved_layout.h"
#include "kernels.h"

namespace lmport {
namespace kernels {

namespace {

// Unit k of rows 0..15 of a segment (rows ``stride`` bytes apart) as vector k, for each k.
template <int UNIT>
void pack_units(const uint8_t* rows, int64_t stride, int64_t length, uint8_t* out) {
  for (int64_t k = 0; k < length / UNIT; ++k)
    for (int r = 0; r < interleaved::kGroup; ++r)
      std::memcpy(out + (k * interleaved::kGroup + r) * UNIT, rows + r * stride + k * UNIT, UNIT);
}

// Half a byte a unit: vector k (8 bytes) holds row r's bits 4 k .. 4 k + 3 as its bits 4 r .. 4 r + 3.
void pack_nibbles(const uint8_t* rows, int64_t stride, int64_t length, uint8_t* out) {
  for (int64_t k = 0; k < 2 * length; ++k) {
    uint64_t vector = 0;
    for (int r = 0; r < interleaved::kGroup; ++r)
      vector |= static_cast<uint64_t>((rows[r * stride + k / 2] >> (4 * (k % 2))) & 0xF) << (4 * r);
    std::memcpy(out + 8 * k, &vector, 8);
  }
}

}  // namespace

void interleave_groups(const uint8_t* src, uint8_t* dst, int64_t groups, int64_t row_bytes, const int64_t* segments,
                       int64_t count, int64_t block_bytes) {
  const int64_t group_bytes = interleaved::kGroup * row_bytes, blocks = row_bytes / block_bytes;
  const bool in_place = src == dst;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> scratch(in_place ? group_bytes : 0);
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* in = src + g * group_bytes;
      uint8_t* out = dst + g * group_bytes;
      if (in_place) in = static_cast<const uint8_t*>(std::memcpy(scratch.data(), in, group_bytes));
      for (int64_t b = 0; b < blocks; ++b)
        for (const int64_t* s = segments; s < segments + 3 * count; s += 3) {   // start, length, unit
          const uint8_t* rows = in + b * block_bytes + s[0];
          uint8_t* vectors = out + interleaved::kGroup * (b * block_bytes + s[0]);
          switch (s[2]) {
            case 0: pack_nibbles(rows, row_bytes, s[1], vectors); break;
            case 1: pack_units<1>(rows, row_bytes, s[1], vectors); break;
            case 2: pack_units<2>(rows, row_bytes, s[1], vectors); break;
            default: pack_units<4>(rows, row_bytes, s[1], vectors); break;
          }
        }
    }
  });
}

}  // namespace kernels
}  // namespace lmport
