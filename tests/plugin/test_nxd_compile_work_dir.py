"""Every NxD compile in a work folder of its own (backends/nxd/work_dir.py), against the
NxDI double, which reproduces how neuronx-distributed's ModelBuilder.trace uses
BASE_COMPILE_WORK_DIR: it deletes the folder, writes each bucket's NEFF there and reads
the NEFFs back into the compiled model (tests/plugin/fake_nxdi, application_base
_trace). Two compiles of different configurations at once on one host, in two
processes, as two servers or two precompiles start them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from neuron_plugin.backends.nxd.work_dir import WORK_DIR_ENV, compile_work_dir
from tests.plugin.fake_nxdi.nxdi_release import ROOT as FAKE_ROOT

COMPILE = """
import json, sys
from pathlib import Path
from neuron_plugin.backends.nxd.backend import NxDBackend
from neuron_plugin.core.settings import EngineLimits, resolve_settings

model, override, folder = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
limits = EngineLimits(max_model_len=256, max_num_seqs=4, block_size=None,
                      enable_prefix_caching=False, enable_chunked_prefill=False,
                      max_num_batched_tokens=256, dtype="float32", tp_degree=2)
settings = resolve_settings(limits, override, backend="nxd", architecture="LlamaForCausalLM")
backend = NxDBackend(settings, model)
backend.compile(folder)
backend.load(folder)  # NxDI's load refuses graphs other than its configuration's
print("loaded", json.dumps(backend.model.traced_model.nxd_model.buckets))
"""


def test_two_compiles_at_once_on_one_host_each_get_their_own_work_folder(model_dirs,
                                                                        tmp_path):
    """Both processes inherit one BASE_COMPILE_WORK_DIR (NxD's /tmp/nxd_model/ where
    unset) and reach the point where ModelBuilder reads its NEFFs back at the same
    time: each compiles and loads its own graphs, and leaves no work folder behind."""
    shared = tmp_path / "nxd_model"
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    repo = FAKE_ROOT.parents[2]
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(FAKE_ROOT), str(repo),
                                                       os.environ.get("PYTHONPATH")])),
           "FAKE_NXDI_RELEASE": "0.9", "NEURON_RT_VISIBLE_CORES": "0-1",
           "VLLM_NEURON_CACHE_URL": str(tmp_path / "cache"),
           WORK_DIR_ENV: str(shared), "FAKE_NXDI_TRACE_BARRIER": f"{barrier}:2"}
    configurations = {
        "a": {"context_encoding_buckets": [128, 256], "token_generation_buckets": [256]},
        "b": {"context_encoding_buckets": [64, 256], "token_generation_buckets": [128, 256]},
    }
    processes = {
        name: subprocess.Popen(
            [sys.executable, "-c", COMPILE, str(model_dirs["llama"]), json.dumps(override),
             str(tmp_path / name)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        for name, override in configurations.items()}
    results = {name: p.communicate(timeout=300) for name, p in processes.items()}
    for name, (out, err) in results.items():
        assert processes[name].returncode == 0, err[-3000:]
        buckets = json.loads(out.strip().splitlines()[-1].removeprefix("loaded "))
        assert buckets["context_encoding_model"] == configurations[name][
            "context_encoding_buckets"]
    assert len(os.listdir(barrier)) == 2  # both traces met there
    assert os.listdir(shared) == []  # each work folder removed after its compile


def test_a_work_folder_is_the_compiles_and_kept_when_it_fails(tmp_path, monkeypatch):
    monkeypatch.setenv(WORK_DIR_ENV, str(tmp_path / "base"))
    monkeypatch.delenv("TMPDIR", raising=False)
    with compile_work_dir() as work:
        assert work.parent == tmp_path / "base"
        assert os.environ[WORK_DIR_ENV] == f"{work}{os.sep}"
        assert os.environ["TMPDIR"] == str(work / "tmp") and (work / "tmp").is_dir()
        (work / "context_encoding_model").mkdir()
    assert not work.exists()
    assert os.environ[WORK_DIR_ENV] == str(tmp_path / "base") and "TMPDIR" not in os.environ
    with pytest.raises(RuntimeError, match="neuronx-cc"):
        with compile_work_dir() as failed:
            raise RuntimeError("neuronx-cc failed")
    assert failed.is_dir() and failed != work  # its logs stay for the user to read
