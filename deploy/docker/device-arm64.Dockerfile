# The device runtime for 64-bit Raspberry Pi OS / Jetson boards (linux/arm64), torch backend.
# onnxruntime-training has no arm64 wheel (docs/install-edge.md); the numpy and torch
# backends work as they are.  Build on the board or with buildx:
#   docker buildx build --platform linux/arm64 -f deploy/docker/device-arm64.Dockerfile -t safl-device .
FROM --platform=linux/arm64 python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends libgl1 libglib2.0-0 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --home /var/lib/safl --create-home --groups video safl
WORKDIR /opt/safl
COPY pyproject.toml README.md ./
COPY edge_client edge_client
COPY aggregator/__init__.py aggregator/__init__.py
COPY models models
# The torch extra takes torch 2.9.1 on aarch64: CPU-only, and it runs on a Pi 4 (2.10.0
# dies of SIGILL there, 2.11 on need CUDA 13; deploy/check_aarch64.py installs it so).
RUN pip install --no-cache-dir '.[torch,camera]'
USER safl
WORKDIR /var/lib/safl
ENTRYPOINT ["safl", "device"]
CMD ["--config", "/etc/safl/device.toml"]
