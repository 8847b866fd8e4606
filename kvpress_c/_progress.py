"""One progress bar for every long run (evaluations, Judge Q's data and training): tqdm when installed,
else a silent stand-in with the same methods, so a missing extra never stops a run."""
from __future__ import annotations

import sys


class _Silent:
    def update(self, n=1):
        pass

    def set_postfix(self, *args, **kwargs):
        pass

    def close(self):
        pass


def progress_bar(total=None, initial=0, desc="", disable=False, unit="it"):
    if disable:
        return _Silent()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Silent()
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, file=sys.stderr)
