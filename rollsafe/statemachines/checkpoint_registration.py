"""CheckpointRegistration: staging one weights version in a transport and pushing it to targets.

Uniform for every transport that stages weights (checkpoint-engine registers pinned host shards;
ipc/nccl record the source and bucketing plan). A (name, version) is published only after a
register in which every rank succeeded with exact key coverage; an update only ever targets the
published checkpoint.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from statemachine import State
from statemachine.exceptions import TransitionNotAllowed

from rollsafe.errors import InvalidArgument
from rollsafe.statemachines.base import GuardedMachine, GuardInputMissing

__all__ = ["CheckpointRegistration"]


class CheckpointRegistration(GuardedMachine):
    """Registration of the weights a transport serves, one machine per transport.

    States: ``empty`` (initial), ``registering`` (the previous checkpoint is unregistered first to
    bound pinned memory: nothing is published while registering), ``registered`` (published),
    ``updating`` (pushing the published checkpoint to targets), ``failed`` (last register failed;
    nothing published).

    Guards: ``register_ok(ranks_ok=, expected_keys=, registered_keys=)`` needs every rank of
    ``range(world_size)``, no registered key outside the expected set, and every missing expected
    key under an allowed prefix (``mtp.`` by default); ``begin_update(targets=)`` takes a list of
    rank lists, refused when empty, when a group is empty, a rank is out of range or named twice;
    ``begin_register(name=, version=)`` refuses a version older than the one last published.

    Invariants: ``published`` is ``(name, version)`` only in ``registered``/``updating`` and only
    after a successful register; no update targets an unpublished checkpoint.
    """

    empty = State("Empty", initial=True)
    registering = State("Registering")
    registered = State("Registered")
    updating = State("Updating")
    failed = State("Failed")

    begin_register = (
        empty.to(registering, cond="version_not_older", validators="version_given")
        | registered.to(registering, cond="version_not_older", validators="version_given")
        | failed.to(registering, cond="version_not_older", validators="version_given")
    )
    register_ok = registering.to(
        registered,
        cond=["every_rank_registered", "key_coverage_exact"],
        validators="register_report_given",
    )
    register_failed = registering.to(failed)
    begin_update = registered.to(updating, cond="targets_valid", validators="targets_given")
    update_done = updating.to(registered)

    def __init__(self, world_size: int, allow_missing_prefixes: Iterable[str] = ("mtp.",)) -> None:
        if world_size < 1:
            raise InvalidArgument(
                "world_size", f"CheckpointRegistration world_size must be >= 1, got {world_size}"
            )
        self.world_size = world_size
        self.allow_missing_prefixes: tuple[str, ...] = tuple(allow_missing_prefixes)
        self.pending: tuple[str, int] | None = None
        self.last_published_version: int | None = None
        self.failure_reason: str | None = None
        self.current_targets: tuple[tuple[int, ...], ...] = ()
        self.last_results: dict[int, tuple[bool, str]] = {}
        self._published: tuple[str, int] | None = None
        super().__init__()

    @property
    def published(self) -> tuple[str, int] | None:
        """``(name, version)`` published in ``registered``/``updating``; None otherwise."""
        if self.current_state_value in ("registered", "updating"):
            return self._published
        return None

    def restore_published(
        self,
        published: tuple[str, int] | None,
        pending: tuple[str, int] | None,
        last_published_version: int | None,
    ) -> None:
        """Set what is published, pending and last published (model checking only; the state
        is set with ``restore_state``)."""
        with self._lock:
            self._published, self.pending = published, pending
            self.last_published_version = last_published_version

    @property
    def failed_targets(self) -> list[int]:
        """Ranks whose last update failed (for the fleet to act on)."""
        return sorted(r for r, (ok, _) in self.last_results.items() if not ok)

    def facts_token(self) -> Any:
        return self._published

    def facts_from_token(self, token: Any) -> dict[str, Any]:
        return {"world_size": self.world_size, "published": token}

    # ------------------------------------------------------------------ validators
    def version_given(self, version: int | None = None) -> None:
        """``begin_register`` needs ``name=`` and ``version=``."""
        if version is None:
            raise GuardInputMissing(f"{self.label}: begin_register needs name= and version=")

    def register_report_given(
        self,
        ranks_ok: Collection[int] | None = None,
        expected_keys: Collection[str] | None = None,
        registered_keys: Collection[str] | None = None,
    ) -> None:
        """``register_ok`` needs what the ranks reported."""
        if ranks_ok is None:
            raise GuardInputMissing(f"{self.label}: register_ok needs ranks_ok=")
        if expected_keys is None or registered_keys is None:
            raise GuardInputMissing(
                f"{self.label}: register_ok needs expected_keys= and registered_keys="
            )

    def targets_given(self, targets: Sequence[Sequence[int]] | None = None) -> None:
        """``begin_update`` needs ``targets=``."""
        if targets is None:
            raise GuardInputMissing(f"{self.label}: begin_update needs targets=")

    # ------------------------------------------------------------------ guards
    def version_not_older(self, version: int | None = None) -> bool:
        """The version to register is not older than the last published one."""
        if version is None:
            return False
        last = self.last_published_version
        return last is None or version >= last

    def every_rank_registered(self, ranks_ok: Collection[int] | None = None) -> bool:
        """Every rank in range(world_size) registered its shard."""
        if ranks_ok is None:
            return False
        return set(ranks_ok) == set(range(self.world_size))

    def key_coverage_exact(
        self,
        expected_keys: Collection[str] | None = None,
        registered_keys: Collection[str] | None = None,
    ) -> bool:
        """No extra key, and every missing key starts with an allowed prefix."""
        if expected_keys is None or registered_keys is None:
            return False
        expected, got = set(expected_keys), set(registered_keys)
        if got - expected:
            return False
        return all(k.startswith(self.allow_missing_prefixes) for k in expected - got)

    def targets_valid(self, targets: Sequence[Sequence[int]] | None = None) -> bool:
        """Non-empty list of non-empty rank lists, each rank in range, none named twice."""
        if targets is None:
            return False
        if isinstance(targets, (str, bytes)) or len(targets) == 0:
            return False
        seen: set[int] = set()
        for group in targets:
            if isinstance(group, (str, bytes)) or len(group) == 0:
                return False
            for rank in group:
                if isinstance(rank, bool) or not isinstance(rank, int):
                    return False
                if not 0 <= rank < self.world_size or rank in seen:
                    return False
                seen.add(rank)
        return True

    # ------------------------------------------------------------------ the register protocol
    def finish_register(
        self,
        *,
        ranks_ok: Collection[int],
        expected_keys: Collection[str],
        registered_keys: Collection[str],
    ) -> str | None:
        """End a register begun with ``begin_register``: ``register_ok`` with what the ranks
        reported, or ``register_failed`` when the guards refuse it. Returns None when the
        checkpoint is published, else why not (the refusal's text). Every transport ends its
        register this way, and so does ``rollsafe verify``.
        """
        try:
            self.register_ok(
                ranks_ok=ranks_ok, expected_keys=expected_keys, registered_keys=registered_keys
            )
        except TransitionNotAllowed as exc:
            reason = str(exc)
            self.register_failed(reason=reason[:2048])
            return reason
        return None

    # ------------------------------------------------------------------ actions
    def on_begin_register(self, name: str = "", version: int | None = None) -> None:
        if not name:
            raise InvalidArgument("name", f"{self.label}: begin_register needs a non-empty name=")
        # The previous checkpoint is unregistered first (bounded pinned memory): unpublish now.
        self._published = None
        self.pending = (name, int(version if version is not None else -1))
        self.failure_reason = None

    def on_register_ok(self) -> None:
        assert self.pending is not None
        self._published = self.pending
        self.last_published_version = self.pending[1]
        self.pending = None

    def on_register_failed(self, reason: str = "unspecified") -> None:
        self.pending = None
        self._published = None
        self.failure_reason = reason

    def on_begin_update(self, targets: Sequence[Sequence[int]] = ()) -> None:
        self.current_targets = tuple(tuple(g) for g in targets)
        self.last_results = {}

    def on_update_done(self, results: Mapping[int, Any] | None = None) -> None:
        recorded: dict[int, tuple[bool, str]] = {}
        for rank, outcome in (results or {}).items():
            if isinstance(outcome, tuple):
                ok, reason = bool(outcome[0]), str(outcome[1]) if len(outcome) > 1 else ""
            else:
                ok, reason = bool(outcome), ""
            recorded[int(rank)] = (ok, reason[:512])
        self.last_results = recorded
        self.current_targets = ()
