#!/usr/bin/env python3
"""llm-sandbox (PyPI) on the local Docker engine and sandgate's image: what a user gets instead.

Measures, with loops bounded in count and time:
  - SandboxSession: open + first run of `print(1+1)` + close (a fresh sandbox per conversation);
  - SandboxSession: a repeated run on an open session (no state kept between runs);
  - InteractiveSandboxSession (IPython, state kept): open, and a repeated run of `1+1`.

The image is sandgate's own image with a `python` name and `sleep infinity` as its command (see
llm-sandbox.Dockerfile); it is never pulled. Containers get `--init` and no network, like
sandgate's. Prints one JSON object on stdout: {"rows": [{"name", "samples_ms", "errors"}]}.
"""

import argparse
import json
import sys
import time
import traceback


def runtime_configs():
    return {
        "command": ["sleep", "infinity"],
        "init": True,
        "network_mode": "none",
        "labels": {"sandgate.bench": "llm-sandbox"},
    }


def timed(samples, errors, fn, deadline):
    if time.monotonic() > deadline:
        return None
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception:  # noqa: BLE001 - a failure is counted and shown, not fatal
        errors.append(traceback.format_exc(limit=3))
        return None
    samples.append((time.perf_counter() - t0) * 1000.0)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--image", required=True)
    ap.add_argument("--sessions", type=int, default=5)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--budget-seconds", type=float, default=180.0)
    args = ap.parse_args()

    from llm_sandbox import InteractiveSandboxSession, SandboxSession

    deadline = time.monotonic() + args.budget_seconds
    rows = []

    def session():
        return SandboxSession(
            lang="python",
            image=args.image,
            runtime_configs=runtime_configs(),
            skip_environment_setup=True,
            keep_template=True,
            verbose=False,
        )

    # Fresh sandbox per conversation: open + first run + close.
    samples, errors = [], []

    def open_run_close():
        with session() as s:
            out = s.run("print(1+1)")
            if out.exit_code != 0 or out.stdout.strip() != "2":
                raise RuntimeError(f"unexpected output: {out!r}")

    # One unmeasured round first: the Docker client's first connection and imports.
    timed([], [], open_run_close, deadline)
    for _ in range(args.sessions):
        timed(samples, errors, open_run_close, deadline)
    rows.append({"name": "llm_sandbox.open_run_close", "samples_ms": samples, "errors": errors})

    # Repeated run on an open session (each run is a new `python file.py`: no state).
    samples, errors = [], []
    with session() as s:
        s.run("print(1+1)")

        def run():
            out = s.run("print(1+1)")
            if out.stdout.strip() != "2":
                raise RuntimeError(f"unexpected output: {out!r}")

        for _ in range(args.runs):
            timed(samples, errors, run, deadline)
    rows.append({"name": "llm_sandbox.run", "samples_ms": samples, "errors": errors})

    # Interactive (IPython) session: state kept between runs.
    open_samples, open_errors = [], []
    samples, errors = [], []
    holder = {}

    def open_interactive():
        s = InteractiveSandboxSession(
            image=args.image,
            runtime_configs=runtime_configs(),
            skip_environment_setup=True,
            keep_template=True,
            max_memory=None,
            verbose=False,
        )
        s.open()
        holder["s"] = s

    timed(open_samples, open_errors, open_interactive, deadline)
    s = holder.get("s")
    if s is not None:
        try:
            s.run("x = 1")

            def run_interactive():
                out = s.run("print(x + 1)")
                if out.stdout.strip() != "2":
                    raise RuntimeError(f"unexpected output: {out!r}")

            for _ in range(args.runs):
                timed(samples, errors, run_interactive, deadline)
        finally:
            s.close()
    rows.append({"name": "llm_sandbox.interactive_open", "samples_ms": open_samples, "errors": open_errors})
    rows.append({"name": "llm_sandbox.interactive_run", "samples_ms": samples, "errors": errors})

    json.dump({"rows": rows}, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
