# syntax=docker/dockerfile:1
# The Sluice gateway.
#   docker build -t sluice:0.1.0 .
#   docker run --rm -p 8080:8080 sluice:0.1.0
#       (no policy: the built-in example policy with two simulated backends and demo keys)
#   docker run --rm -p 8080:8080 -v "$PWD/examples:/etc/sluice:ro" sluice:0.1.0 \
#       --config /etc/sluice/policy.yaml --host 0.0.0.0 --port 8080
# In Kubernetes: deploy/k8s/deployment.yaml (args as above, policy from the ConfigMap).

ARG PYTHON_IMAGE=python:3.11-slim

# --- build: a wheel of the package, then a venv holding it and its dependencies ----------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
# pip compiles the .pyc files here, so the read-only runtime never needs to write them.
RUN python -m pip wheel --no-deps --wheel-dir /wheels . \
 && python -m venv /opt/sluice \
 && /opt/sluice/bin/pip install /wheels/sluice-*.whl

# --- runtime: the same Python, the venv, a non-root user --------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="sluice" \
      org.opencontainers.image.description="Overload-protecting gateway for LLM inference servers" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 sluice \
 && useradd --system --uid 10001 --gid sluice --no-create-home --home-dir /tmp \
            --shell /usr/sbin/nologin sluice
COPY --from=build /opt/sluice /opt/sluice
# HOME and MPLCONFIGDIR point at /tmp: the root filesystem is read-only in Kubernetes,
# where /tmp is an emptyDir.
ENV PATH="/opt/sluice/bin:${PATH}" \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib
# Numeric, so that Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
EXPOSE 8080
# Exec form: `sluice` is PID 1 and receives SIGTERM itself (it drains, then exits).
ENTRYPOINT ["sluice", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8080"]
