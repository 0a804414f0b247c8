// SIMD helpers shared by the cpu kernels: eight floats in one register (AVX on
// x86) through GCC/Clang vector extensions, so no intrinsics header is needed.
#pragma once

#include <cstdint>

namespace lmport {

// The aligned(4) twin lets loads touch rows that are only float-aligned.
typedef float vec8 __attribute__((vector_size(32)));
typedef float vec8_unaligned __attribute__((vector_size(32), aligned(4)));

inline vec8 load(const float* p) { return *reinterpret_cast<const vec8_unaligned*>(p); }
inline void store(float* p, vec8 v) { *reinterpret_cast<vec8_unaligned*>(p) = v; }
inline float sum(vec8 v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

}  // namespace lmport
