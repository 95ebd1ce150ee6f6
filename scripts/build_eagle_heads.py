"""Build tiny EAGLE and EAGLE-3 heads for the corpus-trained speculation target, trained on
its hidden states so their drafts are accepted as a real head's are (a random head's
almost never are).

The heads are written as the published checkpoints are (vLLM 0.32 reads them with
`llama_eagle.py` / `llama_eagle3.py`): a Llama config.json of one decoder layer and a
safetensors file without the `model.` prefix; no embed_tokens nor (EAGLE) lm_head, so the
target's are shared. EAGLE: `fc` over [embedding; the target's final hidden state] and a
layer without input norm. EAGLE-3: `fc` over the target's residual stream entering
layers (0, 1, 2) (`eagle_aux_hidden_state_layer_ids`: the embedding, the middle and the
last layer's output of the 2-layer target), `midlayer.*` attending over
[input_layernorm(embedding); hidden_norm(hidden)], a final norm, and its own lm_head
over the 512 tokens most frequent in the corpus with `d2t` / `t2d` mapping them.

Training is EAGLE's teacher forcing: element j is (token j + 1, the target's state at j)
and learns the target's greedy token after token j + 1. This is an independent plain
PyTorch implementation of the head (the plugin's graphs compute it in
neuron_plugin/backends/reference/eagle.py).

    python scripts/build_eagle_heads.py --models models
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from build_tiny_model import CORPUS, build_speculation_models, building

from neuron_plugin.core.checkpoint import replacing_folder

HEAD_RECIPE_VERSION = 2
DRAFT_VOCAB = 512
AUX_LAYERS = (0, 1, 2)
STEPS = 200
CHAIN = 3  # training passes per step: the target's states, then the head's own twice


def _rms(x, weight, eps):
    import torch

    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x, positions, theta):
    import torch

    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    freqs = positions[:, None].float() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * emb.cos()[:, None] + rotated * emb.sin()[:, None]


def _head_module(config: dict, method: str, draft_vocab: int):
    """The head's parameters (named as its checkpoint names them) and its forward."""
    import torch
    from torch import nn

    hidden, heads, kv = (
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    )
    head_dim, inter = config["head_dim"], config["intermediate_size"]
    attn_in = 2 * hidden if method == "eagle3" else hidden
    prefix = "midlayer." if method == "eagle3" else "layers.0."
    shapes = {
        "fc.weight": (hidden, (len(AUX_LAYERS) if method == "eagle3" else 2) * hidden),
        prefix + "self_attn.q_proj.weight": (heads * head_dim, attn_in),
        prefix + "self_attn.k_proj.weight": (kv * head_dim, attn_in),
        prefix + "self_attn.v_proj.weight": (kv * head_dim, attn_in),
        prefix + "self_attn.o_proj.weight": (hidden, heads * head_dim),
        prefix + "mlp.gate_proj.weight": (inter, hidden),
        prefix + "mlp.up_proj.weight": (inter, hidden),
        prefix + "mlp.down_proj.weight": (hidden, inter),
    }
    norms = [prefix + "post_attention_layernorm.weight"]
    if method == "eagle3":
        norms += [prefix + "input_layernorm.weight", prefix + "hidden_norm.weight", "norm.weight"]
        shapes["lm_head.weight"] = (draft_vocab, hidden)
    params = nn.ParameterDict()
    for name, shape in shapes.items():
        params[name.replace(".", "__")] = nn.Parameter(torch.randn(shape) * 0.08)
    for name in norms:
        params[name.replace(".", "__")] = nn.Parameter(torch.ones(hidden))
    eps, theta = config["rms_norm_eps"], config["rope_theta"]

    def p(name):
        return params[name.replace(".", "__")]

    def forward(embed, state):
        """embed, state [batch, seq, hidden] -> (the states its logits come from, the
        state a chained next element reads)."""
        batch, seq, _ = embed.shape
        if method == "eagle3":
            residual = state
            x_in = torch.cat(
                (
                    _rms(embed, p(prefix + "input_layernorm.weight"), eps),
                    _rms(state, p(prefix + "hidden_norm.weight"), eps),
                ),
                dim=-1,
            )
        else:
            residual = torch.cat((embed, state), dim=-1) @ p("fc.weight").t()
            x_in = residual
        a = prefix + "self_attn."
        positions = torch.arange(seq)
        q = (x_in @ p(a + "q_proj.weight").t()).view(batch, seq, heads, head_dim)
        k = (x_in @ p(a + "k_proj.weight").t()).view(batch, seq, kv, head_dim)
        v = (x_in @ p(a + "v_proj.weight").t()).view(batch, seq, kv, head_dim)
        q, k = _rope(q, positions, theta), _rope(k, positions, theta)
        k = k.repeat_interleave(heads // kv, dim=2)
        v = v.repeat_interleave(heads // kv, dim=2)
        out = (
            torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            .transpose(1, 2)
            .reshape(batch, seq, -1)
        )
        x = residual + out @ p(a + "o_proj.weight").t()
        h = _rms(x, p(prefix + "post_attention_layernorm.weight"), eps)
        m = prefix + "mlp."
        mlp = (
            torch.nn.functional.silu(h @ p(m + "gate_proj.weight").t())
            * (h @ p(m + "up_proj.weight").t())
        ) @ p(m + "down_proj.weight").t()
        x = x + mlp
        return (_rms(x, p("norm.weight"), eps), x) if method == "eagle3" else (x, x)

    return params, forward


def _target_states(model, ids):
    """(final normed hidden states, the residual stream entering each layer of AUX_LAYERS
    (index num_layers: the last layer's output), logits) of the target on ids."""
    import torch

    outputs: dict[int, torch.Tensor] = {}
    hooks = [
        layer.register_forward_hook(
            lambda _m, _i, out, i=i: outputs.__setitem__(
                i + 1, out[0] if isinstance(out, tuple) else out
            )
        )
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        result = model(ids, output_hidden_states=True)
    finally:
        for hook in hooks:
            hook.remove()
    outputs[0] = result.hidden_states[0]
    return result.hidden_states[-1], [outputs[i] for i in AUX_LAYERS], result.logits


def build_head(target: Path, out: Path, method: str, steps: int = STEPS, seed: int = 0) -> Path:
    """Write a trained `method` head for `target` to `out` (kept when its stamp matches)."""
    import hashlib

    wanted = {
        "head_recipe_version": HEAD_RECIPE_VERSION,
        "method": method,
        "steps": steps,
        "seed": seed,
        "target_recipe": json.loads((target / "tiny_model_recipe.json").read_text()),
        "corpus_sha256": hashlib.sha256(CORPUS.read_bytes()).hexdigest(),
    }
    with building(out, "eagle_head_recipe.json", wanted) as stale:
        if stale:
            _write_head(target, out, method, steps, seed, wanted)
    return out


def _write_head(target: Path, out: Path, method: str, steps: int, seed: int, wanted: dict) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tconfig = json.loads((target / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target)
    ids = torch.tensor(tokenizer(CORPUS.read_text())["input_ids"])
    vocab = tconfig["vocab_size"]
    counts = torch.bincount(ids, minlength=vocab)
    draft_ids = torch.sort(torch.topk(counts, DRAFT_VOCAB).indices).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    to_draft = torch.full((vocab,), -100, dtype=torch.long)
    to_draft[draft_ids] = torch.arange(DRAFT_VOCAB)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": tconfig["hidden_size"],
        "intermediate_size": tconfig["intermediate_size"],
        "num_attention_heads": tconfig["num_attention_heads"],
        "num_key_value_heads": tconfig["num_key_value_heads"],
        "head_dim": tconfig["head_dim"],
        "num_hidden_layers": 1,
        "rms_norm_eps": tconfig["rms_norm_eps"],
        "rope_theta": 10000.0,
        "vocab_size": vocab,
        "max_position_embeddings": tconfig["max_position_embeddings"],
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": tconfig["bos_token_id"],
        "eos_token_id": tconfig["eos_token_id"],
    }
    if method == "eagle3":
        config["architectures"] = ["LlamaForCausalLMEagle3"]
        config["draft_vocab_size"] = DRAFT_VOCAB
        config["eagle_aux_hidden_state_layer_ids"] = list(AUX_LAYERS)
    params, forward = _head_module(config, method, DRAFT_VOCAB)
    optimizer = torch.optim.AdamW(params.parameters(), lr=3e-3)
    embed, lm_head = model.model.embed_tokens.weight.detach(), model.lm_head.weight.detach()
    generator = torch.Generator().manual_seed(seed)
    window, batch = 64, 16
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - window, (batch,), generator=generator)
        inputs = torch.stack([ids[s : s + window] for s in starts.tolist()])
        with torch.no_grad():
            final, aux, logits = _target_states(model, inputs)
        wanted_next = logits.argmax(-1)[:, 1:]  # the target's token after token j + 1
        if method == "eagle3":
            state = torch.cat(aux, dim=-1)[:, :-1] @ params["fc__weight"].t()
        else:
            state = final[:, :-1]
        loss = torch.zeros(())
        for _ in range(CHAIN):
            states, state = forward(embed[inputs[:, 1:]], state)
            if method == "eagle3":
                scores, labels = states @ params["lm_head__weight"].t(), to_draft[wanted_next]
            else:
                scores, labels = states @ lm_head.t(), wanted_next
            loss = loss + torch.nn.functional.cross_entropy(
                scores.reshape(-1, scores.shape[-1]), labels.reshape(-1)
            )
            # The next pass reads each element's predecessor's own output, as a chained
            # draft does (EAGLE-3's training-time test, in its simplest form).
            state = torch.cat((state[:, :1], state[:, :-1]), dim=1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    tensors = {name.replace("__", "."): p.detach().contiguous() for name, p in params.items()}
    if method == "eagle3":
        tensors["d2t"] = (draft_ids - torch.arange(DRAFT_VOCAB)).to(torch.int64)
        tensors["t2d"] = t2d
    with replacing_folder(out) as staging:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save_pretrained(staging)
        (staging / "eagle_head_recipe.json").write_text(json.dumps(wanted, indent=2))


def build_eagle_heads(models: Path) -> tuple[Path, Path, Path]:
    """The speculation target (`build_speculation_models`) and its trained EAGLE and
    EAGLE-3 heads, in `models`/tiny-mistral-{eagle,eagle3}."""
    target, _ = build_speculation_models(models)
    return (
        target,
        build_head(target, models / "tiny-mistral-eagle", "eagle"),
        build_head(target, models / "tiny-mistral-eagle3", "eagle3"),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, default=Path("models"), help="models folder")
    args = parser.parse_args(argv)
    for path in build_eagle_heads(args.models):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
