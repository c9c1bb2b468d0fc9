"""``python -m braid.viz TRACE.json [MORE.json ...] -o timeline.html [--chrome out.json] [--plotlyjs MODE]``.

Renders every trace of the given files into one interactive HTML timeline (a dropdown when
there are several; a simulated and a measured trace of one schedule are laid side by side;
a mixture-of-experts run's expert load, where its trace carries it, in a column beside them)
and, with ``--chrome``, writes the first trace as Chrome-trace JSON for Perfetto. A missing,
corrupt, wrong-schema (malformed expert load included) or empty trace file, an output that cannot be written or that names
an input is one line on stderr and exit code 2, before anything is rendered.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Sequence

from braid.io.cli import Parser, check_outputs, run_main
from braid.io.files import atomic_write_text
from braid.io.trace import TraceError, load_traces


def _parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m braid.viz",
        description="Render braid traces (simulated or measured) as an interactive timeline in one HTML file.",
    )
    p.add_argument("traces", nargs="+", type=Path, help="trace files written by the simulator or the executor")
    p.add_argument("-o", "--output", type=Path, default=Path("timeline.html"), help="HTML file to write")
    p.add_argument("--chrome", type=Path, default=None,
                   help="also write the first trace as Chrome-trace JSON (open it in ui.perfetto.dev)")  # fmt: skip
    p.add_argument("--plotlyjs", choices=("inline", "cdn", "directory"), default="inline",
                   help="embed plotly.js (offline, default), link the CDN, or write plotly.min.js next to the HTML")  # fmt: skip
    p.add_argument("--title", default=None, help="title shown above the timeline")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Render the traces; bad input is one line on stderr and exit code 2."""
    ap = _parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    check_outputs(ap, [("-o", args.output), ("--chrome", args.chrome)], inputs=args.traces)
    from braid.viz.timeline import PlotlyMissingError, require_plotly

    try:
        require_plotly()
    except PlotlyMissingError as err:
        ap.error(str(err))
    try:
        traces = []
        for path in args.traces:
            for i, t in enumerate(load_traces(path)):
                if not t.events:
                    raise TraceError(f"{path}: trace {i} has no events; nothing to render")
                traces.append(t)
    except TraceError as err:
        ap.error(str(err))
    from braid.viz.chrome import to_chrome_trace
    from braid.viz.html import render_html

    try:
        out = render_html(traces, args.output, plotlyjs=args.plotlyjs, title=args.title)
    except ValueError as err:
        ap.error(str(err))
    print(f"wrote {out}")
    if args.chrome is not None:
        atomic_write_text(args.chrome, json.dumps(to_chrome_trace(traces[0])))
        print(f"wrote {args.chrome}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
