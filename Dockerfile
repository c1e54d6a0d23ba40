# One image for every Tollgate process: admission, scheduler, worker, ledger and the CLI.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

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
    && mkdir -p /models \
    && chown tollgate /models

USER tollgate

# The gateway (admission) listens here; the other processes are configured by TOLLGATE_LISTEN.
EXPOSE 50051

CMD ["tollgate", "--help"]
