"""Pretrain or fine-tune a Qwen2.5 / Qwen3 / Qwen3-MoE / LLaMA-3.1 model with Megatron-Core
worker groups on Ray (model.preset: 0.5B … 72B or qwen2.5-7B, qwen3-0.6B … qwen3-32B,
qwen3-30B-A3B, qwen3-235B-A22B, llama3.1-8B, llama3.1-70B; or checkpoint.pretrained=HF_DIR).

    python entrypoints/pretrain.py                       # the demo, on a local Ray
    python entrypoints/pretrain.py --config run.yaml [section.field=value ...] [--dry-run]
    python entrypoints/pretrain.py --help-config [SECTION]   # every config field, documented
    ray job submit --address http://127.0.0.1:8265 --working-dir . \\
        --runtime-env cluster/runtime_env.yaml -- python entrypoints/pretrain.py --config run.yaml

With RAY_ADDRESS set (as under ``ray job submit``) the job joins that cluster; otherwise it
starts a local Ray that advertises simulated PPUs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ray_ppu import quiet  # noqa: E402
from ray_ppu.config.loader import load  # noqa: E402
from ray_ppu.errors import ConfigError, UserError, entry_point  # noqa: E402
from ray_ppu.plan import build_plan  # noqa: E402
from ray_ppu.launch.output import absolute_paths  # noqa: E402

DEMO_CONFIG = REPO / "entrypoints" / "configs" / "demo.yaml"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML run config (default: the demo)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check what the launch checks before it needs a cluster (the memory "
                             "plan, corpora or SFT files and tokenizer, the checkpoint to start "
                             "from) and print the resolved config, the plan, the Megatron-Core "
                             "settings and the memory plan as JSON, a summary on stderr; start "
                             "and write nothing; exit 2 on a problem (with RAY_ADDRESS set: also "
                             "the preflight checks of every PPU node of that cluster)")
    parser.add_argument("--plan-only", action="store_true",
                        help="with --dry-run: skip the file checks (data, tokenizer, checkpoint), "
                             "for planning on a machine that does not have them")
    parser.add_argument("--help-config", nargs="?", const="", metavar="SECTION",
                        help="list every config field (or one section's: model, parallel, "
                             "training, memory, data, output, cluster, checkpoint) with its type, "
                             "default and description, then exit")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value")
    args = parser.parse_args(argv)
    if args.help_config is not None:
        from ray_ppu.config.reference import format_reference, sections

        if args.help_config and args.help_config not in sections():
            parser.error(f"--help-config {args.help_config}: no such section (sections: "
                         f"{', '.join(sections())})")
        print(format_reference(args.help_config or None), end="")
        parser.exit(0)
    return args


def dry_run(cfg, plan, files: bool = True, demo: bool = False) -> tuple[dict, list[str], list[str]]:
    """``(result, summary lines, problems)``: the resolved config, the plan (batches,
    iterations, FLOPs per iteration), the Megatron-Core settings the workers will build and the
    memory plan of one device; the launch's local checks (:mod:`ray_ppu.launch.local_checks`,
    ``files=False``: the memory plan only; ``demo``: not its corpus, which its launch makes); with RAY_ADDRESS set, the preflight report of that
    cluster's PPU nodes (:mod:`ray_ppu.launch.preflight`: paths writable / readable there,
    Transformer Engine, device)."""
    from ray_ppu.launch import local_checks
    from ray_ppu.model.megatron_settings import describe
    from ray_ppu.plan.memory import memory_plan
    from ray_ppu.plan.summary import summary_lines

    te = cfg.cluster.device != "cpu"  # PPU / GPU images carry Transformer Engine
    memory = memory_plan(cfg, plan)
    result = {"config": cfg.to_dict(), "plan": plan.to_dict(),
              "megatron": describe(cfg, plan, te), "memory": memory.to_dict()}
    lines, problems = summary_lines(cfg, plan, memory), []
    try:
        checked = local_checks.check(cfg, plan, files=files, data=not demo)
        lines += checked.lines + [f"warning: {line}" for line in checked.warnings]
    except UserError as err:
        problems.append(str(err))
    if not files:
        lines.append(f"not checked (--plan-only): {'; '.join(local_checks.unchecked(cfg))}")
    if os.environ.get("RAY_ADDRESS"):
        result["preflight"] = _preflight(cfg)
        if not result["preflight"]["ok"]:
            problems.append("preflight found problems:\n  " +
                            "\n  ".join(result["preflight"]["problems"]))
    result["problems"] = problems
    return result, lines, problems


def _preflight(cfg) -> dict:
    """Join the cluster in RAY_ADDRESS (unless already connected) and run the preflight."""
    import ray

    from ray_ppu.errors import ClusterError
    from ray_ppu.launch import preflight, ray_connect

    joined = not ray.is_initialized()
    if joined:
        try:
            ray_connect.check_reachable(os.environ["RAY_ADDRESS"], cfg.cluster.connect_timeout_s)
            ray.init(log_to_driver=False)  # RAY_ADDRESS names the cluster
        except ClusterError as err:
            return {"ok": False, "nodes": [], "problems": [str(err)]}
        except ConnectionError as err:
            problem = f"cannot join the cluster at RAY_ADDRESS={os.environ['RAY_ADDRESS']}: {err}"
            return {"ok": False, "nodes": [], "problems": [problem]}
    try:
        return preflight.node_reports(cfg)
    finally:
        if joined:
            ray.shutdown()


def main(argv=None) -> int:
    args = parse_args(argv)
    quiet.plain_output()  # before Ray is imported: no colour codes in a log file
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        with warnings.catch_warnings(record=True) as notes:
            warnings.simplefilter("always")
            files = not args.plan_only  # --plan-only: from the config alone
            cfg = absolute_paths(load(args.config or DEMO_CONFIG, args.overrides, files=files))
            plan = build_plan(cfg, files=files)
        # the demo builds its own corpus; the demo's settings on a user's corpus do not (it
        # would have been written beside theirs, then found missing)
        demo = args.config is None and cfg.data.data_path == _demo_data_path()
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for note in notes:
        logging.warning("%s", note.message)
    if args.dry_run:
        result, lines, problems = dry_run(cfg, plan, files=not args.plan_only, demo=demo)
        print("\n".join(lines), file=sys.stderr)
        print(json.dumps(result, indent=2))
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2 if problems else 0

    from ray_ppu.launch.launcher import connect, launch, shutdown
    from ray_ppu.monitor.trackers import feeding

    started = False
    try:
        if demo:
            # The demo's corpus is made the way users make theirs: JSONL shards tokenized by
            # Ray Data with a Hugging Face tokenizer (preprocess_data.py's code path).
            from ray_ppu.tools.demo import build_demo_corpus

            started = connect(cfg)  # the Ray (with simulated PPUs) the run will use too
            build_demo_corpus(Path(cfg.data.data_path[0]).parent)
        with feeding(cfg, plan) as trackers:  # None without output.trackers
            final = launch(cfg, plan)
            report = _report(cfg)
            if trackers is not None:
                status = "KILLED" if "stopped_at" in final else "FINISHED"  # SIGTERM: saved
                final["trackers"] = trackers.finish(status, [
                    *(Path(cfg.output.dir) / n for n in ("config.yaml", "plan.json")),
                    *([report] if report else [])])
                if any(t["dropped"] for t in final["trackers"].values()):
                    _report(cfg)  # again: its events now say what the trackers lost
    except UserError as err:  # config, cluster, corpus, checkpoint: one line, not a traceback
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: workers stopped", file=sys.stderr)
        return 130
    finally:
        if started:
            shutdown()
    print(json.dumps({"final": final}))
    if "stopped_at" in final:  # SIGTERM: saved and stopped early; the same command resumes
        return 143
    return 0


def _demo_data_path() -> list[str]:
    """The corpus the demo config names (absolute), which the demo builds."""
    return absolute_paths(load(DEMO_CONFIG, [])).data.data_path


def _report(cfg):
    """The run report (``output.report``): its path, or None."""
    if not cfg.output.report:
        return None
    from ray_ppu.monitor.report import write_report

    path = write_report(cfg.output.dir)
    logging.info("run report: %s", path)
    return path


if __name__ == "__main__":
    sys.exit(entry_point(main))
