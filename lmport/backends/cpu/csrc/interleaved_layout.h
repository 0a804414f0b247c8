// GGUF blocks with output rows interleaved in groups of 16 (lmport.weights.interleaved lays them out and
// documents the layout): vector lane r is row r, so a block's codes of 16 rows meet x's codes for those
// inputs broadcast to every lane, the 16 rows' scales are one load and their results one store.
//
// Every row of x of a step, a decode step's or a prefill's (each row on its own, while the group's bytes
// stay in L1; a prefill's a chunk of rows at a time whose codes stay in L2). With AVX-512 VNNI, x held as
// two int8 codes per input as isa/avx512/int8_rows.h holds it (hi and lo, as fine as int16): vpdpbusd over the rows'
// unsigned codes and hi, and again over lo, gives each lane's exact int32 sums 256 hi + lo per sub-block.
// On the AVX2 path, x rounded to int16 as its row-by-row kernels round it, a group's rows taken as two
// halves of 8: the codes widened to int16 and vpmaddwd gives the exact int32 sums (see its kernels). Either
// way a type whose codes are offset (Q5_0's q + 16, Q6_K's q + 32, int8's q + 128) takes the offset times
// x's codes summed back off. The sums are scaled in float32 by the rows' scales times x's step; Q4_K's and Q5_K's
// mins meet the float sums of x. The dequantize kernels (an embedding lookup in a tied LM head's table) read a
// row back in the file's layout (file_row).
//
// This file: the layouts and what every instruction set's kernels share; isa/*/interleaved_groups.h the
// group kernels; interleaved_rows.h the loops over groups.
#pragma once

#include <c10/util/Half.h>

#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "isa/isa.h"

namespace lmport {
namespace interleaved {

constexpr int kGroup = 16;

// A block's segment as lmport.weights.interleaved.SEGMENTS gives it: in a group's block it is
// length / unit vectors of 16 units, unit k of rows 0..15. A unit of 0: half a byte.
struct Segment {
  int start, length, unit;
};

// The types, their segments, and where a group's block holds what the kernels read (bytes from its start).
struct Q5_0Rows {   // d, qh (4 bits a unit: vector k masks inputs 4 k .. 4 k + 3), qs
  static constexpr int kElements = 32, kBytes = 22;
  static constexpr Segment kSegments[] = {{0, 2, 2}, {2, 4, 0}, {6, 16, 4}};
  static constexpr int kMasks = 32, kNibbles = 96;
  Q5_0Rows group(int64_t) const { return *this; }   // what group g reads besides its bytes: nothing
};

struct Q4_KRows {   // d, dmin, scales (bytes 0..11 a vector each), qs (vector 8 c + j: bytes 32 c + 4 j ..)
  static constexpr int kElements = 256, kBytes = 144;
  static constexpr Segment kSegments[] = {{0, 2, 2}, {2, 2, 2}, {4, 12, 1}, {16, 128, 4}};
  static constexpr int kMin = 32, kScales = 64, kNibbles = 256;
  Q4_KRows group(int64_t) const { return *this; }   // what group g reads besides its bytes: nothing
};

struct Q5_KRows {   // Q4_K's d, dmin, scales; qh (vector j: bytes 4 j .. 4 j + 3); qs (as Q4_K's)
  static constexpr int kElements = 256, kBytes = 176;
  static constexpr Segment kSegments[] = {{0, 2, 2}, {2, 2, 2}, {4, 12, 1}, {16, 32, 4}, {48, 128, 4}};
  static constexpr int kMin = 32, kScales = 64, kHigh = 256, kNibbles = 768;
  Q5_KRows group(int64_t) const { return *this; }   // what group g reads besides its bytes: nothing
};
static_assert(Q5_KRows::kMin == Q4_KRows::kMin && Q5_KRows::kScales == Q4_KRows::kScales,
              "Q5_K's block starts as Q4_K's: the kernels read both's scales alike");

// Q4_K and Q5_K: 8 sub-blocks of 32 inputs, w = d sc q - dmin m, the same 16 bytes of d, dmin and scales first.
template <class L> constexpr bool kLikeQ4_K = std::is_same_v<L, Q4_KRows> || std::is_same_v<L, Q5_KRows>;

struct Q6_KRows {   // ql (vector k: bytes 4 k ..), qh (likewise), scales (sub-block s a vector), d
  static constexpr int kElements = 256, kBytes = 210;
  static constexpr Segment kSegments[] = {{0, 128, 4}, {128, 64, 4}, {192, 16, 1}, {208, 2, 2}};
  static constexpr int kHigh = 2048, kScales = 3072, kScale = 3328;
  Q6_KRows group(int64_t) const { return *this; }   // what group g reads besides its bytes: nothing
};

// The GGUF block types with an interleaved layout (lmport.weights.interleaved.SEGMENTS).
inline const std::vector<std::string>& type_names() {
  static const std::vector<std::string> names{"q5_0", "q4_k", "q5_k", "q6_k"};
  return names;
}

// Whether this build has the kernels that read interleaved rows: AVX-512 VNNI's, or AVX2's (with FMA and F16C;
// isa/isa.h defines LMPORT_INTERLEAVED).
#ifdef LMPORT_INTERLEAVED
constexpr bool kKernels = true;
#else
constexpr bool kKernels = false;
#endif

// Whether a prefill's rows (more than a decode step's) are best run by these kernels rather than by the weight
// expanded to float32 for a GEMM: with AVX-512 VNNI (vpdpbusd, 64 products an instruction, the codes as they
// are), not on the AVX2 path (vpmaddwd, 16, the codes widened first), where the GEMM is faster.
#ifdef LMPORT_ISA_AVX512
constexpr bool kPrefill = true;
#else
constexpr bool kPrefill = false;
#endif

// Row r's units of a segment of ``length`` bytes (UNIT bytes each) from its vectors ``c``, to ``out``.
template <int UNIT>
inline void unpack_units(const uint8_t* c, int r, int length, uint8_t* out) {
  for (int k = 0; k < length / UNIT; ++k) std::memcpy(out + k * UNIT, c + (k * kGroup + r) * UNIT, UNIT);
}

// Row r's block as the file lays it out (L::kBytes) from its group's block ``c``.
template <class L>
inline void unpack(const uint8_t* c, int r, uint8_t* out) {
  for (const Segment& s : L::kSegments) {
    uint8_t* o = out + s.start;
    switch (s.unit) {
      case 0:   // unit k is bits 4 r .. 4 r + 3 of vector k (8 bytes): two a byte
        for (int k = 0; k < 2 * s.length; k += 2) {
          uint64_t even, odd;
          std::memcpy(&even, c + 8 * k, 8);
          std::memcpy(&odd, c + 8 * k + 8, 8);
          o[k / 2] = static_cast<uint8_t>(((even >> (4 * r)) & 0xF) | ((odd >> (4 * r)) & 0xF) << 4);
        }
        break;
      case 1: unpack_units<1>(c, r, s.length, o); break;
      case 2: unpack_units<2>(c, r, s.length, o); break;
      default: unpack_units<4>(c, r, s.length, o); break;
    }
    c += kGroup * s.length;
  }
}

// Row n of a weight of N rows whose whole groups are interleaved (the rows after them as the file lays
// them out), in the file's layout: unpacked into ``scratch`` (row_bytes) where interleaved.
template <class L>
inline const uint8_t* file_row(const uint8_t* w, int64_t N, int64_t row_bytes, int64_t n, uint8_t* scratch) {
  if (n >= N / kGroup * kGroup) return w + n * row_bytes;
  const uint8_t* group = w + n / kGroup * kGroup * row_bytes;
  for (int64_t i = 0; i < row_bytes / L::kBytes; ++i)
    unpack<L>(group + i * kGroup * L::kBytes, static_cast<int>(n % kGroup), scratch + i * L::kBytes);
  return scratch;
}

// lmport's int4 / int8 format (lmport.weights.format), each tensor interleaved over its whole row: a group
// of 16 rows' codes (``q``: vector k, lane r, is row r's bytes 4 k .. 4 k + 3), scales and mins (``scales``,
// ``mins``: vector g is the 16 rows' group g; mins null where all are zero); w = scale q + min per group of
// ``group_size`` inputs. int4 codes are 0..15, a run's 16 bytes holding inputs j (low nibble) and j + 16;
// int8 codes are signed, taken as q + 128 (less 128 times x's codes summed).
template <int BITS>
struct QuantRows {
  const at::Half *scales, *mins;
  int64_t K, group_size;
  QuantRows group(int64_t g) const {   // group g's scales and mins
    const int64_t at = kGroup * (K / group_size) * g;
    return {scales + at, mins ? mins + at : nullptr, K, group_size};
  }
};

// The next group's block, fetched into L2 while this one is worked on (none: ``next`` null). Not for int8
// codes with AVX-512: that kernel does the least work a byte, the hardware prefetchers keep ahead of it
// alone, and the prefetches only cost it load slots (docs/weight-quantization.md, "Prefetching").
inline void prefetch(const uint8_t* next, int64_t bytes) {
  if (next != nullptr)
    for (int64_t line = 0; line < bytes; line += 64) isa::prefetch_l2(next + line);
}

// Part ``part`` of ``parts`` of those ``bytes``' cache lines: the AVX2 kernels ask for the next block a part with
// each stretch of their own block's work. Asked for all at once at the block's start, the lines left a
// first-generation Zen's kernels waiting on memory (docs/weight-quantization.md, "Prefetching").
inline void prefetch_part(const uint8_t* next, int64_t bytes, int part, int parts) {
  if (next == nullptr) return;
  const int64_t lines = (bytes + 63) / 64;
  for (int64_t line = part * lines / parts; line < (part + 1) * lines / parts; ++line) isa::prefetch_l2(next + 64 * line);
}

}  // namespace interleaved
}  // namespace lmport
