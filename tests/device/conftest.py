"""The device a device test runs on: the emulated device always, CUDA where this build and machine have it
(skipped with the reason otherwise)."""
import pytest

import kvpress_c
from capi import why_no_cuda


@pytest.fixture(params=["emulated", "cuda"])
def device(request):
    if request.param == "cuda" and not kvpress_c.cuda_available():
        pytest.skip(why_no_cuda() or "no CUDA backend")
    return request.param
