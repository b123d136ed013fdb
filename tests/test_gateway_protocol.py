"""The gateway's protocol layer (issue #35): requests in, answers out, no sockets.

Every accepted field lands in the fleet's sampling vocabulary, every refused one is a 400
naming it (nothing reaches an engine), and every answer and stream chunk parses with the
OpenAI SDK's own types (``openai.types``) and carries SGLang 0.5.23's field names. The facts
about the upstream shapes are hard-coded below with the file of the pinned wheel they were read
from.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import openai
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from openai._models import construct_type
from openai._streaming import SSEDecoder

from rollsafe.fleet.provenance import Segment, TokenChunk
from rollsafe.gateway.openai_api import models_list, parse_chat, parse_completion
from rollsafe.gateway.output import ChoiceOutput
from rollsafe.gateway.requests import GenRequest, InvalidRequest, OutputSpec, ProtocolLimits
from rollsafe.gateway.sglang_api import parse_generate, stream_error
from rollsafe.gateway.tokenizer import Detokenizer, GatewayTokenizer, StopStrings

# vllm/entrypoints/openai/completion/protocol.py CompletionResponseChoice (model_dump: all)
VLLM_COMPLETION_CHOICE = [
    "index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids",
    "prompt_logprobs", "prompt_token_ids", "routed_experts", "weight_versions",
]  # fmt: skip
# ... CompletionResponse
VLLM_COMPLETION = [
    "id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
    "usage", "kv_transfer_params", "ec_transfer_params", "metrics",
]  # fmt: skip
# ... CompletionResponseStreamChoice, every field passed by completion/serving.py
VLLM_COMPLETION_STREAM_CHOICE = [
    "index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids",
    "token_ids", "weight_versions",
]  # fmt: skip
# chat_completion/protocol.py ChatCompletionResponseChoice / ChatMessage (tool_calls popped)
VLLM_CHAT_CHOICE = [
    "index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids",
    "routed_experts", "weight_versions",
]  # fmt: skip
VLLM_CHAT_MESSAGE = [
    "role", "content", "refusal", "annotations", "audio", "function_call", "reasoning",
]  # fmt: skip
VLLM_CHAT = [
    "id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
    "usage", "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params",
    "ec_transfer_params", "metrics",
]  # fmt: skip
# chat_completion/serving.py: the first chunk per choice, then token chunks, then the last
VLLM_CHAT_FIRST_CHOICE = ["index", "delta", "logprobs", "finish_reason"]
VLLM_CHAT_TOKEN_CHOICE = ["index", "delta", "logprobs", "finish_reason", "token_ids"]
VLLM_CHAT_LAST_CHOICE = [
    "index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids", "weight_versions",
]  # fmt: skip
# srt/managers/tokenizer_manager.py _handle_batch_output: an answer and its meta_info
SGLANG_ANSWER = ["text", "output_ids", "meta_info"]
SGLANG_META = [
    "id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions",
    "input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length",
    "reasoning_tokens", "completion_tokens", "cached_tokens",
]  # fmt: skip
SGLANG_META_FINISHED = ["weight_versions", "e2e_latency", "response_sent_to_client_ts"]

MULTIBYTE = ["héllo wörld", "日本語のテキスト", "emoji 🎉🚀 done", "mixed ß∑≈ç √"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("gw-tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> GatewayTokenizer:
    return GatewayTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def limits(model_dir: Path) -> ProtocolLimits:
    return ProtocolLimits.from_model(model_dir)


def chunks_of(
    ids: list[int],
    *,
    split: int = 2,
    finish: str | None = "stop",
    version: str = "3",
    group: str = "g0",
    logprobs: bool = True,
    meta: dict[str, Any] | None = None,
) -> list[TokenChunk]:
    """``ids`` as fleet chunks of ``split`` tokens, then the finishing chunk."""
    out = [
        TokenChunk(
            tuple(ids[i : i + split]),
            group,
            version,
            logprobs=tuple(-0.25 for _ in ids[i : i + split]) if logprobs else (),
        )
        for i in range(0, len(ids), split)
    ]
    if finish is not None:
        seg = Segment(group, version, (0, len(ids)))
        out.append(
            TokenChunk((), group, version, finished=True, finish_reason=finish, segments=(seg,),
                       meta=meta or {})
        )  # fmt: skip
    return out


def sse_events(data: bytes) -> list[Any]:
    """The JSON events of a stream, decoded by the OpenAI SDK's own SSE decoder."""
    events = list(SSEDecoder().iter_bytes(iter([data])))
    assert events and events[-1].data == "[DONE]", data[-200:]
    return [json.loads(e.data) for e in events[:-1]]


def refused(fn: Any, *args: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        fn(*args)
    return info.value


# -- the tiny model's chat template ---------------------------------------------------------


def test_tiny_model_writes_its_chat_template_into_the_tokenizer_config(
    model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    from rollsafe.adapters.reference_engine.tiny_model import CHAT_TEMPLATE, make_tiny_model

    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    assert not (model_dir / "chat_template.jinja").exists()
    again = make_tiny_model(tmp_path / "again", seed=0)
    for name in ("tokenizer_config.json", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name
    hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add 2 and 3."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 2}}}
            ],
        },
        {"role": "tool", "content": "5", "tool_call_id": "c1"},
    ]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    text = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n"
        '{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}'
        "<|im_end|>\n<|im_start|>user\nAdd 2 and 3.<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
        "<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = hf.apply_chat_template(messages[:2], add_generation_prompt=False, tokenize=False)
    assert (
        plain
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nAdd 2 and 3.<|im_end|>\n"
    )


def test_chat_prompt_is_the_template_encoded_without_special_tokens(tok: GatewayTokenizer) -> None:
    messages = [{"role": "user", "content": "Hello world!"}]
    text = tok.chat_text(messages, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.chat_prompt(messages) == tok.encode(text, add_special_tokens=False)
    assert tok.decode(tok.chat_prompt(messages)) == text
    without = tok.chat_prompt(messages, add_generation_prompt=False)
    assert tok.decode(without) == text.removesuffix("<|im_start|>assistant\n")


def test_a_model_without_chat_template_is_a_400_naming_messages(
    model_dir: Path, tmp_path: Path, limits: ProtocolLimits
) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    plain = GatewayTokenizer.from_pretrained(bare)
    err = refused(parse_chat, {"messages": [{"role": "user", "content": "hi"}]}, {}, plain, limits)
    assert err.field == "messages" and "no chat template" in str(err)
    assert err.as_openai()["error"]["param"] == "messages"


def test_from_pretrained_reads_local_files_only(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="model_path") as info:
        GatewayTokenizer.from_pretrained(tmp_path / "missing")
    assert getattr(info.value, "key", None) == "model_path"


# -- detokenizer and stop strings -----------------------------------------------------------


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_detokenizer_equals_decoding_all_ids_for_any_split(
    tok: GatewayTokenizer, data: Any
) -> None:
    source = data.draw(st.sampled_from(["ids", "text"]))
    if source == "text":
        text = data.draw(st.sampled_from(MULTIBYTE)) + data.draw(st.text(max_size=12))
        ids = tok.encode(text, add_special_tokens=False)
    else:
        ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40))
    skip = data.draw(st.booleans())
    # the byte table (the tiny model's decoder is byte-level) or vLLM's window
    if not data.draw(st.booleans()):
        tok = copy.copy(tok)
        tok.byte_level = False
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=8)))
    prompt = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=8))
    # a prompt that ends inside a UTF-8 character (random ids do) merges its last bytes with
    # the output's first ones, as vLLM's window does: the output alone decodes otherwise
    assume(not tok.decode(prompt, skip_special_tokens=skip).endswith("\ufffd"))
    detok = Detokenizer(tok, prompt, skip_special_tokens=skip)
    pieces, start = [], 0
    for cut in [*cuts, len(ids)]:
        pieces.append(detok.add(ids[start:cut]))
        start = cut
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("byte_table", [True, False])
def test_detokenizer_waits_for_a_split_multibyte_character(
    tok: GatewayTokenizer, byte_table: bool
) -> None:
    assert tok.byte_level  # the tiny model's decoder is byte-level, every id checked at load
    if not byte_table:
        tok = copy.copy(tok)
        tok.byte_level = False
    ids = tok.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # a byte-level vocabulary spells it in several tokens
    detok = Detokenizer(tok)
    assert [detok.add([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "🎉"
    # an id past the vocabulary (an embedding padded beyond the tokenizer) decodes to nothing
    assert detok.add([tok.vocab_size + 7]) == "" and detok.flush() == ""


def test_a_tokenizer_whose_decoder_is_not_byte_level_keeps_the_window() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"▁a": 0, "▁b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = GatewayTokenizer(PreTrainedTokenizerFast(tokenizer_object=backend))
    assert not tok.byte_level
    detok = Detokenizer(tok)
    assert detok.add([0, 1]) + detok.flush() == tok.decode([0, 1]) == "a b"


def test_stop_strings_find_as_vllm_and_hold_back_a_prefix() -> None:
    stops = StopStrings(["STOP", "end"])
    assert stops.find("abc STOP", 4) == ("STOP", 4)
    assert stops.find("abc STOP", 0) is None
    assert stops.find("xx end yy STOP", 14) == ("end", 3)  # the one completing first
    assert StopStrings(["STOP"], include=True).find("a STOP b", 8) == ("STOP", 6)
    assert stops.holdback("abc ST") == 2
    assert stops.holdback("abc en") == 2
    assert stops.holdback("abc e") == 1
    assert stops.holdback("abc x") == 0
    assert StopStrings(["STOP"], include=True).holdback("ST") == 0


def _spec(max_tokens: int = 64, **kw: Any) -> OutputSpec:
    return OutputSpec(max_tokens=max_tokens, **kw)


def _request(spec: OutputSpec, prompt: tuple[int, ...] = (5, 6)) -> GenRequest:
    return GenRequest(prompt, {}, True, None, spec)


@pytest.mark.parametrize("split", [1, 2, 3, 7])
def test_a_stream_never_shows_a_stop_string_it_then_trims(
    tok: GatewayTokenizer, split: int
) -> None:
    ids = tok.encode(" The quick brown fox jumps over the lazy dog", add_special_tokens=False)
    out = ChoiceOutput(tok, _request(_spec(stop=("fox jumps",))), stream=True)
    sent = ""
    for chunk in chunks_of(ids, split=split, finish=None):
        sent += out.add(chunk).text
        assert "fox" not in sent  # the stop string's first characters were held back
        if out.finished:
            break
    assert out.finished and out.finish_reason == "stop" and out.stop_reason == "fox jumps"
    assert out.stopped_early  # the gateway saw it before the engine said so: end the request
    assert sent == out.text == " The quick brown "
    assert tok.decode(out.token_ids).startswith(" The quick brown fox jumps")
    assert not tok.decode(out.token_ids[:-1]).endswith("fox jumps")  # later tokens dropped


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_a_streamed_choice_sends_its_text_once_and_cuts_at_the_first_stop(
    tok: GatewayTokenizer, data: Any
) -> None:
    """Any split of the tokens, any stop strings: the deltas joined are the final text, which is
    the decoded text cut before the stop string that completes first (ties: the one listed
    first), or all of it. (The text is kept in pieces: this pins the offsets.)"""
    words = data.draw(
        st.lists(st.sampled_from(["the", " fox", " é", "🎉", " ox", "x", " "]), max_size=14)
    )
    # a lead without any stop string: the stop is found far from the text's start
    ids = tok.encode("the the the the the the" + "".join(words), add_special_tokens=False)
    full = tok.decode(ids)
    stops = data.draw(
        st.lists(st.sampled_from(["ox", "fox", " é", "🎉 t", "x x", "zz"]), max_size=3)
    )
    split = data.draw(st.integers(1, 5))
    out = ChoiceOutput(tok, _request(_spec(max_tokens=256, stop=tuple(stops))), stream=True)
    sent = ""
    for chunk in chunks_of(ids, split=split):
        sent += out.add(chunk).text
        if out.finished:
            break
    best: tuple[int, int] | None = None  # (end, start) of the stop completing first
    for stop in dict.fromkeys(stops):
        at = full.find(stop)
        if at != -1 and (best is None or at + len(stop) < best[0]):
            best = (at + len(stop), at)
    assert out.finished
    assert sent == out.text == (full if best is None else full[: best[1]])


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_a_whole_answer_from_merged_chunks_equals_one_from_each_chunk(
    tok: GatewayTokenizer, data: Any
) -> None:
    """``add_all`` merges runs of one try under one version before taking them: the answer is
    the same as from the chunks one by one (text, ids, logprobs, finish, spans, provenance),
    across version changes, continued tries, missing logprobs, stop strings and stop ids."""
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), min_size=1, max_size=30))
    chunks, start = [], 0
    while start < len(ids):
        n = data.draw(st.integers(1, 4))
        piece = tuple(ids[start : start + n])
        lps = data.draw(st.sampled_from(["all", "none", "some"]))
        chunks.append(
            TokenChunk(
                piece,
                data.draw(st.sampled_from(["g0", "g1"])),
                data.draw(st.sampled_from(["3", "4"])),
                attempt=data.draw(st.integers(1, 2)),
                start=start,
                logprobs={"all": (-0.5,) * len(piece), "none": (), "some": (-0.5,)}[lps],
            )
        )
        start += len(piece)
    chunks.append(
        TokenChunk(
            (),
            chunks[-1].group_id,
            chunks[-1].weight_version,
            finished=True,
            finish_reason=data.draw(st.sampled_from(["stop", "length"])),
            attempt=chunks[-1].attempt,
            start=start,
        )
    )
    spec = _spec(
        max_tokens=data.draw(st.integers(1, 40)),
        stop=tuple(data.draw(st.lists(st.sampled_from(["e", "th", " "]), max_size=2))),
        stop_token_ids=frozenset(data.draw(st.lists(st.sampled_from(ids), max_size=1))),
        logprobs=data.draw(st.booleans()),
    )
    one, merged = ChoiceOutput(tok, _request(spec)), ChoiceOutput(tok, _request(spec))
    for chunk in chunks:
        one.add(chunk)
    merged.add_all(chunks)

    def seen(out: ChoiceOutput) -> tuple[Any, ...]:
        return (
            out.text,
            out.token_ids,
            out.logprobs,
            out.finish_reason,
            out.stop_reason,
            out.matched,
            out.spans(),
            out.provenance(),
            out.weight_version,
            out.group_id,
        )

    assert seen(merged) == seen(one)


def test_include_stop_keeps_the_stop_string_and_min_tokens_delays_it(tok: GatewayTokenizer) -> None:
    ids = tok.encode(" the rollout the engine", add_special_tokens=False)
    keep = ChoiceOutput(tok, _request(_spec(stop=("the",), include_stop=True)))
    for chunk in chunks_of(ids, finish=None):
        keep.add(chunk)
    assert keep.text == " the" and keep.stop_reason == "the"
    late = ChoiceOutput(tok, _request(_spec(stop=("the",), min_tokens=2)))
    for chunk in chunks_of(ids, finish=None):
        late.add(chunk)
    assert late.text == " the rollout " and late.finish_reason == "stop"


def test_a_stop_token_ends_the_text_but_stays_in_the_token_ids(tok: GatewayTokenizer) -> None:
    eos = next(iter(tok.eos_token_ids))
    ids = [*tok.encode(" Hello world", add_special_tokens=False), eos]
    out = ChoiceOutput(tok, _request(_spec(skip_special_tokens=False)))
    for chunk in chunks_of(ids):
        out.add(chunk)
    assert out.text == " Hello world" and out.token_ids == ids
    assert out.matched == eos and out.stop_reason is None  # vLLM: no stop_reason for EOS
    ids2 = tok.encode(" Hello world", add_special_tokens=False)
    stop_id = ids2[-1]
    out2 = ChoiceOutput(tok, _request(_spec(stop_token_ids=frozenset({stop_id}))))
    for chunk in chunks_of(ids2):
        out2.add(chunk)
    assert out2.text == tok.decode(ids2[:-1]) and out2.token_ids == ids2
    assert out2.stop_reason == stop_id  # vLLM: a client stop token id is the stop_reason
    ignored = ChoiceOutput(tok, _request(_spec(ignore_eos=True, skip_special_tokens=False)))
    for chunk in chunks_of([*ids2, eos, *ids2], finish="length"):
        ignored.add(chunk)
    assert ignored.text == tok.decode([*ids2, eos, *ids2], skip_special_tokens=False)


def test_tokens_past_max_tokens_are_dropped(tok: GatewayTokenizer) -> None:
    ids = tok.encode(" one two three four five", add_special_tokens=False)
    out = ChoiceOutput(tok, _request(_spec(max_tokens=3)))
    for chunk in chunks_of(ids, finish=None):
        out.add(chunk)
    assert out.finished and out.finish_reason == "length" and out.token_ids == ids[:3]


# -- limits and bad requests ----------------------------------------------------------------


def test_limits_come_from_the_model_config(model_dir: Path) -> None:
    limits = ProtocolLimits.from_model(model_dir, max_n=4)
    assert (limits.max_model_len, limits.vocab_size, limits.max_n) == (1024, 512, 4)
    with pytest.raises(Exception, match="max_n"):
        ProtocolLimits(max_model_len=16, max_n=0)


def test_bad_request_bodies_match_vllm_and_sglang() -> None:
    err = InvalidRequest("messages[2].content", "must be a string")
    # vllm/entrypoints/serve/engine/protocol.py ErrorResponse(error=ErrorInfo(...))
    assert err.as_openai() == {
        "error": {
            "message": "messages[2].content: must be a string",
            "type": "BadRequestError",
            "param": "messages[2].content",
            "code": 400,
        }
    }
    # srt/entrypoints/http_server.py _create_error_response
    assert err.as_sglang() == {"error": {"message": "messages[2].content: must be a string"}}
    assert err.status == 400 and isinstance(err, ValueError)
    event = json.loads(stream_error("engine died", 503)[len(b"data: ") :])
    assert event == {
        "error": {
            "message": "engine died",
            "type": "invalid_request_error",
            "code": 503,
            "retryable": False,
        }
    }


COMPLETION_REFUSALS: list[tuple[dict[str, Any], str]] = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, -2]}, "prompt[1]"),
    ({"prompt": [1, 512]}, "prompt[1]"),
    ({"prompt": [1, True]}, "prompt[1]"),
    ({"prompt": [[1], "x", 3]}, "prompt[2]"),
    ({"prompt": ["a"] * 1025}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 2000}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "8"}, "max_tokens"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": 65}, "n"),
    ({"prompt": "hi", "n": 2, "temperature": 0}, "n"),
    ({"prompt": "hi", "temperature": 2.5}, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_k": -2}, "top_k"),
    ({"prompt": "hi", "min_p": 1.5}, "min_p"),
    ({"prompt": "hi", "frequency_penalty": 3}, "frequency_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "hi", "seed": 2**63}, "seed"),
    ({"prompt": "hi", "stop": [""]}, "stop[0]"),
    ({"prompt": "hi", "stop": ["a"] * 33}, "stop"),
    ({"prompt": "hi", "stop": 3}, "stop"),
    ({"prompt": "hi", "stop_token_ids": [600]}, "stop_token_ids[0]"),
    ({"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"prompt": "hi", "logprobs": 2}, "logprobs"),
    ({"prompt": "hi", "logprobs": -3}, "logprobs"),
    ({"prompt": "hi", "logprobs": "1"}, "logprobs"),
    ({"prompt": "hi", "echo": True, "logprobs": 0}, "echo"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "suffix": "x"}, "suffix"),
    ({"prompt": "hi", "use_beam_search": True}, "use_beam_search"),
    ({"prompt": "hi", "logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"prompt": "hi", "response_format": {"type": "json_object"}}, "response_format"),
    ({"prompt": "hi", "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"prompt": "hi", "prompt_logprobs": 0}, "prompt_logprobs"),
    ({"prompt": "hi", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ({"prompt": "hi", "prompt_embeds": "AAAA"}, "prompt_embeds"),
    ({"prompt": "hi", "priority": 1}, "priority"),
    ({"prompt": "hi", "cache_salt": "s"}, "cache_salt"),
    ({"prompt": "hi", "allowed_token_ids": [1]}, "allowed_token_ids"),
    ({"prompt": "hi", "ignore_eos": "yes"}, "ignore_eos"),
    ({"prompt": "hi", "session_id": 7}, "session_id"),
    ({"prompt": [1] * 1024}, "prompt"),
]


@pytest.mark.parametrize(("body", "field"), COMPLETION_REFUSALS)
def test_completions_refuse_a_bad_field_naming_it(
    tok: GatewayTokenizer, limits: ProtocolLimits, body: dict[str, Any], field: str
) -> None:
    err = refused(parse_completion, body, {}, tok, limits)
    assert err.field == field and field in str(err) and err.status == 400
    assert err.as_openai()["error"]["param"] == field


def test_a_prompt_past_the_context_is_vllms_400(
    tok: GatewayTokenizer, limits: ProtocolLimits
) -> None:
    err = refused(parse_completion, {"prompt": [7] * 1024}, {}, tok, limits)
    assert "This model's maximum context length is 1024 tokens" in str(err)
    fits = parse_completion({"prompt": [7] * 1000, "max_tokens": 100}, {}, tok, limits)
    assert fits.requests[0].sampling_params["max_new_tokens"] == 24  # clamped as vLLM does
    assert refused(parse_completion, [1, 2], {}, tok, limits).field == "body"


def test_completions_accept_every_served_field(
    tok: GatewayTokenizer, limits: ProtocolLimits
) -> None:
    body = {
        "model": "anything",
        "prompt": ["Hello world", [5, 6, 7]],
        "max_tokens": 12,
        "n": 3,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 0,
        "min_p": 0.05,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.5,
        "repetition_penalty": 1.1,
        "stop": "fox",
        "stop_token_ids": [9],
        "seed": 41,
        "logprobs": 0,
        "ignore_eos": True,
        "min_tokens": 2,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
        "return_token_ids": True,
        "return_weight_versions": True,
        "return_tokens_as_token_ids": False,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "u",
        "request_id": "abc",
        "unknown_key": {"ignored": True},  # vLLM's OpenAIBaseModel ignores extra keys
        "no_stop_trim": True,  # what vllm-router adds
        "return_hidden_states": False,
    }
    call = parse_completion(body, {"x-session-id": "conv-1"}, tok, limits)
    assert call.id == "cmpl-abc" and call.stream and call.n == 3
    assert [r.index for r in call.requests] == [0, 1, 2, 3, 4, 5]
    assert [r.prompt_index for r in call.requests] == [0, 0, 0, 1, 1, 1]
    assert call.requests[3].input_ids == (5, 6, 7)
    assert call.requests[0].input_ids == tuple(tok.encode("Hello world"))
    seeds = [r.sampling_params["sampling_seed"] for r in call.requests]
    assert seeds == [41, 42, 43, 41, 42, 43]  # seed + choice index, per prompt
    params = dict(call.requests[0].sampling_params)
    params.pop("sampling_seed")
    assert params == {
        "max_new_tokens": 12,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "repetition_penalty": 1.1,
        "stop": ["fox"],
        "stop_token_ids": [9],
        "ignore_eos": True,
        "min_new_tokens": 2,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "return_logprob": True,
    }
    assert all(r.session_id == "conv-1" and r.stream for r in call.requests)
    spec = call.requests[0].output
    assert spec.stop == ("fox",) and spec.include_stop and spec.min_tokens == 2
    plain = parse_completion({"prompt": "hi"}, {}, tok, limits).requests[0]
    assert dict(plain.sampling_params) == {"max_new_tokens": 16}  # vLLM's default max_tokens
    assert plain.session_id is None
    body_session = parse_completion(
        {"prompt": "hi", "session_id": "s"}, {"X-Session-Id": "h"}, tok, limits
    )
    assert body_session.requests[0].session_id == "s"


def test_completion_answer_parses_with_the_openai_sdk(
    tok: GatewayTokenizer, limits: ProtocolLimits
) -> None:
    call = parse_completion(
        {"prompt": ["Hello", "world"], "n": 2, "max_tokens": 8, "logprobs": 0, "seed": 1,
         "return_token_ids": True, "return_weight_versions": True},
        {}, tok, limits,
    )  # fmt: skip
    ids = tok.encode(" quick brown fox", add_special_tokens=False)
    results = []
    for _ in call.requests:
        first = [TokenChunk(tuple(ids[:2]), "g0", "1", logprobs=(-0.5, -0.25))]
        rest = [TokenChunk(tuple(ids[2:]), "g1", "2", attempt=2, logprobs=(-1.0,) * (len(ids) - 2))]
        segs = (Segment("g0", "1", (0, 2), 1, "failed"), Segment("g1", "2", (2, len(ids)), 2))
        end = [TokenChunk((), "g1", "2", 2, finished=True, finish_reason="length", segments=segs)]
        results.append(first + rest + end)
    answer = call.render(results)
    parsed = openai.types.Completion.model_validate(answer)
    assert list(answer) == VLLM_COMPLETION
    assert [list(c)[: len(VLLM_COMPLETION_CHOICE)] for c in answer["choices"]] == [
        VLLM_COMPLETION_CHOICE
    ] * 4
    assert [c.index for c in parsed.choices] == [0, 1, 2, 3]
    choice = answer["choices"][2]
    assert choice["text"] == " quick brown fox" and choice["finish_reason"] == "length"
    assert choice["token_ids"] == ids and choice["prompt_token_ids"] == tok.encode("world")
    assert choice["weight_versions"] == [
        {"version": "1", "start": 0, "end": 2},
        {"version": "2", "start": 2, "end": len(ids)},
    ]
    assert choice["rollsafe"]["segments"][0] == {
        "group": "g0", "weights_version": "1", "token_range": [0, 2], "attempt": 1,
        "ended": "failed",
    }  # fmt: skip
    lp = choice["logprobs"]
    assert lp["token_logprobs"][:2] == [-0.5, -0.25]
    assert lp["tokens"] == [tok.token_text(t) for t in ids]
    assert lp["top_logprobs"][0] == {lp["tokens"][0]: -0.5}  # logprobs=0: the sampled token
    assert lp["text_offset"][1] == len(lp["tokens"][0])
    prompt_tokens = len(tok.encode("Hello")) + len(tok.encode("world"))  # each prompt once
    assert answer["usage"]["prompt_tokens"] == prompt_tokens
    assert answer["usage"]["completion_tokens"] == 4 * len(ids)
    assert answer["usage"]["total_tokens"] == prompt_tokens + 4 * len(ids)
    with pytest.raises(ValueError, match="results"):
        call.render(results[:1])


def test_completion_stream_chunks_parse_and_join_to_the_answer(
    tok: GatewayTokenizer, limits: ProtocolLimits
) -> None:
    body = {"prompt": "Hi", "n": 2, "max_tokens": 30, "stop": ["lazy"], "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True,
            "return_weight_versions": True, "logprobs": 0}  # fmt: skip
    call = parse_completion(body, {}, tok, limits)
    ids = tok.encode(" The quick brown fox jumps over the lazy dog", add_special_tokens=False)
    streamer = call.streamer()
    data = streamer.start()
    for i in range(2):
        for chunk in chunks_of(ids, split=i + 1):
            data += streamer.chunk(i, chunk)
        assert streamer.finished(i)
    assert streamer.all_finished
    data += streamer.end()
    events = sse_events(data)
    texts = {0: "", 1: ""}
    tokens: dict[int, list[int]] = {0: [], 1: []}
    for event in events[:-1]:
        # the SDK builds stream chunks leniently (construct_type: a chunk's finish_reason is
        # null until its last, as vLLM sends it); a last chunk also validates strictly
        parsed = construct_type(type_=openai.types.Completion, value=event)
        assert isinstance(parsed, openai.types.Completion) and parsed.id == call.id
        if event["choices"][0]["finish_reason"] is not None:
            openai.types.Completion.model_validate(event)
        (choice,) = event["choices"]
        assert list(choice)[: len(VLLM_COMPLETION_STREAM_CHOICE)] == VLLM_COMPLETION_STREAM_CHOICE
        texts[choice["index"]] += choice["text"]
        tokens[choice["index"]] += choice["token_ids"]
        if choice["finish_reason"] is None:
            assert choice["weight_versions"] is None and "rollsafe" not in choice
    usage = events[-1]
    assert usage["choices"] == [] and set(usage) == {
        "id",
        "object",
        "created",
        "model",
        "choices",
        "usage",
    }
    whole = call.render([chunks_of(ids), chunks_of(ids)])
    for i in range(2):
        assert texts[i] == whole["choices"][i]["text"] == " The quick brown fox jumps over the "
        assert tokens[i] == whole["choices"][i]["token_ids"]
    assert usage["usage"] == {
        k: whole["usage"][k] for k in ("prompt_tokens", "total_tokens", "completion_tokens")
    }
    firsts = [e for e in events[:-1] if e["choices"][0]["prompt_token_ids"] is not None]
    assert [e["choices"][0]["index"] for e in firsts] == [0, 1]  # once per choice, first chunk


def test_echo_prepends_the_prompt(tok: GatewayTokenizer, limits: ProtocolLimits) -> None:
    call = parse_completion({"prompt": "Hello", "echo": True, "max_tokens": 5}, {}, tok, limits)
    ids = tok.encode(" world", add_special_tokens=False)
    assert call.render([chunks_of(ids)])["choices"][0]["text"] == "Hello world"
    tokens = parse_completion({"prompt": tok.encode("Hello"), "echo": True}, {}, tok, limits)
    assert tokens.render([chunks_of(ids)])["choices"][0]["text"] == "Hello world"


# -- chat -----------------------------------------------------------------------------------


CHAT_REFUSALS: list[tuple[dict[str, Any], str]] = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "a"}, "b"]}, "messages[1]"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
     "tool_choice"),
    ({"logprobs": True, "top_logprobs": 3}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ({"echo": True}, "echo"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"messages": [{"role": "user", "content": "x" * 70000}]}, "messages"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "field"), CHAT_REFUSALS)
def test_chat_refuses_a_bad_field_naming_it(
    tok: GatewayTokenizer, limits: ProtocolLimits, extra: dict[str, Any], field: str
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    err = refused(parse_chat, body, {}, tok, limits)
    assert err.field == field and field in str(err)


def test_chat_renders_the_template_with_tools_and_all_roles(
    tok: GatewayTokenizer, limits: ProtocolLimits
) -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user",
         "content": [{"type": "text", "text": "Add"}, {"type": "text", "text": "2 and 3"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 2}'}}]},
        {"role": "tool", "content": "5", "tool_call_id": "c1"},
    ]  # fmt: skip
    call = parse_chat(
        {"messages": messages, "tools": tools, "tool_choice": "auto", "max_completion_tokens": 9,
         "return_prompt_text": True, "session_id": "agent-7", "n": 2, "seed": 3},
        {}, tok, limits,
    )  # fmt: skip
    text = call.prompt_text
    assert text is not None and text.endswith(
        "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "Add\n2 and 3" in text  # text parts joined with newlines, as vLLM does
    assert '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>' in text
    assert '"name": "add"' in text.split("<|im_end|>")[0]  # the tools in the system turn
    assert call.requests[0].input_ids == tuple(tok.encode(text, add_special_tokens=False))
    assert [r.sampling_params["sampling_seed"] for r in call.requests] == [3, 4]
    assert {r.session_id for r in call.requests} == {"agent-7"}
    assert call.requests[0].sampling_params["max_new_tokens"] == 9
    open_ended = parse_chat(
        {"messages": messages[:2], "add_generation_prompt": False}, {}, tok, limits
    )
    assert not tok.decode(open_ended.requests[0].input_ids).endswith("assistant\n")
    assert open_ended.role == "user"
    unbounded = parse_chat({"messages": messages[:2]}, {}, tok, limits).requests[0]
    assert unbounded.sampling_params["max_new_tokens"] == 1024 - len(unbounded.input_ids)


def test_chat_answer_and_stream_parse_with_the_openai_sdk(
    tok: GatewayTokenizer, limits: ProtocolLimits
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "logprobs": True,
            "top_logprobs": 0, "return_token_ids": True, "return_weight_versions": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    call = parse_chat(body, {}, tok, limits)
    eos = next(iter(tok.eos_token_ids))
    ids = [*tok.encode(" Héllo 🎉 world", add_special_tokens=False), eos]
    streamer = call.streamer()
    data = b""
    for chunk in chunks_of(ids, split=1):
        data += streamer.chunk(1, chunk)
    for chunk in chunks_of(ids, split=3):
        data += streamer.chunk(0, chunk)
    data += streamer.end()
    events = sse_events(data)
    for event in events:
        openai.types.chat.ChatCompletionChunk.model_validate(event)
    assert [list(e["choices"][0]) for e in events[:2]] == [VLLM_CHAT_FIRST_CHOICE] * 2
    assert [e["choices"][0]["delta"] for e in events[:2]] == [
        {"role": "assistant", "content": ""}
    ] * 2
    assert events[0]["prompt_token_ids"] == list(call.requests[0].input_ids)
    content = {0: "", 1: ""}
    for event in events[2:-1]:
        (choice,) = event["choices"]
        keys = VLLM_CHAT_LAST_CHOICE if choice["finish_reason"] else VLLM_CHAT_TOKEN_CHOICE
        assert list(choice)[: len(keys)] == keys
        content[choice["index"]] += choice["delta"].get("content", "")
    assert content == {0: " Héllo 🎉 world", 1: " Héllo 🎉 world"}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 2 * len(ids)
    answer = call.render([chunks_of(ids), chunks_of(ids)])
    parsed = openai.types.chat.ChatCompletion.model_validate(answer)
    assert list(answer) == VLLM_CHAT
    assert list(answer["choices"][0])[: len(VLLM_CHAT_CHOICE)] == VLLM_CHAT_CHOICE
    assert list(answer["choices"][0]["message"]) == VLLM_CHAT_MESSAGE
    assert parsed.choices[0].message.content == " Héllo 🎉 world"
    assert answer["choices"][0]["token_ids"] == ids  # the EOS is kept in the ids
    logprobs = answer["choices"][0]["logprobs"]["content"]
    assert [e["logprob"] for e in logprobs] == [-0.25] * len(ids)
    assert all(e["top_logprobs"] == [] for e in logprobs)
    assert answer["usage"]["prompt_tokens"] == len(call.requests[0].input_ids)


# -- models ---------------------------------------------------------------------------------


def test_models_list_parses_with_the_openai_sdk() -> None:
    listing = models_list("tiny", 1024)
    model = openai.types.Model.model_validate(listing["data"][0])
    assert model.id == "tiny" and listing["object"] == "list"
    assert listing["data"][0]["max_model_len"] == 1024


# -- SGLang /generate -----------------------------------------------------------------------


def test_generate_accepts_slimes_and_areals_bodies(
    tok: GatewayTokenizer, limits: ProtocolLimits
) -> None:
    # slime/rollout/sglang_rollout.py (THUDM/slime): GenerateState.sampling_params and generate()
    slime = {
        "sampling_params": {
            "temperature": 1.0, "top_p": 0.95, "top_k": -1, "max_new_tokens": 64,
            "stop": ["</answer>"], "stop_token_ids": [2], "skip_special_tokens": False,
            "no_stop_trim": True, "spaces_between_special_tokens": False,
            "custom_params": {"return_top_p_token_ids": True}, "sampling_seed": 7,
        },
        "return_logprob": True,
        "input_ids": [5, 6, 7],
    }  # fmt: skip
    call = parse_generate(slime, {"X-SMG-Routing-Key": "sess-1"}, tok, limits)
    (req,) = call.requests
    assert not call.listed and req.input_ids == (5, 6, 7) and req.session_id == "sess-1"
    assert dict(req.sampling_params) == {
        "temperature": 1.0,
        "top_p": 0.95,
        "top_k": -1,
        "max_new_tokens": 64,
        "stop": ["</answer>"],
        "stop_token_ids": [2],
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "no_stop_trim": True,
        "sampling_seed": 7,
        "return_logprob": True,
    }  # fmt: skip (custom_params are not forwarded)
    assert req.output.include_stop
    # areal/engine/sglang_remote.py (inclusionAI/AReaL): RemoteSGLangEngine.agenerate
    areal = {
        "input_ids": [5, 6, 7, 8],
        "image_data": None,
        "sampling_params": {"top_p": 1.0, "top_k": 100000000, "max_new_tokens": 32,
                            "temperature": 0.0, "stop_token_ids": [], "frequency_penalty": 0.0},
        "return_logprob": True,
        "stream": False,
        "model": "added-by-sglang-router",
    }  # fmt: skip
    (req,) = parse_generate(areal, {}, tok, limits).requests
    assert dict(req.sampling_params) == {
        "top_p": 1.0,
        "top_k": 100000000,
        "max_new_tokens": 32,
        "temperature": 0.0,
        "return_logprob": True,
    }  # fmt: skip (neutral values are left out)
    text = parse_generate({"text": "Hello world"}, {}, tok, limits).requests[0]
    assert text.input_ids == tuple(tok.encode("Hello world"))
    assert text.sampling_params["max_new_tokens"] == 128  # SGLang's default


GENERATE_REFUSALS: list[tuple[dict[str, Any], str, str]] = [
    ({}, "text", "Either text, input_ids or input_embeds should be provided."),
    ({"input_ids": []}, "input_ids", "input_ids cannot be empty."),
    ({"input_ids": [1], "text": "a"}, "input_ids", "not both"),
    ({"input_ids": "abc"}, "input_ids", "must be list"),
    ({"input_ids": [1, 9999]}, "input_ids[1]", "out of the vocabulary"),
    ({"input_ids": [[1], [2, -1]]}, "input_ids[1][1]", "out of the vocabulary"),
    ({"input_ids": [1] * 1024}, "input_ids",
     "The input (1024 tokens) is longer than the model's context length (1024 tokens)."),
    ({"input_ids": [1] * 1000, "sampling_params": {"max_new_tokens": 100}},
     "sampling_params.max_new_tokens", "Requested token count exceeds the model's maximum context"),
    ({"input_ids": [1], "sampling_params": {"foo": 1}}, "sampling_params.foo", "unknown sampling"),
    ({"input_ids": [1], "sampling_params": {"seed": 1}}, "sampling_params.seed",
     "unknown sampling"),
    ({"input_ids": [1], "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p", "at most"),
    ({"input_ids": [1], "sampling_params": {"regex": "a+"}}, "sampling_params.regex", "not served"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}},
     "sampling_params.min_new_tokens", "min_new_tokens must be in [0, max_new_tokens(2)]"),
    ({"input_ids": [1], "sampling_params": 5}, "sampling_params", "must be a JSON object"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params",
     "one object per prompt"),
    ({"input_ids": [[1], [2]], "stream": True}, "stream", "not a batch"),
    ({"input_ids": [1], "sampling_params": {"n": 2}, "stream": True}, "stream", "not a batch"),
    ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob", "boolean"),
    ({"input_ids": [1], "top_logprobs_num": 5}, "top_logprobs_num", "not supported"),
    ({"input_ids": [1], "logprob_start_len": 0}, "logprob_start_len", "input logprobs"),
    ({"input_ids": [1], "image_data": ["x.png"]}, "image_data", "multimodal"),
    ({"input_ids": [1], "return_hidden_states": True}, "return_hidden_states", "not supported"),
    ({"input_ids": [1], "lora_path": "a"}, "lora_path", "not supported"),
    ({"input_ids": [1], "rid": 5}, "rid", "The rid should be a string or a list of strings."),
    ({"input_ids": [[1], [2]], "rid": ["a"]}, "rid", "rids length mismatch"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "field", "message"), GENERATE_REFUSALS)
def test_generate_refuses_a_bad_field_naming_it(
    tok: GatewayTokenizer, limits: ProtocolLimits, body: dict[str, Any], field: str, message: str
) -> None:
    err = refused(parse_generate, body, {}, tok, limits)
    assert err.field == field and message in str(err) and field in str(err)
    assert err.as_sglang() == {"error": {"message": str(err)}}


def test_generate_answer_has_sglangs_fields(tok: GatewayTokenizer, limits: ProtocolLimits) -> None:
    call = parse_generate(
        {"input_ids": [[5, 6], [7]], "sampling_params": {"max_new_tokens": 6, "stop": ["fox"]},
         "return_logprob": [True, False], "rid": "req", "return_text_in_logprobs": True},
        {}, tok, limits,
    )  # fmt: skip
    assert call.listed and [r.rid for r in call.requests] == ["req_0", "req_1"]
    ids = tok.encode(" brown fox jumps", add_special_tokens=False)
    other = tok.encode(" one two three", add_special_tokens=False)
    answers = call.render([chunks_of(ids, finish=None), chunks_of(other, finish="length")])
    assert isinstance(answers, list)
    first, second = answers
    assert list(first) == SGLANG_ANSWER
    assert list(first["meta_info"])[: len(SGLANG_META)] == SGLANG_META
    assert list(first["meta_info"])[len(SGLANG_META) :][:3] == SGLANG_META_FINISHED
    meta = first["meta_info"]
    assert first["text"] == " brown " and meta["finish_reason"] == {
        "type": "stop",
        "matched": "fox",
    }
    assert first["output_ids"] == ids[: len(first["output_ids"])]
    assert tok.decode(first["output_ids"]).endswith("fox")  # the stop string's tokens stay
    assert meta["output_token_logprobs"] == [
        [-0.25, t, tok.token_text(t)] for t in first["output_ids"]
    ]
    assert meta["output_token_logprobs_length"] == len(first["output_ids"])
    assert meta["completion_tokens"] == len(first["output_ids"]) and meta["prompt_tokens"] == 2
    assert meta["weight_version"] == "3"
    assert meta["weight_versions"] == [
        {"version": "3", "start": 0, "end": len(first["output_ids"])}
    ]
    assert meta["rollsafe"]["segments"][0]["group"] == "g0"
    assert second["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert "output_token_logprobs" not in second["meta_info"]
    single = parse_generate(
        {"input_ids": [5], "sampling_params": {"max_new_tokens": 4}}, {}, tok, limits
    )
    eos = next(iter(tok.eos_token_ids))
    answer = single.render([chunks_of([*tok.encode(" Hi", add_special_tokens=False), eos])])
    assert isinstance(answer, dict) and answer["meta_info"]["finish_reason"] == {
        "type": "stop",
        "matched": eos,
    }
    assert answer["text"] == " Hi"


def test_generate_stream_is_cumulative_and_ends_with_done(
    tok: GatewayTokenizer, limits: ProtocolLimits
) -> None:
    call = parse_generate(
        {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 20, "stop": "lazy"},
         "return_logprob": True, "stream": True},
        {}, tok, limits,
    )  # fmt: skip
    ids = tok.encode(" The quick brown fox jumps over the lazy dog", add_special_tokens=False)
    streamer = call.streamer()
    *tokens, last = chunks_of(ids, split=2)
    data = b"".join(streamer.chunk(0, c) for c in tokens)
    assert streamer.finished() and streamer.stopped_early()  # end the engine request
    data += streamer.chunk(0, last) + streamer.end()  # an engine finish after it adds nothing
    events = sse_events(data)
    previous_text, previous_ids = "", []
    for event in events:
        assert list(event) == SGLANG_ANSWER
        assert event["text"].startswith(previous_text)  # cumulative, never takes text back
        assert event["output_ids"][: len(previous_ids)] == previous_ids
        assert len(event["meta_info"]["output_token_logprobs"]) == len(event["output_ids"])
        previous_text, previous_ids = event["text"], event["output_ids"]
    assert [e["meta_info"]["finish_reason"] for e in events[:-1]] == [None] * (len(events) - 1)
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": "lazy"}
    assert events[-1]["text"] == " The quick brown fox jumps over the "
    assert "weight_versions" in events[-1]["meta_info"]
    assert "weight_versions" not in events[0]["meta_info"]


# -- sessions -------------------------------------------------------------------------------


def test_sessions_idle_past_their_ttl_are_forgotten_without_being_looked_up(
    tok: GatewayTokenizer, limits: ProtocolLimits, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A conversation that ends is never looked up again: its turns go once idle past the TTL,
    when a later turn of any session is stored (they stayed until ``max_sessions``, 100,000,
    newer ones pushed them out: an hour of the soak's traffic kept every one)."""
    import rollsafe.gateway.sessions as sessions_mod
    from rollsafe.gateway.app import GatewayCounters

    clock = [1000.0]
    monkeypatch.setattr(sessions_mod.time, "monotonic", lambda: clock[0])
    store = sessions_mod.SessionStore(100, 60.0, limits.max_model_len)
    counters = GatewayCounters()
    eos = next(iter(tok.eos_token_ids))
    reply = [*tok.encode(" hello", add_special_tokens=False), eos]

    def turn(session: str) -> None:
        body = {"messages": [{"role": "user", "content": f"hi from {session}"}]}
        call = store.reuse(parse_chat(body, {"x-session-id": session}, tok, limits), tok, counters)
        store.remember(call, [chunks_of(reply)], tok)

    for name in ("a", "b", "c"):  # three conversations' one turn each, 25 s apart
        turn(name)
        clock[0] += 25.0
    assert len(store) == 3  # at t=75 s: a is 75 s old but nothing was stored since t=50
    turn("d")  # t=75: a (idle 75 s) goes; b (50 s) and c (25 s) stay
    assert len(store) == 3 and store._get("a") is None and store._get("b") is not None
    clock[0] += 100.0
    turn("e")  # every earlier one is past the TTL now
    assert len(store) == 1 and store._get("e") is not None
