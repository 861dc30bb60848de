"""Background jobs (PROTOCOL.md, "command" with `background`, "jobs", "kill_job"): commands that
outlive their call, their output in a log file, listed and killed by id."""

import collections
import os
import signal
import subprocess
import threading
import time

from .config import JOBS_DIR, MAX_JOBS, SWEEP_S
from .processes import belonging, kill_group, leader_exited, read_processes, start_user_shell
from .protocol import OpError


class Jobs:
    """The sandbox's background jobs, running and recently finished."""

    def __init__(self, rt, state_lock, spawn):
        self.rt = rt
        self.writer = rt.writer
        self.state_lock = state_lock
        self.spawn = spawn  # the supervisor's FrameServer.spawn
        self.jobs = collections.OrderedDict()  # job id -> dict (the protocol's job object)
        self.job_procs = {}  # job id -> Popen of a running job
        self.job_seq = 0

    def ops(self):
        """The ops this part answers, by name."""
        return {"jobs": self.op_jobs, "kill_job": self.op_kill_job}

    def roots(self):
        """The main processes of the running jobs (call with the state lock held)."""
        return [p.pid for p in self.job_procs.values()]

    def start_job(self, req_id, command, cwd):
        """Starts `command` in `cwd` as a background job and answers `req_id` with it."""
        with self.state_lock:
            if len(self.job_procs) >= MAX_JOBS:
                raise OpError(
                    "limit",
                    f"{MAX_JOBS} background jobs are running already; kill one first "
                    "(kill_job) or wait for one to end",
                )
            self.job_seq += 1
            job_id = f"job-{self.job_seq}"
        log_path = f"{JOBS_DIR}/{job_id}.log"
        # The job creates its log itself, as the sandbox user, so the agent never writes into a
        # directory user code controls.
        script = 'mkdir -p -- "$3" && cd -- "$1" || exit 126; exec bash -lc "$2" >"$4" 2>&1'
        with self.rt.spawn_lock:
            proc = start_user_shell(
                self.rt,
                [script, "sandgate-job", cwd, command, JOBS_DIR, log_path], subprocess.DEVNULL
            )
            job = {
                "id": job_id,
                "pid": proc.pid,
                "command": command,
                "log": log_path,
                "started": time.time(),
                "running": True,
                "exit_code": None,
                "signal": None,
            }
            with self.state_lock:
                self.jobs[job_id] = job
                self.job_procs[job_id] = proc
            while len(self.jobs) > 4 * MAX_JOBS:  # forget the oldest finished ones
                oldest = next((j for j in self.jobs if j not in self.job_procs), None)
                if oldest is None:
                    break
                del self.jobs[oldest]
        threading.Thread(target=self.wait_job, args=(job_id, proc), daemon=True).start()
        self.writer.ok(req_id, {"job": dict(job)})

    def wait_job(self, job_id, proc):
        while not leader_exited(proc.pid):
            time.sleep(0.1)
        kill_group(proc.pid)  # the group goes with its leader, still unreaped (see leader_exited)
        rc = proc.wait()
        with self.state_lock:
            self.job_procs.pop(job_id, None)
            job = self.jobs.get(job_id)
            if job is not None:
                job.update(
                    running=False,
                    exit_code=rc if rc >= 0 else None,
                    signal=-rc if rc < 0 else None,
                )

    def op_jobs(self, req_id, frame):
        with self.state_lock:
            jobs = [dict(job) for job in self.jobs.values()]
        self.writer.ok(req_id, {"jobs": jobs})

    def op_kill_job(self, req_id, frame):
        job_id = frame.get("job")
        with self.state_lock:
            job = self.jobs.get(job_id) if isinstance(job_id, str) else None
            proc = self.job_procs.get(job_id) if job is not None else None
        if job is None:
            raise OpError("not_found", f"no background job {job_id!r}; list them with jobs")
        if proc is not None:
            kill_group(proc.pid)
            procs = read_processes()
            for pid in belonging(procs, [proc.pid]):
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        try:
            self.spawn("kill_job", self.finish_kill_job, req_id, job_id, proc)
        except OpError:
            # The kill is done; its end is recorded when processes are free again.
            with self.state_lock:
                job = dict(self.jobs.get(job_id, {}))
            self.writer.ok(req_id, {"killed": proc is not None, "job": job})

    def finish_kill_job(self, req_id, job_id, proc):
        deadline = time.monotonic() + SWEEP_S
        while True:
            with self.state_lock:
                job = dict(self.jobs.get(job_id, {}))
            if not job.get("running") or time.monotonic() >= deadline:
                break
            time.sleep(0.01)  # wait_job records the end
        self.writer.ok(req_id, {"killed": proc is not None, "job": job})
