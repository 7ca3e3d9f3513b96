// Loading tokenizer_config.json chat templates (string and named-list forms,
// AddedToken BOS/EOS, missing or broken files) and the default template.

#include "common/chat/chat_template.h"

#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace specserve {
namespace chat {
namespace {

using json = nlohmann::json;

std::string Dir(const std::string& name, const std::string& config) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp ? tmp : "/tmp", "/", name);
  EXPECT_EQ(std::system(absl::StrCat("mkdir -p '", dir, "'").c_str()), 0);
  if (!config.empty()) std::ofstream(dir + "/tokenizer_config.json") << config;
  return dir;
}

const json kMessages = json::parse(R"([
  {"role": "system", "content": "Be brief."},
  {"role": "user", "content": "Hi"}])");

TEST(ChatTemplateTest, DefaultTemplate) {
  const ChatTemplate t = ChatTemplate::Default();
  EXPECT_TRUE(t.is_default());
  EXPECT_EQ(t.bos_token(), "");
  auto out = t.Render({{"messages", kMessages}, {"add_generation_prompt", true}});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, "system: Be brief.\nuser: Hi\nassistant:");
  out = t.Render({{"messages", kMessages}, {"add_generation_prompt", false}});
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(*out, "system: Be brief.\nuser: Hi\n");
}

TEST(ChatTemplateTest, LoadsStringTemplateWithAddedTokens) {
  const std::string dir = Dir("string", R"({
    "bos_token": {"content": "<s>", "lstrip": false},
    "eos_token": "</s>",
    "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"})");
  auto t = LoadChatTemplate(dir);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_FALSE(t->is_default());
  EXPECT_EQ(t->bos_token(), "<s>");
  EXPECT_EQ(t->eos_token(), "</s>");
  auto out = t->Render({{"messages", kMessages}, {"add_generation_prompt", true}});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, "<s>[system]Be brief.</s>[user]Hi</s>[assistant]");
}

TEST(ChatTemplateTest, LoadsTheDefaultOfANamedList) {
  const std::string dir = Dir("list", R"({"chat_template": [
    {"name": "tool_use", "template": "tools"},
    {"name": "default", "template": "{{ messages|length }}"}]})");
  auto t = LoadChatTemplate(dir);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t->Render({{"messages", kMessages}}), "2");
}

TEST(ChatTemplateTest, Errors) {
  EXPECT_EQ(LoadChatTemplate(Dir("none", "")).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(LoadChatTemplate(Dir("notemplate", R"({"bos_token": "<s>"})"))
                .status()
                .code(),
            absl::StatusCode::kNotFound);
  auto bad = LoadChatTemplate(Dir("badjson", "{"));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("tokenizer_config.json"),
            std::string::npos);
  EXPECT_EQ(LoadChatTemplate(Dir("badtmpl", R"({"chat_template": "{% macro x() %}{% endmacro %}"})"))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  // The bundled models ship sentencepiece files only.
  EXPECT_EQ(LoadChatTemplate("models/stories260K").status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace chat
}  // namespace specserve
