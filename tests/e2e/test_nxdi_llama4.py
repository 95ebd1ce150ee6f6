"""Why the nxd backend refuses Llama 4: NxDI's own NeuronLlama4ForCausalLM on real NxD
Inference in its CPU mode (nxdi_llama4_probe.py), against transformers'
Llama4ForConditionalGeneration (this environment's, float32) on the tiny checkpoint of
scripts/build_tiny_model.py --arch llama4 (NoPE and chunked RoPE layers, temperature
tuning from position 7, llama3 RoPE scaling, dense and MoE layers). Each test pins one
finding on each NxDI release listed (NEURON_TEST_NXDI_PYTHONS, see tests/e2e/conftest.py):
- the vision encoder (NeuronLlama4VisionEmbeddings), inside NeuronLlama4ForCausalLM and
  as the NeuronLlama4ForImageEncoding application, equals transformers' vision model and
  projector;
- the text model differs from transformers: it ignores attn_temperature_tuning (nothing
  in NxDI reads it, floor_scale or attn_scale) and the checkpoint's llama3 rope_scaling
  (NxD's precompute_freqs_cis is called without it and applies its own ROPE_DEFAULTS);
- the same prompts (one with an image) against transformers with temperature tuning
  off and NxD's RoPE defaults are equal: those two are the whole difference;
- a prompt that exactly fills its context bucket differs (NxDI pads the dummy vision
  mask with bucket - 1, and the merge overwrites the last token's embedding); one token
  shorter is equal;
- on NxDI 0.8 the shipped forward raises NameError (tensor_capture_hook) on every call;
- the shipped to_cpu cannot load the checkpoint at TP 1 (CPU mode only).

These measure NxDI as shipped, without the plugin's patches; the nxd backend serves
Llama 4 with patches llama4-rope-temperature, vision-scatter-scratch-row and (0.8)
i2t-capture-hook, and its own CPU loader (test_nxdi_llama4_served.py). A failure of a
"differs" or "raises" test means NxDI fixed it: the patch's probe then finds nothing to
fix; check that it does (tests/plugin/test_llama4_rope_patch.py). Without an NxDI interpreter these tests skip."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.e2e.support import corpus_token_ids
from tests.e2e.test_nxdi_vision import run_probe

pytestmark = [pytest.mark.nxdi]

BUCKET = 64  # the one context-encoding (and token-generation) bucket; chunks of 16 apply
STEPS = 6  # decode steps after the prefill's token
STEPS_OF = {"text": STEPS, "image": STEPS}  # the bucket prompts: the prefill only
CHUNKS = 4  # image chunks (56-pixel tiles) per vision-encoder call
PATCH_TOKENS = 4  # features per chunk: (56 / 14)^2 patches, pixel shuffle ratio 0.5
# Logits of NxDI's float32 CPU mode against transformers' (measured up to 4.8e-5 here).
TOLERANCE = 1e-4
# A difference no rounding explains: measured 6e-2 at the 13-token prompt's prefill as
# shipped, 2e-2 with transformers' temperature tuning off, 3.2 for the full bucket.
DIFFERS = 10 * TOLERANCE
# neuronx_distributed/modules/attention/utils.py ROPE_DEFAULTS (NxD 0.17 and 0.18): what
# apply_scaling uses whatever the checkpoint's rope_scaling says.
NXD_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
PROBE = Path(__file__).with_name("nxdi_llama4_probe.py")
FIXED = (
    "NxDI fixed it: lift the Llama 4 refusal for NxDI {} "
    "(neuron_plugin/models/table.py, its Refused rows) and add the patch/driver"
)


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> Path:
    return tiny_model("llama4")


def _hf_model(model_dir: Path, **text_config):
    """transformers' Llama 4 with `text_config` keys replaced (the NxDI behaviour a
    reference imitates)."""
    from transformers import AutoConfig, Llama4ForConditionalGeneration

    config = AutoConfig.from_pretrained(model_dir)
    for key, value in text_config.items():
        setattr(config.text_config, key, value)
    return Llama4ForConditionalGeneration.from_pretrained(
        model_dir, config=config, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def checkpoint_rope(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())["text_config"]["rope_parameters"]


@pytest.fixture(scope="module")
def prompts(model_dir) -> dict[str, list[int]]:
    """A text prompt past the temperature-tuning floor and the first attention chunk,
    decoded into the second; one with an image (its features replace the image's
    <|patch|> tokens: 4 per chunk); one exactly filling the bucket; one a token shorter."""
    config = json.loads((model_dir / "config.json").read_text())
    image = (
        [config["boi_token_index"]]
        + [config["image_token_index"]] * (CHUNKS * PATCH_TOKENS)
        + [config["eoi_token_index"]]
    )
    return {
        "text": corpus_token_ids(model_dir, 13, offset=11),
        "image": (
            corpus_token_ids(model_dir, 10, offset=40)
            + image
            + corpus_token_ids(model_dir, 8, offset=200)
        ),
        "full_bucket": corpus_token_ids(model_dir, BUCKET, offset=300),
        "below_bucket": corpus_token_ids(model_dir, BUCKET - 1, offset=300),
    }


@pytest.fixture(scope="module")
def pixel_values() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.standard_normal((CHUNKS, 3, 56, 56)).astype(np.float32)


@pytest.fixture(scope="module")
def expected(model_dir, prompts, pixel_values, checkpoint_rope) -> dict[str, dict]:
    """transformers' greedy tokens and logits per reference: "shipped" (the checkpoint
    as it is), "no_temperature" (attn_temperature_tuning off), "nxdi" (also NxD's RoPE
    defaults, the checkpoint's rope_theta); and the shipped model's vision features
    after the projector."""
    references = {
        "shipped": {},
        "no_temperature": {"attn_temperature_tuning": False},
        "nxdi": {
            "attn_temperature_tuning": False,
            "rope_parameters": {**checkpoint_rope, **NXD_ROPE},
        },
    }
    found: dict[str, dict] = {}
    for reference, overrides in references.items():
        model = _hf_model(model_dir, **overrides)
        for name, prompt in prompts.items():
            image = {"pixel_values": torch.from_numpy(pixel_values)} if name == "image" else {}
            with torch.no_grad():
                out = model.generate(
                    input_ids=torch.tensor([prompt]),
                    **image,
                    max_new_tokens=STEPS_OF.get(name, 0) + 1,
                    do_sample=False,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
            found[f"{reference}/{name}"] = {
                "tokens": out.sequences[0, len(prompt) :].tolist(),
                "logits": torch.stack(out.logits, 1)[0].float().numpy(),
            }
        if reference == "shipped":
            with torch.no_grad():
                features = model.get_image_features(
                    pixel_values=torch.from_numpy(pixel_values), return_dict=True
                ).last_hidden_state
                found["vision"] = {"features": model.multi_modal_projector(features).numpy()}
    return found


@pytest.fixture(scope="module")
def probed(nxdi_python, model_dir, prompts, pixel_values, tmp_path_factory):
    """(the probe's report, its output folder, the NxDI release)."""
    out = tmp_path_factory.mktemp("nxdi-llama4")
    np.save(out / "pixel_values.npy", pixel_values)
    plan = {
        "model": str(model_dir),
        "bucket": BUCKET,
        "vision_bucket": CHUNKS,
        "pixel_values": str(out / "pixel_values.npy"),
        "image_token": json.loads((model_dir / "config.json").read_text())["image_token_index"],
        "cases": {
            name: {"prompt": prompt, "steps": STEPS_OF.get(name, 0), "image": name == "image"}
            for name, prompt in prompts.items()
        },
    }
    return run_probe(nxdi_python, PROBE, plan, out)


def _gap(probed, expected, case: str, reference: str) -> tuple[list, list, float]:
    """(NxDI's tokens, the reference's tokens, max |logit difference| over the steps)."""
    report, out, _ = probed
    want = expected[f"{reference}/{case}"]
    logits = np.load(out / f"{case}.npy", allow_pickle=False)
    assert logits.shape == want["logits"].shape, (case, logits.shape)
    return (
        report["cases"][case]["tokens"],
        want["tokens"],
        float(np.abs(logits - want["logits"]).max()),
    )


@pytest.mark.parametrize("output", ["vision", "image_encoding"])
def test_vision_encoder_equals_transformers(probed, expected, output):
    """NxDI's vision encoder, adapter and projection give transformers' image features
    (vision model, pixel shuffle MLP, multi-modal projector) for four 56-pixel chunks:
    inside NeuronLlama4ForCausalLM and as the NeuronLlama4ForImageEncoding application
    (measured 4.2e-7 both)."""
    _, out, _ = probed
    features = np.load(out / f"{output}.npy", allow_pickle=False)
    want = expected["vision"]["features"]
    assert features.shape == want.shape
    assert float(np.abs(features - want).max()) < TOLERANCE


def test_text_prompts_differ_from_transformers(probed, expected):
    """As shipped, NxDI's logits part from transformers' at the prefill already: measured
    6e-2 for the 13-token prompt, 0.19 for the image one, 0.51 for the 63-token one (the
    greedy tokens of these prompts stay transformers' on this checkpoint)."""
    fixed = FIXED.format(probed[2])
    for case in ("text", "image", "below_bucket"):
        _, _, gap = _gap(probed, expected, case, "shipped")
        assert gap > DIFFERS, f"{case}: logits within {gap} of transformers': {fixed}"


def test_rope_scaling_of_the_checkpoint_is_ignored(probed, expected, checkpoint_rope):
    """With transformers' temperature tuning off too, the logits still differ (measured
    2e-2, 5e-3 and 5e-2): NxD scales RoPE by its own defaults, not the checkpoint's
    rope_scaling (whose original_max_position_embeddings is not NxD's 8192)."""
    assert checkpoint_rope["original_max_position_embeddings"] != 8192
    for case in ("text", "image", "below_bucket"):
        _, _, gap = _gap(probed, expected, case, "no_temperature")
        assert gap > DIFFERS, f"{case}: logits within {gap}: {FIXED.format(probed[2])}"


def test_equal_to_transformers_without_temperature_tuning_and_with_nxd_rope(probed, expected):
    """The two are the whole difference: against transformers with temperature tuning off
    and NxD's RoPE defaults, NxDI's tokens and logits are equal (measured 4.8e-5), chunked
    attention (decoding into the second chunk), MoE layers and a prompt with an image
    (NxDI's forward runs the vision encoder and merges its features) included."""
    for case in ("text", "image", "below_bucket"):
        tokens, want, gap = _gap(probed, expected, case, "nxdi")
        assert tokens == want, case
        assert gap < TOLERANCE, f"{case}: logits off by {gap}"


def test_prompt_filling_its_context_bucket_differs(probed, expected):
    """NxDI's forward pads the dummy vision mask of a text prompt with bucket - 1
    (NeuronLlama4ForCausalLM.forward, fill_value=pad_limit - 1), so a prompt filling the
    bucket gets a zero row merged over its last token (measured 3.2, another token); the
    same prompt a token shorter is equal (test above)."""
    tokens, want, gap = _gap(probed, expected, "full_bucket", "nxdi")
    fixed = FIXED.format(probed[2])
    assert tokens != want, f"the full bucket's token is transformers': {fixed}"
    assert gap > DIFFERS, f"a prompt filling its bucket is within {gap}: {fixed}"


def test_shipped_forward_raises_name_error_on_0_8_only(probed):
    """NxDI 0.8's NeuronBaseForImageToText.forward reads tensor_capture_hook, neither a
    parameter nor a global: every request fails, on a device too. 0.9 has the
    parameter."""
    report, _, release = probed
    shipped = report["shipped_forward"]
    patched = [s for s in report["stand_ins"] if "tensor_capture_hook" in s["what"]]
    if release == "0.8":
        assert shipped.get("error") == "NameError", f"{shipped}: {FIXED.format(release)}"
        assert "tensor_capture_hook" in shipped["message"]
        assert patched
    else:
        assert shipped == {"ok": "the shipped forward ran"}
        assert not patched


def test_shipped_to_cpu_does_not_shard_at_tp_1(probed):
    """CPU mode only: NeuronLlama4ForCausalLM.to_cpu skips get_sharded_checkpoint at TP 1,
    so the shared experts' weights keep the checkpoint's layout, not NxD's transposed one
    (a device's builder always shards). The probe's stand-in shards; nothing else."""
    report = probed[0]
    shipped = report["shipped_to_cpu"]
    assert shipped.get("error") == "RuntimeError", shipped
    assert "shared_experts" in shipped["message"]
    assert {s["works_around"] for s in report["stand_ins"]} <= {
        "models/llama4/modeling_llama4.py NeuronLlama4ForCausalLM.to_cpu",
        "models/model_wrapper.py ModelWrapper._forward",
        "models/image_to_text_model_base.py NeuronBaseForImageToText.forward",
    }, report["stand_ins"]
