#include "router/draft_proposer.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

TEST(AddPointMassDraftsTest, GreedyHasNoQSampledAPointMass) {
  v1::Drafts greedy;
  AddPointMassDrafts({5, 9}, /*greedy=*/true, greedy.mutable_drafts());
  ASSERT_EQ(greedy.drafts_size(), 2);
  EXPECT_EQ(greedy.drafts(1).id(), 9);
  EXPECT_EQ(greedy.drafts(0).q_size(), 0);

  v1::Drafts sampled;
  AddPointMassDrafts({5, 9}, /*greedy=*/false, sampled.mutable_drafts());
  ASSERT_EQ(sampled.drafts_size(), 2);
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(sampled.drafts(i).q_size(), 1);
    EXPECT_EQ(sampled.drafts(i).q(0).id(), sampled.drafts(i).id());
    EXPECT_FLOAT_EQ(sampled.drafts(i).q(0).prob(), 1.f);
  }
  AddPointMassDrafts({}, false, sampled.mutable_drafts());
  EXPECT_EQ(sampled.drafts_size(), 2);
}

ResolvedOptions Opts(SpecDecodeMethod method) {
  ResolvedOptions o;
  o.spec_decode = true;
  o.num_draft_tokens = 4;
  o.spec_decode_method = method;
  o.tree_branching = {3, 2, 1};
  o.tree_max_nodes = 10;
  o.tree_min_path_prob = 0.02;
  return o;
}

TEST(MakeDraftRequestTest, ChainForDraft) {
  const v1::DraftRequest r =
      MakeDraftRequest(Opts(SpecDecodeMethod::kDraft), "s1", {7, 8}, 4);
  EXPECT_EQ(r.session_id(), "s1");
  EXPECT_THAT(r.emitted_token_ids(), ElementsAre(7, 8));
  EXPECT_EQ(r.num_draft_tokens(), 4);
  EXPECT_FALSE(r.has_tree());
}

TEST(MakeDraftRequestTest, TreeShapeForDraftTreeUnlessLoadCutK) {
  const ResolvedOptions o = Opts(SpecDecodeMethod::kDraftTree);
  v1::DraftRequest r = MakeDraftRequest(o, "", {3}, 4);
  ASSERT_TRUE(r.has_tree());
  EXPECT_THAT(r.tree().branching(), ElementsAre(3, 2, 1));
  EXPECT_EQ(r.tree().max_nodes(), 10);
  EXPECT_DOUBLE_EQ(r.tree().min_path_prob(), 0.02);  // one request running
  r = MakeDraftRequest(o, "", {3}, 4, /*running=*/8);
  EXPECT_DOUBLE_EQ(r.tree().min_path_prob(), 0.32);
  // Under load (k cut to 2) the round is a plain chain of 2.
  r = MakeDraftRequest(o, "", {3}, 2);
  EXPECT_FALSE(r.has_tree());
  EXPECT_EQ(r.num_draft_tokens(), 2);
}

TEST(TreeMinPathProbUnderLoadTest, GrowsWithTheRequestsInFlightUpToAHalf) {
  EXPECT_EQ(TreeMinPathProbUnderLoad(0.0, 100), 0.0);
  EXPECT_DOUBLE_EQ(TreeMinPathProbUnderLoad(0.01, 0), 0.01);
  EXPECT_DOUBLE_EQ(TreeMinPathProbUnderLoad(0.01, 1), 0.01);
  EXPECT_DOUBLE_EQ(TreeMinPathProbUnderLoad(0.01, 2), 0.04);
  EXPECT_DOUBLE_EQ(TreeMinPathProbUnderLoad(0.01, 16), 0.32);
  EXPECT_DOUBLE_EQ(TreeMinPathProbUnderLoad(0.01, 1000), 0.5);
  EXPECT_DOUBLE_EQ(TreeMinPathProbUnderLoad(0.9, 1), 0.5);
}

v1::DraftResponse Response(std::vector<int> ids, std::vector<int> parents) {
  v1::DraftResponse r;
  for (int id : ids) r.add_drafts()->set_id(id);
  r.mutable_parents()->Add(parents.begin(), parents.end());
  return r;
}

TEST(ToTargetDraftsTest, ForwardsChainsAndTreesWithTheirParents) {
  v1::Drafts d;
  ASSERT_TRUE(ToTargetDrafts(Response({4, 5}, {}), false, &d).ok());
  EXPECT_EQ(d.drafts_size(), 2);
  EXPECT_THAT(d.parents(), IsEmpty());
  // A chain answering a tree request (a speculator without trees) is fine.
  ASSERT_TRUE(ToTargetDrafts(Response({4, 5}, {}), true, &d).ok());
  EXPECT_EQ(d.drafts_size(), 2);
  // Root 4 with children 5 (child 6) and 7; root 8.
  ASSERT_TRUE(
      ToTargetDrafts(Response({4, 5, 6, 7, 8}, {-1, 0, 1, 0, -1}), true, &d)
          .ok());
  EXPECT_EQ(d.drafts(4).id(), 8);
  EXPECT_THAT(d.parents(), ElementsAre(-1, 0, 1, 0, -1));
}

TEST(ToTargetDraftsTest, RejectsWhatIsNotATree) {
  v1::Drafts d;
  const struct {
    v1::DraftResponse response;
    bool tree;
  } cases[] = {
      {Response({4, 5}, {-1}), true},         // one parent short
      {Response({4, 5}, {-1, 1}), true},      // a node its own parent
      {Response({4, 5}, {-1, 2}), true},      // a parent after the node
      {Response({4, 5}, {-2, 0}), true},      // below -1
      {Response({4, 5}, {-1, 0}), false},     // no tree was asked for
  };
  for (const auto& c : cases) {
    absl::Status s = ToTargetDrafts(c.response, c.tree, &d);
    EXPECT_TRUE(absl::IsFailedPrecondition(s)) << c.response.DebugString();
    EXPECT_EQ(d.drafts_size(), 0);
  }
}

}  // namespace
}  // namespace specserve
