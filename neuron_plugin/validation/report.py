"""The validation report: what a user attaches to a bug, as JSON (schema below, from
these models: `ValidationReport.model_json_schema()`) and as Markdown."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Status = Literal["pass", "fail", "refused", "not-configured"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CaseResult(_Strict):
    """One named case of the feature matrix."""

    name: str
    status: Status
    detail: str = Field(description="what was checked, or what went wrong and where")
    evidence: dict[str, Any] = Field(default_factory=dict)
    inputs: list[dict[str, Any]] | None = Field(
        default=None,
        description="a failing case's requests (prompt token ids, sampling, adapter), "
        "to reproduce it",
    )
    seconds: float | None = None


class BucketLatency(_Strict):
    """One compiled graph's forward time, beside what reading HBM alone would take."""

    phase: str
    shape: list[int] = Field(
        description="[batch, seq] or [active, prefix] as compiled; [patches] of a vision bucket"
    )
    p50_ms: float
    roofline_ms: float | None = Field(
        default=None,
        description="token generation: (weights + the bucket's KV cache) per NeuronCore "
        "/ the core's HBM bandwidth",
    )
    ratio: float | None = Field(default=None, description="p50_ms / roofline_ms")


class Speed(_Strict):
    buckets: list[BucketLatency]
    decode_host_share: float | None = Field(
        default=None,
        description="of the decode steps served during the cases: host time / step time",
    )
    hbm_bytes_per_s_per_core: float | None = None
    note: str = ""


class ValidationReport(_Strict):
    """`neuron-plugin validate`'s report (schema version 1)."""

    schema_version: Literal[1] = 1
    ok: bool = Field(description="no case failed")
    created: str = Field(description="UTC, ISO 8601")
    model: str
    command: list[str] = Field(
        description="the arguments validate ran with: the model, vllm serve's flags, its own"
    )
    backend: str
    instance_type: str | None
    visible_cores: list[int] | None
    versions: dict[str, str | None] = Field(
        description="plugin, git commit, vLLM (and its build), torch, transformers; with "
        "the nxd backend NxDI, NxD, torch-neuronx and neuronx-cc of the backend's "
        "environment"
    )
    nxdi: dict[str, Any] | None = Field(
        default=None,
        description="with the nxd backend: the installed NxDI (`installed`), the release the "
        "plugin was checked on that it belongs to (`checked_release`, null: none), the "
        "host's chip target (`instance_family`), the release that family runs "
        "(`family_runs`) and whether the installed one supports it (`supports_family`)",
    )
    settings: dict[str, Any] = Field(description="the resolved Neuron settings")
    compile_cache_key: str | None
    oracle: dict[str, Any] = Field(description="the oracle's interpreter, dtype, versions")
    cases: list[CaseResult]
    speed: Speed | None = None
    seconds: float

    def _nxdi_lines(self) -> list[str]:
        if self.nxdi is None:
            return []
        checked = self.nxdi["checked_release"] or "not a release the plugin was checked on"
        family = self.nxdi["instance_family"] or "this host"
        support = "" if self.nxdi["supports_family"] else " (does not support it)"
        return [
            f"- NxDI: {self.nxdi['installed']}{support}, {checked}; {family} runs "
            f"{self.nxdi['family_runs']}"
        ]

    def markdown(self) -> str:
        """The report as Markdown, failing cases first."""
        verdict = "PASS" if self.ok else "FAIL"
        instance = self.instance_type or "not an EC2 Neuron instance"
        lines = [
            f"# neuron-plugin validate: {verdict}",
            "",
            f"- model: `{self.model}`",
            f"- command: `neuron-plugin validate {' '.join(self.command)}`",
            f"- backend: {self.backend}; instance: {instance}; cores: {self.visible_cores}",
            f"- compile-cache key: `{self.compile_cache_key}`",
            "- versions: " + ", ".join(f"{k} {v}" for k, v in self.versions.items() if v),
            *self._nxdi_lines(),
            f"- oracle: {', '.join(f'{k} {v}' for k, v in self.oracle.items())}",
            f"- {self.created}, {self.seconds:.0f} s",
            "",
            "| case | result | detail |",
            "|---|---|---|",
        ]
        order = {"fail": 0, "refused": 1, "pass": 2, "not-configured": 3}
        for case in sorted(self.cases, key=lambda c: order[c.status]):
            lines.append(f"| {case.name} | {case.status} | {_cell(case.detail)} |")
        failing = [c for c in self.cases if c.status == "fail"]
        for case in failing:
            lines += ["", f"## {case.name}: inputs", "", "```json", _json(case.inputs), "```"]
        if self.speed is not None:
            lines += [
                "",
                "## Speed",
                "",
                self.speed.note,
                "",
                "| phase | shape | p50 ms | HBM roofline ms | p50 / roofline |",
                "|---|---|---|---|---|",
            ]
            for b in self.speed.buckets:
                roof = f"{b.roofline_ms:.3f}" if b.roofline_ms is not None else "n/a"
                ratio = f"{b.ratio:.2f}" if b.ratio is not None else "n/a"
                lines.append(f"| {b.phase} | {b.shape} | {b.p50_ms:.3f} | {roof} | {ratio} |")
            if self.speed.decode_host_share is not None:
                lines += ["", f"Decode steps' host share: {self.speed.decode_host_share:.1%}"]
        return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _json(value: Any) -> str:
    import json

    return json.dumps(value, indent=1)
