"""The shells cells run in (kernel role): IPython's InteractiveShell when it is importable, plain
`exec` otherwise; both report a cell's value as a MIME bundle and its error with a traceback that
shows the user's frames and none of the agent's (`is_agent_file`)."""

import ast
import linecache
import re
import sys
import traceback
import types

from . import AGENT_ROOT, is_agent_file
from .display import mime_bundle
from .packages import register_pip_magic

# How an IPython traceback entry names a file of the agent.
AGENT_FRAME = AGENT_ROOT + "/"

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def strip_ansi(text):
    """`text` without its terminal colour codes."""
    return ANSI_ESCAPE.sub("", text)


class IPythonKernel:
    """Runs cells in an IPython InteractiveShell, the way a Jupyter kernel would (minus ZMQ)."""

    def __init__(self, figures, log):
        from IPython.core.displayhook import DisplayHook
        from IPython.core.displaypub import DisplayPublisher
        from IPython.core.interactiveshell import InteractiveShell
        from traitlets.config import Config

        kernel = self

        class QuietDisplayHook(DisplayHook):
            # The stock hook prints "Out[n]: ..." to stdout; the value belongs in the result instead.
            def write_output_prompt(self):
                pass

            def write_format_data(self, format_dict, md_dict=None):
                kernel.last_value = mime_bundle(format_dict)

            def finish_displayhook(self):
                pass

        class EventDisplayPublisher(DisplayPublisher):
            # display(obj) in a cell becomes a display event instead of text on stdout.
            def publish(self, data, metadata=None, source=None, **kwargs):
                if figures.req_id is None:
                    return
                figures.capture.drain()
                figures.writer.event(figures.req_id, "display", data=mime_bundle(data))

            def clear_output(self, wait=False):
                pass

        class AgentShell(InteractiveShell):
            # The hook ipykernel uses too: take the traceback instead of printing it to stdout.
            def _showtraceback(self, etype, evalue, stb):
                lines = [strip_ansi(line) for line in stb]
                kernel.last_error = {
                    "name": etype.__name__,
                    "value": str(evalue),
                    # Frames of the agent (the SIGINT handler's, above all) are not the user's
                    # (IPython's __tracebackhide__ never hides the innermost frame, so filter
                    # here): each entry of `stb` is one frame, named by its file.
                    "traceback": [line for line in lines if AGENT_FRAME not in line],
                }

        config = Config()
        # History in memory: the home directory is the user's and may be on a quota.
        config.HistoryManager.hist_file = ":memory:"
        self.shell = AgentShell.instance(
            config=config,
            displayhook_class=QuietDisplayHook,
            display_pub_class=EventDisplayPublisher,
            # Lower case is valid for both IPython 8 (caseless enum) and 9 (lower-case names).
            colors="nocolor",
        )
        register_pip_magic(self.shell, log)
        self.last_value = None
        self.last_error = None

    def next_count(self):
        return self.shell.execution_count

    def run(self, code):
        self.last_value = None
        self.last_error = None
        outcome = self.shell.run_cell(code, store_history=True)
        error = self.last_error
        exc = outcome.error_before_exec or outcome.error_in_exec
        if exc is not None and error is None:
            # e.g. a UsageError from a magic, which IPython reports without a traceback.
            error = {"name": type(exc).__name__, "value": str(exc), "traceback": []}
        return self.last_value, error


class PlainKernel:
    """Fallback when IPython is missing: exec with the value of a trailing expression captured."""

    def __init__(self):
        import builtins

        # A real module registered as __main__, so pickle and dataclasses can find user classes.
        self.module = types.ModuleType("__main__")
        self.module.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = self.module
        self.ns = self.module.__dict__
        self.count = 1

    def next_count(self):
        return self.count

    def run(self, code):
        filename = f"<cell-{self.count}>"
        self.count += 1
        # Register the source so tracebacks show the offending lines.
        lines = code.splitlines(True)
        linecache.cache[filename] = (len(code), None, lines, filename)
        try:
            tree = ast.parse(code, filename, "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            body = compile(tree, filename, "exec")
            tail = compile(last, filename, "eval") if last is not None else None
        except (SyntaxError, ValueError, OverflowError) as exc:
            return None, self._error(exc, None)
        try:
            exec(body, self.ns)
            value = eval(tail, self.ns) if tail is not None else None
        except BaseException as exc:  # KeyboardInterrupt and SystemExit too: the kernel lives on
            return None, self._error(exc, exc.__traceback__)
        if value is None:
            return None, None
        self.ns["_"] = value
        return self._format(value), None

    def _format(self, value):
        bundle = {"text/plain": repr(value)}
        html = getattr(value, "_repr_html_", None)
        if callable(html):
            try:
                rendered = html()
            except Exception:
                rendered = None
            if isinstance(rendered, str):
                bundle["text/html"] = rendered
        return bundle

    @staticmethod
    def _error(exc, tb):
        # Drop the agent's own frames: the traceback starts in the cell.
        while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<cell-"):
            tb = tb.tb_next
        report = traceback.TracebackException(type(exc), exc, tb, compact=True)
        # Frames of the agent (the SIGINT handler's, the figure flush's) are not the user's.
        report.stack = traceback.StackSummary.from_list(
            [f for f in report.stack if not is_agent_file(f.filename)]
        )
        lines = list(report.format())
        return {
            "name": type(exc).__name__,
            "value": str(exc),
            "traceback": [line.rstrip("\n") for line in lines],
        }
