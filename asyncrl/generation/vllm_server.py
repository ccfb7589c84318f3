"""Runs inside the vLLM environment: registers asyncrl's weight-transfer engines, then serves.

Started by the vLLM venv's interpreter as a script (``python vllm_server.py <api_server args>``),
so it imports only vLLM, torch, safetensors and the standard library, never asyncrl's own
environment (the collective engine's group code, ``weights/broadcast.py``, is loaded by path:
it needs only torch). The registration runs at import: the engine-core process, forked or spawned from
this one, finds it in vLLM's registry too. The server leads its own process group and ends it
when the process that started it is gone (``exit_with_parent``).

Two engines, chosen at start by ``--weight-transfer-config``. "asyncrl_file": the trainer writes
its state dict to a safetensors file (in /dev/shm when there is one) and sends its path with
``update_weights``. "asyncrl_collective": ``init_weight_transfer_engine`` joins the worker to a
process group of two with the trainer's side (``BroadcastMember``: gloo on CPU, NCCL on GPU), and
``update_weights`` carries the names, dtypes and shapes of the tensors the trainer then broadcasts
as one flat buffer per dtype; it takes a file too, so a client outside the group can still load.
vLLM's built-in engines (nccl, ipc) need CUDA. A weight update must redo the
weight post-processing that loading did: on CPU, linear weights are repacked for oneDNN and the
original parameter emptied, so the update runs vLLM's layerwise reload around ``load_weights``.
A tied ``lm_head`` shares the embedding's parameter but keeps its own packed copy, which the
reload does not revisit (it processes a tied parameter through one parent only), so every
output head is repacked afterwards, or logits would stay on the old weights.

After each load the engine keeps the fingerprint sample (``weights/fingerprint.py``, also loaded by
path) of the tensors it loaded, in the dtype the model holds them in; the client asks for it with
``/collective_rpc`` (``asyncrl_served_weights``, a method added to vLLM's workers here) to prove
which weights the server serves. vLLM fuses and repacks its parameters, so the checkpoint-named
tensors cannot be read back from them.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
from vllm.v1.worker.worker_base import WorkerBase

REMOVE_ON_EXIT = "ASYNCRL_VLLM_REMOVE_ON_EXIT"  # paths, os.pathsep-separated


def load_weights_module(name: str):
    """asyncrl's ``weights/<name>.py`` as a module of its own (asyncrl itself is not installed here)."""
    spec = importlib.util.spec_from_file_location(
        f"asyncrl_{name}", Path(__file__).resolve().parents[1] / "weights" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


broadcast = load_weights_module("broadcast")
fingerprint = load_weights_module("fingerprint")


@dataclass
class FileInitInfo(WeightTransferInitInfo):
    """Nothing to connect: every update names its own file."""


@dataclass
class FileUpdateInfo(WeightTransferUpdateInfo):
    path: str  # a safetensors file holding every weight, named as in the HF checkpoint


@dataclass
class CollectiveInitInfo(WeightTransferInitInfo):
    """Where the trainer's side hosts the group's store (it is rank 0, the worker rank 1); no
    host: a client that sends files."""

    host: str | None = None
    port: int = 0
    backend: str = "gloo"  # or "nccl"
    timeout_s: float = 600.0


@dataclass
class CollectiveUpdateInfo(WeightTransferUpdateInfo):
    """The tensors of one broadcast in its order (``Layout.meta``); or, with ``path``, a file."""

    names: list[str] | None = None
    dtype_names: list[str] | None = None
    shapes: list[list[int]] | None = None
    path: str | None = None


class FileWeightTransferEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        """Nothing to set up; the call exists so a client checks the engine is registered."""

    served = None  # the sample of the last weights loaded, with the dtype the model holds them in

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        self.load(load_file(update_info.path))

    def load(self, weights: dict) -> None:
        """Load ``weights`` into the model, then keep their fingerprint sample (``served_weights``)."""
        self.model.load_weights(weights.items())
        dtype = fingerprint.dtype_name(self.model_config.dtype)
        self.served = {"dtype": dtype, "sample": fingerprint.sample(weights).to_json()}

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)
        for module in self.model.modules():
            if isinstance(module, ParallelLMHead):
                module.quant_method.process_weights_after_loading(module)

    def shutdown(self) -> None:
        """No connection to release."""


class CollectiveWeightTransferEngine(FileWeightTransferEngine):
    """The file engine's reload around a broadcast from the trainer's side."""

    init_info_cls = CollectiveInitInfo
    update_info_cls = CollectiveUpdateInfo
    member = None

    def init_transfer_engine(self, init_info: CollectiveInitInfo) -> None:
        """Join a new group, replacing the one before (its client reconnects after a failed update);
        a client that sends files leaves it alone."""
        if init_info.host is None:
            return
        self.shutdown()
        rendezvous = broadcast.Rendezvous(init_info.host, init_info.port, 2, init_info.backend, init_info.timeout_s)
        self.member = broadcast.BroadcastMember(rendezvous, rank=1)

    def receive_weights(self, update_info: CollectiveUpdateInfo) -> None:
        if update_info.path is not None:
            super().receive_weights(update_info)
        elif self.member is None:
            raise RuntimeError("asyncrl_collective: update_weights before init_weight_transfer_engine")
        else:
            layout = broadcast.Layout.describe(zip(update_info.names, update_info.dtype_names, update_info.shapes))
            self.load(self.member.receive(layout))

    def shutdown(self) -> None:
        if self.member is not None:
            self.member.group.abort()
            self.member = None


WeightTransferEngineFactory.register_engine("asyncrl_file", FileWeightTransferEngine)
WeightTransferEngineFactory.register_engine("asyncrl_collective", CollectiveWeightTransferEngine)


def served_weights(worker) -> dict:
    """The fingerprint sample of what the worker's model loaded last, for the client's
    ``/collective_rpc`` with ``method`` ``asyncrl_served_weights``: the last update's, else the
    checkpoint the server started from (the files in its model directory)."""
    engine = getattr(worker, "weight_transfer_engine", None)
    if getattr(engine, "served", None) is not None:
        return engine.served
    config = worker.model_config
    weights = {}
    for path in sorted(Path(config.model).glob("*.safetensors")):
        weights.update(load_file(str(path)))
    return {"dtype": fingerprint.dtype_name(config.dtype), "sample": fingerprint.sample(weights).to_json()}


WorkerBase.asyncrl_served_weights = served_weights


def exit_with_parent(remove: list[str]) -> None:
    """Kill the server's whole process group (it leads its own) once this process's parent is gone,
    after removing ``remove``. Every process of the server watches its own parent (the engine and
    worker processes start watching when forked or spawned): whichever link dies first, and however
    it died (a SIGKILL from the runtime included), the rest follow, and no engine process is left
    behind. Only the server's first process removes the files the client left for it
    (``REMOVE_ON_EXIT``: its initial checkpoint and weights file), and only when the client is gone:
    after an engine crash the client restarts the server from those files."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        for path in remove:
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else Path(path).unlink(missing_ok=True)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


# The first process takes the files to remove out of the environment: its children inherit none.
exit_with_parent([path for path in os.environ.pop(REMOVE_ON_EXIT, "").split(os.pathsep) if path])
os.register_at_fork(after_in_child=lambda: exit_with_parent([]))

if __name__ == "__main__":
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")
