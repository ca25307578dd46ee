import numpy as np
import pytest
import torch

from glmquant.exl3 import Codebook
from glmquant.exl3.codebooks import MARKER_VALUES, codebook_values


@pytest.mark.parametrize(
    ("codebook", "rms"), [(Codebook.THREE_INST, 1.24371), (Codebook.MCG, 1.2441), (Codebook.MUL1, 1.0003)]
)
def test_codebook_rms_matches_the_format_doc(codebook: Codebook, rms: float) -> None:
    values = codebook_values(codebook)
    assert values.dtype == torch.float16 and values.shape == (65536,)
    assert values.float().square().mean().sqrt().item() == pytest.approx(rms, abs=1e-4)


def test_mul1_state_zero_is_the_affine_map_of_byte_sum_zero() -> None:
    scale = np.array(0x1EEE, dtype=np.uint16).view(np.float16).astype(np.float32)
    bias = np.array(0xC931, dtype=np.uint16).view(np.float16).astype(np.float32)
    assert codebook_values("mul1")[0].item() == pytest.approx(float(np.float16(1024 * scale + bias)))


def test_markers_are_the_multipliers_as_int32() -> None:
    assert MARKER_VALUES == {Codebook.MCG: -877912083, Codebook.MUL1: -2082680531}
    assert Codebook("mcg") is Codebook.MCG and Codebook.THREE_INST.value == "3inst"
