// Long-range retrieval evaluation of Speculative Prefill: does the
// pruned target still recall a fact introduced ~250+ tokens before the cue?
// And keep-by-importance-mass against fixed keep ratios, on this evaluation
// and on the TinyStories continuation fidelity prompts.
//
//   /usr/bin/python3 bench/make_retrieval_prompts.py   # the prompts (seeded)
//   bench/run_retrieval_eval.sh                         # full run + plot
//   bazel-bin/bench/eval_retrieval --limit 20 --out_dir /tmp/x  # quick run
//
// Outputs: retrieval_results.{json,md} in --out_dir and the counted prompts
// in --counted_out; by default both under $TMPDIR/specserve_retrieval (or
// /tmp/specserve_retrieval), never in the source tree. The committed
// bench/results and bench/data come from bench/run_retrieval_eval.sh, which
// names them explicitly. Run from the repository root (models/ and
// bench/eval_prompts are read relative to it).
//
// Protocol: the target greedily continues the full prompt; a prompt counts
// only if that continuation states the fact (starts with the answer word).
// Every method then prunes the prompt (BOS and the last token always kept),
// the target prefills the kept tokens at their ORIGINAL positions and
// continues greedily (docs/ARCHITECTURE.md, Speculative Prefill step 7), and the prompt is
// correct when the continuation still starts with the answer. Baselines keep
// exactly as many tokens as Speculative Prefill (look-ahead 8) at chunk 8 and
// at chunk 32 on that prompt. Accuracies carry Wilson 95% intervals.

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "bench/eval_util.h"
#include "common/decoding/sampling.h"
#include "common/engine/cpu_model_runner.h"
#include "common/speculation/draft_session.h"
#include "common/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"

namespace specserve {
namespace bench {
namespace {

// Where the outputs go by default: $TMPDIR/specserve_retrieval (or
// /tmp/specserve_retrieval), never the source tree.
std::string ScratchRoot() {
  const char* tmp = std::getenv("TMPDIR");
  return absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp",
                      "/specserve_retrieval");
}

// --counted_out's default: under ScratchRoot(), created when used.
std::string DefaultCountedOut() {
  return ScratchRoot() + "/counted/{target}_{band}.jsonl";
}

// --out_dir's default: under ScratchRoot().
std::string DefaultOutDir() { return ScratchRoot() + "/results"; }

}  // namespace
}  // namespace bench
}  // namespace specserve

ABSL_FLAG(std::string, prompts, "/tmp/specserve_retrieval/{target}_{band}.jsonl",
          "retrieval prompts (bench/make_retrieval_prompts.py, written by "
          "bench/run_retrieval_eval.sh); {target} and {band} are replaced "
          "(filler lengths differ with the tokenizer)");
ABSL_FLAG(std::string, bands, "short,medium,long",
          "distance bands: one prompt file each");
ABSL_FLAG(std::string, counted_out, specserve::bench::DefaultCountedOut(),
          "where the counted prompts (full prefill states the fact) go; "
          "{target} and {band} are replaced; '' = nowhere. The default is "
          "under $TMPDIR (or /tmp), created if missing; a path given here "
          "must name an existing folder (bench/run_retrieval_eval.sh passes "
          "bench/data/retrieval_counted_{target}_{band}.jsonl)");
ABSL_FLAG(std::string, fidelity_prompts, "bench/eval_prompts",
          "directory of TinyStories continuation prompts for the keep_mass "
          "fidelity comparison ('' = skip)");
ABSL_FLAG(std::string, pairs,
          "stories260K-draft:stories260K,tinystories-656K-draft:"
          "tinystories-656K",
          "comma-separated scorer:target bundled model pairs");
ABSL_FLAG(std::string, ratios, "0.1,0.2,0.3,0.4,0.5", "keep ratios");
ABSL_FLAG(std::string, masses, "0.5,0.7,0.8,0.9,0.95",
          "keep_mass values (chunk 8, look-ahead 8, keep_ratio ceiling 1)");
ABSL_FLAG(int, limit, 0, "use only the first N prompts (0 = all)");
ABSL_FLAG(int, show, 0,
          "print the first N full-prompt continuations (to check prompts)");
ABSL_FLAG(std::string, out_dir, specserve::bench::DefaultOutDir(),
          "where retrieval_results.json and retrieval_results.md go (created "
          "if missing); the default is under $TMPDIR (or /tmp), "
          "bench/run_retrieval_eval.sh passes bench/results");

namespace specserve {
namespace bench {
namespace {

using json = nlohmann::ordered_json;

struct Prompt {
  std::string kind, templ, before, fact, after, answer;
};

absl::StatusOr<std::vector<Prompt>> ReadPrompts(const std::string& path,
                                                int limit) {
  std::ifstream f(path);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::vector<Prompt> out;
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty()) continue;
    const json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": line ", out.size() + 1, " is not JSON"));
    }
    Prompt p;
    p.kind = j.value("kind", "");
    p.templ = j.value("template", "");
    p.before = j.value("before", "");
    p.fact = j.value("fact", "");
    p.after = j.value("after", "");
    p.answer = j.value("answer", "");
    if (p.answer.empty() || p.fact.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": line ", out.size() + 1, " lacks a fact"));
    }
    out.push_back(std::move(p));
    if (limit > 0 && static_cast<int>(out.size()) >= limit) break;
  }
  return out;
}

// Wilson score interval for k successes in n trials (z = 1.96).
std::pair<double, double> Wilson(int k, int n) {
  if (n == 0) return {0, 0};
  const double z = 1.96, p = static_cast<double>(k) / n;
  const double d = 1 + z * z / n;
  const double c = (p + z * z / (2 * n)) / d;
  const double h = z * std::sqrt(p * (1 - p) / n + z * z / (4.0 * n * n)) / d;
  return {std::max(0.0, c - h), std::min(1.0, c + h)};
}

// True if `text` (the decoded greedy continuation, a few words long)
// states `answer` as a whole word, case-insensitively. Not only at the
// start: the tiny models often end the sentence first (".\nOne day, Mia").
bool StatesAnswer(const std::string& text, const std::string& answer) {
  const std::string t = absl::AsciiStrToLower(text);
  const std::string a = absl::AsciiStrToLower(answer);
  for (size_t at = t.find(a); at != std::string::npos; at = t.find(a, at + 1)) {
    const bool left =
        at == 0 || !std::isalpha(static_cast<unsigned char>(t[at - 1]));
    const size_t end = at + a.size();
    const bool right =
        end == t.size() || !std::isalpha(static_cast<unsigned char>(t[end]));
    if (left && right) return true;
  }
  return false;
}

// One accuracy cell: correct / counted prompts, kept fraction, fact kept.
struct Cell {
  int correct = 0, n = 0, fact_kept = 0;
  double kept_sum = 0;
  void Add(bool ok, double kept_frac, bool fact) {
    correct += ok;
    ++n;
    kept_sum += kept_frac;
    fact_kept += fact;
  }
  json ToJson() const {
    const auto [lo, hi] = Wilson(correct, n);
    return json{{"correct", correct},
                {"n", n},
                {"accuracy", n ? static_cast<double>(correct) / n : 0.0},
                {"ci95", {lo, hi}},
                {"kept_fraction", n ? kept_sum / n : 0.0},
                {"fact_kept", n ? static_cast<double>(fact_kept) / n : 0.0}};
  }
};

struct SpecConfig {
  int chunk, look_ahead;
  std::string Name() const {
    return absl::StrCat("specprefill_c", chunk, "_la", look_ahead);
  }
};
const SpecConfig kSpec[] = {{8, 0}, {16, 0}, {32, 0}, {8, 8}, {16, 8}, {32, 8}};

absl::StatusOr<std::vector<float>> Importance(ModelRunner& scorer,
                                              absl::Span<const int> prompt,
                                              int look_ahead) {
  ScoreOptions o;
  o.look_ahead = look_ahead;
  auto session = DraftSession::Create(
      &scorer, static_cast<int>(prompt.size()) + look_ahead, SamplingParams{});
  if (!session.ok()) return session.status();
  auto r = (*session)->Score(prompt, o);
  if (!r.ok()) return r.status();
  return r->importance;
}

absl::StatusOr<std::vector<int>> Select(absl::Span<const float> imp,
                                        double ratio, double mass, int chunk) {
  SelectionOptions o;
  o.keep_ratio = static_cast<float>(ratio);
  o.keep_mass = static_cast<float>(mass);
  o.chunk_size = chunk;
  auto sel = SelectTokens(imp, o);
  if (!sel.ok()) return sel.status();
  return sel->kept_indices;
}

// Parses --ratios / --masses ("0.1,0.2"): every entry a number in (0, 1].
absl::StatusOr<std::vector<double>> ParseList(absl::string_view flag,
                                              const std::string& s) {
  std::vector<double> out;
  for (absl::string_view p : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    double v;
    if (!absl::SimpleAtod(p, &v) || !(v > 0 && v <= 1)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--", flag, ": \"", p, "\" is not a number in (0, 1]"));
    }
    out.push_back(v);
  }
  return out;
}

// Replaces {target} and {band} in a --prompts / --counted_out template.
std::string Expand(const std::string& path, const std::string& target,
                   absl::string_view band) {
  return absl::StrReplaceAll(path, {{"{target}", target}, {"{band}", band}});
}

// Makes sure the counted prompts can go to `path` before any work: its
// folder must exist (INVALID_ARGUMENT naming both otherwise); the default
// one, under $TMPDIR, is created. "" = nowhere, always fine.
absl::Status PrepareCountedOut(const std::string& path) {
  if (path.empty()) return absl::OkStatus();
  const std::filesystem::path dir =
      std::filesystem::path(path).parent_path();
  if (dir.empty()) return absl::OkStatus();  // The working directory.
  std::error_code ec;
  if (absl::GetFlag(FLAGS_counted_out) == DefaultCountedOut()) {
    std::filesystem::create_directories(dir, ec);
    if (ec) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--counted_out ", path, ": cannot create ", dir.string(), ": ",
          ec.message()));
    }
  }
  if (!std::filesystem::is_directory(dir, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--counted_out ", path, ": folder ", dir.string(),
                     " does not exist"));
  }
  return absl::OkStatus();
}

// Writes `text` to `path`; INTERNAL naming the path if that fails.
absl::Status WriteText(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
  f.close();
  if (!f) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

std::string Pct(const json& cell) {
  return absl::StrFormat(
      "%.1f [%.1f, %.1f]", 100 * cell["accuracy"].get<double>(),
      100 * cell["ci95"][0].get<double>(), 100 * cell["ci95"][1].get<double>());
}

class PairEval {
 public:
  PairEval(std::string scorer, std::string target)
      : scorer_name_(std::move(scorer)), target_name_(std::move(target)) {}

  absl::Status Load() {
    auto sw = LoadBenchModel(scorer_name_);
    if (!sw.ok()) return sw.status();
    auto tw = LoadBenchModel(target_name_);
    if (!tw.ok()) return tw.status();
    auto sm = CpuModelRunner::CreateForSequences(*sw, 2);
    if (!sm.ok()) return sm.status();
    auto tm = CpuModelRunner::CreateForSequences(*tw, 2);
    if (!tm.ok()) return tm.status();
    scorer_ = *std::move(sm);
    target_ = *std::move(tm);
    auto tok = LoadTokenizer("models/" + target_name_);
    if (!tok.ok()) return tok.status();
    tok_ = *std::move(tok);
    return absl::OkStatus();
  }

  absl::Status Retrieval(const std::vector<Prompt>& prompts,
                         const std::vector<double>& ratios,
                         const std::vector<double>& masses,
                         const std::string& counted_path, json* out);
  absl::Status Fidelity(const std::string& dir,
                        const std::vector<double>& ratios,
                        const std::vector<double>& masses, json* out);

 private:
  absl::StatusOr<std::string> Continue(absl::Span<const int> ids,
                                       absl::Span<const int> kept, int gen) {
    auto run = RunPruned(*target_, ids, kept, gen);
    if (!run.ok()) return run.status();
    return tok_->Decode(run->continuation);
  }

  std::string scorer_name_, target_name_;
  std::unique_ptr<CpuModelRunner> scorer_, target_;
  std::unique_ptr<Tokenizer> tok_;
};

absl::Status PairEval::Retrieval(const std::vector<Prompt>& prompts,
                                 const std::vector<double>& ratios,
                                 const std::vector<double>& masses,
                                 const std::string& counted_path,
                                 json* out) {
  std::ofstream counted_file;
  if (!counted_path.empty()) {
    counted_file.open(counted_path);
    if (!counted_file) {
      return absl::InvalidArgumentError(
          absl::StrCat("--counted_out: cannot write ", counted_path));
    }
  }
  const int ctx = std::min(target_->config().max_position_embeddings,
                           scorer_->config().max_position_embeddings - 8);
  // [method][ratio index] and [method][kind][ratio index].
  std::map<std::string, std::vector<Cell>> cells;
  std::map<std::string, std::map<std::string, std::vector<Cell>>> by_kind;
  std::vector<Cell> mass_cells(masses.size());
  int too_long = 0, full_wrong = 0, guessable = 0, counted = 0;
  std::vector<double> distances, fact_pct0, fact_pct8;
  // Importance (look-ahead 8) around the fact start, relative to the
  // prompt's mean, offsets -16 .. +16.
  constexpr int kHalo = 16;
  constexpr int kSlack = 6;
  std::vector<double> halo(2 * kHalo + 1, 0.0);
  std::vector<int> halo_n(2 * kHalo + 1, 0);
  auto cell = [&](const std::string& m, const std::string& kind, size_t r)
      -> std::pair<Cell*, Cell*> {
    auto& v = cells[m];
    if (v.empty()) v.resize(ratios.size());
    auto& k = by_kind[m][kind];
    if (k.empty()) k.resize(ratios.size());
    return {&v[r], &k[r]};
  };

  for (size_t pi = 0; pi < prompts.size(); ++pi) {
    const Prompt& p = prompts[pi];
    const std::string text = p.before + p.fact + p.after;
    auto ids = tok_->Encode(text, /*add_bos=*/true);
    auto pre = tok_->Encode(p.before, true);
    auto thru = tok_->Encode(p.before + p.fact, true);
    auto ans = tok_->Encode(" " + p.answer, false);
    if (!ids.ok() || !pre.ok() || !thru.ok() || !ans.ok()) {
      return absl::InternalError("tokenizer failed on a prompt");
    }
    // The answer's tokens plus a short sentence end / restart.
    const int gen = static_cast<int>(ans->size()) + kSlack;
    const int n = static_cast<int>(ids->size());
    if (n + gen > ctx) {
      ++too_long;
      continue;
    }
    // The fact's tokens, [fa, fb): from where the prefix before it ends.
    const int fa = std::min<int>(pre->size(), n - 1);
    const int fb = std::max(fa + 1, std::min<int>(thru->size(), n - 1));
    std::vector<int> all(n);
    std::iota(all.begin(), all.end(), 0);
    auto full = Continue(*ids, all, gen);
    if (!full.ok()) return full.status();
    if (static_cast<int>(pi) < absl::GetFlag(FLAGS_show)) {
      std::fprintf(stderr, "[%s n=%d] ...%s| %s\n", p.answer.c_str(), n,
                   text.substr(text.size() - std::min<size_t>(60, text.size()))
                       .c_str(),
                   full->c_str());
    }
    if (!StatesAnswer(*full, p.answer)) {
      ++full_wrong;
      continue;
    }
    // Control: without the fact's tokens the target must NOT state it,
    // else the cue alone gives the answer away and nothing is retrieved.
    std::vector<int> no_fact;
    for (int i = 0; i < n; ++i) {
      if (i < fa || i >= fb) no_fact.push_back(i);
    }
    auto control = Continue(*ids, no_fact, gen);
    if (!control.ok()) return control.status();
    if (StatesAnswer(*control, p.answer)) {
      ++guessable;
      continue;
    }
    ++counted;
    distances.push_back(n - fb);
    if (counted_file) {
      counted_file << json{{"kind", p.kind},       {"template", p.templ},
                           {"before", p.before},   {"fact", p.fact},
                           {"after", p.after},     {"answer", p.answer}}
                          .dump()
                   << "\n";
    }

    auto imp0 = Importance(*scorer_, *ids, 0);
    auto imp8 = Importance(*scorer_, *ids, 8);
    if (!imp0.ok()) return imp0.status();
    if (!imp8.ok()) return imp8.status();
    // Percentile of the fact's mean importance among all tokens' scores.
    auto percentile = [&](const std::vector<float>& imp) {
      double m = 0;
      for (int i = fa; i < fb; ++i) m += imp[i];
      m /= (fb - fa);
      int below = 0;
      for (float x : imp) below += x < m;
      return 100.0 * below / n;
    };
    fact_pct0.push_back(percentile(*imp0));
    fact_pct8.push_back(percentile(*imp8));
    double mean8 = 0;
    for (float x : *imp8) mean8 += x;
    mean8 /= n;
    for (int d = -kHalo; d <= kHalo; ++d) {
      const int i = fa + d;
      if (i < 1 || i >= n || mean8 <= 0) continue;
      halo[d + kHalo] += (*imp8)[i] / mean8;
      ++halo_n[d + kHalo];
    }

    auto fact_in = [&](const std::vector<int>& kept) {
      for (int i = fa; i < fb; ++i) {
        if (!std::binary_search(kept.begin(), kept.end(), i)) return false;
      }
      return true;
    };
    auto record = [&](const std::string& method, size_t r,
                      const std::vector<int>& kept) -> absl::Status {
      auto c = Continue(*ids, kept, gen);
      if (!c.ok()) return c.status();
      const bool ok = StatesAnswer(*c, p.answer);
      const double frac = static_cast<double>(kept.size()) / n;
      auto [all_c, kind_c] = cell(method, p.kind, r);
      all_c->Add(ok, frac, fact_in(kept));
      kind_c->Add(ok, frac, fact_in(kept));
      return absl::OkStatus();
    };
    for (size_t r = 0; r < ratios.size(); ++r) {
      for (const SpecConfig& sc : kSpec) {
        auto kept = Select(sc.look_ahead ? *imp8 : *imp0, ratios[r], 0,
                           sc.chunk);
        if (!kept.ok()) return kept.status();
        if (auto s = record(sc.Name(), r, *kept); !s.ok()) return s;
        if (sc.look_ahead == 8 && (sc.chunk == 8 || sc.chunk == 32)) {
          const int count = static_cast<int>(kept->size());
          const std::string suf = absl::StrCat("_c", sc.chunk);
          for (auto& [name, kb] :
               std::vector<std::pair<std::string, std::vector<int>>>{
                   {"recent" + suf, KeepRecent(n, count)},
                   {"sink_recent" + suf, KeepSinkRecent(n, count)},
                   {"random" + suf,
                    KeepRandom(n, count, 1000 * pi + r)}}) {
            if (auto s = record(name, r, kb); !s.ok()) return s;
          }
        }
      }
    }
    for (size_t m = 0; m < masses.size(); ++m) {
      auto kept = Select(*imp8, 1.0, masses[m], 8);
      if (!kept.ok()) return kept.status();
      auto c = Continue(*ids, *kept, gen);
      if (!c.ok()) return c.status();
      mass_cells[m].Add(StatesAnswer(*c, p.answer),
                        static_cast<double>(kept->size()) / n, fact_in(*kept));
    }
  }

  if (counted_file.is_open()) {
    counted_file.close();
    if (!counted_file) {
      return absl::InternalError(absl::StrCat("cannot write ", counted_path));
    }
  }

  json& o = *out;
  o["prompts"] = prompts.size();
  o["too_long"] = too_long;
  o["full_prefill_wrong"] = full_wrong;
  o["guessable_without_fact"] = guessable;
  o["counted"] = counted;
  const MeanStd dist = ComputeMeanStd(distances);
  o["fact_to_cue_tokens"] = {
      {"mean", dist.mean},
      {"min", distances.empty() ? 0 : *std::min_element(distances.begin(),
                                                        distances.end())}};
  o["fact_importance_percentile"] = {
      {"look_ahead_0", ComputeMeanStd(fact_pct0).mean},
      {"look_ahead_8", ComputeMeanStd(fact_pct8).mean}};
  json h = json::array();
  for (int d = -kHalo; d <= kHalo; ++d) {
    h.push_back({{"offset", d},
                 {"relative_importance",
                  halo_n[d + kHalo] ? halo[d + kHalo] / halo_n[d + kHalo]
                                    : 0.0}});
  }
  o["importance_around_fact"] = h;
  o["ratios"] = ratios;
  json methods = json::object();
  for (const auto& [m, v] : cells) {
    json row = json::array();
    for (const Cell& c : v) row.push_back(c.ToJson());
    json kinds = json::object();
    for (const auto& [k, kv] : by_kind[m]) {
      json kr = json::array();
      for (const Cell& c : kv) kr.push_back(c.ToJson());
      kinds[k] = kr;
    }
    methods[m] = {{"by_ratio", row}, {"by_kind", kinds}};
  }
  o["methods"] = methods;
  json mj = json::array();
  for (size_t m = 0; m < masses.size(); ++m) {
    json c = mass_cells[m].ToJson();
    c["keep_mass"] = masses[m];
    mj.push_back(c);
  }
  o["keep_mass"] = mj;
  return absl::OkStatus();
}

absl::Status PairEval::Fidelity(const std::string& dir,
                                const std::vector<double>& ratios,
                                const std::vector<double>& masses,
                                json* out) {
  constexpr int kGen = 32;
  const int ctx = std::min(target_->config().max_position_embeddings - kGen,
                           scorer_->config().max_position_embeddings - 8);
  const std::vector<std::string> files = PromptFiles({dir});
  if (files.empty()) {
    return absl::NotFoundError(absl::StrCat("no *.txt prompts in ", dir));
  }
  struct Acc {
    double top1 = 0, match = 0, kept = 0;
    int n = 0;
  };
  std::vector<Acc> fixed(ratios.size()), by_mass(masses.size());
  for (const std::string& f : files) {
    auto text = ReadPromptFile(f);
    if (!text.ok()) return text.status();
    auto ids = tok_->Encode(*text, true);
    if (!ids.ok()) return ids.status();
    if (static_cast<int>(ids->size()) > ctx) ids->resize(ctx);
    const int n = static_cast<int>(ids->size());
    std::vector<int> all(n);
    std::iota(all.begin(), all.end(), 0);
    auto full = RunPruned(*target_, *ids, all, kGen);
    if (!full.ok()) return full.status();
    auto imp = Importance(*scorer_, *ids, 8);
    if (!imp.ok()) return imp.status();
    auto add = [&](Acc* a, const std::vector<int>& kept) -> absl::Status {
      auto run = RunPruned(*target_, *ids, kept, kGen);
      if (!run.ok()) return run.status();
      a->top1 += Argmax(full->next_logits) == Argmax(run->next_logits);
      a->match += MatchRate(full->continuation, run->continuation);
      a->kept += static_cast<double>(kept.size()) / n;
      ++a->n;
      return absl::OkStatus();
    };
    for (size_t r = 0; r < ratios.size(); ++r) {
      auto kept = Select(*imp, ratios[r], 0, 8);
      if (!kept.ok()) return kept.status();
      if (auto s = add(&fixed[r], *kept); !s.ok()) return s;
    }
    for (size_t m = 0; m < masses.size(); ++m) {
      auto kept = Select(*imp, 1.0, masses[m], 8);
      if (!kept.ok()) return kept.status();
      if (auto s = add(&by_mass[m], *kept); !s.ok()) return s;
    }
  }
  auto row = [](const Acc& a) {
    return json{{"top1_agreement", a.n ? a.top1 / a.n : 0.0},
                {"match_rate", a.n ? a.match / a.n : 0.0},
                {"kept_fraction", a.n ? a.kept / a.n : 0.0},
                {"n", a.n}};
  };
  json fr = json::array(), mr = json::array();
  for (size_t r = 0; r < ratios.size(); ++r) {
    json x = row(fixed[r]);
    x["keep_ratio"] = ratios[r];
    fr.push_back(x);
  }
  for (size_t m = 0; m < masses.size(); ++m) {
    json x = row(by_mass[m]);
    x["keep_mass"] = masses[m];
    mr.push_back(x);
  }
  (*out)["fixed_ratio"] = fr;
  (*out)["keep_mass"] = mr;
  return absl::OkStatus();
}

std::string Markdown(const json& results) {
  std::string md = absl::StrCat(
      "# Long-range retrieval evaluation\n\n"
      "Generated by `bench/run_retrieval_eval.sh` (",
      results["date"].get<std::string>(),
      "). Prompts: `bench/make_retrieval_prompts.py` (seeded; the "
      "counted ones are kept in `bench/data/retrieval_counted_*.jsonl`). "
      "Accuracy = share of "
      "counted prompts (full prefill states the fact, and the same prompt "
      "with only the fact's tokens removed does not) whose pruned greedy "
      "continuation still states the fact, with Wilson 95% intervals; kept = mean kept fraction of prompt "
      "tokens. Baselines keep as many tokens as SpecPrefill "
      "(look-ahead 8) at the chunk size named.\n");
  for (const auto& [pair, r] : results["pairs"].items()) {
   absl::StrAppend(&md, "\n## ", pair, "\n");
   const json& fid = r["fidelity"];
   for (const auto& [band, ret] : r["retrieval"].items()) {
    absl::StrAppend(
        &md, "\n### ", band, " distance\n\n", ret["prompts"].get<int>(),
        " prompts: ", ret["counted"].get<int>(),
        " counted (full prefill states the fact), ",
        ret["full_prefill_wrong"].get<int>(), " where full prefill fails, ",
        ret["guessable_without_fact"].get<int>(),
        " where the target states the answer even with the fact's tokens "
        "removed (excluded), ",
        ret["too_long"].get<int>(), " too long. Fact to cue: ",
        absl::StrFormat("%.0f", ret["fact_to_cue_tokens"]["mean"].get<double>()),
        " tokens on average (min ",
        absl::StrFormat("%.0f", ret["fact_to_cue_tokens"]["min"].get<double>()),
        ").\n\n");
    const json& ratios = ret["ratios"];
    const json& methods = ret["methods"];
    if (ret["counted"].get<int>() == 0 || methods.empty() || ratios.empty()) {
      absl::StrAppend(&md,
                      "No prompt was counted in this band, so there are no "
                      "accuracies to compare.\n");
      continue;
    }
    absl::StrAppend(&md, "| method |");
    for (const auto& x : ratios) {
      absl::StrAppend(&md, " keep ", absl::StrFormat("%.1f", x.get<double>()),
                      " |");
    }
    absl::StrAppend(&md, "\n|---|");
    for (size_t i = 0; i < ratios.size(); ++i) absl::StrAppend(&md, "---|");
    absl::StrAppend(&md, "\n");
    for (const auto& [m, v] : methods.items()) {
      absl::StrAppend(&md, "| ", m, " |");
      for (const auto& c : v["by_ratio"]) {
        absl::StrAppend(&md, " ", Pct(c), " (kept ",
                        absl::StrFormat("%.2f", c["kept_fraction"].get<double>()),
                        ", fact kept ",
                        absl::StrFormat("%.0f%%",
                                        100 * c["fact_kept"].get<double>()),
                        ") |");
      }
      absl::StrAppend(&md, "\n");
    }
    // Per fact kind at keep 0.2 (or the second ratio).
    const size_t rk = ratios.size() > 1 ? 1 : 0;
    absl::StrAppend(&md, "\nBy fact kind at keep ",
                    absl::StrFormat("%.1f", ratios[rk].get<double>()),
                    ":\n\n| method |");
    // Every kind any method saw (each counted prompt goes through every
    // method, so all of them see the same kinds).
    std::set<std::string> kinds;
    for (const auto& [m, v] : methods.items()) {
      for (const auto& [k, _] : v["by_kind"].items()) kinds.insert(k);
    }
    for (const std::string& k : kinds) absl::StrAppend(&md, " ", k, " |");
    absl::StrAppend(&md, "\n|---|");
    for (size_t i = 0; i < kinds.size(); ++i) absl::StrAppend(&md, "---|");
    absl::StrAppend(&md, "\n");
    for (const char* m : {"specprefill_c8_la8", "specprefill_c32_la8",
                          "recent_c8", "sink_recent_c8", "random_c8"}) {
      if (!methods.contains(m)) continue;
      absl::StrAppend(&md, "| ", m, " |");
      for (const auto& k : kinds) {
        const json& by_kind = methods[m]["by_kind"];
        if (!by_kind.contains(k)) {
          absl::StrAppend(&md, " - |");
          continue;
        }
        const json& c = by_kind[k][rk];
        absl::StrAppend(&md, " ", Pct(c), " n=", c["n"].get<int>(), " |");
      }
      absl::StrAppend(&md, "\n");
    }
    absl::StrAppend(
        &md, "\nThe fact's mean importance percentile among the prompt's "
        "tokens: ",
        absl::StrFormat(
            "%.0f (look-ahead 0), %.0f (look-ahead 8)",
            ret["fact_importance_percentile"]["look_ahead_0"].get<double>(),
            ret["fact_importance_percentile"]["look_ahead_8"].get<double>()),
        ". Importance around the fact's first token (look-ahead 8, relative "
        "to the prompt mean), offsets -4..+4: ");
    std::vector<std::string> halo;
    for (const auto& h : ret["importance_around_fact"]) {
      const int d = h["offset"].get<int>();
      if (d < -4 || d > 4) continue;
      halo.push_back(absl::StrFormat("%+d: %.2f", d,
                                     h["relative_importance"].get<double>()));
    }
    absl::StrAppend(&md, absl::StrJoin(halo, ", "), ".\n");
    absl::StrAppend(&md,
                    "\nKeep by importance mass (chunk 8, look-ahead 8, "
                    "keep_ratio ceiling 1):\n\n| keep_mass | accuracy | "
                    "kept | fact kept |\n|---|---|---|---|\n");
    for (const json& c : ret["keep_mass"]) {
      absl::StrAppend(
          &md, "| ", absl::StrFormat("%.2f", c["keep_mass"].get<double>()),
          " | ", Pct(c), " | ",
          absl::StrFormat("%.2f | %.0f%%", c["kept_fraction"].get<double>(),
                          100 * c["fact_kept"].get<double>()),
          " |\n");
    }
   }
    if (fid.contains("keep_mass")) {
      absl::StrAppend(&md,
                      "\n### Fidelity on the TinyStories continuation "
                      "prompts (bench/eval_prompts, 32 greedy tokens vs "
                      "the full prompt; chunk 8, look-ahead 8)\n\n| "
                      "selection | top-1 agreement | match rate | kept |\n"
                      "|---|---|---|---|\n");
      for (const auto& x : fid["keep_mass"]) {
        absl::StrAppend(
            &md, absl::StrFormat("| keep_mass %.2f | %.3f | %.3f | %.2f |\n",
                                 x["keep_mass"].get<double>(),
                                 x["top1_agreement"].get<double>(),
                                 x["match_rate"].get<double>(),
                                 x["kept_fraction"].get<double>()));
      }
    }
    if (fid.contains("fixed_ratio")) {
      for (const auto& x : fid["fixed_ratio"]) {
        absl::StrAppend(
            &md,
            absl::StrFormat("| keep_ratio %.1f | %.3f | %.3f | %.2f |\n",
                            x["keep_ratio"].get<double>(),
                            x["top1_agreement"].get<double>(),
                            x["match_rate"].get<double>(),
                            x["kept_fraction"].get<double>()));
      }
    }
  }
  return md;
}

absl::Status Main() {
  const auto ratios_or = ParseList("ratios", absl::GetFlag(FLAGS_ratios));
  if (!ratios_or.ok()) return ratios_or.status();
  const auto masses_or = ParseList("masses", absl::GetFlag(FLAGS_masses));
  if (!masses_or.ok()) return masses_or.status();
  const std::vector<double>& ratios = *ratios_or;
  const std::vector<double>& masses = *masses_or;
  if (ratios.empty()) return absl::InvalidArgumentError("--ratios is empty");
  const std::vector<std::string> bands =
      absl::StrSplit(absl::GetFlag(FLAGS_bands), ',', absl::SkipEmpty());
  std::vector<std::pair<std::string, std::string>> pairs;
  for (absl::string_view spec :
       absl::StrSplit(absl::GetFlag(FLAGS_pairs), ',', absl::SkipEmpty())) {
    const std::vector<std::string> parts = absl::StrSplit(spec, ':');
    if (parts.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("--pairs entry \"", spec, "\" is not scorer:target"));
    }
    pairs.emplace_back(parts[0], parts[1]);
    // Where the counted prompts go must be writable before hours of work.
    for (const std::string& band : bands) {
      if (auto s = PrepareCountedOut(
              Expand(absl::GetFlag(FLAGS_counted_out), parts[1], band));
          !s.ok()) {
        return s;
      }
    }
  }
  json results;
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof(date), "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  results["date"] = date;
  results["pairs"] = json::object();
  for (const auto& [scorer, target] : pairs) {
    const std::string spec = absl::StrCat(scorer, ":", target);
    PairEval pe(scorer, target);
    if (auto s = pe.Load(); !s.ok()) return s;
    const double t0 = Now();
    json r;
    r["retrieval"] = json::object();
    for (const std::string& band : bands) {
      auto prompts =
          ReadPrompts(Expand(absl::GetFlag(FLAGS_prompts), target, band),
                      absl::GetFlag(FLAGS_limit));
      if (!prompts.ok()) return prompts.status();
      const std::string counted_path =
          Expand(absl::GetFlag(FLAGS_counted_out), target, band);
      json& out = r["retrieval"][band];
      if (auto s = pe.Retrieval(*prompts, ratios, masses, counted_path, &out);
          !s.ok()) {
        return s;
      }
      std::fprintf(stderr, "%s -> %s, %s: %d of %zu counted\n",
                   scorer.c_str(), target.c_str(), band.c_str(),
                   out["counted"].get<int>(), prompts->size());
    }
    r["fidelity"] = json::object();
    if (!absl::GetFlag(FLAGS_fidelity_prompts).empty()) {
      if (auto s = pe.Fidelity(absl::GetFlag(FLAGS_fidelity_prompts), ratios,
                               masses, &r["fidelity"]);
          !s.ok()) {
        return s;
      }
    }
    r["seconds"] = Now() - t0;
    std::fprintf(stderr, "%s -> %s: %.0f s\n", scorer.c_str(),
                 target.c_str(), r["seconds"].get<double>());
    results["pairs"][spec] = r;
  }
  const std::string dir = absl::GetFlag(FLAGS_out_dir);
  if (dir.empty()) return absl::InvalidArgumentError("--out_dir is empty");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("--out_dir ", dir, ": ", ec.message()));
  }
  const std::string md = Markdown(results);
  if (auto s = WriteText(dir + "/retrieval_results.json",
                         results.dump(1) + "\n");
      !s.ok()) {
    return s;
  }
  if (auto s = WriteText(dir + "/retrieval_results.md", md); !s.ok()) return s;
  std::printf("%s", md.c_str());
  std::fprintf(stderr, "results in %s\n", dir.c_str());
  return absl::OkStatus();
}

}  // namespace
}  // namespace bench
}  // namespace specserve

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const absl::Status s = specserve::bench::Main();
  if (!s.ok()) {
    std::fprintf(stderr, "eval_retrieval: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
