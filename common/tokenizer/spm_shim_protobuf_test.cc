// The reason spm_shim.cc exists: libsentencepiece.so.0 bundles and exports
// protobuf 3.14, and must coexist with the system libprotobuf 3.21 that every
// gRPC binary loads. This test is such a process: it uses libprotobuf before
// and after loading and running a sentencepiece model.

#include <memory>
#include <string>
#include <vector>

#include "common/tokenizer/tokenizer.h"
#include "google/protobuf/struct.pb.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

TEST(SpmShimProtobufTest, SentencePieceCoexistsWithSystemProtobuf) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "ASan cannot use RTLD_DEEPBIND; see spm_shim.cc";
#endif
  google::protobuf::Struct before;
  (*before.mutable_fields())["prompt"].set_string_value("Once upon a time");
  std::string wire;
  ASSERT_TRUE(before.SerializeToString(&wire));

  absl::StatusOr<std::unique_ptr<Tokenizer>> tok =
      LoadTokenizer("models/stories260K");
  ASSERT_TRUE(tok.ok()) << tok.status();
  ASSERT_EQ((*tok)->kind(), "sentencepiece");
  absl::StatusOr<std::vector<int>> ids =
      (*tok)->Encode("Once upon a time", true);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*(*tok)->Decode(*ids), "Once upon a time");
  tok->reset();  // Destroys the processor inside the isolated library.

  google::protobuf::Struct after;
  ASSERT_TRUE(after.ParseFromString(wire));
  EXPECT_EQ(after.fields().at("prompt").string_value(), "Once upon a time");
}

}  // namespace
}  // namespace specserve
