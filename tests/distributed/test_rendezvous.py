"""Patient rendezvous: a worker waits for the chief's address, every process for its peers, under one
deadline (VERTEXRT_RENDEZVOUS_TIMEOUT) separate from the collective timeout."""

from __future__ import annotations

import logging
import socket
import threading

import pytest

from vertexrt._net import free_port
from vertexrt.distributed import Cluster, init_torch
from vertexrt.distributed.rendezvous import Deadline, wait_for_address, wait_for_count
from vertexrt.errors import ConfigError, RendezvousTimeout


def test_deadline_comes_from_the_variable_and_refuses_nonsense() -> None:
    assert Deadline.from_environment({}).seconds == 1800
    assert Deadline.from_environment({"VERTEXRT_RENDEZVOUS_TIMEOUT": "45.5"}).seconds == 45.5
    for bad in ("0", "-3", "soon", "nan", "inf", "1e12"):
        with pytest.raises(ConfigError, match="VERTEXRT_RENDEZVOUS_TIMEOUT"):
            Deadline.from_environment({"VERTEXRT_RENDEZVOUS_TIMEOUT": bad})


def test_a_worker_waits_for_the_chief_to_listen(caplog) -> None:
    port = free_port()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def listen_late() -> None:
        server.bind(("127.0.0.1", port))
        server.listen()

    late = threading.Timer(2.5, listen_late)
    late.start()
    caplog.set_level(logging.INFO, logger="vertexrt.distributed.rendezvous")
    try:
        wait_for_address("127.0.0.1", port, Deadline.from_environment({"VERTEXRT_RENDEZVOUS_TIMEOUT": "30"}))
    finally:
        late.join()
        server.close()
    assert f"waiting for the chief at 127.0.0.1:{port}, 2 s" in caplog.text
    assert "answered after" in caplog.text


def test_an_unresolvable_chief_ends_in_a_typed_error_naming_address_and_variable() -> None:
    deadline = Deadline.from_environment({"VERTEXRT_RENDEZVOUS_TIMEOUT": "0.5"})
    with pytest.raises(RendezvousTimeout, match=r"chief at no-such-host\.invalid:2222 .*resolve") as err:
        wait_for_address("no-such-host.invalid", 2222, deadline)
    assert "VERTEXRT_RENDEZVOUS_TIMEOUT" in str(err.value)


def test_init_torch_worker_gives_up_at_the_rendezvous_deadline(monkeypatch) -> None:
    port = free_port()  # nobody listens: the chief never comes
    worker = Cluster(
        source="CLUSTER_SPEC",
        role="worker",
        node_rank=1,
        num_nodes=2,
        rank=1,
        world_size=2,
        rendezvous_address=f"127.0.0.1:{port}",
    )
    monkeypatch.setenv("VERTEXRT_RENDEZVOUS_TIMEOUT", "1")
    with pytest.raises(RendezvousTimeout, match=f"127.0.0.1:{port}.*VERTEXRT_RENDEZVOUS_TIMEOUT"):
        init_torch(cluster=worker, timeout=600)  # the collective timeout does not govern the rendezvous


def test_init_torch_chief_counts_who_joined_until_the_deadline(monkeypatch, caplog) -> None:
    chief = Cluster(
        source="CLUSTER_SPEC",
        node_rank=0,
        num_nodes=2,
        rank=0,
        world_size=2,
        rendezvous_address=f"127.0.0.1:{free_port()}",
    )
    monkeypatch.setenv("VERTEXRT_RENDEZVOUS_TIMEOUT", "2.5")
    caplog.set_level(logging.INFO, logger="vertexrt.distributed.rendezvous")
    with pytest.raises(RendezvousTimeout, match="only 1 of 2 replicas joined"):
        init_torch(cluster=chief, timeout=600)
    assert "1 of 2 replicas joined, 2 s" in caplog.text


def test_counting_joiners_backs_off_at_most_a_second_so_the_last_join_is_seen_soon(monkeypatch) -> None:
    import time

    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)  # record the pauses instead of taking them
    counts = iter([0] * 12 + [3])
    wait_for_count(lambda: next(counts), 3, Deadline(600.0, time.monotonic()))
    assert len(slept) == 12 and slept[:4] == [0.1, 0.2, 0.4, 0.8]
    assert max(slept) == 1.0  # then every second: the last replica is seen ~1 s after it joined, not 5 s
