"""Host index arrays to the cache's device in one copy per call, never waiting for the device."""

from __future__ import annotations

import collections

import numpy as np
import torch

_PAD = np.zeros(1, dtype=np.int32)
_TORCH_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}


class Uploader:
    """int32 / int64 host arrays to a device in one copy per call, as views of one device buffer.

    On CUDA the arrays are packed into a pinned buffer and copied asynchronously. Buffers are reused, oldest first,
    once the copy that last read them has run (a CUDA event each, queried, never waited on); while none has, a new
    one is made. So nothing is pinned per call and the host never waits for the device. On CPU the tensors are views
    of a fresh host buffer."""

    def __init__(self, device: torch.device):
        self.device, self.on_cpu = device, device.type == "cpu"
        self.ring: collections.deque = collections.deque()  # (pinned int32 buffer, event of its last copy)

    def __call__(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        if not arrays:
            return []
        parts, sizes, index, at = [], [], [], 0  # int32 words to send, their sizes, which are the arrays, words so far
        for a in arrays:
            words = a.ravel()
            if a.dtype == np.int64:
                if at % 2:  # an int64 view needs an 8-byte aligned start
                    parts.append(_PAD)
                    sizes.append(1)
                    at += 1
                words = words.view(np.int32)
            index.append(len(parts))
            parts.append(words)
            sizes.append(len(words))
            at += len(words)
        parts.append(_PAD)  # never empty: views of an empty buffer cannot change dtype
        sizes.append(1)
        if self.on_cpu:
            dev = torch.from_numpy(np.concatenate(parts))
        else:
            host, done = self._pinned(at + 1)
            np.concatenate(parts, out=host.numpy()[: at + 1])
            dev = host[: at + 1].to(self.device, non_blocking=True)
            done.record(torch.cuda.current_stream(self.device))
            self.ring.append((host, done))
        pieces = dev.split_with_sizes(sizes)
        return [pieces[i] if a.dtype == np.int32 and a.ndim == 1 else
                pieces[i].view(_TORCH_DTYPES[a.dtype]).view(a.shape) for i, a in zip(index, arrays)]

    def _pinned(self, n: int) -> tuple[torch.Tensor, torch.cuda.Event]:
        """The oldest buffer if its last copy has run, else a new one; grown to at least ``n`` words."""
        if self.ring and self.ring[0][1].query():
            host, done = self.ring.popleft()
        else:
            host, done = torch.empty(0, dtype=torch.int32), torch.cuda.Event()
        if host.numel() < n:
            host = torch.empty(max(n, 2 * host.numel(), 16 << 10), dtype=torch.int32, pin_memory=True)
        return host, done
