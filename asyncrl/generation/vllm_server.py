"""Runs inside the vLLM environment: registers asyncrl's file weight-transfer engine, then serves.

Started by the vLLM venv's interpreter as a script (``python vllm_server.py <api_server args>``),
so it imports only vLLM, torch, safetensors and the standard library, never asyncrl's own
environment. The registration runs at import: the engine-core process, forked or spawned from
this one, finds it in vLLM's registry too. The server leads its own process group and ends it
when the process that started it is gone (``exit_with_parent``).

The engine ("asyncrl_file") is the CPU path of vLLM's weight-transfer API: the trainer writes its
state dict to a safetensors file (in /dev/shm when there is one) and sends its path with
``update_weights``. vLLM's built-in engines (nccl, ipc) need CUDA. A weight update must redo the
weight post-processing that loading did: on CPU, linear weights are repacked for oneDNN and the
original parameter emptied, so the update runs vLLM's layerwise reload around ``load_weights``.
A tied ``lm_head`` shares the embedding's parameter but keeps its own packed copy, which the
reload does not revisit (it processes a tied parameter through one parent only), so every
output head is repacked afterwards, or logits would stay on the old weights.
"""

from __future__ import annotations

import os
import runpy
import shutil
import signal
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

ENGINE_NAME = "asyncrl_file"
REMOVE_ON_EXIT = "ASYNCRL_VLLM_REMOVE_ON_EXIT"  # paths, os.pathsep-separated


@dataclass
class FileInitInfo(WeightTransferInitInfo):
    """Nothing to connect: every update names its own file."""


@dataclass
class FileUpdateInfo(WeightTransferUpdateInfo):
    path: str  # a safetensors file holding every weight, named as in the HF checkpoint


class FileWeightTransferEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        """Nothing to set up; the call exists so a client checks the engine is registered."""

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        self.model.load_weights(load_file(update_info.path).items())

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)
        for module in self.model.modules():
            if isinstance(module, ParallelLMHead):
                module.quant_method.process_weights_after_loading(module)

    def shutdown(self) -> None:
        """No connection to release."""


WeightTransferEngineFactory.register_engine(ENGINE_NAME, FileWeightTransferEngine)


def exit_with_parent() -> None:
    """Remove the files the client left for the server (``REMOVE_ON_EXIT``: its initial checkpoint
    and weights file) and kill the server's whole process group (it leads its own) once this
    process's parent is gone. Every process of the server watches its own parent (the engine and worker processes
    start watching when forked): whichever link dies first, and however it died (a SIGKILL from
    the runtime included), the rest follow, and no engine process is left behind."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        for path in filter(None, os.environ.get(REMOVE_ON_EXIT, "").split(os.pathsep)):
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else Path(path).unlink(missing_ok=True)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


exit_with_parent()
os.register_at_fork(after_in_child=exit_with_parent)

if __name__ == "__main__":
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")
