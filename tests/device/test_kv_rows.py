"""The row rules of a K/V store (core/kv_layout.h), one for every backend: reads and gathers stay inside
the rows the store holds (its lengths), writes inside its room (its capacity), with a pruned prefix of
ThinK's freed keys (dk > 0) or without. Checked on the CPU (the reference) and on each device."""
import pytest

from capi import DEVICES, CError, check, lib

READ, GATHER, WRITE, READ_BATCHED, WRITE_BATCHED = 0, 1, 2, 3, 4  # 3, 4: every head in one transfer, checked
# against a read per head / read back (kvc_device_kernel_kv_rows)
HKV, D, LEN = 2, 64, 10  # room for LEN + 4 rows


def kv_rows(device, op, row0, rows, dk):
    check(lib.kvc_device_kernel_kv_rows(DEVICES[device], op, HKV, D, LEN, dk, row0, rows))


@pytest.fixture(params=["cpu", "device"])
def where(request, device):
    return "cpu" if request.param == "cpu" else device


@pytest.mark.parametrize("dk", [0, 16])
@pytest.mark.parametrize("op", [READ, GATHER, READ_BATCHED])
def test_rows_held_are_the_limit(where, op, dk):
    kv_rows(where, op, 0, LEN, dk)  # every row held
    kv_rows(where, op, LEN - 3, 3, dk)  # the last rows (full ones)
    kv_rows(where, op, 2, 3, dk)  # inside the pruned prefix when dk > 0
    for row0, rows in [(LEN - 2, 3), (LEN, 1), (0, LEN + 1), (-1, 2)]:  # past the rows held (in the room) or before
        with pytest.raises(CError, match="K/V (read|gather).*(outside the 10 rows it holds|of the 10 it holds|inside the 10 rows it holds)"):
            kv_rows(where, op, row0, rows, dk)


@pytest.mark.parametrize("dk", [0, 16])
@pytest.mark.parametrize("op", [WRITE, WRITE_BATCHED])
def test_writes_reach_the_room(where, op, dk):
    kv_rows(where, op, LEN, 4, dk)  # past the rows held, inside the room: appends write there
    kv_rows(where, op, 0, LEN + 4, dk)
    kv_rows(where, op, 3, 2, dk)  # inside the pruned prefix when dk > 0
    with pytest.raises(CError, match="K/V write: rows \\[(12, 15|14, 15)\\) of head 0 are outside the 14 rows it has room for"):
        kv_rows(where, op, LEN + 2, 3, dk)
