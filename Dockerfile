# syntax=docker/dockerfile:1
# voxrecall sidecar image: multi-stage, non-root, the embedded model inside, portable hnswlib.
# Build: deploy/build-image.sh (podman, no Docker engine needed) or `docker build -t voxrecall .`
# Run:   docker run -v $PWD/examples:/config:ro -v $PWD/var/store:/store:ro -p 50051:50051 voxrecall
# The config and the snapshot store are mounts; the config's [sidecar] store is replaced by /store.
# The image runs as uid 10001: `voxrecall index build` publishes versions readable by every user;
# a store copied in by other means may need `chmod -R a+rX` first.
FROM python:3.11-slim-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential=12.9 \
 && rm -rf /var/lib/apt/lists/*
# hnswlib compiles with -march=native by default: an image built that way can die with SIGILL on
# another CPU. x86-64-v3 (AVX2) runs on every x86 server of the last decade.
ENV HNSWLIB_NO_NATIVE=1 CXXFLAGS=-march=x86-64-v3 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# A CA bundle handed in as a build secret (a TLS-inspecting proxy) is used by pip, never kept.
RUN --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
 && python -m venv /opt/voxrecall \
 && /opt/voxrecall/bin/pip install pip==24.3.1 \
 && /opt/voxrecall/bin/pip install hnswlib==0.8.0
WORKDIR /src
COPY pyproject.toml README.md ./
COPY index ./index
COPY sidecar ./sidecar
RUN --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
 && /opt/voxrecall/bin/pip install '.[s3]' \
 && /opt/voxrecall/bin/python -c "import hnswlib, onnxruntime, sidecar.edge.server, index.s3_store" \
 && /opt/voxrecall/bin/pip uninstall -y -q pip setuptools

# The run-time stage: the venv (no pip, no compiler) and a user; the sources stay behind.
FROM python:3.11-slim-bookworm
RUN useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin voxrecall
COPY --from=build /opt/voxrecall /opt/voxrecall
ENV PATH=/opt/voxrecall/bin:$PATH PYTHONUNBUFFERED=1
USER 10001
WORKDIR /tmp
EXPOSE 50051 9464
VOLUME ["/config", "/store"]
# The health service answers without a token. With [sidecar.tls], override it with the probe's
# --ca (and --cert/--key for mutual TLS): python -m sidecar.healthcheck --help
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s \
  CMD ["python", "-m", "sidecar.healthcheck", "--target", "127.0.0.1:50051"]
# The server handles SIGTERM itself (health NOT_SERVING, drain, exit 0), so it runs as PID 1.
# Arguments replace CMD: e.g. an http(s) store from the config instead of the /store mount.
ENTRYPOINT ["voxrecall", "serve"]
CMD ["--config", "/config/voxrecall.toml", "--listen", "0.0.0.0:50051", "--store", "/store"]
