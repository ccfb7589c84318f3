"""TRL's GRPOTrainer on an asyncrl run's model, prompts and rewards: the peer baseline of
``asyncrl bench e2e --against trl``.

Only the trainer differs. Shared with asyncrl: the warm-started initial weights (asyncrl's own
warm start and its cache), the train prompts in the order asyncrl's PromptLoader gives them, the
reward functions (one RewardRunner, weights applied), and held-out accuracy and mean reward,
measured by asyncrl's ``RolloutWorker.evaluate`` (greedy, on a generator that takes the TRL
policy's weights at every evaluation). With an ``environment`` in the config, TRL runs the
environment's tool episodes itself (asyncrl/bench/trl_environment.py). Torch uses as many
threads per op as asyncrl's local runtime: ``runtime.torch_threads``, else half the cores.
Evaluations are timed and subtracted from the training time, as for asyncrl.

``trl_settings`` maps every setting the two share. Not matched (a run lists those that apply to
its config under "unmatched"):

- sampling seeds: TRL draws from the global RNG; asyncrl seeds each sample from (run seed, prompt, index);
- batching: TRL generates a step's completions in one call and trains them in one forward/backward
  (gradient accumulation 1 keeps one optimizer step per generation batch), whatever
  ``generation.batch_size`` and ``trainer.micro_batch_size`` say;
- advantages: TRL divides by std + 1e-4, asyncrl by std + 1e-6; TRL has no leave-one-out baseline
  and no filter for zero-variance groups;
- warmup: TRL's ramps from 0 (lr * s / w), asyncrl's from lr / (w + 1);
- ``seq-mean-token-sum-norm``: TRL's dr_grpo divides by max_completion_length, so only C = max_new_tokens matches;
- off-policy correction: TRL without vLLM trains on-policy and has no tis / icepop weights;
- the KL clamps, the entropy bonus outside token-mean (TRL's is always a token mean), a dual clip
  at or below 1 + clip_high, and a temperature other than 1 (TRL trains on temperature-scaled
  logprobs, asyncrl on the model's own);
- ``sampler.max_lag`` above 0: TRL is synchronous;
- with ``lora.rank`` above 0 both train the same adapters (peft's LoraConfig of the ``lora``
  section), but TRL draws their A matrices from the global RNG, asyncrl from a seed of its own.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import PreTrainedTokenizerFast, TrainerCallback

from asyncrl.algorithms import build_algorithm
from asyncrl.algorithms.grpo import GRPO
from asyncrl.bench import trl_environment
from asyncrl.config import ConfigError, RunConfig
from asyncrl.data import PromptLoader, build_task
from asyncrl.environments.tool_env import close_toolboxes
from asyncrl.generation import build_generator
from asyncrl.models.factory import build_model, build_tokenizer, resolve_device
from asyncrl.models.lora import adapter_tensors, is_lora, peft_config
from asyncrl.parts import build_run_parts
from asyncrl.rewards import RewardRunner
from asyncrl.rollout import RolloutWorker
from asyncrl.run import local_torch_threads
from asyncrl.warm_start import warm_start_policy
from asyncrl.workers import generator_request_bound, rollout_worker

# token-mean is DAPO's global token mean. TRL's "luspo" sums each sequence's token losses and
# averages over sequences, which is seq-mean-token-sum as long as ratios stay per token.
LOSS_TYPES = {
    "token-mean": "dapo",
    "seq-mean-token-mean": "grpo",
    "seq-mean-token-sum": "luspo",
    "seq-mean-token-sum-norm": "dr_grpo",
}


def trl_settings(config: RunConfig) -> dict[str, Any]:
    """``{"kwargs": GRPOConfig keyword arguments, "unmatched": {setting: why}}`` for ``config``."""
    return {"kwargs": _grpo_kwargs(config), "unmatched": _unmatched(config)}


def _grpo(config: RunConfig) -> GRPO:
    """The run's algorithm, which must be GRPO: the one TRL implements."""
    try:
        algorithm = build_algorithm(config)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if not isinstance(algorithm, GRPO):
        raise ConfigError(f"--against trl: algorithm.name '{config.algorithm.name}' is not grpo, the one TRL runs")
    return algorithm


def _grpo_kwargs(config: RunConfig) -> dict[str, Any]:
    """The GRPOConfig keyword arguments of every setting the two share."""
    step, loss, trainer, generation = config.step, _grpo(config).options, config.trainer, config.generation
    cosine = trainer.lr_schedule == "cosine"
    episodes = (
        {"max_completion_length": config.environment.max_tokens}
        | {"max_tool_calling_iterations": config.environment.max_turns - 1}
        if config.environment.name is not None
        else {}
    )
    return {
        "num_generations": step.generations_per_prompt,
        "per_device_train_batch_size": step.prompts_per_step * step.generations_per_prompt,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 1,
        "num_iterations": 1,
        "max_completion_length": generation.max_new_tokens,
        "temperature": generation.temperature,
        "top_p": generation.top_p,
        "top_k": generation.top_k,
        "scale_rewards": "group" if loss.scale_by_std else "none",
        "loss_type": LOSS_TYPES[trainer.aggregation],
        "epsilon": loss.clip_low,
        "epsilon_high": loss.clip_high,
        "delta": loss.dual_clip,
        "beta": loss.kl_coef,
        "use_bias_correction_kl": False,  # asyncrl's k3 carries no importance weight
        "entropy_coef": loss.entropy_coef,
        "optim": "adamw_torch",
        "learning_rate": trainer.lr,
        "adam_beta1": trainer.betas[0],
        "adam_beta2": trainer.betas[1],
        "adam_epsilon": trainer.eps,
        "weight_decay": trainer.weight_decay,
        "max_grad_norm": trainer.max_grad_norm or 0.0,  # 0 disables clipping in the HF Trainer
        "warmup_steps": trainer.warmup_steps,
        "lr_scheduler_type": "cosine_with_min_lr" if cosine else "constant_with_warmup",
        "lr_scheduler_kwargs": {"min_lr_rate": trainer.min_lr_ratio} if cosine else {},
        "use_cpu": resolve_device(trainer.device).type == "cpu",
        "bf16": False,
        "activation_checkpointing": False,
        **episodes,
    }


def _unmatched(config: RunConfig) -> dict[str, str]:
    """{setting: why TRL cannot match it}, for those that apply to ``config``."""
    grpo = _grpo(config)
    loss, trainer, generation = grpo.options, config.trainer, config.generation
    unmatched = {
        "sampling seeds": "TRL samples from the global RNG, asyncrl seeds each sample from (run seed, prompt, index)",
        "generation.batch_size": "TRL generates all of a step's completions in one call",
        "trainer.micro_batch_size": "TRL trains a step's completions in one forward/backward",
        "advantage epsilon": "TRL divides advantages by std + 1e-4, asyncrl by std + 1e-6",
    }
    if loss.baseline != "mean":
        unmatched["algorithm.options.baseline"] = f"{loss.baseline}: TRL's GRPO baseline is the group mean"
    if config.step.filter_zero_variance:
        unmatched["step.filter_zero_variance"] = "TRL keeps zero-variance groups (advantage 0, counted in the loss)"
    if trainer.warmup_steps:
        unmatched["trainer.warmup_steps"] = "TRL's warmup ramps lr * s / w from 0, asyncrl's lr * (s + 1) / (w + 1)"
    if trainer.aggregation == "seq-mean-token-sum-norm" and trainer.norm_constant != generation.max_new_tokens:
        unmatched["trainer.norm_constant"] = (
            f"TRL's dr_grpo divides by max_completion_length {generation.max_new_tokens}, not {trainer.norm_constant}"
        )
    if grpo.importance_sampling != "none":
        unmatched["algorithm.options.importance_sampling"] = (
            f"{grpo.importance_sampling}: TRL without vLLM trains on-policy"
        )
    if loss.kl_coef > 0:
        unmatched["algorithm.options.kl_clamp"] = "TRL does not clamp the KL input or output"
    if loss.entropy_coef > 0 and trainer.aggregation != "token-mean":
        unmatched["algorithm.options.entropy_coef"] = (
            "TRL's entropy bonus is a token mean whatever the loss aggregation"
        )
    if loss.dual_clip is not None and loss.dual_clip <= 1 + loss.clip_high:
        unmatched["algorithm.options.dual_clip"] = "TRL's delta equals a dual clip only above 1 + clip_high"
    if generation.temperature != 1.0:
        unmatched["generation.temperature"] = "TRL trains on temperature-scaled logprobs, asyncrl on the model's own"
    if config.sampler.max_lag > 0:
        unmatched["sampler.max_lag"] = "TRL is synchronous"
    if config.environment.name is not None:
        unmatched.update(trl_environment.UNMATCHED)
    if config.lora.rank > 0:
        unmatched["lora initialization"] = (
            "TRL draws the adapters' A matrices from the global RNG, asyncrl from its seed"
        )
    return unmatched


def require_trl() -> None:
    """Fail in one line, before any run, when the optional TRL extra is missing."""
    if importlib.util.find_spec("trl") is None:
        raise ConfigError('--against trl: TRL is not installed; run pip install -e ".[bench]"')


def refuse_trl_async() -> None:
    """TRL's asynchronous trainer is no baseline: it needs CUDA GPUs end to end (docs/performance.md)."""
    raise ConfigError(
        "--against trl-async: TRL's AsyncGRPOTrainer needs CUDA GPUs (it generates on a vLLM server, sends it "
        "weights over NCCL and trains with a FlashAttention-3 kernel) and fails to construct on a CPU build of "
        "torch, so it is not a baseline; see docs/performance.md"
    )


def run_trl(config: RunConfig, *, seed: int, max_steps: int, eval_every_steps: int, output_dir: Path) -> dict[str, Any]:
    """Train with TRL; the evals (with training time that excludes evaluation) and wall time, as
    ``asyncrl.bench.e2e.run_asyncrl`` reports them, plus the unmatched settings."""
    start = time.perf_counter()
    require_trl()
    torch.manual_seed(seed)
    torch.set_num_threads(local_torch_threads(config))
    transformers.utils.logging.disable_progress_bar()
    tokenizer = build_tokenizer(config)
    model = build_model(config, tokenizer)
    task = build_task(config.data, tokenizer)
    parts = build_run_parts(config)
    warm_start_policy(
        model, tokenizer, config, parts.environment, prompts=task.train
    )  # the weights asyncrl's runs start from

    loader = PromptLoader(task.train, shuffle_seed=config.data.shuffle_seed, epochs=config.data.epochs)
    prompts = list(itertools.islice(iter(loader.next, None), max_steps * config.step.prompts_per_step))
    settings = trl_settings(config)
    rewards = RewardRunner.from_config(config.rewards, task)
    with tempfile.TemporaryDirectory(prefix="asyncrl-trl-init-") as init_dir:
        # TRL builds the policy (and a KL reference) from a path, saved before the generator takes
        # the model: with lora.rank > 0 the generator puts its adapter slot into it in place.
        model.save_pretrained(init_dir)
        tokenizer.save_pretrained(init_dir)
        bound = generator_request_bound(config, task, parts.environment, tokenizer)
        generator = build_generator(config, model, tokenizer, request_bound=bound)
        evaluator = Evaluator(
            rollout_worker(config.model_copy(update={"seed": seed}), parts, generator, rewards, tokenizer),
            list(task.heldout[: config.data.eval_size]),
            every=eval_every_steps,
            samples_per_step=config.step.prompts_per_step * config.step.generations_per_prompt,
        )
        args = _grpo_config(
            config, settings, seed=seed, steps=len(prompts) // config.step.prompts_per_step, output_dir=output_dir
        )
        try:
            _train(config, Path(init_dir), prompts, rewards, evaluator, args)
        finally:
            evaluator.worker.close()
            rewards.close()
            close_toolboxes()  # TRL calls tools on this thread, whose tool processes would outlive the run
    return {
        "evals": evaluator.evals,
        "wall_s": time.perf_counter() - start,
        "torch_threads": evaluator.torch_threads,
        "reward_errors": sum(count.errors for count in rewards.counts.values()),
        "unmatched": settings["unmatched"],
    }


def _grpo_config(config: RunConfig, settings: dict[str, Any], *, seed: int, steps: int, output_dir: Path) -> Any:
    """TRL's GRPOConfig: the shared settings, ``steps`` steps over the prompts in the order given, no
    logging or saving of its own."""
    from trl import GRPOConfig

    return GRPOConfig(
        **settings["kwargs"],
        output_dir=str(output_dir),
        seed=seed,
        max_steps=steps,
        shuffle_dataset=False,  # the dataset is already in PromptLoader order
        model_init_kwargs={"dtype": "auto"},  # the saved dtype, which is trainer.dtype
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )


def _train(
    config: RunConfig,
    init_dir: Path,
    prompts: list,
    rewards: RewardRunner,
    evaluator: Evaluator,
    args: Any,
) -> None:
    """TRL's GRPOTrainer from the weights saved in ``init_dir`` on ``prompts`` (the environment's episodes, if the
    config has one), scored by asyncrl's rewards."""
    from datasets import Dataset
    from trl import GRPOTrainer

    # The dataset carries uids, not answers: a task's checker may need the answer object itself
    # (a reasoning-gym entry), which a dataset column would flatten to its text.
    answers = {p.uid: p.answer for p in prompts}
    episodes = config.environment.name is not None
    texts = trl_environment.episode_prompts(config, prompts) if episodes else [p.text for p in prompts]
    dataset = Dataset.from_list([{"prompt": text, "uid": p.uid} for text, p in zip(texts, prompts)])
    environment = {"environment_factory": trl_environment.trl_environment(config)} if episodes else {}
    adapters = {"peft_config": peft_config(config.lora)} if config.lora.rank > 0 else {}

    def asyncrl_rewards(completions: list, uid: list[str], **_: Any) -> list[float]:
        texts = [trl_environment.answer_text(c) for c in completions] if episodes else completions
        return rewards.score(texts, [answers[u] for u in uid]).rewards

    # The tokenizer is reloaded as the fast class, since AutoTokenizer would pick one that drops spaces.
    trl_tokenizer = PreTrainedTokenizerFast.from_pretrained(init_dir)
    trl_environment.use_response_template(trl_tokenizer)
    # TRL prints its logs; stdout belongs to the benchmark's JSON.
    with contextlib.redirect_stdout(sys.stderr):
        trainer = GRPOTrainer(
            model=str(init_dir),
            reward_funcs=asyncrl_rewards,
            args=args,
            train_dataset=dataset,
            processing_class=trl_tokenizer,
            callbacks=[evaluator],
            **environment,
            **adapters,
        )
        trainer.train()


class Evaluator(TrainerCallback):
    """Held-out accuracy at step 0, every ``every`` steps and at the end, each evaluation timed
    so that ``train_wall_s`` leaves it out."""

    def __init__(self, worker: RolloutWorker, prompts: list, *, every: int, samples_per_step: int) -> None:
        self.worker = worker
        self.prompts = prompts
        self.every = every
        self.samples_per_step = samples_per_step
        self.evals: list[dict[str, Any]] = []
        self.eval_s = 0.0
        self.start = 0.0
        self.torch_threads = 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.torch_threads = torch.get_num_threads()
        self.evaluate(model, 0)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            self.evaluate(model, state.global_step)

    def evaluate(self, model: torch.nn.Module, step: int) -> None:
        begin = time.perf_counter()
        if not self.evals:
            self.start = begin  # the clock starts with the first evaluation, as asyncrl's controller does
        # A LoRA run's generator holds one adapter slot: it takes the adapter's tensors alone.
        self.worker.load_weights(adapter_tensors(model) if is_lora(model) else model.state_dict(), step)
        result = self.worker.evaluate(self.prompts)
        end = time.perf_counter()
        self.eval_s += end - begin
        wall = end - self.start
        self.evals.append(
            {
                "step": step,
                "samples": step * self.samples_per_step,
                "wall_s": wall,
                "train_wall_s": wall - self.eval_s,
                "accuracy": result.accuracy,
                "reward_mean": result.reward_mean,
            }
        )
