"""How a topology is laid out over the nodes a live membership has (``fault_tolerance=live``): after a change the
members sit on fewer nodes, or on nodes of different sizes, and the schedule is built again over what remains.

Nodes of one size keep their structure (a whole node lost leaves them so: ``hierarchical`` keeps its two stages over
a power-of-two number of nodes, and over one node is its within-node average); nodes of different sizes (a worker
lost, not its node) are laid out as one node, unless that makes a round one group of every member (``hierarchical``
as one node is ``complete``: every worker a message to every other at each step): ring then, as for a topology that
cannot serve the count. The reason goes into one warning per change (docs/fault-tolerance.md).
"""

from __future__ import annotations

from decent_train.engine.topology import Topology, build_topology

__all__ = ["layout_over_nodes"]


def layout_over_nodes(name: str, world_size: int, sizes: list[int], configured_local: int | None
                      ) -> tuple[str, int, str]:
    """(topology, workers per node, why it is not ``name`` over these nodes: '' when it is) for ``world_size``
    members on nodes of ``sizes`` members each (in rank order); ``configured_local``: ``topology.local_world_size``."""
    why = ""
    if len(sizes) > 1 and len(set(sizes)) == 1:
        local = configured_local if configured_local and sizes[0] % configured_local == 0 else sizes[0]
    else:
        local = world_size if configured_local is None or configured_local >= world_size else configured_local
        if len(set(sizes)) > 1:
            why = (f"topology {name}: nodes of different sizes ({', '.join(map(str, sizes))}) laid out as "
                   + ("one node" if local == world_size else f"nodes of {local}"))
    try:
        built = build_topology(name, world_size, local)
    except ValueError as error:
        return "ring", world_size, f"topology {name} cannot serve {world_size} workers ({local} per node): {error}"
    if why and _groups(built) == _node_free_groups(name, world_size):
        why = ""  # a schedule that does not depend on the nodes (ring, complete) lost nothing
    if why and world_size > 2 and any(len(stages) == 1 and len(stages[0]) == 1 for stages in built.stages):
        return "ring", world_size, (f"{why} would be one group of all {world_size} (each worker a message to "
                                    "every other at every step)")
    return name, local, why


def _groups(topology: Topology) -> list[list[list[list[int]]]]:
    """A schedule's groups (ranks only), round by round and stage by stage."""
    return [[[edge.ranks for edge in edges] for edges in stages] for stages in topology.stages]


def _node_free_groups(name: str, world_size: int) -> list[list[list[list[int]]]] | None:
    """The groups of topology ``name`` over ``world_size`` workers of a node each (None if it cannot be laid out so)."""
    try:
        return _groups(build_topology(name, world_size, 1))
    except ValueError:
        return None
