import pytest
import torch

from glmquant.exl3.trellis import (
    RING_ORDER,
    from_ring,
    pack_trellis,
    to_ring,
    unpack_trellis,
)


def ring_states(bits: int, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random valid tail-biting state sequences: each state's high bits repeat the previous one's."""
    new = torch.randint(0, 1 << bits, (*shape, 256), generator=torch.Generator().manual_seed(seed))
    state = torch.zeros_like(new)
    for m in range(-(-16 // bits)):
        state |= torch.roll(new, m, dims=-1) << (m * bits)
    return (state & 0xFFFF).to(torch.int32)


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_unpack_round_trip(bits: int) -> None:
    states = ring_states(bits, (3, 5), seed=bits)
    packed = pack_trellis(states, bits)
    assert packed.dtype == torch.int16 and packed.shape == (3, 5, 16 * bits)
    assert torch.equal(unpack_trellis(packed, bits), states)
    mask = (1 << (16 - bits)) - 1
    assert torch.equal(states >> bits, torch.roll(states, 1, dims=-1) & mask)  # windows overlap, ring wraps


def test_golden_unpacked_states_pack_to_the_golden_trellis(golden) -> None:
    encoded, trellis = golden["mcg.K2.nopack.encoded"], golden["mcg.K2.nopack.trellis"]
    assert torch.equal(pack_trellis(encoded, 2), trellis)
    assert torch.equal(unpack_trellis(trellis, 2), encoded.to(torch.int32) & 0xFFFF)


def test_stream_is_msb_first_in_little_endian_uint32_words() -> None:
    states = torch.zeros(256, dtype=torch.int32)
    states[0] = 0b11  # K=2: the first two stream bits are 1, i.e. the top bits of u[0] = w[0] | w[1] << 16
    packed = pack_trellis(states, 2).to(torch.int32) & 0xFFFF
    assert packed[1].item() == 0xC000 and packed[0].item() == 0 and packed[2:].abs().sum() == 0


def test_ring_order_follows_the_doc_formula() -> None:
    assert sorted(RING_ORDER.tolist()) == list(range(256))
    for t in (0, 1, 2, 7, 8, 100, 255):
        lane, e = divmod(t, 8)
        row = 2 * (lane % 4) + (e & 1) + 8 * ((e >> 1) & 1)
        col = lane // 4 + 8 * ((e >> 2) & 1)
        assert RING_ORDER[t].item() == 16 * row + col


def test_to_ring_and_from_ring_are_inverse() -> None:
    x = torch.randn(2, 32, 48)
    tiles = to_ring(x)
    assert tiles.shape == (2, 2, 3, 256)
    assert torch.equal(from_ring(tiles), x)
    assert torch.equal(tiles[0, 1, 2, 0], x[0, 16, 32])  # ring position 0 is the tile's top-left element


def test_bad_bits_are_rejected() -> None:
    with pytest.raises(ValueError, match="1..8"):
        pack_trellis(torch.zeros(256, dtype=torch.int32), 9)
    with pytest.raises(ValueError, match="expected 32"):
        unpack_trellis(torch.zeros(48, dtype=torch.int16), 2)
