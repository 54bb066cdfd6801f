/* Native CPU kernels for m31r, AVX2 + FMA family (built and loaded by m31r/native.py with -mavx2 -mfma -mf16c;
 * OpenMP through torch's runtime). The sibling of kernels.c (AVX-512, bf16 activations) for the CPUs most laptops
 * have, where bf16 is not native and the engine runs fp32 activations and an fp16 KV cache (fp32 on request).
 *
 * decode attention (m31r_attend_decode_f32): one query per (row, head) over that row's own fp32 KV cache, for any
 * number of rows in one call, as kernels.c does in bf16.
 *
 * weight-only int8 and int4 matmuls of fp32 activations. int8 (m31r_int8_mm_q16, what engines run): each activation
 * row is quantized to int16 in blocks of 32 values with one fp32 scale per block (q16), multiplied with the codes
 * sign-extended to int16 (vpmaddwd, exact in int32), each block's sum scaled by its activation scale in fp32 and the
 * channel's weight scale applied to the sum. int4 (m31r_int4_mm_q8) and the older int8 m31r_int8_mm_q8: activations
 * quantized to int8 per block of 32 (llama.cpp's q8_0, with an fp32 scale) and vpmaddubsw + vpmaddwd (32 products per
 * two instructions); for int8, q8's ~258x coarser rounding changed greedy output (README "Speed"), so it stays for
 * comparison only. The fp32 alternative, widening each code to fp32 and one fused multiply-add per weight and row,
 * is m31r_int8_mm_f32 (kept for comparison too).
 *
 * fp32 weights (m31r_f32_mm): float layers of fp32 engines below 64 rows (decode rows, short chunks), for the
 * summation order below, which torch's fp32 matmuls do not keep across row counts.
 *
 * Arithmetic is fixed whatever the row count, thread count or tile, so a row gets the same bits alone or batched:
 * every (row, column) has its own accumulator walking k in order, lanes summed in a fixed fold.
 *
 * Threads: the int8 and int4 matmuls hand out their columns 16 blocks (128 columns) at a time as threads come free
 * (schedule(dynamic, 16)), not in one half each: on a 2-core VM one core is often a little slower, and a static
 * split waits for it. Measured on the medium shape, decode 4-5% faster end to end (int8 and int4), fp32 weights
 * the same either way (they stream at the memory's pace), so f32_mm keeps its static split. Which thread computes
 * a column never changes its bits.
 *
 * AVX-VNNI (native.py builds this file a second time with -mavxvnni, the avx2vnni family, where the CPU has
 * avx_vnni): each block's integer dot product takes the fused VEX instructions instead, vpdpwssd for q16 (two per
 * block instead of vpmaddwd + vpmaddwd + vpaddd) and vpdpbusd for q8 and int4 (one instead of vpmaddubsw +
 * vpmaddwd). Every int32 lane then holds the same 4 products as before, summed exactly, so the results are the
 * plain build's bit for bit, for all inputs: vpmaddubsw saturates its int16 pair sums where vpdpbusd does not, but
 * its operands here never reach that (q8: |x| <= 127 times a code of [-128, 127], a pair at most 2 * 127 * 128 =
 * 32512; int4: codes 0..15 times |x| <= 127, at most 3810; the limit is 32767), and vpmaddwd's one overflow (all
 * four operands -32768) cannot occur on q16 activations clamped to [-32767, 32767].
 */
#include <immintrin.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVXVNNI__) /* the VEX forms (the avx2vnni build) */
#define VNNI 1
#define DPWSSD256 _mm256_dpwssd_avx_epi32
#define DPBUSD256 _mm256_dpbusd_avx_epi32
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__) /* their EVEX forms (avx512vnni: Zen 4 has no AVX-VNNI) */
#define VNNI 1
#define DPWSSD256 _mm256_dpwssd_epi32
#define DPBUSD256 _mm256_dpbusd_epi32
#else
#define VNNI 0
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q16_PAIRS 1 /* the avx512vnni build: q16 tiles of two rows per 512-bit register (below) */
#else
#define Q16_PAIRS 0
#endif

/* Whether this build's integer dot products are AVX-VNNI's (native.Kernels checks it against its family). */
int m31r_avx2_vnni(void) { return VNNI; }

/* Whether this build runs the 512-bit q16 tiles of row pairs (native.Kernels checks it against its family). */
int m31r_avx2_q16_pairs(void) { return Q16_PAIRS; }

#define MAX_CHUNKS 32 /* head_dim up to 256, in chunks of 8 */
#define BLOCK 8       /* matmul columns per unit of work; N must be a multiple */
#define Q8_ABS 1      /* q8 activations keep a copy of |codes| for vpmaddubsw (kernels_layer.h) */
#define MAX_KEYS 65536
#define PREFETCH_KEYS 8

static inline float hsum8(__m256 v) { /* fixed fold: halves, then quarters, ... */
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  b = _mm_add_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}

/* exp(x) for x <= 0, as kernels.c's exp_nonpositive: Cephes' degree-7 polynomial on x - k ln2, scaled by 2^k
 * (built from the exponent bits: k >= -126 here). About 1 ulp; 0 below -87. */
static inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* hsum8 of four vectors at once, each folded in hsum8's order (halves, then quarters, then the pair): the same bits
 * as four hsum8 calls. Lane i of the result is the sum of the i-th argument. */
static inline __m128 fold4(__m256 a, __m256 b, __m256 c, __m256 d) {
  /* [a' | b'] and [c' | d'], x' = x's low half + its high half */
  const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
  /* per 128-bit lane: [x'0 + x'2, x'1 + x'3, y'0 + y'2, y'1 + y'3] (x, y: a, c in the low lane, b, d in the high) */
  const __m256 q = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  /* the last pair of each: [a, c, a, c | b, d, b, d] */
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(q, q, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(q, q, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm_unpacklo_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps(r, 1));
}

/* Attention of one query (hd fp32 values) over keys/values [0, n) of one head ([cap, hd] each, of type T: fp32, or
 * fp16 for a half-size cache, whose values LOAD widens to fp32 exactly), positions [0, shared) read from KS/VS and
 * the rest from K/V (a beam search's rows read their common prompt from one cache; see kernels_layer.h). Everything
 * after the load is the same arithmetic for both types: an fp16 cache changes what is stored, not how it is summed.
 *
 * The scores run four keys at a time, four independent chains of multiply-adds folded together at the end (fold4),
 * and the weighted sum of the values eight chunks of the output at a time, each chunk's sum in a register across the
 * keys: a key's score is one dependent chain of hd / 8 multiply-adds, and a chunk's sum one chain across the keys,
 * so one key at a time (or the sums in memory) left the multiply-add units waiting on their own results. Each score
 * and each output value is summed in the same order as one key at a time would: the same bits. */

/* Scores of keys [j, end) of one part (key i at Kp + i * hd, its value at Vp + i * hd, prefetched with it) against
 * the scaled query qv, into s: four keys at a time (fold4), then one at a time; their maximum into *mv and *m. */
#define SCORE_KEYS(NAME, T, LOAD)                                                                                    \
  static inline void NAME(const __m256* qv, int nc, const T* Kp, const T* Vp, int j, int end, int hd, float* s,     \
                          __m128* mv, float* m) {                                                                    \
    const int line = 64 / (int)sizeof(T); /* values per cache line */                                                \
    for (; j + 4 <= end; j += 4) {                                                                                   \
      const T* k0 = Kp + (long)j * hd;                                                                               \
      for (int i = 0; i < 4 * hd; i += line) { /* the four keys and values PREFETCH_KEYS ahead, by cache line */     \
        _mm_prefetch((const char*)(k0 + PREFETCH_KEYS * hd + i), _MM_HINT_T0);                                       \
        _mm_prefetch((const char*)(Vp + (long)(j + PREFETCH_KEYS) * hd + i), _MM_HINT_T0);                           \
      }                                                                                                              \
      __m256 a0 = _mm256_mul_ps(qv[0], LOAD(k0)), a1 = _mm256_mul_ps(qv[0], LOAD(k0 + hd));                          \
      __m256 a2 = _mm256_mul_ps(qv[0], LOAD(k0 + 2 * hd)), a3 = _mm256_mul_ps(qv[0], LOAD(k0 + 3 * hd));             \
      for (int c = 1; c < nc; ++c) {                                                                                 \
        a0 = _mm256_fmadd_ps(qv[c], LOAD(k0 + 8 * c), a0);                                                           \
        a1 = _mm256_fmadd_ps(qv[c], LOAD(k0 + hd + 8 * c), a1);                                                      \
        a2 = _mm256_fmadd_ps(qv[c], LOAD(k0 + 2 * hd + 8 * c), a2);                                                  \
        a3 = _mm256_fmadd_ps(qv[c], LOAD(k0 + 3 * hd + 8 * c), a3);                                                  \
      }                                                                                                              \
      const __m128 f = fold4(a0, a1, a2, a3);                                                                        \
      _mm_storeu_ps(s + j, f);                                                                                       \
      *mv = _mm_max_ps(*mv, f);                                                                                      \
    }                                                                                                                \
    for (; j < end; ++j) {                                                                                           \
      const T* kj = Kp + (long)j * hd;                                                                               \
      __m256 a = _mm256_mul_ps(qv[0], LOAD(kj));                                                                     \
      for (int c = 1; c < nc; ++c) a = _mm256_fmadd_ps(qv[c], LOAD(kj + 8 * c), a);                                  \
      s[j] = hsum8(a);                                                                                               \
      *m = s[j] > *m ? s[j] : *m;                                                                                    \
    }                                                                                                                \
  }

/* The largest of m and mv's lanes. */
static inline float max_of(__m128 mv, float m) {
  float mt[4];
  _mm_storeu_ps(mt, mv);
  for (int i = 0; i < 4; ++i) m = mt[i] > m ? mt[i] : m;
  return m;
}

/* s[0, n) = exp(s - m), eight at a time (the tail through a padded copy: lanes past n are exp(-inf) = 0); returns 1 /
 * their sum, summed in eight lanes and then hsum8. */
static inline float softmax_weights(float* s, int n, float m) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 total = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
    _mm256_storeu_ps(s + j, e);
    total = _mm256_add_ps(total, e);
  }
  if (j < n) {
    float t[8];
    for (int i = 0; i < 8; ++i) t[i] = j + i < n ? s[j + i] - m : -INFINITY;
    __m256 e = exp_nonpositive(_mm256_loadu_ps(t));
    _mm256_storeu_ps(t, e);
    for (int i = 0; j + i < n; ++i) s[j + i] = t[i];
    total = _mm256_add_ps(total, e);
  }
  return 1.0f / hsum8(total);
}

#define ATTEND_HEAD(NAME, KEYS, T, LOAD)                                                                             \
  static void NAME(const float* q, const T* KS, const T* VS, int shared, const T* K, const T* V, int n, int hd,     \
                   float scale, float* s, float* out) {                                                              \
    const int nc = hd / 8;                                                                                           \
    __m256 qv[MAX_CHUNKS];                                                                                           \
    const __m256 sc = _mm256_set1_ps(scale);                                                                         \
    for (int c = 0; c < nc; ++c) qv[c] = _mm256_mul_ps(_mm256_loadu_ps(q + 8 * c), sc);                             \
    __m128 mv = _mm_set1_ps(-INFINITY);                                                                              \
    float m = -INFINITY;                                                                                             \
    KEYS(qv, nc, KS, VS, 0, shared, hd, s, &mv, &m);                                                                 \
    KEYS(qv, nc, K, V, shared, n, hd, s, &mv, &m);                                                                   \
    const __m256 inv = _mm256_set1_ps(softmax_weights(s, n, max_of(mv, m)));                                        \
                                                                                                                     \
    int c0 = 0;                                                                                                      \
    for (; c0 + 8 <= nc; c0 += 8) { /* eight chunks of the output in registers */                                    \
      __m256 acc[8];                                                                                                 \
      for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();                                                      \
      for (int jj = 0; jj < n; ++jj) {                                                                               \
        const T* vj = (jj < shared ? VS : V) + (long)jj * hd + 8 * c0;                                               \
        const __m256 p = _mm256_set1_ps(s[jj]);                                                                      \
        for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(p, LOAD(vj + 8 * c), acc[c]);                           \
      }                                                                                                              \
      for (int c = 0; c < 8; ++c) _mm256_storeu_ps(out + 8 * (c0 + c), _mm256_mul_ps(acc[c], inv));                 \
    }                                                                                                                \
    for (; c0 < nc; ++c0) { /* the rest, a chunk at a time */                                                        \
      __m256 acc = _mm256_setzero_ps();                                                                              \
      for (int jj = 0; jj < n; ++jj)                                                                                 \
        acc = _mm256_fmadd_ps(_mm256_set1_ps(s[jj]), LOAD((jj < shared ? VS : V) + (long)jj * hd + 8 * c0), acc);    \
      _mm256_storeu_ps(out + 8 * c0, _mm256_mul_ps(acc, inv));                                                       \
    }                                                                                                                \
  }

/* attend_head for two queries over one cache and no shared part, of n0 <= n1 keys (two consecutive rows of a
 * prefill chunk: kernels_layer.h): each key and value is loaded once for both, and each query's arithmetic is
 * attend_head's in attend_head's order, so each gets attend_head's bits (tested). A 256-token chunk at 1,024
 * positions: 4.07 ms row by row, 3.20 ms in pairs (one mini layer, 2 cores of an AMD EPYC Zen 5). */
#define ATTEND_PAIR(NAME, KEYS, T, LOAD)                                                                             \
  static void NAME(const float* q0, const float* q1, const T* K, const T* V, int n0, int n1, int hd, float scale,   \
                   float* s0, float* s1, float* out0, float* out1) {                                                 \
    const int nc = hd / 8, line = 64 / (int)sizeof(T);                                                               \
    __m256 qa[MAX_CHUNKS], qb[MAX_CHUNKS];                                                                           \
    const __m256 sc = _mm256_set1_ps(scale);                                                                         \
    for (int c = 0; c < nc; ++c) {                                                                                   \
      qa[c] = _mm256_mul_ps(_mm256_loadu_ps(q0 + 8 * c), sc);                                                        \
      qb[c] = _mm256_mul_ps(_mm256_loadu_ps(q1 + 8 * c), sc);                                                        \
    }                                                                                                                \
    __m128 mva = _mm_set1_ps(-INFINITY), mvb = mva;                                                                  \
    float ma = -INFINITY, mb = -INFINITY;                                                                            \
    int j = 0;                                                                                                       \
    for (; j + 4 <= n0; j += 4) { /* KEYS' four-key step for both queries on one load of the keys */                \
      const T* k0 = K + (long)j * hd;                                                                                \
      for (int i = 0; i < 4 * hd; i += line) {                                                                       \
        _mm_prefetch((const char*)(k0 + PREFETCH_KEYS * hd + i), _MM_HINT_T0);                                       \
        _mm_prefetch((const char*)(V + (long)(j + PREFETCH_KEYS) * hd + i), _MM_HINT_T0);                            \
      }                                                                                                              \
      __m256 x0 = LOAD(k0), x1 = LOAD(k0 + hd), x2 = LOAD(k0 + 2 * hd), x3 = LOAD(k0 + 3 * hd);                      \
      __m256 a0 = _mm256_mul_ps(qa[0], x0), a1 = _mm256_mul_ps(qa[0], x1);                                           \
      __m256 a2 = _mm256_mul_ps(qa[0], x2), a3 = _mm256_mul_ps(qa[0], x3);                                           \
      __m256 b0 = _mm256_mul_ps(qb[0], x0), b1 = _mm256_mul_ps(qb[0], x1);                                           \
      __m256 b2 = _mm256_mul_ps(qb[0], x2), b3 = _mm256_mul_ps(qb[0], x3);                                           \
      for (int c = 1; c < nc; ++c) {                                                                                 \
        x0 = LOAD(k0 + 8 * c), x1 = LOAD(k0 + hd + 8 * c), x2 = LOAD(k0 + 2 * hd + 8 * c);                           \
        x3 = LOAD(k0 + 3 * hd + 8 * c);                                                                              \
        a0 = _mm256_fmadd_ps(qa[c], x0, a0), a1 = _mm256_fmadd_ps(qa[c], x1, a1);                                    \
        a2 = _mm256_fmadd_ps(qa[c], x2, a2), a3 = _mm256_fmadd_ps(qa[c], x3, a3);                                    \
        b0 = _mm256_fmadd_ps(qb[c], x0, b0), b1 = _mm256_fmadd_ps(qb[c], x1, b1);                                    \
        b2 = _mm256_fmadd_ps(qb[c], x2, b2), b3 = _mm256_fmadd_ps(qb[c], x3, b3);                                    \
      }                                                                                                              \
      const __m128 fa = fold4(a0, a1, a2, a3), fb = fold4(b0, b1, b2, b3);                                           \
      _mm_storeu_ps(s0 + j, fa);                                                                                     \
      _mm_storeu_ps(s1 + j, fb);                                                                                     \
      mva = _mm_max_ps(mva, fa);                                                                                     \
      mvb = _mm_max_ps(mvb, fb);                                                                                     \
    }                                                                                                                \
    KEYS(qa, nc, K, V, j, n0, hd, s0, &mva, &ma);                                                                    \
    KEYS(qb, nc, K, V, j, n1, hd, s1, &mvb, &mb);                                                                    \
    const __m256 inva = _mm256_set1_ps(softmax_weights(s0, n0, max_of(mva, ma)));                                   \
    const __m256 invb = _mm256_set1_ps(softmax_weights(s1, n1, max_of(mvb, mb)));                                   \
                                                                                                                     \
    int c0 = 0;                                                                                                      \
    for (; c0 + 4 <= nc; c0 += 4) { /* four chunks of both outputs in registers */                                   \
      __m256 acca[4], accb[4];                                                                                       \
      for (int c = 0; c < 4; ++c) acca[c] = accb[c] = _mm256_setzero_ps();                                           \
      int jj = 0;                                                                                                    \
      for (; jj < n0; ++jj) {                                                                                        \
        const T* vj = V + (long)jj * hd + 8 * c0;                                                                    \
        const __m256 pa = _mm256_set1_ps(s0[jj]), pb = _mm256_set1_ps(s1[jj]);                                       \
        for (int c = 0; c < 4; ++c) {                                                                                \
          const __m256 v = LOAD(vj + 8 * c);                                                                         \
          acca[c] = _mm256_fmadd_ps(pa, v, acca[c]);                                                                 \
          accb[c] = _mm256_fmadd_ps(pb, v, accb[c]);                                                                 \
        }                                                                                                            \
      }                                                                                                              \
      for (; jj < n1; ++jj) {                                                                                        \
        const __m256 pb = _mm256_set1_ps(s1[jj]);                                                                    \
        for (int c = 0; c < 4; ++c) accb[c] = _mm256_fmadd_ps(pb, LOAD(V + (long)jj * hd + 8 * (c0 + c)), accb[c]);   \
      }                                                                                                              \
      for (int c = 0; c < 4; ++c) {                                                                                  \
        _mm256_storeu_ps(out0 + 8 * (c0 + c), _mm256_mul_ps(acca[c], inva));                                         \
        _mm256_storeu_ps(out1 + 8 * (c0 + c), _mm256_mul_ps(accb[c], invb));                                         \
      }                                                                                                              \
    }                                                                                                                \
    for (; c0 < nc; ++c0) { /* the rest, a chunk at a time */                                                        \
      __m256 acca = _mm256_setzero_ps(), accb = _mm256_setzero_ps();                                                 \
      for (int jj = 0; jj < n1; ++jj) {                                                                              \
        const __m256 v = LOAD(V + (long)jj * hd + 8 * c0);                                                           \
        if (jj < n0) acca = _mm256_fmadd_ps(_mm256_set1_ps(s0[jj]), v, acca);                                        \
        accb = _mm256_fmadd_ps(_mm256_set1_ps(s1[jj]), v, accb);                                                     \
      }                                                                                                              \
      _mm256_storeu_ps(out0 + 8 * c0, _mm256_mul_ps(acca, inva));                                                    \
      _mm256_storeu_ps(out1 + 8 * c0, _mm256_mul_ps(accb, invb));                                                    \
    }                                                                                                                \
  }
#define LOAD_F32(p) _mm256_loadu_ps(p)
#define LOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p)))
SCORE_KEYS(score_keys, float, LOAD_F32)
SCORE_KEYS(score_keys_f16, uint16_t, LOAD_F16)
ATTEND_HEAD(attend_head, score_keys, float, LOAD_F32)
ATTEND_HEAD(attend_head_f16, score_keys_f16, uint16_t, LOAD_F16)
ATTEND_PAIR(attend_pair, score_keys, float, LOAD_F32)
ATTEND_PAIR(attend_pair_f16, score_keys_f16, uint16_t, LOAD_F16)

/* hd fp32 values into an fp16 cache row, rounded to nearest even (as torch's fp32 -> fp16 cast). */
static inline void store_f16(uint16_t* dst, const float* src, int hd) {
  for (int i = 0; i < hd; i += 8)
    _mm_storeu_si128((__m128i*)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
}

/* Rotate-half RoPE of one head (hd values): out = x * cos + roll(x, hd/2) * sin, the second product fused into the
 * sum as torch's addcmul does it (apply_rope in m31r/model.py), so a key or query gets torch's bits. `sin` carries
 * rotate-half's sign (model.rope_tables). */
static inline void rope_head(const float* x, const float* cos, const float* sin, int hd, float* out) {
  const int half = hd / 2;
  for (int i = 0; i < hd; i += 8) {
    const int j = i < half ? i + half : i - half; /* hd % 16 == 0: a chunk of 8 never straddles the halves */
    const __m256 xc = _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(cos + i));
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(sin + i), xc));
  }
}

/* The multiplier that turns a block's values into codes of at most `top` (127: q8, 32767: q16) given its max |x|,
 * or 0 (all codes zero) where top / mx is not finite: mx = 0, or a block so small (q16: mx below ~1e-34, q8: ~4e-37)
 * that the quotient overflows, where inf * x (and NaN for x = 0) would convert to INT_MIN and clamp every code to
 * -top whatever x's sign. Such a block then adds nothing, as a zero block does (its true share is below 4e-30 times
 * the weights' scale). */
static inline float code_step(float top, float mx) { return mx > 0.0f && top / mx <= FLT_MAX ? top / mx : 0.0f; }

/* ---------------------------------------------------------------------------------------------------------------
 * Activations to q8: x [M, K] fp32 → codes [M, K] int8 (|code| <= 127), |codes| [M, K] uint8 and one fp32 scale per
 * block of 32 values [M, K/32]: scale = max|x| / 127, code = round-to-nearest-even(x / scale). `nibble_order` lays
 * each block out as the int4 kernel reads its codes: the 16 even positions, then the 16 odd ones. `sums` (optional)
 * gets each row's plain fp32 sum of x per `group` values (for int4's zero points), summed in order. */
static void q8_row(const float* x, int K, int nibble_order, int8_t* q, uint8_t* aq, float* d, float* sums,
                   int group) {
  for (int b = 0; b < K / 32; ++b) {
    const float* xb = x + 32 * b;
    float t[32];
    if (nibble_order)
      for (int i = 0; i < 16; ++i) t[i] = xb[2 * i], t[16 + i] = xb[2 * i + 1];
    else
      memcpy(t, xb, sizeof t);
    __m256 amax = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < 32; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(t + i)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float mx = _mm_cvtss_f32(m4);
    const float scale = mx / 127.0f;
    d[b] = scale;
    const __m256 inv = _mm256_set1_ps(code_step(127.0f, mx));
    __m256i v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(t + 8 * i), inv));
    /* pack 32 int32 → 32 int8 in order (packs interleave 128-bit lanes; the permute restores the order) */
    __m256i p16a = _mm256_packs_epi32(v[0], v[1]), p16b = _mm256_packs_epi32(v[2], v[3]);
    __m256i p8 = _mm256_packs_epi16(p16a, p16b);
    p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    p8 = _mm256_max_epi8(p8, _mm256_set1_epi8(-127));
    _mm256_storeu_si256((__m256i*)(q + 32 * b), p8);
    _mm256_storeu_si256((__m256i*)(aq + 32 * b), _mm256_abs_epi8(p8));
  }
  if (sums)
    for (int g = 0; g < K / group; ++g) {
      float s = 0.0f;
      for (int i = 0; i < group; ++i) s += x[g * group + i];
      sums[g] = s;
    }
}

/* ---------------------------------------------------------------------------------------------------------------
 * int8 weights [N, K], one bf16 scale per output channel: y[m, n] = scale[n] * sum_b d[m, b] * sum_{k in b} xq * w. */

static inline float bf16_value(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* 32 products of one block, summed pairwise to 8 int32: |x| * (w with x's sign) = x * w, exact (|x|, |w| <= 127). */
static inline __m256 dot32(__m256i aq, __m256i xq, __m256i w) {
#if VNNI
  return _mm256_cvtepi32_ps(DPBUSD256(_mm256_setzero_si256(), aq, _mm256_sign_epi8(w, xq)));
#else
  __m256i p = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(w, xq));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
}

#define Q8_TILE(R, C)                                                                                              \
  static void q8_tile_##R##_##C(const int8_t* xq, const uint8_t* aq, const float* d, int K, const int8_t* w,     \
                                const uint16_t* s, float* y, int N) {                                            \
    __m256 acc[R * C];                                                                                           \
    for (int i = 0; i < R * C; ++i) acc[i] = _mm256_setzero_ps();                                                \
    const int nb = K / 32;                                                                                       \
    for (int b = 0; b < nb; ++b) {                                                                               \
      __m256i wv[C];                                                                                             \
      for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_si256((const __m256i*)(w + (long)c * K + 32 * b));        \
      if (!(b & 1))                                                                                              \
        for (int c = 0; c < C; ++c) _mm_prefetch((const char*)(w + (long)(C + c) * K + 32 * b + 64), _MM_HINT_T0); \
      for (int r = 0; r < R; ++r) {                                                                              \
        const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + (long)r * K + 32 * b));                      \
        const __m256i av = _mm256_loadu_si256((const __m256i*)(aq + (long)r * K + 32 * b));                      \
        const __m256 dv = _mm256_broadcast_ss(d + (long)r * nb + b);                                             \
        for (int c = 0; c < C; ++c) acc[r * C + c] = _mm256_fmadd_ps(dot32(av, xv, wv[c]), dv, acc[r * C + c]);   \
      }                                                                                                          \
    }                                                                                                            \
    for (int r = 0; r < R; ++r)                                                                                  \
      for (int c = 0; c < C; ++c) y[(long)r * N + c] = hsum8(acc[r * C + c]) * bf16_value(s[c]);                \
  }
Q8_TILE(1, 4)
Q8_TILE(2, 4)
Q8_TILE(3, 2)
Q8_TILE(4, 2)
Q8_TILE(5, 1)
Q8_TILE(6, 1)
Q8_TILE(7, 1)
Q8_TILE(8, 1)

/* ---------------------------------------------------------------------------------------------------------------
 * The accurate int8 path: activations to q16, int16 codes in blocks of 32 (|code| <= 32767) with one fp32 scale
 * per block, scale = max|x| / 32767: a rounding step 258 times finer than q8's max|x| / 127, so the activations'
 * rounding stays well below the int8 weights' own. The weights are sign-extended to int16 (vpmovsxbw) and each
 * block multiplied with vpmaddwd: every int32 lane then sums 4 products of at most 32767 * 127, below 2^24, so the
 * block's integer sum is exact and so is its conversion to fp32. Per block and row, two vpmaddwd, one add, one
 * conversion and one FMA: as many instructions as q8's vpsignb + vpmaddubsw + vpmaddwd + conversion + FMA, plus
 * the widening of each weight once per tile (shared by its rows), and activations of 2 bytes instead of 2 x 1. */
static void q16_row(const float* x, int K, int16_t* q, float* d) {
  for (int b = 0; b < K / 32; ++b) {
    const float* xb = x + 32 * b;
    __m256 amax = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < 32; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float mx = _mm_cvtss_f32(m4);
    d[b] = mx / 32767.0f;
    const __m256 inv = _mm256_set1_ps(code_step(32767.0f, mx));
    for (int h = 0; h < 2; ++h) { /* 16 values: 2 x 8 int32 → 16 int16 (packs interleaves 128-bit lanes) */
      __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 16 * h), inv));
      __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 16 * h + 8), inv));
      __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, c), 0xD8);
      _mm256_storeu_si256((__m256i*)(q + 32 * b + 16 * h), _mm256_max_epi16(p, _mm256_set1_epi16(-32767)));
    }
  }
}

static inline __m256i widen16(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)); }

/* One block of 32: int16 activations x, weights widened to int16 in w0 (values 0-15) and w1 (16-31). */
static inline __m256 wdot32(const int16_t* x, __m256i w0, __m256i w1) {
#if VNNI
  __m256i a = DPWSSD256(_mm256_setzero_si256(), w0, _mm256_loadu_si256((const __m256i*)x));
  return _mm256_cvtepi32_ps(DPWSSD256(a, w1, _mm256_loadu_si256((const __m256i*)(x + 16))));
#else
  __m256i a = _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i*)x));
  __m256i b = _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i*)(x + 16)));
  return _mm256_cvtepi32_ps(_mm256_add_epi32(a, b));
#endif
}

/* The q16 tiles prefetch the columns two tiles ahead (Q16_AHEAD * C), not the next tile's: at one decode row the
 * weights stream from memory and a tile's arithmetic is short, so a prefetch one tile (4 KB at K = 1,024) ahead came
 * late. The q16 matmuls of the medium shape's 18 layers (2 cores of an AMD EPYC Zen 5, avx2 build, interleaved A/B,
 * medians of 30 steps): 1 row 4.28 -> 3.76 ms (46 -> 52 GB/s), 4 rows 8.39 -> 7.79 ms; a medium int8 decode step
 * 4.84 -> 4.32 ms, m31r-mini's 0.94 -> 0.87 ms. Three tiles ahead or more was slower again. Only the prefetch's
 * address changes: the arithmetic, and so the bits, are the same. */
#define Q16_AHEAD 2
#define Q16_TILE(R, C)                                                                                             \
  static void q16_tile_##R##_##C(const int16_t* xq, const float* d, int K, const int8_t* w, const uint16_t* s,    \
                                 float* y, int N) {                                                              \
    __m256 acc[R * C];                                                                                           \
    for (int i = 0; i < R * C; ++i) acc[i] = _mm256_setzero_ps();                                                \
    const int nb = K / 32;                                                                                       \
    for (int b = 0; b < nb; ++b) {                                                                               \
      __m256i w0[C], w1[C];                                                                                      \
      for (int c = 0; c < C; ++c) {                                                                              \
        w0[c] = widen16(w + (long)c * K + 32 * b);                                                               \
        w1[c] = widen16(w + (long)c * K + 32 * b + 16);                                                          \
      }                                                                                                          \
      if (!(b & 1))                                                                                              \
        for (int c = 0; c < C; ++c)                                                                              \
          _mm_prefetch((const char*)(w + (long)(Q16_AHEAD * C + c) * K + 32 * b + 64), _MM_HINT_T0);             \
      for (int r = 0; r < R; ++r) {                                                                              \
        const __m256 dv = _mm256_broadcast_ss(d + (long)r * nb + b);                                             \
        for (int c = 0; c < C; ++c)                                                                              \
          acc[r * C + c] = _mm256_fmadd_ps(wdot32(xq + (long)r * K + 32 * b, w0[c], w1[c]), dv, acc[r * C + c]);  \
      }                                                                                                          \
    }                                                                                                            \
    for (int r = 0; r < R; ++r)                                                                                  \
      for (int c = 0; c < C; ++c) y[(long)r * N + c] = hsum8(acc[r * C + c]) * bf16_value(s[c]);                \
  }
Q16_TILE(1, 4)
Q16_TILE(2, 2)
Q16_TILE(3, 2)
Q16_TILE(4, 2)
Q16_TILE(5, 1)
Q16_TILE(6, 1)
Q16_TILE(7, 1)
Q16_TILE(8, 1)

#if Q16_PAIRS
/* The avx512vnni build's q16 tiles: two rows in one 512-bit register, each lane pair (2i, 2i + 1) holding lane i of
 * the 8-lane accumulators above for the first and the second row. Per block of 32 and pair of rows: two vpdpwssd,
 * one conversion and one FMA, where the tiles above spend twice that on the two rows. Every lane sums the same four
 * products (exact in int32) and then takes the same conversion, FMA and final fold as its 8-lane twin, so a row's
 * bits are the avx2 build's, alone or batched, paired or not (tests/test_native_avx512vnni.py). The activations
 * come laid out for it (q16_pair): per pair and block, values 0-15 of both rows with their dwords interleaved, then
 * values 16-31 likewise, and the two rows' scales side by side, so every operand is one load. */
static void q16_pair(const int16_t* x0, const int16_t* x1, const float* d0, const float* d1, int K, int16_t* xp,
                     float* dp) {
  const __m512i idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  for (int b = 0; b < K / 32; ++b) {
    for (int h = 0; h < 2; ++h) {
      const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(x0 + 32 * b + 16 * h)));
      const __m512i c = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(x1 + 32 * b + 16 * h)));
      _mm512_storeu_si512(xp + 64 * b + 32 * h, _mm512_permutex2var_epi32(a, idx, c));
    }
    dp[2 * b] = d0[b];
    dp[2 * b + 1] = d1[b];
  }
}

#define Q16P_TILE(P, C)                                                                                            \
  static void q16p_tile_##P##_##C(const int16_t* xp, const float* dp, int K, const int8_t* w, const uint16_t* s,   \
                                  float* y, int N) {                                                             \
    const __m512i lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);                         \
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));                                               \
    __m512 acc[P * C];                                                                                           \
    for (int i = 0; i < P * C; ++i) acc[i] = _mm512_setzero_ps();                                                \
    const int nb = K / 32;                                                                                       \
    for (int b = 0; b < nb; ++b) {                                                                               \
      __m512i w0[C], w1[C]; /* each dword (two codes) twice: once per row of the pair */                          \
      for (int c = 0; c < C; ++c) {                                                                              \
        const __m512i wz = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + (long)c * K + 32 * b)));  \
        w0[c] = _mm512_permutexvar_epi32(lo, wz);                                                                \
        w1[c] = _mm512_permutexvar_epi32(hi, wz);                                                                \
      }                                                                                                          \
      if (!(b & 1))                                                                                              \
        for (int c = 0; c < C; ++c) _mm_prefetch((const char*)(w + (long)(C + c) * K + 32 * b + 64), _MM_HINT_T0); \
      for (int p = 0; p < P; ++p) {                                                                              \
        const int16_t* xb = xp + (long)p * 2 * K + 64 * b;                                                       \
        const __m512i x0 = _mm512_loadu_si512(xb), x1 = _mm512_loadu_si512(xb + 32);                            \
        double dd;                                                                                               \
        memcpy(&dd, dp + (long)p * 2 * nb + 2 * b, 8);                                                           \
        const __m512 dv = _mm512_castpd_ps(_mm512_set1_pd(dd)); /* the two rows' scales, alternating */           \
        for (int c = 0; c < C; ++c) {                                                                            \
          const __m512i t = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w0[c], x0);                              \
          acc[p * C + c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpwssd_epi32(t, w1[c], x1)), dv,             \
                                           acc[p * C + c]);                                                      \
        }                                                                                                        \
      }                                                                                                          \
    }                                                                                                            \
    const __m512i split = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);                 \
    for (int p = 0; p < P; ++p)                                                                                  \
      for (int c = 0; c < C; ++c) {                                                                              \
        const __m512 v = _mm512_permutexvar_ps(split, acc[p * C + c]);                                           \
        const float sc = bf16_value(s[c]);                                                                       \
        y[(long)(2 * p) * N + c] = hsum8(_mm512_castps512_ps256(v)) * sc;                                        \
        y[(long)(2 * p + 1) * N + c] = hsum8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))) * sc; \
      }                                                                                                          \
  }
Q16P_TILE(1, 4)
Q16P_TILE(2, 4)
Q16P_TILE(3, 4)
Q16P_TILE(4, 4)

/* R rows (1-8) over BLOCK columns: their pairs in the tiles above, an odd last row in the 8-lane tile. */
static void q16_pairs_block(int R, const int16_t* xq, const float* d, const int16_t* xp, const float* dp, int K,
                            const int8_t* w, const uint16_t* s, float* y, int N) {
#define Q16P_RUN(P, C) \
  for (int c = 0; c < BLOCK; c += C) q16p_tile_##P##_##C(xp, dp, K, w + (long)c * K, s + c, y + c, N);
  switch (R / 2) {
    case 1: Q16P_RUN(1, 4) break;
    case 2: Q16P_RUN(2, 4) break;
    case 3: Q16P_RUN(3, 4) break;
    case 4: Q16P_RUN(4, 4) break;
  }
#undef Q16P_RUN
  if (R & 1) {
    const int r = R - 1;
    for (int c = 0; c < BLOCK; c += 4)
      q16_tile_1_4(xq + (long)r * K, d + (long)r * (K / 32), K, w + (long)c * K, s + c, y + (long)r * N + c, N);
  }
}
#endif

/* The fp32 alternative: each code widened to fp32, one fused multiply-add per weight and row (8 columns at a time,
 * rows one by one). Same contract as m31r_int8_mm_q8 without the work buffer; for comparison (README "Speed"). */
int m31r_int8_mm_f32(int M, int N, int K, const float* x, const int8_t* w, const uint16_t* scale, float* y) {
  if (M < 1 || K % 32 || N % BLOCK) return 1;
#pragma omp parallel for schedule(dynamic, 16)
  for (int b = 0; b < N / BLOCK; ++b) {
    const long n0 = (long)b * BLOCK;
    for (int m = 0; m < M; m += 2) {
      const int R = M - m < 2 ? 1 : 2;
      for (int c = 0; c < BLOCK; c += 4) {
        __m256 acc[2][4];
        for (int r = 0; r < 2; ++r)
          for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_ps();
        for (int k = 0; k < K; k += 8) {
          __m256 wv[4];
          for (int i = 0; i < 4; ++i)
            wv[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w + (n0 + c + i) * K + k))));
          for (int r = 0; r < R; ++r) {
            const __m256 xv = _mm256_loadu_ps(x + (long)(m + r) * K + k);
            for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_fmadd_ps(xv, wv[i], acc[r][i]);
          }
        }
        for (int r = 0; r < R; ++r)
          for (int i = 0; i < 4; ++i)
            y[(long)(m + r) * N + n0 + c + i] = hsum8(acc[r][i]) * bf16_value(scale[n0 + c + i]);
      }
    }
  }
  return 0;
}

/* ---------------------------------------------------------------------------------------------------------------
 * int4 weights: codes [N, K/2] (two per byte, the even column in the low nibble), per (channel, group of G values)
 * an fp32 scale and base (the value of code 0): w = q * scale + base. Then
 *   y[m, n] = sum_g scale[n, g] * sum_{b in g} d[m, b] * sum_{k in b} xq * q  +  sum_g base[n, g] * xsum[m, g]
 * with the activations quantized in nibble order (q8_row) and xsum their plain fp32 sums per group. */

static inline __m256i nibbles32(const uint8_t* p) { /* 16 bytes → 32 codes: 16 low nibbles, then 16 high */
  __m128i b = _mm_loadu_si128((const __m128i*)p);
  __m128i lo = _mm_and_si128(b, _mm_set1_epi8(15));
  __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
  return _mm256_set_m128i(hi, lo);
}

static inline __m256 udot32(__m256i q, __m256i xq) { /* codes 0..15 (unsigned) times signed activations */
#if VNNI
  return _mm256_cvtepi32_ps(DPBUSD256(_mm256_setzero_si256(), q, xq));
#else
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q, xq), _mm256_set1_epi16(1)));
#endif
}

#define I4_TILE(R, C)                                                                                              \
  static void i4_tile_##R##_##C(const int8_t* xq, const float* d, const float* xs, int K, int G, const uint8_t* w, \
                                const float* sc, const float* base, float* y, int N) {                           \
    __m256 acc[R * C];                                                                                           \
    for (int i = 0; i < R * C; ++i) acc[i] = _mm256_setzero_ps();                                                \
    const int nb = K / 32, ng = K / G, per = G / 32;                                                             \
    for (int g = 0; g < ng; ++g) {                                                                               \
      __m256 part[R * C];                                                                                        \
      for (int i = 0; i < R * C; ++i) part[i] = _mm256_setzero_ps();                                             \
      for (int b = g * per; b < (g + 1) * per; ++b) {                                                            \
        __m256i wv[C];                                                                                           \
        for (int c = 0; c < C; ++c) wv[c] = nibbles32(w + (long)c * (K / 2) + 16 * b);                            \
        if (!(b & 3))                                                                                            \
          for (int c = 0; c < C; ++c) _mm_prefetch((const char*)(w + (long)(C + c) * (K / 2) + 16 * b + 64), _MM_HINT_T0); \
        for (int r = 0; r < R; ++r) {                                                                            \
          const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + (long)r * K + 32 * b));                    \
          const __m256 dv = _mm256_broadcast_ss(d + (long)r * nb + b);                                           \
          for (int c = 0; c < C; ++c) part[r * C + c] = _mm256_fmadd_ps(udot32(wv[c], xv), dv, part[r * C + c]); \
        }                                                                                                        \
      }                                                                                                          \
      for (int c = 0; c < C; ++c) {                                                                              \
        const __m256 sv = _mm256_broadcast_ss(sc + (long)c * ng + g);                                            \
        for (int r = 0; r < R; ++r) acc[r * C + c] = _mm256_fmadd_ps(part[r * C + c], sv, acc[r * C + c]);       \
      }                                                                                                          \
    }                                                                                                            \
    for (int r = 0; r < R; ++r)                                                                                  \
      for (int c = 0; c < C; ++c) {                                                                              \
        float z = 0.0f;                                                                                          \
        for (int g = 0; g < ng; ++g) z += base[(long)c * ng + g] * xs[(long)r * ng + g];                         \
        y[(long)r * N + c] = hsum8(acc[r * C + c]) + z;                                                          \
      }                                                                                                          \
  }
I4_TILE(1, 4)
I4_TILE(2, 2)
I4_TILE(3, 2)
I4_TILE(4, 1)
I4_TILE(5, 1)
I4_TILE(6, 1)
I4_TILE(7, 1)
I4_TILE(8, 1)

/* ---------------------------------------------------------------------------------------------------------------
 * fp32 weights [N, K] (torch's Linear layout, row-major), fp32 activations: y[m, n] = sum_k x[m, k] * w[n, k], for
 * decode rows and short chunks of fp32 engines. A decode step streams every weight once, so it is bound by memory
 * bandwidth; what this kernel adds over torch's GEMV/GEMM paths is a summation order that never depends on the row
 * count: each (row, column) has its own accumulator of 8 lanes walking k in steps of 8, folded by hsum8 at the end,
 * whatever tile, row count or thread count computes it. So a row gets the same bits alone or batched, and fp32
 * engines can decode a lone stream at one row (torch's fp32 matmuls round differently at 1, 2-3 and 4+ rows, which
 * the engine's probe used to pay for with padding rows). The x values feed the FMAs straight from memory (L1: a
 * tile's rows are at most 8 x K floats), the weights of a tile's columns once per step of 8, and the next tile's
 * columns are prefetched a cache line ahead, as in the int8 kernels. */
#define F32_TILE(R, C)                                                                                             \
  static void f32_tile_##R##_##C(const float* x, int K, const float* w, float* y, int N) {                         \
    __m256 acc[R * C];                                                                                           \
    for (int i = 0; i < R * C; ++i) acc[i] = _mm256_setzero_ps();                                                \
    for (int k = 0; k < K; k += 8) {                                                                             \
      __m256 wv[C];                                                                                              \
      for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w + (long)c * K + k);                                  \
      if (!(k & 15))                                                                                             \
        for (int c = 0; c < C; ++c) _mm_prefetch((const char*)(w + (long)(C + c) * K + k + 16), _MM_HINT_T0);     \
      for (int r = 0; r < R; ++r) {                                                                              \
        const __m256 xv = _mm256_loadu_ps(x + (long)r * K + k);                                                  \
        for (int c = 0; c < C; ++c) acc[r * C + c] = _mm256_fmadd_ps(xv, wv[c], acc[r * C + c]);                 \
      }                                                                                                          \
    }                                                                                                            \
    for (int r = 0; r < R; ++r)                                                                                  \
      for (int c = 0; c < C; ++c) y[(long)r * N + c] = hsum8(acc[r * C + c]);                                    \
  }
F32_TILE(1, 4)
F32_TILE(2, 4)
F32_TILE(3, 2)
F32_TILE(4, 2)
F32_TILE(5, 2)
F32_TILE(6, 2)
F32_TILE(7, 1)
F32_TILE(8, 1)

/* ---------------------------------------------------------------------------------------------------------------
 * The per-token work between the matmuls of fp32 engines (model.Transformer.step), each one call for all rows of a
 * step instead of a chain of small torch ops. Row by row, so a row's bits never depend on the others.
 *
 * RMSNorm after the residual add: x += delta (delta may be NULL: the first layer's norm), then
 * out = w * (x / sqrt(mean(x^2) + eps)), the squares summed in 8 lanes over d in order and folded by hsum8, in the
 * order torch's RMSNorm applies them (model.RMSNorm). d must be a multiple of 8. */
int m31r_add_rmsnorm_f32(int rows, int d, float* x, const float* delta, const float* w, float eps, float* out) {
  if (d < 8 || d % 8) return 1;
  for (int r = 0; r < rows; ++r) {
    float* xr = x + (long)r * d;
    __m256 ss = _mm256_setzero_ps();
    for (int k = 0; k < d; k += 8) {
      __m256 v = _mm256_loadu_ps(xr + k);
      if (delta) {
        v = _mm256_add_ps(v, _mm256_loadu_ps(delta + (long)r * d + k));
        _mm256_storeu_ps(xr + k, v);
      }
      ss = _mm256_fmadd_ps(v, v, ss);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum8(ss) / (float)d + eps));
    for (int k = 0; k < d; k += 8)
      _mm256_storeu_ps(out + (long)r * d + k,
                       _mm256_mul_ps(_mm256_loadu_ps(w + k), _mm256_mul_ps(_mm256_loadu_ps(xr + k), inv)));
  }
  return 0;
}

/* SwiGLU's product: rows of [gate (h values) | up (h values)] as the fused w13 matmul writes them, to
 * out [rows, h] = silu(gate) * up, silu(g) = g / (1 + e^-g) from e^-|g| (exp_nonpositive): g / (1 + t) for g >= 0,
 * g * t / (1 + t) below, so the exponential never overflows. h must be a multiple of 8. */
int m31r_swiglu_f32(int rows, int h, const float* gu, float* out) {
  if (h < 8 || h % 8) return 1;
  const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
  for (int r = 0; r < rows; ++r)
    for (int k = 0; k < h; k += 8) {
      const __m256 g = _mm256_loadu_ps(gu + 2L * r * h + k);
      const __m256 t = exp_nonpositive(_mm256_or_ps(g, sign)); /* e^-|g| */
      const __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, t), g); /* sign bit set: g < 0 (or -0) */
      const __m256 silu = _mm256_div_ps(num, _mm256_add_ps(one, t));
      _mm256_storeu_ps(out + (long)r * h + k, _mm256_mul_ps(silu, _mm256_loadu_ps(gu + 2L * r * h + h + k)));
    }
  return 0;
}

/* Decode attention on the wqkv projection and one decoder layer in one call: the same code for both fp32 families. */
#include "kernels_layer.h"
