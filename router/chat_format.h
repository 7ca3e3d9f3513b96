#ifndef SPECSERVE_ROUTER_CHAT_FORMAT_H_
#define SPECSERVE_ROUTER_CHAT_FORMAT_H_

// How /v1/chat/completions turns messages into a prompt: the model's chat
// template, loaded once at start-up (common/chat renders it).

#include <string>

#include "absl/status/statusor.h"
#include "router/openai_api.h"

namespace specserve {

/// The chat format of a model directory: its tokenizer_config.json
/// chat_template (common/chat) when present, else
/// chat::kDefaultChatTemplate ("<role>: <content>\n" per message, then
/// "assistant:"; BOS added as an id). LoadChatTemplate's INVALID_ARGUMENT
/// for a template that does not parse. "" = the default template.
absl::StatusOr<openai::ChatFormat> ChatFormatFor(const std::string& model_dir);

}  // namespace specserve

#endif  // SPECSERVE_ROUTER_CHAT_FORMAT_H_
