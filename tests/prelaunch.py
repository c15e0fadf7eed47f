"""The suite's longest Ray Train runs, started with the session in a second Ray driver beside the
tests (``python tests/prelaunch.py SPEC``): they train while the modules before theirs run.

Why: on 2 cores the suite keeps both cores busy only ~70 % of its time. Most tests are one
Python process that leaves the other core idle, while these runs (the checkpoint tests'
reference, test_training's, and LoRA, Qwen2.5-VL and LLaVA killed and restored under Ray Train)
keep both busy for 20 to 75 s each when their module reaches them. Started at once, they fill
the idle core instead.

What is prelaunched is a *run function* of a test module (``RUNS``): ``fn(root, **inputs)``,
where ``root`` is its own directory and ``inputs`` are session fixtures by name (files only:
tokenizers, model directories); it builds what else it needs under ``root``, runs, and returns
the dict its module's fixtures read (it must pickle). The helper connects to the session's Ray
(its GCS address; the state API stays pinned to the session's, the variable inherited), runs
the wanted functions in order (the order of their modules), and leaves each result in
``<root>/result.pkl``, or its traceback in ``<root>/error.txt``. A module's fixture waits for
it (:meth:`Prelaunch.result`), or runs the function in the test process when nothing was
prelaunched for it.

Running beside the tests is safe because nothing of it is shared with them but Ray: a run
kills only its own workers and snapshot keepers (tests/test_checkpoint.py ``run_workers``,
``_kill_keepers``), counts only its own job's actors, and the session's Ray has PPUs for it
and for the tests' largest group at once (conftest ``SIMULATED_PPUS``).
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pickle
import subprocess
import sys
import time
import traceback
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# the fixture that reads a run's result → its run function, in the order the suite reaches them
RUNS = {
    "uninterrupted": "test_checkpoint:run_uninterrupted",  # (test_hf's, ~30 s in, first)
    "lora_run": "test_lora_training:run_lora",
    "qwen_vl_runs": "test_qwen_vl_training:run_qwen_vl",
    "training_runs": "test_training:run_training",
    "vl_stage2_run": "test_vl_run:run_vl_stage2",
}
# RAY_PPU_TESTS_PRELAUNCH=0: each run in the test process when its module reaches it (a
# debugger, or a failure to see without a second driver)
ENABLED = os.environ.get("RAY_PPU_TESTS_PRELAUNCH", "1") != "0"
NICE = 19  # the helper process: its runs' own processes go further, under SCHED_IDLE


def run_function(key: str):
    module, name = RUNS[key].split(":")
    return getattr(importlib.import_module(module), name)


def inputs_of(key: str) -> list[str]:
    """The session fixtures ``key``'s run function takes (every parameter but ``root``)."""
    return [p for p in inspect.signature(run_function(key)).parameters if p != "root"]


class Prelaunch:
    """The test process's end: ``runs`` (key → its directory and its inputs), made by the
    helper once :meth:`start` ed, else each in this process when its fixture asks."""

    def __init__(self, runs: dict[str, tuple[Path, dict]]) -> None:
        self.runs = runs
        self.proc = None
        self.log = None

    def start(self, address: str, log: Path) -> None:
        """Start the helper on every run, one at a time, connected to the Ray at ``address``."""
        spec = log.with_suffix(".json")
        spec.write_text(json.dumps({"address": address, "runs": [
            {"key": key, "root": str(root), "inputs": {k: str(v) for k, v in inputs.items()}}
            for key, (root, inputs) in self.runs.items()]}))
        self.log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__)), str(spec)],
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # killed with its children (close)

    def result(self, key: str, timeout: float = 900) -> dict:
        """``key``'s result: the helper's (waited for), else computed here."""
        root, inputs = self.runs[key]
        if self.proc is None:
            return run_function(key)(root, **inputs)
        deadline = time.monotonic() + timeout
        while not (root / "result.pkl").exists() and not (root / "error.txt").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = "timed out" if self.proc.poll() is None else f"exited {self.proc.returncode}"
                output = Path(self.log.name).read_text()[-4000:]
                raise AssertionError(f"the prelaunched run {key} {why}; its output:\n{output}")
            time.sleep(0.2)
        if (root / "error.txt").exists():
            raise AssertionError(f"the prelaunched run {key} failed (the helper's output: "
                                 f"{self.log.name}; its workers': Ray's session logs):\n"
                                 + (root / "error.txt").read_text())
        with open(root / "result.pkl", "rb") as f:
            return pickle.load(f)

    def close(self) -> None:
        import signal

        if self.proc is None:
            return
        if self.proc.poll() is None:  # the session ended before its runs did (-x, Ctrl-C)
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()
        self.proc = None


def _yield_to_the_tests(job_id: str) -> None:
    """Every second, put every thread of this helper's Ray processes (its job's actors: the
    runs' controllers, workers, readers, keepers) under SCHED_IDLE: they run when the tests
    leave a core idle, never instead of them. Threads they start later inherit it. Not the
    named actors of other namespaces: Ray Data's, shared with the tests' pipelines.

    A listed pid is acted on only once it is checked to be that actor's process
    (:func:`_actor_process`): on 2 cores the suite goes through Linux's 32,768 pids every
    minute or two, so an actor that died since the state API answered may have left its pid
    to any new process or thread. Unchecked, one such pid put the whole process it fell to
    under SCHED_IDLE: a test's worker, or the session's GCS or raylet, starved behind both
    busy cores.
    """
    import psutil
    from ray.util.state import list_actors

    from ray_ppu.recovery.snapshot_keeper import NAMESPACE

    done: set[int] = set()
    while True:
        asked = time.time()
        try:
            actors = [a for a in list_actors(filters=[("job_id", "=", job_id),
                                                      ("state", "=", "ALIVE")], limit=1000)
                      if not a["name"] or a["ray_namespace"] == NAMESPACE]
        except Exception:  # noqa: BLE001 - the state API busy: the next second
            actors = []
        for actor in actors:
            proc = _actor_process(actor, asked)
            if proc is None:
                continue
            try:
                for thread in proc.threads():
                    if thread.id not in done:
                        os.sched_setscheduler(thread.id, os.SCHED_IDLE, os.sched_param(0))
                        done.add(thread.id)
            except (OSError, psutil.Error):  # gone meanwhile
                continue
        time.sleep(1.0)


def _actor_process(actor: dict, asked: float):
    """The process of ``actor`` (a row of the state API, asked at ``asked``), or None where its
    pid is now another's: a process, not one thread of a process (a pid may come back as a
    thread id, and psutil reads a thread id as its whole process), started before the state
    API was asked, its title a Ray worker's (``ray::RayTrainWorker``, ``ray::execute…``)."""
    import psutil

    pid = actor.get("pid")
    try:
        with open(f"/proc/{pid}/status") as status:
            leader = next(int(line.split()[1]) for line in status if line.startswith("Tgid:"))
        proc = psutil.Process(pid)
        title = proc.cmdline()[:1]
        # Linux keeps boot time in whole seconds: a start time may read up to 1 s early
        if (leader == pid and proc.create_time() < asked - 1.0 and title
                and title[0].startswith("ray::")):
            return proc
    except (OSError, ValueError, StopIteration, psutil.Error):  # gone, or on another node
        pass
    return None


def main(spec_path: str) -> int:
    import threading

    import ray

    sys.path[:0] = [str(TESTS), str(TESTS.parent)]
    spec = json.loads(Path(spec_path).read_text())
    # this process and what it starts (the model files it makes, a conversion) behind the
    # tests too, but not idle: its kills and its watchdog must act on time
    os.nice(NICE)
    ray.init(address=spec["address"], log_to_driver=False)
    threading.Thread(target=_yield_to_the_tests, args=(ray.get_runtime_context().get_job_id(),),
                     daemon=True).start()
    failed = 0
    for run in spec["runs"]:
        root = Path(run["root"])
        started = time.monotonic()
        try:
            inputs = {name: Path(value) for name, value in run["inputs"].items()}
            result = run_function(run["key"])(root, **inputs)
            tmp = root / "result.pkl.tmp"
            with open(tmp, "wb") as f:
                pickle.dump(result, f)
            tmp.rename(root / "result.pkl")
            print(f"{run['key']}: done in {time.monotonic() - started:.1f} s", flush=True)
        except BaseException:  # noqa: BLE001 - the waiting fixture reports it
            failed += 1
            (root / "error.txt").write_text(traceback.format_exc())
            print(f"{run['key']}: failed", flush=True)
    ray.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
