"""The weight-update endpoints of `lichen serve` (docs/architecture.md#weight-sync, docs/weight-format.md#pull-weights).

- `/init_weights_update_group`: join a torch.distributed group with the trainer (rank 0) as rank `rank_offset`
  (lichen serve is one rank per engine); `nccl` on an accelerator, `gloo` on CPU. The call returns once the group
  is formed, so the trainer posts it and builds its own side of the group at the same time.
- `/update_weights_from_distributed`: receive `names` (with `dtypes`, `shapes`) broadcast from rank 0 — one
  tensor per name, or with `load_format: "flattened_bucket"` one uint8 tensor holding every tensor's bytes in
  `names` order (SGLang's FlattenedTensorBucket layout) — then copy them into the served parameters between two
  decode steps. The bytes are always received (the sender's broadcast would hang otherwise); a name the model
  lacks or a wrong shape then answers 400 and changes nothing.
- `/destroy_weights_update_group`: leave a group (400 for an unknown one, as SGLang).
- `/pull_weights`: bring a host-local checkpoint dir to a published version (lichen.weights.pull_weights: per-host
  file lock, deltas checked against their checksums); the served weights do not change here. When the served
  weights are the version the local copy held, each delta is also decoded into staging buffers (lichen.weights.
  staging: a second copy of the CPU weights, verified by the same checksums), so it is decompressed only once.
- `/update_weights_from_disk` (replaces the server's route, docs/architecture.md#live-delta-apply): when `model_path`
is a local checkpoint
  dir this server pulled into, and the served weights are an earlier version of the same publishing chain, the
  served weights move by the deltas instead of reloading the whole checkpoint: the staged tensors are swapped in
  (no copy) when the last pull staged exactly this version, else the deltas in the pulled source dir are applied
  to the live parameters (lichen.weights.apply_delta_in_place, every changed tensor checked against its
  checksum). Otherwise — and whenever the live apply fails — the checkpoint is reloaded as before.
- `/weights_checker`: `checksum` answers SGLang's shape `{"success", "message", "ranks": [{"checksums": {name:
  hex}, "per_gpu_checksum", "parallelism_info"}], "per_engine_checksum"}` with the xxh3-128 of each loaded
  parameter's raw bytes (engine dtype), computed from the parameters themselves after loading; lichen adds
  `"checksum_format": "xxh3-128"` so a trainer knows it can recompute them. `snapshot`, `reset_tensors` and
  `compare` follow SGLang (compare answers 400 naming the tensors that differ from the snapshot).

The group, bucket-layout and checksum helpers both sides use live in lichen.weights.wire.
"""

from __future__ import annotations

import asyncio
import os
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from aiohttp import web

from lichen.engines.api.protocol import RequestError, expect
from lichen.excerpt import clip, excerpt
from lichen.observe.metrics import get_logger
from lichen.weights.wire import (
    BACKENDS,
    DEFAULT_GROUP,
    WeightGroup,
    checksum_body,
    nbytes,
    open_group,
    parse_dtype,
    unflatten_tensors,
)

log = get_logger(__name__)
MAX_PROBLEMS = 5  # refusals name at most this many tensors (the names come from the request)


def apply_delta_live(
    params: dict[str, torch.Tensor],
    delta_dir: str,
    *,
    held_version: int,
    chain_id: str | None,
    num_threads: int | None = None,
) -> int:
    """Move served parameters from `held_version` to the delta version in `delta_dir`
    (lichen.weights.live_delta.apply_delta_in_place); returns the number of tensors changed."""
    from lichen.weights.live_delta import apply_delta_in_place

    return apply_delta_in_place(
        params, delta_dir, held_version=held_version, chain_id=chain_id, num_threads=num_threads
    )


def _reply(success: bool, message: str, status: int | None = None, **extra: Any) -> web.Response:
    import json

    body = {"success": success, "message": message, **extra}
    return web.Response(
        body=json.dumps(body).encode(), status=status or (200 if success else 400), content_type="application/json"
    )


@dataclass
class Held:
    """The published version the served weights are, when they came from a pulled local checkpoint dir."""

    version: int
    chain_id: str | None


class WeightEndpoints:
    """The handlers; `server` is the LichenServer (its engine, control() and pause state)."""

    def __init__(self, server: Any):
        self.server = server
        self.base_dir = server.model_path  # version 0 of a pull: the checkpoint the server started from
        self.groups: dict[str, WeightGroup] = {}
        self.pulled: dict[str, str] = {}  # local checkpoint dir -> the source dir it was last pulled from
        self.held: Held | None = None
        self.stage: Any = None  # a lichen.weights.staging.LiveStage filled by the last /pull_weights
        self.spare: dict[str, torch.Tensor] = {}  # staging buffers kept between syncs
        self.snapshot: dict[str, torch.Tensor] | None = None
        self.last_update: dict = {}  # how the last disk update was done (tests and logs read it)
        self._lock = asyncio.Lock()  # one weight transfer at a time (broadcasts of two calls must not interleave)

    def _set_held(self, held: Held | None) -> None:
        """Record what the served weights are; a stage built on other weights is dropped."""
        self.held = held
        if self.stage is not None:
            self.stage.release()
            self.stage = None

    def _stage_for_pull(self) -> Any:
        """The stage a pull should fill: the current one, or a new one on the served version (CPU weights of a
        known chain only; LICHEN_LIVE_STAGE=0 turns staging off)."""
        from lichen.weights.staging import LiveStage

        if os.environ.get("LICHEN_LIVE_STAGE", "1") == "0" or self.held is None or self.held.chain_id is None:
            return None
        if self.stage is not None and self.stage.usable:
            return self.stage
        try:
            self.stage = LiveStage(self._params(), self.held.version, self.held.chain_id, spare=self.spare)
        except ValueError:  # parameters on an accelerator: the update decodes the deltas itself
            self.stage = None
        return self.stage

    @property
    def engine(self):
        return self.server.engine

    def _params(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.engine.model.named_parameters())

    async def _object(self, request: web.Request) -> dict:
        return await self.server._object(request)

    # ---- distributed --------------------------------------------------------------------------------------
    async def init_group(self, request: web.Request) -> web.Response:
        body = await self._object(request)
        address = expect(body.get("master_address"), (str,), "master_address", "a string (rank 0's address)")
        port = body.get("master_port")
        if isinstance(port, str) and port.isdigit():
            port = int(port)  # SGLang's own test sends a string; pydantic coerces it
        expect(port, (int,), "master_port", "an integer")
        rank = expect(body.get("rank_offset"), (int,), "rank_offset", "an integer (this engine's rank)")
        world = expect(body.get("world_size"), (int,), "world_size", "an integer")
        name = expect(body.get("group_name", DEFAULT_GROUP), (str,), "group_name", "a string")
        backend = expect(body.get("backend", "nccl"), (str,), "backend", "a string")
        if backend not in BACKENDS:
            return _reply(False, f"backend must be one of {', '.join(BACKENDS)}, got {excerpt(backend)}")
        if backend == "nccl" and self.engine.device.type != "cuda":
            return _reply(
                False, f"backend nccl needs a CUDA device; this server runs on {self.engine.device}: use backend gloo"
            )
        if not 0 < rank < world:
            return _reply(False, f"rank_offset {rank} must be in [1, world_size) (rank 0 is the trainer)")
        if name in self.groups:
            return _reply(False, f"group {excerpt(name)} already exists; destroy it first")
        try:
            group = await asyncio.to_thread(
                open_group,
                backend=backend,
                master_address=address,
                master_port=port,
                rank=rank,
                world_size=world,
                group_name=name,
            )
        except Exception as e:
            return _reply(
                False, f"Failed to init custom process group {excerpt(name)}: {type(e).__name__}: {clip(str(e))}"
            )
        self.groups[name] = group
        log.info("joined weight update group %r as rank %d of %d (%s)", name, rank, world, backend)
        return _reply(True, "Succeeded to initialize custom process group.")

    async def destroy_group(self, request: web.Request) -> web.Response:
        body = await self._object(request)
        name = expect(body.get("group_name", DEFAULT_GROUP), (str,), "group_name", "a string")
        group = self.groups.pop(name, None)
        if group is None:
            return _reply(False, "The group to be destroyed does not exist.")
        await asyncio.to_thread(group.close)
        return _reply(True, "Succeeded to destroy custom process group.")

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        body = await self._object(request)
        names = expect(body.get("names"), (list,), "names", "a list of parameter names")
        dtypes = expect(body.get("dtypes"), (list,), "dtypes", "a list of dtype names")
        shapes = expect(body.get("shapes"), (list,), "shapes", "a list of shapes")
        if not len(names) == len(dtypes) == len(shapes):
            raise RequestError(
                f"names, dtypes and shapes must have one entry each per tensor; got {len(names)}, "
                f"{len(dtypes)} and {len(shapes)}",
                shape="object",
            )
        name = expect(body.get("group_name", DEFAULT_GROUP), (str,), "group_name", "a string")
        version = body.get("weight_version")
        if version is not None:
            expect(version, (str,), "weight_version", "a string")
        fmt = body.get("load_format")
        if fmt not in (None, "flattened_bucket"):
            return _reply(False, f"load_format {excerpt(fmt)} is not supported here (null or 'flattened_bucket')")
        try:
            torch_dtypes = [parse_dtype(d) for d in dtypes]
            shapes = [[int(d) for d in expect(s, (list,), "shapes[i]", "a list of integers")] for s in shapes]
        except (ValueError, TypeError) as e:
            return _reply(False, clip(str(e)))
        group = self.groups.get(name)
        if group is None:
            return _reply(False, f"group {excerpt(name)} does not exist; call /init_weights_update_group first")
        await self.server._abort_all_if(body, False)
        device = self.engine.device

        def receive() -> list[torch.Tensor]:
            if fmt == "flattened_bucket":
                flat = torch.empty(
                    sum(nbytes(d, s) for d, s in zip(torch_dtypes, shapes)), dtype=torch.uint8, device=device
                )
                group.broadcast(flat)
                return unflatten_tensors(flat, torch_dtypes, shapes)
            out = []
            for d, s in zip(torch_dtypes, shapes):
                t = torch.empty(s, dtype=d, device=device)
                group.broadcast(t)
                out.append(t)
            return out

        async with self._lock:
            try:
                tensors = await asyncio.to_thread(receive)
            except Exception as e:
                return _reply(
                    False,
                    f"Failed to receive the broadcast of group {excerpt(name)}: {type(e).__name__}: {clip(str(e))}. "
                    "The weights were not changed.",
                )
            problems = self._check_named(names, tensors)
            if problems:
                return _reply(
                    False,
                    f"Failed to update parameter online: {'; '.join(problems[:5])}. The weights were not changed.",
                )

            def apply(s) -> None:
                params = self._params()
                with torch.no_grad():
                    for n, t in zip(names, tensors):
                        if n in params:
                            params[n].copy_(t)
                if version is not None:
                    s.engine.weight_version = version
                self._set_held(None)

            await self.server.control(apply, exclusive=True)
        msg = "Succeeded to update parameter online." + (f" Weight version updated to {version}." if version else "")
        return _reply(True, msg)

    def _check_named(self, names: list[str], tensors: list[torch.Tensor]) -> list[str]:
        params = self._params()
        tied = self.engine.model.cfg.tie_word_embeddings
        problems: list[str] = []
        for n, t in zip(names, tensors):
            if len(problems) >= MAX_PROBLEMS:  # names come from the request: a bounded report of them
                break
            if n not in params:
                if not (tied and n == "lm_head.weight"):  # a tied head is the embedding: SGLang skips it too
                    problems.append(f"the model has no parameter {excerpt(n)}")
            elif tuple(t.shape) != tuple(params[n].shape):
                problems.append(f"{n}: shape {tuple(t.shape)} != {tuple(params[n].shape)}")
        return problems

    # ---- disk: pull and update ----------------------------------------------------------------------------
    async def pull_weights(self, request: web.Request) -> web.Response:
        from lichen.weights.pull import pull_weights

        body = await self._object(request)
        local = expect(body.get("local_checkpoint_dir"), (str,), "local_checkpoint_dir", "a string (a directory)")
        source = expect(body.get("source_dir"), (str,), "source_dir", "a string (a directory)")
        target = expect(body.get("target_version"), (int,), "target_version", "an integer")
        # only the directories this server was started with (403 otherwise, before anything is touched)
        local, source = self.server.weight_dirs.local(local), self.server.weight_dirs.source(source)
        async with self._lock:  # a stage reads the served weights: no update may swap them meanwhile
            stage = self._stage_for_pull()
            try:
                res = await asyncio.to_thread(pull_weights, local, source, target, base_dir=self.base_dir, stage=stage)
            except Exception as e:
                log.error("pull_weights to version %d failed: %s", target, e)
                return _reply(False, "".join(traceback.format_exception_only(type(e), e)).strip())
            finally:
                if stage is not None and not stage.usable:
                    self._set_held(self.held)  # drops it
            self.pulled[local] = source
        what = (
            "already at that version"
            if res.noop
            else f"seeded from {res.seeded_from}"
            if res.seeded_from is not None
            else "continued its chain"
        )
        deltas = f", applied deltas {res.deltas_applied}" if res.deltas_applied else ""
        return _reply(
            True,
            f"Pulled weights to version {target} ({what}{deltas}; read {res.bytes_read} bytes in {res.seconds:.3f} s).",
            bytes_read=res.bytes_read,
            deltas_applied=res.deltas_applied,
        )

    def _live_plan(self, local: str) -> tuple[list[str], Held] | None:
        """The delta dirs that take the served weights to what `local` holds, or None when a reload is needed."""
        from lichen.weights.pull import read_local_state
        from lichen.weights.versions import read_version_info, version_dir

        source, held = self.pulled.get(local), self.held
        if source is None or held is None or held.chain_id is None:
            return None
        try:
            state = read_local_state(local)
        except Exception:
            return None
        if state is None or state.get("chain_id") != held.chain_id or state["version"] <= held.version:
            return None
        dirs = []
        for v in range(held.version + 1, state["version"] + 1):
            path = version_dir(source, v)
            try:
                info = read_version_info(path)
            except Exception:
                return None
            if not info.is_delta or info.chain_id != held.chain_id:
                return None
            dirs.append(path)
        return dirs, Held(state["version"], held.chain_id)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        from lichen.weights.pull import read_local_state
        from lichen.weights.versions import read_version_info

        body = await self._object(request)
        path = expect(body.get("model_path"), (str,), "model_path", "a string (the checkpoint directory)")
        version = body.get("weight_version")
        if version is not None:
            expect(version, (str,), "weight_version", "a string")
        local = self.server.weight_dirs.model(path)  # 403 for a directory this server was not started with
        async with self._lock:
            plan = self._live_plan(local)
            if plan is not None:
                dirs, target = plan
                await self.server._abort_all_if(body, False)
                sch = self.server.scheduler
                paused = sch.num_running + sch.num_waiting if self.server.paused else 0
                stage, self.stage = self.stage, None
                staged = (
                    stage is not None
                    and stage.usable
                    and stage.version == target.version
                    and stage.base_version == self.held.version
                    and stage.chain_id == target.chain_id
                )
                if stage is not None and not staged:
                    stage.release()

                def swap(s) -> int:  # the deltas were decoded and verified into the stage at pull time
                    count = stage.swap_in()
                    self.held = target
                    if version is not None:
                        s.engine.weight_version = version
                    return count

                def apply(s) -> int:
                    params = self._params()
                    cur, changed = self.held.version, 0
                    for d in dirs:
                        changed += apply_delta_live(
                            params, d, held_version=cur, chain_id=target.chain_id, num_threads=torch.get_num_threads()
                        )
                        cur = read_version_info(d).version
                        self.held = Held(cur, target.chain_id)
                    if version is not None:
                        s.engine.weight_version = version
                    return changed

                try:
                    changed = await self.server.control(swap if staged else apply, exclusive=True)
                except Exception as e:  # the served weights may be between versions: reload the verified copy
                    log.warning("live delta apply to %s failed (%s); reloading the checkpoint", path, e)
                    self._set_held(None)
                else:
                    self.server.set_model_path(path)
                    how = "staged" if staged else "live_delta"
                    self.last_update = {
                        "mode": how,
                        "versions": [read_version_info(d).version for d in dirs],
                        "tensors_changed": changed,
                    }
                    msg = (
                        f"Succeeded to update model weights. Applied deltas {self.last_update['versions']} "
                        f"({changed} tensors) to the live weights"
                        + (" (decoded and verified at pull time)." if staged else ".")
                    )
                    if version:
                        msg += f" Weight version updated to {version}."
                    return _reply(True, msg, num_paused_requests=paused)
            state = None
            if local in self.pulled:
                try:
                    state = read_local_state(local)
                except Exception:
                    state = None
            resp = await self.server.update_weights_from_disk(request)
            if resp.status == 200:
                self._set_held(None if state is None else Held(state["version"], state.get("chain_id")))
                self.last_update = {"mode": "reload", "versions": [] if state is None else [state["version"]]}
                if self.held is not None and os.environ.get("LICHEN_LIVE_STAGE", "1") != "0":
                    await asyncio.to_thread(self._reserve_spare)
            return resp

    def _reserve_spare(self) -> None:
        """Allocate the staging buffers now (a reload starts a chain), not at the first delta's pull."""
        from lichen.weights.staging import reserve

        reserve(self._params(), self.spare)

    # ---- checks -------------------------------------------------------------------------------------------
    async def weights_checker(self, request: web.Request) -> web.Response:
        body = await self._object(request)
        action = expect(body.get("action", "checksum"), (str,), "action", "a string")
        if action == "checksum":
            body = await self.server.control(lambda s: checksum_body(s.engine.model.named_parameters()))
            return web.json_response(body)
        if action == "snapshot":

            def snap(s) -> int:
                self.snapshot = {n: p.detach().to("cpu", copy=True) for n, p in s.engine.model.named_parameters()}
                return len(self.snapshot)

            return _reply(True, f"Snapshot of {await self.server.control(snap)} tensors taken.")
        if action == "reset_tensors":

            def reset(s) -> None:
                gen = torch.Generator(device="cpu").manual_seed(0)
                with torch.no_grad():
                    for p in s.engine.model.parameters():
                        p.copy_(torch.rand(p.shape, generator=gen, dtype=torch.float32).to(p.dtype))
                self._set_held(None)

            await self.server.control(reset, exclusive=True)
            return _reply(True, "Parameters reset to random values.")
        if action == "compare":
            if self.snapshot is None:
                return _reply(False, "no snapshot to compare with; call action 'snapshot' first")

            def compare(s) -> list[str]:
                params = dict(s.engine.model.named_parameters())
                bad = sorted(set(params) ^ set(self.snapshot))
                bad += [
                    n
                    for n, p in params.items()
                    if n in self.snapshot and not torch.equal(p.detach().to("cpu"), self.snapshot[n])
                ]
                return bad

            bad = await self.server.control(compare)
            if bad:
                return _reply(
                    False,
                    f"check tensor equality failed: {len(bad)} tensor(s) differ from the snapshot: "
                    f"{', '.join(bad[:20])}",
                )
            return _reply(True, f"All {len(self.snapshot)} tensors equal the snapshot.")
        return _reply(False, f"unknown action {excerpt(action)}; expected checksum, snapshot, reset_tensors or compare")


def add_routes(app: web.Application, server: Any) -> WeightEndpoints:
    """Route the weight endpoints (including /update_weights_from_disk) to a WeightEndpoints of `server`."""
    h = WeightEndpoints(server)
    r = app.router
    r.add_post("/update_weights_from_disk", h.update_weights_from_disk)
    r.add_post("/init_weights_update_group", h.init_group)
    r.add_post("/update_weights_from_distributed", h.update_from_distributed)
    r.add_post("/destroy_weights_update_group", h.destroy_group)
    r.add_post("/pull_weights", h.pull_weights)
    for method in ("GET", "POST"):
        r.add_route(method, "/weights_checker", h.weights_checker)
    server.weight_endpoints = h
    return h
