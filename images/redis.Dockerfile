# Redis for the chart's bundled mode (helm/orchestrator: redis.bundled.image), made from
# Debian's own packages where Docker Hub's `redis` image cannot be pulled: the suite's
# `helm install` (tests/k8s/test_helm_install.py) runs it. The chart needs `redis-server`
# (also run as `--sentinel`) and `redis-cli` on PATH and a writable /data; it runs the
# container as uid 999 with a read-only root and /tmp as an emptyDir.
#
#   docker build -t orchestrator/redis:7.0 -f images/redis.Dockerfile images
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server redis-tools \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir /data && chown 999:999 /data

WORKDIR /data
USER 999:999
CMD ["redis-server"]
