"""Build small, deterministic Llama- and Qwen3-family checkpoints for tests and the demo.

No model can be downloaded on the machines this project is built on, so the tests, the
demo and the benchmarks use checkpoints made here: random weights from a fixed seed and a
byte-level BPE tokenizer trained on `scripts/corpus/tiny_corpus.txt`. The output is a
normal Hugging Face folder (config.json, model.safetensors, tokenizer files) that both
`transformers` and vLLM load, with a chat template in tokenizer_config.json (as Hugging
Face chat checkpoints ship one) so `/v1/chat/completions` works without
`--chat-template`. Re-running with the same arguments leaves an existing folder
untouched (a stamp file records the recipe).

    python scripts/build_tiny_model.py --arch llama --out models/tiny-llama

A Qwen3-shaped checkpoint with Qwen3's real vocabulary (151,936 embedding rows; the
tokenizer stays the tiny one, as Qwen3's own 151,669-token tokenizer also leaves padding
rows) and one layer, for measurements where the vocabulary's size matters (sampling,
logits traffic):

    python scripts/build_tiny_model.py --arch qwen3 --layers 1 --model-vocab 151936 \
        --out models/qwen3-vocab151936
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "corpus" / "tiny_corpus.txt"
RECIPE_VERSION = 2  # 2: the tokenizer config carries CHAT_TEMPLATE
QWEN3_VOCAB = 151_936  # Qwen3's embedding rows

# One turn per message: the role on its own line, the text, then the end-of-text token,
# which is also the model's EOS, so a generated reply stops at the end of its turn. With
# add_generation_prompt the prompt ends with an open assistant turn.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('chat template of the tiny models: role ' ~ message['role'] ~ "
    "' is not supported; use system, user or assistant') }}"
    "{%- endif %}"
    "{{- message['role'] ~ '\\n' ~ message['content'] ~ eos_token ~ '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'assistant\\n' }}{%- endif %}"
)

# Small but structurally faithful: head_dim 64, GQA (2 KV heads for 4 query heads).
ARCHITECTURES: dict[str, dict] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "attention_bias": False,
    },
}


def train_tokenizer(vocab_size: int):
    """Byte-level BPE trained on the shipped corpus (deterministic for a fixed corpus)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|bos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(CORPUS)], trainer)
    return tokenizer


def recipe(arch: str, seed: int, vocab_size: int, max_positions: int,
           layers: int | None = None, model_vocab: int | None = None) -> dict:
    corpus_digest = __import__("hashlib").sha256(CORPUS.read_bytes()).hexdigest()
    shape = {k: v for k, v in (("layers", layers), ("model_vocab", model_vocab))
             if v is not None}  # absent by default, so existing folders stay valid
    return {
        "recipe_version": RECIPE_VERSION,
        "arch": arch,
        "seed": seed,
        "vocab_size": vocab_size,
        "max_positions": max_positions,
        "corpus_sha256": corpus_digest,
        **shape,
    }


def build(arch: str, out: Path, *, seed: int = 0, vocab_size: int = 1024,
          max_positions: int = 4096, layers: int | None = None,
          model_vocab: int | None = None) -> Path:
    """Write the checkpoint to `out` unless an identical one is already there.
    `vocab_size` sizes the trained tokenizer; `model_vocab` (default: the tokenizer's
    size) the embedding and output rows; `layers` overrides the architecture's depth."""
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"--arch {arch!r} is not known; choose one of {sorted(ARCHITECTURES)}"
        )
    wanted = recipe(arch, seed, vocab_size, max_positions, layers, model_vocab)
    stamp = out / "tiny_model_recipe.json"
    if stamp.exists() and json.loads(stamp.read_text()) == wanted:
        return out

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    tokenizer_core = train_tokenizer(vocab_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer_core,
        bos_token="<|bos|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    fields = dict(ARCHITECTURES[arch])
    model_type = fields.pop("model_type")
    if layers is not None:
        fields["num_hidden_layers"] = layers
    if model_vocab is not None and model_vocab < len(tokenizer):
        raise ValueError(f"--model-vocab {model_vocab} is below the tokenizer's "
                         f"{len(tokenizer)} tokens; pass at least that many rows")
    config = AutoConfig.for_model(
        model_type,
        **fields,
        vocab_size=model_vocab or len(tokenizer),
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        # Larger than the usual 0.02 so greedy choices are well separated and float
        # rounding differences between implementations cannot flip an argmax.
        initializer_range=0.08,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        config.save_pretrained(staging)
        tensors = {
            name: t.detach().contiguous()
            for name, t in model.state_dict().items()
            if not (config.tie_word_embeddings and name == "lm_head.weight")
        }
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        # In tokenizer_config.json, where most Hugging Face checkpoints keep it.
        tokenizer.save_pretrained(staging, save_jinja_files=False)
        (staging / "tiny_model_recipe.json").write_text(json.dumps(wanted, indent=2))
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--max-positions", type=int, default=4096)
    parser.add_argument("--layers", type=int, help="decoder layers (default: the arch's)")
    parser.add_argument("--model-vocab", type=int,
                        help=f"embedding/output rows, e.g. {QWEN3_VOCAB} (Qwen3's); "
                             f"default: the tokenizer's size")
    args = parser.parse_args(argv)
    path = build(args.arch, args.out, seed=args.seed, vocab_size=args.vocab_size,
                 max_positions=args.max_positions, layers=args.layers,
                 model_vocab=args.model_vocab)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
