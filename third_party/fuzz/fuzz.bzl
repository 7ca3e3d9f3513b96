"""specserve_fuzz_test: a libFuzzer target and the test that runs it."""

def specserve_fuzz_test(name, srcs, corpus, deps = [], data = [], seconds = 20, runs = 3000):
    """A fuzz target (LLVMFuzzerTestOneInput in `srcs`) and its test.

    Default build: linked with //third_party/fuzz:driver, which replays the
    corpus and `runs` deterministic mutations. --config=fuzz: linked with
    libFuzzer (clang-14, ASan + UBSan) and fuzzed for `seconds` from a copy
    of the corpus. `corpus`: the checked-in seed directory, relative to the
    package. The test carries the tag "fuzz".
    """
    native.cc_binary(
        name = name + "_bin",
        srcs = srcs,
        deps = deps + select({
            "//third_party/fuzz:fuzzing": [],
            "//conditions:default": ["//third_party/fuzz:driver"],
        }),
        testonly = True,
        tags = ["fuzz"],
    )
    native.sh_test(
        name = name,
        srcs = ["//third_party/fuzz:run_fuzz.sh"],
        args = [
            "$(location :%s_bin)" % name,
            native.package_name() + "/" + corpus,
            str(seconds),
            str(runs),
        ],
        data = [":" + name + "_bin"] + native.glob([corpus + "/**"]) + data,
        tags = ["fuzz"],
        size = "medium",
    )
