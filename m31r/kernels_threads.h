/* How many threads the kernels' parallel loops run on, so that Python can say whether a build is threaded: the
 * OpenMP runtime's team size, or 1 in a build without OpenMP. A build links no runtime of its own: on Linux libgomp
 * by soname, which is torch's loaded copy; on macOS torch's libomp, bound when the library loads (native.py). So
 * the figure follows torch.set_num_threads. Declared here rather than through omp.h, which Apple's clang lacks. */

#ifdef _OPENMP
int omp_get_max_threads(void);
#endif

int m31r_threads(void) {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}
