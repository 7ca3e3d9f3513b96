#include "common/util/parse.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/strings/ascii.h"

namespace specserve {

absl::StatusOr<std::vector<int>> ParseIntList(absl::string_view text,
                                              absl::string_view field) {
  std::vector<int> out;
  if (absl::StripAsciiWhitespace(text).empty()) return out;
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    int v;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(item), &v)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": '", item, "' is not an integer"));
    }
    out.push_back(v);
  }
  return out;
}

}  // namespace specserve
