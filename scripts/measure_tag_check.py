"""Cost of the tag exchange beside a collective on gloo's message path
(comm/tag_check.py): comm.all_gather_into at 2 ranks with
COMPOSABLE_SHARD_SHARED_MEMORY=0, tagged and untagged, interleaved, median
of 50 after 10 warm-up. Run: python scripts/measure_tag_check.py
"""
import os, time, statistics
import torch, torch.distributed as dist, torch.multiprocessing as mp
from composable_shard import comm
from composable_shard.comm import tags

def run(rank, ws):
    os.environ["COMPOSABLE_SHARD_SHARED_MEMORY"] = "0"
    os.environ["MASTER_ADDR"] = "127.0.0.1"; os.environ["MASTER_PORT"] = "29561"
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    key = object.__new__(type("K", (), {}))
    tags.register(key, 5, "unit 'x'")
    for numel in (256, 786432):
        shard = torch.randn(numel); out = torch.empty(numel * ws)
        times = {False: [], True: []}
        for i in range(60):
            for tagged in (False, True):
                dist.barrier()
                t = time.perf_counter()
                if tagged:
                    with tags.collective_of(key):
                        w = comm.all_gather_into(out, shard, None, async_op=True)
                else:
                    w = comm.all_gather_into(out, shard, None, async_op=True)
                w.wait()
                if i >= 10: times[tagged].append(time.perf_counter() - t)
        if rank == 0:
            print(f"{numel*4} bytes/rank: untagged median {statistics.median(times[False])*1e6:.0f} us, tagged {statistics.median(times[True])*1e6:.0f} us")
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(run, args=(2,), nprocs=2)
