"""kvpress_c._core.PressSpec: a press's settings by name over the C ABI's kvc_press_spec. Settings round-trip
(attributes, items, .get, .settings()), unknown names (TypeError), values the C core refuses (ValueError with
its message), the C check and budget rule, Session.attach_press equal to Session.set_press on a prefill of the
default model, and no leak over many specs."""
import gc
import resource

import numpy as np
import pytest

import kvpress_c
from kvpress_c import _core


def test_defaults_are_the_press_params():
    spec = _core.PressSpec()
    settings = spec.settings()
    assert set(settings) == set(_core.PRESS_PARAMS)
    for name, row in _core.PRESS_PARAMS.items():
        value = settings[name]
        if row["choices"]:
            assert value == row["choices"][int(row["default"])], name
        else:
            assert value == pytest.approx(row["default"], rel=1e-6, abs=1e-12), name


def test_settings_round_trip():
    spec = _core.PressSpec("knorm", compression_ratio=0.25, window=8, allocation="adakv")
    assert spec.scorer == "knorm" and spec["scorer"] == "knorm" and spec.get("scorer") == "knorm"
    assert spec.compression_ratio == 0.25 and spec.window == 8 and spec.allocation == "adakv"
    spec.window = 16
    spec["kernel"] = 3
    spec.scorer = "snapkv"
    spec.seed = 2**63 + 5  # an unsigned setting past int64
    assert (spec.window, spec.get("kernel"), spec.scorer) == (16, 3, "snapkv")
    assert spec.seed >= 2**63  # read back through a double (kvc_press_spec_get): 53 bits exact
    settings = spec.settings()
    assert settings["window"] == 16 and settings["allocation"] == "adakv" and settings["kernel"] == 3
    again = _core.PressSpec(**{k: v for k, v in settings.items() if k != "seed"})
    assert {k: v for k, v in again.settings().items() if k != "seed"} == {k: v for k, v in settings.items() if k != "seed"}
    assert "window=16" in repr(spec) and "allocation='adakv'" in repr(spec)  # the settings that are not defaults
    assert repr(_core.PressSpec()) == "PressSpec()"
    assert "window" in dir(spec) and "kept" in dir(spec)
    assert isinstance(spec.record_scores, bool) and isinstance(spec.epsilon, float) and isinstance(spec.window, int)


def test_unknown_names_are_type_errors():
    with pytest.raises(TypeError, match="'windw' is not a press setting"):
        _core.PressSpec(windw=3)
    spec = _core.PressSpec()
    with pytest.raises(TypeError, match="'windw' is not a press setting"):
        spec.windw = 3
    with pytest.raises(TypeError, match="'windw' is not a press setting"):
        spec["windw"] = 3
    with pytest.raises(TypeError, match="'windw' is not a press setting"):
        spec.get("windw")
    with pytest.raises(TypeError, match="'windw' is not a press setting"):
        spec["windw"]
    with pytest.raises(AttributeError):
        spec.windw
    with pytest.raises(TypeError):
        del spec.window
    with pytest.raises(TypeError, match="twice"):
        _core.PressSpec("knorm", scorer="snapkv")


def test_bad_values_are_value_errors():
    with pytest.raises(ValueError, match="no_such_scorer"):
        _core.PressSpec("no_such_scorer")
    spec = _core.PressSpec()
    with pytest.raises(ValueError, match="allocation"):
        spec.allocation = "nope"
    with pytest.raises(ValueError, match="window"):
        spec.window = 2.5  # an integer setting takes an integral value
    with pytest.raises(TypeError, match="must be a number or a name"):
        spec.window = [1]
    assert spec.window == _core.PressSpec().window  # a refused value leaves the setting as it was
    spec.compression_ratio = 2.0  # the range is the check's
    with pytest.raises(ValueError, match="compression_ratio must be in"):
        spec.check()
    with pytest.raises(ValueError, match="compression_ratio must be in"):
        _core.press_config_check(compression_ratio=2.0)
    spec.compression_ratio = 0.5
    assert spec.check() is None


@pytest.mark.parametrize("settings", [dict(scorer="knorm", compression_ratio=0.5),
                                      dict(scorer="snapkv", window=4, budget=20, allocation="pyramid"),
                                      dict(scorer="streaming", n_sink=4, compression_ratio=0.7)])
def test_kept_is_press_kept(settings):
    spec = _core.PressSpec(**settings)
    for n, layer, n_layers in [(100, 0, 1), (333, 3, 30), (57, 29, 30)]:
        assert spec.kept(n, layer, n_layers) == _core.press_kept(n, layer, n_layers, **settings)
        assert spec.kept(n, layer=layer, n_layers=n_layers) == spec.kept(n, layer, n_layers)


@pytest.mark.parametrize("settings", [dict(scorer="knorm", compression_ratio=0.5),
                                      dict(scorer="snapkv", window=8, compression_ratio=0.6, allocation="adakv")])
def test_attach_press_equals_set_press(default_model, settings):
    ids = np.random.default_rng(5).integers(3, 1000, 120).astype(np.int32)
    a, b = default_model.new_session(), default_model.new_session()
    a.set_press(**settings)
    b.attach_press(_core.PressSpec(**settings))
    la, lb = a.forward(ids), b.forward(ids)
    np.testing.assert_array_equal(la, lb)
    cfg = default_model.config
    assert (a.cache_lengths() < len(ids)).any()
    np.testing.assert_array_equal(a.cache_lengths(), b.cache_lengths())
    for layer in range(cfg["n_layers"]):
        for head in range(cfg["n_kv_heads"]):
            np.testing.assert_array_equal(a.cache_positions(layer, head), b.cache_positions(layer, head))
    # None detaches: the next prefill keeps everything
    b.reset()
    b.attach_press(None)
    b.forward(ids)
    assert (b.cache_lengths() == len(ids)).all()
    with pytest.raises(TypeError, match="PressSpec or None"):
        b.attach_press(settings)


def test_attach_copies_the_spec(default_model):
    ids = np.random.default_rng(6).integers(3, 1000, 64).astype(np.int32)
    spec = _core.PressSpec("knorm", compression_ratio=0.5)
    s = default_model.new_session()
    s.attach_press(spec)
    spec.compression_ratio = 0.0  # after attaching: the session's press keeps its own copy
    s.forward(ids)
    assert (s.cache_lengths() == 32).all()


def test_no_leak():
    def rss():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(2000):  # warm up the allocator
        _core.PressSpec("knorm", window=8).settings()
    gc.collect()
    before = rss()
    for i in range(50000):
        spec = _core.PressSpec("snapkv", compression_ratio=0.5, window=i % 64)
        spec.kernel = 3
        spec.settings()
        try:
            spec.windw = 1
        except TypeError:
            pass
        del spec
    gc.collect()
    assert rss() - before < 20_000  # KiB: 50k specs that were never freed would be far more (settings dicts alone)


def test_press_arrays_are_rows_of_the_part_table():
    """Every wrapper's or method's array by name, with the press it belongs to, its type and its count; the
    dataclasses set them through Session.set_press_array (no method per press)."""
    arrays = _core.PRESS_ARRAYS
    assert set(arrays) == {"layer_ratios", "head_budgets", "block_size", "key_rerotation", "key_channel_ratio",
                           "channel_window", "channel_free", "key_filters", "query_mean", "query_cov", "head_prune",
                           "lukv_sink", "lukv_window"}
    assert arrays["key_filters"] == {"press": "QFilterPress", "type": "float32",
                                     "shape": "layers x kv_heads x head_dim", "doc": arrays["key_filters"]["doc"]}
    assert all(row["doc"] for row in arrays.values())


def test_set_press_array_checks_against_the_model(default_model):
    s = default_model.new_session()
    with pytest.raises(ValueError, match="no press is attached"):
        s.set_press_array("block_size", 8)
    s.set_press(scorer="snapkv", compression_ratio=0.5, window=2)
    with pytest.raises(NotImplementedError, match="keys alone"):  # BlockPress refuses a scorer that reads queries
        s.set_press_array("block_size", 8)
    L, Hkv = default_model.config["n_layers"], default_model.config["n_kv_heads"]
    with pytest.raises(ValueError, match=rf"head_budgets \(DuoAttentionPress\) needs \[{L} layers, {Hkv} KV heads\]"):
        s.set_press_array("head_budgets", np.ones(L * Hkv + 1, np.int64))
    s.set_press_array("head_budgets", np.full((L, Hkv), 3))
    with pytest.raises(ValueError, match="DuoAttentionPress and LUKVPress each choose"):
        s.set_press_array("head_prune", np.zeros((L, Hkv), np.float32))
    with pytest.raises(ValueError, match="ExpectedAttention"):
        s.set_press_array("query_mean", np.zeros(L * default_model.config["n_heads"] * default_model.config["head_dim"]))
