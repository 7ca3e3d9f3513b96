#ifndef SPECSERVE_COMMON_UTIL_PARSE_H_
#define SPECSERVE_COMMON_UTIL_PARSE_H_

#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"

namespace specserve {

/// Parses a comma-separated list of integers ("1,5,9"; spaces allowed;
/// empty string -> empty list). INVALID_ARGUMENT naming `field` and the
/// offending item otherwise.
absl::StatusOr<std::vector<int>> ParseIntList(absl::string_view text,
                                              absl::string_view field);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_UTIL_PARSE_H_
