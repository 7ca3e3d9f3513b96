#include "common/model/synthetic.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/model/config.h"
#include "common/model/safetensors.h"
#include "common/model/weights.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string TmpDir(const std::string& name) {
  const char* root = std::getenv("TEST_TMPDIR");
  return absl::StrCat(root != nullptr ? root : "/tmp", "/", name);
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

TEST(PresetTest, NamesAndConfigs) {
  EXPECT_THAT(PresetNames(),
              ElementsAre("llama2-15m", "llama2-110m", "llama-3.2-1b",
                          "llama-3.2-3b", "llama-3.1-8b", "qwen2.5-0.5b",
                          "qwen2.5-7b", "qwen3-0.6b", "qwen3-8b",
                          "llama-3-draft-small", "llama-tiny",
                          "llama3-tiny", "llama-linear-tiny", "qwen2-tiny",
                          "qwen2-yarn-tiny", "qwen3-tiny", "llama-bias-tiny",
                          "llama-3.2-1b-tiny", "llama-3.1-8b-tiny"));
  for (const std::string& name : PresetNames()) {
    absl::StatusOr<ModelConfig> c = PresetConfig(name);
    ASSERT_TRUE(c.ok()) << name;
    // Every preset is a config the loader accepts.
    absl::StatusOr<ModelConfig> back = ParseModelConfig(ModelConfigToJson(*c));
    ASSERT_TRUE(back.ok()) << name << ": " << back.status();
    EXPECT_EQ(back->head_dim, c->head_dim) << name;
    EXPECT_EQ(back->model_type, c->model_type) << name;
    EXPECT_EQ(back->rope_scaling.type, c->rope_scaling.type) << name;
  }
  absl::StatusOr<ModelConfig> c = PresetConfig("llama-3.2-1b");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->hidden_size, 2048);
  EXPECT_EQ(c->num_hidden_layers, 16);
  EXPECT_EQ(c->num_attention_heads, 32);
  EXPECT_EQ(c->num_key_value_heads, 8);
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_EQ(c->intermediate_size, 8192);
  EXPECT_EQ(c->vocab_size, 128256);
  EXPECT_EQ(c->max_position_embeddings, 131072);
  EXPECT_DOUBLE_EQ(c->rope_theta, 500000.0);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->rope_scaling.type, "llama3");
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 32.0);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 8192);
  c = PresetConfig("llama-3.1-8b");
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 8.0);
  c = PresetConfig("qwen2.5-7b");
  EXPECT_EQ(c->model_type, "qwen2");
  EXPECT_TRUE(c->has_qkv_bias());
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->vocab_size, 152064);
  c = PresetConfig("qwen3-0.6b");
  EXPECT_TRUE(c->has_qk_norm());
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->hidden_size, 1024);
  EXPECT_DOUBLE_EQ(c->rope_theta, 1000000.0);

  absl::StatusOr<ModelConfig> bad = PresetConfig("gpt-2");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("llama2-15m, llama2-110m"));
}

// Published parameter counts of the real models (HF model cards /
// safetensors metadata) and llama2.c's stories models.
TEST(PresetTest, ParameterCountsMatchTheRealModels) {
  EXPECT_EQ(CountParameters(*PresetConfig("llama-3.2-1b")), 1235814400);
  EXPECT_EQ(CountParameters(*PresetConfig("llama-3.1-8b")), 8030261248);
  EXPECT_EQ(CountParameters(*PresetConfig("llama-3.2-3b")), 3212749824);
  EXPECT_EQ(CountParameters(*PresetConfig("qwen2.5-0.5b")), 494032768);
  EXPECT_EQ(CountParameters(*PresetConfig("qwen2.5-7b")), 7615616512);
  EXPECT_EQ(CountParameters(*PresetConfig("qwen3-0.6b")), 596049920);
  EXPECT_EQ(CountParameters(*PresetConfig("qwen3-8b")), 8190735360);
  const int64_t m15 = CountParameters(*PresetConfig("llama2-15m"));
  const int64_t m110 = CountParameters(*PresetConfig("llama2-110m"));
  EXPECT_GT(m15, 15000000);
  EXPECT_LT(m15, 15500000);
  EXPECT_GT(m110, 109000000);
  EXPECT_LT(m110, 111000000);
}

// Every tiny preset writes a checkpoint the loader reads back with its
// biases and q/k norms, in F32 and BF16.
TEST(SyntheticTest, TinyPresetsLoadWithTheirArchitectureTensors) {
  for (const std::string name :
       {"llama-tiny", "llama3-tiny", "llama-linear-tiny", "qwen2-tiny",
        "qwen2-yarn-tiny", "qwen3-tiny", "llama-bias-tiny",
        "llama-3.2-1b-tiny", "llama-3.1-8b-tiny"}) {
    for (const std::string dtype : {"F32", "BF16"}) {
      SCOPED_TRACE(name + " " + dtype);
      const std::string dir = TmpDir(name + "-" + dtype);
      ASSERT_TRUE(WriteSyntheticCheckpoint(name, dir, 3, dtype).ok());
      absl::StatusOr<ModelConfig> c = PresetConfig(name);
      absl::StatusOr<ModelWeights> w = LoadModelWeights(dir);
      ASSERT_TRUE(w.ok()) << w.status();
      EXPECT_EQ(w->bytes(), static_cast<size_t>(CountParameters(*c)) * 4);
      EXPECT_EQ(w->config.rope_scaling.type, c->rope_scaling.type);
      for (const LayerWeights& l : w->layers) {
        EXPECT_EQ(l.bqkv.size(),
                  c->has_qkv_bias() ? static_cast<size_t>(c->qkv_dim()) : 0u);
        EXPECT_EQ(l.q_norm.size(), c->has_qk_norm() ? 32u : 0u);
        EXPECT_EQ(l.k_norm.size(), l.q_norm.size());
        EXPECT_EQ(l.bo.size(), c->has_o_bias() ? 64u : 0u);
        // q/k norm weights scatter around 1 (not all ones).
        if (!l.q_norm.empty()) {
          EXPECT_NE(l.q_norm, l.k_norm);
        }
      }
    }
  }
}

TEST(SyntheticTest, Llama2_15mLoadsWithPresetShapes) {
  const std::string dir = TmpDir("llama2-15m");
  ASSERT_TRUE(WriteSyntheticCheckpoint("llama2-15m", dir, 0).ok());
  absl::StatusOr<ModelConfig> preset = PresetConfig("llama2-15m");
  absl::StatusOr<ModelWeights> w = LoadModelWeights(dir);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->config.hidden_size, 288);
  EXPECT_EQ(w->config.num_hidden_layers, 6);
  EXPECT_EQ(w->config.num_attention_heads, 6);
  EXPECT_EQ(w->config.num_key_value_heads, 6);
  EXPECT_EQ(w->config.intermediate_size, 768);
  EXPECT_EQ(w->config.vocab_size, 32000);
  EXPECT_EQ(w->config.max_position_embeddings, 2048);
  EXPECT_TRUE(w->config.tie_word_embeddings);
  EXPECT_EQ(w->embed.size(), 32000u * 288);
  ASSERT_EQ(w->layers.size(), 6u);
  for (const LayerWeights& l : w->layers) {
    EXPECT_EQ(l.wqkv.size(), 3u * 288 * 288);
    EXPECT_EQ(l.wo.size(), 288u * 288);
    EXPECT_EQ(l.w_gate_up.size(), 2u * 768 * 288);
    EXPECT_EQ(l.w_down.size(), 288u * 768);
    for (float v : l.attn_norm) ASSERT_EQ(v, 1.0f);
    for (float v : l.mlp_norm) ASSERT_EQ(v, 1.0f);
  }
  for (float v : w->final_norm) ASSERT_EQ(v, 1.0f);
  EXPECT_EQ(w->bytes(), static_cast<size_t>(CountParameters(*preset)) * 4);

  // The file is exactly header + 4 bytes per parameter.
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f =
      SafetensorsFile::Open(dir + "/model.safetensors");
  ASSERT_TRUE(f.ok());
  EXPECT_EQ((*f)->header().data_size,
            static_cast<uint64_t>(CountParameters(*preset)) * 4);
  EXPECT_EQ((*f)->metadata().at("specserve_synthetic"), "llama2-15m");

  // Weights look like N(0, 0.02^2): Irwin-Hall(4) is bounded by
  // 2 * sqrt(3) standard deviations.
  double sum = 0, sum_sq = 0, max_abs = 0;
  for (float v : w->embed) {
    sum += v;
    sum_sq += double{v} * v;
    max_abs = std::max(max_abs, std::fabs(double{v}));
  }
  const double n = w->embed.size();
  const double mean = sum / n;
  const double stddev = std::sqrt(sum_sq / n - mean * mean);
  EXPECT_NEAR(mean, 0.0, 1e-4);
  EXPECT_NEAR(stddev, 0.02, 0.0002);
  EXPECT_LE(max_abs, 0.02 * 2 * std::sqrt(3.0) + 1e-6);
  EXPECT_GT(max_abs, 0.05);
  // Tensors get different streams.
  EXPECT_NE(w->layers[0].wqkv[0], w->layers[1].wqkv[0]);
  EXPECT_NE(std::vector<float>(w->layers[0].wo.begin(),
                               w->layers[0].wo.begin() + 100),
            std::vector<float>(w->layers[0].w_down.begin(),
                               w->layers[0].w_down.begin() + 100));

  // A BF16 copy with the same seed holds the F32 values rounded to bf16.
  const std::string bf_dir = TmpDir("llama2-15m-bf16");
  ASSERT_TRUE(WriteSyntheticCheckpoint("llama2-15m", bf_dir, 0, "BF16").ok());
  absl::StatusOr<ModelWeights> bf = LoadModelWeights(bf_dir);
  ASSERT_TRUE(bf.ok()) << bf.status();
  EXPECT_EQ(bf->config.torch_dtype, "bfloat16");
  ASSERT_EQ(bf->embed.size(), w->embed.size());
  for (size_t i = 0; i < w->embed.size(); i += 97) {
    ASSERT_EQ(bf->embed[i], BFloat16ToFloat(FloatToBFloat16(w->embed[i])));
  }
  for (size_t i = 0; i < w->layers[5].w_gate_up.size(); i += 31) {
    ASSERT_EQ(bf->layers[5].w_gate_up[i],
              BFloat16ToFloat(FloatToBFloat16(w->layers[5].w_gate_up[i])));
  }
}

ModelConfig SmallConfig(bool tied) {
  ModelConfig c;
  c.hidden_size = 512;
  c.intermediate_size = 96;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.vocab_size = 1000;  // embed 512K elements: spans write chunks
  c.tie_word_embeddings = tied;
  c.eos_token_ids = {2};
  return c;
}

TEST(SyntheticTest, SameSeedSameBytesOtherSeedOtherBytes) {
  const ModelConfig c = SmallConfig(/*tied=*/false);
  ASSERT_TRUE(
      WriteSyntheticCheckpointForConfig(c, TmpDir("s1"), 7, DType::kF32).ok());
  ASSERT_TRUE(
      WriteSyntheticCheckpointForConfig(c, TmpDir("s2"), 7, DType::kF32).ok());
  ASSERT_TRUE(
      WriteSyntheticCheckpointForConfig(c, TmpDir("s3"), 8, DType::kF32).ok());
  const std::string a = ReadBytes(TmpDir("s1") + "/model.safetensors");
  const std::string b = ReadBytes(TmpDir("s2") + "/model.safetensors");
  const std::string other = ReadBytes(TmpDir("s3") + "/model.safetensors");
  ASSERT_GT(a.size(), 4u * 1000 * 512);
  EXPECT_TRUE(a == b);
  EXPECT_EQ(a.size(), other.size());
  EXPECT_FALSE(a == other);
  absl::StatusOr<ModelWeights> w = LoadModelWeights(TmpDir("s1"));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->lm_head_weight.size(), 1000u * 512);
  EXPECT_NE(w->lm_head_weight, w->embed);
  EXPECT_EQ(w->bytes(), static_cast<size_t>(CountParameters(c)) * 4);
}

TEST(SyntheticTest, Errors) {
  absl::Status s = WriteSyntheticCheckpoint("nope", TmpDir("e1"), 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  s = WriteSyntheticCheckpoint("llama2-15m", TmpDir("e2"), 0, "I8");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("I8"));
  s = WriteSyntheticCheckpoint("llama2-15m", TmpDir("e3"), 0, "fp32");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  ModelConfig bad = SmallConfig(true);
  bad.num_key_value_heads = 3;
  s = WriteSyntheticCheckpointForConfig(bad, TmpDir("e4"), 0, DType::kF32);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  // A path under a regular file cannot be created.
  std::ofstream(TmpDir("plainfile")).put('x');
  s = WriteSyntheticCheckpoint("llama2-15m", TmpDir("plainfile") + "/sub", 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace specserve
