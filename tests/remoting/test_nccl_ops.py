"""The emulated NCCL's parts below the worker: reductions as the GPU computes them, the unique id's
layout, and the mesh's wording of a peer that went away."""

from __future__ import annotations

import socket
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from rgpu.remoting.datapath.backends import nccl_ops
from rgpu.remoting.datapath.backends.nccl_mesh import ID_BYTES, Mesh, MeshError, Rendezvous, UniqueId

DTYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64, 6: np.float16, 7: np.float32,
          8: np.float64}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("op", [nccl_ops.SUM, nccl_ops.PROD, nccl_ops.MAX, nccl_ops.MIN])
def test_reductions_equal_numpys_wrapping_integers_as_the_gpu_does(dtype: int, op: int) -> None:
    rng = np.random.default_rng(dtype * 10 + op)
    t = DTYPES[dtype]
    if np.issubdtype(t, np.integer):
        info = np.iinfo(t)
        parts = [rng.integers(info.min, info.max, 257, dtype=t, endpoint=True) for _ in range(3)]
    else:
        parts = [rng.integers(-8, 8, 257).astype(t) for _ in range(3)]   # exact in every float type
    with np.errstate(over="ignore"):
        want = {nccl_ops.SUM: parts[0] + parts[1] + parts[2], nccl_ops.PROD: parts[0] * parts[1] * parts[2],
                nccl_ops.MAX: np.maximum(np.maximum(parts[0], parts[1]), parts[2]),
                nccl_ops.MIN: np.minimum(np.minimum(parts[0], parts[1]), parts[2])}[op]
    got = np.frombuffer(nccl_ops.reduce([p.tobytes() for p in parts], dtype, op), dtype=t)
    assert np.array_equal(got, want)


def test_bfloat16_and_unknown_operators_are_refused_by_name() -> None:
    with pytest.raises(nccl_ops.Unsupported, match="data type bfloat16 is not supported by the emulated GPU's NCCL"):
        nccl_ops.reduce([bytes(2)], 9, nccl_ops.SUM)
    with pytest.raises(nccl_ops.Unsupported, match="reduction operator 7 is not supported"):
        nccl_ops.reduce([bytes(4)], 7, 7)


def test_a_unique_id_is_128_bytes_and_a_foreign_one_is_refused() -> None:
    uid = UniqueId("10.1.2.3", 40123, bytes(range(16)))
    packed = uid.pack()
    assert len(packed) == ID_BYTES and UniqueId.unpack(packed) == uid
    with pytest.raises(ValueError, match="not a unique id of rgpu's emulated NCCL"):
        UniqueId.unpack(bytes(ID_BYTES))


def _pair() -> tuple[Mesh, Mesh]:
    """Two ranks of one communicator, connected on loopback."""
    uid = Rendezvous("127.0.0.1", 10.0).id.pack()
    with ThreadPoolExecutor(2) as pool:
        m0, m1 = pool.map(lambda r: Mesh(uid, 2, r, "127.0.0.1", 10.0), range(2))
    return m0, m1


@pytest.mark.parametrize("reset", [False, True])
def test_a_peer_that_goes_away_reads_the_same_whether_its_socket_closed_or_reset(reset: bool) -> None:
    m0, m1 = _pair()
    try:
        m0.send(1, b"ping")
        assert m1.recv(0, 4) == b"ping"
        if reset:   # SO_LINGER 0: the kernel answers with RST, as for a process killed with unread data
            m1.peers[0].setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        m1.close()
        with pytest.raises(MeshError) as err:
            m0.recv(1, 4)
        assert str(err.value) == "rank 1's worker went away (its connection closed)"
    finally:
        m0.close()


def test_premulsum_scales_each_ranks_elements_before_summing_them() -> None:
    parts = [np.array([1, 2, 3], np.float32).tobytes(), np.array([4, 5, 6], np.float32).tobytes()]
    scale = nccl_ops.scalar(np.float32(0.5).tobytes(), 7)
    got = np.frombuffer(nccl_ops.reduce(parts, 7, nccl_ops.SUM, scale=scale), np.float32)
    assert got.tolist() == [2.5, 3.5, 4.5]
    ints = [np.array([2**31 - 1], np.int32).tobytes(), np.array([1], np.int32).tobytes()]
    wrapped = np.frombuffer(nccl_ops.reduce(ints, 2, nccl_ops.SUM, scale=nccl_ops.scalar(np.int32(2).tobytes(), 2)), np.int32)
    assert wrapped.tolist() == [0]   # (2^31 - 1) * 2 wraps to -2, plus 2: as the GPU's int32 arithmetic


def test_a_rank_that_closes_right_after_sending_still_delivers_what_it_sent() -> None:
    """ncclCommDestroy right after a collective: the rank's part, queued for its sender thread, must
    still reach the peer (found as 'rank 1's worker went away' in a shrink test with 4 ranks)."""
    m0, m1 = _pair()
    try:
        big = bytes(range(256)) * (1 << 14)     # 4 MiB: more than a socket buffer takes at once
        with ThreadPoolExecutor(1) as pool:
            got = pool.submit(m0.recv, 1, len(big))     # the peer, receiving
            m1.send(0, big)
            m1.close(flush_s=10.0)
            assert got.result(timeout=30) == big
    finally:
        m0.close()
        m1.close()


def test_a_shrink_keeps_the_other_ranks_in_order_and_refuses_a_bad_list() -> None:
    assert nccl_ops.shrink_members(4, 2, [0]) == [1, 2, 3]
    assert nccl_ops.shrink_members(4, 1, [3, 0]) == [1, 2]
    for exclude, why in (([2], "rank 2 excludes itself"), ([4], "names a rank outside 0..3"),
                         ([0, 0], "names a rank twice")):
        with pytest.raises(ValueError, match=why):
            nccl_ops.shrink_members(4, 2, exclude)
