// Fuzz target: the router's request validation. The input is decoded as a
// v1::GenerateTextRequest (protos/router.proto); a decodable one goes
// through ResolveOptions with the default flags, which must give a fully
// valid option set (ResolvedOptionsViolation) or INVALID_ARGUMENT, never a
// crash.
// Seeds: router/testdata/fuzz/generate.

#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "protos/router.pb.h"
#include "router/request_runner.h"
#include "router/resolved_options_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  specserve::v1::GenerateTextRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  const auto r = specserve::ResolveOptions(req, specserve::RequestDefaults{});
  if (!r.ok()) {
    if (!absl::IsInvalidArgument(r.status())) std::abort();
    return 0;
  }
  if (!specserve::ResolvedOptionsViolation(*r).empty()) std::abort();
  return 0;
}
