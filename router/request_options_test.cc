// ResolveOptions for the speculative decoding method and its shapes (the
// other fields are covered by request_runner_test's ResolveOptionsTest).

#include "router/request_options.h"

#include <cmath>

#include <functional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "protos/router.pb.h"

namespace specserve {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(SpecDecodeMethodTest, NamesRoundTrip) {
  for (SpecDecodeMethod m :
       {SpecDecodeMethod::kDraft, SpecDecodeMethod::kNgram,
        SpecDecodeMethod::kDraftTree}) {
    auto back = ParseSpecDecodeMethod(SpecDecodeMethodName(m), "f");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, m);
  }
  EXPECT_EQ(SpecDecodeMethodName(SpecDecodeMethod::kNgram), "ngram");
  EXPECT_EQ(SpecDecodeMethodName(SpecDecodeMethod::kDraftTree), "draft_tree");
  auto bad = ParseSpecDecodeMethod("eagle", "speculative_decoding.method");
  EXPECT_TRUE(absl::IsInvalidArgument(bad.status()));
  EXPECT_THAT(bad.status().message(),
              HasSubstr("speculative_decoding.method must be one of "
                        "\"draft\", \"ngram\", \"draft_tree\", got "
                        "\"eagle\""));
}

TEST(ResolveOptionsTest, MethodDefaultsAreTheFlags) {
  auto r = ResolveOptions(v1::GenerateTextRequest(), RequestDefaults());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->spec_decode_method, SpecDecodeMethod::kDraft);
  EXPECT_EQ(r->prompt_lookup_min, 2);
  EXPECT_EQ(r->prompt_lookup_max, 5);
  EXPECT_THAT(r->tree_branching, ElementsAre(3, 2, 2, 2, 2, 2));
  EXPECT_EQ(r->tree_max_nodes, 16);
  EXPECT_EQ(r->tree_min_path_prob, kDefaultTreeMinPathProb);

  RequestDefaults d;
  d.spec_decode_method = SpecDecodeMethod::kNgram;
  d.prompt_lookup_min = 2;
  d.prompt_lookup_max = 4;
  d.tree_branching = {3, 1};
  d.tree_max_nodes = 6;
  d.tree_min_path_prob = 0.03;
  r = ResolveOptions(v1::GenerateTextRequest(), d);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->spec_decode_method, SpecDecodeMethod::kNgram);
  EXPECT_EQ(r->prompt_lookup_min, 2);
  EXPECT_EQ(r->prompt_lookup_max, 4);
  EXPECT_THAT(r->tree_branching, ElementsAre(3, 1));
  EXPECT_EQ(r->tree_max_nodes, 6);
  EXPECT_EQ(r->tree_min_path_prob, 0.03);
}

TEST(ResolveOptionsTest, RequestFieldsOverrideTheDefaults) {
  v1::GenerateTextRequest req;
  v1::SpeculativeDecodingConfig* sd = req.mutable_speculative_decoding();
  sd->set_method("draft_tree");
  sd->set_prompt_lookup_min(1);
  sd->set_prompt_lookup_max(16);
  sd->add_tree_branching(8);
  sd->add_tree_branching(2);
  sd->set_tree_max_nodes(64);
  sd->set_tree_min_path_prob(0.0);  // set, even to 0, overrides
  RequestDefaults d;
  d.tree_min_path_prob = 0.1;
  auto r = ResolveOptions(req, d);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->spec_decode_method, SpecDecodeMethod::kDraftTree);
  EXPECT_EQ(r->prompt_lookup_min, 1);
  EXPECT_EQ(r->prompt_lookup_max, 16);
  EXPECT_THAT(r->tree_branching, ElementsAre(8, 2));  // replaces the default
  EXPECT_EQ(r->tree_max_nodes, 64);
  EXPECT_EQ(r->tree_min_path_prob, 0.0);
}

// One bound alone: the other keeps its default where that stays valid.
TEST(ResolveOptionsTest, OneLookupBoundAloneKeepsThePairValid) {
  v1::GenerateTextRequest req;
  req.mutable_speculative_decoding()->set_prompt_lookup_max(1);
  auto r = ResolveOptions(req, RequestDefaults());  // defaults 2..5
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->prompt_lookup_min, 1);
  EXPECT_EQ(r->prompt_lookup_max, 1);

  req.Clear();
  req.mutable_speculative_decoding()->set_prompt_lookup_min(8);
  r = ResolveOptions(req, RequestDefaults());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->prompt_lookup_min, 8);
  EXPECT_EQ(r->prompt_lookup_max, 8);

  RequestDefaults d;
  d.prompt_lookup_min = 2;
  d.prompt_lookup_max = 6;
  req.Clear();
  req.mutable_speculative_decoding()->set_prompt_lookup_min(3);
  r = ResolveOptions(req, d);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->prompt_lookup_min, 3);
  EXPECT_EQ(r->prompt_lookup_max, 6);
}

TEST(ResolveOptionsTest, RejectsBadMethodFieldsNamingThem) {
  struct Case {
    std::function<void(v1::SpeculativeDecodingConfig*)> edit;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](auto* c) { c->set_method("medusa"); },
       "speculative_decoding.method must be one of"},
      {[](auto* c) { c->set_method(""); },
       "speculative_decoding.method must be one of"},
      {[](auto* c) { c->set_prompt_lookup_min(0); },
       "speculative_decoding.prompt_lookup_min must be >= 1, got 0"},
      {[](auto* c) {
         c->set_prompt_lookup_min(4);
         c->set_prompt_lookup_max(3);
       },
       "speculative_decoding.prompt_lookup_max must be in "
       "[prompt_lookup_min = 4, 16], got 3"},
      {[](auto* c) { c->set_prompt_lookup_max(17); },
       "speculative_decoding.prompt_lookup_max must be in"},
      {[](auto* c) {
         for (int i = 0; i < 17; ++i) c->add_tree_branching(1);
       },
       "speculative_decoding.tree_branching must be 1 to 16 depths long, "
       "got 17"},
      {[](auto* c) {
         c->add_tree_branching(2);
         c->add_tree_branching(9);
       },
       "speculative_decoding.tree_branching[1] must be in [1, 8], got 9"},
      {[](auto* c) { c->add_tree_branching(0); },
       "speculative_decoding.tree_branching[0]"},
      {[](auto* c) { c->set_tree_max_nodes(0); },
       "speculative_decoding.tree_max_nodes must be in [1, 64], got 0"},
      {[](auto* c) { c->set_tree_max_nodes(65); },
       "speculative_decoding.tree_max_nodes"},
      {[](auto* c) { c->set_tree_min_path_prob(1.0); },
       "speculative_decoding.tree_min_path_prob must be in [0, 1), got 1"},
      {[](auto* c) { c->set_tree_min_path_prob(-0.01); },
       "speculative_decoding.tree_min_path_prob"},
      {[](auto* c) { c->set_tree_min_path_prob(std::nan("")); },
       "speculative_decoding.tree_min_path_prob"},
  };
  for (const Case& c : cases) {
    v1::GenerateTextRequest req;
    c.edit(req.mutable_speculative_decoding());
    auto r = ResolveOptions(req, RequestDefaults());
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << c.message;
    EXPECT_THAT(r.status().message(), HasSubstr(c.message));
  }
}

TEST(ResolveOptionsTest, LogprobsAreCheckedAndKept) {
  v1::GenerateTextRequest req;
  auto off = ResolveOptions(req, RequestDefaults());
  ASSERT_TRUE(off.ok());
  EXPECT_FALSE(off->logprobs);
  EXPECT_EQ(off->top_logprobs, 0);
  req.mutable_sampling()->set_logprobs(true);
  req.mutable_sampling()->set_top_logprobs(20);
  auto on = ResolveOptions(req, RequestDefaults());
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_TRUE(on->logprobs);
  EXPECT_EQ(on->top_logprobs, 20);
  for (int bad : {-1, 21}) {
    req.mutable_sampling()->set_top_logprobs(bad);
    auto r = ResolveOptions(req, RequestDefaults());
    EXPECT_TRUE(absl::IsInvalidArgument(r.status()));
    EXPECT_THAT(r.status().message(),
                HasSubstr("sampling.top_logprobs must be in [0, 20]"));
  }
  req.mutable_sampling()->set_logprobs(false);
  req.mutable_sampling()->set_top_logprobs(3);
  auto r = ResolveOptions(req, RequestDefaults());
  EXPECT_TRUE(absl::IsInvalidArgument(r.status()));
  EXPECT_THAT(r.status().message(), HasSubstr("needs sampling.logprobs"));
}

TEST(ResolveOptionsTest, JsonSchemaIsCompiledAtTheEdge) {
  v1::GenerateTextRequest req;
  req.mutable_sampling()->set_json_schema(
      R"({"type": "object", "properties": {"a": {"type": "integer"}}})");
  auto ok = ResolveOptions(req, RequestDefaults());
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->sampling.json_schema(), req.sampling().json_schema());
  struct Case {
    std::string schema;
    bool json_object;
    const char* message;
  };
  for (const Case& c : std::vector<Case>{
           {R"({"type": "object", "properties": {"a": {"format": "uri"}}})",
            false, "sampling.json_schema: properties.a: 'format' is not"},
           {"[", false, "sampling.json_schema: the schema is not JSON"},
           {"", false, "sampling.json_schema is empty"},
           {R"({"type": "object"})", true, "are exclusive"}}) {
    req.mutable_sampling()->set_json_schema(c.schema);
    req.mutable_sampling()->set_json_object(c.json_object);
    auto r = ResolveOptions(req, RequestDefaults());
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << c.schema;
    EXPECT_THAT(r.status().message(), HasSubstr(c.message));
  }
}

TEST(ResolveOptionsTest, PromptLogprobsTurnPruningOff) {
  v1::GenerateTextRequest req;
  RequestDefaults d;
  d.spec_prefill = true;
  auto off = ResolveOptions(req, d);
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(off->prompt_logprobs, -1);
  EXPECT_TRUE(off->spec_prefill);
  req.mutable_sampling()->set_prompt_logprobs(0);
  auto on = ResolveOptions(req, d);
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_EQ(on->prompt_logprobs, 0);
  EXPECT_FALSE(on->spec_prefill);
  for (int bad : {-1, 21}) {
    req.mutable_sampling()->set_prompt_logprobs(bad);
    auto r = ResolveOptions(req, d);
    EXPECT_TRUE(absl::IsInvalidArgument(r.status()));
    EXPECT_THAT(r.status().message(),
                HasSubstr("sampling.prompt_logprobs must be in [0, 20]"));
  }
  req.mutable_sampling()->set_prompt_logprobs(5);
  req.mutable_speculative_prefill()->set_enabled(true);
  auto r = ResolveOptions(req, d);
  EXPECT_TRUE(absl::IsInvalidArgument(r.status()));
  EXPECT_THAT(r.status().message(), HasSubstr("needs the whole prompt"));
  req.mutable_speculative_prefill()->set_enabled(false);
  EXPECT_TRUE(ResolveOptions(req, d).ok());
}

TEST(ResolveOptionsTest, PenaltiesAreCheckedAndKept) {
  v1::GenerateTextRequest req;
  auto off = ResolveOptions(req, RequestDefaults());
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(off->sampling.presence_penalty(), 0.f);
  EXPECT_EQ(off->sampling.frequency_penalty(), 0.f);
  // Unset on the wire: the services read 0 as 1 (off).
  EXPECT_EQ(off->sampling.repetition_penalty(), 0.f);
  v1::GenerationSampling* s = req.mutable_sampling();
  s->set_presence_penalty(-2.f);
  s->set_frequency_penalty(2.f);
  s->set_repetition_penalty(0.8f);
  auto on = ResolveOptions(req, RequestDefaults());
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_EQ(on->sampling.presence_penalty(), -2.f);
  EXPECT_EQ(on->sampling.frequency_penalty(), 2.f);
  EXPECT_FLOAT_EQ(on->sampling.repetition_penalty(), 0.8f);
  (*s->mutable_logit_bias())[7] = -3.f;
  s->set_min_tokens(5);
  auto more = ResolveOptions(req, RequestDefaults());
  ASSERT_TRUE(more.ok()) << more.status();
  EXPECT_EQ(more->sampling.logit_bias().at(7), -3.f);
  EXPECT_EQ(more->min_tokens, 5);
  struct Bad {
    std::function<void(v1::GenerationSampling*)> set;
    const char* message;
  };
  const std::vector<Bad> bad = {
      {[](auto* g) { g->set_presence_penalty(2.5f); },
       "sampling.presence_penalty must be in [-2, 2]"},
      {[](auto* g) { g->set_frequency_penalty(NAN); },
       "sampling.frequency_penalty must be in [-2, 2]"},
      {[](auto* g) { g->set_repetition_penalty(0.f); },
       "sampling.repetition_penalty must be > 0"},
      {[](auto* g) { g->set_repetition_penalty(-1.f); },
       "sampling.repetition_penalty must be > 0"},
      {[](auto* g) { g->set_repetition_penalty(INFINITY); },
       "sampling.repetition_penalty must be a finite number > 0"},
      {[](auto* g) { (*g->mutable_logit_bias())[4] = 100.5f; },
       "sampling.logit_bias[4] must be in [-100, 100]"},
      {[](auto* g) { (*g->mutable_logit_bias())[-4] = 1.f; },
       "sampling.logit_bias ids must be >= 0"},
      {[](auto* g) {
         for (int i = 0; i <= kMaxLogitBias; ++i) {
           (*g->mutable_logit_bias())[i] = 1.f;
         }
       },
       "sampling.logit_bias has 1025 ids; at most 1024"},
      {[](auto* g) {
         g->set_max_new_tokens(8);
         g->set_min_tokens(9);
       },
       "sampling.min_tokens must be in [0, max_new_tokens = 8], got 9"},
      {[](auto* g) { g->set_min_p(1.5f); },
       "sampling.min_p must be in [0, 1]"},
      {[](auto* g) { g->set_min_tokens(-1); },
       "sampling.min_tokens must be in [0, max_new_tokens"},
  };
  for (const Bad& b : bad) {
    v1::GenerateTextRequest r;
    b.set(r.mutable_sampling());
    auto got = ResolveOptions(r, RequestDefaults());
    EXPECT_TRUE(absl::IsInvalidArgument(got.status())) << b.message;
    EXPECT_THAT(got.status().message(), HasSubstr(b.message));
  }
}

TEST(ValidateDefaultsTest, NamesTheBadDefault) {
  RequestDefaults d;
  d.prompt_lookup_min = 6;
  d.prompt_lookup_max = 5;
  absl::Status s = ValidateDefaults(d);
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_THAT(s.message(), HasSubstr("prompt_lookup_max"));
  d = RequestDefaults();
  d.tree_branching.clear();
  EXPECT_THAT(ValidateDefaults(d).message(), HasSubstr("tree_branching"));
  d = RequestDefaults();
  d.tree_max_nodes = 100;
  EXPECT_THAT(ValidateDefaults(d).message(), HasSubstr("tree_max_nodes"));
  d = RequestDefaults();
  d.tree_min_path_prob = 2;
  EXPECT_THAT(ValidateDefaults(d).message(), HasSubstr("tree_min_path_prob"));
  EXPECT_TRUE(ValidateDefaults(RequestDefaults()).ok());
}

}  // namespace
}  // namespace specserve
