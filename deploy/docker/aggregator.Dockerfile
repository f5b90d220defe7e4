# The base station and cloud services (x86_64 or arm64 servers).
# Build from the repository root: docker build -f deploy/docker/aggregator.Dockerfile -t safl-aggregator .
FROM python:3.11-slim-bookworm
RUN useradd --system --home /var/lib/safl --create-home safl
WORKDIR /opt/safl
COPY pyproject.toml README.md ./
COPY edge_client edge_client
COPY aggregator aggregator
COPY models/__init__.py models/__init__.py
RUN pip install --no-cache-dir '.[deploy,station]'
USER safl
WORKDIR /var/lib/safl
ENTRYPOINT ["safl"]
CMD ["--help"]
