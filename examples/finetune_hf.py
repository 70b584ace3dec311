"""Example 3: train a Hugging Face LlamaForCausalLM with Muon under MatrixFSDP, offline, on 2 CPU processes.

The model is a small ``LlamaForCausalLM`` built from a ``LlamaConfig`` (nothing is
downloaded); to fine-tune a real checkpoint, pass ``--pretrained DIR`` (a directory
written by ``save_pretrained``, or a hub name when the machine has network access).
The data are byte tokens of local text (pydoc's help topics by default; vocabulary 256).
What makes a Hugging Face model train well under the strategy:

- ``wrap_policy=LlamaDecoderLayer``: one unit per decoder layer, the root unit takes the
  embeddings, the final norm and the LM head;
- ``activation_checkpointing_policy=LlamaDecoderLayer`` with the config's
  ``use_cache=False`` (``HFCausalLM`` sets it): the KV cache grows again when a layer
  is recomputed, and with transformers up to 5.3 torch's checkpoint then fails;
- tied embeddings (``--tied``) need nothing.

    pip install torch==2.13.0 -e ".[hf]"
    python examples/finetune_hf.py                          # 2 CPU processes, 20 steps, Muon
    python examples/finetune_hf.py --tied --no-checkpointing --max-steps 40
    python examples/finetune_hf.py --pretrained ./my-llama  # from save_pretrained(...)
"""

from __future__ import annotations

import argparse
from typing import Optional

from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger

import lightning_matrixfsdp
from lightning_matrixfsdp.demos import ByteTextDataModule, HFCausalLM, LossPrinter, OptimizerReport

LAYER = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"  # the class, or its import path


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--print-every", type=int, default=5, help="print the loss every N steps (rank 0)")
    parser.add_argument("--lr", type=float, default=0.02, help="Muon learning rate")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--tied", action="store_true", help="tie the LM head to the input embedding")
    parser.add_argument("--no-checkpointing", action="store_true", help="keep activations instead of recomputing")
    parser.add_argument("--pretrained", default=None, help="save_pretrained directory or hub name to start from")
    parser.add_argument("--data-dir", default=None, help="directory, file or glob of text; default: pydoc help topics")
    parser.add_argument("--save-dir", default="runs", help="TensorBoard log root")
    args = parser.parse_args(argv)

    seed_everything(42)
    model = HFCausalLM(
        model_type="llama",
        config=dict(
            hidden_size=64, intermediate_size=172, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=args.seq_len, tie_word_embeddings=args.tied,
        ),
        pretrained=args.pretrained,
        lr=args.lr,
    )
    strategy = lightning_matrixfsdp.MatrixFSDPStrategy(
        wrap_policy=LAYER,
        activation_checkpointing_policy=None if args.no_checkpointing else LAYER,
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        log_every_n_steps=args.print_every,
        limit_val_batches=4,
        val_check_interval=args.max_steps,  # one validation, at the end
        check_val_every_n_epoch=None,  # count val_check_interval in steps, across epochs
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,  # LossPrinter prints the losses instead
        logger=TensorBoardLogger(save_dir=args.save_dir, name="finetune_hf"),
        callbacks=[LossPrinter(every=args.print_every), OptimizerReport()],
    )
    trainer.fit(model, datamodule=ByteTextDataModule(data_dir=args.data_dir, seq_len=args.seq_len,
                                                     batch_size=args.batch_size))


if __name__ == "__main__":
    main()
