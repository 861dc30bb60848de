"""Background jobs (jobs.py)."""

import os
import time

from agent_harness import alive, gone_within


def test_a_background_job_survives_and_can_be_listed_and_killed(agent):
    marker = f"{os.getpid()}{time.monotonic_ns() % 100000}"
    _, started = agent.ok("command", command=f"sleep 4{marker}", background=True)
    job = started["job"]
    assert job["running"] is True and job["id"].startswith("job-"), job
    agent.ok("command", command="true", timeout_ms=5000)  # a sweep runs at its end
    assert alive(f"sleep 4{marker}"), "the job was killed by another call's sweep"
    jobs = agent.ok("jobs")[1]["jobs"]
    assert [j["id"] for j in jobs if j["running"]] == [job["id"]], jobs
    _, killed = agent.ok("kill_job", job=job["id"])
    assert killed["killed"] is True
    assert gone_within(f"sleep 4{marker}")
    assert agent.call("kill_job", job="job-999")[1]["error"]["kind"] == "not_found"
