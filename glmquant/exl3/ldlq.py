"""LDLQ: quantize 16-row strips from the last to the first, feeding back the H-weighted error of the strips
already done. Work comes as stacks: G independent problems of one shape [G, k, n] (tensors that share one
factorization are concatenated along n by the caller, since LDLQ treats columns independently); every step
quantizes the current strip of every stack in one backend call, with batched matmuls for the feedback."""

from __future__ import annotations

from collections.abc import Callable

import torch

from glmquant.exl3.trellis import from_ring, to_ring

BLOCK = 128  # feedback from finished 128-row blocks is accumulated with one matmul per block

Stack = tuple[torch.Tensor, torch.Tensor | None]  # regularized weights [G, k, n], strictly block-lower L [G, k, k]


def ldlq(
    stacks: list[Stack],
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """quantize maps ring-ordered tiles to (values, states). Returns per stack the quantized weights [G, k, n]
    and the states [G, k/16, n/16, 256]. L = None: no feedback (uncalibrated)."""
    qs = [torch.zeros_like(w) for w, _ in stacks]
    states = [
        torch.empty((w.shape[0], w.shape[1] // 16, w.shape[2] // 16, 256), dtype=torch.int32, device=w.device)
        for w, _ in stacks
    ]
    accs = [torch.zeros_like(w) if ldl is not None else None for w, ldl in stacks]
    for step in range(max((w.shape[1] // 16 for w, _ in stacks), default=0)):
        active, targets = [], []
        for m, (w, ldl) in enumerate(stacks):
            strip = w.shape[1] // 16 - 1 - step
            if strip < 0:
                continue
            r0, r1 = 16 * strip, 16 * strip + 16
            rows = w[:, r0:r1]
            acc = accs[m]
            if ldl is not None and acc is not None:  # acc exists exactly when ldl does
                end = (r0 // BLOCK + 1) * BLOCK
                err = w[:, r1:end] - qs[m][:, r1:end]
                rows = rows + acc[:, r0:r1] + ldl[:, r1:end, r0:r1].transpose(1, 2) @ err
            active.append((m, strip))
            targets.append(to_ring(rows).reshape(-1, 256))
        values, found = quantize(torch.cat(targets))
        offset = 0
        for (m, strip), t in zip(active, targets):
            w, ldl = stacks[m]
            g, tn, count = w.shape[0], w.shape[2] // 16, t.shape[0]
            r0 = 16 * strip
            qs[m][:, r0 : r0 + 16] = from_ring(values[offset : offset + count].view(g, 1, tn, 256))
            states[m][:, strip] = found[offset : offset + count].view(g, tn, 256)
            offset += count
            acc = accs[m]
            if ldl is not None and acc is not None and r0 % BLOCK == 0 and r0 > 0:
                done = w[:, r0 : r0 + BLOCK] - qs[m][:, r0 : r0 + BLOCK]
                acc[:, :r0] += ldl[:, r0 : r0 + BLOCK, :r0].transpose(1, 2) @ done
    return list(zip(qs, states))
