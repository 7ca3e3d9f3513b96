#ifndef SPECSERVE_ROUTER_TOOL_CALLS_H_
#define SPECSERVE_ROUTER_TOOL_CALLS_H_

// Tool calls in a model's own words (chat tool_choice "auto"; vLLM's
// --tool-call-parser hermes and llama3_json): the answer is read once it
// is complete, and the calls it holds become OpenAI tool_calls.

#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace specserve {

/// One call: the function's name and its arguments as JSON text.
struct ParsedToolCall {
  std::string name;
  std::string arguments;
};

/// An answer split into its text and its calls.
struct ParsedAnswer {
  std::string content;  ///< the answer without the calls (trimmed).
  std::vector<ParsedToolCall> calls;
};

/// Reads the tool calls of `text`, in the formats the chat templates of the
/// supported families teach: Hermes / Qwen 2.5's `<tool_call>{"name": F,
/// "arguments": {...}}</tool_call>` blocks (the text around them is the
/// content; the last block may lack its closing tag), or Llama 3.1's JSON
/// answer: the whole answer one object {"name": F, "parameters": {...}}
/// ("arguments" also read), a list of them, or several joined by ';'.
/// Every call must name one of `tools` and carry an object (or, for
/// "arguments", a JSON string holding one); otherwise nothing is a call
/// and the whole answer is content.
ParsedAnswer ParseToolCalls(absl::string_view text,
                            absl::Span<const std::string> tools);

}  // namespace specserve

#endif  // SPECSERVE_ROUTER_TOOL_CALLS_H_
