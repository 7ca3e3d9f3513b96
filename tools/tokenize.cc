// Tokenizes text or detokenizes ids with a model directory's tokenizer.
//   bazel run //tools:tokenize -- --model models/stories260K --text "Once upon"
//     ->
//     {"kind":"sentencepiece","ids":[1,403,...],"pieces":["<s>","▁Once",...]}
//   bazel run //tools:tokenize -- --model models/stories260K --decode 1,403
//     -> Once
// --model takes any directory LoadTokenizer accepts: tokenizer.model, or
// tokenizer.json (+ tokenizer_config.json) as downloaded from HuggingFace,
// byte-level ones (Llama 3, Qwen) included; special tokens written in --text
// (e.g. "<|eot_id|>") become their ids.
// --no_bos omits the BOS id. Exit status 2 for bad arguments, 1 otherwise.

#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "common/tokenizer/tokenizer.h"
#include "common/util/parse.h"
#include "common/util/paths.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, model, "",
          "model directory (tokenizer.model or tokenizer.json)");
ABSL_FLAG(std::string, text, "", "text to encode");
ABSL_FLAG(bool, no_bos, false, "do not prepend the BOS id when encoding");
ABSL_FLAG(std::string, decode, "", "comma-separated ids to decode instead");

namespace specserve {
namespace {

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
  return s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

int Run() {
  if (absl::GetFlag(FLAGS_model).empty()) {
    return Fail(absl::InvalidArgumentError("--model is required"));
  }
  auto tok = LoadTokenizer(ResolveUserPath(absl::GetFlag(FLAGS_model)));
  if (!tok.ok()) return Fail(tok.status());
  const std::string decode = absl::GetFlag(FLAGS_decode);
  if (!decode.empty()) {
    auto ids = ParseIntList(decode, "--decode");
    if (!ids.ok()) return Fail(ids.status());
    auto text = (*tok)->Decode(*ids);
    if (!text.ok()) return Fail(text.status());
    std::printf("%s\n", text->c_str());
    return 0;
  }
  auto ids =
      (*tok)->Encode(absl::GetFlag(FLAGS_text), !absl::GetFlag(FLAGS_no_bos));
  if (!ids.ok()) return Fail(ids.status());
  nlohmann::json out;
  out["kind"] = (*tok)->kind();
  out["ids"] = *ids;
  nlohmann::json pieces = nlohmann::json::array();
  for (int id : *ids) {
    auto piece = (*tok)->IdToPiece(id);
    if (!piece.ok()) return Fail(piece.status());
    pieces.push_back(*piece);
  }
  out["pieces"] = pieces;
  // Pieces may hold bytes that are not UTF-8 on their own; escape them.
  std::printf("%s\n",
              out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
                  .c_str());
  return 0;
}

}  // namespace
}  // namespace specserve

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return specserve::Run();
}
