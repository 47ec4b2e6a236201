/* The C kernels' entry points (one extension, pdd.kernels._native; kernels/native.py binds them). */
#ifndef PDD_NATIVE_H
#define PDD_NATIVE_H
#include <stdint.h>

/* cpu_linear.c; weight formats (kernels/cpu_linear.py WeightFormat) */
#define PDD_W_FP32 0
#define PDD_W_BF16 1
#define PDD_W_BF16_DOT 2
int pdd_linear(const float *x, int64_t M, int64_t K, const void *w, int w_format, int64_t N, const float *bias,
               const float *res, float *out, int threads);
/* cpu_linear_bf16.c */
int pdd_linear_bf16(const float *x, int64_t M, int64_t K, const void *w, int64_t N, const float *bias,
                    const float *res, float *out, int threads);
int pdd_linear_bf16_supported(void);
int pdd_linear_bf16_panel_width(void);
/* cpu_attention.c */
int pdd_paged_attention(const float *q, int64_t q_stride, float *out, int64_t hq, int64_t hkv, int64_t d,
                        const void *k_cache, const void *v_cache, int kv_bf16, int64_t block_size, const int64_t *rows,
                        const int64_t *tables, const int64_t *table_offsets, const int64_t *lens, int64_t nrows,
                        double scale, int threads);
/* cpu_pointwise.c */
void pdd_rms_norm(const float *x, int64_t x_stride, int64_t rows, int64_t groups, int64_t dim, const float *w,
                  float eps, float *out, int64_t out_stride);
void pdd_rope(float *x, int64_t x_stride, int64_t rows, int64_t heads, int64_t dim, const float *cos_rows,
              const float *sin_rows);
void pdd_silu_mul(const float *gate_up, int64_t rows, int64_t inter, float *out);
int pdd_store_rows(const float *src, int64_t src_stride, int64_t rows, int64_t width, const int64_t *slots,
                   void *pool, int64_t num_slots, int pool_bf16);

#endif
