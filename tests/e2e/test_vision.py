"""Vision-language models served end to end: `vllm serve TINY_QWEN2_VL --device neuron`
(the reference backend) answers OpenAI chat requests with images with transformers'
greedy tokens, and so does a tiny Qwen3-VL (its DeepStack features and interleaved
M-RoPE; one more server, for its one-image and two-image requests and its refusals).

Served from a Neuron host's vLLM environment (NEURON_TEST_HOST_PYTHON, the `vllm` wheel
with its torch and torchvision): the model's processor needs torchvision, whose only
wheels are CUDA builds that cannot load beside the test build's CPU torch. The oracle
runs in the same environment (tests/e2e/vision_oracle.py), so both sides see the same
processor output. Covered: one image, two images in a prompt, a text-only request to the
vision model, concurrent requests mixing images and text, streaming, the same image
again (a prefix-cache hit) and another image under the same text (never a hit), an
image larger than the largest vision bucket, a corrupt image, too many images and a
video (each a 400), a server that still answers right after them, and the offline API
(`LLM.generate` with `multi_modal_data`, `LLM.chat`; tests/e2e/vision_offline.py).
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import requests

from neuron_plugin.core.checkpoint import read_hf_config, text_config
from tests.e2e.support import Server

pytestmark = [pytest.mark.server, pytest.mark.deployment]

TOKENS = 10
ORACLE = Path(__file__).with_name("vision_oracle.py")


def image_url(seed: int, height: int, width: int) -> str:
    """A PNG of random pixels as a data URL (no network: clients send files this way)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat(text: str, *images: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


RED, BLUE, WIDE = image_url(1, 224, 224), image_url(2, 224, 224), image_url(3, 56, 140)
REQUESTS = {
    "one": chat("what is in the picture", RED),
    "other": chat("what is in the picture", BLUE),
    "two": chat("compare the two pictures", WIDE, RED),
    "text": [{"role": "user", "content": "the scheduler decides"}],
}


@pytest.fixture(scope="module")
def model(tiny_model) -> Path:
    return tiny_model("qwen2_vl")


@pytest.fixture(scope="module")
def expected(model, host_python) -> dict[str, list[int]]:
    return transformers_answers(model, host_python, REQUESTS)


def transformers_answers(
    model: Path, host_python: str, requests: dict[str, list[dict]]
) -> dict[str, list[int]]:
    """Each request's greedy tokens from transformers (tests/e2e/vision_oracle.py)."""
    job = {
        "model": str(model),
        "requests": [{"messages": m, "max_tokens": TOKENS} for m in requests.values()],
    }
    done = subprocess.run(
        [host_python, str(ORACLE)],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(zip(requests, json.loads(done.stdout), strict=True))


@dataclass(frozen=True)
class Endpoint:
    url: str
    model: str  # the served model's name: its folder
    log: Path | None = None  # the server's output


# The Qwen servers: up to 512 tokens, images of up to 1,024 patches (beyond the largest
# vision bucket, 256), prefix caching on
SERVED_BUCKETS = ([64, 128, 256, 512], [64, 256])
SERVED_FLAGS = ("--max-num-seqs", "4", "--enable-prefix-caching", "--mm-processor-kwargs",
                json.dumps({"max_pixels": 448 * 448}))


@pytest.fixture(scope="module")
def server(model, host_python, tmp_path_factory):
    yield from serve(model, host_python, tmp_path_factory, *SERVED_BUCKETS, SERVED_FLAGS)


def serve(
    model: Path,
    host_python: str,
    tmp_path_factory,
    context_buckets: list[int],
    vision_buckets: list[int] | None,
    flags: tuple[str, ...] = (),
):
    """A server of the vision model `model` on the reference backend (module-scoped):
    two images a prompt, the given buckets (vision buckets None: the plugin's, planned
    from the model's processor), `flags` beside them."""
    override: dict = {"context_encoding_buckets": context_buckets}
    if vision_buckets is not None:
        override["vision_buckets"] = vision_buckets
    config = {"override_neuron_config": override}
    log = tmp_path_factory.mktemp("vision") / "server.log"
    served = Server(
        model,
        log,
        ["--max-model-len", str(context_buckets[-1]), "--limit-mm-per-prompt",
         json.dumps({"image": 2}), *flags, "--additional-config", json.dumps(config)],
        env={**os.environ, "VLLM_NEURON_BACKEND": "reference"},
        python=host_python,
    )
    try:
        served.wait_healthy(timeout=420)
        yield Endpoint(served.url, str(model), log)
    finally:
        served.stop()


def validate_images(
    model: Path, host_python: str, out: Path, context_buckets: list[int],
    vision_buckets: list[int],
) -> dict:
    """`neuron-plugin validate --quick --cases images` on the vision model: the images
    case's report entry, after checking that every vision bucket was timed."""
    config = {"override_neuron_config": {"context_encoding_buckets": context_buckets,
                                         "vision_buckets": vision_buckets}}
    done = subprocess.run(
        [str(Path(host_python).with_name("neuron-plugin")), "validate", str(model),
         "--device", "neuron", "--dtype", "float32", "--max-model-len",
         str(context_buckets[-1]), "--max-num-seqs", "4", "--quick", "--cases", "images",
         "--out", str(out), "--limit-mm-per-prompt", json.dumps({"image": 2}),
         "--additional-config", json.dumps(config)],
        capture_output=True, text=True, timeout=900, check=False,
        env={**os.environ, "VLLM_NEURON_BACKEND": "reference"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    timed = {tuple(row["shape"]) for row in report["speed"]["buckets"]
             if row["phase"] == "vision_encoding"}
    assert timed == {(bucket,) for bucket in vision_buckets}
    return next(case for case in report["cases"] if case["name"] == "images")


def _until_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


@pytest.fixture(scope="module")
def eos(model) -> int:
    return int(text_config(read_hf_config(model))["eos_token_id"])


# A video part: refused before its bytes are read (the limit per prompt the platform
# sets), so a placeholder payload is enough.
VIDEO = [{"role": "user", "content": [
    {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
    {"type": "text", "text": "what happens"}]}]
BIGGER_THAN_THE_BUCKETS = chat("look", image_url(4, 448, 448))


def ask(server, messages, **extra) -> requests.Response:
    return requests.post(
        f"{server.url}/v1/chat/completions",
        json={
            "model": server.model,
            "messages": messages,
            "max_tokens": TOKENS,
            "temperature": 0,
            "return_token_ids": True,
            **extra,
        },
        timeout=300,
    )


def answer(server, messages, eos) -> list[int]:
    response = ask(server, messages)
    assert response.status_code == 200, response.text
    return _until_eos(response.json()["choices"][0]["token_ids"], eos)


@pytest.mark.parametrize("name", list(REQUESTS))
def test_greedy_tokens_equal_transformers(server, expected, eos, name):
    assert answer(server, REQUESTS[name], eos) == _until_eos(expected[name], eos)


def test_concurrent_image_and_text_requests_equal_transformers(server, expected, eos):
    names = ["one", "text", "two", "other", "text", "one"]
    with ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda n: answer(server, REQUESTS[n], eos), names))
    assert got == [_until_eos(expected[n], eos) for n in names]


def test_streamed_answer_equals_transformers(server, expected, eos):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model=server.model,
        messages=REQUESTS["two"],
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    # vLLM's extension field, beside the OpenAI schema's
    ids = [i for chunk in stream for c in chunk.choices
           for i in (c.model_extra or {}).get("token_ids") or []]
    assert _until_eos(ids, eos) == _until_eos(expected["two"], eos)


def test_offline_generate_and_chat_with_images_equal_transformers(model, host_python, expected,
                                                                 eos):
    """vLLM's offline API on the plugin: `LLM.generate` with `multi_modal_data` for every
    request in one batch (images and text mixed), and `LLM.chat` with image parts."""
    job = {
        "model": str(model),
        "requests": [{"messages": m, "max_tokens": TOKENS} for m in REQUESTS.values()],
        "engine": {
            "max_model_len": 512,
            "max_num_seqs": 4,
            "limit_mm_per_prompt": {"image": 2},
            "additional_config": {
                "override_neuron_config": {
                    "context_encoding_buckets": [64, 128, 256, 512],
                    "vision_buckets": [64, 256],
                }
            },
        },
    }
    done = subprocess.run(
        [host_python, str(ORACLE.with_name("vision_offline.py"))],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "VLLM_NEURON_BACKEND": "reference"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    got = json.loads(result.removeprefix("RESULT "))
    want = [_until_eos(expected[name], eos) for name in REQUESTS]
    assert [_until_eos(ids, eos) for ids in got["generate"]] == want
    assert _until_eos(got["chat"], eos) == want[0]


def first_logprobs(server, name: str) -> list[float]:
    """The top-5 log-probabilities of a request's first answer token."""
    response = ask(server, REQUESTS[name], max_tokens=1, logprobs=True, top_logprobs=5)
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["logprobs"]["content"][0]
    return [t["logprob"] for t in content["top_logprobs"]]


def test_same_image_hits_the_prefix_cache_and_another_image_does_not(server):
    """The same text and image twice: the second is a prefix-cache hit with the same
    answer. Another image under the same text (the same token ids: only vLLM's image
    hash tells them apart) must not reuse those blocks: its log-probabilities differ,
    which also shows the image reaches the decoder (the tiny model's greedy tokens may
    not change)."""
    cached = first_logprobs(server, "one")
    before = _prefix_hits(server)
    assert first_logprobs(server, "one") == pytest.approx(cached, abs=1e-5)
    assert _prefix_hits(server) > before
    other = first_logprobs(server, "other")
    assert max(abs(a - b) for a, b in zip(cached, other, strict=True)) > 1e-3


def _prefix_hits(server) -> float:
    text = requests.get(f"{server.url}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prefix_cache_hits_total")
    )


@pytest.mark.parametrize(
    ("messages", "extra", "says"),
    [
        # 1,024 patches, which the server's max_pixels lets through and no vision
        # bucket holds (the largest: 256)
        (BIGGER_THAN_THE_BUCKETS, {}, "exceeds the largest vision bucket"),
        (chat("look", "data:image/png;base64," + base64.b64encode(b"not a png").decode()), {}, ""),
        (chat("look", RED, BLUE, WIDE), {}, "image"),
        (VIDEO, {}, "At most 0 video(s)"),
    ],
    ids=["larger-than-the-largest-bucket", "corrupt", "too-many", "video"],
)
def test_bad_images_get_a_400_and_the_server_keeps_serving(
    server, expected, eos, messages, extra, says
):
    response = ask(server, messages, **extra)
    assert response.status_code == 400, response.text
    assert says in response.text
    assert answer(server, REQUESTS["one"], eos) == _until_eos(expected["one"], eos)


def test_vision_calls_are_counted_per_vision_bucket(server):
    """The per-bucket telemetry has the vision graphs' calls beside the text graphs'."""
    text = requests.get(f"{server.url}/metrics", timeout=30).text
    calls = [
        line for line in text.splitlines()
        if line.startswith("neuron:bucket_calls") and 'phase="vision_encoding"' in line
    ]
    assert calls and sum(float(line.rsplit(" ", 1)[1]) for line in calls) > 0, text[-2000:]


def test_explain_config_plans_the_vision_graphs(model, host_python):
    done = subprocess.run(
        [str(Path(host_python).with_name("neuron-plugin")), "explain-config", str(model),
         "--max-model-len", "512", "--json"],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "VLLM_NEURON_BACKEND": "reference"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    # the tiny processor's images: 16 to 256 patches (min_pixels 56x56, max 28x28x64)
    assert report["buckets"]["vision"] == [16, 32, 64, 128, 256]
    assert report["graphs"]["vision_encoding"] == 5
    # decode batch sizes are powers of two up to max_num_seqs, one graph per size and length
    batches = report["decode_batches"]["sizes"]
    assert batches == sorted(batches) and batches[0] == 1 and len(batches) > 1
    graphs = report["graphs"]
    assert graphs["token_generation"] == len(batches) * len(report["buckets"]["token_generation"])
    assert graphs["total"] == (graphs["context_encoding"] + graphs["token_generation"]
                               + graphs["token_generation_logits"] + 5)


def test_validate_judges_images_against_the_oracle_and_times_each_vision_bucket(
    model, host_python, tmp_path
):
    """`neuron-plugin validate` on the vision model: its images case (an image filling
    each vision bucket, two in a prompt, a text-only row) passes against transformers,
    and the speed table has every vision bucket beside the text graphs."""
    images = validate_images(model, host_python, tmp_path / "validate",
                             [64, 128, 256, 512], [64, 256])
    assert images["status"] == "pass", images
    assert images["evidence"]["image_sizes"] == [[112, 112], [224, 224], [112, 112], [224, 224]]


@pytest.fixture(scope="module")
def qwen3_vl(tiny_model) -> Path:
    return tiny_model("qwen3_vl")


@pytest.fixture(scope="module")
def qwen3_server(qwen3_vl, host_python, tmp_path_factory):
    yield from serve(qwen3_vl, host_python, tmp_path_factory, *SERVED_BUCKETS, SERVED_FLAGS)


def test_qwen3_vl_answers_images_as_transformers_and_refuses_the_rest(
    qwen3_vl, qwen3_server, host_python
):
    """Qwen3-VL through the same server flags: one image and two images (one wide, its
    DeepStack levels at every image token) with transformers' greedy tokens; an image
    beyond the largest vision bucket (784 of its 16-pixel patches), more images than
    --limit-mm-per-prompt allows and a video get a 400, and the server answers right
    after."""
    names = ["one", "two"]
    expected = transformers_answers(qwen3_vl, host_python, {n: REQUESTS[n] for n in names})
    eos = int(text_config(read_hf_config(qwen3_vl))["eos_token_id"])
    for name in names:
        assert answer(qwen3_server, REQUESTS[name], eos) == _until_eos(expected[name], eos)
    for messages, says in (
        (BIGGER_THAN_THE_BUCKETS, "784 patches exceeds the largest vision bucket"),
        (chat("look", RED, BLUE, WIDE), "At most 2 image(s)"),
        (VIDEO, "At most 0 video(s)"),
    ):
        response = ask(qwen3_server, messages)
        assert response.status_code == 400 and says in response.text, response.text
    assert answer(qwen3_server, REQUESTS["one"], eos) == _until_eos(expected["one"], eos)


@pytest.fixture(scope="module")
def qwen2_vl_tf5(tiny_model) -> Path:
    return tiny_model("qwen2_vl_tf5")


@pytest.fixture(scope="module")
def tf5_server(qwen2_vl_tf5, host_python, tmp_path_factory):
    """The same Qwen2-VL saved as transformers 5 saves a processor
    (processor_config.json, size only, no preprocessor_config.json), served with the
    vision buckets the plugin plans from those files: no --mm-processor-kwargs and no
    vision_buckets."""
    yield from serve(qwen2_vl_tf5, host_python, tmp_path_factory, SERVED_BUCKETS[0], None,
                     ("--max-num-seqs", "4"))


def test_a_transformers5_checkpoint_answers_images_as_transformers(
    qwen2_vl_tf5, tf5_server, host_python
):
    """A checkpoint whose processor transformers 5 saved (issue 50: the server exited at
    start, reading min_pixels from a preprocessor_config.json it does not have) starts
    with the image range of its processor_config.json (16 to 256 patches: five vision
    buckets) and answers one image, two images, a large image (scaled down to the
    largest bucket) and text, all at once, with transformers' greedy tokens."""
    log = tf5_server.log.read_text(errors="replace")
    assert ("images of 16 to 256 patches (the image processor's settings in "
            "processor_config.json (image_processor))") in log, log[-3000:]
    requests = {name: REQUESTS[name] for name in ("one", "two", "text")}
    requests["large"] = chat("what is in the picture", image_url(5, 448, 448))
    expected = transformers_answers(qwen2_vl_tf5, host_python, requests)
    eos = int(text_config(read_hf_config(qwen2_vl_tf5))["eos_token_id"])
    with ThreadPoolExecutor(len(requests)) as pool:
        got = dict(zip(requests, pool.map(lambda m: answer(tf5_server, m, eos),
                                          requests.values()), strict=True))
    assert got == {name: _until_eos(ids, eos) for name, ids in expected.items()}
