"""transformers' greedy answers to chat requests with images, in the interpreter given
(a Neuron host's vLLM environment: its transformers builds the model's processor, which
needs torchvision). Reads {"model": DIR, "requests": [{"messages": [...], "max_tokens":
N}]} on stdin, where image parts are {"type": "image_url", "image_url": {"url": DATA_URL}}
as the OpenAI API carries them; prints each request's generated token ids as JSON."""

from __future__ import annotations

import base64
import io
import json
import sys


def hf_messages(messages: list[dict]) -> tuple[list[dict], list]:
    """The messages with image parts as transformers' chat templates take them, and the
    images in order."""
    from PIL import Image

    images, converted = [], []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            converted.append(message)
            continue
        parts = []
        for part in content:
            if part["type"] == "image_url":
                data = part["image_url"]["url"].split(",", 1)[1]
                images.append(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB"))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        converted.append({**message, "content": parts})
    return converted, images


def main() -> None:
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    job = json.load(sys.stdin)
    processor = AutoProcessor.from_pretrained(job["model"])
    model = AutoModelForImageTextToText.from_pretrained(job["model"], dtype=torch.float32)
    model.eval()
    answers = []
    for request in job["requests"]:
        messages, images = hf_messages(request["messages"])
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = processor(text=[text], images=images or None, return_tensors="pt")
        # Llama 4's processor hands bfloat16 pixels (as vLLM gets them): the model's dtype
        inputs = inputs.to(model.dtype)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=request["max_tokens"], do_sample=False)
        answers.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    json.dump(answers, sys.stdout)


if __name__ == "__main__":
    main()
