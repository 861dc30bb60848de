"""Seed matplotlib's font cache from the copy baked into the sandbox image.

matplotlib keeps its font list in MPLCONFIGDIR and rebuilds it (scanning every
font file) when the file is missing. Sandboxes run on a read-only root with an
empty tmpfs at /tmp, and matplotlib only uses a cache directory it can write, so
MPLCONFIGDIR is /tmp/matplotlib; this copies the list built when the image was
made (finalize.sh) so that the first `import matplotlib.pyplot` is fast.

Imported from sandgate_mplcache.pth at every interpreter start: it must be cheap
and must never raise.
"""

import os

_BAKED = "/usr/local/share/sandgate/matplotlib"


def _seed():
    target = os.environ.get("MPLCONFIGDIR")
    if not target or os.path.abspath(target) == _BAKED:
        return
    try:
        names = os.listdir(_BAKED)
        os.makedirs(target, mode=0o700, exist_ok=True)
        for name in names:
            dst = os.path.join(target, name)
            if os.path.exists(dst):
                continue
            # Write aside and rename, so that a concurrent start never reads half a file.
            tmp = "%s.%d.tmp" % (dst, os.getpid())
            with open(os.path.join(_BAKED, name), "rb") as src, open(tmp, "wb") as out:
                out.write(src.read())
            os.replace(tmp, dst)
    except OSError:
        pass


_seed()
