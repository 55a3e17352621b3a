import torch, torch.distributed as dist
from tests.support.harness_pool import run_distributed

def fn(rank, world):
    from tests.support.tensor_parallel import mesh_2x2, build_stack, parallelize, global_batch, local_slice, local_loss, reference_loss
    from composable_shard import fully_shard, clip_grad_norm_, unshard_params
    import copy
    mesh = mesh_2x2()
    ref = build_stack(); model = copy.deepcopy(ref)
    parallelize(model, mesh["tp"])
    for b in model.blocks: fully_shard(b, device_mesh=mesh["dp"])
    fully_shard(model, device_mesh=mesh["dp"])
    x = global_batch(0)
    reference_loss(ref(x)).backward()
    local_loss(model(local_slice(x, mesh)), x, mesh).backward()
    n1 = clip_grad_norm_(model, 100.0); n2 = torch.nn.utils.clip_grad_norm_(ref.parameters(), 100.0)
    from composable_shard.state import unit_states_under
    loc = []
    for _, st in unit_states_under(model):
        for h in st.handles:
            for p, spec in zip(h.orig_params, h.tp_specs):
                loc.append((spec.is_sharded if spec else None, float(p.grad._local_tensor.norm()**2) if p.grad is not None else None, p.grad._local_tensor.numel() if p.grad is not None else None))
    return float(n1), float(n2), loc
    out = []
    with unshard_params(model, with_grads=True):
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            g = p.grad
            out.append((n, type(p).__name__, getattr(g, "placements", None), float(q.grad.norm()), float(g.full_tensor().norm()) if hasattr(g, "full_tensor") else None))
    return out

if __name__ == "__main__":
    for r in run_distributed(fn, 4, timeout=120): print(r)
