"""Config loading, overrides and every cross-field rule, each reported as one line naming the field."""

import json
import subprocess
import sys
from types import SimpleNamespace
from typing import Annotated, get_args, get_origin

import pytest
import yaml
from helpers import ROOT

from asyncrl.cli import main
from asyncrl.config import ConfigError, RunConfig, config_keys, dump_config, load_config
from asyncrl.config.base import section_model
from asyncrl.run_sampler import build_run_sampler


def error_of(overrides=(), path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_defaults_are_valid_and_round_trip(tmp_path):
    config = load_config()
    assert config.sampler.name == "in_order"
    path = tmp_path / "run.yaml"
    path.write_text(dump_config(config))
    assert load_config(path) == config


def test_yaml_then_overrides_with_typed_values(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("step:\n  prompts_per_step: 4\ntrainer:\n  aggregation: seq-mean-token-sum\n")
    config = load_config(
        path, ["trainer.aggregation=token-mean", "trainer.lr=3e-4", "algorithm.options.dual_clip=null"]
    )
    assert config.step.prompts_per_step == 4
    assert config.trainer.aggregation == "token-mean"
    assert config.trainer.lr == pytest.approx(3e-4)
    assert config.algorithm.options == {"dual_clip": None}


def capacity_error(overrides) -> str:
    with pytest.raises(ValueError) as info:
        build_run_sampler(load_config(None, overrides))
    return str(info.value)


def test_gated_sampler_capacity_below_requirement_is_rejected():
    message = capacity_error(["step.prompts_per_step=4", "sampler.max_lag=2", "sampler.buffer_capacity=11"])
    assert message.startswith("sampler.buffer_capacity: 11 < 12")
    assert "deadlock" in message
    assert (
        build_run_sampler(
            load_config(None, ["step.prompts_per_step=4", "sampler.max_lag=2", "sampler.buffer_capacity=12"])
        )[1]
        == 12
    )


def test_weight_fifo_is_gated_too():
    message = capacity_error(
        ["sampler.name=weight_fifo", "step.prompts_per_step=3", "sampler.max_lag=1", "sampler.buffer_capacity=5"]
    )
    assert message.startswith("sampler.buffer_capacity: 5 < 6")


def test_windowed_sampler_needs_only_one_step_of_capacity():
    config = load_config(
        None, ["sampler.name=windowed", "step.prompts_per_step=4", "sampler.max_lag=3", "sampler.buffer_capacity=4"]
    )
    assert build_run_sampler(config)[1] == 4
    assert capacity_error(["sampler.name=windowed", "step.prompts_per_step=4", "sampler.buffer_capacity=3"]).startswith(
        "sampler.buffer_capacity: 3 < 4"
    )


def test_default_capacity_is_the_sampler_requirement_plus_refills():
    config = load_config(None, ["step.prompts_per_step=5", "sampler.max_lag=2"])
    assert build_run_sampler(config)[1] == 15
    refill = [
        "step.prompts_per_step=5",
        "sampler.max_lag=2",
        "step.filter_zero_variance=true",
        "step.max_refill_groups=3",
    ]
    assert build_run_sampler(load_config(None, refill))[1] == 18


def test_loading_a_config_checks_the_sampler_name_without_building_it(monkeypatch):
    import asyncrl.control.sampler as samplers

    def never(*args, **kwargs):
        raise AssertionError("the config built a sampler")

    monkeypatch.setattr(samplers, "build_sampler", never)
    monkeypatch.setattr(samplers, "resolve_sampler", never)
    load_config(None, ["sampler.name=my_module:Sampler", "sampler.options={any: 1}"])
    assert error_of(["sampler.name=fifo"]).startswith("sampler.name: unknown sampler 'fifo'")


def test_step_batch_size_must_equal_prompts_times_generations():
    message = error_of(["step.prompts_per_step=4", "step.generations_per_prompt=8", "step.step_batch_size=30"])
    assert message.startswith("step.step_batch_size: 30 != prompts_per_step * generations_per_prompt")
    assert load_config(None, ["step.prompts_per_step=4", "step.generations_per_prompt=8", "step.step_batch_size=32"])


def test_unknown_key_in_yaml_suggests_the_closest(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  aggregatoin: token-mean\n")
    assert error_of(path=path) == "trainer.aggregatoin: unknown key (did you mean 'trainer.aggregation'?)"


def test_unknown_section_and_override_suggest_the_closest():
    assert error_of(["trainr.lr=1"]) == "trainr: unknown key (did you mean 'trainer'?)"
    assert error_of(["trainer.lrr=1"]) == "trainer.lrr: unknown key (did you mean 'trainer.lr'?)"


def test_unknown_key_without_a_close_match_lists_valid_keys():
    message = error_of(["runtime.zzzz=1"])
    assert message.startswith("runtime.zzzz: unknown key (valid keys: name, max_inflight_groups")


def test_wrong_type_names_the_field_and_value():
    message = error_of(["trainer.lr=fast"])
    assert message.startswith("trainer.lr: ")
    assert "'fast'" in message


def test_out_of_range_value_names_the_field():
    assert error_of(["trainer.lr=-1"]).startswith("trainer.lr: Input should be greater than 0")
    assert error_of(["step.prompts_per_step=0"]).startswith("step.prompts_per_step: ")
    assert error_of(["generation.top_p=1.5"]).startswith("generation.top_p: ")


def test_mode_constant_and_other_cross_field_rules():
    assert error_of(["trainer.aggregation=seq-mean-token-sum-norm"]).startswith("trainer.norm_constant: required")
    assert error_of(["model.hidden_size=100", "model.num_heads=3"]).startswith("model.num_heads: ")
    assert error_of(["rewards.weights=[1.0, 2.0]"]).startswith("rewards.weights: 2 weights for 1 functions")
    assert error_of(["step.min_groups_per_chunk=17"]).startswith("step.min_groups_per_chunk: 17 > prompts_per_step 16")


def test_unknown_sampler_names_the_field():
    assert error_of(["sampler.name=fifo"]).startswith("sampler.name: ")


def test_bad_override_syntax_and_files(tmp_path):
    assert error_of(["trainer.aggregation"]).startswith("override 'trainer.aggregation': expected key=value")
    assert error_of(["trainer.aggregation.x=1"]) == "trainer.aggregation: is a value, not a section"
    assert error_of(path=tmp_path / "missing.yaml").startswith("--config: no such file")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [unclosed\n")
    assert "invalid YAML" in error_of(path=bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    assert error_of(path=listing).endswith("must hold a mapping of sections, got list")


def test_every_section_rejects_unknown_keys():
    for section in RunConfig.model_fields:
        if section == "seed":
            continue
        assert error_of([f"{section}.not_a_field=1"]).startswith(f"{section}.not_a_field: unknown key")


def test_cli_config_error_is_one_line_with_exit_code_2(capsys):
    assert main(["config", "trainer.lrr=1"]) == 2
    err = capsys.readouterr().err
    assert err == "error: trainer.lrr: unknown key (did you mean 'trainer.lr'?)\n"


def test_cli_usage_error_is_one_line_with_exit_code_2(capsys):
    assert main(["verify", "--micro-batchs", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: No such option: --micro-batchs")
    assert "\n" not in err
    assert main(["verify", "--dtype", "float16"]) == 2
    assert "--dtype" in capsys.readouterr().err


def test_cli_prints_the_resolved_config(capsys):
    assert main(["config", "step.prompts_per_step=3"]) == 0
    assert "prompts_per_step: 3" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--config", str(ROOT / "configs" / "tool-use.yaml")],
        ["generation.backend.name=vllm", "data.task.options.difficulty=3"],
        ["rewards.functions=[exact_match,format,overlong]", "rewards.options.overlong.cache=4"],
    ],
)
def test_the_printed_config_holds_each_parts_options_with_their_defaults_and_loads_back(capsys, tmp_path, args):
    assert main(["config", *args]) == 0
    printed = capsys.readouterr().out
    parts = yaml.safe_load(printed)
    assert parts["algorithm"]["options"]["clip_low"] == 0.2  # grpo's defaults, written once in GRPOOptions
    assert parts["data"]["task"]["options"]["seed"] == 0  # a default of every built-in generated task
    if "generation.backend.name=vllm" in args:
        assert parts["data"]["task"]["options"]["difficulty"] == 3  # a given option is kept
        assert parts["generation"]["backend"]["options"]["gpu_memory_utilization"] == 0.5
    if parts["environment"]["name"] is not None:
        assert parts["environment"]["options"]["max_tool_calls"] == 2  # given in tool-use.yaml
        assert parts["environment"]["options"]["parser"] == "hermes"  # its default
    if "overlong" in parts["rewards"]["functions"]:
        assert parts["rewards"]["options"] == {"format": {"pattern": None}, "overlong": {"cache": 4}}
    (tmp_path / "printed.yaml").write_text(printed)
    assert main(["config", "--config", str(tmp_path / "printed.yaml")]) == 0
    assert capsys.readouterr().out == printed  # the defaults written out mean what they meant


def test_installed_script_reports_errors_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "config", "sampler.buffer_capacity=1"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: sampler.buffer_capacity: 1 < 32")


def test_every_key_is_documented_and_the_reference_is_current():
    from asyncrl.config import config_reference

    for name, field in RunConfig.model_fields.items():
        section = field.annotation
        keys = section.model_fields.items() if hasattr(section, "model_fields") else [(name, field)]
        assert section.__doc__ or name == "seed", name
        for key, sub in keys:
            assert sub.description, f"{name}.{key} has no description"
    from asyncrl.plugins import builtin_options

    reference = config_reference(builtin_options())
    assert "| `max_lag` | int >= 0 | `1` |" in reference
    assert "### `algorithm.options` of `grpo`" in reference and "| `clip_high` | float >= 0 | `0.28` |" in reference
    committed = ROOT / "docs" / "configuration.md"
    assert committed.read_text() == reference, "regenerate with: asyncrl config --reference > docs/configuration.md"


FROZEN_KEYS = ROOT / "tests" / "data" / "config_keys.json"
REGENERATE_KEYS = (
    'python -c "import json; from asyncrl.config import config_keys; from asyncrl.plugins import builtin_options; '
    'print(json.dumps(config_keys(builtin_options()), indent=1))" > tests/data/config_keys.json'
)


def test_every_key_its_type_and_default_are_frozen():
    """A renamed or removed key breaks users' configs, and a new default changes their runs: each
    is a deliberate act, made by regenerating the frozen file in the same commit. The built-in
    parts' options are frozen too."""
    from asyncrl.plugins import builtin_options

    frozen, current = json.loads(FROZEN_KEYS.read_text()), config_keys(builtin_options())
    changed = [
        f"{key}: {frozen.get(key, 'absent')} -> {current.get(key, 'absent')}"
        for key in sorted(frozen.keys() | current.keys())
        if frozen.get(key) != current.get(key)
    ]
    assert not changed, (
        "config keys changed against tests/data/config_keys.json:\n"
        + "\n".join(changed)
        + f"\nif deliberate, regenerate it with: {REGENERATE_KEYS}"
    )
    assert current["seed"] == {"type": "int", "default": 0} and current["model.arch"]["type"] == "qwen2 | llama"
    assert current["algorithm.options[grpo].clip_low"] == {"type": "float", "default": 0.2}


def test_loading_a_config_stays_light():
    code = (
        "import sys; from asyncrl.cli import main; from asyncrl.config import load_config; load_config(None, []);"
        "heavy = [m for m in ('torch', 'transformers', 'ray', 'datasets') if m in sys.modules]; print(heavy)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


def test_override_into_a_section_that_yaml_set_to_a_value_is_one_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer: 5\n")
    assert error_of(["trainer.aggregation=token-mean"], path=path) == "trainer: expected a section (a mapping), got 5"
    assert error_of(path=path).startswith("trainer: ")


def test_a_dotted_override_reaches_into_a_parts_options_keeping_the_files_other_options():
    config = load_config(
        ROOT / "configs" / "tool-use.yaml",
        ["environment.options.latency_median_s=0.05", "environment.options.parser_options={}"],
    )
    assert config.environment.options == {"max_tool_calls": 2, "latency_median_s": 0.05, "parser_options": {}}
    from asyncrl.parts import check_parts

    named = load_config(None, ["environment.name=calculator", "environment.options.parser_options.strict=true"])
    with pytest.raises(ValueError) as err:  # the config checks the name; the options, where parts are checked
        check_parts(named)
    assert str(err.value) == "environment.options.parser_options.strict: unknown option; 'hermes' takes no options"
    assert load_config(None, ["sampler.options.window=4"]).sampler.options == {"window": 4}
    assert error_of(["environment.options={a: 1}", "environment.options.a.b=2"]) == (
        "environment.options.a: expected a mapping, got 1"
    )


def test_shipped_configs_load_and_the_default_one_is_the_embedded_default():
    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert {p.name for p in configs} >= {"default.yaml", "sync.yaml", "gpu-hf.yaml"}
    for path in configs:
        load_config(path)
    assert load_config(ROOT / "configs" / "default.yaml") == RunConfig()
    assert load_config(ROOT / "configs" / "sync.yaml").sampler.max_lag == 0


def test_minibatch_rules():
    assert error_of(["step.prompts_per_step=2", "step.num_minibatches=3"]).startswith(
        "step.num_minibatches: 3 > prompts_per_step 2"
    )


# --- every number has a range


BOUNDS = ("ge", "gt", "le", "lt")
CHECKED_ELSEWHERE = {"trainer.betas": "[1.5, 0.9]"}  # a tuple of two, each in [0, 1): the section's own check
ANY_NUMBER = {"rewards.weights"}  # a negative weight subtracts its reward


def _numbers(annotation) -> bool:
    if get_origin(annotation) is Annotated:
        return _numbers(get_args(annotation)[0])
    return annotation in (int, float) or any(_numbers(a) for a in get_args(annotation))


def _bounds(field) -> list[tuple[str, float]]:
    """A field's bounds, those of its list items or of its union's number included."""
    inner = [get_args(a)[1].metadata for a in get_args(field.annotation) if get_origin(a) is Annotated]
    found = [*field.metadata, *(m for metadata in inner for m in metadata)]
    return [(key, getattr(m, key)) for m in found for key in BOUNDS if hasattr(m, key)]


def _numbers_of(model, prefix: str = "") -> list[tuple[str, object]]:
    """(dotted key, field) of every number in ``model``, but those its own checks bound."""
    found = []
    for key, field in model.model_fields.items():
        dotted, nested = f"{prefix}{key}", section_model(field.annotation)
        if nested is not None:
            found += _numbers_of(nested, f"{dotted}.")
        elif _numbers(field.annotation) and dotted not in ANY_NUMBER and dotted not in CHECKED_ELSEWHERE:
            found.append((dotted, field))
    return found


def out_of_range(model) -> list[tuple[str, str, str]]:
    """(dotted key, an out-of-range value as YAML, the key its error names) for each bound of each
    number in ``model``."""
    cases = [(key, value, key) for key, value in CHECKED_ELSEWHERE.items() if model is RunConfig]
    for dotted, field in _numbers_of(model):
        listed = get_origin(field.annotation) is list
        for bound, limit in _bounds(field):
            value = {"ge": limit - 1, "gt": limit, "le": limit + 1, "lt": limit}[bound]
            cases.append((dotted, f"[{value}]" if listed else str(value), f"{dotted}.0" if listed else dotted))
    return cases


def test_every_number_has_a_range():
    from asyncrl.plugins import builtin_options

    models = [("", RunConfig)] + [(f"{where}[{name}].", model) for where, name, model in builtin_options()]
    unbounded = [prefix + key for prefix, model in models for key, field in _numbers_of(model) if not _bounds(field)]
    assert unbounded == []


@pytest.mark.parametrize(("key", "value", "named"), out_of_range(RunConfig))
def test_every_number_out_of_its_range_is_one_line_naming_its_key(key, value, named):
    assert error_of([f"{key}={value}"]).startswith(f"{named}: ")


def test_every_option_of_a_built_in_part_out_of_its_range_is_one_line_naming_its_key():
    from asyncrl.plugins import builtin_options, checked_options

    required = {"dataset": "leg_counting", "cache": 1}  # the options without a default
    checked = 0
    for where, name, model in builtin_options():
        cases = out_of_range(model)
        given = {key: required[key] for key, field in model.model_fields.items() if cases and field.is_required()}
        for key, value, named in cases:
            options = {**given, key: yaml.safe_load(value)}
            with pytest.raises(ValueError) as err:
                checked_options(SimpleNamespace(Options=model), name, options, where)
            assert str(err.value).startswith(f"{where}.{named}: ") and "\n" not in str(err.value), (where, key)
            checked += 1
    assert checked > 30


def test_a_union_of_a_number_and_a_word_names_both_and_null_is_one_line():
    assert error_of(["trainer.logprob_chunk_tokens=0"]) == (
        "trainer.logprob_chunk_tokens: Input should be greater than or equal to 1 or 'auto' (got 0)"
    )
    assert error_of(["trainer.logprob_chunk_tokens="]) == (
        "trainer.logprob_chunk_tokens: cannot be null (an empty value is null); give a value, e.g. the default auto"
    )
    assert (
        error_of(["trainer.logprob_chunk_tokens=true"]) == "trainer.logprob_chunk_tokens: expected a number, got true"
    )
    assert load_config(None, ["trainer.logprob_chunk_tokens=1"]).trainer.logprob_chunk_tokens == 1
    assert error_of(["seed=9223372036854775808"]).startswith("seed: Input should be less than 9223372036854775808")


def test_the_reference_gives_each_numbers_range():
    from asyncrl.config import config_reference

    reference = config_reference()
    assert "| `logprob_chunk_tokens` | int >= 1 or auto | `auto` |" in reference
    assert (
        "| `top_p` | float in (0, 1] | `1.0` |" in reference and "| `generate_errors` | list[int >= 0] |" in reference
    )
    assert "- `seed` (int in [0, 2**63), default `0`)" in reference
