"""The Kubernetes recipe (configs/kubernetes/): every resource is valid against the
Kubernetes API schemas (strict: an unknown field is an error), and the pieces fit
together the way the fleet test runs them on loopback: the precompile Job compiles what
the serving pods load and signs it with the key they trust, the pods ask for the
NeuronCores their engines slice, are ready on /health and scraped, and the router finds
them with the policy the fleet test exercises. The served configuration is resolved by
`neuron-plugin explain-config`, as `vllm serve` would resolve it."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from neuron_plugin.core.instances import core_slices, format_core_list
from tests.e2e.test_fleet import POLICY

ROOT = Path(__file__).resolve().parents[1]
KUBERNETES = ROOT / "configs" / "kubernetes"
# The oldest Kubernetes version EKS still supports as standard, and the newest schemas.
VERSIONS = ("1.31.0", kubernetes_validate.latest_version())


def _resources() -> list[dict]:
    return [doc for path in sorted(KUBERNETES.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def _one(kind: str, name: str) -> dict:
    (found,) = [r for r in _resources()
                if r["kind"] == kind and r["metadata"]["name"] == name]
    return found


def _serve_config() -> dict:
    return yaml.safe_load(_one("ConfigMap", "vllm-neuron-config")["data"]["serve.yaml"])


def _container(kind: str, name: str) -> dict:
    (container,) = _one(kind, name)["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container["env"]}


def _option(command: list[str], flag: str) -> list[str]:
    """The values after `flag` up to the next option."""
    start = command.index(flag) + 1
    end = next((i for i in range(start, len(command)) if command[i].startswith("--")),
               len(command))
    return command[start:end]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_resource_is_valid_kubernetes(version):
    resources = _resources()
    assert {r["kind"] for r in resources} >= {"ConfigMap", "Job", "Deployment", "Service",
                                              "ServiceAccount", "Role", "RoleBinding"}
    for resource in resources:
        kubernetes_validate.validate(resource, version, strict=True)


def test_validation_refuses_a_misspelled_field():
    deployment = copy.deepcopy(_one("Deployment", "vllm-neuron"))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(deployment, VERSIONS[0], strict=True)


def test_serving_pods_request_the_cores_their_engines_slice():
    serve = _serve_config()
    tp, dp = serve["tensor-parallel-size"], serve["data-parallel-size"]
    cores = _container("Deployment", "vllm-neuron")["resources"]["limits"][
        "aws.amazon.com/neuroncore"]
    assert cores == tp * dp
    slices = core_slices(tp, dp, list(range(cores)), "aws.amazon.com/neuroncore")
    assert sorted(c for s in slices for c in s) == list(range(cores))


def test_the_precompile_job_compiles_what_the_pods_load_and_signs_it_for_them():
    job, serving = _container("Job", "vllm-neuron-precompile"), _container(
        "Deployment", "vllm-neuron")
    assert job["command"][:2] == ["neuron-plugin", "precompile"]
    assert serving["command"][:2] == ["vllm", "serve"]
    assert _option(job["command"], "--config") == _option(serving["command"], "--config")
    mounts = [{m["mountPath"]: m for m in c["volumeMounts"]} for c in (job, serving)]
    config = _option(serving["command"], "--config")[0]
    assert mounts[0][config]["name"] == mounts[1][config]["name"] == "config"
    assert job["resources"]["limits"]["aws.amazon.com/neuroncore"] == _serve_config()[
        "tensor-parallel-size"]
    job_env, serving_env = _env(job), _env(serving)
    assert job_env["VLLM_NEURON_CACHE_URL"] == serving_env["VLLM_NEURON_CACHE_URL"]
    assert "VLLM_NEURON_CACHE_SIGNING_KEY" not in serving_env
    signing = Path(job_env["VLLM_NEURON_CACHE_SIGNING_KEY"]["value"])
    trusted = Path(serving_env["VLLM_NEURON_CACHE_TRUSTED_KEYS"]["value"])
    assert trusted.name == f"{signing.name}.pub"
    assert str(signing.parent) in mounts[0] and str(trusted.parent) in mounts[1]


def test_serving_pods_are_ready_on_health_and_scraped():
    deployment = _one("Deployment", "vllm-neuron")
    container = _container("Deployment", "vllm-neuron")
    (port,) = container["ports"]
    assert _option(container["command"], "--port") == [str(port["containerPort"])]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": port["name"]}
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true",
                           "prometheus.io/port": str(port["containerPort"]),
                           "prometheus.io/path": "/metrics"}
    scrape = yaml.safe_load(_one("ConfigMap", "vllm-neuron-prometheus")["data"][
        "prometheus.yml"])
    (job,) = scrape["scrape_configs"]
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]


def test_the_router_discovers_the_serving_pods_with_the_tested_policy():
    router = _container("Deployment", "vllm-router")
    command = router["command"]
    assert command[0] == "vllm-router" and "--service-discovery" in command
    assert _option(command, "--policy") == [POLICY]
    labels = _one("Deployment", "vllm-neuron")["spec"]["template"]["metadata"]["labels"]
    selector = dict(s.split("=", 1) for s in _option(command, "--selector"))
    assert selector.items() <= labels.items()
    (serving_port,) = _container("Deployment", "vllm-neuron")["ports"]
    assert _option(command, "--service-discovery-port") == [str(serving_port["containerPort"])]
    role = _one("Role", "vllm-router")
    assert {"get", "list", "watch"} <= set(role["rules"][0]["verbs"])
    assert role["rules"][0]["resources"] == ["pods"]
    binding = _one("RoleBinding", "vllm-router")
    account = _one("Deployment", "vllm-router")["spec"]["template"]["spec"][
        "serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    service = _one("Service", "vllm-neuron")
    router_labels = _one("Deployment", "vllm-router")["spec"]["template"]["metadata"][
        "labels"]
    assert service["spec"]["selector"].items() <= router_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] in {p["name"] for p in router["ports"]}


def test_every_pod_runs_the_one_image():
    images = {c["image"] for r in _resources() if r["kind"] in ("Deployment", "Job")
              for c in r["spec"]["template"]["spec"]["containers"]}
    assert images == {"vllm-neuron-plugin:0.1.0"}


def test_the_served_configuration_resolves_as_vllm_serve_would(model_dirs, tmp_path):
    """`neuron-plugin explain-config` resolves `--config serve.yaml` with vLLM's own
    parser and the platform's settings (a misspelled flag or a refused value fails),
    for the Qwen3 architecture of the recipe's model (its tiny twin here, no download).
    The precompile Job's extra flags change nothing that is compiled."""
    serve = _serve_config() | {"model": str(model_dirs["qwen3"])}
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(serve))
    cli = str(Path(sys.executable).with_name("neuron-plugin"))
    job = _container("Job", "vllm-neuron-precompile")["command"]
    job_flags = job[job.index("--config") + 2:]
    assert job_flags  # what the Job adds to the served flags
    # The backend the pods choose (the suite's e2e set-up exports another one).
    env = dict(os.environ, VLLM_NEURON_BACKEND=_env(_container(
        "Deployment", "vllm-neuron"))["VLLM_NEURON_BACKEND"]["value"])
    reports = []
    # Each pod sees the cores it requests (the device plugin sets NEURON_RT_VISIBLE_CORES).
    for extra, kind, name in (([], "Deployment", "vllm-neuron"),
                              (job_flags, "Job", "vllm-neuron-precompile")):
        cores = _container(kind, name)["resources"]["limits"]["aws.amazon.com/neuroncore"]
        env["NEURON_RT_VISIBLE_CORES"] = format_core_list(range(int(cores)))
        done = subprocess.run([cli, "explain-config", "--config", str(config), *extra,
                               "--json"], capture_output=True, text=True, timeout=600,
                              env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        reports.append(json.loads(done.stdout))
    settings = reports[0]["settings"]
    assert (settings["tp_degree"], settings["max_model_len"], settings["max_num_seqs"],
            settings["dtype"]) == (serve["tensor-parallel-size"], serve["max-model-len"],
                                   serve["max-num-seqs"], serve["dtype"])
    assert reports[0]["data_parallel"]["engine_cores"] == [[0, 1], [2, 3]]
    compiled = ("buckets", "graphs", "kv_layout")
    assert [reports[1][k] for k in compiled] == [reports[0][k] for k in compiled]
    assert reports[1]["settings"]["tp_degree"] == settings["tp_degree"]


# -- disaggregated prefill and decode (configs/kubernetes/disaggregated/pd.yaml) ------------
PD = KUBERNETES / "disaggregated" / "pd.yaml"


def _pd(kind: str, name: str) -> dict:
    (found,) = [r for r in yaml.safe_load_all(PD.read_text())
                if r and r["kind"] == kind and r["metadata"]["name"] == name]
    return found


def _pd_containers() -> dict[str, dict]:
    pod = _pd("Deployment", "vllm-neuron-pd")["spec"]["template"]["spec"]
    return {c["name"]: c for c in pod["containers"]}


def _pd_serve_config() -> dict:
    return yaml.safe_load(_pd("ConfigMap", "vllm-neuron-pd-config")["data"]["serve.yaml"])


@pytest.mark.parametrize("version", VERSIONS)
def test_pd_resources_are_valid_kubernetes(version):
    resources = [r for r in yaml.safe_load_all(PD.read_text()) if r]
    assert {r["kind"] for r in resources} == {"ConfigMap", "ServiceAccount", "Job",
                                              "Deployment", "Service"}
    for resource in resources:
        kubernetes_validate.validate(resource, version, strict=True)


def test_pd_prefill_and_decode_share_the_payload_folder_and_the_configuration():
    containers = _pd_containers()
    prefill, decode = containers["prefill"], containers["decode"]
    kv = _pd_serve_config()["kv-transfer-config"]
    assert (kv["kv_connector"], kv["kv_connector_module_path"]) == (
        "NeuronKVConnector", "neuron_plugin.kv_transfer.connector")
    path = kv["kv_connector_extra_config"]["path"]
    volumes = {v["name"]: v for v in _pd("Deployment", "vllm-neuron-pd")["spec"]["template"][
        "spec"]["volumes"]}
    for server in (prefill, decode):
        assert server["command"][:2] == ["vllm", "serve"]
        assert _option(server["command"], "--config") == ["/etc/vllm-neuron/serve.yaml"]
        mounts = {m["mountPath"]: m["name"] for m in server["volumeMounts"]}
        # the payload folder: a subfolder (created 0700) of a memory-backed volume
        (volume,) = [mounts[m] for m in mounts if path.startswith(m + "/")]
        assert volumes[volume]["emptyDir"]["medium"] == "Memory"
        # one payload key for both (else the decode server refuses every payload)
        assert _env(server)["VLLM_NEURON_KV_KEY"]["valueFrom"]["secretKeyRef"]["name"] == \
            "vllm-neuron-pd-kv-key"
        assert volumes[mounts["/etc/vllm-neuron/serve.yaml"]]["configMap"]["name"] == \
            "vllm-neuron-pd-config"
        # each server its own NeuronCores: tensor-parallel-size of them
        assert server["resources"]["limits"]["aws.amazon.com/neuroncore"] == \
            _pd_serve_config()["tensor-parallel-size"]
        (port,) = server["ports"]
        assert server["readinessProbe"]["httpGet"] == {"path": "/health", "port": port["name"]}
    assert _env(prefill) == _env(decode)
    assert "VLLM_NEURON_CACHE_SIGNING_KEY" not in _env(prefill)


def test_pd_router_sends_prefill_to_the_prefill_server_and_decode_to_the_decode_server():
    containers = _pd_containers()
    command = containers["router"]["command"]
    assert command[0] == "vllm-router" and "--vllm-pd-disaggregation" in command
    ports = {name: containers[name]["ports"][0]["containerPort"] for name in ("prefill",
                                                                                "decode")}
    for role in ("prefill", "decode"):
        assert _option(command, f"--{role}") == [f"http://127.0.0.1:{ports[role]}"]
        assert _option(containers[role]["command"], "--port") == [str(ports[role])]
    service = _pd("Service", "vllm-neuron-pd")
    labels = _pd("Deployment", "vllm-neuron-pd")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] in {
        p["name"] for p in containers["router"]["ports"]}
    job = _pd("Job", "vllm-neuron-pd-precompile")["spec"]["template"]["spec"]
    (precompile,) = job["containers"]
    assert _option(precompile["command"], "--config") == ["/etc/vllm-neuron/serve.yaml"]
    assert {c["image"] for c in [precompile, *containers.values()]} == {
        "vllm-neuron-plugin:0.1.0"}


def test_pd_served_configuration_resolves_as_vllm_serve_would(model_dirs, tmp_path):
    """The disaggregated servers' flags (the plugin's connector, the block layout) pass
    `neuron-plugin explain-config` as `vllm serve` would resolve them."""
    serve = _pd_serve_config() | {"model": str(model_dirs["qwen3"])}
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(serve))
    cli = str(Path(sys.executable).with_name("neuron-plugin"))
    env = dict(os.environ, VLLM_NEURON_BACKEND="nxd", NEURON_RT_VISIBLE_CORES="0")
    done = subprocess.run([cli, "explain-config", "--config", str(config), "--json"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["kv_layout"]["layout"] == "block"
    assert report["kv_layout"]["block_size"] == serve["block-size"]
