"""What a driver process deserializes and fetches, watched from inside it (a test runs these in
the driver actor with `__ray_call__`; they live here so that the actor can import them)."""


def watch_driver(driver_actor) -> None:
    """Run inside the driver's process (`__ray_call__`): from now on, record every tensor it
    deserializes (every pickled torch storage is rebuilt by `torch.storage._load_from_bytes`, every
    tensor by one of torch._utils' `_rebuild_*`: a CUDA tensor is where "Attempting to deserialize
    object on a CUDA device" is raised), every ObjectRef it fetches, and every snapshot it keeps."""
    import ray
    import torch

    from cluster.expert_group import ExpertGroup
    seen = driver_actor.watched = {"tensors": 0, "fetched": set(), "snapshots": set()}

    def counting(fn):
        def rebuild(*args, **kwargs):
            seen["tensors"] += 1
            return fn(*args, **kwargs)
        return rebuild
    torch.storage._load_from_bytes = counting(torch.storage._load_from_bytes)
    for name in [n for n in dir(torch._utils) if n.startswith("_rebuild")]:
        setattr(torch._utils, name, counting(getattr(torch._utils, name)))
    fetch, keep = ray.get, ExpertGroup.keep

    def get(refs, *args, **kwargs):
        for ref in refs.values() if isinstance(refs, dict) else refs if isinstance(refs, list) else [refs]:
            seen["fetched"].add(ref.hex())
        return fetch(refs, *args, **kwargs)

    def kept(group, snapshot, e):
        out = keep(group, snapshot, e)
        seen["snapshots"].update(ref.hex() for ref in (out.weights, out.optimizer))
        return out
    ray.get, ExpertGroup.keep = get, kept


def watched(driver_actor) -> dict:
    """What `watch_driver` recorded so far."""
    return driver_actor.watched
