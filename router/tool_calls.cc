#include "router/tool_calls.h"

#include <algorithm>
#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"

namespace specserve {
namespace {

using Json = nlohmann::ordered_json;

// {"name": F, "arguments" | "parameters": {...}} naming one of `tools`.
std::optional<ParsedToolCall> ReadCall(const Json& v,
                                       absl::Span<const std::string> tools) {
  if (!v.is_object() || !v.contains("name") || !v["name"].is_string()) {
    return std::nullopt;
  }
  const std::string name = v["name"].get<std::string>();
  if (std::find(tools.begin(), tools.end(), name) == tools.end()) {
    return std::nullopt;
  }
  for (const char* key : {"arguments", "parameters"}) {
    if (!v.contains(key)) continue;
    const Json& a = v[key];
    if (a.is_object()) return ParsedToolCall{name, a.dump()};
    if (a.is_string()) {  // arguments as a JSON string, as OpenAI sends them
      const Json inner =
          Json::parse(a.get<std::string>(), nullptr, /*allow_exceptions=*/false);
      if (inner.is_object()) return ParsedToolCall{name, inner.dump()};
    }
    return std::nullopt;
  }
  return std::nullopt;
}

std::optional<Json> ParseJson(absl::string_view text) {
  const Json v = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (v.is_discarded()) return std::nullopt;
  return v;
}

// Hermes / Qwen: <tool_call> blocks. nullopt when there is none or one is
// malformed.
std::optional<ParsedAnswer> ReadTagged(absl::string_view text,
                                       absl::Span<const std::string> tools) {
  constexpr absl::string_view kOpen = "<tool_call>", kClose = "</tool_call>";
  if (text.find(kOpen) == absl::string_view::npos) return std::nullopt;
  ParsedAnswer out;
  std::string content;
  size_t at = 0;
  while (true) {
    const size_t open = text.find(kOpen, at);
    if (open == absl::string_view::npos) {
      absl::StrAppend(&content, text.substr(at));
      break;
    }
    absl::StrAppend(&content, text.substr(at, open - at));
    const size_t body = open + kOpen.size();
    const size_t close = text.find(kClose, body);
    const absl::string_view inner =
        text.substr(body, close == absl::string_view::npos ? absl::string_view::npos
                                                           : close - body);
    std::optional<Json> v = ParseJson(absl::StripAsciiWhitespace(inner));
    if (!v) return std::nullopt;
    std::optional<ParsedToolCall> call = ReadCall(*v, tools);
    if (!call) return std::nullopt;
    out.calls.push_back(*std::move(call));
    if (close == absl::string_view::npos) break;
    at = close + kClose.size();
  }
  out.content = std::string(absl::StripAsciiWhitespace(content));
  return out;
}

// Llama 3.1: the whole answer a call, a list of calls, or calls joined by
// ';'. nullopt otherwise.
std::optional<ParsedAnswer> ReadJsonAnswer(absl::string_view text,
                                           absl::Span<const std::string> tools) {
  const absl::string_view t = absl::StripAsciiWhitespace(text);
  if (t.empty() || (t.front() != '{' && t.front() != '[')) return std::nullopt;
  ParsedAnswer out;
  std::vector<Json> values;
  if (std::optional<Json> v = ParseJson(t)) {
    if (v->is_array()) {
      values.assign(v->begin(), v->end());
    } else {
      values.push_back(*std::move(v));
    }
  } else {
    for (absl::string_view part : absl::StrSplit(t, ';', absl::SkipWhitespace())) {
      std::optional<Json> p = ParseJson(absl::StripAsciiWhitespace(part));
      if (!p) return std::nullopt;
      values.push_back(*std::move(p));
    }
  }
  if (values.empty()) return std::nullopt;
  for (const Json& v : values) {
    std::optional<ParsedToolCall> call = ReadCall(v, tools);
    if (!call) return std::nullopt;
    out.calls.push_back(*std::move(call));
  }
  return out;
}

}  // namespace

ParsedAnswer ParseToolCalls(absl::string_view text,
                            absl::Span<const std::string> tools) {
  if (std::optional<ParsedAnswer> a = ReadTagged(text, tools)) return *a;
  if (std::optional<ParsedAnswer> a = ReadJsonAnswer(text, tools)) return *a;
  return ParsedAnswer{std::string(text), {}};
}

}  // namespace specserve
