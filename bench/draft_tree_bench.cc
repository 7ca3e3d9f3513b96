// Draft chains vs draft trees at batch 1, engine only (no RPC): greedy
// TinyStories continuations with a speculator -> target pair, each method
// over the same prompts. Prints, per method, tokens per target forward
// (the mean acceptance length: 1 + accepted drafts per verify round), its
// ratio to the chain's, draft rows forwarded by the speculator and by the
// target, and decode tokens/s. Greedy output must equal the target's
// plain greedy decoding (checked: a mismatch is an error).
//
//   bazel run -c opt //bench:draft_tree_bench -- --pairs=stories260K
//   --trees="3,3,3,3,3,3,3:16;4,2,2,1,1:16"
//
// A tree is "b0,b1,...:max_nodes[:min_path_prob]" (DraftTreeShape).

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <numeric>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "bench/eval_util.h"
#include "common/engine/cpu_model_runner.h"
#include "common/engine/thread_pool.h"
#include "common/speculation/draft_session.h"
#include "common/speculation/target_session.h"
#include "common/tokenizer/tokenizer.h"

ABSL_FLAG(std::string, pairs, "stories260K,tinystories-656K",
          "targets; each is drafted by <target>-draft");
ABSL_FLAG(std::string, prompt_dir, "bench/eval_prompts",
          "one story per .txt file; its first --prompt_tokens tokens are "
          "the prompt");
ABSL_FLAG(int, prompt_tokens, 48, "prompt length (tokens, BOS included)");
ABSL_FLAG(int, gen, 128, "tokens generated per prompt (EOS ignored)");
ABSL_FLAG(std::string, chains, "4", "chain lengths k, comma separated");
ABSL_FLAG(std::string, trees, "3,2,2,2,2,2:16;3,3,3,3,3,3,3:16;2,2,2,2,2,2,2,2:16",
          "tree shapes 'b0,b1,...:max_nodes[:min_path_prob]', ';' separated");
ABSL_FLAG(int, reps, 2, "timed repetitions (the fastest counts)");
ABSL_FLAG(int, threads, 1, "engine threads (ThreadPool::Default)");

namespace specserve {
namespace {

struct Method {
  std::string name;
  int k = 0;              // chain length (0 with a tree: tree)
  DraftTreeShape tree;
  bool is_tree = false;
};

struct Totals {
  int64_t tokens = 0, rounds = 0, draft_rows = 0, accepted = 0;
  double secs = 0, draft_secs = 0, verify_secs = 0;
};

absl::StatusOr<std::vector<int>> Run(ModelRunner& draft, ModelRunner& target,
                                     const std::vector<int>& prompt, int gen,
                                     const Method& m, Totals* t) {
  const int n = static_cast<int>(prompt.size());
  TargetRequest req;
  req.token_ids = prompt;
  req.position_ids.resize(n);
  std::iota(req.position_ids.begin(), req.position_ids.end(), 0);
  req.stop.max_new_tokens = gen;
  req.ignore_eos = true;
  req.max_drafts = 64;
  auto ts = TargetSession::Create(&target, req);
  if (!ts.ok()) return ts.status();
  auto first = (*ts)->Step({});
  if (!first.ok()) return first.status();
  std::unique_ptr<DraftSession> ds;
  if (m.k > 0 || m.is_tree) {
    auto d = DraftSession::Create(&draft, draft.config().max_position_embeddings,
                                  SamplingParams{});
    if (!d.ok()) return d.status();
    ds = *std::move(d);
    ScoreOptions opt;
    opt.look_ahead = 0;
    opt.selection.keep_ratio = 1.f;
    if (auto r = ds->Score(prompt, opt); !r.ok()) return r.status();
  }
  std::vector<int> emitted = first->tokens;
  const double t0 = bench::Now();
  while (!(*ts)->finished()) {
    std::vector<DraftToken> drafts;
    std::vector<int> parents;
    const double td = bench::Now();
    if (ds != nullptr) {
      auto d = m.is_tree ? ds->DraftTree(emitted, m.tree, &parents)
                         : ds->Draft(emitted, m.k);
      if (!d.ok()) return d.status();
      drafts = *std::move(d);
    }
    const double tv = bench::Now();
    t->draft_secs += tv - td;
    auto round = (*ts)->Step(drafts, parents);
    if (!round.ok()) return round.status();
    t->verify_secs += bench::Now() - tv;
    emitted = round->tokens;
    t->tokens += static_cast<int64_t>(round->tokens.size());
    t->rounds += 1;
    t->draft_rows += round->num_drafts;
    t->accepted += round->num_accepted;
  }
  t->secs += bench::Now() - t0;
  return (*ts)->output();
}

absl::StatusOr<std::vector<Method>> ParseMethods() {
  std::vector<Method> out = {{"none", 0, {}, false}};
  for (absl::string_view k : absl::StrSplit(absl::GetFlag(FLAGS_chains), ',',
                                            absl::SkipEmpty())) {
    Method m;
    if (!absl::SimpleAtoi(k, &m.k) || m.k < 1) {
      return absl::InvalidArgumentError(absl::StrCat("bad chain ", k));
    }
    m.name = absl::StrCat("chain k=", m.k);
    out.push_back(m);
  }
  for (absl::string_view spec : absl::StrSplit(absl::GetFlag(FLAGS_trees), ';',
                                               absl::SkipEmpty())) {
    std::vector<absl::string_view> parts = absl::StrSplit(spec, ':');
    Method m;
    m.is_tree = true;
    for (absl::string_view b : absl::StrSplit(parts[0], ',')) {
      int v = 0;
      if (!absl::SimpleAtoi(b, &v)) {
        return absl::InvalidArgumentError(absl::StrCat("bad tree ", spec));
      }
      m.tree.branching.push_back(v);
    }
    if (parts.size() < 2 || parts.size() > 3 ||
        !absl::SimpleAtoi(parts[1], &m.tree.max_nodes) ||
        (parts.size() == 3 &&
         !absl::SimpleAtod(parts[2], &m.tree.min_path_prob))) {
      return absl::InvalidArgumentError(absl::StrCat("bad tree ", spec));
    }
    if (absl::Status s = ValidateDraftTreeShape(m.tree); !s.ok()) return s;
    m.name = absl::StrCat("tree ", spec);
    out.push_back(m);
  }
  return out;
}

absl::Status Main() {
  ThreadPool::SetDefaultThreads(absl::GetFlag(FLAGS_threads));
  auto methods = ParseMethods();
  if (!methods.ok()) return methods.status();
  std::vector<std::string> files;
  for (const auto& e :
       std::filesystem::directory_iterator(absl::GetFlag(FLAGS_prompt_dir))) {
    if (e.path().extension() == ".txt") files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  const int gen = absl::GetFlag(FLAGS_gen);
  for (absl::string_view pair : absl::StrSplit(absl::GetFlag(FLAGS_pairs), ',',
                                                absl::SkipEmpty())) {
    const std::string target_name(pair);
    auto tw = bench::LoadBenchModel(target_name);
    if (!tw.ok()) return tw.status();
    auto dw = bench::LoadBenchModel(target_name + "-draft");
    if (!dw.ok()) return dw.status();
    auto target = CpuModelRunner::CreateForSequences(*tw, 2);
    auto draft = CpuModelRunner::CreateForSequences(*dw, 2);
    if (!target.ok()) return target.status();
    if (!draft.ok()) return draft.status();
    auto tok = LoadTokenizer("models/" + target_name);
    if (!tok.ok()) return tok.status();
    std::vector<std::vector<int>> prompts;
    for (const std::string& f : files) {
      auto text = bench::ReadPromptFile(f);
      if (!text.ok()) return text.status();
      auto ids = (*tok)->Encode(*text, /*add_bos=*/true);
      if (!ids.ok()) return ids.status();
      ids->resize(std::min<size_t>(ids->size(),
                                   absl::GetFlag(FLAGS_prompt_tokens)));
      prompts.push_back(*std::move(ids));
    }
    std::printf("\n%s <- %s-draft: %zu prompts of %d tokens, %d generated "
                "each, greedy, batch 1, %d engine thread(s)\n",
                target_name.c_str(), target_name.c_str(), prompts.size(),
                absl::GetFlag(FLAGS_prompt_tokens), gen,
                absl::GetFlag(FLAGS_threads));
    std::printf("| method | tokens / target forward | vs chain | "
                "draft rows / round | draft us / round | verify us / round | "
                "decode tok/s | vs none |\n"
                "|---|---|---|---|---|---|---|---|\n");
    std::vector<std::vector<int>> reference(prompts.size());
    double chain_len = 0, none_tps = 0;
    for (const Method& m : *methods) {
      Totals best;
      for (int rep = 0; rep < absl::GetFlag(FLAGS_reps); ++rep) {
        Totals t;
        for (size_t p = 0; p < prompts.size(); ++p) {
          auto out = Run(**draft, **target, prompts[p], gen, m, &t);
          if (!out.ok()) return out.status();
          if (reference[p].empty()) {
            reference[p] = *out;
          } else if (*out != reference[p]) {
            return absl::InternalError(absl::StrCat(
                m.name, ": greedy output differs from plain decoding on ",
                files[p]));
          }
        }
        if (rep == 0 || t.secs < best.secs) best = t;
      }
      const double len = static_cast<double>(best.tokens) / best.rounds;
      const double tps = best.tokens / best.secs;
      if (m.k == 4 && !m.is_tree) chain_len = len;
      if (m.k == 0 && !m.is_tree) none_tps = tps;
      const std::string vs_chain =
          chain_len > 0 && (m.is_tree || m.k == 4)
              ? absl::StrFormat("%.2fx", len / chain_len)
              : "";
      std::printf("| %s | %.2f | %s | %.1f | %.0f | %.0f | %.0f | %.2fx |\n",
                  m.name.c_str(), len, vs_chain.c_str(),
                  static_cast<double>(best.draft_rows) / best.rounds,
                  1e6 * best.draft_secs / best.rounds,
                  1e6 * best.verify_secs / best.rounds, tps,
                  none_tps > 0 ? tps / none_tps : 1.0);
    }
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace specserve

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  absl::Status s = specserve::Main();
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
