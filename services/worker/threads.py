"""How the engine's OpenMP threads wait between parallel regions (no I/O)."""

from __future__ import annotations

from collections.abc import MutableMapping

# libgomp counts some 100000 rounds of its wait loop per millisecond.
SPIN_ROUNDS = "100000"


def set_openmp_wait(environ: MutableMapping[str, str]) -> None:
    """Has the engine's threads spin about a millisecond between parallel regions, then sleep.

    Sleeping at once costs a wake-up per region, dozens per decode step: one stream went
    through the stack at 74 tok/s that way against 92 (bench.stack, README). An idle
    engine still sleeps and leaves its cores to the database, the broker and the other
    services. Takes effect when torch loads its OpenMP runtime; OMP_WAIT_POLICY or
    GOMP_SPINCOUNT already set win.
    """
    if "OMP_WAIT_POLICY" not in environ:
        environ.setdefault("GOMP_SPINCOUNT", SPIN_ROUNDS)
