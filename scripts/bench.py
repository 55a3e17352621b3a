"""Benchmark composable_shard against its peers on one GPT, in one run.

Run::

    python scripts/bench.py                                  # 2 ranks, CPU, gloo, GPT, all modes
    python scripts/bench.py --activation-checkpointing
    python scripts/bench.py --mixed-precision bf16           # sized down: see bench/configs.py
    python scripts/bench.py --config lora                    # frozen base, LoRA adapters per block
    python scripts/bench.py --config many-small              # 64 narrow blocks
    python scripts/bench.py --config largest                 # largest n_layer per mode (width 1,280)
    python scripts/bench.py --config largest --memory-budget 3   # ... pretending the machine has 3 GiB
    python scripts/bench.py --config largest --optimizer-in-backward   # per-parameter AdamW stepped in backward
    python scripts/bench.py --plot step.png                  # composable_shard's plan with its measured memory
    python scripts/bench.py --config gpt-326m --modes composable_shard,fsdp1,fsdp2 --rounds 1 --steps 2 --warmup 1  # 16 x 1280
    python scripts/bench.py --rounds 5 --steps 6             # 5 rounds of 6 timed steps per mode
    python scripts/bench.py --markdown                       # the result tables as Markdown (docs/benchmarks.md)
    python scripts/bench.py --device cuda --world-size 8 --mixed-precision bf16
    python scripts/bench.py --device cuda --simulate-world-size 64 --cpu-offload --mixed-precision bf16
    python scripts/bench.py --device cuda --simulate-world-size 8 --overlap-report   # lanes vs compute, per step
    python scripts/bench.py comm | checkpoint | tp | scale | runtime-memory | skipped-units | tag-check | overhead [--help]

The subcommands (listed by ``--help``) are other measurements, one module
of ``bench/`` each; every one takes ``--help``.

The script spawns its own processes (``torch.multiprocessing``); do not start
it with torchrun. What it measures and how: ``scripts/bench/__init__.py``;
configurations: ``bench/configs.py``; the modes (peers): ``bench/peers.py``.
"""

from __future__ import annotations

import sys

from bench.cli import main  # scripts/bench/, found next to this file

if __name__ == "__main__":
    sys.exit(main())
