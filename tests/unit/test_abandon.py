"""Abandoning a running forward, backward or generation from another thread (models/abandon.py),
and the local runtime's shutdown that asks its workers to (runtime/local.py)."""

import copy
import threading
import time

import pytest
import torch
from torch import nn

from asyncrl.generation import HFGenerator, SampleRequest, SamplingParams
from asyncrl.models import build_char_tokenizer, build_tiny_model
from asyncrl.models.abandon import Abandoned, AbandonSwitch
from asyncrl.runtime.local import LocalHandle

TOKENIZER = build_char_tokenizer()


def slow_model(seconds: float) -> nn.Module:
    """Four linear layers, each sleeping before its forward."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    for layer in model:
        layer.register_forward_pre_hook(lambda module, args: time.sleep(seconds))
    return model


def run_in_thread(work) -> tuple[threading.Thread, dict]:
    outcome = {}

    def target():
        try:
            outcome["result"] = work()
        except Exception as err:
            outcome["error"] = err

    thread = threading.Thread(target=target)
    thread.start()
    return thread, outcome


def test_a_watched_forward_stops_at_its_next_module_once_the_switch_is_set():
    model = slow_model(1.0)  # 4 s a forward
    switch = AbandonSwitch("the train step")
    switch.attach(model)

    def forward():
        with switch.watching():
            return model(torch.randn(2, 8))

    thread, outcome = run_in_thread(forward)
    time.sleep(0.3)
    switch.set()
    thread.join(10)
    assert isinstance(outcome["error"], Abandoned) and "the train step was abandoned" in str(outcome["error"])


def test_a_watched_backward_stops_at_the_next_module_output_gradient():
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    switch = AbandonSwitch("the train step")
    switch.attach(model)
    with switch.watching():
        loss = model(torch.randn(2, 8)).sum()
        switch.set()
        with pytest.raises(Abandoned, match="abandoned in backward"):
            loss.backward()
    assert model[0].weight.grad is None  # backward never reached the first layer


def test_a_model_carrying_the_hooks_still_deep_copies_and_its_copy_runs_unwatched():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    switch = AbandonSwitch("the train step")
    switch.attach(model)
    twin = copy.deepcopy(model)  # an in-process generator's copy, a frozen reference
    switch.set()
    twin(torch.randn(2, 8)).sum().backward()  # its users never run it under this switch's watch
    with switch.watching(), pytest.raises(Abandoned):
        model(torch.randn(2, 8))


def test_the_switch_leaves_unwatched_forwards_and_forwards_after_clear_alone():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    switch = AbandonSwitch("the train step")
    switch.attach(model)
    switch.set()
    model(torch.randn(2, 8)).sum().backward()  # not under watching(): another thread's, or a copy's
    switch.clear()
    with switch.watching():
        model(torch.randn(2, 8)).sum().backward()
    assert model[0].weight.grad is not None


def test_an_abandoned_generation_raises_within_a_token_and_a_later_call_runs():
    model = build_tiny_model(len(TOKENIZER), seed=0, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    model.register_forward_pre_hook(lambda module, args: time.sleep(0.1))  # 0.1 s a token: 20 s a call
    generator = HFGenerator(model, stop_token_ids=[TOKENIZER.eos_token_id], pad_token_id=0, batch_size=4)
    request = SampleRequest(TOKENIZER.encode("1+1="), 0)
    params = SamplingParams(max_new_tokens=200, temperature=1.0)
    thread, outcome = run_in_thread(lambda: generator.generate([request], params))
    time.sleep(0.5)
    generator.abandon()
    thread.join(10)
    assert isinstance(outcome.get("error"), Abandoned)
    [rollout] = generator.generate([request], SamplingParams(max_new_tokens=3, temperature=1.0))
    assert len(rollout.response_ids) <= 3


class SlowWorker:
    def __init__(self) -> None:
        self.stop = threading.Event()

    def work(self) -> str:
        self.stop.wait(30)
        return "abandoned" if self.stop.is_set() else "finished"

    def abandon(self) -> None:
        self.stop.set()


def test_the_local_runtime_shutdown_asks_a_worker_to_abandon_its_running_call():
    worker = SlowWorker()
    handle = LocalHandle(worker, "slow")
    future = handle._executor.submit(worker.work)
    time.sleep(0.1)
    started = time.monotonic()
    handle.shutdown(timeout_s=30)
    assert time.monotonic() - started < 5 and future.result(1) == "abandoned"
