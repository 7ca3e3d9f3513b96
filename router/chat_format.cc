#include "router/chat_format.h"

#include <memory>
#include <utility>

#include "common/chat/chat_template.h"

namespace specserve {

absl::StatusOr<openai::ChatFormat> ChatFormatFor(const std::string& model_dir) {
  absl::StatusOr<chat::ChatTemplate> t =
      model_dir.empty() ? absl::NotFoundError("no tokenizer directory")
                        : chat::LoadChatTemplate(model_dir);
  std::shared_ptr<const chat::ChatTemplate> tmpl;
  if (t.ok()) {
    tmpl = std::make_shared<const chat::ChatTemplate>(*std::move(t));
  } else if (absl::IsNotFound(t.status())) {
    tmpl = std::make_shared<const chat::ChatTemplate>(
        chat::ChatTemplate::Default());
  } else {
    return t.status();
  }
  openai::ChatFormat f;
  f.bos_token = tmpl->bos_token();
  f.add_bos = tmpl->is_default();
  f.render = [tmpl](const nlohmann::json& context) {
    return tmpl->Render(context);
  };
  return f;
}

}  // namespace specserve
