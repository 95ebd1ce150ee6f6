"""The validation oracle: Hugging Face transformers on the same checkpoint, on the CPU, as
a process of its own in the backend's environment (the Neuron SDK's venv has
transformers; no vLLM, no device, no second download).

It scores what the server produced rather than generating its own continuation: for a
prompt and the tokens served after it, one teacher-forced forward gives, at every served
position, the oracle's log-probabilities (the served token's, the best, the top k). A
served greedy token is right when it is the oracle's argmax or within the dtype's
tolerance of it (a near tie), and every position is checked, even past a tie, because the
oracle reads the served context. LoRA adapters (PEFT's safetensors layout) are applied
as y += scale * B(A x) on their target modules, by forward hooks, so the base weights are
never copied.

Protocol: one JSON object per line on stdin, one answer per line on stdout.
  {"op": "score", "prompt": [ids], "tokens": [ids], "adapter": folder|null,
   "of": [[ids] per position] (optional),
   "prompt_of": [[ids] per prompt position 1..] and "prompt_k": k (optional),
   "images": {name: array} (optional: what the model's image processor returned for
   the prompt's images, validation/images.py encode_arrays; the prompt holds each
   image's placeholder tokens as vLLM expanded them)}
    -> {"chosen": [logprob], "best": [logprob], "argmax": [id],
        "of": [{id: logprob} per position] (with "of"),
        "prompt_of": [{id: logprob}], "prompt_kth": [k-th best logprob], "prompt_k": k
        per prompt position 1.. (with "prompt_of")}
  {"op": "info"} -> {"vocab_size": n, "transformers": version, "torch": version}
An error answers {"error": message}; the process keeps serving.
Run as `python -m neuron_plugin.validation.oracle MODEL_DIR [--dtype float32]`.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from neuron_plugin.validation.images import decode_arrays

ADAPTER_WEIGHTS = "adapter_model.safetensors"


class LoraAdapter:
    """A PEFT LoRA adapter: per module, (A [r, in], B [out, r], scale)."""

    def __init__(self, folder: Path):
        from safetensors.torch import load_file

        config = json.loads((folder / "adapter_config.json").read_text())
        if config.get("rank_pattern") or config.get("alpha_pattern"):
            raise ValueError(
                f"{folder}: the oracle applies adapters of one rank and alpha only "
                f"(rank_pattern / alpha_pattern are set); validate with such an adapter"
            )
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        tensors = load_file(str(folder / ADAPTER_WEIGHTS))
        self.modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
        for name, a in tensors.items():
            if not name.endswith(".lora_A.weight"):
                continue
            module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            self.modules[module] = (a.float(), b.float(), scale)

    @contextmanager
    def applied(self, model: torch.nn.Module) -> Iterator[None]:
        modules = dict(model.named_modules())
        missing = sorted(set(self.modules) - set(modules))
        if missing:
            raise ValueError(f"the adapter trains modules the model lacks: {missing[:3]}")
        handles = []
        for name, (a, b, scale) in self.modules.items():

            def hook(
                _module: Any,
                args: tuple[torch.Tensor, ...],
                out: torch.Tensor,
                a: torch.Tensor = a,
                b: torch.Tensor = b,
                scale: float = scale,
            ) -> torch.Tensor:
                x = args[0].to(a.dtype)
                return out + (scale * (x @ a.T) @ b.T).to(out.dtype)

            handles.append(modules[name].register_forward_hook(hook))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


class Oracle:
    def __init__(self, model_dir: Path, dtype: str):
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        config = json.loads((model_dir / "config.json").read_text())
        # a vision-language model: its language model and its vision tower
        auto = AutoModelForImageTextToText if "vision_config" in config else AutoModelForCausalLM
        self.model = auto.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        self.adapters: dict[str, LoraAdapter] = {}

    def info(self) -> dict[str, Any]:
        import transformers

        return {
            "vocab_size": self.model.get_output_embeddings().weight.shape[0],
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        }

    def score(
        self,
        prompt: list[int],
        tokens: list[int],
        adapter: str | None,
        of: list[list[int]] | None = None,
        prompt_of: list[list[int]] | None = None,
        prompt_k: int = 0,
        images: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        if not tokens:
            raise ValueError("nothing to score: the request produced no tokens")
        ids = torch.tensor([prompt + tokens[:-1]])
        inputs = {name: torch.from_numpy(a) for name, a in decode_arrays(images or {}).items()}
        if adapter is None:
            logits = self._logits(ids, inputs)
        else:
            lora = self.adapters.get(adapter) or LoraAdapter(Path(adapter))
            self.adapters[adapter] = lora
            with lora.applied(self.model):
                logits = self._logits(ids, inputs)
        logprobs = torch.log_softmax(logits[len(prompt) - 1 :].float(), dim=-1)
        prompt_logprobs = torch.log_softmax(logits[: len(prompt) - 1].float(), dim=-1)
        served = torch.tensor(tokens)
        best, argmax = logprobs.max(dim=-1)
        answer: dict[str, Any] = {
            "chosen": logprobs.gather(1, served[:, None])[:, 0].tolist(),
            "best": best.tolist(),
            "argmax": argmax.tolist(),
        }
        if of is not None:
            answer["of"] = [
                {str(token): float(row[token]) for token in ids}
                for row, ids in zip(logprobs, of, strict=True)
            ]
        if prompt_of is not None:
            answer["prompt_of"] = [
                {str(token): float(row[token]) for token in ids}
                for row, ids in zip(prompt_logprobs, prompt_of, strict=True)
            ]
            answer["prompt_kth"] = (
                prompt_logprobs.topk(max(prompt_k, 1), dim=-1).values[:, -1].tolist()
            )
            answer["prompt_k"] = prompt_k
        return answer

    def _logits(self, ids: torch.Tensor, images: dict[str, torch.Tensor]) -> torch.Tensor:
        """Every position's logits; `images` the image processor's tensors (pixel values
        in the model's dtype). transformers 5 reads the image tokens' places from
        `mm_token_type_ids` (1 at an image token, what its processors return beside
        input_ids), 4.57 from the ids themselves."""
        dtype = self.model.dtype
        inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in images.items()}
        if inputs and "mm_token_type_ids" in inspect.signature(self.model.forward).parameters:
            config = self.model.config
            image_token = getattr(config, "image_token_id", None)
            if image_token is None:
                image_token = config.image_token_index
            inputs["mm_token_type_ids"] = (ids == image_token).long()
        with torch.no_grad():
            return self.model(input_ids=ids, **inputs).logits[0]


def serve(oracle: Oracle, lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        try:
            request = json.loads(line)
            if request["op"] == "info":
                yield oracle.info()
            elif request["op"] == "score":
                yield oracle.score(
                    request["prompt"],
                    request["tokens"],
                    request.get("adapter"),
                    request.get("of"),
                    request.get("prompt_of"),
                    request.get("prompt_k", 0),
                    request.get("images"),
                )
            else:
                yield {"error": f"unknown op {request['op']!r}"}
        except Exception as exc:  # answered to the caller, who reports it per case
            yield {"error": f"{type(exc).__name__}: {exc}"}


def main() -> None:
    parser = argparse.ArgumentParser(description="The validation oracle (see the module doc).")
    parser.add_argument("model")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    answers, sys.stdout = sys.stdout, sys.stderr  # libraries' prints stay off the protocol
    oracle = Oracle(Path(args.model), args.dtype)
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for answer in serve(oracle, iter(sys.stdin.readline, "")):
        print(json.dumps(answer), file=answers, flush=True)


if __name__ == "__main__":
    main()
