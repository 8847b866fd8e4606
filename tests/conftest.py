import os
import sys

# quiet the reference libraries (progress bars and warnings would bury the test output)
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch and kvpress_c each bring an OpenMP pool; pools that spin without end on 2 cores starve each other
# (10 decode steps: 17.7 s spinning vs 0.5 s passive, under load), and PASSIVE makes each
# of a decode step's ~240 parallel regions wake sleeping threads (kivi4 at 8k on 2 threads: 17.8 ms a step).
# A short spin, then sleep: GOMP_SPINCOUNT=10000 spins ~0.26 ms after a region (GOMP's default, 300000,
# ~5.8 ms), the step 9.1 ms; the fast tier 202 -> 161 s, the kvpress/MoE parity files 155 -> 124 s. Both
# pools read it (torch's bundled libgomp too); it must be set before either runtime starts.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import numpy as np
import pytest

# the shared helpers: support/ (the one ctypes binding, model writers) and reference/ (float64 NumPy)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "support"), os.path.join(HERE, "reference")]


def _default_gguf():
    env = os.environ.get("KVC_DEFAULT_GGUF")
    if env and os.path.exists(env):
        return env
    from kvpress_c import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def default_gguf():
    return _default_gguf()


@pytest.fixture(scope="session")
def default_model(default_gguf):
    """The default model in fp32 mode: the reference the parity tests hold to HF / kvpress tolerances
    (native weights quantise decode activations to int8, as llama.cpp does: tests/model/test_native_weights.py)."""
    import kvpress_c
    return kvpress_c.load_model(default_gguf, weights="fp32")


@pytest.fixture(scope="session")
def default_model_native(default_gguf):
    """The default model as load_model gives it: weights in the file's types (Q4_1, Q8_0)."""
    import kvpress_c
    return kvpress_c.load_model(default_gguf)


@pytest.fixture
def rng(request):
    """Fresh randomness each run; the seed is printed on failure (pytest shows captured stdout), and
    KVC_TEST_SEED=<seed> replays it."""
    seed = int(os.environ.get("KVC_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"[{request.node.name}] numpy seed = {seed}")
    return np.random.default_rng(seed)


# ---- test tiers --------------------------------------------------------------------------------------------
# A test gets the marker `torch` (torch / transformers / kvpress / peft as a reference), `ray`, `llamacpp` or
# `notebook` (nbclient) when its function, a fixture it uses, or a helper one of them calls imports that
# library or importorskips it, followed through the test module, the test modules it imports, support/ and
# reference/ (by name, statically); an import at a module's top level marks every test of the module.
# `make test-fast` deselects these and `slow`, and runs with KVC_FAST_TIER=1: importing one of the
# libraries then raises ImportError, and a test skipped for it fails, so a test that the analysis missed
# fails instead of passing without its reference.
import ast
import inspect

_MARK_OF = {"torch": "torch", "transformers": "torch", "kvpress": "torch", "peft": "torch", "ray": "ray",
            "llama_cpp": "llamacpp", "nbclient": "notebook", "nbformat": "notebook"}
_SEARCH = [os.path.join(HERE, "support"), os.path.join(HERE, "reference")]
FAST_TIER = os.environ.get("KVC_FAST_TIER") == "1"
_BLOCKED = "blocked in the fast tier (KVC_FAST_TIER=1)"


def _module_mark(name):
    """The marker that importing `name` calls for: torch.nn -> torch, safetensors.torch -> torch."""
    if not name:
        return None
    if name == "safetensors.torch" or name.startswith("safetensors.torch."):
        return "torch"
    return _MARK_OF.get(name.split(".")[0])


class _Module:
    """One local file: for each top-level name (None: the statements run at import), the marks its own code
    calls for and the local names it uses."""
    _cache = {}

    @classmethod
    def get(cls, path):
        path = os.path.abspath(path)
        if path not in cls._cache:
            cls._cache[path] = cls(path)
        return cls._cache[path]

    def __init__(self, path):
        self.path = path
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        self.nodes = {None: []}  # name -> the statements that define it
        self.imports = {}        # local name -> (path, attribute; None for the module itself)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.nodes.setdefault(node.name, []).append(node)
                self.nodes[None] += node.decorator_list
                continue
            self.nodes[None].append(node)
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            self.nodes.setdefault(n.id, []).append(node)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if self._local(a.name):
                        self.imports[a.asname or a.name] = (self._local(a.name), None)
            elif isinstance(node, ast.ImportFrom) and not node.level and self._local(node.module):
                for a in node.names:
                    self.imports[a.asname or a.name] = (self._local(node.module), a.name)
        for node in ast.walk(tree):  # `import capi` inside a function: capi.name below resolves through it
            if isinstance(node, ast.Import):
                for a in node.names:
                    if self._local(a.name):
                        self.imports.setdefault(a.asname or a.name, (self._local(a.name), None))
        self._direct = {}

    def _local(self, name):
        if not name or "." in name:
            return None
        for d in [os.path.dirname(self.path)] + _SEARCH:
            p = os.path.join(d, name + ".py")
            if os.path.exists(p):
                return os.path.abspath(p)
        return None

    def direct(self, name):
        """(marks, references) of the top-level name: references are (path, name) keys."""
        if name not in self._direct:
            marks, refs = set(), set()
            if name is None:  # importing this module runs the local modules it imports
                refs |= {(p, None) for p, _ in self.imports.values()}
            if name in self.imports:
                p, attr = self.imports[name]
                refs |= {(p, None), (p, attr)}
            for node in self.nodes.get(name, []):
                for n in ast.walk(node):
                    if isinstance(n, ast.Import):  # here or inside a function (imports of local modules too)
                        marks.update(_module_mark(a.name) for a in n.names)
                        refs |= {(self._local(a.name), None) for a in n.names if self._local(a.name)}
                    elif isinstance(n, ast.ImportFrom) and not n.level:
                        marks.update(_module_mark(f"{n.module}.{a.name}") for a in n.names)
                        marks.add(_module_mark(n.module))
                        if self._local(n.module):
                            refs |= {(self._local(n.module), a.name) for a in n.names} | {(self._local(n.module), None)}
                    elif isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", None)) == "importorskip":
                        if n.args and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str):
                            marks.add(_module_mark(n.args[0].value))
                    elif isinstance(n, ast.Name) and n.id != name and (n.id in self.imports or n.id in self.nodes):
                        refs.add((self.path, n.id))
                    elif (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in self.imports
                          and self.imports[n.value.id][1] is None):
                        refs.add((self.imports[n.value.id][0], n.attr))
            marks.discard(None)
            self._direct[name] = (marks, refs)
        return self._direct[name]


_closure = {}


def _marks(path, name):
    """The marks of a top-level name with everything it uses, and of its module's import."""
    key = (os.path.abspath(path), name)
    if key not in _closure:
        marks, todo, seen = set(), [key, (key[0], None)], set()
        while todo:
            k = todo.pop()
            if k in seen or not os.path.exists(k[0]):
                continue
            seen.add(k)
            m, refs = _Module.get(k[0]).direct(k[1])
            marks |= m
            todo += refs
        _closure[key] = marks
    return _closure[key]


def _function_marks(func):
    func = inspect.unwrap(func)
    try:
        path = inspect.getsourcefile(func)
    except TypeError:
        return set()
    if not path or not os.path.abspath(path).startswith(HERE + os.sep):
        return set()
    return _marks(path, func.__qualname__.split(".")[0])


def pytest_collection_modifyitems(config, items):
    for item in items:
        fn = getattr(item, "function", None)
        if fn is None:
            continue
        marks = set(_function_marks(fn))
        info = getattr(item, "_fixtureinfo", None)
        for name in (info.names_closure if info else []):
            for fdef in (info.name2fixturedefs.get(name) or []):
                marks |= _function_marks(fdef.func)
        for mark in sorted(marks):
            item.add_marker(mark)


if FAST_TIER:
    import importlib.abc

    class _Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if _module_mark(fullname):
                raise ModuleNotFoundError(f"{fullname} is {_BLOCKED}: mark the test (torch, ray, llamacpp, notebook) or "
                                  "let tests/conftest.py see the import", name=fullname)
            return None

    sys.meta_path.insert(0, _Blocker())

    def pytest_ignore_collect(collection_path, config):
        """A module that cannot be imported without a blocked library (all its tests are marked) is not collected."""
        p = str(collection_path)
        if p.endswith(".py") and os.path.basename(p).startswith("test_") and _marks(p, None):
            return True
        return None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        """A test skipped by importorskip on a blocked library fails: it needs a marker."""
        outcome = yield
        rep = outcome.get_result()
        if rep.skipped and _BLOCKED in str(rep.longrepr):
            rep.outcome = "failed"

    def pytest_sessionfinish(session, exitstatus):
        heavy = sorted(m for m in sys.modules if _module_mark(m))
        if heavy:
            print(f"\nfast tier: imported {heavy}", file=sys.stderr)
            session.exitstatus = 1
