"""The README's main job as a new user runs it: `scripts/serve-demo.sh` (set-up stamp
check, the tiny checkpoint, `vllm serve --device neuron` on the embedded reference
backend), then the requests the documentation sends it, exactly as documented (the
curl commands to the demo's model, on the port the test chose)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import requests

from tests.docs.shell import commands
from tests.docs.test_commands import PAGES, ROOT
from tests.e2e.support import LoopbackProcess, free_port

pytestmark = pytest.mark.server

DEMO_MODEL = str(ROOT / "models" / "tiny-llama")


def demo_requests() -> list[tuple[str, dict]]:
    """(route, JSON body) of each documented request to the demo's model."""
    found = []
    for page in PAGES:
        for command in commands(page, ROOT):
            if command.argv[0] != "curl" or "-d" not in command.argv:
                continue
            body = json.loads(command.argv[command.argv.index("-d") + 1])
            if body.get("model") == DEMO_MODEL:
                url = next(w for w in command.argv[1:] if w.startswith("localhost:8000/"))
                found.append((url.removeprefix("localhost:8000"), body))
    return found


def test_the_demo_serves_the_documented_requests(tmp_path):
    documented = demo_requests()
    routes = {route for route, _ in documented}
    assert {"/v1/completions", "/v1/chat/completions"} <= routes
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_NEURON_BACKEND"}
    demo = LoopbackProcess([str(ROOT / "scripts" / "serve-demo.sh"), "--port", str(port)],
                           port, tmp_path / "demo.log", env=env)
    try:
        demo.wait_healthy(timeout=600)
        for route, body in documented:
            reply = requests.post(f"{demo.url}{route}", json=body, timeout=120)
            assert reply.status_code == 200, (route, reply.text)
            choice = reply.json()["choices"][0]
            assert (choice.get("text") or choice["message"]["content"]), (route, choice)
    finally:
        demo.proc.send_signal(signal.SIGTERM)
        try:
            demo.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            demo.proc.kill()
    assert "environment" in demo.log() and "is up to date" in demo.log(), \
        "the demo's set-up reinstalled the tests' environment"
    assert Path(DEMO_MODEL, "config.json").exists()
