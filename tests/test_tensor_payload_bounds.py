"""The restricted unpickler of /update_weights_from_tensor does bounded work on hostile entries (issue 33 item 4).

A 260-byte pickle that shares one list 17 times per level once turned into a 124 MB error message (+455 MB RSS in
the server): the error shows its value through lichen.excerpt now, and the unpickler bounds opcodes, nesting, dict
keys and sets. Each payload is built opcode by opcode here, as an attacker would.
"""

from __future__ import annotations

import base64
import pickle

import pytest
from helpers.serve_process import call, launch

from lichen.engines.server.tensor_payload import MAX_DEPTH, MAX_OPS, PayloadError, load_named_tensors
from lichen.excerpt import excerpt, json_excerpt


def shared_lists(levels: int, width: int = 17, tuples: bool = False) -> bytes:
    """Level i is a list (or tuple) holding level i-1 `width` times, all through one memo entry: the pickle grows
    by ~2 bytes per reference, the unfolded value by a factor of `width` per level. Leaves level `levels` on the
    stack."""
    close = pickle.TUPLE if tuples else pickle.APPENDS
    out = pickle.EMPTY_LIST + pickle.BINPUT + b"\x00" + pickle.BININT1 + b"\x00" + pickle.APPEND + pickle.POP
    for i in range(1, levels + 1):
        refs = (pickle.BINGET + bytes([i - 1])) * width
        opener = pickle.MARK if tuples else pickle.EMPTY_LIST + pickle.MARK
        out += opener + refs + close + pickle.BINPUT + bytes([i])
        if i < levels:
            out += pickle.POP
    return out


def entry(body: bytes) -> str:
    return base64.b64encode(pickle.PROTO + b"\x02" + body + pickle.STOP).decode()


def size_of_bomb(levels: int = 6) -> str:
    """torch.Size(<shared lists>): the reported payload (17 entries is one past MAX_DIMS, so it is refused)."""
    return entry(pickle.GLOBAL + b"torch\nSize\n" + shared_lists(levels) + pickle.TUPLE1 + pickle.REDUCE)


def test_the_nested_payload_gets_a_short_error():
    raw = size_of_bomb()
    assert len(base64.b64decode(raw)) < 300
    with pytest.raises(PayloadError) as e:
        load_named_tensors(raw)
    assert "torch.Size must be a tuple of at most 16 integers" in str(e.value)
    assert len(str(e.value)) < 400  # 124 MB before


def test_a_tuple_key_that_shares_itself_is_refused_before_it_is_hashed():
    # {t: 0} with t = (t', t', ...) 17 wide, 5 deep: hashing t walks 17^5 tuples (and 17^8 takes minutes)
    body = pickle.EMPTY_DICT + shared_lists(5, tuples=True) + pickle.BININT1 + b"\x00" + pickle.SETITEM
    with pytest.raises(PayloadError, match="dictionary keys must be strings or numbers"):
        load_named_tensors(entry(body))


def test_sets_nesting_opcode_count_and_self_reference_are_bounded():
    with pytest.raises(PayloadError, match="sets are not part"):
        load_named_tensors(entry(pickle.EMPTY_SET + pickle.MARK + pickle.BININT1 + b"\x01" + pickle.ADDITEMS))
    deep = pickle.MARK * (MAX_DEPTH + 2) + pickle.BININT1 + b"\x00"
    with pytest.raises(PayloadError, match=f"deeper than {MAX_DEPTH} levels"):
        load_named_tensors(entry(deep))
    # nesting without MARK: [[[...]]] by APPEND, found in the result
    nested = pickle.EMPTY_LIST * (MAX_DEPTH + 2) + pickle.APPEND * (MAX_DEPTH + 1)
    with pytest.raises(PayloadError, match=f"deeper than {MAX_DEPTH} levels"):
        load_named_tensors(entry(nested))
    ops = (pickle.NONE + pickle.POP) * (MAX_OPS // 2 + 1) + pickle.NONE
    with pytest.raises(PayloadError, match=f"past {MAX_OPS} pickle operations"):
        load_named_tensors(entry(ops))
    loop = pickle.EMPTY_LIST + pickle.BINPUT + b"\x00" + pickle.BINGET + b"\x00" + pickle.APPEND
    with pytest.raises(PayloadError, match="contains itself"):
        load_named_tensors(entry(loop))


def test_excerpts_are_bounded_whatever_the_value():
    shared: list = [0]
    for _ in range(30):
        shared = [shared] * 17
    assert len(excerpt(shared)) < 200 and len(json_excerpt(shared)) < 200
    assert excerpt(10**100_000).startswith("<int of")
    assert len(excerpt(b"x" * 10**7)) < 200
    assert json_excerpt({"a": None, "b": True, "c": "x" * 1000}, 40).startswith('{"a": null, "b": true, "c": "xxx')


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.slow
def test_the_nested_payload_over_http_is_a_small_400_and_memory_stays_flat(tiny_ckpt, tmp_path):
    server = launch(tiny_ckpt, "--num-threads", "1", log_path=str(tmp_path / "serve.log"))
    try:
        before = rss_kb(server.proc.pid)
        st, out = call(server.url + "/update_weights_from_tensor", {"serialized_named_tensors": [size_of_bomb()]})
        assert st == 400 and out["success"] is False
        assert "torch.Size must be a tuple" in out["message"] and len(out["message"]) < 500
        assert rss_kb(server.proc.pid) - before < 50_000  # kB; +455 MB before
        assert (tmp_path / "serve.log").stat().st_size < 100_000  # the warning logged is as short
    finally:
        server.stop()
