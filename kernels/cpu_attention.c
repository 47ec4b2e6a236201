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
 * Threads (OpenMP) take (row, query head) pairs.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

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

/* One (row, query head h) over kv head g (GQA: h / group). q_row is the row's [hq, d] query (float32);
 * qd/scores/acc are this thread's scratch (d, len, d doubles). */
static void attend(const float *q_row, float *out_row, int64_t h, int64_t g, int64_t d, int64_t hkv,
                   const void *k_cache, const void *v_cache, int bf16, int64_t block_size, const int64_t *table,
                   int64_t len, double scale, double *qd, double *sc, double *acc) {
  for (int64_t t = 0; t < d; t++) qd[t] = q_row[h * d + t];
  int64_t d4 = d & ~(int64_t)3;
  score_row(qd, sc, d, hkv, g, k_cache, bf16, block_size, table, len, scale);
  double m = sc[0], total = 0.0;
  for (int64_t j = 1; j < len; j++) m = sc[j] > m ? sc[j] : m;
  for (int64_t j = 0; j < len; j++) { sc[j] = exp(sc[j] - m); total += sc[j]; }
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
  int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
  {
    double *scratch = malloc(sizeof(double) * (2 * d + max_len));
    if (!scratch) failed = 1;
    /* one query head per item: a batch-1 step has hq items to share, not hkv (3 kv heads on 2 threads left
     * one idle a third of the time); a head's arithmetic does not depend on which thread takes it */
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < nrows * hq; w++) {
      if (!scratch) continue;
      int64_t r = w / hq, h = w % hq, tok = rows[r];
      attend(q + tok * q_stride, out + tok * hq * d, h, h / group, d, hkv, k_cache, v_cache, kv_bf16, block_size,
             tables + table_offsets[r], lens[r], scale, scratch, scratch + d, scratch + d + max_len);
    }
    free(scratch);
  }
  return failed ? -1 : 0;
}
