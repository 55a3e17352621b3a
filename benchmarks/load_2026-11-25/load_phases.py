"""Per-rank phases of a checkpoint load, as bench_checkpoint.py times it.

2 ranks (gloo), GPT 8 x 512 with AdamW over ``param_groups`` (the bench's
default model); a fresh ``dcp.save`` before each load (a new ``save_id``, as
in the bench); ``--mode direct``: ``get_*_state_dict``, ``dcp.load`` through
``DirectFileSystemReader``, ``set_*_state_dict``; ``--mode safe``:
``save_checkpoint`` / ``load_checkpoint``. For each load and rank: wall and
CPU (``thread_time`` of the main thread) of the load and of each wrapped
function (inclusive), and the absolute times the rank entered and left
DCP's collectives (so waits show). ``--profile DIR`` also writes a cProfile
of each rank's loads. Works on any checkout (wraps only what exists).

Usage: PYTHONPATH=<checkout> python load_phases.py --loads 20 --mode direct --out x.json
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import gc
import importlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

ACC: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
EVENTS: list[tuple[str, float, float]] = []
FINE_ON = [False]


def timed(name: str, fn):  # inclusive wall / cpu per name; recursion counted once
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            acc = ACC[name]
            acc[0] += time.perf_counter() - w0
            acc[1] += time.thread_time() - c0
            acc[2] += 1

    return wrapper


def evented(name: str, fn):  # absolute enter / leave times (for waits across ranks)
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            EVENTS.append((name, t0, time.time()))

    return wrapper


def wrap(module_name: str, attr_path: str, name: str | None = None, how=timed) -> None:
    if (name or attr_path) in FINE and not FINE_ON[0]:
        return
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return
    owner, *rest = attr_path.split(".")
    target = module
    parts = attr_path.split(".")
    for part in parts[:-1]:
        target = getattr(target, part, None)
        if target is None:
            return
    original = getattr(target, parts[-1], None)
    if original is None:
        return
    if isinstance(target, type) and isinstance(target.__dict__.get(parts[-1]), staticmethod):
        setattr(target, parts[-1], staticmethod(how(name or attr_path, original)))
    else:
        setattr(target, parts[-1], how(name or attr_path, original))


FINE = {"reader._describe", "reader._check_stored", "reader._read_direct", "reader._read_checked_item", "reader._read_item",
        "reader.box_span", "reader.layout_problem", "reader.describe_item", "planner.resolve_tensor", "planner.commit_tensor",
        "saved_tensor.check_pickle", "saved_tensor._describe_pickle", "reader.load_object", "reader._item_bytes",
        "reader._deliver", "safe_pickle.check_pickle", "safe_pickle.check_saved_pickles", "reader.check_saved_pickles"}


GC_START = [0.0, 0.0]


def gc_callback(phase: str, info: dict) -> None:  # each collection's wall / cpu, by generation
    if phase == "start":
        GC_START[:] = [time.perf_counter(), time.thread_time()]
        return
    acc = ACC[f"gc.gen{info['generation']}"]
    acc[0] += time.perf_counter() - GC_START[0]
    acc[1] += time.thread_time() - GC_START[1]
    acc[2] += 1


def instrument(fine: bool) -> None:
    gc.callbacks.append(gc_callback)
    ck = "composable_shard.checkpoint"
    for attr in ("read_metadata", "set_up_storage_reader", "prepare_local_plan", "prepare_global_plan", "read_data",
                 "_check_and_stage", "_write", "_parse_items", "_read_objects", "_read_checked_item", "_describe",
                 "_load_whole", "_item_bytes", "_open", "_read_direct", "_check_stored", "_read_item", "_read_stock"):
        wrap(f"{ck}.reader", f"DirectFileSystemReader.{attr}", f"reader.{attr}")
    for module, attr in (
        (f"{ck}.reader", "check_metadata"), (f"{ck}.reader", "load_metadata"), (f"{ck}.reader", "load_object"),
        (f"{ck}.reader", "describe_item"), (f"{ck}.reader", "resolve_inside"), (f"{ck}.reader", "open_regular"),
        (f"{ck}.reader", "agree_on_refusal"), (f"{ck}.metadata_checks", "check_metadata"), (f"{ck}.reader", "_deliver"), (f"{ck}.reader", "box_span"),
        (f"{ck}.reader", "layout_problem"), (f"{ck}.reader", "check_saved_pickles"),
        (f"{ck}.safe_pickle", "check_pickle"), (f"{ck}.safe_pickle", "check_saved_pickles"),
        (f"{ck}.safe_pickle", "read_bounded"),
        (f"{ck}.saved_tensor", "check_pickle"), (f"{ck}.saved_tensor", "_describe_pickle"),
        (f"{ck}.metadata_checks", "_check_storage"),
        (f"{ck}.metadata_checks", "resolve_inside"), (f"{ck}.metadata_checks", "open_regular"),
        (f"{ck}.save_load", "verify_checkpoint"), (f"{ck}.save_load", "_read_metadata"), (f"{ck}.save_load", "_read"),
        (f"{ck}.save_load", "saved_paths"), (f"{ck}.save_load", "model_destination"),
        (f"{ck}.save_load", "optim_destination"), (f"{ck}.save_load", "_optim_to_check"),
        (f"{ck}.save_load", "check_optimizer_state_dict"), (f"{ck}.save_load", "set_model_state_dict"),
        (f"{ck}.save_load", "set_optimizer_state_dict"), (f"{ck}.save_load", "model_entries"),
        (f"{ck}.save_load", "prepare_units"),
    ):
        wrap(module, attr, f"{module.rsplit('.', 1)[-1]}.{attr}")
    planner = "torch.distributed.checkpoint.default_planner"
    for attr in ("set_up_planner", "create_local_plan", "create_global_plan", "finish_plan", "resolve_tensor", "commit_tensor"):
        wrap(planner, f"DefaultLoadPlanner.{attr}", f"planner.{attr}")
    utils = "torch.distributed.checkpoint.utils"
    for attr in ("reduce_scatter", "all_gather", "broadcast_object", "all_reduce"):
        wrap(utils, f"_DistWrapper.{attr}", f"dist.{attr}")
        wrap(utils, f"_DistWrapper.{attr}", f"dist.{attr}", how=evented)


def build(args):
    sys.path.insert(0, os.path.join(os.environ["PYTHONPATH"].split(":")[0], "examples"))
    from gpt import GPT, GPTConfig, param_groups

    from composable_shard import fully_shard

    config = GPTConfig(block_size=256, n_layer=8, n_head=8, n_embd=512)
    model = GPT(config, seed=0)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3)
    idx = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(dist.get_rank()))
    _, loss = model(idx, idx)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def worker(rank: int, args, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world)
    import composable_shard as api
    from composable_shard.checkpoint import DirectFileSystemReader

    model, optimizer = build(args)
    path = os.path.join(args.dir, "ckpt")

    def save():
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        if args.mode == "safe":
            api.save_checkpoint(path, model, optimizer)
        else:
            dcp.save({"model": api.get_model_state_dict(model), "optim": api.get_optimizer_state_dict(model, optimizer)}, checkpoint_id=path)

    def load():
        if args.mode == "safe":
            api.load_checkpoint(path, model, optimizer)
            return
        state = {"model": T("get_model_state_dict", api.get_model_state_dict)(model),
                 "optim": T("get_optimizer_state_dict", api.get_optimizer_state_dict)(model, optimizer)}
        T("dcp.load", dcp.load)(state, storage_reader=DirectFileSystemReader(path))
        T("set_model_state_dict", api.set_model_state_dict)(model, state["model"])
        T("set_optimizer_state_dict", api.set_optimizer_state_dict)(model, optimizer, state["optim"])

    def T(name, fn):
        return timed(name, fn)

    FINE_ON[0] = args.fine
    instrument(args.fine)
    profile = cProfile.Profile(time.thread_time) if args.profile else None  # CPU of the main thread
    samples = []
    for i in range(-args.warmup, args.loads):
        if args.gc_freeze and i == 0:
            gc.collect()
            gc.freeze()  # the model, torch and the warm-up's objects: a full collection then skips them
        save()
        dist.barrier()
        ACC.clear()
        EVENTS.clear()
        if profile is not None and i >= 0:
            profile.enable()
        t0, w0, c0 = time.time(), time.perf_counter(), time.thread_time()
        load()
        w1, c1, t1 = time.perf_counter(), time.thread_time(), time.time()
        if profile is not None and i >= 0:
            profile.disable()
        dist.barrier()
        w2 = time.perf_counter()
        if i >= 0:
            samples.append({
                "start": t0, "end": t1, "wall": w1 - w0, "cpu": c1 - c0, "wall_barrier": w2 - w0,
                "phases": {k: list(v) for k, v in ACC.items()},
                "events": [(n, a - t0, b - t0) for n, a, b in EVENTS],
            })
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(samples, f)
    if profile is not None:
        profile.dump_stats(f"{args.profile}.rank{rank}.prof")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--loads", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--mode", choices=["direct", "safe"], default="direct")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--profile", default="")
    p.add_argument("--dir", default="")
    p.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after the warm-up (for profiles without 150 ms collections)")
    p.add_argument("--keep", action="store_true", help="keep the last checkpoint in --dir/ckpt")
    p.add_argument("--fine", action="store_true", help="also wrap the per-item functions (adds ~1 us per call)")
    args = p.parse_args()
    args.dir = args.dir or tempfile.mkdtemp(prefix="load_phases_")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(worker, args=(args, port, out), nprocs=args.world, join=True)
        per_rank = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(args.world)]
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)
    with open(args.out, "w") as f:
        json.dump({"checkout": os.environ.get("PYTHONPATH", ""), "mode": args.mode, "ranks": per_rank}, f)


if __name__ == "__main__":
    main()
