"""The validation oracle as a process of its own (validation/oracle.py), driven over its
JSON-lines protocol. It starts loading the model at once, so it loads while the engine
starts; its stderr goes to a log file whose tail any failure quotes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import IO, Any


class OracleError(RuntimeError):
    pass


class OracleProcess:
    def __init__(self, python: str, model: str, dtype: str, log: Path):
        self.python, self.log = python, log
        with open(log, "w") as err:
            self._proc = subprocess.Popen(
                [python, "-m", "neuron_plugin.validation.oracle", model, "--dtype", dtype],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        self._ready = False

    def _pipes(self) -> tuple[IO[str], IO[str]]:
        assert self._proc.stdin is not None and self._proc.stdout is not None  # PIPE above
        return self._proc.stdin, self._proc.stdout

    def _read(self) -> dict[str, Any]:
        line = self._pipes()[1].readline()
        if not line:
            tail = self.log.read_text(errors="replace")[-2000:]
            raise OracleError(f"the oracle ({self.python}) exited: {tail}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """One answer ({"error": ...} for a request the oracle could not serve)."""
        if not self._ready:
            self._read()  # {"ready": true} once the model is loaded
            self._ready = True
        stdin = self._pipes()[0]
        stdin.write(json.dumps(request) + "\n")
        stdin.flush()
        return self._read()

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(timeout=30)
