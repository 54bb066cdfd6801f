/* A test driver for the fp32 kernel families (m31r/kernels_avx2.c, m31r/kernels_neon.c): it calls their exported
 * functions on arrays read from files and writes the results to files, so that tests/test_native_neon.py can run
 * the same calls on a build for this machine and on cross-compiled Arm builds under qemu-user, where ctypes cannot
 * reach.
 *
 * Commands come on stdin, one a line (the arrays are raw little-endian files of exactly the size the shapes imply);
 * each prints one line, "rc N" with the kernel's return value, or "error ..." for a malformed line or file:
 *   variant                                                  prints "dotprod 1", "dotprod 0" (NEON), "dotprod -1"
 *   int8 MODE M N K x w scale y                              MODE q16, q8 or f32; x fp32 [M,K], w int8 [N,K],
 *                                                            scale bf16 [N]; writes y fp32 [M,N]
 *   int4 M N K G x w scale base y                            w uint8 [N,K/2], scale/base fp32 [N,K/G]
 *   attend ROWS HEADS KV HD SCALE q knew vnew k v cap len out kout vout
 *        SCALE a C float (hex is exact); k/v all rows' caches one after the other, row r [KV, cap[r], HD]; cap/len
 *        int32 [ROWS]; writes out [ROWS, HEADS, HD] and the caches as the call left them to kout/vout.
 *   f32mm M N K x w y                                        x fp32 [M,K], w fp32 [N,K]; writes y fp32 [M,N]
 *   qkv ROWS HEADS KV HD SCALE qkv cos sin k v cap len out kout vout [lead shared]
 *        attend on the projection: qkv [ROWS, (HEADS + 2 KV) * HD], cos/sin [ROWS, HD]; the rest as attend;
 *        lead/shared int32 [ROWS]: row r reads positions [0, shared[r]) from row lead[r]'s cache
 *   qkv16 ROWS HEADS KV HD SCALE qkv cos sin k v cap len out kout vout
 *        qkv over fp16 caches (k, v and kout, vout: fp16 values, 2 bytes each)
 *   layer ROWS N D HEADS KV HD FFN KIND G KV16 EPS1 EPS2 x h cos sin k v cap len norm1 norm2 (w s b) x 4 xout hout kout vout
 *        m31r_decode_layer_f32 with all four matrices (wqkv, wo, w13, w2) of one KIND (0 fp32, 1-3 int8 q16/q8/f32,
 *        4 int4 in groups of G): s and b "-" where the kind has none; caches fp16 where KV16, else fp32
 *   norm ROWS D EPS x delta w out xout                       delta "-" for none; writes out and x as left [ROWS, D]
 *   swiglu ROWS H gu out                                     gu [ROWS, 2H]; writes out [ROWS, H]
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int m31r_attend_decode_f32(int rows, int heads, int kv_heads, int hd, const float* q, const float* knew,
                           const float* vnew, const int64_t* kptr, const int64_t* vptr, const int32_t* cap,
                           const int32_t* len, const int32_t* lead, const int32_t* shared, float scale, float* out);
int m31r_int8_mm_q16(int M, int N, int K, const float* x, const int8_t* w, const uint16_t* scale, float* y);
int m31r_int8_mm_q8(int M, int N, int K, const float* x, const int8_t* w, const uint16_t* scale, float* y);
int m31r_int8_mm_f32(int M, int N, int K, const float* x, const int8_t* w, const uint16_t* scale, float* y);
int m31r_int4_mm_q8(int M, int N, int K, int G, const float* x, const uint8_t* w, const float* scale,
                    const float* base, float* y);
int m31r_f32_mm(int M, int N, int K, const float* x, const float* w, float* y);
int m31r_attend_qkv_f32(int rows, int heads, int kv_heads, int hd, const float* qkv, const float* cos,
                        const float* sin, const int64_t* kptr, const int64_t* vptr, const int32_t* cap,
                        const int32_t* len, const int32_t* lead, const int32_t* shared, float scale, float* out);
int m31r_attend_qkv_f32_kv16(int rows, int heads, int kv_heads, int hd, const float* qkv, const float* cos,
                             const float* sin, const int64_t* kptr, const int64_t* vptr, const int32_t* cap,
                             const int32_t* len, const int32_t* lead, const int32_t* shared, float scale, float* out);
int m31r_add_rmsnorm_f32(int rows, int d, float* x, const float* delta, const float* w, float eps, float* out);
int m31r_swiglu_f32(int rows, int h, const float* gu, float* out);
typedef struct {
  int32_t kind, n, k, group;
  int64_t w, scale, base;
} m31r_mat;
int m31r_decode_layer_f32(int rows, int n, int d, int heads, int kv_heads, int hd, int ffn, const m31r_mat* mats,
                          const float* ffn_norm, float ffn_eps, const float* next_norm, float next_eps, float* x,
                          float* h, const float* cos, const float* sin, const int64_t* kptr, const int64_t* vptr,
                          const int32_t* cap, const int32_t* len, const int32_t* lead, const int32_t* shared,
                          float scale, int kv16, float* scratch);
int m31r_neon_dotprod(void) __attribute__((weak)); /* the NEON family's only */

#define MAX_ARGS 48

/* The whole file, which must hold exactly `size` bytes; NULL (and a message on stdout) otherwise. */
static void* slurp(const char* path, long size) {
  FILE* f = fopen(path, "rb");
  if (!f) {
    printf("error cannot open %s\n", path);
    return NULL;
  }
  void* buf = malloc(size > 0 ? size : 1);
  long got = buf ? (long)fread(buf, 1, size, f) : -1;
  int extra = fgetc(f) != EOF;
  fclose(f);
  if (got != size || extra) {
    printf("error %s does not hold %ld bytes\n", path, size);
    free(buf);
    return NULL;
  }
  return buf;
}

static int spill(const char* path, const void* buf, long size) {
  FILE* f = fopen(path, "wb");
  int ok = f && (long)fwrite(buf, 1, size, f) == size;
  if (f) ok = (fclose(f) == 0) && ok;
  if (!ok) printf("error cannot write %s\n", path);
  return ok;
}

static void int8_cmd(char** a, int n) {
  if (n != 9) {
    printf("error int8 takes 8 arguments\n");
    return;
  }
  const int M = atoi(a[2]), N = atoi(a[3]), K = atoi(a[4]);
  int (*fn)(int, int, int, const float*, const int8_t*, const uint16_t*, float*) =
      !strcmp(a[1], "q16") ? m31r_int8_mm_q16 : !strcmp(a[1], "q8") ? m31r_int8_mm_q8
                                              : !strcmp(a[1], "f32") ? m31r_int8_mm_f32 : NULL;
  if (!fn) {
    printf("error no int8 mode %s\n", a[1]);
    return;
  }
  float* x = slurp(a[5], 4L * M * K);
  int8_t* w = x ? slurp(a[6], (long)N * K) : NULL;
  uint16_t* s = w ? slurp(a[7], 2L * N) : NULL;
  float* y = calloc((size_t)M * N + 1, 4);
  if (s) {
    int rc = fn(M, N, K, x, w, s, y);
    if (spill(a[8], y, 4L * M * N)) printf("rc %d\n", rc);
  }
  free(x), free(w), free(s), free(y);
}

static void int4_cmd(char** a, int n) {
  if (n != 10) {
    printf("error int4 takes 9 arguments\n");
    return;
  }
  const int M = atoi(a[1]), N = atoi(a[2]), K = atoi(a[3]), G = atoi(a[4]);
  const long groups = G > 0 ? (long)N * (K / G) : 0;
  float* x = slurp(a[5], 4L * M * K);
  uint8_t* w = x ? slurp(a[6], (long)N * (K / 2)) : NULL;
  float* s = w ? slurp(a[7], 4 * groups) : NULL;
  float* b = s ? slurp(a[8], 4 * groups) : NULL;
  float* y = calloc((size_t)M * N + 1, 4);
  if (b) {
    int rc = m31r_int4_mm_q8(M, N, K, G, x, w, s, b, y);
    if (spill(a[9], y, 4L * M * N)) printf("rc %d\n", rc);
  }
  free(x), free(w), free(s), free(b), free(y);
}

/* Each row's k and v cache, laid out one after another in k and v: their addresses, as DecodeTable passes them. */
static void cache_pointers(int rows, int kv, int hd, const int32_t* cap, void* k, void* v, int size, int64_t* kp,
                           int64_t* vp) {
  long at = 0;
  for (int r = 0; r < rows; ++r) {
    kp[r] = (int64_t)(intptr_t)((char*)k + at * size);
    vp[r] = (int64_t)(intptr_t)((char*)v + at * size);
    at += (long)kv * cap[r] * hd;
  }
}

static void attend_cmd(char** a, int n) {
  if (n != 16) {
    printf("error attend takes 15 arguments\n");
    return;
  }
  const int rows = atoi(a[1]), heads = atoi(a[2]), kv = atoi(a[3]), hd = atoi(a[4]);
  const float scale = strtof(a[5], NULL);
  int32_t* cap = slurp(a[11], 4L * rows);
  int32_t* len = cap ? slurp(a[12], 4L * rows) : NULL;
  int32_t* lead = len && n == 18 ? slurp(a[16], 4L * rows) : NULL;
  int32_t* shared = lead ? slurp(a[17], 4L * rows) : NULL;
  if (!len || (n == 18 && !shared)) {
    free(cap), free(len), free(lead), free(shared);
    return;
  }
  long total = 0;
  for (int r = 0; r < rows; ++r) total += (long)kv * cap[r] * hd;
  float* q = slurp(a[6], 4L * rows * heads * hd);
  float* kn = q ? slurp(a[7], 4L * rows * kv * hd) : NULL;
  float* vn = kn ? slurp(a[8], 4L * rows * kv * hd) : NULL;
  float* k = vn ? slurp(a[9], 4 * total) : NULL;
  float* v = k ? slurp(a[10], 4 * total) : NULL;
  float* out = calloc((size_t)rows * heads * hd + 1, 4);
  int64_t* kp = calloc(rows + 1, 8);
  int64_t* vp = calloc(rows + 1, 8);
  if (v) {
    cache_pointers(rows, kv, hd, cap, k, v, 4, kp, vp);
    int rc = m31r_attend_decode_f32(rows, heads, kv, hd, q, kn, vn, kp, vp, cap, len, NULL, NULL, scale, out);
    if (spill(a[13], out, 4L * rows * heads * hd) && spill(a[14], k, 4 * total) && spill(a[15], v, 4 * total))
      printf("rc %d\n", rc);
  }
  free(cap), free(len), free(q), free(kn), free(vn), free(k), free(v), free(out), free(kp), free(vp);
}

static void f32mm_cmd(char** a, int n) {
  if (n != 7) {
    printf("error f32mm takes 6 arguments\n");
    return;
  }
  const int M = atoi(a[1]), N = atoi(a[2]), K = atoi(a[3]);
  float* x = slurp(a[4], 4L * M * K);
  float* w = x ? slurp(a[5], 4L * N * K) : NULL;
  float* y = calloc((size_t)M * N + 1, 4);
  if (w) {
    int rc = m31r_f32_mm(M, N, K, x, w, y);
    if (spill(a[6], y, 4L * M * N)) printf("rc %d\n", rc);
  }
  free(x), free(w), free(y);
}

static void qkv_cmd(char** a, int n, int half) {
  if (n != 16 && n != 18) {
    printf("error qkv%s takes 15 or 17 arguments\n", half ? "16" : "");
    return;
  }
  const int rows = atoi(a[1]), heads = atoi(a[2]), kv = atoi(a[3]), hd = atoi(a[4]);
  const float scale = strtof(a[5], NULL);
  int32_t* cap = slurp(a[11], 4L * rows);
  int32_t* len = cap ? slurp(a[12], 4L * rows) : NULL;
  int32_t* lead = len && n == 18 ? slurp(a[16], 4L * rows) : NULL;
  int32_t* shared = lead ? slurp(a[17], 4L * rows) : NULL;
  if (!len || (n == 18 && !shared)) {
    free(cap), free(len), free(lead), free(shared);
    return;
  }
  long total = 0;
  for (int r = 0; r < rows; ++r) total += (long)kv * cap[r] * hd;
  float* qkv = slurp(a[6], 4L * rows * (heads + 2 * kv) * hd);
  float* cos = qkv ? slurp(a[7], 4L * rows * hd) : NULL;
  float* sin = cos ? slurp(a[8], 4L * rows * hd) : NULL;
  const int size = half ? 2 : 4; /* bytes per cached value */
  void* k = sin ? slurp(a[9], size * total) : NULL;
  void* v = k ? slurp(a[10], size * total) : NULL;
  float* out = calloc((size_t)rows * heads * hd + 1, 4);
  int64_t* kp = calloc(rows + 1, 8);
  int64_t* vp = calloc(rows + 1, 8);
  if (v) {
    cache_pointers(rows, kv, hd, cap, k, v, size, kp, vp);
    int rc = (half ? m31r_attend_qkv_f32_kv16 : m31r_attend_qkv_f32)(rows, heads, kv, hd, qkv, cos, sin, kp, vp, cap,
                                                                      len, lead, shared, scale, out);
    if (spill(a[13], out, 4L * rows * heads * hd) && spill(a[14], k, size * total) && spill(a[15], v, size * total))
      printf("rc %d\n", rc);
  }
  free(cap), free(len), free(lead), free(shared), free(qkv), free(cos), free(sin), free(k), free(v), free(out),
      free(kp), free(vp);
}

static void layer_cmd(char** a, int n) {
  if (n != 39) {
    printf("error layer takes 38 arguments\n");
    return;
  }
  const int rows = atoi(a[1]), nr = atoi(a[2]), d = atoi(a[3]), heads = atoi(a[4]), kv = atoi(a[5]), hd = atoi(a[6]);
  const int ffn = atoi(a[7]), kind = atoi(a[8]), g = atoi(a[9]), kv16 = atoi(a[10]);
  const float eps1 = strtof(a[11], NULL), eps2 = strtof(a[12], NULL);
  const int size = kv16 ? 2 : 4;
  int32_t* cap = slurp(a[19], 4L * nr);
  int32_t* len = cap ? slurp(a[20], 4L * nr) : NULL;
  long total = 0;
  for (int r = 0; len && r < nr; ++r) total += (long)kv * cap[r] * hd;
  float* x = len ? slurp(a[13], 4L * rows * d) : NULL;
  float* h = x ? slurp(a[14], 4L * rows * d) : NULL;
  float* cos = h ? slurp(a[15], 4L * nr * hd) : NULL;
  float* sin = cos ? slurp(a[16], 4L * nr * hd) : NULL;
  void* k = sin ? slurp(a[17], size * total) : NULL;
  void* v = k ? slurp(a[18], size * total) : NULL;
  float* n1 = v ? slurp(a[21], 4L * d) : NULL;
  float* n2 = n1 ? slurp(a[22], 4L * d) : NULL;
  const int shapes[4][2] = {{(heads + 2 * kv) * hd, d}, {d, heads * hd}, {2 * ffn, d}, {d, ffn}};
  m31r_mat mats[4];
  void* bufs[12] = {0};
  int ok = n2 != NULL;
  for (int i = 0; i < 4 && ok; ++i) {
    const long N = shapes[i][0], K = shapes[i][1], groups = g > 0 ? N * (K / g) : 0;
    const long wb = kind == 0 ? 4 * N * K : kind == 4 ? N * K / 2 : N * K;
    const long sb = kind == 0 ? 0 : kind == 4 ? 4 * groups : 2 * N;
    bufs[3 * i] = slurp(a[23 + 3 * i], wb);
    if (sb) bufs[3 * i + 1] = bufs[3 * i] ? slurp(a[24 + 3 * i], sb) : NULL;
    if (kind == 4) bufs[3 * i + 2] = bufs[3 * i + 1] ? slurp(a[25 + 3 * i], sb) : NULL;
    ok = bufs[3 * i] && (!sb || bufs[3 * i + 1]) && (kind != 4 || bufs[3 * i + 2]);
    mats[i] = (m31r_mat){kind, (int32_t)N, (int32_t)K, g, (int64_t)(intptr_t)bufs[3 * i],
                         (int64_t)(intptr_t)bufs[3 * i + 1], (int64_t)(intptr_t)bufs[3 * i + 2]};
  }
  int64_t* kp = calloc(nr + 1, 8);
  int64_t* vp = calloc(nr + 1, 8);
  float* scratch = calloc((size_t)rows * ((heads + 2 * kv) * hd + heads * hd + 2 * d + 3 * ffn) + 1, 4);
  if (ok) {
    cache_pointers(nr, kv, hd, cap, k, v, size, kp, vp);
    int rc = m31r_decode_layer_f32(rows, nr, d, heads, kv, hd, ffn, mats, n1, eps1, n2, eps2, x, h, cos, sin, kp, vp,
                                   cap, len, NULL, NULL, 1.0f / sqrtf((float)hd), kv16, scratch);
    if (spill(a[35], x, 4L * rows * d) && spill(a[36], h, 4L * rows * d) && spill(a[37], k, size * total) &&
        spill(a[38], v, size * total))
      printf("rc %d\n", rc);
  }
  for (int i = 0; i < 12; ++i) free(bufs[i]);
  free(cap), free(len), free(x), free(h), free(cos), free(sin), free(k), free(v), free(n1), free(n2), free(kp),
      free(vp), free(scratch);
}

static void norm_cmd(char** a, int n) {
  if (n != 9) {
    printf("error norm takes 8 arguments\n");
    return;
  }
  const int rows = atoi(a[1]), d = atoi(a[2]);
  const float eps = strtof(a[3], NULL);
  const int has_delta = strcmp(a[5], "-") != 0;
  float* x = slurp(a[4], 4L * rows * d);
  float* delta = x && has_delta ? slurp(a[5], 4L * rows * d) : NULL;
  float* w = x && (delta || !has_delta) ? slurp(a[6], 4L * d) : NULL;
  float* out = calloc((size_t)rows * d + 1, 4);
  if (w) {
    int rc = m31r_add_rmsnorm_f32(rows, d, x, delta, w, eps, out);
    if (spill(a[7], out, 4L * rows * d) && spill(a[8], x, 4L * rows * d)) printf("rc %d\n", rc);
  }
  free(x), free(delta), free(w), free(out);
}

static void swiglu_cmd(char** a, int n) {
  if (n != 5) {
    printf("error swiglu takes 4 arguments\n");
    return;
  }
  const int rows = atoi(a[1]), h = atoi(a[2]);
  float* gu = slurp(a[3], 8L * rows * h);
  float* out = calloc((size_t)rows * h + 1, 4);
  if (gu) {
    int rc = m31r_swiglu_f32(rows, h, gu, out);
    if (spill(a[4], out, 4L * rows * h)) printf("rc %d\n", rc);
  }
  free(gu), free(out);
}

int main(void) {
  char line[8192];
  while (fgets(line, sizeof line, stdin)) {
    char* a[MAX_ARGS];
    int n = 0;
    for (char* t = strtok(line, " \t\r\n"); t && n < MAX_ARGS; t = strtok(NULL, " \t\r\n")) a[n++] = t;
    if (n == 0) continue;
    if (!strcmp(a[0], "variant"))
      printf("dotprod %d\n", m31r_neon_dotprod ? m31r_neon_dotprod() : -1);
    else if (!strcmp(a[0], "int8"))
      int8_cmd(a, n);
    else if (!strcmp(a[0], "int4"))
      int4_cmd(a, n);
    else if (!strcmp(a[0], "attend"))
      attend_cmd(a, n);
    else if (!strcmp(a[0], "f32mm"))
      f32mm_cmd(a, n);
    else if (!strcmp(a[0], "qkv"))
      qkv_cmd(a, n, 0);
    else if (!strcmp(a[0], "qkv16"))
      qkv_cmd(a, n, 1);
    else if (!strcmp(a[0], "layer"))
      layer_cmd(a, n);
    else if (!strcmp(a[0], "norm"))
      norm_cmd(a, n);
    else if (!strcmp(a[0], "swiglu"))
      swiglu_cmd(a, n);
    else
      printf("error unknown command %s\n", a[0]);
    fflush(stdout);
  }
  return 0;
}
