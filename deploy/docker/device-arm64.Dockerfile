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
# PyPI's aarch64 torch pulls CUDA 13 packages (454 MB and more): take PyTorch's CPU build.
RUN pip install --no-cache-dir torch --index-url https://download.pytorch.org/whl/cpu \
    && pip install --no-cache-dir '.[camera]'
USER safl
WORKDIR /var/lib/safl
ENTRYPOINT ["safl", "device"]
CMD ["--config", "/etc/safl/device.toml"]
