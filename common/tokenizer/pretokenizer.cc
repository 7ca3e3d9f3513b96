#include "common/tokenizer/pretokenizer.h"

#include <oniguruma.h>

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/tokenizer/byte_level.h"
#include "common/tokenizer/utf8.h"
#include "nlohmann/json.hpp"

namespace specserve {
namespace {

using Json = nlohmann::json;

// The pattern HF's ByteLevel pre-tokenizer splits with when use_regex is set
// (GPT-2's encoder.py).
constexpr char kGpt2Pattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

void InitOniguruma() {
  // onig_initialize is not thread-safe: run it once.
  static const bool done = [] {
    OnigEncoding encodings[] = {ONIG_ENCODING_UTF8};
    onig_initialize(encodings, 1);
    return true;
  }();
  (void)done;
}

std::string TypeOf(const Json& j) {
  if (!j.is_object()) return "";
  auto it = j.find("type");
  return it != j.end() && it->is_string() ? it->get<std::string>() : "";
}

bool GetBool(const Json& j, const char* key, bool dflt) {
  auto it = j.find(key);
  return it != j.end() && it->is_boolean() ? it->get<bool>() : dflt;
}

// One piece of text between steps. `opaque` pieces are single bytes that
// are not valid UTF-8: no regex sees them.
struct Piece {
  std::string text;
  bool opaque;
};

}  // namespace

absl::StatusOr<std::unique_ptr<OnigRegex>> OnigRegex::Compile(
    std::string_view pattern) {
  InitOniguruma();
  regex_t* reg = nullptr;
  OnigErrorInfo einfo;
  const auto* p = reinterpret_cast<const OnigUChar*>(pattern.data());
  const int r = onig_new(&reg, p, p + pattern.size(), ONIG_OPTION_NONE,
                         ONIG_ENCODING_UTF8, ONIG_SYNTAX_ONIGURUMA, &einfo);
  if (r != ONIG_NORMAL) {
    OnigUChar msg[ONIG_MAX_ERROR_MESSAGE_LEN];
    onig_error_code_to_str(msg, r, &einfo);
    return absl::InvalidArgumentError(absl::StrCat(
        "regex \"", std::string(pattern),
        "\" does not compile: ", reinterpret_cast<const char*>(msg)));
  }
  return std::unique_ptr<OnigRegex>(new OnigRegex(reg));
}

OnigRegex::~OnigRegex() { onig_free(static_cast<regex_t*>(regex_)); }

void OnigRegex::FindAll(std::string_view text,
                        std::vector<ByteRange>* out) const {
  auto* reg = static_cast<regex_t*>(regex_);
  OnigRegion* region = onig_region_new();
  const auto* str = reinterpret_cast<const OnigUChar*>(text.data());
  const OnigUChar* end = str + text.size();
  size_t pos = 0;
  bool have_last = false;
  size_t last_end = 0;
  while (pos <= text.size()) {
    onig_region_clear(region);
    const int r =
        onig_search(reg, str, end, str + pos, end, region, ONIG_OPTION_NONE);
    if (r < 0) break;  // ONIG_MISMATCH (or a matcher error: stop there).
    const size_t b = static_cast<size_t>(region->beg[0]);
    const size_t e = static_cast<size_t>(region->end[0]);
    if (b == e && have_last && last_end == e) {
      // Empty match where the last one ended: step over one character.
      if (pos >= text.size()) break;
      const size_t n = ValidUtf8Len(text, pos);
      pos += n == 0 ? 1 : n;
      continue;
    }
    out->emplace_back(b, e);
    pos = e;
    have_last = true;
    last_end = e;
  }
  onig_region_free(region, /*free_self=*/1);
}

void SplitByMatches(size_t size, const std::vector<ByteRange>& matches,
                    SplitBehavior behavior, bool invert,
                    std::vector<ByteRange>* out) {
  // Cut into (range, is_match) runs covering [0, size).
  std::vector<std::pair<ByteRange, bool>> runs;
  if (size == 0) {
    runs.push_back({{0, 0}, false});
  } else {
    size_t prev = 0;
    for (const ByteRange& m : matches) {
      if (prev != m.first) runs.push_back({{prev, m.first}, false});
      runs.push_back({m, true});
      prev = m.second;
    }
    if (prev != size) runs.push_back({{prev, size}, false});
  }
  if (invert) {
    for (auto& r : runs) r.second = !r.second;
  }
  // (range, remove) pieces per behavior, as HF's NormalizedString::split.
  std::vector<std::pair<ByteRange, bool>> pieces;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const auto& r : runs) pieces.push_back({r.first, false});
      break;
    case SplitBehavior::kRemoved:
      pieces = runs;
      break;
    case SplitBehavior::kContiguous: {
      bool prev_match = false;
      for (const auto& r : runs) {
        if (r.second == prev_match && !pieces.empty()) {
          pieces.back().first.second = r.first.second;
        } else {
          pieces.push_back({r.first, false});
        }
        prev_match = r.second;
      }
      break;
    }
    case SplitBehavior::kMergedWithPrevious: {
      bool prev_match = false;
      for (const auto& r : runs) {
        if (r.second && !prev_match && !pieces.empty()) {
          pieces.back().first.second = r.first.second;
        } else {
          pieces.push_back({r.first, false});
        }
        prev_match = r.second;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool prev_match = false;
      for (auto it = runs.rbegin(); it != runs.rend(); ++it) {
        if (it->second && !prev_match && !pieces.empty()) {
          pieces.back().first.first = it->first.first;
        } else {
          pieces.push_back({it->first, false});
        }
        prev_match = it->second;
      }
      std::reverse(pieces.begin(), pieces.end());
      break;
    }
  }
  for (const auto& [range, remove] : pieces) {
    if (!remove && range.second > range.first) out->push_back(range);
  }
}

struct PreTokenizer::Step {
  enum Type { kSplit, kByteLevel } type;
  // kSplit: a regex, or else a literal pattern.
  std::unique_ptr<OnigRegex> regex;
  std::string literal;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  // kByteLevel.
  bool add_prefix_space = false;
};

PreTokenizer::~PreTokenizer() = default;

absl::StatusOr<std::unique_ptr<PreTokenizer>> PreTokenizer::FromJson(
    const Json& json) {
  std::vector<const Json*> parts;
  if (TypeOf(json) == "Sequence") {
    auto it = json.find("pretokenizers");
    if (it == json.end() || !it->is_array()) {
      return absl::InvalidArgumentError(
          "pre_tokenizer Sequence without \"pretokenizers\"");
    }
    for (const Json& p : *it) parts.push_back(&p);
  } else {
    parts.push_back(&json);
  }
  auto pre = std::unique_ptr<PreTokenizer>(new PreTokenizer());
  for (const Json* p : parts) {
    const std::string type = TypeOf(*p);
    if (type == "Split") {
      Step step;
      step.type = Step::kSplit;
      auto pat = p->find("pattern");
      if (pat == p->end() || !pat->is_object()) {
        return absl::InvalidArgumentError("Split without a \"pattern\" object");
      }
      if (pat->contains("Regex") && (*pat)["Regex"].is_string()) {
        absl::StatusOr<std::unique_ptr<OnigRegex>> re =
            OnigRegex::Compile((*pat)["Regex"].get<std::string>());
        if (!re.ok()) return re.status();
        step.regex = *std::move(re);
      } else if (pat->contains("String") && (*pat)["String"].is_string()) {
        step.literal = (*pat)["String"].get<std::string>();
      } else {
        return absl::InvalidArgumentError(
            "Split pattern is neither {\"Regex\": ...} nor {\"String\": ...}");
      }
      const std::string behavior =
          p->contains("behavior") && (*p)["behavior"].is_string()
              ? (*p)["behavior"].get<std::string>()
              : "";
      if (behavior == "Removed") {
        step.behavior = SplitBehavior::kRemoved;
      } else if (behavior == "Isolated") {
        step.behavior = SplitBehavior::kIsolated;
      } else if (behavior == "MergedWithPrevious") {
        step.behavior = SplitBehavior::kMergedWithPrevious;
      } else if (behavior == "MergedWithNext") {
        step.behavior = SplitBehavior::kMergedWithNext;
      } else if (behavior == "Contiguous") {
        step.behavior = SplitBehavior::kContiguous;
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("Split behavior \"", behavior, "\" is unknown"));
      }
      step.invert = GetBool(*p, "invert", false);
      pre->steps_.push_back(std::move(step));
    } else if (type == "ByteLevel") {
      Step step;
      step.type = Step::kByteLevel;
      step.add_prefix_space = GetBool(*p, "add_prefix_space", true);
      if (GetBool(*p, "use_regex", true)) {
        absl::StatusOr<std::unique_ptr<OnigRegex>> re =
            OnigRegex::Compile(kGpt2Pattern);
        if (!re.ok()) return re.status();
        step.regex = *std::move(re);
      }
      pre->steps_.push_back(std::move(step));
      pre->byte_level_ = true;
    } else {
      return absl::UnimplementedError(absl::StrCat(
          "pre_tokenizer \"", type.empty() ? "(no type)" : type, "\""));
    }
  }
  return pre;
}

void PreTokenizer::Split(std::string_view text,
                         std::vector<std::string>* words) const {
  // Cut out bytes that are not valid UTF-8 (Oniguruma must not see them).
  std::vector<Piece> pieces;
  size_t run = 0;
  for (size_t i = 0; i < text.size();) {
    const size_t n = ValidUtf8Len(text, i);
    if (n > 0) {
      i += n;
      continue;
    }
    if (i > run)
      pieces.push_back({std::string(text.substr(run, i - run)), false});
    pieces.push_back({std::string(text.substr(i, 1)), true});
    run = ++i;
  }
  if (run < text.size())
    pieces.push_back({std::string(text.substr(run)), false});

  std::vector<Piece> next;
  std::vector<ByteRange> matches;
  std::vector<ByteRange> ranges;
  for (const Step& step : steps_) {
    next.clear();
    for (Piece& piece : pieces) {
      if (step.type == Step::kByteLevel && step.add_prefix_space &&
          !piece.opaque && piece.text[0] != ' ') {
        piece.text.insert(0, " ");
      }
      const bool splits = step.regex != nullptr || !step.literal.empty();
      if (piece.opaque || !splits) {
        next.push_back(std::move(piece));
        continue;
      }
      matches.clear();
      if (step.regex != nullptr) {
        step.regex->FindAll(piece.text, &matches);
      } else {
        for (size_t pos = piece.text.find(step.literal);
             pos != std::string::npos;
             pos = piece.text.find(step.literal, pos + step.literal.size())) {
          matches.emplace_back(pos, pos + step.literal.size());
        }
      }
      ranges.clear();
      // ByteLevel's own regex split is Isolated.
      SplitByMatches(
          piece.text.size(), matches,
          step.type == Step::kSplit ? step.behavior : SplitBehavior::kIsolated,
          step.type == Step::kSplit && step.invert, &ranges);
      for (const ByteRange& r : ranges) {
        next.push_back({piece.text.substr(r.first, r.second - r.first), false});
      }
    }
    if (step.type == Step::kByteLevel) {
      for (Piece& piece : next) {
        std::string mapped;
        ByteLevelEncode(piece.text, &mapped);
        piece.text = std::move(mapped);
        piece.opaque = false;
      }
    }
    pieces.swap(next);
  }
  for (Piece& piece : pieces) words->push_back(std::move(piece.text));
}

}  // namespace specserve
