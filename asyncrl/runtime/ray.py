"""The Ray runtime: every worker is an actor; rollout payloads and weights live in the object store.

The controller sees the same handles as on the local runtime: ``handle.method(*args)`` submits at
once and returns an awaitable, and calls to one actor run in submission order (one caller, a
synchronous actor, one call at a time), except the methods a worker lists in
``unordered_methods`` (a rollout worker's in-flight weight load, a trainer's ``abandon``): they
run in a concurrency group of their own, beside the queued calls. Three things differ from
threads in one process:

- workers are built inside their actors by picklable module-level factories, never pickled from
  the driver; a factory that raises surfaces as the same exception the local runtime would raise;
- a generation batch returns each group's payload as a separate task return, so the caller (the
  controller's process) owns it and it outlives the generator that made it. The controller and
  the buffer hold ``RemoteGroup``s: metadata plus a reference; trainer ranks fetch the payloads
  (the payload types live in runtime/payloads.py, which imports no ray);
- rank 0 leaves exported weights in the object store and the generators load them from there;
  the controller only passes the reference along. A restarted generator reloads the last weights
  its handle sent before it serves another call. Or, with ``sync.transport: broadcast``, rank 0
  broadcasts them to the generators over a process group of their own (weights/broadcast.py):
  NCCL between GPUs. A generator that misses a broadcast loads that version from rank 0's copy
  through the object store, and every later sync goes through the object store
  (``WeightBroadcast``).

``ray`` is imported inside functions only: ``import asyncrl`` and the local runtime never load it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from asyncrl.config import RuntimeConfig
from asyncrl.errors import ProcessGroupError, RunStopped
from asyncrl.runtime.payloads import BroadcastWeights, RemoteGroup, SentWeights, WeightsRef
from asyncrl.weights.broadcast import BroadcastError, BroadcastMember, Layout, Rendezvous, signal_stop

logger = logging.getLogger(__name__)

UNORDERED = "unordered"  # an actor's concurrency group for its worker's unordered methods
SOCKET_INTERFACES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # where gloo and NCCL's bootstrap bind


class WorkerDiedError(RuntimeError):
    """A rollout worker's actor died while a call was pending: the controller retries the batch."""


class TrainerRankDiedError(RunStopped):
    """A trainer rank's actor died: the run stops; its last checkpoint is intact and resumable."""

    saves_checkpoint = False  # the trainer that would write it is gone


class WeightBroadcast:
    """The driver's side of the weight broadcast group (trainer rank 0 and the generators).

    It carries every sync until a generator misses one (it died, restarted, or the collective
    failed); from then on rank 0 exports to the object store, as without it, for the rest of the
    run. A restarted actor is not in the group, and rebuilding the group would need every member.
    """

    def __init__(self, source: Any, rendezvous: Rendezvous) -> None:
        self.source = source  # trainer rank 0's actor: it holds the last version it broadcast
        self.rendezvous = rendezvous
        self.stopped: str | None = None  # why syncs no longer broadcast
        self._held: tuple[int, Any] | None = None

    @property
    def active(self) -> bool:
        return self.stopped is None

    def stop(self, reason: str) -> None:
        """Broadcast no more; members still waiting in a broadcast give up now."""
        if self.stopped is not None:
            return
        self.stopped = reason
        logger.warning("weight broadcast stopped (%s); weights go through the object store from now on", reason)
        try:
            signal_stop(self.rendezvous, reason)
        except RuntimeError as err:  # rank 0 unreachable: a waiting member gives up at the group's timeout
            logger.warning("could not signal the weight broadcast group to stop: %s", err)

    def held(self, version: int) -> Any:
        """The reference of rank 0's copy of ``version`` in the object store, published once."""
        if self._held is None or self._held[0] != version:
            self._held = (version, self.source.publish_weights.remote(version))
        return self._held[1]


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds ``address``, or None."""
    import psutil  # installed with peft

    for name, addresses in psutil.net_if_addrs().items():
        for entry in addresses:
            if entry.family in (socket.AF_INET, socket.AF_INET6) and entry.address.split("%")[0] == address:
                return name
    return None


def bind_collectives(address: str) -> None:
    """Bind this process's gloo and NCCL sockets to the interface that holds ``address`` (its Ray
    node's), unless the user set them.

    Left alone, both bind to the address the hostname resolves to, which is loopback on many
    machines (Debian's 127.0.1.1 convention), and then tell peers on other nodes to connect to
    127.0.0.1: a multi-node group cannot form."""
    interface = interface_of(address)
    if interface is not None:
        for variable in SOCKET_INTERFACES:
            os.environ.setdefault(variable, interface)


def _group_error(err: Exception, addresses: Sequence[str]) -> ProcessGroupError:
    """``err`` in one line naming the group's node addresses, with what to check."""
    error = ProcessGroupError(f"{_first_line(err)} (node addresses, in rank order: {', '.join(addresses)})")
    error.add_note(
        "each member binds gloo and NCCL to the interface holding its node's Ray address unless "
        "GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME is set on its node; check that the nodes reach each other there"
    )
    return error


class WorkerActor:
    """Hosts one worker object. Decorated with ``ray.remote`` when a runtime starts.

    The worker is built on first use from ``factory``; a restarted actor runs ``__init__`` again,
    so it rebuilds its worker and, at its next call, reloads the weights its handle last sent.
    """

    def __init__(self, torch_threads: int, factory: Callable[[], Any] | None = None) -> None:
        import ray

        torch.set_num_threads(torch_threads)
        bind_collectives(ray.util.get_node_ip_address())
        self.factory = factory
        self.worker: Any = None
        self.weights_version: int | None = None
        self.rank = 0
        self.member: BroadcastMember | None = None  # in the weight broadcast group
        self.building = threading.Lock()  # an unordered call may arrive first after a restart

    def build(self, factory: Callable[[], Any] | None = None, rank: int = 0) -> tuple[str, ...]:
        """Build the worker now (from ``factory``, or the one given at creation), so errors surface;
        returns its ``unordered_methods``."""
        self.factory = factory or self.factory
        self.rank = rank
        self.worker = self.factory()
        return tuple(getattr(self.worker, "unordered_methods", ()))

    def alive(self) -> None:
        """Answers once the actor is up (after a restart: once it is up again)."""

    def node_address(self) -> tuple[str, int]:
        """This node's IP and a port free on it: the trainer ranks' rendezvous."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind((ip, 0))
            return ip, probe.getsockname()[1]

    def call(self, sent: SentWeights | None, method: str, args: tuple, kwargs: dict) -> Any:
        return getattr(self._ready(sent), method)(*args, **kwargs)

    def generate(self, sent: SentWeights | None, jobs: Sequence[Any]) -> tuple:
        """(the batch with ``RemoteGroup`` metadata, then each group's payload as its own return)."""
        batch = self._ready(sent).generate(jobs)
        return (replace(batch, groups=[RemoteGroup.describe(g) for g in batch.groups]), *batch.groups)

    def load_weights(self, weights: dict[str, Any], version: int) -> str | None:
        """Load ``weights`` as ``version``; the worker's answer (a generator's served fingerprint)."""
        served = self._ready(None).load_weights(_from_arrays(weights), version)
        self.weights_version = version
        return served

    def export_weights(self, broadcast: bool = False) -> tuple[tuple[int, int], Any]:
        """((version, bytes), rank 0's weights, or the ``Layout`` of their broadcast once it has
        started). Every rank takes part: FSDP gathers."""
        from asyncrl.weights.size import state_dict_bytes

        if not broadcast:
            if self.member is not None:
                self.member.stopped()  # after a stop: end a broadcast still stuck on a lost peer
            version, weights = self._ready(None).export_weights()
            return (version, state_dict_bytes(weights)), (_to_arrays(weights) if self.rank == 0 else None)
        device = None if self.member.device == "cuda" else "cpu"  # NCCL sends from the GPU
        version, weights = self._ready(None).export_weights(device=device)
        return (version, state_dict_bytes(weights)), self.member.send(weights, version)

    def join_broadcast(self, rendezvous: Rendezvous, rank: int) -> None:
        self.member = BroadcastMember(rendezvous, rank)

    def receive_weights(self, layout: Layout, version: int) -> str | None:
        """Join rank 0's broadcast of ``version`` and load it; the worker's answer, as ``load_weights``."""
        worker = self._ready(None)
        served = worker.load_weights(self._member().receive(layout), version)
        self.weights_version = version
        return served

    def publish_weights(self, version: int) -> dict[str, Any]:
        """Rank 0's copy of the last version it broadcast, for a generator that missed it."""
        return _to_arrays({name: tensor.cpu() for name, tensor in self._member().held(version).items()})

    def _member(self) -> BroadcastMember:
        if self.member is None:
            raise BroadcastError("this actor is not in the weight broadcast group (it was restarted)")
        return self.member

    def _ready(self, sent: SentWeights | None) -> Any:
        with self.building:
            if self.worker is None:
                self.build()
        if sent is not None and sent.version != self.weights_version:
            ref = sent.ref if sent.ref is not None else sent.source.publish_weights.remote(sent.version)
            self.load_weights(resolve([ref])[0], sent.version)
        return self.worker


def _to_arrays(weights: dict[str, Tensor]) -> dict[str, Any]:
    """Weights as numpy arrays, which the object store writes in one copy and a reader maps
    without one (torch tensors are pickled through bytes: several times slower). bfloat16,
    which numpy lacks, travels as its int16 bits."""
    return {
        name: (tensor.view(torch.int16).numpy(), "bfloat16") if tensor.dtype == torch.bfloat16 else tensor.numpy()
        for name, tensor in weights.items()
    }


def _from_arrays(weights: dict[str, Any]) -> dict[str, Tensor]:
    """Tensors over the arrays ``_to_arrays`` sent (read-only shared memory: loading copies them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the arrays are not writable
        return {
            name: torch.from_numpy(array[0]).view(torch.bfloat16)
            if isinstance(array, tuple)
            else torch.from_numpy(array)
            for name, array in weights.items()
        }


class ControllerActor:
    """Runs the controller next to the driver when ``runtime.controller_actor`` is set."""

    def run(self, drive: Callable[[], Any]) -> Any:
        return drive()


class RayHandle:
    """``await handle.method(*args)`` runs ``worker.method(*args)`` in the actor, in call order.

    Every call carries the weights last sent (``sent``), so a call runs on the weights that were
    current when it was made, even on an actor restarted since. A rollout worker's actor is
    restartable: Ray retries its calls through a restart, except a generation batch, which fails
    when its actor dies so the controller retries it and counts it. Batches submitted while the
    actor restarts wait for it rather than fail again. A method in ``unordered`` (the rollout
    worker's ``unordered_methods``, known once it is built) runs in the actor's ``UNORDERED``
    concurrency group, beside the calls in order.
    """

    def __init__(self, actor: Any, name: str, *, died: type[Exception] = WorkerDiedError) -> None:
        self.actor = actor
        self.name = name
        self.died = died
        self.sent: SentWeights | None = None
        self.revival: asyncio.Future | None = None  # pending while the actor restarts
        self.broadcast: WeightBroadcast | None = None  # set on trainer rank 0 and the generators
        self.unordered: tuple[str, ...] = ()

    def __getattr__(self, method: str) -> Callable[..., asyncio.Future]:
        if method.startswith("__"):
            raise AttributeError(method)

        def submit(*args: Any, **kwargs: Any) -> asyncio.Future:
            return self._future(self._method("call", method).remote(self.sent, method, args, kwargs))

        return submit

    @property
    def loads_while_generating(self) -> bool:
        return "load_weights" in self.unordered

    def _method(self, name: str, worker_method: str) -> Any:
        """The actor's ``name``, in the unordered group when it serves the worker's ``worker_method`` there."""
        remote = getattr(self.actor, name)
        return remote.options(concurrency_group=UNORDERED) if worker_method in self.unordered else remote

    def generate(self, jobs: Sequence[Any]) -> asyncio.Future:
        if self.revival is not None and not self.revival.done():
            return asyncio.ensure_future(self._generate_after_revival(jobs, self.sent))
        return self._submit_generate(jobs, self.sent)

    def _submit_generate(self, jobs: Sequence[Any], sent: SentWeights | None) -> asyncio.Future:
        options = {"num_returns": len(jobs) + 1, "max_task_retries": 0}
        meta, *payloads = self.actor.generate.options(**options).remote(sent, jobs)
        return self._future(
            meta,
            lambda batch: replace(batch, groups=[replace(g, ref=r) for g, r in zip(batch.groups, payloads)]),
            revive=True,
        )

    async def _generate_after_revival(self, jobs: Sequence[Any], sent: SentWeights | None) -> Any:
        await self.revival
        return await self._submit_generate(jobs, sent)

    async def _revived(self) -> None:
        """Returns once the restarted actor answers (Ray retries the call through the restart), or
        once it is dead for good: then the batches that waited fail on their own."""
        with contextlib.suppress(Exception):
            await asyncio.wrap_future(self.actor.alive.remote().future())

    def load_weights(self, weights: WeightsRef | BroadcastWeights, version: int) -> asyncio.Future:
        """The reference is a top-level argument, so Ray resolves it inside the actor.

        If the actor dies meanwhile, the load is not an error: the restarted actor reloads these
        weights before its next call (and a generator that stays dead fails its next batch)."""
        if isinstance(weights, BroadcastWeights):
            self.sent = SentWeights(version, None, weights.channel.source)
            return asyncio.ensure_future(self._receive(weights, version))
        self.sent = SentWeights(version, weights.ref)
        loaded = self._method("load_weights", "load_weights").remote(weights.ref, version)
        return self._future(loaded, survive_death=True)

    async def _receive(self, weights: BroadcastWeights, version: int) -> str | None:
        """Join the broadcast; if that fails, stop broadcasting and load rank 0's copy instead."""
        joined = self._method("receive_weights", "load_weights").options(max_task_retries=0)
        joined = joined.remote(weights.layout, version)
        try:
            return await self._result(joined, None, revive=True)
        except Exception as err:
            weights.channel.stop(f"{self.name} missed weight version {version}: {_first_line(err)}")
        ref = weights.channel.held(version)
        if self.sent is not None and self.sent.version == version:
            self.sent = SentWeights(version, ref)
        loaded = self._method("load_weights", "load_weights").remote(ref, version)
        return await self._result(loaded, None, survive_death=True)

    def export_weights(self) -> asyncio.Future:
        """(version, WeightsRef): rank 0's weights stay in the object store, owned by this caller;
        or (version, BroadcastWeights) while this rank broadcasts them."""
        if self.broadcast is not None and self.broadcast.active:
            info, layout = self.actor.export_weights.options(num_returns=2).remote(True)
            channel = self.broadcast
            return self._future(info, lambda v: (v[0], BroadcastWeights(layout, v[1], channel)))
        info, weights = self.actor.export_weights.options(num_returns=2).remote()
        return self._future(info, lambda v: (v[0], WeightsRef(weights, v[1])))

    def _future(self, ref: Any, convert: Callable[[Any], Any] | None = None, **on_death: bool) -> asyncio.Future:
        return asyncio.ensure_future(self._result(ref, convert, **on_death))

    async def _result(
        self, ref: Any, convert: Callable[[Any], Any] | None, *, survive_death: bool = False, revive: bool = False
    ) -> Any:
        import ray.exceptions

        try:
            value = await asyncio.wrap_future(ref.future())
        except ray.exceptions.RayTaskError as err:
            cause = err.cause if isinstance(err.cause, Exception) else RuntimeError(_first_line(err))
            raise cause from None
        except ray.exceptions.RayActorError as err:
            if self.broadcast is not None and self.died is WorkerDiedError:
                self.broadcast.stop(f"{self.name} died")
            if revive and (self.revival is None or self.revival.done()):
                self.revival = asyncio.ensure_future(self._revived())
            if survive_death:
                return None
            raise self.died(f"{self.name} died: {_first_line(err)}") from None
        return convert(value) if convert is not None else value


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def resolve(refs: Sequence[Any]) -> list[Any]:
    """``ray.get`` with a task's own exception raised as itself (a ValueError stays a ValueError)."""
    import ray
    import ray.exceptions

    try:
        return ray.get(list(refs))
    except ray.exceptions.RayTaskError as err:
        raise (err.cause if isinstance(err.cause, Exception) else RuntimeError(_first_line(err))) from None


class RayRuntime:
    """Actors on a Ray cluster: started here (``runtime.address`` null) or joined.

    ``shutdown`` kills this run's actors; it shuts Ray down when this runtime connected to it,
    which ends the cluster when the runtime started it, and only disconnects from a joined one.
    A cluster that was already connected (a test session's) is left running. Implements
    ``asyncrl.runtime.Runtime``; ``broadcast`` (backend, timeout): ``ready`` forms the weight
    broadcast group of trainer rank 0 and the rollout workers.
    """

    name = "ray"
    in_process = False

    def __init__(
        self,
        cfg: RuntimeConfig,
        *,
        num_cpus: float = 0.0,
        num_gpus: float = 0.0,
        broadcast: tuple[str, float] | None = None,
    ) -> None:
        import ray

        self.cfg = cfg
        self.broadcast = broadcast
        self.generators: list[RayHandle] = []
        self.trainer_ranks: list[RayHandle] = []
        self.actors: list[Any] = []
        self.builds: list[tuple[RayHandle, Any]] = []  # (a handle, its build): ``ready``
        self.trainer_nodes: list[str] = []  # the node address of each trainer rank, when they form a group
        self.connected = not ray.is_initialized()
        if self.connected:
            options: dict[str, Any] = {}
            if cfg.address is None:
                options["num_cpus"] = max(os.cpu_count() or 1, math.ceil(num_cpus))
                if num_gpus:
                    options["num_gpus"] = math.ceil(num_gpus)
            ray.init(
                address=cfg.address or "local",  # "local": a new cluster, never one found on the machine
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.ERROR,
                configure_logging=True,
                **options,
            )
        self._worker_actor = ray.remote(concurrency_groups={UNORDERED: 1})(WorkerActor)
        self._controller_actor = ray.remote(ControllerActor)

    def spawn_generators(self, factory: Callable[[], Any], count: int) -> list[RayHandle]:
        """``count`` rollout worker actors, each built by ``factory``, restarted when they die.

        Like ``spawn_trainer_ranks`` it returns once the builds are under way, so the actors of
        both kinds start together; ``ready`` waits for them and raises a build's error."""
        actors = [
            self._worker_actor.options(
                num_cpus=self.cfg.generator_cpus,
                num_gpus=self.cfg.generator_gpus,
                max_restarts=self.cfg.generator_restarts,
                max_task_retries=-1,  # but a generation batch fails, to be retried by the controller
            ).remote(self._threads(self.cfg.generator_cpus), factory)
            for _ in range(count)
        ]
        self.actors += actors
        handles = [RayHandle(actor, f"rollout worker {i}") for i, actor in enumerate(actors)]
        self.builds += [(handle, handle.actor.build.remote()) for handle in handles]
        self.generators += handles
        return handles

    def spawn_trainer_ranks(
        self, build_rank: Callable[[int, str | None], Callable[[], Any]], world_size: int
    ) -> list[RayHandle]:
        """``world_size`` trainer rank actors; rank r runs ``build_rank(r, init_method)()``.

        With more than one rank they meet at rank 0's node IP and a port free on that node."""
        actors = [
            self._worker_actor.options(
                num_cpus=self.cfg.trainer_cpus, num_gpus=self.cfg.trainer_gpus, max_restarts=0
            ).remote(self._threads(self.cfg.trainer_cpus))
            for _ in range(world_size)
        ]
        self.actors += actors
        init_method = None
        if world_size > 1:
            addresses = resolve([actor.node_address.remote() for actor in actors])
            self.trainer_nodes = [ip for ip, _ in addresses]
            init_method = "tcp://{}:{}".format(*addresses[0])
        ranks = [
            RayHandle(actor, f"trainer rank {rank}", died=TrainerRankDiedError) for rank, actor in enumerate(actors)
        ]
        self.builds += [
            (handle, handle.actor.build.remote(build_rank(rank, init_method), rank))
            for rank, handle in enumerate(ranks)
        ]
        self.trainer_ranks += ranks
        return ranks

    def ready(self) -> None:
        """Wait until every spawned worker is built; a factory that raised raises here. Each handle
        learns its worker's unordered methods (a generator's in-flight load, a trainer's abandon).
        With ``broadcast``, trainer rank 0 and the rollout workers then form its group."""
        builds, self.builds = self.builds, []
        try:
            built = resolve([build for _, build in builds])
        except ProcessGroupError as err:  # the trainer ranks' group did not form
            raise _group_error(err, self.trainer_nodes) from None
        for (handle, _), unordered in zip(builds, built):
            handle.unordered = unordered
        if self.broadcast is not None and self.trainer_ranks:
            self.connect_broadcast(self.trainer_ranks[0], self.generators, *self.broadcast)

    def connect_broadcast(
        self, source: RayHandle, generators: Sequence[RayHandle], backend: str, timeout_s: float
    ) -> None:
        """Form the weight broadcast group of trainer rank 0 (``source``) and the generators; from
        now on their handles sync weights through it (``WeightBroadcast``)."""
        members = [source, *generators]
        addresses = resolve([handle.actor.node_address.remote() for handle in members])
        rendezvous = Rendezvous(*addresses[0], len(members), backend, timeout_s)
        try:
            resolve([handle.actor.join_broadcast.remote(rendezvous, rank) for rank, handle in enumerate(members)])
        except RuntimeError as err:  # torch's DistError and gloo's connect failures
            message = (
                f"the weight broadcast group ({backend}) of trainer rank 0 and the rollout workers did not form: {err}"
            )
            raise _group_error(RuntimeError(message), [ip for ip, _ in addresses]) from None
        channel = WeightBroadcast(source.actor, rendezvous)
        for handle in members:
            handle.broadcast = channel

    def run_controller(self, drive: Callable[[], Any]) -> Any:
        """``drive()`` inside a CPU actor pinned to this node, so the run directory is this one's."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        actor = self._controller_actor.options(num_cpus=0, scheduling_strategy=node).remote()
        self.actors.append(actor)
        return resolve([actor.run.remote(drive)])[0]

    def shutdown(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors.clear()
        if self.connected:
            ray.shutdown()

    def _threads(self, cpus: float) -> int:
        return self.cfg.torch_threads or max(1, round(cpus))
