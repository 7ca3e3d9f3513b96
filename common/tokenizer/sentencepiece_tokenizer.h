#ifndef SPECSERVE_COMMON_TOKENIZER_SENTENCEPIECE_TOKENIZER_H_
#define SPECSERVE_COMMON_TOKENIZER_SENTENCEPIECE_TOKENIZER_H_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/tokenizer/spm_shim.h"
#include "common/tokenizer/tokenizer.h"

namespace specserve {

/// Tokenizer over a sentencepiece `tokenizer.model` (Llama-2 / Mistral
/// family), run by Debian's libsentencepiece through the isolation shim in
/// spm_shim.cc. Encode/Decode are exactly the library's EncodeAsIds /
/// DecodeIds (control pieces decode to nothing, unknown to " ⁇ ").
/// Not usable under --config=asan in processes that also load libprotobuf
/// (see spm_shim.cc).
class SentencePieceTokenizer : public Tokenizer {
 public:
  /// Loads `model_path`. NOT_FOUND if the file cannot be opened,
  /// INVALID_ARGUMENT if it is not a sentencepiece model, UNAVAILABLE if the
  /// library cannot be loaded; messages name the file.
  static absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> Load(
      const std::string& model_path);

  absl::StatusOr<std::vector<int>> Encode(std::string_view text,
                                          bool add_bos) const override;
  absl::StatusOr<std::string> Decode(absl::Span<const int> ids) const override;
  absl::StatusOr<std::string> IdToPiece(int id) const override;
  int vocab_size() const override { return vocab_size_; }
  int bos_id() const override { return bos_id_; }
  int eos_id() const override { return eos_id_; }
  int unk_id() const override { return unk_id_; }
  int pad_id() const override { return pad_id_; }
  std::string Fingerprint() const override { return fingerprint_; }
  std::string kind() const override { return "sentencepiece"; }

 private:
  SentencePieceTokenizer(std::unique_ptr<spm_shim::SpmProcessor> processor,
                         std::string path);

  std::unique_ptr<spm_shim::SpmProcessor> processor_;
  std::string path_;  // For error messages.
  int vocab_size_;
  int bos_id_;
  int eos_id_;
  int unk_id_;
  int pad_id_;
  std::string fingerprint_;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_TOKENIZER_SENTENCEPIECE_TOKENIZER_H_
