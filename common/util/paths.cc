#include "common/util/paths.h"

#include <sys/stat.h>

#include <cstdlib>

namespace specserve {

std::string ResolveUserPath(const std::string& path) {
  if (path.empty() || path[0] == '/') return path;
  const char* wd = std::getenv("BUILD_WORKING_DIRECTORY");
  if (wd == nullptr) return path;
  std::string joined = std::string(wd) + "/" + path;
  struct stat st;
  if (stat(joined.c_str(), &st) == 0) return joined;
  return path;
}

}  // namespace specserve
