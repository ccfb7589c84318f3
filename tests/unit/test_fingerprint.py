"""Weight fingerprints (weights/fingerprint.py) and the sync checks of promises 1 and 2
(integrity/sync_checks.py): what a fingerprint catches, that both sides agree across the casts a
transport makes, and what the checks do with a mismatch, an unknown version and a probe's gap."""

import asyncio

import pytest
import torch

from asyncrl.config import IntegrityConfig
from asyncrl.errors import IntegrityStop
from asyncrl.generation import HFGenerator
from asyncrl.integrity import IntegrityGuard
from asyncrl.integrity.sync_checks import SyncChecks
from asyncrl.models import build_char_tokenizer, build_tiny_model
from asyncrl.types import ProbeGap, SyncReport
from asyncrl.weights.fingerprint import HELD_DTYPES, SAMPLES, Sample, fingerprint, sample

TOKENIZER = build_char_tokenizer()


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(40, 16, generator=generator),
        "layer.q.weight": torch.randn(16, 16, generator=generator),
        "layer.k.weight": torch.randn(16, 16, generator=generator),
        "norm.weight": torch.ones(16),
        "steps": torch.tensor([3]),
    }


def stepped(state: dict[str, torch.Tensor], lr: float = 1e-3) -> dict[str, torch.Tensor]:
    """Every floating element moved by an optimizer-sized step."""
    return {name: t + lr * torch.sign(torch.randn_like(t)) if t.is_floating_point() else t for name, t in state.items()}


def test_a_fingerprint_catches_stale_missing_partial_and_misnamed_tensors():
    old = weights()
    new = stepped(old)
    assert fingerprint(new) == fingerprint({name: t.clone() for name, t in new.items()})
    assert fingerprint(old) != fingerprint(new)  # a skipped load, stale weights
    one_stale = dict(new, **{"layer.k.weight": old["layer.k.weight"]})
    assert fingerprint(one_stale) != fingerprint(new)  # one tensor not loaded
    assert fingerprint({k: v for k, v in new.items() if k != "norm.weight"}) != fingerprint(new)
    half = new["embed.weight"].clone()
    half[20:] = old["embed.weight"][20:]  # the second half of one tensor not loaded
    assert fingerprint(dict(new, **{"embed.weight": half})) != fingerprint(new)
    swapped = dict(new, **{"layer.q.weight": new["layer.k.weight"], "layer.k.weight": new["layer.q.weight"]})
    assert fingerprint(swapped) != fingerprint(new)


def test_a_fingerprint_reads_a_strided_sample_of_each_tensor():
    state = {"big": torch.arange(10_000, dtype=torch.float32)}
    [values] = sample(state).values
    assert len(values) == SAMPLES and values[0] == 0 and values[-1] == 9_999
    untouched = state["big"].clone()
    untouched[1:100] += 1  # between two sampled positions: the sample cannot see it
    assert fingerprint({"big": untouched}) == fingerprint(state)


@pytest.mark.parametrize("exported", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("held", ["float32", "bfloat16", "float16"])
def test_the_trainers_sample_agrees_with_a_generator_holding_another_dtype(exported, held):
    """A generator fingerprints what it holds after the transport's cast: float64 and float32 go
    through a float32 weights file, then into the server's dtype."""
    state = {name: t.to(getattr(torch, exported)) if t.is_floating_point() else t for name, t in weights().items()}
    through_file = {n: t.to(torch.float32) if t.is_floating_point() else t for n, t in state.items()}
    delivered = {n: t.to(getattr(torch, held)) if t.is_floating_point() else t for n, t in through_file.items()}
    assert sample(state).digest(held) == fingerprint(delivered)
    assert fingerprint(delivered).startswith(f"{held}:")


def test_a_sample_survives_json_and_takes_the_tied_names_a_sender_left_out():
    state = weights()
    state["head.weight"] = state["embed.weight"]
    sent = {name: t for name, t in state.items() if name != "head.weight"}
    received = Sample.from_json(sample(sent).to_json())
    assert received.with_aliases({"head.weight": "embed.weight"}).digest("float32") == fingerprint(state)
    assert received.digest("float32") != fingerprint(state)


def test_an_hf_generator_fingerprints_what_it_serves_after_a_load():
    model = build_tiny_model(len(TOKENIZER), seed=0)
    generator = HFGenerator(model, stop_token_ids=[TOKENIZER.eos_token_id], pad_token_id=0, batch_size=2)
    update = build_tiny_model(len(TOKENIZER), seed=1).state_dict()
    before = generator.fingerprint()
    generator.load_weights(update, 1)
    assert generator.fingerprint() == fingerprint(update) != before


class Generators:
    """Rollout handles that answer the probe with a fixed group (a stand-in for the real worker)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.probed = 0

    def handles(self):
        return [self] * self.count

    async def probe(self, prompts, version):
        self.probed += 1
        return ("probe", version)


class Trainer:
    def __init__(self, gaps):
        self.gaps = list(gaps)

    async def probe_gap(self, group):
        return self.gaps.pop(0)


def checks(config=None, generators=1, gaps=(), prompts=("p",)):
    config = config or IntegrityConfig()
    fake = Generators(generators)
    return SyncChecks(IntegrityGuard(config), config, Trainer(gaps), fake.handles(), list(prompts), 0), fake


def report(version, served, exported_state=None):
    exported = {} if exported_state is None else {d: sample(exported_state).digest(d) for d in HELD_DTYPES}
    return SyncReport(version, 0.0, 0.0, 0, "in_process", served=tuple(served), exported=exported)


def test_a_generator_serving_other_weights_than_the_export_stops_the_run_naming_it():
    config = IntegrityConfig(sampling={"every_syncs": 0})
    state = weights()
    new = stepped(state)
    check, _ = checks(config, generators=2)
    asyncio.run(check(report(1, [fingerprint(state), None], state)))  # None: a backend that cannot tell
    assert check.guard.step_metrics()["integrity/weights"] == 0
    with pytest.raises(IntegrityStop) as stop:
        asyncio.run(check(report(2, [fingerprint(new), fingerprint(state)], new)))
    assert stop.value.promise == "weights" and stop.value.step == 2
    assert "generator 1 reports weight version 2 but serves weights with fingerprint float32:" in str(stop.value)
    assert "(1 of 2 generators differ)" in str(stop.value)


def test_a_group_reporting_a_version_no_generator_was_given_stops_the_run():
    check, _ = checks()
    check.check_versions("p0", 0, 0, step=1, sent=0)
    with pytest.raises(IntegrityStop, match="group p1 reports weight version 1, which no generator was given"):
        check.check_versions("p1", 0, 1, step=1, sent=0)
    check.latest = 1  # after the first sync, or a run resumed at step 1
    check.check_versions("p1", 0, 1, step=1, sent=1)
    with pytest.raises(IntegrityStop, match="weight version -1"):
        check.check_versions("p2", -1, 1, step=1, sent=1)


def test_a_version_whose_load_has_started_is_given_before_the_syncs_checks_run():
    """In flight, a generator may serve version 1, and a group return under it, while the sync
    still reads the fingerprints back: the gate's ``sent`` vouches for it then."""
    check, _ = checks()
    check.check_versions("p", 0, 1, step=1, sent=1)
    assert check.guard.step_metrics()["integrity/weights"] == 0
    with pytest.raises(IntegrityStop, match="weight version 2, which no generator was given .the newest given is 1."):
        check.check_versions("p", 1, 2, step=1, sent=1)


def test_the_probe_runs_after_the_first_sync_and_every_n_and_knows_the_generators_dtype():
    config = IntegrityConfig(sampling={"every_syncs": 2, "threshold": 0.01, "half_precision_threshold": 0.1})
    state = weights()
    bf16 = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in state.items()}
    gaps = [ProbeGap(0.05, 0.2, 10), ProbeGap(0.005, 0.02, 10), ProbeGap(0.05, 0.2, 10)]
    check, fake = checks(config, gaps=gaps)
    asyncio.run(check(report(1, [fingerprint(bf16)], state)))  # 0.05 in bfloat16: within 0.1
    assert check.guard.step_metrics()["integrity/sampling"] == pytest.approx(0.005)  # scaled to float32's
    asyncio.run(check(report(2, [fingerprint(state)], state)))  # not probed
    asyncio.run(check(report(3, [fingerprint(state)], state)))
    asyncio.run(check(report(4, [fingerprint(state)], state)))
    assert fake.probed == 2
    with pytest.raises(IntegrityStop, match="by 0.05 per token on average .max 0.2., above the 0.01 allowed"):
        asyncio.run(check(report(5, [fingerprint(state)], state)))


def test_a_disabled_guard_checks_and_probes_nothing():
    config = IntegrityConfig(enabled=False)
    check, fake = checks(config, gaps=[ProbeGap(9.0, 9.0, 1)])
    asyncio.run(check(report(1, [fingerprint(weights())], stepped(weights()))))
    check.check_versions("p", 5, 5, step=1, sent=0)
    assert fake.probed == 0 and check.guard.step_metrics() == {}
