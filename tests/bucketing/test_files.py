"""Bucket-set files: schema, error messages, round trips and the shipped sets."""

from pathlib import Path

import pytest
import yaml

from bucketing.errors import BucketFileError
from bucketing.files import KEYS, dump_bucket_set, load_bucket_set

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "buckets"


def test_yaml_loads_into_override_keys(tmp_path):
    path = tmp_path / "set.yaml"
    path.write_text("# a comment\n"
                    "description: short prompts\n"
                    "context_encoding_buckets: [128, 256, 2048]\n"
                    "prefix_buckets: [0, 512, 2048]\n")
    # prefix 0 is always added by the grid, so listing it is allowed and dropped.
    assert load_bucket_set(path) == {"context_encoding_buckets": [128, 256, 2048],
                                     "prefix_buckets": [512, 2048]}


def test_round_trip_in_yaml_and_json(tmp_path):
    lists = dict(context_encoding_buckets=[128, 512], token_generation_buckets=[512, 2048],
                 prefix_buckets=[512], token_generation_batches=[1, 4])
    for name in ("set.yaml", "set.json"):
        path = dump_bucket_set(tmp_path / name, **lists, description="d", comment="made here")
        assert load_bucket_set(path) == lists
    assert (tmp_path / "set.yaml").read_text().startswith("# made here\n")


def test_yaml_output_is_plain_yaml_whatever_the_description_holds(tmp_path):
    description = ('tuned on "trace.jsonl": 42% fewer # padded tokens, é ' + "x" * 200 +
                   "\nsecond line")
    path = dump_bucket_set(tmp_path / "deep" / "set.yaml", description=description,
                           context_encoding_buckets=[128, 512], comment="made here")
    text = path.read_text()
    assert yaml.safe_load(text) == {"description": description,
                                    "context_encoding_buckets": [128, 512]}
    assert "context_encoding_buckets: [128, 512]\n" in text  # lists stay on one line


def test_limits_are_checked_on_load(tmp_path):
    path = tmp_path / "set.yaml"
    path.write_text("token_generation_buckets: [512, 4096]\ntoken_generation_batches: [1, 8]\n"
                    "prefix_buckets: [500]\n")
    with pytest.raises(BucketFileError, match="token_generation_buckets: the list has 4096, "
                                              "above max_model_len 2048"):
        load_bucket_set(path, max_model_len=2048)
    with pytest.raises(BucketFileError, match="token_generation_batches: the list has 8, "
                                              "above max_num_seqs 4"):
        load_bucket_set(path, max_num_seqs=4)
    with pytest.raises(BucketFileError, match="prefix_buckets: the list has 500, not a "
                                              "multiple of 32.*use 512"):
        load_bucket_set(path, block_size=32)


@pytest.mark.parametrize("name, text, message", [
    ("a.yaml", "context_encoding_bucket: [128]\n",
     "a.yaml: context_encoding_bucket: unknown key "
     "\\(did you mean 'context_encoding_buckets'\\?\\)"),
    ("a.yaml", "context_encoding_buckets: [256, 128]\n",
     "a.yaml: context_encoding_buckets: the list is not sorted"),
    ("a.yaml", "context_encoding_buckets: [128, 128]\n", "lists 128 twice"),
    ("a.yaml", "context_encoding_buckets: [128, big]\n", "the list has 'big'; every bucket"),
    ("a.yaml", "context_encoding_buckets: 128\n", "must be a list of bucket sizes, got 128"),
    ("a.yaml", "description: 5\ncontext_encoding_buckets: [128]\n", "description: must be text"),
    ("a.yaml", "description: only words\n", "a.yaml: holds no bucket list; add at least one of"),
    ("a.yaml", "- 128\n- 256\n", "a.yaml: must hold a mapping of keys at the top level, got list"),
    ("a.yaml", "context_encoding_buckets: [128\n", "a.yaml: is not valid YAML"),
    ("a.json", "{\"context_encoding_buckets\": [128,]}", "a.json: is not valid JSON"),
    ("a.txt", "context_encoding_buckets: [128]\n", "unknown file type '.txt'"),
])
def test_bad_files_name_file_key_and_expectation(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(BucketFileError, match=message):
        load_bucket_set(path)


def test_missing_file(tmp_path):
    with pytest.raises(BucketFileError, match="nope.yaml: cannot be read"):
        load_bucket_set(tmp_path / "nope.yaml")


def test_dump_refuses_invalid_lists(tmp_path):
    with pytest.raises(BucketFileError, match="context_encoding_buckets: the list is not sorted"):
        dump_bucket_set(tmp_path / "x.yaml", context_encoding_buckets=[512, 128])
    assert not (tmp_path / "x.yaml").exists()


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_bucket_sets_load_and_say_where_they_come_from(path):
    lists = load_bucket_set(path)
    assert set(lists) <= set(KEYS) and lists
    assert path.read_text().startswith("#")


def test_there_are_shipped_bucket_sets():
    assert len(list(CONFIGS.glob("*.yaml"))) >= 3
