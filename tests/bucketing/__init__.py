"""Tests of the bucketing package."""

from pathlib import Path

# The Azure LLM inference trace 2023 (conversation) shipped with the repository
# (attribution in scripts/data/README.md).
AZURE = (Path(__file__).resolve().parents[2] / "scripts" / "data"
         / "azure_llm_inference_conv_2023.csv")
