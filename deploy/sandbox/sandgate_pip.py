"""`pip` in a sandbox: runs `python3 -m pip` and, when it fails, says what sandgate's package index
refused and why (a denied package, one without a wheel, a corrupted download, installs turned off).

pip itself reports a refused index page only as "no matching distribution"; the agent's loopback
relay keeps the gateway's reasons as notes, and this prints those that arrived while pip ran.
Installed as /usr/local/bin/pip, pip3 and pip3.11 by finalize.sh; `%pip` and `!pip` in a cell run it.
"""

import json
import os
import subprocess
import sys
import urllib.request

NOTES = "http://127.0.0.1:%s/_sandgate/notes" % (os.environ.get("SANDGATE_AGENT_INDEX_PORT") or 3141)


def notes(after):
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open("%s?after=%d" % (NOTES, after), timeout=5) as answer:
            data = json.load(answer)
        return int(data["seq"]), [str(n) for n in data["notes"]]
    except Exception:  # no relay (e.g. the image run without the agent): pip's own words only
        return after, []


def main():
    seq, _ = notes(0)
    code = subprocess.call([sys.executable, "-m", "pip"] + sys.argv[1:])
    if code != 0:
        _, new = notes(seq)
        for note in dict.fromkeys(new):
            print("sandgate: " + note, file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
