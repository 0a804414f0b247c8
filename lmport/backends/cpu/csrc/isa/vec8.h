// SIMD helpers shared by the cpu kernels: eight floats in one register (AVX on
// x86) through GCC/Clang vector extensions; F16C's conversions for float16 rows
// (the compilers' own vector conversion of _Float16 goes one lane at a time).
#pragma once

#include <cstdint>
#include <cstring>
#ifdef __F16C__
#include <immintrin.h>
#endif

namespace lmport {

// The aligned(4) twin lets loads touch rows that are only float-aligned.
typedef float vec8 __attribute__((vector_size(32)));
typedef float vec8_unaligned __attribute__((vector_size(32), aligned(4)));
typedef int32_t vec8i __attribute__((vector_size(32)));

inline vec8 load(const float* p) { return *reinterpret_cast<const vec8_unaligned*>(p); }
inline void store(float* p, vec8 v) { *reinterpret_cast<vec8_unaligned*>(p) = v; }
inline vec8 splat(float x) { return vec8{} + x; }

// Eight IEEE half floats (as their bits) to floats, and back rounding to nearest even (torch's .half()).
inline vec8 load_half(const uint16_t* p) {
#ifdef __F16C__
  return reinterpret_cast<vec8>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  _Float16 h[8];
  std::memcpy(h, p, sizeof(h));
  return vec8{h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]};
#endif
}
inline void store_half(uint16_t* p, vec8 v) {
#ifdef __F16C__
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(reinterpret_cast<__m256>(v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  _Float16 h[8];
  for (int i = 0; i < 8; ++i) h[i] = static_cast<_Float16>(v[i]);
  std::memcpy(p, h, sizeof(h));
#endif
}
inline vec8 vmax(vec8 a, vec8 b) { return a > b ? a : b; }
inline float sum(vec8 v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }
inline float max(vec8 v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// Pairwise sums within each 128-bit half, as AVX's vhaddps.
inline vec8 hadd(vec8 a, vec8 b) {
  return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

// Lane u of the result is the sum of a[u]'s lanes: eight dot products finished at once.
inline vec8 sum8(const vec8* a) {
  const vec8 lo = hadd(hadd(a[0], a[1]), hadd(a[2], a[3]));
  const vec8 hi = hadd(hadd(a[4], a[5]), hadd(a[6], a[7]));
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
}

// exp on eight lanes: Cephes' expf (range reduction by ln 2, degree-5 polynomial), a
// couple of ulp from std::exp; inputs below -88.37 give 0.
inline vec8 exp8(vec8 x) {
  x = x > splat(88.3762626647949f) ? splat(88.3762626647949f) : x;
  x = x < splat(-88.3762626647949f) ? splat(-88.3762626647949f) : x;
  const vec8 fx = x * 1.44269504088896341f + 0.5f;
  vec8 n = __builtin_convertvector(__builtin_convertvector(fx, vec8i), vec8);
  n = n > fx ? n - 1.f : n;  // floor
  x = x - n * 0.693359375f + n * 2.12194440e-4f;
  vec8 y = splat(1.9875691500e-4f);
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * (x * x) + x + 1.f;
  const vec8i pow2n = (__builtin_convertvector(n, vec8i) + 127) << 23;
  return y * reinterpret_cast<const vec8&>(pow2n);
}

}  // namespace lmport
