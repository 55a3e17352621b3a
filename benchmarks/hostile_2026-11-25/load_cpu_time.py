"""One process, 1 rank, GPT 8 x 512 + AdamW (bench_checkpoint.py's default):
save (a fresh save_id each time), then the CPU time (process_time) of a load
through DirectFileSystemReader, as bench_checkpoint.py's direct mode does, or
with "safe" through save_checkpoint / load_checkpoint, as its safe mode does.
CPU time, not wall time: the machine was shared at load 30-60 when this ran.
Usage: PYTHONPATH=<checkout> python load_cpu_time.py <checkpoint dir> <port> [direct|safe]"""
import os, sys, time, shutil, json, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
sys.path.insert(0, "examples")
from gpt import GPT, GPTConfig
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
torch.set_num_threads(1)
from composable_shard import fully_shard, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict
from composable_shard.checkpoint import DirectFileSystemReader
m = GPT(GPTConfig(block_size=256, n_layer=8, n_head=8, n_embd=512), seed=0)
for b in m.blocks: fully_shard(b)
fully_shard(m)
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
idx = torch.randint(0, 50, (2, 32)); _, loss = m(idx, idx); loss.backward(); opt.step()
path = sys.argv[1]
safe = sys.argv[3:] == ["safe"]
def save():
    shutil.rmtree(path, ignore_errors=True)
    if safe:
        from composable_shard import save_checkpoint
        save_checkpoint(path, m, opt)
    else:
        dcp.save({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}, checkpoint_id=path)
def load():
    if safe:
        from composable_shard import load_checkpoint
        load_checkpoint(path, m, opt)
        return
    state = {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}
    dcp.load(state, storage_reader=DirectFileSystemReader(path))
    set_model_state_dict(m, state["model"]); set_optimizer_state_dict(m, opt, state["optim"])
save(); load()
ts = []
for _ in range(10):
    save(); s = time.process_time(); load(); ts.append(time.process_time() - s)
print(json.dumps({"load_s": ts}))
dist.destroy_process_group()
