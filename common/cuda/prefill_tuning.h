#ifndef SPECSERVE_COMMON_CUDA_PREFILL_TUNING_H_
#define SPECSERVE_COMMON_CUDA_PREFILL_TUNING_H_

// Choosing the prefill attention kernel at start-up by measuring it, as
// PyTorch's torch.backends.cudnn.benchmark picks convolution algorithms:
// CudaModelRunner::TunePrefillAttention times one long prefill chunk with
// each kernel that applies (cudnn_attention.h, flash_mma.h, the WMMA
// FlashAttention) and keeps the fastest whose logits agree with the
// reference's. These are its host-side rules: plain C++, tested on the CPU.

#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace specserve {

/// One prefill attention kernel's trial.
struct PrefillPathTrial {
  /// "flash" (the WMMA FlashAttention, the reference), "mma", "cudnn".
  std::string name;
  /// Whether it ran; false where it does not apply to this model or GPU
  /// (head_dim, dtype, no libcudnn, no cuDNN engine for the shape) or its
  /// forward failed: `note` says which.
  bool ran = false;
  std::string note;
  /// Median wall seconds of the timed chunk forwards (tokens embedded to
  /// last-row logits on the host).
  double seconds = 0;
  /// Last-row logits against the reference's: MaxRelDiff, and whether the
  /// top-1 token agrees (TopOneAgrees). The reference agrees with itself.
  double max_rel_diff = 0;
  bool agrees = false;
};

/// The outcome of a tuning run.
struct PrefillTuning {
  /// Tokens of the scratch sequence after the timed chunk (cached
  /// context + chunk), and the chunk's rows.
  int context_tokens = 0;
  int chunk_rows = 0;
  /// trials[0] is the reference.
  std::vector<PrefillPathTrial> trials;
  /// Index into trials of the kernel kept (ChoosePrefillTrial).
  int chosen = -1;
};

/// The services' tuning run (prefill_attention "auto"): the timed chunk
/// has the smallest CUDA default of --max_num_batched_tokens rows and ends at
/// kPrefillTuningContextTokens tokens, long enough that attention, not the
/// projections, sets most of the chunk's time with the WMMA kernel.
inline constexpr int kPrefillTuningChunkRows = 2048;
inline constexpr int kPrefillTuningContextTokens = 8192;

/// Near-tie tolerance of TopOneAgrees, as a fraction of max |reference
/// logit|: bf16 kernels that sum in another order move logits by ~1e-3
/// of that.
inline constexpr double kPrefillTieTolerance = 1e-2;
/// A library kernel ("cudnn") is kept when it is at most this fraction
/// slower than the fastest: a well-kept library over our own code.
inline constexpr double kPrefillLibraryMargin = 0.05;
/// PrefillPathTrial::note of the "cudnn" trial where libcudnn does not
/// load on this host (then no prefill runs on cuDNN, whatever the shape).
inline constexpr char kLibcudnnUnavailable[] = "libcudnn unavailable";

/// max_j |logits[j] - ref[j]| / max_j |ref[j]|; 0 for empty or all-zero
/// `ref`, +inf when the sizes differ or `logits` holds a NaN.
double MaxRelDiff(absl::Span<const float> ref, absl::Span<const float> logits);

/// Whether `logits` picks the reference's top-1 token up to a near tie:
/// ref[argmax(logits)] >= max(ref) - tie * max |ref|. False when the sizes
/// differ, either is empty or `logits` holds a NaN.
bool TopOneAgrees(absl::Span<const float> ref, absl::Span<const float> logits,
                  double tie = kPrefillTieTolerance);

/// The median of `x` (the mean of the middle two for even sizes); 0 when
/// empty.
double MedianSeconds(std::vector<double> x);

/// The trial to keep: the fastest that ran and agrees, except that the
/// trial named `library` is kept when it ran, agrees and is within
/// `library_margin` of that fastest. trials[0] (the reference) is kept
/// when nothing else qualifies, even if it did not run; -1 when `trials`
/// is empty.
int ChoosePrefillTrial(absl::Span<const PrefillPathTrial> trials,
                       absl::string_view library = "cudnn",
                       double library_margin = kPrefillLibraryMargin);

/// One log line: the kept kernel, then every trial's milliseconds,
/// relative difference and agreement (or why it did not run), e.g.
/// "prefill attention: cudnn (tuned on a 2048-row chunk at 8192 tokens:
/// cudnn 12.10 ms, mma 30.52 ms, flash 110.20 ms ...)".
std::string DescribePrefillTuning(const PrefillTuning& tuning);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_CUDA_PREFILL_TUNING_H_
