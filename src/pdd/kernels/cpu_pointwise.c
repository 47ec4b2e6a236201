/* A layer's small row-wise ops for x86-64 CPUs with AVX2 and FMA (see kernels/pointwise.py).
 *
 * Between its four projections a decoder layer runs RMSNorm twice, rotates q and k, stores k and v into the
 * paged pool and gates the MLP. In torch that is ~20 eager ops per layer, each a dispatch, an allocation
 * and a pass over memory: ~6 ms of a 45 ms batch-1 step of SmolLM2 (30 layers), ~25 ms of a batch-32 step.
 * Here each is one call and one pass. Every op works row by row in one fixed order, so a row's bits depend
 * only on that row (the engine's batch invariance, docs/ENGINE.md), and none allocates.
 *
 * All activations are float32 rows with contiguous last dimension and an explicit row stride (in floats),
 * so views into the fused qkv output need no copy.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native.h"

/* out[r, g, :] = w * x[r, g, :] / sqrt(mean(x[r, g, :]^2) + eps) for each of `groups` vectors of `dim` in a
 * row (groups > 1: per-head q/k norm). The mean of squares accumulates in float64, 4 lanes in a fixed order;
 * then, like the reference (Hugging Face LlamaRMSNorm in float32), (x * inv) * w in float32. */
void pdd_rms_norm(const float *x, int64_t x_stride, int64_t rows, int64_t groups, int64_t dim, const float *w,
                  float eps, float *out, int64_t out_stride) {
  int64_t d4 = dim & ~(int64_t)3, d8 = dim & ~(int64_t)7;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t g = 0; g < groups; g++) {
      const float *xr = x + r * x_stride + g * dim;
      float *o = out + r * out_stride + g * dim;
      __m256d acc = _mm256_setzero_pd();
      for (int64_t i = 0; i < d4; i += 4) {
        __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(xr + i));
        acc = _mm256_fmadd_pd(v, v, acc);
      }
      __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(acc), _mm256_extractf128_pd(acc, 1));
      double sum = _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));
      for (int64_t i = d4; i < dim; i++) sum += (double)xr[i] * xr[i];
      float inv = 1.0f / sqrtf((float)(sum / (double)dim) + eps);
      __m256 iv = _mm256_set1_ps(inv);
      for (int64_t i = 0; i < d8; i += 8)
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), iv), _mm256_loadu_ps(w + i)));
      for (int64_t i = d8; i < dim; i++) o[i] = (xr[i] * inv) * w[i];
    }
}

/* Rotary embedding in place, "rotate half" layout: for each row r and each of its `heads` vectors of `dim`
 * (dim even), with c = cos[r], s = sin[r] (the row's angles, [rows, dim]) and h = dim / 2:
 *   x[i] <- x[i] * c[i] - x[i + h] * s[i],   x[i + h] <- x[i + h] * c[i + h] + x[i] * s[i + h]. */
void pdd_rope(float *x, int64_t x_stride, int64_t rows, int64_t heads, int64_t dim, const float *cos_rows,
              const float *sin_rows) {
  int64_t h = dim / 2, h8 = h & ~(int64_t)7;
  for (int64_t r = 0; r < rows; r++) {
    const float *c = cos_rows + r * dim, *s = sin_rows + r * dim;
    for (int64_t g = 0; g < heads; g++) {
      float *a = x + r * x_stride + g * dim, *b = a + h;
      for (int64_t i = 0; i < h8; i += 8) {
        __m256 va = _mm256_loadu_ps(a + i), vb = _mm256_loadu_ps(b + i);
        __m256 na = _mm256_sub_ps(_mm256_mul_ps(va, _mm256_loadu_ps(c + i)), _mm256_mul_ps(vb, _mm256_loadu_ps(s + i)));
        __m256 nb = _mm256_add_ps(_mm256_mul_ps(vb, _mm256_loadu_ps(c + h + i)), _mm256_mul_ps(va, _mm256_loadu_ps(s + h + i)));
        _mm256_storeu_ps(a + i, na);
        _mm256_storeu_ps(b + i, nb);
      }
      for (int64_t i = h8; i < h; i++) {
        float va = a[i], vb = b[i];
        a[i] = va * c[i] - vb * s[i];
        b[i] = vb * c[h + i] + va * s[h + i];
      }
    }
  }
}

/* e^x for 8 floats: x = n ln2 + r with |r| <= ln2 / 2, e^r by the Cephes degree-6 polynomial (within 2 ulp
 * of expf), 2^n through the exponent bits. x below -87.3 gives 0 (so silu(x) = x / inf = -0), above 88.7 inf. */
static inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.7228391f), lo = _mm256_set1_ps(-87.3365448f);
  __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ), over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  /* n in [-126, 128]: 2^n as (n + 127) << 23; n = 128 only at the clamp, fixed below */
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  y = _mm256_andnot_ps(under, y);
  return _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), over);
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i], silu(g) = g / (1 + e^-g): the gated MLP's
 * activation over the fused gate|up projection, [rows, 2 * inter] -> [rows, inter]. */
void pdd_silu_mul(const float *gate_up, int64_t rows, int64_t inter, float *out) {
  int64_t n8 = inter & ~(int64_t)7;
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (int64_t r = 0; r < rows; r++) {
    const float *g = gate_up + r * 2 * inter, *u = g + inter;
    float *o = out + r * inter;
    for (int64_t i = 0; i < n8; i += 8) {
      __m256 vg = _mm256_loadu_ps(g + i);
      __m256 silu = _mm256_div_ps(vg, _mm256_add_ps(one, exp8(_mm256_xor_ps(vg, sign))));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
    }
    for (int64_t i = n8; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
  }
}

/* float32 -> bf16, round to nearest even; NaN -> quiet NaN. The same bits as torch's .to(torch.bfloat16),
 * which the fresh-prompt attention uses on the same values (kernels/attention.py). */
static inline uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Store `rows` rows of `width` floats (row stride src_stride) into rows slots[r] of a [num_slots, width]
 * pool, float32 or bf16 (pool_bf16). Returns 0, or -2 (nothing written) if a slot is outside the pool. */
int pdd_store_rows(const float *src, int64_t src_stride, int64_t rows, int64_t width, const int64_t *slots,
                   void *pool, int64_t num_slots, int pool_bf16) {
  for (int64_t r = 0; r < rows; r++)
    if (slots[r] < 0 || slots[r] >= num_slots) return -2;
  for (int64_t r = 0; r < rows; r++) {
    const float *s = src + r * src_stride;
    if (pool_bf16) {
      uint16_t *d = (uint16_t *)pool + slots[r] * width;
      for (int64_t i = 0; i < width; i++) d[i] = to_bf16(s[i]);
    } else {
      memcpy((float *)pool + slots[r] * width, s, sizeof(float) * width);
    }
  }
  return 0;
}
