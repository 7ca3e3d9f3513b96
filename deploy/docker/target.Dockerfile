# specserve target service (pruned prefill + draft verification).
# Build from the repository root:
#   docker build -f deploy/docker/target.Dockerfile -t specserve/target:cuda .
#   docker build -f deploy/docker/target.Dockerfile \
#     --build-arg RUNTIME_IMAGE=debian:bookworm-slim -t specserve/target:cpu .
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
COPY target_service/ target_service/
COPY deploy/docker/bundle.sh deploy/docker/
RUN bazel build -c opt //target_service:target_service && \
    bash deploy/docker/bundle.sh bazel-bin/target_service/target_service /out

FROM ${RUNTIME_IMAGE}
COPY --from=build /out/ /opt/specserve/
ENV LD_LIBRARY_PATH=/opt/specserve/lib:/usr/local/nvidia/lib:/usr/local/nvidia/lib64
USER 65532:65532
VOLUME ["/models"]
EXPOSE 50052 9092
ENTRYPOINT ["/opt/specserve/bin/target_service"]
CMD ["--model=/models/target", "--host=0.0.0.0", "--port=50052", "--metrics_port=9092"]
