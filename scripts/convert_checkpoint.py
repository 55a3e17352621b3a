"""Convert between a sharded checkpoint directory and one file of full
tensors: a ``torch.save`` file or a ``.safetensors`` file.

Owns: the command line of ``composable_shard.checkpoint.convert``
(``dcp_to_torch_save`` / ``torch_save_to_dcp`` / ``dcp_to_safetensors`` /
``safetensors_to_dcp``). Knows nothing of: how checkpoints are laid out (the
library does).

No process group is needed; run it on one machine that sees the directory::

    # the unsharded model's state dict (original names and shapes), loadable
    # with model.load_state_dict(torch.load("model.pt")) by the plain model:
    python scripts/convert_checkpoint.py to-torch CHECKPOINT_DIR model.pt
    # everything saved (model, optimizer, extra state), nested:
    python scripts/convert_checkpoint.py to-torch CHECKPOINT_DIR all.pt --everything
    # back: a directory load_checkpoint reads at any world size
    python scripts/convert_checkpoint.py to-dcp model.pt CHECKPOINT_DIR

    # the model as one safetensors file, tied weights stored once (as
    # transformers' save_pretrained writes them; load it with
    # safetensors.torch.load_model(model, path, strict=True) or, beside a
    # config.json, with from_pretrained):
    python scripts/convert_checkpoint.py to-safetensors CHECKPOINT_DIR model.safetensors
    # back (tied aliases from the file's metadata, or --tie ALIAS=NAME):
    python scripts/convert_checkpoint.py from-safetensors model.safetensors CHECKPOINT_DIR

The whole model is read into memory on this machine.

Reading a checkpoint never runs code from its files: its pickles are read as
data, and anything beyond plain data is refused (README, "Checkpoints are
data"). To admit a type of yours, name it (its module is imported)::

    python scripts/convert_checkpoint.py to-torch DIR all.pt --everything --safe-global mypkg.schedules.Warmup

and ``--trusted`` reads a checkpoint you trust unrestricted (never the default).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from composable_shard.checkpoint.convert import (  # noqa: E402
    dcp_to_safetensors,
    dcp_to_torch_save,
    safetensors_to_dcp,
    torch_save_to_dcp,
)

logger = logging.getLogger("convert_checkpoint")


def _tie(text: str) -> tuple[str, str]:
    alias, sep, canonical = text.partition("=")
    if not sep or not alias or not canonical:
        raise argparse.ArgumentTypeError(f"--tie expects ALIAS=NAME (e.g. lm_head.weight=model.embed_tokens.weight), got '{text}'")
    return alias, canonical


def _safe_global(text: str) -> object:
    module, _, name = text.rpartition(".")
    if not module:
        raise argparse.ArgumentTypeError(f"--safe-global expects MODULE.NAME (e.g. mypkg.schedules.Warmup), got '{text}'")
    try:
        found: object = importlib.import_module(module)
        for part in name.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as exc:
        raise argparse.ArgumentTypeError(f"--safe-global {text}: cannot find it ({exc}); check the name and PYTHONPATH") from exc
    return found


def _add_trust_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--safe-global", type=_safe_global, action="append", default=[], metavar="MODULE.NAME",
        help="admit this class or function in the checkpoint's pickles (repeatable)",
    )
    parser.add_argument("--trusted", action="store_true", help="read the checkpoint's pickles unrestricted (only one you trust)")
    parser.add_argument(
        "--allow-links-outside", action="store_true",
        help="follow symbolic links that lead out of the checkpoint directory (refused by default)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    to_torch = commands.add_parser("to-torch", help="checkpoint directory -> one torch.save file")
    to_torch.add_argument("checkpoint_dir", type=Path)
    to_torch.add_argument("output", type=Path)
    to_torch.add_argument("--everything", action="store_true", help="also the optimizer and extra state, nested")
    _add_trust_options(to_torch)
    to_dcp = commands.add_parser("to-dcp", help="torch.save file -> checkpoint directory")
    to_dcp.add_argument("input", type=Path)
    to_dcp.add_argument("checkpoint_dir", type=Path)
    to_st = commands.add_parser("to-safetensors", help="checkpoint directory -> one .safetensors file of the model")
    to_st.add_argument("checkpoint_dir", type=Path)
    to_st.add_argument("output", type=Path)
    _add_trust_options(to_st)
    from_st = commands.add_parser("from-safetensors", help=".safetensors file -> checkpoint directory")
    from_st.add_argument("input", type=Path)
    from_st.add_argument("checkpoint_dir", type=Path)
    from_st.add_argument("--tie", type=_tie, action="append", default=[], help="ALIAS=NAME: a tied alias to restore")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "to-torch":
        dcp_to_torch_save(
            args.checkpoint_dir, args.output, everything=args.everything, trusted=args.trusted, safe_globals=args.safe_global,
            allow_links_outside=args.allow_links_outside,
        )
        logger.info("wrote %s", args.output)
    elif args.command == "to-dcp":
        torch_save_to_dcp(args.input, args.checkpoint_dir)
        logger.info("wrote %s", args.checkpoint_dir)
    elif args.command == "to-safetensors":
        dcp_to_safetensors(
            args.checkpoint_dir, args.output, trusted=args.trusted, safe_globals=args.safe_global,
            allow_links_outside=args.allow_links_outside,
        )
        logger.info("wrote %s", args.output)
    else:
        safetensors_to_dcp(args.input, args.checkpoint_dir, aliases=dict(args.tie))
        logger.info("wrote %s", args.checkpoint_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
