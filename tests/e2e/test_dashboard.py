"""The Grafana dashboard (configs/grafana/vllm-neuron.json) queries only metrics a running
server exports: every `neuron:` and `vllm:` name in its queries is scraped from the
session's `vllm serve --device neuron` after it served a request (the shared server of
test_server.py and test_chat.py; the Kubernetes example's Prometheus job, which scrapes
those pods' /metrics, is checked in tests/test_manifests.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.server  # the session's server (conftest.py; tests/xdist_schedule.py)

DASHBOARD = Path(__file__).resolve().parents[2] / "configs" / "grafana" / "vllm-neuron.json"
METRIC = re.compile(r"\b(?:neuron|vllm):[a-zA-Z0-9_]+")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
            "gauge": ("",), "summary": ("_sum", "_count", "")}


def queried_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    queries += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return {name for query in queries for name in METRIC.findall(query)}


def exported_metrics(text: str) -> set[str]:
    """Every series name the exposition has or would have (a counter family with no
    sample yet is still its `_total` series)."""
    from prometheus_client.parser import text_string_to_metric_families

    names = set()
    for family in text_string_to_metric_families(text):
        names |= {sample.name for sample in family.samples}
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
    return names


def test_every_metric_the_dashboard_queries_is_exported(server, client, model_dirs):
    import requests

    client.completions.create(model=str(model_dirs["llama"]), prompt="The scheduler",
                              max_tokens=4, temperature=0)
    exported = exported_metrics(requests.get(f"{server.url}/metrics", timeout=30).text)
    queried = queried_metrics()
    assert {"neuron:compile_cache_lookups_total", "neuron:kv_transfer_bytes_total",
            "neuron:spec_accepted_tokens_total", "neuron:forward_seconds_bucket",
            "neuron:step_host_seconds_sum", "vllm:time_to_first_token_seconds_bucket"} <= queried
    assert sorted(queried - exported) == []


def test_the_engine_counts_its_compile_cache_lookup(server, client, model_dirs):
    import requests

    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{server.url}/metrics", timeout=30).text
    lookups = {sample.labels["result"]: sample.value
               for family in text_string_to_metric_families(text)
               if family.name == "neuron:compile_cache_lookups" for sample in family.samples}
    assert sum(lookups.values()) == 1 and set(lookups) <= {"hit", "miss"}
