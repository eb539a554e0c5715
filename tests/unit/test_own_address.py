"""raychat.capacity.own_address: the environment a local Ray cluster's processes inherit while ray.init starts
it, and this process's again after (no Ray started here: tests/ray/test_local_cluster_address.py starts one)."""

import os
from pathlib import Path

import pytest

from raychat.capacity import own_address
from raychat.ports import PORT_LOW


def test_a_local_cluster_gets_its_own_address_and_no_users_api_server_and_the_environment_comes_back(
    monkeypatch,
):
    """RAY_API_SERVER_ADDRESS, which Ray's state API reads before RAY_ADDRESS, is the user's dashboard of another
    cluster (raychat submit's default): the cluster's processes must not inherit it. Restored after ray.init
    fails too."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_GCS_SERVER_PORT", raising=False)
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://10.0.0.9:8265")
    ephemeral_start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    with pytest.raises(RuntimeError, match="ray.init failed"), own_address():
        port = int(os.environ["RAY_GCS_SERVER_PORT"])
        assert PORT_LOW <= port < ephemeral_start
        assert os.environ["RAY_ADDRESS"] == f"127.0.0.1:{port}"
        assert "RAY_API_SERVER_ADDRESS" not in os.environ
        raise RuntimeError("ray.init failed")
    assert "RAY_ADDRESS" not in os.environ and "RAY_GCS_SERVER_PORT" not in os.environ
    assert os.environ["RAY_API_SERVER_ADDRESS"] == "http://10.0.0.9:8265"


def test_a_users_gcs_port_is_the_one_the_local_cluster_binds(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "")
    monkeypatch.setenv("RAY_GCS_SERVER_PORT", "23456")
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    with own_address():
        assert (os.environ["RAY_ADDRESS"], os.environ["RAY_GCS_SERVER_PORT"]) == ("127.0.0.1:23456", "23456")
    assert (os.environ["RAY_ADDRESS"], os.environ["RAY_GCS_SERVER_PORT"]) == ("", "23456")
    assert "RAY_API_SERVER_ADDRESS" not in os.environ
