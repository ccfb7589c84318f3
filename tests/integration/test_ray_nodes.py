"""Trainer ranks on two Ray nodes with different addresses: two network namespaces on this machine,
joined by a veth pair. The hostname resolves to loopback here (as Debian's 127.0.1.1 does), so a
gloo left to bind by the hostname tells the other node to connect to 127.0.0.1.

The nodes are ``ray start --block`` processes with a temp directory of their own, stopped by the
process ids under them, never by ``ray stop`` (which stops every Ray on the machine).
"""

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

HEAD, NODE = "10.77.0.1", "10.77.0.2"  # only inside the namespaces this test makes
PORT = 6379
STARTED = "This command will now block forever"  # what ``ray start --block`` prints once its node is up


def drive(address: str) -> None:
    """The driver, in the head's namespace: two trainer ranks (one CPU each, one per node) form
    their group through the runtime's rank launcher and all-reduce once, and form a weight
    broadcast group across the nodes too; then two ranks whose gloo
    the user bound to loopback on purpose (kept: never overridden) cannot, in one line. Prints
    what it saw as JSON."""
    from functools import partial

    import ray
    import torch

    from asyncrl.config import ParallelConfig, RuntimeConfig
    from asyncrl.runtime.ray import RayRuntime
    from asyncrl.trainer.parallel import start_rank

    def spawn(runtime, timeout_s):
        rank = partial(start_rank, ParallelConfig(dp=2), timeout_s=timeout_s)
        handles = runtime.spawn_trainer_ranks(lambda r, init: partial(rank, rank=r, init_method=init), 2)
        runtime.ready()
        return handles

    cfg = RuntimeConfig(name="ray", address=address, trainer_cpus=1)
    runtime = RayRuntime(cfg)
    try:
        handles = spawn(runtime, 60.0)
        one = (torch.ones(1), torch.ones(1), torch.ones(1))  # sums, and the ranged metrics' lows and highs
        sums = ray.get([h.actor.call.remote(None, "reduce_step", one, {}) for h in handles])
        nodes = ray.get([h.actor.node_address.remote() for h in handles])
        seen = {"nodes": [ip for ip, _ in nodes], "sums": [s.item() for s, _ in sums]}
        runtime.connect_broadcast(handles[0], handles[1:], "gloo", 60.0)  # rank 1's actor stands in for a generator
        seen["broadcast"] = handles[1].broadcast is not None
    finally:
        runtime.shutdown()
    from asyncrl.errors import ProcessGroupError

    ray.init(address=address, runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo"}}, log_to_driver=False)
    runtime = RayRuntime(cfg)
    try:
        spawn(runtime, 3.0)
    except ProcessGroupError as err:
        seen["error"], seen["notes"] = str(err), err.__notes__
    finally:
        runtime.shutdown()
    print(json.dumps(seen))


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def namespaces():
    """Two network namespaces joined by a veth pair: (head's, node's); skipped where none can be made."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("network namespaces need root and iproute2's ip")
    tag = os.getpid()
    head, node = f"asyncrl-{tag}-head", f"asyncrl-{tag}-node"
    made = []
    try:
        for name in (head, node):
            sh("ip", "netns", "add", name)
            made.append(name)
        sh("ip", "link", "add", f"ar{tag}h", "type", "veth", "peer", "name", f"ar{tag}n")
        for name, link, address in ((head, f"ar{tag}h", HEAD), (node, f"ar{tag}n", NODE)):
            sh("ip", "link", "set", link, "netns", name)
            sh("ip", "-n", name, "addr", "add", f"{address}/24", "dev", link)
            sh("ip", "-n", name, "link", "set", "lo", "up")
            sh("ip", "-n", name, "link", "set", link, "up")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        pytest.skip(f"network namespaces cannot be made here: {(getattr(err, 'stderr', '') or err)!s}".strip())
    yield head, node
    for name in made:  # the veth pair goes with them
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def start_node(namespace: str, env: dict, log: Path, *args: str) -> subprocess.Popen:
    """``ray start --block`` in ``namespace``; returns once its node is up."""
    command = ["ip", "netns", "exec", namespace, "ray", "start", "--block", "--num-cpus=1", "--disable-usage-stats"]
    with log.open("w") as out:
        process = subprocess.Popen(
            [*command, *args], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + 120
    while STARTED not in log.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            stop_nodes([process])
            pytest.fail(f"ray start in {namespace} did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return process


def processes_under(roots: set[int]) -> set[int]:
    """``roots`` and every process descended from them (some of Ray's in sessions of their own)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone while we looked
            pass
    found, grew = set(roots), True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in found} - found
        found, grew = found | more, bool(more)
    return found


def stop_nodes(processes: list[subprocess.Popen]) -> None:
    """Kill each node's ``ray start --block`` and every process under it (servers, workers), by
    process id, and wait until they are gone: no part of a node outlives the test."""
    doomed = processes_under({process.pid for process in processes})
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for process in processes:
        process.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in doomed) and time.monotonic() < deadline:
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_ranks_on_two_nodes_form_their_group_without_any_interface_setting(namespaces, tmp_path):
    head_ns, node_ns = namespaces
    temp_dir = tempfile.mkdtemp(prefix="ar-")  # short: Ray's socket paths live under it
    # Ray turns token authentication on for a new head when it has a token (here: RAY_AUTH_TOKEN);
    # a joining node and a driver that names the address send it only with RAY_AUTH_MODE=token.
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "RAY_ADDRESS"):
        env.pop(variable, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))
    nodes = []
    try:
        nodes.append(
            start_node(
                head_ns,
                env,
                tmp_path / "head.log",
                "--head",
                f"--node-ip-address={HEAD}",
                f"--port={PORT}",
                "--include-dashboard=false",
                f"--temp-dir={temp_dir}",
            )
        )
        nodes.append(
            start_node(
                node_ns,
                env,
                tmp_path / "node.log",
                f"--address={HEAD}:{PORT}",
                f"--node-ip-address={NODE}",
                f"--temp-dir={temp_dir}",
            )
        )
        code = f"from test_ray_nodes import drive; drive('{HEAD}:{PORT}')"
        command = ["ip", "netns", "exec", head_ns, sys.executable, "-c", code]
        driver = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    finally:
        stop_nodes(nodes)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert driver.returncode == 0, driver.stderr[-3000:]
    seen = json.loads(driver.stdout.strip().splitlines()[-1])
    assert sorted(seen["nodes"]) == [HEAD, NODE] and seen["sums"] == [2.0, 2.0] and seen["broadcast"]
    pattern = r"trainer rank [01] could not form the trainer ranks' gloo group at tcp://([\d.]+):\d+: (.*) "
    match = re.fullmatch(pattern + r"\(node addresses, in rank order: ([\d.]+), ([\d.]+)\)", seen["error"])
    assert match, seen["error"]
    rank0, cause, *ranks = match.groups()
    assert ranks[0] == rank0 and sorted(ranks) == [HEAD, NODE]
    assert "remote=[127.0.0.1]" in cause  # gloo bound to loopback, as the user asked
    assert "GLOO_SOCKET_IFNAME" in seen["notes"][0]
