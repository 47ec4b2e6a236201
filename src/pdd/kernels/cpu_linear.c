/* Row-invariant dense projection for x86-64 CPUs with AVX2 and FMA (see kernels/cpu_linear.py).
 *
 *   out[m, n] = res[m, n] + ((sum_k x[m, k] * w[n, k]) + bias[n])      (bias, res optional)
 *
 * Every output accumulates over k = 0..K-1 in order, in one fp32 FMA chain (one lane of one register),
 * then adds bias and residual in that order. No reduction is split or reassociated, so an output row's
 * bits depend only on its input row: not on M, not on which rows share its micro-tile, not on the thread
 * count. That is what lets a decode step (1 row), a batch (8-256 rows) and an extend of known tokens
 * give the same tokens (batch invariance), which oneDNN's and MKL's GEMV/GEMM do not promise.
 *
 * Weights are packed once, at load, in panels of PANEL output columns: w_packed[p][k][c] = w[PANEL*p + c][k]
 * (N zero-padded to a multiple of PANEL), fp32 or bf16 (the upper half of an fp32: widening is exact, so
 * a bf16 weight gives the same bits through either load). The micro-kernel keeps a 4 x 24 output tile in
 * 12 ymm registers: per k, three 8-wide weight loads and four broadcasts feed twelve FMAs.
 * Threads (OpenMP, the runtime torch already loaded) take contiguous ranges of panels.
 */
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>

#include "native.h"

#define PANEL 24
#define MR 4
#define UNPACK_ROWS 8 /* from this many rows a bf16 panel is widened once to fp32, then reused per tile */
#define ROW_BLOCK 128 /* rows of x one pass over a thread's panels takes (a multiple of MR: same tiles) */

static inline __attribute__((always_inline)) void load_f32(const float *p, __m256 *w0, __m256 *w1, __m256 *w2) {
  *w0 = _mm256_loadu_ps(p);
  *w1 = _mm256_loadu_ps(p + 8);
  *w2 = _mm256_loadu_ps(p + 16);
}

static inline __attribute__((always_inline)) __m256 widen_bf16(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __attribute__((always_inline)) void load_bf16(const uint16_t *p, __m256 *w0, __m256 *w1, __m256 *w2) {
  *w0 = widen_bf16(_mm_loadu_si128((const __m128i *)p));
  *w1 = widen_bf16(_mm_loadu_si128((const __m128i *)(p + 8)));
  *w2 = widen_bf16(_mm_loadu_si128((const __m128i *)(p + 16)));
}

#define FMA_ROW(i)                                                 \
  if (rows > i) {                                                  \
    __m256 xv = _mm256_broadcast_ss(x + i * K + k);                \
    a##i##0 = _mm256_fmadd_ps(xv, w0, a##i##0);                    \
    a##i##1 = _mm256_fmadd_ps(xv, w1, a##i##1);                    \
    a##i##2 = _mm256_fmadd_ps(xv, w2, a##i##2);                    \
  }
#define STORE_ROW(i)                                               \
  if (rows > i) {                                                  \
    _mm256_storeu_ps(tile[i], a##i##0);                            \
    _mm256_storeu_ps(tile[i] + 8, a##i##1);                        \
    _mm256_storeu_ps(tile[i] + 16, a##i##2);                       \
  }

/* One tile: `rows` (1..MR, a constant after inlining) rows of x against one panel. Named accumulators,
 * not an array: gcc keeps them in registers only then. `pf`, when set, is a slice of the next panel to
 * prefetch into L2 while this tile computes from cache, `pf_step` bytes of it per k (see DEFINE_PANEL). */
#define DEFINE_TILE(NAME, WT, LOAD)                                                                      \
  static inline __attribute__((always_inline)) void NAME(                                               \
      const int rows, const float *x, int64_t K, const WT *panel, int64_t cols, const float *bias,       \
      const float *res, float *out, int64_t N, const char *pf, int64_t pf_step) {                        \
    __m256 z = _mm256_setzero_ps();                                                                      \
    __m256 a00 = z, a01 = z, a02 = z, a10 = z, a11 = z, a12 = z;                                         \
    __m256 a20 = z, a21 = z, a22 = z, a30 = z, a31 = z, a32 = z;                                         \
    if (pf) {                                                                                            \
      for (int64_t k = 0; k < K; k++) {                                                                  \
        __m256 w0, w1, w2;                                                                               \
        _mm_prefetch(pf + k * pf_step, _MM_HINT_T1);                                                     \
        LOAD(panel + k * PANEL, &w0, &w1, &w2);                                                          \
        FMA_ROW(0) FMA_ROW(1) FMA_ROW(2) FMA_ROW(3)                                                      \
      }                                                                                                  \
    } else {                                                                                             \
      for (int64_t k = 0; k < K; k++) {                                                                  \
        __m256 w0, w1, w2;                                                                               \
        LOAD(panel + k * PANEL, &w0, &w1, &w2);                                                          \
        FMA_ROW(0) FMA_ROW(1) FMA_ROW(2) FMA_ROW(3)                                                      \
      }                                                                                                  \
    }                                                                                                    \
    float tile[MR][PANEL];                                                                               \
    STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3)                                                  \
    for (int i = 0; i < rows; i++)                                                                       \
      for (int64_t j = 0; j < cols; j++) {                                                               \
        float v = tile[i][j];                                                                            \
        if (bias) v = v + bias[j];                                                                       \
        if (res) v = res[i * N + j] + v;                                                                 \
        out[i * N + j] = v;                                                                              \
      }                                                                                                  \
  }

DEFINE_TILE(tile_f32, float, load_f32)
DEFINE_TILE(tile_bf16, uint16_t, load_bf16)

/* All M rows of x against one panel (columns n0 .. n0+cols). The first tile streams the panel from memory;
 * the others reread it from cache, so while they compute they prefetch the next panel (`next`, `next_bytes`),
 * each its share: without it a tile of every panel waited on memory (32 rows: ~90 GFLOP/s streaming vs ~107
 * with the weights cached). */
#define DEFINE_PANEL(NAME, WT, TILE)                                                                    \
  static void NAME(const float *x, int64_t M, int64_t K, const WT *panel, int64_t N, int64_t n0,        \
                   int64_t cols, const float *bias, const float *res, float *out, const char *next,     \
                   int64_t next_bytes) {                                                                 \
    const float *b = bias ? bias + n0 : 0;                                                               \
    int64_t tiles = M / MR, share = tiles > 1 ? (next_bytes + tiles - 2) / (tiles - 1) : 0;               \
    int64_t m = 0;                                                                                       \
    for (; m + MR <= M; m += MR) {                                                                       \
      int64_t t = m / MR;                                                                                \
      const char *pf = next && t > 0 ? next + (t - 1) * share : 0;                                        \
      TILE(MR, x + m * K, K, panel, cols, b, res ? res + m * N + n0 : 0, out + m * N + n0, N, pf,        \
           (share + K - 1) / K);                                                                         \
    }                                                                                                    \
    const float *xr = x + m * K, *rr = res ? res + m * N + n0 : 0;                                       \
    float *orow = out + m * N + n0;                                                                      \
    switch (M - m) {                                                                                     \
      case 3: TILE(3, xr, K, panel, cols, b, rr, orow, N, 0, 0); break;                                  \
      case 2: TILE(2, xr, K, panel, cols, b, rr, orow, N, 0, 0); break;                                  \
      case 1: TILE(1, xr, K, panel, cols, b, rr, orow, N, 0, 0); break;                                  \
    }                                                                                                    \
  }

DEFINE_PANEL(panel_f32, float, tile_f32)
DEFINE_PANEL(panel_bf16, uint16_t, tile_bf16)

/* One row against three consecutive full panels (72 columns): nine independent FMA chains instead of three,
 * so a batch-1 GEMV is not held by the FMA latency of three chains (bf16 weights bring only 48 bytes per k
 * and panel). Each output is still one chain over k in order, then bias and residual: the bits of tile_*. */
#define DEFINE_ROW3(NAME, WT, LOAD)                                                                      \
  static void NAME(const float *x, int64_t K, const WT *panel, const float *bias, const float *res,     \
                   float *out) {                                                                        \
    const WT *q1 = panel + K * PANEL, *q2 = q1 + K * PANEL;                                             \
    __m256 z = _mm256_setzero_ps();                                                                     \
    __m256 a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z, a6 = z, a7 = z, a8 = z;                       \
    for (int64_t k = 0; k < K; k++) {                                                                   \
      __m256 xv = _mm256_broadcast_ss(x + k), w0, w1, w2;                                               \
      LOAD(panel + k * PANEL, &w0, &w1, &w2);                                                           \
      a0 = _mm256_fmadd_ps(xv, w0, a0);                                                                 \
      a1 = _mm256_fmadd_ps(xv, w1, a1);                                                                 \
      a2 = _mm256_fmadd_ps(xv, w2, a2);                                                                 \
      LOAD(q1 + k * PANEL, &w0, &w1, &w2);                                                              \
      a3 = _mm256_fmadd_ps(xv, w0, a3);                                                                 \
      a4 = _mm256_fmadd_ps(xv, w1, a4);                                                                 \
      a5 = _mm256_fmadd_ps(xv, w2, a5);                                                                 \
      LOAD(q2 + k * PANEL, &w0, &w1, &w2);                                                              \
      a6 = _mm256_fmadd_ps(xv, w0, a6);                                                                 \
      a7 = _mm256_fmadd_ps(xv, w1, a7);                                                                 \
      a8 = _mm256_fmadd_ps(xv, w2, a8);                                                                 \
    }                                                                                                   \
    float tile[3 * PANEL];                                                                              \
    _mm256_storeu_ps(tile, a0); _mm256_storeu_ps(tile + 8, a1); _mm256_storeu_ps(tile + 16, a2);        \
    _mm256_storeu_ps(tile + 24, a3); _mm256_storeu_ps(tile + 32, a4); _mm256_storeu_ps(tile + 40, a5);  \
    _mm256_storeu_ps(tile + 48, a6); _mm256_storeu_ps(tile + 56, a7); _mm256_storeu_ps(tile + 64, a8);  \
    for (int64_t j = 0; j < 3 * PANEL; j++) {                                                           \
      float v = tile[j];                                                                                \
      if (bias) v = v + bias[j];                                                                        \
      if (res) v = res[j] + v;                                                                          \
      out[j] = v;                                                                                       \
    }                                                                                                   \
  }

DEFINE_ROW3(row3_f32, float, load_f32)
DEFINE_ROW3(row3_bf16, uint16_t, load_bf16)

int pdd_linear_panel_width(void) { return PANEL; }

/* x [M, K] fp32, w packed (see above) in `w_format` (0 fp32, 1 bf16 widened to fp32, 2 bf16 pairs for
 * cpu_linear_bf16.c, which this hands over to), bias [N] or NULL, res [M, N] or NULL, out [M, N].
 * Each thread takes a contiguous range of panels and walks the rows in blocks of ROW_BLOCK, so a block of
 * x stays in L2 while the thread's panels stream past it (one pass over x per panel spilled to L3 at
 * thousands of rows). Returns 0, or -1 when a buffer could not be allocated (-3: see pdd_linear_bf16). */
int pdd_linear(const float *x, int64_t M, int64_t K, const void *w, int w_format, int64_t N, const float *bias,
               const float *res, float *out, int threads) {
  if (w_format == PDD_W_BF16_DOT) return pdd_linear_bf16(x, M, K, w, N, bias, res, out, threads);
  const int w_bf16 = w_format == PDD_W_BF16;
  int64_t panels = (N + PANEL - 1) / PANEL;
  int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
  {
    int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
    int64_t p0 = panels * me / team, p1 = panels * (me + 1) / team;
    float *wide = 0; /* this thread's fp32 copy of a bf16 panel, for many-row inputs */
    if (w_bf16 && M >= UNPACK_ROWS && !(wide = malloc(sizeof(float) * K * PANEL))) failed = 1;
    for (int64_t m0 = 0; m0 < M && !failed; m0 += ROW_BLOCK) {
      int64_t rows = M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK;
      const float *xb = x + m0 * K, *rb = res ? res + m0 * N : 0;
      float *ob = out + m0 * N;
      for (int64_t p = p0; p < p1; p++) {
        int64_t n0 = p * PANEL, cols = N - n0 < PANEL ? N - n0 : PANEL;
        if (rows == 1 && p + 3 <= p1 && n0 + 3 * PANEL <= N) { /* one row: three panels at a time */
          const float *b3 = bias ? bias + n0 : 0, *r3 = rb ? rb + n0 : 0;
          if (w_bf16)
            row3_bf16(xb, K, (const uint16_t *)w + p * K * PANEL, b3, r3, ob + n0);
          else
            row3_f32(xb, K, (const float *)w + p * K * PANEL, b3, r3, ob + n0);
          p += 2;
          continue;
        }
        int64_t wbytes = K * PANEL * (w_bf16 ? 2 : 4);
        const char *next = p + 1 < p1 ? (const char *)w + (p + 1) * wbytes : 0;
        if (!w_bf16) {
          panel_f32(xb, rows, K, (const float *)w + p * K * PANEL, N, n0, cols, bias, rb, ob, next, wbytes);
        } else if (wide) {
          const uint16_t *src = (const uint16_t *)w + p * K * PANEL;
          for (int64_t i = 0; i + 8 <= K * PANEL; i += 8)
            _mm256_storeu_ps(wide + i, widen_bf16(_mm_loadu_si128((const __m128i *)(src + i))));
          panel_f32(xb, rows, K, wide, N, n0, cols, bias, rb, ob, next, wbytes);
        } else {
          panel_bf16(xb, rows, K, (const uint16_t *)w + p * K * PANEL, N, n0, cols, bias, rb, ob, next, wbytes);
        }
      }
    }
    free(wide);
  }
  return failed ? -1 : 0;
}
