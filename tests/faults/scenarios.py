"""The fault tests' multi-node scenarios, each on a simulated cluster with its own Ray:

    python tests/faults/scenarios.py recovery [--reference] [--drain] [--hard] --dir DIR
        --corpus PREFIX --json FILE [--timeout S]
    python tests/faults/scenarios.py elastic [--reference] --dir DIR --corpus PREFIX --json FILE

tests/test_faults.py runs them in a subprocess (the session's Ray cannot host a cluster whose
nodes come and go) and reads the --json result. The scenarios themselves are library code
(ray_ppu/tools/bench/recovery.py, elastic.py), since ``benchmark.py recovery`` / ``elastic``
measure the same runs; this is the tests' own front end, so they depend on no benchmark
script: the same flags and the same result, each scenario's child re-running this file.

Not a test module (pytest collects test_*.py only).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from ray_ppu.tools.bench import elastic, recovery  # noqa: E402
from ray_ppu.tools.bench.common import subcommand_parser  # noqa: E402

SCENARIOS = {"recovery": recovery, "elastic": elastic}


def main() -> None:
    parser, _ = subcommand_parser(__doc__, "scenario", SCENARIOS)
    args = parser.parse_args()
    SCENARIOS[args.scenario].main(args, Path(__file__))


if __name__ == "__main__":
    main()
