"""Trace formats and the needs derived from them."""

import json

import numpy as np
import pytest

from bucketing.errors import BucketError, BucketFileError
from bucketing.trace import read_lengths
from bucketing.workload import (Workload, as_workload, concurrency, context_needs,
                                decode_needs, histogram, needs, paired_needs)
from tests.bucketing import AZURE


def jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_jsonl_reads_known_fields_and_ignores_the_rest(tmp_path):
    path = jsonl(tmp_path / "t.jsonl", [
        {"request_id": "a", "prompt_tokens": 94, "output_tokens": 3, "batch": 4,
         "prefix_hit_tokens": 64, "bucket": [128], "ttft_ms": 13.4},
        {"request_id": "b", "prompt_tokens": 300, "output_tokens": 1, "batch": 1,
         "prefix_hit_tokens": 0, "bucket": [512], "ttft_ms": 40.1},
    ])
    workload = read_lengths(path)
    assert workload.prompt_tokens.tolist() == [94, 300]
    assert workload.output_tokens.tolist() == [3, 1]
    assert workload.batch.tolist() == [4, 1]
    assert workload.prefix_hit_tokens.tolist() == [64, 0]
    assert workload.requests == 2 and workload.source == str(path)


def test_a_json_file_holding_json_lines_is_read_as_a_trace(tmp_path):
    path = jsonl(tmp_path / "t.json", [{"prompt_tokens": 5}, {"prompt_tokens": 7}])
    assert read_lengths(path).prompt_tokens.tolist() == [5, 7]


def test_optional_fields_absent_everywhere_are_none(tmp_path):
    workload = read_lengths(jsonl(tmp_path / "t.jsonl", [{"prompt_tokens": 5}]))
    assert workload.output_tokens is None and workload.batch is None
    assert workload.prefix_hit_tokens is None


@pytest.mark.parametrize("records, message", [
    ([{"output_tokens": 5}], "line 1: prompt_tokens: is missing"),
    ([{"prompt_tokens": 0}], "line 1: prompt_tokens: must be a whole number >= 1, got 0"),
    ([{"prompt_tokens": "94"}], "line 1: prompt_tokens: must be a whole number >= 1, got '94'"),
    ([{"prompt_tokens": 5, "batch": 0}], "line 1: batch: must be a whole number >= 1"),
    ([{"prompt_tokens": 5, "prefix_hit_tokens": 6}],
     "line 1: prefix_hit_tokens: 6 is more than prompt_tokens 5"),
    ([{"prompt_tokens": 5, "output_tokens": 2}, {"prompt_tokens": 6}],
     "line 2: output_tokens: is missing although other requests have it"),
    ([[5]], "line 1: must be a JSON object"),
])
def test_bad_jsonl_records_name_line_field_and_fix(tmp_path, records, message):
    with pytest.raises(BucketFileError, match=message):
        read_lengths(jsonl(tmp_path / "t.jsonl", records))


def test_broken_json_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt_tokens": 5}\n{"prompt_tokens": \n')
    with pytest.raises(BucketFileError, match="t.jsonl: line 2: is not a JSON object"):
        read_lengths(path)


def test_azure_csv_trace():
    workload = read_lengths(AZURE)
    assert workload.requests == 19366
    assert workload.prompt_tokens[:3].tolist() == [374, 396, 879]
    assert workload.output_tokens[:3].tolist() == [44, 109, 55]
    assert workload.batch is None


def test_csv_with_field_names_and_bad_cells(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("id,prompt_tokens,batch\nx,10,2\ny,20,1\n")
    workload = read_lengths(path)
    assert workload.prompt_tokens.tolist() == [10, 20] and workload.batch.tolist() == [2, 1]
    path.write_text("ContextTokens,GeneratedTokens\n10,abc\n")
    with pytest.raises(BucketFileError, match="line 2: output_tokens: must be a whole number"):
        read_lengths(path)
    path.write_text("when,tokens\n1,2\n")
    with pytest.raises(BucketFileError, match="header: has no prompt-length column"):
        read_lengths(path)


def test_plain_list_of_lengths(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("# prompt lengths\n94\n\n120  # a comment\n94\n")
    workload = read_lengths(path)
    assert workload.prompt_tokens.tolist() == [94, 120]
    assert workload.counts.tolist() == [2, 1]
    path.write_text("94\nninety\n")
    with pytest.raises(BucketFileError, match="line 2: 'ninety' is not a whole number"):
        read_lengths(path)


def test_empty_trace(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("\n# nothing\n")
    with pytest.raises(BucketFileError, match="holds no requests"):
        read_lengths(path)


def test_histogram_documents(tmp_path):
    path = tmp_path / "h.yaml"
    path.write_text("source: made up\nhistogram: {97: 300, 120: 40}\n")
    workload = read_lengths(path)
    assert workload.prompt_tokens.tolist() == [97, 120]
    assert workload.counts.tolist() == [300, 40]
    path = tmp_path / "h.json"
    path.write_text('{"histogram": {"97": 3}}')
    assert read_lengths(path).counts.tolist() == [3]
    path.write_text('{"histogram": {"x": 3}}')
    with pytest.raises(BucketFileError, match="histogram key 'x': must be a whole number"):
        read_lengths(path)
    path.write_text('{"hist": {"97": 3}}')
    with pytest.raises(BucketFileError, match="unknown key \\(did you mean 'histogram'\\?\\)"):
        read_lengths(path)


def test_histogram_and_as_workload():
    hist = histogram([5, 3, 5, 9], [1, 2, 3, 0])
    assert hist.values.tolist() == [3, 5] and hist.counts.tolist() == [2, 4]
    assert as_workload({7: 2, 3: 1}).prompt_tokens.tolist() == [3, 7]
    with pytest.raises(BucketError, match="the workload is empty"):
        as_workload([])
    with pytest.raises(BucketError, match="request length -1 is negative"):
        as_workload([-1, 5])


def decode_brute_force(prompts, outputs, speculation=0):
    steps = {}
    for p, o in zip(prompts, outputs):
        for k in range(2, o + 1):  # output token k is decoded at position p + k - 2
            need = p + k - 2 + 1 + speculation
            steps[need] = steps.get(need, 0) + 1
    return steps


def test_decode_needs_match_a_step_by_step_count():
    workload = Workload(np.array([10, 12, 30]), np.array([1, 1, 1]),
                        output_tokens=np.array([4, 1, 3]))
    hist = decode_needs(workload, speculation_length=2)
    assert dict(zip(hist.values.tolist(), hist.counts.tolist())) == decode_brute_force(
        [10, 12, 30], [4, 1, 3], speculation=2)


def test_decode_needs_on_the_azure_trace_count_every_step():
    workload = read_lengths(AZURE)
    hist = decode_needs(workload)
    assert hist.counts.sum() == np.maximum(workload.output_tokens - 1, 0).sum()
    first = workload.prompt_tokens[0] + 1
    assert first in hist.values


def test_no_decode_steps_gives_an_empty_histogram():
    workload = Workload(np.array([5]), np.array([1]), output_tokens=np.array([1]))
    assert decode_needs(workload).values.size == 0


def test_context_needs_with_prefix_caching(tmp_path):
    workload = read_lengths(jsonl(tmp_path / "t.jsonl", [
        {"prompt_tokens": 100, "prefix_hit_tokens": 64},
        {"prompt_tokens": 36, "prefix_hit_tokens": 0}]))
    assert context_needs(workload).values.tolist() == [36, 100]
    assert context_needs(workload, prefix_caching=True).values.tolist() == [36]
    assert context_needs(workload, prefix_caching=True).counts.tolist() == [2]
    with pytest.raises(BucketError, match="has no prefix_hit_tokens"):
        context_needs(read_lengths(jsonl(tmp_path / "u.jsonl", [{"prompt_tokens": 5}])),
                      prefix_caching=True)


def test_paired_needs(tmp_path):
    workload = read_lengths(jsonl(tmp_path / "t.jsonl", [
        {"prompt_tokens": 100, "output_tokens": 3, "batch": 2, "prefix_hit_tokens": 64},
        {"prompt_tokens": 100, "output_tokens": 2, "batch": 2, "prefix_hit_tokens": 64},
        {"prompt_tokens": 50, "output_tokens": 1, "batch": 1, "prefix_hit_tokens": 0}]))
    rows, counts = paired_needs(workload, "prefix")
    assert rows.tolist() == [[36, 64], [50, 0]] and counts.tolist() == [2, 1]
    rows, counts = paired_needs(workload, "batch", "context")
    assert rows.tolist() == [[1, 50], [2, 100]] and counts.tolist() == [1, 2]
    rows, counts = paired_needs(workload, "batch", "decode")
    assert rows.tolist() == [[2, 101], [2, 102]] and counts.tolist() == [2, 1]
    with pytest.raises(BucketError, match="use --phase context"):
        paired_needs(workload, "prefix", "decode")
    with pytest.raises(BucketError, match="unknown pair 'seq'"):
        paired_needs(workload, "seq")
    with pytest.raises(BucketError, match="unknown phase 'prefill'"):
        needs(workload, "prefill")


def test_csv_timestamps_become_arrival_seconds(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,374,44\n"
                    "2023-11-16 18:15:50.9951690,396,109\n")
    workload = read_lengths(path)
    assert workload.arrival_s == pytest.approx([0.0, 4.3145790], abs=1e-6)


def test_the_azure_trace_keeps_its_arrivals():
    workload = read_lengths(AZURE)
    assert workload.arrival_s is not None and workload.arrival_s.size == workload.requests
    assert workload.arrival_s.min() == 0 and 3000 < workload.arrival_s.max() < 4000


@pytest.mark.parametrize("records, message", [
    ([{"prompt_tokens": 5, "arrival_s": 0}, {"prompt_tokens": 5}],
     "line 2: arrival_s: is missing although other requests have it"),
    ([{"prompt_tokens": 5, "arrival_s": "soon"}], "line 1: arrival_s: 'soon' is not a number"),
])
def test_arrivals_are_all_or_none_and_numbers(tmp_path, records, message):
    with pytest.raises(BucketFileError, match=message):
        read_lengths(jsonl(tmp_path / "t.jsonl", records))


def test_a_bad_csv_timestamp_names_line_and_column(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,374,44\n")
    with pytest.raises(BucketFileError, match="line 2: TIMESTAMP.*'yesterday' is neither"):
        read_lengths(path)


def test_concurrency_is_the_mean_in_flight_over_each_request():
    """Two requests of 10 tokens at 100 ms a token (1 s each): b arrives half-way through
    a, so each has company half its time (1.5 in flight, rounded to 2); c arrives alone."""
    workload = Workload(prompt_tokens=np.array([10, 10, 10]), counts=np.ones(3, dtype=int),
                        output_tokens=np.array([10, 10, 10]),
                        arrival_s=np.array([0.0, 0.5, 5.0]))
    assert concurrency(workload, ms_per_token=100, max_num_seqs=8).tolist() == [2, 2, 1]
    # a server of one sequence slot queues the rest: every batch is 1
    assert concurrency(workload, ms_per_token=100, max_num_seqs=1).tolist() == [1, 1, 1]
    # a slower pace keeps them in flight longer: c still alone, a and b together
    assert concurrency(workload, ms_per_token=1000, max_num_seqs=8).tolist() == [2, 2, 2]
    with pytest.raises(BucketError, match="arrival_s"):
        concurrency(Workload(np.array([1]), np.array([1]), output_tokens=np.array([1])),
                    ms_per_token=25, max_num_seqs=8)
