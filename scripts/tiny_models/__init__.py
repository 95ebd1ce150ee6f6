"""The tiny checkpoints scripts/build_tiny_model.py builds, by kind: what they share
(common), text models (text), vision-language models (vision), trained weights
(training)."""
