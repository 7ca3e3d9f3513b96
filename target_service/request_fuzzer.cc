// Fuzz target: the target's Generate stream messages. The input is decoded
// as a v1::GenerateRequest (protos/target.proto); a prefill becomes a
// TargetSession on the bundled stories260K model exactly as the server
// makes it (ToTargetRequest, TargetSession::Create) and, when valid, runs
// its first round with the message's drafts. Never a crash; rejections are
// INVALID_ARGUMENT (or RESOURCE_EXHAUSTED for the KV pool).
// Seeds: target_service/testdata/fuzz/generate.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "common/engine/cpu_model_runner.h"
#include "common/model/weights.h"
#include "protos/target.pb.h"
#include "target_service/request_convert.h"

namespace {

specserve::CpuModelRunner* Model() {
  static specserve::CpuModelRunner* model = [] {
    auto w = specserve::LoadModelWeights("models/stories260K");
    if (!w.ok()) std::abort();
    auto m = specserve::CpuModelRunner::CreateForSequences(
        std::make_shared<const specserve::ModelWeights>(*std::move(w)), 2);
    if (!m.ok()) std::abort();
    return m->release();
  }();
  return model;
}

bool Expected(const absl::Status& s) {
  return absl::IsInvalidArgument(s) || absl::IsResourceExhausted(s) ||
         absl::IsFailedPrecondition(s);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  specserve::v1::GenerateRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  if (!req.has_prefill()) return 0;
  if (absl::Status s =
          specserve::ValidatePromptLookup(req.prefill(), /*max_drafts=*/8);
      !s.ok()) {
    if (!absl::IsInvalidArgument(s)) std::abort();
    return 0;
  }
  auto session = specserve::TargetSession::Create(
      Model(), specserve::ToTargetRequest(req.prefill(),
                                          /*default_max_new_tokens=*/4,
                                          /*max_drafts=*/8));
  if (!session.ok()) {
    if (!Expected(session.status())) std::abort();
    return 0;
  }
  const auto round =
      (*session)->Step(specserve::ToDrafts(req.prefill().drafts()));
  if (!round.ok() && !Expected(round.status())) std::abort();
  return 0;
}
