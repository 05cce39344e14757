# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Several `vllm bench serve` runs in one process: vLLM's own bench-serve
argument parser and `main`, imported once, called once per argument list.

The CLI imports vLLM for every run (20-30 s on the H200 host, 4-7 s of
requests per workload), which kept the 8B TP 2 benchmark from fitting a
10-minute call. Each run is the CLI's code with the CLI's arguments; a run
that fails prints its error and the next one still runs.

    python benchmarks/kv_checksum_bench_serve_batch.py RUNS.json
    python benchmarks/kv_checksum_bench_serve_batch.py --stdin

RUNS.json: a JSON list of argument lists (what follows `vllm bench serve`).
Exits 1 if any run failed. `--stdin`: one argument list (JSON) per input line,
each answered by a line `[bench_batch] done FAILED` (0 or 1) once it ran, so a
driver can read engine counters between runs; ends at end of input.
"""

import gc
import json
import sys
import traceback
from pathlib import Path


def run_all(runs: list[list[str]]) -> int:
    """Each argument list through vLLM's bench-serve parser and `main`;
    the number of runs that raised."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    failed = 0
    for argv in runs:
        parser = FlexibleArgumentParser(prog="vllm bench serve")
        add_cli_args(parser)
        print(f"[bench_batch] vllm bench serve {' '.join(argv)}", flush=True)
        try:
            main(parser.parse_args(argv))
        except (Exception, SystemExit):  # one bad run must not stop the rest
            failed += 1
            print(f"[bench_batch] run failed:\n{traceback.format_exc()}", flush=True)
        # The last run's garbage collected now, not inside the next one's timing.
        gc.collect()
    return failed


DONE = "[bench_batch] done"


def serve_stdin() -> int:
    """Run each argument list read from stdin, answering DONE after each;
    the number of runs that failed."""
    failed = 0
    for line in sys.stdin:
        if not line.strip():
            continue
        ran = run_all([json.loads(line)])
        failed += ran
        print(f"{DONE} {ran}", flush=True)
    return failed


if __name__ == "__main__":
    if sys.argv[1:] == ["--stdin"]:
        sys.exit(1 if serve_stdin() else 0)
    sys.exit(1 if run_all(json.loads(Path(sys.argv[1]).read_text())) else 0)
