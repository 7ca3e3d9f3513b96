#include "common/chat/chat_template.h"

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"

namespace specserve {
namespace chat {

using json = nlohmann::json;

absl::StatusOr<ChatTemplate> ChatTemplate::Create(const std::string& source,
                                                  std::string bos_token,
                                                  std::string eos_token) {
  auto t = JinjaTemplate::Parse(source);
  if (!t.ok()) return t.status();
  return ChatTemplate(*std::move(t), std::move(bos_token),
                      std::move(eos_token));
}

ChatTemplate ChatTemplate::Default() {
  auto t = JinjaTemplate::Parse(kDefaultChatTemplate);
  ChatTemplate c(*std::move(t), "", "");  // a constant that parses
  c.is_default_ = true;
  return c;
}

absl::StatusOr<std::string> ChatTemplate::Render(json context) const {
  if (!context.is_object()) {
    return absl::InvalidArgumentError("chat template context must be an object");
  }
  if (!context.contains("bos_token")) context["bos_token"] = bos_token_;
  if (!context.contains("eos_token")) context["eos_token"] = eos_token_;
  return template_.Render(context);
}

namespace {

// A token field: "str" or an AddedToken {"content": "str", ...}; "" if null.
std::string TokenString(const json& cfg, const char* key) {
  auto it = cfg.find(key);
  if (it == cfg.end()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") &&
      (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  return "";
}

}  // namespace

absl::StatusOr<ChatTemplate> LoadChatTemplate(const std::string& model_dir) {
  const std::string path = absl::StrCat(model_dir, "/tokenizer_config.json");
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("no ", path));
  std::stringstream buf;
  buf << in.rdbuf();
  const json cfg = json::parse(buf.str(), nullptr, /*allow_exceptions=*/false);
  if (!cfg.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  }
  auto it = cfg.find("chat_template");
  if (it == cfg.end() || it->is_null()) {
    return absl::NotFoundError(absl::StrCat(path, " has no chat_template"));
  }
  std::string source;
  if (it->is_string()) {
    source = it->get<std::string>();
  } else if (it->is_array()) {
    for (const json& t : *it) {
      if (t.is_object() && t.value("name", "") == "default" &&
          t.contains("template") && t["template"].is_string()) {
        source = t["template"].get<std::string>();
      }
    }
    if (source.empty()) {
      return absl::NotFoundError(
          absl::StrCat(path, " has no chat_template named \"default\""));
    }
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": chat_template must be a string or a list"));
  }
  auto t = ChatTemplate::Create(source, TokenString(cfg, "bos_token"),
                                TokenString(cfg, "eos_token"));
  if (!t.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", t.status().message()));
  }
  return t;
}

}  // namespace chat
}  // namespace specserve
