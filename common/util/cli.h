#ifndef SPECSERVE_COMMON_UTIL_CLI_H_
#define SPECSERVE_COMMON_UTIL_CLI_H_

#include "absl/status/status.h"

namespace specserve {

/// Prints `status` to stderr as "error: ..." and returns the command-line
/// tools' exit code: 2 for bad input (INVALID_ARGUMENT, NOT_FOUND: a wrong
/// flag or path), 1 for anything else.
int ReportCliError(const absl::Status& status);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_UTIL_CLI_H_
