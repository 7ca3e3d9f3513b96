#include "router/api_key.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace specserve {

bool ConstantTimeEquals(absl::string_view got, absl::string_view want) {
  unsigned diff = got.size() == want.size() ? 0 : 1;
  for (size_t i = 0; i < want.size(); ++i) {
    const unsigned char g =
        i < got.size() ? static_cast<unsigned char>(got[i]) : 0;
    diff |= g ^ static_cast<unsigned char>(want[i]);
  }
  return diff == 0;
}

bool BearerTokenMatches(absl::string_view authorization,
                        absl::string_view key) {
  constexpr absl::string_view kBearer = "bearer";
  absl::string_view a = authorization;
  if (a.size() <= kBearer.size() ||
      !absl::EqualsIgnoreCase(a.substr(0, kBearer.size()), kBearer) ||
      a[kBearer.size()] != ' ') {
    return false;
  }
  a.remove_prefix(kBearer.size());
  while (!a.empty() && a.front() == ' ') a.remove_prefix(1);
  return ConstantTimeEquals(a, key);
}

absl::Status CheckApiKey(absl::string_view authorization, absl::string_view key,
                         absl::string_view where) {
  if (key.empty() || BearerTokenMatches(authorization, key)) {
    return absl::OkStatus();
  }
  return absl::UnauthenticatedError(
      absl::StrCat("missing or invalid API key: send ", where,
                   ": Bearer <key>'"));
}

}  // namespace specserve
