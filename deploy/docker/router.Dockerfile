# specserve router (public specserve.v1.Router API; CPU only).
# Build from the repository root:
#   docker build -f deploy/docker/router.Dockerfile -t specserve/router:dev .
# The router reads the target model's tokenizer from /models (mounted).
ARG BUILD_IMAGE=debian:bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

FROM ${BUILD_IMAGE} AS build
WORKDIR /src
COPY tools/install_deps.sh tools/
RUN bash tools/install_deps.sh && rm -rf /var/lib/apt/lists/*
COPY WORKSPACE .bazelrc ./
COPY third_party/ third_party/
COPY protos/ protos/
COPY common/ common/
COPY speculator_service/ speculator_service/
COPY router/ router/
COPY deploy/docker/bundle.sh deploy/docker/
RUN bazel build -c opt //router:router && \
    bash deploy/docker/bundle.sh bazel-bin/router/router /out

FROM ${RUNTIME_IMAGE}
COPY --from=build /out/ /opt/specserve/
ENV LD_LIBRARY_PATH=/opt/specserve/lib
USER 65532:65532
VOLUME ["/models"]
EXPOSE 50051 8000 9151
ENTRYPOINT ["/opt/specserve/bin/router"]
CMD ["--port=50051", "--http_port=8000", "--metrics_port=9151", "--tokenizer=/models/target", "--speculator=dns:///specserve-speculator:50061", "--target=dns:///specserve-target:50052"]
