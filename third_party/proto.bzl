"""C++ protobuf + gRPC code generation with Debian's protoc and grpc_cpp_plugin.

No rules_proto or com_github_grpc_grpc (both need downloads): a genrule runs
the system `protoc` and the cc_library compiles what it wrote.
"""

def cc_grpc_library(name, srcs, deps = [], grpc = True, visibility = None):
    """Generates C++ messages (and gRPC stubs when `grpc`) for `srcs`.

    Args:
      name: name of the resulting cc_library.
      srcs: .proto files in this package; imports are resolved from the
        workspace root, e.g. `import "protos/common.proto";`.
      deps: cc_grpc_library targets of imported protos.
      grpc: also emit `.grpc.pb.{h,cc}` service stubs.
      visibility: passed to the cc_library.
    """
    outs_h = []
    outs_cc = []
    for src in srcs:
        base = src[:-len(".proto")]
        outs_h.append(base + ".pb.h")
        outs_cc.append(base + ".pb.cc")
        if grpc:
            outs_h.append(base + ".grpc.pb.h")
            outs_cc.append(base + ".grpc.pb.cc")

    pkg = native.package_name()
    cmd = "protoc -I. --cpp_out=$(GENDIR)"
    if grpc:
        cmd += " --grpc_out=$(GENDIR) --plugin=protoc-gen-grpc=$$(command -v grpc_cpp_plugin)"
    cmd += " " + " ".join([pkg + "/" + s for s in srcs])

    native.genrule(
        name = name + "_codegen",
        srcs = srcs + [d + "_srcs" for d in deps],
        outs = outs_h + outs_cc,
        cmd = cmd,
    )
    native.filegroup(
        name = name + "_srcs",
        srcs = srcs + [d + "_srcs" for d in deps],
        visibility = ["//visibility:public"],
    )
    native.cc_library(
        name = name,
        srcs = outs_cc,
        hdrs = outs_h,
        deps = deps + ["//third_party:grpc", "//third_party:protobuf"],
        visibility = visibility,
    )
