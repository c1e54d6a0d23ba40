"""Chaos: load on a supervised stack while its processes are SIGKILLed, then the
invariants checked from outside. `python -m tests.chaos [--long]`; a bounded form runs
in the test suite (test_chaos.py)."""
