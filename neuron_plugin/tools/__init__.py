"""The `neuron-plugin` command-line verbs: explain-config, doctor, precompile,
measure-buckets, and the helpers they share."""
