#include "common/model/config.h"

#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Expected values from the table in models/README.md (the checkpoints'
// documented shapes), not from running the parser.
struct Expected {
  const char* dir;
  int hidden, ffn, layers, heads, kv_heads, head_dim, vocab;
  float eps;
};

class BundledConfigTest : public ::testing::TestWithParam<Expected> {};

TEST_P(BundledConfigTest, MatchesDocumentedShapes) {
  const Expected& e = GetParam();
  absl::StatusOr<ModelConfig> c =
      LoadModelConfig(std::string("models/") + e.dir + "/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model_type, "llama");
  EXPECT_EQ(c->hidden_size, e.hidden);
  EXPECT_EQ(c->intermediate_size, e.ffn);
  EXPECT_EQ(c->num_hidden_layers, e.layers);
  EXPECT_EQ(c->num_attention_heads, e.heads);
  EXPECT_EQ(c->num_key_value_heads, e.kv_heads);
  EXPECT_EQ(c->head_dim, e.head_dim);
  EXPECT_EQ(c->vocab_size, e.vocab);
  EXPECT_EQ(c->max_position_embeddings, 512);
  EXPECT_FLOAT_EQ(c->rms_norm_eps, e.eps);
  EXPECT_DOUBLE_EQ(c->rope_theta, 10000.0);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->bos_token_id, 1);
  EXPECT_THAT(c->eos_token_ids, ElementsAre(2));
  EXPECT_EQ(c->hidden_act, "silu");
  EXPECT_EQ(c->torch_dtype, "float32");
  EXPECT_EQ(c->gqa_group(), e.heads / e.kv_heads);
  EXPECT_EQ(c->qkv_dim(), (e.heads + 2 * e.kv_heads) * e.head_dim);
}

INSTANTIATE_TEST_SUITE_P(
    Models, BundledConfigTest,
    ::testing::Values(
        Expected{"stories260K", 64, 172, 5, 8, 4, 8, 512, 1e-5f},
        Expected{"stories260K-draft", 48, 128, 2, 6, 2, 8, 512, 1e-5f},
        Expected{"tinystories-656K", 128, 384, 2, 8, 4, 16, 2048, 1e-6f},
        Expected{"tinystories-656K-draft", 64, 192, 2, 4, 2, 16, 2048, 1e-6f}));

constexpr char kMinimal[] = R"({
  "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3,
  "num_attention_heads": 4, "vocab_size": 1000
})";

TEST(ParseModelConfigTest, HuggingFaceDefaultsWhenKeysAbsent) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kMinimal);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model_type, "llama");
  EXPECT_EQ(c->num_key_value_heads, 4);
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_EQ(c->max_position_embeddings, 2048);
  EXPECT_FLOAT_EQ(c->rms_norm_eps, 1e-6f);
  EXPECT_DOUBLE_EQ(c->rope_theta, 10000.0);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->bos_token_id, 1);
  EXPECT_THAT(c->eos_token_ids, ElementsAre(2));
  EXPECT_EQ(c->hidden_act, "silu");
}

TEST(ParseModelConfigTest, Llama3StyleConfig) {
  // Llama-3.2-1B-Instruct's keys (rope_scaling dropped: not supported yet).
  absl::StatusOr<ModelConfig> c = ParseModelConfig(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "rope_scaling": null,
    "tie_word_embeddings": true, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16"})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->gqa_group(), 4);
  EXPECT_EQ(c->qkv_dim(), (32 + 16) * 64);
  EXPECT_DOUBLE_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->bos_token_id, 128000);
  EXPECT_THAT(c->eos_token_ids, ElementsAre(128001, 128008, 128009));
  EXPECT_EQ(c->torch_dtype, "bfloat16");
}

TEST(ParseModelConfigTest, ExplicitHeadDimNeedNotDivideHidden) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(R"({
    "hidden_size": 100, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 3, "head_dim": 32, "vocab_size": 10})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 32);
}

struct BadCase {
  const char* name;
  const char* json;
  const char* message;  // substring the error must contain
};

class BadConfigTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadConfigTest, IsInvalidArgumentNamingTheKey) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(GetParam().json);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr(GetParam().message));
}

#define BASE                                                               \
  "\"hidden_size\": 64, \"intermediate_size\": 128, "                      \
  "\"num_hidden_layers\": 2, \"num_attention_heads\": 8, \"vocab_size\": " \
  "512"

INSTANTIATE_TEST_SUITE_P(
    Cases, BadConfigTest,
    ::testing::Values(
        BadCase{"NotJson", "{\"hidden_size\": 64,", "not valid JSON"},
        BadCase{"NotObject", "[1, 2]", "JSON object"},
        BadCase{"MissingHidden",
                R"({"intermediate_size": 1, "num_hidden_layers": 1,
                    "num_attention_heads": 1, "vocab_size": 1})",
                "missing required key 'hidden_size'"},
        BadCase{"MissingVocab",
                R"({"hidden_size": 8, "intermediate_size": 1,
                    "num_hidden_layers": 1, "num_attention_heads": 1})",
                "'vocab_size'"},
        BadCase{"RopeScalingLlama3",
                "{" BASE ", \"rope_scaling\": {\"factor\": 32.0, "
                "\"rope_type\": \"llama3\"}}",
                "rope_scaling type 'llama3' is not supported"},
        BadCase{"RopeScalingLegacyKey",
                "{" BASE ", \"rope_scaling\": {\"type\": \"linear\", "
                "\"factor\": 2.0}}",
                "rope_scaling type 'linear' is not supported"},
        BadCase{"KvHeadsDoNotDivide", "{" BASE ", \"num_key_value_heads\": 3}",
                "multiple of num_key_value_heads"},
        BadCase{"ZeroKvHeads", "{" BASE ", \"num_key_value_heads\": 0}",
                "'num_key_value_heads' = 0"},
        BadCase{"NegativeLayers",
                R"({"hidden_size": 64, "intermediate_size": 128,
                    "num_hidden_layers": -1, "num_attention_heads": 8,
                    "vocab_size": 512})",
                "'num_hidden_layers' = -1"},
        BadCase{"FloatForInt",
                R"({"hidden_size": 64.5, "intermediate_size": 128,
                    "num_hidden_layers": 1, "num_attention_heads": 8,
                    "vocab_size": 512})",
                "'hidden_size' must be an integer"},
        BadCase{"HugeInt",
                R"({"hidden_size": 99999999999, "intermediate_size": 128,
                    "num_hidden_layers": 1, "num_attention_heads": 8,
                    "vocab_size": 512})",
                "'hidden_size' = 99999999999 is out of range"},
        BadCase{"HiddenNotDivisible",
                R"({"hidden_size": 65, "intermediate_size": 128,
                    "num_hidden_layers": 1, "num_attention_heads": 8,
                    "vocab_size": 512})",
                "not divisible by num_attention_heads"},
        BadCase{"OddHeadDim", "{" BASE ", \"head_dim\": 7}", "must be even"},
        BadCase{"Gelu", "{" BASE ", \"hidden_act\": \"gelu\"}",
                "hidden_act 'gelu' is not supported"},
        BadCase{"Mistral", "{" BASE ", \"model_type\": \"mistral\"}",
                "model_type 'mistral' is not supported"},
        BadCase{"ZeroEps", "{" BASE ", \"rms_norm_eps\": 0}", "rms_norm_eps"},
        BadCase{"NegativeTheta", "{" BASE ", \"rope_theta\": -1.0}",
                "rope_theta"},
        BadCase{"StringTheta", "{" BASE ", \"rope_theta\": \"1e4\"}",
                "'rope_theta' must be a number"},
        BadCase{"TieNotBool", "{" BASE ", \"tie_word_embeddings\": 1}",
                "'tie_word_embeddings' must be a boolean"},
        BadCase{"EosString", "{" BASE ", \"eos_token_id\": \"</s>\"}",
                "'eos_token_id'"},
        BadCase{"EosEmptyList", "{" BASE ", \"eos_token_id\": []}",
                "empty list"},
        BadCase{"EosNegative", "{" BASE ", \"eos_token_id\": [2, -1]}",
                "'eos_token_id'"},
        BadCase{"AttentionBias", "{" BASE ", \"attention_bias\": true}",
                "'attention_bias'"}),
    [](const ::testing::TestParamInfo<BadCase>& info) {
      return std::string(info.param.name);
    });

#undef BASE

TEST(LoadModelConfigTest, MissingFileIsNotFound) {
  absl::StatusOr<ModelConfig> c = LoadModelConfig("no/such/config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr("no/such/config.json"));
}

TEST(ModelConfigToJsonTest, RoundTrips) {
  ModelConfig c;
  c.hidden_size = 2048;
  c.intermediate_size = 8192;
  c.num_hidden_layers = 16;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 8;
  c.head_dim = 64;
  c.vocab_size = 128256;
  c.max_position_embeddings = 131072;
  c.rms_norm_eps = 1e-5f;
  c.rope_theta = 500000.0;
  c.tie_word_embeddings = true;
  c.bos_token_id = 128000;
  c.eos_token_ids = {128001, 128009};
  c.torch_dtype = "bfloat16";
  absl::StatusOr<ModelConfig> back = ParseModelConfig(ModelConfigToJson(c));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->hidden_size, c.hidden_size);
  EXPECT_EQ(back->intermediate_size, c.intermediate_size);
  EXPECT_EQ(back->num_hidden_layers, c.num_hidden_layers);
  EXPECT_EQ(back->num_attention_heads, c.num_attention_heads);
  EXPECT_EQ(back->num_key_value_heads, c.num_key_value_heads);
  EXPECT_EQ(back->head_dim, c.head_dim);
  EXPECT_EQ(back->vocab_size, c.vocab_size);
  EXPECT_EQ(back->max_position_embeddings, c.max_position_embeddings);
  EXPECT_EQ(back->rms_norm_eps, c.rms_norm_eps);
  EXPECT_EQ(back->rope_theta, c.rope_theta);
  EXPECT_EQ(back->tie_word_embeddings, c.tie_word_embeddings);
  EXPECT_EQ(back->bos_token_id, c.bos_token_id);
  EXPECT_EQ(back->eos_token_ids, c.eos_token_ids);
  EXPECT_EQ(back->torch_dtype, c.torch_dtype);
}

}  // namespace
}  // namespace specserve
