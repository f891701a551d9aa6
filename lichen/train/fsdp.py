"""torch.distributed plumbing of the multi-rank trainer: the process group, FSDP2 sharding, sums across ranks.

Sharding is FSDP2 (`torch.distributed.fsdp.fully_shard`): each decoder layer is one unit, the root holds the
embeddings, the final norm and the LM head. Gradients are SUMMED across ranks, not averaged: every micro-batch's
loss is already its share of the global batch's loss (lichen.algo.aggregate_loss with global counts), so the sum
of the ranks' gradients is the global batch's gradient, as one rank would compute it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from datetime import timedelta
from typing import Any, Callable, ContextManager, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lichen.models.sharded_load import ShardedLoad


def default_backend(device: torch.device, *, cpu_offload: bool = False) -> str:
    """nccl on CUDA, gloo on CPU; with CPU offload on CUDA both (the sharded parameters, their gradients and the
    optimizer live in host memory, so gradient clipping's norm is reduced over CPU tensors: gloo)."""
    if device.type != "cuda":
        return "gloo"
    return "cpu:gloo,cuda:nccl" if cpu_offload else "nccl"


def offloads_to_cpu(requested: bool, device: torch.device) -> bool:
    """--optimizer-cpu-offload takes effect on CUDA; a CPU trainer's state is in host memory already."""
    return requested and device.type == "cuda"


def init_process_group(
    *, rank: int, world_size: int, master_addr: str, master_port: int, backend: str, timeout_s: float = 600.0
) -> None:
    """Join the trainer's process group over TCP at master_addr:master_port (rank 0 hosts the store).

    torch's own rendezvous (init_method="tcp://...") has rank 0's store listen on every interface whatever
    master_addr says, and the store has no authentication; so rank 0 binds the listening socket to master_addr
    itself and hands it to the store. With every rank on one host (master_addr loopback), gloo's sockets are put
    on the loopback interface too (GLOO_SOCKET_IFNAME; a value the user set is kept), not the address the host
    name resolves to. Across hosts gloo binds the host's own address, which the other ranks need.
    """
    timeout = timedelta(seconds=timeout_s)
    family, _, _, _, sockaddr = socket.getaddrinfo(master_addr, master_port, type=socket.SOCK_STREAM)[0]
    if "gloo" in backend and ipaddress.ip_address(sockaddr[0]).is_loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
    listen_fd = None
    if rank == 0:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(max(world_size, 128))
        listen_fd = sock.detach()  # the store owns (and closes) the descriptor
    store = dist.TCPStore(master_addr, master_port, world_size, rank == 0, timeout, master_listen_fd=listen_fd)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _loopback_interface() -> str:
    """The name of the loopback network interface ("lo" on Linux, "lo0" on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n in ("lo", "lo0")), next((n for n in names if n.startswith("lo")), "lo"))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a policy model, one FSDP2 unit each: the HF module's own (HFCausalLM.decoder_layers:
    the classes it names in `_no_split_modules`, MoE layers included), else lichen's `model.layers`."""
    if hasattr(model, "decoder_layers"):
        return model.decoder_layers()
    return list(model.model.layers)


def shard(model: nn.Module, *, layers: list[nn.Module], bf16: bool, cpu_offload: bool = False) -> nn.Module:
    """FSDP2 over every rank of the default group, in place, one unit per module of `layers` plus the root;
    returns `model`.

    bf16: parameters are all-gathered and computed in bfloat16 (MixedPrecisionPolicy; gloo carries bf16 on CPU),
    gradients reduced in float32 into the float32 master shards.

    The root unit keeps its parameters gathered after `forward` (reshard_after_forward=False), so `logits` (the LM
    head, called after `forward`, only where a caller needs logits) reads the full embeddings / LM head, and their
    gradients from both calls are reduced once, when the whole backward is done. A no-grad forward therefore
    leaves the root's module parameters as the gathered tensors (which carry no gradient): call `reshard` after
    it, before anything reads `model.parameters()` (gradient clipping does).

    cpu_offload (`--optimizer-cpu-offload`, CUDA only): FSDP2's CPUOffloadPolicy. The sharded float32 parameters,
    their gradients and the AdamW state stay in (pinned) host memory and the optimizer steps there; each unit's
    parameters are copied to the GPU for its forward and backward. Device memory then holds activations and one
    unit's gathered parameters; the cost is the host-device copies and a CPU optimizer step.

    Units sharded already are left as they are: a model built sharded (`sharded_load`) passes through unchanged,
    and the critic's wrapper around such a backbone gets a root unit of its own (its value head).
    """
    mp = MixedPrecisionPolicy()
    if bf16:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # pinned host memory (faster copies) needs CUDA; a CPU-only process (the tests) runs the same policy unpinned
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    for layer in layers:
        if not isinstance(layer, FSDPModule):  # already sharded at load (lichen.models.sharded_load)
            fully_shard(layer, mp_policy=mp, offload_policy=offload)
    if not isinstance(model, FSDPModule):
        fully_shard(model, mp_policy=mp, offload_policy=offload, reshard_after_forward=False)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum, see the module docstring
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    return model


def sharded_load(
    *, bf16: bool, region: Callable[[], ContextManager[object]] | None = None, cpu_offload: bool = False
) -> ShardedLoad:
    """What `lichen.models.sharded_load.sharded_loading` needs to build a model sharded as `shard` does it (one unit
    per decoder layer plus the root), its shards allocated inside `region()` when given; with `cpu_offload` the
    shards are allocated in host memory, where CPUOffloadPolicy keeps them."""

    def shard_it(model: nn.Module) -> nn.Module:
        return shard(model, layers=decoder_layers(model), bf16=bf16, cpu_offload=cpu_offload)

    return ShardedLoad(shard_it, region or contextlib.nullcontext, device="cpu" if cpu_offload else None)


def reshard(model: nn.Module) -> None:
    """Free the gathered parameters of every FSDP unit of `model`: its parameters are the sharded ones again."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """In place: the sum of `t` over all ranks (each rank filled a disjoint part, or a partial sum)."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def full_tensors(
    model: nn.Module, names: list[str], dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full parameter) for each of `names`, one at a time: a DTensor shard's `full_tensor()` (an
    all-gather: every rank must ask for the same names in the same order), else the tensor itself. Only one full
    tensor is alive per step of the iteration, so a weight sync never holds the whole model.

    dtype: floating-point shards are cast to it before the all-gather (a bf16 engine's sync moves half the bytes
    of fp32; casting is elementwise, so the result equals the gathered tensor cast); tensors held whole are
    yielded as they are."""
    reshard(model)  # the root's parameters are the sharded ones again after a no-grad forward
    params = dict(model.named_parameters())
    for name in names:
        p = params[name].detach()
        if not isinstance(p, DTensor):
            yield name, p
            continue
        if dtype is not None and p.is_floating_point() and p.dtype != dtype:
            cast = p.to(dtype)
            assert isinstance(cast, DTensor)  # an elementwise op keeps the placement: still this rank's shard
            p = cast
        yield name, p.full_tensor()


def owned_tensors(
    model: nn.Module,
    names: list[str],
    owner: dict[str, int],
    dtype: torch.dtype | None = None,
    group_bytes: int = 32 << 20,
    into: Callable[[str], torch.Tensor | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(name, full parameter) on the rank `owner[name]`, (name, None) on the others, for each of `names` in order:
    every rank must ask for the same names in the same order (the exchanges are collectives).

    Parameters sharded on dim 0 over all ranks (FSDP2's layout: rank r holds rows [r c, (r+1) c) of the d0 rows,
    c = ceil(d0 / N), the last ranks fewer or none) are exchanged a group of about `group_bytes` (full-tensor
    bytes) at a time in one all-to-all: every rank sends its shard of each tensor another rank owns, padded to c
    rows, to the owner, which copies each source's rows into the full tensor once (its own shard straight from
    its memory). Against `full_tensors` (an all-gather: every rank receives the whole model) each rank receives
    only what it owns; with the tensors spread over the owners, the ranks receive at the same time, so the
    exchange's time divides by the ranks too. The exchange of a group is started before the previous group's
    tensors are yielded, so it runs while the caller works on them (encodes, copies, broadcasts): two groups'
    received bytes are held at most. `into(name)`, when given, is where the owner builds the full tensor (a
    contiguous tensor of its shape and dtype, e.g. a slice of a broadcast bucket: no copy after) or None for a new
    one. One rank yields its shards as they are (they are the full tensors). Any other layout falls back to
    `full_tensor()` on every rank. dtype: floating-point shards are cast to it first, as in `full_tensors`;
    tensors held whole are yielded as they are."""
    reshard(model)
    return owned_of(dict(model.named_parameters()), names, owner, dtype, group_bytes, into)


def write_local_rows(model: nn.Module, names: list[str], views: list[torch.Tensor]) -> None:
    """Every rank writes its own rows of each of `names` into `views[i]` (a buffer of the full tensor's shape that
    every rank maps: a shared-memory bucket on this host), cast to the view's dtype: FSDP2's dim-0 shards land at
    rows [r c, r c + their rows) with c = ceil(d0 / N), so the ranks assemble each tensor together, at the same
    time, and no shard crosses a process boundary. A parameter in any other layout is gathered by every rank
    (`full_tensor()`, a collective, in `names` order) and written by rank 0; one held whole, by rank 0."""
    reshard(model)
    params = dict(model.named_parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    for name, view in zip(names, views):
        p = params[name].detach()
        if isinstance(p, DTensor) and _rows_over_all_ranks(p, world):
            local = p.to_local()
            d0, c = p.shape[0], -(-p.shape[0] // world)
            want = max(0, min(c, d0 - rank * c))
            if local.shape[0] != want:  # the rule every rank assumes; a different layout is a bug, said at once
                raise RuntimeError(f"a dim-0 shard of {tuple(p.shape)} on rank {rank} has {local.shape[0]} rows")
            if want:
                view[rank * c : rank * c + want].copy_(local)
            continue
        whole = p.full_tensor() if isinstance(p, DTensor) else p
        if rank == 0:
            view.copy_(whole)


def owned_of(
    tensors: dict[str, torch.Tensor],
    names: list[str],
    owner: dict[str, int],
    dtype: torch.dtype | None = None,
    group_bytes: int = 32 << 20,
    into: Callable[[str], torch.Tensor | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """`owned_tensors` over `tensors` (a module's parameters or its state dict: DTensors or tensors held whole)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pending: list[tuple[str, DTensor]] = []
    size = 0
    in_flight: _Exchange | None = None  # started, its tensors not yet yielded
    for name in names:
        p = tensors[name].detach()
        if isinstance(p, DTensor) and dtype is not None and p.is_floating_point() and p.dtype != dtype:
            cast = p.to(dtype)
            assert isinstance(cast, DTensor)  # an elementwise op keeps the placement
            p = cast
        if isinstance(p, DTensor) and _rows_over_all_ranks(p, world):
            pending.append((name, p))
            size += p.numel() * p.element_size()
            if size >= group_bytes:
                started = _Exchange(pending, owner, rank, world, into)
                if in_flight is not None:
                    yield from in_flight.tensors()
                in_flight, pending, size = started, [], 0
            continue
        # in order: what came before goes first
        for group in (in_flight, _Exchange(pending, owner, rank, world, into)):
            if group is not None:
                yield from group.tensors()
        in_flight, pending, size = None, [], 0
        if isinstance(p, DTensor):
            p = p.full_tensor()
        yield name, (p if owner[name] == rank else None)
    for group in (in_flight, _Exchange(pending, owner, rank, world, into)):
        if group is not None:
            yield from group.tensors()


def _rows_over_all_ranks(p: DTensor, world: int) -> bool:
    """Whether `p` is sharded on dim 0 over one mesh dimension holding ranks 0..world-1 in order."""
    from torch.distributed.tensor import Shard

    mesh = p.device_mesh
    return (
        mesh.ndim == 1
        and p.dim() > 0
        and p.shape[0] > 0
        and tuple(p.placements) == (Shard(0),)
        and mesh.mesh.flatten().tolist() == list(range(world))
    )


def _padded_shard(p: DTensor, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of a dim-0 sharded `p`, padded with zeros to c = ceil(d0 / world) rows, contiguous."""
    local = p.to_local()
    d0 = p.shape[0]
    c = -(-d0 // world)
    want = max(0, min(c, d0 - rank * c))
    if local.shape[0] != want:  # every rank computes the same rule: a different layout is a bug, said at once
        raise RuntimeError(f"a dim-0 shard of {tuple(p.shape)} on rank {rank} has {local.shape[0]} rows, not {want}")
    if want == c:
        return local.contiguous()
    out = local.new_zeros((c, *p.shape[1:]))
    out[:want].copy_(local)
    return out


class _Exchange:
    """One all_to_all_single of the padded shards of the dim-0 sharded `items`, started at construction (async);
    `tensors()` waits for it and yields the full tensors on their owners (None elsewhere), in order.

    A rank sends its shard of each tensor another rank owns (destination-major, each owner's in `items` order) and
    receives, from every other rank, its shard of each tensor it owns (source-major); its own shards of what it
    owns never enter the exchange. An owned tensor is then built with one copy of each source's rows into the full
    tensor (`into(name)`, a caller's buffer such as a slice of a broadcast bucket, or a new one)."""

    def __init__(
        self,
        items: list[tuple[str, DTensor]],
        owner: dict[str, int],
        rank: int,
        world: int,
        into: Callable[[str], torch.Tensor | None] | None = None,
    ):
        self.items, self.rank, self.world, self.into = items, rank, world, into
        self.work: Any = None
        self.send: torch.Tensor | None = None  # alive until the exchange is done
        self.received: torch.Tensor | None = None
        self.offsets: dict[int, int] = {}  # owned item -> byte offset of its shard within each source's chunk
        self.per_source = 0  # bytes each other rank sends this one: the padded shards of what it owns
        if not items or world == 1:
            return
        padded = [_padded_bytes(p, world) for _, p in items]
        for i, (name, _) in enumerate(items):
            if owner[name] == rank:
                self.offsets[i] = self.per_source
                self.per_source += padded[i]
        others = sorted((i for i, (n, _) in enumerate(items) if owner[n] != rank), key=lambda i: owner[items[i][0]])
        shards = [_padded_shard(items[i][1], rank, world).reshape(-1).view(torch.uint8) for i in others]
        device = items[0][1].to_local().device
        send = torch.cat(shards) if shards else torch.empty(0, dtype=torch.uint8, device=device)
        del shards
        in_splits = [
            0 if r == rank else sum(padded[i] for i in others if owner[items[i][0]] == r) for r in range(world)
        ]
        out_splits = [0 if s == rank else self.per_source for s in range(world)]
        self.received = torch.empty(self.per_source * (world - 1), dtype=torch.uint8, device=device)
        self.send = send
        self.work = dist.all_to_all_single(
            self.received, send, out_splits, in_splits, group=items[0][1].device_mesh.get_group(), async_op=True
        )

    def tensors(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        if self.world == 1:
            for name, p in self.items:
                yield name, p.to_local()
            return
        if self.work is not None:
            self.work.wait()
            self.work = self.send = None
        for i, (name, p) in enumerate(self.items):  # one full tensor built at a time, as the caller takes it
            if i not in self.offsets:
                yield name, None
                continue
            yield name, self._build(name, p, self.offsets[i])
        self.received = None

    def _build(self, name: str, p: DTensor, start: int) -> torch.Tensor:
        """The full tensor `p` from this rank's shard and the other ranks' received rows (source s: rows [s c, ...))."""
        world, d0 = self.world, p.shape[0]
        c = -(-d0 // world)
        out = self.into(name) if self.into is not None else None
        if out is None:
            out = torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device)
        elif out.shape != p.shape or out.dtype != p.dtype or not out.is_contiguous():
            raise RuntimeError(f"{name}: into() gave {tuple(out.shape)} {out.dtype}, not {tuple(p.shape)} {p.dtype}")
        row = p.numel() // d0 * p.element_size()  # bytes per row
        flat = out.view(-1).view(torch.uint8)
        assert self.received is not None
        for s in range(world):
            rows = max(0, min(c, d0 - s * c))
            if not rows:
                continue
            dst = flat[s * c * row : (s * c + rows) * row]
            if s == self.rank:
                local = p.to_local()
                if local.shape[0] != rows:  # the rule every rank computes (_padded_shard): a different layout is a bug
                    raise RuntimeError(
                        f"a dim-0 shard of {tuple(p.shape)} on rank {s} has {local.shape[0]} rows, not {rows}"
                    )
                dst.copy_(local.reshape(-1).view(torch.uint8))
            else:
                j = s if s < self.rank else s - 1  # the received chunks skip this rank
                at = j * self.per_source + start
                dst.copy_(self.received[at : at + rows * row])
        return out


def _padded_bytes(p: DTensor, world: int) -> int:
    """Bytes of one rank's shard of dim-0 sharded `p` padded to c = ceil(d0 / world) rows."""
    return -(-p.shape[0] // world) * (p.numel() // p.shape[0]) * p.element_size()


def full_weights(model: nn.Module, *, parameters_only: bool = False) -> dict[str, torch.Tensor] | None:
    """The full (unsharded) weights on CPU on rank 0, None on the others. Every rank must call it (it gathers).

    parameters_only: the parameters under `named_parameters()`'s names, what the single-rank trainer sends to the
    engines (TrainActor.named_weights): no buffers, and a tied LM head once (an HF module's state dict names it
    twice, `model.embed_tokens.weight` and `lm_head.weight`, where the engine serves one parameter)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if parameters_only:
        names = {name for name, _ in model.named_parameters()}
        state = {k: v for k, v in state.items() if k in names}
    if dist.get_world_size() == 1:  # one CPU rank: the "gathered" tensors are the parameters themselves
        state = {k: v.clone() for k, v in state.items()}
    return state if dist.get_rank() == 0 else None
