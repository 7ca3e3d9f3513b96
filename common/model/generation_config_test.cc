#include "common/model/generation_config.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/status/status.h"
#include "common/model/config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(ApplyGenerationConfigTest, AddsListedEosIdsAfterConfigJsons) {
  ModelConfig c;
  c.eos_token_ids = {128001};
  // Llama 3.1 Instruct's generation_config.json.
  ASSERT_TRUE(ApplyGenerationConfig(R"({"bos_token_id": 128000,
      "do_sample": true, "eos_token_id": [128001, 128008, 128009],
      "temperature": 0.6, "top_p": 0.9})",
                                    &c)
                  .ok());
  EXPECT_THAT(c.eos_token_ids, ElementsAre(128001, 128008, 128009));
}

TEST(ApplyGenerationConfigTest, IntFormAndAbsentKey) {
  ModelConfig c;
  c.eos_token_ids = {151645};
  ASSERT_TRUE(ApplyGenerationConfig(R"({"eos_token_id": 151643})", &c).ok());
  EXPECT_THAT(c.eos_token_ids, ElementsAre(151645, 151643));
  ASSERT_TRUE(ApplyGenerationConfig(R"({"eos_token_id": 151645})", &c).ok());
  EXPECT_THAT(c.eos_token_ids, ElementsAre(151645, 151643));  // No repeat.
  ASSERT_TRUE(ApplyGenerationConfig(R"({"eos_token_id": null})", &c).ok());
  ASSERT_TRUE(ApplyGenerationConfig(R"({"temperature": 0.7})", &c).ok());
  EXPECT_THAT(c.eos_token_ids, ElementsAre(151645, 151643));
}

TEST(ApplyGenerationConfigTest, BadValuesAreInvalidArgument) {
  for (const char* bad :
       {R"({"eos_token_id": -1})", R"({"eos_token_id": "2"})",
        R"({"eos_token_id": [2, 1.5]})", R"({"eos_token_id": 99999999999})",
        R"([1, 2])", "{not json"}) {
    ModelConfig c;
    c.eos_token_ids = {2};
    absl::Status s = ApplyGenerationConfig(bad, &c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(s.message()), HasSubstr("generation_config.json"))
        << bad;
    EXPECT_THAT(c.eos_token_ids, ElementsAre(2)) << bad;  // Unchanged.
  }
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

TEST(LoadModelConfigTest, ReadsEosFromGenerationConfigNextToIt) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(tmp != nullptr ? tmp : "/tmp");
  WriteFile(dir + "/config.json", R"({
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 100,
    "bos_token_id": 1, "eos_token_id": 2})");
  std::remove((dir + "/generation_config.json").c_str());
  absl::StatusOr<ModelConfig> c = LoadModelConfig(dir + "/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->eos_token_ids, ElementsAre(2));  // No file: config.json's.

  WriteFile(dir + "/generation_config.json",
            R"({"_from_model_config": true, "eos_token_id": [2, 7]})");
  c = LoadModelConfig(dir + "/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->eos_token_ids, ElementsAre(2, 7));

  WriteFile(dir + "/generation_config.json", R"({"eos_token_id": "x"})");
  c = LoadModelConfig(dir + "/config.json");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr(dir + "/generation_config.json"));
}

}  // namespace
}  // namespace specserve
