"""What every tiny checkpoint shares: the corpus and its byte-level BPE tokenizer, the
chat template, and the random offsets on parameters transformers initialises to
constants (so the tests check they are applied)."""

from __future__ import annotations

from pathlib import Path

CORPUS = Path(__file__).resolve().parents[1] / "corpus" / "tiny_corpus.txt"

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


def perturb_constants(model, seed: int) -> None:
    """Random offsets (std 0.1) on the parameters transformers initialises to constants:
    norm weights, biases, attention sinks, Gemma 4's router scales and its layers'
    layer_scalar (a buffer the checkpoint holds)."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    constant = ("bias", "sinks", "scale", "per_expert_scale")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(constant):
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.add_(0.1 * torch.randn(buffer.shape, generator=generator))
