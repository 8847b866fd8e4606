"""The scorer table (csrc/press/scorer.h) through the public ABI: one row per index, found by the linker section
the scorer files register in (the built-in scorers at their kvc_scorer codes, scorers added as one file after
them), consistent with the Python presses' `scorer` strings and the settings table."""
import ctypes as C
import inspect

import kvpress_c.presses as presses
import kvpress_c
from capi import PressSpec, lib
from kvpress_c import _core

# csrc/press/scorer.h's trait bits
WINDOW, HOST, CHUNKABLE, BLOCKABLE, READS_V, READS_ATTN, OWN_BUDGET, FIRST_ONLY, SAME_LEN, LAST_QUERY = (
    1 << i for i in range(10))


def rows():
    out = []
    for i in range(lib.kvc_scorer_count()):
        name, code, traits, params = C.c_char_p(), C.c_int32(), C.c_uint32(), C.POINTER(C.c_char_p)()
        assert lib.kvc_scorer_info(i, C.byref(name), C.byref(code), C.byref(traits), C.byref(params)) == 0
        names, j = [], 0
        while params[j]:
            names.append(params[j].decode())
            j += 1
        out.append((name.value.decode(), code.value, traits.value, names))
    return out


# the built-in scorers (core/backend.h's kvc_scorer codes 0..16); rows after them are scorers added as a file
BUILTIN = 17


def test_one_row_per_code_in_code_order():
    table = rows()
    codes = [code for _, code, _, _ in table]
    assert codes == list(range(len(_core.SCORERS))), codes
    names = [name for name, _, _, _ in table]
    assert len(set(names)) == len(names)
    assert dict(_core.SCORERS) == {name: code for name, code, _, _ in table}


def test_out_of_range_is_an_error():
    name = C.c_char_p()
    assert lib.kvc_scorer_info(lib.kvc_scorer_count(), C.byref(name), None, None, None) != 0
    assert lib.kvc_scorer_info(-1, None, None, None, None) != 0


def test_python_presses_name_rows():
    names = {name for name, _, _, _ in rows()}
    used = {cls.scorer for _, cls in inspect.getmembers(presses, inspect.isclass) if isinstance(getattr(cls, "scorer", None), str)}
    assert used and used <= names, used - names


def test_params_are_settings():
    fields = set(kvpress_c.press_params())
    for name, _, _, params in rows():
        assert set(params) <= fields, (name, set(params) - fields)


def test_traits_match_the_presses():
    t = {name: traits for name, code, traits, _ in rows() if code < BUILTIN}
    def has(bit):
        return {n for n, v in t.items() if v & bit}
    assert has(WINDOW) == {"snapkv", "edie", "finch", "simlayerkv"}
    assert has(BLOCKABLE) == {"knorm", "streaming", "random"}  # kvpress_c/presses/block.py's list
    assert has(CHUNKABLE) == {"knorm", "keydiff", "lagkv", "streaming", "random", "snapkv", "tova"}
    assert has(READS_ATTN) == {"edie"} and has(FIRST_ONLY) == {"observed"} and has(OWN_BUDGET) == {"simlayerkv"}
    assert has(SAME_LEN) == has(LAST_QUERY) == {"tova"}
    assert {"observed", "keydiff", "finch", "cap"} <= has(HOST) and not has(HOST) & {"snapkv", "tova", "knorm", "edie"}


def test_messages_list_the_table():
    c = PressSpec(scorer="observed", chunk_press=8, compression_ratio=0.5)
    assert lib.kvc_press_spec_check(c._p) != 0
    msg = lib.kvc_last_error().decode()
    assert "scores each chunk alone" in msg and msg.endswith("StreamingLLM, Knorm, Random, TOVA, SnapKV, KeyDiff, LagKV, Callback or CallbackWindow"), msg
