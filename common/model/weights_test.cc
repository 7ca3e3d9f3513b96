#include "common/model/weights.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/model/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::string TmpDir(const std::string& name) {
  const char* root = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(root != nullptr ? root : "/tmp", "/", name);
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

std::string Message(const absl::Status& s) { return std::string(s.message()); }

// ---------------------------------------------------------------------------
// The bundled checkpoints, against the shapes and parameter counts documented
// in models/README.md.

struct Bundled {
  const char* dir;
  int hidden, ffn, layers, heads, kv_heads, head_dim, vocab;
  size_t params;
};

class BundledWeightsTest : public ::testing::TestWithParam<Bundled> {};

TEST_P(BundledWeightsTest, LoadsWithDocumentedShapes) {
  const Bundled& b = GetParam();
  absl::StatusOr<ModelWeights> w =
      LoadModelWeights(std::string("models/") + b.dir);
  ASSERT_TRUE(w.ok()) << w.status();
  const size_t hidden = b.hidden, ffn = b.ffn;
  const size_t q = size_t{1} * b.heads * b.head_dim;
  const size_t kv = size_t{1} * b.kv_heads * b.head_dim;
  EXPECT_EQ(w->config.hidden_size, b.hidden);
  EXPECT_EQ(w->embed.size(), size_t{1} * b.vocab * hidden);
  EXPECT_TRUE(w->lm_head_weight.empty());  // all four are tied
  EXPECT_EQ(w->lm_head(), w->embed.data());
  EXPECT_EQ(w->final_norm.size(), hidden);
  ASSERT_EQ(w->layers.size(), static_cast<size_t>(b.layers));
  for (const LayerWeights& l : w->layers) {
    EXPECT_EQ(l.attn_norm.size(), hidden);
    EXPECT_EQ(l.wqkv.size(), (q + 2 * kv) * hidden);
    EXPECT_EQ(l.wo.size(), hidden * q);
    EXPECT_EQ(l.mlp_norm.size(), hidden);
    EXPECT_EQ(l.w_gate_up.size(), 2 * ffn * hidden);
    EXPECT_EQ(l.w_down.size(), hidden * ffn);
  }
  EXPECT_EQ(w->bytes(), b.params * sizeof(float));
  // Trained weights: finite and not all zero.
  double sum_sq = 0;
  for (float v : w->embed) {
    ASSERT_TRUE(std::isfinite(v));
    sum_sq += double{v} * v;
  }
  EXPECT_GT(sum_sq, 0.0);
}

INSTANTIATE_TEST_SUITE_P(
    Models, BundledWeightsTest,
    ::testing::Values(
        Bundled{"stories260K", 64, 172, 5, 8, 4, 8, 512, 260032},
        Bundled{"stories260K-draft", 48, 128, 2, 6, 2, 8, 512, 73968},
        Bundled{"tinystories-656K", 128, 384, 2, 8, 4, 16, 2048, 656000},
        Bundled{"tinystories-656K-draft", 64, 192, 2, 4, 2, 16, 2048, 229696}));

// The fused matrices hold the checkpoint's q, k, v (gate, up) rows in order.
TEST(LoadModelWeightsTest, FusedLayoutMatchesCheckpointTensors) {
  absl::StatusOr<ModelWeights> w = LoadModelWeights("models/stories260K");
  ASSERT_TRUE(w.ok()) << w.status();
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f =
      SafetensorsFile::Open("models/stories260K/model.safetensors");
  ASSERT_TRUE(f.ok()) << f.status();
  const int64_t h = 64, q = 64, kv = 32, ffn = 172;
  for (int i = 0; i < 5; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    std::vector<float> wq, wk, wv, gate, up;
    ASSERT_TRUE(
        ReadTensorAsFloat(**f, p + "self_attn.q_proj.weight", {q, h}, &wq)
            .ok());
    ASSERT_TRUE(
        ReadTensorAsFloat(**f, p + "self_attn.k_proj.weight", {kv, h}, &wk)
            .ok());
    ASSERT_TRUE(
        ReadTensorAsFloat(**f, p + "self_attn.v_proj.weight", {kv, h}, &wv)
            .ok());
    ASSERT_TRUE(
        ReadTensorAsFloat(**f, p + "mlp.gate_proj.weight", {ffn, h}, &gate)
            .ok());
    ASSERT_TRUE(
        ReadTensorAsFloat(**f, p + "mlp.up_proj.weight", {ffn, h}, &up).ok());
    std::vector<float> qkv = wq;
    qkv.insert(qkv.end(), wk.begin(), wk.end());
    qkv.insert(qkv.end(), wv.begin(), wv.end());
    EXPECT_EQ(w->layers[i].wqkv, qkv) << "layer " << i;
    std::vector<float> gu = gate;
    gu.insert(gu.end(), up.begin(), up.end());
    EXPECT_EQ(w->layers[i].w_gate_up, gu) << "layer " << i;
  }
}

// tinystories-656K stores only lm_head.weight; it becomes the embedding.
TEST(LoadModelWeightsTest, TiedCheckpointWithOnlyLmHead) {
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f =
      SafetensorsFile::Open("models/tinystories-656K/model.safetensors");
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ((*f)->Find("model.embed_tokens.weight"), nullptr);
  std::vector<float> lm_head;
  ASSERT_TRUE(
      ReadTensorAsFloat(**f, "lm_head.weight", {2048, 128}, &lm_head).ok());
  absl::StatusOr<ModelWeights> w = LoadModelWeights("models/tinystories-656K");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->embed, lm_head);
}

// ---------------------------------------------------------------------------
// A tiny handmade model: 2 layers, hidden 8, 2 heads of dim 4, 1 kv head,
// ffn 12, vocab 16. Each tensor's values encode (tensor id, index) so layout
// errors are visible.

constexpr int kHidden = 8, kFfn = 12, kVocab = 16, kHeadDim = 4;

std::string TinyConfig(bool tied) {
  return absl::StrCat(R"({"model_type": "llama", "hidden_size": 8,
    "intermediate_size": 12, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 16,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": )",
                      tied ? "true" : "false", "}");
}

NamedTensor Tensor(const std::string& name, std::vector<int64_t> shape,
                   float id) {
  NamedTensor t{name, shape, {}};
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  for (int64_t i = 0; i < n; ++i) t.values.push_back(id * 1000 + i);
  return t;
}

std::vector<NamedTensor> TinyTensors(bool with_lm_head) {
  std::vector<NamedTensor> ts;
  ts.push_back(Tensor("model.embed_tokens.weight", {kVocab, kHidden}, 1));
  for (int i = 0; i < 2; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    const float id = 10 * (i + 1);
    ts.push_back(Tensor(p + "input_layernorm.weight", {kHidden}, id + 0));
    ts.push_back(
        Tensor(p + "self_attn.q_proj.weight", {2 * kHeadDim, kHidden}, id + 1));
    ts.push_back(
        Tensor(p + "self_attn.k_proj.weight", {kHeadDim, kHidden}, id + 2));
    ts.push_back(
        Tensor(p + "self_attn.v_proj.weight", {kHeadDim, kHidden}, id + 3));
    ts.push_back(
        Tensor(p + "self_attn.o_proj.weight", {kHidden, 2 * kHeadDim}, id + 4));
    ts.push_back(
        Tensor(p + "post_attention_layernorm.weight", {kHidden}, id + 5));
    ts.push_back(Tensor(p + "mlp.gate_proj.weight", {kFfn, kHidden}, id + 6));
    ts.push_back(Tensor(p + "mlp.up_proj.weight", {kFfn, kHidden}, id + 7));
    ts.push_back(Tensor(p + "mlp.down_proj.weight", {kHidden, kFfn}, id + 8));
  }
  ts.push_back(Tensor("model.norm.weight", {kHidden}, 2));
  if (with_lm_head) {
    ts.push_back(Tensor("lm_head.weight", {kVocab, kHidden}, 3));
  }
  return ts;
}

// Writes a model dir; `edit` may change the tensors first.
template <typename Edit>
std::string WriteTiny(const std::string& name, bool tied, bool with_lm_head,
                      Edit edit) {
  const std::string dir = TmpDir(name);
  std::vector<NamedTensor> ts = TinyTensors(with_lm_head);
  edit(&ts);
  WriteText(dir + "/config.json", TinyConfig(tied));
  EXPECT_TRUE(WriteSafetensors(dir + "/model.safetensors", ts, {}).ok());
  return dir;
}

std::string WriteTiny(const std::string& name, bool tied, bool with_lm_head) {
  return WriteTiny(name, tied, with_lm_head, [](std::vector<NamedTensor>*) {});
}

std::vector<float> Values(float id, int n) {
  std::vector<float> v;
  for (int i = 0; i < n; ++i) v.push_back(id * 1000 + i);
  return v;
}

std::vector<float> Concat(std::vector<float> a, const std::vector<float>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(LoadModelWeightsTest, TinyModelLayout) {
  absl::StatusOr<ModelWeights> w =
      LoadModelWeights(WriteTiny("tiny", /*tied=*/true, false));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->embed, Values(1, kVocab * kHidden));
  EXPECT_EQ(w->final_norm, Values(2, kHidden));
  ASSERT_EQ(w->layers.size(), 2u);
  const LayerWeights& l = w->layers[1];
  EXPECT_EQ(l.attn_norm, Values(20, kHidden));
  EXPECT_EQ(l.wqkv,
            Concat(Concat(Values(21, 8 * kHidden), Values(22, 4 * kHidden)),
                   Values(23, 4 * kHidden)));
  EXPECT_EQ(l.wo, Values(24, kHidden * 8));
  EXPECT_EQ(l.mlp_norm, Values(25, kHidden));
  EXPECT_EQ(l.w_gate_up,
            Concat(Values(26, kFfn * kHidden), Values(27, kFfn * kHidden)));
  EXPECT_EQ(l.w_down, Values(28, kHidden * kFfn));
  const size_t params =
      kVocab * kHidden + kHidden +
      2 * (2 * kHidden + 16 * kHidden + kHidden * 8 + 3 * kFfn * kHidden);
  EXPECT_EQ(w->bytes(), params * sizeof(float));
}

TEST(LoadModelWeightsTest, OnLayerSeesEachLayerInOrderAndMayTakeIt) {
  const std::string dir = WriteTiny("on_layer", /*tied=*/true, false);
  absl::StatusOr<ModelWeights> whole = LoadModelWeights(dir);
  ASSERT_TRUE(whole.ok());
  std::vector<int> seen;
  std::vector<std::vector<float>> taken;
  LoadWeightsOptions o;
  o.on_layer = [&](const ModelWeights& partial, int layer, LayerWeights* l) {
    seen.push_back(layer);
    EXPECT_EQ(partial.embed, whole->embed);  // read before the layers
    EXPECT_EQ(&partial.layers[layer], l);
    if (layer + 1 < static_cast<int>(partial.layers.size())) {
      EXPECT_TRUE(partial.layers[layer + 1].wqkv.empty());  // not read yet
    }
    taken.push_back(std::move(l->wqkv));
    l->wqkv.clear();
    return absl::OkStatus();
  };
  absl::StatusOr<ModelWeights> w = LoadModelWeights(dir, o);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(seen, (std::vector<int>{0, 1}));
  ASSERT_EQ(taken.size(), 2u);
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(taken[l], whole->layers[l].wqkv);
    EXPECT_TRUE(w->layers[l].wqkv.empty());
    EXPECT_EQ(w->layers[l].w_down, whole->layers[l].w_down);
  }
  // An error stops loading and is returned.
  o.on_layer = [](const ModelWeights&, int layer, LayerWeights*) {
    return layer == 1 ? absl::CancelledError("stop at 1") : absl::OkStatus();
  };
  w = LoadModelWeights(dir, o);
  EXPECT_EQ(w.status().code(), absl::StatusCode::kCancelled);
}

// Every row range of a view, converted, equals the same rows of the f32
// load (ranges cross the q / k / v and gate / up block boundaries).
void ExpectViewEquals(const LinearView& v, const std::vector<float>& want,
                      const char* what) {
  ASSERT_EQ(static_cast<size_t>(v.rows() * v.cols), want.size()) << what;
  for (int64_t b = 0; b < v.rows(); ++b) {
    for (int64_t e = b + 1; e <= v.rows(); e += 3) {
      std::vector<float> got((e - b) * v.cols, -1.f);
      v.RowsToFloat(b, e, got.data());
      ASSERT_EQ(got, std::vector<float>(want.begin() + b * v.cols,
                                        want.begin() + e * v.cols))
          << what << " rows " << b << ".." << e;
    }
  }
}

TEST(LoadModelWeightsTest, LinearViewsEqualTheFloatLoad) {
  for (bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const std::string dir = WriteTiny(tied ? "views_tied" : "views_untied",
                                      tied, /*with_lm_head=*/!tied);
    absl::StatusOr<ModelWeights> whole = LoadModelWeights(dir);
    ASSERT_TRUE(whole.ok()) << whole.status();
    std::vector<int> seen;
    int embeddings_calls = 0;
    LoadWeightsOptions o;
    o.on_embeddings = [&](const ModelWeights& partial, const LinearView& e,
                          const LinearView* head) {
      ++embeddings_calls;
      EXPECT_TRUE(seen.empty());  // before the first layer
      EXPECT_EQ(partial.config.vocab_size, kVocab);
      ExpectViewEquals(e, whole->embed, "embed");
      EXPECT_EQ(head == nullptr, tied);
      if (head != nullptr) ExpectViewEquals(*head, whole->lm_head_weight, "head");
      return absl::OkStatus();
    };
    o.on_linear_layer = [&](const ModelWeights& partial, int layer,
                            const LayerLinearViews& v) {
      seen.push_back(layer);
      // on_layer's part (norms) is already read; no f32 projection is.
      EXPECT_EQ(partial.layers[layer].attn_norm, whole->layers[layer].attn_norm);
      EXPECT_TRUE(partial.layers[layer].wqkv.empty());
      EXPECT_EQ(v.wqkv.blocks.size(), 3u);
      EXPECT_EQ(v.w_gate_up.blocks.size(), 2u);
      const LayerWeights& f = whole->layers[layer];
      ExpectViewEquals(v.wqkv, f.wqkv, "wqkv");
      ExpectViewEquals(v.wo, f.wo, "wo");
      ExpectViewEquals(v.w_gate_up, f.w_gate_up, "w_gate_up");
      ExpectViewEquals(v.w_down, f.w_down, "w_down");
      return absl::OkStatus();
    };
    absl::StatusOr<ModelWeights> w = LoadModelWeights(dir, o);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ(embeddings_calls, 1);
    EXPECT_EQ(seen, (std::vector<int>{0, 1}));
    EXPECT_TRUE(w->embed.empty());
    EXPECT_TRUE(w->lm_head_weight.empty());
    EXPECT_TRUE(w->layers[1].w_down.empty());
    EXPECT_EQ(w->layers[1].mlp_norm, whole->layers[1].mlp_norm);
    EXPECT_EQ(w->final_norm, whole->final_norm);
    // A callback's error stops loading and is returned.
    seen.clear();
    o.on_linear_layer = [](const ModelWeights&, int layer,
                           const LayerLinearViews&) {
      return layer == 1 ? absl::CancelledError("stop") : absl::OkStatus();
    };
    EXPECT_EQ(LoadModelWeights(dir, o).status().code(),
              absl::StatusCode::kCancelled);
  }
}

TEST(LoadModelWeightsTest, LinearViewsKeepTheChecks) {
  // A wrong shape is caught before any callback sees a view.
  const std::string dir =
      WriteTiny("views_bad_shape", true, false, [](std::vector<NamedTensor>* ts) {
        for (NamedTensor& t : *ts) {
          if (t.name == "model.layers.1.mlp.up_proj.weight") {
            t = Tensor(t.name, {kFfn - 1, kHidden}, 27);
          }
        }
      });
  LoadWeightsOptions o;
  int layers = 0;
  o.on_embeddings = [](const ModelWeights&, const LinearView&,
                       const LinearView*) { return absl::OkStatus(); };
  o.on_linear_layer = [&](const ModelWeights&, int, const LayerLinearViews&) {
    ++layers;
    return absl::OkStatus();
  };
  absl::StatusOr<ModelWeights> w = LoadModelWeights(dir, o);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(w.status()),
              AllOf(HasSubstr("model.layers.1.mlp.up_proj.weight"),
                    HasSubstr("[11, 8]")));
  EXPECT_EQ(layers, 1);  // layer 0 only
}

TEST(LoadModelWeightsTest, UntiedNeedsAndUsesLmHead) {
  absl::StatusOr<ModelWeights> w =
      LoadModelWeights(WriteTiny("untied", /*tied=*/false, true));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->lm_head_weight, Values(3, kVocab * kHidden));
  EXPECT_EQ(w->lm_head(), w->lm_head_weight.data());
  EXPECT_EQ(w->embed, Values(1, kVocab * kHidden));

  w = LoadModelWeights(WriteTiny("untied_missing", /*tied=*/false, false));
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(w.status()), AllOf(HasSubstr("model.safetensors"),
                                         HasSubstr("'lm_head.weight'")));
}

TEST(LoadModelWeightsTest, TiedAcceptsEitherName) {
  // Only lm_head.weight stored (the tinystories-656K layout).
  absl::StatusOr<ModelWeights> w = LoadModelWeights(
      WriteTiny("tied_lm_only", true, true, [](std::vector<NamedTensor>* ts) {
        ts->erase(ts->begin());  // drop model.embed_tokens.weight
      }));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->embed, Values(3, kVocab * kHidden));
  EXPECT_TRUE(w->lm_head_weight.empty());
  // Both stored: the embedding wins, as in HF's tie_weights.
  w = LoadModelWeights(WriteTiny("tied_both", true, true));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->embed, Values(1, kVocab * kHidden));
  // Neither stored.
  w = LoadModelWeights(
      WriteTiny("tied_none", true, false,
                [](std::vector<NamedTensor>* ts) { ts->erase(ts->begin()); }));
  EXPECT_EQ(w.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(w.status()), HasSubstr("model.embed_tokens.weight"));
}

TEST(LoadModelWeightsTest, MissingTensorIsNotFound) {
  absl::StatusOr<ModelWeights> w = LoadModelWeights(
      WriteTiny("missing", true, false, [](std::vector<NamedTensor>* ts) {
        for (auto it = ts->begin(); it != ts->end(); ++it) {
          if (it->name == "model.layers.1.mlp.up_proj.weight") {
            ts->erase(it);
            break;
          }
        }
      }));
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(w.status()),
              AllOf(HasSubstr("missing/model.safetensors"),
                    HasSubstr("'model.layers.1.mlp.up_proj.weight'")));
}

TEST(LoadModelWeightsTest, WrongShapeNamesFileTensorAndShapes) {
  absl::StatusOr<ModelWeights> w = LoadModelWeights(
      WriteTiny("wrongshape", true, false, [](std::vector<NamedTensor>* ts) {
        for (NamedTensor& t : *ts) {
          if (t.name == "model.layers.0.self_attn.k_proj.weight") {
            t = Tensor(t.name, {8, 8}, 0);  // MHA shape in a GQA model
          }
        }
      }));
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(w.status()),
              AllOf(HasSubstr("wrongshape/model.safetensors"),
                    HasSubstr("'model.layers.0.self_attn.k_proj.weight'"),
                    HasSubstr("has shape [8, 8], expected [4, 8]")));
}

TEST(LoadModelWeightsTest, UnexpectedTensorsAreRejected) {
  // A third layer the config does not know about.
  absl::StatusOr<ModelWeights> w = LoadModelWeights(
      WriteTiny("extra_layer", true, false, [](std::vector<NamedTensor>* ts) {
        ts->push_back(
            Tensor("model.layers.2.input_layernorm.weight", {kHidden}, 9));
      }));
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(w.status()),
              HasSubstr("'model.layers.2.input_layernorm.weight'"));
  // A bias this engine would silently drop.
  w = LoadModelWeights(
      WriteTiny("bias", true, false, [](std::vector<NamedTensor>* ts) {
        ts->push_back(Tensor("model.layers.0.self_attn.q_proj.bias", {8}, 9));
      }));
  EXPECT_THAT(Message(w.status()), HasSubstr("q_proj.bias"));
  // RoPE inv_freq buffers of older exports are harmless.
  w = LoadModelWeights(
      WriteTiny("inv_freq", true, false, [](std::vector<NamedTensor>* ts) {
        ts->push_back(
            Tensor("model.layers.0.self_attn.rotary_emb.inv_freq", {2}, 9));
      }));
  EXPECT_TRUE(w.ok()) << w.status();
}

// Qwen2 / Qwen3 / llama-with-attention_bias variants of the tiny model.
std::string WriteTinyArch(const std::string& name, const std::string& extra,
                          const std::vector<NamedTensor>& extra_tensors) {
  const std::string dir = TmpDir(name);
  std::vector<NamedTensor> ts = TinyTensors(false);
  ts.insert(ts.end(), extra_tensors.begin(), extra_tensors.end());
  std::string config = TinyConfig(true);
  config.replace(config.find("\"model_type\": \"llama\""),
                 std::string("\"model_type\": \"llama\"").size(), extra);
  WriteText(dir + "/config.json", config);
  EXPECT_TRUE(WriteSafetensors(dir + "/model.safetensors", ts, {}).ok());
  return dir;
}

std::vector<NamedTensor> QkvBiases(int layers) {
  std::vector<NamedTensor> ts;
  for (int i = 0; i < layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".self_attn.");
    const float id = 100 + 10 * i;
    ts.push_back(Tensor(p + "q_proj.bias", {2 * kHeadDim}, id + 1));
    ts.push_back(Tensor(p + "k_proj.bias", {kHeadDim}, id + 2));
    ts.push_back(Tensor(p + "v_proj.bias", {kHeadDim}, id + 3));
  }
  return ts;
}

TEST(LoadModelWeightsTest, Qwen2QkvBiasesFuseInRowOrder) {
  absl::StatusOr<ModelWeights> w = LoadModelWeights(
      WriteTinyArch("qwen2", "\"model_type\": \"qwen2\"", QkvBiases(2)));
  ASSERT_TRUE(w.ok()) << w.status();
  for (int i = 0; i < 2; ++i) {
    const float id = 100 + 10 * i;
    EXPECT_EQ(w->layers[i].bqkv,
              Concat(Concat(Values(id + 1, 2 * kHeadDim), Values(id + 2, 4)),
                     Values(id + 3, 4)));
    EXPECT_TRUE(w->layers[i].bo.empty());
    EXPECT_TRUE(w->layers[i].q_norm.empty());
  }
  // A missing bias is NOT_FOUND naming it.
  std::vector<NamedTensor> ts = QkvBiases(2);
  ts.erase(ts.begin() + 4);  // layer 1 k_proj.bias
  w = LoadModelWeights(
      WriteTinyArch("qwen2_missing", "\"model_type\": \"qwen2\"", ts));
  EXPECT_EQ(w.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(w.status()),
              HasSubstr("'model.layers.1.self_attn.k_proj.bias'"));
  // A wrong-shaped one is INVALID_ARGUMENT naming it and both shapes.
  ts = QkvBiases(2);
  ts[0] = Tensor(ts[0].name, {kHeadDim}, 9);
  w = LoadModelWeights(
      WriteTinyArch("qwen2_shape", "\"model_type\": \"qwen2\"", ts));
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(w.status()),
              AllOf(HasSubstr("'model.layers.0.self_attn.q_proj.bias'"),
                    HasSubstr("expected [8]")));
}

TEST(LoadModelWeightsTest, Qwen3QkNormsAndNoBiases) {
  std::vector<NamedTensor> norms;
  for (int i = 0; i < 2; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".self_attn.");
    norms.push_back(Tensor(p + "q_norm.weight", {kHeadDim}, 200 + i));
    norms.push_back(Tensor(p + "k_norm.weight", {kHeadDim}, 300 + i));
  }
  absl::StatusOr<ModelWeights> w = LoadModelWeights(
      WriteTinyArch("qwen3", "\"model_type\": \"qwen3\"", norms));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->layers[1].q_norm, Values(201, kHeadDim));
  EXPECT_EQ(w->layers[1].k_norm, Values(301, kHeadDim));
  EXPECT_TRUE(w->layers[1].bqkv.empty());
  // q_norm over the whole q row (not per head) is the wrong shape.
  norms[0] = Tensor(norms[0].name, {2 * kHeadDim}, 9);
  w = LoadModelWeights(
      WriteTinyArch("qwen3_shape", "\"model_type\": \"qwen3\"", norms));
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(w.status()),
              HasSubstr("'model.layers.0.self_attn.q_norm.weight'"));
  // Biases in a Qwen3 checkpoint whose config says none are unexpected.
  std::vector<NamedTensor> both = QkvBiases(2);
  norms[0] = Tensor(norms[0].name, {kHeadDim}, 9);
  both.insert(both.end(), norms.begin(), norms.end());
  w = LoadModelWeights(
      WriteTinyArch("qwen3_bias", "\"model_type\": \"qwen3\"", both));
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(w.status()), HasSubstr("_proj.bias"));
}

TEST(LoadModelWeightsTest, LlamaAttentionBiasReadsOProjBias) {
  std::vector<NamedTensor> ts = QkvBiases(2);
  ts.push_back(Tensor("model.layers.0.self_attn.o_proj.bias", {kHidden}, 7));
  ts.push_back(Tensor("model.layers.1.self_attn.o_proj.bias", {kHidden}, 8));
  absl::StatusOr<ModelWeights> w = LoadModelWeights(WriteTinyArch(
      "llama_bias", "\"model_type\": \"llama\", \"attention_bias\": true",
      ts));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->layers[1].bo, Values(8, kHidden));
  EXPECT_EQ(w->layers[0].bqkv.size(), 16u);
}

TEST(LoadModelWeightsTest, MissingFiles) {
  absl::StatusOr<ModelWeights> w = LoadModelWeights(TmpDir("empty_model"));
  EXPECT_EQ(w.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(w.status()), HasSubstr("config.json"));
  const std::string dir = TmpDir("config_only");
  WriteText(dir + "/config.json", TinyConfig(true));
  w = LoadModelWeights(dir);
  EXPECT_EQ(w.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(w.status()), HasSubstr("model.safetensors"));
}

TEST(LoadModelWeightsTest, ShardedCheckpointLoadsTheSame) {
  const std::string dir = TmpDir("tiny_sharded");
  std::vector<NamedTensor> ts = TinyTensors(false);
  const size_t half = ts.size() / 2;
  std::vector<NamedTensor> a(ts.begin(), ts.begin() + half);
  std::vector<NamedTensor> b(ts.begin() + half, ts.end());
  ASSERT_TRUE(WriteSafetensors(dir + "/m-1.safetensors", a, {}).ok());
  ASSERT_TRUE(WriteSafetensors(dir + "/m-2.safetensors", b, {}).ok());
  std::string map;
  for (size_t i = 0; i < ts.size(); ++i) {
    absl::StrAppend(&map, i ? "," : "", "\"", ts[i].name, "\": \"",
                    i < half ? "m-1" : "m-2", ".safetensors\"");
  }
  WriteText(dir + "/model.safetensors.index.json",
            absl::StrCat("{\"metadata\": {}, \"weight_map\": {", map, "}}"));
  WriteText(dir + "/config.json", TinyConfig(true));
  absl::StatusOr<ModelWeights> sharded = LoadModelWeights(dir);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  absl::StatusOr<ModelWeights> single =
      LoadModelWeights(WriteTiny("tiny_single", true, false));
  ASSERT_TRUE(single.ok());
  EXPECT_EQ(sharded->embed, single->embed);
  EXPECT_EQ(sharded->final_norm, single->final_norm);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(sharded->layers[i].wqkv, single->layers[i].wqkv);
    EXPECT_EQ(sharded->layers[i].w_gate_up, single->layers[i].w_gate_up);
    EXPECT_EQ(sharded->layers[i].w_down, single->layers[i].w_down);
  }
}

// ---------------------------------------------------------------------------
// F16 / BF16 copies of stories260K load to within rounding of the F32 values.

class HalfCopyTest : public ::testing::TestWithParam<DType> {};

TEST_P(HalfCopyTest, LoadsWithinRounding) {
  const DType dtype = GetParam();
  const std::string src = "models/stories260K";
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f =
      SafetensorsFile::Open(src + "/model.safetensors");
  ASSERT_TRUE(f.ok()) << f.status();
  std::vector<NamedTensor> ts;
  for (const TensorInfo& info : (*f)->tensors()) {
    NamedTensor t{info.name, info.shape, {}, dtype};
    ASSERT_TRUE(ReadTensorAsFloat(**f, info.name, info.shape, &t.values).ok());
    ts.push_back(std::move(t));
  }
  const std::string dir = TmpDir(
      absl::StrCat("stories260K_", DTypeName(dtype) == "F16" ? "f16" : "bf16"));
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", ts, {}).ok());
  WriteText(dir + "/config.json", ReadText(src + "/config.json"));

  absl::StatusOr<ModelWeights> ref = LoadModelWeights(src);
  absl::StatusOr<ModelWeights> half = LoadModelWeights(dir);
  ASSERT_TRUE(ref.ok()) << ref.status();
  ASSERT_TRUE(half.ok()) << half.status();
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> hf =
      SafetensorsFile::Open(dir + "/model.safetensors");
  ASSERT_TRUE(hf.ok());
  EXPECT_EQ((*hf)->Find("model.norm.weight")->dtype, dtype);

  // Half an ulp relative: 2^-11 for fp16 (11 significant bits), 2^-8 for
  // bf16; fp16 subnormals below 2^-14 have absolute spacing 2^-24.
  const float rel =
      dtype == DType::kF16 ? std::ldexp(1.0f, -11) : std::ldexp(1.0f, -8);
  const float abs_floor = dtype == DType::kF16 ? std::ldexp(1.0f, -25) : 0.0f;
  size_t differing = 0, total = 0;
  auto compare = [&](const std::vector<float>& a, const std::vector<float>& b,
                     const char* what) {
    ASSERT_EQ(a.size(), b.size()) << what;
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_LE(std::fabs(a[i] - b[i]),
                std::max(std::fabs(a[i]) * rel, abs_floor))
          << what << "[" << i << "]: " << a[i] << " vs " << b[i];
      differing += a[i] != b[i];
      ++total;
    }
  };
  compare(ref->embed, half->embed, "embed");
  compare(ref->final_norm, half->final_norm, "final_norm");
  for (size_t i = 0; i < ref->layers.size(); ++i) {
    compare(ref->layers[i].attn_norm, half->layers[i].attn_norm, "attn_norm");
    compare(ref->layers[i].wqkv, half->layers[i].wqkv, "wqkv");
    compare(ref->layers[i].wo, half->layers[i].wo, "wo");
    compare(ref->layers[i].mlp_norm, half->layers[i].mlp_norm, "mlp_norm");
    compare(ref->layers[i].w_gate_up, half->layers[i].w_gate_up, "w_gate_up");
    compare(ref->layers[i].w_down, half->layers[i].w_down, "w_down");
  }
  EXPECT_EQ(total, 260032u);
  // The copy really was rounded (trained fp32 weights rarely fit 16 bits).
  EXPECT_GT(differing, total / 2);
}

INSTANTIATE_TEST_SUITE_P(DTypes, HalfCopyTest,
                         ::testing::Values(DType::kF16, DType::kBF16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeName(info.param));
                         });

}  // namespace
}  // namespace specserve
