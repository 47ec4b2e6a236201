/* A pass of exact rows through every decoder layer in one call (see kernels/decoder.py).
 *
 * engine/model.py runs a Llama-family layer as ~12 calls into our kernels (norm, qkv projection, rotary,
 * KV store, attention, o projection with the residual, norm, gate|up projection, activation, down
 * projection with the residual). For a decode step that is ~360 calls from Python, each paying the
 * interpreter, ctypes and a tensor allocation: ~10 ms of a 45 ms batch-1 step of SmolLM2. When every row of
 * a pass takes the exact attention path (decode tokens, extends of output tokens: no fresh prompt needing
 * SDPA), this file makes the same calls, in the same order with the same arguments, from C: a row's bits
 * are those of the per-op route (tests/engine/test_decoder_layers.py), and the step costs one call.
 */
#include <stdint.h>

#include "native.h"

/* One layer's weights: packed projections (cpu_linear.c) and float32 norm weights and biases. */
typedef struct {
  const float *input_norm, *post_norm, *q_norm, *k_norm; /* q_norm, k_norm: NULL unless the model has them */
  const void *qkv, *o, *gate_up, *down;
  const float *qkv_bias, *o_bias; /* NULL when none */
} pdd_layer;

typedef struct {
  int64_t hidden, hq, hkv, d, inter, block_size, num_slots;
  int w_format, kv_bf16; /* w_format: cpu_linear.c's */
  float eps;
  double scale;
} pdd_dims;

/* hidden [rows, hidden] is updated in place (the residual stream). cos/sin [rows, d]: the rows' rotary angles.
 * slots [rows]: each row's KV slot. att_rows/tables/offsets/lens: the exact-rows metadata (kernels/attention.py,
 * ExactRows) listing every row. work: rows * (hidden + (hq + 2 hkv) d + hq d + 3 inter) floats.
 * Returns 0, or the first failing kernel's status (-1 no memory, -2 bad sizes or slots). */
int pdd_decoder_layers(const pdd_dims *m, const pdd_layer *layers, int64_t nlayers, void *const *k_pools,
                       void *const *v_pools, float *hidden, int64_t rows, const float *cos, const float *sin,
                       const int64_t *slots, const int64_t *att_rows, const int64_t *tables, const int64_t *offsets,
                       const int64_t *lens, float *work, int threads) {
  const int64_t H = m->hidden, d = m->d, hq = m->hq, hkv = m->hkv, qkv_n = (hq + 2 * hkv) * d;
  float *x = work, *qkv = x + rows * H, *attn = qkv + rows * qkv_n, *gate_up = attn + rows * hq * d;
  float *act = gate_up + rows * 2 * m->inter;
  for (int64_t i = 0; i < nlayers; i++) {
    const pdd_layer *l = layers + i;
    int status;
    pdd_rms_norm(hidden, H, rows, 1, H, l->input_norm, m->eps, x, H);
    if ((status = pdd_linear(x, rows, H, l->qkv, m->w_format, qkv_n, l->qkv_bias, 0, qkv, threads))) return status;
    if (l->q_norm) {
      pdd_rms_norm(qkv, qkv_n, rows, hq, d, l->q_norm, m->eps, qkv, qkv_n);
      pdd_rms_norm(qkv + hq * d, qkv_n, rows, hkv, d, l->k_norm, m->eps, qkv + hq * d, qkv_n);
    }
    pdd_rope(qkv, qkv_n, rows, hq, d, cos, sin);
    pdd_rope(qkv + hq * d, qkv_n, rows, hkv, d, cos, sin);
    if ((status = pdd_store_rows(qkv + hq * d, qkv_n, rows, hkv * d, slots, k_pools[i], m->num_slots, m->kv_bf16)))
      return status;
    if ((status = pdd_store_rows(qkv + (hq + hkv) * d, qkv_n, rows, hkv * d, slots, v_pools[i], m->num_slots,
                                 m->kv_bf16)))
      return status;
    if ((status = pdd_paged_attention(qkv, qkv_n, attn, hq, hkv, d, k_pools[i], v_pools[i], m->kv_bf16, m->block_size,
                                      att_rows, tables, offsets, lens, rows, m->scale, threads)))
      return status;
    if ((status = pdd_linear(attn, rows, hq * d, l->o, m->w_format, H, l->o_bias, hidden, hidden, threads)))
      return status;
    pdd_rms_norm(hidden, H, rows, 1, H, l->post_norm, m->eps, x, H);
    if ((status = pdd_linear(x, rows, H, l->gate_up, m->w_format, 2 * m->inter, 0, 0, gate_up, threads))) return status;
    pdd_silu_mul(gate_up, rows, m->inter, act);
    if ((status = pdd_linear(act, rows, m->inter, l->down, m->w_format, H, 0, hidden, hidden, threads))) return status;
  }
  return 0;
}
