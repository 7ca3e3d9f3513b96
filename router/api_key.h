#ifndef SPECSERVE_ROUTER_API_KEY_H_
#define SPECSERVE_ROUTER_API_KEY_H_

// The router's API key check, one rule for both doors: HTTP's
// `Authorization` header and gRPC's `authorization` metadata carry
// "Bearer <key>" (RFC 6750 section 2.1).

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace specserve {

/// `got` == `want`, in time that depends on their lengths only.
bool ConstantTimeEquals(absl::string_view got, absl::string_view want);

/// True when `authorization` is "Bearer <key>": the scheme in any case
/// (RFC 9110 section 11.1), one or more spaces, then exactly `key`
/// (compared in constant time).
bool BearerTokenMatches(absl::string_view authorization, absl::string_view key);

/// OK when `key` is empty (no key configured) or `authorization` carries
/// it; else UNAUTHENTICATED telling the client what to send (`where`: "the
/// header 'Authorization" or "the metadata 'authorization").
absl::Status CheckApiKey(absl::string_view authorization, absl::string_view key,
                         absl::string_view where);

}  // namespace specserve

#endif  // SPECSERVE_ROUTER_API_KEY_H_
