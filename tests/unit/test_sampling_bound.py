"""The sampling probe's bound by the dtype a generator holds (integrity/sync_checks.py): a
half-precision generator is held to a multiple of what bfloat16 moves the trainer's own scores
of the probe, never less than float32's threshold, and a threshold of 0 allows no gap in any dtype."""

import asyncio

import pytest

from asyncrl.config import IntegrityConfig
from asyncrl.errors import IntegrityStop
from asyncrl.integrity import IntegrityGuard
from asyncrl.integrity.sync_checks import SyncChecks
from asyncrl.types import ProbeGap, SyncReport


class Generator:
    async def probe(self, prompts, version):
        return ("probe", version)


class Trainer:
    def __init__(self, gap: ProbeGap) -> None:
        self.gap = gap

    async def probe_gap(self, group):
        return self.gap


def probed(gap: ProbeGap, dtype: str | None, **sampling) -> float:
    """The probe's ``integrity/sampling`` value for one generator holding ``dtype`` (None: a
    backend that cannot tell); raises ``IntegrityStop`` where the gap breaks the promise."""
    config = IntegrityConfig(sampling={"every_syncs": 1, **sampling})
    check = SyncChecks(IntegrityGuard(config), config, Trainer(gap), [Generator()], ["p"], 0)
    served = None if dtype is None else f"{dtype}:fingerprint"
    asyncio.run(check(SyncReport(1, 0.0, 0.0, 0, "in_process", served=(served,), exported={str(dtype): served})))
    return check.guard.step_metrics()["integrity/sampling"]


def test_a_half_precision_bound_is_a_multiple_of_the_measured_noise_and_never_under_float32s():
    assert probed(ProbeGap(0.02, 0.3, 40, noise=0.004), "bfloat16") == pytest.approx(0.005)  # 0.02 of 0.04: scaled
    assert probed(ProbeGap(0.009, 0.3, 40, noise=1e-4), "float16") == pytest.approx(0.009)  # under 0.01
    with pytest.raises(IntegrityStop, match=r"by 0.045 per token .* above the 0.01 allowed for weights in bfloat16 "):
        probed(ProbeGap(0.045, 0.15, 16, noise=4e-4), "bfloat16")  # twice the temperature, on the small model
    with pytest.raises(IntegrityStop, match=r"above the 0.05 allowed .* 10 times the 0.005 that bfloat16 moves"):
        probed(ProbeGap(0.06, 0.3, 40, noise=0.005), "bfloat16")
    assert probed(ProbeGap(0.06, 0.3, 40, noise=0.005), "bfloat16", noise_multiple=20) == pytest.approx(0.006)
    assert probed(ProbeGap(0.009, 0.3, 40, noise=0.5), "float32") == pytest.approx(0.009)  # full precision: 0.01


def test_without_a_measured_noise_a_half_precision_generator_has_the_half_precision_threshold():
    assert probed(ProbeGap(0.05, 0.2, 10), "bfloat16") == pytest.approx(0.005)
    with pytest.raises(IntegrityStop, match=r"above the 0.1 allowed for weights in bfloat16 .integrity.sampling.half"):
        probed(ProbeGap(0.2, 0.4, 10), "bfloat16")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", None])
def test_a_sampling_threshold_of_zero_allows_no_gap_in_any_dtype(dtype):
    assert probed(ProbeGap(0.0, 0.0, 16, noise=4e-4), dtype, threshold=0) == 0
    held = dtype or "an unknown dtype"
    with pytest.raises(IntegrityStop, match=rf"by 1e-06 per token .* above the 0 allowed for weights in {held}$"):
        probed(ProbeGap(1e-6, 1e-6, 16, noise=4e-4), dtype, threshold=0)
