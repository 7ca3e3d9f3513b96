#ifndef SPECSERVE_COMMON_MODEL_SAFETENSORS_H_
#define SPECSERVE_COMMON_MODEL_SAFETENSORS_H_

// Reading and writing the safetensors format (huggingface/safetensors,
// docs/ARCHITECTURE.md, Conventions): an 8-byte little-endian header length N, N
// bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]},
// "__metadata__": {string: string}}, then the raw little-endian data buffer
// (offsets are relative to its start).

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace specserve {

/// Element types of the safetensors format. Only kF32, kF16 and kBF16 can be
/// read as weights; the others are parsed and bounds-checked so checkpoints
/// holding e.g. an I64 buffer still open, and fail only when read.
enum class DType {
  kF32,
  kF16,
  kBF16,
  kF64,
  kI64,
  kI32,
  kI16,
  kI8,
  kU8,
  kBool,
  kF8E4M3,
  kF8E5M2,
};

/// Bytes per element.
size_t DTypeSize(DType dtype);
/// The format's spelling: "F32", "BF16", ...
std::string_view DTypeName(DType dtype);
/// Inverse of DTypeName. INVALID_ARGUMENT for an unknown name.
absl::StatusOr<DType> ParseDType(std::string_view name);

/// One tensor's entry in a safetensors header.
struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  ///< row-major; empty = scalar.
  uint64_t begin = 0;          ///< byte offset into the data buffer.
  uint64_t end = 0;            ///< one past the last byte; end - begin bytes.

  /// Product of `shape` (1 for a scalar). Validated not to overflow.
  int64_t num_elements() const;
  uint64_t num_bytes() const { return end - begin; }
};

/// A validated header. Every tensor satisfies begin <= end <= data_size,
/// end - begin == num_elements * DTypeSize(dtype), and no two tensors'
/// byte ranges overlap.
struct SafetensorsHeader {
  uint64_t header_size = 0;  ///< N, bytes of JSON after the length prefix.
  uint64_t data_start = 0;   ///< 8 + N: file offset of the data buffer.
  uint64_t data_size = 0;    ///< file size - data_start.
  std::vector<TensorInfo> tensors;              ///< sorted by name.
  std::map<std::string, std::string> metadata;  ///< "__metadata__".
};

/// Largest header accepted (the reference implementation's limit), bytes.
inline constexpr uint64_t kMaxSafetensorsHeaderSize = 100'000'000;

/// Parses and validates the header of a whole safetensors file held in
/// `file_bytes` (pure: no I/O). `file_name` only labels error messages.
/// Errors, all INVALID_ARGUMENT naming the file and, where one is at fault,
/// the tensor: file shorter than 8 bytes; N past the end of the file or over
/// kMaxSafetensorsHeaderSize; JSON malformed, not an object, nested too
/// deeply or with duplicate tensor names; an entry that is not
/// {dtype, shape, data_offsets}; unknown dtype; negative or overflowing
/// shape; offsets past the data buffer or begin > end; byte length !=
/// prod(shape) * dtype size; overlapping tensors; `__metadata__` that is not
/// a string -> string map. Gaps and trailing bytes in the buffer are allowed.
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(
    std::string_view file_bytes, std::string_view file_name);

/// A read-only, validated safetensors file: memory-mapped (PROT_READ) by
/// Open, or holding bytes handed over by FromBytes. Tensor data is read in
/// place; nothing is copied until a caller converts it. Immutable after
/// construction, so concurrent reads from several threads are safe.
class SafetensorsFile {
 public:
  /// Maps and validates `path`. NOT_FOUND if it does not exist, otherwise
  /// errors as ParseSafetensorsHeader (labelled with `path`).
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(
      const std::string& path);
  /// Validates an in-memory file (tests, fuzzing). `name` labels errors.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> FromBytes(
      std::string bytes, std::string name);

  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  /// The path (or name) the file was opened with.
  const std::string& path() const { return path_; }
  /// The tensor called `name`, or nullptr.
  const TensorInfo* Find(std::string_view name) const;
  /// All tensors, sorted by name.
  const std::vector<TensorInfo>& tensors() const { return header_.tensors; }
  /// Tensor names, sorted.
  std::vector<std::string> names() const;
  /// The `__metadata__` map (empty if absent).
  const std::map<std::string, std::string>& metadata() const {
    return header_.metadata;
  }
  const SafetensorsHeader& header() const { return header_; }

  /// The raw little-endian bytes of `info` (which must come from this
  /// file), num_bytes() long.
  absl::Span<const uint8_t> RawBytes(const TensorInfo& info) const;

  /// The data of `info` viewed as elements of T, e.g. Data<float> for F32 or
  /// Data<uint16_t> for F16/BF16 bits. INVALID_ARGUMENT if sizeof(T) is not
  /// the dtype's size, or the data is not aligned for T (possible when N is
  /// not a multiple of 8); then use RawBytes or ReadTensorAsFloat.
  /// Drops the mapped pages that lie wholly inside `info`'s bytes from
  /// this process's resident memory (madvise MADV_DONTNEED on the file
  /// mapping; a later read faults them back in from the file). A loader
  /// that has converted a tensor calls it so the checkpoint's pages do not
  /// add up alongside the converted copy. No-op for FromBytes files.
  void ReleasePages(const TensorInfo& info) const;

  template <typename T>
  absl::StatusOr<absl::Span<const T>> Data(const TensorInfo& info) const {
    absl::Status s = CheckView(info, sizeof(T), alignof(T));
    if (!s.ok()) return s;
    absl::Span<const uint8_t> raw = RawBytes(info);
    return absl::Span<const T>(reinterpret_cast<const T*>(raw.data()),
                               raw.size() / sizeof(T));
  }

 private:
  SafetensorsFile() = default;
  absl::Status Init(std::string_view path);
  absl::Status CheckView(const TensorInfo& info, size_t size,
                         size_t align) const;

  std::string path_;
  const uint8_t* bytes_ = nullptr;  // whole file
  size_t size_ = 0;
  void* mapping_ = nullptr;  // munmap'd in the destructor when non-null
  size_t mapping_size_ = 0;
  std::string owned_;  // FromBytes storage
  SafetensorsHeader header_;
  absl::flat_hash_map<std::string, size_t> index_;  // name -> tensors()[i]
};

/// Converts IEEE 754 binary16 bits to float, exactly (subnormals, +-inf,
/// NaN included).
float HalfToFloat(uint16_t h);
/// Converts bfloat16 bits (the top half of a float) to float, exactly.
float BFloat16ToFloat(uint16_t b);
/// float -> binary16, round to nearest even; overflow -> inf, NaN kept NaN.
uint16_t FloatToHalf(float f);
/// float -> bfloat16, round to nearest even; NaN kept NaN.
uint16_t FloatToBFloat16(float f);

/// Reads tensor `name` of `file` as fp32 into `out` (resized to
/// prod(expected_shape)), converting F16/BF16. Errors name the file and
/// tensor: NOT_FOUND if absent; INVALID_ARGUMENT if its shape is not
/// `expected_shape` (both printed) or its dtype is not F32/F16/BF16.
absl::Status ReadTensorAsFloat(const SafetensorsFile& file,
                               std::string_view name,
                               absl::Span<const int64_t> expected_shape,
                               std::vector<float>* out);

/// As ReadTensorAsFloat, writing into `dst`, which must hold exactly
/// prod(expected_shape) floats (used to fill slices of fused matrices).
absl::Status ReadTensorInto(const SafetensorsFile& file, std::string_view name,
                            absl::Span<const int64_t> expected_shape,
                            absl::Span<float> dst);

/// A weight tensor's stored bytes, read in place from a mapped file (valid
/// while the file is open; possibly unaligned: read with memcpy).
struct RawTensor {
  absl::Span<const uint8_t> bytes;  ///< num_elements * DTypeSize(dtype)
  DType dtype = DType::kF32;        ///< kF32, kF16 or kBF16
};

/// Tensor `name` of `file` in place, after the checks of ReadTensorInto
/// (NOT_FOUND if absent; INVALID_ARGUMENT for a shape other than
/// `expected_shape` or a dtype other than F32 / F16 / BF16).
absl::StatusOr<RawTensor> ViewTensor(const SafetensorsFile& file,
                                     std::string_view name,
                                     absl::Span<const int64_t> expected_shape);

/// Converts n stored elements of `dtype` (F32, F16 or BF16; `src` possibly
/// unaligned) to fp32 dst[n]. F16 and BF16 widen exactly.
void ConvertToFloat(const uint8_t* src, DType dtype, size_t n, float* dst);

/// The tensors of a HF model directory: `model.safetensors`, or the shards
/// that `model.safetensors.index.json` lists in its `weight_map`
/// (name -> shard file in the same directory; each shard opened once).
class Checkpoint {
 public:
  /// Opens `model_dir`. Prefers model.safetensors when both exist. Errors:
  /// NOT_FOUND if neither file (or a listed shard) exists; INVALID_ARGUMENT
  /// for a malformed index (not JSON, no weight_map, shard names with path
  /// separators), a weight_map entry whose shard lacks the tensor, or any
  /// shard error of SafetensorsFile::Open.
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(
      const std::string& model_dir);

  const std::string& dir() const { return dir_; }
  /// The file holding tensor `name`, or nullptr if the checkpoint lacks it.
  const SafetensorsFile* FileFor(std::string_view name) const;
  /// The entry for tensor `name`, or nullptr.
  const TensorInfo* Find(std::string_view name) const;
  /// All tensor names the checkpoint provides, sorted.
  std::vector<std::string> names() const;
  /// The opened files (one, or one per shard).
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const {
    return files_;
  }
  /// What model_dir was opened from ("model.safetensors" or the index's
  /// path), for messages about absent tensors.
  const std::string& source() const { return source_; }

  /// ReadTensorAsFloat on the file holding `name`; NOT_FOUND naming
  /// source() if no file holds it.
  absl::Status ReadTensorAsFloat(std::string_view name,
                                 absl::Span<const int64_t> expected_shape,
                                 std::vector<float>* out) const;
  /// ReadTensorInto on the file holding `name`.
  absl::Status ReadTensorInto(std::string_view name,
                              absl::Span<const int64_t> expected_shape,
                              absl::Span<float> dst) const;
  /// ViewTensor on the file holding `name`.
  absl::StatusOr<RawTensor> ViewTensor(
      std::string_view name, absl::Span<const int64_t> expected_shape) const;
  /// SafetensorsFile::ReleasePages of tensor `name`; no-op if absent.
  void ReleaseTensor(std::string_view name) const;

 private:
  Checkpoint() = default;

  std::string dir_;
  std::string source_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  absl::flat_hash_map<std::string, size_t> where_;  // name -> files_[i]
};

/// A tensor to write: fp32 values stored as `dtype` (kF32, kF16 or kBF16;
/// F16/BF16 rounded to nearest even).
struct NamedTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;  ///< row-major, prod(shape) elements.
  DType dtype = DType::kF32;
};

/// The shape and stored type of a tensor to be streamed by SafetensorsWriter.
struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::kF32;
};

/// Builds the header bytes (8-byte length + JSON padded with spaces to a
/// multiple of 8, so the data buffer is 8-byte aligned) for tensors laid out
/// back to back in `specs` order. `__metadata__` comes first. INVALID_ARGUMENT
/// for empty or duplicate names, a name "__metadata__", negative dims, a
/// dtype other than F32/F16/BF16, or invalid UTF-8.
absl::StatusOr<std::string> BuildSafetensorsHeader(
    const std::vector<TensorSpec>& specs,
    const std::map<std::string, std::string>& metadata);

/// Streams a safetensors file to disk without holding all values in memory
/// (the synthetic-checkpoint writer produces GBs): the header is written on
/// Create, then either Append supplies fp32 values that fill the tensors in
/// `specs` order, or WriteAt puts ranges of them at their place in the file
/// from any number of threads at once; each converted to its tensor's
/// dtype. One file takes one of the two ways.
class SafetensorsWriter {
 public:
  /// Creates/truncates `path` and writes the header (errors as
  /// BuildSafetensorsHeader, or INTERNAL on I/O failure naming `path`).
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Create(
      const std::string& path, std::vector<TensorSpec> specs,
      const std::map<std::string, std::string>& metadata);
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  /// Appends values; they may span tensor boundaries. FAILED_PRECONDITION if
  /// more values arrive than the tensors hold, or after WriteAt.
  absl::Status Append(absl::Span<const float> values);
  /// Writes `values` as elements [first, first + values.size()) of tensor
  /// `tensor` (an index into `specs`) at their byte offset in the file
  /// (pwrite(2)). Thread-safe for disjoint ranges, in any order; the ranges
  /// of all calls must not overlap (Finish checks only their total).
  /// INVALID_ARGUMENT for a tensor index or range outside `specs`;
  /// FAILED_PRECONDITION after Append or Finish; INTERNAL on I/O failure.
  absl::Status WriteAt(size_t tensor, int64_t first,
                       absl::Span<const float> values);
  /// Flushes and closes. FAILED_PRECONDITION if tensors are not complete
  /// (for WriteAt: fewer elements written than the tensors hold); INTERNAL
  /// on I/O failure.
  absl::Status Finish();

 private:
  SafetensorsWriter() = default;
  absl::Status WriteBytes(const void* data, size_t n);

  std::string path_;
  std::FILE* file_ = nullptr;
  std::vector<TensorSpec> specs_;
  size_t current_ = 0;              // index into specs_
  int64_t written_in_current_ = 0;  // elements of specs_[current_] written
  std::vector<uint8_t> scratch_;
  // WriteAt: each tensor's first byte in the file, and elements written.
  std::vector<uint64_t> offsets_;
  std::atomic<int64_t> written_at_{0};
};

/// Serialises `tensors` to safetensors bytes in memory (errors as
/// BuildSafetensorsHeader, or INVALID_ARGUMENT naming a tensor whose value
/// count does not match its shape).
absl::StatusOr<std::string> SerializeSafetensors(
    const std::vector<NamedTensor>& tensors,
    const std::map<std::string, std::string>& metadata);

/// Writes `tensors` to `path` as one safetensors file (errors as
/// SerializeSafetensors, or INTERNAL on I/O failure naming `path`).
absl::Status WriteSafetensors(
    const std::string& path, const std::vector<NamedTensor>& tensors,
    const std::map<std::string, std::string>& metadata);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_MODEL_SAFETENSORS_H_
