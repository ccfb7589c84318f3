"""The weight broadcast group (runtime/broadcast.py) on gloo, its members as threads of this process:
exact delivery, rank 0's held copy, and the stop signal that frees a waiting member."""

import socket
import threading

import pytest
import torch

from asyncrl.weights.broadcast import BroadcastError, BroadcastMember, Entry, Layout, Rendezvous, signal_stop

GROUP_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def in_threads(function, *args_per_thread):
    """``function(*args)`` for each args in its own thread; the results (or exceptions) in order."""
    results = [None] * len(args_per_thread)

    def run(i, args):
        try:
            results[i] = function(*args)
        except Exception as err:
            results[i] = err

    threads = [threading.Thread(target=run, args=(i, args)) for i, args in enumerate(args_per_thread)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
        assert not thread.is_alive(), "a rank's call did not return within 300 s"
    return results


@pytest.fixture
def group():
    """Three members: rank 0 (the trainer's end) and two receivers."""
    rendezvous = Rendezvous("127.0.0.1", free_port(), 3, "gloo", GROUP_TIMEOUT_S)
    members = in_threads(BroadcastMember, *[(rendezvous, rank) for rank in range(3)])
    yield rendezvous, members
    for member in members:
        member.group.abort()


def weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(7, 4, generator=generator),
        "norm.weight": torch.randn(4, generator=generator).to(torch.bfloat16),
        "lm_head.weight": torch.randn(7, 4, generator=generator),
        "step": torch.tensor([seed, seed + 1]),
    }


def mismatches(received: dict, sent: dict) -> list[str]:
    assert received.keys() == sent.keys()
    return [
        name for name in sent if received[name].dtype != sent[name].dtype or not torch.equal(received[name], sent[name])
    ]


def test_a_layout_packs_each_dtype_into_one_buffer_and_unpacks_views():
    sent = weights(0)
    layout = Layout.of(sent)
    assert dict(layout.sizes) == {"float32": 56, "bfloat16": 4, "int64": 2}
    buffers = layout.empty("cpu")
    layout.pack(sent, buffers)
    assert mismatches(layout.unpack(buffers), sent) == []


def test_every_receiver_gets_every_tensor_of_each_version_exactly(group):
    _, (rank0, *receivers) = group
    for version in (1, 2):
        sent = weights(version)
        layout = rank0.send(sent, version)
        received = in_threads(BroadcastMember.receive, *[(member, layout) for member in receivers])
        assert [mismatches(r, sent) for r in received] == [[], []]


def test_a_receiver_that_unpacks_with_another_layout_is_caught(group):
    """The planted-mistake twin of the delivery test: two same-shaped tensors swapped in the layout."""
    _, (rank0, *receivers) = group
    sent = weights(3)
    layout = rank0.send(sent, 3)
    embed, norm, head, step = layout.entries
    swapped = Layout(
        (
            Entry(embed.name, embed.dtype, embed.shape, head.offset),
            norm,
            Entry(head.name, head.dtype, head.shape, embed.offset),
            step,
        ),
        layout.sizes,
    )
    received = in_threads(BroadcastMember.receive, *[(member, layout) for member in receivers])
    assert mismatches(swapped.unpack(receivers[0].buffers), sent) == ["embed.weight", "lm_head.weight"]
    assert mismatches(received[1], sent) == []


def test_rank0_holds_only_the_last_version_it_sent(group):
    _, (rank0, *receivers) = group
    for version in (1, 2):
        layout = rank0.send(weights(version), version)
        in_threads(BroadcastMember.receive, *[(member, layout) for member in receivers])
    assert mismatches(rank0.held(2), weights(2)) == []
    with pytest.raises(BroadcastError, match=r"^weight version 1 is no longer held by trainer rank 0 \(it holds 2\)$"):
        rank0.held(1)


def test_the_stop_signal_frees_a_receiver_waiting_on_a_member_that_never_joins(group):
    """Member 2 never receives (as if dead): without the signal, member 1 would wait out the
    group's timeout and fail with the group's own error; with it, it gives up with this one, and
    rank 0 still holds the version."""
    rendezvous, (rank0, waiting, _) = group
    layout = rank0.send(weights(5), 5)
    threading.Timer(0.5, signal_stop, args=(rendezvous, "member 2 died")).start()
    with pytest.raises(BroadcastError, match="stopped while this generator waited"):
        waiting.receive(layout)
    assert mismatches(rank0.held(5), weights(5)) == [] and rank0.aborted
