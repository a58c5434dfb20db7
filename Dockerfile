# The orchestrator's own service image: the API, workers and reapers of the Helm chart
# (`orchestrator serve|worker|reaper`; helm/orchestrator's image.repository).
#
# Python packages come from a wheelhouse made on the host, because build containers may
# have no route to PyPI (they do reach Debian's mirrors). scripts/service-images.sh makes
# it and builds this (and Redis's image); `make test` runs it.
#
# The wheels must match the image's Python (bookworm: 3.11.2, which also needs what a newer
# 3.11 does not: the script adds it). Runs as uid 10001 with a read-only root filesystem:
# nothing is written outside /tmp and /var/lib/orchestrator, which the chart mounts as
# emptyDirs.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates tini patch \
    && rm -rf /var/lib/apt/lists/*

RUN groupadd --gid 10001 orchestrator \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin orchestrator

COPY build/wheelhouse/ /tmp/wheelhouse/
RUN python3 -m venv /opt/orchestrator \
    && /opt/orchestrator/bin/pip install --no-cache-dir --no-index \
       --find-links /tmp/wheelhouse orchestrator \
    && /opt/orchestrator/bin/python -m compileall -q /opt/orchestrator/lib \
    && rm -rf /tmp/wheelhouse

# No bytecode writes at run time (the root is read-only; compileall did them above).
ENV PATH=/opt/orchestrator/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
WORKDIR /tmp
USER 10001:10001

# tini as PID 1 forwards SIGTERM to the process `orchestrator` execs into (uvicorn or
# celery, which drain on it) and reaps what that leaves behind.
ENTRYPOINT ["/usr/bin/tini", "--", "orchestrator"]
CMD ["serve"]
