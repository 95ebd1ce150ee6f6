"""`neuron-plugin validate MODEL [vllm serve flags]`: prove a host, feature by feature,
against an oracle on the same host's CPU.

The configuration `vllm serve` would run is served through the real serving path (vLLM's
engine, the plugin's worker, model runner and backend, in the backend's runner process
where one is configured) and every case of the feature matrix (`validation/cases.py`)
is judged against transformers on the same checkpoint in float32, run in the backend's
environment (`validation/oracle.py`). Then the engine is shut down and each compiled
graph is timed on the backend alone, beside the HBM roofline of the instance. The report
(Markdown and JSON, schema in `validation/report.py`) is what a hardware bug report
attaches; the exit status is 1 when any case fails, 2 for a configuration that cannot
run (its error names the setting and the fix).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from compile_cache import safe_fs
from neuron_plugin import BACKEND_ENV, BACKENDS, plugin_logger
from neuron_plugin.core import nxdi_releases
from neuron_plugin.core.instances import (
    INSTANCE_TYPES,
    detect_instance_type,
    host_visible_core_ids,
    package_version,
)
from neuron_plugin.core.prompt_logprobs import PROMPT_LOGPROBS_KEY
from neuron_plugin.core.settings import NeuronSettings
from neuron_plugin.core.speculation import host_sampling_refusal
from neuron_plugin.core.vision import LLAMA4_MERGE
from neuron_plugin.core.vllm_builds import installed_vllm
from neuron_plugin.tools.serve_args import add_serve_command, engine_args_from_serve_args
from neuron_plugin.tools.validate_backend import speed_report
from neuron_plugin.validation.cases import (
    CASE_NAMES,
    Case,
    ImageLimits,
    Limits,
    Request,
    Served,
    judge,
    plan,
    selected,
)
from neuron_plugin.validation.images import (
    LLAMA4_VISION,
    encode_arrays,
    image_pixels,
    placeholder_ids,
)
from neuron_plugin.validation.oracle_client import OracleProcess
from neuron_plugin.validation.report import CaseResult, ValidationReport
from neuron_plugin.validation.speed import decode_host_share

logger = plugin_logger(__name__)

SCORED = ("greedy", "logprobs", "quantized", "prompt-logprobs")
NXD_DISTRIBUTIONS = (
    "neuronx-distributed-inference",
    "neuronx-distributed",
    "torch-neuronx",
    "neuronx-cc",
)


def _options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("validate")
    group.add_argument(
        "--backend",
        choices=BACKENDS,
        help=f"backend to validate (default: ${BACKEND_ENV}, else what `vllm serve` with "
        f"these flags would use)",
    )
    group.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="where report.json and report.md go (default ./neuron-validate-<UTC time>)",
    )
    group.add_argument(
        "--quick", action="store_true", help="a short subset: three buckets, fewer draws"
    )
    group.add_argument(
        "--new-tokens", type=int, default=12, help="greedy tokens per request (default 12)"
    )
    group.add_argument(
        "--cases",
        metavar="NAME[,NAME]",
        help=f"run only these cases (default: all): {', '.join(CASE_NAMES)}",
    )
    group.add_argument(
        "--lora-adapter",
        metavar="FOLDER",
        help="the PEFT adapter the lora case serves (default: one the kit builds)",
    )
    group.add_argument(
        "--oracle-python",
        metavar="PYTHON",
        help="the oracle's interpreter (default: the backend's, where transformers is)",
    )
    group.add_argument(
        "--oracle-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="float32 unless the host's memory cannot hold the model so",
    )
    group.add_argument(
        "--repeats", type=int, default=10, help="timed calls per compiled graph (default 10)"
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    add_serve_command(
        subparsers,
        "validate",
        run,
        _options,
        "check a `vllm serve` configuration on this host against a CPU oracle, "
        "feature by feature, and time its graphs",
    )


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    options, engine_args = engine_args_from_serve_args(args.argv, args.own_options, prog=args.prog)
    chosen = selected(options.cases)
    if options.new_tokens < 2:
        raise ValueError(
            f"--new-tokens {options.new_tokens}: at least 2 (a token after the prefill)"
        )
    out = output_folder(options.out or Path(f"neuron-validate-{datetime.now(UTC):%Y%m%dT%H%M%SZ}"))
    model = engine_args.model
    refusals = _refusals(engine_args)  # before the engine: probes resolve configurations
    try:
        llm = _engine(engine_args, out)
    except RuntimeError as exc:  # vLLM's "Engine core initialization failed"
        raise ValueError(
            f"the configuration did not start ({exc}); the engine's log above names the "
            f"cause (a backend refusal names the setting and the fix)"
        ) from exc
    vllm_config = llm.llm_engine.vllm_config
    from neuron_plugin.serving.vllm_settings import settings_from_vllm_config

    settings = settings_from_vllm_config(vllm_config)
    python = options.oracle_python or settings.backend_python or sys.executable
    oracle = OracleProcess(python, model, options.oracle_dtype, out / "oracle.log")
    adapter = options.lora_adapter
    if settings.max_loras and adapter is None:
        from neuron_plugin.validation.adapter import build_adapter

        adapter = str(
            build_adapter(
                model,
                out / "adapter",
                settings.lora_target_modules,
                rank=min(8, settings.max_lora_rank),
            )
        )
    limits = _limits(settings, vllm_config, llm)
    cases, results = plan(limits, options.new_tokens, options.quick, adapter)
    cases = [c for c in cases if c.name in chosen]
    results = [_refused(r, refusals) for r in results if r.name in chosen]
    try:
        results += _run_cases(llm, cases, oracle, limits.tolerance, _ImageProcessor(vllm_config))
        share = _decode_host_share(llm, limits, out)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    try:
        speed, key, extra = speed_report(
            settings,
            model,
            options.repeats,
            oracle,
            vllm_config,
            quick=options.quick,
            kv_transfer="kv-transfer" in chosen,
            tolerance=limits.tolerance,
        )
    finally:
        oracle.close()
    results += extra
    instance, versions = detect_instance_type(), _versions(settings)
    report = ValidationReport(
        ok=not any(r.status == "fail" for r in results),
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        model=str(model),
        command=list(args.argv),
        backend=settings.backend,
        instance_type=instance,
        visible_cores=host_visible_core_ids()[0],
        versions=versions,
        nxdi=nxdi_releases.assessment(
            versions.get("neuronx-distributed-inference"),
            INSTANCE_TYPES[instance].chip.target if instance else None,
        )
        if settings.backend == "nxd"
        else None,
        settings=settings.to_dict(),
        compile_cache_key=key,
        oracle={
            "python": python,
            "dtype": options.oracle_dtype,
            "tolerance_nats": limits.tolerance,
        },
        cases=results,
        speed=speed.model_copy(update={"decode_host_share": share}),
        seconds=time.perf_counter() - started,
    )
    write_reports(out, report)
    for result in results:
        print(f"[{result.status:>14}] {result.name}: {result.detail}")
    print(
        f"{'PASS' if report.ok else 'FAIL'}: report in {out / 'report.md'} and "
        f"{out / 'report.json'}"
    )
    return 0 if report.ok else 1


def output_folder(out: Path) -> Path:
    """`--out`, created (mode 0700) if missing. Every file validate writes there is
    written by name (reports, the oracle's log, telemetry, the adapter it builds), so an
    existing folder must be this user's and writable by no group or other user: nobody
    else can then have planted a link where a file goes."""
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.stat(out)
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"--out {out} is not a folder; give a folder (validate creates it)")
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise ValueError(
            f"--out {out} belongs to uid {info.st_uid} with mode "
            f"{oct(info.st_mode & 0o777)}; validate writes its reports there by name, so a "
            f"folder another user may write could redirect them through a link: give a "
            f"folder of this user's (uid {os.geteuid()}) that others cannot write, or a new "
            f"one (validate creates it with mode 0700)"
        )
    return out


def write_reports(out: Path, report: ValidationReport) -> None:
    """report.json and report.md into `out`, never through a link in their place
    (`safe_fs.write_new` replaces one)."""
    safe_fs.write_new(out, ("report.json",), report.model_dump_json(indent=2).encode())
    safe_fs.write_new(out, ("report.md",), report.markdown().encode())


def _engine(engine_args: Any, out: Path) -> Any:
    """vLLM's engine for the parsed `vllm serve` flags, statistics on (prefix-cache hits
    are read from them) and the plugin's telemetry published into `out`."""
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    from neuron_plugin.serving.vllm_settings import TELEMETRY_DIR_KEY

    values = {f.name: getattr(engine_args, f.name) for f in dataclasses.fields(EngineArgs)}
    values["additional_config"] = {
        **(values.get("additional_config") or {}),
        TELEMETRY_DIR_KEY: str(out / "telemetry"),
    }
    values["disable_log_stats"] = False
    return LLM(**values)


# A feature the configuration leaves off -> the engine arguments that turn it on.
_FEATURE_PROBES: dict[str, dict[str, Any]] = {
    "prefix-cache-hit": {"enable_prefix_caching": True},
    "chunked-prefill": {"enable_chunked_prefill": True},
    "speculation": {
        "speculative_config": {
            "method": "ngram",
            "num_speculative_tokens": 2,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        }
    },
    "lora": {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8},
}


def _refusals(engine_args: Any) -> dict[str, str]:
    """Which features this backend and configuration would refuse if they were turned on
    (feature -> the plugin's error), by resolving the configuration with each on."""
    from neuron_plugin.tools.cli import error_message

    additional = engine_args.additional_config or {}
    probes = {
        **_FEATURE_PROBES,
        "prompt-logprobs": {"additional_config": {**additional, PROMPT_LOGPROBS_KEY: True}},
    }
    refused = {}
    for feature, changes in probes.items():
        if all(getattr(engine_args, k) == v for k, v in changes.items()):
            continue  # already on: the feature's case runs
        try:
            dataclasses.replace(engine_args, **changes).create_engine_config()
        except ValueError as exc:
            refused[feature] = error_message(exc)
    return refused


def _refused(result: CaseResult, refusals: dict[str, str]) -> CaseResult:
    """A not-configured feature this backend would refuse, listed as refused, why."""
    why = refusals.get(result.name)
    if why is None or result.status != "not-configured":
        return result
    return result.model_copy(
        update={
            "status": "refused",
            "detail": f"{result.detail}; but this backend refuses it: {why}",
        }
    )


def _limits(settings: NeuronSettings, vllm_config: Any, llm: Any) -> Limits:
    return Limits(
        vocab_size=vllm_config.model_config.get_vocab_size(),
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        context_encoding_buckets=settings.context_encoding_buckets,
        block_size=settings.block_size,
        block_layout=settings.is_block_layout,
        prefix_caching=settings.is_prefix_caching,
        chunked_prefill=settings.is_chunked_prefill,
        max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        on_device_sampling=settings.on_device_sampling,
        speculation=settings.speculation_method,
        lora=settings.max_loras > 0,
        quantized=settings.quantization is not None,
        host_refusal=host_sampling_refusal(
            settings, "the cases with log-probabilities or a seed sample on the host"
        ),
        prompt_logprobs=settings.prompt_logprobs,
        images=_image_limits(settings, vllm_config, llm),
    )


def _image_limits(settings: NeuronSettings, vllm_config: Any, llm: Any) -> ImageLimits | None:
    """A vision-language model's: its vision buckets, how its images grow (patch_size x
    spatial_merge_size pixels a side), the processor's patch range, the images a prompt
    may hold, and its tokenizer's added tokens (random prompts leave them out)."""
    from neuron_plugin.serving.vllm_settings import vision_limits

    model = vllm_config.model_config
    found = vision_limits(model)
    if found is None or not settings.vision_buckets:
        return None
    hf_config = model.hf_config.to_dict()
    vision = hf_config["vision_config"]
    added_vocab = llm.get_tokenizer().get_added_vocab()
    common = {
        "buckets": settings.vision_buckets,
        "patch_range": (found.min_patches, found.max_patches),
        "per_prompt": model.multimodal_config.get_limit_per_prompt("image"),
        "placeholder": placeholder_ids(hf_config, added_vocab),
        "reserved": frozenset(added_vocab.values()),
    }
    if vision.get("model_type") == LLAMA4_VISION:  # images grow in whole tiles
        return ImageLimits(
            unit=int(vision["image_size"]),
            unit_patches=found.step,
            unit_embeddings=found.step // LLAMA4_MERGE**2,
            global_tile=True,
            **common,
        )
    merge = int(vision.get("spatial_merge_size", 1))
    return ImageLimits(unit=int(vision["patch_size"]) * merge, unit_patches=merge * merge, **common)


class _ImageProcessor:
    """The model's image processor, under --mm-processor-kwargs as vLLM runs it: what
    the oracle gets for a request's images (loaded on first use)."""

    def __init__(self, vllm_config: Any):
        model = vllm_config.model_config
        self.model = model.model
        self.kwargs = (
            dict(model.multimodal_config.mm_processor_kwargs or {})
            if (model.is_multimodal_model)
            else {}
        )
        self._processor: Any = None

    def arrays(self, request: Request) -> dict[str, np.ndarray]:
        if self._processor is None:
            from transformers import AutoProcessor

            self._processor = AutoProcessor.from_pretrained(self.model).image_processor
        out = self._processor(images=_pictures(request), return_tensors="pt", **self.kwargs)
        return {name: _as_numpy(value) for name, value in out.items()}


def _as_numpy(value: Any) -> np.ndarray:
    """A processor's output as numpy: bfloat16 (Llama 4's pixel values), which numpy
    has no type for, widened to float32 exactly; the oracle casts to the model's dtype."""
    import torch

    if isinstance(value, torch.Tensor):
        return (value.float() if value.dtype == torch.bfloat16 else value).numpy()
    return np.asarray(value)


def _pictures(request: Request) -> list[Any]:
    """The request's images as vLLM takes them (PIL)."""
    from PIL import Image

    return [Image.fromarray(image_pixels(*image)) for image in request.images]


def _run_cases(
    llm: Any,
    cases: Sequence[Case],
    oracle: OracleProcess,
    tolerance: float,
    processor: _ImageProcessor,
) -> list[CaseResult]:
    from tqdm import tqdm

    results = []
    for case in tqdm(cases, desc="validating", unit="case"):
        started = time.perf_counter()
        try:
            observed: dict[str, Any] = {}
            served = _serve(llm, case, observed)
            scores = [
                _score(oracle, case, r, s, processor)
                for r, s in zip(case.requests, served, strict=True)
            ]
            result = judge(case, served, scores, tolerance, observed)
        except Exception as exc:  # one case's failure is reported; the others still run
            logger.exception("validate: case %s raised", case.name)
            result = CaseResult(
                name=case.name,
                status="fail",
                detail=f"{type(exc).__name__}: {exc}",
                inputs=[r.to_dict() for r in case.requests[:3]],
            )
        results.append(result.model_copy(update={"seconds": time.perf_counter() - started}))
    return results


def _serve(llm: Any, case: Case, observed: dict[str, Any]) -> list[Served]:
    """The case's requests through the engine, in `case.batches` rounds (a later round
    finds what an earlier one cached); prefix-cache hits and drafts counted around them."""
    rounds = np.array_split(np.arange(len(case.requests)), case.batches)
    before = _counters(llm)
    served: list[Served] = []
    for indices in rounds:
        served += _generate(llm, [case.requests[i] for i in indices])
    after = _counters(llm)
    observed.update({key: after[key] - before[key] for key in _COUNTERS})
    return served


def _generate(llm: Any, requests: Sequence[Request]) -> list[Served]:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    adapters: dict[str, int] = {}
    loras: list[LoRARequest | None] = []
    for request in requests:
        if request.adapter is None:
            loras.append(None)
            continue
        ident = adapters.setdefault(request.adapter, len(adapters) + 1)
        loras.append(LoRARequest(f"validate-{ident}", ident, request.adapter))
    outputs = llm.generate(
        [_prompt(r) for r in requests],
        [SamplingParams(**r.sampling) for r in requests],
        lora_request=loras,
        use_tqdm=False,
    )
    served = []
    for request, output in zip(requests, outputs, strict=True):
        completion = output.outputs[0]
        logprobs = None
        if completion.logprobs is not None:
            logprobs = [
                {int(t): float(lp.logprob) for t, lp in step.items()}
                for step in completion.logprobs
            ]
        prompt = output.prompt_logprobs  # [None, {id: Logprob} per position 1..] or None
        k = request.sampling.get("prompt_logprobs") or 0
        served.append(
            Served(
                list(completion.token_ids),
                logprobs,
                None
                if prompt is None
                else [{int(t): float(lp.logprob) for t, lp in s.items()} for s in prompt[1:]],
                None
                if prompt is None
                else [[int(t) for t, lp in s.items() if lp.rank <= k] for s in prompt[1:]],
                list(output.prompt_token_ids) if request.images else None,
            )
        )
    return served


def _prompt(request: Request) -> dict[str, Any]:
    """vLLM's prompt: the token ids and, with images, the pictures its placeholders
    stand for (vLLM's processor expands each placeholder to one token per embedding)."""
    if not request.images:
        return {"prompt_token_ids": request.prompt}
    return {"prompt_token_ids": request.prompt, "multi_modal_data": {"image": _pictures(request)}}


# What `judge` reads from the engine -> vLLM's counter (summed over its engines).
_COUNTERS = {
    "prefix_hit_tokens": "vllm:prefix_cache_hits",
    "drafted_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}


def _counters(llm: Any) -> dict[str, float]:
    metrics = llm.get_metrics()
    return {
        key: sum(getattr(m, "value", 0) for m in metrics if m.name == name)
        for key, name in _COUNTERS.items()
    }


def _score(
    oracle: OracleProcess,
    case: Case,
    request: Request,
    served: Served,
    processor: _ImageProcessor,
) -> dict[str, Any] | None:
    if case.judge not in SCORED:
        return None
    ask: dict[str, Any] = {
        "op": "score",
        "prompt": served.prompt_ids or request.prompt,
        "tokens": served.tokens,
        "adapter": request.adapter,
    }
    if request.images:
        ask["images"] = encode_arrays(processor.arrays(request))
    if case.judge == "logprobs" and served.logprobs is not None:
        ask["of"] = [sorted(step) for step in served.logprobs]
    if case.judge == "prompt-logprobs" and served.prompt_logprobs is not None:
        ask["prompt_of"] = [sorted(step) for step in served.prompt_logprobs]
        ask["prompt_k"] = case.evidence["top_k"]
    return oracle.ask(ask)


def _decode_host_share(llm: Any, limits: Limits, out: Path) -> float | None:
    """The host's share of decode steps: a batch of long greedy requests (mostly decode
    steps) between two telemetry snapshots."""
    before = _snapshot(out)
    rng = np.random.default_rng(7)
    requests = [
        Request(
            rng.integers(0, limits.vocab_size, 16).tolist(),
            {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True},
        )
        for _ in range(limits.max_num_seqs)
    ]
    _generate(llm, requests)
    time.sleep(1.0)  # the engine publishes its counters every 0.5 s
    return decode_host_share(before, _snapshot(out))


def _snapshot(out: Path) -> dict[str, Any] | None:
    files = sorted((out / "telemetry").glob("engine-*.json"))
    return json.loads(files[0].read_text()) if files else None


def _versions(settings: NeuronSettings) -> dict[str, str | None]:
    vllm = installed_vllm(package_version)
    versions: dict[str, str | None] = {
        "plugin": package_version("vllm-neuron-plugin"),
        "git_commit": _git_commit(),
        "vllm": vllm.describe() if vllm else None,
        "torch": package_version("torch"),
        "transformers": package_version("transformers"),
    }
    if settings.backend == "nxd":
        versions.update(_backend_versions(settings.backend_python or sys.executable))
    return versions


def _git_commit() -> str | None:
    source = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        ["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        return None  # an installed package, not a checkout
    return done.stdout.strip()


def _backend_versions(python: str) -> dict[str, str | None]:
    """The NxD packages' versions in the backend's environment (metadata only)."""
    code = (
        "import importlib.metadata as m, json\n"
        "def v(d):\n"
        "    try:\n        return m.version(d)\n"
        "    except m.PackageNotFoundError:\n        return None\n"
        f"print(json.dumps({{d: v(d) for d in {list(NXD_DISTRIBUTIONS)!r}}}))"
    )
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return dict.fromkeys(NXD_DISTRIBUTIONS)
    found: dict[str, str | None] = json.loads(done.stdout)
    return found
