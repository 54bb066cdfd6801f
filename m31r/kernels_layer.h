/* One decoder layer of a decode pass in one call: what Transformer._layers_native runs per layer through Python
 * (the wqkv matmul, decode attention on its projection, wo, the residual add and RMSNorm, w13, SwiGLU, w2, the
 * residual add and the next RMSNorm), the same kernels called in the same order on the same operands, so the bits
 * are the per-call path's (tested). What it saves is the Python between the calls: about 25 calls per layer into
 * torch and ctypes, 5-9 ms of a medium decode step on 2 cores (README "One call per layer").
 *
 * Both fp32 families include this after their own kernels (m31r_f32_mm, the int8 and int4 matmuls, attend_qkv,
 * m31r_add_rmsnorm_f32, m31r_swiglu_f32), which it calls: it has no instructions of its own, so kernels_avx2.c and
 * kernels_neon.c run the same code. native.build (and the tests' driver) hash it with the source that includes it. */

typedef struct {
  int32_t kind; /* M31R_F32, M31R_Q16, M31R_Q8, M31R_I8F32 (int8 codes: the three activation modes), M31R_I4 */
  int32_t n, k, group;
  int64_t w, scale, base; /* weights / codes; int8: bf16 scale per output; int4: fp32 scale and base [N, K/G] */
} m31r_mat;

enum { M31R_F32 = 0, M31R_Q16 = 1, M31R_Q8 = 2, M31R_I8F32 = 3, M31R_I4 = 4 };

static int mat_mul(const m31r_mat* m, int rows, const float* x, float* y) {
  switch (m->kind) {
    case M31R_F32: return m31r_f32_mm(rows, m->n, m->k, x, (const float*)m->w, y);
    case M31R_Q16: return m31r_int8_mm_q16(rows, m->n, m->k, x, (const int8_t*)m->w, (const uint16_t*)m->scale, y);
    case M31R_Q8: return m31r_int8_mm_q8(rows, m->n, m->k, x, (const int8_t*)m->w, (const uint16_t*)m->scale, y);
    case M31R_I8F32: return m31r_int8_mm_f32(rows, m->n, m->k, x, (const int8_t*)m->w, (const uint16_t*)m->scale, y);
    case M31R_I4:
      return m31r_int4_mm_q8(rows, m->n, m->k, m->group, x, (const uint8_t*)m->w, (const float*)m->scale,
                             (const float*)m->base, y);
  }
  return 1;
}

/* rows decode rows (the first n real, the rest padding, whose attention output is zero as in Attention.step),
 * x [rows, d] the residual stream (updated in place), h [rows, d] its attention norm on entry and the next layer's
 * norm on return; mats: wqkv, wo, w13, w2; cos/sin [n, hd]; the caches and kv16 as m31r_attend_qkv_f32(_kv16);
 * scratch: rows * ((heads + 2 kv) hd + heads hd + 2 d + 3 ffn) floats. Returns nonzero at the first kernel that
 * refuses its shape (nothing is half-written that the per-call path would not have written too). */
int m31r_decode_layer_f32(int rows, int n, int d, int heads, int kv_heads, int hd, int ffn, const m31r_mat* mats,
                          const float* ffn_norm, float ffn_eps, const float* next_norm, float next_eps, float* x,
                          float* h, const float* cos, const float* sin, const int64_t* kptr, const int64_t* vptr,
                          const int32_t* cap, const int32_t* len, float scale, int kv16, float* scratch) {
  if (n < 1 || n > rows) return 1;
  float* flat = scratch;
  float* y = flat + (long)rows * (heads + 2 * kv_heads) * hd;
  float* a = y + (long)rows * heads * hd;
  float* gu = a + (long)rows * d;
  float* sw = gu + (long)rows * 2 * ffn;
  float* f = sw + (long)rows * ffn;
  int err = mat_mul(&mats[0], rows, h, flat);
  if (err) return err;
  memset(y, 0, sizeof(float) * rows * heads * hd);
  err = attend_qkv(n, heads, kv_heads, hd, flat, cos, sin, kptr, vptr, cap, len, scale, kv16, y);
  if (err || (err = mat_mul(&mats[1], rows, y, a))) return err;
  if ((err = m31r_add_rmsnorm_f32(rows, d, x, a, ffn_norm, ffn_eps, h))) return err;
  if ((err = mat_mul(&mats[2], rows, h, gu)) || (err = m31r_swiglu_f32(rows, ffn, gu, sw))) return err;
  if ((err = mat_mul(&mats[3], rows, sw, f))) return err;
  return m31r_add_rmsnorm_f32(rows, d, x, f, next_norm, next_eps, h);
}
