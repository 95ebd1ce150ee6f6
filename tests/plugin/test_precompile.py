"""`neuron-plugin measure-buckets`: timings of every compiled bucket as cost tables the
tuner reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bucketing.cost import load_cost_table


def test_measure_buckets_writes_tables_the_tuner_accepts(model_dirs, tmp_path):
    cli = Path(sys.executable).with_name("neuron-plugin")
    prefix = tmp_path / "costs"
    subprocess.run([str(cli), "measure-buckets", str(model_dirs["llama"]), "--device", "neuron",
                    "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "2",
                    "--cache", str(tmp_path / "cache"), "--repeats", "3", "-o", str(prefix),
                    "--additional-config", json.dumps({"override_neuron_config": {
                        "context_encoding_buckets": [16, 64, 128],
                        "token_generation_buckets": [64, 128]}})],
                   check=True, capture_output=True, text=True)
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
