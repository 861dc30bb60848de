# The sandbox image as llm-sandbox needs it, built locally FROM sandgate's own image (never pulled):
# - a long-running main process (`sleep infinity`; the container runs with --init so that
#   llm-sandbox's `container.stop()` does not wait out Docker's 10 s SIGKILL grace);
# - `python` as a name for `python3` (llm-sandbox runs `python file.py`);
# - the virtualenv path its InteractiveSandboxSession expects (/sandbox/.sandbox-venv, sharing the
#   image's site-packages) with a `pip` that does nothing: IPython is already in the image and the
#   container has no network, so "pip install ipython" has nothing to do.
ARG BASE
FROM ${BASE}
USER root
RUN ln -sf python3 /usr/bin/python \
 && mkdir -p /sandbox \
 && python3 -m venv --without-pip --system-site-packages /sandbox/.sandbox-venv \
 && printf '#!/bin/sh\n# IPython is preinstalled; nothing to install offline.\nexit 0\n' > /sandbox/.sandbox-venv/bin/pip \
 && chmod 0755 /sandbox/.sandbox-venv/bin/pip
CMD ["sleep", "infinity"]
