#include "router/output_processor.h"

#include <initializer_list>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/time.h"
#include "common/tokenizer/tokenizer.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "protos/target.pb.h"
#include "router/metrics.h"

namespace specserve {
namespace {

v1::GenerateResponse Round(int drafts, int accepted,
                           std::initializer_list<int> tokens) {
  v1::GenerateResponse r;
  r.set_num_drafts(drafts);
  r.set_num_accepted(accepted);
  r.mutable_token_ids()->Add(tokens.begin(), tokens.end());
  return r;
}

// The rounds of a request counted one message per round, and the same
// rounds with the last three coalesced into one message (as a continuous
// stream sends the rounds that ended while its previous message was being
// written): the same tokens, forwards, drafts, accepted-per-position and
// metrics.
TEST(OutputProcessorTest, CoalescedRoundsCountAsTheirRounds) {
  const absl::Time start = absl::UnixEpoch();
  auto run = [&](bool coalesce, prometheus::Registry* registry) {
    RouterMetrics metrics(*registry);
    OutputProcessor out(/*tokenizer=*/nullptr, {}, start, &metrics);
    out.SetSpecDecodeMethod("ngram");
    v1::GenerateTextChunk chunk;
    int chunks = 0;
    auto add = [&](const v1::GenerateResponse& r) {
      EXPECT_TRUE(out.AddRound(r, start + absl::Milliseconds(1), &chunk).ok());
      ++chunks;
    };
    add(Round(0, 0, {5}));        // the prefill's token
    add(Round(4, 2, {6, 7, 8}));  // a drafted round
    const v1::GenerateResponse a = Round(0, 0, {9});
    const v1::GenerateResponse b = Round(3, 3, {10, 11, 12, 13});
    v1::GenerateResponse c = Round(2, 0, {14});
    c.set_finish_reason("length");
    if (!coalesce) {
      add(a);
      add(b);
      add(c);
    } else {
      v1::GenerateResponse m = Round(5, 3, {9, 10, 11, 12, 13, 14});
      m.set_finish_reason("length");
      for (const v1::GenerateResponse* r :
           std::initializer_list<const v1::GenerateResponse*>{&a, &b, &c}) {
        v1::RoundCounts* rc = m.add_rounds();
        rc->set_num_drafts(r->num_drafts());
        rc->set_num_accepted(r->num_accepted());
        rc->set_num_tokens(r->token_ids_size());
      }
      add(m);
      EXPECT_EQ(chunk.token_ids_size(), 6);  // the message's tokens
    }
    EXPECT_TRUE(out.finished());
    v1::GenerateTextChunk last;
    out.Finish(/*prompt_tokens=*/10, /*kept_tokens=*/10, "",
               start + absl::Milliseconds(2), &last);
    EXPECT_EQ(chunks, coalesce ? 3 : 5);
    return last;
  };
  prometheus::Registry r1, r2;
  const v1::GenerateTextChunk one = run(false, &r1);
  const v1::GenerateTextChunk many = run(true, &r2);
  for (const v1::GenerateTextChunk* c : {&one, &many}) {
    const v1::GenerationStats& s = c->stats();
    EXPECT_EQ(c->usage().completion_tokens(), 10);
    EXPECT_EQ(c->finish_reason(), "length");
    EXPECT_EQ(s.num_target_forwards(), 5);
    EXPECT_EQ(s.num_drafts(), 3);  // rounds that carried drafts
    EXPECT_EQ(s.num_draft_tokens(), 9);
    EXPECT_EQ(s.num_accepted_tokens(), 5);
    EXPECT_DOUBLE_EQ(s.tokens_per_target_forward(), 2.0);
    EXPECT_DOUBLE_EQ(s.mean_acceptance_length(), 1.0 + 5.0 / 3);
    ASSERT_EQ(s.accepted_per_position_size(), 4);
    EXPECT_EQ(s.accepted_per_position(0), 2);
    EXPECT_EQ(s.accepted_per_position(1), 2);
    EXPECT_EQ(s.accepted_per_position(2), 1);
    EXPECT_EQ(s.accepted_per_position(3), 0);
  }
  EXPECT_EQ(prometheus::TextSerializer().Serialize(r1.Collect()),
            prometheus::TextSerializer().Serialize(r2.Collect()));
}

// Logprobs go with their tokens into the chunks and the unary response,
// and a stop string drops the tokens after it with their logprobs.
TEST(OutputProcessorTest, LogprobsStayAlignedWithTokens) {
  auto tok = LoadTokenizer("models/stories260K");
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::vector<int> ids = *(*tok)->Encode("Once upon a time there", false);
  ASSERT_GE(ids.size(), 5u);
  v1::GenerateResponse r;
  for (size_t i = 0; i < ids.size(); ++i) {
    r.add_token_ids(ids[i]);
    v1::TokenLogprob* lp = r.add_logprobs();
    lp->set_logprob(-static_cast<float>(i));
    v1::TopLogprob* t = lp->add_top();
    t->set_id(ids[i]);
    t->set_logprob(-static_cast<float>(i));
  }
  {
    OutputProcessor out(tok->get(), {}, absl::UnixEpoch(), nullptr);
    v1::GenerateTextChunk chunk;
    ASSERT_TRUE(out.AddRound(r, absl::UnixEpoch(), &chunk).ok());
    ASSERT_EQ(chunk.logprobs_size(), chunk.token_ids_size());
    v1::GenerateTextResponse response;
    AppendChunk(chunk, &response);
    AppendChunk(chunk, &response);
    ASSERT_EQ(response.logprobs_size(), 2 * static_cast<int>(ids.size()));
    for (int i = 0; i < response.logprobs_size(); ++i) {
      EXPECT_EQ(response.logprobs(i).logprob(),
                -static_cast<float>(i % ids.size()));
      EXPECT_EQ(response.logprobs(i).top(0).id(), response.token_ids(i));
    }
  }
  {  // " a" ends the text: "a" and what follows are dropped.
    OutputProcessor out(tok->get(), {" a"}, absl::UnixEpoch(), nullptr);
    v1::GenerateTextChunk chunk;
    ASSERT_TRUE(out.AddRound(r, absl::UnixEpoch(), &chunk).ok());
    EXPECT_TRUE(out.finished());
    EXPECT_LT(chunk.token_ids_size(), static_cast<int>(ids.size()));
    EXPECT_EQ(chunk.logprobs_size(), chunk.token_ids_size());
  }
  {  // min_tokens: " a" inside the first tokens does not count.
    OutputProcessor out(tok->get(), {" a"}, absl::UnixEpoch(), nullptr,
                        static_cast<int>(ids.size()));
    v1::GenerateTextChunk chunk;
    ASSERT_TRUE(out.AddRound(r, absl::UnixEpoch(), &chunk).ok());
    EXPECT_FALSE(out.finished());
    EXPECT_EQ(chunk.token_ids_size(), static_cast<int>(ids.size()));
    // Past min_tokens it does.
    v1::GenerateResponse more;
    for (int id : ids) more.add_token_ids(id);
    ASSERT_TRUE(out.AddRound(more, absl::UnixEpoch(), &chunk).ok());
    EXPECT_TRUE(out.finished());
    EXPECT_TRUE(out.stopped_by_string());
  }
  {  // min_tokens ends after "Once upon": "upon a" straddles the boundary
     // and still ends the text (vLLM's rule); "Once" alone does not.
    int upon = 0;
    for (size_t k = 1; k <= ids.size() && upon == 0; ++k) {
      auto text = (*tok)->Decode(absl::MakeConstSpan(ids.data(), k));
      ASSERT_TRUE(text.ok());
      if (absl::EndsWith(*text, "upon")) upon = static_cast<int>(k);
    }
    ASSERT_GT(upon, 0);
    OutputProcessor out(tok->get(), {"upon a", "Once"}, absl::UnixEpoch(),
                        nullptr, upon);
    v1::GenerateTextChunk chunk;
    ASSERT_TRUE(out.AddRound(r, absl::UnixEpoch(), &chunk).ok());
    EXPECT_TRUE(out.stopped_by_string());
    EXPECT_EQ(chunk.text(), "Once ");
    EXPECT_EQ(chunk.token_ids_size(), upon + 1);  // up to the one ending it
  }
  {  // A target that sent none: none.
    OutputProcessor out(tok->get(), {}, absl::UnixEpoch(), nullptr);
    v1::GenerateTextChunk chunk;
    r.clear_logprobs();
    ASSERT_TRUE(out.AddRound(r, absl::UnixEpoch(), &chunk).ok());
    EXPECT_EQ(chunk.logprobs_size(), 0);
  }
}

}  // namespace
}  // namespace specserve
