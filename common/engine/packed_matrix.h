#ifndef SPECSERVE_COMMON_ENGINE_PACKED_MATRIX_H_
#define SPECSERVE_COMMON_ENGINE_PACKED_MATRIX_H_

// The CPU engine's one resident copy of a Linear weight, in the element
// type it computes with (f32, bf16 or 8-bit blocks) and in 32-column
// panels: the layout the decode kernels stream. Prefill-sized products run
// from the same copy by unpacking a tile of output rows to f32 and handing
// it to OpenBLAS sgemm.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace specserve {

/// Element type of the CPU engine's linear weights.
enum class WeightDType {
  kF32,   ///< 4 bytes per weight; exact.
  kBF16,  ///< 2 bytes per weight (round to nearest even).
  /// 8-bit blocks as GGML's Q8_0: per output row, each block of 32 input
  /// weights is round(w / d) with d = absmax / 127 stored as f16: 34 bytes
  /// per 32 weights (1.0625 per weight).
  kInt8,
};

/// "f32", "bf16" or "int8".
std::string WeightDTypeName(WeightDType t);

/// Parses `--weight_dtype`: "f32" (alias "fp32", "float32"), "bf16"
/// (alias "bfloat16"), "int8" (alias "q8_0"), or "auto" / "" (returns
/// nullopt: the caller keeps the checkpoint's dtype). INVALID_ARGUMENT
/// naming the value otherwise.
absl::StatusOr<std::optional<WeightDType>> ParseWeightDType(
    const std::string& s);

/// Which kernel a dtype's products use on this CPU (for logs and tests):
/// "avx512" / "avx2" for f32, "avx512bf16" / "avx2" for bf16,
/// "avx512vnni" / "avx2" for int8. SPECSERVE_DISABLE_AVX512 forces avx2.
std::string PackedKernelName(WeightDType t);

/// A Linear weight W [out, in] (PyTorch layout, y = x W^T) in panels of
/// kernels::kPanelWidth (32) output rows, each panel stored k-major so
/// that a decode step streams it sequentially:
///   f32:  [panels][in][32] floats (kernels::PackPanels);
///   bf16: [panels][in2 / 2][32][2] bf16, in2 = in rounded up to even:
///         two consecutive k of an output side by side (vdpbf16ps pairs);
///   int8: [panels][in32 / 4][32][4] bytes, in32 = in rounded up to 32:
///         four consecutive k of an output side by side (vpdpbusd quads),
///         stored as q + 128 (unsigned); scales [panels][in32 / 32][32] f16.
/// Padding rows and columns hold zeros. Immutable after Pack; safe to read
/// from many threads.
class PackedMatrix {
 public:
  /// Input rows converted once per product for a matrix's format (bf16
  /// pairs, or int8 blocks with their scales); reuse across calls keeps
  /// the buffers' capacity.
  struct Input {
    const float* x = nullptr;  ///< f32 rows as given (f32 format)
    int n = 0;
    std::vector<float> padded;    ///< [n, in_padded] f32 (AVX2 paths)
    std::vector<uint32_t> pairs;  ///< [n, in2 / 2] bf16 pairs
    std::vector<int8_t> q;        ///< [n, in32] int8
    std::vector<float> scale;     ///< [n, in32 / 32]
    std::vector<int32_t> bias;    ///< [n, in32 / 32]: -128 * sum(q block)
  };

  PackedMatrix() = default;

  /// Packs w [out, in] (row-major f32) into `dtype`. out, in >= 1. Runs on
  /// the calling thread (safe inside a ThreadPool job).
  static PackedMatrix Pack(const float* w, int out, int in, WeightDType dtype);

  /// Writes rows [begin, end) of a [out, in] weight as f32 to dst [end -
  /// begin, in]; called with at most 32 rows at a time.
  using RowSource = std::function<void(int begin, int end, float* dst)>;

  /// As Pack, fetching the weight 32 rows at a time from `rows` (e.g. a
  /// checkpoint's BF16 bytes widened in place), so no f32 copy of the whole
  /// matrix exists. Panels are spread over ThreadPool::Default(): do not
  /// call from inside one of its jobs. `rows` must be thread-safe.
  static PackedMatrix PackRows(const RowSource& rows, int out, int in,
                               WeightDType dtype);

  WeightDType dtype() const { return dtype_; }
  int out() const { return out_; }
  int in() const { return in_; }
  /// Panels of 32 output rows: ceil(out / 32).
  int panels() const { return panels_; }
  /// Bytes held (data and scales).
  size_t bytes() const { return bytes_; }

  /// True when Gemm runs this dtype's own dot-product instructions
  /// (vdpbf16ps for bf16, vpdpbusd for int8: 2x / 4x the MACs per
  /// instruction of f32 FMA), so it beats dequantize + sgemm at any batch;
  /// false for f32 and for the AVX2 fallbacks.
  bool HasNativeKernel() const;

  /// Converts n rows of x [n, in] (row stride in) for Gemm; `input` keeps
  /// a pointer to x for the f32 format, so x must outlive the products.
  void PrepareInput(const float* x, int n, Input* input) const;

  /// y[i, o] = dot(x[i, :], W[o, :]) + beta * y[i, o] for the input's n
  /// rows and the output rows of panels [panel_begin, panel_end); y is
  /// [n, y_stride]. Weight-streaming kernels for decode-sized n (up to a
  /// few dozen rows); the bf16 AVX-512 path and the int8 paths round the
  /// inputs to the weights' precision (bf16; int8 per 32-block absmax).
  void Gemm(const Input& input, int panel_begin, int panel_end, float* y,
            int y_stride, float beta) const;

  /// Writes W^T of the output rows of panels [panel_begin, panel_end) as
  /// f32, dequantized: dst[k * ld + j] = W[32 * panel_begin + j, k] for
  /// k < in, j < 32 * (panel_end - panel_begin) (rows past out are 0);
  /// ld >= 32 * (panel_end - panel_begin). The tiles prefill's sgemm reads.
  void UnpackPanels(int panel_begin, int panel_end, float* dst,
                    size_t ld) const;

  /// Writes row `row` (< out) of W, dequantized, to dst [in] (embedding
  /// lookups from a tied or packed table).
  void DequantizeRow(int row, float* dst) const;

 private:
  // Zeroed storage for a [out, in] matrix in `dtype`.
  static PackedMatrix Allocate(int out, int in, WeightDType dtype);
  // Packs panel p from its `valid` (<= 32) rows [valid, in] f32.
  void PackPanel(const float* rows, int valid, int p);

  WeightDType dtype_ = WeightDType::kF32;
  int out_ = 0, in_ = 0, panels_ = 0;
  int in_padded_ = 0;  // in (f32), in2 (bf16) or in32 (int8)
  size_t bytes_ = 0;
  // Storage from HugePageArena (huge pages: a decode step streams it all);
  // shared so that copies of an immutable matrix are cheap.
  std::shared_ptr<float[]> f32_;
  std::shared_ptr<uint16_t[]> bf16_;
  std::shared_ptr<uint8_t[]> q8_;
  std::shared_ptr<uint16_t[]> scales_;  // f16
};

/// y[n, out] = x[n, in] W^T + beta * y for the matrix `w` (y row stride
/// out): panels spread over the engine's thread pool (PackedMatrix::Gemm)
/// for n <= max_gemv_rows or when w.HasNativeKernel(), else tiles of W
/// unpacked to f32 and multiplied by OpenBLAS sgemm (its threads). `input`
/// is scratch reused across calls.
void PackedLinear(const PackedMatrix& w, const float* x, int n, float* y,
                  float beta, int max_gemv_rows, PackedMatrix::Input* input);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_ENGINE_PACKED_MATRIX_H_
