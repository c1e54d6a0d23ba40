# One image for every Tollgate process: admission, scheduler, worker, ledger and the CLI.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# A C compiler builds the engine's native decode-attention kernel on first use (without
# one, attention runs in PyTorch, slower).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

ENV TOLLGATE_KERNEL_CACHE=/var/cache/tollgate/kernels

# torch first and from the CPU-only index: the largest layer, kept across code changes.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY pyproject.toml README.md ./
COPY tollgate ./tollgate
COPY engine ./engine
COPY services ./services
COPY migrations ./migrations

# Editable, so that Alembic finds migrations/versions in the source tree.
RUN pip install -e . \
    && useradd --system --uid 10001 --home-dir /app tollgate \
    && mkdir -p /models "$TOLLGATE_KERNEL_CACHE" \
    && chown tollgate /models "$TOLLGATE_KERNEL_CACHE"

USER tollgate

# The gateway (admission) listens here; the other processes are configured by TOLLGATE_LISTEN.
EXPOSE 50051

CMD ["tollgate", "--help"]
