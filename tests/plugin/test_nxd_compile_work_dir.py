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
import time
from pathlib import Path

import pytest

from neuron_plugin.backends.nxd.work_dir import FAILED_KEPT, WORK_DIR_ENV, compile_work_dir
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


def test_a_work_folder_is_the_compiles_and_only_its_logs_outlive_a_failure(tmp_path,
                                                                          monkeypatch):
    """NxD gets `work/`, neuronx-cc's TMPDIR is `tmp/` beside it (never inside what NxD's
    ModelBuilder.trace deletes); a success leaves nothing, a failure only neuronx-cc's
    logs (`log-neuron-cc.txt`) in an nxd-failed-* folder, the newest FAILED_KEPT of them."""
    base = tmp_path / "base"
    monkeypatch.setenv(WORK_DIR_ENV, str(base))
    monkeypatch.delenv("TMPDIR", raising=False)
    with compile_work_dir() as folder:
        assert folder.parent == base
        assert os.environ[WORK_DIR_ENV] == f"{folder / 'work'}{os.sep}"
        assert os.environ["TMPDIR"] == str(folder / "tmp") and (folder / "tmp").is_dir()
        (folder / "work" / "context_encoding_model").mkdir(parents=True)
    assert os.listdir(base) == []
    assert os.environ[WORK_DIR_ENV] == str(base) and "TMPDIR" not in os.environ
    kept = []
    for attempt in range(FAILED_KEPT + 2):
        with pytest.raises(RuntimeError, match="neuronx-cc"):
            with compile_work_dir() as failed:
                bucket = failed / "work" / "token_generation_model" / "_tp0_bk0"
                bucket.mkdir(parents=True)
                (bucket / "log-neuron-cc.txt").write_text(f"ERROR {attempt}")
                (bucket / "model.hlo_module.pb").write_bytes(b"\0" * 4096)
                (failed / "tmp" / "scratch").write_bytes(b"\0" * 4096)
                raise RuntimeError("neuronx-cc failed")
        kept.append(base / failed.name.replace("nxd-compile-", "nxd-failed-"))
        time.sleep(0.01)  # distinct mtimes
    names = sorted(os.listdir(base))
    assert names == sorted(p.name for p in kept[-FAILED_KEPT:])  # the newest, nothing else
    last = kept[-1]
    assert [p.relative_to(last).as_posix() for p in sorted(last.rglob("*")) if p.is_file()] \
        == ["work/token_generation_model/_tp0_bk0/log-neuron-cc.txt"]
    assert (last / "work/token_generation_model/_tp0_bk0/log-neuron-cc.txt").read_text() \
        == f"ERROR {FAILED_KEPT + 1}"


KILLED = """
import os, sys, time
from pathlib import Path
from neuron_plugin.backends.nxd.work_dir import compile_work_dir
with compile_work_dir() as folder:
    log = folder / "work" / "context_encoding_model" / "_tp0_bk0" / "log-neuron-cc.txt"
    log.parent.mkdir(parents=True)
    log.write_text("compiling")
    (log.parent / "graph.neff").write_bytes(b"0" * 4096)
    print(folder, flush=True)
    time.sleep(600)
"""


def test_the_folder_of_a_killed_compile_is_reduced_to_its_logs(tmp_path, monkeypatch):
    """A compile whose process is SIGKILLed (the OOM killer) never runs its cleanup: the
    next compile on the host finds its lock free and keeps only its logs; a live
    compile's folder is left alone."""
    base = tmp_path / "base"
    monkeypatch.setenv(WORK_DIR_ENV, str(base))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(FAKE_ROOT.parents[2]), os.environ.get("PYTHONPATH")]))}
    running = [subprocess.Popen([sys.executable, "-c", KILLED], env=env, stdout=subprocess.PIPE,
                                text=True) for _ in range(2)]
    try:
        folders = [Path(p.stdout.readline().strip()) for p in running]
        running[0].kill()
        running[0].wait()
        with compile_work_dir():
            pass
        dead = base / folders[0].name.replace("nxd-compile-", "nxd-failed-")
        assert [p.name for p in dead.rglob("*") if p.is_file()] == ["log-neuron-cc.txt"]
        assert not folders[0].exists() and not (base / f"{folders[0].name}.lock").exists()
        assert (folders[1] / "work/context_encoding_model/_tp0_bk0/graph.neff").is_file()
    finally:
        for process in running:
            process.kill()
            process.wait()


EAGLE = """
import json, sys, tempfile
from pathlib import Path
from neuron_plugin.backends.nxd.backend import NxDBackend
from tests.plugin.test_nxd_eagle import eagle_settings, write_head

model, folder = Path(sys.argv[1]), Path(sys.argv[2])
head = write_head(folder / "head", "eagle", 2)
settings = eagle_settings("eagle", head, model)
backend = NxDBackend(settings, model)
# A process that has not yet resolved Python's temporary folder (the state the first
# compile of a freshly started worker finds): the EAGLE head is written while compiling.
tempfile.tempdir = None
backend.compile(folder / "graphs")
head_dir = backend._head_dir
backend.load(folder / "graphs")  # NxDI reads the head's folder again
print(json.dumps({"head": str(head_dir), "head_kept": head_dir.is_dir(),
                  "later_temp": tempfile.mkdtemp()}))
"""


def test_the_compile_leaves_this_processs_temporary_folder_alone(model_dirs, tmp_path):
    """NxD's ModelBuilder.trace deletes BASE_COMPILE_WORK_DIR (the double's _trace as
    model_builder.py 544-545): a temporary folder Python resolves while compiling (the
    EAGLE head the backend writes inside the compile) must not be inside it, or the head
    NxDI loads and every later mkdtemp of the process are gone."""
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(FAKE_ROOT), str(FAKE_ROOT.parents[2]),
                                                       os.environ.get("PYTHONPATH")])),
           "FAKE_NXDI_RELEASE": "0.9", "NEURON_RT_VISIBLE_CORES": "0-1",
           "VLLM_NEURON_CACHE_URL": str(tmp_path / "cache"),
           "NEURON_COMPILE_CACHE_URL": str(tmp_path / "neuronx-cc"),
           WORK_DIR_ENV: str(tmp_path / "base"), "TMPDIR": str(tmp_path / "system-tmp")}
    (tmp_path / "system-tmp").mkdir()
    done = subprocess.run([sys.executable, "-c", EAGLE, str(model_dirs["llama"]),
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["head_kept"]
    assert Path(report["head"]).parent == tmp_path / "system-tmp"
    assert Path(report["later_temp"]).parent == tmp_path / "system-tmp"
    assert os.listdir(tmp_path / "base") == []
