// Fuzz target: the Jinja subset of chat templates (jinja.h). A template
// comes from a model directory's tokenizer_config.json, so a malformed or
// hostile one must not take the router down: the input is the template
// source; one that parses is rendered with a fixed conversation (roles,
// unicode and empty content, content parts, a namespace-friendly flag).
// Parse and Render return a template or INVALID_ARGUMENT, never a crash,
// hang or runaway output (Render caps its output and loops).
// Seeds: common/chat/testdata/fuzz/jinja.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/chat/jinja.h"
#include "nlohmann/json.hpp"

namespace {

const nlohmann::json& Context() {
  static const nlohmann::json* context = new nlohmann::json(
      nlohmann::json::parse(R"({
        "messages": [
          {"role": "system", "content": "You are terse."},
          {"role": "user", "content": "Caf\u00e9 \u2581 \ud83d\ude00 {{ x }} {% y %}"},
          {"role": "assistant", "content": ""},
          {"role": "user", "content": [{"type": "text", "text": "a"},
                                       {"type": "text", "text": "b"}]},
          {"role": "tool", "content": "42", "name": "calc"}
        ],
        "add_generation_prompt": true,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "enable_thinking": false,
        "tools": [{"name": "calc", "parameters": {"a": 1}}]
      })"));
  return *context;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view source(reinterpret_cast<const char*>(data), size);
  auto parsed = specserve::chat::JinjaTemplate::Parse(source);
  if (!parsed.ok()) {
    if (!absl::IsInvalidArgument(parsed.status())) std::abort();
    return 0;
  }
  auto rendered = parsed->Render(Context());
  if (!rendered.ok()) {
    if (!absl::IsInvalidArgument(rendered.status())) std::abort();
    return 0;
  }
  if (rendered->size() > 10'000'000) std::abort();
  return 0;
}
