"""The soak's rollout traffic: plain requests and multi-turn sessions, through each fleet's gateway
with the ``openai`` SDK, from a thread each, for the whole run.

* ``plain``: greedy completions of token-id prompts drawn from the seed (12 new tokens,
  ``ignore_eos``), streamed and whole in turn;
* ``session``: chat conversations of :data:`TURNS` turns in one session (``x-session-id``), each
  turn's messages the earlier ones plus the assistant's reply as served and a new user message
  (the gateway reuses the earlier turns' token ids).

Every answer asks for its token ids (``return_token_ids``) and carries its provenance
(``rollsafe.segments``): each is handed to the token check (:mod:`tokens`). Counted per fleet and
kind: requests served, failed (an error after the gateway's own waits and retries: a fleet with
no routable group for ``wait_for_routable_s``), continued (more than one attempt), tokens.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from tokens import Answer

__all__ = ["Traffic"]

NEW_TOKENS = 12
TURNS = 3
USER_TURNS = ("Add 1 and 2.", "And now add 3 more.", "What is the total?", "Say it again.")
#: the client's own bound on one request (the gateway's waits are shorter)
CLIENT_TIMEOUT_S = 900.0


class Traffic:
    """Generates through every fleet's gateway until :meth:`stop` (see the module)."""

    def __init__(
        self,
        gateways: dict[str, str],
        seed: int,
        submit: Callable[[Answer], None],
        say: Callable[[str], None],
    ) -> None:
        self.gateways = gateways
        self.seed = seed
        self.submit = submit
        self.say = say
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(
                target=self._loop, args=(fleet, kind), name=f"soak-{fleet}-{kind}", daemon=True
            )
            for fleet in gateways
            for kind in ("plain", "session")
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self, timeout: float = 120.0) -> list[str]:
        """Stop and join; returns the threads still running after ``timeout`` (a stuck client)."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in self._threads if t.is_alive()]

    def _count(self, **kw: int) -> None:
        with self._lock:
            for k, n in kw.items():
                self.counts[k] += n

    def _loop(self, fleet: str, kind: str) -> None:
        import openai

        client = openai.OpenAI(
            base_url=f"{self.gateways[fleet]}/v1",
            api_key="soak",
            max_retries=0,
            timeout=CLIENT_TIMEOUT_S,
        )
        rng = random.Random(f"{self.seed}/{fleet}/{kind}")
        n = 0
        try:
            while not self._stop.is_set():
                n += 1
                try:
                    if kind == "plain":
                        self._plain(client, fleet, rng, stream=n % 2 == 0)
                    else:
                        self._session(client, fleet, rng, f"soak-{fleet}-{n}")
                except Exception as exc:
                    self._count(**{f"{fleet}.{kind}.failed": 1})
                    with self._lock:
                        if len(self.errors) < 50:
                            self.errors.append(f"{fleet} {kind}: {type(exc).__name__}: {exc}"[:300])
                    self._stop.wait(1.0)
        finally:
            client.close()

    def _record(
        self,
        fleet: str,
        kind: str,
        prompt: list[int],
        output: list[int],
        segments: list[dict[str, Any]],
    ) -> None:
        attempts = {s.get("attempt") for s in segments}
        self._count(
            **{
                f"{fleet}.{kind}.served": 1,
                f"{fleet}.{kind}.tokens": len(output),
                f"{fleet}.{kind}.continued": int(len(attempts) > 1),
            }
        )
        self.submit(Answer(fleet, kind, tuple(prompt), tuple(output), tuple(segments)))

    def _plain(self, client: Any, fleet: str, rng: random.Random, *, stream: bool) -> None:
        prompt = [rng.randrange(1, 500) for _ in range(rng.randint(3, 10))]
        body = {"ignore_eos": True, "return_token_ids": True}
        if not stream:
            out = client.completions.create(
                model="m", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0.0, extra_body=body
            )
            extra = out.choices[0].model_extra or {}
            self._record(
                fleet,
                "plain",
                prompt,
                list(extra["token_ids"]),
                list(extra["rollsafe"]["segments"]),
            )
            return
        ids: list[int] = []
        segments: list[dict[str, Any]] = []
        for chunk in client.completions.create(
            model="m",
            prompt=prompt,
            max_tokens=NEW_TOKENS,
            temperature=0.0,
            stream=True,
            extra_body=body,
        ):
            if not chunk.choices:
                continue
            extra = chunk.choices[0].model_extra or {}
            ids += extra.get("token_ids") or []
            if chunk.choices[0].finish_reason is not None:
                segments = list(extra["rollsafe"]["segments"])
        self._record(fleet, "plain", prompt, ids, segments)

    def _session(self, client: Any, fleet: str, rng: random.Random, session: str) -> None:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a rollout agent."},
            {"role": "user", "content": rng.choice(USER_TURNS)},
        ]
        for _ in range(TURNS):
            if self._stop.is_set():
                return
            answer = client.chat.completions.create(
                model="m",
                messages=messages,
                temperature=0.0,
                max_tokens=NEW_TOKENS,
                extra_headers={"x-session-id": session},
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            choice = answer.choices[0]
            extra = choice.model_extra or {}
            prompt = list((answer.model_extra or {})["prompt_token_ids"])
            self._record(
                fleet,
                "session",
                prompt,
                list(extra["token_ids"]),
                list(extra["rollsafe"]["segments"]),
            )
            messages += [
                {"role": "assistant", "content": choice.message.content or ""},
                {"role": "user", "content": rng.choice(USER_TURNS)},
            ]

    def summary(self) -> dict[str, Any]:
        with self._lock:
            counts = dict(self.counts)
            errors = list(self.errors)
        out: dict[str, Any] = {}
        for key, n in counts.items():
            fleet, kind, what = key.split(".")
            out.setdefault(fleet, {}).setdefault(kind, {})[what] = n
        return {"by_fleet": out, "first_errors": errors[:10]}
