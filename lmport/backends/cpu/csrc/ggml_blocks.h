// GGUF block types (lmport.weights.ggml) as the cpu kernels decode them: ggml_linear.h describes them.
#pragma once

#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "interleaved_layout.h"
#include "isa/isa.h"

namespace lmport {

namespace ggml_detail {

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return isa::half_to_float(h);
}

// ---- The block types: layouts as ggml-common.h, values as gguf.quants dequantizes them. ----
// kSub: inputs per scale (and min); kMin: whether the type has mins (w = scale * q otherwise).
// The codes are worked on 16 or 32 bytes at a time as GCC vector types (bytewise shifts and masks).

typedef uint8_t u8x16 __attribute__((vector_size(16), aligned(1)));
typedef uint8_t u8x32 __attribute__((vector_size(32), aligned(1)));
typedef int8_t i8x16 __attribute__((vector_size(16), aligned(1)));
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(1)));

inline u8x32 load32(const uint8_t* p) { return *reinterpret_cast<const u8x32*>(p); }
inline u8x16 load16(const uint8_t* p) { return *reinterpret_cast<const u8x16*>(p); }
inline void store(int8_t* q, u8x32 v) { *reinterpret_cast<u8x32*>(q) = v; }
inline void store(int8_t* q, u8x16 v) { *reinterpret_cast<u8x16*>(q) = v; }

// Bit ``from`` of each byte moved to bit ``to`` (the other bits cleared), in 16-bit lanes: GCC shifts
// bytes left by repeated adds otherwise.
inline u8x32 bit_to(u8x32 v, int from, int to) {
  const u16x16 w = reinterpret_cast<u16x16>(v);
  return reinterpret_cast<u8x32>(from >= to ? w >> (from - to) : w << (to - from)) & static_cast<uint8_t>(1 << to);
}

// Bits ``from`` .. ``from + n`` of each byte moved to ``to`` .. ``to + n``, the others cleared.
inline u8x32 bits_to(u8x32 v, int from, int to, int n) {
  const u16x16 w = reinterpret_cast<u16x16>(v);
  return reinterpret_cast<u8x32>(from >= to ? w >> (from - to) : w << (to - from)) &
         static_cast<uint8_t>(((1 << n) - 1) << to);
}

// out[i] = mul * v[i] for 8 unsigned or signed bytes.
inline void scale_bytes(const uint8_t* v, float mul, float* out) {
  const __m256i i = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v)));
  _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_set1_ps(mul), _mm256_cvtepi32_ps(i)));
}
inline void scale_bytes(const int8_t* v, float mul, float* out) {
  const __m256i i = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v)));
  _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_set1_ps(mul), _mm256_cvtepi32_ps(i)));
}

// Byte i of the result is 16 where bit i of ``bits`` is set, else 0 (Q5_0 / Q5_1's fifth bits).
inline u8x32 fifth_bits(uint32_t bits) {
  const u8x32 b = reinterpret_cast<u8x32>(_mm256_set1_epi32(static_cast<int>(bits)));
  const u8x32 spread = __builtin_shufflevector(b, b, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2,
                                               2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const u8x32 bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128,
                     1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  return reinterpret_cast<u8x32>((spread & bit) == bit) & 16;
}

// A 32-input run packed as Q4_0's nibbles (byte j: input j low, j + 16 high), as 32 bytes in input order.
inline u8x32 run_nibbles(const uint8_t* qs) {
  const u8x16 v = load16(qs);
  return __builtin_shufflevector(v & 0xF, v >> 4, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18,
                                 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
}

// d, qh (32 fifth bits), qs (16 bytes of nibbles); w = d (q - 16).
struct Q5_0 {
  static constexpr int kElements = 32, kBytes = 22, kSub = 32;
  static constexpr bool kMin = false, kCodes512 = true;
  static void scales(const uint8_t* b, float* scale, float*) { scale[0] = f16(b); }
  static void decode(const uint8_t* b, int8_t* q, float* scale, float* min) {
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    store(q, (run_nibbles(b + 6) | fifth_bits(qh)) - 16);
    scales(b, scale, min);
  }
#ifdef LMPORT_ISA_AVX512
  // The block's 32 codes as int16, straight from its bytes: the nibbles, less 16 where the fifth bit is clear.
  static __m512i codes512(const uint8_t* b, int) {
    const __m512i both = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(b + 6))));
    const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);  // 0 x 16, 4 x 16
    const __m512i nibbles = _mm512_and_si512(_mm512_srlv_epi16(both, shifts), _mm512_set1_epi16(0xF));
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    return _mm512_mask_sub_epi16(nibbles, _cvtu32_mask32(~qh), nibbles, _mm512_set1_epi16(16));
  }
#endif
};

// d, m, qh, qs as Q5_0; w = d q + m.
struct Q5_1 {
  static constexpr int kElements = 32, kBytes = 24, kSub = 32;
  static constexpr bool kMin = true, kCodes512 = false;
  static void decode(const uint8_t* b, int8_t* q, float* scale, float* min) {
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    store(q, run_nibbles(b + 8) | fifth_bits(qh));
    scale[0] = f16(b);
    min[0] = f16(b + 2);
  }
};

// scales (16 bytes: scale low nibble, min high), qs (64 bytes: input 128 h + 32 s + j in bits 2s of
// byte 32 h + j), d, dmin; w = d sc q - dmin m per 16 inputs.
struct Q2_K {
  static constexpr int kElements = 256, kBytes = 84, kSub = 16;
  static constexpr bool kMin = true, kCodes512 = false;
  static void decode(const uint8_t* b, int8_t* q, float* scale, float* min) {
    const float d = f16(b + 80), dmin = f16(b + 82);
    for (int h = 0; h < 2; ++h) {
      const u8x32 v = load32(b + 16 + 32 * h);
      for (int s = 0; s < 4; ++s) store(q + 128 * h + 32 * s, bits_to(v, 2 * s, 0, 2));
    }
    uint8_t sc[16], m[16];
    *reinterpret_cast<u8x16*>(sc) = load16(b) & 0xF;
    *reinterpret_cast<u8x16*>(m) = load16(b) >> 4;
    for (int i = 0; i < 16; i += 8) {
      scale_bytes(sc + i, d, scale + i);
      scale_bytes(m + i, -dmin, min + i);
    }
  }
};

// hmask (32 bytes: input 32 k + j's high bit is bit k of byte j), qs (2-bit low parts as Q2_K),
// scales (12 bytes: 16 6-bit scales), d; w = d (sc - 32) q, q = low - 4 where the high bit is 0.
struct Q3_K {
  static constexpr int kElements = 256, kBytes = 110, kSub = 16;
  static constexpr bool kMin = false, kCodes512 = false;
  static void decode(const uint8_t* b, int8_t* q, float* scale, float*) {
    const u8x32 hmask = load32(b);
    const uint8_t* sc = b + 96;
    for (int h = 0; h < 2; ++h) {
      const u8x32 v = load32(b + 32 + 32 * h);
      for (int s = 0; s < 4; ++s)   // low - 4 where the high bit is clear
        store(q + 128 * h + 32 * s, bits_to(v, 2 * s, 0, 2) - (bit_to(hmask, 4 * h + s, 2) ^ 4));
    }
    int8_t scales[16];
    for (int i = 0; i < 16; ++i) {
      const int low = i < 8 ? sc[i] & 0xF : sc[i - 8] >> 4, high = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
      scales[i] = static_cast<int8_t>((low | high << 4) - 32);
    }
    const float d = f16(b + 108);
    scale_bytes(scales, d, scale);
    scale_bytes(scales + 8, d, scale + 8);
  }
};

// The 8 6-bit scales and mins of Q4_K and Q5_K (12 bytes), times d and -dmin: the 32-bit word
// shuffle of llama.cpp's q4_K dot product, leaving 8 scales then 8 mins a byte each.
inline void k4_scales(const uint8_t* s, float d, float dmin, float* scale, float* min) {
  uint32_t u[4];
  std::memcpy(u, s, 12);
  constexpr uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
  u[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4);
  const uint32_t mins_low = u[1] & low6;
  u[1] = (u[2] & low4) | (((u[0] >> 6) & low2) << 4);
  u[2] = mins_low;
  u[0] &= low6;
  scale_bytes(reinterpret_cast<const uint8_t*>(u), d, scale);
  scale_bytes(reinterpret_cast<const uint8_t*>(u + 2), -dmin, min);
}

// d, dmin, scales (12 bytes), qs (128 bytes: byte 32 c + j holds input 64 c + j low, 64 c + 32 + j
// high); w = d sc q - dmin m per 32 inputs.
struct Q4_K {
  static constexpr int kElements = 256, kBytes = 144, kSub = 32;
  static constexpr bool kMin = true, kCodes512 = true;
  static void scales(const uint8_t* b, float* scale, float* min) { k4_scales(b + 4, f16(b), f16(b + 2), scale, min); }
  static void decode(const uint8_t* b, int8_t* q, float* scale, float* min) {
    for (int c = 0; c < 4; ++c) {
      const u8x32 v = load32(b + 16 + 32 * c);
      store(q + 64 * c, v & 0xF);
      store(q + 64 * c + 32, bits_to(v, 4, 0, 4));
    }
    scales(b, scale, min);
  }
#ifdef LMPORT_ISA_AVX512
  // Run r's 32 codes as int16: the low (r even) or high (r odd) nibbles of qs bytes 32 (r / 2) .. + 31.
  static __m512i codes512(const uint8_t* b, int r) {
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * (r / 2))));
    return r % 2 ? _mm512_srli_epi16(v, 4) : _mm512_and_si512(v, _mm512_set1_epi16(0xF));
  }
#endif
};

// Q4_K plus qh (32 bytes: input 32 k + j's fifth bit is bit k of byte j).
struct Q5_K {
  static constexpr int kElements = 256, kBytes = 176, kSub = 32;
  static constexpr bool kMin = true, kCodes512 = false;
  static void scales(const uint8_t* b, float* scale, float* min) { k4_scales(b + 4, f16(b), f16(b + 2), scale, min); }
  static void decode(const uint8_t* b, int8_t* q, float* scale, float* min) {
    const u8x32 qh = load32(b + 16);
    for (int c = 0; c < 4; ++c) {
      const u8x32 v = load32(b + 48 + 32 * c);
      store(q + 64 * c, (v & 0xF) | bit_to(qh, 2 * c, 4));
      store(q + 64 * c + 32, bits_to(v, 4, 0, 4) | bit_to(qh, 2 * c + 1, 4));
    }
    scales(b, scale, min);
  }
};

// ql (128 bytes: low nibbles), qh (64 bytes: 2-bit high parts), scales (16 int8), d; per half h
// of 128 inputs, input 128 h + 32 t + j is ql[64 h + 32 (t % 2) + j] >> 4 (t / 2) and
// qh[32 h + j] >> 2 t; w = d sc (q - 32) per 16 inputs.
struct Q6_K {
  static constexpr int kElements = 256, kBytes = 210, kSub = 16;
  static constexpr bool kMin = false, kCodes512 = false;
  static void decode(const uint8_t* b, int8_t* q, float* scale, float*) {
    for (int h = 0; h < 2; ++h) {
      const u8x32 lo0 = load32(b + 64 * h), lo1 = load32(b + 64 * h + 32), hi = load32(b + 128 + 32 * h);
      int8_t* out = q + 128 * h;
      store(out, ((lo0 & 0xF) | bits_to(hi, 0, 4, 2)) - 32);
      store(out + 32, ((lo1 & 0xF) | bits_to(hi, 2, 4, 2)) - 32);
      store(out + 64, (bits_to(lo0, 4, 0, 4) | (hi & 0x30)) - 32);
      store(out + 96, (bits_to(lo1, 4, 0, 4) | bits_to(hi, 6, 4, 2)) - 32);
    }
    const float d = f16(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    scale_bytes(sc, d, scale);
    scale_bytes(sc + 8, d, scale + 8);
  }
};

// 16 nibbles (codes 0 .. 15) as the 16 signed ``levels`` they stand for, in one byte shuffle.
inline u8x16 lookup(i8x16 levels, u8x16 nibbles) {
  return reinterpret_cast<u8x16>(_mm_shuffle_epi8(reinterpret_cast<__m128i>(levels), reinterpret_cast<__m128i>(nibbles)));
}

// IQ4's 16 non-linear levels (llama.cpp's kvalues_iq4nl).
inline u8x16 iq4_levels(u8x16 nibbles) {
  return lookup(i8x16{-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113}, nibbles);
}

// d, qs (16 bytes of nibbles as Q4_0's); w = d level[q].
struct IQ4_NL {
  static constexpr int kElements = 32, kBytes = 18, kSub = 32;
  static constexpr bool kMin = false, kCodes512 = false;
  static void decode(const uint8_t* b, int8_t* q, float* scale, float*) {
    const u8x16 v = load16(b + 2);
    store(q, iq4_levels(v & 0xF));
    store(q + 16, iq4_levels(v >> 4));
    scale[0] = f16(b);
  }
};

// d, scales_h (16 bits: 2 a sub-block), scales_l (4 bytes: a nibble a sub-block), qs (128 bytes: 8
// runs of 32 as IQ4_NL's); w = d (sc - 32) level[q] per 32 inputs.
struct IQ4_XS {
  static constexpr int kElements = 256, kBytes = 136, kSub = 32;
  static constexpr bool kMin = false, kCodes512 = false;
  static void decode(const uint8_t* b, int8_t* q, float* scale, float*) {
    const float d = f16(b);
    uint16_t high;
    std::memcpy(&high, b + 2, 2);
    for (int r = 0; r < 8; ++r) {
      const u8x16 v = load16(b + 8 + 16 * r);
      store(q + 32 * r, iq4_levels(v & 0xF));
      store(q + 32 * r + 16, iq4_levels(v >> 4));
      const int ls = ((b[4 + r / 2] >> (4 * (r % 2))) & 0xF) | ((high >> (2 * r)) & 3) << 4;
      scale[r] = d * static_cast<float>(ls - 32);
    }
  }
};

// MXFP4's 16 e2m1 values doubled (llama.cpp's kvalues_mxfp4).
inline u8x16 mxfp4_levels(u8x16 nibbles) {
  return lookup(i8x16{0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12}, nibbles);
}

// An e8m0 scale byte at half its value, 2^(e - 128) (ggml's GGML_E8M0_TO_FP32_HALF), subnormal below e = 2.
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// e (an e8m0 scale), qs (16 bytes of nibbles as Q4_0's, each an e2m1 code); w = e8m0_half(e) level[q]: a
// power of two times an integer of at most 12, exact in float32.
struct MXFP4 {
  static constexpr int kElements = 32, kBytes = 17, kSub = 32;
  static constexpr bool kMin = false, kCodes512 = false;
  static void decode(const uint8_t* b, int8_t* q, float* scale, float*) {
    const u8x16 v = load16(b + 1);
    store(q, mxfp4_levels(v & 0xF));
    store(q + 16, mxfp4_levels(v >> 4));
    scale[0] = e8m0_half(b[0]);
  }
};

// Calls f(T{}) with the block type named ``name`` (lower case, as lmport.weights.ggml.BLOCK_TYPES): false for
// a name that is none of them.
template <class F>
inline bool with_type(const std::string& name, F&& f) {
  if (name == "q4_k") f(Q4_K{});
  else if (name == "q6_k") f(Q6_K{});
  else if (name == "q5_0") f(Q5_0{});
  else if (name == "q5_k") f(Q5_K{});
  else if (name == "q5_1") f(Q5_1{});
  else if (name == "q3_k") f(Q3_K{});
  else if (name == "q2_k") f(Q2_K{});
  else if (name == "iq4_nl") f(IQ4_NL{});
  else if (name == "iq4_xs") f(IQ4_XS{});
  else if (name == "mxfp4") f(MXFP4{});
  else return false;
  return true;
}

inline std::vector<std::string> type_names() {
  return {"q4_k", "q6_k", "q5_0", "q5_k", "q5_1", "q3_k", "q2_k", "iq4_nl", "iq4_xs", "mxfp4"};
}

// One weight row decoded: K int8 codes, K / kSub scales and mins.
struct RowBuffer {
  std::vector<int8_t> codes;
  std::vector<float> scales, mins;
  explicit RowBuffer(int64_t K) : codes(K + 64), scales(K / 16 + 16), mins(K / 16 + 16, 0.f) {}
};

template <class T>
inline void decode_row(const uint8_t* row, int64_t K, RowBuffer& buf) {
  constexpr int subs = T::kElements / T::kSub;
  for (int64_t i = 0; i < K / T::kElements; ++i)
    T::decode(row + i * T::kBytes, buf.codes.data() + i * T::kElements, buf.scales.data() + i * subs,
              buf.mins.data() + i * subs);
}

template <class T>
inline void decode_row_scales(const uint8_t* row, int64_t K, RowBuffer& buf) {
  constexpr int subs = T::kElements / T::kSub;
  for (int64_t i = 0; i < K / T::kElements; ++i)
    T::scales(row + i * T::kBytes, buf.scales.data() + i * subs, buf.mins.data() + i * subs);
}

// The interleaved layout of a block type (interleaved_rows.h), void for a type without one.
template <class T> struct RowsOf { using type = void; };
template <> struct RowsOf<Q5_0> { using type = interleaved::Q5_0Rows; };
template <> struct RowsOf<Q4_K> { using type = interleaved::Q4_KRows; };
template <> struct RowsOf<Q5_K> { using type = interleaved::Q5_KRows; };
template <> struct RowsOf<Q6_K> { using type = interleaved::Q6_KRows; };

// Row n of a weight of N rows in the file's layout, where its rows are interleaved in groups of
// ``row_group`` (16: interleaved_rows.h) or not (1); ``scratch`` holds row_bytes.
template <class T>
inline const uint8_t* file_row(const uint8_t* w, int64_t N, int64_t row_bytes, int64_t row_group, int64_t n,
                               uint8_t* scratch) {
  using L = typename RowsOf<T>::type;
  if constexpr (!std::is_void_v<L>)
    if (row_group == interleaved::kGroup) return interleaved::file_row<L>(w, N, row_bytes, n, scratch);
  return w + n * row_bytes;
}

// A decoded row as float32: w = scale * q (+ min), as the reference computes it.
template <class T>
inline void expand_row(const RowBuffer& buf, int64_t K, float* out) {
  for (int64_t s = 0; s < K / T::kSub; ++s) {
    const float sc = buf.scales[s], mn = buf.mins[s];
    const int8_t* q = buf.codes.data() + s * T::kSub;
    float* o = out + s * T::kSub;
    for (int j = 0; j < T::kSub; ++j) o[j] = T::kMin ? sc * static_cast<float>(q[j]) + mn : sc * static_cast<float>(q[j]);
  }
}

}  // namespace ggml_detail
}  // namespace lmport
