"""How the engine's OpenMP threads wait between parallel regions (no I/O)."""

from __future__ import annotations

from collections.abc import MutableMapping

# Rounds of libgomp's wait loop: long enough to bridge the gap between two parallel
# regions of one decode step, short enough that an idle engine soon sleeps.
SPIN_ROUNDS = "100000"


def set_openmp_wait(environ: MutableMapping[str, str]) -> None:
    """Has the engine's threads spin briefly between parallel regions, then sleep.

    Sleeping at once costs a wake-up per region, dozens per decode step, and a single
    stream through the stack pays for each of them (figures in bench/RESULTS.md). An idle
    engine still sleeps and leaves its cores to the database, the broker and the other
    services. Takes effect when torch loads its OpenMP runtime; OMP_WAIT_POLICY or
    GOMP_SPINCOUNT already set win.
    """
    if "OMP_WAIT_POLICY" not in environ:
        environ.setdefault("GOMP_SPINCOUNT", SPIN_ROUNDS)
