"""Kernel dispatch: what `attention_impl` resolves to, and that the model follows it."""

from __future__ import annotations

import pytest

from nsa_jax.kernels import describe_impl, resolve_impl


@pytest.mark.parametrize(
    "impl,backend,expected",
    [("auto", "gpu", "pallas"), ("auto", "cpu", "xla"), ("xla", "gpu", "xla"), ("pallas", "cpu", "pallas")],
)
def test_resolve_impl(impl, backend, expected):
    assert resolve_impl(impl, backend) == expected


def test_describe_impl_names_every_branch():
    assert describe_impl("auto", "gpu") == {"cmp": "pallas-triton", "slc": "pallas-triton", "win": "pallas-triton"}
    assert describe_impl("auto", "cpu") == {"cmp": "xla-chunked", "slc": "xla-chunked", "win": "xla-chunked"}
    assert describe_impl("pallas", "cpu")["slc"] == "pallas-interpret"


def test_auto_keeps_selection_on_xla_when_the_kernel_cannot_take_the_blocks():
    assert describe_impl("auto", "gpu", block_size=8)["slc"] == "xla-chunked"
    assert describe_impl("auto", "gpu", block_size=48)["slc"] == "xla-chunked"
    assert describe_impl("auto", "gpu", block_size=64) == describe_impl("auto", "gpu")
    # Asked for explicitly, pallas stays pallas (and its argument check names the problem).
    assert describe_impl("pallas", "gpu", block_size=8)["slc"] == "pallas-triton"


def test_unknown_impl_is_rejected():
    with pytest.raises(ValueError, match="attention_impl"):
        resolve_impl("cuda", "gpu")
