"""The compiled decode math keeps compiling past dynamo's default recompile limit (`engine/ops.py`)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch._dynamo

from glmquant.runtime.engine.ops import ops_for


def test_compiled_ops_take_more_signatures_than_dynamos_default_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """rms_norm in 13 graphs (a static one, then ranks 1-4 x 3 dtypes with a dynamic width) stays compiled: with
    dynamo's default limit of 8 the ninth would run eager (here: raise, `fail_on_recompile_limit_hit`)."""
    monkeypatch.setattr(torch, "compile", partial(torch.compile, backend="eager"))  # graphs without inductor's time
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=True):
        ops = ops_for(torch.device("cpu"), compiled=True)
        for rank in (1, 2, 3, 4):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                for width in (16, 24):  # the first change of width makes the width dynamic
                    x = torch.randn(*(2,) * (rank - 1), width).to(dtype)
                    weight = torch.ones(width, dtype=dtype)
                    y = ops.rms_norm(x, weight, 1e-6)
                    expected = weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(
                        dtype
                    )
                    torch.testing.assert_close(y, expected)
    torch._dynamo.reset()
