"""Which network interface a Ray node's collectives bind to (asyncrl/runtime/ray.py)."""

import os

from asyncrl.runtime.ray import bind_collectives, interface_of

NOWHERE = "198.51.100.7"  # TEST-NET-2: on no interface of any machine


def test_the_interface_of_an_address_is_the_one_holding_it_and_none_for_an_address_on_none():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of(NOWHERE) is None


def test_collectives_bind_to_the_nodes_interface_but_keep_what_the_user_set(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    bind_collectives("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth9"
    assert os.environ["NCCL_SOCKET_IFNAME"] == "lo"


def test_an_address_on_no_interface_sets_nothing(monkeypatch):
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(variable, raising=False)
    bind_collectives(NOWHERE)
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    assert "NCCL_SOCKET_IFNAME" not in os.environ
