#include "common/cuda/prefill_tuning.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/decoding/sampling.h"

namespace specserve {
namespace {

bool AnyNan(absl::Span<const float> x) {
  return std::any_of(x.begin(), x.end(),
                     [](float v) { return std::isnan(v); });
}

double MaxAbs(absl::Span<const float> x) {
  double m = 0;
  for (float v : x) m = std::max(m, std::fabs(static_cast<double>(v)));
  return m;
}

}  // namespace

double MaxRelDiff(absl::Span<const float> ref,
                  absl::Span<const float> logits) {
  if (ref.size() != logits.size() || AnyNan(logits)) {
    return std::numeric_limits<double>::infinity();
  }
  const double scale = MaxAbs(ref);
  if (scale == 0) return 0;
  double d = 0;
  for (size_t j = 0; j < ref.size(); ++j) {
    d = std::max(d, std::fabs(static_cast<double>(logits[j]) - ref[j]));
  }
  return d / scale;
}

bool TopOneAgrees(absl::Span<const float> ref, absl::Span<const float> logits,
                  double tie) {
  if (ref.empty() || ref.size() != logits.size() || AnyNan(logits)) {
    return false;
  }
  // Argmax: ties -> lowest id, NaN never wins; a NaN reference row compares
  // false below.
  const int r = Argmax(ref);
  const int l = Argmax(logits);
  return ref[l] >= ref[r] - tie * MaxAbs(ref);
}

double MedianSeconds(std::vector<double> x) {
  if (x.empty()) return 0;
  std::sort(x.begin(), x.end());
  const size_t n = x.size();
  return n % 2 == 1 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

int ChoosePrefillTrial(absl::Span<const PrefillPathTrial> trials,
                       absl::string_view library, double library_margin) {
  if (trials.empty()) return -1;
  auto eligible = [&](int i) {
    return trials[i].ran && (i == 0 || trials[i].agrees);
  };
  int fastest = -1;
  for (int i = 0; i < static_cast<int>(trials.size()); ++i) {
    if (!eligible(i)) continue;
    if (fastest < 0 || trials[i].seconds < trials[fastest].seconds) {
      fastest = i;
    }
  }
  if (fastest < 0) return 0;
  for (int i = 0; i < static_cast<int>(trials.size()); ++i) {
    if (eligible(i) && trials[i].name == library &&
        trials[i].seconds <= trials[fastest].seconds * (1 + library_margin)) {
      return i;
    }
  }
  return fastest;
}

std::string DescribePrefillTuning(const PrefillTuning& tuning) {
  std::string s = absl::StrCat(
      "prefill attention: ",
      tuning.chosen >= 0 &&
              tuning.chosen < static_cast<int>(tuning.trials.size())
          ? tuning.trials[tuning.chosen].name
          : "?",
      " (tuned on a ", tuning.chunk_rows, "-row chunk at ",
      tuning.context_tokens, " tokens:");
  for (size_t i = 0; i < tuning.trials.size(); ++i) {
    const PrefillPathTrial& t = tuning.trials[i];
    absl::StrAppend(&s, i == 0 ? " " : "; ", t.name);
    if (!t.ran) {
      absl::StrAppend(&s, " not run: ", t.note);
      continue;
    }
    absl::StrAppend(&s, absl::StrFormat(" %.2f ms", 1e3 * t.seconds));
    if (i == 0) {
      absl::StrAppend(&s, " (reference)");
    } else {
      absl::StrAppend(&s, absl::StrFormat(", rel diff %.1e, %s",
                                          t.max_rel_diff,
                                          t.agrees ? "agrees" : "DISAGREES"));
    }
  }
  absl::StrAppend(&s, ")");
  return s;
}

}  // namespace specserve
