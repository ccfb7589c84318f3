"""The vLLM environment is created once even when two processes find it missing at once."""

import fcntl
import json
import threading
import time

import pytest

from asyncrl.generation import vllm_env


def test_a_second_caller_waits_for_the_first_creation_and_creates_nothing(tmp_path, monkeypatch):
    path = tmp_path / "venv"
    created = []
    monkeypatch.setattr(vllm_env, "_create", lambda *args: created.append(args))
    lock = open(tmp_path / "venv.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # another process is creating it

    def finish_creating():
        time.sleep(1.5)
        path.mkdir()
        (path / vllm_env.MARKER).write_text(json.dumps({"vllm": vllm_env.VLLM_VERSION}))
        lock.close()

    creator = threading.Thread(target=finish_creating)
    creator.start()
    assert vllm_env.ensure_env(path, log=lambda _: None) == path / "bin" / "python"
    creator.join()
    assert created == []


def test_a_caller_that_finds_it_missing_after_the_lock_creates_it(tmp_path, monkeypatch):
    path = tmp_path / "venv"
    created = []
    monkeypatch.setattr(vllm_env, "_create", lambda *args: created.append(args[0]))
    vllm_env.ensure_env(path, log=lambda _: None)
    assert created == [path]


def test_a_creation_that_holds_the_lock_past_the_deadline_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_env, "LOCK_TIMEOUT_S", 0.5)
    monkeypatch.setattr(vllm_env, "_create", lambda *args: pytest.fail("created while another process held the lock"))
    with open(tmp_path / "venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with pytest.raises(vllm_env.VLLMEnvError, match=r"^another process has been creating .* for over 0.5s$"):
            vllm_env.ensure_env(tmp_path / "venv", log=lambda _: None)
