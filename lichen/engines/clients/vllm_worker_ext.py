"""lichen's weight-sync receiver inside a vLLM worker (`--worker-extension-cls
lichen.engines.clients.vllm_worker_ext.LichenWeightReceiver`), called through vLLM's `/collective_rpc`.

This file runs in vLLM's own environment, which cannot share lichen's (docs/engines.md): it imports only the
standard library, torch, vLLM and, for the checksums, `xxhash` (installed there by scripts/setup_vllm.sh). Every
argument arrives as one JSON string (`/collective_rpc` passes strings only); every answer is a JSON-able dict.

One sync (lichen.sync.vllm_sync drives it, with vLLM paused):

1. `lichen_join(spec)`: rank 1 of a standalone gloo group with the trainer's weight sender (rank 0), on the
   TCPStore the sender opened — the group layout of lichen.weights.wire.open_group (same store prefix);
2. `lichen_begin()`: vLLM's layerwise reload is opened, so `load_weights` works on a model whose CPU linear
   layers were repacked for oneDNN (their parameters are dropped after loading: a plain `load_weights` would
   write into nothing);
3. per bucket, `lichen_receive(bucket)` (from the group, one flattened uint8 tensor: each tensor's bytes in
   `names` order, lichen.weights.rank_send.RankSender.broadcast) or `lichen_receive_shm(bucket)` (from a file in
   /dev/shm the trainer filled): each tensor is hashed (xxh3-128 of its bytes) and handed to `load_weights`;
4. `lichen_finish()`: vLLM re-processes the layers (repacks the linear weights); every parameter that survives
   processing unchanged in shape (norms, embeddings) is read back and must hash as received;
5. `lichen_checksums()`: {"checksum_format": "xxh3-128", "checksums": {name: digest}} of what was loaded, which
   the trainer compares with the digests of what it sent (lichen.sync.verify.compare_checksums).
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

import torch

RECEIVER = (
    "lichen.engines.clients.vllm_worker_ext.LichenWeightReceiver"  # the --worker-extension-cls lichen launches with
)
CHECKSUM_FORMAT = "xxh3-128"
STORE_PREFIX = "lichen/"  # lichen.weights.wire.open_group's PrefixStore prefix: both ends must agree
SHM_DIR = "/dev/shm"
# where lichen_load_dir may read (os.pathsep-separated; set by lichen.engines.clients.vllm_launcher)
WEIGHT_DIRS_ENV = "LICHEN_VLLM_WEIGHT_DIRS"


def _digest(t: torch.Tensor) -> str:
    try:
        import xxhash
    except ImportError:  # the sync fails with this line rather than skipping the check
        raise RuntimeError(
            "xxhash is not installed in vLLM's environment; install it there (scripts/setup_vllm.sh does)"
        ) from None
    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_128_hexdigest(data.data)


def _split(flat: torch.Tensor, spec: dict) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors as views of `flat` (each tensor's bytes back to back in `names` order)."""
    out, offset = [], 0
    offsets = spec.get("offsets")
    for i, (name, dtype, shape) in enumerate(zip(spec["names"], spec["dtypes"], spec["shapes"])):
        dt = getattr(torch, str(dtype), None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
        n = 1
        for d in shape:
            n *= int(d)
        start = int(offsets[i]) if offsets else offset
        size = n * dt.itemsize
        if start < 0 or start + size > flat.numel():
            raise ValueError(f"tensor {name!r} ends at byte {start + size}, past the bucket's {flat.numel()}")
        out.append((str(name), flat[start : start + size].view(dt).reshape([int(d) for d in shape])))
        offset = start + size
    return out


def _repack_kept_weights(model: torch.nn.Module) -> list[str]:
    """Re-pack every CPU layer that keeps its weight beside a packed copy (embeddings, the LM head) and check that
    the packed copy computes with the weight; returns the layers whose copy does not.

    vLLM's layerwise reload re-processes a layer when its own weights arrive, but a tied LM head
    (tie_word_embeddings) receives none — its weight is the embedding's — so its oneDNN copy would keep the old
    weights: the logits would come from the launch checkpoint while the checksums match (measured: the rollout /
    trainer log-prob gap went from 1e-6 to 1e-2 after the first sync)."""
    bad = []
    gen = torch.Generator().manual_seed(0)
    for name, mod in model.named_modules():
        weight, method = getattr(mod, "weight", None), getattr(mod, "quant_method", None)
        if not (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.numel()):
            continue
        if method is None or not callable(getattr(mod, "cpu_linear", None)):
            continue
        method.process_weights_after_loading(mod)
        probe = torch.randn(2, weight.shape[1], generator=gen).to(weight.dtype)
        with torch.no_grad():
            got = mod.cpu_linear(probe, weight, None).float()
            want = probe.float() @ weight.float().t()
        # float32 kernels agree to ~1e-6 relative; a weight one optimizer step old differs by ~lr (1e-3 and more)
        tol = (1e-4 if weight.dtype == torch.float32 else 2e-2) * float(want.abs().max()) + 1e-6
        if float((got - want).abs().max()) > tol:
            bad.append(name)
    return bad


class LichenWeightReceiver:
    """Mixed into vLLM's worker class by `--worker-extension-cls`: `self` is the worker (model_runner,
    vllm_config)."""

    def _lichen_model(self) -> Any:
        return self.model_runner.model  # type: ignore[attr-defined]

    def _lichen_state(self) -> dict:
        st = getattr(self, "_lichen", None)
        if st is None:
            st = {"group": None, "sums": {}, "shapes": {}, "open": False}
            self._lichen = st
        return st

    # ---- the group ----------------------------------------------------------------------------------------
    def lichen_join(self, spec_json: str) -> dict:
        """Join the trainer's gloo group {master_address, master_port, rank_offset, world_size, group_name,
        timeout_s} as rank `rank_offset` + this worker's tensor-parallel rank; returns once every rank joined."""
        spec = json.loads(spec_json)
        rank = int(spec["rank_offset"]) + int(getattr(self, "rank", 0) or 0)
        self.lichen_leave()
        timeout = datetime.timedelta(seconds=float(spec.get("timeout_s", 300)))
        dist = torch.distributed
        store = dist.TCPStore(
            str(spec["master_address"]), int(spec["master_port"]), int(spec["world_size"]), False, timeout
        )
        prefixed = dist.PrefixStore(STORE_PREFIX + str(spec["group_name"]), store)
        pg = dist.ProcessGroupGloo(prefixed, rank, int(spec["world_size"]), timeout)
        self._lichen_state()["group"] = (pg, store)
        return {"joined": True, "rank": rank}

    def lichen_leave(self) -> dict:
        st = self._lichen_state()
        if st["group"] is not None:
            pg = st["group"][0]
            shutdown = getattr(pg, "shutdown", None)
            if shutdown is not None:
                try:
                    shutdown()
                except Exception:  # the trainer's side is already gone: nothing left to release
                    pass
            st["group"] = None
        return {"left": True}

    # ---- one sync -----------------------------------------------------------------------------------------
    def lichen_begin(self) -> dict:
        """Open a weight update: vLLM's layerwise reload, and a fresh record of the checksums."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        st = self._lichen_state()
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            initialize_layerwise_reload(self._lichen_model())
        st["sums"], st["shapes"], st["open"] = {}, {}, True
        return {"begun": True}

    def _lichen_load(self, tensors: list[tuple[str, torch.Tensor]]) -> int:
        from vllm.config import set_current_vllm_config

        st = self._lichen_state()
        if not st["open"]:
            raise RuntimeError("lichen_receive before lichen_begin: no weight update is open")
        for name, t in tensors:
            st["sums"][name] = _digest(t)
            st["shapes"][name] = tuple(t.shape)
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            self._lichen_model().load_weights(tensors)
        return sum(t.numel() * t.element_size() for _, t in tensors)

    def lichen_receive(self, spec_json: str) -> dict:
        """Receive one bucket {names, dtypes, shapes, total} from the group and load it."""
        spec = json.loads(spec_json)
        st = self._lichen_state()
        if st["group"] is None:
            raise RuntimeError("lichen_receive: this worker has not joined the weight group (lichen_join)")
        flat = torch.empty(int(spec["total"]), dtype=torch.uint8)
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        st["group"][0].broadcast([flat], opts).wait()
        return {"bytes": self._lichen_load(_split(flat, spec))}

    def lichen_receive_shm(self, spec_json: str) -> dict:
        """Load one bucket {path, total, names, dtypes, shapes, offsets} from a file under /dev/shm."""
        spec = json.loads(spec_json)
        path = os.path.realpath(str(spec["path"]))
        if os.path.dirname(path) != SHM_DIR:  # the request names the file: only the trainer's shm buckets
            raise ValueError(f"lichen_receive_shm: {spec['path']!r} is not a file in {SHM_DIR}")
        flat = torch.from_file(path, shared=False, size=int(spec["total"]), dtype=torch.uint8)
        return {"bytes": self._lichen_load(_split(flat, spec))}

    def lichen_finish(self) -> dict:
        """Close the update: vLLM processes the layers; parameters it keeps as loaded must hash as received."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        st = self._lichen_state()
        if not st["open"]:
            raise RuntimeError("lichen_finish without lichen_begin: no weight update is open")
        st["open"] = False
        model = self._lichen_model()
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            finalize_layerwise_reload(model, self.vllm_config.model_config)  # type: ignore[attr-defined]
        differ = _repack_kept_weights(model)
        params = dict(model.named_parameters())
        for name, want in st["sums"].items():
            p = params.get(name)
            # a parameter vLLM repacked, padded or fused has another shape: only the received tensors are hashed
            if p is not None and tuple(p.shape) == st["shapes"][name] and _digest(p) != want:
                differ.append(name)
        if differ:
            raise RuntimeError(
                f"{len(differ)} parameter(s) or packed layer(s) differ from the received tensors after loading: "
                f"{', '.join(differ[:10])}"
            )
        return {"finished": True, "tensors": len(st["sums"])}

    def lichen_info(self) -> dict:
        """The dtype this worker serves in and its tensor-parallel rank."""
        return {"dtype": str(self.vllm_config.model_config.dtype), "rank": int(getattr(self, "rank", 0) or 0)}  # type: ignore[attr-defined]

    def lichen_checksums(self) -> dict:
        """xxh3-128 of every tensor loaded by the last update, by the trainer's names."""
        return {"checksum_format": CHECKSUM_FORMAT, "checksums": dict(self._lichen_state()["sums"])}

    def lichen_load_dir(self, spec_json: str) -> dict:
        """Load every tensor of the HF checkpoint directory {"path": DIR} as one update (the disk transport:
        lichen.engines.clients.vllm_client maps /update_weights_from_disk here), through the same begin / load / finish as
        the other transports, so the checksums and the packed-layer check cover it. DIR must lie in one of the
        directories of $LICHEN_VLLM_WEIGHT_DIRS (the launcher sets them from the run's weight directories, as
        lichen serve's --weight-dir): the request names the path, the server decides what it may read."""
        from safetensors.torch import load_file

        path = os.path.realpath(str(json.loads(spec_json)["path"]))
        allowed = [os.path.realpath(d) for d in os.environ.get(WEIGHT_DIRS_ENV, "").split(os.pathsep) if d]
        if not any(path == d or path.startswith(d + os.sep) for d in allowed):
            raise ValueError(f"lichen_load_dir: {path!r} is not inside the weight directories this server was given")
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise ValueError(f"lichen_load_dir: no .safetensors file in {path!r}")
        self.lichen_begin()
        loaded = 0
        for f in files:
            loaded += self._lichen_load(list(load_file(os.path.join(path, f)).items()))
        return {**self.lichen_finish(), "bytes": loaded}
