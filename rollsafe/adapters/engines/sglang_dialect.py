"""The SGLang releases ``SGLangClient`` speaks, and what it does where they differ.

Owns :class:`SGLangDialect`: the facts that differ between SGLang 0.5.16 (the newest release
built for the GPU image's torch 2.11) and 0.5.23 (the pinned contract), read from their
committed contracts (``contracts/sglang-<version>.json``, ``"dialect"``; generated from the
wheels by ``tools/upstream_contract.py``). Which contract applies is decided by the server's own
``GET /server_info`` (``"version"``; :func:`rollsafe.adapters.engines.contract.
contract_version_for` matches major.minor.patch for SGLang).

What differs (0.5.16 / 0.5.23):

* ``/generate`` contract gate: none / the generated ``sglang.api.v1`` decoders;
* an unknown ``sampling_params`` key: a ``TypeError`` in the tokenizer manager that
  ``/generate`` does not catch, HTTP **500** / a **400** naming the field. A 500 reads as a
  failing engine to the router's request health, so on 0.5.16 the client refuses such a request
  itself with the 400 0.5.23 answers, nothing sent;
* ``meta_info.weight_versions`` spans on the finished event: absent / present (both report
  ``meta_info.weight_version``, the label when the output was built);
* ``/ready``, ``/begin_weight_update``, ``/end_weight_update``: absent / present (the client
  uses none of them);
* ``SafeUnpickler``: module-prefix allow-list with a deny-list / an allow-list of globals
  (rollsafe's payloads load under both: ``tests/test_sglang_wire.py``);
* stop strings per request: any number / at most 32 (``MAX_STOP_COUNT``).
"""

from __future__ import annotations

from dataclasses import dataclass

from rollsafe.adapters.engines.contract import PINNED_VERSIONS, load_contract

__all__ = ["SGLangDialect"]


@dataclass(frozen=True)
class SGLangDialect:
    """What an SGLang release does differently (the ``"dialect"`` section of its contract)."""

    #: the committed contract this server speaks (``"0.5.16"``, ``"0.5.23"``)
    version: str
    #: what the server's ``/server_info`` said; None when pinned or not reported
    server_version: str | None = None
    #: ``/generate`` decodes the body with the generated contract gate first
    generate_contract_gate: bool = True
    #: the status of a ``/generate`` with an unknown ``sampling_params`` key
    sampling_unknown_key_status: int = 400
    #: ``meta_info.weight_versions`` spans on the finished event
    weight_version_spans: bool = True
    #: the ``sampling_params`` keys the release accepts
    sampling_keys: frozenset[str] = frozenset()
    #: the most stop strings a request may carry (``MAX_STOP_COUNT``); None: no limit
    max_stop_strings: int | None = 32

    @classmethod
    def of(cls, version: str | None = None, server_version: str | None = None) -> SGLangDialect:
        """The dialect of the committed contract ``version`` (the pinned one when None)."""
        contract = load_contract("sglang", version or PINNED_VERSIONS["sglang"])
        facts = contract.data.get("dialect", {})
        return cls(
            version=contract.version,
            server_version=server_version,
            generate_contract_gate=bool(facts.get("generate_contract_gate", True)),
            sampling_unknown_key_status=int(facts.get("sampling_unknown_key_status", 400)),
            weight_version_spans=bool(facts.get("weight_version_spans", True)),
            sampling_keys=contract.sampling_keys(),
            max_stop_strings=contract.data.get("stops", {}).get("max_stop_strings"),
        )
