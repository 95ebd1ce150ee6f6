"""The architecture table: which Hugging Face architectures the plugin serves, and with
what on each backend (`table`); third-party NxD classes join it through an entry-point
group (`third_party`); the docs and `neuron-plugin models` print it (`render`).

Imports neither vLLM, torch nor NxDI: both backends, the tools, the tiny-checkpoint
builder and the docs read it."""
