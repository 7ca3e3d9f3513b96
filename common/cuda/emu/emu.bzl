"""cuda_emu_library: .cu sources compiled as host C++ for the emulated device.

Each .cu file is copied to a .cc (Bazel's cc rules take no .cu) and compiled
by the host compiler with common/cuda/emu/cuda_emu.h force-included and
SPECSERVE_CUDA_EMU defined: kernels become host functions that
//common/cuda/emu:cuda_emu runs one fiber per CUDA thread. Link the result
with :cuda_emu instead of //third_party:cuda (no libcudart, no cuBLAS).
"""

load("//third_party:cuda.bzl", "CUDA_HOST_COPTS", "cuda_library")

# -O2: the emulated kernels run every CUDA thread on the host.
CUDA_EMU_COPTS = CUDA_HOST_COPTS + [
    "-DSPECSERVE_CUDA_EMU",
    "-include",
    "common/cuda/emu/cuda_emu.h",
    "-O2",
    "-Wno-unknown-pragmas",  # #pragma unroll
]

def cuda_emu_library(name, srcs, hdrs = [], textual_hdrs = [], deps = []):
    """The emulated twin of a cuda_library (same sources, same headers).

    Args:
      name: the cc_library's name.
      srcs: .cu files of this package.
      hdrs: public headers, as in the cuda_library.
      textual_hdrs: headers only the .cu files include.
      deps: cc_library deps (emulated twins, not nvcc-built libraries).
    """
    ccs = []
    for src in srcs:
        if not src.endswith(".cu"):
            fail("cuda_emu_library %s: %s is not a .cu file" % (name, src))
        stem = src[:-len(".cu")].replace("/", "_")
        out = "_%s_emu/%s.cc" % (name, stem)
        native.genrule(
            name = "%s_%s_cc" % (name, stem),
            srcs = [src],
            outs = [out],
            cmd = "cp $< $@",
            visibility = ["//visibility:private"],
        )
        ccs.append(out)
    native.cc_library(
        name = name,
        srcs = ccs,
        hdrs = hdrs,
        textual_hdrs = textual_hdrs,
        copts = CUDA_EMU_COPTS,
        deps = deps + ["//common/cuda/emu:cuda_emu"],
    )

def cuda_library_with_emu_twin(name, srcs, hdrs = [], textual_hdrs = [], deps = [], emu_deps = []):
    """A cuda_library `name` and its emulated twin `name`_emu, same sources.

    Args:
      name: the nvcc-built cc_library; `name`_emu is the emulated one.
      srcs: .cu files.
      hdrs: public headers.
      textual_hdrs: headers only the .cu files include.
      deps: deps of the nvcc-built library.
      emu_deps: deps of the twin (the twins of `deps`).
    """
    cuda_library(
        name = name,
        srcs = srcs,
        hdrs = hdrs,
        textual_hdrs = textual_hdrs,
        deps = deps,
    )
    cuda_emu_library(
        name = name + "_emu",
        srcs = srcs,
        hdrs = hdrs,
        textual_hdrs = textual_hdrs,
        deps = emu_deps,
    )

def cuda_test_with_emu_twin(name, srcs, deps, device_deps, emu_deps, size, emu_size, emu_args = [], emu_shard_count = None, data = []):
    """A GPU cc_test `name` and its twin on the emulated device, same sources.

    `name` is one self-contained binary (linkstatic) that
    tools/gpu/bundle_gpu_tests.sh bundles for the GPU machine; its GPU cases
    skip without one. The twin, `name` with `_test` replaced by `_emu_test`,
    runs them on //common/cuda/emu (in CI) and is not bundled.

    Args:
      name: the GPU test's name, ending in _test.
      srcs: the test sources.
      deps: deps both share.
      device_deps: the nvcc-built libraries and //third_party:cuda.
      emu_deps: their emulated twins.
      size: the GPU test's size.
      emu_size: the twin's size (emulated kernels run on the host).
      emu_args: the twin's args, e.g. a --gtest_filter leaving out timing
        reports and cases too slow to emulate.
      emu_shard_count: the twin's shard count: its cases spread over the
        cores instead of one long test at the end of a CI step.
      data: runfiles both read.
    """
    if not name.endswith("_test"):
        fail("cuda_test_with_emu_twin %s: the name must end in _test" % name)
    native.cc_test(
        name = name,
        size = size,
        linkstatic = True,
        srcs = srcs,
        copts = CUDA_HOST_COPTS,
        data = data,
        deps = deps + device_deps,
    )
    native.cc_test(
        name = name[:-len("_test")] + "_emu_test",
        size = emu_size,
        shard_count = emu_shard_count,
        srcs = srcs,
        args = emu_args,
        copts = CUDA_HOST_COPTS,
        data = data,
        deps = deps + emu_deps,
    )
