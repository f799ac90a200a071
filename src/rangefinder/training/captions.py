"""Tag-shuffled training captions, conditioned afresh for every micro-batch.

With `training.shuffle_tags` a caption's order changes each time its image is drawn, so its text embedding cannot be
encoded once and cached like a fixed caption's: the number of distinct orders grows factorially with the tags, and
caching each would fill the disk with entries read once. The training captions are therefore encoded per micro-batch
by the frozen text encoder (a CLIP forward, small next to the UNet's forward and backward); validation captions are
never shuffled and stay cached. The orders are drawn from the run's training generator (state.RunState.train_gen),
which every checkpoint saves, so a resumed run draws exactly the orders the uninterrupted run would have.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from rangefinder.data.captions import movable_tags, shuffled_caption


@dataclass
class ShuffledCaptions:
    captions: list[str]  # the training items' captions, as the method transformed them
    keep_tokens: int  # the first tags stay in place
    tokenize: Callable[[Sequence[str]], torch.Tensor]  # captions -> (B, 77) ids
    # (B, 77) ids on the device -> (B, 77, D) hidden states (the frozen encoder); None when the text encoder trains,
    # in which case the loop gets the ids and the denoiser encodes them.
    encode: Optional[Callable[[torch.Tensor], torch.Tensor]]
    device: torch.device

    def texts(self, indices: Sequence[int], gen: torch.Generator) -> list[str]:
        """The captions of the items, each in a fresh order drawn from `gen` (one randperm per caption that has two
        or more movable tags)."""
        out = []
        for i in indices:
            text = self.captions[i]
            n = movable_tags(text, self.keep_tokens)
            if n < 2:
                out.append(text)
                continue
            out.append(shuffled_caption(text, self.keep_tokens, torch.randperm(n, generator=gen).tolist()))
        return out

    @torch.no_grad()
    def cond(self, indices: Sequence[int], gen: torch.Generator) -> torch.Tensor:
        """(B, 77, D) fp32 hidden states on the CPU (as the cached ones), or (B, 77) ids when the encoder trains."""
        ids = self.tokenize(self.texts(indices, gen))
        if self.encode is None:
            return ids
        return self.encode(ids.to(self.device)).float().cpu()
