"""One way to plug in a part: a user's sampler, reward, task and generation backend, each with
options, named as ``package.module:attr`` in a config and used by a real run."""

import json
from typing import Annotated, Any

import pytest
from helpers import SMALL, error, user_module
from pydantic import BaseModel

from asyncrl.config import AlgorithmConfig, BackendConfig, EnvironmentConfig, SamplerConfig, TaskConfig, load_config
from asyncrl.config.base import PartSection
from asyncrl.generation import build_generator
from asyncrl.models.factory import build_model, build_tokenizer
from asyncrl.plugins import BUILTINS, OPTIONS_AT, PartRef, build_part, resolve, validate_options
from asyncrl.run import train

PLUGINS = '''
from pydantic import BaseModel

from asyncrl.data import Prompt, Task
from asyncrl.generation import GeneratorBase
from asyncrl.generation.hf import build_hf_generator
from asyncrl.control.sampler import InOrderSampler

built_samplers = []


class Counted(InOrderSampler):
    """in_order, recording each construction and its options."""

    class Options(BaseModel):
        label: str

    def __init__(self, prompts_per_step, max_lag, options):
        super().__init__(prompts_per_step, max_lag)
        built_samplers.append(options.label)


class Scaled:
    """exact match, times a scale."""

    class Options(BaseModel):
        scale: float = 1.0

    def __init__(self, options):
        self.scale = options.scale

    def __call__(self, completion, answer):
        return self.scale * float(completion.strip() == answer.strip())


class Doubling:
    """Prompts "n+n=" for n below count."""

    class Options(BaseModel):
        count: int

    def __init__(self, data, options):
        if options.count < data.eval_size + 1:
            raise ValueError(f"data.task.options.count: {options.count} leaves no train prompts")
        self.data, self.count = data, options.count

    def build(self):
        prompts = [Prompt(uid=f"d{n}", text=f"{n}+{n}=", answer=str(2 * n)) for n in range(self.count)]
        return Task("doubling", train=prompts[self.data.eval_size :], heldout=prompts[: self.data.eval_size])


def hf_inflight(config, model, tokenizer, stop_token_ids, options):
    """The hf generator, declaring the capability its option gives (only the false one is true of it)."""
    generator = build_hf_generator(config, model, tokenizer, stop_token_ids)
    generator.loads_while_generating = options.loads_while_generating
    return generator


class _InflightOptions(BaseModel):
    loads_while_generating: bool


hf_inflight.Options = _InflightOptions


class Bare:
    """A generator with the members every backend writes and none of the capabilities."""

    version = 0

    def __init__(self, config, model, tokenizer, stop_token_ids):
        self.stop_token_ids = stop_token_ids

    def generate(self, requests, params):
        return []

    def load_weights(self, state_dict, version):
        self.version = version


class Based(GeneratorBase, Bare):
    """The same generator, with every capability at its default."""
'''

PARTS = [
    "sampler.name=my_parts:Counted",
    "sampler.options={label: run}",
    "rewards.functions=['my_parts:Scaled']",
    "rewards.options={'my_parts:Scaled': {scale: 2.0}}",
    "data.task={name: my_parts:Doubling, options: {count: 40}}",
    "data.eval_size=4",
    "generation.backend.name=my_parts:hf_inflight",
    "generation.backend.options={loads_while_generating: false}",
]


@pytest.fixture
def my_parts(tmp_path, monkeypatch):
    return user_module(tmp_path, monkeypatch, "my_parts", PLUGINS)


@pytest.mark.slow
def test_a_run_uses_a_users_sampler_reward_task_and_backend_with_their_options(tmp_path, my_parts):
    config = load_config(None, [*SMALL, *PARTS, f"logging.output_dir={tmp_path / 'run'}", "step.max_steps=2"])
    assert my_parts.built_samplers == []  # validating the config checked its name only
    train(config)
    assert my_parts.built_samplers == ["run"]  # the run built it, once
    groups = [json.loads(line) for line in (tmp_path / "run" / "groups.jsonl").read_text().splitlines()]
    assert groups and all(g["prompt_uid"].startswith("d") for g in groups)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2


@pytest.mark.parametrize("loads", [True, False])
def test_the_backend_declares_whether_it_loads_while_generating(my_parts, loads):
    config = load_config(None, [*SMALL, *PARTS, f"generation.backend.options={{loads_while_generating: {loads}}}"])
    tokenizer = build_tokenizer(config)
    generator = build_generator(config, build_model(config, tokenizer), tokenizer)
    assert generator.loads_while_generating is loads
    from asyncrl.parts import build_run_parts
    from asyncrl.workers import rollout_worker

    worker = rollout_worker(config, build_run_parts(config), generator, None, tokenizer)
    assert worker.inflight is loads  # asked of the generator, whatever its backend is called


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "sampler.options={label: x, colour: red}",
            "sampler.options.colour: unknown option of 'my_parts:Counted' (its options: label)",
        ),
        ("sampler.options={}", "sampler.options.label: required by 'my_parts:Counted'"),
        (
            "rewards.options={'my_parts:Scaled': {scale: big}}",
            "rewards.options.my_parts:Scaled.scale: Input should be a valid number, unable to parse string as a number",
        ),
        ("rewards.options={exact_match: {scale: 2}}", "rewards.options.exact_match: not in rewards.functions"),
        ("data.task.options={count: 2}", "data.task.options.count: 2 leaves no train prompts"),
        (
            "data.task.options.path=x.jsonl",
            "data.task.options.path: unknown option of 'my_parts:Doubling' (its options: count)",
        ),
        ("sampler.name=in_order", "sampler.options.label: unknown option; 'in_order' takes no options"),
    ],
)
def test_bad_options_are_one_line_errors_naming_the_key(my_parts, capsys, override, message):
    assert error(capsys, "config", *SMALL, *PARTS, override) == message


def test_bad_backend_options_stop_the_run_in_one_line(my_parts, capsys, tmp_path):
    message = error(
        capsys, "train", "--output-dir", str(tmp_path / "run"), *SMALL, *PARTS, "generation.backend.options={}"
    )
    assert message == "generation.backend.options.loads_while_generating: required by 'my_parts:hf_inflight'"


def test_a_generator_lacking_capabilities_is_refused_and_generator_base_gives_their_defaults(my_parts):
    config = load_config(None, [*SMALL, "generation.backend.name=my_parts:Bare"])
    tokenizer = build_tokenizer(config)
    model = build_model(config, tokenizer)
    with pytest.raises(ValueError) as refused:
        build_generator(config, model, tokenizer)
    assert str(refused.value) == (
        "generation.backend.name: 'my_parts:Bare' built a Bare without abandon, close, concurrent_calls, fingerprint, "
        "loads_while_generating, score of the Generator protocol; derive it from asyncrl.generation.GeneratorBase, which gives every "
        "capability its default (docs/generation.md)"
    )
    based = build_generator(load_config(None, [*SMALL, "generation.backend.name=my_parts:Based"]), model, tokenizer)
    assert not based.loads_while_generating and not based.concurrent_calls
    assert based.score([[1, 2]], None) is None and based.close() is None and based.fingerprint() is None
    assert based.abandon() is None


def test_lora_needs_a_backend_that_declares_it_takes_adapters(my_parts, capsys, tmp_path, monkeypatch):
    lora = [*SMALL, *PARTS, "lora.rank=4", "trainer.device=cpu"]
    message = error(capsys, "train", "--output-dir", str(tmp_path / "run"), *lora)
    assert message == (
        "lora.rank: generation.backend.name 'my_parts:hf_inflight' does not declare takes_lora_adapters, so it cannot "
        "load the adapters a LoRA trainer syncs (docs/plugins.md)"
    )
    monkeypatch.setattr(my_parts.hf_inflight, "takes_lora_adapters", True, raising=False)
    config = load_config(None, lora)
    tokenizer = build_tokenizer(config)
    generator = build_generator(config, build_model(config, tokenizer), tokenizer)
    assert generator._targets and all(".lora_" in name for name in generator._targets)  # the adapter alone syncs


@pytest.mark.parametrize("kind", list(BUILTINS))
def test_every_builtin_is_found_the_way_a_users_part_is(kind):
    for name, path in BUILTINS[kind].items():
        assert resolve(kind, name, "field") is resolve(kind, path, "field")


class Nesting:
    """A part whose options name another part, as a tool environment names its parser."""

    class Options(BaseModel):
        inner: Annotated[str, PartRef("sampler", options="inner_options")] = "in_order"
        inner_options: dict[str, Any] = {}


def test_a_part_named_in_options_is_resolved_and_its_options_checked_by_the_loader():
    assert validate_options(Nesting, "n", {"inner": "windowed"}, "x.options") == Nesting.Options(inner="windowed")
    with pytest.raises(ValueError, match=r"^x\.options\.inner: unknown sampler 'nosuch'; built-ins are"):
        validate_options(Nesting, "n", {"inner": "nosuch"}, "x.options")
    with pytest.raises(ValueError) as caught:
        validate_options(Nesting, "n", {"inner_options": {"window": 2}}, "x.options")
    assert str(caught.value) == "x.options.inner_options.window: unknown option; 'in_order' takes no options"


class Sized:
    """A part with options, a check of its own and a capability keyword."""

    checked: list = []

    class Options(BaseModel):
        size: int = 1

    @classmethod
    def check_options(cls, options):
        cls.checked.append(options)

    def __init__(self, first, options, *, extra=None):
        self.built_with = (first, options, extra)


def bare(first):
    return first


def test_every_part_is_built_with_its_options_instance_whole_and_a_part_without_options_with_none():
    options = validate_options(Sized, "s", {"size": 2}, "x.options")
    assert options == Sized.Options(size=2) and Sized.checked == [options]
    assert build_part(Sized, options, "first", extra=3).built_with == ("first", options, 3)
    assert build_part(bare, validate_options(bare, "b", {}, "x.options"), "first") == "first"


def test_every_section_naming_a_part_derives_from_one_base_that_knows_where_its_options_are_set():
    sections = [SamplerConfig, TaskConfig, BackendConfig, AlgorithmConfig, EnvironmentConfig]
    assert all(issubclass(section, PartSection) for section in sections)
    assert {section.kind: f"{section.at}.options" for section in sections} == {
        kind: at for kind, at in OPTIONS_AT.items() if kind != "reward"
    }
    assert all(list(section.model_fields)[:2] == ["name", "options"] for section in sections)
