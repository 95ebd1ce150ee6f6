"""`neuron-plugin precompile` and `measure-buckets` as real subprocesses: the progress bar
names every bucket, timings become cost tables the tuner accepts, and a bad output path
fails before anything is measured."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from bucketing.cost import load_cost_table

CLI = Path(sys.executable).with_name("neuron-plugin")
# One decode batch size (max_batch_buckets 1): five graphs to compile, not seven.
GRID = json.dumps({"override_neuron_config": {"context_encoding_buckets": [16, 64, 128],
                                              "token_generation_buckets": [64, 128],
                                              "max_batch_buckets": 1}})
# graph_specs order: context encoding, then (batch, length) token generation.
GRAPHS = ["cte_16", "cte_64", "cte_128", "tkg_2x64", "tkg_2x128"]


def plugin(verb: str, model: Path, *extra: str,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI), verb, str(model), "--device", "neuron", "--dtype",
                           "float32", "--max-model-len", "128", "--max-num-seqs", "2",
                           "--additional-config", GRID, *extra],
                          capture_output=True, text=True, timeout=300, env=env)


def test_precompile_progress_bar_names_the_bucket_being_compiled(model_dirs, tmp_path):
    cache = str(tmp_path / "cache")
    result = plugin("precompile", model_dirs["llama"], "--cache", cache)
    assert result.returncode == 0, result.stderr
    assert "5 graphs compiled and published" in result.stdout
    # One bar line per compiled graph: "compiling buckets: k/5 ... bucket=<just compiled>".
    shown = re.findall(r"compiling buckets:.*?(\d)/5 .*?bucket=(\w+)\]", result.stderr)
    named = {int(done): bucket for done, bucket in shown}
    assert named == {k + 1: graph for k, graph in enumerate(GRAPHS)}

    again = plugin("precompile", model_dirs["llama"], "--cache", cache)
    assert again.returncode == 0, again.stderr
    assert "5 graphs already in the cache" in again.stdout
    assert "compiling buckets" not in again.stderr  # nothing compiled, no bar


def test_measure_buckets_writes_tables_the_tuner_accepts(model_dirs, tmp_path):
    prefix = tmp_path / "not" / "yet" / "costs"  # folders that do not exist yet
    result = plugin("measure-buckets", model_dirs["llama"], "--cache", str(tmp_path / "cache"),
                    "--repeats", "3", "-o", str(prefix))
    assert result.returncode == 0, result.stderr
    context = load_cost_table(f"{prefix}-context_encoding.yaml")
    decode = load_cost_table(f"{prefix}-token_generation.yaml")
    assert sorted(context.table) == [(16,), (64,), (128,)]
    assert sorted(decode.table) == [(2, 64), (2, 128)]
    assert all(ms > 0 for ms in [*context.table.values(), *decode.table.values()])

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in (3, 9, 40, 41, 90, 120)) + "\n")
    tuned = subprocess.run([str(Path(sys.executable).with_name("neuron-buckets")), "tune",
                            str(lengths), "--max", "128", "-k", "3", "--json",
                            "--cost", f"{prefix}-context_encoding.yaml"],
                           check=True, capture_output=True, text=True)
    report = json.loads(tuned.stdout)
    assert "measured table" in report["report"]["cost_model"]
    assert report["buckets"]["context_encoding_buckets"][-1] == 128


def test_measure_buckets_with_an_unusable_output_fails_before_measuring(model_dirs, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = tmp_path / "cache"
    result = plugin("measure-buckets", model_dirs["llama"], "--cache", str(cache),
                    "-o", str(blocker / "costs"))
    assert result.returncode == 2
    assert (f"--output {blocker / 'costs'}: cannot create the folder {blocker}"
            in result.stderr)
    assert "Traceback" not in result.stderr
    assert not cache.exists()  # nothing was compiled, loaded or timed


def test_precompile_runs_in_the_backend_environment(model_dirs, tmp_path, sdk_python):
    """With a runner interpreter, compiling happens there (torch 2.9.1): a serving host
    with the same runner then finds the entry; the manifest names the runner's torch."""
    env = {**os.environ, "VLLM_NEURON_BACKEND_PYTHON": sdk_python}
    cache = str(tmp_path / "cache")
    manifest = tmp_path / "manifest.json"
    dry = plugin("precompile", model_dirs["llama"], "--cache", cache, "--dry-run",
                 str(manifest), env=env)
    assert dry.returncode == 0, dry.stderr
    assert json.loads(manifest.read_text())["versions"]["torch"].startswith("2.9.1")
    result = plugin("precompile", model_dirs["llama"], "--cache", cache, env=env)
    assert result.returncode == 0, result.stderr
    assert "5 graphs compiled and published" in result.stdout
    assert "backend runner pid" in result.stdout  # vLLM logs to stdout


def test_precompile_into_a_shared_store_fails_without_the_fleet_key(
        model_dirs, tmp_path, s3_endpoint, fleet_key):
    """Without a signing key a host keeps its build in its read cache (a shared store
    trusts only the fleet's key): the precompile, whose purpose is the store, says so
    and fails; with the key the same command publishes."""
    import boto3

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "VLLM_NEURON_CACHE_"))}
    env.update(AWS_ENDPOINT_URL_S3=s3_endpoint, AWS_ACCESS_KEY_ID="testing",
               AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
               XDG_CACHE_HOME=str(tmp_path / "cache"), XDG_CONFIG_HOME=str(tmp_path / "config"))
    boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id="testing",
                 aws_secret_access_key="testing", region_name="us-east-1").create_bucket(
        Bucket="precompile-fleet")
    store = ["--cache", "s3://precompile-fleet/cache"]
    unsigned = plugin("precompile", model_dirs["llama"], *store, env=env)
    assert unsigned.returncode == 1, unsigned.stderr[-3000:]
    assert "5 graphs are only in this host's read cache, not in the store" in unsigned.stderr
    assert "VLLM_NEURON_CACHE_SIGNING_KEY" in unsigned.stderr
    assert "compiled and kept on this host 5 graphs" in unsigned.stdout
    signed = plugin("precompile", model_dirs["llama"], *store,
                    env={**env, "VLLM_NEURON_CACHE_SIGNING_KEY": str(fleet_key)})
    assert signed.returncode == 0, signed.stderr[-3000:]
    assert "5 graphs compiled and published" in signed.stdout
