#include "common/model/safetensors.h"

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <iterator>
#include <string>
#include <thread>  // NOLINT: WriteAt from several threads
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string TmpDir(const std::string& name) {
  const char* root = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(root != nullptr ? root : "/tmp", "/", name);
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

std::string Message(const absl::Status& s) { return std::string(s.message()); }

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A file from a hand-written header: 8-byte LE length, JSON, `data_size`
// zero bytes.
std::string MakeFile(const std::string& json, size_t data_size) {
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out + json + std::string(data_size, '\0');
}

absl::Status ParseError(const std::string& bytes) {
  absl::StatusOr<SafetensorsHeader> h = ParseSafetensorsHeader(bytes, "t.st");
  return h.status();
}

// ---------------------------------------------------------------------------
// Conversions. Expected bit patterns are IEEE 754 binary16 / bfloat16 facts.

TEST(HalfTest, KnownValues) {
  EXPECT_EQ(HalfToFloat(0x3c00), 1.0f);
  EXPECT_EQ(HalfToFloat(0xc000), -2.0f);
  EXPECT_EQ(HalfToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(HalfToFloat(0x0400), std::ldexp(1.0f, -14));  // min normal
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));  // min subnormal
  EXPECT_EQ(HalfToFloat(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_EQ(Bits(HalfToFloat(0x8000)), 0x80000000u);  // -0
  EXPECT_EQ(HalfToFloat(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(HalfToFloat(0xfc00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7e00)));
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7c01)));

  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7bff);  // below the halfway point
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);  // tie rounds to even: inf
  EXPECT_EQ(FloatToHalf(1e10f), 0x7c00);
  EXPECT_EQ(FloatToHalf(-1e10f), 0xfc00);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);  // tie to even (0)
  EXPECT_EQ(FloatToHalf(std::ldexp(3.0f, -25)), 0x0002);  // tie to even (2)
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -26)), 0x0000);
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie, even
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(3.0f, -11)), 0x3c02);  // tie, even
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::infinity()), 0x7c00);
  const uint16_t nan = FloatToHalf(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan & 0x7c00, 0x7c00);
  EXPECT_NE(nan & 0x03ff, 0);
}

TEST(HalfTest, EveryHalfRoundTrips) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f)))) << h;
    } else {
      ASSERT_EQ(FloatToHalf(f), h) << "half bits " << h;
    }
  }
}

#if defined(__FLT16_MAX__)
// The compiler's _Float16 conversion (F16C hardware, round to nearest even)
// is an independent reference.
TEST(HalfTest, MatchesCompilerFloat16) {
  std::mt19937 rng(7);
  for (int i = 0; i < 1'000'000; ++i) {
    uint32_t u = rng();
    // Half the samples near the half-precision range, where it matters.
    if (i % 2 == 0) u = (u & 0x807fffffu) | ((98u + (u >> 23) % 50u) << 23);
    const float f = FromBits(u);
    if (std::isnan(f)) continue;
    const _Float16 ref = static_cast<_Float16>(f);
    uint16_t ref_bits;
    std::memcpy(&ref_bits, &ref, 2);
    ASSERT_EQ(FloatToHalf(f), ref_bits) << "float bits " << u;
    ASSERT_EQ(Bits(HalfToFloat(ref_bits)), Bits(static_cast<float>(ref)));
  }
}
#endif

TEST(BFloat16Test, KnownValues) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBFloat16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToBFloat16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);  // tie
  EXPECT_EQ(FloatToBFloat16(1.0f + std::ldexp(3.0f, -8)), 0x3f82);  // tie
  EXPECT_EQ(FloatToBFloat16(1.0f + std::ldexp(1.0f, -7)), 0x3f81);
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(
      FloatToBFloat16(std::numeric_limits<float>::quiet_NaN()))));
  // A signalling-NaN pattern whose payload lives only in the low half must
  // not become inf.
  EXPECT_TRUE(
      std::isnan(BFloat16ToFloat(FloatToBFloat16(FromBits(0x7f800001u)))));
  EXPECT_EQ(BFloat16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(BFloat16ToFloat(0x4049), 3.140625f);
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = BFloat16ToFloat(static_cast<uint16_t>(b));
    if (!std::isnan(f)) {
      ASSERT_EQ(FloatToBFloat16(f), b);
    }
  }
}

// ---------------------------------------------------------------------------
// Round trips

std::vector<NamedTensor> SmallTensors() {
  std::vector<NamedTensor> ts;
  NamedTensor a{"a.weight", {2, 3}, {1, -2, 3.5f, 0.25f, -0.0f, 1e-3f}};
  NamedTensor b{"b", {4}, {10, 20, 30, 40}};
  NamedTensor scalar{"scalar", {}, {42.0f}};
  NamedTensor empty{"empty", {0, 5}, {}};
  ts.push_back(a);
  ts.push_back(b);
  ts.push_back(scalar);
  ts.push_back(empty);
  return ts;
}

TEST(SafetensorsTest, RoundTripF32) {
  const std::string path = TmpDir("rt") + "/f32.safetensors";
  const std::vector<NamedTensor> in = SmallTensors();
  ASSERT_TRUE(WriteSafetensors(path, in, {{"format", "pt"}}).ok());

  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f =
      SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->header().header_size % 8, 0u);
  EXPECT_THAT((*f)->names(), ElementsAre("a.weight", "b", "empty", "scalar"));
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
  for (const NamedTensor& t : in) {
    const TensorInfo* info = (*f)->Find(t.name);
    ASSERT_NE(info, nullptr) << t.name;
    EXPECT_EQ(info->dtype, DType::kF32);
    EXPECT_EQ(info->shape, t.shape);
    std::vector<float> out;
    ASSERT_TRUE(ReadTensorAsFloat(**f, t.name, t.shape, &out).ok());
    ASSERT_EQ(out.size(), t.values.size());
    for (size_t i = 0; i < out.size(); ++i) {
      EXPECT_EQ(Bits(out[i]), Bits(t.values[i])) << t.name << "[" << i << "]";
    }
    absl::StatusOr<absl::Span<const float>> view = (*f)->Data<float>(*info);
    ASSERT_TRUE(view.ok()) << view.status();
    EXPECT_EQ(view->size(), t.values.size());
  }
  EXPECT_EQ((*f)->Find("nope"), nullptr);
  EXPECT_FALSE((*f)->Data<uint16_t>(*(*f)->Find("b")).ok());

  // The file matches the in-memory serialisation byte for byte.
  absl::StatusOr<std::string> bytes =
      SerializeSafetensors(in, {{"format", "pt"}});
  ASSERT_TRUE(bytes.ok());
  std::ifstream disk(path, std::ios::binary);
  std::string disk_bytes((std::istreambuf_iterator<char>(disk)),
                         std::istreambuf_iterator<char>());
  EXPECT_EQ(disk_bytes, *bytes);
}

TEST(SafetensorsTest, ReleasedPagesReadBackTheSame) {
  // A tensor spanning several pages: released pages fault back in from the
  // file with the same bytes.
  const std::string path = TmpDir("release") + "/big.safetensors";
  std::vector<float> values(5 * 4096);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.25f * i - 7.f;
  const std::vector<NamedTensor> in = {
      {"big", {static_cast<int64_t>(values.size())}, values, DType::kF32}};
  ASSERT_TRUE(WriteSafetensors(path, in, {}).ok());
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f =
      SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  const TensorInfo* info = (*f)->Find("big");
  ASSERT_NE(info, nullptr);
  std::vector<float> before, after;
  ASSERT_TRUE(ReadTensorAsFloat(**f, "big", info->shape, &before).ok());
  (*f)->ReleasePages(*info);
  ASSERT_TRUE(ReadTensorAsFloat(**f, "big", info->shape, &after).ok());
  EXPECT_EQ(before, values);
  EXPECT_EQ(after, values);
  // In-memory files have no mapping: a no-op.
  absl::StatusOr<std::string> bytes = SerializeSafetensors(in, {});
  ASSERT_TRUE(bytes.ok());
  auto mem = SafetensorsFile::FromBytes(*bytes, "mem");
  ASSERT_TRUE(mem.ok());
  (*mem)->ReleasePages(*(*mem)->Find("big"));
  ASSERT_TRUE(ReadTensorAsFloat(**mem, "big", info->shape, &after).ok());
  EXPECT_EQ(after, values);
}

TEST(SafetensorsTest, RoundTripHalfTypes) {
  std::vector<NamedTensor> in;
  std::vector<float> values = {1.0f, -0.5f, 3.14159f, 65504.0f, 1e-7f, 0.1f};
  in.push_back({"h", {6}, values, DType::kF16});
  in.push_back({"b", {3, 2}, values, DType::kBF16});
  absl::StatusOr<std::string> bytes = SerializeSafetensors(in, {});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f =
      SafetensorsFile::FromBytes(*bytes, "mem");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->Find("h")->dtype, DType::kF16);
  EXPECT_EQ((*f)->Find("b")->dtype, DType::kBF16);
  EXPECT_EQ((*f)->Find("b")->num_bytes(), 12u);
  std::vector<float> h, b;
  ASSERT_TRUE(ReadTensorAsFloat(**f, "h", {6}, &h).ok());
  ASSERT_TRUE(ReadTensorAsFloat(**f, "b", {3, 2}, &b).ok());
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_EQ(h[i], HalfToFloat(FloatToHalf(values[i])));
    EXPECT_EQ(b[i], BFloat16ToFloat(FloatToBFloat16(values[i])));
    // Within half an ulp: 2^-11 relative for fp16 normals, 2^-8 for bf16.
    if (values[i] > 1e-4f) {
      EXPECT_NEAR(h[i], values[i], values[i] * std::ldexp(1.0f, -11));
    }
    EXPECT_NEAR(b[i], values[i], std::fabs(values[i]) * std::ldexp(1.0f, -8));
  }
}

TEST(SafetensorsTest, UnalignedDataStillReads) {
  // N = 61 leaves the F32 data at file offset 69: Data<float> may refuse it,
  // ReadTensorAsFloat must not.
  std::string json =
      R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  json.append(61 - json.size(), ' ');
  std::string file = MakeFile(json, 0);
  const float v[2] = {1.5f, -7.0f};
  file.append(reinterpret_cast<const char*>(v), 8);
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f =
      SafetensorsFile::FromBytes(file, "odd");
  ASSERT_TRUE(f.ok()) << f.status();
  std::vector<float> out;
  ASSERT_TRUE(ReadTensorAsFloat(**f, "x", {2}, &out).ok());
  EXPECT_THAT(out, ElementsAre(1.5f, -7.0f));
}

TEST(SafetensorsTest, ReadErrorsNameFileTensorAndShapes) {
  absl::StatusOr<std::string> bytes = SerializeSafetensors(SmallTensors(), {});
  ASSERT_TRUE(bytes.ok());
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f =
      SafetensorsFile::FromBytes(*bytes, "mem.safetensors");
  ASSERT_TRUE(f.ok());
  std::vector<float> out;
  absl::Status s = ReadTensorAsFloat(**f, "a.weight", {3, 2}, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(s),
              AllOf(HasSubstr("mem.safetensors"), HasSubstr("'a.weight'"),
                    HasSubstr("has shape [2, 3], expected [3, 2]")));
  s = ReadTensorAsFloat(**f, "a.weight", {6}, &out);
  EXPECT_THAT(Message(s), HasSubstr("expected [6]"));
  s = ReadTensorAsFloat(**f, "missing", {1}, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(s),
              AllOf(HasSubstr("mem.safetensors"), HasSubstr("'missing'")));
  std::vector<float> wrong(5);
  s = ReadTensorInto(**f, "a.weight", {2, 3}, absl::MakeSpan(wrong));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

TEST(SafetensorsTest, NonFloatDTypeParsesButCannotBeRead) {
  const std::string file = MakeFile(
      R"({"ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}})", 16);
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f =
      SafetensorsFile::FromBytes(file, "ids.st");
  ASSERT_TRUE(f.ok()) << f.status();
  std::vector<float> out;
  absl::Status s = ReadTensorAsFloat(**f, "ids", {2}, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(s), AllOf(HasSubstr("'ids'"), HasSubstr("I64")));
}

TEST(SafetensorsTest, OpenMissingAndDirectory) {
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f =
      SafetensorsFile::Open(TmpDir("nothing") + "/absent.safetensors");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound);
  f = SafetensorsFile::Open(TmpDir("adir"));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  // An empty file is too short for the header length.
  const std::string empty = TmpDir("empty") + "/e.safetensors";
  std::ofstream(empty).close();
  f = SafetensorsFile::Open(empty);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(f.status()), HasSubstr("e.safetensors"));
}

// ---------------------------------------------------------------------------
// Header validation: each malformed header is INVALID_ARGUMENT naming the
// file and, where one is at fault, the tensor.

struct BadHeader {
  const char* name;
  std::string bytes;
  std::vector<std::string> messages;
};

class BadHeaderTest : public ::testing::TestWithParam<BadHeader> {};

TEST_P(BadHeaderTest, IsInvalidArgument) {
  absl::Status s = ParseError(GetParam().bytes);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(s), HasSubstr("t.st"));
  for (const std::string& m : GetParam().messages) {
    EXPECT_THAT(Message(s), HasSubstr(m));
  }
}

std::string Entry(const std::string& name, const std::string& dtype,
                  const std::string& shape, const std::string& offsets) {
  return absl::StrCat("\"", name, "\":{\"dtype\":\"", dtype,
                      "\",\"shape\":", shape, ",\"data_offsets\":", offsets,
                      "}");
}

std::string LengthPrefix(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, BadHeaderTest,
    ::testing::Values(
        BadHeader{"TruncatedLength", std::string("\x10\0\0", 3), {"too short"}},
        BadHeader{"LengthPastEof",
                  LengthPrefix(1000) + "{}",
                  {"header length 1000 extends past the end"}},
        BadHeader{"HugeLength",
                  LengthPrefix(~uint64_t{0}) + "{}",
                  {"extends past the end"}},
        BadHeader{
            "BadJson", MakeFile("{\"w\":{\"dtype\":", 0), {"not valid JSON"}},
        BadHeader{"NotObject", MakeFile("[1,2]", 0), {"not an object"}},
        BadHeader{"Overlap",
                  MakeFile("{" + Entry("first", "F32", "[2]", "[0,8]") + "," +
                               Entry("second", "F32", "[2]", "[4,12]") + "}",
                           12),
                  {"'second'", "'first'", "overlap"}},
        BadHeader{"WrongByteLength",
                  MakeFile("{" + Entry("w", "F32", "[3]", "[0,8]") + "}", 8),
                  {"'w'", "span 8 bytes", "needs 12"}},
        BadHeader{"UnknownDType",
                  MakeFile("{" + Entry("w", "Q4_K", "[2]", "[0,8]") + "}", 8),
                  {"'w'", "unknown dtype 'Q4_K'"}},
        BadHeader{"OffsetsPastBuffer",
                  MakeFile("{" + Entry("w", "F32", "[4]", "[0,16]") + "}", 8),
                  {"'w'", "past the data buffer (8 bytes)"}},
        BadHeader{"BeginAfterEnd",
                  MakeFile("{" + Entry("w", "F32", "[0]", "[8,4]") + "}", 8),
                  {"'w'", "begin > end"}},
        BadHeader{"NegativeDim",
                  MakeFile("{" + Entry("w", "F32", "[-2]", "[0,8]") + "}", 8),
                  {"'w'", "non-negative"}},
        BadHeader{"FloatOffset",
                  MakeFile("{" + Entry("w", "F32", "[2]", "[0,8.0]") + "}", 8),
                  {"'w'", "data_offsets"}},
        BadHeader{"ThreeOffsets",
                  MakeFile("{" + Entry("w", "F32", "[2]", "[0,8,8]") + "}", 8),
                  {"'w'", "data_offsets"}},
        BadHeader{
            "ShapeOverflow",
            MakeFile("{" +
                         Entry("w", "F32", "[4294967296,4294967296,4294967296]",
                               "[0,8]") +
                         "}",
                     8),
            {"'w'", "overflows"}},
        BadHeader{
            "ByteLengthOverflow",
            MakeFile("{" + Entry("w", "F64", "[4611686018427387904]", "[0,8]") +
                         "}",
                     8),
            {"'w'"}},
        BadHeader{"MissingDType",
                  MakeFile(R"({"w":{"shape":[1],"data_offsets":[0,4]}})", 4),
                  {"'w'", "dtype"}},
        BadHeader{"MissingShape",
                  MakeFile(R"({"w":{"dtype":"F32","data_offsets":[0,4]}})", 4),
                  {"'w'", "shape"}},
        BadHeader{"EntryNotObject",
                  MakeFile(R"({"w":[1]})", 0),
                  {"'w'", "not an object"}},
        BadHeader{"DuplicateName",
                  MakeFile("{" + Entry("w", "F32", "[1]", "[0,4]") + "," +
                               Entry("w", "F32", "[1]", "[4,8]") + "}",
                           8),
                  {"'w'", "more than once"}},
        BadHeader{"MetadataNotStrings",
                  MakeFile(R"({"__metadata__":{"format":1}})", 0),
                  {"__metadata__", "'format'"}},
        BadHeader{"MetadataNotObject",
                  MakeFile(R"({"__metadata__":"pt"})", 0),
                  {"__metadata__"}},
        BadHeader{"DeepNesting",
                  MakeFile(std::string(1000, '[') + std::string(1000, ']'), 0),
                  {"deeper"}}),
    [](const ::testing::TestParamInfo<BadHeader>& info) {
      return std::string(info.param.name);
    });

TEST(SafetensorsHeaderTest, EmptyTensorsMayShareOffsets) {
  const std::string file =
      MakeFile("{" + Entry("a", "F32", "[0]", "[4,4]") + "," +
                   Entry("b", "F32", "[1]", "[0,4]") + "," +
                   Entry("c", "BF16", "[0,3]", "[4,4]") + "}",
               4);
  absl::StatusOr<SafetensorsHeader> h = ParseSafetensorsHeader(file, "t");
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->tensors.size(), 3u);
  EXPECT_EQ(h->data_size, 4u);
}

// ---------------------------------------------------------------------------
// Writer errors

TEST(SafetensorsWriterTest, RejectsBadInput) {
  const std::string dir = TmpDir("wr");
  absl::Status s = WriteSafetensors(dir + "/a.st", {{"x", {2}, {1.0f}}}, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(s), AllOf(HasSubstr("'x'"), HasSubstr("1 values")));
  s = WriteSafetensors(dir + "/b.st", {{"x", {1}, {1}}, {"x", {1}, {2}}}, {});
  EXPECT_THAT(Message(s), HasSubstr("more than once"));
  s = WriteSafetensors(dir + "/c.st", {{"x", {1}, {1}, DType::kI32}}, {});
  EXPECT_THAT(Message(s), HasSubstr("I32"));
  s = WriteSafetensors(dir + "/d.st", {{"__metadata__", {1}, {1}}}, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  s = WriteSafetensors(dir + "/no/such/dir/e.st", {{"x", {1}, {1}}}, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);

  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> w =
      SafetensorsWriter::Create(dir + "/f.st", {{"a", {2}}, {"b", {3}}}, {});
  ASSERT_TRUE(w.ok());
  const float v[6] = {1, 2, 3, 4, 5, 6};
  ASSERT_TRUE((*w)->Append(absl::MakeConstSpan(v, 4)).ok());  // spans a, b
  s = (*w)->Finish();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Message(s), HasSubstr("'b' got 2 of 3"));

  w = SafetensorsWriter::Create(dir + "/g.st", {{"a", {2}}}, {});
  ASSERT_TRUE(w.ok());
  EXPECT_EQ((*w)->Append(absl::MakeConstSpan(v, 3)).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(SafetensorsWriterTest, ChunkedAppendsMatchOneShot) {
  const std::string dir = TmpDir("chunk");
  std::vector<float> a(1000), b(333);
  for (size_t i = 0; i < a.size(); ++i) a[i] = 0.001f * i;
  for (size_t i = 0; i < b.size(); ++i) b[i] = -0.5f * i;
  std::vector<TensorSpec> specs = {{"a", {10, 100}, DType::kBF16},
                                   {"z", {0}, DType::kF32},
                                   {"b", {333}, DType::kF16}};
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> w =
      SafetensorsWriter::Create(dir + "/c.st", specs, {});
  ASSERT_TRUE(w.ok());
  std::vector<float> all = a;
  all.insert(all.end(), b.begin(), b.end());
  for (size_t i = 0; i < all.size(); i += 77) {
    const size_t n = std::min<size_t>(77, all.size() - i);
    ASSERT_TRUE((*w)->Append(absl::MakeConstSpan(all.data() + i, n)).ok());
  }
  ASSERT_TRUE((*w)->Finish().ok());
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f =
      SafetensorsFile::Open(dir + "/c.st");
  ASSERT_TRUE(f.ok()) << f.status();
  std::vector<float> ra, rb;
  ASSERT_TRUE(ReadTensorAsFloat(**f, "a", {10, 100}, &ra).ok());
  ASSERT_TRUE(ReadTensorAsFloat(**f, "b", {333}, &rb).ok());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(ra[i], BFloat16ToFloat(FloatToBFloat16(a[i])));
  }
  for (size_t i = 0; i < b.size(); ++i) {
    ASSERT_EQ(rb[i], HalfToFloat(FloatToHalf(b[i])));
  }
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// WriteAt from several threads, chunks out of order, gives the bytes of one
// in-order Append.
TEST(SafetensorsWriterTest, WriteAtFromThreadsMatchesAppend) {
  const std::string dir = TmpDir("at");
  std::vector<TensorSpec> specs = {{"a", {10, 100}, DType::kBF16},
                                   {"z", {0}, DType::kF32},
                                   {"b", {333}, DType::kF16},
                                   {"c", {257}, DType::kF32}};
  std::vector<float> all(1000 + 333 + 257);
  for (size_t i = 0; i < all.size(); ++i) all[i] = std::sin(0.37f * i) * 3;
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> w =
      SafetensorsWriter::Create(dir + "/append.st", specs, {{"k", "v"}});
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->Append(all).ok());
  ASSERT_TRUE((*w)->Finish().ok());

  w = SafetensorsWriter::Create(dir + "/at.st", specs, {{"k", "v"}});
  ASSERT_TRUE(w.ok());
  // (tensor, first element, count, offset into `all`), in reverse order.
  struct Range {
    size_t tensor;
    int64_t first, count;
    size_t at;
  };
  std::vector<Range> ranges;
  const int64_t sizes[] = {1000, 0, 333, 257};
  size_t at = 0;
  for (size_t t = 0; t < 4; ++t) {
    for (int64_t f = 0; f < sizes[t]; f += 61) {
      ranges.push_back({t, f, std::min<int64_t>(61, sizes[t] - f), at + f});
    }
    at += sizes[t];
  }
  std::reverse(ranges.begin(), ranges.end());
  std::atomic<size_t> next{0};
  std::atomic<bool> ok{true};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < ranges.size();) {
      const Range& r = ranges[i];
      if (!(*w)->WriteAt(r.tensor, r.first,
                         absl::MakeConstSpan(all.data() + r.at, r.count))
               .ok()) {
        ok = false;
      }
    }
  };
  std::vector<std::thread> pool;
  for (int i = 0; i < 4; ++i) pool.emplace_back(work);
  for (std::thread& t : pool) t.join();
  ASSERT_TRUE(ok);
  ASSERT_TRUE((*w)->Finish().ok());
  EXPECT_EQ(ReadBytes(dir + "/at.st"), ReadBytes(dir + "/append.st"));
}

TEST(SafetensorsWriterTest, WriteAtRejectsBadRanges) {
  const std::string dir = TmpDir("atbad");
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> w =
      SafetensorsWriter::Create(dir + "/f.st", {{"a", {2}}, {"b", {3}}}, {});
  ASSERT_TRUE(w.ok());
  const float v[4] = {1, 2, 3, 4};
  absl::Status s = (*w)->WriteAt(2, 0, absl::MakeConstSpan(v, 1));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(s), HasSubstr("tensor index 2 of 2"));
  s = (*w)->WriteAt(1, 1, absl::MakeConstSpan(v, 3));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(s), HasSubstr("[1, 4) outside tensor 'b' of 3"));
  EXPECT_EQ((*w)->WriteAt(0, -1, absl::MakeConstSpan(v, 1)).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE((*w)->WriteAt(1, 0, absl::MakeConstSpan(v, 3)).ok());
  EXPECT_EQ((*w)->Append(absl::MakeConstSpan(v, 1)).code(),
            absl::StatusCode::kFailedPrecondition);
  s = (*w)->Finish();  // tensor a never written
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Message(s), HasSubstr("wrote 3 of 5 elements"));

  w = SafetensorsWriter::Create(dir + "/g.st", {{"a", {2}}}, {});
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->Append(absl::MakeConstSpan(v, 1)).ok());
  EXPECT_EQ((*w)->WriteAt(0, 1, absl::MakeConstSpan(v, 1)).code(),
            absl::StatusCode::kFailedPrecondition);
}

// ---------------------------------------------------------------------------
// Checkpoint directories

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

TEST(CheckpointTest, SingleFile) {
  const std::string dir = TmpDir("single");
  ASSERT_TRUE(
      WriteSafetensors(dir + "/model.safetensors", SmallTensors(), {}).ok());
  absl::StatusOr<std::unique_ptr<Checkpoint>> c = Checkpoint::Open(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->files().size(), 1u);
  EXPECT_THAT((*c)->names(), ElementsAre("a.weight", "b", "empty", "scalar"));
  std::vector<float> out;
  ASSERT_TRUE((*c)->ReadTensorAsFloat("b", {4}, &out).ok());
  EXPECT_THAT(out, ElementsAre(10, 20, 30, 40));
  absl::Status s = (*c)->ReadTensorAsFloat("zzz", {4}, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(s),
              AllOf(HasSubstr("model.safetensors"), HasSubstr("'zzz'")));
}

TEST(CheckpointTest, Sharded) {
  const std::string dir = TmpDir("sharded");
  ASSERT_TRUE(WriteSafetensors(dir + "/model-00001-of-00002.safetensors",
                               {{"a", {2}, {1, 2}}, {"b", {1}, {3}}}, {})
                  .ok());
  ASSERT_TRUE(WriteSafetensors(dir + "/model-00002-of-00002.safetensors",
                               {{"c", {3}, {4, 5, 6}, DType::kBF16}}, {})
                  .ok());
  WriteText(dir + "/model.safetensors.index.json", R"({
    "metadata": {"total_size": 18},
    "weight_map": {"a": "model-00001-of-00002.safetensors",
                   "b": "model-00001-of-00002.safetensors",
                   "c": "model-00002-of-00002.safetensors"}})");
  absl::StatusOr<std::unique_ptr<Checkpoint>> c = Checkpoint::Open(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->files().size(), 2u);  // each shard opened once
  EXPECT_THAT((*c)->names(), ElementsAre("a", "b", "c"));
  EXPECT_EQ((*c)->FileFor("a"), (*c)->FileFor("b"));
  EXPECT_NE((*c)->FileFor("a"), (*c)->FileFor("c"));
  EXPECT_EQ((*c)->FileFor("d"), nullptr);
  EXPECT_EQ((*c)->Find("c")->dtype, DType::kBF16);
  std::vector<float> out;
  ASSERT_TRUE((*c)->ReadTensorAsFloat("c", {3}, &out).ok());
  EXPECT_THAT(out, ElementsAre(4, 5, 6));
  ASSERT_TRUE((*c)->ReadTensorAsFloat("a", {2}, &out).ok());
  EXPECT_THAT(out, ElementsAre(1, 2));
}

TEST(CheckpointTest, IndexErrors) {
  const std::string dir = TmpDir("badindex");
  ASSERT_TRUE(
      WriteSafetensors(dir + "/s1.safetensors", {{"a", {1}, {1}}}, {}).ok());
  const std::string index = dir + "/model.safetensors.index.json";

  WriteText(index, R"({"weight_map": {"a": "s1.safetensors",
                                      "ghost": "s1.safetensors"}})");
  absl::StatusOr<std::unique_ptr<Checkpoint>> c = Checkpoint::Open(dir);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(c.status()),
              AllOf(HasSubstr("'ghost'"), HasSubstr("s1.safetensors")));

  WriteText(index, R"({"weight_map": {"a": "s2.safetensors"}})");
  c = Checkpoint::Open(dir);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(c.status()), HasSubstr("s2.safetensors"));

  WriteText(index, R"({"weight_map": {"a": "../s1.safetensors"}})");
  c = Checkpoint::Open(dir);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(c.status()), HasSubstr("invalid shard name"));

  WriteText(index, R"({"metadata": {}})");
  c = Checkpoint::Open(dir);
  EXPECT_THAT(Message(c.status()), HasSubstr("weight_map"));

  WriteText(index, "{not json");
  c = Checkpoint::Open(dir);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(c.status()), HasSubstr("model.safetensors.index.json"));

  c = Checkpoint::Open(TmpDir("emptydir"));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace specserve
