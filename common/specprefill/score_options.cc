#include "common/specprefill/score_options.h"

#include "absl/strings/str_cat.h"

namespace specserve {

absl::Status ValidateScoreOptions(const ScoreOptions& options, int num_layers) {
  if (options.look_ahead < 0 || options.look_ahead > 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "look_ahead must be in [0, 64], got ", options.look_ahead));
  }
  if (auto s = ValidateScoringOptions(options.scoring, num_layers); !s.ok()) {
    return s;
  }
  return ValidateSelectionOptions(options.selection);
}

}  // namespace specserve
