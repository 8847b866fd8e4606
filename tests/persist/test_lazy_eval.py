"""`kvpress_c.eval.run(...)` as the README writes it works after a plain `import kvpress_c`, in a fresh
interpreter, and the plain import does not load the harness."""
import os
import subprocess
import sys

import kvpress_c

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(kvpress_c.__file__)))  # the checkout under test


def _fresh(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_eval_run_after_plain_import():
    out = _fresh("import sys, kvpress_c\n"
                 "print('before', 'kvpress_c.eval' in sys.modules)\n"
                 "run = kvpress_c.eval.run\n"
                 "print('after', 'kvpress_c.eval' in sys.modules, callable(run), run.__module__)\n"
                 "print('judgeq', kvpress_c.judgeq.__name__)\n")
    assert "before False" in out
    assert "after True True kvpress_c.eval" in out
    assert "judgeq kvpress_c.judgeq" in out


def test_unknown_attribute_still_raises():
    out = _fresh("import kvpress_c\n"
                 "try:\n    kvpress_c.no_such_thing\nexcept AttributeError as e:\n    print('AttributeError', e)\n")
    assert "AttributeError module 'kvpress_c' has no attribute 'no_such_thing'" in out
