#ifndef SPECSERVE_COMMON_ENGINE_AVX2_RERUN_H_
#define SPECSERVE_COMMON_ENGINE_AVX2_RERUN_H_

#include <unistd.h>

#include <cstdlib>
#include <string>

namespace specserve {
namespace testing_util {

/// For tests of kernels dispatched once per process (AVX-512 or AVX2):
/// runs this test binary again with SPECSERVE_DISABLE_AVX512 set and
/// `gtest_filter`, so the same tests cover the AVX2 path. Returns the
/// child's exit status (0 = its tests passed), -1 if the binary's path is
/// unknown. Tests that call it should return early when
/// InAvx2Rerun() (the child) to avoid recursing.
inline int RerunWithoutAvx512(const std::string& gtest_filter) {
  char self[4096];
  const ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (len <= 0) return -1;
  self[len] = 0;
  setenv("SPECSERVE_DISABLE_AVX512", "1", 1);
  const int rc = std::system(
      (std::string(self) + " --gtest_filter='" + gtest_filter + "'").c_str());
  unsetenv("SPECSERVE_DISABLE_AVX512");
  return rc;
}

/// Whether this process is RerunWithoutAvx512's child.
inline bool InAvx2Rerun() {
  return std::getenv("SPECSERVE_DISABLE_AVX512") != nullptr;
}

}  // namespace testing_util
}  // namespace specserve

#endif  // SPECSERVE_COMMON_ENGINE_AVX2_RERUN_H_
