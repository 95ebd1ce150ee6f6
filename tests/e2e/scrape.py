"""Reading a server's `neuron:` metrics as Prometheus would scrape them."""

from __future__ import annotations

import time
from collections.abc import Callable

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def neuron_samples(base_url: str, prefix: str = "neuron:") -> Samples:
    """Every `neuron:` sample (or `prefix`'s) on `base_url`/metrics except histogram
    buckets, keyed by (sample name, labels)."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{base_url}/metrics", timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name.startswith(prefix) and "le" not in s.labels}


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum over the samples named `name` whose labels include `labels` (what PromQL's
    `sum(name{labels})` answers)."""
    wanted = set(labels.items())
    return sum(v for (n, found), v in samples.items() if n == name and wanted <= found)


def wait_for(base_url: str, done: Callable[[Samples], bool], timeout: float = 30) -> Samples:
    """Scrape until `done` holds (engines publish every 0.5 s); the last scrape either way."""
    return wait_for_hosts([base_url], lambda samples: done(samples[0]), timeout)[0]


def wait_for_hosts(base_urls: list[str], done: Callable[[list[Samples]], bool],
                   timeout: float = 30) -> list[Samples]:
    """`wait_for` over several servers scraped together: `done` sees one scrape of each."""
    deadline = time.monotonic() + timeout
    while True:
        samples = [neuron_samples(url) for url in base_urls]
        if done(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.5)
