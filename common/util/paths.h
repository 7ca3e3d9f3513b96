#ifndef SPECSERVE_COMMON_UTIL_PATHS_H_
#define SPECSERVE_COMMON_UTIL_PATHS_H_

#include <string>

namespace specserve {

/// Resolves a path a user typed on the command line. `bazel run` starts
/// programs inside their runfiles tree and exports the caller's directory
/// as BUILD_WORKING_DIRECTORY: relative paths are taken against it when set
/// and the path does not already exist relative to the current directory.
std::string ResolveUserPath(const std::string& path);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_UTIL_PATHS_H_
