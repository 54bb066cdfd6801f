/* What both fp32 families share above their instructions: the drivers that hand rows and column blocks to each
 * family's tiles (m31r_f32_mm, m31r_int8_mm_q16, m31r_int8_mm_q8, m31r_int4_mm_q8) and heads to its attend_head
 * (m31r_attend_decode_f32), decode attention on the wqkv projection (m31r_attend_qkv_f32 and its fp16-cache twin),
 * and one decoder layer of a decode pass in one call (m31r_decode_layer_f32). kernels_avx2.c and kernels_neon.c
 * include this after their own kernels, which it calls (the f32, q16, q8 and int4 tiles, q16_row and q8_row,
 * rope_head, store_f16, attend_head, attend_head_f16, attend_pair, attend_pair_f16, m31r_int8_mm_f32,
 * m31r_add_rmsnorm_f32, m31r_swiglu_f32), with their BLOCK and Q8_ABS: it has no instructions of its own, so both
 * families run the same code.
 * native.build (and the tests' driver) hash it with the source that includes it.
 *
 * The layer call: what Transformer._layers_native runs per layer through Python (the wqkv matmul, decode attention
 * on its projection, wo, the residual add and RMSNorm, w13, SwiGLU, w2, the residual add and the next RMSNorm), the
 * same kernels called in the same order on the same operands, so the bits are the per-call path's (tested). What it
 * saves is the Python between the calls: about 25 calls per layer into torch and ctypes, 5-9 ms of a medium decode
 * step on 2 cores (docs/speed.md "One call per layer"). */

/* -- the drivers: the same loops over each family's own tiles and attend_head ------------------------------ */

#include "kernels_rows.h"
#include "kernels_scratch.h"
#include "kernels_threads.h"

/* One decode step's attention for `rows` sequences in one layer, fp32 throughout; layout and contract as
 * kernels.c's (bf16) m31r_attend_decode: q/out [rows, heads, hd], knew/vnew [rows, kv_heads, hd], row r's cache tensors
 * at kptr[r] / vptr[r] laid out [kv_heads, cap[r], hd], its new token at position len[r] - 1; lead/shared as
 * attend_qkv's (below). Returns 1, having done nothing, for shapes it does not handle; 2 where a thread's score
 * scratch cannot grow (kernels.c's m31r_attend_decode says what is then written). */
int m31r_attend_decode_f32(int rows, int heads, int kv_heads, int hd, const float* q, const float* knew,
                           const float* vnew, const int64_t* kptr, const int64_t* vptr, const int32_t* cap,
                           const int32_t* len, const int32_t* lead, const int32_t* shared, float scale, float* out) {
  if (kv_heads < 1 || heads < 1 || hd < 1 || hd % 8 || hd > 8 * MAX_CHUNKS || heads % kv_heads) return 1;
  if (!rows_ok(rows, cap, len, lead, shared)) return 1;
  const int group = heads / kv_heads;
  const size_t need = (size_t)longest(rows, len) + 8; /* the longest row's scores (kernels_scratch.h) */
  int failed = 0;
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int t = 0; t < rows * kv_heads; ++t) {
      const int r = t / kv_heads, h = t % kv_heads;
      const long at = ((long)h * cap[r] + (len[r] - 1)) * hd;
      memcpy((float*)kptr[r] + at, knew + (long)t * hd, (size_t)hd * 4);
      memcpy((float*)vptr[r] + at, vnew + (long)t * hd, (size_t)hd * 4);
    }
#pragma omp for schedule(static)
    for (int t = 0; t < rows * heads; ++t) { /* head by head, the rows of a head together */
      const int h = t / rows, r = t % rows;
      const int l = lead && shared ? lead[r] : r, p = lead && shared ? shared[r] : 0;
      const long base = (long)(h / group) * cap[r] * hd, lbase = (long)(h / group) * cap[l] * hd;
      const long at = ((long)r * heads + h) * hd;
      float* s = thread_scratch(need);
      if (!s) {
#pragma omp atomic write
        failed = 1;
        continue;
      }
      attend_head(q + at, (const float*)kptr[l] + lbase, (const float*)vptr[l] + lbase, p, (const float*)kptr[r] + base,
                  (const float*)vptr[r] + base, len[r], hd, scale, s, out + at);
    }
  }
  return failed ? 2 : 0;
}

/* Each family's tiles of one kind over a block of BLOCK columns for R rows (1-8): the tile widths (columns per
 * call) are the families' shared choice, so a column's bits never depend on which family or tile ran it.
 * BY_ROWS runs RUN(R, C) for the row count at hand, C1..C8 the kind's tile width for 1..8 rows. */
#define BY_ROWS(rows, RUN, C1, C2, C3, C4, C5, C6, C7, C8) \
  switch (rows) {                                          \
    case 1: RUN(1, C1) break;                              \
    case 2: RUN(2, C2) break;                              \
    case 3: RUN(3, C3) break;                              \
    case 4: RUN(4, C4) break;                              \
    case 5: RUN(5, C5) break;                              \
    case 6: RUN(6, C6) break;                              \
    case 7: RUN(7, C7) break;                              \
    case 8: RUN(8, C8) break;                              \
  }

static void q8_block(int R, const int8_t* xq, const uint8_t* aq, const float* d, int K, const int8_t* w,
                     const uint16_t* s, float* y, int N) {
#define Q8_RUN(R, C)                                                                                        \
  for (int c = 0; c < BLOCK; c += C) q8_tile_##R##_##C(xq, aq, d, K, w + (long)c * K, s + c, y + c, N);
  BY_ROWS(R, Q8_RUN, 4, 4, 2, 2, 1, 1, 1, 1);
#undef Q8_RUN
}

static void i4_block(int R, const int8_t* xq, const float* d, const float* xs, int K, int G, const uint8_t* w,
                     const float* sc, const float* base, float* y, int N) {
  const int ng = K / G;
#define I4_RUN(R, C)                                                                                              \
  for (int c = 0; c < BLOCK; c += C)                                                                              \
    i4_tile_##R##_##C(xq, d, xs, K, G, w + (long)c * (K / 2), sc + (long)c * ng, base + (long)c * ng, y + c, N);
  BY_ROWS(R, I4_RUN, 4, 2, 2, 1, 1, 1, 1, 1);
#undef I4_RUN
}

static void f32_block(int R, const float* x, int K, const float* w, float* y, int N) {
#define F32_RUN(R, C)                                                                     \
  for (int c = 0; c < BLOCK; c += C) f32_tile_##R##_##C(x, K, w + (long)c * K, y + c, N);
  BY_ROWS(R, F32_RUN, 4, 4, 2, 2, 2, 2, 1, 1);
#undef F32_RUN
}

/* The q8 activations' work buffer for M rows of K values: the codes [M, K] int8, then (Q8_ABS, AVX2's vpmaddubsw
 * multiplies unsigned bytes by signed ones) their absolute values [M, K] uint8, then one fp32 scale per block of 32
 * [M, K/32] and `extra` more floats. Where a family keeps no |codes|, aq aliases the codes and is never read. */
static void* q8_work(int M, int K, long extra, int8_t** xq, uint8_t** aq, float** d) {
  const long codes = (1L + Q8_ABS) * M * K;
  void* work = malloc(codes + ((long)M * (K / 32) + extra) * 4);
  if (!work) return NULL;
  *xq = (int8_t*)work;
  *aq = (uint8_t*)work + (Q8_ABS ? (long)M * K : 0);
  *d = (float*)((uint8_t*)work + codes);
  return work;
}

/* x [M, K] fp32, w [N, K] int8, scale [N] bf16, y [M, N] fp32. Returns nonzero, having done nothing, unless K is a
 * multiple of 32 and N of BLOCK (2 when out of memory). */
int m31r_int8_mm_q8(int M, int N, int K, const float* x, const int8_t* w, const uint16_t* scale, float* y) {
  if (M < 1 || K % 32 || N % BLOCK) return 1;
  int8_t* xq;
  uint8_t* aq;
  float* d;
  void* work = q8_work(M, K, 0, &xq, &aq, &d);
  if (!work) return 2;
  for (int m = 0; m < M; ++m)
    q8_row(x + (long)m * K, K, 0, xq + (long)m * K, aq + (long)m * K, d + (long)m * (K / 32), 0, 32);
#pragma omp parallel for schedule(dynamic, 16)
  for (int b = 0; b < N / BLOCK; ++b) {
    const long n = (long)b * BLOCK;
    for (int m = 0; m < M; m += 8)
      q8_block(M - m < 8 ? M - m : 8, xq + (long)m * K, aq + (long)m * K, d + (long)m * (K / 32), K, w + n * K,
               scale + n, y + (long)m * N + n, N);
  }
  free(work);
  return 0;
}

/* x [M, K] fp32, codes [N, K/2] uint8, scale/base [N, K/G] fp32, y [M, N] fp32. Returns nonzero, having done
 * nothing, unless G is a multiple of 32 dividing K and N a multiple of BLOCK (2 when out of memory). */
int m31r_int4_mm_q8(int M, int N, int K, int G, const float* x, const uint8_t* w, const float* scale,
                    const float* base, float* y) {
  if (M < 1 || G < 32 || G % 32 || K % G || N % BLOCK) return 1;
  const int nb = K / 32, ng = K / G;
  int8_t* xq;
  uint8_t* aq;
  float* d;
  void* work = q8_work(M, K, (long)M * ng, &xq, &aq, &d);
  if (!work) return 2;
  float* xs = d + (long)M * nb;
  for (int m = 0; m < M; ++m)
    q8_row(x + (long)m * K, K, 1, xq + (long)m * K, aq + (long)m * K, d + (long)m * nb, xs + (long)m * ng, G);
#pragma omp parallel for schedule(dynamic, 16)
  for (int b = 0; b < N / BLOCK; ++b) {
    const long n = (long)b * BLOCK;
    for (int m = 0; m < M; m += 8)
      i4_block(M - m < 8 ? M - m : 8, xq + (long)m * K, d + (long)m * nb, xs + (long)m * ng, K, G,
               w + n * (K / 2), scale + n * ng, base + n * ng, y + (long)m * N + n, N);
  }
  free(work);
  return 0;
}

#ifndef Q16_PAIRS
#define Q16_PAIRS 0
#endif

/* xp, dp: the rows' pair layout, where the family pairs rows (Q16_PAIRS: kernels_avx2.c's q16_pair); else unused. */
static void q16_block(int R, const int16_t* xq, const float* d, const int16_t* xp, const float* dp, int K,
                      const int8_t* w, const uint16_t* s, float* y, int N) {
#if Q16_PAIRS
  q16_pairs_block(R, xq, d, xp, dp, K, w, s, y, N);
#else
  (void)xp;
  (void)dp;
#define Q16_RUN(R, C)                                                                                \
  for (int c = 0; c < BLOCK; c += C) q16_tile_##R##_##C(xq, d, K, w + (long)c * K, s + c, y + c, N);
  BY_ROWS(R, Q16_RUN, 4, 2, 2, 2, 1, 1, 1, 1);
#undef Q16_RUN
#endif
}

/* Same contract as m31r_int8_mm_q8, on q16 activations: the int8 matmul fp32 engines run. */
int m31r_int8_mm_q16(int M, int N, int K, const float* x, const int8_t* w, const uint16_t* scale, float* y) {
  if (M < 1 || K % 32 || N % BLOCK) return 1;
  const long nb = K / 32, paired = Q16_PAIRS ? M / 2 * 2 : 0; /* rows with a pair layout too */
  void* work = malloc(2L * (M + paired) * K + (M + paired) * nb * 4);
  if (!work) return 2;
  int16_t* xq = (int16_t*)work;
  int16_t* xp = xq + (long)M * K; /* pair p's rows at p * 2K: the same offset as its first row's in xq */
  float* d = (float*)(xp + paired * K);
  float* dp = d + M * nb;
  for (int m = 0; m < M; ++m) q16_row(x + (long)m * K, K, xq + (long)m * K, d + m * nb);
#if Q16_PAIRS
  for (int m = 0; m < paired; m += 2)
    q16_pair(xq + (long)m * K, xq + (long)(m + 1) * K, d + m * nb, d + (m + 1) * nb, K, xp + (long)m * K, dp + m * nb);
#endif
#pragma omp parallel for schedule(dynamic, 16)
  for (int b = 0; b < N / BLOCK; ++b) {
    const long n = (long)b * BLOCK;
    for (int m = 0; m < M; m += 8)
      q16_block(M - m < 8 ? M - m : 8, xq + (long)m * K, d + m * nb, xp + (long)m * K, dp + m * nb, K, w + n * K,
                scale + n, y + (long)m * N + n, N);
  }
  free(work);
  return 0;
}

/* x [M, K] fp32, w [N, K] fp32, y [M, N] fp32. Returns nonzero, having done nothing, unless K is a multiple of 8
 * and N of BLOCK. Rows past 8 run in groups of 8 over each block of columns, whose weights are then read from
 * cache. */
int m31r_f32_mm(int M, int N, int K, const float* x, const float* w, float* y) {
  if (M < 1 || K < 8 || K % 8 || N % BLOCK) return 1;
#pragma omp parallel for schedule(static)
  for (int b = 0; b < N / BLOCK; ++b) {
    const long n = (long)b * BLOCK;
    for (int m = 0; m < M; m += 8)
      f32_block(M - m < 8 ? M - m : 8, x + (long)m * K, K, w + n * K, y + (long)m * N + n, N);
  }
  return 0;
}

/* -- decode attention on the projection, and the layer call -------------------------------------------------- */

/* Whether rows r and s read one cache with nothing shared from another row's: two tokens of one prefill chunk
 * (model.py's chunk tables), whose heads then run together (attend_pair). Decode rows each have their own. */
static int one_cache(int r, int s, const int64_t* kptr, const int64_t* vptr, const int32_t* cap, const int32_t* lead,
                     const int32_t* shared) {
  return kptr[r] == kptr[s] && vptr[r] == vptr[s] && cap[r] == cap[s] && !(lead && shared && (shared[r] || shared[s]));
}

/* m31r_attend_decode_f32 on the query/key/value projection as the fused wqkv matmul writes it, RoPE included: row r
 * reads qkv[r] = [heads query heads | kv_heads keys | kv_heads values] of hd values each and its rotation tables
 * cos[r], sin[r] (hd values at its position); its keys are rotated on their way into the cache and its queries
 * before they attend. Writes out [rows, heads * hd]. Replaces the layout copies and the RoPE ops of the torch side
 * with one call. Returns 1, having done nothing, for shapes it does not handle (hd a multiple of 16 here); 2 where a
 * thread's score scratch cannot grow (the new keys and values may then be written, the output is not).
 *
 * lead/shared (NULL: none): row r reads positions [0, shared[r]) from row lead[r]'s cache instead of its own, whose
 * keys and values there must be the same bits (a beam search's hypotheses share their prompt, each in a cache of its
 * own). The rows of one head run one after another on one thread, so the prompt they share is read from memory
 * once and from the core's cache after that: a step of three beam rows otherwise reads three copies of it. */
static int attend_qkv(int rows, int heads, int kv_heads, int hd, const float* qkv, const float* cos, const float* sin,
                      const int64_t* kptr, const int64_t* vptr, const int32_t* cap, const int32_t* len,
                      const int32_t* lead, const int32_t* shared, float scale, int kv16, float* out) {
  if (kv_heads < 1 || heads < 1 || hd < 1 || hd % 16 || hd > 8 * MAX_CHUNKS || heads % kv_heads) return 1;
  if (!rows_ok(rows, cap, len, lead, shared)) return 1;
  const int group = heads / kv_heads;
  const long width = (long)(heads + 2 * kv_heads) * hd;
  /* A thread's scores (kernels_scratch.h): one row's, or a pair's, the second at `stride` (whole cache lines). */
  const size_t stride = ((size_t)longest(rows, len) + 8 + 15) / 16 * 16;
  int failed = 0;
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int t = 0; t < rows * kv_heads; ++t) {
      const int r = t / kv_heads, h = t % kv_heads;
      const long at = ((long)h * cap[r] + (len[r] - 1)) * hd;
      const float* row = qkv + r * width;
      const float* v = row + (long)(heads + kv_heads + h) * hd;
      if (kv16) {
        float k[8 * MAX_CHUNKS];
        rope_head(row + (long)(heads + h) * hd, cos + (long)r * hd, sin + (long)r * hd, hd, k);
        store_f16((uint16_t*)kptr[r] + at, k, hd);
        store_f16((uint16_t*)vptr[r] + at, v, hd);
      } else {
        rope_head(row + (long)(heads + h) * hd, cos + (long)r * hd, sin + (long)r * hd, hd, (float*)kptr[r] + at);
        memcpy((float*)vptr[r] + at, v, (size_t)hd * 4);
      }
    }
    const int pairs = (rows + 1) / 2;
#pragma omp for schedule(static)
    for (int t = 0; t < heads * pairs; ++t) { /* head by head, the rows of a head together, two at a time */
      const int h = t / pairs, r0 = 2 * (t % pairs), n = r0 + 1 < rows ? 2 : 1;
      float q[2][8 * MAX_CHUNKS];
      for (int i = 0; i < n; ++i)
        rope_head(qkv + (r0 + i) * width + (long)h * hd, cos + (long)(r0 + i) * hd, sin + (long)(r0 + i) * hd, hd,
                  q[i]);
      if (n == 2 && one_cache(r0, r0 + 1, kptr, vptr, cap, lead, shared)) {
        const int a = len[r0] <= len[r0 + 1] ? 0 : 1, ra = r0 + a, rb = r0 + 1 - a; /* ra: the shorter context */
        const long base = (long)(h / group) * cap[ra] * hd;
        float* oa = out + ((long)ra * heads + h) * hd;
        float* ob = out + ((long)rb * heads + h) * hd;
        float* sa = thread_scratch(2 * stride);
        if (!sa) {
#pragma omp atomic write
          failed = 1;
          continue;
        }
        float* sb = sa + stride;
        if (kv16)
          attend_pair_f16(q[a], q[1 - a], (const uint16_t*)kptr[ra] + base, (const uint16_t*)vptr[ra] + base, len[ra],
                          len[rb], hd, scale, sa, sb, oa, ob);
        else
          attend_pair(q[a], q[1 - a], (const float*)kptr[ra] + base, (const float*)vptr[ra] + base, len[ra], len[rb],
                      hd, scale, sa, sb, oa, ob);
        continue;
      }
      for (int i = 0; i < n; ++i) {
        const int r = r0 + i;
        const int l = lead && shared ? lead[r] : r, p = lead && shared ? shared[r] : 0;
        const long base = (long)(h / group) * cap[r] * hd, lbase = (long)(h / group) * cap[l] * hd;
        float* o = out + ((long)r * heads + h) * hd;
        float* s = thread_scratch(stride);
        if (!s) {
#pragma omp atomic write
          failed = 1;
          continue;
        }
        if (kv16)
          attend_head_f16(q[i], (const uint16_t*)kptr[l] + lbase, (const uint16_t*)vptr[l] + lbase, p,
                          (const uint16_t*)kptr[r] + base, (const uint16_t*)vptr[r] + base, len[r], hd, scale, s, o);
        else
          attend_head(q[i], (const float*)kptr[l] + lbase, (const float*)vptr[l] + lbase, p,
                      (const float*)kptr[r] + base, (const float*)vptr[r] + base, len[r], hd, scale, s, o);
      }
    }
  }
  return failed ? 2 : 0;
}

int m31r_attend_qkv_f32(int rows, int heads, int kv_heads, int hd, const float* qkv, const float* cos,
                        const float* sin, const int64_t* kptr, const int64_t* vptr, const int32_t* cap,
                        const int32_t* len, const int32_t* lead, const int32_t* shared, float scale, float* out) {
  return attend_qkv(rows, heads, kv_heads, hd, qkv, cos, sin, kptr, vptr, cap, len, lead, shared, scale, 0, out);
}

/* m31r_attend_qkv_f32 over an fp16 cache ([kv_heads, cap, hd] fp16 per row and layer): the new key (rotated) and
 * value are rounded to fp16 on their way in, and every read widens them back exactly (attend_head_f16). A decode
 * step reads its whole context's keys and values per layer, the step's largest read after the weights: half the
 * bytes, as llama.cpp's default f16 cache. */
int m31r_attend_qkv_f32_kv16(int rows, int heads, int kv_heads, int hd, const float* qkv, const float* cos,
                             const float* sin, const int64_t* kptr, const int64_t* vptr, const int32_t* cap,
                             const int32_t* len, const int32_t* lead, const int32_t* shared, float scale, float* out) {
  return attend_qkv(rows, heads, kv_heads, hd, qkv, cos, sin, kptr, vptr, cap, len, lead, shared, scale, 1, out);
}

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
 * norm on return; mats: wqkv, wo, w13, w2; cos/sin [n, hd]; the caches, lead/shared and kv16 as
 * m31r_attend_qkv_f32(_kv16);
 * scratch: rows * ((heads + 2 kv) hd + heads hd + 2 d + 3 ffn) floats. Returns nonzero at the first kernel that
 * refuses its shape (nothing is half-written that the per-call path would not have written too), 2 at the first
 * that runs out of memory. */
int m31r_decode_layer_f32(int rows, int n, int d, int heads, int kv_heads, int hd, int ffn, const m31r_mat* mats,
                          const float* ffn_norm, float ffn_eps, const float* next_norm, float next_eps, float* x,
                          float* h, const float* cos, const float* sin, const int64_t* kptr, const int64_t* vptr,
                          const int32_t* cap, const int32_t* len, const int32_t* lead, const int32_t* shared,
                          float scale, int kv16, float* scratch) {
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
  err = attend_qkv(n, heads, kv_heads, hd, flat, cos, sin, kptr, vptr, cap, len, lead, shared, scale, kv16, y);
  if (err || (err = mat_mul(&mats[1], rows, y, a))) return err;
  if ((err = m31r_add_rmsnorm_f32(rows, d, x, a, ffn_norm, ffn_eps, h))) return err;
  if ((err = mat_mul(&mats[2], rows, h, gu)) || (err = m31r_swiglu_f32(rows, ffn, gu, sw))) return err;
  if ((err = mat_mul(&mats[3], rows, sw, f))) return err;
  return m31r_add_rmsnorm_f32(rows, d, x, f, next_norm, next_eps, h);
}
