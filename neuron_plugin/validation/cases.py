"""The validation kit's feature matrix: which cases a configuration gets, the requests
each serves, and how each answer is judged against the oracle. Pure: no vLLM, no
backend, no oracle process (`tools/validate.py` serves the requests and asks the oracle;
`validation/oracle.py` is the oracle).

Every case is named, so a report and a bug say which feature failed. A feature the
configuration does not turn on is listed as not configured, naming the flag that turns
it on; nothing is skipped silently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from neuron_plugin.core.neuron_settings import FUSED_METHODS
from neuron_plugin.validation.images import image_sizes
from neuron_plugin.validation.report import CaseResult
from neuron_plugin.validation.statistics import homogeneity

# How far a served log-probability may be from the float32 oracle's, by the served dtype
# (nats): a greedy token within this of the oracle's best is a near tie, not a mismatch.
# Quantized weights are held to their own bound instead (QUANTIZED_LOGPROB_NATS).
TOLERANCE_NATS = {"float32": 0.01, "float16": 0.1, "bfloat16": 0.3}
# The stated bound for quantized weights (the reference backend's own, measured with
# int8 per channel: docs/configuration/quantization.md): teacher-forced along the served
# tokens, the float model's argmax agrees at >= 90% of the positions and each served
# token's log-probability is within 0.3 nats of the float model's.
QUANTIZED_AGREEMENT = 0.9
QUANTIZED_LOGPROB_NATS = 0.3
TOP_LOGPROBS = 5
# The sampled path's distribution: draws of one position at these settings.
SAMPLED = {"temperature": 1.0, "top_k": 20, "top_p": 0.95}


@dataclass(frozen=True)
class ImageLimits:
    """What a vision-language model's configuration fixes for the `images` case."""

    buckets: tuple[int, ...]  # the vision buckets, patches per image
    unit: int  # images grow in squares of this many pixels a side (images.image_sizes)
    unit_patches: int  # patches per such square
    patch_range: tuple[int, int]  # the processor's (min, max) patches per image
    per_prompt: int  # the most images a prompt may hold (--limit-mm-per-prompt)
    placeholder: tuple[int, ...]  # the token ids that stand for one image
    # ids random prompts leave out: the tokenizer's added tokens (the image token among
    # them, which vLLM would take for an image)
    reserved: frozenset[int]
    unit_embeddings: int = 1  # embeddings per square (Llama 4: a tile's, pixel-shuffled)
    # Llama 4: an image of more than one square (tile) gets another, the whole image
    # scaled to one, and each tile a separator token, between image start and end tokens
    global_tile: bool = False

    def sizes(self) -> list[tuple[int, int]]:
        """An image size filling each vision bucket (images.image_sizes)."""
        return image_sizes(
            self.buckets, self.unit, self.unit_patches, self.patch_range, self.global_tile
        )

    def tokens(self, height: int, width: int) -> int:
        """At most the prompt tokens vLLM expands one image of this size into, beyond its
        placeholder's first."""
        units = height * width // self.unit**2
        if not self.global_tile:
            return len(self.placeholder) - 1 + units * self.unit_embeddings
        tiles = units + (units > 1)
        return tiles * (self.unit_embeddings + 1) + 2


@dataclass(frozen=True)
class Limits:
    """What the configuration fixes (from the resolved settings and vLLM's config)."""

    vocab_size: int
    dtype: str
    max_model_len: int
    max_num_seqs: int
    context_encoding_buckets: tuple[int, ...]
    block_size: int
    block_layout: bool
    prefix_caching: bool
    chunked_prefill: bool
    max_num_batched_tokens: int
    on_device_sampling: bool
    speculation: str | None = None
    lora: bool = False
    quantized: bool = False
    # Why this configuration refuses requests the host samples (logprobs, a seed), if it
    # does (core.speculation.host_sampling_refusal).
    host_refusal: str | None = None
    # The k of the prompt-logprob graphs (core.prompt_logprobs), None without them.
    prompt_logprobs: int | None = None
    # A vision-language model's images, None for a text model.
    images: ImageLimits | None = None

    @property
    def tolerance(self) -> float:
        """How far from the float oracle a served log-probability may be (nats)."""
        return max(TOLERANCE_NATS[self.dtype], QUANTIZED_LOGPROB_NATS * self.quantized)

    def describe_tolerance(self) -> str:
        kind = "quantized weights" if self.quantized else self.dtype
        return f"{kind} tolerance of {self.tolerance} nats"


@dataclass(frozen=True)
class Request:
    """One request a case serves: token ids in, SamplingParams' keyword arguments."""

    prompt: list[int]
    sampling: Mapping[str, Any]
    adapter: str | None = None  # a LoRA adapter's folder
    # (seed, height, width) per image (images.image_pixels), in the order of the
    # prompt's placeholders
    images: tuple[tuple[int, int, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        described = {"prompt": self.prompt, "sampling": dict(self.sampling)}
        return {**described, "adapter": self.adapter, "images": [list(i) for i in self.images]}


@dataclass(frozen=True)
class Served:
    """What the engine answered a request: tokens and, where asked, log-probabilities
    (per position: token id -> logprob, the served token's included)."""

    tokens: list[int]
    logprobs: list[dict[int, float]] | None = None
    # prompt positions 1.. (position 0 has none): token id -> logprob, the prompt's own
    # token and the top k; and the top k's ids (ranks 1..k) per position
    prompt_logprobs: list[dict[int, float]] | None = None
    prompt_top: list[list[int]] | None = None
    # the prompt as the engine ran it, where it differs from the request's (each image
    # placeholder expanded to one token per embedding)
    prompt_ids: list[int] | None = None


@dataclass(frozen=True)
class Case:
    """A named case: its requests (served together, as one batch of traffic) and how
    its answers are judged (`judge`: greedy, logprobs, sampled, quantized)."""

    name: str
    feature: str
    requests: list[Request]
    judge: str
    batches: int = 1  # served in this many rounds, the first priming the next (cache)
    evidence: dict[str, Any] = field(default_factory=dict)


def _prompt(rng: np.random.Generator, limits: Limits, length: int) -> list[int]:
    """Random token ids, none of them a vision-language model's reserved ones."""
    if limits.images is None or not limits.images.reserved:
        return rng.integers(0, limits.vocab_size, size=length).tolist()
    allowed = np.setdiff1d(np.arange(limits.vocab_size), sorted(limits.images.reserved))
    return rng.choice(allowed, size=length).tolist()


def greedy(tokens: int) -> dict[str, Any]:
    return {"temperature": 0.0, "max_tokens": tokens, "ignore_eos": True}


def plan(
    limits: Limits,
    new_tokens: int,
    quick: bool,
    adapter: str | None,
    seed: int = 0,
    sample_draws: int = 400,
) -> tuple[list[Case], list[CaseResult]]:
    """The cases this configuration gets, and the features it does not turn on."""
    rng = np.random.default_rng(seed)
    room = limits.max_model_len - new_tokens  # the longest prompt that fits
    cases = [
        _bucket_boundaries(limits, rng, new_tokens, room, quick),
        Case(
            "first-steps-logprobs",
            f"the top-{TOP_LOGPROBS} log-probabilities of the first steps, within the "
            f"{limits.describe_tolerance()}",
            [
                Request(_prompt(rng, limits, n), {**greedy(new_tokens), "logprobs": TOP_LOGPROBS})
                for n in (7, min(room, 61))
            ],
            "logprobs",
        ),
        Case(
            "continuous-batching",
            f"{3 * limits.max_num_seqs} requests of different lengths through "
            f"{limits.max_num_seqs} sequence slots: requests join as others leave",
            [
                Request(
                    _prompt(rng, limits, 5 + 9 * i % max(1, room - 5)),
                    greedy(1 + (i * 5) % (2 * new_tokens)),
                )
                for i in range(3 * limits.max_num_seqs)
            ],
            "greedy",
        ),
        Case(
            "mixed-step",
            "rows sampled on the device and rows with logprobs (sampled on the host) in "
            "the same steps",
            [
                Request(
                    _prompt(rng, limits, 12 + 3 * i),
                    {**greedy(new_tokens), **({"logprobs": 1} if i % 2 else {})},
                )
                for i in range(limits.max_num_seqs)
            ],
            "greedy",
        ),
    ]
    skipped: list[CaseResult] = []
    draws = sample_draws * 3 // 10 if quick else sample_draws
    if limits.on_device_sampling:
        prompt = _prompt(rng, limits, 16)
        device = [Request(prompt, {**SAMPLED, "max_tokens": 1}) for _ in range(draws)]
        host = [Request(prompt, {**SAMPLED, "max_tokens": 1, "seed": i}) for i in range(draws)]
        cases.append(
            Case(
                "device-sampling",
                f"{draws} draws of the on-device sampler against {draws} of vLLM's host "
                f"sampler (a seed sends a request there) at T {SAMPLED['temperature']}, top-k "
                f"{SAMPLED['top_k']}, top-p {SAMPLED['top_p']}: one distribution (chi-square, "
                f"significance 0.001)",
                device + host,
                "sampled",
            )
        )
    else:
        skipped.append(
            _not_configured(
                "device-sampling",
                "on-device sampling is off",
                "leave on_device_sampling_config at its default",
            )
        )
    if limits.prefix_caching:
        cases.append(_prefix_hit(limits, rng, new_tokens, room))
    else:
        skipped.append(
            _not_configured("prefix-cache-hit", "prefix caching is off", "--enable-prefix-caching")
        )
    if limits.chunked_prefill:
        length = min(room, 2 * limits.max_num_batched_tokens + 3)
        cases.append(
            Case(
                "chunked-prefill",
                f"a {length}-token prompt encoded in chunks of at most "
                f"{limits.max_num_batched_tokens} tokens",
                [Request(_prompt(rng, limits, length), greedy(new_tokens))],
                "greedy",
            )
        )
    else:
        skipped.append(
            _not_configured("chunked-prefill", "chunked prefill is off", "--enable-chunked-prefill")
        )
    if limits.prompt_logprobs is not None:
        cases.append(_prompt_scores(limits, rng, room))
    else:
        skipped.append(
            _not_configured(
                "prompt-logprobs",
                "the prompt-logprob graphs are not compiled",
                """--additional-config '{"prompt_logprobs": true}'""",
            )
        )
    if limits.speculation:
        base = _prompt(rng, limits, 8)
        cases.append(
            Case(
                "speculation",
                f"greedy tokens with {limits.speculation} speculation, prompts "
                f"that repeat themselves (where n-gram looks for its drafts)",
                [
                    Request(base * 4, greedy(2 * new_tokens)),
                    Request(_prompt(rng, limits, 20), greedy(new_tokens)),
                ],
                "greedy",
                evidence={"method": limits.speculation},
            )
        )
    else:
        skipped.append(
            _not_configured("speculation", "no --speculative-config", "--speculative-config")
        )
    if limits.lora:
        if adapter is None:
            raise ValueError("LoRA is on: the lora case needs an adapter folder")
        cases.append(
            Case(
                "lora",
                f"an adapter ({adapter}) and the base model in the same steps",
                [
                    Request(
                        _prompt(rng, limits, 10 + i),
                        greedy(new_tokens),
                        adapter if i % 2 == 0 else None,
                    )
                    for i in range(limits.max_num_seqs)
                ],
                "greedy",
            )
        )
    else:
        skipped.append(_not_configured("lora", "LoRA is off", "--enable-lora"))
    if limits.quantized:
        cases.append(
            Case(
                "quantized",
                f"quantized weights against the float model: argmax agreement >= "
                f"{QUANTIZED_AGREEMENT:.0%}, each served token within {QUANTIZED_LOGPROB_NATS} "
                f"nats",
                [
                    Request(
                        _prompt(rng, limits, 12 + 5 * i), {**greedy(3 * new_tokens), "logprobs": 0}
                    )
                    for i in range(4)
                ],
                "quantized",
            )
        )
    else:
        skipped.append(
            _not_configured(
                "quantized",
                "the weights are not quantized",
                'override_neuron_config {"quantized": true, ...}',
            )
        )
    if limits.images is not None:
        cases.append(_images(limits, limits.images, rng, new_tokens, room, quick))
    else:
        skipped.append(
            CaseResult(
                name="images", status="not-configured", detail="a text model: it takes no images"
            )
        )
    if limits.host_refusal is None:
        return cases, skipped
    host_sampled = [c for c in cases if any(_on_host(r) for r in c.requests)]
    skipped += [
        CaseResult(name=c.name, status="refused", detail=limits.host_refusal) for c in host_sampled
    ]
    return [c for c in cases if c not in host_sampled], skipped


def _on_host(request: Request) -> bool:
    """Whether the host samples the request (what the judges ask of some rows)."""
    return "logprobs" in request.sampling or "seed" in request.sampling


def _bucket_boundaries(
    limits: Limits, rng: np.random.Generator, new_tokens: int, room: int, quick: bool
) -> Case:
    """Prompts one short of, at and one past each context-encoding bucket, one token (a
    prefill NxDI routes to token generation), and the longest prompt that fits."""
    buckets = sorted(b for b in limits.context_encoding_buckets if b > 1)
    if quick and len(buckets) > 3:
        buckets = [buckets[0], buckets[len(buckets) // 2], buckets[-1]]
    around = {n for b in buckets for n in (b - 1, b, b + 1)}
    lengths = sorted(n for n in around | {1, room} if 1 <= n <= room)
    return Case(
        "bucket-boundaries",
        f"greedy tokens for prompts at and around each context-encoding bucket "
        f"{buckets}, of one token and of the longest that fits: lengths {lengths}",
        [Request(_prompt(rng, limits, n), greedy(new_tokens)) for n in lengths],
        "greedy",
    )


def _prefix_hit(limits: Limits, rng: np.random.Generator, new_tokens: int, room: int) -> Case:
    shared = max(
        limits.block_size,
        (min(room, 4 * limits.block_size) // limits.block_size - 1) * limits.block_size,
    )
    tail = max(1, min(room - shared, limits.block_size // 2 + 3))
    prefix = _prompt(rng, limits, shared)
    first = Request(prefix + _prompt(rng, limits, tail), greedy(new_tokens))
    second = Request(prefix + _prompt(rng, limits, tail), greedy(new_tokens))
    return Case(
        "prefix-cache-hit",
        f"a prompt sharing its first {shared} tokens ({shared // limits.block_size} "
        f"blocks) with one served before: its cached blocks are read, not recomputed",
        [first, second],
        "greedy",
        batches=2,
        evidence={"shared_tokens": shared},
    )


def _prompt_scores(limits: Limits, rng: np.random.Generator, room: int) -> Case:
    """What lm-evaluation-harness's loglikelihood tasks read: every prompt position's
    logprob of its token and the top k, a short prompt and a long one (in chunks where
    chunked prefill is on)."""
    k = min(TOP_LOGPROBS, limits.prompt_logprobs or 0)
    long = min(room, 2 * limits.max_num_batched_tokens + 3 if limits.chunked_prefill else 61)
    return Case(
        "prompt-logprobs",
        f"the prompt tokens' log-probabilities and the top {k} at every prompt position "
        f"(prompts of 9 and {long} tokens), within the {limits.describe_tolerance()}",
        [Request(_prompt(rng, limits, n), {**greedy(1), "prompt_logprobs": k}) for n in (9, long)],
        "prompt-logprobs",
        evidence={"top_k": k},
    )


def _images(
    limits: Limits,
    images: ImageLimits,
    rng: np.random.Generator,
    new_tokens: int,
    room: int,
    quick: bool,
) -> Case:
    """An image filling each vision bucket (quick: the smallest and the largest), two
    images in one prompt, and a text-only request, served together."""
    sizes = images.sizes()
    if quick and len(sizes) > 2:
        sizes = [sizes[0], sizes[-1]]

    def placed(*shapes: tuple[int, int]) -> Request | None:
        """Text, then each image between text; None if it does not fit the model."""
        prompt, shown = _prompt(rng, limits, 5), []
        tokens = len(prompt)
        for height, width in shapes:
            prompt += [*images.placeholder, *_prompt(rng, limits, 4)]
            shown.append((int(rng.integers(2**31)), height, width))
            tokens += 4 + images.tokens(height, width)
        return Request(prompt, greedy(new_tokens), images=tuple(shown)) if tokens <= room else None

    shapes: list[tuple[tuple[int, int], ...]] = [(size,) for size in sizes]
    if images.per_prompt >= 2 and sizes:
        shapes.append((sizes[0], sizes[len(sizes) // 2]))
    requests = [r for r in (placed(*s) for s in shapes) if r is not None]
    requests.append(Request(_prompt(rng, limits, 9), greedy(new_tokens)))
    return Case(
        "images",
        f"greedy tokens for prompts with images of {sorted(set(sizes))} pixels (height, "
        f"width), one per vision bucket {list(images.buckets)} they fill, two images in "
        f"one prompt and a text-only prompt in the same steps",
        requests,
        "greedy",
        evidence={"image_sizes": [list(i[1:]) for r in requests for i in r.images]},
    )


def _not_configured(name: str, why: str, flag: str) -> CaseResult:
    return CaseResult(
        name=name, status="not-configured", detail=f"{why}; turn it on with {flag} to validate it"
    )


CASE_NAMES = (
    "bucket-boundaries",
    "first-steps-logprobs",
    "continuous-batching",
    "mixed-step",
    "device-sampling",
    "prefix-cache-hit",
    "chunked-prefill",
    "speculation",
    "lora",
    "quantized",
    "prompt-logprobs",
    "images",
    "kv-transfer",
)


def selected(names: str | None) -> frozenset[str]:
    """`--cases a,b`: the named cases (every one when None); an unknown name is an
    error listing them all."""
    if names is None:
        return frozenset(CASE_NAMES)
    chosen = frozenset(n.strip() for n in names.split(",") if n.strip())
    unknown = sorted(chosen - set(CASE_NAMES))
    if unknown or not chosen:
        raise ValueError(
            f"--cases {names!r}: unknown case {', '.join(unknown) or '(none given)'}; "
            f"choose from {', '.join(CASE_NAMES)}"
        )
    return chosen


# -- judging -------------------------------------------------------------------------
def _drafts(method: str, detail: str, observed: Mapping[str, Any]) -> tuple[str, list[str]]:
    """The speculation case's detail with the drafts vLLM counted, and its problem if a
    drafter that proposes every step (a draft model or an EAGLE head: the fused methods)
    proposed nothing. N-gram drafts only where the text repeats the context, which a
    model's own continuation may never do, so none is no fault of the host's."""
    drafted = observed.get("drafted_tokens", 0)
    accepted = observed.get("accepted_tokens", 0)
    if drafted:
        share = f"{accepted:.0f} of {drafted:.0f} draft tokens accepted ({accepted / drafted:.0%})"
        return f"{detail}; {share}", []
    if method in FUSED_METHODS:
        return detail, [
            f"no draft token was proposed: the {method} drafts never ran, so the tokens "
            f"were checked without speculation"
        ]
    return (
        f"{detail}; no n-gram draft was proposed (this model's continuations never repeated "
        f"the context), so the tokens were checked without speculation",
        [],
    )


def judge(
    case: Case,
    served: Sequence[Served],
    scores: Sequence[Mapping[str, Any] | None],
    tolerance: float,
    observed: Mapping[str, Any],
) -> CaseResult:
    """The case's result from what was served, the oracle's scores (one per request;
    None where the judge needs none) and what the engine observed while the case ran
    (`prefix_hit_tokens`: tokens read from the prefix cache; `drafted_tokens` and
    `accepted_tokens`: speculation's, as vLLM counts them); `tolerance`: `Limits.tolerance`."""
    problems: list[str] = []
    failing: list[int] = []
    for index, (answer, score) in enumerate(zip(served, scores, strict=True)):
        if score is not None and "error" in score:
            problems.append(f"request {index}: the oracle failed: {score['error']}")
            failing.append(index)
            continue
        request_judge = _REQUEST_JUDGES.get(case.judge)
        found = (
            None
            if request_judge is None or score is None
            else request_judge(answer, score, tolerance)
        )
        if found:
            problems.append(f"request {index}: {found}")
            failing.append(index)
    evidence: dict[str, Any] = {
        **case.evidence,
        **observed,
        "requests": len(served),
        "tokens": sum(len(a.tokens) for a in served),
    }
    shared = case.evidence.get("shared_tokens")
    hits = observed.get("prefix_hit_tokens", 0)
    if shared is not None and hits < shared:
        problems.append(
            f"{hits:.0f} tokens came from the prefix cache, not the {shared} shared with "
            f"the earlier prompt"
        )
    detail = case.feature
    if "method" in case.evidence:
        detail, missing = _drafts(case.evidence["method"], detail, observed)
        problems += missing
    if case.judge == "sampled":
        ok, why = _sampled(case, served)
        evidence["test"] = why
        if not ok:
            problems.append(f"the device's draws and the host's differ: {why}")
            device = next(i for i, r in enumerate(case.requests) if not _on_host(r))
            failing += [device, next(i for i, r in enumerate(case.requests) if _on_host(r))]
    if case.judge == "quantized":
        ok, why = _quantized(served, scores)
        evidence["bound"] = why
        if not ok:
            problems.append(why)
    if problems:
        return CaseResult(
            name=case.name,
            status="fail",
            detail="; ".join(problems[:3]),
            evidence=evidence,
            inputs=[case.requests[i].to_dict() for i in failing[:3]] or None,
        )
    return CaseResult(name=case.name, status="pass", detail=detail, evidence=evidence)


def _greedy(answer: Served, score: Mapping[str, Any], tolerance: float) -> str | None:
    """The first served token that is neither the oracle's argmax nor within
    `tolerance` of its log-probability."""
    for position, (token, chosen, best, argmax) in enumerate(
        zip(answer.tokens, score["chosen"], score["best"], score["argmax"], strict=True)
    ):
        if token != argmax and best - chosen > tolerance:
            return (
                f"token {position} is {token}, the oracle's is {argmax} ("
                f"{best - chosen:.3g} nats better than the served one, tolerance "
                f"{tolerance})"
            )
    return None


def _logprobs(answer: Served, score: Mapping[str, Any], tolerance: float) -> str | None:
    """`_greedy`, and every log-probability served within `tolerance` of the oracle's."""
    found = _greedy(answer, score, tolerance)
    if found or answer.logprobs is None:
        return found or "no log-probabilities came back"
    for position, (served, oracle) in enumerate(zip(answer.logprobs, score["of"], strict=True)):
        for token, value in served.items():
            if abs(value - oracle[str(token)]) > tolerance:
                return (
                    f"position {position}: token {token}'s logprob is {value:.4f}, the "
                    f"oracle's {oracle[str(token)]:.4f} (tolerance {tolerance})"
                )
    return None


def _prompt_logprobs(answer: Served, score: Mapping[str, Any], tolerance: float) -> str | None:
    """Every prompt position answered; each served log-probability within `tolerance` of
    the oracle's, and each served top-k token among the oracle's top k up to a near tie
    (at least its k-th best less `tolerance`)."""
    if answer.prompt_logprobs is None or answer.prompt_top is None:
        return "no prompt log-probabilities came back"
    oracle_of, kth = score["prompt_of"], score["prompt_kth"]
    if len(answer.prompt_logprobs) != len(oracle_of):
        return (
            f"{len(answer.prompt_logprobs)} prompt positions answered, the prompt has "
            f"{len(oracle_of)} after its first token"
        )
    for position, (served, top, oracle, floor) in enumerate(
        zip(answer.prompt_logprobs, answer.prompt_top, oracle_of, kth, strict=True), start=1
    ):
        for token, value in served.items():
            expected = oracle[str(token)]
            if abs(value - expected) > tolerance:
                return (
                    f"prompt position {position}: token {token}'s logprob is {value:.4f}, "
                    f"the oracle's {expected:.4f} (tolerance {tolerance})"
                )
        below = [t for t in top if oracle[str(t)] < floor - tolerance]
        if len(top) != score["prompt_k"] or below:
            return (
                f"prompt position {position}: the served top {len(top)} {top} are not the "
                f"oracle's top {score['prompt_k']} (below its k-th best {floor:.4f}: {below})"
            )
    return None


_REQUEST_JUDGES = {"greedy": _greedy, "logprobs": _logprobs, "prompt-logprobs": _prompt_logprobs}


def _sampled(case: Case, served: Sequence[Served]) -> tuple[bool, str]:
    """The device's draws (requests without a seed) against the host's (with one)."""
    tokens: dict[str, list[int]] = {"device": [], "host": []}
    for request, answer in zip(case.requests, served, strict=True):
        tokens["host" if "seed" in request.sampling else "device"] += answer.tokens[:1]
    size = 1 + max(max(t, default=0) for t in tokens.values())
    device, host = (
        np.bincount(np.asarray(tokens[kind], dtype=np.int64), minlength=size)
        for kind in ("device", "host")
    )
    ok, why = homogeneity(device, host)
    distinct = int(np.count_nonzero(device))
    if distinct < 2:
        return False, f"the device drew one token only ({why}): it does not sample"
    return ok, f"{why}; {distinct} distinct device tokens"


def _quantized(
    served: Sequence[Served], scores: Sequence[Mapping[str, Any] | None]
) -> tuple[bool, str]:
    agree = total = 0
    worst = 0.0
    for answer, score in zip(served, scores, strict=True):
        if score is None or "error" in score or answer.logprobs is None:
            return False, "no scores or log-probabilities to judge the bound with"
        for token, argmax, chosen, logprobs in zip(
            answer.tokens, score["argmax"], score["chosen"], answer.logprobs, strict=True
        ):
            total += 1
            agree += token == argmax
            worst = max(worst, abs(logprobs[token] - chosen))
    share = agree / max(1, total)
    ok = share >= QUANTIZED_AGREEMENT and worst <= QUANTIZED_LOGPROB_NATS
    return ok, (
        f"argmax agreement {share:.0%} (>= {QUANTIZED_AGREEMENT:.0%}), largest "
        f"logprob gap {worst:.3f} nats (<= {QUANTIZED_LOGPROB_NATS}) over {total} "
        f"tokens"
    )
