# specserve speculator service (Speculative Prefill scoring + drafts).
# Build from the repository root:
#   docker build -f deploy/docker/speculator.Dockerfile -t specserve/speculator:cuda .
#   docker build -f deploy/docker/speculator.Dockerfile \
#     --build-arg RUNTIME_IMAGE=debian:bookworm-slim -t specserve/speculator:cpu .
# The model directory is mounted at /models, never baked in.
ARG BUILD_IMAGE=debian:bookworm
ARG RUNTIME_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04

FROM ${BUILD_IMAGE} AS build
WORKDIR /src
COPY tools/install_deps.sh tools/
RUN bash tools/install_deps.sh && rm -rf /var/lib/apt/lists/*
COPY WORKSPACE .bazelrc ./
COPY third_party/ third_party/
COPY protos/ protos/
COPY common/ common/
COPY speculator_service/ speculator_service/
COPY deploy/docker/bundle.sh deploy/docker/
RUN bazel build -c opt //speculator_service:speculator_service && \
    bash deploy/docker/bundle.sh bazel-bin/speculator_service/speculator_service /out

FROM ${RUNTIME_IMAGE}
COPY --from=build /out/ /opt/specserve/
ENV LD_LIBRARY_PATH=/opt/specserve/lib:/usr/local/nvidia/lib:/usr/local/nvidia/lib64
USER 65532:65532
VOLUME ["/models"]
EXPOSE 50061 9161
ENTRYPOINT ["/opt/specserve/bin/speculator_service"]
CMD ["--model=/models/speculator", "--host=0.0.0.0", "--port=50061", "--metrics_port=9161"]
