#include "common/decoding/stop.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace specserve {

absl::Status ValidateStopConditions(const StopConditions& conditions,
                                    int vocab_size) {
  if (conditions.max_new_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_new_tokens must be >= 0, got ", conditions.max_new_tokens));
  }
  if (conditions.max_context < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_context must be >= 0 (0 = unlimited), got ",
        conditions.max_context));
  }
  if (conditions.min_new_tokens < 0 ||
      conditions.min_new_tokens > conditions.max_new_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "min_new_tokens must be in [0, max_new_tokens = ",
        conditions.max_new_tokens, "], got ", conditions.min_new_tokens));
  }
  auto check_ids = [&](const std::vector<int>& ids,
                       const char* field) -> absl::Status {
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || (vocab_size > 0 && ids[i] >= vocab_size)) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, "[", i, "] = ", ids[i], " is outside the vocabulary"));
      }
    }
    return absl::OkStatus();
  };
  if (absl::Status s = check_ids(conditions.eos_token_ids, "eos_token_ids");
      !s.ok()) {
    return s;
  }
  return check_ids(conditions.stop_token_ids, "stop_token_ids");
}

std::string_view FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kNone:
      return "none";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kEos:
      return "eos";
    case FinishReason::kStopToken:
      return "stop_token";
    case FinishReason::kContextLimit:
      return "context_limit";
    case FinishReason::kStopString:
      return "stop";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kError:
      return "error";
  }
  return "unknown";
}

StopChecker::StopChecker(StopConditions conditions, int start_position)
    : conditions_(std::move(conditions)), start_position_(start_position) {
  CheckBudgets();
}

void StopChecker::CheckBudgets() {
  if (reason_ != FinishReason::kNone) return;
  if (num_emitted_ >= conditions_.max_new_tokens) {
    reason_ = FinishReason::kLength;
  } else if (conditions_.max_context > 0 &&
             start_position_ + num_emitted_ >= conditions_.max_context) {
    reason_ = FinishReason::kContextLimit;
  }
}

bool StopChecker::IsEos(int token) const {
  const auto& ids = conditions_.eos_token_ids;
  return std::find(ids.begin(), ids.end(), token) != ids.end();
}

bool StopChecker::IsStopToken(int token) const {
  const auto& ids = conditions_.stop_token_ids;
  return std::find(ids.begin(), ids.end(), token) != ids.end();
}

StopChecker::Result StopChecker::Append(absl::Span<const int> candidates) {
  Result result;
  for (const int token : candidates) {
    if (finished()) break;
    if (IsEos(token)) {
      reason_ = FinishReason::kEos;
      break;
    }
    if (IsStopToken(token)) {
      reason_ = FinishReason::kStopToken;
      break;
    }
    ++num_emitted_;
    ++result.num_emit;
    CheckBudgets();
  }
  result.reason = reason_;
  return result;
}

void StopChecker::Finish(FinishReason reason) {
  if (reason_ == FinishReason::kNone) reason_ = reason;
}

StopStringFilter::StopStringFilter(std::vector<std::string> stops,
                                   bool include_stop)
    : include_stop_(include_stop) {
  for (auto& s : stops) {
    if (!s.empty()) stops_.push_back(std::move(s));
  }
}

std::string StopStringFilter::Append(absl::string_view text, bool can_match) {
  if (matched_) return "";
  held_.append(text.data(), text.size());
  if (!can_match) protected_ = held_.size();
  // Text before held_ never hides a match start (it would have been held),
  // so the earliest match in held_ that ends past the protected bytes is
  // the first one in the whole output.
  size_t first = std::string::npos, first_len = 0;
  for (const std::string& s : stops_) {
    const size_t from =
        protected_ >= s.size() ? protected_ - s.size() + 1 : 0;
    const size_t at = held_.find(s, from);
    // The earliest match; at one place, the longest stop string.
    if (at < first || (at == first && at != std::string::npos &&
                       s.size() > first_len)) {
      first = at;
      first_len = s.size();
    }
  }
  if (first != std::string::npos) {
    matched_ = true;
    std::string out = held_.substr(0, first + (include_stop_ ? first_len : 0));
    held_.clear();
    return out;
  }
  // Hold the longest suffix that is a proper prefix of a stop string.
  size_t hold = 0;
  for (const std::string& s : stops_) {
    for (size_t k = std::min(s.size() - 1, held_.size()); k > hold; --k) {
      if (held_.compare(held_.size() - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
    }
  }
  std::string out = held_.substr(0, held_.size() - hold);
  held_.erase(0, held_.size() - hold);
  protected_ = protected_ > out.size() ? protected_ - out.size() : 0;
  return out;
}

std::string StopStringFilter::Flush() {
  std::string out;
  out.swap(held_);
  return out;
}

}  // namespace specserve
