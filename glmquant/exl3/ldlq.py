"""LDLQ: quantize 16-row strips from the last to the first, feeding back the H-weighted error of the
strips already done, with the Viterbi of every tensor's current strip in one backend call."""

from __future__ import annotations

from collections.abc import Callable

import torch

from glmquant.exl3.trellis import from_ring, to_ring

BLOCK = 128  # feedback from finished 128-row blocks is accumulated with one matmul per block


def ldlq(
    jobs: list[tuple[torch.Tensor, torch.Tensor | None]],
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """jobs: (regularized weight [k, n], strictly block-lower L [k, k] or None for no feedback).

    quantize maps ring-ordered tiles to (values, states). Returns per job the quantized weight [k, n]
    and the states [k/16, n/16, 256].
    """
    qs = [torch.zeros_like(w) for w, _ in jobs]
    states = [torch.empty((w.shape[0] // 16, w.shape[1] // 16, 256), dtype=torch.int32, device=w.device) for w, _ in jobs]
    accs = [torch.zeros_like(w) if ldl is not None else None for w, ldl in jobs]
    for step in range(max(w.shape[0] // 16 for w, _ in jobs)):
        active, targets = [], []
        for m, (w, ldl) in enumerate(jobs):
            strip = w.shape[0] // 16 - 1 - step
            if strip < 0:
                continue
            r0, r1 = 16 * strip, 16 * strip + 16
            rows = w[r0:r1]
            if ldl is not None:
                end = (r0 // BLOCK + 1) * BLOCK
                err = w[r1:end] - qs[m][r1:end]
                rows = rows + accs[m][r0:r1] + ldl[r1:end, r0:r1].T @ err
            active.append((m, strip))
            targets.append(to_ring(rows).reshape(-1, 256))
        values, found = quantize(torch.cat(targets))
        offset = 0
        for (m, strip), t in zip(active, targets):
            count = t.shape[0]
            r0 = 16 * strip
            qs[m][r0 : r0 + 16] = from_ring(values[offset : offset + count].view(1, count, 256))
            states[m][strip] = found[offset : offset + count]
            offset += count
            ldl = jobs[m][1]
            if ldl is not None and r0 % BLOCK == 0 and r0 > 0:
                done = jobs[m][0][r0 : r0 + BLOCK] - qs[m][r0 : r0 + BLOCK]
                accs[m][:r0] += ldl[r0 : r0 + BLOCK, :r0].T @ done
    return list(zip(qs, states))
