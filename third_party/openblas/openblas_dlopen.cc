// The OpenBLAS entry points the project calls, with cblas.h's exact C
// signatures, each forwarding to libopenblas.so.0 (Debian's
// libopenblas-dev alternative), which is dlopen'ed on first use instead of
// linked: see third_party/lazy_library.h for why. OpenBLAS reads
// OPENBLAS_CORETYPE when it loads, i.e. at the first call here.

#include <cblas.h>

#include <cstdio>
#include <cstdlib>

#include "third_party/lazy_library.h"

namespace {

// Resolves `symbol` or ends the process: BLAS calls have no error channel
// and OpenBLAS is a hard dependency (tools/install_deps.sh installs it).
template <typename Fn>
Fn Require(const char* symbol) {
  static void* const library = specserve::lazy_library::LoadFirst(
      {"libopenblas.so.0", "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"});
  Fn fn = specserve::lazy_library::Resolve<Fn>(library, symbol);
  if (fn == nullptr) {
    std::fprintf(stderr, "fatal: cannot load %s from libopenblas.so.0: %s\n",
                 symbol, library == nullptr ? dlerror() : "symbol missing");
    std::abort();
  }
  return fn;
}

}  // namespace

extern "C" {

void cblas_sgemm(OPENBLAS_CONST enum CBLAS_ORDER order,
                 OPENBLAS_CONST enum CBLAS_TRANSPOSE trans_a,
                 OPENBLAS_CONST enum CBLAS_TRANSPOSE trans_b,
                 OPENBLAS_CONST blasint m, OPENBLAS_CONST blasint n,
                 OPENBLAS_CONST blasint k, OPENBLAS_CONST float alpha,
                 OPENBLAS_CONST float* a, OPENBLAS_CONST blasint lda,
                 OPENBLAS_CONST float* b, OPENBLAS_CONST blasint ldb,
                 OPENBLAS_CONST float beta, float* c,
                 OPENBLAS_CONST blasint ldc) {
  using Fn = decltype(&cblas_sgemm);
  static const Fn fn = Require<Fn>("cblas_sgemm");
  fn(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void openblas_set_num_threads(int num_threads) {
  using Fn = decltype(&openblas_set_num_threads);
  static const Fn fn = Require<Fn>("openblas_set_num_threads");
  fn(num_threads);
}

char* openblas_get_corename(void) {
  using Fn = decltype(&openblas_get_corename);
  static const Fn fn = Require<Fn>("openblas_get_corename");
  return fn();
}

}  // extern "C"
