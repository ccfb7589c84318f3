"""``StepProfile``: exclusive time per phase on each thread, the window between the evaluations,
and the union and overlap of phases that ran at once. A clock the test moves stands in for
``time.perf_counter``, so every figure is exact."""

import threading
import types

import pytest

from asyncrl.bench import step_profile
from asyncrl.bench.step_profile import EVALUATION, StepProfile, summarize


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(step_profile, "time", fake)
    return fake


class Work:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def evaluate(self) -> None:
        self.clock.advance(1.0)
        self.score()

    def generate(self) -> None:
        self.clock.advance(2.0)
        self.score()
        self.clock.advance(1.0)

    def score(self) -> None:
        self.clock.advance(0.5)


PHASES = {EVALUATION: [(Work, "evaluate")], "generation": [(Work, "generate")], "rewards": [(Work, "score")]}


def test_a_phase_called_inside_another_is_charged_to_the_inner_one_alone(clock):
    work = Work(clock)
    with StepProfile(PHASES) as profile:
        work.evaluate()  # ends at 1.5: the window opens
        work.generate()
        work.generate()
        clock.advance(0.25)  # glue no phase covers
        work.evaluate()  # starts at 8.75: the window closes
    report = profile.window(steps=2)
    assert report["step_s"] == pytest.approx((8.75 - 1.5) / 2)
    assert report["phases_s"] == pytest.approx({"generation": 3.0, "rewards": 0.5})  # per step
    assert report["busy_s"] == pytest.approx(3.5)
    assert report["untimed_s"] == pytest.approx(0.125)
    assert report["overlap_s"] == pytest.approx(0.0)


def test_an_evaluation_inside_an_evaluation_counts_as_one(clock):
    class Outer:
        def __init__(self, work: Work) -> None:
            self.work = work

        def evaluate(self) -> None:
            self.work.clock.advance(2.0)
            self.work.evaluate()
            self.work.clock.advance(2.0)

    work = Work(clock)
    outer = Outer(work)
    with StepProfile({**PHASES, EVALUATION: [(Work, "evaluate"), (Outer, "evaluate")]}) as profile:
        outer.evaluate()  # 0 to 5.5, with an inner evaluation from 2 to 3.5
        work.generate()
        outer.evaluate()
    report = profile.window(steps=1)
    assert report["step_s"] == pytest.approx(3.5)  # from the outer call's end, not the inner one's
    assert report["phases_s"] == pytest.approx({"generation": 3.0, "rewards": 0.5})


def test_phases_on_two_threads_overlap_and_busy_time_is_their_union(clock):
    """One thread trains while another generates: each thread's own stack charges its own phase,
    so the seconds they share count once in ``busy_s`` and again in ``overlap_s``."""

    class Trainer:
        def train(self) -> None:
            thread = threading.Thread(target=work.generate)
            thread.start()
            thread.join()  # the other thread moves the clock by 3.5 while this call is open
            clock.advance(1.0)

    work = Work(clock)
    with StepProfile({**PHASES, "backward": [(Trainer, "train")]}) as profile:
        work.evaluate()
        Trainer().train()
        work.evaluate()
    report = profile.window(steps=1)
    assert report["phases_s"] == pytest.approx({"backward": 4.5, "generation": 3.0, "rewards": 0.5})
    assert report["busy_s"] == pytest.approx(4.5) and report["step_s"] == pytest.approx(4.5)
    assert report["overlap_s"] == pytest.approx(3.5) and report["untimed_s"] == pytest.approx(0.0)


def test_summarize_clips_segments_to_the_window():
    segments = [("generation", -1.0, 4.0), ("backward", 2.0, 6.0), ("sync", 7.0, 9.0)]
    report = summarize(segments, start=0.0, end=8.0, steps=2)
    assert report["phases_s"] == pytest.approx({"backward": 2.0, "generation": 2.0, "sync": 0.5})
    assert report["busy_s"] == pytest.approx(3.5)  # 0-6 and 7-8
    assert report["untimed_s"] == pytest.approx(0.5) and report["overlap_s"] == pytest.approx(1.0)


def test_a_call_that_raises_still_closes_its_phase(clock):
    class Failing:
        def generate(self) -> None:
            clock.advance(1.0)
            raise ValueError("boom")

    work = Work(clock)
    with StepProfile({**PHASES, "generation": [(Failing, "generate")]}) as profile:
        work.evaluate()
        with pytest.raises(ValueError, match="boom"):
            Failing().generate()
        work.score()
        work.evaluate()
    assert profile.window(steps=1)["phases_s"] == pytest.approx({"generation": 1.0, "rewards": 0.5})


def test_patched_functions_are_restored_and_inherited_ones_fall_back_to_the_base():
    class Base:
        def run(self) -> str:
            return "base"

    class Child(Base):
        pass

    class Own:
        def run(self) -> str:
            return "own"

    module = types.ModuleType("fake_module")
    module.step = lambda: "module"
    originals = Base.run, Own.run, module.step
    with StepProfile({"generation": [(Child, "run"), (Own, "run")], "optimizer": [(module, "step")]}):
        assert "run" in vars(Child) and Child().run() == "base" and Own().run() == "own"
        assert module.step() == "module" and module.step is not originals[2]
        assert Base.run is originals[0]  # the base itself is left alone
    assert "run" not in vars(Child) and Child.run is Base.run
    assert (Base.run, Own.run, module.step) == originals


def test_static_and_class_methods_are_refused_and_a_window_needs_two_evaluations(clock):
    class Helpers:
        @staticmethod
        def plain() -> None:
            pass

    score = Work.score
    with pytest.raises(TypeError, match=r"Helpers\.plain is not a plain function"):
        with StepProfile({"rewards": [(Work, "score"), (Helpers, "plain")]}):
            pytest.fail("the profile was entered")
    assert Work.score is score and isinstance(vars(Helpers)["plain"], staticmethod)  # nothing left patched
    with StepProfile(PHASES) as profile:
        Work(clock).evaluate()
    with pytest.raises(ValueError, match="fewer than two evaluation calls"):
        profile.window(steps=1)
