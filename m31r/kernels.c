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

/* Attention of one query (hd values, bf16) over keys/values [0, n) of one head ([cap, hd] bf16 each, rows of hd). */
static void attend_head(const uint16_t* q, const uint16_t* K, const uint16_t* V, int n, int hd, float scale,
                        float* s, uint16_t* out) {
  const int nc = hd / 16;
  __m512 qv[MAX_CHUNKS], acc[MAX_CHUNKS];
  const __m512 sc = _mm512_set1_ps(scale);
  for (int c = 0; c < nc; ++c) qv[c] = _mm512_mul_ps(load_bf16(q + 16 * c), sc);

  float m = -INFINITY;
  for (int j = 0; j < n; ++j) {
    const uint16_t* kj = K + (long)j * hd;
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
    const uint16_t* vj = V + (long)j * hd;
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
 * Query head h reads k/v head h / (heads / kv_heads). Returns nonzero, having done nothing, for shapes it does not
 * handle (the caller then runs the eager path). */
int m31r_attend_decode(int rows, int heads, int kv_heads, int hd, const uint16_t* q, const uint16_t* knew,
                       const uint16_t* vnew, const int64_t* kptr, const int64_t* vptr, const int32_t* cap,
                       const int32_t* len, float scale, uint16_t* out) {
  if (hd % 16 || hd > 16 * MAX_CHUNKS || heads % kv_heads) return 1;
  for (int r = 0; r < rows; ++r)
    if (len[r] < 1 || len[r] > cap[r] || len[r] > MAX_KEYS) return 1;
  const int group = heads / kv_heads;
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
    for (int t = 0; t < rows * heads; ++t) {
      const int r = t / heads, h = t % heads;
      const long base = (long)(h / group) * cap[r] * hd;
      float s[len[r] + 16]; /* scores, on the thread's stack (at most MAX_KEYS * 4 bytes) */
      attend_head(q + (long)t * hd, (const uint16_t*)kptr[r] + base, (const uint16_t*)vptr[r] + base, len[r], hd,
                  scale, s, out + (long)t * hd);
    }
  }
  return 0;
}
