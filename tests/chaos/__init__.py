"""The chaos soak: `python -m tests.chaos --backend sqlite|postgres --seconds S --seed N`.

A seeded schedule of process kills, terminated database connections and cut connections against
real servers, writers, subscribers and workers; every invariant of the promise checked at the end
(`tests.chaos.invariants`) and summed up in one figure line. `tests/chaos/test_chaos_soak.py`
runs a bounded profile of it on both backends in the suite; see `docs/reliability.md`.
"""
