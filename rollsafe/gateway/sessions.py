"""Sessions: a multi-turn conversation keeps its tokens exactly as they were sampled.

Owns :class:`SessionStore`. A request names its session with the body's ``session_id`` or the
``x-session-id`` header; the data plane pins the session to one group for its prefix cache
(moving it when that group leaves routing). For chat completions the gateway also keeps, per
session, the last turn's token ids as served (prompt + output, the sampled tokens themselves)
and the messages they stand for. When the next turn's ``messages`` begin with exactly those
messages (the assistant's reply as it was served), its prompt is

    the earlier turn's ids  +  tokens of (the template's end of that reply + the new messages)

so the model's own output is never re-tokenized: a trajectory's tokens are exactly what was
sampled (re-tokenizing text can merge or split tokens differently). The end of the reply is
what the chat template renders after the assistant's content (``<|im_end|>\\n``) less the stop
token the engine already sampled. Anything else (a changed history, other tools or template
arguments, a template that does not render a prefix of its next turn, a prompt that would no
longer fit) renders the whole conversation again, counted as ``session_retokenized``.

Sessions are kept in memory, least recently used first out past ``max_sessions``, forgotten
after ``ttl_s`` idle; everything runs on the gateway's event loop (no lock).
"""

from __future__ import annotations

import dataclasses
import json
import time
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollsafe.fleet.provenance import TokenChunk
from rollsafe.gateway.openai_api import ChatCall, ChatPrompt
from rollsafe.gateway.output import ChoiceOutput
from rollsafe.gateway.tokenizer import GatewayTokenizer

if TYPE_CHECKING:
    from rollsafe.gateway.app import GatewayCounters

__all__ = ["SessionStore"]


def _key(messages: Sequence[Mapping[str, Any]]) -> str:
    return json.dumps(list(messages), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _context_key(chat: ChatPrompt) -> str:
    return json.dumps(
        [chat.tools, dict(chat.template_kwargs)], sort_keys=True, separators=(",", ":"), default=str
    )


@dataclass(frozen=True)
class _Turn:
    """A session's last turn: its messages with the reply as served, their ids as served."""

    messages: tuple[Mapping[str, Any], ...]
    key: str  #: ``messages`` canonically serialized
    context: str  #: tools and template arguments
    ids: tuple[int, ...]  #: prompt + output ids as sampled
    closing: str  #: what the template renders after the reply, not yet in ``ids``
    used: float


@dataclass(frozen=True)
class _Pending:
    session_id: str
    chat: ChatPrompt
    prompt_ids: tuple[int, ...]


class SessionStore:
    """Per-session token histories for chat completions (see the module)."""

    def __init__(self, max_sessions: int, ttl_s: float, max_model_len: int) -> None:
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.max_model_len = max_model_len
        self._turns: OrderedDict[str, _Turn] = OrderedDict()
        self._pending: weakref.WeakKeyDictionary[ChatCall, _Pending] = weakref.WeakKeyDictionary()

    def __len__(self) -> int:
        return len(self._turns)

    def forget(self, session_id: str) -> None:
        self._turns.pop(session_id, None)

    def _get(self, session_id: str) -> _Turn | None:
        turn = self._turns.get(session_id)
        if turn is None:
            return None
        if time.monotonic() - turn.used > self.ttl_s:
            del self._turns[session_id]
            return None
        return turn

    # ------------------------------------------------------------------ a new turn
    def reuse(self, call: Any, tokenizer: GatewayTokenizer, counters: GatewayCounters) -> Any:
        """``call`` with its prompt built from the session's earlier tokens where it may be
        (see the module); ``call`` itself when it is no chat call in a session."""
        if not isinstance(call, ChatCall) or call.session_id is None or call.chat is None:
            return call
        chat = call.chat
        session = call.session_id
        prompt = tuple(call.prompts[0]) if call.prompts else ()
        turn = self._get(session)
        reused = None if turn is None else self._prompt(turn, chat, tokenizer)
        if reused is not None and self._fits(call, reused, self.max_model_len):
            counters.session_reused += 1
            call.requests = tuple(dataclasses.replace(r, input_ids=reused) for r in call.requests)
            call.prompts = [reused]
            prompt = reused
        elif turn is not None:
            counters.session_retokenized += 1
        if chat.add_generation_prompt:
            self._pending[call] = _Pending(session, chat, prompt)
        return call

    def _prompt(
        self, turn: _Turn, chat: ChatPrompt, tokenizer: GatewayTokenizer
    ) -> tuple[int, ...] | None:
        """The next turn's ids from ``turn``'s, or None when they cannot be reused."""
        n = len(turn.messages)
        if len(chat.messages) <= n or _context_key(chat) != turn.context:
            return None
        if _key(chat.messages[:n]) != turn.key:
            return None
        kwargs = dict(chat.template_kwargs)
        full = tokenizer.chat_text(chat.messages, chat.tools, add_generation_prompt=True, **kwargs)
        before = tokenizer.chat_text(
            turn.messages, chat.tools, add_generation_prompt=False, **kwargs
        )
        if not full.startswith(before):
            return None
        suffix = turn.closing + full[len(before) :]
        return turn.ids + tuple(tokenizer.encode(suffix, add_special_tokens=False))

    @staticmethod
    def _fits(call: ChatCall, ids: tuple[int, ...], max_model_len: int) -> bool:
        """Whether ``ids`` plus each choice's budget still fit the context."""
        for req in call.requests:
            budget = req.sampling_params.get("max_new_tokens")
            if isinstance(budget, int) and len(ids) + budget > max_model_len:
                return False
        return True

    # ------------------------------------------------------------------ a turn served
    def remember(
        self, call: Any, results: Sequence[Sequence[TokenChunk]], tokenizer: GatewayTokenizer
    ) -> None:
        """Keep the served turn of a chat call in a session (its first choice)."""
        pending = self._pending.pop(call, None) if isinstance(call, ChatCall) else None
        if pending is None or not results or not results[0]:
            return
        out = ChoiceOutput(tokenizer, call.requests[0])
        for chunk in results[0]:
            out.add(chunk)
        if not out.finished:
            return  # cut short (the client left): the next turn renders the whole history
        reply = {"role": "assistant", "content": out.text}
        messages = (*pending.chat.messages, reply)
        kwargs = dict(pending.chat.template_kwargs)
        try:
            before = tokenizer.chat_text(
                pending.chat.messages, pending.chat.tools, add_generation_prompt=True, **kwargs
            )
            after = tokenizer.chat_text(
                messages, pending.chat.tools, add_generation_prompt=False, **kwargs
            )
        except Exception:
            return
        rendered = after[len(before) :] if after.startswith(before) else None
        if rendered is None or not rendered.startswith(out.text):
            self.forget(pending.session_id)
            return
        closing = rendered[len(out.text) :]
        ids = tuple(out.token_ids)
        if ids:
            last = tokenizer.token_text(ids[-1])
            if (
                ids[-1] in tokenizer.eos_token_ids or out.finish_reason == "stop"
            ) and closing.startswith(last):
                closing = closing[len(last) :]  # the engine sampled the template's end token
        now = time.monotonic()
        self._turns[pending.session_id] = _Turn(
            messages=messages,
            key=_key(messages),
            context=_context_key(pending.chat),
            ids=pending.prompt_ids + ids,
            closing=closing,
            used=now,
        )
        self._turns.move_to_end(pending.session_id)
        self._expire(now)
        while len(self._turns) > self.max_sessions:
            self._turns.popitem(last=False)

    def _expire(self, now: float) -> None:
        """Forget the sessions idle past ``ttl_s``: the store is in the order of each session's
        last turn, so they are at its front (without this, a finished conversation, never
        looked up again, stayed until ``max_sessions`` newer ones pushed it out)."""
        turns = self._turns
        while turns:
            session_id, oldest = next(iter(turns.items()))
            if now - oldest.used <= self.ttl_s:
                return
            del turns[session_id]
