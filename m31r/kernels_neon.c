/* Native CPU kernels for m31r, Arm NEON family (built and loaded by m31r/native.py with -march=armv8.2-a+dotprod
 * where the CPU has the dot-product extension, plain -march=armv8-a elsewhere; OpenMP through torch's runtime, none
 * on macOS). The Arm sibling of kernels_avx2.c: the same exported functions, arguments, weight layouts (int4: the
 * even column in the low nibble) and fp32 activations and KV cache.
 *
 * Every function computes what its kernels_avx2.c namesake computes in the same order, down to the bits: AVX2's
 * eight fp32 lanes are two float32x4 (lanes 0-3 and 4-7), each lane sums the same products in the same order with
 * the same fused multiply-adds, and the lanes fold in AVX2's order (hsum8). Integer block sums are exact either way,
 * so how they are formed does not matter, only which products each lane gets. A machine's output thus does not
 * depend on whether it is an AVX2 laptop or an Arm one, nor on the dot-product extension
 * (tests/test_native_neon.py checks all three builds give the same bits, under qemu-user).
 *
 * decode attention (m31r_attend_decode_f32): one query per (row, head) over that row's own fp32 KV cache.
 * int8 (m31r_int8_mm_q16, what engines run): activations to int16 per block of 32 (q16), codes widened to int16,
 * smull/smlal into int32 lanes of 4 products each (below 2^24: exact in int32 and in the conversion to fp32).
 * int4 (m31r_int4_mm_q8) and int8 m31r_int8_mm_q8: activations to int8 per block of 32 (q8); sdot where the CPU has
 * the dot-product extension (__ARM_FEATURE_DOTPROD), smull + pairwise adds otherwise. m31r_int8_mm_f32 widens each
 * code to fp32 (for comparison, as in kernels_avx2.c).
 * fp32 weights (m31r_f32_mm) and the per-token ops of fp32 engines: decode attention on the wqkv projection with RoPE
 * (m31r_attend_qkv_f32), the residual add with the RMSNorm after it (m31r_add_rmsnorm_f32), SwiGLU's product
 * (m31r_swiglu_f32).
 *
 * Arithmetic is fixed whatever the row count, thread count or tile, so a row gets the same bits alone or batched:
 * every (row, column) has its own accumulator walking k in order, lanes summed in a fixed fold. Built with
 * -ffp-contract=off so that the compiler fuses nothing the source does not.
 *
 * Threads: the int8 and int4 matmuls hand out columns 16 blocks at a time (schedule(dynamic, 16)), as kernels_avx2.c
 * explains; a thread never changes a column's bits.
 */
#include <arm_neon.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_CHUNKS 32 /* head_dim up to 256, in chunks of 8 (two float32x4) */
#define BLOCK 8       /* matmul columns per unit of work; N must be a multiple */
#define Q8_ABS 0      /* q8 activations need no |codes| copy here: NEON multiplies signed bytes (kernels_layer.h) */
#define MAX_KEYS 65536
#define PREFETCH_KEYS 8

/* Whether this build uses the dot-product extension (native.Kernels reports it). */
int m31r_neon_dotprod(void) {
#ifdef __ARM_FEATURE_DOTPROD
  return 1;
#else
  return 0;
#endif
}

/* Eight fp32 lanes: AVX2's __m256 as its low and high halves. */
typedef struct {
  float32x4_t lo, hi;
} f8;

static inline f8 f8_zero(void) { return (f8){vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}; }
static inline f8 f8_load(const float* p) { return (f8){vld1q_f32(p), vld1q_f32(p + 4)}; }
static inline f8 f8_fma(f8 acc, f8 a, f8 b) { /* acc + a * b, fused (AVX2's fmadd(a, b, acc)) */
  return (f8){vfmaq_f32(acc.lo, a.lo, b.lo), vfmaq_f32(acc.hi, a.hi, b.hi)};
}
static inline f8 f8_fma1(f8 acc, f8 a, float32x4_t b) { /* acc + a * b, b one value in every lane */
  return (f8){vfmaq_f32(acc.lo, a.lo, b), vfmaq_f32(acc.hi, a.hi, b)};
}
static inline f8 f8_cvt(int32x4_t lo, int32x4_t hi) { return (f8){vcvtq_f32_s32(lo), vcvtq_f32_s32(hi)}; }

/* kernels_avx2.c's fold: halves (lane i + lane i+4), then quarters, then the last pair. */
static inline float hsum8(f8 v) {
  const float32x4_t b = vaddq_f32(v.lo, v.hi);
  const float32x2_t c = vadd_f32(vget_low_f32(b), vget_high_f32(b));
  return vget_lane_f32(c, 0) + vget_lane_f32(c, 1);
}

/* exp(x) for x <= 0, as kernels_avx2.c's: Cephes' degree-7 polynomial on x - k ln2, scaled by 2^k (built from the
 * exponent bits: k >= -126 here). About 1 ulp; 0 below -87. vrndnq rounds to nearest even, as _mm256_round_ps. */
static inline float32x4_t exp_nonpositive(float32x4_t x) {
  x = vmaxq_f32(x, vdupq_n_f32(-87.0f));
  const float32x4_t k = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
  float32x4_t r = vfmsq_f32(x, k, vdupq_n_f32(0.693359375f));
  r = vfmsq_f32(r, k, vdupq_n_f32(-2.12194440e-4f));
  float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
  p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
  p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
  p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
  p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
  p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), p, vmulq_f32(r, r));
  const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(k), vdupq_n_s32(127)), 23);
  return vmulq_f32(p, vreinterpretq_f32_s32(e));
}

static inline f8 f8_exp(f8 x) { return (f8){exp_nonpositive(x.lo), exp_nonpositive(x.hi)}; }

/* Attention of one query (hd fp32 values) over keys/values [0, n) of one head ([cap, hd] each, of type T: fp32, or
 * fp16 for a half-size cache, which LOAD widens to fp32 exactly), positions [0, shared) from KS/VS and the rest from
 * K/V; as kernels_avx2.c's ATTEND_HEAD (which runs four keys at a time, summed in this order). */
#define ATTEND_HEAD(NAME, T, LOAD)                                                                                     \
static void NAME(const float* q, const T* KS, const T* VS, int shared, const T* K, const T* V, int n, int hd,        \
                 float scale, float* s, float* out) {                                                                 \
  const int nc = hd / 8;                                                                                              \
  f8 qv[MAX_CHUNKS], acc[MAX_CHUNKS];                                                                                 \
  const float32x4_t sc = vdupq_n_f32(scale);                                                                          \
  for (int c = 0; c < nc; ++c) {                                                                                      \
    const f8 x = f8_load(q + 8 * c);                                                                                  \
    qv[c] = (f8){vmulq_f32(x.lo, sc), vmulq_f32(x.hi, sc)};                                                           \
  }                                                                                                                   \
                                                                                                                      \
  float m = -INFINITY;                                                                                                \
  for (int j = 0; j < n; ++j) {                                                                                       \
    const T* kj = (j < shared ? KS : K) + (long)j * hd;                                                               \
    for (int c = 0; c < nc; c += 64 / (8 * (int)sizeof(T))) { /* one cache line at a time */                          \
      __builtin_prefetch(kj + PREFETCH_KEYS * hd + 8 * c);                                                            \
      __builtin_prefetch((j < shared ? VS : V) + (long)(j + PREFETCH_KEYS) * hd + 8 * c);                             \
    }                                                                                                                 \
    const f8 k0 = LOAD(kj);                                                                                           \
    f8 a = {vmulq_f32(qv[0].lo, k0.lo), vmulq_f32(qv[0].hi, k0.hi)};                                                  \
    for (int c = 1; c < nc; ++c) a = f8_fma(a, qv[c], LOAD(kj + 8 * c));                                              \
    s[j] = hsum8(a);                                                                                                  \
    m = s[j] > m ? s[j] : m;                                                                                          \
  }                                                                                                                   \
                                                                                                                      \
  const float32x4_t vm = vdupq_n_f32(m);                                                                              \
  f8 total = f8_zero();                                                                                               \
  int j = 0;                                                                                                          \
  for (; j + 8 <= n; j += 8) {                                                                                        \
    const f8 x = f8_load(s + j);                                                                                      \
    const f8 e = f8_exp((f8){vsubq_f32(x.lo, vm), vsubq_f32(x.hi, vm)});                                              \
    vst1q_f32(s + j, e.lo);                                                                                           \
    vst1q_f32(s + j + 4, e.hi);                                                                                       \
    total = (f8){vaddq_f32(total.lo, e.lo), vaddq_f32(total.hi, e.hi)};                                               \
  }                                                                                                                   \
  if (j < n) { /* the tail through a padded copy: lanes past n are exp(-inf) = 0 */                                   \
    float t[8];                                                                                                       \
    for (int i = 0; i < 8; ++i) t[i] = j + i < n ? s[j + i] - m : -INFINITY;                                          \
    const f8 e = f8_exp(f8_load(t));                                                                                  \
    vst1q_f32(t, e.lo);                                                                                               \
    vst1q_f32(t + 4, e.hi);                                                                                           \
    for (int i = 0; j + i < n; ++i) s[j + i] = t[i];                                                                  \
    total = (f8){vaddq_f32(total.lo, e.lo), vaddq_f32(total.hi, e.hi)};                                               \
  }                                                                                                                   \
  const float inv = 1.0f / hsum8(total);                                                                              \
                                                                                                                      \
  for (int c = 0; c < nc; ++c) acc[c] = f8_zero();                                                                    \
  for (int jj = 0; jj < n; ++jj) {                                                                                    \
    const T* vj = (jj < shared ? VS : V) + (long)jj * hd;                                                             \
    const float32x4_t p = vdupq_n_f32(s[jj]);                                                                         \
    for (int c = 0; c < nc; ++c) acc[c] = f8_fma1(acc[c], LOAD(vj + 8 * c), p);                                       \
  }                                                                                                                   \
  const float32x4_t vi = vdupq_n_f32(inv);                                                                            \
  for (int c = 0; c < nc; ++c) {                                                                                      \
    vst1q_f32(out + 8 * c, vmulq_f32(acc[c].lo, vi));                                                                 \
    vst1q_f32(out + 8 * c + 4, vmulq_f32(acc[c].hi, vi));                                                             \
  }                                                                                                                   \
}
static inline f8 f8_load_f16(const uint16_t* p) {
  return (f8){vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))), vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4)))};
}
ATTEND_HEAD(attend_head, float, f8_load)
ATTEND_HEAD(attend_head_f16, uint16_t, f8_load_f16)

/* Two queries over one cache, as kernels_avx2.c's attend_pair: here attend_head for each (the same bits). */
#define ATTEND_PAIR(NAME, HEAD, T)                                                                                    \
static void NAME(const float* q0, const float* q1, const T* K, const T* V, int n0, int n1, int hd, float scale,     \
                 float* s0, float* s1, float* out0, float* out1) {                                                    \
  HEAD(q0, K, V, 0, K, V, n0, hd, scale, s0, out0);                                                                   \
  HEAD(q1, K, V, 0, K, V, n1, hd, scale, s1, out1);                                                                   \
}
ATTEND_PAIR(attend_pair, attend_head, float)
ATTEND_PAIR(attend_pair_f16, attend_head_f16, uint16_t)

/* hd fp32 values into an fp16 cache row, rounded to nearest even (FPCR's default mode: F16C's and torch's). */
static inline void store_f16(uint16_t* dst, const float* src, int hd) {
  for (int i = 0; i < hd; i += 4) vst1_u16(dst + i, vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(src + i))));
}

/* ---------------------------------------------------------------------------------------------------------------
 * Activation blocks of 32 to integers: the largest |x| of the block, and its values times `inv` rounded to the
 * nearest integer, ties to even (vcvtnq, as AVX2's cvtps under the default rounding mode). */

static inline float block_max(const float* xb) {
  float32x4_t amax = vdupq_n_f32(0.0f);
  for (int i = 0; i < 32; i += 4) amax = vmaxq_f32(amax, vabsq_f32(vld1q_f32(xb + i)));
  return vmaxvq_f32(amax);
}

static inline int32x4_t round4(const float* p, float32x4_t inv) { return vcvtnq_s32_f32(vmulq_f32(vld1q_f32(p), inv)); }

/* kernels_avx2.c's code_step: the multiplier to codes of at most `top`, or 0 (all codes zero) where top / mx is not
 * finite (mx = 0, or a block so small that the quotient overflows, where the codes would saturate), so that both
 * families round such a block alike. */
static inline float code_step(float top, float mx) { return mx > 0.0f && top / mx <= FLT_MAX ? top / mx : 0.0f; }

/* Activations to q8: x [M, K] fp32 → codes [M, K] int8 (|code| <= 127) and one fp32 scale per block of 32 values
 * [M, K/32]: scale = max|x| / 127, code = round-to-nearest-even(x / scale), as kernels_avx2.c's q8_row (which also
 * keeps |codes| for vpmaddubsw: NEON multiplies signed bytes). `nibble_order` lays each block out as the int4
 * kernel reads its codes: the 16 even positions, then the 16 odd ones. `sums` (optional) gets each row's plain fp32
 * sum of x per `group` values (for int4's zero points), summed in order. */
static void q8_row(const float* x, int K, int nibble_order, int8_t* q, uint8_t* aq, float* d, float* sums,
                   int group) {
  (void)aq; /* kernels_avx2.c's |codes|, not needed here (Q8_ABS) */
  for (int b = 0; b < K / 32; ++b) {
    const float* xb = x + 32 * b;
    float t[32];
    if (nibble_order)
      for (int i = 0; i < 16; ++i) t[i] = xb[2 * i], t[16 + i] = xb[2 * i + 1];
    else
      memcpy(t, xb, sizeof t);
    const float mx = block_max(t);
    const float scale = mx / 127.0f;
    d[b] = scale;
    const float32x4_t inv = vdupq_n_f32(code_step(127.0f, mx));
    for (int h = 0; h < 2; ++h) { /* 16 values: 4 x 4 int32 → 16 int8, saturating, then clamped to -127 */
      const float* th = t + 16 * h;
      const int16x8_t a = vcombine_s16(vqmovn_s32(round4(th, inv)), vqmovn_s32(round4(th + 4, inv)));
      const int16x8_t c = vcombine_s16(vqmovn_s32(round4(th + 8, inv)), vqmovn_s32(round4(th + 12, inv)));
      const int8x16_t p = vcombine_s8(vqmovn_s16(a), vqmovn_s16(c));
      vst1q_s8(q + 32 * b + 16 * h, vmaxq_s8(p, vdupq_n_s8(-127)));
    }
  }
  if (sums)
    for (int g = 0; g < K / group; ++g) {
      float s = 0.0f;
      for (int i = 0; i < group; ++i) s += x[g * group + i];
      sums[g] = s;
    }
}

/* 16 products of signed bytes, summed by fours: lane i = a[4i..4i+3] . b[4i..4i+3] (AVX2's vpmaddubsw + vpmaddwd
 * lanes), exact (|a|, |b| <= 127; the int16 pairs stay below 2^15). */
static inline int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) {
#ifdef __ARM_FEATURE_DOTPROD
  return vdotq_s32(acc, a, b);
#else
  const int32x4_t lo = vpaddlq_s16(vmull_s8(vget_low_s8(a), vget_low_s8(b)));   /* pairs of products 0-7 */
  const int32x4_t hi = vpaddlq_s16(vmull_high_s8(a, b));                        /* pairs of products 8-15 */
  return vaddq_s32(acc, vpaddq_s32(lo, hi));
#endif
}

/* ---------------------------------------------------------------------------------------------------------------
 * int8 weights [N, K], one bf16 scale per output channel: y[m, n] = scale[n] * sum_b d[m, b] * sum_{k in b} xq * w. */

static inline float bf16_value(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* One block of 32 in AVX2's eight lanes: lane i sums products 4i..4i+3. */
static inline f8 q8_dot32(const int8_t* x, int8x16_t w0, int8x16_t w1) {
  const int32x4_t z = vdupq_n_s32(0);
  return f8_cvt(dot16(z, w0, vld1q_s8(x)), dot16(z, w1, vld1q_s8(x + 16)));
}

#define Q8_TILE(R, C)                                                                                              \
  static void q8_tile_##R##_##C(const int8_t* xq, const uint8_t* aq, const float* d, int K, const int8_t* w,     \
                                const uint16_t* s, float* y, int N) {                                            \
    (void)aq;                                                                                                    \
    f8 acc[R * C];                                                                                               \
    for (int i = 0; i < R * C; ++i) acc[i] = f8_zero();                                                          \
    const int nb = K / 32;                                                                                       \
    for (int b = 0; b < nb; ++b) {                                                                               \
      int8x16_t w0[C], w1[C];                                                                                    \
      for (int c = 0; c < C; ++c) {                                                                              \
        w0[c] = vld1q_s8(w + (long)c * K + 32 * b);                                                              \
        w1[c] = vld1q_s8(w + (long)c * K + 32 * b + 16);                                                         \
      }                                                                                                          \
      if (!(b & 1))                                                                                              \
        for (int c = 0; c < C; ++c) __builtin_prefetch(w + (long)(C + c) * K + 32 * b + 64);                     \
      for (int r = 0; r < R; ++r) {                                                                              \
        const float32x4_t dv = vdupq_n_f32(d[(long)r * nb + b]);                                                 \
        for (int c = 0; c < C; ++c)                                                                              \
          acc[r * C + c] = f8_fma1(acc[r * C + c], q8_dot32(xq + (long)r * K + 32 * b, w0[c], w1[c]), dv);       \
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
 * The accurate int8 path: activations to q16, int16 codes in blocks of 32 (|code| <= 32767) with one fp32 scale per
 * block, scale = max|x| / 32767 (kernels_avx2.c's q16_row). The weights are widened to int16 once per tile (sxtl,
 * shared by its rows) and multiplied with smull/smlal into int32: each lane sums 4 products of at most
 * 32767 * 127, below 2^24, so the block's lanes are exact in int32 and in their conversion to fp32. */
static void q16_row(const float* x, int K, int16_t* q, float* d) {
  for (int b = 0; b < K / 32; ++b) {
    const float* xb = x + 32 * b;
    const float mx = block_max(xb);
    d[b] = mx / 32767.0f;
    const float32x4_t inv = vdupq_n_f32(code_step(32767.0f, mx));
    for (int i = 0; i < 32; i += 8) {
      const int16x8_t p = vcombine_s16(vqmovn_s32(round4(xb + i, inv)), vqmovn_s32(round4(xb + i + 4, inv)));
      vst1q_s16(q + 32 * b + i, vmaxq_s16(p, vdupq_n_s16(-32767)));
    }
  }
}

/* One block of 32: int16 activations x, weights widened to int16 in w[0..3] (values 0-7, 8-15, 16-23, 24-31).
 * AVX2's lanes (vpmaddwd on values 0-15 plus vpmaddwd on 16-31): lane i (0-7) sums the products 2i, 2i+1, 16+2i,
 * 17+2i. Here values 0-7 with 16-23 make lanes 0-3, values 8-15 with 24-31 lanes 4-7. */
static inline f8 q16_dot32(const int16_t* x, const int16x8_t* w) {
  const int16x8_t x0 = vld1q_s16(x), x1 = vld1q_s16(x + 8), x2 = vld1q_s16(x + 16), x3 = vld1q_s16(x + 24);
  const int32x4_t a = vmlal_s16(vmull_s16(vget_low_s16(w[0]), vget_low_s16(x0)), vget_low_s16(w[2]), vget_low_s16(x2));
  const int32x4_t b = vmlal_high_s16(vmull_high_s16(w[0], x0), w[2], x2);
  const int32x4_t c = vmlal_s16(vmull_s16(vget_low_s16(w[1]), vget_low_s16(x1)), vget_low_s16(w[3]), vget_low_s16(x3));
  const int32x4_t e = vmlal_high_s16(vmull_high_s16(w[1], x1), w[3], x3);
  return f8_cvt(vpaddq_s32(a, b), vpaddq_s32(c, e));
}

#define Q16_TILE(R, C)                                                                                             \
  static void q16_tile_##R##_##C(const int16_t* xq, const float* d, int K, const int8_t* w, const uint16_t* s,    \
                                 float* y, int N) {                                                              \
    f8 acc[R * C];                                                                                               \
    for (int i = 0; i < R * C; ++i) acc[i] = f8_zero();                                                          \
    const int nb = K / 32;                                                                                       \
    for (int b = 0; b < nb; ++b) {                                                                               \
      int16x8_t wv[C][4];                                                                                        \
      for (int c = 0; c < C; ++c) {                                                                              \
        const int8x16_t lo = vld1q_s8(w + (long)c * K + 32 * b), hi = vld1q_s8(w + (long)c * K + 32 * b + 16);  \
        wv[c][0] = vmovl_s8(vget_low_s8(lo));                                                                    \
        wv[c][1] = vmovl_high_s8(lo);                                                                            \
        wv[c][2] = vmovl_s8(vget_low_s8(hi));                                                                    \
        wv[c][3] = vmovl_high_s8(hi);                                                                            \
      }                                                                                                          \
      if (!(b & 1))                                                                                              \
        for (int c = 0; c < C; ++c) __builtin_prefetch(w + (long)(C + c) * K + 32 * b + 64);                     \
      for (int r = 0; r < R; ++r) {                                                                              \
        const float32x4_t dv = vdupq_n_f32(d[(long)r * nb + b]);                                                 \
        for (int c = 0; c < C; ++c)                                                                              \
          acc[r * C + c] = f8_fma1(acc[r * C + c], q16_dot32(xq + (long)r * K + 32 * b, wv[c]), dv);             \
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

/* The fp32 alternative: each code widened to fp32, one fused multiply-add per weight and row (8 columns at a time,
 * rows one by one), lane j taking k = j mod 8 as in kernels_avx2.c. For comparison. */
int m31r_int8_mm_f32(int M, int N, int K, const float* x, const int8_t* w, const uint16_t* scale, float* y) {
  if (M < 1 || K % 32 || N % BLOCK) return 1;
#pragma omp parallel for schedule(dynamic, 16)
  for (int b = 0; b < N / BLOCK; ++b) {
    const long n0 = (long)b * BLOCK;
    for (int m = 0; m < M; m += 2) {
      const int R = M - m < 2 ? 1 : 2;
      for (int c = 0; c < BLOCK; c += 4) {
        f8 acc[2][4];
        for (int r = 0; r < 2; ++r)
          for (int i = 0; i < 4; ++i) acc[r][i] = f8_zero();
        for (int k = 0; k < K; k += 8) {
          f8 wv[4];
          for (int i = 0; i < 4; ++i) {
            const int16x8_t w16 = vmovl_s8(vld1_s8(w + (n0 + c + i) * K + k));
            wv[i] = f8_cvt(vmovl_s16(vget_low_s16(w16)), vmovl_high_s16(w16));
          }
          for (int r = 0; r < R; ++r) {
            const f8 xv = f8_load(x + (long)(m + r) * K + k);
            for (int i = 0; i < 4; ++i) acc[r][i] = f8_fma(acc[r][i], xv, wv[i]);
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

/* 16 bytes → 32 codes 0..15 as signed bytes: the 16 low nibbles (even columns), then the 16 high (odd). */
static inline void nibbles32(const uint8_t* p, int8x16_t* lo, int8x16_t* hi) {
  const uint8x16_t b = vld1q_u8(p);
  *lo = vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8(15)));
  *hi = vreinterpretq_s8_u8(vshrq_n_u8(b, 4));
}

#define I4_TILE(R, C)                                                                                              \
  static void i4_tile_##R##_##C(const int8_t* xq, const float* d, const float* xs, int K, int G, const uint8_t* w, \
                                const float* sc, const float* base, float* y, int N) {                           \
    f8 acc[R * C];                                                                                               \
    for (int i = 0; i < R * C; ++i) acc[i] = f8_zero();                                                          \
    const int nb = K / 32, ng = K / G, per = G / 32;                                                             \
    for (int g = 0; g < ng; ++g) {                                                                               \
      f8 part[R * C];                                                                                            \
      for (int i = 0; i < R * C; ++i) part[i] = f8_zero();                                                       \
      for (int b = g * per; b < (g + 1) * per; ++b) {                                                            \
        int8x16_t lo[C], hi[C];                                                                                  \
        for (int c = 0; c < C; ++c) nibbles32(w + (long)c * (K / 2) + 16 * b, &lo[c], &hi[c]);                   \
        if (!(b & 3))                                                                                            \
          for (int c = 0; c < C; ++c) __builtin_prefetch(w + (long)(C + c) * (K / 2) + 16 * b + 64);             \
        for (int r = 0; r < R; ++r) {                                                                            \
          const float32x4_t dv = vdupq_n_f32(d[(long)r * nb + b]);                                               \
          for (int c = 0; c < C; ++c)                                                                            \
            part[r * C + c] = f8_fma1(part[r * C + c], q8_dot32(xq + (long)r * K + 32 * b, lo[c], hi[c]), dv);   \
        }                                                                                                        \
      }                                                                                                          \
      for (int c = 0; c < C; ++c) {                                                                              \
        const float32x4_t sv = vdupq_n_f32(sc[(long)c * ng + g]);                                                \
        for (int r = 0; r < R; ++r) acc[r * C + c] = f8_fma1(acc[r * C + c], part[r * C + c], sv);               \
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
 * fp32 weights [N, K] (torch's Linear layout), fp32 activations: y[m, n] = sum_k x[m, k] * w[n, k], as
 * kernels_avx2.c's f32 tiles (m31r_f32_mm in kernels_layer.h runs either): each (row, column) one accumulator of 8
 * lanes walking k in steps of 8 with fused multiply-adds, folded by hsum8, whatever the tile, row or thread count. */
#define F32_TILE(R, C)                                                                                             \
  static void f32_tile_##R##_##C(const float* x, int K, const float* w, float* y, int N) {                         \
    f8 acc[R * C];                                                                                               \
    for (int i = 0; i < R * C; ++i) acc[i] = f8_zero();                                                          \
    for (int k = 0; k < K; k += 8) {                                                                             \
      f8 wv[C];                                                                                                  \
      for (int c = 0; c < C; ++c) wv[c] = f8_load(w + (long)c * K + k);                                          \
      if (!(k & 15))                                                                                             \
        for (int c = 0; c < C; ++c) __builtin_prefetch(w + (long)(C + c) * K + k + 16);                          \
      for (int r = 0; r < R; ++r) {                                                                              \
        const f8 xv = f8_load(x + (long)r * K + k);                                                              \
        for (int c = 0; c < C; ++c) acc[r * C + c] = f8_fma(acc[r * C + c], xv, wv[c]);                          \
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

/* Rotate-half RoPE of one head, as kernels_avx2.c's rope_head: x * cos, then roll(x, hd/2) * sin fused into it. */
static inline void rope_head(const float* x, const float* cos, const float* sin, int hd, float* out) {
  const int half = hd / 2;
  for (int i = 0; i < hd; i += 4) {
    const int j = i < half ? i + half : i - half;
    const float32x4_t xc = vmulq_f32(vld1q_f32(x + i), vld1q_f32(cos + i));
    vst1q_f32(out + i, vfmaq_f32(xc, vld1q_f32(x + j), vld1q_f32(sin + i)));
  }
}

/* kernels_avx2.c's m31r_add_rmsnorm_f32: x += delta (delta may be NULL), then out = w * (x / sqrt(mean(x^2) + eps)),
 * the squares summed in 8 lanes over d in order and folded by hsum8. */
int m31r_add_rmsnorm_f32(int rows, int d, float* x, const float* delta, const float* w, float eps, float* out) {
  if (d < 8 || d % 8) return 1;
  for (int r = 0; r < rows; ++r) {
    float* xr = x + (long)r * d;
    f8 ss = f8_zero();
    for (int k = 0; k < d; k += 8) {
      f8 v = f8_load(xr + k);
      if (delta) {
        const f8 e = f8_load(delta + (long)r * d + k);
        v = (f8){vaddq_f32(v.lo, e.lo), vaddq_f32(v.hi, e.hi)};
        vst1q_f32(xr + k, v.lo);
        vst1q_f32(xr + k + 4, v.hi);
      }
      ss = f8_fma(ss, v, v);
    }
    const float32x4_t inv = vdupq_n_f32(1.0f / sqrtf(hsum8(ss) / (float)d + eps));
    for (int k = 0; k < d; k += 4)
      vst1q_f32(out + (long)r * d + k, vmulq_f32(vld1q_f32(w + k), vmulq_f32(vld1q_f32(xr + k), inv)));
  }
  return 0;
}

/* kernels_avx2.c's m31r_swiglu_f32: out = silu(gate) * up from e^-|gate|, picking by the sign bit as blendv does. */
int m31r_swiglu_f32(int rows, int h, const float* gu, float* out) {
  if (h < 8 || h % 8) return 1;
  const float32x4_t one = vdupq_n_f32(1.0f);
  for (int r = 0; r < rows; ++r)
    for (int k = 0; k < h; k += 4) {
      const float32x4_t g = vld1q_f32(gu + 2L * r * h + k);
      const float32x4_t t = exp_nonpositive(vnegq_f32(vabsq_f32(g)));
      const uint32x4_t neg = vreinterpretq_u32_s32(vshrq_n_s32(vreinterpretq_s32_f32(g), 31));
      const float32x4_t num = vbslq_f32(neg, vmulq_f32(g, t), g);
      const float32x4_t silu = vdivq_f32(num, vaddq_f32(one, t));
      vst1q_f32(out + (long)r * h + k, vmulq_f32(silu, vld1q_f32(gu + 2L * r * h + h + k)));
    }
  return 0;
}

/* Decode attention on the wqkv projection and one decoder layer in one call: the same code for both fp32 families. */
#include "kernels_layer.h"
