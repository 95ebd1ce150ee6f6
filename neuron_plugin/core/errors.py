"""The one error type for configurations that cannot work (kept apart so that
`core.settings` and `core.instances` can both raise it)."""


class NeuronConfigError(ValueError):
    """A configuration that cannot work; the message names the settings and the fix."""
