"""``VLLMClient``: the :class:`EngineClient` protocol mapped onto vLLM's HTTP endpoints.

It speaks vLLM 0.33.0, 0.32.0 and 0.26.0, picked from the server's ``GET /version`` (or pinned
with ``server_version=``); what differs and how 0.26 and 0.32 are made to look like 0.33 (the
weight version from ``/weight_info``, or kept by this client on 0.26; generates refused while
this client has the engine paused; packing sent where 0.26 reads it) is
:mod:`rollsafe.adapters.engines.vllm_dialect`.

=============================================  ==========================================
EngineClient call                              vLLM endpoint
=============================================  ==========================================
health                                         GET ``/health``
generate                                       POST ``/v1/completions`` (token-id prompt,
                                               ``return_weight_versions``)
pause_generation / continue_generation         POST ``/pause?mode=`` / ``/resume``
flush_cache                                    POST ``/reset_prefix_cache``
release / resume_memory_occupation             POST ``/sleep?level=1`` (``level=``: 0-2)
                                               / ``/wake_up?tags=``
init_weights_update_group                      POST ``/init_weight_transfer_engine``
                                               ``{init_info}`` (packing fixed here; 0.26:
                                               sent in every ``update_info``)
update_weights_from_distributed                ``/start_weight_update`` (first call of a
                                               version), ``/update_weights`` {update_info},
                                               ``/finish_weight_update`` {weight_version}
                                               (the call that carries the version; 0.26: no
                                               body, the client keeps the version)
update_weights_from_disk                       POST ``/collective_rpc`` ``reload_weights``
                                               {weights_path}, ``/update_weight_version``
update_weights_from_ipc                        POST ``/collective_rpc``
                                               ``update_weights_from_ipc`` {zmq_handles}
                                               (checkpoint-engine's worker extension)
update_weights_from_tensor                     not supported (raises EngineNotSupported)
destroy_weights_update_group                   POST ``/shutdown_weight_transfer_engine``
                                               (0.26: none, nothing sent)
weights_checksum                               POST ``/weight_checker`` {action: checksum}
                                               (0.26: none, raises NoWeightChecker: use
                                               ``rollsafe.probe``)
weight_version / update_weight_version         GET ``/weight_info`` / POST
                                               ``/update_weight_version`` (0.26: the label
                                               this client keeps, nothing sent)
=============================================  ==========================================

A weight update (``update_weights_from_distributed``, ``_from_disk``, ``_from_ipc``) while this
client has the engine's weights asleep (``/sleep`` level >= 1, not woken) raises
:class:`~rollsafe.adapters.engines.errors.EngineAsleep` before anything is sent: vLLM 0.26.0
crashes on it (vllm#57853), and no release can load weights it has offloaded or discarded.

The sleep/wake, collective-RPC and weight-transfer routes exist on a real vLLM only in dev mode
(``VLLM_SERVER_DEV_MODE=1``, plus ``--enable-sleep-mode`` and ``--weight-transfer-config``).
SGLang-style sampling parameters are translated (``max_new_tokens`` -> ``max_tokens``,
``min_new_tokens`` -> ``min_tokens``, ``sampling_seed`` -> ``seed``). Request bodies follow the
contracts (``rollsafe/adapters/engines/contracts/vllm-{0.26.0,0.32.0,0.33.0}.json``; checked
by ``tests/test_client_contracts.py``).

vLLM has one weight-transfer group per engine and no group names (``init_info`` has none), so
the three group calls take only ``group_name=VLLM_WEIGHT_TRANSFER_GROUP`` (their default; the
name both ends of rollsafe's rendezvous join under, :mod:`rollsafe.wire.group_names`) and
refuse any other with :class:`EngineNotSupported` before sending anything: a trainer that
joined under a name of its own would never meet the engine.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import httpx

from rollsafe.adapters.engines.base import (
    DEFAULT_HEALTH_TIMEOUT,
    DEFAULT_WEIGHTS_TIMEOUT,
    HttpEngineClient,
)
from rollsafe.adapters.engines.contract import (
    PINNED_VERSIONS,
    UnsupportedVersion,
    contract_version_for,
)
from rollsafe.adapters.engines.errors import (
    EngineAsleep,
    EngineError,
    EngineNotSupported,
    EngineOperationFailed,
    EngineRequestError,
    NoWeightChecker,
)
from rollsafe.adapters.engines.http import RetryPolicy
from rollsafe.adapters.engines.streaming import StreamDelta, WeightSpan, stream_deltas
from rollsafe.adapters.engines.vllm_dialect import (
    Mark,
    PauseLedger,
    Start,
    VersionSteps,
    VLLMDialect,
    read_version_holds,
    run_steps,
)
from rollsafe.errors import InvalidArgument
from rollsafe.ports import Dialect, GenerateResult, MemoryTag, PauseMode, WeightsChecksum
from rollsafe.wire.group_names import VLLM_WEIGHT_TRANSFER_GROUP

#: vLLM's completion route (token-id or text prompts; streamed with ``stream: true``)
COMPLETIONS_PATH = "/v1/completions"

_SAMPLING_RENAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "sampling_seed": "seed",
}
#: SGLang pause modes -> vLLM ``/pause`` modes.
_PAUSE_MODES = {"abort": "abort", "in_place": "keep", "retract": "wait"}


def to_vllm_sampling(sampling_params: Mapping[str, Any] | None) -> dict[str, Any]:
    """Translate SGLang-style sampling parameters into OpenAI/vLLM completion fields
    (``return_logprob: true`` asks for the sampled tokens' logprobs: ``logprobs: 0``)."""
    out: dict[str, Any] = {}
    return_logprob = False
    for key, value in (sampling_params or {}).items():
        if key == "return_logprob":
            return_logprob = bool(value)
            continue
        out[_SAMPLING_RENAMES.get(key, key)] = value
    if return_logprob:
        out.setdefault("logprobs", 0)
    return out


class VLLMClient(HttpEngineClient):
    """Drive one vLLM(-compatible) engine over HTTP with the SGLang-shaped protocol."""

    _dialect: Dialect = "vllm"

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        model: str | None = None,
        timeout: float = 60.0,
        health_timeout: float = DEFAULT_HEALTH_TIMEOUT,
        weights_timeout: float = DEFAULT_WEIGHTS_TIMEOUT,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
        server_version: str | None = None,
    ) -> None:
        super().__init__(
            url,
            api_key=api_key,
            timeout=timeout,
            health_timeout=health_timeout,
            weights_timeout=weights_timeout,
            retry=retry,
            transport=transport,
        )
        #: served model name sent as ``model`` in completions (omitted when None)
        self.model = model
        # one weight update (start .. finish) per version, possibly over many calls
        self._update_lock = threading.Lock()
        self._update_open = False
        # the server's dialect: pinned here, else asked once (GET /version) on first need
        self._dialect_lock = threading.Lock()
        self._server_dialect: VLLMDialect | None = None
        if server_version is not None:
            try:
                pinned = contract_version_for("vllm", server_version)
            except UnsupportedVersion as exc:
                raise UnsupportedVersion(f"VLLMClient(server_version=...): {exc}") from None
            self._server_dialect = VLLMDialect.of(pinned)
        self._ledger = PauseLedger()
        # vLLM 0.26.0 has no weight version: the label this client keeps (None: unknown)
        self._label: str | None = None
        # NCCL packing for every /update_weights on 0.26 (its init_info takes none)
        self._packing: dict[str, Any] = {}
        # the /sleep level this client put the weights in (0: awake, or only paused)
        self._asleep_level = 0

    # -- dialect --------------------------------------------------------------------------
    @property
    def known_dialect(self) -> VLLMDialect | None:
        """The release this server speaks when already known (pinned, or asked once by
        :meth:`server_dialect`); None before: reading it needs a request."""
        return self._server_dialect

    def server_dialect(self, *, timeout: float | None = None) -> VLLMDialect:
        """The vLLM release this server speaks: pinned by ``server_version=``, else asked once
        with ``GET /version`` (retried) and cached. A server without ``/version`` (404: the
        reference engine) speaks the pinned release (0.33.0); one older than every supported
        release is :class:`EngineNotSupported`."""
        dialect = self._server_dialect
        if dialect is not None:
            return dialect
        with self._dialect_lock:
            if self._server_dialect is not None:
                return self._server_dialect
            try:
                answer = self._get("/version", timeout=timeout)
            except EngineRequestError as exc:
                if exc.status_code != 404:
                    raise
                answer = None
            reported = answer.get("version") if isinstance(answer, Mapping) else None
            if reported is None:
                dialect = VLLMDialect.of(PINNED_VERSIONS["vllm"])
            else:
                try:
                    version = contract_version_for("vllm", str(reported))
                except UnsupportedVersion as exc:
                    raise EngineNotSupported(
                        "vllm",
                        f"a server reporting version {reported!r}",
                        f"{exc}; pin VLLMClient(server_version=...) to speak one of them",
                    ) from None
                dialect = VLLMDialect.of(version, str(reported))
            self._server_dialect = dialect
            return dialect

    def refuse_while_paused(self, path: str, dialect: VLLMDialect) -> None:
        """On a server that queues new requests while paused (0.32), refuse a generate while
        this client has it paused in ``abort``/``wait``, as 0.33 does with its 503."""
        mode = self._ledger.refusing_mode()
        if mode is not None and dialect.pause_queues_new_requests:
            raise EngineRequestError(
                self.url,
                path,
                503,
                f"generation is paused by this client (mode={mode}); retry after /resume "
                f"(refused here: vLLM {dialect.version} would queue the request until /resume, "
                "vLLM 0.33 answers 503 engine_paused)",
            )

    def version_before(
        self, path: str, dialect: VLLMDialect
    ) -> VersionSteps[tuple[Mark, str | None]]:
        """Steps: refuse while paused, then the version: the one remembered for the ledger's
        steady stretch (no I/O), else read (yield) with no pause, resume or weight change of
        this client around the read (re-read if one happened, up to 3 times). Returns the
        ledger's mark before the read and the version."""
        version: str | None = None
        for _ in range(3):
            self.refuse_while_paused(path, dialect)
            start = self._start()
            if start.known:
                return start.mark, start.version
            version = yield
            self.refuse_while_paused(path, dialect)
            if self._ledger.mark() == start.mark:
                self._learned(start, version)
                return start.mark, version
        return Mark(-1, -1, -1, False), version  # kept changing: compare again after

    def mark_beside(self, path: str, dialect: VLLMDialect) -> Start:
        """The start of a request whose version is read *beside* it, not before it (the async
        engine sends the read and the request together): refuse while paused, then the
        ledger's start. Where it holds a remembered version (``known``) no read is needed;
        else the read counts as one made before the request, for :meth:`version_after` and
        :meth:`read_delta`, only where the ledger still shows the start's mark once the read
        is in (:meth:`read_beside_holds`)."""
        self.refuse_while_paused(path, dialect)
        return self._start()

    def read_beside_holds(self, start: Start, version: str | None) -> bool:
        """Whether ``version``, read beside a request (see :meth:`mark_beside`), stands for
        the one before it: no pause, resume or weight change of this client between the
        request's start and the read's answer, so the version held from the start until the
        read, which is when the request was sent or earlier, or the request was sent after
        the read and :meth:`version_after`'s comparison covers it as it covers a request
        sent after a sequential read. A read that holds is remembered for its stretch."""
        if self._ledger.mark() != start.mark:
            return False
        self._learned(start, version)
        return True

    def forget_version(self) -> None:
        """Read the version again at the next request: call after the engine's weights or
        label were changed by something other than this client (see :mod:`.vllm_dialect`,
        *Remembered versions*)."""
        self._ledger.forget()

    def _start(self) -> Start:
        start = self._ledger.start()
        if self._update_open:  # between the calls of one update: nothing is steady
            return Start(start.mark, None)
        return start

    def _learned(self, start: Start, version: str | None) -> None:
        dialect = self._server_dialect  # 0.26's label is this client's own: nothing to save
        if dialect is not None and dialect.weight_version_routes and not self._update_open:
            self._ledger.learned(start.steady, version)

    def version_after(
        self, before: Mark, version: str | None, finish_reason: str | None
    ) -> VersionSteps[tuple[str | None, bool]]:
        """Steps: the version that produced an answer (see :mod:`.vllm_dialect`; read again,
        yield, only when the ledger moved) and whether it is exact."""
        if read_version_holds(before, self._ledger.mark()):
            return version, True
        after = yield
        if after == version:
            return version, True
        return (version if finish_reason == "abort" else after), False

    # -- versions and checks ---------------------------------------------------------------
    def weight_version(self, *, timeout: float | None = None) -> str | None:
        """The weights version: ``GET /weight_info`` (retried), or on a release without it
        (0.26) the label this client keeps (set by the update that carried a version or by
        :meth:`update_weight_version`; None until then and after a failed update)."""
        if self.server_dialect(timeout=timeout).weight_version_routes:
            return super().weight_version(timeout=timeout)
        return self._label

    def weights_checksum(self, *, timeout: float | None = None) -> WeightsChecksum:
        """``POST /weight_checker {action: checksum}``; on a release without it (0.26)
        :class:`~rollsafe.adapters.engines.errors.NoWeightChecker` (an
        :class:`EngineNotSupported`), nothing sent: check those weights with the behavioural
        probe (:mod:`rollsafe.probe`)."""
        dialect = self.server_dialect(timeout=timeout)
        if not dialect.weight_checker:
            raise NoWeightChecker("vllm", dialect.version)
        return super().weights_checksum(timeout=timeout)

    def _refuse_while_asleep(self, operation: str) -> None:
        level = self._asleep_level
        if level >= 1:
            raise EngineAsleep(self.url, operation, level)

    # -- liveness and serving -------------------------------------------------------------
    def health(self, *, timeout: float | None = None, retry: bool = True) -> None:
        """GET ``/health`` (retried unless ``retry=False``: then exactly one request); raises
        unless it answers 2xx."""
        limit = self.health_timeout if timeout is None else timeout
        self._get("/health", timeout=limit, idempotent=retry, retries=retry)

    def generate(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> GenerateResult:
        """POST ``/v1/completions`` once (never retried) and return the first choice.

        vLLM 0.33 reports the serving weights only when asked (``return_weight_versions``): as
        spans ``[{version, start, end}]`` over the generated tokens; ``weight_version`` is the
        last span's version (the one that produced the final token). vLLM 0.32 reports none:
        the version comes from ``GET /weight_info`` (read before the completion, checked after
        it, :mod:`.vllm_dialect`), and ``meta_info`` says ``weight_version_source:
        "weight_info"`` and ``weight_version_exact``; on 0.26 it is this client's label
        (``weight_version_source: "client"``)."""
        path = COMPLETIONS_PATH
        dialect = self.server_dialect()
        body = self.completion_body(input_ids, text, sampling_params, dialect)
        before: Mark | None = None
        read: str | None = None
        if not dialect.completion_weight_versions:
            before, read = run_steps(self.version_before(path, dialect), self.weight_version)
        result = completion_result(self.url, self._post(path, body, timeout=timeout))
        if before is not None and "weight_versions" not in result.meta_info:
            steps = self.version_after(before, read, result.finish_reason)
            version, exact = run_steps(steps, self.weight_version)
            result = with_read_version(result, version, exact, dialect)
        return result

    def completion_body(
        self,
        input_ids: Sequence[int] | None,
        text: str | None,
        sampling_params: Mapping[str, Any] | None,
        dialect: VLLMDialect,
    ) -> dict[str, Any]:
        """The ``/v1/completions`` body of one prompt for a server speaking ``dialect``
        (sampling translated, token ids asked for, this client's ``model``)."""
        if (input_ids is None) == (text is None):
            raise InvalidArgument("input_ids", "generate needs exactly one of input_ids or text")
        body: dict[str, Any] = to_vllm_sampling(sampling_params)
        body["prompt"] = [int(t) for t in input_ids] if input_ids is not None else text
        body.setdefault("return_token_ids", True)
        # text without special tokens on every release (0.33's default follows the model's
        # generation config), as SGLang and the reference engine decode it
        body.setdefault("skip_special_tokens", True)
        if dialect.completion_weight_versions:
            body.setdefault("return_weight_versions", True)
        if self.model is not None:
            body.setdefault("model", self.model)
        return body

    def generate_stream(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Iterator[StreamDelta]:
        """POST ``/v1/completions`` with ``stream: true`` once (``return_token_ids``, so each
        event carries its token ids); yield each event's new tokens. ``timeout`` bounds each
        wait for an event. On vLLM 0.32 the last event's version comes from ``/weight_info``
        as in :meth:`generate` (a span over the whole output when exact)."""
        path = COMPLETIONS_PATH
        dialect = self.server_dialect()
        body = self.completion_body(input_ids, text, sampling_params, dialect)
        body["stream"] = True
        if dialect.completion_weight_versions:
            return stream_deltas(self._http, path, body, timeout, "vllm")
        before, read = run_steps(self.version_before(path, dialect), self.weight_version)
        return self._stream_with_version(body, timeout, before, read, dialect)

    def _stream_with_version(
        self,
        body: dict[str, Any],
        timeout: float | None,
        before: Mark,
        read: str | None,
        dialect: VLLMDialect,
    ) -> Iterator[StreamDelta]:
        produced = 0
        for delta in stream_deltas(self._http, COMPLETIONS_PATH, body, timeout, "vllm"):
            produced += len(delta.token_ids)
            if delta.finished and delta.weight_version is None:
                steps = self.version_after(before, read, delta.finish_reason)
                version, exact = run_steps(steps, self.weight_version)
                delta = with_read_version_delta(delta, produced, version, exact, dialect)
            else:
                delta = self.read_delta(delta, before, read)
            yield delta

    def read_delta(self, delta: StreamDelta, before: Mark, read: str | None) -> StreamDelta:
        """A delta before the last of a stream from a server that reports no version (0.26,
        0.32), labelled as it is read: while the version read before the request still holds
        (:func:`read_version_holds`: no resume or unpaused weight change of this client since),
        its tokens came from ``read``. Read after one, they may have waited in a buffer since
        before the pause or come from the new weights: which weights produced them cannot be
        told, and the delta says so (``weight_version_exact: False``, no version; the fleet's
        continuation keeps none of them, :mod:`rollsafe.fleet.continuation`)."""
        if not delta.token_ids:
            return delta
        if read_version_holds(before, self._ledger.mark()):
            return delta if read is None else replace(delta, weight_version=read)
        meta = {**delta.meta, "weight_version_exact": False}
        return replace(delta, weight_version=None, meta=meta)

    def pause_generation(self, mode: PauseMode = "abort", *, timeout: float | None = None) -> None:
        """POST ``/pause?mode=`` (``abort`` -> abort, ``in_place`` -> keep, ``retract`` -> wait).

        On vLLM 0.32, which queues new requests while paused, this client refuses its own
        generates from now until :meth:`continue_generation` in ``abort``/``retract`` mode with
        the 503 :class:`EngineRequestError` that 0.33 answers (``in_place`` queues on both)."""
        if mode not in _PAUSE_MODES:
            raise InvalidArgument(
                "mode", f"pause mode must be one of {sorted(_PAUSE_MODES)}, got {mode!r}"
            )
        self._ledger.pausing(_PAUSE_MODES[mode])
        try:
            answer = self._post("/pause", params={"mode": _PAUSE_MODES[mode]}, timeout=timeout)
            self._checked("/pause", answer)
        except BaseException:
            self._ledger.resumed()  # not paused: stop refusing
            raise

    def continue_generation(self, *, timeout: float | None = None) -> None:
        """POST ``/resume`` (this client stops refusing generates whatever it answers)."""
        try:
            self._checked("/resume", self._post("/resume", timeout=timeout))
        finally:
            self._ledger.resumed()

    def flush_cache(self, *, timeout: float | None = None) -> None:
        """POST ``/reset_prefix_cache``."""
        self._checked("/reset_prefix_cache", self._post("/reset_prefix_cache", timeout=timeout))

    def is_sleeping(self, *, timeout: float | None = None) -> bool:
        """GET ``/is_sleeping`` (retried)."""
        answer = self._get("/is_sleeping", timeout=timeout)
        return bool(answer.get("is_sleeping")) if isinstance(answer, Mapping) else bool(answer)

    # -- memory ---------------------------------------------------------------------------
    def release_memory_occupation(
        self,
        tags: Sequence[MemoryTag] | None = None,
        *,
        timeout: float | None = None,
        level: int = 1,
    ) -> None:
        """POST ``/sleep?level=`` (default 1): level 1 offloads the weights to host memory and
        drops the KV cache, level 2 discards both (the weights must be loaded again after
        waking), level 0 only pauses scheduling. vLLM releases weights and KV cache together,
        so ``tags`` can only be None or both tags. From level 1 on, this client refuses weight
        updates (:class:`~rollsafe.adapters.engines.errors.EngineAsleep`) until the weights are
        woken (:meth:`resume_memory_occupation`)."""
        if tags is not None and set(tags) != {"weights", "kv_cache"}:
            raise EngineNotSupported(
                "vllm",
                f"release_memory_occupation(tags={list(tags)})",
                "vLLM's /sleep releases weights and KV cache together",
            )
        dialect = self.server_dialect(timeout=timeout)
        if isinstance(level, bool) or not isinstance(level, int):
            raise InvalidArgument("level", f"sleep level must be an int, got {level!r}")
        if level not in dialect.sleep_levels:
            raise InvalidArgument(
                "level",
                f"vLLM {dialect.version} sleeps at levels {list(dialect.sleep_levels)}, "
                f"got {level}",
            )
        if level >= 1:
            # from here on the weights may be gone, whatever /sleep answers
            self._asleep_level = max(self._asleep_level, level)
        self._checked(
            "/sleep",
            self._post("/sleep", params={"level": level}, timeout=self._weights_timeout(timeout)),
        )

    def resume_memory_occupation(
        self, tags: Sequence[MemoryTag] | None = None, *, timeout: float | None = None
    ) -> None:
        """POST ``/wake_up?tags=...`` (all when ``tags`` is None). Once it answered 2xx with
        the weights among the tags, weight updates go through again (after level 2 the
        weights woken are uninitialised: load some before serving)."""
        params = None if tags is None else {"tags": list(tags)}
        self._checked(
            "/wake_up",
            self._post("/wake_up", params=params, timeout=self._weights_timeout(timeout)),
        )
        if tags is None or "weights" in tags:
            self._asleep_level = 0

    @property
    def asleep_level(self) -> int:
        """The ``/sleep`` level this client put the engine's weights in and has not woken
        them from (0: awake as far as this client knows)."""
        return self._asleep_level

    # -- weights --------------------------------------------------------------------------
    def collective_rpc(
        self,
        method: str,
        *,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        rpc_timeout: float | None = None,
        timeout: float | None = None,
    ) -> Any:
        """POST ``/collective_rpc`` {method, args, kwargs, timeout}; return ``results``."""
        if method in _WEIGHT_RPCS:
            self._refuse_while_asleep(f"collective_rpc {method}")
        body: dict[str, Any] = {"method": method, "args": list(args), "kwargs": dict(kwargs or {})}
        if rpc_timeout is not None:
            body["timeout"] = rpc_timeout
        with self._ledger.changing_weights():  # reload_weights, update_weights_from_ipc, ...
            answer = self._post("/collective_rpc", body, timeout=self._weights_timeout(timeout))
        self._checked("/collective_rpc", answer)
        return answer.get("results") if isinstance(answer, Mapping) else answer

    def _rpc_message(self, method: str, kwargs: Mapping[str, Any], timeout: float | None) -> str:
        results = self.collective_rpc(method, kwargs=kwargs, timeout=timeout)
        if isinstance(results, list):
            for item in results:
                if isinstance(item, Mapping) and item.get("success") is False:
                    raise EngineOperationFailed(
                        self.url, f"/collective_rpc:{method}", 200, str(item.get("message", ""))
                    )
        return "" if results is None else str(results)

    def get_weights_by_name(
        self, name: str, *, truncate_size: int = 100, timeout: float | None = None
    ) -> Any:
        """Not available: vLLM has no endpoint that returns a parameter's values."""
        raise EngineNotSupported("vllm", "get_weights_by_name", "use weights_checksum()")

    def update_weight_version(self, new_version: str, *, timeout: float | None = None) -> None:
        """POST ``/update_weight_version`` {new_version}: the label the engine reports. On a
        release without it (0.26) the label this client keeps and reports: nothing sent."""
        with self._ledger.changing_weights():
            if not self.server_dialect(timeout=timeout).weight_version_routes:
                self._label = str(new_version)
                return
            self._post_checked(
                "/update_weight_version",
                {"new_version": str(new_version)},
                timeout=self._weights_timeout(timeout),
            )

    def update_weights_from_disk(
        self,
        model_path: str,
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        timeout: float | None = None,
    ) -> str:
        """``/collective_rpc`` method ``reload_weights`` {weights_path}, then
        ``/update_weight_version`` when ``weight_version`` is given.

        vLLM's ``reload_weights(weights_path=...)`` reloads in place in the server's own load
        format, so ``load_format`` must be None; ``abort_all_requests`` pauses (abort) around the
        reload, then resumes.
        """
        if load_format is not None:
            raise EngineNotSupported(
                "vllm",
                f"update_weights_from_disk(load_format={load_format!r})",
                "vLLM's reload_weights uses the load format the server was started with",
            )
        kwargs = {"weights_path": str(model_path)}
        self._refuse_while_asleep("update_weights_from_disk")
        if abort_all_requests:
            self.pause_generation("abort", timeout=timeout)
        try:
            self._forget_label()
            message = self._rpc_message("reload_weights", kwargs, timeout)
            if weight_version is not None:
                self.update_weight_version(weight_version, timeout=timeout)
        finally:
            if abort_all_requests:
                self.continue_generation(timeout=timeout)
        return message

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
        timeout: float | None = None,
        finite_checked: bool = False,
    ) -> str:
        """Not available: vLLM 0.33.0 has no ``update_weights_from_tensor``.

        Its own colocated path is the ``ipc`` weight-transfer backend (CUDA IPC handles keyed
        by GPU UUID through ``/update_weights``), a different payload; use the ``nccl``
        transport with vLLM, or an SGLang engine for ``ipc``."""
        raise EngineNotSupported(
            "vllm",
            "update_weights_from_tensor",
            "vLLM 0.33.0 has no such endpoint; use the nccl transport (native weight transfer)",
        )

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = VLLM_WEIGHT_TRANSFER_GROUP,
        backend: str = "nccl",
        timeout: float | None = None,
        packed: bool = True,
        packed_buffer_size_bytes: int | None = None,
        packed_num_buffers: int | None = None,
        keep_delta_base: bool = False,
    ) -> str:
        """POST ``/init_weight_transfer_engine`` {init_info}; blocks until the trainer joins.

        vLLM has one weight-transfer group whose backend is fixed at server start
        (``--weight-transfer-config``), so ``group_name`` and ``backend`` are not sent: the
        trainer joins under :data:`VLLM_WEIGHT_TRANSFER_GROUP` (any other ``group_name`` is
        refused with :class:`EngineNotSupported`, nothing sent). Packing
        is fixed here for every later ``/update_weights``: ``packed`` (rollsafe's default, as
        vLLM's own trainer side) sends each call as uint8 chunks closed once they exceed
        ``packed_buffer_size_bytes`` (vLLM's default 1 GiB when None). ``keep_delta_base``
        (sent only when True; rollsafe's ``rollsafe_gloo`` backend alone knows it): the engine
        keeps a host copy of the weights it loads, to apply later deltas onto.
        """
        _only_group("init_weights_update_group", group_name)
        dialect = self.server_dialect(timeout=timeout)
        init_info: dict[str, Any] = {
            "master_address": master_address,
            "master_port": int(master_port),
            "rank_offset": int(rank_offset),
            "world_size": int(world_size),
        }
        packing: dict[str, Any] = {"packed": bool(packed)}
        if packed_buffer_size_bytes is not None:
            packing["packed_buffer_size_bytes"] = int(packed_buffer_size_bytes)
        if packed_num_buffers is not None:
            packing["packed_num_buffers"] = int(packed_num_buffers)
        if dialect.packed_in == "init_info":
            init_info.update(packing)
            packing = {}
        if keep_delta_base:
            if dialect.packed_in != "init_info":  # rollsafe_gloo speaks 0.32+ only
                raise EngineNotSupported(
                    "vllm",
                    "init_weights_update_group(keep_delta_base=True)",
                    f"rollsafe's rollsafe_gloo backend does not run on vLLM {dialect.version}",
                )
            init_info["keep_delta_base"] = True
        with self._update_lock:
            self._update_open = False  # a new group starts outside any update
            self._packing = packing  # 0.26: sent with every /update_weights
        return self._post_checked(
            "/init_weight_transfer_engine",
            {"init_info": init_info},
            timeout=self._weights_timeout(timeout),
        )

    def destroy_weights_update_group(
        self, group_name: str = VLLM_WEIGHT_TRANSFER_GROUP, *, timeout: float | None = None
    ) -> str:
        """POST ``/shutdown_weight_transfer_engine`` (vLLM's single group; ``group_name`` is
        not sent, and must be :data:`VLLM_WEIGHT_TRANSFER_GROUP`). vLLM 0.26.0 has no such
        route: nothing is sent, the engine keeps its group until the next
        :meth:`init_weights_update_group` or a restart (the message says so)."""
        _only_group("destroy_weights_update_group", group_name)
        with self._update_lock:
            self._update_open = False
        dialect = self.server_dialect(timeout=timeout)
        if not dialect.shutdown_route:
            return (
                f"vLLM {dialect.version} has no /shutdown_weight_transfer_engine: its group "
                "stays until the next /init_weight_transfer_engine or a restart"
            )
        return self._post_checked(
            "/shutdown_weight_transfer_engine", None, timeout=self._weights_timeout(timeout)
        )

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = VLLM_WEIGHT_TRANSFER_GROUP,
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
        timeout: float | None = None,
    ) -> str:
        """One call of vLLM's update lifecycle; blocks while the trainer broadcasts.

        The first call of a version sends ``/start_weight_update``; every call sends
        ``/update_weights`` {update_info: {names, dtype_names, shapes}}; the call that carries
        ``weight_version`` (the last) sends ``/finish_weight_update`` {weight_version} and, with
        ``flush_cache``, ``/reset_prefix_cache``. A failed call also sends
        ``/finish_weight_update`` (without a version) so the engine leaves update mode; the
        version it serves is unchanged. ``load_format`` is ignored: vLLM's packing was fixed by
        :meth:`init_weights_update_group`; ``group_name`` must be
        :data:`VLLM_WEIGHT_TRANSFER_GROUP`.
        """
        _only_group("update_weights_from_distributed", group_name)
        if not (len(names) == len(dtypes) == len(shapes)):
            raise InvalidArgument(
                "names",
                f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}",
            )
        self._refuse_while_asleep("update_weights_from_distributed")
        wt = self._weights_timeout(timeout)
        update_info: dict[str, Any] = {
            "names": list(names),
            "dtype_names": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [[int(d) for d in s] for s in shapes],
        }
        with self._update_lock:
            opened, self._update_open = not self._update_open, True
            update_info.update(self._packing)  # 0.26: packing travels with each call
        with self._ledger.changing_weights():
            if opened:
                self._forget_label()
            try:
                if opened:
                    self._post_checked("/start_weight_update", None, timeout=wt)
                body = {"update_info": update_info}
                message = self._post_checked("/update_weights", body, timeout=wt)
            except BaseException:
                self._leave_update(wt, None, quiet=True)
                raise
        if weight_version is not None:
            self._leave_update(wt, str(weight_version), quiet=False)
            if flush_cache:
                self.flush_cache(timeout=timeout)
        return message

    def _leave_update(self, timeout: float, version: str | None, *, quiet: bool) -> None:
        with self._update_lock:
            was_open, self._update_open = self._update_open, False
        if not was_open:
            return
        dialect = self.server_dialect()
        body: dict[str, Any] | None = {} if version is None else {"weight_version": version}
        if not dialect.finish_takes_version:
            body = None  # 0.26: no body; the version is this client's label
        with self._ledger.changing_weights():
            try:
                self._post_checked("/finish_weight_update", body, timeout=timeout)
            except EngineError:
                if not quiet:
                    raise
                return
            if version is not None and not dialect.weight_version_routes:
                self._label = version

    def _forget_label(self) -> None:
        """The weights are about to change: until a version is set again the client's label
        (0.26) is unknown."""
        self._label = None

    def update_weights_from_ipc(
        self,
        zmq_handles: Mapping[str, str],
        *,
        flush_cache: bool = True,
        weight_version: str | None = None,
        timeout: float | None = None,
    ) -> str:
        """checkpoint-engine's vLLM path: ``/collective_rpc`` method ``update_weights_from_ipc``
        {zmq_handles} (its worker extension takes nothing else), then ``/reset_prefix_cache``
        and ``/update_weight_version``."""
        self._forget_label()
        message = self._rpc_message(
            "update_weights_from_ipc", {"zmq_handles": dict(zmq_handles)}, timeout
        )
        if flush_cache:
            self.flush_cache(timeout=timeout)
        if weight_version is not None:
            self.update_weight_version(weight_version, timeout=timeout)
        return message


#: ``/collective_rpc`` methods that change the weights (refused while the weights sleep)
_WEIGHT_RPCS = frozenset({"reload_weights", "update_weights_from_ipc"})


def _version_source(dialect: VLLMDialect) -> str:
    """Where a completion's version came from when the server does not report it."""
    return "weight_info" if dialect.weight_version_routes else "client"


def completion_result(url: str, answer: Any) -> GenerateResult:
    """The :class:`GenerateResult` of a ``/v1/completions`` answer's first choice; its
    ``weight_version`` is the last ``weight_versions`` span's (0.33, when asked), else None
    (:func:`with_read_version` adds the one read around the request)."""
    choices = answer.get("choices") if isinstance(answer, Mapping) else None
    if not choices or not isinstance(choices[0], Mapping):
        raise EngineOperationFailed(url, COMPLETIONS_PATH, 200, f"no choices in answer: {answer!r}")
    assert isinstance(answer, Mapping)
    choice = choices[0]
    meta: dict[str, Any] = {k: v for k, v in answer.items() if k != "choices"}
    reason = choice.get("finish_reason")
    spans = choice.get("weight_versions")
    version = None
    lp = choice.get("logprobs")
    if isinstance(lp, Mapping):  # asked for with "logprobs": k
        meta["logprobs"] = lp  # {tokens, token_logprobs, top_logprobs, ...}
    if isinstance(spans, list) and spans and isinstance(spans[-1], Mapping):
        version = spans[-1].get("version")
        meta["weight_versions"] = spans
    token_lps = lp.get("token_logprobs") if isinstance(lp, Mapping) else None
    return GenerateResult(
        text=str(choice.get("text", "")),
        output_ids=[int(t) for t in choice.get("token_ids") or []],
        weight_version=None if version is None else str(version),
        finish_reason=None if reason is None else str(reason),
        meta_info=meta,
        output_logprobs=(
            None
            if not isinstance(token_lps, Sequence)
            else tuple(None if v is None else float(v) for v in token_lps)
        ),
    )


def with_read_version(
    result: GenerateResult, version: str | None, exact: bool, dialect: VLLMDialect
) -> GenerateResult:
    """``result`` of a server that reports no version (0.32, 0.26), with the version read
    around the request (``meta_info``: ``weight_version_source``, ``weight_version_exact``)."""
    meta = {
        **result.meta_info,
        "weight_version_source": _version_source(dialect),
        "weight_version_exact": exact,
    }
    return replace(result, weight_version=None if version is None else str(version), meta_info=meta)


def with_read_version_delta(
    delta: StreamDelta, produced: int, version: str | None, exact: bool, dialect: VLLMDialect
) -> StreamDelta:
    """The last ``delta`` of a stream of ``produced`` tokens from a server that reports no
    version, with the version read around it (a span over the whole output when exact)."""
    spans = (WeightSpan(str(version), 0, produced),) if exact and produced else ()
    meta = {**delta.meta, "weight_version_source": _version_source(dialect)}
    meta["weight_version_exact"] = exact
    return replace(
        delta, weight_version=None if version is None else str(version), spans=spans, meta=meta
    )


def _only_group(operation: str, group_name: str) -> None:
    """vLLM's one weight-transfer group has no name; refuse a call that names another group."""
    if group_name != VLLM_WEIGHT_TRANSFER_GROUP:
        raise EngineNotSupported(
            "vllm",
            f"{operation}(group_name={group_name!r})",
            "vLLM has one unnamed weight-transfer group (init_info carries no name); its ranks "
            f"join rollsafe's rendezvous as {VLLM_WEIGHT_TRANSFER_GROUP!r}, so the trainer must "
            f"join under that name and pass group_name={VLLM_WEIGHT_TRANSFER_GROUP!r}",
        )
