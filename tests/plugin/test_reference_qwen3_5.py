"""Qwen3.5's text model on the reference backend against transformers 5: the tiny
checkpoints (scripts/build_tiny_model.py `qwen3_5`, `qwen3_5_moe`) have both layer kinds,
four gated DeltaNet layers (2 key heads shared by 4 value heads, a 4-tap convolution)
and two gated full-attention layers with RoPE on a quarter of the head, dense or MoE
with a shared expert. Logits equal transformers' for prompts across the chunked form's
64-token chunks and the 32-token bucket, in the contiguous layout and the block layout
(each state in the vLLM block of its position, as the hybrid KV cache manager hands them
out), over a prefill in chunks and a prefix hit that reads a cached state block; greedy
decoding and a batched decode with padding rows equal transformers' generate; the state
the graphs leave equals transformers' cache (padding tokens change none of it); each
feature moves transformers' own logits, so parity checks that it is computed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from neuron_plugin.backends.reference.architectures import DecoderSpec
from neuron_plugin.backends.reference.backend import ReferenceBackend
from neuron_plugin.core.checkpoint import read_hf_config
from neuron_plugin.core.inputs import context_encoding_inputs, state_slots, token_generation_inputs
from neuron_plugin.core.recurrent_state import state_geometry
from neuron_plugin.core.neuron_settings import KVTransferLimits
from neuron_plugin.core.settings import EngineLimits, NeuronConfigError, resolve_settings

ARCHS = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}
BLOCK = 16
PROMPT = 100  # past the chunked form's first 64-token chunk
STEPS = 8


def limits(model, block: bool) -> EngineLimits:
    return EngineLimits(
        max_model_len=128,
        max_num_seqs=4,
        block_size=BLOCK if block else None,
        enable_prefix_caching=block,
        enable_chunked_prefill=block,
        max_num_batched_tokens=128,
        dtype="float32",
        state=state_geometry(read_hf_config(model)),
    )


@pytest.fixture(scope="module", params=list(ARCHS))
def model(request, tiny_model):
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def hf_model(model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model, dtype=torch.float32, experts_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def dense_hf(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model("qwen3_5"), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(0).integers(3, 900, PROMPT)


def compiled(model, block: bool, folder) -> ReferenceBackend:
    buckets = {} if block else {"context_encoding_buckets": [32, 128]}
    settings = resolve_settings(
        limits(model, block), buckets, backend="reference", architecture=ARCHS[model.name[5:]]
    )
    ReferenceBackend(settings, model).compile(folder)
    loaded = ReferenceBackend(settings, model)
    loaded.load(folder)
    return loaded


@pytest.fixture(scope="module")
def contiguous(model, tmp_path_factory):
    return compiled(model, False, tmp_path_factory.mktemp("qwen3_5-contiguous"))


@pytest.fixture(scope="module")
def block(tiny_model, tmp_path_factory):
    return compiled(tiny_model("qwen3_5"), True, tmp_path_factory.mktemp("qwen3_5-block"))


def hf_logits(hf_model, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(input_ids=torch.tensor([list(ids)])).logits[0]


def hf_generate(hf_model, ids, steps: int = STEPS) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=torch.tensor([list(ids)]), max_new_tokens=steps, do_sample=False
        )
    return out[0, len(ids) :].tolist()


class Blocks:
    """A request's blocks as vLLM's hybrid KV cache manager hands them out with prefix
    caching (16 positions a block): its attention blocks and, per state group, a block
    per 16 positions (vLLM's 'align' mode), all distinct and never block 0."""

    def __init__(self, first: int, groups: int = 2, columns: int = 8):
        ids = iter(range(first, first + (groups + 1) * columns))
        self.attention = [next(ids) for _ in range(columns)]
        self.state = [[next(ids) for _ in range(columns)] for _ in range(groups)]

    def slots(self, computed: int, end: int) -> np.ndarray:
        # the tiny model's state layers 0, 1, 3, 4 in groups 0, 1, 0, 1, as vLLM groups them
        return state_slots(self.state, [0, 1, 0, 1], computed, end, BLOCK)


def test_the_tiny_checkpoints_have_both_layer_kinds(model):
    spec = DecoderSpec.from_hf_config(read_hf_config(model))
    assert spec.state is not None
    assert spec.state.layers == (0, 1, 3, 4) and spec.state.attention_layers == (2, 5)
    assert spec.state.conv_shape == (2 * 2 * 32 + 4 * 32, 3)
    assert spec.state.recurrent_shape == (4, 32, 32)
    assert spec.cache_geometry == (2, 2, 32)  # a KV cache row per full-attention layer
    assert spec.state.groups() == 2
    assert spec.moe_layers == ((True,) * 6 if model.name.endswith("moe") else (False,) * 6)


def test_the_multimodal_checkpoint_reads_its_nested_text_config(tiny_model):
    """Qwen3_5ForConditionalGeneration (the Hub's form) nests the text config
    (text_config) and its tensors (model.language_model.): the same text model."""
    config = read_hf_config(tiny_model("qwen3_5_mm"))
    spec = DecoderSpec.from_hf_config(config)
    flat = DecoderSpec.from_hf_config(read_hf_config(tiny_model("qwen3_5")))
    assert spec.architecture == "Qwen3_5ForConditionalGeneration"
    assert (spec.state, spec.layer_types, spec.kv_rows) == (
        flat.state,
        flat.layer_types,
        flat.kv_rows,
    )
    assert "vision_config" in config and spec.vocab_size == flat.vocab_size


@pytest.mark.parametrize("length", [5, 64, 65, PROMPT])
def test_prefill_logits_equal_transformers(contiguous, hf_model, prompt, length):
    ids = prompt[:length]
    logits = contiguous.forward(context_encoding_inputs(contiguous.settings, ids, 0, 0, None))[0]
    np.testing.assert_allclose(
        logits.numpy(), hf_logits(hf_model, ids)[-1].numpy(), atol=1e-4, rtol=1e-4
    )


def test_greedy_decoding_equals_transformers_generate(contiguous, hf_model, prompt):
    settings = contiguous.settings
    ids = prompt[:70]
    tokens = [
        int(contiguous.forward(context_encoding_inputs(settings, ids, 0, 1, None))[0].argmax())
    ]
    for position in range(70, 70 + STEPS - 1):
        step = token_generation_inputs(
            settings, np.array([tokens[-1]]), np.array([position]), np.array([1]), None
        )
        tokens.append(int(contiguous.forward(step)[0].argmax()))
    assert tokens == hf_generate(hf_model, ids)


def test_a_batched_decode_keeps_each_sequences_state(contiguous, hf_model, prompt):
    """Two sequences in sequence slots 0 and 2 decode together in a batch of 3 rows (slot
    1 a padding row): each gets its own greedy tokens."""
    settings = contiguous.settings
    prompts = {0: prompt[:37], 2: prompt[40:95]}
    last = {
        seq: int(
            contiguous.forward(context_encoding_inputs(settings, ids, 0, seq, None))[0].argmax()
        )
        for seq, ids in prompts.items()
    }
    tokens = {seq: [token] for seq, token in last.items()}
    for step in range(STEPS - 1):
        seqs = np.array(list(prompts))
        inputs = token_generation_inputs(
            settings,
            np.array([tokens[s][-1] for s in seqs]),
            np.array([len(prompts[s]) + step for s in seqs]),
            seqs,
            None,
        )
        logits = contiguous.forward(inputs)
        for row, seq in enumerate(seqs):
            tokens[seq].append(int(logits[row].argmax()))
    assert tokens == {seq: hf_generate(hf_model, ids) for seq, ids in prompts.items()}


def test_the_state_equals_transformers_cache(contiguous, hf_model, prompt):
    """After a prefill of 37 tokens in the 128-token bucket (91 padding tokens), each
    state layer's recurrent state and conv state equal transformers' cache."""
    ids = prompt[:37]
    contiguous.forward(context_encoding_inputs(contiguous.settings, ids, 0, 3, None))
    with torch.no_grad():
        cache = hf_model(input_ids=torch.tensor([ids.tolist()]), use_cache=True).past_key_values
    assert contiguous.states is not None and contiguous.states.tensors is not None
    conv, recurrent = contiguous.states.tensors
    for index, layer in enumerate((0, 1, 3, 4)):
        expected = cache.layers[layer]
        torch.testing.assert_close(
            recurrent[index, 3], expected.recurrent_states[0][0], atol=1e-5, rtol=1e-4
        )
        torch.testing.assert_close(conv[index, 3], expected.conv_states[0][0, :, 1:])


def test_block_layout_decoding_equals_transformers_generate(block, dense_hf, prompt):
    """Prefill and decode with each state in the block of its position: a step that
    crosses a 16-position boundary reads the previous block and writes the next."""
    settings, blocks = block.settings, Blocks(1)
    ids = prompt[:45]
    inputs = context_encoding_inputs(
        settings, ids, 0, 0, blocks.attention, state=blocks.slots(0, 45)
    )
    tokens = [int(block.forward(inputs)[0].argmax())]
    for position in range(45, 45 + STEPS - 1):
        step = token_generation_inputs(
            settings,
            np.array([tokens[-1]]),
            np.array([position]),
            np.array([0]),
            [blocks.attention],
            state=blocks.slots(position, position + 1)[None],
        )
        tokens.append(int(block.forward(step)[0].argmax()))
    assert tokens == hf_generate(dense_hf, ids)


def test_chunks_and_a_prefix_hit_read_the_state_block(block, dense_hf, prompt):
    """A prefill in two chunks ([0, 48), then [48, 100) from the state the first left in
    the block of position 47), and a second request whose first 48 positions are a
    prefix-cache hit: its blocks up to 48 are the first's (attention and state), its own
    after; both equal transformers' logits."""
    settings, first = block.settings, Blocks(1)
    block.forward(
        context_encoding_inputs(
            settings, prompt[:48], 0, 0, first.attention, state=first.slots(0, 48)
        )
    )
    logits = block.forward(
        context_encoding_inputs(
            settings, prompt, 48, 0, first.attention, state=first.slots(48, PROMPT)
        )
    )[0]
    expected = hf_logits(dense_hf, prompt)[-1].numpy()
    np.testing.assert_allclose(logits.numpy(), expected, atol=1e-4, rtol=1e-4)
    second = Blocks(first.state[-1][-1] + 1)
    second.attention[:3] = first.attention[:3]
    for own, cached in zip(second.state, first.state, strict=True):
        own[2] = cached[2]  # the state after position 47
    other = np.concatenate((prompt[:48], prompt[::-1][:30]))
    logits = block.forward(
        context_encoding_inputs(
            settings, other, 48, 1, second.attention, state=second.slots(48, 78)
        )
    )[0]
    np.testing.assert_allclose(
        logits.numpy(), hf_logits(dense_hf, other)[-1].numpy(), atol=1e-4, rtol=1e-4
    )


def test_each_feature_changes_the_logits(hf_model, prompt):
    """Parity rests on these: halving the decay's A_log, the convolution, the output
    gate's half of a full layer's q_proj or the gated norm's z projection in
    transformers' own model moves its logits past the tolerance."""
    expected = hf_logits(hf_model, prompt)[-1]
    layers = hf_model.model.layers
    changes = {
        "A_log": lambda: layers[0].linear_attn.A_log,
        "conv1d": lambda: layers[1].linear_attn.conv1d.weight,
        "output gate": lambda: layers[2].self_attn.q_proj.weight[32:64],
        "in_proj_z": lambda: layers[3].linear_attn.in_proj_z.weight,
    }
    for name, tensor in changes.items():
        saved = tensor().clone()
        with torch.no_grad():
            tensor().mul_(0.5)
        try:
            assert (hf_logits(hf_model, prompt)[-1] - expected).abs().max() > 1e-3, name
        finally:
            with torch.no_grad():
                tensor().copy_(saved)


def test_state_slots_follow_the_blocks_vllm_hands_out():
    """With prefix caching (vLLM's 'align' mode) a call reads the block of its first new
    position's predecessor and writes the block of its last; without it ('none', a block
    of max_model_len positions) both are the request's one block; a new sequence reads
    nothing; a state in vLLM's null block is a bug, never read."""
    groups = [[5, 0, 7], [6, 0, 8]]  # vLLM's null block where a state was freed
    assert state_slots(groups, [0, 1, 0], 0, 20, 16).tolist() == [[-1, -1, -1], [0, 0, 0]]
    assert state_slots(groups, [0, 1, 0], 16, 40, 16).tolist() == [[5, 6, 5], [7, 8, 7]]
    assert state_slots([[9], [4]], [1, 0], 70, 71, 128).tolist() == [[4, 9], [4, 9]]
    with pytest.raises(RuntimeError, match="null block"):
        state_slots(groups, [0, 1, 0], 32, 40, 16)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"speculative_method": "ngram", "num_speculative_tokens": 2}, "--speculative-config"),
        (
            {
                "kv_transfer": KVTransferLimits(
                    "NeuronKVConnector", "neuron_plugin.kv_transfer.connector", "kv_both"
                )
            },
            "KV blocks",
        ),
        ({}, "prompt-logprob graphs take no per-sequence state"),
    ],
)
def test_what_the_state_cannot_serve_yet_is_refused_by_flag(tiny_model, change, message):
    given = dataclasses.replace(limits(tiny_model("qwen3_5"), True), **change)
    with pytest.raises(NeuronConfigError, match=message):
        resolve_settings(
            given,
            {},
            backend="reference",
            architecture="Qwen3_5ForCausalLM",
            prompt_logprobs=None if change else True,
        )
