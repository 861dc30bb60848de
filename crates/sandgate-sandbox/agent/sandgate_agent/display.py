"""What a cell shows besides text (kernel role): matplotlib figures as display events and PNG files,
rich values as JSON-safe MIME bundles, and the background import of the data stack."""

import base64
import io
import json
import os
import sys
import threading

from .config import HOME


class Figures:
    """Turns matplotlib figures into display events and PNG files under <home>/outputs."""

    def __init__(self, capture, writer):
        self.capture = capture
        self.writer = writer
        self.req_id = None
        self.execution_count = 0
        self.index = 0

    def begin(self, req_id, execution_count):
        self.req_id = req_id
        self.execution_count = execution_count
        self.index = 0

    def end(self):
        self.req_id = None

    def patch_pyplot(self):
        """Replaces plt.show (a no-op warning under Agg) with one that emits the open figures."""
        plt = loaded_module("matplotlib.pyplot")
        if plt is None or getattr(plt.show, "_sandgate", False):
            return

        def show(*args, **kwargs):
            self.flush()

        show._sandgate = True
        show.__doc__ = "Display all open figures (sandgate: as display events) and close them."
        plt.show = show

    def flush(self):
        """Emits every open figure and closes it."""
        plt = loaded_module("matplotlib.pyplot")
        if plt is None or self.req_id is None:
            return
        for num in plt.get_fignums():
            fig = plt.figure(num)
            try:
                self._emit(fig)
            finally:
                plt.close(fig)

    def _emit(self, fig):
        buf = io.BytesIO()
        # bbox_inches="tight" is what Jupyter's inline backend uses: no large empty margins.
        fig.savefig(buf, format="png", bbox_inches="tight")
        png = buf.getvalue()
        self.index += 1
        path = None
        try:
            outputs = os.path.join(HOME, "outputs")
            os.makedirs(outputs, exist_ok=True)
            candidate = os.path.join(outputs, f"figure-{self.execution_count}-{self.index}.png")
            with open(candidate, "wb") as f:
                f.write(png)
            path = candidate
        except OSError as err:  # e.g. quota exceeded: the chart is still shown
            print(f"[figure not saved: {err}]", file=sys.stderr)
        # Output printed before the figure must arrive before it.
        self.capture.drain()
        fields = {
            "data": {"image/png": base64.b64encode(png).decode("ascii"), "text/plain": repr(fig)}
        }
        if path is not None:
            fields["path"] = path
        self.writer.event(self.req_id, "display", **fields)


def mime_bundle(format_dict):
    """Makes a formatter's output JSON-safe: bytes become base64, unserialisable values are dropped."""
    bundle = {}
    for mime, value in (format_dict or {}).items():
        if isinstance(value, str):
            bundle[mime] = value
        elif isinstance(value, (bytes, bytearray)):
            bundle[mime] = base64.b64encode(value).decode("ascii")
        else:
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError):
                continue
            bundle[mime] = value
    return bundle


# What the kernel imports in the background once it has said ready, in this order.
PRELOAD = ("numpy", "pandas", "matplotlib")


def module_present(name):
    """Whether a top-level module can be found, without importing it (cheap: a path scan)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def loaded_module(name):
    """The module if it is fully imported; None while another thread is still importing it (its
    attributes may not exist yet) or when nobody imported it."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    if module is None or getattr(spec, "_initializing", False):
        return None
    return module


class ThreadMuted:
    """A stand-in for sys.stdout/sys.stderr that drops what one thread writes and passes the rest
    (every other thread's writes, attributes, flush) to the stream it wraps."""

    def __init__(self, inner, muted_thread):
        self.inner = inner
        self.muted_thread = muted_thread

    def write(self, data):
        if threading.get_ident() == self.muted_thread:
            return len(data)
        return self.inner.write(data)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def __getattr__(self, name):
        return getattr(self.inner, name)


# Kernels
