#ifndef SPECSERVE_COMMON_TOKENIZER_SPM_SHIM_H_
#define SPECSERVE_COMMON_TOKENIZER_SPM_SHIM_H_

// Plain-C++ facade over libsentencepiece, loaded in isolation (see the
// comment at the top of spm_shim.cc for why). Only std types appear here:
// this header must stay free of Abseil and sentencepiece types, because
// sentencepiece_processor.h and Abseil cannot share a translation unit.

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace specserve {
namespace spm_shim {

/// Error categories the shim reports (a subset of the canonical codes).
enum class ShimCode {
  kOk = 0,
  kInvalidArgument = 3,  ///< The library rejected the model or the input.
  kNotFound = 5,         ///< The model file could not be opened.
  kUnavailable = 14,     ///< libsentencepiece.so.0 could not be loaded.
  kInternal = 13,        ///< Any other library error.
};

/// Result of a fallible shim call: `code` kOk means success; otherwise
/// `message` says what failed.
struct ShimStatus {
  ShimCode code = ShimCode::kOk;
  std::string message;
  bool ok() const { return code == ShimCode::kOk; }
};

/// One loaded sentencepiece model (a `tokenizer.model` ModelProto).
/// Thread-safe for concurrent const calls, like SentencePieceProcessor.
class SpmProcessor {
 public:
  /// Loads the model file at `path`. On failure returns nullptr and fills
  /// `*status` (kUnavailable when the library itself cannot be loaded).
  static std::unique_ptr<SpmProcessor> Load(const std::string& path,
                                            ShimStatus* status);

  ~SpmProcessor();
  SpmProcessor(const SpmProcessor&) = delete;
  SpmProcessor& operator=(const SpmProcessor&) = delete;

  /// Text -> ids (no BOS/EOS added). Any byte string is accepted.
  ShimStatus Encode(std::string_view text, std::vector<int>* ids) const;
  /// Ids -> text; ids must be in [0, GetPieceSize()) (caller checks).
  ShimStatus Decode(const std::vector<int>& ids, std::string* text) const;

  /// Piece string of `id` (caller checks the range).
  std::string IdToPiece(int id) const;
  int GetPieceSize() const;
  bool IsControl(int id) const;
  bool IsByte(int id) const;
  bool IsUnknown(int id) const;
  bool IsUnused(int id) const;
  int bos_id() const;  ///< -1 if the model has none.
  int eos_id() const;
  int unk_id() const;
  int pad_id() const;

 private:
  explicit SpmProcessor(void* processor) : processor_(processor) {}
  void* processor_;  // sentencepiece::SentencePieceProcessor*, owned.
};

}  // namespace spm_shim
}  // namespace specserve

#endif  // SPECSERVE_COMMON_TOKENIZER_SPM_SHIM_H_
