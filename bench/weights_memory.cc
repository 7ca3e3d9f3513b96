// Resident memory and start-up time of the CPU engine's weights: loads a
// checkpoint directory the way the services do (LoadModelRunner with
// --weight_dtype: every weight packed from the mapped file, 32 rows at a
// time), runs one forward, and
// prints the process's peak and current resident set against the bytes
// the runner holds and the checkpoint's size on disk.
//
//   bazel-bin/bench/weights_memory --model DIR --weight_dtype bf16
//
// Run one dtype per process: peak RSS (VmHWM) covers the whole run.

#include <sys/stat.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "bench/bench_util.h"
#include "common/engine/cpu_model_runner.h"
#include "common/engine/model_runner_factory.h"

ABSL_FLAG(std::string, model, "", "checkpoint directory (HF layout)");
ABSL_FLAG(std::string, weight_dtype, "auto", "auto | f32 | bf16 | int8");
ABSL_FLAG(int, threads, 2, "engine threads");
ABSL_FLAG(bool, whole, false,
          "load the whole model in f32 first (LoadModelWeights, then the "
          "consuming CreateModelRunner) instead of packing from the file");

namespace specserve {
namespace bench {
namespace {

double DirBytes(const std::string& dir) {
  double total = 0;
  for (const char* f : {"model.safetensors"}) {
    struct stat st;
    if (::stat((dir + "/" + f).c_str(), &st) == 0) total += st.st_size;
  }
  return total;
}

int Run() {
  SetEngineThreads(absl::GetFlag(FLAGS_threads));
  const std::string dir = absl::GetFlag(FLAGS_model);
  RunnerOptions o;
  o.device = "cpu";
  o.weight_dtype = absl::GetFlag(FLAGS_weight_dtype);
  o.kv_cache.pool_bytes = 64 << 20;
  const double t0 = Now();
  double t_load = 0;
  absl::StatusOr<std::unique_ptr<ModelRunner>> r;
  if (absl::GetFlag(FLAGS_whole)) {
    absl::StatusOr<ModelWeights> w = LoadModelWeights(dir);
    if (!w.ok()) {
      std::fprintf(stderr, "%s\n", w.status().ToString().c_str());
      return 1;
    }
    t_load = Now() - t0;
    r = CreateModelRunner(*std::move(w), o);
  } else {
    r = LoadModelRunner(dir, o);
  }
  if (!r.ok()) {
    std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
    return 1;
  }
  const double t_ready = Now() - t0;
  if (t_load == 0) t_load = t_ready;
  auto* cpu = static_cast<CpuModelRunner*>(r->get());
  auto seq = cpu->NewSequence(16);
  if (!seq.ok()) return 1;
  const int ids[4] = {1, 2, 3, 4}, pos[4] = {0, 1, 2, 3};
  ForwardInput in;
  in.token_ids = ids;
  in.position_ids = pos;
  ForwardOutput out;
  if (!cpu->Forward(in, seq->get(), &out).ok()) return 1;
  const double rss = ProcStatusBytes("VmRSS"), peak = ProcStatusBytes("VmHWM");
  const double held = cpu->weight_bytes(), disk = DirBytes(dir);
  std::printf(
      "| %s | %s | %s (%s) | %.2f | %.2f | %.2f (%.2fx) | %.2f (%.2fx) | "
      "%.1f | %.1f |\n",
      dir.substr(dir.find_last_of('/') + 1).c_str(),
      absl::GetFlag(FLAGS_whole) ? "whole f32, then pack" : "from the file",
      WeightDTypeName(cpu->weight_dtype()).c_str(),
      PackedKernelName(cpu->weight_dtype()).c_str(), disk / 1e9, held / 1e9,
      rss / 1e9, rss / held, peak / 1e9, peak / held, t_load, t_ready);
  return 0;
}

}  // namespace
}  // namespace bench
}  // namespace specserve

int main(int argc, char** argv) {
  specserve::MaybeReexecForAvx512(argv);
  absl::ParseCommandLine(argc, argv);
  std::printf(
      "| checkpoint | load | weights | on disk GB | held GB | RSS GB (x held) | "
      "peak RSS GB (x held) | load s | ready s |\n");
  return specserve::bench::Run();
}
