// Fuzz target: the speculator's request validation, as Score runs it. The
// input is decoded as a v1::ScoreRequest (protos/speculator.proto); a
// decodable one goes through ResolveScoreOptions and ValidatePrompt for a
// 512-token, 512-context model, and what passes through token selection
// (importance made from the ids). Never a crash; every rejection is
// INVALID_ARGUMENT. Seeds: speculator_service/testdata/fuzz/score.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "common/specprefill/selection.h"
#include "protos/speculator.pb.h"
#include "common/service/wire_options.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  specserve::v1::ScoreRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  specserve::ModelConfig config;
  config.vocab_size = 512;
  config.max_position_embeddings = 512;
  config.num_hidden_layers = 2;
  const auto opts = specserve::ResolveScoreOptions(
      req.options(), specserve::SpecPrefillDefaults{}, config.num_hidden_layers,
      "options.");
  if (!opts.ok()) {
    if (!absl::IsInvalidArgument(opts.status())) std::abort();
    return 0;
  }
  const std::vector<int> ids(req.token_ids().begin(), req.token_ids().end());
  const absl::Status valid =
      specserve::ValidatePrompt(ids, opts->look_ahead, config, "token_ids");
  if (!valid.ok()) {
    if (!absl::IsInvalidArgument(valid)) std::abort();
    return 0;
  }
  std::vector<float> importance(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) importance[i] = ids[i] / 512.0f;
  const auto sel = specserve::SelectTokens(importance, opts->selection);
  if (!sel.ok()) std::abort();  // validated options must select
  if (sel->kept_indices.empty() || sel->kept_indices.back() >=
                                       static_cast<int>(ids.size())) {
    std::abort();
  }
  return 0;
}
