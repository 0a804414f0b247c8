// Linear layers over GGUF block weights as the file stores them (lmport.weights.ggml: each weight
// row is in / elements blocks laid out as llama.cpp's block_q4_K and friends, ggml-common.h):
// y = x W^T (+ b) for float32 rows x.
//
// Each block type is one small struct whose decode() turns a block into int8 codes in input order
// and, per sub-block of 16 or 32 inputs, a float scale and min, with w = scale * q + min computed as
// gguf's reference dequantizer does (gguf.quants, llama.cpp's dequantize_row_*). scale * q is exact in
// float32 for every type here (a float16 times integers of 23 bits at most in all), so only the min's
// add rounds, as in the reference: the weights expand bit for bit. Everything else is shared:
//
// - Q5_0, Q4_K and Q6_K rows interleaved in groups of 16 (a model's linears, as the cpu backend holds
//   them): every row of x a step passes, by interleaved_rows.h's kernels.
// - Up to 8 rows of x (decode) over Q5_0, Q4_K and Q6_K with AVX-512 VNNI: x held as two int8
//   codes per input (as fine as int16), the blocks' codes unpacked to bytes a run pair at a time and
//   dotted with each by vpdpbusd (int8_rows.h), 8 weight rows at a time.
// - Otherwise up to kIntegerRows rows of x (decode): x is rounded to int16 per run of 32 inputs, as in
//   quant_linear.h; threads split the output rows, each weight row is decoded into a buffer that stays in L1 and
//   dotted with every row of x in integer arithmetic (512 bits wide with AVX-512 VNNI, else AVX2),
//   accumulated in float32 per run with the sub-block's scale times x's step. Each weight byte is
//   read once a call, and rows are fetched ahead into L2 as they are in quant_linear.h.
// - More rows (a batched decode step): tiles of 4 weight rows expanded to float32 in cache and run
//   by linear.h's small-batch kernel.
// - ggml_dequantize: the whole weight as float32, for the BLAS (prefill).
// The row-by-row paths read interleaved rows back in the file's layout (file_row).
#pragma once

#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "linear.h"
#include "quant_linear.h"   // defines LMPORT_QUANT_AVX512 where the CPU has AVX-512 VNNI, before:
#include "interleaved_rows.h"
#include "row_index.h"

namespace lmport {

namespace ggml_detail {

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
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
#ifdef LMPORT_QUANT_AVX512
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
#ifdef LMPORT_QUANT_AVX512
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
  static void decode(const uint8_t* b, int8_t* q, float* scale, float* min) {
    const u8x32 qh = load32(b + 16);
    for (int c = 0; c < 4; ++c) {
      const u8x32 v = load32(b + 48 + 32 * c);
      store(q + 64 * c, (v & 0xF) | bit_to(qh, 2 * c, 4));
      store(q + 64 * c + 32, bits_to(v, 4, 0, 4) | bit_to(qh, 2 * c + 1, 4));
    }
    k4_scales(b + 4, f16(b), f16(b + 2), scale, min);
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

// IQ4's 16 non-linear levels (llama.cpp's kvalues_iq4nl), looked up 16 nibbles at a time.
inline u8x16 iq4_levels(u8x16 nibbles) {
  const i8x16 levels = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
  return reinterpret_cast<u8x16>(_mm_shuffle_epi8(reinterpret_cast<__m128i>(levels), reinterpret_cast<__m128i>(nibbles)));
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

// Calls f(T{}) with the block type named ``name`` (lower case, as lmport.weights.ggml.BLOCK_TYPES).
template <class F>
inline void with_type(const std::string& name, F&& f) {
  if (name == "q4_k") f(Q4_K{});
  else if (name == "q6_k") f(Q6_K{});
  else if (name == "q5_0") f(Q5_0{});
  else if (name == "q5_k") f(Q5_K{});
  else if (name == "q5_1") f(Q5_1{});
  else if (name == "q3_k") f(Q3_K{});
  else if (name == "q2_k") f(Q2_K{});
  else if (name == "iq4_nl") f(IQ4_NL{});
  else if (name == "iq4_xs") f(IQ4_XS{});
  else TORCH_CHECK(false, "ggml_linear: no kernel for GGML type '", name, "'");
}

inline std::vector<std::string> type_names() {
  return {"q4_k", "q6_k", "q5_0", "q5_k", "q5_1", "q3_k", "q2_k", "iq4_nl", "iq4_xs"};
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

// ---- The integer path (decode). ----

constexpr int kRun = 32;               // inputs per activation step
constexpr int64_t kIntegerRows = 8;    // rows of x up to which the integer path runs
constexpr int64_t kAhead = 16;         // weight rows fetched ahead (into L2), as in quant_linear.h

// x [M, K] rounded to int16 per run of 32 (step max|x_run| / 32767, rounded to nearest even as
// std::nearbyint does); per sub-block of 16 and of 32 inputs the step of its run and the sum of x.
struct Activations {
  std::vector<int16_t> codes;
  std::vector<float> step16, step32, sum16, sum32;
  int64_t K;
  template <int SUB> const float* step(int64_t m) const {
    return SUB == 16 ? step16.data() + m * K / 16 : step32.data() + m * K / 32;
  }
  template <int SUB> const float* sum(int64_t m) const {
    return SUB == 16 ? sum16.data() + m * K / 16 : sum32.data() + m * K / 32;
  }
};

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline Activations quantize(const float* x, int64_t M, int64_t K) {
  const int64_t runs = M * K / kRun;
  Activations a{std::vector<int16_t>(M * K), std::vector<float>(2 * runs), std::vector<float>(runs),
                std::vector<float>(2 * runs), std::vector<float>(runs), K};
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t r = 0; r < runs; ++r) {
    const float* v = x + r * kRun;
    __m256 p[4];
    for (int i = 0; i < 4; ++i) p[i] = _mm256_loadu_ps(v + 8 * i);
    const float amax = hmax(_mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, p[0]), _mm256_andnot_ps(sign, p[1])),
                                          _mm256_max_ps(_mm256_andnot_ps(sign, p[2]), _mm256_andnot_ps(sign, p[3]))));
    const float lo = quant_detail::hsum(_mm256_add_ps(p[0], p[1])), hi = quant_detail::hsum(_mm256_add_ps(p[2], p[3]));
    const float d = amax / 32767.f, inv = d > 0.f ? 1.f / d : 0.f;
    const __m256 scale = _mm256_set1_ps(inv);
    for (int i = 0; i < 4; i += 2) {
      const __m256i c = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(p[i], scale)),
                                           _mm256_cvtps_epi32(_mm256_mul_ps(p[i + 1], scale)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.codes.data() + r * kRun + 8 * i),
                          _mm256_permute4x64_epi64(c, _MM_SHUFFLE(3, 1, 2, 0)));
    }
    a.step16[2 * r] = a.step16[2 * r + 1] = a.step32[r] = d;
    a.sum16[2 * r] = lo;
    a.sum16[2 * r + 1] = hi;
    a.sum32[r] = lo + hi;
  }
  return a;
}

// A tile of MT rows of x (from m0) against RT weight rows (``rows``: their blocks; ``w``: their scales and
// mins, and their codes unless the type unpacks them from the blocks itself):
// out[j * RT + r] = sum_k x[m0 + j, k] w_r[k]. ``folded`` is scratch for MT * RT * K / kSub floats: each
// sub-block's scale times x's step there.
template <class T, int MT, int RT>
inline void dot_tile(const uint8_t* const* rows, const RowBuffer* w, const Activations& a, int64_t m0, float* folded,
                     float* out) {
  constexpr int SUB = T::kSub, kAcc = MT * RT;
  const int64_t K = a.K, runs = K / kRun, subs = K / SUB;
  for (int j = 0; j < MT; ++j)
    for (int r = 0; r < RT; ++r) {
      const float* step = a.step<SUB>(m0 + j);
      float* f = folded + (j * RT + r) * subs;
      for (int64_t s = 0; s < subs; ++s) f[s] = w[r].scales[s] * step[s];
    }
#ifdef LMPORT_QUANT_AVX512
  // A run's 32 codes widened to int16 in one register; the products summed in pairs leave inputs 0..15
  // in lanes 0..7 and 16..31 in lanes 8..15, the halves of a run that 16-input sub-blocks scale apart.
  __m512 acc0[kAcc], acc1[kAcc];   // even and odd runs: consecutive runs do not wait on each other's FMA
  for (int i = 0; i < kAcc; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  constexpr int runs_per_block = T::kElements / kRun;
  const auto run = [&](int64_t b, __m512* acc) {
    __m512i wq[RT];
    for (int r = 0; r < RT; ++r) {
      if constexpr (T::kCodes512)
        wq[r] = T::codes512(rows[r] + b / runs_per_block * T::kBytes, static_cast<int>(b % runs_per_block));
      else
        wq[r] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r].codes.data() + b * kRun)));
    }
    for (int j = 0; j < MT; ++j) {
      const __m512i xq = _mm512_loadu_si512(a.codes.data() + (m0 + j) * K + b * kRun);
      for (int r = 0; r < RT; ++r) {
        const __m512 d = _mm512_cvtepi32_ps(_mm512_madd_epi16(wq[r], xq));   // a run's sums, nothing to add to
        const float* f = folded + (j * RT + r) * subs;
        __m512& sum = acc[j * RT + r];
        if constexpr (SUB == 32) {
          sum = _mm512_fmadd_ps(d, _mm512_set1_ps(f[b]), sum);
        } else {   // each half of the lanes with its sub-block's scale
          sum = _mm512_mask3_fmadd_ps(d, _mm512_set1_ps(f[2 * b]), sum, 0x00FF);
          sum = _mm512_mask3_fmadd_ps(d, _mm512_set1_ps(f[2 * b + 1]), sum, 0xFF00);
        }
      }
    }
  };
  int64_t b = 0;
  for (; b + 1 < runs; b += 2) {
    run(b, acc0);
    run(b + 1, acc1);
  }
  if (b < runs) run(b, acc0);
  for (int j = 0; j < MT; ++j)
    for (int r = 0; r < RT; ++r) {
      __m512 v = _mm512_add_ps(acc0[j * RT + r], acc1[j * RT + r]);
      if constexpr (T::kMin) {   // the mins meet the sums of x over their sub-blocks
        const float* xs = a.sum<SUB>(m0 + j);
        for (int64_t s = 0; s < subs; s += 16) {
          const __mmask16 k = quant512::tail_mask(subs - s);
          v = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, w[r].mins.data() + s), _mm512_maskz_loadu_ps(k, xs + s), v);
        }
      }
      out[j * RT + r] = _mm512_reduce_add_ps(v);
    }
#else
  static_assert(RT == 1, "the AVX2 path takes one weight row at a time (16 registers)");
  const int8_t* q = w[0].codes.data();
  __m256 acc0[MT], acc1[MT];
  for (int j = 0; j < MT; ++j) acc0[j] = acc1[j] = _mm256_setzero_ps();
  const auto run = [&](int64_t b, __m256* acc, __m256* other) {
    const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * kRun)));
    const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * kRun + 16)));
    for (int j = 0; j < MT; ++j) {
      const int16_t* x = a.codes.data() + (m0 + j) * K + b * kRun;
      const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
      const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
      const float* f = folded + j * subs;
      if constexpr (SUB == 32) {
        const __m256i d = quant_detail::dot_s16(quant_detail::dot_s16(_mm256_setzero_si256(), lo, xlo), hi, xhi);
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(f[b]), acc[j]);
      } else {   // a scale each half
        const __m256i d0 = quant_detail::dot_s16(_mm256_setzero_si256(), lo, xlo);
        const __m256i d1 = quant_detail::dot_s16(_mm256_setzero_si256(), hi, xhi);
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_set1_ps(f[2 * b]), acc[j]);
        other[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_set1_ps(f[2 * b + 1]), other[j]);
      }
    }
  };
  int64_t b = 0;
  for (; b + 1 < runs; b += 2) {
    run(b, acc0, acc1);
    run(b + 1, acc1, acc0);
  }
  if (b < runs) run(b, acc0, acc1);
  for (int j = 0; j < MT; ++j) {
    float v = quant_detail::hsum(_mm256_add_ps(acc0[j], acc1[j]));
    if constexpr (T::kMin) {
      const float* xs = a.sum<SUB>(m0 + j);
      for (int64_t s = 0; s < subs; ++s) v += w[0].mins[s] * xs[s];
    }
    out[j] = v;
  }
#endif
}

// One row of x (single-stream decode) takes the weight rows kRowBlock at a time: x's runs are loaded
// once for them and their sums are independent. More rows of x take one weight row at a time against
// up to kTile rows of x.
#ifdef LMPORT_QUANT_AVX512
constexpr int kRowBlock = 4;
#else
constexpr int kRowBlock = 1;
#endif
constexpr int kTile = 4;

template <class T>
inline void linear_integer(const Activations& a, int64_t M, const uint8_t* w, int64_t N, const float* bias, float* y) {
  const int64_t K = a.K, row_bytes = K / T::kElements * T::kBytes;
  const int RT = M == 1 ? kRowBlock : 1;
  at::parallel_for(0, (N + RT - 1) / RT, 16 / RT, [&](int64_t begin, int64_t end) {
    const int64_t first = begin * RT, last = std::min(N, end * RT);   // this thread's weight rows
    // The first rows are asked for at once rather than missed one after another.
    for (int64_t off = 0; off < std::min(last - first, kAhead) * row_bytes; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + first * row_bytes + off), _MM_HINT_T1);
    std::vector<RowBuffer> bufs(RT, RowBuffer(K));
    std::vector<float> folded(kTile * kRowBlock * K / 16 + 16);
    float out[kTile * kRowBlock];
    for (int64_t n = first; n < last; n += RT) {
      const int64_t ahead = n + RT + kAhead - 1;   // the rows kAhead ahead of this block's
      for (int64_t off = 0; ahead < last && off < RT * row_bytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w + (ahead - RT + 1) * row_bytes + off), _MM_HINT_T1);
      const int valid = static_cast<int>(std::min<int64_t>(RT, N - n));
      const uint8_t* rows[kRowBlock];
      for (int r = 0; r < RT; ++r) {   // past the weight's end the last row again, its sums not stored
        rows[r] = w + (n + std::min(r, valid - 1)) * row_bytes;
#ifdef LMPORT_QUANT_AVX512
        if constexpr (T::kCodes512)   // the codes are unpacked from the blocks as the dot products need them
          decode_row_scales<T>(rows[r], K, bufs[r]);
        else
#endif
          decode_row<T>(rows[r], K, bufs[r]);
      }
      if (RT > 1) {
        dot_tile<T, 1, kRowBlock>(rows, bufs.data(), a, 0, folded.data(), out);
        for (int r = 0; r < valid; ++r) y[n + r] = out[r] + (bias ? bias[n + r] : 0.f);
        continue;
      }
      for (int64_t m0 = 0; m0 < M; m0 += kTile) {
        const int64_t mt = std::min<int64_t>(kTile, M - m0);
        switch (mt) {
          case 4: dot_tile<T, 4, 1>(rows, bufs.data(), a, m0, folded.data(), out); break;
          case 3: dot_tile<T, 3, 1>(rows, bufs.data(), a, m0, folded.data(), out); break;
          case 2: dot_tile<T, 2, 1>(rows, bufs.data(), a, m0, folded.data(), out); break;
          default: dot_tile<T, 1, 1>(rows, bufs.data(), a, m0, folded.data(), out); break;
        }
        for (int64_t j = 0; j < mt; ++j) y[(m0 + j) * N + n] = out[j] + (bias ? bias[n] : 0.f);
      }
    }
  });
}

#ifdef LMPORT_QUANT_AVX512
// ---- Up to 8 rows of x (decode) in int8 arithmetic (int8_rows.h) for the types of a Q4_K_M
// file: Q5_0 (its 576-wide rows), Q4_K and Q6_K. Each gives its run pairs' codes as unsigned bytes. ----

// Two Q5_0 blocks' 32 + 32 codes q (0..31, w = d (q - 16)) in input order: both blocks' 16 bytes side by
// side, their low nibbles (inputs 0..15) and high nibbles (16..31) interleaved 16 bytes at a time, the
// fifth bits (one 32-bit word a block, input order) adding 16. An odd last run is paired with itself
// against x's zeros.
struct Q5_0Int8 {
  static constexpr int kOffset = 16, kSubs = 2;
  static constexpr bool kInlineScales = true;
  // The two blocks' d times x's steps, from the blocks being dotted: folding them beforehand, a block at a
  // time, cost as much again as the dot products.
  static __m128 scales(const uint8_t* row, int64_t p, int64_t runs, __m128 steps) {
    const uint8_t* first = row + 2 * p * Q5_0::kBytes;
    const uint8_t* second = 2 * p + 1 < runs ? first + Q5_0::kBytes : first;
    uint16_t d0, d1;
    std::memcpy(&d0, first, 2);
    std::memcpy(&d1, second, 2);
    return _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(d0 | static_cast<int>(d1) << 16)), steps);
  }
  static __m512i lanes() { return _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1); }
  static __m512i pair(const uint8_t* row, int64_t p, int64_t runs) {
    const uint8_t* first = row + 2 * p * Q5_0::kBytes;
    const uint8_t* second = 2 * p + 1 < runs ? first + Q5_0::kBytes : first;
    const __m256i raw = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(second + 6),
                                            reinterpret_cast<const __m128i*>(first + 6));
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
    // [first lo, first hi, second lo, second hi] in 64-bit words of [lo, hi]
    const __m512i order = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i codes = _mm512_permutex2var_epi64(_mm512_castsi256_si512(lo), order, _mm512_castsi256_si512(hi));
    uint32_t h0, h1;
    std::memcpy(&h0, first + 2, 4);
    std::memcpy(&h1, second + 2, 4);
    return _mm512_mask_add_epi8(codes, _cvtu64_mask64(h0 | uint64_t{h1} << 32), codes, _mm512_set1_epi8(16));
  }
};

// Q4_K's runs 2c and 2c + 1 of a block are the low and high nibbles of its qs bytes 32 c .. 32 c + 31:
// input order as they are; no offset (the mins are the rows' extra).
struct Q4_KInt8 {
  static constexpr int kOffset = 0, kSubs = 2;
  static constexpr bool kInlineScales = false;
  static __m128 scales(const uint8_t*, int64_t, int64_t, __m128) { return _mm_setzero_ps(); }
  static __m512i lanes() { return _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1); }
  static __m512i pair(const uint8_t* row, int64_t p, int64_t) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + p / 4 * Q4_K::kBytes + 16 + 32 * (p % 4)));
    const __m256i mask = _mm256_set1_epi8(0x0F);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, mask)),
                              _mm256_and_si256(_mm256_srli_epi16(v, 4), mask), 1);
  }
};

// Q6_K's pair q of a block (half h = q / 2, t = q % 2): the low (t = 0) or high (t = 1) nibbles of ql
// bytes 64 h .. 64 h + 63, with bits 4 t, 4 t + 1 (first run) and 4 t + 2, 4 t + 3 (second) of qh bytes
// 32 h .. 32 h + 31 on top; codes 0..63 for w = d sc (q - 32), a scale every 16 inputs.
struct Q6_KInt8 {
  static constexpr int kOffset = 32, kSubs = 4;
  static constexpr bool kInlineScales = false;
  static __m128 scales(const uint8_t*, int64_t, int64_t, __m128) { return _mm_setzero_ps(); }
  static __m512i lanes() { return _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3); }
  static __m512i pair(const uint8_t* row, int64_t p, int64_t) {
    const uint8_t* b = row + p / 4 * Q6_K::kBytes;
    const int h = static_cast<int>(p % 4) / 2, t = static_cast<int>(p % 2);
    const __m512i ql = _mm512_loadu_si512(b + 64 * h);
    const __m512i low = _mm512_and_si512(t ? _mm512_srli_epi16(ql, 4) : ql, _mm512_set1_epi8(0x0F));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m512i shifts = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(4 * t)),
                                              _mm256_set1_epi16(static_cast<int16_t>(4 * t + 2)), 1);
    const __m512i two = _mm512_and_si512(_mm512_srlv_epi16(_mm512_inserti64x4(_mm512_castsi256_si512(qh), qh, 1), shifts),
                                         _mm512_set1_epi8(0x03));
    return _mm512_or_si512(low, _mm512_slli_epi16(two, 4));
  }
};

// y [M, N] for a few rows of x over T's blocks, T one of the three above's types.
template <class T>
inline void linear_int8(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, const float* bias, float* y) {
  using Codes = std::conditional_t<std::is_same_v<T, Q5_0>, Q5_0Int8,
                                   std::conditional_t<std::is_same_v<T, Q4_K>, Q4_KInt8, Q6_KInt8>>;
  using int8_rows::kRowBlock;
  std::vector<int8_rows::Activations> xs;
  for (int64_t m = 0; m < M; ++m) xs.push_back(int8_rows::quantize(x + m * K, K));
  const int64_t blocks = K / T::kElements, row_bytes = blocks * T::kBytes, subs = xs[0].pairs * Codes::kSubs;
  // Per row of the K-quants: each sub-block's scale times x's step for its run, and the mins times x's run
  // sums, eight sub-blocks a vector (scalar, this costs as much as the dot products). Q5_0 gives its scales
  // inline (Q5_0Int8::scales).
  const auto fold = [&](const int8_rows::Activations& a, int64_t n, int valid, float* folded, float* extra) {
    if constexpr (Codes::kInlineScales) return;   // Q5_0: its scales are read as its blocks are dotted
    // steps and sums as locals: read through ``a``, every store to ``folded`` would reload them.
    const float* steps = a.run_steps.data();
    const float* sums = a.run_sums.data();
    for (int r = 0; r < kRowBlock; ++r) {
      float* f = folded + r * subs;
      if (r >= valid) {
        std::fill(f, f + subs, 0.f);
        continue;
      }
      const uint8_t* row = w + (n + r) * row_bytes;
      __m256 mins = _mm256_setzero_ps();
      for (int64_t i = 0; i < blocks; ++i) {
        const uint8_t* block = row + i * T::kBytes;
        if constexpr (std::is_same_v<T, Q4_K>) {   // 8 sub-blocks of 32: a run each
          float scale[8], min[8];
          T::scales(block, scale, min);
          _mm256_storeu_ps(f + 8 * i, _mm256_mul_ps(_mm256_loadu_ps(scale), _mm256_loadu_ps(steps + 8 * i)));
          mins = _mm256_fmadd_ps(_mm256_loadu_ps(min), _mm256_loadu_ps(sums + 8 * i), mins);
        } else {   // Q6_K: 16 sub-blocks of 16, two a run
          float scale[16];
          const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
          scale_bytes(sc, f16(block + 208), scale);
          scale_bytes(sc + 8, f16(block + 208), scale + 8);
          const __m256 run = _mm256_loadu_ps(steps + 8 * i);
          const __m256 lo = _mm256_permutevar8x32_ps(run, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
          const __m256 hi = _mm256_permutevar8x32_ps(run, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
          _mm256_storeu_ps(f + 16 * i, _mm256_mul_ps(_mm256_loadu_ps(scale), lo));
          _mm256_storeu_ps(f + 16 * i + 8, _mm256_mul_ps(_mm256_loadu_ps(scale + 8), hi));
        }
      }
      if constexpr (T::kMin) extra[r] = quant_detail::hsum(mins);
    }
  };
  int8_rows::linear<Codes>(xs, w, row_bytes, N, fold, bias, y);
}

// The types linear_int8 runs.
template <class T>
constexpr bool kInt8 = std::is_same_v<T, Q5_0> || std::is_same_v<T, Q4_K> || std::is_same_v<T, Q6_K>;
#endif

// Rows of x beyond kIntegerRows: tiles of weight rows expanded to float32 in cache, as quant_linear.h's
// linear_by_tiles does.
template <class T>
inline void linear_by_tiles(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, const float* bias,
                            float* y) {
  using linear_detail::kRows;
  const int64_t row_bytes = K / T::kElements * T::kBytes;
  at::parallel_for(0, (N + kRows - 1) / kRows, 4, [&](int64_t begin, int64_t end) {
    RowBuffer buf(K);
    std::vector<float> tile(kRows * K);
    const float* next[kRows] = {tile.data(), tile.data(), tile.data(), tile.data()};
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * kRows, rows = std::min<int64_t>(kRows, N - n);
      for (int64_t r = 0; r < rows; ++r) {
        decode_row<T>(w + (n + r) * row_bytes, K, buf);
        expand_row<T>(buf, K, tile.data() + r * K);
      }
      linear_detail::rows_times_x(tile.data(), rows, K, x, M, y + n, N, bias ? bias + n : nullptr, next);
    }
  });
}

inline int64_t checked_inputs(const torch::Tensor& blocks, const std::string& type, int64_t in_features) {
  TORCH_CHECK(blocks.scalar_type() == torch::kByte && blocks.dim() == 2, "ggml blocks must be a 2-d uint8 tensor, got ",
              blocks.scalar_type(), " ", blocks.sizes());
  with_type(type, [&](auto t) {
    using T = decltype(t);
    TORCH_CHECK(in_features > 0 && in_features % T::kElements == 0 &&
                    blocks.size(1) == in_features / T::kElements * T::kBytes,
                type, " blocks of ", in_features, " inputs must be [out, ", in_features / T::kElements * T::kBytes,
                "] (", T::kElements, " inputs a block of ", T::kBytes, " bytes), got ", blocks.sizes());
  });
  return in_features;
}

// The types whose rows this build reads interleaved (interleaved_rows.h).
inline std::vector<std::string> interleaved_types() {
  return interleaved::kKernels ? interleaved::type_names() : std::vector<std::string>{};
}

inline void check_row_group(const std::string& type, int64_t row_group) {
  const auto& types = interleaved::type_names();
  TORCH_CHECK(row_group == 1 || (row_group == interleaved::kGroup && interleaved::kKernels &&
                                 std::find(types.begin(), types.end(), type) != types.end()),
              "ggml: ", type, " rows interleaved in groups of ", row_group, ": this build reads groups of ",
              interleaved::kGroup, " of ", interleaved::kKernels ? c10::Join(", ", types) : std::string("no type"),
              " (lmport.weights.interleaved.file_layout gives the file's rows back)");
}

#ifdef LMPORT_INTERLEAVED
// Rows of x over a weight whose whole groups are interleaved: the groups by the interleaved kernel, the rows
// after them (as the file lays them out) row by row, x held alike by both (each row of x on its own): by
// linear_int8 with AVX-512 VNNI, by the int16 integer path on the AVX2 path.
template <class T>
inline void linear_interleaved(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, const float* bias,
                               float* y) {
  const int64_t row_bytes = K / T::kElements * T::kBytes, whole = N / interleaved::kGroup * interleaved::kGroup;
  interleaved::linear_groups(typename RowsOf<T>::type{}, x, M, K, w, whole / interleaved::kGroup,
                             interleaved::kGroup * row_bytes, K / T::kElements, bias, y, N);
  interleaved::rows_after_groups(M, N, y, [&](int64_t first, int64_t count, float* out) {
#ifdef LMPORT_QUANT_AVX512
    linear_int8<T>(x, M, K, w + first * row_bytes, count, bias ? bias + first : nullptr, out);
#else
    linear_integer<T>(quantize(x, M, K), M, w + first * row_bytes, count, bias ? bias + first : nullptr, out);
#endif
  });
}
#endif

}  // namespace ggml_detail

inline torch::Tensor ggml_linear(torch::Tensor x, torch::Tensor blocks, const std::string& type, int64_t in_features,
                                 c10::optional<torch::Tensor> bias, int64_t row_group) {
  using namespace ggml_detail;
  const int64_t K = checked_inputs(blocks, type, in_features), N = blocks.size(0);
  check_row_group(type, row_group);
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.size(1) == K,
              "ggml_linear: x must be float32 [tokens, ", K, "], got ", x.scalar_type(), " ", x.sizes());
  if (bias) TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == N,
                        "ggml_linear: bias must be float32 with ", N, " elements");
  x = x.contiguous();
  blocks = blocks.contiguous();
  const torch::Tensor b = bias ? bias->contiguous() : torch::Tensor();
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;   // e.g. an expert no token was routed to
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const float* bp = bias ? b.data_ptr<float>() : nullptr;
  with_type(type, [&](auto t) {
    using T = decltype(t);
#ifdef LMPORT_INTERLEAVED
    if (row_group != 1) {   // a type with a layout (check_row_group)
      if constexpr (!std::is_void_v<typename RowsOf<T>::type>)
        linear_interleaved<T>(x.data_ptr<float>(), M, K, w, N, bp, y.data_ptr<float>());
      return;
    }
#endif
    if (M > kIntegerRows) {
      linear_by_tiles<T>(x.data_ptr<float>(), M, K, w, N, bp, y.data_ptr<float>());
#ifdef LMPORT_QUANT_AVX512
    } else if (kInt8<T> && M <= quant512::kInt8Rows) {
      linear_int8<T>(x.data_ptr<float>(), M, K, w, N, bp, y.data_ptr<float>());
#endif
    } else {
      const Activations a = quantize(x.data_ptr<float>(), M, K);
      linear_integer<T>(a, M, w, N, bp, y.data_ptr<float>());
    }
  });
  return y;
}

// W in float32; with ``rows`` (int64 indices) only those rows, in that order (an embedding lookup).
inline torch::Tensor ggml_dequantize(torch::Tensor blocks, const std::string& type, int64_t in_features,
                                     int64_t row_group, c10::optional<torch::Tensor> rows = c10::nullopt) {
  using namespace ggml_detail;
  const int64_t K = checked_inputs(blocks, type, in_features), N = blocks.size(0);
  check_row_group(type, row_group);
  blocks = blocks.contiguous();
  const torch::Tensor picked = checked_rows(rows, N, "ggml_dequantize");
  const int64_t* index = rows ? picked.data_ptr<int64_t>() : nullptr;
  const int64_t count = rows ? picked.numel() : N;
  auto out = torch::empty({count, K}, blocks.options().dtype(torch::kFloat));
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
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
  return out;
}

inline std::vector<std::string> ggml_kernel_types() { return ggml_detail::type_names(); }

inline std::vector<std::string> ggml_interleaved_types() { return ggml_detail::interleaved_types(); }

// The types whose path for up to quant_int8_rows() rows of x holds x as two int8 codes rather than
// int16: the tolerance a test of that path allows depends on it.
inline std::vector<std::string> ggml_int8_types() {
#ifdef LMPORT_QUANT_AVX512
  return {"q5_0", "q4_k", "q6_k"};
#else
  return {};
#endif
}

}  // namespace lmport
