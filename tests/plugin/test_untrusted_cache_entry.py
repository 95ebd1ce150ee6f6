"""The attack of the compile-cache issue, end to end: someone with write access to the
fleet's S3 bucket computes a key (`neuron-plugin precompile --dry-run`), publishes an
entry whose `.pt2` archives carry a pickled payload, with the record's digests rewritten
to match. `neuron-cache verify`, `neuron-plugin precompile` and the serving path
(`load_backend`, what vLLM's worker calls) all refuse it, and the payload, which would
create a marker file, never runs. Also: the reference loader itself refuses anything but
its data-only graph format, even in an entry signed by a trusted key."""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import boto3
import numpy as np
import pytest
import torch

from compile_cache.manifest import cache_key
from compile_cache.record import new_record
from neuron_plugin.backends.base import graph_specs
from neuron_plugin.backends.loader import cache_manifest, load_backend, make_backend
from neuron_plugin.backends.reference.backend import ReferenceBackend
from neuron_plugin.backends.reference.graph_file import GraphFileError, load_graph
from neuron_plugin.core.inputs import CONTEXT_ENCODING
from neuron_plugin.core.settings import EngineLimits, NeuronConfigError, resolve_settings
from tests.compile_cache.conftest import own_config_home, s3_bucket  # noqa: F401 (fixtures)

GRID = {"context_encoding_buckets": [64], "token_generation_buckets": [64]}
PREFIX = "fleet"


def reference_settings():
    limits = EngineLimits(max_model_len=64, max_num_seqs=1, block_size=None,
                          enable_prefix_caching=False, enable_chunked_prefill=False,
                          max_num_batched_tokens=64, dtype="float32")
    return resolve_settings(limits, GRID, backend="reference", architecture="LlamaForCausalLM")


class Payload:
    """Unpickling this creates `marker`: proof that code from the store ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def crafted_pt2(marker: Path) -> bytes:
    """A genuine torch.export archive whose weights are marked `use_pickle` and replaced
    by the payload: what torch.export.load unpickles with weights_only=False."""

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b", torch.ones(2))

        def forward(self, x):
            return x + self.b

    saved = io.BytesIO()
    torch.export.save(torch.export.export(Module(), (torch.ones(2),)), saved)
    source = zipfile.ZipFile(io.BytesIO(saved.getvalue()))
    config_name = next(n for n in source.namelist() if n.endswith("model_weights_config.json"))
    config = json.loads(source.read(config_name))
    for meta in config["config"].values():
        meta["use_pickle"] = True
    weights = {f"data/weights/{meta['path_name']}" for meta in config["config"].values()}
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for info in source.infolist():
            data = source.read(info)
            if info.filename == config_name:
                data = json.dumps(config).encode()
            elif any(info.filename.endswith(w) for w in weights):
                data = pickle.dumps(Payload(marker))
            archive.writestr(info.filename, data)
    return out.getvalue()


def craft_entry(folder: Path, marker: Path, names: list[str]) -> None:
    """The attacker's artifact folder: payload archives and an artifact record."""
    (folder / "graphs").mkdir(parents=True)
    for name in names:
        (folder / "graphs" / f"{name}.pt2").write_bytes(crafted_pt2(marker))
    (folder / "graphs.json").write_text(json.dumps({"format": 1, "backend": "reference",
                                                    "graphs": names}))


def publish_to_s3(bucket: str, manifest: dict, folder: Path) -> str:
    """Push the entry as a bucket writer can: objects, then a record whose digests match
    the planted files (unsigned: the attacker holds no fleet key)."""
    record = new_record(manifest, folder)
    client = boto3.client("s3")
    for rel in record.files:
        client.put_object(Bucket=bucket, Key=f"{PREFIX}/objects/{record.key}/{record.id}/{rel}",
                          Body=(folder / rel).read_bytes())
    client.put_object(Bucket=bucket, Key=f"{PREFIX}/entries/{record.key}.json",
                      Body=record.to_json())
    return record.key


def test_the_crafted_archive_is_live(tmp_path):
    """The payload does run when torch.export.load reads the archive (what the old
    loader did), so its absence below means it was refused, not that it was inert."""
    archive = tmp_path / "probe.pt2"
    archive.write_bytes(crafted_pt2(tmp_path / "ran"))
    try:
        torch.export.load(str(archive))
    except RuntimeError:
        pass  # the archive is broken after the payload ran
    assert (tmp_path / "ran").exists()


def test_verify_and_serving_refuse_a_crafted_entry_in_s3(s3_bucket, fleet_key, model_dirs,
                                                         tmp_path, monkeypatch):
    marker = tmp_path / "payload-ran"
    settings = reference_settings()
    model = model_dirs["llama"]
    manifest = cache_manifest(settings, make_backend(settings, model))
    craft_entry(tmp_path / "crafted", marker, [g.name for g in graph_specs(settings)])
    key = publish_to_s3(s3_bucket, manifest, tmp_path / "crafted")
    assert key == cache_key(manifest)

    # A serving host: trusts the fleet's public key, holds no signing key.
    monkeypatch.delenv("VLLM_NEURON_CACHE_SIGNING_KEY")
    monkeypatch.setenv("VLLM_NEURON_CACHE_TRUSTED_KEYS", f"{fleet_key}.pub")
    monkeypatch.setenv("VLLM_NEURON_CACHE_LOCAL_DIR", str(tmp_path / "read-cache"))
    url = f"s3://{s3_bucket}/{PREFIX}"
    verified = subprocess.run([str(Path(sys.executable).with_name("neuron-cache")), "verify",
                               "--store", url], capture_output=True, text=True, timeout=120)
    assert verified.returncode == 1
    assert f"{key}  FAILED: record is not signed" in verified.stdout

    backend, result = load_backend(settings, model, url)
    assert not result.hit and f"miss: entry {key} refused: record is not signed" in result.reason
    assert result.path.is_relative_to(tmp_path / "read-cache")
    assert not list(result.path.rglob("*.pt2"))
    logits = backend.forward(_one_prompt(settings))
    assert logits.shape[0] == 1 and torch.isfinite(logits).all()
    assert not marker.exists()


def _one_prompt(settings):
    from neuron_plugin.core.inputs import context_encoding_inputs

    return context_encoding_inputs(settings, np.array([4, 5, 6]), 0, 0, None)


def test_precompile_on_the_compile_host_refuses_and_replaces_a_crafted_entry(
        s3_bucket, fleet_key, model_dirs, tmp_path, monkeypatch):
    marker = tmp_path / "payload-ran"
    cli = str(Path(sys.executable).with_name("neuron-plugin"))
    url = f"s3://{s3_bucket}/{PREFIX}"
    monkeypatch.setenv("VLLM_NEURON_CACHE_LOCAL_DIR", str(tmp_path / "read-cache"))
    flags = [str(model_dirs["llama"]), "--backend", "reference", "--device", "neuron",
             "--dtype", "float32", "--max-model-len", "64", "--max-num-seqs", "1",
             "--cache", url, "--additional-config",
             json.dumps({"override_neuron_config": GRID})]
    manifest_file = tmp_path / "manifest.json"
    subprocess.run([cli, "precompile", *flags, "--dry-run", str(manifest_file)], check=True,
                   capture_output=True, text=True, timeout=300)
    manifest = json.loads(manifest_file.read_text())  # what anyone can compute
    craft_entry(tmp_path / "crafted", marker, ["cte_64", "tkg_1x64"])
    key = publish_to_s3(s3_bucket, manifest, tmp_path / "crafted")

    done = subprocess.run([cli, "precompile", *flags], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"compiled and published: key {key} (miss: entry {key} quarantined: record is " \
           "not signed" in done.stdout
    assert not marker.exists()
    quarantined = boto3.client("s3").list_objects_v2(
        Bucket=s3_bucket, Prefix=f"{PREFIX}/quarantine/").get("Contents", [])
    assert len(quarantined) == 1
    verified = subprocess.run([str(Path(sys.executable).with_name("neuron-cache")), "verify",
                               "--store", url], capture_output=True, text=True, timeout=120)
    assert verified.returncode == 0 and f"{key}  ok" in verified.stdout


def test_the_reference_loader_never_reads_an_archive_even_from_a_trusted_entry(
        model_dirs, tmp_path):
    marker = tmp_path / "payload-ran"
    settings = reference_settings()
    craft_entry(tmp_path / "entry", marker, [g.name for g in graph_specs(settings)])
    with pytest.raises(NeuronConfigError, match="graph_format"):
        ReferenceBackend(settings, model_dirs["llama"]).load(tmp_path / "entry")
    assert not marker.exists()


@pytest.mark.parametrize("op", ["aten.as_strided.default", "torch.os.system",
                                "aten.from_file.default", "builtins.exec"])
def test_a_graph_naming_an_operator_outside_the_allow_list_is_refused(tmp_path, op):
    (tmp_path / "g.safetensors").write_bytes(b'\x02\x00\x00\x00\x00\x00\x00\x00{}')
    (tmp_path / "g.json").write_text(json.dumps({
        "format": "neuron-reference-graph/1", "inputs": [{"user": 0}],
        "nodes": [{"op": op, "args": [{"ref": 0}, "echo hi"], "kwargs": {}}],
        "outputs": [{"ref": 1}]}))
    with pytest.raises(GraphFileError, match="is not allowed"):
        load_graph(tmp_path, "g")


@pytest.mark.parametrize("value", [{"call": "os.system"}, {"ref": 5}, {"dtype": "os"},
                                   {"device": "cuda; rm -rf /"}])
def test_a_graph_value_that_is_not_a_literal_or_earlier_reference_is_refused(tmp_path, value):
    (tmp_path / "g.safetensors").write_bytes(b'\x02\x00\x00\x00\x00\x00\x00\x00{}')
    (tmp_path / "g.json").write_text(json.dumps({
        "format": "neuron-reference-graph/1", "inputs": [{"user": 0}],
        "nodes": [{"op": "aten.add.Tensor", "args": [{"ref": 0}, value], "kwargs": {}}],
        "outputs": [{"ref": 1}]}))
    with pytest.raises(GraphFileError, match="is not allowed"):
        load_graph(tmp_path, "g")


def test_loaded_graphs_compute_exactly_what_the_decoder_computes(model_dirs, tmp_path):
    settings = reference_settings()
    backend = ReferenceBackend(settings, model_dirs["llama"])
    backend.compile(tmp_path / "graphs")
    assert sorted(p.suffix for p in (tmp_path / "graphs" / "graphs").iterdir()) == \
        [".json", ".json", ".safetensors", ".safetensors"]
    backend.load(tmp_path / "graphs")
    for graph in graph_specs(settings):
        args = list(backend._example_inputs(graph, backend.weights))
        generator = torch.Generator().manual_seed(0)
        args[1] = torch.randint(0, 100, args[1].shape, generator=generator)
        width = args[4].shape[-1]
        args[2] = torch.arange(args[2].shape[-1]).expand(args[2].shape).contiguous()
        args[3] = args[2].clone()
        args[4] = torch.arange(width).expand(args[4].shape).contiguous()
        args[5] = torch.full(args[5].shape, 3 if graph.phase == CONTEXT_ENCODING else width)
        caches = [torch.randn(args[7].shape, generator=generator) for _ in range(2)]
        outputs = []
        loaded = backend.graphs[graph.key]
        # the loaded graph twice: its first call records the trace, the second runs it
        for run in (backend.module, loaded, loaded):
            call = [*args[:7], caches[0].clone(), caches[1].clone(), *args[9:]]
            with torch.inference_mode():
                result = run(*call)  # logits, or (logits, tokens) with on-device sampling
            outputs.append((*(result if isinstance(result, tuple) else (result,)),
                            call[7], call[8]))
        assert loaded.traced is not None
        for got in outputs[1:]:
            assert len(outputs[0]) == len(got)
            for expected, value in zip(outputs[0], got):
                assert torch.equal(expected, value), graph.name


class _Accumulate(torch.nn.Module):
    def forward(self, x: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.index_put_((slots,), x, accumulate=True)
        return cache.sum()


def test_a_loaded_graph_writes_its_inputs_once_per_call_traced_or_not(tmp_path):
    """The first call runs the graph while recording its trace, later calls run the
    trace: each adds to the cache exactly once, as the exported module does."""
    from neuron_plugin.backends.reference.graph_file import save_graph

    x, slots, cache = torch.tensor([1.0, 10.0]), torch.tensor([0, 2]), torch.zeros(3)
    save_graph(torch.export.export(_Accumulate(), (x, slots, cache.clone())), tmp_path, "g")
    graph = load_graph(tmp_path, "g")
    assert graph.traced is None
    assert graph(x, slots, cache).item() == 11.0 and cache.tolist() == [1.0, 0.0, 10.0]
    assert graph.traced is not None
    assert graph(2 * x, slots.flip(0), cache).item() == 33.0
    assert cache.tolist() == [21.0, 0.0, 12.0]


class _Conversions(torch.nn.Module):
    def forward(self, x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return x.float() * 2 + i.to(torch.float32)  # x is float32 already: a no-op


def test_calls_that_do_nothing_are_left_out_of_graph_files(tmp_path):
    """Export's metadata asserts and a conversion to the dtype a value already has cost
    a call each on every step and change nothing: the file holds neither, and the graph
    computes the same."""
    from neuron_plugin.backends.reference.graph_file import save_graph

    x, i = torch.randn(3), torch.arange(3)
    save_graph(torch.export.export(_Conversions(), (x, i)), tmp_path, "g")
    ops = [node["op"] for node in json.loads((tmp_path / "g.json").read_text())["nodes"]]
    assert "aten._assert_tensor_metadata.default" not in ops
    assert ops.count("aten.to.dtype") == 1  # the int64 -> float32 one
    assert torch.equal(load_graph(tmp_path, "g")(x, i), _Conversions()(x, i))


def test_graph_files_written_with_metadata_asserts_still_load(tmp_path):
    (tmp_path / "g.safetensors").write_bytes(b'\x02\x00\x00\x00\x00\x00\x00\x00{}')
    (tmp_path / "g.json").write_text(json.dumps({
        "format": "neuron-reference-graph/1", "inputs": [{"user": 0}],
        "nodes": [{"op": "aten._assert_tensor_metadata.default", "args": [{"ref": 0}],
                   "kwargs": {"dtype": {"dtype": "float32"}}},
                  {"op": "aten.add.Tensor", "args": [{"ref": 0}, {"ref": 0}], "kwargs": {}}],
        "outputs": [{"ref": 2}]}))
    assert load_graph(tmp_path, "g")(torch.ones(2)).tolist() == [2.0, 2.0]
