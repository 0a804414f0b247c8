// Paged attention for the cpu backend. It reads K/V straight from the block
// pool (no gathered copy); each query token is one work item over all its heads.
// The pool holds float32 or float16 values (kv_cache_dtype), or lmport.kv.quant's codes
// (8 bits, or 4 bits two a byte with element 2i in the low nibble) with a float32 scale
// and integer zero per (token, KV head): value = (code - zero) * scale. Over codes, the step's own tokens
// attend to their keys and values as the step computed them (k_new, v_new), not to their codes: a prefill sees
// itself in full precision and its history through the cache (lmport.ops.attention).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "isa/vec8.h"

namespace lmport {

constexpr int64_t kMaxHeadDim = 256;

// kBits: 32 for float32 values, 16 for float16 values, 8 or 4 for codes.
template <int kBits>
struct Pool {
  const void* k;
  const void* v;
  const float* k_params;  // [tokens, kv_heads, 2]: scale, zero (codes only)
  const float* v_params;
  int64_t block_size, kv_heads, head_dim;
  // The step's own K and V rows [T, kv_heads, head_dim] float32 (codes only; null: read from the codes too).
  const float* k_new = nullptr;
  const float* v_new = nullptr;
  // Bytes of one (token, KV head) row, and the row of token ``t`` (a pool position), KV head ``h``.
  int64_t row_bytes() const { return head_dim * kBits / 8; }
  const char* row(const void* pool, int64_t t, int64_t h) const {
    return static_cast<const char*>(pool) + (t * kv_heads + h) * row_bytes();
  }
};

typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef uint8_t u8x4 __attribute__((vector_size(4)));

// Elements d .. d + 7 of a row, as floats (codes as they are: the zero and scale come after).
template <int kBits>
inline vec8 load8(const char* row, int64_t d) {
  if constexpr (kBits == 32) {
    return load(reinterpret_cast<const float*>(row) + d);
  } else if constexpr (kBits == 16) {
    return load_half(reinterpret_cast<const uint16_t*>(row) + d);
  } else if constexpr (kBits == 8) {
    u8x8 codes;
    std::memcpy(&codes, row + d, 8);
    return __builtin_convertvector(codes, vec8);
  } else {
    u8x4 bytes;
    std::memcpy(&bytes, row + d / 2, 4);
    const u8x4 low = bytes & 15, high = bytes >> 4;
    return __builtin_convertvector(__builtin_shufflevector(low, high, 0, 4, 1, 5, 2, 6, 3, 7), vec8);
  }
}

// Per-worker buffers, reused across tokens.
struct Scratch {
  std::vector<int64_t> rows;    // pool position of each visible key
  std::vector<float> scores;    // [Hq, n rounded up to 8]
  std::vector<float> values;    // codes: the visible K and V rows dequantized, [2, n, Hkv, D]
  std::vector<float> inv;       // each head's 1 / sum of its softmax numerators
};

// Heads taken together against each key's row (one KV head's, so each K and V vector loaded serves them
// all): as many as keep their accumulators in registers (eight keys' dot products a head; AVX-512 has 32
// vector registers, AVX2 16).
#ifdef __AVX512F__
template <int64_t kD>
constexpr int64_t kHeadChunk = kD == 64 ? 3 : 1;
#else
template <int64_t kD>
constexpr int64_t kHeadChunk = 1;
#endif

// The scores of kC heads (q: D floats apart) against eight keys' K rows (at their KV head), scaled (and soft
// capped), into the first ``keys`` places of each head's row of ``scores`` (rows ``width`` apart).
template <int64_t kC, int64_t kD, int kBits>
inline void score_keys(const float* q, int64_t D, const char* const* k_rows, float scale, float softcap,
                       int64_t keys, float* scores, int64_t width) {
  if constexpr (kD != 0) D = kD;
  vec8 acc[kC][8] = {};
  for (int64_t d = 0; d < D; d += 8) {
    vec8 qd[kC];
    for (int64_t c = 0; c < kC; ++c) qd[c] = load(q + c * D + d);
    for (int u = 0; u < 8; ++u) {
      const vec8 k = load8<kBits>(k_rows[u], d);
      for (int64_t c = 0; c < kC; ++c) acc[c][u] += qd[c] * k;
    }
  }
  for (int64_t c = 0; c < kC; ++c) {
    const vec8 s = sum8(acc[c]) * scale;
    float* row = scores + c * width;
    if (softcap > 0)  // Gemma 2's attention-logit soft cap
      for (int64_t u = 0; u < keys; ++u) row[u] = softcap * std::tanh(s[u] / softcap);
    else if (keys == 8)
      store(row, s);
    else
      for (int64_t u = 0; u < keys; ++u) row[u] = s[u];
  }
}

// out (kC heads, D floats apart) = the sum over the n keys of p * their V row (at KV head kv), times each
// head's ``inv``; p: the heads' softmax numerators, rows ``width`` apart.
template <int64_t kC, int64_t kD, int kBits>
inline void sum_values(const float* p, int64_t width, const int64_t* rows, int64_t n, const Pool<kBits>& pool,
                       int64_t kv, int64_t D, const float* inv, float* out) {
  if constexpr (kD != 0) D = kD;
  vec8 acc[kC][(kD ? kD : kMaxHeadDim) / 8] = {};
  for (int64_t j = 0; j < n; ++j) {
    const char* vj = pool.row(pool.v, rows[j], kv);
    for (int64_t i = 0; i < D / 8; ++i) {
      const vec8 v = load8<kBits>(vj, 8 * i);
      for (int64_t c = 0; c < kC; ++c) acc[c][i] += p[c * width + j] * v;
    }
  }
  for (int64_t c = 0; c < kC; ++c)
    for (int64_t i = 0; i < D / 8; ++i) store(out + c * D + 8 * i, acc[c][i] * inv[c]);
}

// Query token with heads q[Hq, D] at position end - 1 of a sequence whose blocks are
// ``blocks``, over the keys at positions [first, end) (at least one) of a pool of float32 or float16
// values (kBits 32 or 16): out[Hq, D], and when ``stats`` is given each head's largest score and sum of
// exp(score - largest) in stats[2h], stats[2h + 1], which merge attention over parts of the keys. ``sinks``
// (null: none): each head's logit that joins its softmax's denominator with no value (gpt-oss). kD is
// the head dim when known at compile time (then the output accumulators live in registers), 0 to read it
// from the pool.
template <int64_t kD, int kBits>
void attend_values(const float* q, float* out, float* stats, const int32_t* blocks, int64_t first, int64_t end,
                   int64_t q_heads, const Pool<kBits>& pool, float scale, float softcap, const float* sinks,
                   bool prefetch, Scratch& scratch) {
  static_assert(kBits == 32 || kBits == 16, "values: float32 or float16");
  const int64_t D = kD ? kD : pool.head_dim, bs = pool.block_size, row = pool.kv_heads * pool.row_bytes();
  const int64_t n = end - first;  // visible keys; row j below is position first + j
  const int64_t group = q_heads / pool.kv_heads, width = (n + 7) / 8 * 8;
  auto& rows = scratch.rows;
  rows.resize(n);
  for (int64_t p = first; p < end;) {  // a block at a time: one table read, no division per key
    const int64_t blk = p / bs, stop = std::min(end, (blk + 1) * bs), base = (blocks[blk] - blk) * bs;
    for (; p < stop; ++p) rows[p - first] = base + p;
  }
  auto& scores = scratch.scores;
  scores.assign(q_heads * width, -INFINITY);  // the padding keys get exp() == 0
  // How many heads the chunk from head h takes: kHeadChunk, fewer where its KV head's group ends first.
  const auto chunk_at = [&](int64_t h) { return std::min<int64_t>(kHeadChunk<kD>, (h / group + 1) * group - h); };

  // Scores, eight keys at a time: their K rows (every kv head) stay in L1 while each
  // chunk of heads sums its dot products in one go. For a decode token the lines of the K rows
  // kPrefetchKeys ahead and of these keys' V rows are asked for meanwhile (into L2: the L1's few
  // miss buffers would hold the loads back), spread over the chunks so that the requests go out
  // alongside the arithmetic rather than in one burst that waits on the miss buffers.
  constexpr int64_t kPrefetchKeys = 16;
  const int64_t row_lines = (row + 63) / 64;
  for (int64_t j = 0; j < n; j += 8) {
    const int64_t keys = std::min<int64_t>(8, n - j);
    // A last group short of eight repeats its final key (its scores are not kept), so the
    // loops below run a fixed eight keys and their accumulators stay in registers.
    int64_t keys_at[8];
    for (int64_t u = 0; u < 8; ++u) keys_at[u] = rows[j + std::min(u, keys - 1)];
    const char* ahead[16];   // the rows asked for, row_lines lines each
    int64_t rows_ahead = 0;
    if (prefetch) {
      for (int64_t u = j + kPrefetchKeys; u < std::min(n, j + kPrefetchKeys + 8); ++u)
        ahead[rows_ahead++] = pool.row(pool.k, rows[u], 0);
      for (int64_t u = 0; u < keys; ++u) ahead[rows_ahead++] = pool.row(pool.v, rows[j + u], 0);
    }
    const int64_t lines = rows_ahead * row_lines, per_head = (lines + q_heads - 1) / q_heads;
    int64_t asked = 0, r = 0, line = 0;   // lines asked for so far; the next one: line ``line`` of row r
    for (int64_t h = 0, chunk; h < q_heads; h += chunk) {
      chunk = chunk_at(h);
      for (const int64_t stop = std::min(lines, (h + chunk) * per_head); asked < stop; ++asked) {
        __builtin_prefetch(ahead[r] + 64 * line, 0, 2);
        if (++line == row_lines) line = 0, ++r;
      }
      const char* k_rows[8];
      for (int u = 0; u < 8; ++u) k_rows[u] = pool.row(pool.k, keys_at[u], h / group);
      float* chunk_scores = scores.data() + h * width + j;
      if (chunk == kHeadChunk<kD>)
        score_keys<kHeadChunk<kD>, kD, kBits>(q + h * D, D, k_rows, scale, softcap, keys, chunk_scores, width);
      else
        for (int64_t c = 0; c < chunk; ++c)
          score_keys<1, kD, kBits>(q + (h + c) * D, D, k_rows, scale, softcap, keys, chunk_scores + c * width, width);
    }
  }
  // Softmax per head, then V a chunk of heads at a time, their accumulators in registers across keys.
  auto& inv = scratch.inv;
  inv.resize(q_heads);
  for (int64_t h = 0; h < q_heads; ++h) {
    float* s = scores.data() + h * width;
    vec8 m8 = load(s);
    for (int64_t j = 8; j < width; j += 8) m8 = vmax(m8, load(s + j));
    const float m = sinks ? std::max(max(m8), sinks[h]) : max(m8);
    vec8 total = {};
    for (int64_t j = 0; j < width; j += 8) {
      const vec8 e = exp8(load(s + j) - m);
      store(s + j, e);
      total += e;
    }
    const float denominator = sum(total) + (sinks ? std::exp(sinks[h] - m) : 0.f);
    inv[h] = 1.f / denominator;
    if (stats) stats[2 * h] = m, stats[2 * h + 1] = denominator;
  }
  for (int64_t h = 0, chunk; h < q_heads; h += chunk) {
    chunk = chunk_at(h);
    const float* p = scores.data() + h * width;
    if (chunk == kHeadChunk<kD>)
      sum_values<kHeadChunk<kD>, kD>(p, width, rows.data(), n, pool, h / group, D, inv.data() + h, out + h * D);
    else
      for (int64_t c = 0; c < chunk; ++c)
        sum_values<1, kD>(p + c * width, width, rows.data(), n, pool, h / group, D, inv.data() + h + c,
                          out + (h + c) * D);
  }
}

// The same over a pool of codes (kBits 8 or 4), or of values (kBits 32 or 16) as attend_values. Positions
// from new_first on are the step's own tokens, rows new_row on of the pool's k_new and v_new.
template <int64_t kD, int kBits>
void attend(const float* q, float* out, float* stats, const int32_t* blocks, int64_t first, int64_t end,
            int64_t q_heads, const Pool<kBits>& pool, float scale, float softcap, const float* sinks, bool prefetch,
            Scratch& scratch, int64_t new_first, int64_t new_row) {
  if constexpr (kBits == 32 || kBits == 16) {
    attend_values<kD>(q, out, stats, blocks, first, end, q_heads, pool, scale, softcap, sinks, prefetch, scratch);
  } else {
    // Codes: the visible rows dequantized once, (code - zero) * scale as the reference computes them, into
    // a float32 pool of one block that the float path then reads (each KV head's rows serve its whole
    // GQA group, converted once rather than once a query head).
    const int64_t n = end - first, H = pool.kv_heads, D = pool.head_dim, bs = pool.block_size;
    scratch.values.resize(2 * n * H * D);
    float* values = scratch.values.data();
    for (int64_t p = first; p < end; ++p) {
      const int64_t t = (blocks[p / bs] - p / bs) * bs + p;   // the key's pool position
      for (int64_t h = 0; h < H; ++h)
        for (int kv = 0; kv < 2; ++kv) {
          const char* codes = pool.row(kv ? pool.v : pool.k, t, h);
          const float* params = (kv ? pool.v_params : pool.k_params) + (t * H + h) * 2;
          const vec8 row_scale = splat(params[0]), zero = splat(params[1]);
          float* dst = values + ((kv * n + p - first) * H + h) * D;
          if (p >= new_first && pool.k_new != nullptr) {
            std::memcpy(dst, (kv ? pool.v_new : pool.k_new) + ((new_row + p - new_first) * H + h) * D,
                        D * sizeof(float));
            continue;
          }
          for (int64_t d = 0; d < D; d += 8) store(dst + d, (load8<kBits>(codes, d) - zero) * row_scale);
        }
    }
    const Pool<32> flat{values, values + n * H * D, nullptr, nullptr, n, H, D};
    const int32_t only_block = 0;
    attend_values<kD>(q, out, stats, &only_block, 0, n, q_heads, flat, scale, softcap, sinks, false, scratch);
  }
}

// A step's attention work, from its metadata: block_tables [B, max_blocks]; q_start_loc [B + 1]; kv_lens [B].
// Token t of sequence b sits at position kv_lens[b] - q_len + (t - q_start_loc[b]) and attends to positions
// <= that; with a sliding window (window > 0) only to those > that - window; with chunks (chunk > 0) only to
// those in its own chunk, from (position / chunk) * chunk on (Llama 4's local layers).
//
// Work items are (token, part of its keys). A small step (a decode step of a few sequences, a verification
// of a few proposed tokens) splits each token's keys into parts, attended apart and merged by their softmax
// statistics, so that the items share out evenly: threads / gcd(T, threads) parts, each thread then taking
// the same part of every token (five tokens on two threads: each thread half the keys of all five, where
// whole tokens would go three to one thread and two to the other). Larger steps (prefill) take a token an
// item. Items go round-robin to the workers, so prefill rows, whose cost grows with position, are shared
// evenly.
struct AttentionWork {
  const int32_t *tab, *st, *kl;
  int64_t T, Hq, D, width, parts, items, workers;
  std::vector<int64_t> seq_of;
  std::vector<float> part_out, part_stats;   // each item's output and its heads' softmax statistics (parts > 1)

  // tables [B, width] int32, starts [B + 1] int32 (ending at T), lens [B] int32: checked by the caller.
  AttentionWork(const int32_t* tables, const int32_t* starts, const int32_t* lens, int64_t B, int64_t width_,
                int64_t T_, int64_t Hq_, int64_t D_, int64_t threads)
      : tab(tables), st(starts), kl(lens), T(T_), Hq(Hq_), D(D_), width(width_) {
    seq_of.resize(T);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = st[b]; t < st[b + 1]; ++t) seq_of[t] = b;
    parts = T < 4 * threads ? threads / std::gcd(T, threads) : 1;
    items = T * parts;
    workers = std::min(threads, items);
    part_out.resize(parts > 1 ? items * Hq * D : 0);
    part_stats.resize(parts > 1 ? items * Hq * 2 : 0);
  }
};

// Worker ``worker``'s items of ``work``: query token t's heads at q + t * q_stride, its output at out + t * Hq * D
// (where a token is one item; else the item's share, merged by merge_parts). softcap > 0: scores become
// softcap * tanh(scores / softcap) before the softmax. chunk: 0 for none; sinks: [Hq] or null, as attend_values
// takes them.
template <int kBits>
void attend_items(AttentionWork& work, int64_t worker, const float* q, int64_t q_stride, const Pool<kBits>& pool,
                  float* out, double scale, int64_t window, double softcap, Scratch& scratch, int64_t chunk = 0,
                  const float* sinks = nullptr) {
  const int64_t Hq = work.Hq, D = work.D, parts = work.parts;
  const auto run = D == 64 ? attend<64, kBits> : D == 128 ? attend<128, kBits> : attend<0, kBits>;
  const int32_t *st = work.st, *kl = work.kl;
  for (int64_t i = worker; i < work.items; i += work.workers) {
    const int64_t t = i / parts, part = i % parts, b = work.seq_of[t];
    const int64_t end = kl[b] - (st[b + 1] - t) + 1;  // token t sits at position end - 1
    int64_t first = window > 0 ? std::max<int64_t>(0, end - window) : 0;
    if (chunk > 0) first = std::max(first, (end - 1) / chunk * chunk);
    const int64_t lo = first + (end - first) * part / parts, hi = first + (end - first) * (part + 1) / parts;
    float* stats = parts > 1 ? work.part_stats.data() + i * Hq * 2 : nullptr;
    if (lo == hi) {  // more parts than keys: this one weighs nothing in the merge
      for (int64_t h = 0; h < Hq; ++h) stats[2 * h] = -INFINITY, stats[2 * h + 1] = 0.f;
      continue;
    }
    // A decode token reads its history cold; prefill tokens of one sequence share it in cache.
    const bool decode = st[b + 1] - st[b] == 1;
    // Split into parts, a token's sinks join its softmax once, where merge_parts weighs the parts.
    run(q + t * q_stride, parts > 1 ? work.part_out.data() + i * Hq * D : out + t * Hq * D, stats,
        work.tab + b * work.width, lo, hi, Hq, pool, static_cast<float>(scale), static_cast<float>(softcap),
        parts > 1 ? nullptr : sinks, decode, scratch, kl[b] - (st[b + 1] - st[b]), st[b]);
  }
}

// Each head's parts of ``work`` into out [T, Hq, D], weighed by their share of the softmax mass:
// exp(max_part - max) * sum_part, each head's sink (sinks: [Hq] or null) joining the denominator once. Nothing
// to do where a token is one item.
inline void merge_parts(AttentionWork& work, float* out, const float* sinks = nullptr) {
  const int64_t T = work.T, Hq = work.Hq, D = work.D, parts = work.parts;
  std::vector<float> weight(parts);
  for (int64_t t = 0; t < T && parts > 1; ++t)
    for (int64_t h = 0; h < Hq; ++h) {
      float m = sinks ? sinks[h] : -INFINITY, total = 0.f;
      for (int64_t part = 0; part < parts; ++part) m = std::max(m, work.part_stats[((t * parts + part) * Hq + h) * 2]);
      for (int64_t part = 0; part < parts; ++part) {
        const float* st2 = work.part_stats.data() + ((t * parts + part) * Hq + h) * 2;
        weight[part] = st2[1] > 0.f ? std::exp(st2[0] - m) * st2[1] : 0.f;
        total += weight[part];
      }
      if (sinks) total += std::exp(sinks[h] - m);
      float* o = out + (t * Hq + h) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      for (int64_t part = 0; part < parts; ++part) {
        const float* src = work.part_out.data() + ((t * parts + part) * Hq + h) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += weight[part] / total * src[d];
      }
    }
}

}  // namespace lmport
