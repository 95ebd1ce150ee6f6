"""`python -m neuron_plugin.backends.runner`: the runner process (see server.py)."""

from neuron_plugin.backends.runner.server import main

raise SystemExit(main())
