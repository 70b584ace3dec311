"""Local data for fine-tuning ``lightning.pytorch.demos.LightningTransformer`` unmodified.

That module was not written for this package: it trains with SGD and reads
WikiText-2, which it downloads. Its batches are ``(input, target)`` token tensors of
shape ``(B, T)`` with ``target`` the input shifted by one token, exactly what
:class:`~lightning_matrixfsdp.demos.data.ByteTextDataModule` yields, so the only
work left is the vocabulary (bytes: build it with ``vocab_size=256``) and its
``prepare_data`` hook.

``LightningTransformer.prepare_data`` always calls ``WikiText2(download=True)``,
which reads ``./data/wikitext-2.txt`` when it exists and fetches it from the
network otherwise (and imports ``requests`` either way). Lightning calls the data
module's ``prepare_data`` first, on the same process, so
:class:`LocalTokenDataModule` writes a small local stand-in there when the file is
missing. The module's hook then finds its cache and never touches the network; the
batches it trains on come from this data module, not from that file. A real
WikiText-2 file already there is left alone.
"""

from __future__ import annotations

import os
from typing import Optional

from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_matrixfsdp.demos.data import ByteTextDataModule

_STANDIN_HEADER = (
    "# Local stand-in written by lightning_matrixfsdp.demos.finetune.LocalTokenDataModule so that "
    "LightningTransformer.prepare_data() needs no network. This is NOT WikiText-2; delete it freely.\n"
)


class LocalTokenDataModule(ByteTextDataModule):
    """Byte tokens of local text in LightningTransformer's batch format.

    Args:
        data_dir, max_bytes, num_workers: as in ``ByteTextDataModule``.
        val_fraction: as there; the held-out tail is left out of training, and no
            validation loader is offered (the module has no ``validation_step``).
        seq_len: tokens per example (35 is WikiText2's block size in Lightning's demo).
        batch_size: examples per batch on each rank.
        wikitext_cache: where the untouched module's ``prepare_data`` looks for its
            data (relative to the working directory); ``None`` disables the stand-in.
        cache_bytes: size of the stand-in (the module tokenizes it and discards it).
    """

    def __init__(
        self,
        data_dir: Optional[str] = None,
        seq_len: int = 35,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        max_bytes: Optional[int] = None,
        num_workers: int = 0,
        wikitext_cache: Optional[str] = os.path.join("data", "wikitext-2.txt"),
        cache_bytes: int = 64 * 1024,
    ) -> None:
        super().__init__(
            data_dir=data_dir,
            seq_len=seq_len,
            batch_size=batch_size,
            val_fraction=val_fraction,
            max_bytes=max_bytes,
            num_workers=num_workers,
        )
        self.wikitext_cache = wikitext_cache
        self.cache_bytes = cache_bytes

    # No validation data: LightningTransformer has no validation_step, and Lightning warns
    # ("val_dataloader but no validation_step") whenever a data module overrides this hook.
    # The base class's hook is what "not overridden" means to Lightning.
    val_dataloader = LightningDataModule.val_dataloader

    def prepare_data(self) -> None:
        """Give the module's own ``prepare_data`` a local file so it stays offline."""
        if self.wikitext_cache is None or os.path.exists(self.wikitext_cache):
            return
        from lightning.pytorch.demos.transformer import _REQUESTS_AVAILABLE

        if not _REQUESTS_AVAILABLE:
            rank_zero_warn(
                "LightningTransformer.prepare_data imports `requests` even when its data file exists; "
                "install it (no network is used) or the module's own hook will fail."
            )
        text = b"".join(self.documents())[: self.cache_bytes].decode("utf-8", errors="replace")
        os.makedirs(os.path.dirname(os.path.abspath(self.wikitext_cache)), exist_ok=True)
        tmp = f"{self.wikitext_cache}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(_STANDIN_HEADER + text)
        os.replace(tmp, self.wikitext_cache)  # atomic: a concurrent reader never sees half a file
        rank_zero_info(f"wrote offline stand-in {self.wikitext_cache} for LightningTransformer.prepare_data")
