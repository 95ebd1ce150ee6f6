"""Pure pieces shared by both sides of the backend boundary: settings resolution, the
NxD forward inputs, checkpoint reading, instance facts. No vLLM imports, so they run in
the Neuron SDK's Python environment too."""
