/* Native CPU kernels for m31r (built and loaded by m31r/native.py; AVX-512, OpenMP through torch's runtime).
 *
 * decode attention: one query per (row, head) over that row's own KV cache, for any number of rows in one call.
 * In eager torch a decode step's attention is a chain of small ops per row and layer (cache writes, a copy that
 * stacks rows, two batched matmuls, a mask, a softmax); each has a fixed cost larger than its arithmetic, and the
 * stacking copy reads and writes every row's cache once more. Here each row reads its keys and values once, from
 * where they live.
 *
 * Arithmetic (fixed, whatever the row count or thread count, so a row gets the same bits alone or batched):
 * scores in fp32 (q * scale, then one fused multiply-add chain over the head dimension per key and a fixed
 * reduction), softmax in fp32 with the exponential below, the weighted sum of values in fp32 in key order, one
 * rounding to bf16 at the end. The eager path rounds scores and probabilities to bf16; this one is closer to fp32.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_CHUNKS 16  /* head_dim up to 256, in chunks of 16 */
#define MAX_KEYS 65536 /* context length up to 64k */
#define PREFETCH_KEYS 16 /* keys and values are fetched this many positions ahead of the scores */

#include "kernels_rows.h"
#include "kernels_scratch.h"
#include "kernels_threads.h"

static inline __m512 load_bf16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256((const __m256i*)p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch does */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* exp(x) for x <= 0 (softmax after subtracting the max): x = k ln2 + r with |r| <= ln2/2, a degree-7 polynomial
 * (Cephes' coefficients) for exp(r), then scaling by 2^k; about 1 ulp, and 0 below -87. */
static inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, k);
}

/* Attention of one query (hd values, bf16) over keys/values [0, n) of one head ([cap, hd] bf16 each, rows of hd),
 * positions [0, shared) read from KS/VS (another row's cache holding the same bits: a beam search's prompt). */
static void attend_head(const uint16_t* q, const uint16_t* KS, const uint16_t* VS, int shared, const uint16_t* K,
                        const uint16_t* V, int n, int hd, float scale, float* s, uint16_t* out) {
  const int nc = hd / 16;
  __m512 qv[MAX_CHUNKS], acc[MAX_CHUNKS];
  const __m512 sc = _mm512_set1_ps(scale);
  for (int c = 0; c < nc; ++c) qv[c] = _mm512_mul_ps(load_bf16(q + 16 * c), sc);

  float m = -INFINITY;
  for (int j = 0; j < n; ++j) {
    const uint16_t* kj = (j < shared ? KS : K) + (long)j * hd;
    for (int c = 0; c < nc; c += 2) { /* one cache line per 32 values */
      _mm_prefetch((const char*)(kj + PREFETCH_KEYS * hd + 16 * c), _MM_HINT_T0);
      _mm_prefetch((const char*)((j < shared ? VS : V) + (long)(j + PREFETCH_KEYS) * hd + 16 * c), _MM_HINT_T0);
    }
    __m512 a = _mm512_mul_ps(qv[0], load_bf16(kj));
    for (int c = 1; c < nc; ++c) a = _mm512_fmadd_ps(qv[c], load_bf16(kj + 16 * c), a);
    s[j] = _mm512_reduce_add_ps(a);
    m = s[j] > m ? s[j] : m;
  }

  const __m512 vm = _mm512_set1_ps(m);
  __m512 total = _mm512_setzero_ps();
  for (int j = 0; j < n; j += 16) {
    __mmask16 live = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1u);
    __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + j), vm)));
    _mm512_mask_storeu_ps(s + j, live, e);
    total = _mm512_add_ps(total, e);
  }
  const float inv = 1.0f / _mm512_reduce_add_ps(total);

  for (int c = 0; c < nc; ++c) acc[c] = _mm512_setzero_ps();
  for (int j = 0; j < n; ++j) {
    const uint16_t* vj = (j < shared ? VS : V) + (long)j * hd;
    const __m512 p = _mm512_set1_ps(s[j]);
    for (int c = 0; c < nc; ++c) acc[c] = _mm512_fmadd_ps(p, load_bf16(vj + 16 * c), acc[c]);
  }
  float o[16];
  for (int c = 0; c < nc; ++c) {
    _mm512_storeu_ps(o, _mm512_mul_ps(acc[c], _mm512_set1_ps(inv)));
    for (int d = 0; d < 16; ++d) out[16 * c + d] = to_bf16(o[d]);
  }
}

/* One decode step's attention for `rows` sequences in one layer.
 *
 * q [rows, heads, hd], knew/vnew [rows, kv_heads, hd]: bf16, contiguous. Row r's cache tensors for this layer start
 * at kptr[r] / vptr[r], laid out [kv_heads, cap[r], hd]; its new token sits at position len[r] - 1, where its key
 * and value are written first, and it attends over positions [0, len[r]). out [rows, heads, hd] bf16.
 * Query head h reads k/v head h / (heads / kv_heads). lead/shared (NULL: none): row r reads positions [0, shared[r])
 * from row lead[r]'s cache, which holds the same bits there (kernels_layer.h's attend_qkv says why); the rows of a
 * head run one after another. Returns 1, having done nothing, for shapes it does not handle (the caller then runs the
 * eager path); 2 where a thread's score scratch (kernels_scratch.h) cannot grow: the new keys and values may then be
 * written (the same bits the next try writes again), the output is not. */
int m31r_attend_decode(int rows, int heads, int kv_heads, int hd, const uint16_t* q, const uint16_t* knew,
                       const uint16_t* vnew, const int64_t* kptr, const int64_t* vptr, const int32_t* cap,
                       const int32_t* len, const int32_t* lead, const int32_t* shared, float scale, uint16_t* out) {
  if (kv_heads < 1 || heads < 1 || hd < 1 || hd % 16 || hd > 16 * MAX_CHUNKS || heads % kv_heads) return 1;
  if (!rows_ok(rows, cap, len, lead, shared)) return 1;
  const int group = heads / kv_heads;
  const size_t need = (size_t)longest(rows, len) + 16; /* scores of the longest row, and room for a masked tail */
  int failed = 0;
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int t = 0; t < rows * kv_heads; ++t) {
      const int r = t / kv_heads, h = t % kv_heads;
      const long at = ((long)h * cap[r] + (len[r] - 1)) * hd;
      memcpy((uint16_t*)kptr[r] + at, knew + (long)t * hd, (size_t)hd * 2);
      memcpy((uint16_t*)vptr[r] + at, vnew + (long)t * hd, (size_t)hd * 2);
    }
#pragma omp for schedule(static)
    for (int t = 0; t < rows * heads; ++t) { /* head by head, the rows of a head together */
      const int h = t / rows, r = t % rows;
      const int l = lead && shared ? lead[r] : r, p = lead && shared ? shared[r] : 0;
      const long base = (long)(h / group) * cap[r] * hd, lbase = (long)(h / group) * cap[l] * hd;
      const long at = ((long)r * heads + h) * hd;
      float* s = thread_scratch(need); /* the scores: heap, not the stack, whose size is the thread's creator's */
      if (!s) {
#pragma omp atomic write
        failed = 1;
        continue;
      }
      attend_head(q + at, (const uint16_t*)kptr[l] + lbase, (const uint16_t*)vptr[l] + lbase, p,
                  (const uint16_t*)kptr[r] + base, (const uint16_t*)vptr[r] + base, len[r], hd, scale, s, out + at);
    }
  }
  return failed ? 2 : 0;
}

/* Weight-only int8 matmul: y[m, n] = bf16(scale[n] * sum_k x[m, k] * w[n, k]) for bf16 x [M, K], int8 w [N, K].
 *
 * torch's kernel (aten._weight_int8pack_mm) turns every weight into fp32, multiplies it by its scale and runs one
 * fp32 fused multiply-add per weight and row. Here each group of 32 weights becomes 32 bf16 values (exact: an int8
 * code has at most 8 significant bits) and one AVX512-BF16 dot-product instruction (vdpbf16ps) multiplies them
 * with 32 activations of a row, adding pairs of exact products into 16 fp32 lanes; the scale applies once, to the
 * sum. Per 32 weights that is 5 conversion instructions shared by all rows plus one per row, against 6 plus 2 per
 * row, and software prefetch keeps the weight stream ahead of the arithmetic: on the medium shape a lone decode
 * step's matmuls took ~6.2 ms against ~7.6 (aten), eight rows ~9.4 against ~13.7 (see README).
 *
 * Arithmetic (fixed, whatever the row count, thread count or tile, so a row gets the same bits alone or batched):
 * for each (row, column), one accumulator of 16 fp32 lanes walks k in steps of 32, lanes summed in a fixed fold
 * (halves, then quarters, ...), times the fp32 scale, rounded to bf16 once. */

#define I8_BLOCK 8 /* columns per unit of work; N must be a multiple */

static inline __m512bh i8_weights(const int8_t* p) {
  __m256i b = _mm256_loadu_si256((const __m256i*)p);
  __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
  __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
  return _mm512_cvtne2ps_pbh(hi, lo); /* lo fills lanes 0-15: k order kept */
}

static inline float fold(__m512 v) {
  __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  b = _mm_add_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}

static inline float bf16_value(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* The tiles and the block of a weight-only matmul on bf16 activations, for weights of type WT: LOADW turns the 32
 * weights at a pointer into bf16 pairs, OUT(v, c) is column c's folded sum (c counted from the block's first
 * column) before its one rounding to bf16, and the next C columns are prefetched one cache line per PF_STEP weights,
 * PF_AHEAD weights ahead. A tile is R rows times C columns (from column c0 of the block), its accumulators in
 * registers; P##_block runs rows [0, R) of x (R <= 8) against the I8_BLOCK columns at w in tiles of the most columns
 * that fit in registers. */
#define DOT_TILE(P, WT, LOADW, PF_STEP, PF_AHEAD, OUT, R, C)                                                         \
  static void P##_tile_##R##_##C(const uint16_t* x, int K, const WT* w, const uint16_t* s, int c0, uint16_t* y,      \
                                 int N) {                                                                            \
    (void)s;                                                                                                         \
    __m512 acc[R * C];                                                                                               \
    for (int i = 0; i < R * C; ++i) acc[i] = _mm512_setzero_ps();                                                    \
    for (int k = 0; k < K; k += 32) {                                                                                \
      __m512bh wv[C];                                                                                                \
      for (int c = 0; c < C; ++c) wv[c] = LOADW(w + (long)c * K + k);                                                \
      if (!(k % PF_STEP))                                                                                            \
        for (int c = 0; c < C; ++c)                                                                                  \
          _mm_prefetch((const char*)(w + (long)(C + c) * K + k + PF_AHEAD), _MM_HINT_T0);                            \
      for (int r = 0; r < R; ++r) {                                                                                  \
        __m512bh xv = (__m512bh)_mm512_loadu_si512((const void*)(x + (long)r * K + k));                              \
        for (int c = 0; c < C; ++c) acc[r * C + c] = _mm512_dpbf16_ps(acc[r * C + c], xv, wv[c]);                    \
      }                                                                                                              \
    }                                                                                                                \
    for (int r = 0; r < R; ++r)                                                                                      \
      for (int c = 0; c < C; ++c) y[(long)r * N + c] = to_bf16(OUT(fold(acc[r * C + c]), c0 + c));                   \
  }
#define DOT_RUN(P, R, C)                                                                                             \
  for (int c = 0; c < I8_BLOCK; c += C) P##_tile_##R##_##C(x, K, w + (long)c * K, s, c, y + c, N);                   \
  break;
#define DOT_KERNEL(P, WT, LOADW, PF_STEP, PF_AHEAD, OUT)                                                             \
  DOT_TILE(P, WT, LOADW, PF_STEP, PF_AHEAD, OUT, 1, 8)                                                               \
  DOT_TILE(P, WT, LOADW, PF_STEP, PF_AHEAD, OUT, 2, 8)                                                               \
  DOT_TILE(P, WT, LOADW, PF_STEP, PF_AHEAD, OUT, 3, 4)                                                               \
  DOT_TILE(P, WT, LOADW, PF_STEP, PF_AHEAD, OUT, 4, 4)                                                               \
  DOT_TILE(P, WT, LOADW, PF_STEP, PF_AHEAD, OUT, 5, 2)                                                               \
  DOT_TILE(P, WT, LOADW, PF_STEP, PF_AHEAD, OUT, 6, 2)                                                               \
  DOT_TILE(P, WT, LOADW, PF_STEP, PF_AHEAD, OUT, 7, 2)                                                               \
  DOT_TILE(P, WT, LOADW, PF_STEP, PF_AHEAD, OUT, 8, 2)                                                               \
  static void P##_block(int R, const uint16_t* x, int K, const WT* w, const uint16_t* s, uint16_t* y, int N) {       \
    switch (R) {                                                                                                     \
      case 1: DOT_RUN(P, 1, 8)                                                                                       \
      case 2: DOT_RUN(P, 2, 8)                                                                                       \
      case 3: DOT_RUN(P, 3, 4)                                                                                       \
      case 4: DOT_RUN(P, 4, 4)                                                                                       \
      case 5: DOT_RUN(P, 5, 2)                                                                                       \
      case 6: DOT_RUN(P, 6, 2)                                                                                       \
      case 7: DOT_RUN(P, 7, 2)                                                                                       \
      case 8: DOT_RUN(P, 8, 2)                                                                                       \
    }                                                                                                                \
  }

/* int8: codes widened to bf16, a line of 64 codes prefetched every second step, the channel's scale on the sum (the
 * block's scales start at s). */
#define I8_OUT(v, c) ((v) * bf16_value(s[c]))
DOT_KERNEL(i8, int8_t, i8_weights, 64, 64, I8_OUT)

/* x [M, K] bf16, w [N, K] int8, scale [N] bf16, y [M, N] bf16, all contiguous. Returns nonzero, having done nothing,
 * for shapes it does not take (K a multiple of 32, N of I8_BLOCK). */
int m31r_int8_mm(int M, int N, int K, const uint16_t* x, const int8_t* w, const uint16_t* scale, uint16_t* y) {
  if (M < 1 || K % 32 || N % I8_BLOCK) return 1;
  /* Columns 16 blocks at a time as threads come free (kernels_avx2.c, "Threads"); bits never depend on the thread. */
#pragma omp parallel for schedule(dynamic, 16)
  for (int b = 0; b < N / I8_BLOCK; ++b) {
    const long n = (long)b * I8_BLOCK;
    for (int m = 0; m < M; m += 8)
      i8_block(M - m < 8 ? M - m : 8, x + (long)m * K, K, w + n * K, scale + n, y + (long)m * N + n, N);
  }
  return 0;
}

/* bf16 weights: y[m, n] = bf16(sum_k x[m, k] * w[n, k]) for bf16 x [M, K] and w [N, K] (nn.Linear's layout), the
 * float layers of bf16 engines below quant.BF16_GEMM_ROWS rows (decode passes). oneDNN's packed bf16 matmul read a
 * decode step's weights at about half the memory's pace on one row; this is the int8 kernel above without the
 * widening: each cache line of a column (32 weights) goes straight into one vdpbf16ps per row, the next columns'
 * line prefetched at every step. Same arithmetic rules, so a row gets the same bits alone or batched. */
#define BF_LOAD(p) ((__m512bh)_mm512_loadu_si512((const void*)(p)))
#define BF_OUT(v, c) (v)
DOT_KERNEL(bf, uint16_t, BF_LOAD, 32, 0, BF_OUT)

/* x [M, K] bf16, w [N, K] bf16, y [M, N] bf16, all contiguous. Returns nonzero, having done nothing, for shapes it
 * does not take (K a multiple of 32, N of I8_BLOCK). */
int m31r_bf16_mm(int M, int N, int K, const uint16_t* x, const uint16_t* w, uint16_t* y) {
  if (M < 1 || K % 32 || N % I8_BLOCK) return 1;
#pragma omp parallel for schedule(dynamic, 16)
  for (int b = 0; b < N / I8_BLOCK; ++b) {
    const long n = (long)b * I8_BLOCK;
    for (int m = 0; m < M; m += 8)
      bf_block(M - m < 8 ? M - m : 8, x + (long)m * K, K, w + n * K, NULL, y + (long)m * N + n, N);
  }
  return 0;
}
