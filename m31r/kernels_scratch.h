/* Per-thread heap scratch for decode attention's scores (kernels.c's m31r_attend_decode, kernels_layer.h's
 * m31r_attend_decode_f32 and attend_qkv): one fp32 score per context position, 256 KB a query at MAX_KEYS.
 *
 * Why not the stack: these were variable-length arrays on the running thread's stack (up to 512 KB for a prefill
 * chunk's pair of rows). The main thread has the stack limit (usually 8 MB), but an OpenMP worker has OMP_STACKSIZE
 * (unset: the system's thread default under libgomp, 4 MB under LLVM's libomp; users and other libraries set it
 * smaller), and a thread another runtime made has whatever that runtime gave it (macOS: 512 KB by default): a long
 * context then died of SIGSEGV (tests/test_native_edges.py and test_native_neon.py run one with OMP_STACKSIZE=128K).
 *
 * Why per thread and kept: a malloc per call (per layer and token) would map and fault in fresh pages each time at
 * long contexts. A thread's buffer instead grows on demand, in steps of SCRATCH_STEP floats, and stays for its next
 * call: once a thread has seen the longest context, a call costs a pthread_getspecific and a compare. It is freed
 * when its thread exits (the key's destructor); the library is never unloaded (ctypes does not dlclose), so that
 * destructor is always there to run. Which buffer holds a score never changes its bits.
 *
 * Allocation failure is the caller's return code 2 (the convention of kernels_layer.h's matmuls): native.py raises
 * MemoryError for it. */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define SCRATCH_STEP 4096 /* floats (16 KB): a growing context reallocates once per this many positions */
#define SCRATCH_HEAD 64   /* the buffer's capacity sits in its first cache line; the scores start on the next */

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static int scratch_ready;

static void scratch_init(void) { scratch_ready = pthread_key_create(&scratch_key, free) == 0; }

/* The calling thread's scratch of at least n floats (64-byte aligned, contents undefined), or NULL where memory (or
 * a thread-specific key) runs out; the thread's old buffer, if any, then stays as it was. */
static float* thread_scratch(size_t n) {
  if (pthread_once(&scratch_once, scratch_init) != 0 || !scratch_ready) return NULL;
  char* buf = (char*)pthread_getspecific(scratch_key);
  if (buf && *(size_t*)buf >= n) return (float*)(buf + SCRATCH_HEAD);
  const size_t cap = (n + SCRATCH_STEP - 1) / SCRATCH_STEP * SCRATCH_STEP;
  void* grown;
  if (cap < n || cap > ((size_t)-1 - SCRATCH_HEAD) / sizeof(float) ||
      posix_memalign(&grown, 64, SCRATCH_HEAD + cap * sizeof(float)) != 0)
    return NULL;
  if (pthread_setspecific(scratch_key, grown) != 0) {
    free(grown);
    return NULL;
  }
  free(buf); /* the scores are rewritten from scratch by every call: nothing to copy */
  *(size_t*)grown = cap;
  return (float*)((char*)grown + SCRATCH_HEAD);
}

/* The longest context among the rows (rows_ok has checked each is in [1, MAX_KEYS]). */
static int longest(int rows, const int32_t* len) {
  int n = 0;
  for (int r = 0; r < rows; ++r) n = len[r] > n ? len[r] : n;
  return n;
}
