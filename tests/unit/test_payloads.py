"""The Ray payload types (runtime/payloads.py) are importable without ray or torch, and a
RemoteGroup holds a group's metadata, never its [n, T] tensors."""

import subprocess
import sys
from dataclasses import fields

from asyncrl.runtime.payloads import BroadcastWeights, RemoteGroup, SentWeights, WeightsRef


def test_importing_the_payload_types_loads_neither_ray_nor_torch():
    probe = "import sys, asyncrl.runtime.payloads; print(sorted({'ray', 'torch'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_a_remote_group_keeps_the_sequence_lengths_and_a_reference():
    names = [f.name for f in fields(RemoteGroup)]
    assert "sequence_lengths" in names and names[-1] == "ref"
    tensors = {"input_ids", "attention_mask", "response_mask", "behaviour_logprobs", "token_versions"}
    assert tensors.isdisjoint(names)


def test_the_weight_payloads_name_their_transport():
    assert WeightsRef(ref=None, nbytes=8).transport == "object_store"
    assert BroadcastWeights(layout=None, nbytes=8, channel=None).transport == "broadcast"
    assert SentWeights(3, None).source is None
