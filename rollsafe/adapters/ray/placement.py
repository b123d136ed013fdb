"""One Ray placement group per engine group: its ranks packed on one node (or one node per
slice of a group that spans nodes), groups spread.

:class:`GroupPlacer` reserves, for one engine group of ``ranks`` processes, one bundle of
``resources_per_rank`` per rank in a ``STRICT_PACK`` placement group (the group on one node),
or, for a group that spans nodes (``slices`` > 1, ``GroupSpec.ranks_per_node``), one bundle per
node slice (``ranks // slices`` ranks' resources each) in a ``STRICT_SPREAD`` placement group:
every slice on its own node, and Ray reserves all the bundles or none, so a group is never
held half placed (``docs/cluster.md``, "Groups that span nodes"). It spreads the groups of
one fleet over the nodes: each one-node placement is hinted at the alive node that fits the
group and holds the fewest of this placer's groups (Ray's ``_soft_target_node_id``, a hint for
``STRICT_PACK`` groups only: a node without room is passed over by Ray itself). A group may
also be kept apart from others where it can (:attr:`GroupPlacer.apart`: a spare from the
groups it covers, so one node's loss does not take both): among the nodes that fit, those
holding fewer of them come first.
:meth:`GroupPlacer.place` returns once Ray reserved the bundles, as a :class:`Placement` naming
the node, or raises :class:`PlacementUnavailable` after
``timeout_s`` (no node has room: the group waits, see ``docs/cluster.md``). A group can be
pinned to one node (``place(node=)``: the trainer's, ``RaySettings.trainer_node_groups``) and
nodes can be excluded (:meth:`GroupPlacer.exclude`: a node that cannot read the shared
``export_root``). Both are hard constraints where Ray takes bundle label selectors (Ray 2.47
on; every node carries the ``ray.io/node-id`` label): a pinned group's bundles select its node,
other groups' bundles select ``!in(<excluded nodes>)``, so Ray never reserves on a node it
should not, however stale its view of the nodes' free resources. An older Ray takes only the
soft hint: a reservation it makes on a node it should not is given back and asked again until
``timeout_s``, then refused.

Ray is imported when a placement is made, not when this module is imported.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from rollsafe.errors import InvalidArgument, RollsafeError

__all__ = ["GroupPlacer", "Placement", "PlacementUnavailable", "ray_node_id"]

#: the label Ray gives every node (its hex id), selected by bundle label selectors
NODE_LABEL = "ray.io/node-id"
#: pause before asking again after Ray reserved on a node it should not (an older Ray only)
_RETRY_PAUSE_S = 0.05
#: whether this Ray takes bundle label selectors (None: not asked yet)
_SELECTORS: bool | None = None


def _label_selectors() -> bool:
    """Whether this Ray's ``placement_group`` takes ``bundle_label_selector`` (hard node
    constraints); checked once per process."""
    global _SELECTORS
    if _SELECTORS is None:
        import inspect

        from ray.util.placement_group import placement_group

        _SELECTORS = "bundle_label_selector" in inspect.signature(placement_group).parameters
    return _SELECTORS


def node_selector(node: str | None, excluded: Collection[str]) -> dict[str, str] | None:
    """One bundle's label selector: ``node`` only, or any node but the ``excluded`` ones
    (None: no constraint)."""
    if node is not None:
        return {NODE_LABEL: node}
    if excluded:
        return {NODE_LABEL: "!in(" + ",".join(sorted(excluded)) + ")"}
    return None


def _constraint(n_bundles: int, node: str | None, excluded: Collection[str]) -> dict[str, Any]:
    """``placement_group`` keyword arguments holding ``n_bundles`` bundles to ``node`` or off
    the ``excluded`` nodes (none where this Ray takes no label selectors)."""
    selector = node_selector(node, excluded)
    if selector is None or not _label_selectors():
        return {}
    return {"bundle_label_selector": [dict(selector) for _ in range(n_bundles)]}


def _why_not(
    exc: BaseException, node: str | None, excluded: Collection[str], refused: list[str]
) -> str:
    """What a placement that Ray did not make in time was held to."""
    import ray

    parts = [] if isinstance(exc, ray.exceptions.GetTimeoutError) else [repr(exc)]
    if node is not None:
        parts.append(f"on node {node} only")
    elif excluded:
        parts.append(f"off the excluded {sorted(excluded)}")
    if refused:
        parts.append(f"Ray offered {refused} first")
    return "; ".join(parts)


class PlacementUnavailable(RollsafeError, RuntimeError):
    """No node of the Ray cluster had room for a group's placement within the time allowed;
    nothing stays reserved. ``group_id``, ``bundles`` (one per rank) and ``timeout_s`` say
    which group asked for what."""

    def __init__(
        self,
        group_id: str,
        bundles: list[dict[str, float]],
        timeout_s: float,
        why: str = "",
        *,
        slices: int = 1,
    ) -> None:
        self.group_id = group_id
        self.bundles = bundles
        self.timeout_s = timeout_s
        self.slices = slices
        detail = f": {why}" if why else ""
        shape = (
            "packed on one node"
            if slices == 1
            else f"one per node on {slices} distinct nodes (one per node slice)"
        )
        super().__init__(
            f"group {group_id!r}: no Ray node had room for {len(bundles)} bundle(s) of "
            f"{bundles[0] if bundles else {}} {shape} within {timeout_s:g} s{detail}"
        )


@dataclass(frozen=True)
class Placement:
    """A group's reservation: the Ray placement group ``pg`` (its bundle 0 hosts the group's
    actor; with slices, bundle ``i`` hosts slice ``i``), the ``node_id`` (hex) of bundle 0, the
    ``bundles`` reserved and ``node_ids``, the node of every slice in slice order (one entry,
    ``node_id``, for a group on one node)."""

    group_id: str
    pg: Any
    node_id: str
    bundles: tuple[Mapping[str, float], ...]
    node_ids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.node_ids:
            object.__setattr__(self, "node_ids", (self.node_id,))

    @property
    def slices(self) -> int:
        """How many node slices the group holds (1: one node)."""
        return len(self.node_ids)


class GroupPlacer:
    """Places the engine groups of one fleet (thread-safe: groups start concurrently).

    ``resources_per_rank``: Ray resources one engine rank needs (``{"CPU": 1.0}``,
    ``{"GPU": 1.0}``, a custom resource...); ``timeout_s``: how long :meth:`place` waits for
    Ray to reserve them; ``spread``: hint each group at the node holding the fewest of this
    placer's groups (False: Ray chooses); ``name_prefix``: placement groups are named
    ``{name_prefix}-{group_id}-{n}`` (visible in ``ray status`` / the dashboard)."""

    def __init__(
        self,
        resources_per_rank: Mapping[str, float] | None = None,
        *,
        timeout_s: float = 60.0,
        spread: bool = True,
        name_prefix: str = "rollsafe",
    ) -> None:
        bundle = dict(resources_per_rank if resources_per_rank is not None else {"CPU": 1.0})
        for name, amount in bundle.items():
            if not isinstance(amount, (int, float)) or isinstance(amount, bool) or amount < 0:
                raise InvalidArgument(
                    f"resources_per_rank[{name!r}]", f"must be a number >= 0, got {amount!r}"
                )
        if not any(v > 0 for v in bundle.values()):
            raise InvalidArgument(
                "resources_per_rank",
                f"needs one resource > 0 (Ray refuses empty bundles): {bundle}",
            )
        if timeout_s <= 0:
            raise InvalidArgument("timeout_s", f"must be > 0, got {timeout_s!r}")
        self.bundle = {k: float(v) for k, v in bundle.items()}
        self.timeout_s = float(timeout_s)
        self.spread = spread
        self.name_prefix = name_prefix
        self._lock = threading.Lock()
        #: group id -> the nodes of its live placement, slice order (or the hint while placing)
        self._held: dict[str, tuple[str, ...]] = {}
        #: ``apart(group_id)``: the groups ``group_id`` should not share a node with, where
        #: another node fits (a spare and the groups it covers; None: no such preference)
        self.apart: Callable[[str], Collection[str]] | None = None
        self._excluded: dict[str, str] = {}  # node id -> why no group may be placed there
        self._made = 0

    def bundles(self, ranks: int, slices: int = 1) -> list[dict[str, float]]:
        """The bundles of a group of ``ranks`` processes: one :attr:`bundle` per rank on one
        node; with ``slices`` > 1, one bundle per node slice holding its ``ranks // slices``
        ranks' resources."""
        if slices == 1:
            return [dict(self.bundle) for _ in range(ranks)]
        per_slice = ranks // slices
        return [{k: v * per_slice for k, v in self.bundle.items()} for _ in range(slices)]

    def exclude(self, node_id: str, why: str) -> None:
        """Place no group on ``node_id`` from now on (e.g. it cannot read the shared
        ``export_root``). Ray's placement groups cannot be kept off a node, so :meth:`place`
        hints each placement at an allowed node and, when Ray reserves the bundles on an
        excluded one anyway, gives them back and asks again."""
        with self._lock:
            self._excluded[str(node_id)] = why

    def excluded(self) -> dict[str, str]:
        """``{node_id: why}`` of the nodes no group is placed on."""
        with self._lock:
            return dict(self._excluded)

    def nodes(self) -> dict[str, str]:
        """``{group_id: node_id}`` of every group this placer holds a placement for (a group
        that spans nodes: its head slice's node; :meth:`slice_nodes` has them all)."""
        with self._lock:
            return {gid: nodes[0] for gid, nodes in self._held.items()}

    def slice_nodes(self) -> dict[str, tuple[str, ...]]:
        """``{group_id: (node_id, ...)}``: every node each placed group holds, slice order."""
        with self._lock:
            return dict(self._held)

    def place(
        self, group_id: str, ranks: int, *, node: str | None = None, slices: int = 1
    ) -> Placement:
        """Reserve ``ranks`` bundles packed on one node for ``group_id``, or with ``slices`` > 1
        one bundle per node slice on ``slices`` distinct nodes (``STRICT_SPREAD``: all or
        none); wait up to :attr:`timeout_s`. ``node``: that node only (a group on one node; a
        reservation Ray makes elsewhere is given back and asked again). Raises
        :class:`PlacementUnavailable` (nothing left reserved)."""
        import ray
        from ray.util.placement_group import placement_group, placement_group_table

        if isinstance(slices, bool) or not isinstance(slices, int) or slices < 1:
            raise InvalidArgument("slices", f"must be an int >= 1, got {slices!r}")
        if ranks % slices:
            raise InvalidArgument(
                "slices", f"{slices} node slices do not divide the group's {ranks} ranks"
            )
        if slices > 1 and node is not None:
            raise InvalidArgument(
                "node", f"group {group_id!r} spans {slices} nodes: it cannot be pinned to one"
            )
        if slices > 1:
            return self._place_spread(group_id, ranks, slices)
        bundles = self.bundles(ranks)
        deadline = time.monotonic() + self.timeout_s
        refused: list[str] = []  # nodes an older Ray reserved the bundles on though it should not
        while True:
            with self._lock:
                excluded = set(self._excluded)
                if node is not None:
                    target: str | None = node
                    if node in excluded:
                        raise PlacementUnavailable(
                            group_id, bundles, self.timeout_s, f"its node {node} is excluded"
                        )
                elif self.spread or excluded or self.apart is not None:
                    avoid = self.apart(group_id) if self.apart is not None else ()
                    target = self._target_node(ranks, excluded, avoid)
                else:
                    target = None
                if excluded and target is None:
                    raise PlacementUnavailable(
                        group_id,
                        bundles,
                        self.timeout_s,
                        f"no node fits but the excluded {sorted(excluded)}",
                    )
                self._made += 1
                name = f"{self.name_prefix}-{group_id}-{self._made}"
                if target is not None:
                    self._held[group_id] = (target,)  # counted while Ray places it
            hint: dict[str, Any] = {"_soft_target_node_id": target} if target is not None else {}
            hint.update(_constraint(len(bundles), node, excluded))
            pg = placement_group(bundles, strategy="STRICT_PACK", name=name, **hint)
            try:
                ray.get(pg.ready(), timeout=max(0.1, deadline - time.monotonic()))
            except Exception as exc:
                self._drop(group_id)
                with contextlib.suppress(Exception):
                    ray.util.remove_placement_group(pg)
                why = _why_not(exc, node, excluded, refused)
                raise PlacementUnavailable(group_id, bundles, self.timeout_s, why) from exc
            node_id = str(placement_group_table(pg)["bundles_to_node_id"][0])
            with self._lock:
                allowed = node_id not in self._excluded and node in (None, node_id)
                if allowed:
                    self._held[group_id] = (node_id,)
            if allowed:
                return Placement(group_id, pg, node_id, tuple(bundles))
            # an older Ray passed the hint over (or the node was excluded meanwhile): give it
            # back, ask again until the deadline
            refused.append(node_id)
            self._drop(group_id)
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(pg)
            if time.monotonic() + _RETRY_PAUSE_S >= deadline:
                want = f"node {node}" if node is not None else "a node not excluded"
                raise PlacementUnavailable(
                    group_id, bundles, self.timeout_s, f"Ray offered {refused}, not {want}"
                )
            time.sleep(_RETRY_PAUSE_S)

    def _place_spread(self, group_id: str, ranks: int, slices: int) -> Placement:
        """A group over ``slices`` nodes: one ``STRICT_SPREAD`` placement group whose bundle
        ``i`` is slice ``i``'s resources; Ray reserves every bundle, each on another node, or
        none. Ray takes no node hint for it, so the groups' spreading is Ray's; one that lands
        a slice on an excluded node is given back and asked again."""
        import ray
        from ray.util.placement_group import placement_group, placement_group_table

        bundles = self.bundles(ranks, slices)
        deadline = time.monotonic() + self.timeout_s
        refused: list[str] = []
        while True:
            with self._lock:
                self._made += 1
                name = f"{self.name_prefix}-{group_id}-{self._made}"
                excluded = set(self._excluded)
            hint = _constraint(len(bundles), None, excluded)
            pg = placement_group(bundles, strategy="STRICT_SPREAD", name=name, **hint)
            try:
                ray.get(pg.ready(), timeout=max(0.1, deadline - time.monotonic()))
            except Exception as exc:
                with contextlib.suppress(Exception):
                    ray.util.remove_placement_group(pg)
                why = _why_not(exc, None, excluded, refused)
                raise PlacementUnavailable(
                    group_id, bundles, self.timeout_s, why, slices=slices
                ) from exc
            table = placement_group_table(pg)["bundles_to_node_id"]
            node_ids = tuple(str(table[i]) for i in range(slices))
            with self._lock:
                bad = [n for n in node_ids if n in self._excluded]
                if not bad:
                    self._held[group_id] = node_ids
            if not bad:
                return Placement(group_id, pg, node_ids[0], tuple(bundles), node_ids)
            refused.extend(bad)
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(pg)
            if time.monotonic() + _RETRY_PAUSE_S >= deadline:
                raise PlacementUnavailable(
                    group_id,
                    bundles,
                    self.timeout_s,
                    f"Ray offered the excluded {sorted(set(refused))}",
                    slices=slices,
                )
            time.sleep(_RETRY_PAUSE_S)

    def release(self, placement: Placement) -> None:
        """Give the reservation back to Ray (idempotent; a dead node's is already gone)."""
        import ray

        self._drop(placement.group_id)
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(placement.pg)

    def _drop(self, group_id: str) -> None:
        with self._lock:
            self._held.pop(group_id, None)

    def _target_node(
        self, ranks: int, excluded: set[str] | None = None, avoid: Collection[str] = ()
    ) -> str | None:
        """The alive node (not ``excluded``) whose total resources fit the group and that holds
        the fewest of the ``avoid`` groups, then the fewest of this placer's groups (ties: Ray's
        node order); None when no node fits (Ray decides)."""
        import ray

        api: Any = ray  # ray.nodes() is untyped
        load = Counter(n for nodes in self._held.values() for n in nodes)
        shunned = Counter(n for g in avoid if g in self._held for n in self._held[g])
        best: tuple[int, int, int, str] | None = None
        for order, node in enumerate(api.nodes()):
            if not node.get("Alive") or str(node["NodeID"]) in (excluded or ()):
                continue
            total: Mapping[str, float] = node.get("Resources", {})
            if any(total.get(k, 0.0) < v * ranks for k, v in self.bundle.items()):
                continue
            node_id = str(node["NodeID"])
            key = (shunned[node_id], load[node_id], order, node_id)
            if best is None or key < best:
                best = key
        return None if best is None else best[3]


def ray_node_id() -> str:
    """The id (hex) of the Ray node this process runs on."""
    import ray

    return str(ray.get_runtime_context().get_node_id())
