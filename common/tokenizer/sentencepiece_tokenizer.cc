#include "common/tokenizer/sentencepiece_tokenizer.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace specserve {
namespace {

absl::Status FromShim(const spm_shim::ShimStatus& s, std::string_view what) {
  const std::string msg = absl::StrCat(
      absl::string_view(what.data(), what.size()), ": ", s.message);
  switch (s.code) {
    case spm_shim::ShimCode::kOk:
      return absl::OkStatus();
    case spm_shim::ShimCode::kInvalidArgument:
      return absl::InvalidArgumentError(msg);
    case spm_shim::ShimCode::kNotFound:
      return absl::NotFoundError(msg);
    case spm_shim::ShimCode::kUnavailable:
      return absl::UnavailableError(msg);
    default:
      return absl::InternalError(msg);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>>
SentencePieceTokenizer::Load(const std::string& model_path) {
  spm_shim::ShimStatus status;
  std::unique_ptr<spm_shim::SpmProcessor> processor =
      spm_shim::SpmProcessor::Load(model_path, &status);
  if (processor == nullptr) {
    // The library reports unparsable files as INTERNAL ("cannot parse").
    if (status.code == spm_shim::ShimCode::kInternal) {
      status.code = spm_shim::ShimCode::kInvalidArgument;
    }
    return FromShim(status,
                    absl::StrCat("loading sentencepiece model ", model_path));
  }
  return std::unique_ptr<SentencePieceTokenizer>(
      new SentencePieceTokenizer(std::move(processor), model_path));
}

SentencePieceTokenizer::SentencePieceTokenizer(
    std::unique_ptr<spm_shim::SpmProcessor> processor, std::string path)
    : processor_(std::move(processor)),
      path_(std::move(path)),
      vocab_size_(processor_->GetPieceSize()),
      bos_id_(processor_->bos_id()),
      eos_id_(processor_->eos_id()),
      unk_id_(processor_->unk_id()),
      pad_id_(processor_->pad_id()) {
  std::vector<std::string> pieces;
  pieces.reserve(vocab_size_);
  for (int id = 0; id < vocab_size_; ++id) {
    pieces.push_back(processor_->IdToPiece(id));
  }
  fingerprint_ = ComputeVocabFingerprint(kind(), pieces, bos_id_, eos_id_,
                                         unk_id_, pad_id_);
}

absl::StatusOr<std::vector<int>> SentencePieceTokenizer::Encode(
    std::string_view text, bool add_bos) const {
  std::vector<int> ids;
  spm_shim::ShimStatus s = processor_->Encode(text, &ids);
  if (!s.ok()) {
    return FromShim(s, absl::StrCat("sentencepiece encode (", path_, ")"));
  }
  if (add_bos && bos_id_ >= 0) ids.insert(ids.begin(), bos_id_);
  return ids;
}

absl::StatusOr<std::string> SentencePieceTokenizer::Decode(
    absl::Span<const int> ids) const {
  for (int id : ids) {
    if (id < 0 || id >= vocab_size_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "token id ", id, " outside [0, ", vocab_size_, ") for ", path_));
    }
  }
  std::string text;
  spm_shim::ShimStatus s =
      processor_->Decode(std::vector<int>(ids.begin(), ids.end()), &text);
  if (!s.ok()) {
    return FromShim(s, absl::StrCat("sentencepiece decode (", path_, ")"));
  }
  return text;
}

absl::StatusOr<std::string> SentencePieceTokenizer::IdToPiece(int id) const {
  if (id < 0 || id >= vocab_size_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "token id ", id, " outside [0, ", vocab_size_, ") for ", path_));
  }
  return processor_->IdToPiece(id);
}

}  // namespace specserve
