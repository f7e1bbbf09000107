"""comm/ops.py: which failures inside a collective are reported as a lost peer."""
from __future__ import annotations

import pytest


def test_only_transport_failures_become_peer_lost() -> None:
    """gloo reports a lost peer as a plain RuntimeError naming the transport failure; a local error inside
    a collective must not be mislabelled as a lost peer."""
    from zeropp.comm.ops import PeerLostError, _peer_errors
    from zeropp.topology import Group

    with pytest.raises(PeerLostError, match=r"rank 1: all_reduce over ranks \[0, 1\] failed: a peer rank was lost"):
        with _peer_errors("all_reduce", Group((0, 1)), 1):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242")
    with pytest.raises(RuntimeError, match="unsupported dtype") as err:
        with _peer_errors("all_reduce", Group((0, 1)), 1):
            raise RuntimeError("unsupported dtype complex64")
    assert not isinstance(err.value, PeerLostError)
