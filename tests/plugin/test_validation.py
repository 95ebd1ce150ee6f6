"""`neuron-plugin validate`'s pure parts (neuron_plugin/validation): which cases a
configuration gets, how answers are judged, the statistics, the roofline, the report, and
the oracle process in the backend's environment against transformers and PEFT."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from neuron_plugin.validation.cases import (
    CASE_NAMES,
    ImageLimits,
    Limits,
    Request,
    Served,
    judge,
    plan,
    selected,
)
from neuron_plugin.validation.report import CaseResult, ValidationReport
from neuron_plugin.validation.speed import bucket_latencies, decode_host_share, roofline_ms
from neuron_plugin.validation.statistics import goodness_of_fit, homogeneity

LIMITS = Limits(vocab_size=1000, dtype="bfloat16", max_model_len=256, max_num_seqs=4,
                context_encoding_buckets=(32, 64, 128, 256), block_size=32,
                block_layout=False, prefix_caching=False, chunked_prefill=False,
                max_num_batched_tokens=256, on_device_sampling=True)


# tiny-qwen2_vl's: images grow in 28-pixel squares of 2x2 patches, 16 to 256 patches
IMAGES = ImageLimits(buckets=(16, 64, 256), unit=28, unit_patches=4, patch_range=(16, 256),
                     per_prompt=2, placeholder=(977, 979, 978),
                     reserved=frozenset(range(970, 1000)))


def _names(cases, skipped) -> tuple[list[str], dict[str, str]]:
    return [c.name for c in cases], {r.name: r.status for r in skipped}


def test_every_feature_is_a_case_or_listed_with_the_flag_that_turns_it_on():
    cases, skipped = plan(LIMITS, new_tokens=8, quick=False, adapter=None)
    names, rest = _names(cases, skipped)
    assert names == ["bucket-boundaries", "first-steps-logprobs", "continuous-batching",
                     "mixed-step", "device-sampling"]
    assert rest == {"prefix-cache-hit": "not-configured", "chunked-prefill": "not-configured",
                    "speculation": "not-configured", "lora": "not-configured",
                    "quantized": "not-configured", "prompt-logprobs": "not-configured",
                    "images": "not-configured"}
    assert set(names) | set(rest) | {"kv-transfer"} == set(CASE_NAMES)
    assert "--enable-prefix-caching" in next(r.detail for r in skipped
                                             if r.name == "prefix-cache-hit")
    boundaries = cases[0]
    lengths = [len(r.prompt) for r in boundaries.requests]
    # one token, each bucket -1/0/+1 within the room, and the longest prompt that fits
    assert lengths == [1, 31, 32, 33, 63, 64, 65, 127, 128, 129, 248]
    assert all(r.sampling["temperature"] == 0 for r in boundaries.requests)


def test_a_full_configuration_gets_every_case():
    limits = Limits(**{**LIMITS.__dict__, "block_layout": True, "prefix_caching": True,
                       "chunked_prefill": True, "max_num_batched_tokens": 64,
                       "speculation": "ngram", "lora": True, "quantized": True,
                       "prompt_logprobs": 20, "images": IMAGES})
    cases, skipped = plan(limits, new_tokens=8, quick=True, adapter="/adapters/a")
    assert not skipped
    lora = next(c for c in cases if c.name == "lora")
    assert {r.adapter for r in lora.requests} == {"/adapters/a", None}
    hit = next(c for c in cases if c.name == "prefix-cache-hit")
    first, second = hit.requests
    shared = hit.evidence["shared_tokens"]
    assert shared % 32 == 0 and first.prompt[:shared] == second.prompt[:shared]
    assert first.prompt != second.prompt and hit.batches == 2
    assert limits.tolerance == 0.3  # quantized weights: their own bound
    with pytest.raises(ValueError, match="needs an adapter"):
        plan(limits, new_tokens=8, quick=True, adapter=None)


def test_a_configuration_that_refuses_host_sampling_lists_those_cases_refused():
    limits = Limits(**{**LIMITS.__dict__, "host_refusal": "no logits with a draft model"})
    cases, skipped = plan(limits, new_tokens=8, quick=True, adapter=None)
    refused = {r.name: r.detail for r in skipped if r.status == "refused"}
    assert refused == dict.fromkeys(
        ["first-steps-logprobs", "mixed-step", "device-sampling"], "no logits with a draft model")
    assert "bucket-boundaries" in [c.name for c in cases]


def test_cases_are_selected_by_name():
    assert selected("lora, speculation") == {"lora", "speculation"}
    assert selected(None) == set(CASE_NAMES)
    with pytest.raises(ValueError, match=r"unknown case nonsense; choose from bucket-bound"):
        selected("lora,nonsense")


def _score(argmax, best, chosen, of=None) -> dict:
    score = {"argmax": argmax, "best": best, "chosen": chosen}
    if of is not None:
        score["of"] = of
    return score


def test_greedy_tokens_pass_on_the_argmax_or_a_near_tie_and_fail_otherwise():
    cases, _ = plan(LIMITS, new_tokens=2, quick=True, adapter=None)
    case = cases[0]
    one = case.requests[:1]
    right = Served([5, 6])
    near_tie = Served([5, 7])  # 7 is 0.2 nats below the oracle's 6 (bf16 tolerance 0.3)
    wrong = Served([5, 8])
    scores = [_score([5, 6], [-0.1, -1.0], [-0.1, -1.0])]
    ok = judge(case.__class__(case.name, case.feature, one, "greedy"), [right], scores, 0.3, {})
    assert ok.status == "pass"
    tie = [_score([5, 6], [-0.1, -1.0], [-0.1, -1.2])]
    assert judge(case.__class__(case.name, "", one, "greedy"), [near_tie], tie, 0.3,
                 {}).status == "pass"
    bad = [_score([5, 6], [-0.1, -1.0], [-0.1, -3.0])]
    failed = judge(case.__class__(case.name, "", one, "greedy"), [wrong], bad, 0.3, {})
    assert failed.status == "fail"
    assert "token 1 is 8, the oracle's is 6 (2 nats better" in failed.detail
    assert failed.inputs == [one[0].to_dict()]


def test_logprobs_beyond_the_tolerance_fail():
    cases, _ = plan(LIMITS, new_tokens=2, quick=True, adapter=None)
    case = next(c for c in cases if c.name == "first-steps-logprobs")
    one = case.__class__(case.name, "", case.requests[:1], "logprobs")
    served = Served([5], [{5: -0.1, 9: -2.0}])
    close = _score([5], [-0.1], [-0.1], [{"5": -0.12, "9": -2.2}])
    far = _score([5], [-0.1], [-0.1], [{"5": -0.12, "9": -2.5}])
    assert judge(one, [served], [close], 0.3, {}).status == "pass"
    result = judge(one, [served], [far], 0.3, {})
    assert result.status == "fail" and "token 9's logprob is -2.0000, the oracle's -2.5000" \
        in result.detail


def test_a_prefix_hit_must_come_from_the_cache():
    limits = Limits(**{**LIMITS.__dict__, "block_layout": True, "prefix_caching": True})
    cases, _ = plan(limits, new_tokens=2, quick=True, adapter=None)
    hit = next(c for c in cases if c.name == "prefix-cache-hit")
    served = [Served([1, 2]), Served([3, 4])]
    scores = [_score([1, 2], [0, 0], [0, 0]), _score([3, 4], [0, 0], [0, 0])]
    shared = hit.evidence["shared_tokens"]
    assert judge(hit, served, scores, 0.3, {"prefix_hit_tokens": shared}).status == "pass"
    missed = judge(hit, served, scores, 0.3, {"prefix_hit_tokens": 0})
    assert missed.status == "fail" and f"not the {shared} shared" in missed.detail


def test_speculation_must_have_drafted_and_reports_how_many_were_accepted():
    limits = Limits(**{**LIMITS.__dict__, "speculation": "eagle3"})
    cases, _ = plan(limits, new_tokens=2, quick=True, adapter=None)
    case = next(c for c in cases if c.name == "speculation")
    served = [Served([1, 2]), Served([3, 4])]
    scores = [_score([1, 2], [0, 0], [0, 0]), _score([3, 4], [0, 0], [0, 0])]
    drafted = judge(case, served, scores, 0.3, {"drafted_tokens": 12, "accepted_tokens": 9})
    assert drafted.status == "pass" and "9 of 12 draft tokens accepted (75%)" in drafted.detail
    idle = judge(case, served, scores, 0.3, {"drafted_tokens": 0, "accepted_tokens": 0})
    assert idle.status == "fail" and "the eagle3 drafts never ran" in idle.detail
    # n-gram drafts only where the continuation repeats the context: none is no fault
    ngram = next(c for c in plan(Limits(**{**LIMITS.__dict__, "speculation": "ngram"}),
                                 new_tokens=2, quick=True, adapter=None)[0]
                 if c.name == "speculation")
    quiet = judge(ngram, served, scores, 0.3, {"drafted_tokens": 0, "accepted_tokens": 0})
    assert quiet.status == "pass" and "no n-gram draft was proposed" in quiet.detail


def test_device_draws_must_follow_the_host_samplers_distribution():
    cases, _ = plan(LIMITS, new_tokens=2, quick=True, adapter=None, sample_draws=1000)
    case = next(c for c in cases if c.name == "device-sampling")
    rng = np.random.default_rng(0)
    host = rng.choice(20, size=500, p=np.full(20, 0.05))
    same = rng.choice(20, size=500, p=np.full(20, 0.05))
    skewed = rng.choice(20, size=500, p=np.r_[np.full(10, 0.09), np.full(10, 0.01)])

    def served(device):
        tokens = iter([*device, *host])
        return [Served([int(next(tokens))]) for _ in case.requests]

    scores = [None] * len(case.requests)
    assert judge(case, served(same), scores, 0.3, {}).status == "pass"
    wrong = judge(case, served(skewed), scores, 0.3, {})
    assert wrong.status == "fail" and "differ: chi-square" in wrong.detail
    stuck = judge(case, served(np.zeros(500, dtype=int)), scores, 0.3, {})
    assert stuck.status == "fail" and "drew one token only" in stuck.detail


def test_quantized_weights_are_held_to_the_stated_bound():
    limits = Limits(**{**LIMITS.__dict__, "quantized": True})
    case = next(c for c in plan(limits, 2, True, None)[0] if c.name == "quantized")
    n = len(case.requests)
    tokens = [[1, 2, 3, 4, 5]] * n
    served = [Served(t, [{tok: -1.0} for tok in t]) for t in tokens]
    agree = [_score([1, 2, 3, 4, 5], [-1.0] * 5, [-1.1] * 5)] * n
    assert judge(case, served, agree, 0.3, {}).status == "pass"
    drift = [_score([1, 2, 3, 4, 5], [-1.0] * 5, [-1.5] * 5)] * n  # 0.5 nats off
    assert "largest logprob gap 0.500" in judge(case, served, drift, 0.3, {}).detail
    disagree = [_score([1, 9, 9, 4, 5], [-1.0] * 5, [-1.1] * 5)] * n  # 60% agreement
    assert judge(case, served, disagree, 0.3, {}).status == "fail"


def test_statistics_accept_the_same_distribution_and_reject_another():
    rng = np.random.default_rng(1)
    p = np.r_[np.full(8, 0.1), np.full(20, 0.01)]
    draws = np.bincount(rng.choice(28, size=2000, p=p), minlength=28)
    assert goodness_of_fit(draws, p)[0]
    assert not goodness_of_fit(draws, np.full(28, 1 / 28))[0]
    zero = np.r_[p[:-1], 0.0] / p[:-1].sum()  # the last token, drawn ~20 times, impossible
    ok, why = goodness_of_fit(draws, zero)
    assert not ok and why.endswith("draws where the probability is 0")
    other = np.bincount(rng.choice(28, size=2000, p=p), minlength=28)
    assert homogeneity(draws, other)[0]
    assert not homogeneity(draws, np.bincount(rng.choice(28, size=2000), minlength=28))[0]


def test_roofline_and_host_share():
    # 1 GB of weights and 4x1024 positions of 128 KiB each, at 820 GB/s
    assert roofline_ms((4, 1024), 10**9, 131072, 820e9) == pytest.approx(
        1e3 * (10**9 + 4 * 1024 * 131072) / 820e9)
    rows = bucket_latencies({"token_generation": [((4, 1024), 3.0)],
                             "context_encoding": [((128,), 9.0)]}, 10**9, 131072, 820e9)
    tkg, cte = rows
    assert tkg.ratio == pytest.approx(3.0 / tkg.roofline_ms) and cte.roofline_ms is None
    assert bucket_latencies({"token_generation": [((4, 64), 1.0)]}, 10**9, 1, None)[0] \
        .roofline_ms is None  # off a Neuron instance
    before = {"step_host": {"sum": 1.0}, "buckets": [
        {"phase": "token_generation", "forward": {"sum": 4.0}},
        {"phase": "context_encoding", "forward": {"sum": 100.0}}]}
    after = {"step_host": {"sum": 2.0}, "buckets": [
        {"phase": "token_generation", "forward": {"sum": 13.0}},
        {"phase": "context_encoding", "forward": {"sum": 150.0}}]}
    assert decode_host_share(before, after) == pytest.approx(1 / 10)
    assert decode_host_share(before, None) is None


def test_the_report_round_trips_and_puts_failures_first():
    report = ValidationReport(
        ok=False, created="2026-11-26T00:00:00+00:00", model="m", command=["m"],
        backend="nxd", instance_type="inf2.xlarge", visible_cores=[0, 1],
        versions={"plugin": "0.1.0"}, settings={}, compile_cache_key="k", oracle={},
        cases=[CaseResult(name="lora", status="pass", detail="ok"),
               CaseResult(name="mixed-step", status="fail", detail="token 3",
                          inputs=[{"prompt": [1, 2]}])],
        seconds=1.0)
    again = ValidationReport.model_validate_json(report.model_dump_json())
    assert again == report
    markdown = report.markdown()
    assert markdown.index("| mixed-step | fail |") < markdown.index("| lora | pass |")
    assert '"prompt"' in markdown.split("## mixed-step: inputs")[1]
    schema = ValidationReport.model_json_schema()
    assert schema["properties"]["cases"]["items"]["$ref"].endswith("CaseResult")
    with pytest.raises(ValueError):
        ValidationReport.model_validate({**json.loads(report.model_dump_json()), "extra": 1})


@pytest.mark.parametrize("installed,line", [
    ("0.8.16251", "- NxDI: 0.8.16251, NxDI 0.8 (Neuron SDK 2.28, cd3abf3); inf2 runs NxDI 0.8 "
                  "(Neuron SDK 2.28, cd3abf3)"),
    ("0.9.17334", "- NxDI: 0.9.17334 (does not support it), NxDI 0.9 (Neuron SDK 2.29, "
                  "ef2731e); inf2 runs NxDI 0.8 (Neuron SDK 2.28, cd3abf3)"),
    ("0.7.14366", "- NxDI: 0.7.14366, not a release the plugin was checked on; inf2 runs "
                  "NxDI 0.8 (Neuron SDK 2.28, cd3abf3)"),
])
def test_report_names_the_nxdi_release_against_the_instance_family(installed, line):
    """A report from an inf2 host says which NxDI ran, whether the plugin was checked on
    that release, and the release inf2 runs (core/nxdi_releases.py)."""
    from neuron_plugin.core import nxdi_releases

    report = ValidationReport(
        ok=True, created="2026-11-27T00:00:00+00:00", model="m", command=["m"],
        backend="nxd", instance_type="inf2.xlarge", visible_cores=[0, 1],
        versions={"neuronx-distributed-inference": installed}, settings={},
        compile_cache_key="k", oracle={}, cases=[], seconds=1.0,
        nxdi=nxdi_releases.assessment(installed, "inf2"))
    assert line in report.markdown().splitlines()
    assert ValidationReport.model_validate_json(report.model_dump_json()) == report


def test_validate_never_writes_through_a_link_in_its_out_folder(tmp_path):
    """Issue 39: `--out` into an existing folder. A folder others may write is refused
    (they could plant a link where a report goes); in the user's own folder a link where
    a report goes is replaced, its target untouched."""
    import os

    from neuron_plugin.tools.validate import output_folder, write_reports

    report = ValidationReport(
        ok=True, created="2026-11-26T00:00:00+00:00", model="m", command=["m"],
        backend="reference", instance_type=None, visible_cores=[], versions={},
        settings={}, compile_cache_key="k", oracle={}, cases=[], seconds=1.0)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ValueError, match=r"--out .*shared belongs to uid \d+ with mode "
                                         r"0o777.*others cannot write"):
        output_folder(shared)
    mine = output_folder(tmp_path / "new" / "out")
    assert oct(mine.stat().st_mode & 0o777) == "0o700"
    precious = tmp_path / "precious"
    precious.write_text("keep")
    (mine / "report.json").symlink_to(precious)
    write_reports(mine, report)
    assert precious.read_text() == "keep"
    assert not os.path.islink(mine / "report.json")
    assert ValidationReport.model_validate_json((mine / "report.json").read_text()) == report


def test_prompt_logprobs_are_judged_position_by_position_and_by_top_k():
    """Every prompt position answered, its values within the tolerance, its top k the
    oracle's up to a near tie; and where the graphs are not compiled, the case is listed
    with the setting that compiles them."""
    _, skipped = plan(LIMITS, new_tokens=2, quick=True, adapter=None)
    assert """'{"prompt_logprobs": true}'""" in next(
        r.detail for r in skipped if r.name == "prompt-logprobs")
    limits = Limits(**{**LIMITS.__dict__, "chunked_prefill": True, "max_num_batched_tokens": 32,
                       "prompt_logprobs": 20})
    cases, _ = plan(limits, new_tokens=2, quick=True, adapter=None)
    case = next(c for c in cases if c.name == "prompt-logprobs")
    assert [len(r.prompt) for r in case.requests] == [9, 67]  # 67: three 32-token chunks
    assert all(r.sampling["prompt_logprobs"] == 5 for r in case.requests)
    one = case.__class__(case.name, "", [Request([1, 2, 3], {"prompt_logprobs": 1})],
                         "prompt-logprobs")
    served = Served([4], None, [{2: -1.0, 7: -0.5}, {3: -0.2}], [[7], [3]])
    oracle = {"argmax": [4], "best": [-0.1], "chosen": [-0.1], "prompt_k": 1,
              "prompt_of": [{"2": -1.05, "7": -0.45}, {"3": -0.25}], "prompt_kth": [-0.45, -0.25]}
    assert judge(one, [served], [oracle], 0.3, {}).status == "pass"
    far = {**oracle, "prompt_of": [{"2": -1.5, "7": -0.45}, {"3": -0.25}]}
    result = judge(one, [served], [far], 0.3, {})
    assert result.status == "fail"
    assert "prompt position 1: token 2's logprob is -1.0000, the oracle's -1.5000" in result.detail
    # 7 is served as the most likely, the oracle's best is 0.6 nats above it
    wrong_top = {**oracle, "prompt_kth": [0.15, -0.25]}
    result = judge(one, [served], [wrong_top], 0.3, {})
    assert result.status == "fail" and "are not the oracle's top 1" in result.detail
    short = Served([4], None, [{2: -1.0, 7: -0.5}], [[7]])
    assert "1 prompt positions answered, the prompt has 2" in judge(
        one, [short], [oracle], 0.3, {}).detail
    assert judge(one, [Served([4])], [oracle], 0.3, {}).detail.endswith(
        "no prompt log-probabilities came back")


@pytest.fixture(scope="module")
def oracle(model_dirs, sdk_python, tmp_path_factory):
    from neuron_plugin.validation.oracle_client import OracleProcess

    process = OracleProcess(sdk_python, str(model_dirs["llama"]), "float32",
                            tmp_path_factory.mktemp("oracle") / "oracle.log")
    yield process
    process.close()


def test_the_oracle_in_the_sdk_environment_scores_transformers_greedy_tokens(
        oracle, model_dirs):
    from tests.e2e.support import GreedyOracle, corpus_token_ids

    prompt = corpus_token_ids(model_dirs["llama"], 20)
    tokens = GreedyOracle(model_dirs["llama"]).generate(prompt, 6)
    score = oracle.ask({"op": "score", "prompt": prompt, "tokens": tokens, "adapter": None,
                        "of": [[t] for t in tokens]})
    assert score["argmax"] == tokens
    assert score["chosen"] == pytest.approx(score["best"])
    assert [row[str(t)] for row, t in zip(score["of"], tokens, strict=True)] == \
        pytest.approx(score["chosen"])
    assert "transformers" in oracle.ask({"op": "info"})
    # a prompt's own positions, as prompt_logprobs scores them
    scored = oracle.ask({"op": "score", "prompt": prompt, "tokens": tokens[:1], "adapter": None,
                         "prompt_of": [[t] for t in prompt[1:]], "prompt_k": 2})
    assert len(scored["prompt_of"]) == len(scored["prompt_kth"]) == len(prompt) - 1
    import torch

    with torch.no_grad():
        reference = GreedyOracle(model_dirs["llama"]).model(torch.tensor([prompt])).logits[0]
    reference = reference.log_softmax(-1)
    assert [row[str(t)] for row, t in zip(scored["prompt_of"], prompt[1:], strict=True)] == \
        pytest.approx([float(reference[i, t]) for i, t in enumerate(prompt[1:])], abs=1e-4)
    assert scored["prompt_kth"] == pytest.approx(
        reference[:-1].topk(2, dim=-1).values[:, -1].tolist(), abs=1e-4)
    assert scored["prompt_k"] == 2
    assert oracle.ask({"op": "score", "prompt": prompt, "tokens": []})["error"].startswith(
        "ValueError: nothing to score")


def test_the_oracles_lora_hooks_compute_what_peft_does(oracle, model_dirs, lora_adapters,
                                                        tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from neuron_plugin.validation.adapter import build_adapter
    from tests.e2e.support import corpus_token_ids

    prompt = corpus_token_ids(model_dirs["llama"], 16)
    kit = build_adapter(model_dirs["llama"], tmp_path / "kit", ["q_proj", "v_proj", "down_proj"],
                        rank=4, seed=3)
    for folder in (lora_adapters["lora-a"], kit):
        base = AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=torch.float32)
        peft = PeftModel.from_pretrained(base, str(folder)).eval()
        with torch.no_grad():
            logprobs = torch.log_softmax(peft(input_ids=torch.tensor([prompt])).logits[0, -1],
                                         -1)
        token = int(logprobs.argmax())
        score = oracle.ask({"op": "score", "prompt": prompt, "tokens": [token],
                            "adapter": str(folder)})
        assert score["argmax"] == [token]
        assert score["chosen"][0] == pytest.approx(float(logprobs[token]), abs=1e-4)
    refused = oracle.ask({"op": "score", "prompt": prompt, "tokens": [1],
                          "adapter": str(lora_adapters["lora-b"])})
    assert "rank_pattern / alpha_pattern" in refused["error"]
    assert Path(kit, "adapter_config.json").exists()


def test_a_vision_language_model_gets_an_image_filling_each_vision_bucket():
    """One image per vision bucket, filling it (patches = height x width / 14**2), two
    images in one prompt, a text-only prompt beside them; no random prompt of any case
    holds a reserved id (vLLM would take the image token for an image)."""
    limits = Limits(**{**LIMITS.__dict__, "images": IMAGES})
    cases, skipped = plan(limits, new_tokens=8, quick=False, adapter=None)
    assert "images" not in {r.name for r in skipped}
    images = next(c for c in cases if c.name == "images")
    shown = [[image[1:] for image in r.images] for r in images.requests]
    assert shown == [[(56, 56)], [(112, 112)], [(224, 224)], [(56, 56), (112, 112)], []]
    assert [h * w // 14**2 for h, w in (s[0] for s in shown[:3])] == [16, 64, 256]
    for request in images.requests:
        opened = [i for i, t in enumerate(request.prompt) if t == 977]
        assert len(opened) == len(request.images)
        assert all(request.prompt[i:i + 3] == [977, 979, 978] for i in opened)
        assert request.sampling["temperature"] == 0
    seeds = [image[0] for r in images.requests for image in r.images]
    assert len(set(seeds)) == len(seeds)
    for case in cases:
        for request in case.requests:
            text = [t for t in request.prompt if t not in IMAGES.placeholder]
            assert not set(text) & IMAGES.reserved, case.name
    # quick: the smallest and largest bucket; a model too short for the largest image,
    # and one image a prompt, leave those requests out
    quick, _ = plan(limits, new_tokens=8, quick=True, adapter=None)
    quick_images = next(c for c in quick if c.name == "images").requests
    assert [[i[1:] for i in r.images] for r in quick_images] == \
        [[(56, 56)], [(224, 224)], [(56, 56), (224, 224)], []]
    short = Limits(**{**limits.__dict__, "max_model_len": 64,
                      "images": ImageLimits(**{**IMAGES.__dict__, "per_prompt": 1})})
    cases, _ = plan(short, new_tokens=8, quick=False, adapter=None)
    kept = [[i[1:] for i in r.images] for r in next(c for c in cases if c.name == "images").requests]
    assert kept == [[(56, 56)], [(112, 112)], []]


def test_image_placeholders_and_arrays_for_the_oracle():
    from neuron_plugin.core.errors import NeuronConfigError
    from neuron_plugin.validation.images import (
        decode_arrays,
        encode_arrays,
        image_sizes,
        placeholder_ids,
    )

    qwen = {"vision_start_token_id": 5, "image_token_id": 6, "vision_end_token_id": 7}
    assert placeholder_ids(qwen, {}) == (5, 6, 7)
    assert placeholder_ids({"image_token_index": 10}, {}) == (10,)
    # Llama 4's image_token_index is <|patch|>, what each embedding takes; a prompt marks
    # an image with <|image|>, which vLLM's processor expands into the tiles
    llama4 = {"image_token_index": 981, "vision_config": {"model_type": "llama4_vision_model"}}
    assert placeholder_ids(llama4, {"<|image|>": 980, "<|patch|>": 981}) == (980,)
    with pytest.raises(NeuronConfigError, match="does not know how .*Foo.* mark an image"):
        placeholder_ids({"architectures": ["Foo"]}, {})
    with pytest.raises(NeuronConfigError, match="no <\\|image\\|> in the tokenizer"):
        placeholder_ids(llama4, {"<|patch|>": 981})
    # 48 patches: 12 squares, 3 x 4; buckets outside the processor's range are left out
    assert image_sizes((48, 8, 1024), 28, 4, (16, 256)) == [(84, 112)]
    # Llama 4's tiles (56 pixels, 16 patches): one tile, or n - 1 local tiles and the
    # global one; 2 tiles no image makes
    assert image_sizes((16, 32, 64, 80), 56, 16, (16, 80), global_tile=True) == [
        (56, 56), (56, 168), (112, 112)]
    arrays = {"pixel_values": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
              "image_grid_thw": np.array([[1, 2, 6]], dtype=np.int64)}
    back = decode_arrays(json.loads(json.dumps(encode_arrays(arrays))))
    for name, array in arrays.items():
        assert back[name].dtype == array.dtype and np.array_equal(back[name], array)


def test_the_oracle_scores_a_prompt_with_images_as_transformers_does(
        tiny_model, sdk_python, tmp_path):
    """The oracle (transformers 4.57 in the SDK environment) with the image processor's
    arrays gives this environment's transformers' log-probabilities; without the images
    the same prompt scores differently, so they reach the model."""
    import torch
    from transformers import Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor

    from neuron_plugin.validation.images import encode_arrays, image_pixels
    from neuron_plugin.validation.oracle_client import OracleProcess

    model = tiny_model("qwen2_vl")
    processor = Qwen2VLImageProcessor.from_pretrained(model)
    arrays = dict(processor(images=[image_pixels(3, 56, 112)], return_tensors="np"))
    tokens = arrays["image_grid_thw"].prod() // 4
    prompt = [11, 12, 13, 977, *[979] * int(tokens), 978, 14, 15]
    served = [21, 22, 23]
    process = OracleProcess(sdk_python, str(model), "float32", tmp_path / "oracle.log")
    try:
        ask = {"op": "score", "prompt": prompt, "tokens": served, "adapter": None}
        score = process.ask({**ask, "images": encode_arrays(arrays)})
        blind = process.ask(ask)
    finally:
        process.close()
    reference = Qwen2VLForConditionalGeneration.from_pretrained(model, dtype=torch.float32)
    ids = torch.tensor([prompt + served[:-1]])
    with torch.no_grad():
        logits = reference.eval()(
            input_ids=ids, mm_token_type_ids=(ids == 979).long(),
            **{k: torch.from_numpy(v) for k, v in arrays.items()}).logits[0]
    logprobs = logits[len(prompt) - 1:].log_softmax(-1)
    assert score["argmax"] == logprobs.argmax(-1).tolist()
    assert score["best"] == pytest.approx(logprobs.max(-1).values.tolist(), abs=1e-4)
    assert score["chosen"] == pytest.approx(
        [float(logprobs[i, t]) for i, t in enumerate(served)], abs=1e-4)
    assert max(abs(a - b) for a, b in zip(score["best"], blind["best"], strict=True)) > 1e-3
