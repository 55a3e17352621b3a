"""Benchmark composable_shard against its peers on one GPT, in one run.

Owns: the comparison of step time, memory and loss between
``composable_shard``, FSDP1, FSDP2, DDP and unsharded references, on CPU
(gloo) or CUDA (NCCL, or PyTorch's fake process group).
Knows nothing of: how any of them works inside.

The entry point is ``scripts/bench.py`` (its docstring lists the command
lines). The package, one concern per module, each depending only on those
above it::

    configs.py    the model configurations (--config): sizes, LoRA or not.
                  A new configuration is one entry in CONFIGS.
    models.py     the model every mode starts from, its optimizer
    peers.py      the modes: how each wraps the model (MODES, PEERS).
                  A new peer is one builder function and one PEERS entry.
    training.py   one mode's run in one rank: batches, steps, the schedule
    processes.py  the worker processes: CPU (gloo), CUDA (NCCL) or
                  simulated (PyTorch's fake process group); the malloc switch
    timing.py     the timing pass (all modes interleaved), --profile and
                  --overlap-report
    overlap.py    --overlap-report: the lanes' device time overlapped by
                  compute, per profiled step (interval arithmetic + profiler)
    memory.py     the memory pass (each mode in fresh processes)
    report.py     collecting the ranks' records, the printed table
    markdown.py   --markdown: a table as Markdown, the same cells
    trials.py     --config largest: one trial (one mode, one n_layer) in
                  fresh processes, and the memory watchdog that stops it
    largest.py    --config largest: the budget, the plan's prediction, the
                  search for each mode's largest n_layer, its table
    plot.py       --plot: composable_shard's memory sampled at every hook
                  of one step on rank 0, drawn over its plan
    cli.py        the command line and the order of the passes; the
                  subcommands (SUBCOMMANDS), each one module below

Subcommands (``bench.py NAME ...``), each its own measurement:

    collectives.py     comm: the handle's collectives vs raw torch.distributed
    checkpoints.py     checkpoint: sharded save / load vs FSDP2's
    tensor_parallel.py tp: composable_shard + TP vs FSDP2 + TP
    scale.py           scale: 8-1,024 simulated ranks of a 7B model vs the plan
    runtime_memory.py  runtime-memory: a rank's non-tensor memory; the fit of
                       composable_shard/planning/runtime_memory.py's constants
    skipped_units.py   skipped-units: set_may_be_skipped's memory
    tag_check.py       tag-check: the tag exchange's cost on gloo
    overhead.py        overhead: the runtime's µs per unit per step against
                       FSDP2 and FSDP1, one process, fake group of 8 ranks
    phases.py          phases: where a step's time goes per mode (forward,
                       backward, optimizer step, the main thread's CPU)

Modes, each with its own model copy (same seed, so the same initial weights)
and its own AdamW (same ``param_groups``); every mode sees the same batches:

- ``composable_shard``: ``fully_shard(block)`` for each block, then ``fully_shard(model)``;
- ``fsdp1``: ``FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
  use_orig_params=True)``;
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` for each block, then the root;
- ``ddp``: ``DistributedDataParallel(model)``;
- ``local``: every rank trains an unwrapped model on its own slice, with no
  communication at all: the compute-only floor of a data-parallel step on
  this machine (ranks compete for cores as in the other modes). Its loss
  diverges from the others after the first step and is not compared.
- ``single``: rank 0 alone trains an unwrapped model on the whole global batch
  (the other ranks wait); it is the loss reference. Under bf16 it runs under
  ``torch.autocast`` (on CUDA: the single-GPU autocast model).

Distributed modes train on their rank's slice of the global batch, so their
loss (the mean over ranks) must match ``single`` up to float round-off.

Configurations (``--config``; ``--n-layer`` and friends override a preset):
see ``configs.py``. With ``--mixed-precision bf16`` on CPU the presets shrink
(bf16 matrix products are 20-60x slower than fp32 on CPUs without bf16
instructions).

How it measures:

- Step time (timing pass): all modes live in one set of processes. After
  ``--warmup`` untimed steps per mode, ``--rounds`` rounds follow; in each,
  every mode runs ``--steps`` steps in turns of ``--round-steps`` steps, the
  order rotating every turn, so machine noise hits all modes alike. Every
  step starts after a barrier and ends after the optimizer step (plus a
  device synchronize on CUDA); its time is the slowest rank's. Because the
  modes share processes, they also share the C allocator's state: glibc
  moves its mmap threshold after large frees, so one mode's allocations
  decided whether the next mode's buffers came from the heap or from fresh,
  page-faulting mmaps. That made FSDP1 and DDP 10-20% slower in runs where
  composable_shard used shared memory than where it used gloo (ratio to
  FSDP1 0.73-0.83 against 0.87-0.89, three pairs of runs), and with fixed
  thresholds both gave 0.87-0.88. So the timing processes start with
  ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` fixed at 256 MiB
  (``--no-fixed-malloc`` leaves glibc's defaults; the memory pass always
  runs with the defaults, as a user would). The table
  shows each round's median per mode (a reader sees the noise) and the
  median over all rounds.
- Memory (memory pass): interleaving makes a process's RSS meaningless per
  mode (every mode's model lives in it, and freed memory stays in the
  allocator). So each mode gets a fresh set of processes: after the process
  group and the data are set up, the peak is reset (CPU: ``/proc/self/clear_refs``
  resets the RSS high-water mark; CUDA: ``torch.cuda.reset_peak_memory_stats``),
  (after importing every mode's library: code is not the mode's memory),
  then the mode builds its model and optimizer ("after build": the level
  then, i.e. memory after sharding on CUDA) and trains ``--memory-steps``
  steps ("peak"). Both are relative to the level at the reset (CPU: RSS;
  CUDA: ``memory_allocated``), the largest over ranks (with
  ``--memory-repeats R``: the median of R passes, modes alternating). They include building
  the full model before sharding, the same for every mode. RSS is coarse
  (pages, allocator caching): compare differences of several MB, not single MBs.
- Loss: every step of every mode (warm-up included) is kept; the table shows
  the final loss and the largest difference, over all steps, from ``single``
  (or, without it, from the first mode listed). In fp32 a relative difference
  above 1e-4 is flagged and the script exits with status 1.

``--simulate-world-size W`` runs one process in PyTorch's fake process group
of W ranks (collectives do nothing): memory per rank and the runtime's own
overhead (hooks, copies, stream waits) as if on W ranks, without the
communication. Parameters are then never really gathered, so losses are
meaningless and not compared. ``ddp`` and ``local`` are not offered there.

Mixed precision (``--mixed-precision bf16``): composable_shard and FSDP1
``MixedPrecision(param_dtype=bf16, reduce_dtype=R)``, FSDP2
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=R)`` with R from
``--reduce-dtype`` (bf16 by default). DDP, local and single have no such
setting; they run their forward under ``torch.autocast(dtype=torch.bfloat16)``
with fp32 weights and gradients, which rounds differently, so in bf16 the
loss differences are shown but not flagged. The loss itself is always
computed in fp32.

``--optimizer-in-backward``: one AdamW per parameter (the groups'
settings), stepped as soon as its gradient is final and then freed
(``models.StepsInBackward``): composable_shard and FSDP2 in post-accumulate-
grad hooks, FSDP1 through its ``_in_backward_optimizers``, ``single`` as
autograd accumulates; DDP and local are left out (they would step before
the all-reduce).

``--cpu-offload`` (CUDA only): composable_shard and FSDP1
``CPUOffload(offload_params=True)``, FSDP2 ``CPUOffloadPolicy()``; the
unsharded modes keep everything on the GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The example's gpt.py and data.py, and composable_shard from this checkout,
# for the entry point and for every spawned worker (which imports this package).
for _index, _path in enumerate((ROOT / "examples", ROOT)):
    if str(_path) not in sys.path:
        sys.path.insert(_index, str(_path))
