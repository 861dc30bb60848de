"""Fixtures of the sandbox agent's tests (the harness: agent_harness.py)."""

import pytest

from agent_harness import KERNELS, AgentProcess


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("agent-work")


@pytest.fixture(params=KERNELS, ids=[k[0] for k in KERNELS])
def kernel(request):
    return request.param


@pytest.fixture
def agent(kernel, tmp_path, workdir):
    _, python, hide = kernel
    home = tmp_path / "home"
    home.mkdir()
    proc = AgentProcess(python, home, hide, workdir)
    yield proc
    proc.close()
