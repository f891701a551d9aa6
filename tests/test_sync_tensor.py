"""`--update-weight-transport tensor`: weights by shared-memory handles into real `lichen serve` processes, and
`/update_weights_from_tensor` refusing hostile or wrong payloads.

The references are independent of the code under test: served tensors compared by xxh3 recomputed here and read
back with /get_weights_by_name; sharing is shown by a second, unrelated process seeing a write made after it
mapped the bucket; hostile pickles are written by hand with pickle opcodes.
"""

from __future__ import annotations

import base64
import os
import pickle
import subprocess
import sys

import pytest
import torch
import xxhash
from helpers.runs import base_args, run
from helpers.serve_process import call as plain_call

from lichen.engines.server.tensor_payload import PayloadError, load_named_tensors
from lichen.sync.distributed import plan_buckets
from lichen.sync.tensor_handles import TensorSync
from lichen.weights.hf_io import load_hf_state_dict
from lichen.weights.shm_buckets import fill_bucket, serialize

F32 = torch.float32
Q = "model.layers.0.self_attn.q_proj.weight"


def admin(pair) -> dict:
    return {"Authorization": f"Bearer {pair.launcher.admin_api_key}"}


def xxh(t: torch.Tensor) -> str:
    return xxhash.xxh3_128(t.contiguous().numpy().tobytes()).hexdigest()


def served_sums(pair) -> list[dict]:
    return [b["ranks"][0]["checksums"] for b in pair.post_each("/weights_checker", {"action": "checksum"})]


def moved(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def post_tensor(pair, body: dict, headers: dict | None = None):
    return plain_call(
        pair.urls[0] + "/update_weights_from_tensor", body, headers=admin(pair) if headers is None else headers
    )


def entry(named) -> str:
    return serialize(named)


# ---- the sender ---------------------------------------------------------------------------------------------
def test_buckets_split_by_engine_bytes_and_views_are_aligned():
    named = [("a", torch.zeros(10)), ("b", torch.zeros(30)), ("c", torch.zeros(5)), ("i", torch.arange(3))]
    got = [[n for n, _ in b] for b in plan_buckets(named, torch.bfloat16, 60)]  # bf16: 20, 60, 10 bytes; int64 24
    assert got == [["a"], ["b"], ["c", "i"]]
    flat, views = fill_bucket(named, torch.bfloat16, torch.device("cpu"))
    assert [v.dtype for _, v in views] == [torch.bfloat16] * 3 + [torch.int64]
    assert all(v.data_ptr() % 64 == 0 for _, v in views) and flat.is_shared()


def test_a_bucket_larger_than_the_free_shared_memory_is_refused_before_it_is_written(monkeypatch):
    from lichen.errors import ConfigError
    from lichen.weights import shm_buckets

    monkeypatch.setattr(shm_buckets, "shm_free_bytes", lambda: 1000)
    with pytest.raises(ConfigError, match=r"--update-weight-buffer-size .*--shm-size"):
        fill_bucket([("w", torch.zeros(1000))], F32, torch.device("cpu"))
    flat, _ = fill_bucket([("w", torch.zeros(100))], F32, torch.device("cpu"))  # 400 bytes fit
    assert flat.numel() == 448


def test_handles_map_the_same_memory_in_an_unrelated_process():
    """The engine side maps the trainer's bucket: a write made after it loaded the handle is seen (a copy would
    not see it), and the serialized entry is a few hundred bytes for a 4 MB bucket."""
    named = [("w", torch.zeros(1024, 1024))]
    _flat, views = fill_bucket(named, F32, torch.device("cpu"))
    payload = entry(views)
    assert len(payload) < 2000
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\nfrom lichen.engines.server.tensor_payload import load_named_tensors\n"
            "[(n, t)] = load_named_tensors(sys.stdin.readline().strip())\nprint(float(t[5, 7]), flush=True)\n"
            "sys.stdin.readline()\nprint(float(t[5, 7]), flush=True)\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        child.stdin.write(payload + "\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "0.0"
        views[0][1][5, 7] = 42.0  # after the child mapped it
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "42.0"
    finally:
        child.communicate(timeout=60)
    assert child.returncode == 0


# ---- the endpoint -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_tensor_syncs_are_bit_exact_and_set_the_version(pair, tiny_ckpt):
    state = load_hf_state_dict(tiny_ckpt)
    ts = TensorSync(pair, buffer_size=60_000)
    for version in (1, 2):
        state = moved(state, version)
        m = ts.push(iter(state.items()), version, F32)
        assert m["sync/buckets"] > 1 and m["sync/bytes"] == sum(v.numel() * 4 for v in state.values())
        assert m["sync/request_bytes"] < 1000 * m["sync/buckets"] * 2  # handles, not the weights (~500 KB here)
        assert pair.weight_versions() == [str(version)] * 2
        assert served_sums(pair) == [{k: xxh(v) for k, v in state.items()}] * 2
    got = torch.tensor(pair.get_weights_by_name(Q, 10_000)[1])
    assert torch.equal(got, state[Q])


def test_shared_segments_are_released_after_each_sync(pair, tiny_ckpt):
    before = set(os.listdir("/dev/shm"))
    state = moved(load_hf_state_dict(tiny_ckpt), 5)
    TensorSync(pair, buffer_size=60_000).push(iter(state.items()), 5, F32)
    left = {f for f in set(os.listdir("/dev/shm")) - before if f.startswith("torch_")}
    assert left == set()


def test_wrong_name_or_shape_is_refused_naming_it(pair):
    version = pair.weight_versions()[0]
    st, body = post_tensor(
        pair, {"serialized_named_tensors": [entry([("model.nope.weight", torch.zeros(2))])], "weight_version": "999"}
    )
    assert st == 400 and "model.nope.weight" in body["message"]
    st, body = post_tensor(
        pair, {"serialized_named_tensors": [entry([(Q, torch.zeros(3, 3))])], "weight_version": "999"}
    )
    assert st == 400 and Q in body["message"] and "(3, 3)" in body["message"]
    assert pair.weight_versions()[0] == version


def test_admin_key_is_required(pair):
    st, _ = post_tensor(
        pair,
        {"serialized_named_tensors": [entry([(Q, torch.zeros(64, 64))])]},
        headers={"Authorization": f"Bearer {pair.launcher.api_key}"},
    )
    assert st == 401


def _global_call(module: str, name: str, arg: str) -> bytes:
    """A protocol-2 pickle calling module.name(arg), written with opcodes (no object of ours is pickled)."""
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + pickle.dumps(arg, 2)[2:-1] + b"\x85R."


class _Handle:
    """Pickles as torch's storage rebuild with a chosen shared-memory name."""

    def __init__(self, name: bytes):
        self.name = name

    def __reduce__(self):
        from torch.multiprocessing.reductions import rebuild_storage_filename

        return rebuild_storage_filename, (torch.UntypedStorage, b"/tmp/torch-shm-dir-x/manager.sock", self.name, 16)


def test_the_hostile_pickle_is_live_under_plain_pickle(tmp_path):
    """The payloads below are real: plain pickle.loads runs them (so refusing them is the unpickler's doing)."""
    marker = tmp_path / "ran"
    pickle.loads(hostile_payloads(str(marker))["os.system"])
    assert marker.exists()


def hostile_payloads(marker: str) -> dict[str, bytes]:
    cmd = f"touch {marker}"
    return {
        "os.system": _global_call("os", "system", cmd),
        "posix.system": _global_call("posix", "system", cmd),
        "builtins.eval": _global_call("builtins", "eval", f"__import__('os').system({cmd!r})"),
        "subprocess.getoutput": _global_call("subprocess", "getoutput", cmd),
        # a class a pickle names is a token here: calling it allocates nothing
        "UntypedStorage(huge)": b"\x80\x02ctorch.storage\nUntypedStorage\nJ\x00\x00\x00\x10\x85R.",
        "shm name outside /dev/shm": pickle.dumps(_Handle(b"/../../etc/passwd"), 2),
        "shm name of a missing file": pickle.dumps(_Handle(b"/torch_1_2_3"), 2),
    }


@pytest.mark.parametrize("what", list(hostile_payloads("x")))
def test_hostile_pickles_are_refused_and_never_run(pair, tmp_path, what):
    marker = tmp_path / "pwned"
    raw = hostile_payloads(str(marker))[what]
    version = pair.weight_versions()[0]
    st, body = post_tensor(
        pair, {"serialized_named_tensors": [base64.b64encode(raw).decode()], "weight_version": "666"}
    )
    assert st == 400 and body["success"] is False, body
    assert not marker.exists()
    assert pair.weight_versions()[0] == version
    with pytest.raises(PayloadError):  # and the same in this process
        load_named_tensors(base64.b64encode(raw).decode())
    assert not marker.exists()


def test_segment_larger_than_its_file_and_state_setting_are_refused():
    flat, views = fill_bucket([("w", torch.zeros(16))], F32, torch.device("cpu"))
    raw = base64.b64decode(entry(views))
    size = int(flat.untyped_storage().size())
    lying = raw.replace(pickle.dumps(size, 2)[2:-1], pickle.dumps(size * 1000, 2)[2:-1], 1)
    assert lying != raw
    with pytest.raises(PayloadError, match="fewer than"):
        load_named_tensors(base64.b64encode(lying).decode())
    build = raw[:-2] + b"}b" + raw[-2:]  # a BUILD on the list before STOP
    with pytest.raises(PayloadError, match="BUILD"):
        load_named_tensors(base64.b64encode(build).decode())


@pytest.fixture
def sglang_bucket_class(monkeypatch):
    """SGLang's FlattenedTensorMetadata under its module path (SGLang is not installed here): a dataclass of the
    same fields, pickled by that name as slime's sender pickles SGLang's."""
    import dataclasses
    import types

    mod = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")

    @dataclasses.dataclass
    class FlattenedTensorMetadata:
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    FlattenedTensorMetadata.__module__ = mod.__name__
    FlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    mod.FlattenedTensorMetadata = FlattenedTensorMetadata
    for name in ("sglang", "sglang.srt", "sglang.srt.weight_sync"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return FlattenedTensorMetadata


def flattened_bucket(meta_cls, named, lie: int = 0) -> str:
    """SGLang's FlattenedTensorBucket.from_tensors layout: each tensor's bytes, back to back."""
    parts, metas, at = [], [], 0
    for name, t in named:
        b = t.contiguous().flatten().view(torch.uint8)
        metas.append(
            meta_cls(
                name=name,
                shape=t.shape,
                dtype=t.dtype,
                start_idx=at,
                end_idx=at + b.numel() + lie,
                numel=b.numel() + lie,
            )
        )
        parts.append(b)
        at += b.numel()
    return entry({"flattened_tensor": torch.cat(parts), "metadata": metas})


def test_slimes_flattened_bucket_format_is_read(pair, tiny_ckpt, sglang_bucket_class):
    state = moved(load_hf_state_dict(tiny_ckpt), 21)
    names = [Q, "model.norm.weight"]
    st, body = post_tensor(
        pair,
        {
            "serialized_named_tensors": [flattened_bucket(sglang_bucket_class, [(n, state[n]) for n in names])],
            "load_format": "flattened_bucket",
            "weight_version": "21",
        },
    )
    assert st == 200, body
    sums = served_sums(pair)[0]
    assert [sums[n] for n in names] == [xxh(state[n]) for n in names]
    assert pair.weight_versions()[0] == "21"
    st, body = post_tensor(
        pair,
        {
            "serialized_named_tensors": [flattened_bucket(sglang_bucket_class, [(Q, state[Q])], lie=4)],
            "load_format": "flattened_bucket",
            "weight_version": "22",
        },
    )
    assert st == 400 and Q in body["message"] and "inside the bucket" in body["message"]
    assert pair.weight_versions()[0] == "21"


# ---- a training run -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_training_over_launched_engines_by_tensor_handles(tiny_ckpt, addition_data, tmp_path):
    metrics = run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "o",
            "--num-rollout",
            "3",
            "--num-threads",
            "1",
            "--rollout-num-engines",
            "1",
            "--update-weight-transport",
            "tensor",
        )
    )
    assert [m["sync/weight_version"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert m["sync/transport_tensor"] == 1 and m["sync/verified_tensors"] == 20
        assert m["train/train_rollout_logprob_abs_diff"] <= 1e-5


# ---- where it cannot work -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "engines, needle",
    [
        (["--rollout-external-engine-addrs", "127.0.0.1:9"], "--rollout-external-engine-addrs"),
        ([], "the in-process engine"),
    ],
)
def test_refused_with_exit_2_where_it_cannot_work(tiny_ckpt, addition_data, tmp_path, capsys, engines, needle):
    from lichen.cli import main

    argv = base_args(
        tiny_ckpt, addition_data, tmp_path / "o", "--num-rollout", "1", *engines, "--update-weight-transport", "tensor"
    )
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--update-weight-transport" in err and needle in err and "Traceback" not in err


def test_engines_on_another_host_are_refused_at_the_first_sync():
    """Engines that can be asked (Ray actors) read a probe file back from this host's /dev/shm; one that reads
    nothing there is on another machine and cannot map the handles."""
    from types import SimpleNamespace

    from lichen.errors import ConfigError
    from lichen.sync.visibility import check_same_host

    def read_each(path):
        here = open(path).read()
        return [{"content": here, "where": "node a"}, {"error": "No such file", "where": "node b (10.0.0.7)"}]

    engines = SimpleNamespace(launcher=SimpleNamespace(read_each=read_each))
    with pytest.raises(ConfigError, match=r"--update-weight-transport tensor /dev/shm: engine 1 \(node b"):
        check_same_host(engines)
    both = SimpleNamespace(launcher=SimpleNamespace(read_each=lambda p: [{"content": open(p).read()}] * 2))
    assert check_same_host(both) == 2
