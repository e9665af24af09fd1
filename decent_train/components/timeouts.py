"""The order of the job's timeouts: the orderings under which a documented bound cannot hold are refused in one line
(the table of waits and bounds: docs/fault-tolerance.md, "Every wait has a bound"; the analysis: "The timeouts' order").

Each refusal here was caused in a real run first (tests/test_timeouts.py shows the misbehaviour it prevents); an
ordering that is only odd (``detect_s`` above ``comm_timeout_s``, ``comm_timeout_s`` above ``pg_timeout_s`` under
live mode, the rendezvous' timeouts against the others) passes.
"""

from __future__ import annotations

from decent_train.components.checks import refusing_ignored

# The live protocol's shortest silence that is no fault: workers and node agents beat every 0.1 s (HEARTBEAT_S), and
# a member that ends its run stops beating for longer than that before it exits (healthy runs were declared dead
# below 1 s, and once in 14 at 1 s, on a loaded 2-core machine: docs/fault-tolerance.md); 2 s is what the live tests
# run with.
MIN_DETECT_S = 2.0


def check_timeouts(comm_timeout_s: float, pg_timeout_s: float, gloo_exchanges: bool, live: bool,
                   detect_s: float) -> None:
    """Refuse an order of the timeouts that a run cannot keep. ``gloo_exchanges``: the algorithm bounds its exchanges
    by ``comm_timeout_s`` and they may run over gloo (on CUDA the engine's groups take comm_timeout_s as their own
    timeout); ``live``: fault_tolerance=live, whose ``detect_s`` applies. A run already written still loads
    (``load_model``): its timeouts are spent."""
    if not refusing_ignored():
        return
    if gloo_exchanges and not live and comm_timeout_s > pg_timeout_s:
        # gloo ends an all-reduce (the engine's, a gossip group of three or more) at the group's own timeout, and the
        # error would name comm_timeout_s as the limit; under live the default group's timeout is comm_timeout_s
        raise ValueError(
            f"comm_timeout_s={comm_timeout_s} must be <= pg_timeout_s={pg_timeout_s}: gloo ends an exchange's "
            "all-reduce at the process group's timeout, sooner than comm_timeout_s; lower comm_timeout_s or raise "
            "pg_timeout_s"
        )
    if live and detect_s < MIN_DETECT_S:
        raise ValueError(
            f"fault_tolerance.detect_s={detect_s} must be >= {MIN_DETECT_S} s: workers and node agents beat every "
            "0.1 s and a worker ending its run is silent longer, so healthy members would be declared dead"
        )
