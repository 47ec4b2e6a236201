/* Row-invariant dense projection in bf16 arithmetic, for CPUs with AVX512-BF16 (see kernels/cpu_linear.py).
 *
 *   out[m, n] = res[m, n] + ((sum_k bf16(x[m, k]) * w[n, k]) + bias[n])      (bias, res optional)
 *
 * The route for bf16 weights where the CPU has `vdpbf16ps`: each instruction multiplies 16 pairs of bf16
 * values exactly and adds them to 16 fp32 accumulators, twice the products per instruction of an fp32 FMA.
 * x is rounded to bf16 once per call (round to nearest even, as `vcvtneps2bf16` does); accumulation, bias,
 * residual and the output stay fp32 (the precision layout docs/ENGINE.md measured at >= 99 % top-1).
 *
 * Row invariance, as in cpu_linear.c: every output is one accumulator lane that takes k-pairs 0..K/2-1 in
 * order, one `vdpbf16ps` per pair, then bias and residual. A row's bits depend only on its input row: not on
 * M, the micro-tile, the thread count, or whether the one-row route below took it.
 *
 * Weights are packed once, at load, in panels of PANEL_BF16 output columns, pairs of k interleaved:
 * w_packed[p][kk][c][t] = w[PANEL_BF16 * p + c][2 kk + t] (N and K zero-padded to a multiple of PANEL_BF16 and 2).
 * The micro-kernel keeps an 8 x 48 output tile in 24 zmm registers: per k-pair, three weight loads and eight
 * broadcast pairs of x feed 24 `vdpbf16ps`.
 */
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>

#include "native.h"

#define PANEL_BF16 48
#define MR_BF16 8
#define ROW_BLOCK_BF16 128 /* rows of x one pass over a thread's panels takes (a multiple of MR_BF16) */
#define ROW_PANELS 4       /* the one-row route takes this many panels at a time: 12 accumulator chains */
#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define INLINE static inline __attribute__((always_inline)) AVX512_BF16

int pdd_linear_bf16_supported(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") ? 1 : 0;
}

int pdd_linear_bf16_panel_width(void) { return PANEL_BF16; }

/* x [M, K] fp32 -> xb [M, KP] bf16 pairs (KP = K rounded up to even, zero pad), round to nearest even. */
static AVX512_BF16 void round_rows(const float *x, int64_t M, int64_t K, uint16_t *xb, int64_t KP) {
  for (int64_t m = 0; m < M; m++) {
    const float *src = x + m * K;
    uint16_t *dst = xb + m * KP;
    for (int64_t k = 0; k < KP; k += 16) {
      int64_t n = K - k < 16 ? (K - k > 0 ? K - k : 0) : 16;
      __mmask16 mask = (__mmask16)((1u << n) - 1u);
      __m512 v = _mm512_maskz_loadu_ps(mask, src + k);
      __m256i b = (__m256i)_mm512_cvtneps_pbh(v);
      __mmask16 store = (__mmask16)((KP - k < 16 ? (1u << (KP - k)) : 0x10000u) - 1u);
      _mm256_mask_storeu_epi16(dst + k, store, b);
    }
  }
}

#define DOT_ROW(i)                                                                            \
  if (rows > i) {                                                                             \
    __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[i * KK + kk]); /* an embedded broadcast */ \
    a##i##0 = _mm512_dpbf16_ps(a##i##0, w0, xv);                                              \
    a##i##1 = _mm512_dpbf16_ps(a##i##1, w1, xv);                                              \
    a##i##2 = _mm512_dpbf16_ps(a##i##2, w2, xv);                                              \
  }
#define FINISH_ROW(i)                                                                         \
  if (rows > i) {                                                                             \
    finish(a##i##0, 0, cols, bias, res ? res + i * N : 0, out + i * N);                       \
    finish(a##i##1, 16, cols, bias, res ? res + i * N : 0, out + i * N);                      \
    finish(a##i##2, 32, cols, bias, res ? res + i * N : 0, out + i * N);                      \
  }

/* Columns j0 .. j0+15 of a row (those below `cols`): + bias, then residual + that, in that order (cpu_linear.c's
 * epilogue, the same IEEE adds in a vector): the same bits whichever route computed the accumulator. */
INLINE void finish(__m512 v, int64_t j0, int64_t cols, const float *bias, const float *res, float *out) {
  if (j0 >= cols) return;
  __mmask16 m = cols - j0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (cols - j0)) - 1u);
  if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + j0));
  if (res) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, res + j0), v);
  _mm512_mask_storeu_ps(out + j0, m, v);
}

/* One tile: `rows` (1..MR_BF16, a constant after inlining) rows of x (bf16 pairs, as uint32) against one panel.
 * `pf`, when set, is a slice of the next panel to prefetch into L2, `pf_step` bytes of it per k-pair. */
INLINE void tile_dot(const int rows, const uint32_t *xp, int64_t KK, const uint16_t *panel, int64_t cols,
                     const float *bias, const float *res, float *out, int64_t N, const char *pf, int64_t pf_step) {
  __m512 z = _mm512_setzero_ps();
  __m512 a00 = z, a01 = z, a02 = z, a10 = z, a11 = z, a12 = z, a20 = z, a21 = z, a22 = z, a30 = z, a31 = z, a32 = z;
  __m512 a40 = z, a41 = z, a42 = z, a50 = z, a51 = z, a52 = z, a60 = z, a61 = z, a62 = z, a70 = z, a71 = z, a72 = z;
  for (int64_t kk = 0; kk < KK; kk++) {
    const uint16_t *w = panel + kk * 2 * PANEL_BF16;
    if (pf) _mm_prefetch(pf + kk * pf_step, _MM_HINT_T1);
    __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64);
    DOT_ROW(0) DOT_ROW(1) DOT_ROW(2) DOT_ROW(3) DOT_ROW(4) DOT_ROW(5) DOT_ROW(6) DOT_ROW(7)
  }
  FINISH_ROW(0) FINISH_ROW(1) FINISH_ROW(2) FINISH_ROW(3) FINISH_ROW(4) FINISH_ROW(5) FINISH_ROW(6) FINISH_ROW(7)
}

/* All M rows of x against one panel (columns n0 .. n0+cols): the first tile streams the panel from memory,
 * the others reread it from cache while prefetching their share of the next panel (cpu_linear.c: why). */
static AVX512_BF16 void panel_dot(const uint32_t *xp, int64_t M, int64_t KK, const uint16_t *panel, int64_t N,
                                  int64_t n0, int64_t cols, const float *bias, const float *res, float *out,
                                  const char *next, int64_t next_bytes) {
  const float *b = bias ? bias + n0 : 0;
  int64_t tiles = M / MR_BF16, share = tiles > 1 ? (next_bytes + tiles - 2) / (tiles - 1) : 0;
  int64_t m = 0;
  for (; m + MR_BF16 <= M; m += MR_BF16) {
    int64_t t = m / MR_BF16;
    const char *pf = next && t > 0 ? next + (t - 1) * share : 0;
    tile_dot(MR_BF16, xp + m * KK, KK, panel, cols, b, res ? res + m * N + n0 : 0, out + m * N + n0, N, pf,
             (share + KK - 1) / KK);
  }
  const uint32_t *xr = xp + m * KK;
  const float *rr = res ? res + m * N + n0 : 0;
  float *orow = out + m * N + n0;
  switch (M - m) {
    case 7: tile_dot(7, xr, KK, panel, cols, b, rr, orow, N, 0, 0); break;
    case 6: tile_dot(6, xr, KK, panel, cols, b, rr, orow, N, 0, 0); break;
    case 5: tile_dot(5, xr, KK, panel, cols, b, rr, orow, N, 0, 0); break;
    case 4: tile_dot(4, xr, KK, panel, cols, b, rr, orow, N, 0, 0); break;
    case 3: tile_dot(3, xr, KK, panel, cols, b, rr, orow, N, 0, 0); break;
    case 2: tile_dot(2, xr, KK, panel, cols, b, rr, orow, N, 0, 0); break;
    case 1: tile_dot(1, xr, KK, panel, cols, b, rr, orow, N, 0, 0); break;
  }
}

/* One row against ROW_PANELS consecutive full panels: twelve independent accumulator chains instead of three,
 * so a batch-1 GEMV streams weights instead of waiting on `vdpbf16ps` latency. Same lane arithmetic as tile_dot. */
static AVX512_BF16 void row_dot(const uint32_t *xp, int64_t KK, const uint16_t *panel, const float *bias,
                                const float *res, float *out) {
  const int64_t step = KK * 2 * PANEL_BF16;
  __m512 z = _mm512_setzero_ps();
  __m512 a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z, a6 = z, a7 = z, a8 = z, a9 = z, a10 = z, a11 = z;
#define DOT_PANEL(q, c0, c1, c2)                                                              \
  c0 = _mm512_dpbf16_ps(c0, (__m512bh)_mm512_loadu_si512(q), xv);                             \
  c1 = _mm512_dpbf16_ps(c1, (__m512bh)_mm512_loadu_si512((q) + 32), xv);                      \
  c2 = _mm512_dpbf16_ps(c2, (__m512bh)_mm512_loadu_si512((q) + 64), xv);
  for (int64_t kk = 0; kk < KK; kk++) {
    __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[kk]);
    const uint16_t *w = panel + kk * 2 * PANEL_BF16;
    DOT_PANEL(w, a0, a1, a2)
    DOT_PANEL(w + step, a3, a4, a5)
    DOT_PANEL(w + 2 * step, a6, a7, a8)
    DOT_PANEL(w + 3 * step, a9, a10, a11)
  }
#undef DOT_PANEL
  const int64_t n = ROW_PANELS * PANEL_BF16;
  finish(a0, 0, n, bias, res, out); finish(a1, 16, n, bias, res, out); finish(a2, 32, n, bias, res, out);
  finish(a3, 48, n, bias, res, out); finish(a4, 64, n, bias, res, out); finish(a5, 80, n, bias, res, out);
  finish(a6, 96, n, bias, res, out); finish(a7, 112, n, bias, res, out); finish(a8, 128, n, bias, res, out);
  finish(a9, 144, n, bias, res, out); finish(a10, 160, n, bias, res, out); finish(a11, 176, n, bias, res, out);
}

/* x [M, K] fp32, w packed as above (K padded to KP = K + K % 2), bias [N] or NULL, res [M, N] or NULL,
 * out [M, N] fp32. Threads take contiguous ranges of panels (cpu_linear.c: why). Returns 0, -1 when the bf16
 * copy of x could not be allocated, -3 when this CPU lacks AVX512-BF16. */
int pdd_linear_bf16(const float *x, int64_t M, int64_t K, const void *w, int64_t N, const float *bias,
                    const float *res, float *out, int threads) {
  if (!pdd_linear_bf16_supported()) return -3;
  const int64_t KP = K + (K & 1), KK = KP / 2, panels = (N + PANEL_BF16 - 1) / PANEL_BF16;
  uint16_t *xb = malloc(sizeof(uint16_t) * (M * KP > 0 ? M * KP : 1));
  if (!xb) return -1;
  const uint32_t *xp = (const uint32_t *)xb;
  const uint16_t *wp = (const uint16_t *)w;
  const int64_t panel_elems = KK * 2 * PANEL_BF16;
#pragma omp parallel num_threads(threads)
  {
    int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
    int64_t p0 = panels * me / team, p1 = panels * (me + 1) / team;
    int64_t r0 = M * me / team, r1 = M * (me + 1) / team;
    round_rows(x + r0 * K, r1 - r0, K, xb + r0 * KP, KP);
#pragma omp barrier
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK_BF16) {
      int64_t rows = M - m0 < ROW_BLOCK_BF16 ? M - m0 : ROW_BLOCK_BF16;
      const uint32_t *xblk = xp + m0 * KK;
      const float *rb = res ? res + m0 * N : 0;
      float *ob = out + m0 * N;
      for (int64_t p = p0; p < p1; p++) {
        int64_t n0 = p * PANEL_BF16, cols = N - n0 < PANEL_BF16 ? N - n0 : PANEL_BF16;
        if (rows == 1 && p + ROW_PANELS <= p1 && n0 + ROW_PANELS * PANEL_BF16 <= N) {
          row_dot(xblk, KK, wp + p * panel_elems, bias ? bias + n0 : 0, rb ? rb + n0 : 0, ob + n0);
          p += ROW_PANELS - 1;
          continue;
        }
        const char *next = p + 1 < p1 ? (const char *)(wp + (p + 1) * panel_elems) : 0;
        panel_dot(xblk, rows, KK, wp + p * panel_elems, N, n0, cols, bias, rb, ob, next,
                  panel_elems * (int64_t)sizeof(uint16_t));
      }
    }
  }
  free(xb);
  return 0;
}
