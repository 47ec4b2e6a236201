/* Exact-path paged attention for x86-64 CPUs with AVX2 and FMA (see kernels/attention.py).
 *
 * For each listed row r (a query token: a decode token, or a known output token an extend recomputes),
 * every query head h attends over positions 0 .. lens[r]-1 of its sequence, read straight from the paged
 * pool through the sequence's block table (no gather, no dtype copy):
 *
 *   s_j = scale * sum_d q[h, d] * k[j, d]        e_j = exp(s_j - max_j s_j)
 *   out[h, d] = (sum_j e_j * v[j, d]) / (sum_j e_j)
 *
 * in float64, each sum in one fixed order, rounded to float32 once at the end. A row's result depends only
 * on its query and its context: not on which rows share the call or the thread count. So a token decoded
 * one step at a time and the same token recomputed inside an extend (main decode after a handoff) give the
 * same bits, which is what makes the handoff exact (docs/ENGINE.md, batch invariance).
 *
 * Pool layout per layer: [num_blocks, block_size, kv_heads, head_dim], float32 or bf16 (kv_bf16).
 * Threads (OpenMP) take (row, query head) pairs, or (row, kv head) groups over a dense copy (pdd_paged_attention).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

#define GROUP_MAX_LEN 4096 /* the dense copy of a kv head's context: 2 * len * d doubles per thread */

static inline __attribute__((always_inline)) __m256d load4(const void *base, int64_t i, int bf16) {
  if (bf16) {
    uint64_t raw;
    memcpy(&raw, (const uint16_t *)base + i, 8);
    __m128i w = _mm_cvtepu16_epi32(_mm_cvtsi64_si128((long long)raw));
    return _mm256_cvtps_pd(_mm_castsi128_ps(_mm_slli_epi32(w, 16)));
  }
  return _mm256_cvtps_pd(_mm_loadu_ps((const float *)base + i));
}

static inline double hsum4(__m256d v) {
  __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

static inline double scalar_at(const void *base, int64_t i, int bf16) {
  if (bf16) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)((const uint16_t *)base)[i] << 16;
    return c.f;
  }
  return ((const float *)base)[i];
}


/* k row j of kv head g, through the block table. */
static inline int64_t kv_offset(const int64_t *table, int64_t j, int64_t block_size, int64_t hkv, int64_t g,
                                int64_t d) {
  return ((table[j / block_size] * block_size + j % block_size) * hkv + g) * d;
}

/* scores[j] = scale * (q . k_j), each dot product in 4 lanes over d (lane t % 4), summed by hsum4, then the
 * tail. Four positions at a time only to overlap their FMA chains: each score's arithmetic is the same. */
static void score_row(const double *qi, double *sc, int64_t d, int64_t hkv, int64_t g, const void *k_cache, int bf16,
                      int64_t block_size, const int64_t *table, int64_t len, double scale) {
  int64_t d4 = d & ~(int64_t)3, j = 0;
  for (; j + 4 <= len; j += 4) {
    int64_t b0 = kv_offset(table, j, block_size, hkv, g, d), b1 = kv_offset(table, j + 1, block_size, hkv, g, d);
    int64_t b2 = kv_offset(table, j + 2, block_size, hkv, g, d), b3 = kv_offset(table, j + 3, block_size, hkv, g, d);
    __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t t = 0; t < d4; t += 4) {
      __m256d qv = _mm256_loadu_pd(qi + t);
      a0 = _mm256_fmadd_pd(qv, load4(k_cache, b0 + t, bf16), a0);
      a1 = _mm256_fmadd_pd(qv, load4(k_cache, b1 + t, bf16), a1);
      a2 = _mm256_fmadd_pd(qv, load4(k_cache, b2 + t, bf16), a2);
      a3 = _mm256_fmadd_pd(qv, load4(k_cache, b3 + t, bf16), a3);
    }
    double s[4] = {hsum4(a0), hsum4(a1), hsum4(a2), hsum4(a3)};
    int64_t base[4] = {b0, b1, b2, b3};
    for (int c = 0; c < 4; c++) {
      for (int64_t t = d4; t < d; t++) s[c] += qi[t] * scalar_at(k_cache, base[c] + t, bf16);
      sc[j + c] = s[c] * scale;
    }
  }
  for (; j < len; j++) {
    int64_t base = kv_offset(table, j, block_size, hkv, g, d);
    __m256d a = _mm256_setzero_pd();
    for (int64_t t = 0; t < d4; t += 4) a = _mm256_fmadd_pd(_mm256_loadu_pd(qi + t), load4(k_cache, base + t, bf16), a);
    double s = hsum4(a);
    for (int64_t t = d4; t < d; t++) s += qi[t] * scalar_at(k_cache, base + t, bf16);
    sc[j] = s * scale;
  }
}

/* acc[t] = sum_j p[j] * v_j[t] for t in [t0, t0 + 4 * NV), j in order: NV accumulators in registers. */
#define DEFINE_PV(NAME, NV)                                                                                       \
  static inline void NAME(const double *p, double *acc, int64_t t0, int64_t d, int64_t hkv, int64_t g,           \
                          const void *v_cache, int bf16, int64_t block_size, const int64_t *table, int64_t len) { \
    __m256d a[NV];                                                                                                \
    for (int c = 0; c < NV; c++) a[c] = _mm256_setzero_pd();                                                      \
    for (int64_t j = 0; j < len; j++) {                                                                           \
      int64_t base = kv_offset(table, j, block_size, hkv, g, d) + t0;                                             \
      __m256d pj = _mm256_set1_pd(p[j]);                                                                          \
      for (int c = 0; c < NV; c++) a[c] = _mm256_fmadd_pd(pj, load4(v_cache, base + 4 * c, bf16), a[c]);          \
    }                                                                                                             \
    for (int c = 0; c < NV; c++) _mm256_storeu_pd(acc + t0 + 4 * c, a[c]);                                       \
  }
DEFINE_PV(pv8, 8)
DEFINE_PV(pv1, 1)

/* The same two passes over a dense copy of one kv head's context (kd, vd: [len, d] doubles, the values load4
 * gives): the same values in the same order of operations, so the same bits as score_row / pv*, without
 * re-reading and re-widening the pool for every query head of a GQA group. */
static void score_dense(const double *qi, double *sc, int64_t d, const double *kd, int64_t len, double scale) {
  int64_t d4 = d & ~(int64_t)3, j = 0;
  for (; j + 4 <= len; j += 4) {
    const double *k0 = kd + j * d, *k1 = k0 + d, *k2 = k1 + d, *k3 = k2 + d;
    __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t t = 0; t < d4; t += 4) {
      __m256d qv = _mm256_loadu_pd(qi + t);
      a0 = _mm256_fmadd_pd(qv, _mm256_loadu_pd(k0 + t), a0);
      a1 = _mm256_fmadd_pd(qv, _mm256_loadu_pd(k1 + t), a1);
      a2 = _mm256_fmadd_pd(qv, _mm256_loadu_pd(k2 + t), a2);
      a3 = _mm256_fmadd_pd(qv, _mm256_loadu_pd(k3 + t), a3);
    }
    double s[4] = {hsum4(a0), hsum4(a1), hsum4(a2), hsum4(a3)};
    const double *kr[4] = {k0, k1, k2, k3};
    for (int c = 0; c < 4; c++) {
      for (int64_t t = d4; t < d; t++) s[c] += qi[t] * kr[c][t];
      sc[j + c] = s[c] * scale;
    }
  }
  for (; j < len; j++) {
    const double *kr = kd + j * d;
    __m256d a = _mm256_setzero_pd();
    for (int64_t t = 0; t < d4; t += 4) a = _mm256_fmadd_pd(_mm256_loadu_pd(qi + t), _mm256_loadu_pd(kr + t), a);
    double s = hsum4(a);
    for (int64_t t = d4; t < d; t++) s += qi[t] * kr[t];
    sc[j] = s * scale;
  }
}

#define DEFINE_PV_DENSE(NAME, NV)                                                                                 \
  static inline void NAME(const double *p, double *acc, int64_t t0, int64_t d, const double *vd, int64_t len) {    \
    __m256d a[NV];                                                                                                \
    for (int c = 0; c < NV; c++) a[c] = _mm256_setzero_pd();                                                      \
    for (int64_t j = 0; j < len; j++) {                                                                           \
      const double *vr = vd + j * d + t0;                                                                         \
      __m256d pj = _mm256_set1_pd(p[j]);                                                                          \
      for (int c = 0; c < NV; c++) a[c] = _mm256_fmadd_pd(pj, _mm256_loadu_pd(vr + 4 * c), a[c]);                \
    }                                                                                                             \
    for (int c = 0; c < NV; c++) _mm256_storeu_pd(acc + t0 + 4 * c, a[c]);                                       \
  }
DEFINE_PV_DENSE(pv8_dense, 8)
DEFINE_PV_DENSE(pv1_dense, 1)

/* One (row, query head h) over kv head g (GQA: h / group). q_row is the row's [hq, d] query (float32);
 * qd/scores/acc are this thread's scratch (d, len, d doubles). */
/* sc[j] <- exp(sc[j] - max), returns their sum (in order). */
static double softmax_numerators(double *sc, int64_t len) {
  double m = sc[0], total = 0.0;
  for (int64_t j = 1; j < len; j++) m = sc[j] > m ? sc[j] : m;
  for (int64_t j = 0; j < len; j++) { sc[j] = exp(sc[j] - m); total += sc[j]; }
  return total;
}

static void attend(const float *q_row, float *out_row, int64_t h, int64_t g, int64_t d, int64_t hkv,
                   const void *k_cache, const void *v_cache, int bf16, int64_t block_size, const int64_t *table,
                   int64_t len, double scale, double *qd, double *sc, double *acc) {
  for (int64_t t = 0; t < d; t++) qd[t] = q_row[h * d + t];
  int64_t d4 = d & ~(int64_t)3;
  score_row(qd, sc, d, hkv, g, k_cache, bf16, block_size, table, len, scale);
  double total = softmax_numerators(sc, len);
  int64_t t = 0;
  for (; t + 32 <= d4; t += 32) pv8(sc, acc, t, d, hkv, g, v_cache, bf16, block_size, table, len);
  for (; t < d4; t += 4) pv1(sc, acc, t, d, hkv, g, v_cache, bf16, block_size, table, len);
  for (t = d4; t < d; t++) acc[t] = 0.0;
  for (int64_t j = 0; j < len; j++) {
    int64_t base = kv_offset(table, j, block_size, hkv, g, d);
    for (t = d4; t < d; t++) acc[t] += sc[j] * scalar_at(v_cache, base + t, bf16);
  }
  float *o = out_row + h * d;
  for (t = 0; t < d; t++) o[t] = (float)(acc[t] / total);
}

/* K and V of one position, columns 0 .. 16*floor(d/16), widened 16 at a time with AVX-512 (the dense copy's
 * cost at batch 32: with load4 it was ~14 % of a SmolLM2 step). The same exact values as load4. Returns the
 * columns done. */
__attribute__((target("avx512f,avx512bw"))) static int64_t widen16(const void *k_cache, const void *v_cache,
                                                                    int64_t base, int bf16, int64_t d, double *kr,
                                                                    double *vr) {
  int64_t t = 0;
  for (; t + 16 <= d; t += 16) {
    __m512 k, v;
    if (bf16) {
      __m256i kb = _mm256_loadu_si256((const __m256i *)((const uint16_t *)k_cache + base + t));
      __m256i vb = _mm256_loadu_si256((const __m256i *)((const uint16_t *)v_cache + base + t));
      k = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(kb), 16));
      v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(vb), 16));
    } else {
      k = _mm512_loadu_ps((const float *)k_cache + base + t);
      v = _mm512_loadu_ps((const float *)v_cache + base + t);
    }
    _mm512_storeu_pd(kr + t, _mm512_cvtps_pd(_mm512_castps512_ps256(k)));
    _mm512_storeu_pd(kr + t + 8, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(k), 1))));
    _mm512_storeu_pd(vr + t, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
    _mm512_storeu_pd(vr + t + 8, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
  }
  return t;
}

/* Every query head of kv head g's group (h0 .. h0 + group - 1) for one row: the context's K and V widened
 * once into kd/vd, then each head as attend computes it (same values, same order: the same bits). */
static void attend_group(const float *q_row, float *out_row, int64_t h0, int64_t group, int64_t g, int64_t d,
                         int64_t hkv, const void *k_cache, const void *v_cache, int bf16, int64_t block_size,
                         const int64_t *table, int64_t len, double scale, double *qd, double *sc, double *acc,
                         double *kd, double *vd, int wide) {
  int64_t d4 = d & ~(int64_t)3;
  for (int64_t j = 0; j < len; j++) {
    int64_t base = kv_offset(table, j, block_size, hkv, g, d);
    double *kr = kd + j * d, *vr = vd + j * d;
    int64_t t = wide ? widen16(k_cache, v_cache, base, bf16, d, kr, vr) : 0;
    for (; t < d4; t += 4) {
      _mm256_storeu_pd(kr + t, load4(k_cache, base + t, bf16));
      _mm256_storeu_pd(vr + t, load4(v_cache, base + t, bf16));
    }
    for (; t < d; t++) {
      kr[t] = scalar_at(k_cache, base + t, bf16);
      vr[t] = scalar_at(v_cache, base + t, bf16);
    }
  }
  for (int64_t h = h0; h < h0 + group; h++) {
    for (int64_t t = 0; t < d; t++) qd[t] = q_row[h * d + t];
    score_dense(qd, sc, d, kd, len, scale);
    double total = softmax_numerators(sc, len);
    int64_t t = 0;
    for (; t + 32 <= d4; t += 32) pv8_dense(sc, acc, t, d, vd, len);
    for (; t < d4; t += 4) pv1_dense(sc, acc, t, d, vd, len);
    for (t = d4; t < d; t++) acc[t] = 0.0;
    for (int64_t j = 0; j < len; j++)
      for (t = d4; t < d; t++) acc[t] += sc[j] * vd[j * d + t];
    float *o = out_row + h * d;
    for (t = 0; t < d; t++) o[t] = (float)(acc[t] / total);
  }
}

/* q: [tokens, hq, d] float32 at row stride q_stride (floats: a view into a fused qkv output needs no copy),
 * out: [tokens, hq, d] contiguous; rows[r]: the token index of row r; tables + table_offsets[r]: its block
 * table; lens[r]: its context length (>= 1). Returns 0, -1 if scratch could not be allocated, -2 on
 * bad sizes. */
int pdd_paged_attention(const float *q, int64_t q_stride, float *out, int64_t hq, int64_t hkv, int64_t d,
                        const void *k_cache, const void *v_cache, int kv_bf16, int64_t block_size, const int64_t *rows,
                        const int64_t *tables, const int64_t *table_offsets, const int64_t *lens, int64_t nrows,
                        double scale, int threads) {
  if (hkv <= 0 || hq % hkv || d <= 0 || block_size <= 0) return -2;
  int64_t group = hq / hkv, max_len = 1;
  for (int64_t r = 0; r < nrows; r++) {
    if (lens[r] < 1) return -2;
    if (lens[r] > max_len) max_len = lens[r];
  }
  /* Work items: (row, kv head) when there are enough of them to keep every thread busy and the contexts are
   * short enough for a dense copy (each GQA group's K and V widened once, not once per query head); else
   * (row, query head): a batch-1 step has hq items to share, not hkv (3 kv heads on 2 threads left one idle a
   * third of the time). A head's arithmetic is the same either way and on any thread. */
  int grouped = group > 1 && nrows * hkv >= 4 * (int64_t)threads && max_len <= GROUP_MAX_LEN;
  __builtin_cpu_init();
  int wide = __builtin_cpu_supports("avx512bw") ? 1 : 0;
  int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
  {
    double *scratch = malloc(sizeof(double) * (2 * d + max_len + (grouped ? 2 * max_len * d : 0)));
    if (!scratch) failed = 1;
    double *qd = scratch, *sc = scratch + d, *acc = scratch + d + max_len, *kd = acc + d, *vd = kd + max_len * d;
    int64_t items = nrows * (grouped ? hkv : hq);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < items; w++) {
      if (!scratch) continue;
      if (grouped) {
        int64_t r = w / hkv, g = w % hkv, tok = rows[r];
        attend_group(q + tok * q_stride, out + tok * hq * d, g * group, group, g, d, hkv, k_cache, v_cache, kv_bf16,
                     block_size, tables + table_offsets[r], lens[r], scale, qd, sc, acc, kd, vd, wide);
      } else {
        int64_t r = w / hq, h = w % hq, tok = rows[r];
        attend(q + tok * q_stride, out + tok * hq * d, h, h / group, d, hkv, k_cache, v_cache, kv_bf16, block_size,
               tables + table_offsets[r], lens[r], scale, qd, sc, acc);
      }
    }
    free(scratch);
  }
  return failed ? -1 : 0;
}
