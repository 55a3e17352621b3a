"""Pickles of a known shape (composable_shard/checkpoint/untrusted/pickle_bounds.py,
[Note: pickles of a known shape]): a pickle that differs from one already
walked and passed only inside string, bytes or binary-number payloads is
admitted without a walk — a re-saved DCP ``.metadata`` (a new ``save_id``)
among them, which is what keeps a load's cost where it was — while any
difference outside the payloads (an opcode, a memo index, a length byte),
however few bytes, is walked and refused as before."""

from __future__ import annotations

import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from composable_shard.checkpoint import CheckpointError
from composable_shard.checkpoint.untrusted import pickle_bounds
from composable_shard.checkpoint.untrusted.pickle_bounds import check_pickle

PROTO, MEMOIZE, STOP = b"\x80\x04", b"\x94", b"."


def _short_string(text: bytes) -> bytes:
    return b"\x8c" + bytes([len(text)]) + text


def _padding(count: int) -> bytes:
    """``count`` memoized 200-byte strings: payload enough to make a pickle
    large enough to be remembered by shape."""
    return b"".join(_short_string(bytes([65 + i % 26]) * 200) + MEMOIZE for i in range(count))


def _pair_chain(pair: bytes, links: int) -> bytes:
    """A pickle whose ``links`` steps each make a tuple of two items:
    ``pair(i)`` is what pushes them (two memo reads of step i's tuple make
    a DAG of 2**links leaves; two small ints make a flat tuple)."""
    body = _short_string(b"a") + MEMOIZE
    for i in range(links):
        body += pair.replace(b"@", bytes([i])) + b"\x86" + MEMOIZE
    return PROTO + body + _padding(24) + STOP


@pytest.fixture(autouse=True)
def _fresh_caches():
    pickle_bounds._PASSED.clear()
    pickle_bounds._SHAPES.clear()
    yield
    pickle_bounds._PASSED.clear()
    pickle_bounds._SHAPES.clear()


def test_changed_string_payloads_keep_the_shape_and_are_admitted_without_a_walk():
    honest = pickle.dumps({"names": [f"block.{i}.weight" for i in range(400)], "id": "a" * 32, "note": "é" * 40}, protocol=4)
    resaved = honest.replace(b"a" * 32, b"b" * 32).replace("é".encode() * 40, "è".encode() * 40)
    assert len(resaved) == len(honest) and resaved != honest
    assert not pickle_bounds._same_shape_as_passed(resaved)
    check_pickle(honest, "honest")
    # The last changed byte is the last byte of a two-byte-per-character
    # payload: its span is counted in bytes, not characters.
    assert pickle_bounds._same_shape_as_passed(resaved)
    check_pickle(resaved, "re-saved")
    assert pickle.loads(resaved)["id"] == "b" * 32


def test_a_same_length_change_outside_the_payloads_is_walked_and_refused():
    honest = pickle.dumps({"names": [f"block.{i}.weight" for i in range(400)]}, protocol=4)
    check_pickle(honest, "honest")
    damaged = bytearray(honest)
    length_byte = honest.index(_short_string(b"block.0.weight")) + 1
    damaged[length_byte] += 1  # a string's length, not its payload
    assert not pickle_bounds._same_shape_as_passed(bytes(damaged))
    with pytest.raises(CheckpointError, match="damaged"):
        check_pickle(bytes(damaged), "damaged")


def test_a_dag_bomb_of_the_same_length_as_a_passed_pickle_is_refused():
    flat = _pair_chain(b"K@K@", 60)  # each step: (i, i)
    bomb = _pair_chain(b"h@h@", 60)  # each step: (t, t) of the step before
    assert len(flat) == len(bomb) and len(flat) >= pickle_bounds._SHAPE_MIN
    check_pickle(flat, "flat")
    assert not pickle_bounds._same_shape_as_passed(bomb)
    with pytest.raises(CheckpointError, match="DAG bomb"):
        check_pickle(bomb, "bomb")


def test_a_resaved_dcp_metadata_is_admitted_by_shape(tmp_path):
    state = {f"layer{i}.weight": torch.zeros(4, 4) for i in range(64)}
    path = tmp_path / "checkpoint"
    dcp.save(state, checkpoint_id=path, no_dist=True)
    first = (path / ".metadata").read_bytes()
    shutil.rmtree(path)
    dcp.save(state, checkpoint_id=path, no_dist=True)
    second = (path / ".metadata").read_bytes()
    assert first != second and len(first) == len(second) >= pickle_bounds._SHAPE_MIN
    check_pickle(first, "first")
    assert pickle_bounds._same_shape_as_passed(second)
