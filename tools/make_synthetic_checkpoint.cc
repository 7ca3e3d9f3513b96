// Writes a synthetic random-weight Llama / Qwen2 / Qwen3 checkpoint (config.json +
// model.safetensors) with the shapes of a real model, for speed measurements
// at realistic sizes. Presets: see PresetNames() in common/model/synthetic.h.
// Example (about 1 s for llama2-110m F32, 20 s for llama-3.2-1b F32):
//   bazel run //tools:make_synthetic_checkpoint -- --preset llama2-110m
//       --out /tmp/llama2-110m --seed 0 --dtype F32

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_join.h"
#include "common/model/synthetic.h"

ABSL_FLAG(std::string, preset, "",
          "model shape: llama2-15m | llama2-110m | llama-3.2-1b | "
          "llama-3.2-3b | llama-3.1-8b | qwen2.5-0.5b | qwen2.5-7b | "
          "qwen3-0.6b | qwen3-8b | llama-3-draft-small, or a test-size "
          "*-tiny preset (see "
          "common/model/synthetic.h)");
ABSL_FLAG(std::string, out, "", "output directory (created if missing)");
ABSL_FLAG(uint64_t, seed, 0, "random seed; the same seed gives the same bytes");
ABSL_FLAG(std::string, dtype, "F32", "stored dtype: F32 | BF16 | F16");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Writes a random-weight Llama checkpoint with real shapes.\n"
      "  make_synthetic_checkpoint --preset NAME --out DIR [--seed 0] "
      "[--dtype F32|BF16|F16]");
  absl::ParseCommandLine(argc, argv);
  const std::string preset = absl::GetFlag(FLAGS_preset);
  const std::string out = absl::GetFlag(FLAGS_out);
  if (preset.empty() || out.empty()) {
    std::fprintf(stderr,
                 "error: --preset and --out are required; presets: %s\n",
                 absl::StrJoin(specserve::PresetNames(), ", ").c_str());
    return 2;
  }
  absl::StatusOr<specserve::ModelConfig> config =
      specserve::PresetConfig(preset);
  if (!config.ok()) {
    std::fprintf(stderr, "error: %s\n", config.status().ToString().c_str());
    return 2;
  }
  const auto start = std::chrono::steady_clock::now();
  absl::Status s = specserve::WriteSyntheticCheckpoint(
      preset, out, absl::GetFlag(FLAGS_seed), absl::GetFlag(FLAGS_dtype));
  if (!s.ok()) {
    std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
    return s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  std::printf("wrote %s (%s, %lld parameters, %s) in %.1f s\n", out.c_str(),
              preset.c_str(),
              static_cast<long long>(specserve::CountParameters(*config)),
              absl::GetFlag(FLAGS_dtype).c_str(), seconds);
  return 0;
}
