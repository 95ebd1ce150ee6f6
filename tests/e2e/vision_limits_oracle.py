"""The image limits the plugin plans vision buckets from, beside what vLLM's processor
makes of the extreme images, in the interpreter given (a Neuron host's vLLM
environment: its transformers builds the model's processor, which needs torchvision).

Reads {"cases": [{"model": DIR, "kwargs": {...}}]} on stdin (kwargs: the
--mm-processor-kwargs) and prints, per case, {"plugin": [min, max, step] or {"error":
message}, "processor": {...} or {"error": message}}: for the largest image vLLM plans
for (Qwen2VLProcessingInfo.get_image_size_with_most_features) and an 8 x 8 one (scaled
up to the smallest), the patches of the HF processor's output as vLLM calls it
(`_apply_hf_processor_main`, --mm-processor-kwargs merged in) and the patches behind vLLM's
own placeholder count (`get_num_image_tokens` x spatial_merge_size**2)."""

from __future__ import annotations

import json
import sys


def processor_patches(config) -> dict:
    from PIL import Image
    from vllm.multimodal import MULTIMODAL_REGISTRY

    processor = MULTIMODAL_REGISTRY.create_processor(config)
    info = processor.info
    merge = int(config.hf_config.vision_config.spatial_merge_size)
    largest = info.get_image_size_with_most_features()
    found = {}
    for name, (width, height) in (("largest", (largest.width, largest.height)), ("smallest", (8, 8))):
        image = Image.new("RGB", (width, height), (90, 30, 200))
        items = info.parse_mm_data({"image": [image]}, validate=False)
        out = processor._apply_hf_processor_main(items, {})
        found[name] = int(out["image_grid_thw"][0].prod())
        tokens = info.get_num_image_tokens(
            image_width=width,
            image_height=height,
            image_processor=info.get_image_processor(),
            mm_kwargs={},
        )
        found[f"{name}_placeholders"] = int(tokens) * merge * merge
    return found


def main() -> None:
    from vllm.config import ModelConfig

    from neuron_plugin.serving.vllm_settings import vision_limits

    answers = []
    for case in json.load(sys.stdin)["cases"]:
        config = ModelConfig(
            model=case["model"],
            mm_processor_kwargs=case["kwargs"] or None,
            limit_mm_per_prompt={"image": 1},
        )
        answer: dict = {}
        try:
            limits = vision_limits(config)
            answer["plugin"] = [limits.min_patches, limits.max_patches, limits.step]
        except Exception as exc:  # the refusal is the answer
            answer["plugin"] = {"error": str(exc)}
        try:
            answer["processor"] = processor_patches(config)
        except Exception as exc:  # vLLM's processor refusing the settings
            answer["processor"] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
        answers.append(answer)
    print("RESULT " + json.dumps(answers))


if __name__ == "__main__":
    main()
