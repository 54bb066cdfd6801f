/* The row checks every family's decode attention makes before it touches a cache (kernels.c's m31r_attend_decode,
 * kernels_layer.h's m31r_attend_decode_f32 and attend_qkv), so that all of them refuse the same bad rows. The
 * including source defines MAX_KEYS. */

/* Whether every row's context fits its cache and, given lead/shared, reads a shared prefix that is neither past its
 * own new position nor past what its lead row's cache holds. */
static int rows_ok(int rows, const int32_t* cap, const int32_t* len, const int32_t* lead, const int32_t* shared) {
  for (int r = 0; r < rows; ++r) {
    if (len[r] < 1 || len[r] > cap[r] || len[r] > MAX_KEYS) return 0;
    if (lead && shared && (lead[r] < 0 || lead[r] >= rows || shared[r] < 0 || shared[r] >= len[r] ||
                           shared[r] > len[lead[r]]))
      return 0;
  }
  return 1;
}
