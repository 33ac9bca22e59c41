# voxrecall sidecar image: multi-stage, non-root, the embedded model inside, portable hnswlib.
#   podman/docker build -t voxrecall .
#   docker run -v $PWD/examples:/config:ro -v $PWD/var/store:/store:ro -p 50051:50051 voxrecall
FROM python:3.11-slim-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential=12.9 \
 && rm -rf /var/lib/apt/lists/*
# hnswlib compiles with -march=native by default: an image built that way can die with SIGILL on
# another CPU. x86-64-v3 (AVX2) runs on every x86 server of the last decade.
ENV HNSWLIB_NO_NATIVE=1 CXXFLAGS=-march=x86-64-v3 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY index ./index
COPY sidecar ./sidecar
RUN python -m venv /opt/voxrecall \
 && /opt/voxrecall/bin/pip install --upgrade pip==24.3.1 \
 && /opt/voxrecall/bin/pip install .

FROM python:3.11-slim-bookworm
RUN useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin voxrecall
COPY --from=build /opt/voxrecall /opt/voxrecall
ENV PATH=/opt/voxrecall/bin:$PATH PYTHONUNBUFFERED=1
USER voxrecall
EXPOSE 50051
VOLUME ["/config", "/store"]
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s \
  CMD ["python", "-c", "import grpc,sys;from grpc_health.v1 import health_pb2 as h,health_pb2_grpc as g;c=grpc.insecure_channel('127.0.0.1:50051');sys.exit(0 if g.HealthStub(c).Check(h.HealthCheckRequest(),timeout=2).status==1 else 1)"]
# The server handles SIGTERM itself (drains, then exits 0), so it can run as PID 1.
ENTRYPOINT ["voxrecall", "serve", "--config", "/config/voxrecall.toml", "--listen", "0.0.0.0:50051", "--store", "/store"]
