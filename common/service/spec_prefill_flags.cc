#include "common/service/spec_prefill_flags.h"

#include "absl/flags/flag.h"

ABSL_FLAG(double, default_keep_ratio,
          specserve::SpecPrefillDefaults().keep_ratio,
          "Speculative Prefill: fraction of chunks kept when unset, (0, 1]");
ABSL_FLAG(double, default_keep_mass, specserve::SpecPrefillDefaults().keep_mass,
          "keep-by-importance-mass fraction when unset, [0, 1]; 0 = off "
          "(keep_ratio alone); with it keep_ratio is the ceiling");
ABSL_FLAG(int, default_chunk_size, specserve::SpecPrefillDefaults().chunk_size,
          "selection chunk size (tokens) when unset");
ABSL_FLAG(int, default_pool_kernel_size,
          specserve::SpecPrefillDefaults().pool_kernel_size,
          "importance avg-pool kernel (odd) when unset");
ABSL_FLAG(int, default_look_ahead, specserve::SpecPrefillDefaults().look_ahead,
          "greedy look-ahead tokens scored when unset, [0, 64]");
ABSL_FLAG(int, default_keep_first, specserve::SpecPrefillDefaults().keep_first,
          "prompt tokens always kept at the start when unset");
ABSL_FLAG(int, default_keep_last, specserve::SpecPrefillDefaults().keep_last,
          "prompt tokens always kept at the end when unset");
ABSL_FLAG(int, default_min_prompt_tokens,
          specserve::SpecPrefillDefaults().min_prompt_tokens,
          "prompts shorter than this are not pruned, when unset");

namespace specserve {

SpecPrefillDefaults SpecPrefillDefaultsFromFlags() {
  SpecPrefillDefaults d;
  d.keep_ratio = static_cast<float>(absl::GetFlag(FLAGS_default_keep_ratio));
  d.keep_mass = static_cast<float>(absl::GetFlag(FLAGS_default_keep_mass));
  d.chunk_size = absl::GetFlag(FLAGS_default_chunk_size);
  d.pool_kernel_size = absl::GetFlag(FLAGS_default_pool_kernel_size);
  d.look_ahead = absl::GetFlag(FLAGS_default_look_ahead);
  d.keep_first = absl::GetFlag(FLAGS_default_keep_first);
  d.keep_last = absl::GetFlag(FLAGS_default_keep_last);
  d.min_prompt_tokens = absl::GetFlag(FLAGS_default_min_prompt_tokens);
  return d;
}

}  // namespace specserve
