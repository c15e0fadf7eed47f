"""The run report (ray_ppu/monitor/report/, entrypoints/report.py), rendered in a real browser.

The output directory is built by hand (config.yaml, plan.json, metrics.jsonl as a run with a
checkpoint and a restart writes them); the page is loaded in Debian's headless Chromium, and
the DOM it builds and the console messages it logs are checked. Chromium is required: `make
test` installs it (`make chromium`); without it these tests fail, they do not skip.
"""

import json
import math
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from ray_ppu.monitor.report import write_report

from conftest import REPO

CHROMIUM = Path("/usr/bin/chromium")
CORPUS = "/mnt/corpus/fineweb_edu_text_document"
RUN_NAME = "<b>qwen & co</b>"  # config text with markup in it: the page must show it escaped
START = 1_800_000_000.0  # time.time() at the run's start
ITERATIONS = range(10, 301, 10)  # 30 training rows, log_interval 10, of 400 planned
RESTART_AFTER = 150  # the group fails after iteration 150 (and its checkpoint), resumes there
RECOVERY_S = 40.0


def write_run(out: Path, moe: bool = False) -> Path:
    """An output directory as a run leaves it: 30 training windows, validation at 100 and 200,
    a checkpoint at 150, a failure right after it and the restart from that checkpoint.
    ``moe``: the training rows also carry a MoE model's two routing figures, both falling
    toward 1 (balanced) as the routers learn; the busiest expert's share stays above the
    balancing loss."""
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "model": {"preset": "qwen2.5-0.5b", "num_layers": 24, "hidden_size": 896},
        "parallel": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1},
        "training": {"micro_batch_size": 2, "global_batch_size": 64, "seq_length": 2048,
                     "train_iters": 400, "lr": 3.0e-4, "lr_decay_style": "cosine",
                     "log_interval": 10, "eval_interval": 100, "eval_iters": 2},
        "data": {"data_path": [CORPUS], "split": "98,2,0"},
        "output": {"dir": str(out), "name": RUN_NAME},
        "cluster": {"num_workers": 8, "device": "ppu"},
    }
    (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    plan = {"world_size": 8, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
            "context_parallel_size": 1, "data_parallel_size": 4, "micro_batch_size": 2,
            "global_batch_size": 64, "num_microbatches": 8, "seq_length": 2048,
            "train_iters": 400, "train_tokens": 52428800, "num_parameters": 494032768,
            "flops_per_iteration": 7.9e14, "warnings": ["eval_iters 2 × 64 samples is small"]}
    (out / "plan.json").write_text(json.dumps(plan, indent=2))
    rows = []
    group_start, now = START, START
    for i in ITERATIONS:
        if i == RESTART_AFTER + 10:  # the failure, its detection, the new group's first window
            group_start = now + 5.0
            now = group_start + RECOVERY_S
            rows.append({"event": "restart", "iteration": RESTART_AFTER, "restarts": 1,
                         "cause": "rank 3: ActorDiedError: The actor died unexpectedly",
                         "failed_ranks": [3], "resumed_from": f"iter_{RESTART_AFTER:07d}",
                         "iterations_lost": 0, "recovery_s": RECOVERY_S, "time": now})
        step = 0.5 + 0.02 * math.sin(i)
        now += 10 * step
        rows.append({"iteration": i, "train_iters": 400, "consumed_samples": 64 * i,
                     "lm_loss": 11.0 * math.exp(-i / 120) + 2.5, "lr": 3e-4, "grad_norm": 0.9,
                     "skipped_iterations": 0, "step_time_s": step, "data_wait_s": 0.002 + i * 1e-6,
                     "tokens_per_s": 64 * 2048 / step, "tflops_per_device": 7.9e14 / step / 8e12,
                     "mfu": 7.9e14 / step / 8 / 312e12, "elapsed_s": now - group_start,
                     "eta_s": (400 - i) * step, "restarts": int(i > RESTART_AFTER),
                     "world_size": 8, "data_parallel_size": 4, "time": now})
        if moe:
            rows[-1].update(moe_load_balancing_loss=1.0 + 0.5 * math.exp(-i / 80),
                            moe_expert_load_max_over_mean=1.1 + 0.9 * math.exp(-i / 80))
        if i in (100, 200):
            now += 3.0
            rows.append({"iteration": i, "valid_lm_loss": rows[-1]["lm_loss"] + 0.2,
                         "valid_ppl": math.exp(rows[-1]["lm_loss"] + 0.2), "valid_samples": 128,
                         "eval_time_s": 3.0, "time": now})
        if i == RESTART_AFTER:
            now += 12.0
            rows.append({"event": "checkpoint", "iteration": i, "checkpoint": f"iter_{i:07d}",
                         "path": f"{out}/ray_train/run/iter_{i:07d}", "checkpoint_time_s": 12.0,
                         "save_blocking_s": 12.0, "time": now})
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def chromium() -> Path:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: the report is checked in a real browser. Install "
                    f"Debian's chromium: `make chromium` (as root it runs `apt-get install -y "
                    f"chromium`), or `sudo apt-get install chromium`", pytrace=False)
    return CHROMIUM


def render(page: Path, tmp_path: Path) -> tuple[str, str]:
    """The DOM headless Chromium builds from ``page``, and what Chromium logged meanwhile."""
    proc = subprocess.run(
        [str(chromium()), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={tmp_path / 'chromium-profile'}",
         "--enable-logging=stderr", "--v=0", "--dump-dom", page.resolve().as_uri()],
        capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "</html>" in proc.stdout, proc.stderr[-3000:]
    return proc.stdout, proc.stderr


def console_messages(log: str) -> list[tuple[str, str]]:
    """(level, message) of each page console message in Chromium's log: lines such as
    ``[pid:tid:time:INFO:CONSOLE:12] "text", source: file:///... (12)``. Chromium 156 logs
    console.error at INFO like every other level, so the level cannot tell them apart: the
    tests allow none at all (the report has no script; uncaught errors land here too)."""
    return re.findall(r":([A-Z]+):CONSOLE[^\]]*\] (.*)", log)


class Dom(HTMLParser):
    """What the checks need from the dumped DOM: charts, series points, markers, texts."""

    VOID = {"meta", "link", "br", "img", "input", "hr", "wbr", "col", "source"}

    def __init__(self, text: str) -> None:
        super().__init__()
        self.charts = 0
        self.tags = []  # every start tag's name
        self.polylines = {}  # series name -> [(chart number, [(x, y)])], a line per stretch
        self.circles = {}  # series name -> count
        self.markers = []  # (chart number, kind, x)
        self.texts = []  # (innermost element's tag, its class, text)
        self._stack = []  # open (tag, attrs)
        self.feed(text)

    def _inside(self, key: str) -> str:
        return next((a[key] for _, a in reversed(self._stack) if a.get(key)), "")

    def handle_starttag(self, tag, attrs):
        attrs = {k: v or "" for k, v in attrs}
        self.tags.append(tag)
        self.charts += tag == "svg"
        series = self._inside("data-name")
        if tag == "polyline":
            points = [tuple(map(float, p.split(","))) for p in attrs["points"].split()]
            self.polylines.setdefault(series, []).append((self.charts, points))
        elif tag == "circle":
            self.circles[series] = self.circles.get(series, 0) + 1
        elif tag == "line" and self._stack and "marker" in self._stack[-1][1].get("class", ""):
            kind = self._stack[-1][1]["class"].split()[-1]
            self.markers.append((self.charts, kind, float(attrs["x1"])))
        if tag not in self.VOID:
            self._stack.append((tag, attrs))

    def handle_endtag(self, tag):
        while self._stack and self._stack.pop()[0] != tag:
            pass

    def handle_data(self, data):
        if data.strip() and self._stack:
            tag, attrs = self._stack[-1]
            self.texts.append((tag, attrs.get("class", ""), data.strip()))

    def text_of(self, tag: str, cls: str = "") -> list[str]:
        return [t for g, c, t in self.texts if g == tag and cls in c.split() + [""]]


def test_report_renders_in_chromium(tmp_path):
    out = write_run(tmp_path / "qwen-run")
    page = write_report(out)
    assert page == out / "report.html"
    source = page.read_text()
    assert "://" not in source and "<script" not in source  # self-contained, no script
    dom_text, log = render(page, tmp_path)
    assert console_messages(log) == []
    dom = Dom(dom_text)

    assert dom.charts == 4  # loss, throughput, MFU (the rows carry it), data wait
    figures = dom.text_of("figcaption")
    assert figures == ["Loss", "Throughput", "Model FLOPs utilization", "Data wait"]
    [(_, loss)] = dom.polylines["training loss"]  # one line: iterations trained once each
    assert len(loss) == len(ITERATIONS)
    assert [y for _, y in loss] == sorted(y for _, y in loss)  # falling loss: rising on screen
    assert dom.circles["validation loss"] == 2

    # restarts and checkpoints on both time charts, labelled; the restart at the failure:
    # after iteration 150's window and its checkpoint, before the new group's first window,
    # where the line breaks (nothing trained in between)
    labels = dom.text_of("text", "marker-label")
    assert labels.count("restart 1") == 2 and labels.count("ckpt 150") == 2
    [(chart, first), (_, second)] = dom.polylines["tokens/s"]
    after = ITERATIONS.index(RESTART_AFTER) + 1
    assert (len(first), len(second)) == (after, len(ITERATIONS) - after)
    [restart_x] = [x for c, kind, x in dom.markers if c == chart and kind == "restart"]
    [checkpoint_x] = [x for c, kind, x in dom.markers if c == chart and kind == "checkpoint"]
    assert first[-1][0] < checkpoint_x < restart_x < second[0][0]
    assert [len(points) for _, points in dom.polylines["MFU"]] == [after, len(ITERATIONS) - after]

    # the header, the config section by section, escaped, and the plan
    summary = dom.text_of("dd")
    assert "300 / 400 (75 %)" in summary and "1 (last at iteration 150)" in summary
    assert dom.text_of("h3")[:6] == ["model", "parallel", "training", "data", "output",
                                     "cluster"]
    cells = dom.text_of("td")
    assert CORPUS in cells and "cosine" in cells and "52,428,800" in cells
    assert RUN_NAME in cells and "b" not in dom.tags  # shown as text, not bold markup
    assert any("ActorDiedError" in c for c in cells)  # the events table


def test_moe_run_has_an_expert_routing_chart(tmp_path):
    """Training rows with the moe_* keys add an "Expert routing" chart, last, with both
    figures per iteration on one axis; the same run without them (dense) has none."""
    dense = write_report(write_run(tmp_path / "dense")).read_text()
    assert "Expert routing" not in dense and "load-balancing loss" not in dense
    dom_text, log = render(write_report(write_run(tmp_path / "moe", moe=True)), tmp_path)
    assert console_messages(log) == []
    dom = Dom(dom_text)
    assert dom.charts == 5
    assert dom.text_of("figcaption") == ["Loss", "Throughput", "Model FLOPs utilization",
                                         "Data wait", "Expert routing"]
    # one line each, in the fifth chart, a point per logged iteration (the restart resumed at
    # a checkpoint, so no iteration was logged twice)
    [(chart, balancing)] = dom.polylines["load-balancing loss"]
    [(busiest_chart, busiest)] = dom.polylines["busiest expert / mean"]
    assert chart == busiest_chart == 5
    assert len(balancing) == len(busiest) == len(ITERATIONS)
    assert [x for x, _ in balancing] == [x for x, _ in busiest]
    # both fall with the iterations (rise on screen), and the busiest expert's share, the
    # larger figure at every iteration, is drawn above the balancing loss on the shared axis
    for line in (balancing, busiest):
        assert [y for _, y in line] == sorted(y for _, y in line)
    assert all(b[1] < a[1] for a, b in zip(balancing, busiest))


def test_console_errors_are_detected(tmp_path):
    """The console check can fail: the same page with a console.error is caught."""
    page = write_report(write_run(tmp_path / "run"))
    broken = page.with_name("broken.html")
    broken.write_text(page.read_text().replace(
        "</body>", '<script>console.error("intentional report error")</script></body>'))
    _, log = render(broken, tmp_path)
    messages = console_messages(log)
    assert len(messages) == 1 and "intentional report error" in messages[0][1], log[-3000:]


def test_report_of_a_run_without_training_rows(tmp_path):
    out = write_run(tmp_path / "starting")
    # the run has just started: a validation-free, iteration-free log, its last line half written
    (out / "metrics.jsonl").write_text('{"iteration": 1, "train_it')
    text = write_report(out).read_text()
    assert "No training iterations logged yet" in text and "<svg" not in text
    assert CORPUS in text  # the config is still shown


def test_entry_point(tmp_path):
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    script = str(REPO / "entrypoints" / "report.py")
    proc = subprocess.run([sys.executable, script, str(empty)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and str(empty) in proc.stderr and "metrics.jsonl" in proc.stderr
    out = write_run(tmp_path / "run")
    proc = subprocess.run([sys.executable, script, str(out)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out / "report.html") and (out / "report.html").is_file()
