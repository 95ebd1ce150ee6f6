"""Cost models and the cost-table file format."""

import json

import numpy as np
import pytest

from bucketing.cost import (DEFAULT_COST, LinearQuadraticCost, PaddedTokenCost, TableCost,
                            dump_cost_table, load_cost_table)
from bucketing.errors import BucketError, BucketFileError


def test_default_model_reproduces_the_measured_points():
    # NEURON_FINDINGS: 128-token bucket 13.4 ms, single 2048 graph 211 ms.
    assert DEFAULT_COST.cost((128,)) == pytest.approx(13.4, abs=0.1)
    assert DEFAULT_COST.cost((2048,)) == pytest.approx(211, abs=0.5)


def test_linear_quadratic_layouts():
    model = LinearQuadraticCost(fixed_ms=1, per_token_ms=0.5, per_pair_ms=0.01)
    assert model((10,)) == pytest.approx(1 + 5 + 1)
    assert model((2, 10)) == pytest.approx(1 + 10 + 0.01 * 20 * 10)
    prefix = LinearQuadraticCost(fixed_ms=1, per_token_ms=0.5, per_pair_ms=0.01,
                                 layout="active_prefix")
    assert prefix((10, 30)) == pytest.approx(1 + 5 + 0.01 * 10 * 40)
    assert prefix.costs(np.array([[10, 30], [10, 0]])).tolist() == pytest.approx([10, 7])
    with pytest.raises(BucketError, match="cost layout 'rows' is unknown"):
        LinearQuadraticCost(layout="rows")


def test_padded_token_cost_is_the_product():
    assert PaddedTokenCost()((4, 128)) == 512
    assert PaddedTokenCost().unit == "tokens"


def write(path, document):
    path.write_text(json.dumps(document))
    return path


TABLE = {"unit": "ms", "phase": "context_encoding", "source": "inf2.xlarge qwen3-0.6b",
         "buckets": [{"shape": [128], "ms": 13.4}, {"shape": [512], "ms": 40.0},
                     {"shape": [2048], "ms": 211.0, "samples": 100}]}


def test_table_lookup_exact_interpolated_clamped_and_refused(tmp_path):
    table = load_cost_table(write(tmp_path / "t.json", TABLE))
    assert table.cost((512,)) == 40.0
    assert table.cost((320,)) == pytest.approx(13.4 + (40 - 13.4) * (320 - 128) / (512 - 128))
    assert table.cost((64,)) == 13.4
    with pytest.raises(BucketError, match=r"no timing for shape \[4096\].*measured: \[128\]"):
        table.cost((4096,))
    assert "3 shapes" in table.describe()


def test_two_dimensional_table_interpolates_along_the_last_dimension():
    table = TableCost(phase="token_generation",
                      table={(1, 128): 5.0, (1, 512): 9.0, (4, 128): 6.0})
    assert table.cost((1, 320)) == pytest.approx(7.0)
    assert table.cost((4, 100)) == 6.0
    with pytest.raises(BucketError, match="no timing for shape"):
        table.cost((2, 128))
    assert table.costs(np.array([[1, 128], [1, 512]])).tolist() == [5.0, 9.0]


def test_yaml_table_round_trip(tmp_path):
    path = dump_cost_table(tmp_path / "t.yaml", phase="token_generation",
                           timings=[((1, 128), 5.0), ((4, 512), 9.25)], source="reference",
                           samples=20)
    text = path.read_text()
    assert text.startswith("# bucket -> ms cost table")
    table = load_cost_table(path)
    assert table.table == {(1, 128): 5.0, (4, 512): 9.25}
    assert table.phase == "token_generation" and table.source == "reference"


@pytest.mark.parametrize("change, key, message", [
    ({"unit": "s"}, "unit", 'must be "ms"'),
    ({"phase": "decode"}, "phase", "must be one of context_encoding"),
    ({"buckets": []}, "buckets", "non-empty list"),
    ({"buckets": [5]}, r"buckets\[0\]", "must be a mapping with shape and ms"),
    ({"buckets": [{"shape": [128]}]}, r"buckets\[0\].ms", "is missing"),
    ({"buckets": [{"shape": [128], "ms": 0}]}, r"buckets\[0\].ms", "must be a number > 0"),
    ({"buckets": [{"shape": [], "ms": 1}]}, r"buckets\[0\].shape", "non-empty list"),
    ({"buckets": [{"shape": [0], "ms": 1}]}, r"buckets\[0\].shape", "whole number >= 1"),
    ({"buckets": [{"shape": [128], "ms": 1, "p50": 2}]}, r"buckets\[0\].p50", "unknown key"),
    ({"buckets": [{"shape": [128], "ms": 1}, {"shape": [128], "ms": 2}]},
     r"buckets\[1\].shape", "listed twice"),
    ({"buckets": [{"shape": [128], "ms": 1}, {"shape": [1, 128], "ms": 2}]},
     r"buckets\[1\].shape", "has 2 dimensions but earlier shapes have 1"),
    ({"source": 5}, "source", "must be a string"),
    ({"units": "ms"}, "units", "unknown key \\(did you mean 'unit'\\?\\)"),
])
def test_bad_tables_name_file_key_and_expectation(tmp_path, change, key, message):
    path = write(tmp_path / "bad.json", {**TABLE, **change})
    with pytest.raises(BucketFileError, match=f"bad.json: {key}: .*{message}"):
        load_cost_table(path)


def test_missing_required_key(tmp_path):
    document = {k: v for k, v in TABLE.items() if k != "phase"}
    with pytest.raises(BucketFileError, match="bad.json: phase: is missing; it is required"):
        load_cost_table(write(tmp_path / "bad.json", document))


def test_dump_refuses_an_invalid_table_before_writing(tmp_path):
    with pytest.raises(BucketFileError, match="phase"):
        dump_cost_table(tmp_path / "t.yaml", phase="warmup", timings=[((128,), 1.0)])
    assert not (tmp_path / "t.yaml").exists()
