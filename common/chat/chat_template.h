#ifndef SPECSERVE_COMMON_CHAT_CHAT_TEMPLATE_H_
#define SPECSERVE_COMMON_CHAT_CHAT_TEMPLATE_H_

// A model's chat template: Hugging Face tokenizer_config.json's
// `chat_template` (rendered by common/chat/jinja.h) with its `bos_token` /
// `eos_token`, or the default template of models that ship none.

#include <string>

#include "absl/status/statusor.h"
#include "common/chat/jinja.h"
#include "nlohmann/json.hpp"

namespace specserve {
namespace chat {

/// The template of models without one (the bundled TinyStories models):
/// "<role>: <content>\n" per message, then "assistant:" when a generation
/// prompt is asked for. It writes no BOS (the caller adds the BOS id).
inline constexpr char kDefaultChatTemplate[] =
    "{% for message in messages %}{{ message['role'] }}: "
    "{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}";

class ChatTemplate {
 public:
  /// `source` is Jinja (JinjaTemplate::Parse's errors).
  static absl::StatusOr<ChatTemplate> Create(const std::string& source,
                                             std::string bos_token,
                                             std::string eos_token);
  /// kDefaultChatTemplate, no BOS / EOS strings.
  static ChatTemplate Default();

  /// Renders `context` (at least {"messages": [...],
  /// "add_generation_prompt": bool}; extra keys, e.g. enable_thinking, are
  /// the template's kwargs) with bos_token / eos_token added unless the
  /// context sets them. JinjaTemplate::Render's errors.
  absl::StatusOr<std::string> Render(nlohmann::json context) const;

  /// The BOS string the output may start with ("" = none).
  const std::string& bos_token() const { return bos_token_; }
  const std::string& eos_token() const { return eos_token_; }
  /// True for kDefaultChatTemplate.
  bool is_default() const { return is_default_; }

 private:
  ChatTemplate(JinjaTemplate t, std::string bos, std::string eos)
      : template_(std::move(t)),
        bos_token_(std::move(bos)),
        eos_token_(std::move(eos)) {}
  JinjaTemplate template_;
  std::string bos_token_;
  std::string eos_token_;
  bool is_default_ = false;
};

/// Loads `model_dir`/tokenizer_config.json's chat template. `chat_template`
/// is a string or a list of {"name", "template"} (the one named "default"
/// is used); bos_token / eos_token are strings or {"content": str}.
/// NOT_FOUND when the file or its chat_template is absent;
/// INVALID_ARGUMENT naming the file for malformed JSON or a template this
/// subset cannot parse.
absl::StatusOr<ChatTemplate> LoadChatTemplate(const std::string& model_dir);

}  // namespace chat
}  // namespace specserve

#endif  // SPECSERVE_COMMON_CHAT_CHAT_TEMPLATE_H_
