// The instruction sets this build targets, decided once here (the build passes -march=native, or
// -mno-avx512f for the AVX2 build: lmport/backends/cpu/kernels.py), and the few per-ISA primitives every
// kernel family uses. The family headers choose an instruction set's file by the LMPORT_ISA_* /
// LMPORT_INTERLEAVED* macros below; finer tests of the compiler's flags (F16C, AVX-VNNI) stay in isa/, but
// for the heads paged_attention.h takes at once with AVX-512's 32 registers.
//
// Where the code lives by instruction set:
//   isa/vec8.h          eight floats as GCC/Clang vector extensions: compiles on any target (AVX registers
//                       on x86, two NEON registers on AArch64); the attention, norm, activation and KV
//                       fill loops use only this.
//   isa/x86.h           small x86 helpers shared by the quantized kernels (256-bit sums, int16 dot products).
//   isa/avx512/*.h      the AVX-512 (BW, VL, VNNI) bodies of the quantized kernels: int8 activations and
//                       vpdpbusd dot products, the interleaved-row group kernels.
//   isa/amx/*.h         the AMX tile loop of a prefill over interleaved rows (bfloat16 products).
//   isa/avx2/*.h        the AVX2 (FMA, F16C) bodies of the interleaved-row group kernels.
//   isa/neon/           (not written yet) the place for an ARM port: the same functions as isa/avx2/ over
//                       NEON's sdot / vmlal, selected by an LMPORT_ISA_NEON branch below. Until then a
//                       non-x86 build has no quantized kernels; lmport.backends.cpu.kernels.load() logs the
//                       build failure and the backend runs the reference ops.
#pragma once

#include <cstdint>
#include <cstring>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define LMPORT_ISA_X86 1
#endif

// AVX-512 with byte dot products (vpdpbusd): the int8 paths of quant_linear and ggml_linear.
#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define LMPORT_ISA_AVX512 1
#endif

// AMX tiles with bfloat16 products (and AVX-512's bfloat16 conversions): a prefill over interleaved rows
// (isa/amx/bf16_groups.h).
#if defined(LMPORT_ISA_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define LMPORT_ISA_AMX 1
#endif

// Kernels over rows interleaved in groups of 16 (interleaved_rows.h): AVX-512 VNNI's, or AVX2's (with FMA
// and F16C).
#if defined(LMPORT_ISA_AVX512)
#define LMPORT_INTERLEAVED 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LMPORT_INTERLEAVED 1
#define LMPORT_INTERLEAVED_AVX2 1
#endif

namespace lmport {
namespace isa {

// An IEEE half float (its bits) as a float.
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  _Float16 f;
  std::memcpy(&f, &h, sizeof(f));
  return static_cast<float>(f);
#endif
}

// A spinning thread's pause between looks at what it waits for.
inline void spin_pause() {
#if defined(LMPORT_ISA_X86)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#else
  std::this_thread::yield();
#endif
}

// The cache line at ``p`` fetched into L2 (prefetcht1 on x86).
inline void prefetch_l2(const void* p) {
#if defined(LMPORT_ISA_X86)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

}  // namespace isa
}  // namespace lmport
