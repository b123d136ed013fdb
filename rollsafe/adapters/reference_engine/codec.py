"""Text <-> token ids for the reference engine (``tokenizer.json``, HF fast-tokenizer format).

Owns where the tokenizer comes from: the model directory by default, or ``--tokenizer-path``
(XTuner's ``reinit(tokenizer_path=...)`` contract; the launcher passes it when it differs from
the model path). Light: imports only ``tokenizers``, so a bad tokenizer fails the start-up in
well under a second, before any rank loads a model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollsafe.adapters.reference_engine.errors import BadRequest, StartupError
from rollsafe.adapters.reference_engine.paths import show_path

__all__ = ["TOKENIZER_FILE", "TextCodec"]

TOKENIZER_FILE = "tokenizer.json"


class TextCodec:
    """Text <-> token ids with a directory's local ``tokenizer.json`` (HF fast format).

    ``TextCodec(model_path)`` uses the model directory's tokenizer if it has one (else only
    token ids are served); ``TextCodec(dir, required=True)`` is ``--tokenizer-path``: the file
    must exist and load, else :class:`StartupError` naming the path.
    """

    def __init__(self, tokenizer_dir: str | Path, *, required: bool = False) -> None:
        self.tokenizer: Any = None
        self.path = Path(tokenizer_dir)
        file = self.path / TOKENIZER_FILE
        try:
            present = file.is_file()
        except (OSError, ValueError):
            present = False
        if not present:
            if required:
                raise StartupError(
                    f"tokenizer directory {show_path(self.path)} has no {TOKENIZER_FILE}"
                )
            return
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises its own exception type
            raise StartupError(f"{show_path(file)} cannot be loaded as a tokenizer: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise BadRequest(
                f"no tokenizer: {show_path(self.path)} has no {TOKENIZER_FILE}; send input_ids "
                "or start the engine with --tokenizer-path"
            )
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_count(self, text: str) -> int:
        """How many tokens ``text`` encodes to, without special tokens (SGLang's measure of a
        stop string's length)."""
        if self.tokenizer is None:
            return len(text)  # SGLang without a tokenizer counts characters
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode_stream(self, prompt: list[int], skip_special_tokens: bool) -> Callable[[int], str]:
        """An incremental decoder after ``prompt``: each call takes the next token id and gives
        the text it adds ("" while a multi-byte character is incomplete), as vLLM's
        ``FastIncrementalDetokenizer`` (``tokenizers.decoders.DecodeStream`` primed with the
        prompt). Without a tokenizer every token adds ""."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            return lambda _token: ""
        from tokenizers.decoders import DecodeStream

        try:
            stream = DecodeStream(ids=list(prompt), skip_special_tokens=skip_special_tokens)
        except TypeError:  # tokenizers < 0.22: no priming; the text is the same for byte-level
            stream = DecodeStream(skip_special_tokens=skip_special_tokens)

        def step(token: int) -> str:
            return str(stream.step(tokenizer, token) or "")

        return step
