"""`neuron-plugin validate`'s pure parts: the feature matrix and its judges (cases), the
oracle process (oracle), the sampling statistics, the HBM roofline (speed) and the
report. None imports vLLM: the oracle runs in the backend's environment."""
