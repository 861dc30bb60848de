#!/usr/bin/env python3
"""sandgate's series driven by the official MCP Python SDK, run by the benchmark
(crates/sandgate/benches/mcp/series.rs) against a real `sandgate serve` in its default
configuration:

* ``back-to-back``: 30 conversations opened and closed one after another on one client
  (create_sandbox, execute_code 1+1, close_sandbox), then execute_code 1+1 repeated on one sandbox
  by the same client, for the ratios the goals are stated in;
* ``open-loop``: whole support-analyst conversations (create, upload a 10 000-row CSV, pandas
  group-by, matplotlib chart, get_file of the chart, close), each on its own client connection,
  arriving at the given rates per minute as a seeded Poisson process for a fixed time; a
  conversation's time runs from its scheduled arrival (so a client that falls behind counts), and
  the pool is never waited for between conversations. For each rate it also takes the CPU time
  spent meanwhile by component: dockerd, containerd and the runc shims, the sandbox containers
  (their cgroups), the gateway, Postgres, and this client; with ``--engine-cpuacct`` also the
  engine as a whole (a cgroup v1 ``cpuacct.usage`` holding dockerd, containerd and everything they
  start outside the containers: shims, runc, runsc's commands).

Prints one JSON object: ``{"rows": [...], "levels": [...]}`` (rows like the peers' scripts).
Network traffic goes to the given loopback URL only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import sys
import threading
import time
import uuid

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

TICKS = os.sysconf("SC_CLK_TCK")

GROUP_BY = (
    "import pandas as pd\n"
    "df = pd.read_csv('tickets.csv')\n"
    "summary = df.groupby('region').agg(tickets=('ticket_id', 'count'), "
    "mean_minutes=('minutes', 'mean'), csat=('csat', 'mean')).round(2)\n"
    "summary"
)
CHART = (
    "import matplotlib.pyplot as plt\n"
    "fig, ax = plt.subplots(figsize=(6, 4))\n"
    "summary['mean_minutes'].plot.bar(ax=ax, color='#4c72b0')\n"
    "ax.set_title('Mean minutes to resolve, by region')\n"
    "ax.set_ylabel('minutes')\n"
    "fig.savefig('chart.png')\n"
    "plt.show()"
)


def tickets_csv() -> str:
    rng = random.Random(0x5EEDCAFE)
    regions = ["EMEA", "NA", "LATAM", "APAC"]
    products = ["billing", "login", "shipping", "returns", "api"]
    lines = ["ticket_id,region,product,minutes,csat"]
    for i in range(10_000):
        lines.append(
            f"{i},{rng.choice(regions)},{rng.choice(products)},{rng.randrange(5, 605)},{rng.randint(1, 5)}"
        )
    return "\n".join(lines) + "\n"


class CallFailed(Exception):
    pass


async def call(client: Client, tool: str, args: dict) -> dict:
    result = await client.call_tool(tool, args)
    if result.is_error:
        text = " ".join(getattr(b, "text", "") for b in result.content)[:300]
        raise CallFailed(f"{tool}: isError: {text}")
    return result


def connect(url: str, token: str, mode: str):
    http = httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(60.0, read=300.0)
    )
    return http, Client(streamable_http_client(url, http_client=http), mode=mode)


def describe(e: BaseException) -> str:
    """What failed, under the SDK's task groups: the first leaf of an ExceptionGroup."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return f"{type(e).__name__}: {e}"


def row(name: str, samples_ms: list[float], errors: list[str], **extra) -> dict:
    return {"name": name, "samples_ms": samples_ms, "errors": errors, "extra": extra}


# ------------------------------------------------------------------------------------------------
# Back to back


async def back_to_back(url: str, token: str, mode: str, count: int, execs: int) -> list[dict]:
    create, first_exec, close, exec_1p1 = [], [], [], []
    errors: list[str] = []
    http, client = connect(url, token, mode)
    async with http, client:
        for i in range(count):
            try:
                t = time.perf_counter()
                created = await call(client, "create_sandbox", {"conversation_id": f"b2b-{uuid.uuid4().hex}"})
                create.append((time.perf_counter() - t) * 1000)
                sid = created.structured_content["sandbox_id"]
                t = time.perf_counter()
                await call(client, "execute_code", {"sandbox_id": sid, "code": "1+1"})
                first_exec.append((time.perf_counter() - t) * 1000)
                t = time.perf_counter()
                await call(client, "close_sandbox", {"sandbox_id": sid})
                close.append((time.perf_counter() - t) * 1000)
            except Exception as e:  # noqa: BLE001 - counted and reported
                errors.append(f"conversation {i}: {describe(e)}"[:300])
        created = await call(client, "create_sandbox", {})
        sid = created.structured_content["sandbox_id"]
        for _ in range(execs):
            t = time.perf_counter()
            await call(client, "execute_code", {"sandbox_id": sid, "code": "1+1"})
            exec_1p1.append((time.perf_counter() - t) * 1000)
        await call(client, "close_sandbox", {"sandbox_id": sid})
    return [
        row("sdk.b2b_create", create, errors),
        row("sdk.b2b_first_exec", first_exec, []),
        row("sdk.b2b_close", close, []),
        row("sdk.exec_1p1", exec_1p1, []),
    ]


# ------------------------------------------------------------------------------------------------
# CPU by component


def proc_cpu(pid: int, children: bool = False) -> float:
    """CPU seconds of a process (with its reaped children's when asked); 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # Fields after the name: state is [0]; utime [11], stime [12], cutime [13], cstime [14].
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / TICKS


def processes() -> list[tuple[int, int, str]]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                text = f.read()
        except OSError:
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        ppid = int(text.rsplit(")", 1)[1].split()[1])
        out.append((int(entry), ppid, name))
    return out


CGROUP_DIRS = ("/sys/fs/cgroup/cpuacct/docker", "/sys/fs/cgroup/docker", "/sys/fs/cgroup/system.slice")


def container_cpu(container_id: str) -> float | None:
    for base in CGROUP_DIRS:
        for path in (f"{base}/{container_id}/cpuacct.usage", f"{base}/docker-{container_id}.scope/cpu.stat",
                     f"{base}/{container_id}/cpu.stat"):
            try:
                with open(path) as f:
                    text = f.read()
            except OSError:
                continue
            if path.endswith("cpuacct.usage"):
                return int(text) / 1e9
            for line in text.splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) / 1e6
    return None


def container_ids() -> list[str]:
    for base in CGROUP_DIRS:
        try:
            names = os.listdir(base)
        except OSError:
            continue
        ids = [n.removeprefix("docker-").removesuffix(".scope") for n in names]
        return [i for i in ids if len(i) == 64]
    return []


def is_ours(container_id: str, instance: str) -> bool:
    try:
        with open(f"/var/lib/docker/containers/{container_id}/config.v2.json") as f:
            labels = json.load(f).get("Config", {}).get("Labels") or {}
    except (OSError, ValueError):
        return False
    return labels.get("sandgate.instance") == instance


class CpuSampler:
    """Samples, every 100 ms, the CPU of things that come and go during a level (sandbox containers
    of the instance and runc shims), keeping each one's last value; long-lived processes are read
    at the start and the end."""

    def __init__(self, instance: str, gateway_pid: int, engine_cpuacct: str = ""):
        self.instance = instance
        self.gateway_pid = gateway_pid
        self.engine_cpuacct = engine_cpuacct
        self.ours: dict[str, bool] = {}
        # container id -> [CPU seconds when first seen (0 if started during the level), last seen]
        self.containers: dict[str, list[float]] = {}
        self.shims: dict[int, float] = {}
        self.shim_base: dict[int, float] = {}
        self.stop = threading.Event()
        self.start_fixed = self.fixed()
        for pid, _, name in processes():
            if name.startswith("containerd-shim"):
                self.shim_base[pid] = proc_cpu(pid)
        for cid in container_ids():
            if self.ours.setdefault(cid, is_ours(cid, instance)):
                now = container_cpu(cid) or 0.0
                self.containers[cid] = [now, now]  # counted from now
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def fixed(self) -> dict[str, float]:
        totals = {"dockerd": 0.0, "containerd": 0.0, "postgres": 0.0}
        procs = processes()
        postmasters = {pid for pid, ppid, name in procs if name == "postgres" and ppid not in
                       {p for p, _, n in procs if n == "postgres"}}
        for pid, ppid, name in procs:
            if name == "dockerd":
                totals["dockerd"] += proc_cpu(pid)
            elif name == "containerd":
                totals["containerd"] += proc_cpu(pid)
            elif name == "postgres" and pid in postmasters:
                totals["postgres"] += proc_cpu(pid, children=True)  # reaped backends included
            elif name == "postgres" and ppid in postmasters:
                totals["postgres"] += proc_cpu(pid)  # live backends
        totals["gateway"] = proc_cpu(self.gateway_pid)
        if self.engine_cpuacct:
            with open(self.engine_cpuacct) as f:
                totals["engine"] = int(f.read()) / 1e9
        usage = resource.getrusage(resource.RUSAGE_SELF)
        totals["client"] = usage.ru_utime + usage.ru_stime
        return totals

    def sample(self) -> None:
        for cid in container_ids():
            if cid not in self.ours:
                self.ours[cid] = is_ours(cid, self.instance)
            if self.ours[cid]:
                value = container_cpu(cid)
                if value is not None:
                    self.containers.setdefault(cid, [0.0, 0.0])[1] = value
        for pid, _, name in processes():
            if name.startswith("containerd-shim"):
                self.shims[pid] = proc_cpu(pid) - self.shim_base.get(pid, 0.0)

    def run(self) -> None:
        while not self.stop.wait(0.1):
            self.sample()

    def finish(self) -> dict[str, float]:
        self.stop.set()
        self.thread.join()
        self.sample()
        end = self.fixed()
        out = {k: end[k] - self.start_fixed[k] for k in end}
        out["shims"] = sum(max(v, 0.0) for v in self.shims.values())
        out["sandboxes"] = sum(max(last - first, 0.0) for first, last in self.containers.values())
        return out


# ------------------------------------------------------------------------------------------------
# Open loop


async def analyst(url: str, token: str, mode: str, csv: str) -> None:
    http, client = connect(url, token, mode)
    async with http, client:
        created = await call(client, "create_sandbox", {"conversation_id": f"ol-{uuid.uuid4().hex}"})
        sid = created.structured_content["sandbox_id"]
        await call(client, "upload_file", {"sandbox_id": sid, "path": "tickets.csv", "content_text": csv})
        analysed = await call(client, "execute_code", {"sandbox_id": sid, "code": GROUP_BY})
        if "EMEA" not in " ".join(getattr(b, "text", "") for b in analysed.content):
            raise CallFailed("the group-by did not show the regions")
        chart = await call(client, "execute_code", {"sandbox_id": sid, "code": CHART})
        if not any(getattr(b, "type", "") == "image" for b in chart.content):
            raise CallFailed("the chart cell returned no image")
        got = await call(client, "get_file", {"sandbox_id": sid, "path": "chart.png"})
        if not any(getattr(b, "type", "") == "image" for b in got.content):
            raise CallFailed("get_file chart.png returned no image")
        await call(client, "close_sandbox", {"sandbox_id": sid})


async def open_loop_level(args, rate: float, csv: str) -> tuple[dict, dict]:
    rng = random.Random(args.seed * 1000 + int(rate))
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(rate / 60.0)
        if t >= args.duration:
            break
        arrivals.append(t)
    sampler = CpuSampler(args.instance, args.gateway_pid, args.engine_cpuacct)
    start = time.perf_counter()
    times: list[float] = []
    errors: list[str] = []

    async def one(at: float) -> None:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        try:
            await asyncio.wait_for(analyst(args.url, args.token, args.mode, csv), args.timeout)
            times.append((time.perf_counter() - (start + at)) * 1000)
        except Exception as e:  # noqa: BLE001 - counted and reported
            errors.append(describe(e)[:300])

    await asyncio.gather(*(one(at) for at in arrivals))
    wall = time.perf_counter() - start
    cpu = sampler.finish()
    done = max(len(times), 1)
    level = {
        "rate_per_min": rate,
        "arrivals": len(arrivals),
        "completed": len(times),
        "errors": len(errors),
        "wall_s": wall,
        "cpu_s": cpu,
        "cpu_s_per_conversation": {k: v / done for k, v in cpu.items()},
    }
    name = f"sdk.open_loop_{int(rate)}"
    return row(name, times, errors, rate_per_min=rate, arrivals=len(arrivals), wall_s=wall), level


async def open_loop(args) -> tuple[list[dict], list[dict]]:
    csv = tickets_csv()
    rows, levels = [], []
    for rate in args.rates:
        print(f"[series] open loop at {rate:g}/min for {args.duration:g} s", file=sys.stderr)
        r, level = await open_loop_level(args, rate, csv)
        rows.append(r)
        levels.append(level)
    return rows, levels


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--mode", default="auto", help="the SDK's protocol mode (default: its own)")
    p.add_argument("--back-to-back", type=int, default=30, help="conversations in the series (0: skip)")
    p.add_argument("--execs", type=int, default=100, help="1+1 calls for the ratio")
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",") if x], default=[])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
    p.add_argument("--timeout", type=float, default=180.0, help="give up on a conversation after this")
    p.add_argument("--seed", type=int, default=16)
    p.add_argument("--instance", default="")
    p.add_argument("--engine-cpuacct", default="", help="a cgroup v1 cpuacct.usage holding the engine")
    p.add_argument("--gateway-pid", type=int, default=0)
    args = p.parse_args()
    rows: list[dict] = []
    levels: list[dict] = []
    if args.back_to_back:
        print(f"[series] back to back x{args.back_to_back}", file=sys.stderr)
        rows += asyncio.run(back_to_back(args.url, args.token, args.mode, args.back_to_back, args.execs))
    if args.rates:
        more, levels = asyncio.run(open_loop(args))
        rows += more
    json.dump({"rows": rows, "levels": levels}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
