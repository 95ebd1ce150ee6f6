"""vLLM's offline API with images on the plugin, in the interpreter given (a Neuron
host's vLLM environment): `LLM.generate` with `multi_modal_data` (the prompt text built
by the model's chat template, the images as PIL images) for every request in one batch,
and `LLM.chat` with OpenAI-style image parts for the first. Reads {"model": DIR,
"requests": [{"messages": [...], "max_tokens": N}], "engine": {LLM keyword arguments}}
on stdin (vision_oracle.py's job, plus the engine's settings); prints {"generate":
[ids per request], "chat": ids} as JSON after "RESULT " on a line of its own (vLLM
prints to stdout too)."""

from __future__ import annotations

import json
import sys

from vision_oracle import hf_messages


def main() -> None:
    from transformers import AutoProcessor
    from vllm import LLM, SamplingParams

    job = json.load(sys.stdin)
    processor = AutoProcessor.from_pretrained(job["model"])
    llm = LLM(model=job["model"], **job["engine"])
    prompts, params = [], []
    for request in job["requests"]:
        messages, images = hf_messages(request["messages"])
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append({"prompt": text, "multi_modal_data": {"image": images}} if images
                       else {"prompt": text})
        params.append(SamplingParams(temperature=0.0, max_tokens=request["max_tokens"]))
    generated = [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]
    first = job["requests"][0]
    chatted = llm.chat(first["messages"], params[0])[0].outputs[0].token_ids
    print("RESULT", json.dumps({"generate": generated, "chat": list(chatted)}), flush=True)


if __name__ == "__main__":
    main()
