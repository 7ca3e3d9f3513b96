// CPU tests of the host-side inputs of CudaModelRunner's device paths: the
// packed SampleRows jobs and the padded inputs of a CUDA-graph step.

#include "common/cuda/step_inputs.h"

#include <cmath>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "common/engine/paged_kv_cache.h"
#include "gtest/gtest.h"

namespace specserve {
namespace cuda_step {
namespace {

using cuda_kernels::kSeqInfoFields;
using cuda_kernels::kSeqRowStart;
using cuda_kernels::kSeqRows;
using cuda_kernels::kSeqTableStart;

TEST(PackRowSamplingTest, PacksRowsInBatchOrderWithTheirDrafts) {
  const SparseDist q0 = {{7, 0.75f}, {3, 0.25f}};
  const SparseDist q1 = {{2, 1.f}};
  RowSampling a;
  a.params = {0.8f, 5, 0.9f, 0};
  a.draft_ids = {7, 2, -1};
  a.draft_q = {&q0, &q1, nullptr};
  a.uniforms = {0.1, 0.2, 0.3, 0.4, 0.5, 0.6};
  RowSampling c;
  c.params = {1.5f, 0, 1.f, 0};
  c.params.min_p = 0.05f;
  c.draft_ids = {-1};
  c.draft_q = {nullptr};
  c.uniforms = {0.7, 0.8};
  std::vector<SequenceForward> batch(3);
  batch[0].input.sampling = &a;  // logit rows 0..2
  // batch[1]: logits, rows 3..4
  batch[2].input.sampling = &c;  // logit row 5
  const std::vector<int> lr0 = {0, 3, 5, 6};
  const PackedRowSampling p = PackRowSampling(batch, lr0);
  ASSERT_EQ(p.num_rows, 4);
  auto ints = [&](int at, int n) {
    return std::vector<int>(p.ints.begin() + at, p.ints.begin() + at + n);
  };
  auto floats = [&](int at, int n) {
    return std::vector<float>(p.floats.begin() + at,
                              p.floats.begin() + at + n);
  };
  EXPECT_EQ(ints(0, 4), (std::vector<int>{0, 1, 2, 5}));
  EXPECT_EQ(ints(PackedRowSampling::top_k_at(4), 4), (std::vector<int>{5, 5, 5, 0}));
  EXPECT_EQ(ints(PackedRowSampling::draft_id_at(4), 4), (std::vector<int>{7, 2, -1, -1}));
  EXPECT_EQ(ints(PackedRowSampling::q_offsets_at(4), 5), (std::vector<int>{0, 2, 3, 3, 3}));
  EXPECT_EQ(ints(PackedRowSampling::q_ids_at(4), 3), (std::vector<int>{7, 3, 2}));
  EXPECT_EQ(p.ints.size(), 4u * 4 + 1 + 3);
  EXPECT_EQ(floats(0, 4),
            (std::vector<float>{0.8f, 0.8f, 0.8f, 1.5f}));
  EXPECT_EQ(floats(PackedRowSampling::top_p_at(4), 4),
            (std::vector<float>{0.9f, 0.9f, 0.9f, 1.f}));
  EXPECT_EQ(floats(PackedRowSampling::min_p_at(4), 4),
            (std::vector<float>{0.f, 0.f, 0.f, 0.05f}));
  EXPECT_EQ(floats(PackedRowSampling::q_probs_at(4), 3),
            (std::vector<float>{0.75f, 0.25f, 1.f}));
  EXPECT_EQ(p.floats.size(), 3u * 4 + 3);
  EXPECT_EQ(p.uniforms,
            (std::vector<double>{0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8}));

  batch[0].input.sampling = nullptr;
  batch[2].input.sampling = nullptr;
  const PackedRowSampling none = PackRowSampling(batch, lr0);
  EXPECT_EQ(none.num_rows, 0);
  EXPECT_TRUE(none.ints.empty() && none.floats.empty() &&
              none.uniforms.empty());
}

TEST(GraphBucketTest, PowersOfTwoToEightThenMultiplesOfEight) {
  const std::vector<std::pair<int, int>> want = {
      {1, 1}, {2, 2}, {3, 4}, {4, 4}, {5, 8}, {8, 8},
      {9, 16}, {16, 16}, {17, 24}, {121, 128}, {128, 128}};
  for (const auto& [rows, bucket] : want) {
    EXPECT_EQ(GraphBucket(rows), bucket) << rows;
  }
}

// A capture that holds nothing: GraphEligible only tells whether a
// sequence has one.
class NoCapture final : public QueryCapture {
 public:
  int rows() const override { return 0; }
  int max_rows() const override { return 0; }
  void Clear() override {}
  absl::StatusOr<std::vector<float>> CopyToHost() const override {
    return std::vector<float>();
  }
};

// A step of `rows[i]` greedy rows per sequence, all of them logit rows.
struct Step {
  std::vector<std::vector<int>> ids, pos, logit_rows;
  std::vector<SequenceForward> batch;
  Step(const std::vector<int>& rows, std::vector<KvSequence*> kv = {}) {
    const size_t S = rows.size();
    ids.resize(S);
    pos.resize(S);
    logit_rows.resize(S);
    batch.resize(S);
    for (size_t i = 0; i < S; ++i) {
      for (int r = 0; r < rows[i]; ++r) {
        ids[i].push_back(100 + 10 * static_cast<int>(i) + r);
        pos[i].push_back(50 + r);
        logit_rows[i].push_back(r);
      }
      batch[i].kv = kv.empty() ? nullptr : kv[i];
      batch[i].input.token_ids = ids[i];
      batch[i].input.position_ids = pos[i];
      batch[i].input.logit_rows = logit_rows[i];
      batch[i].input.argmax_only = true;
    }
  }
};

TEST(GraphEligibleTest, GreedyOrSampledDecodeAndVerifyRowsOnly) {
  EXPECT_TRUE(GraphEligible(Step({1, 1, 1}).batch, Step({1, 1, 1}).logit_rows,
                            128, 32, 100, 100, 4));
  Step verify({4, 4, 1});
  EXPECT_TRUE(
      GraphEligible(verify.batch, verify.logit_rows, 128, 32, 100, 100, 4));
  EXPECT_FALSE(
      GraphEligible(verify.batch, verify.logit_rows, 8, 32, 100, 100, 4));
  EXPECT_FALSE(GraphEligible({}, {}, 128, 32, 100, 100, 4));

  auto with = [](const std::function<void(Step&)>& change, int max_q = 100,
                 int max_edits = 100) {
    Step s({1, 4});
    change(s);
    return GraphEligible(s.batch, s.logit_rows, 128, 32, max_q, max_edits,
                         /*max_capture_rows=*/2);
  };
  // Logits to the host (a request the host decides): yes, copied out of
  // the graph's logits.
  EXPECT_TRUE(with([](Step& s) { s.batch[1].input.argmax_only = false; }));
  // Sampled on the device: yes, within the q capacity.
  const SparseDist q = {{3, 0.5f}, {4, 0.5f}};
  RowSampling rs;
  rs.draft_ids = {7, 8, -1, 9};
  rs.draft_q = {&q, &q, nullptr, &q};
  auto sampled = [&](Step& s) {
    s.batch[1].input.argmax_only = false;
    s.batch[1].input.sampling = &rs;
  };
  EXPECT_TRUE(with(sampled));
  EXPECT_TRUE(with(sampled, 6));
  EXPECT_FALSE(with(sampled, 5));
  // Logit edits on the device: yes, within the edit capacity.
  LogitEdits edits;
  edits.offsets = {0, 2, 2, 3, 3};
  edits.edits = {{1, 1.f, 1.f, 0.f}, {5, 0.f, 1.f, 2.f}, {1, 0.f, 1.3f, 0.f}};
  auto edited = [&](Step& s) { s.batch[1].input.logit_edits = &edits; };
  EXPECT_TRUE(with(edited, 100, 3));
  EXPECT_FALSE(with(edited, 100, 2));
  // Token masks run eagerly.
  LogitEdits masked = edits;
  MaskLastRow({2}, 10, &masked);
  EXPECT_FALSE(with([&](Step& s) { s.batch[1].input.logit_edits = &masked; },
                    100, 3));
  // Both argmax_only and sampling is not a valid input; not graphed.
  EXPECT_FALSE(with([&](Step& s) { s.batch[1].input.sampling = &rs; }));
  // Query capture: into a device capture, up to the capture capacity, in
  // steps without sampled rows; rows captured for the host run eagerly.
  EXPECT_FALSE(
      with([](Step& s) { s.batch[1].input.capture_query_rows = {3}; }));
  NoCapture capture;
  QueryCapture* const device_capture = &capture;
  auto capturing = [&](std::vector<int> rows0, std::vector<int> rows1) {
    return [=](Step& s) {
      s.batch[0].input.capture_query_rows = rows0;
      if (!rows0.empty()) s.batch[0].capture = device_capture;
      s.batch[1].input.capture_query_rows = rows1;
      if (!rows1.empty()) s.batch[1].capture = device_capture;
    };
  };
  EXPECT_TRUE(with(capturing({}, {3})));
  EXPECT_TRUE(with(capturing({0}, {3})));
  EXPECT_FALSE(with(capturing({0}, {1, 3})));  // 3 rows > 2
  EXPECT_TRUE(with([&](Step& s) {
    capturing({}, {3})(s);
    s.batch[1].input.argmax_only = false;  // logits to the host
  }));
  EXPECT_FALSE(with([&](Step& s) {
    capturing({0}, {})(s);
    sampled(s);
  }));
  // A device capture with no rows in this step is no capture.
  EXPECT_TRUE(with([&](Step& s) {
    s.batch[0].capture = device_capture;
    sampled(s);
  }));
  EXPECT_FALSE(
      with([](Step& s) { s.batch[1].input.tree_parents = {-1, 0, 0, 1}; }));
  // Logprobs run eagerly (RowLogprobs after the step).
  EXPECT_FALSE(with([](Step& s) { s.batch[1].input.logprobs_top_n = 0; }));
  EXPECT_TRUE(with([](Step& s) { s.batch[1].input.logprobs_top_n = -1; }));
  // Not every row a logit row, or not in order.
  EXPECT_FALSE(with([](Step& s) { s.logit_rows[1] = {3}; }));
  EXPECT_FALSE(with([](Step& s) { s.logit_rows[1] = {0, 2, 1, 3}; }));
  // A sequence FlashAttention would take.
  Step chunk({1, 32});
  EXPECT_FALSE(
      GraphEligible(chunk.batch, chunk.logit_rows, 128, 32, 100, 100, 4));
  EXPECT_TRUE(
      GraphEligible(chunk.batch, chunk.logit_rows, 128, 0, 100, 100, 4));
  EXPECT_FALSE(AnySampling(chunk.batch));
}

// Each sequence's edits land on its own logit rows of the step; other rows
// and rows past the batch get empty ranges.
TEST(PackLogitEditsTest, EditsFollowTheStepsLogitRows) {
  LogitEdits a, c;
  a.offsets = {0, 1, 1};
  a.edits = {{4, 1.f, 1.f, 0.f}};
  c.offsets = {0, 2};
  c.edits = {{2, 0.f, 1.5f, 0.f}, {9, 0.f, 1.f, INFINITY}};
  std::vector<SequenceForward> batch(3);
  batch[0].input.logit_edits = &a;  // rows 0..1
  // batch[1]: rows 2..4, no edits
  batch[2].input.logit_edits = &c;  // row 5
  const std::vector<int> lr0 = {0, 2, 5, 6};
  const LogitEdits p = PackLogitEdits(batch, lr0, 8);
  EXPECT_EQ(p.offsets, (std::vector<int>{0, 1, 1, 1, 1, 1, 3, 3, 3}));
  ASSERT_EQ(p.edits.size(), 3u);
  EXPECT_EQ(p.edits[0].id, 4);
  EXPECT_EQ(p.edits[1].id, 2);
  EXPECT_EQ(p.edits[2].id, 9);
  EXPECT_EQ(p.edits[2].subtract, INFINITY);
  EXPECT_FALSE(p.has_masks());
  // Token masks: each sequence's masks renumbered after the ones before,
  // -1 for rows without one (and past the batch).
  LogitEdits am = a, cm = c;
  MaskLastRow({3}, 40, &am);  // a's row 1
  MaskLastRow({0, 39}, 40, &cm);  // c's row 0
  batch[0].input.logit_edits = &am;
  batch[2].input.logit_edits = &cm;
  const LogitEdits pm = PackLogitEdits(batch, lr0, 8);
  EXPECT_EQ(pm.offsets, p.offsets);
  EXPECT_EQ(pm.mask_words, 2);
  EXPECT_EQ(pm.mask_of_row, (std::vector<int>{-1, 0, -1, -1, -1, 1, -1, -1}));
  ASSERT_EQ(pm.allowed.size(), 4u);
  EXPECT_EQ(pm.allowed[0], ~(uint32_t{1} << 3));
  EXPECT_EQ(pm.allowed[2], ~uint32_t{1});
  EXPECT_EQ(pm.allowed[3], (uint32_t{1} << 7) - 1);  // ids 32..38 of 40
  batch[0].input.logit_edits = nullptr;
  batch[2].input.logit_edits = nullptr;
  EXPECT_TRUE(PackLogitEdits(batch, lr0, 8).offsets.empty());
}

// A graph step: a job for every logit row at fixed offsets (num_rows =
// capacity), placeholders for greedy rows and past the batch.
TEST(PackRowSamplingTest, GraphStepGetsAJobPerRowAtFixedOffsets) {
  constexpr int kMax = 16;
  // Sequence 0 greedy (1 row), sequence 1 sampled (3 rows, drafts on the
  // first two).
  Step step({1, 3});
  const SparseDist q0 = {{3, 0.5f}, {4, 0.5f}};
  const SparseDist q1 = {{9, 1.f}};
  RowSampling rs;
  rs.params = {0.7f, 40, 0.9f, 0};
  rs.draft_ids = {3, 9, -1};
  rs.draft_q = {&q0, &q1, nullptr};
  rs.uniforms = {0.1, 0.2, 0.3, 0.4, 0.5, 0.6};
  step.batch[1].input.argmax_only = false;
  step.batch[1].input.sampling = &rs;
  EXPECT_TRUE(AnySampling(step.batch));
  const std::vector<int> lr0 = {0, 1, 4};
  const PackedRowSampling g = PackRowSampling(step.batch, lr0, kMax);
  EXPECT_EQ(g.num_rows, kMax);
  auto ints = [&](int at, int n) {
    return std::vector<int>(g.ints.begin() + at, g.ints.begin() + at + n);
  };
  auto floats = [&](int at, int n) {
    return std::vector<float>(g.floats.begin() + at,
                              g.floats.begin() + at + n);
  };
  // Rows 0 (greedy), 1-3 (sampled), 4.. placeholders but rows 1-3.
  EXPECT_EQ(ints(0, 8), (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(ints(PackedRowSampling::top_k_at(kMax), 8),
            (std::vector<int>{1, 40, 40, 40, 1, 1, 1, 1}));
  EXPECT_EQ(ints(PackedRowSampling::draft_id_at(kMax), 8),
            (std::vector<int>{-1, 3, 9, -1, -1, -1, -1, -1}));
  EXPECT_EQ(ints(PackedRowSampling::q_offsets_at(kMax), kMax + 1),
            std::vector<int>({0, 0, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3,
                              3}));
  EXPECT_EQ(ints(PackedRowSampling::q_ids_at(kMax), 3),
            (std::vector<int>{3, 4, 9}));
  EXPECT_EQ(g.ints.size(), static_cast<size_t>(4 * kMax + 1 + 3));
  EXPECT_EQ(floats(0, 5), (std::vector<float>{1.f, 0.7f, 0.7f, 0.7f, 1.f}));
  EXPECT_EQ(floats(PackedRowSampling::top_p_at(kMax), 5),
            (std::vector<float>{1.f, 0.9f, 0.9f, 0.9f, 1.f}));
  EXPECT_EQ(floats(PackedRowSampling::min_p_at(kMax), 5),
            (std::vector<float>{0.f, 0.f, 0.f, 0.f, 0.f}));
  EXPECT_EQ(floats(PackedRowSampling::q_probs_at(kMax), 3),
            (std::vector<float>{0.5f, 0.5f, 1.f}));
  EXPECT_EQ(g.floats.size(), static_cast<size_t>(3 * kMax + 3));
  ASSERT_EQ(g.uniforms.size(), static_cast<size_t>(2 * kMax));
  EXPECT_EQ(std::vector<double>(g.uniforms.begin(), g.uniforms.begin() + 10),
            (std::vector<double>{0, 0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0, 0}));
}

TEST(PackGraphStepTest, PadsToTheBucketAndPlansTheRealSequences) {
  PagedKvCache cache(64, 4, 8, [](int, int) { return absl::OkStatus(); });
  // Three sequences with interleaved blocks and different contexts.
  std::vector<std::unique_ptr<KvSequence>> seqs;
  for (int i = 0; i < 3; ++i) seqs.push_back(cache.NewSequence(128));
  const std::vector<int> context = {9, 2, 13};
  for (int grow = 0; grow < 13; ++grow) {
    for (int i = 0; i < 3; ++i) {
      if (grow < context[i]) {
        ASSERT_TRUE(seqs[i]->Reserve(1).ok());
      }
    }
  }
  const std::vector<int> rows = {1, 4, 1};
  std::vector<int> first;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<int> f = seqs[i]->Reserve(rows[i]);
    ASSERT_TRUE(f.ok());
    first.push_back(*f);
  }
  Step step(rows, {seqs[0].get(), seqs[1].get(), seqs[2].get()});
  constexpr int kMax = 16;
  absl::StatusOr<GraphStepInputs> g =
      PackGraphStep(step.batch, first, kMax, 1000, 8, 2, 4);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->rows, 6);
  EXPECT_EQ(g->bucket, 8);
  ASSERT_EQ(g->head.size(), 4u * kMax);
  int row = 0, table = 0;
  for (int i = 0; i < 3; ++i) {
    const int* info = g->plan.seq_info.data() + i * kSeqInfoFields;
    EXPECT_EQ(info[kSeqRowStart], row);
    EXPECT_EQ(info[kSeqRows], rows[i]);
    EXPECT_EQ(info[kSeqTableStart], table);
    const std::vector<int>& t = seqs[i]->block_table();
    EXPECT_EQ(std::vector<int>(g->tables.begin() + table,
                               g->tables.begin() + table + t.size()),
              t);
    table += static_cast<int>(t.size());
    for (int r = 0; r < rows[i]; ++r, ++row) {
      EXPECT_EQ(g->head[row], step.ids[i][r]);
      EXPECT_EQ(g->head[kMax + row], step.pos[i][r]);
      EXPECT_EQ(g->head[2 * kMax + row], seqs[i]->PhysicalSlot(first[i] + r));
      EXPECT_GE(g->head[2 * kMax + row], 0);
    }
  }
  EXPECT_EQ(g->tables.size(), static_cast<size_t>(table));
  for (int r = 6; r < 8; ++r) {  // padding: token 0 at 0, no KV store
    EXPECT_EQ(g->head[r], 0);
    EXPECT_EQ(g->head[kMax + r], 0);
    EXPECT_EQ(g->head[2 * kMax + r], -1);
  }
  for (int r = 0; r < 8; ++r) EXPECT_EQ(g->head[3 * kMax + r], r);
  const cuda_kernels::BatchedAttentionCapacity cap =
      cuda_kernels::BatchedAttentionCapacityFor(8, 8, 8, 2, 4);
  EXPECT_LE(g->plan.num_work(), cap.num_work);
  EXPECT_LE(g->plan.num_combine(), cap.num_combine);
  EXPECT_LE(g->plan.partial_triples, cap.partial_triples);
  EXPECT_EQ(g->plan.total_rows, 6);

  // Too many rows or table entries for the graph's room.
  EXPECT_EQ(PackGraphStep(step.batch, first, 5, 1000, 8, 2, 4).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PackGraphStep(step.batch, first, kMax, table - 1, 8, 2, 4)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cuda_step
}  // namespace specserve
