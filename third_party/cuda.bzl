"""cuda_library: CUDA C++ (.cu) sources compiled by the toolkit's nvcc.

Bazel 4.2 has no CUDA rules and this workspace builds offline, so each .cu
file is compiled by a genrule calling /usr/local/cuda/bin/nvcc for sm_90
(H100 / H200 machine code) plus compute_90 PTX (which the driver JIT-compiles
for newer GPUs), the objects are archived into a static library, and a
cc_library exposes that archive with its headers. cudart / cuBLAS come from
//third_party:cuda (the toolkit's shared libraries).

Usage (BUILD file):
    load("//third_party:cuda.bzl", "cuda_library")
    cuda_library(
        name = "kernels",
        srcs = ["kernels.cu"],    # compiled by nvcc, one object each
        hdrs = ["kernels.h"],     # host-visible declarations
        textual_hdrs = [...],     # headers only the .cu files include
    )

Headers are passed as genrule srcs so they exist in the sandbox; include
paths are the execution root (-I.) and the genfiles root (-I$(GENDIR)), so
.cu files include "common/cuda/foo.h" like any other source.
"""

NVCC = "/usr/local/cuda/bin/nvcc"

# copts of host C++ targets that include the CUDA runtime / cuBLAS headers
# (directly or through common/cuda headers). Bazel 4 rejects absolute -I /
# -isystem paths in copts and checks every header the compiler's .d file
# lists against the declared ones: -idirafter passes the first check and
# marks the toolkit's headers as system headers, and -MMD keeps system
# headers out of the .d file (the toolkit, like /usr/include, is outside the
# workspace).
CUDA_HOST_COPTS = [
    "-idirafter/usr/local/cuda/include",
    "-MMD",
]

# sm_90 machine code + compute_90 PTX. -Xcompiler -fPIC: the archive is also
# linked into shared objects when Bazel builds tests in dynamic mode.
NVCC_FLAGS = [
    "-std=c++17",
    "-O3",
    "-Xcompiler",
    "-fPIC",
    "-gencode",
    "arch=compute_90,code=sm_90",
    "-gencode",
    "arch=compute_90,code=compute_90",
    "--expt-relaxed-constexpr",
]

def _nvcc_check():
    # A clear failure when the toolkit is missing (the CI machine has it).
    return ("if [ ! -x {nvcc} ]; then " +
            "echo 'cuda_library: {nvcc} not found: install the CUDA 13 " +
            "toolkit under /usr/local/cuda (see common/cuda/README.md)' >&2; " +
            "exit 1; fi; ").format(nvcc = NVCC)

def cuda_library(name, srcs, hdrs = [], textual_hdrs = [], deps = [], nvcc_flags = [], visibility = None):
    """Compiles `srcs` (.cu) with nvcc into a static archive wrapped as a cc_library.

    Args:
      name: the cc_library's name; `name`_archive is the archive genrule.
      srcs: .cu files, one nvcc invocation (and one object) each.
      hdrs: public headers (plain C++, usable by host code).
      textual_hdrs: headers only the .cu files include.
      deps: cc_library deps of the host code that uses this library.
      nvcc_flags: extra nvcc flags appended to NVCC_FLAGS.
      visibility: visibility of the cc_library.
    """
    objs = []
    for src in srcs:
        if not src.endswith(".cu"):
            fail("cuda_library %s: %s is not a .cu file" % (name, src))
        stem = src[:-len(".cu")].replace("/", "_")
        obj = "_%s_objs/%s.o" % (name, stem)
        native.genrule(
            name = "%s_%s_nvcc" % (name, stem),
            srcs = [src] + hdrs + textual_hdrs,
            outs = [obj],
            # nvcc names its temporary files after its process id, which
            # is the same small number in every sandbox's PID namespace:
            # two nvcc actions at once (Bazel's jobs, or two workspaces on
            # one machine) would clobber each other's files in a shared
            # /tmp. Each action gets its own TMPDIR.
            cmd = _nvcc_check() + "tmp=$$(mktemp -d) && TMPDIR=$$tmp " + " ".join(
                [NVCC] + NVCC_FLAGS + nvcc_flags +
                ["-I.", "-I$(GENDIR)", "-c", "$(location %s)" % src, "-o", "$@"],
            ) + "; rc=$$?; rm -rf $$tmp; exit $$rc",
            message = "nvcc %s" % src,
            visibility = ["//visibility:private"],
        )
        objs.append(obj)

    archive = "lib%s_cuda.a" % name
    native.genrule(
        name = "%s_archive" % name,
        srcs = objs,
        outs = [archive],
        cmd = "rm -f $@ && ar rcs $@ $(SRCS)",
        visibility = ["//visibility:private"],
    )
    native.cc_import(
        name = "%s_import" % name,
        static_library = archive,
        # Keep every kernel object: registration of the fat binaries runs
        # from static initialisers the linker would otherwise drop.
        alwayslink = 1,
        visibility = ["//visibility:private"],
    )
    native.cc_library(
        name = name,
        hdrs = hdrs,
        deps = deps + [
            ":%s_import" % name,
            "//third_party:cuda",
        ],
        visibility = visibility,
    )
