"""The run's request bound is computed where the generator is built (the composition root) and
handed to a backend that declares ``takes_request_bound``, and to no other; the generation package
builds no task, resolves no environment and imports nothing of the rollout wing to get it."""

import inspect

import grimp
import pytest
from helpers import SMALL, user_module

from asyncrl import workers
from asyncrl.config import load_config
from asyncrl.data import build_task
from asyncrl.environments.base import environment_class
from asyncrl.generation import build_generator, takes_request_bound
from asyncrl.models.factory import build_model, build_tokenizer
from asyncrl.parts import build_run_parts
from asyncrl.rollout.context import request_bound
from asyncrl.workers import Shared, build_rollout_worker, generator_request_bound

BACKENDS = '''
from asyncrl.generation import GeneratorBase


class Recorded(GeneratorBase):
    """A generator that keeps the keywords its factory was called with."""

    version = 0

    def __init__(self, config, model, tokenizer, stop_token_ids, **given):
        self.stop_token_ids = stop_token_ids
        self.given = given

    def generate(self, requests, params):
        return []

    def load_weights(self, state_dict, version):
        self.version = version


def bounded(config, model, tokenizer, stop_token_ids, **given):
    return Recorded(config, model, tokenizer, stop_token_ids, **given)


bounded.takes_request_bound = True


def unbounded(config, model, tokenizer, stop_token_ids, **given):
    return Recorded(config, model, tokenizer, stop_token_ids, **given)
'''

BOUND = (7, "the budget")  # what build_generator hands over is the caller's, untouched


@pytest.fixture
def backends(tmp_path, monkeypatch):
    return user_module(tmp_path, monkeypatch, "bound_backends", BACKENDS)


def config_of(backend: str, *overrides: str):
    return load_config(None, [*SMALL, f"generation.backend.name={backend}", *overrides])


def test_a_backend_declaring_takes_request_bound_is_handed_the_bound_and_one_without_it_is_not(backends):
    bounded, unbounded = config_of("bound_backends:bounded"), config_of("bound_backends:unbounded")
    tokenizer = build_tokenizer(bounded)
    assert build_generator(bounded, object(), tokenizer, request_bound=BOUND).given == {"request_bound": BOUND}
    assert build_generator(unbounded, object(), tokenizer, request_bound=BOUND).given == {}
    assert build_generator(unbounded, object(), tokenizer).given == {}
    with pytest.raises(TypeError) as missing:
        build_generator(bounded, object(), tokenizer)
    assert str(missing.value) == (
        "build_generator: generation.backend.name 'bound_backends:bounded' declares takes_request_bound; pass the "
        "run's request_bound (asyncrl.workers.generator_request_bound)"
    )


def test_the_composition_root_computes_the_bound_only_for_a_backend_that_declares_it(backends):
    bounded = config_of("bound_backends:bounded")
    tokenizer = build_tokenizer(bounded)
    task, environment = build_task(bounded.data, tokenizer), environment_class(bounded)
    assert takes_request_bound(bounded)
    assert generator_request_bound(bounded, task, environment, tokenizer) == request_bound(
        task, bounded, environment, tokenizer
    )
    for backend in ("bound_backends:unbounded", "hf"):
        assert not takes_request_bound(config_of(backend))
        # no task to read: nothing is tokenized for a backend that takes no bound
        assert generator_request_bound(config_of(backend), None, environment, tokenizer) is None


def test_a_rollout_worker_hands_its_backend_the_bound_it_computes_or_the_drivers(backends):
    config = config_of("bound_backends:bounded")
    worker = build_rollout_worker(config)
    try:
        tokenizer = build_tokenizer(config)
        expected = request_bound(build_task(config.data, tokenizer), config, environment_class(config), tokenizer)
        assert worker.generator.given == {"request_bound": expected}
        shared = Shared(tokenizer, build_model(config, tokenizer), worker.rewards, build_run_parts(config), BOUND)
        shared_worker = build_rollout_worker(config, shared=shared)
        assert shared_worker.generator.given == {"request_bound": BOUND}  # the driver's, not computed again
    finally:
        worker.close()
        worker.rewards.close()
    unbounded = build_rollout_worker(config_of("bound_backends:unbounded"))
    try:
        assert unbounded.generator.given == {}
    finally:
        unbounded.close()
        unbounded.rewards.close()


def test_a_local_run_computes_the_bound_once_in_the_driver_and_shares_it_with_its_rollout_worker(
    backends, tmp_path, monkeypatch
):
    from asyncrl import run as run_module
    from asyncrl.runtime.local import LocalRuntime

    computed = []

    def counted(*args):
        computed.append(request_bound(*args))
        return computed[-1]

    monkeypatch.setattr(workers, "request_bound", counted)
    config = config_of("bound_backends:bounded", "trainer.device=cpu")
    runtime, built = LocalRuntime(), run_module._build(config)
    try:
        _, generators = run_module._start_workers(runtime, config, run_module.RunContext(tmp_path), built)
        assert len(computed) == 1
        assert [handle.worker.generator.given for handle in generators] == [{"request_bound": computed[0]}]
    finally:
        runtime.shutdown()
        built.rewards.close()


def test_the_vllm_backend_declares_the_bound_and_takes_it_as_a_keyword():
    from asyncrl.generation.vllm import build_vllm_generator

    assert build_vllm_generator.takes_request_bound is True
    assert takes_request_bound(load_config(None, ["generation.backend.name=vllm"]))
    assert not takes_request_bound(load_config(None, ["generation.backend.name=hf"]))
    parameter = inspect.signature(build_vllm_generator).parameters["request_bound"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is inspect.Parameter.empty


def test_the_generation_package_imports_no_task_building_environment_resolution_or_rollout_code():
    graph = grimp.build_graph("asyncrl", cache_dir=None)
    generation = [
        name for name in graph.modules if name == "asyncrl.generation" or name.startswith("asyncrl.generation.")
    ]
    imported = {target for module in generation for target in graph.find_modules_directly_imported_by(module)}
    forbidden = [name for name in imported if name.startswith(("asyncrl.rollout", "asyncrl.environments"))]
    assert not forbidden, forbidden
    data = {name for name in imported if name.startswith("asyncrl.data")}
    assert data <= {"asyncrl.data.files"}, data  # the Budget annotation, under TYPE_CHECKING only
    runtime = grimp.build_graph("asyncrl", cache_dir=None, exclude_type_checking_imports=True)
    assert not any(
        runtime.direct_import_exists(importer=module, imported=name)
        for module in generation
        for name in runtime.modules
        if name.startswith("asyncrl.data")
    )
