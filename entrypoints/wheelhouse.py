"""Wheels for a machine that cannot reach a package registry: what ray_ppu needs that it lacks.

    python entrypoints/wheelhouse.py --have have.txt [--python 3.12] [--out wheelhouse]
                                     [--without-dashboard] [--extras tokenizers]
                                     [--no-slim] [--max-mib 60]
    # on the target:  pip install --no-index --find-links wheelhouse -r wheelhouse/requirements.txt

``have.txt``: the target's ``python3 -m pip list --format=freeze`` (or one name per line);
``cluster/images/nvidia-h200-cuda.txt`` is the image the device checks run on
(``benchmark.py device``). Ray's wheel is slimmed of what training never imports (its Java jars,
RLlib, Serve, LLM); ``--no-slim`` keeps it whole (ray_ppu.tools.wheelhouse).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ray_ppu.tools import wheelhouse  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--have", required=True, help="the target's pip freeze, or names")
    parser.add_argument("--out", default="wheelhouse", help="where the wheels go")
    parser.add_argument("--python", default="3.12", help="the target's Python (major.minor)")
    parser.add_argument("--no-slim", action="store_true", help="ship Ray's wheel whole")
    parser.add_argument("--without-dashboard", action="store_true",
                        help="Ray without its dashboard extra (~15 MiB less; benchmarks)")
    parser.add_argument("--extras", nargs="*", default=[],
                        help="ray_ppu extras to include (tokenizers: the Qwen2 vocabulary the "
                             "benchmarks tokenize their corpora with)")
    parser.add_argument("--max-mib", type=float, default=60.0,
                        help="refuse a wheelhouse larger than this (what one transfer carries)")
    args = parser.parse_args()
    have = Path(args.have)
    if not have.is_file():
        parser.error(f"--have {have}: no such file")
    out = Path(args.out)
    report = wheelhouse.build(out, wheelhouse.read_have(have), args.python,
                              slim=not args.no_slim, max_mib=args.max_mib,
                              dashboard=not args.without_dashboard,
                              extras=tuple(args.extras))
    for name, (version, mib) in sorted(report["wheels"].items(), key=lambda kv: -kv[1][1]):
        print(f"{mib:7.2f} MiB  {name}=={version}")
    print(f"{report['total_mib']} MiB in {len(report['wheels'])} wheels for Python "
          f"{report['python']} ({report['skipped_present']} distributions the target has "
          f"left out); install there with:\n  python3 -m pip install --no-index --find-links "
          f"{out} -r {out}/requirements.txt")


if __name__ == "__main__":
    main()
