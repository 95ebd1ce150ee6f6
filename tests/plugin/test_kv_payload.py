"""The KV payload a prefill server writes and a decode server reads (real files): a round
trip, and every refusal with its reason and fix: another model, dtype, block size,
geometry or prompt; unknown metadata or tensor keys; a file too large, truncated, not
safetensors (a pickle is never unpickled), a symlink; a key that is not 32 hex digits.
Leftovers are swept after their lifetime; kv_transfer_params parse strictly."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import struct

import pytest
import torch

from neuron_plugin.backends.kv_blocks import KVGeometry
from neuron_plugin.kv_transfer import params, payload

GEOMETRY = KVGeometry(layers=2, block_size=4, kv_heads=2, head_dim=3, dtype="float32",
                      computation="reference computation 2")
MODEL = "a" * 64
PROMPT = [5, 6, 7, 8, 9, 10]  # two blocks, the second partial
SECRET = b"k" * 32


def _kv(geometry: KVGeometry = GEOMETRY, blocks: int = 2) -> torch.Tensor:
    return torch.randn(geometry.shape(blocks)).to(geometry.torch_dtype)


BASE = payload.RequestScope()


def _write(*args, scope=BASE, **kwargs):
    return payload.write_payload(*args, scope=scope, **kwargs)


def _read(folder, key, geometry=GEOMETRY, prompt=PROMPT, model=MODEL, scope=BASE):
    return payload.read_payload(folder, key, model, geometry, prompt, 4, SECRET, scope=scope)


def test_round_trip_is_exact_and_leaves_no_partial_file(tmp_path):
    kv = _kv()
    key = params.new_key()
    size = _write(tmp_path, key, kv, PROMPT, MODEL, GEOMETRY, SECRET)
    assert os.listdir(tmp_path) == [f"{key}.safetensors"]
    assert (tmp_path / f"{key}.safetensors").stat().st_size == size
    assert oct((tmp_path / f"{key}.safetensors").stat().st_mode & 0o777) == "0o600"
    assert torch.equal(_read(tmp_path, key), kv)
    payload.remove_payload(tmp_path, key)
    assert os.listdir(tmp_path) == []


def test_bfloat16_round_trip(tmp_path):
    geometry = dataclasses.replace(GEOMETRY, dtype="bfloat16")
    kv = _kv(geometry)
    key = params.new_key()
    _write(tmp_path, key, kv, PROMPT, MODEL, geometry, SECRET)
    assert torch.equal(_read(tmp_path, key, geometry), kv)


@pytest.mark.parametrize("change, reason", [
    ({"model": "b" * 64}, "its model is bbbbbbbbbbbbbbbb, this server's is aaaaaaaaaaaaaaaa"),
    ({"dtype": "bfloat16"}, "its KV dtype is bfloat16, this server's is float32"),
    ({"block_size": 2}, "its block size is 2, this server's is 4"),
    ({"kv_heads": 4}, "its kv shape (layers,kv,blocks,block_size,kv_heads,head_dim) is "
                      "[2, 2, 2, 4, 4, 3], this server's is [2, 2, 2, 4, 2, 3]"),
    ({"layers": 3}, "its kv shape"),
    ({"prompt": PROMPT[:-1]}, "its prompt length is 5, this server's is 6"),
    ({"prompt": [t + 1 for t in PROMPT]}, "it holds the KV of another prompt"),
])
def test_a_payload_of_another_configuration_is_refused_naming_it(tmp_path, change, reason):
    written = dataclasses.replace(GEOMETRY, **{k: v for k, v in change.items()
                                             if k in ("dtype", "block_size", "kv_heads",
                                                      "layers")})
    prompt = change.get("prompt", PROMPT)
    blocks = -(-len(prompt) // written.block_size)
    key = params.new_key()
    _write(tmp_path, key, _kv(written, blocks), prompt,
                          change.get("model", MODEL), written, SECRET)
    with pytest.raises(payload.PayloadError) as error:
        _read(tmp_path, key)
    assert reason in str(error.value)
    assert f"KV payload {key} refused" in str(error.value)
    if "prompt" not in change:
        assert payload.SAME_SERVERS in str(error.value)  # the fix


def _rewrite_header(path, edit):
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length:])


@pytest.mark.parametrize("edit, reason", [
    (lambda h: h["__metadata__"].update(extra="1"), "its metadata keys are"),
    (lambda h: h.update(extra=h["token_ids"]), "its tensors are ['extra', 'kv', 'token_ids']"),
    (lambda h: h["__metadata__"].update(format="neuron-kv/0"), "its format is neuron-kv/0"),
    # a forged value of another type (a peer's bug or worse) is refused, never indexed
    (lambda h: h["__metadata__"].update(model=5), "with string values"),
])
def test_unknown_keys_and_formats_are_refused(tmp_path, edit, reason):
    key = params.new_key()
    _write(tmp_path, key, _kv(), PROMPT, MODEL, GEOMETRY, SECRET)
    _rewrite_header(tmp_path / f"{key}.safetensors", edit)
    with pytest.raises(payload.PayloadError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        _read(tmp_path, key)


def test_a_deeply_nested_header_is_refused_not_a_crash(tmp_path):
    """json.loads raises RecursionError, not ValueError, on ~30k nested brackets (well
    inside HEADER_LIMIT): it must end as the payload's refusal, not the engine's death."""
    key = params.new_key()
    raw = b"[" * 30_000
    (tmp_path / f"{key}.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(payload.PayloadError, match="corrupt header"):
        _read(tmp_path, key)


def test_a_pickle_is_never_unpickled(tmp_path, monkeypatch):
    key = params.new_key()
    (tmp_path / f"{key}.safetensors").write_bytes(pickle.dumps({"kv": [1, 2, 3]}))
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("unpickled"))
    with pytest.raises(payload.PayloadError, match="is not a safetensors file"):
        _read(tmp_path, key)


def test_truncated_oversized_and_linked_files_are_refused(tmp_path):
    key = params.new_key()
    _write(tmp_path, key, _kv(), PROMPT, MODEL, GEOMETRY, SECRET)
    path = tmp_path / f"{key}.safetensors"
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) - 10])
    with pytest.raises(payload.PayloadError, match="is corrupt"):
        _read(tmp_path, key)
    path.write_bytes(whole + b"\0" * (payload.HEADER_LIMIT + 10_000))
    with pytest.raises(payload.PayloadError, match="more than a request's worth"):
        _read(tmp_path, key)
    target = tmp_path / "elsewhere"
    target.write_bytes(whole)
    path.unlink()
    path.symlink_to(target)
    with pytest.raises(payload.PayloadError, match="cannot be opened safely"):
        _read(tmp_path, key)


@pytest.mark.parametrize("key", ["../../etc/passwd", "A" * 32, "a" * 31, "a" * 33, "", 7])
def test_keys_that_are_not_32_hex_digits_name_no_file(tmp_path, key):
    with pytest.raises(payload.PayloadError, match="is not 32 lowercase hex digits"):
        payload.payload_path(tmp_path, key)


def test_missing_payload_says_why_it_may_be_missing(tmp_path):
    with pytest.raises(payload.PayloadError, match="no KV payload .* the same "
                                                   "kv_connector_extra_config.path"):
        _read(tmp_path, params.new_key())


def test_sweep_removes_only_old_payloads_and_partial_writes(tmp_path):
    old, fresh = params.new_key(), params.new_key()
    for key in (old, fresh):
        _write(tmp_path, key, _kv(), PROMPT, MODEL, GEOMETRY, SECRET)
    partial = tmp_path / f".{params.new_key()}.123.partial"
    partial.write_bytes(b"x")
    other = tmp_path / "notes.txt"
    other.write_text("not a payload")
    for path in (tmp_path / f"{old}.safetensors", partial, other):
        os.utime(path, (1000, 1000))
    assert payload.sweep(tmp_path, ttl_s=60) == 2
    assert sorted(os.listdir(tmp_path)) == sorted([f"{fresh}.safetensors", "notes.txt"])


def test_model_identity_follows_weights_and_config_not_names(model_dirs, tmp_path):
    import shutil

    source = model_dirs["llama"]
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    config = json.loads((copy / "config.json").read_text())
    config["_name_or_path"] = "somewhere/else"
    (copy / "config.json").write_text(json.dumps(config))
    assert payload.model_identity(copy) == payload.model_identity(source)
    config["rms_norm_eps"] = 1e-6
    (copy / "config.json").write_text(json.dumps(config))
    assert payload.model_identity(copy) != payload.model_identity(source)


def test_model_identity_names_weight_quantization_not_its_folder(model_dirs):
    """A quantized server's KV is not an unquantized one's (nor another quantization's);
    the quantized checkpoint's folder may differ between hosts."""
    from neuron_plugin.core.quantization import Quantization

    def quantized(path, **keys):
        return Quantization.from_override(
            {"quantized": True, "quantized_checkpoints_path": path, **keys})

    model = model_dirs["llama"]
    plain = payload.model_identity(model)
    per_channel = quantized("/a", quantization_type="per_channel_symmetric")
    assert payload.model_identity(model, per_channel) != plain
    assert payload.model_identity(model, per_channel) == payload.model_identity(
        model, quantized("/b", quantization_type="per_channel_symmetric"))
    assert payload.model_identity(model, per_channel) != payload.model_identity(
        model, quantized("/a"))
    assert payload.model_identity(model, per_channel) != payload.model_identity(
        model, quantized("/a", quantization_type="per_channel_symmetric",
                         modules_to_not_convert=["lm_head"]))


def test_kv_transfer_params_parse_strictly():
    key = params.new_key()
    good = params.decode_params(key, 6)
    assert params.wants_remote_prefill(good) and not params.wants_remote_decode(good)
    assert params.remote_prefill(good, 6) == params.RemotePrefill(key, 6)
    assert params.wants_remote_decode({"do_remote_decode": True, "remote_engine_id": None})
    with pytest.raises(ValueError, match="no neuron_kv object: the prefill server does not "
                                         "run NeuronKVConnector"):
        params.remote_prefill({"do_remote_prefill": True, "remote_block_ids": [1]}, 6)
    with pytest.raises(ValueError, match="num_tokens=5 is not this request's prompt length 6"):
        params.remote_prefill(params.decode_params(key, 5), 6)
    with pytest.raises(ValueError, match="format=2, expected 1"):
        params.remote_prefill({"neuron_kv": {"format": 2, "key": key, "num_tokens": 6}}, 6)


# -- hostile payloads and their lifetime (issue 32) -------------------------------------
def test_a_fifo_or_directory_at_a_payload_path_is_refused_without_blocking(tmp_path):
    """A blocking open of a FIFO waits for a writer forever: the engine would hang."""
    fifo, folder = params.new_key(), params.new_key()
    os.mkfifo(tmp_path / f"{fifo}.safetensors")
    (tmp_path / f"{folder}.safetensors").mkdir()
    for key, kind in ((fifo, "a FIFO, device or socket"), (folder, "a directory")):
        with pytest.raises(payload.PayloadError, match=f"is {kind}, not a regular file"):
            _read(tmp_path, key)
        with pytest.raises(payload.PayloadError, match=f"is {kind}"):
            payload.check_available(tmp_path, key, len(PROMPT))
    # deleting what is not a file never raises: logged, left in place
    assert payload.remove_payload(tmp_path, folder) is False
    assert (tmp_path / f"{folder}.safetensors").is_dir()
    assert payload.remove_payload(tmp_path, params.new_key()) is True  # already gone: fine


def test_non_finite_kv_is_refused_naming_where(tmp_path):
    kv = _kv()
    kv[1, 0, 1, 2, 0, 1] = float("inf")
    key = params.new_key()
    _write(tmp_path, key, kv, PROMPT, MODEL, GEOMETRY, SECRET)
    with pytest.raises(payload.PayloadError, match=r"holds NaN or Inf \(1 values; the first "
                                                   r"in layer 1's K cache, block 1\)"):
        _read(tmp_path, key)


def test_only_payloads_tagged_with_the_deployments_key_are_read(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    forged, changed, unsigned = params.new_key(), params.new_key(), params.new_key()
    _write(tmp_path, forged, _kv(), PROMPT, MODEL, GEOMETRY, b"x" * 32)
    _write(tmp_path, changed, _kv(), PROMPT, MODEL, GEOMETRY, SECRET)
    path = str(tmp_path / f"{changed}.safetensors")
    with safe_open(path, "pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    save_file({**tensors, "kv": tensors["kv"] * 1000}, path, metadata=metadata)
    for key in (forged, changed):
        with pytest.raises(payload.PayloadError, match="tag is not the one this deployment's "
                                                       "key makes.*VLLM_NEURON_KV_KEY"):
            _read(tmp_path, key)
    # a payload renamed to another key is not that key's either
    os.rename(tmp_path / f"{forged}.safetensors", tmp_path / f"{unsigned}.safetensors")
    with pytest.raises(payload.PayloadError, match="tag is not the one"):
        payload.read_payload(tmp_path, unsigned, MODEL, GEOMETRY, PROMPT, 4, b"x" * 32,
                             scope=BASE)
    del metadata["hmac"]
    save_file(tensors, path, metadata=metadata)
    with pytest.raises(payload.PayloadError, match="its metadata keys are"):
        _read(tmp_path, changed)


def test_the_folder_holds_at_most_max_bytes_of_payloads(tmp_path):
    size = _write(tmp_path, params.new_key(), _kv(), PROMPT, MODEL, GEOMETRY,
                                 SECRET)
    cap = size + size // 2
    assert payload.folder_bytes(tmp_path) == size
    with pytest.raises(payload.PayloadError, match=rf"holds {size:,} bytes of payloads and "
                                                   rf"{size:,} more would pass "
                                                   rf"kv_connector_extra_config.max_bytes="
                                                   rf"{cap:,}"):
        _write(tmp_path, params.new_key(), _kv(), PROMPT, MODEL, GEOMETRY,
                              SECRET, max_bytes=cap)
    assert len(os.listdir(tmp_path)) == 1
    assert payload.default_max_bytes(tmp_path) > 0


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o720, 0o702])
def test_a_payload_folder_another_user_may_write_is_refused(tmp_path, mode):
    """Group-writable too (issue 39): a group member could plant or remove payloads."""
    folder = tmp_path / "kv"
    assert payload.prepare_folder(folder) == folder
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    folder.chmod(mode)
    with pytest.raises(payload.PayloadError, match=rf"has mode {oct(mode)}: its group or "
                                                   rf"other users may write it.*chmod 700"):
        payload.prepare_folder(folder)
    folder.chmod(0o750)  # others may read nothing but the group's listing: served
    assert payload.prepare_folder(folder) == folder


def test_the_default_payload_folder_is_this_users_own():
    """Another local user creating a shared default name first cannot keep this user's
    servers from starting: the default folder carries the uid."""
    from neuron_plugin.core.kv_transfer import transfer_options

    assert transfer_options({}).path == f"/dev/shm/neuron-kv-{os.geteuid()}"
    assert transfer_options({"path": "/x/kv"}).path == "/x/kv"


def test_a_payload_folder_of_another_user_is_refused_naming_the_setting(tmp_path):
    """(As root the test makes the folder another user's; as anyone else the temp folder's
    root-owned parent stands in.)"""
    if os.geteuid() == 0:
        folder = tmp_path / "theirs"
        folder.mkdir(mode=0o700)
        os.chown(folder, 12345, 12345)
    else:
        folder = tmp_path.parent.parent.parent  # /tmp or /: root's
        assert folder.stat().st_uid != os.geteuid()
    with pytest.raises(payload.PayloadError, match=r"kv_connector_extra_config.path=.* "
                                                   r"belongs to uid \d+.*leaving it out gives "
                                                   r"this user's own default"):
        payload.prepare_folder(folder)


def test_the_default_cap_is_half_the_free_space_not_half_the_size(tmp_path):
    fs = os.statvfs(tmp_path)
    assert payload.default_max_bytes(tmp_path) == fs.f_bavail * fs.f_frsize // 2


def test_a_tag_that_is_not_ascii_is_a_refusal_not_a_crash(tmp_path):
    """hmac.compare_digest raises TypeError on a non-ASCII str: compared as bytes."""
    key = params.new_key()
    _write(tmp_path, key, _kv(), PROMPT, MODEL, GEOMETRY, SECRET)
    _rewrite_header(tmp_path / f"{key}.safetensors",
                    lambda h: h["__metadata__"].update(hmac="é" * 64))
    with pytest.raises(payload.PayloadError, match="tag is not the one this deployment's"):
        _read(tmp_path, key)


# -- what a payload is bound to besides the model (issue 39) ----------------------------
@pytest.mark.parametrize("written, loading, reason", [
    (payload.RequestScope(adapter=payload.adapter_identity("sql", "d" * 64)), BASE,
     "it holds the KV of LoRA adapter 'sql sha256:dddd"),
    (BASE, payload.RequestScope(adapter=payload.adapter_identity("sql", "d" * 64)),
     "LoRA adapter 'base', and the loading request's is 'sql sha256:"),
    # the same name, other files (reloaded, or another folder on the other server)
    (payload.RequestScope(adapter=payload.adapter_identity("sql", "d" * 64)),
     payload.RequestScope(adapter=payload.adapter_identity("sql", "e" * 64)),
     "the same name and the same adapter files on both servers"),
    (payload.RequestScope(cache_salt=payload.salt_digest("tenant-a")),
     payload.RequestScope(cache_salt=payload.salt_digest("tenant-b")), "another cache_salt"),
    (payload.RequestScope(cache_salt=payload.salt_digest("tenant-a")), BASE,
     "another cache_salt"),
])
def test_a_payload_of_another_adapter_or_salt_is_refused(tmp_path, written, loading, reason):
    key = params.new_key()
    _write(tmp_path, key, _kv(), PROMPT, MODEL, GEOMETRY, SECRET, scope=written)
    with pytest.raises(payload.PayloadError, match=re.escape(reason)):
        _read(tmp_path, key, scope=loading)
    assert torch.equal(_read(tmp_path, key, scope=written), _read(tmp_path, key, scope=written))


def test_a_payload_of_another_computation_is_refused(tmp_path):
    """KV NxDI computed with other math-changing patches, or the reference backend's, is
    not this backend's."""
    key = params.new_key()
    theirs = dataclasses.replace(GEOMETRY, computation="nxd, patches: none")
    _write(tmp_path, key, _kv(), PROMPT, MODEL, theirs, SECRET)
    with pytest.raises(payload.PayloadError, match="its KV computation is nxd, patches: none, "
                                                   "this server's is reference computation 2"):
        _read(tmp_path, key)


def test_the_salt_itself_is_never_written():
    assert payload.salt_digest(None) == payload.salt_digest("") == ""
    assert "tenant-a" not in payload.salt_digest("tenant-a")


def test_check_available_reads_the_header_only(tmp_path):
    key = params.new_key()
    _write(tmp_path, key, _kv(), PROMPT, MODEL, GEOMETRY, SECRET)
    payload.check_available(tmp_path, key, len(PROMPT))
    with pytest.raises(payload.PayloadError, match="its prompt length is 6"):
        payload.check_available(tmp_path, key, 7)
    with pytest.raises(payload.PayloadError, match="no KV payload"):
        payload.check_available(tmp_path, params.new_key(), 6)


def test_the_payload_key_comes_from_the_environment_a_private_file_or_the_users_own(tmp_path):
    from neuron_plugin.core.errors import NeuronConfigError
    from neuron_plugin.kv_transfer import auth

    assert auth.load_key({"VLLM_NEURON_KV_KEY": "s" * 40}) == b"s" * 40
    with pytest.raises(NeuronConfigError, match="VLLM_NEURON_KV_KEY holds 5 characters"):
        auth.load_key({"VLLM_NEURON_KV_KEY": "short"})
    key_file = tmp_path / "key"
    key_file.write_text("f" * 64 + "\n")
    key_file.chmod(0o644)
    with pytest.raises(NeuronConfigError, match="readable by others.*chmod 600"):
        auth.load_key({"VLLM_NEURON_KV_KEY_FILE": str(key_file)})
    key_file.chmod(0o600)
    assert auth.load_key({"VLLM_NEURON_KV_KEY_FILE": str(key_file)}) == b"f" * 64
    own = {"XDG_CONFIG_HOME": str(tmp_path / "config")}
    first = auth.load_key(own)
    assert len(first) == 64 and auth.load_key(own) == first  # created once, then shared
    path = auth.own_key_path(own)
    assert oct(path.stat().st_mode & 0o777) == "0o600"


@pytest.mark.parametrize("kv_params, n, streaming, reason", [
    ("yes", 1, False, "kv_transfer_params must be an object"),
    ({"do_remote_prefill": "true"}, 1, False, "do_remote_prefill='true' must be true or false"),
    ({"do_remote_decode": True}, 2, False, "asks for n=2 sequences; its KV payload continues"),
    ({"do_remote_decode": True}, 1, True, "cannot stream"),
    (params.decode_params("ab" * 16, 6), 3, False, "asks for n=3 sequences from one"),
    (params.decode_params("ab" * 16, 5), 1, False, "num_tokens=5 is not this request's"),
    (params.decode_params("AB" * 16, 6), 1, False, "is not 32 lowercase hex digits"),
])
def test_params_the_connector_cannot_serve_are_refused_keeping_the_key(kv_params, n,
                                                                       streaming, reason):
    assert reason in params.request_refusal(kv_params, 6, n, streaming)
    assert params.request_refusal(params.decode_params("ab" * 16, 6), 6, 1, True) is None
    assert params.request_refusal({"do_remote_decode": True}, 6, 1, False) is None
    assert params.named_key(params.decode_params("ab" * 16, 5)) == "ab" * 16
    assert params.named_key({"neuron_kv": {"key": "../x"}}) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_finite_check_finds_nan_and_inf_of_every_kv_dtype(dtype):
    kv = torch.randn(3, 2, 2, 4, 2, 3).to(dtype)
    assert payload.all_finite(kv)
    assert payload.all_finite(torch.full_like(kv, torch.finfo(dtype).max))  # large is fine
    for value in (float("nan"), float("inf"), float("-inf")):
        bad = kv.clone()
        bad[2, 1, 1, 3, 1, 2] = value  # the last layer's last value
        assert not payload.all_finite(bad), value
