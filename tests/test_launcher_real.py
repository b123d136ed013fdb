"""EngineSpec / EngineLauncher for real engines: ``kind="sglang"`` and ``kind="vllm"``.

The argv and environment built for each kind are checked flag by flag against the flags of the
pinned upstream releases (data below, read from their sources). The readiness path of real
engines (HTTP polling, no ready line) runs against real processes: rollsafe's reference engine
started through a small translating wrapper (``EngineSpec.executable``) that takes the real
SGLang / vLLM command line and hides the reference engine's ready line from stdout, and
scripts that exit early or never become healthy. Every test checks nothing is left running.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("httpx")

import httpx
from engine_helpers import all_gone, tiny_model_dir, wait_for  # noqa: F401  (fixture)

from rollsafe.adapters.engines import (
    EngineLauncher,
    EngineNotSupported,
    EngineSpec,
    EngineStartError,
    EngineStartTimeout,
    SGLangClient,
    VLLMClient,
)
from rollsafe.adapters.engines.launch.spec import API_KEY_FILE_PLACEHOLDER
from rollsafe.adapters.engines.vllm_cpu import (
    ROLLSAFE_GLOO_BACKEND,
    VLLM_LEGACY_SERVER_MODULE,
    VLLM_SERVER_MODULE,
    available_cores,
    deal_cores,
    vllm_server_module,
)

# ------------------------------------------------------------------------- upstream flag data
# "flag": (takes a value?, allowed values or None). Only flags the launcher emits or documents.
#
# sglang 0.5.23 (`python -m sglang.launch_server`): ServerArgs fields in
# sglang/srt/arg_groups/fields/{model,parallel,serving,exec_}.py, which
# sglang/srt/arg_groups/arg_utils.py:add_cli_args_from_dataclass turns into `--field-name`
# (bool fields: store_true; `Arg(aliases=...)` adds aliases); `--config` (a YAML file whose keys
# are merged in as flags, sglang/srt/utils/server_args_config_parser.py) is registered by hand in
# sglang/srt/server_args.py. Load formats: LOAD_FORMAT_CHOICES, sglang/srt/arg_groups/choices.py.
SGLANG_LOAD_FORMATS = (
    "auto",
    "pt",
    "safetensors",
    "instanttensor",
    "npcache",
    "dummy",
    "sharded_state",
    "presharded",
    "gguf",
    "expert_pack",
    "bitsandbytes",
    "mistral",
    "layered",
    "flash_rl",
    "remote",
    "remote_instance",
    "fastsafetensors",
    "private",
    "runai_streamer",
)
SGLANG_FLAGS: dict[str, tuple[bool, tuple[str, ...] | None]] = {
    "--model-path": (True, None),  # fields/model.py, alias --model
    "--model": (True, None),
    "--load-format": (True, SGLANG_LOAD_FORMATS),  # fields/model.py
    "--trust-remote-code": (False, None),  # fields/model.py
    "--tp-size": (True, None),  # fields/parallel.py, alias --tensor-parallel-size
    "--tensor-parallel-size": (True, None),
    "--tokenizer-path": (True, None),  # fields/serving.py
    "--host": (True, None),  # fields/serving.py
    "--port": (True, None),  # fields/serving.py
    "--skip-server-warmup": (False, None),  # fields/serving.py
    "--api-key": (True, None),  # fields/serving.py
    "--admin-api-key": (True, None),  # fields/serving.py
    "--served-model-name": (True, None),  # fields/serving.py
    "--weight-version": (True, None),  # fields/serving.py
    "--enable-memory-saver": (False, None),  # fields/exec_.py
    "--enable-weights-cpu-backup": (False, None),  # fields/exec_.py
    "--config": (True, None),  # server_args.py
    # a group over several nodes: fields/parallel.py's dist_init_addr (alias --nccl-init-addr),
    # nnodes and node_rank
    "--dist-init-addr": (True, None),
    "--nnodes": (True, None),
    "--node-rank": (True, None),
}
# vllm 0.33.0 (`vllm serve MODEL`; the console script is vllm.entrypoints.cli.main:main):
# the positional `model_tag` and the FrontendArgs fields host / port / api_key
# (`--{name.replace('_', '-')}`) in vllm/entrypoints/common/cli_args.py (0.33.0 has no
# vllm/entrypoints/openai/cli_args.py); engine flags from the add_argument calls of
# vllm/engine/arg_utils.py (`--enable-sleep-mode` is an argparse.BooleanOptionalAction;
# `--weight-transfer-config` is parsed as JSON into WeightTransferConfig); load formats:
# LoadFormats, vllm/model_executor/model_loader/__init__.py.
VLLM_LOAD_FORMATS = (
    "auto",
    "hf",
    "dummy",
    "fastsafetensors",
    "instanttensor",
    "ipc_cache",
    "mistral",
    "modelexpress",
    "npcache",
    "pt",
    "runai_streamer",
    "runai_streamer_sharded",
    "safetensors",
    "sharded_state",
    "tensorizer",
)
VLLM_FLAGS: dict[str, tuple[bool, tuple[str, ...] | None]] = {
    "--model": (True, None),  # engine/arg_utils.py (the API server module has no positional)
    "--host": (True, None),  # entrypoints/common/cli_args.py FrontendArgs
    "--port": (True, None),
    "--api-key": (True, None),
    "--tokenizer": (True, None),  # engine/arg_utils.py
    "--seed": (True, None),
    "--served-model-name": (True, None),
    "--enable-sleep-mode": (False, None),
    "--no-enable-sleep-mode": (False, None),
    "--load-format": (True, VLLM_LOAD_FORMATS),
    "--tensor-parallel-size": (True, None),
    "-tp": (True, None),
    "--weight-transfer-config": (True, None),
    "--dtype": (True, ("auto", "bfloat16", "float", "float16", "float32", "half")),
    "--max-model-len": (True, None),
    "--kv-cache-memory-bytes": (True, None),
    "--enforce-eager": (False, None),
    # a group over several nodes (the mp backend): engine/arg_utils.py's --master-addr,
    # --master-port, --nnodes (-n), --node-rank (-r); --headless (store_true) in
    # entrypoints/common/cli_args.py, acted on by `vllm serve` only (entrypoints/cli/serve.py
    # run_headless: "Run headless workers (for multi-node PP/TP)"); the API server module
    # parses it and starts a server anyway, so workers run `vllm serve`
    "--master-addr": (True, None),
    "--master-port": (True, None),
    "--nnodes": (True, None),
    "--node-rank": (True, None),
    "--headless": (False, None),
}
# vllm-cpu 0.32.0, what the launcher starts on CPU (`python -m
# vllm.entrypoints.launchers.api_server.entry`, whose main() builds the parser with
# make_arg_parser, vllm/entrypoints/launchers/cli_args.py): FrontendArgs host / port / api_key in
# that same file (0.32.0 has no vllm/entrypoints/common/cli_args.py); engine flags from
# vllm/engine/arg_utils.py: --model, --tokenizer, --dtype (choices: ModelDType), --max-model-len,
# --enforce-eager and --enable-sleep-mode (BooleanOptionalAction), --load-format,
# --tensor-parallel-size / -tp, --kv-cache-memory-bytes, --weight-transfer-config (JSON into
# WeightTransferConfig, whose backend is any string: "Validated against the
# WeightTransferEngineFactory registry at engine creation time", vllm/config/weight_transfer.py).
# The real_vllm test in tests/test_launcher_vllm_real.py parses the same argv with the installed
# 0.32.0 parser itself.
VLLM_032_FLAGS: dict[str, tuple[bool, tuple[str, ...] | None]] = {
    "--model": (True, None),
    "--host": (True, None),
    "--port": (True, None),
    "--api-key": (True, None),
    "--tokenizer": (True, None),
    "--dtype": (True, ("auto", "bfloat16", "float", "float16", "float32", "half")),
    "--max-model-len": (True, None),
    "--enforce-eager": (False, None),
    "--enable-sleep-mode": (False, None),
    "--load-format": (True, ("auto", "hf", "dummy", "safetensors", "pt", "npcache")),
    "--tensor-parallel-size": (True, None),
    "--kv-cache-memory-bytes": (True, None),
    "--weight-transfer-config": (True, None),
    # the same multi-node flags: arg_utils.py's --master-addr / --master-port / --nnodes /
    # --node-rank, launchers/cli_args.py's --headless (run by entrypoints/cli/serve.py)
    "--master-addr": (True, None),
    "--master-port": (True, None),
    "--nnodes": (True, None),
    "--node-rank": (True, None),
    "--headless": (False, None),
}
# vllm/envs.py (0.32.0): VLLM_TARGET_DEVICE, VLLM_CPU_OMP_THREADS_BIND ("auto", "nobind" or one
# "|"-separated core list per rank, vllm/utils/ompmultiprocessing.py), VLLM_CPU_KVCACHE_SPACE
# (GiB; vllm/platforms/cpu.py lets it override --kv-cache-memory-bytes, so the launcher drops an
# inherited one).
VLLM_CPU_ENV = ("VLLM_TARGET_DEVICE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")
# vllm/config/weight_transfer.py: WeightTransferConfig has one field, `backend`.
VLLM_WEIGHT_TRANSFER_FIELDS = {"backend"}
VLLM_WEIGHT_TRANSFER_BACKENDS = ("nccl", "ipc", "sparse_nccl", "sharded_rdt", "nccl_m2n")
# vllm/envs.py: VLLM_SERVER_DEV_MODE is bool(int(value)) (mounts the RL / dev routes,
# vllm/entrypoints/launchers/api_server/routers.py); VLLM_API_KEY is used when --api-key is not
# given (vllm/entrypoints/serve/middleware/register.py).
VLLM_ENV = ("VLLM_SERVER_DEV_MODE", "VLLM_API_KEY")

KEY = "s3cret-key-rollsafe"


def check_flags(
    args: list[str], flags: dict[str, tuple[bool, tuple[str, ...] | None]]
) -> dict[str, str | None]:
    """Walk ``args`` (flags only) against ``flags``; return {flag: value or None}."""
    seen: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        flag = args[i]
        assert flag in flags, f"{flag!r} is not an upstream flag"
        takes_value, choices = flags[flag]
        value = None
        if takes_value:
            assert i + 1 < len(args), f"{flag} needs a value"
            value = args[i + 1]
            assert not value.startswith("--"), f"{flag} has no value"
            if choices is not None:
                assert value in choices, f"{flag} {value!r} not in upstream choices"
            i += 1
        assert flag not in seen, f"{flag} given twice"
        seen[flag] = value
        i += 1
    return seen


# ------------------------------------------------------------------------- argv and env
def test_sglang_argv_flag_by_flag() -> None:
    spec = EngineSpec(
        model_path="/models/m",
        kind="sglang",
        ranks=2,
        port=31000,
        load_format="dummy",
        tokenizer_path="/models/tok",
        weight_version="7",
        release_memory=True,
        api_key=KEY,
        extra_args=("--skip-server-warmup",),
        python="/venv/bin/python",
    )
    assert spec.dialect == "sglang" and spec.real
    cmd = spec.command(api_key_file="/run/key.yaml")
    assert cmd == [
        "/venv/bin/python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/m",
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--tp-size",
        "2",
        "--load-format",
        "dummy",
        "--tokenizer-path",
        "/models/tok",
        "--weight-version",
        "7",
        "--enable-memory-saver",
        "--config",
        "/run/key.yaml",
        "--skip-server-warmup",
    ]
    seen = check_flags(cmd[3:], SGLANG_FLAGS)
    assert seen["--load-format"] == "dummy" and seen["--tp-size"] == "2"
    assert KEY not in " ".join(cmd)  # the key is in the --config file, not in `ps`
    assert spec.command()[-2] == API_KEY_FILE_PLACEHOLDER
    env = spec.environment()
    assert env.get("VLLM_SERVER_DEV_MODE") == os.environ.get("VLLM_SERVER_DEV_MODE")

    plain = EngineSpec(model_path="/m", tokenizer_path="/m", kind="sglang")
    args = plain.command(port=4242)[3:]
    assert check_flags(args, SGLANG_FLAGS) == {
        "--model-path": "/m",
        "--host": "127.0.0.1",
        "--port": "4242",
        "--tp-size": "1",
        "--load-format": "auto",
    }  # no memory saver unless asked: it needs the torch_memory_saver package


def test_a_group_over_two_nodes_starts_each_slice_with_the_upstream_multi_node_flags() -> None:
    """SGLang: every node runs ``sglang.launch_server`` with ``--nnodes --node-rank
    --dist-init-addr`` (``--tp-size`` the whole group's); vLLM: the head runs the API server
    with ``--nnodes --node-rank 0 --master-addr --master-port``, every other node ``vllm serve
    ... --headless`` (no API server). Flag by flag against the pinned releases' flags."""
    from rollsafe.adapters.engines.launch.spec import VLLM_CLI_MODULE, slice_spec

    sglang = EngineSpec(model_path="/m", kind="sglang", ranks=4, ranks_per_node=2, python="/py")
    for node_rank in (0, 1):
        cmd = slice_spec(sglang, node_rank, "10.0.0.5:25000", "k").command(port=30000)
        assert cmd[:3] == ["/py", "-m", "sglang.launch_server"]
        seen = check_flags(cmd[3:], SGLANG_FLAGS)
        assert seen["--tp-size"] == "4" and seen["--nnodes"] == "2"
        assert seen["--node-rank"] == str(node_rank)
        assert seen["--dist-init-addr"] == "10.0.0.5:25000"
        assert "k" not in cmd  # the reference engine's group key is no SGLang flag

    vllm = EngineSpec(
        model_path="/m", kind="vllm", ranks=4, ranks_per_node=2, python="/py", device="cuda"
    )
    head = slice_spec(vllm, 0, "10.0.0.5:29501", "k").command(port=8000)
    worker = slice_spec(vllm, 1, "10.0.0.5:29501", "k").command(port=8000)
    assert head[:3] == ["/py", "-m", VLLM_SERVER_MODULE]  # "/py" has no vLLM to ask
    assert worker[:4] == ["/py", "-m", VLLM_CLI_MODULE, "serve"]
    for cmd, node_rank in ((head[3:], 0), (worker[4:], 1)):
        seen = check_flags(cmd, VLLM_FLAGS)
        assert seen["--tensor-parallel-size"] == "4" and seen["--nnodes"] == "2"
        assert seen["--node-rank"] == str(node_rank)
        assert (seen["--master-addr"], seen["--master-port"]) == ("10.0.0.5", "29501")
        assert ("--headless" in seen) == (node_rank == 1)
    cpu = EngineSpec(model_path="/m", kind="vllm", ranks=2, ranks_per_node=1, python="/py")
    seen = check_flags(
        slice_spec(cpu, 1, "[::1]:29501", "k").command(port=8000)[4:], VLLM_032_FLAGS
    )
    assert (seen["--master-addr"], seen["--master-port"], seen["--node-rank"]) == (
        "::1",
        "29501",
        "1",
    )


def test_vllm_argv_and_env_flag_by_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "inherited")
    spec = EngineSpec(
        model_path="/models/m",
        kind="vllm",
        ranks=4,
        port=8001,
        load_format="dummy",
        tokenizer_path="/models/tok",
        api_key=KEY,
        python="/venv/bin/python",
        host="0.0.0.0",
        env={"EXTRA": "1"},
        device="cuda",
    )
    assert spec.dialect == "vllm" and not spec.on_cpu
    cmd = spec.command()
    assert cmd == [
        "/venv/bin/python",
        "-m",
        "vllm.entrypoints.launchers.api_server.entry",
        "--model",
        "/models/m",
        "--host",
        "0.0.0.0",
        "--port",
        "8001",
        "--tensor-parallel-size",
        "4",
        "--load-format",
        "dummy",
        "--tokenizer",
        "/models/tok",
        "--enable-sleep-mode",
        "--weight-transfer-config",
        '{"backend":"nccl"}',
    ]
    seen = check_flags(cmd[3:], VLLM_FLAGS)
    transfer = json.loads(str(seen["--weight-transfer-config"]))
    assert set(transfer) <= VLLM_WEIGHT_TRANSFER_FIELDS
    assert transfer["backend"] in VLLM_WEIGHT_TRANSFER_BACKENDS
    assert KEY not in " ".join(cmd)
    env = spec.environment()
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and bool(int(env["VLLM_SERVER_DEV_MODE"]))
    assert env["VLLM_API_KEY"] == KEY and env["EXTRA"] == "1"
    assert spec.client_url(8001) == "http://127.0.0.1:8001"
    assert set(VLLM_ENV) <= set(env)
    assert "VLLM_TARGET_DEVICE" not in env or env["VLLM_TARGET_DEVICE"] == os.environ.get(
        "VLLM_TARGET_DEVICE"
    )  # an accelerator: no CPU variables

    # no key: an inherited VLLM_API_KEY would lock the launcher's client out
    bare = EngineSpec(
        model_path="/m",
        kind="vllm",
        release_memory=False,
        device="cuda",
        weight_transfer_backend="ipc",
        executable=("vllm", "serve"),
    )
    assert "VLLM_API_KEY" not in bare.environment()
    cmd = bare.command(port=9)
    assert cmd[:4] == ["vllm", "serve", "--model", "/m"] and "--enable-sleep-mode" not in cmd
    assert "--tokenizer" not in cmd  # only when it differs from the model
    seen = check_flags(cmd[2:], VLLM_FLAGS)
    assert json.loads(str(seen["--weight-transfer-config"])) == {"backend": "ipc"}
    assert EngineSpec(model_path="/m", kind="vllm", host="::").client_url(5) == "http://[::1]:5"


def test_vllm_cpu_argv_and_env_against_0_32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")  # would override --kv-cache-memory-bytes
    spec = EngineSpec(
        model_path="/models/m",
        kind="vllm",
        ranks=2,
        port=8002,
        max_model_len=512,
        python="/venv/bin/python",
        cpu_cores=(0, 1),
    )
    assert spec.device == "cpu" and spec.on_cpu and spec.cpu_cores == (0, 1)
    cmd = spec.command()
    assert cmd == [
        "/venv/bin/python",
        "-m",
        "vllm.entrypoints.launchers.api_server.entry",
        "--model",
        "/models/m",
        "--host",
        "127.0.0.1",
        "--port",
        "8002",
        "--tensor-parallel-size",
        "2",
        "--load-format",
        "auto",
        "--max-model-len",
        "512",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(256 << 20),
        "--weight-transfer-config",
        '{"backend":"rollsafe_gloo"}',
    ]
    seen = check_flags(cmd[3:], VLLM_032_FLAGS)
    assert "--enable-sleep-mode" not in seen  # vLLM refuses sleep mode on CPU
    assert json.loads(str(seen["--weight-transfer-config"])) == {"backend": ROLLSAFE_GLOO_BACKEND}
    check_flags(cmd[3:], VLLM_FLAGS)  # and 0.33.0 takes them too
    env = spec.environment()
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"  # one core list per rank
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    assert set(VLLM_CPU_ENV) >= {k for k in env if k.startswith("VLLM_CPU")}

    sized = EngineSpec(
        model_path="/m",
        kind="vllm",
        dtype="bfloat16",
        kv_cache_bytes=1 << 30,
        cpu_cores=[1],
        env={"VLLM_CPU_KVCACHE_SPACE": "2"},
    )
    args = sized.command(port=7)[3:]
    seen = check_flags(args, VLLM_032_FLAGS)
    assert seen["--dtype"] == "bfloat16" and seen["--kv-cache-memory-bytes"] == str(1 << 30)
    assert "--max-model-len" not in seen  # the model's own unless set
    env = sized.environment()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and sized.cpu_cores == (1,)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"  # the spec's own env wins (documented)
    unbound = EngineSpec(model_path="/m", kind="vllm", cpu_cores=())
    assert "VLLM_CPU_OMP_THREADS_BIND" not in unbound.environment()
    assert EngineLauncher(unbound).spec.cpu_cores == ()  # () binds nothing: no core dealt


def test_each_cpu_launcher_gets_its_own_cores() -> None:
    cores = available_cores()
    # consecutive deals walk the host's cores round-robin: every core once, then again
    first = [deal_cores(1)[0] for _ in cores]
    assert sorted(first) == cores
    assert [deal_cores(1)[0] for _ in cores] == first
    spec = EngineSpec(model_path="/m", kind="vllm")
    assert spec.cpu_cores is None and "VLLM_CPU_OMP_THREADS_BIND" not in spec.environment()
    a, b = EngineLauncher(spec), EngineLauncher(spec)  # nothing starts
    assert a.spec.cpu_cores is not None and b.spec.cpu_cores is not None
    assert len(a.spec.cpu_cores) == len(b.spec.cpu_cores) == 1
    if len(cores) >= 2:
        assert a.spec.cpu_cores != b.spec.cpu_cores
    bind = a.spec.environment()["VLLM_CPU_OMP_THREADS_BIND"]
    assert bind == str(a.spec.cpu_cores[0])
    two = EngineLauncher(dataclasses.replace(spec, ranks=2)).spec
    assert two.cpu_cores is not None and len(two.cpu_cores) == 2
    assert two.environment()["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 1
    # an accelerator gets no cores
    assert EngineLauncher(dataclasses.replace(spec, device="cuda")).spec.cpu_cores is None


def test_vllm_entry_point_follows_the_installed_release(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API server module of 0.32+ where it exists, the deprecated one before it."""
    vllm_server_module.cache_clear()
    try:
        assert vllm_server_module(str(tmp_path / "no-python")) == VLLM_SERVER_MODULE
        old = tmp_path / "old" / "vllm"
        (old / "entrypoints" / "openai").mkdir(parents=True)
        (old / "__init__.py").write_text("raise ImportError('never imported')\n")
        monkeypatch.setenv("PYTHONPATH", str(old.parent))
        assert vllm_server_module(sys.executable) == VLLM_LEGACY_SERVER_MODULE
        vllm_server_module.cache_clear()
        entry = old / "entrypoints" / "launchers" / "api_server" / "entry.py"
        entry.parent.mkdir(parents=True)
        entry.write_text("")
        assert vllm_server_module(sys.executable) == VLLM_SERVER_MODULE
    finally:
        vllm_server_module.cache_clear()


def test_reference_stays_the_default() -> None:
    spec = EngineSpec(model_path="/m")
    assert spec.kind == "reference" and spec.dialect == "sglang" and not spec.real
    assert spec.command()[1:3] == ["-m", "rollsafe.adapters.reference_engine"]
    assert EngineSpec(model_path="/m", dialect="vllm").dialect == "vllm"
    env = EngineSpec(model_path="/m", dialect="vllm").environment()
    assert env.get("VLLM_SERVER_DEV_MODE") == os.environ.get("VLLM_SERVER_DEV_MODE")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "sglang", "dialect": "vllm"}, r"kind='sglang' contradicts EngineSpec\.dialect"),
        ({"kind": "vllm", "dialect": "sglang"}, r"kind='vllm' contradicts EngineSpec\.dialect"),
        ({"kind": "tgi"}, r"EngineSpec\.kind must be one of"),
        ({"kind": "sglang", "warm_standby": True}, r"EngineSpec\.warm_standby=True needs kind"),
        ({"kind": "vllm", "fault_injection": True}, r"EngineSpec\.fault_injection=True needs"),
        ({"kind": "vllm", "module": "x.y"}, r"EngineSpec\.module='x\.y' applies to kind"),
        ({"executable": ["x"]}, r"EngineSpec\.executable applies to kind='sglang'"),
        ({"kind": "vllm", "executable": "vllm serve"}, r"EngineSpec\.executable must be a seq"),
        ({"kind": "sglang", "api_key": KEY, "extra_args": ["--config", "c.yaml"]}, r"--config"),
        ({"kind": "vllm", "weight_transfer_backend": ""}, r"weight_transfer_backend"),
        ({"kind": "vllm", "release_memory": True}, r"release_memory=True needs an accel"),
        ({"kind": "vllm", "weight_transfer_backend": "nccl"}, r"'nccl' needs an accelerator"),
        ({"kind": "vllm", "cpu_cores": (0,), "device": "cuda"}, r"cpu_cores applies to dev"),
        ({"kind": "vllm", "cpu_cores": (0, 0), "ranks": 2}, r"cpu_cores names a core twice"),
        ({"kind": "vllm", "cpu_cores": (0, 1, 2), "ranks": 2}, r"cannot be split evenly"),
        ({"kind": "vllm", "cpu_cores": (-1,)}, r"cpu_cores core numbers must be >= 0"),
        ({"kind": "vllm", "cpu_cores": "0"}, r"cpu_cores must be a sequence of core numbers"),
        ({"kind": "vllm", "kv_cache_bytes": 0}, r"kv_cache_bytes must be a positive int"),
        ({"kind": "vllm", "max_model_len": -5}, r"max_model_len must be a positive int"),
        ({"kind": "vllm", "dtype": "fp8"}, r"EngineSpec\.dtype must be one of"),
        ({"kind": "sglang", "max_model_len": 512}, r"max_model_len=512 applies to kind='vllm'"),
        ({"kind": "sglang", "cpu_cores": (0,)}, r"cpu_cores=\(0,\) applies to kind='vllm'"),
    ],
)
def test_contradictions_are_named(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineSpec(model_path="/m", **kwargs)  # type: ignore[arg-type]


def test_kill_rank_is_not_supported_for_real_engines() -> None:
    launcher = EngineLauncher(EngineSpec(model_path="/m", kind="sglang"))
    with pytest.raises(EngineNotSupported, match="kill_rank"):
        launcher.kill_rank(0)


# ------------------------------------------------------------------------- real processes
# Takes a real SGLang / vLLM command line, checks what rollsafe relies on, and execs rollsafe's
# reference engine on it, with its stdout moved to stderr: the ROLLSAFE_READY line is never on
# stdout, so only the HTTP polling can find the engine ready.
SHIM = textwrap.dedent(
    """
    import json, os, sys
    args = sys.argv[1:]
    kind = os.environ["SHIM_KIND"]
    def take(flag, default=None):
        if flag in args:
            i = args.index(flag)
            value = args[i + 1]
            del args[i : i + 2]
            return value
        return default
    out = ["--dialect", kind]
    if kind == "vllm":
        assert os.environ.get("VLLM_SERVER_DEV_MODE") == "1", "no dev mode"
        assert os.environ.get("VLLM_TARGET_DEVICE") == "cpu", "not the CPU build's variables"
        assert os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), "no core binding"
        out += ["--model-path", take("--model"), "--ranks", take("--tensor-parallel-size")]
        tok = take("--tokenizer")
        key = os.environ.get("VLLM_API_KEY")
        assert "--enable-sleep-mode" not in args, "sleep mode on CPU"
        assert take("--weight-transfer-config") == '{"backend":"rollsafe_gloo"}'
        assert take("--dtype") == "float32" and take("--kv-cache-memory-bytes")
        args.remove("--enforce-eager")
    else:
        out += ["--model-path", take("--model-path"), "--ranks", take("--tp-size")]
        tok = take("--tokenizer-path")
        config = take("--config")
        key = json.load(open(config))["api_key"] if config else None
        version = take("--weight-version")
        if version is not None:
            out += ["--weight-version", version]
    out += ["--host", take("--host"), "--port", take("--port"), "--load-format",
            take("--load-format")]
    if tok is not None:
        out += ["--tokenizer-path", tok]
    if key:
        out += ["--api-key", key]
        print("shim got api key", key, file=sys.stderr, flush=True)
    assert not args, f"unexpected arguments {args}"
    os.dup2(2, 1)
    os.execv(sys.executable, [sys.executable, "-m", "rollsafe.adapters.reference_engine", *out])
    """
)


@pytest.fixture
def shim(tmp_path: Path) -> Path:
    path = tmp_path / "real_engine_shim.py"
    path.write_text(SHIM)
    return path


def group(launcher: EngineLauncher) -> list[int]:
    return [launcher.pid, *launcher.descendant_pids()]


def test_sglang_kind_polls_restarts_and_stops(
    tiny_model_dir: Path,  # noqa: F811
    shim: Path,
    tmp_path: Path,
    launchers: list[EngineLauncher],
) -> None:
    spec = EngineSpec(
        model_path=str(tiny_model_dir),
        kind="sglang",
        ranks=2,
        api_key=KEY,
        weight_version="5",
        executable=(sys.executable, str(shim)),
        env={"SHIM_KIND": "sglang"},
        ready_timeout=90.0,
        log_dir=str(tmp_path / "logs"),
    )
    (tmp_path / "logs").mkdir()
    launcher = EngineLauncher(spec)
    launchers.append(launcher)
    launcher.start()
    info = launcher.ready_info
    assert info["kind"] == "sglang" and info["rank_pids"] == [] and info["health_path"] == "/health"
    assert info["info_path"] in ("/model_info", "/get_server_info")  # 404 on the first: fallback
    assert info["weight_version"] == "5"
    assert isinstance(launcher.client, SGLangClient)
    assert launcher.client.is_healthy()
    out = launcher.client.generate(
        input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2, "ignore_eos": True}
    )
    assert len(out.output_ids) == 2  # the client carries the key
    assert httpx.get(launcher.url + info["info_path"], timeout=5).status_code == 401
    cmd = launcher.command()
    key_file = cmd[cmd.index("--config") + 1]
    assert KEY not in " ".join(cmd) and not os.path.exists(key_file)  # read at start, deleted
    log_text = Path(str(launcher.log_path)).read_text()
    assert "[stderr] ROLLSAFE_READY" in log_text and "[stdout] ROLLSAFE_READY" not in log_text
    assert "shim got api key ***" in log_text and KEY not in log_text
    first = group(launcher)
    assert len(first) >= 2  # the server and its rank 1

    launcher.reinit(model_path=str(tiny_model_dir), skip_load_weights=True)
    assert launcher.spec.load_format == "dummy"
    cmd = launcher.command()
    assert cmd[cmd.index("--load-format") + 1] == "dummy"
    assert all_gone(first)
    assert launcher.pid not in first and launcher.client.is_healthy()
    second = group(launcher)

    launcher.stop()
    assert not launcher.started and all_gone(second)
    assert not any(p.name.endswith(".yaml") for p in (tmp_path / "logs").iterdir())


def test_vllm_kind_polls_with_env_key(
    tiny_model_dir: Path,  # noqa: F811
    shim: Path,
    launchers: list[EngineLauncher],
) -> None:
    launcher = EngineLauncher(
        EngineSpec(
            model_path=str(tiny_model_dir),
            kind="vllm",
            api_key=KEY,
            ready_timeout=90.0,
            executable=(sys.executable, str(shim)),
            env={"SHIM_KIND": "vllm"},
        )
    )
    launchers.append(launcher)
    with launcher:
        info = launcher.ready_info
        assert info["info_path"] == "/v1/models" and isinstance(info["info"].get("data"), list)
        assert isinstance(launcher.client, VLLMClient) and launcher.client.is_healthy()
        assert httpx.get(launcher.url + "/v1/models", timeout=5).status_code == 401
        pids = group(launcher)
    assert not launcher.started and all_gone(pids)


def test_early_exit_raises_start_error_with_output_tail(
    tmp_path: Path, launchers: list[EngineLauncher]
) -> None:
    script = tmp_path / "dies.py"
    script.write_text("import sys\nprint('boom: no GPU here', file=sys.stderr)\nsys.exit(3)\n")
    launcher = EngineLauncher(
        EngineSpec(model_path="/m", kind="sglang", executable=(sys.executable, str(script)))
    )
    launchers.append(launcher)
    with pytest.raises(EngineStartError) as info:
        launcher.start()
    err = info.value
    assert not isinstance(err, EngineStartTimeout)
    assert err.exit_code == 3 and "boom: no GPU here" in err.output_tail
    assert "before it answered 200 on /health" in str(err)
    assert err.command == launcher.command() and "--model-path" in err.command
    assert not launcher.started


def test_never_healthy_times_out_with_a_named_error(
    tmp_path: Path, launchers: list[EngineLauncher]
) -> None:
    script = tmp_path / "unhealthy.py"
    script.write_text(
        textwrap.dedent(
            """
            import http.server, os, sys
            port = int(sys.argv[sys.argv.index("--port") + 1])
            open(os.environ["PID_FILE"], "w").write(str(os.getpid()))
            class H(http.server.BaseHTTPRequestHandler):
                def do_GET(self):
                    self.send_response(503)
                    self.end_headers()
                def log_message(self, *a):
                    pass
            print("listening", port, flush=True)
            http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
            """
        )
    )
    launcher = EngineLauncher(
        EngineSpec(
            model_path="/m",
            kind="vllm",
            executable=(sys.executable, str(script)),
            ready_timeout=3.0,
            env={"PID_FILE": str(tmp_path / "pid")},
        )
    )
    launchers.append(launcher)
    with pytest.raises(EngineStartTimeout) as info:
        launcher.start()
    err = info.value
    assert err.exit_code is None and "answered 503" in str(err) and "listening" in err.output_tail
    port = int(err.command[err.command.index("--port") + 1])
    assert port > 0 and f"listening {port}" in err.output_tail  # the port the launcher picked
    assert not launcher.started
    assert all_gone([int((tmp_path / "pid").read_text())])


# A fake vLLM HTTP surface: answers /health and /v1/models, prints every POST (path, body and
# whether it carried the key) and answers POST /update_weight_version with FAKE_STATUS.
FAKE_VLLM = textwrap.dedent(
    """
    import http.server, json, os, sys
    port = int(sys.argv[sys.argv.index("--port") + 1])
    status = int(os.environ["FAKE_STATUS"])
    key = os.environ.get("VLLM_API_KEY")
    class H(http.server.BaseHTTPRequestHandler):
        def answer(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        def do_GET(self):
            self.answer(200, {"object": "list", "data": [{"id": "m"}]})
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"])).decode()
            auth = self.headers.get("Authorization") == f"Bearer {key}"
            print("POST", self.path, body, "auth", auth, flush=True)
            self.answer(status, {"success": status == 200})
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


@pytest.mark.parametrize("status", [200, 404])
def test_vllm_weight_version_is_set_after_start(
    status: int, tmp_path: Path, launchers: list[EngineLauncher]
) -> None:
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    launcher = EngineLauncher(
        EngineSpec(
            model_path="/m",
            kind="vllm",
            api_key=KEY,
            weight_version="9",
            executable=(sys.executable, str(script)),
            env={"FAKE_STATUS": str(status)},
            ready_timeout=20.0,
        )
    )
    launchers.append(launcher)
    if status == 404:  # dev mode off: no such route
        with pytest.raises(EngineStartError, match="VLLM_SERVER_DEV_MODE") as info:
            launcher.start()
        assert not isinstance(info.value, EngineStartTimeout) and not launcher.started
        return
    with launcher:
        assert launcher.ready_info["weight_version"] == "9"

        def posts_seen() -> list[list[str]]:
            lines = [line.split(" ", 3) for line in launcher.output_tail().splitlines()]
            return [p for p in lines if p[:2] == ["[stdout]", "POST"]]

        # the server prints its line before it answers, but the launcher's reader thread may
        # take it off the pipe a moment after the answer arrived
        wait_for(lambda: len(posts_seen()) >= 1, 5)
        posts = posts_seen()
        assert len(posts) == 1 and posts[0][2] == "/update_weight_version"
        body, auth = posts[0][3].rsplit(" auth ", 1)
        assert json.loads(body) == {"new_version": "9"} and auth == "True"
        pid = launcher.pid
    assert all_gone([pid])
