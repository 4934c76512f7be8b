"""A process of a multi-process run dies: the survivors stop with one line naming it and the last
checkpoint (exit code 4) within --peer-timeout, instead of waiting out jax.distributed's
heartbeat and aborting with a C++ stack dump, and the same command on every process resumes."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from helpers import (
    PEER_TIMEOUT_S,
    PYTHONPATH,
    ROOT,
    TINY,
    dead_peer_said,
    stopped_with_one_line,
)
from jax.errors import JaxRuntimeError

from sagc_jax.config import ConfigError
from sagc_jax.parallel import EXIT_PEER_LOST, initialize, supervisor
from sagc_jax.parallel.distributed import (
    _END_MARKS,
    DONE,
    FAILED,
    PeerWatch,
    runtime_heartbeat_timeout,
)

RUN = [
    *TINY,
    "train.prompts_per_step=4",
    "logging.tensorboard=false",
    "logging.plots=false",
    "train.checkpoint_every=2",
    "train.async_checkpoint=false",  # step 2 is sealed before step 3 starts
    "train.steps=4",
]


# ---------------------------------------------------------------------- the watch, in-process


class _Store:
    """The two calls PeerWatch makes on jax.distributed's client, over a dict."""

    def __init__(self):
        self.values: dict[str, str] = {}
        self.lock = threading.Lock()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.lock:
            self.values[key] = value

    def key_value_dir_get(self, prefix):
        with self.lock:
            return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


class _Clock:
    """The watches' clock, moved only by the test: a peer counts as silent when the test says
    that --peer-timeout has passed, never because a loaded host delayed a thread."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _watches(clock, n=2, timeout_s=1.0):
    store = _Store()
    return [
        PeerWatch(store, i, n, timeout_s, lambda what: f"train: {what}; saved", clock).start()
        for i in range(n)
    ]


def _until(happened):
    """Wait for the watches' threads to make ``happened()`` true (bounded far above the work)."""
    give_up = time.monotonic() + 300
    while not happened():
        assert time.monotonic() < give_up, "the watch's thread stopped beating"
        time.sleep(0.01)


def _join(thread):
    """Wait for ``thread``, which ends on its own once it has seen what the test set up (the
    bound is far above the work: it only keeps a broken watch from hanging the suite)."""
    thread.join(timeout=300)
    assert not thread.is_alive()


# the watch's thread "exits" (raises SystemExit) in the tests below
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_the_watch_tells_a_dead_a_failed_and_a_live_process_apart(monkeypatch, capsys):
    with pytest.raises(ConfigError, match="--peer-timeout 0.5: expected at least 1"):
        initialize("localhost:1234", 2, 0, peer_timeout_s=0.5)
    exits = []

    def exit_(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", exit_)

    clock = _Clock()
    # every process beats: a failure of this process's own is handed back within two beats
    first, second = _watches(clock)
    first.explain()
    assert exits == []
    # the other one ended with an error: one line naming it as soon as a collective fails
    second.finish(FAILED)
    with pytest.raises(SystemExit):
        first.explain()
    first.finish(FAILED)
    assert exits == [EXIT_PEER_LOST]
    assert capsys.readouterr().err == "train: process 1 of 2 failed (see its output); saved\n"

    # the other one stops beating (SIGKILL): the watch's thread finds it once the timeout passed
    first, second = _watches(clock)
    second._stop.set()  # no more beats, no end mark
    second._thread.join()
    last_beat = first.client.values["sagc_jax/peer/1"]
    _until(lambda: first._seen[1][0] == last_beat)  # silence counts from the last beat seen
    clock.advance(1.5)
    _join(first._thread)
    assert exits == [EXIT_PEER_LOST] * 2
    assert capsys.readouterr().err == (
        "train: process 1 of 2 stopped responding (no heartbeat for 1 s, --peer-timeout); saved\n"
    )

    # process 0 stops beating while a collective fails here: named as the coordinator, as the
    # guard names it, and no end mark is written (its service, which holds them, may be stalled)
    first, second = _watches(clock)
    first._stop.set()
    second._stop.set()  # the collective's failure, not the watch's thread, finds it
    clock.advance(1.5)
    with pytest.raises(SystemExit):
        second.explain()
    assert exits == [EXIT_PEER_LOST] * 3
    assert capsys.readouterr().err == (
        "train: process 0 of 2 (the jax.distributed coordinator) stopped answering (1 s, "
        "--peer-timeout); saved\n"
    )
    assert second.client.values["sagc_jax/peer/1"] not in _END_MARKS


class _FailingStore(_Store):
    """A store whose writes raise ``error`` once it is set."""

    def __init__(self):
        super().__init__()
        self.error: Exception | None = None

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.error is not None:
            raise self.error
        super().key_value_set(key, value, allow_overwrite)


def test_the_watch_handles_a_lost_service_and_names_what_it_cannot_handle(capsys):
    store = _FailingStore()
    watch = PeerWatch(store, 1, 2, 1.0, lambda what: what, _Clock()).start()
    watch._stop.set()  # its thread's beats are not what is tested here
    # the coordination service is gone (process 0 died): nobody reads the mark, nothing said
    store.error = JaxRuntimeError("UNAVAILABLE: Failed to send RPC to coordination service")
    watch.finish(DONE)
    assert capsys.readouterr().err == ""

    # anything else is not the watch's to judge: one line naming it, and the run still ends
    store = _FailingStore()
    watch = PeerWatch(store, 1, 2, 1.0, lambda what: what, _Clock()).start()
    watch._stop.set()
    store.error = TypeError("key_value_set() got an unexpected keyword argument\nmore")
    watch.finish(DONE)
    assert capsys.readouterr().err == (
        "process 1 of 2: the peer watch could not leave its end mark (done) (TypeError: "
        "key_value_set() got an unexpected keyword argument); this process ends anyway; the "
        "others may take --peer-timeout (1 s) to see it\n"
    )
    # an unexpected error in the beat itself ends the watch's thread with one line, not a
    # traceback, and not with the verdict that process 0 stopped answering
    store = _FailingStore()
    watch = PeerWatch(store, 1, 2, 1.0, lambda what: what, _Clock()).start()
    store.error = KeyError("sagc_jax/peer/1")
    _join(watch._thread)
    assert capsys.readouterr().err == (
        "process 1 of 2: the peer watch could not exchange beats (KeyError: 'sagc_jax/peer/1'); "
        "it stops: the other processes will stop the run within --peer-timeout (1 s), naming "
        "this one\n"
    )


class _HangingStore(_Store):
    """A store whose calls block, neither answering nor failing, once ``hang`` is set (the
    service of a stopped process 0)."""

    def __init__(self):
        super().__init__()
        self.hang = threading.Event()
        self.hanging = threading.Event()  # a call is blocked now
        self.never = threading.Event()

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.hang.is_set():
            self.hanging.set()
            self.never.wait()
        super().key_value_set(key, value, allow_overwrite)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_the_watch_ends_this_process_when_the_coordinator_hangs(monkeypatch, capsys):
    exits = []

    def exit_(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", exit_)
    store, clock = _HangingStore(), _Clock()
    watch = PeerWatch(store, 1, 3, 1.0, lambda what: f"train: {what}; saved", clock).start()
    store.hang.set()  # the beat thread's next call never returns: the guard speaks
    store.hanging.wait()
    clock.advance(1.5)
    _join(watch._guard)
    assert exits == [EXIT_PEER_LOST]
    assert capsys.readouterr().err == (
        "train: process 0 of 3 (the jax.distributed coordinator) stopped answering (1 s, "
        "--peer-timeout); saved\n"
    )
    assert store.values == {"sagc_jax/peer/1": "0"}  # no end mark tried: it would hang too
    watch._stop.set()
    store.never.set()
    _join(watch._thread)


class _SlowlyFailingStore(_Store):
    """A store whose writes, once ``fail`` is set, fail only after ``seconds`` of the watch's
    clock (the RPC deadline of a stalled process 0's service)."""

    def __init__(self, clock: _Clock, seconds: float):
        super().__init__()
        self.clock, self.seconds = clock, seconds
        self.fail = threading.Event()

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.fail.is_set():
            self.clock.advance(self.seconds)
            raise JaxRuntimeError("DEADLINE_EXCEEDED: coordination service did not answer")
        super().key_value_set(key, value, allow_overwrite)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_calls_that_fail_slowly_end_the_process_within_the_timeout_of_the_first(
    monkeypatch, capsys
):
    """The service's calls fail after 0.7 s each: the silence counts from the start of the
    first unanswered call, so this process ends at the second failure (1.4 s, within one call
    of --peer-timeout 1 s), well before the runtime's own heartbeat timeout (its backstop);
    counting from the first failure instead ended it only at the third (2.1 s)."""
    ended_at = []

    def exit_(code):  # os._exit ends every thread; here the other one must stay quiet
        ended_at.append(clock())
        watch._stop.set()
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", exit_)
    clock = _Clock()
    store = _SlowlyFailingStore(clock, 0.7)
    watch = PeerWatch(store, 1, 2, 1.0, lambda what: f"train: {what}; saved", clock).start()
    store.fail.set()
    _join(watch._thread)
    assert ended_at == [pytest.approx(1.4)]
    assert capsys.readouterr().err == (
        "train: process 0 of 2 (the jax.distributed coordinator) stopped answering (1 s, "
        "--peer-timeout); saved\n"
    )
    assert "LOST" not in store.values.values()  # no end mark tried: the service is what failed


# ---------------------------------------------------------------------- two real processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _two_processes(run_dir, crash_at=None, crashing=1):
    """Start both processes of the run; process ``crashing`` kills itself at ``crash_at``."""
    port = _free_port()
    procs = []
    for i in range(2):
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
        env["PYTHONPATH"] = PYTHONPATH
        env.pop("JAX_COORDINATOR_ADDRESS", None)
        if crash_at and i == crashing:
            env["SAGC_JAX_CRASH_AT"] = crash_at
        cmd = [sys.executable, "-m", "sagc_jax", "train"]
        cmd += [f"--set={o}" for o in [*RUN, f"logging.run_dir={run_dir}"]]
        cmd += [f"--coordinator=localhost:{port}", "--num-processes=2", f"--process-id={i}"]
        cmd += [f"--peer-timeout={PEER_TIMEOUT_S}"]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    # the hang guard: without the watch the survivor would wait jax.distributed's heartbeat
    outs = [p.communicate(timeout=400) for p in procs]
    return [p.returncode for p in procs], outs


def test_the_runtimes_heartbeat_timeout_leaves_the_watch_a_minute_or_more():
    # the backstop speaks only when the watch's threads run a minute (or --peer-timeout) late
    assert runtime_heartbeat_timeout(10) == 70
    assert runtime_heartbeat_timeout(PEER_TIMEOUT_S) == PEER_TIMEOUT_S + 60
    assert runtime_heartbeat_timeout(100) == 200
    assert runtime_heartbeat_timeout(1.5) == 62


@pytest.mark.heavy
def test_a_killed_process_stops_the_survivor_with_one_line_and_the_rerun_resumes(tmp_path):
    run_dir = tmp_path / "run"
    codes, outs = _two_processes(run_dir, crash_at="rollout:3")  # SIGKILL in step 4
    err = outs[0][1]
    assert codes == [EXIT_PEER_LOST, -signal.SIGKILL], err[-3000:]
    assert stopped_with_one_line(err, run_dir, dead_peer_said(1, 2)), err[-3000:]
    assert not (run_dir / "run.lock").exists()  # released before the exit

    codes, outs = _two_processes(run_dir)
    assert codes == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    assert f"resuming {run_dir} from step 2" in outs[0][0]
    assert (run_dir / "checkpoints" / "4" / "integrity.json").is_file()


@pytest.mark.heavy
def test_the_coordinators_death_ends_the_survivor_with_one_line_and_the_rerun_resumes(tmp_path):
    """Process 0 hosts jax.distributed's coordination service: when it dies, the runtime aborts
    the others at once (SIGABRT, a C++ stack dump); each process trains in a supervised child,
    and the supervisor turns that abort into the one line."""
    run_dir = tmp_path / "run"
    codes, outs = _two_processes(run_dir, crash_at="rollout:3", crashing=0)  # SIGKILL in step 4
    err = outs[1][1]
    assert codes == [-signal.SIGKILL, EXIT_PEER_LOST], err[-3000:]
    gone = "process 0 of 2 (the jax.distributed coordinator) disappeared"
    assert stopped_with_one_line(err, run_dir, (gone,)), err[-3000:]

    codes, outs = _two_processes(run_dir)
    assert codes == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    assert f"resuming {run_dir} from step 2" in outs[0][0]
    assert (run_dir / "checkpoints" / "4" / "integrity.json").is_file()


# ---------------------------------------------------------------------- the supervisor

_FATAL = (
    "E1201 18:37:15.874677 22917 coordination_service_agent.cc:289] Polled an error from "
    "coordination service (this can be an error from this or another task).\\n"
    "F1201 18:37:15.875014 22917 client.h:80] Terminating process because the JAX distributed "
    "service detected fatal errors. absl::Status: UNAVAILABLE: Failed to send RPC to "
    "coordination service. Either the leader task was preempted/died\\n"
    "*** Check failure stack trace: ***\\n"
)


def _supervised(script: str, capfd, **kwargs):
    code = supervisor.supervise(
        [sys.executable, "-c", script], 2, lambda what: f"train: {what}; saved", **kwargs
    )
    return code, capfd.readouterr()


def test_the_supervisor_passes_output_through_and_replaces_only_the_runtimes_abort(capfd):
    # the runtime aborts the child after the coordination service's error: one line, exit 4
    abort = f"import os, sys; print('step 3'); sys.stderr.write('warn\\n{_FATAL}'); os.abort()"
    code, out = _supervised(abort, capfd)
    assert code == EXIT_PEER_LOST
    assert out.out == "step 3\n"
    assert out.err == (
        "warn\ntrain: process 0 of 2 (the jax.distributed coordinator) disappeared; saved\n"
    )
    # the same lines from a child that lives on are printed as they were, its code kept
    code, out = _supervised(f"import sys; sys.stderr.write('{_FATAL}'); sys.exit(3)", capfd)
    assert code == 3 and out.err == _FATAL.replace("\\n", "\n")
    # another fatal error of the service is named by its status
    other = "F1201 1 client.h:80] coordination service: absl::Status: INTERNAL: boom. more\\n"
    code, out = _supervised(f"import os, sys; sys.stderr.write('{other}'); os.abort()", capfd)
    assert code == EXIT_PEER_LOST
    assert out.err == (
        "train: jax.distributed's coordination service ended this process: INTERNAL: boom; saved\n"
    )
    # the backstop: the service's heartbeat timeout names the silent process(es)
    unhealthy = (
        "F1205 10:30:00.2 1 client.h:77] Terminating process because the JAX distributed "
        "service detected fatal errors. absl::Status: UNAVAILABLE: The following tasks are "
        "unhealthy (stopped sending heartbeats):\\n/job:jax_worker/replica:0/task:1\\nThe tasks "
        "have crashed.\\n\\nRPC: /tensorflow.CoordinationService/PollForError\\n"
    )
    code, out = _supervised(f"import os, sys; sys.stderr.write('{unhealthy}'); os.abort()", capfd)
    assert code == EXIT_PEER_LOST
    assert out.err == (
        "train: process 1 of 2 stopped sending heartbeats (jax.distributed's heartbeat timeout, "
        "the backstop of --peer-timeout); saved\n"
    )
    # process 0 stalled: this process's heartbeat times out and the runtime aborts at once
    stalled = (
        "F1203 15:07:08.1 15266 client.h:80] Terminating process because the JAX distributed "
        "service detected fatal errors. absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded\\n\\n"
        "RPC: /xla.coordination.CoordinationService/Heartbeat\\n*** Check failure stack trace\\n"
    )
    code, out = _supervised(f"import os, sys; sys.stderr.write('{stalled}'); os.abort()", capfd)
    assert code == EXIT_PEER_LOST
    assert out.err == (
        "train: process 0 of 2 (the jax.distributed coordinator) stopped answering heartbeats; "
        "saved\n"
    )


def test_the_supervising_parent_imports_no_jax():
    """The parent of a rank only passes output through: the CLI and the supervisor load no jax
    (2 s of CPU per process launched, and the memory, saved)."""
    code = (
        "import sys; import sagc_jax.cli, sagc_jax.parallel.supervisor; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'optax')]; "
        "assert not bad, bad[:5]"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )


def test_the_supervisor_forwards_a_signal_once_and_keeps_the_childs_exit_code(capfd):
    # the child (its handler in place) signals the supervisor, which forwards the signal to it
    # once; the child ends with 128 + 15 per signal seen, and the supervisor returns that code
    script = (
        "import os, signal, sys, time\n"
        "seen = []\n"
        "signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))\n"
        "os.kill(os.getppid(), signal.SIGTERM)\n"
        "while not seen: time.sleep(0.01)\n"
        "time.sleep(0.2); print('stopped', flush=True); sys.exit(128 + len(seen) * 15)\n"
    )
    code, out = _supervised(script, capfd)
    assert (code, out.out) == (143, "stopped\n")
