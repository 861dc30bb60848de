#!/usr/bin/env python3
"""Jupyter, the other thing a user would pick: jupyter-kernel-gateway on the host (loopback) and,
as the floor of any Jupyter-based design, an ipykernel reached directly over ZMQ.

Measures, with loops bounded in count and time:
  - kernel gateway: kernel start (POST /api/kernels, open its websocket, kernel_info answered);
  - kernel gateway: `1+1` over the websocket (execute_request until the execute_reply and the
    kernel's return to idle), on a client socket with TCP_NODELAY set;
  - ipykernel over ZMQ (jupyter_client): `1+1`, same completion rule.

Kernels run on the host with this virtualenv's ipykernel (not in a container: that is how a user
would run the kernel gateway). Prints {"rows": [{"name", "samples_ms", "errors"}]} on stdout.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import traceback
import uuid
import urllib.request

import websocket  # websocket-client


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method, url, body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        raw = resp.read()
        return json.loads(raw) if raw else None


def message(msg_type, content, session):
    return {
        "header": {
            "msg_id": uuid.uuid4().hex,
            "msg_type": msg_type,
            "username": "bench",
            "session": session,
            "date": "",
            "version": "5.3",
        },
        "parent_header": {},
        "metadata": {},
        "content": content,
        "channel": "shell",
        "buffers": [],
    }


def await_reply(ws, msg_id, reply_type, need_idle, quickack=False):
    got_reply = False
    got_idle = not need_idle
    while not (got_reply and got_idle):
        if quickack:
            # Not sticky in Linux: re-armed before every read.
            ws.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        msg = json.loads(ws.recv())
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind = msg["header"]["msg_type"]
        if kind == reply_type:
            got_reply = True
            if msg["content"].get("status") not in (None, "ok"):
                raise RuntimeError(f"kernel answered {msg['content']}")
        elif kind == "status" and msg["content"].get("execution_state") == "idle":
            got_idle = True


def connect(base_ws, kernel_id):
    # TCP_NODELAY on the client: without it, Nagle plus the server's delayed ACK add ~40 ms.
    return websocket.create_connection(
        f"{base_ws}/api/kernels/{kernel_id}/channels",
        timeout=30,
        sockopt=((socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),),
    )


def timed(samples, errors, fn, deadline):
    if time.monotonic() > deadline:
        return None
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception:  # noqa: BLE001
        errors.append(traceback.format_exc(limit=3))
        return None
    samples.append((time.perf_counter() - t0) * 1000.0)
    return out


def kernel_gateway(args, deadline, rows):
    port = free_port()
    jupyter = os.path.join(os.path.dirname(sys.executable), "jupyter")
    proc = subprocess.Popen(
        [jupyter, "kernelgateway", "--KernelGatewayApp.ip=127.0.0.1", f"--KernelGatewayApp.port={port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    base_ws = f"ws://127.0.0.1:{port}"
    try:
        start_deadline = time.monotonic() + 30
        while True:
            try:
                http("GET", f"{base}/api")
                break
            except OSError:
                if time.monotonic() > start_deadline or proc.poll() is not None:
                    raise RuntimeError("the kernel gateway did not start") from None
                time.sleep(0.1)

        start_samples, start_errors = [], []
        session = uuid.uuid4().hex

        def start_kernel():
            kernel = http("POST", f"{base}/api/kernels", {"name": "python3"})
            ws = connect(base_ws, kernel["id"])
            try:
                # A fresh kernel may miss the first request while it starts: ask until it answers.
                while True:
                    msg = message("kernel_info_request", {}, session)
                    ws.send(json.dumps(msg))
                    ws.settimeout(0.5)
                    try:
                        await_reply(ws, msg["header"]["msg_id"], "kernel_info_reply", False)
                        break
                    except websocket.WebSocketTimeoutException:
                        continue
            finally:
                ws.close()
            return kernel["id"]

        kernels = []
        for i in range(args.kernels + 1):
            kid = timed(start_samples if i else [], start_errors, start_kernel, deadline)
            if kid:
                kernels.append(kid)
        for kid in kernels[1:]:
            http("DELETE", f"{base}/api/kernels/{kid}")
        rows.append({"name": "kernel_gateway.kernel_start", "samples_ms": start_samples, "errors": start_errors})

        samples, errors = [], []
        if kernels:
            ws = connect(base_ws, kernels[0])
            ws.settimeout(30)

            def execute(quickack):
                msg = message("execute_request", {"code": "1+1", "silent": False, "store_history": True,
                                                  "user_expressions": {}, "allow_stdin": False}, session)
                ws.send(json.dumps(msg))
                await_reply(ws, msg["header"]["msg_id"], "execute_reply", True, quickack)

            for i in range(args.runs + 5):
                timed(samples if i >= 5 else [], errors, lambda: execute(False), deadline)
            # The same with TCP_QUICKACK on the client: the kernel gateway writes each message
            # separately without TCP_NODELAY on its side, so Nagle waits for the client's delayed
            # ACK; a client that acknowledges at once avoids the ~40 ms stall.
            quick, quick_errors = [], []
            for _ in range(args.runs):
                timed(quick, quick_errors, lambda: execute(True), deadline)
            ws.close()
            http("DELETE", f"{base}/api/kernels/{kernels[0]}")
            rows.append({"name": "kernel_gateway.exec_1p1_quickack", "samples_ms": quick, "errors": quick_errors})
        rows.append({"name": "kernel_gateway.exec_1p1", "samples_ms": samples, "errors": errors})
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def zmq_direct(args, deadline, rows):
    from jupyter_client.manager import start_new_kernel

    samples, errors = [], []
    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=60)
    try:
        def execute():
            msg_id = kc.execute("1+1")
            reply = kc.get_shell_msg(timeout=30)
            while reply["parent_header"].get("msg_id") != msg_id:
                reply = kc.get_shell_msg(timeout=30)
            while True:
                msg = kc.get_iopub_msg(timeout=30)
                if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                        and msg["content"]["execution_state"] == "idle"):
                    break

        for i in range(args.runs + 5):
            timed(samples if i >= 5 else [], errors, execute, deadline)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    rows.append({"name": "ipykernel_zmq.exec_1p1", "samples_ms": samples, "errors": errors})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", type=int, default=5)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--budget-seconds", type=float, default=120.0)
    args = ap.parse_args()
    deadline = time.monotonic() + args.budget_seconds
    rows = []
    for part in (kernel_gateway, zmq_direct):
        try:
            part(args, deadline, rows)
        except Exception:  # noqa: BLE001
            rows.append({"name": f"{part.__name__}.failed", "samples_ms": [], "errors": [traceback.format_exc(limit=5)]})
    json.dump({"rows": rows}, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
