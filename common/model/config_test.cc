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
  // Llama-3.2-1B-Instruct's config.json.
  absl::StatusOr<ModelConfig> c = ParseModelConfig(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "attention_bias": false, "attention_dropout": 0.0, "mlp_bias": false,
    "hidden_act": "silu", "initializer_range": 0.02, "pretraining_tp": 1,
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0,
      "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
      "rope_type": "llama3"},
    "tie_word_embeddings": true, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16"})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->gqa_group(), 4);
  EXPECT_EQ(c->qkv_dim(), (32 + 16) * 64);
  EXPECT_DOUBLE_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->bos_token_id, 128000);
  EXPECT_THAT(c->eos_token_ids, ElementsAre(128001, 128008, 128009));
  EXPECT_EQ(c->torch_dtype, "bfloat16");
  EXPECT_EQ(c->rope_scaling.type, "llama3");
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 32.0);
  EXPECT_DOUBLE_EQ(c->rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c->rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_FALSE(c->has_qkv_bias());
  EXPECT_FALSE(c->has_o_bias());
  EXPECT_FALSE(c->has_qk_norm());
}

TEST(ParseModelConfigTest, Qwen2HasQkvBiasWithoutOBias) {
  // Qwen2.5-0.5B-Instruct's config.json (no attention_bias key: Qwen2's
  // q/k/v always have biases).
  absl::StatusOr<ModelConfig> c = ParseModelConfig(R"({
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
    "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
    "max_position_embeddings": 32768, "max_window_layers": 21,
    "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": true,
    "torch_dtype": "bfloat16", "transformers_version": "4.43.1",
    "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model_type, "qwen2");
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_TRUE(c->has_qkv_bias());
  EXPECT_FALSE(c->has_o_bias());
  EXPECT_FALSE(c->has_qk_norm());
  EXPECT_TRUE(c->rope_scaling.type.empty());
}

TEST(ParseModelConfigTest, Qwen3HasQkNormAndExplicitHeadDim) {
  // Qwen3-0.6B's config.json.
  absl::StatusOr<ModelConfig> c = ParseModelConfig(R"({
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": false,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28,
    "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": null,
    "rope_theta": 1000000, "sliding_window": null, "tie_word_embeddings": true,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 128);  // != hidden / heads = 64
  EXPECT_TRUE(c->has_qk_norm());
  EXPECT_FALSE(c->has_qkv_bias());
  EXPECT_FALSE(c->has_o_bias());
}

TEST(ParseModelConfigTest, LlamaAttentionBiasMeansQkvAndOBiases) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(R"({
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
    "num_attention_heads": 4, "vocab_size": 10, "attention_bias": true})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->has_qkv_bias());
  EXPECT_TRUE(c->has_o_bias());
}

TEST(ParseModelConfigTest, YarnDefaultsAndLegacyTypeKey) {
  // Qwen's documented YaRN block (legacy "type" key, no betas).
  absl::StatusOr<ModelConfig> c = ParseModelConfig(R"({
    "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 10,
    "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768,
                     "type": "yarn"}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, "yarn");
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 4.0);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 32768);
  EXPECT_DOUBLE_EQ(c->rope_scaling.beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(c->rope_scaling.beta_slow, 1.0);
  EXPECT_DOUBLE_EQ(c->rope_scaling.attention_factor, 0.0);
  EXPECT_TRUE(c->rope_scaling.truncate);
}

TEST(ParseModelConfigTest, TransformersV5RopeParameters) {
  // transformers >= 5 writes rope_theta and the scaling under one key.
  absl::StatusOr<ModelConfig> c = ParseModelConfig(R"({
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
    "num_attention_heads": 4, "vocab_size": 10,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3",
      "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_DOUBLE_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->rope_scaling.type, "llama3");
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 32.0);
  c = ParseModelConfig(R"({
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
    "num_attention_heads": 4, "vocab_size": 10,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_DOUBLE_EQ(c->rope_theta, 1000000.0);
  EXPECT_TRUE(c->rope_scaling.type.empty());
}

TEST(ParseModelConfigTest, DefaultRopeTypeIsNoScaling) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(R"({
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
    "num_attention_heads": 4, "vocab_size": 10,
    "rope_scaling": {"rope_type": "default"}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->rope_scaling.type.empty());
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
        BadCase{"RopeScalingLlama3MissingFields",
                "{" BASE ", \"rope_scaling\": {\"factor\": 32.0, "
                "\"rope_type\": \"llama3\"}}",
                "rope_scaling.original_max_position_embeddings"},
        BadCase{"RopeScalingLlama3MissingLowFreq",
                "{" BASE ", \"rope_scaling\": {\"factor\": 32.0, "
                "\"rope_type\": \"llama3\", "
                "\"original_max_position_embeddings\": 8192}}",
                "rope_scaling.low_freq_factor"},
        BadCase{"RopeScalingDynamic",
                "{" BASE ", \"rope_scaling\": {\"type\": \"dynamic\", "
                "\"factor\": 2.0}}",
                "rope_scaling type 'dynamic' is not supported"},
        BadCase{"RopeScalingLongrope",
                "{" BASE ", \"rope_scaling\": {\"rope_type\": "
                "\"longrope\", \"factor\": 2.0}}",
                "rope_scaling type 'longrope' is not supported"},
        BadCase{"RopeScalingLinearNoFactor",
                "{" BASE ", \"rope_scaling\": {\"rope_type\": "
                "\"linear\"}}",
                "rope_scaling.factor"},
        BadCase{"RopeScalingZeroFactor",
                "{" BASE ", \"rope_scaling\": {\"rope_type\": "
                "\"linear\", \"factor\": 0}}",
                "'rope_scaling.factor' = 0"},
        BadCase{"YarnThetaOne",
                "{" BASE ", \"rope_theta\": 1.0, \"rope_scaling\": "
                "{\"rope_type\": \"yarn\", \"factor\": 4.0}}",
                "must exceed 1 for rope_scaling type 'yarn'"},
        BadCase{"YarnNegativeMscale",
                "{" BASE ", \"rope_scaling\": {\"rope_type\": \"yarn\", "
                "\"factor\": 4.0, \"mscale\": -20}}",
                "'rope_scaling.mscale'"},
        BadCase{"RopeParametersAndScaling",
                "{" BASE ", \"rope_scaling\": {\"rope_type\": \"linear\", "
                "\"factor\": 2.0}, \"rope_parameters\": "
                "{\"rope_type\": \"default\"}}",
                "both 'rope_scaling' and 'rope_parameters'"},
        BadCase{"RopeParametersMissingFactor",
                "{" BASE ", \"rope_parameters\": {\"rope_type\": "
                "\"yarn\", \"rope_theta\": 10000.0}}",
                "'rope_parameters.factor'"},
        BadCase{"RopeScalingNotObject", "{" BASE ", \"rope_scaling\": 2}",
                "'rope_scaling' must be an object"},
        BadCase{"SlidingWindowInUse",
                "{" BASE ", \"model_type\": \"qwen2\", "
                "\"use_sliding_window\": true, \"sliding_window\": 4096}",
                "'use_sliding_window'"},
        BadCase{"MlpBias", "{" BASE ", \"mlp_bias\": true}", "'mlp_bias'"},
        BadCase{"PartialRotary", "{" BASE ", \"partial_rotary_factor\": 0.5}",
                "'partial_rotary_factor'"},
        BadCase{"Qwen2Moe", "{" BASE ", \"model_type\": \"qwen2_moe\"}",
                "model_type 'qwen2_moe' is not supported"},
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
        BadCase{"AttentionBiasNotBool",
                "{" BASE ", \"attention_bias\": 1}", "'attention_bias'"}),
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
  EXPECT_EQ(back->model_type, "llama");
  EXPECT_TRUE(back->rope_scaling.type.empty());
}

TEST(ModelConfigToJsonTest, RoundTripsArchitectureAndRopeScaling) {
  ModelConfig base;
  base.hidden_size = 64;
  base.intermediate_size = 128;
  base.num_hidden_layers = 2;
  base.num_attention_heads = 4;
  base.num_key_value_heads = 2;
  base.head_dim = 32;
  base.vocab_size = 100;
  base.max_position_embeddings = 4096;
  base.eos_token_ids = {2};

  ModelConfig llama3 = base;
  llama3.rope_scaling.type = "llama3";
  llama3.rope_scaling.factor = 8.0;
  llama3.rope_scaling.low_freq_factor = 1.5;
  llama3.rope_scaling.high_freq_factor = 3.0;
  llama3.rope_scaling.original_max_position_embeddings = 1024;
  llama3.attention_bias = true;
  ModelConfig yarn = base;
  yarn.model_type = "qwen2";
  yarn.rope_scaling.type = "yarn";
  yarn.rope_scaling.factor = 4.0;
  yarn.rope_scaling.original_max_position_embeddings = 1024;
  yarn.rope_scaling.beta_fast = 16.0;
  yarn.rope_scaling.beta_slow = 2.0;
  yarn.rope_scaling.attention_factor = 1.25;
  yarn.rope_scaling.mscale = 0.5;
  yarn.rope_scaling.mscale_all_dim = 0.75;
  yarn.rope_scaling.truncate = false;
  ModelConfig linear = base;
  linear.model_type = "qwen3";
  linear.rope_scaling.type = "linear";
  linear.rope_scaling.factor = 2.0;

  for (const ModelConfig& c : {llama3, yarn, linear}) {
    SCOPED_TRACE(c.model_type);
    absl::StatusOr<ModelConfig> back = ParseModelConfig(ModelConfigToJson(c));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->model_type, c.model_type);
    EXPECT_EQ(back->head_dim, c.head_dim);
    EXPECT_EQ(back->has_qkv_bias(), c.has_qkv_bias());
    EXPECT_EQ(back->has_o_bias(), c.has_o_bias());
    EXPECT_EQ(back->has_qk_norm(), c.has_qk_norm());
    const RopeScaling& a = back->rope_scaling;
    const RopeScaling& b = c.rope_scaling;
    EXPECT_EQ(a.type, b.type);
    EXPECT_EQ(a.factor, b.factor);
    EXPECT_EQ(a.low_freq_factor, b.low_freq_factor);
    EXPECT_EQ(a.high_freq_factor, b.high_freq_factor);
    EXPECT_EQ(a.original_max_position_embeddings,
              b.original_max_position_embeddings);
    EXPECT_EQ(a.beta_fast, b.beta_fast);
    EXPECT_EQ(a.beta_slow, b.beta_slow);
    EXPECT_EQ(a.attention_factor, b.attention_factor);
    EXPECT_EQ(a.mscale, b.mscale);
    EXPECT_EQ(a.mscale_all_dim, b.mscale_all_dim);
    EXPECT_EQ(a.truncate, b.truncate);
  }
}

}  // namespace
}  // namespace specserve
