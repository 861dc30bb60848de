"""What cells show besides text (display.py): the data stack's background import, rich values,
display calls, matplotlib figures."""

import base64
from pathlib import Path

import pytest

from agent_harness import PNG_SIGNATURE, needs, text


def test_a_cell_right_after_ready_gets_the_whole_data_stack_and_only_its_own_output(agent):
    # The data stack is still loading in the background when ready arrives: the cell's imports wait
    # for the modules it uses (complete, never half-initialised) and its output is its own.
    needs(agent, "pandas")
    needs(agent, "matplotlib")
    code = (
        "import pandas as pd\n"
        "import matplotlib.pyplot as plt\n"
        "print('own output')\n"
        "plt.plot([1, 2]); plt.show()\n"
        "int(pd.DataFrame({'a': [1, 2, 3]}).a.sum())"
    )
    result, events = agent.run(code)
    assert result["error"] is None, result
    assert result["result"]["text/plain"] == "6", result
    assert text(events, "stdout") == "own output\n", events
    assert text(events, "stderr") == "", events
    assert [e for e in events if e["event"] == "display"], "the chart comes back"


def test_a_plain_cell_right_after_ready_is_not_disturbed_by_the_preload(agent):
    result, events = agent.run("print('hi')\n1+1")
    assert result["error"] is None, result
    assert result["result"]["text/plain"] == "2", result
    assert text(events, "stdout") == "hi\n", events
    assert text(events, "stderr") == "", events


def test_dataframe_has_html(agent):
    needs(agent, "pandas")
    result, _ = agent.run("import pandas as pd\npd.DataFrame({'a': [1, 2]})")
    bundle = result["result"]
    assert "<table" in bundle["text/html"], bundle
    assert "a" in bundle["text/plain"]


def test_ipython_display_call_becomes_display_event(agent, kernel):
    if not kernel[0].startswith("ipython"):
        pytest.skip("display() is an IPython feature")
    _, events = agent.run("from IPython.display import display, HTML\ndisplay(HTML('<b>x</b>'))")
    displays = [e for e in events if e["event"] == "display"]
    assert displays and displays[0]["data"]["text/html"] == "<b>x</b>", events


def test_plt_show_emits_png_and_saves_it(agent):
    needs(agent, "matplotlib")
    result, events = agent.run(
        "import matplotlib.pyplot as plt\nprint('before')\nplt.plot([1, 2, 3])\nplt.show()"
    )
    assert result["error"] is None, result
    kinds = [e["event"] for e in events]
    assert kinds.index("stdout") < kinds.index("display"), f"output order lost: {kinds}"
    displays = [e for e in events if e["event"] == "display"]
    assert len(displays) == 1, f"plt.show() must display the figure once: {events}"
    png = base64.b64decode(displays[0]["data"]["image/png"])
    assert png.startswith(PNG_SIGNATURE)
    path = Path(displays[0]["path"])
    assert path == agent.home / "outputs" / f"figure-{result['execution_count']}-1.png"
    assert path.read_bytes() == png
    # show() closed the figure: nothing is emitted again by the next cell.
    _, later = agent.run("len(plt.get_fignums())")
    assert not [e for e in later if e["event"] == "display"]


def test_figures_left_open_are_displayed_at_cell_end(agent):
    needs(agent, "matplotlib")
    result, events = agent.run(
        "import matplotlib.pyplot as plt\n"
        "fig1 = plt.figure(); plt.plot([1, 2])\n"
        "fig2 = plt.figure(); plt.plot([2, 1])\n"
    )
    displays = [e for e in events if e["event"] == "display"]
    assert len(displays) == 2, events
    count = result["execution_count"]
    assert [Path(d["path"]).name for d in displays] == [
        f"figure-{count}-1.png",
        f"figure-{count}-2.png",
    ]
    check, _ = agent.run("len(plt.get_fignums())")
    assert check["result"]["text/plain"] == "0"
