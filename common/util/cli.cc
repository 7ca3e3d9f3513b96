#include "common/util/cli.h"

#include <cstdio>

namespace specserve {

int ReportCliError(const absl::Status& status) {
  std::fprintf(stderr, "error: %s\n", status.ToString().c_str());
  const bool bad_input = status.code() == absl::StatusCode::kInvalidArgument ||
                         status.code() == absl::StatusCode::kNotFound;
  return bad_input ? 2 : 1;
}

}  // namespace specserve
