"""The trainer as Ray actors: one `TrainRank` per rank, each running lichen.train.dist_trainer.DistTrainer on its
placement bundle; `RayTrainGroup` implements the Trainer contract (lichen.train.trainer_protocol) over them.

Every rank gets the same global batch and runs the same code (the micro-batch schedule is made for the global
batch inside DistTrainer); the group returns rank 0's metrics, which are the same on every rank. The ranks meet
under torch.distributed at rank 0's node (127.0.0.1 when every rank is on the driver's node) on a port rank 0
picks. `--train-env-vars` go into these actors' runtime_env only; the engines never see them.

A rank that raises stops the group at once: the others would wait in their next collective until the process
group's timeout (600 s), so the driver, which waits on every rank's call, kills every rank as soon as one fails
and raises an error naming it (`RankFailed`, a RunError; a rank's UserError stays one, exit code 2): one line,
the rank, its exit cause (its exception, or the first sentence of Ray's message when its actor died) and what was
done; Ray's full message goes to the debug log. `restart()` puts new ranks on the same bundles
(lichen.cluster.trainer_recovery, --max-trainer-restarts).
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from lichen.cluster.leftovers import start_time, sweep_later
from lichen.cluster.runtime import RayCluster
from lichen.cluster.train_env import memory_saver_hook, train_runtime_env
from lichen.errors import ConfigError, RunError, UserError
from lichen.observe.metrics import get_logger

if TYPE_CHECKING:
    from lichen.train.checkpoint import SavedTrainer
    from lichen.train.trainer_protocol import TokenValues

log = get_logger(__name__)

TRAINER = "lichen.train.dist_trainer.DistTrainer"
CKPT_GROUP = "ckpt"  # the rank actors' concurrency group of save_done (rank_actor_cls)
# slime's shares of a bundle: a trainer rank takes 0.4 of its GPU, an engine 0.2, so both fit when colocated
RANK_GPU_SHARE = 0.4


class RankFailed(RunError):
    """A trainer rank raised or its actor died; the group was torn down. `rank` and `method` say which and where
    (lichen.cluster.trainer_recovery restarts the group when --max-trainer-restarts allows)."""

    def __init__(self, message: str, *, rank: int = -1, method: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.method = method


# How long, after one rank's error, the driver waits for another rank's actor death to surface before stopping
# the group: a rank killed mid-collective makes its peers raise too (gloo: "Connection closed by peer"), and the
# peer's error often arrives first; the death is the cause worth reporting. A failure bound, not a schedule: a
# rank that raised on its own has peers blocked in a collective, which answer nothing within it.
ROOT_CAUSE_WAIT_S = 10.0


def _root_failure(refs: list, rank: int, error: Exception, pending: list) -> tuple[int, Exception]:
    """(rank, error) to report for a failed call: the first rank whose actor died, if one did among the calls
    still pending within ROOT_CAUSE_WAIT_S, else the rank that raised first."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(error, RayActorError) or not pending:
        return rank, error
    done, _ = ray.wait(pending, num_returns=len(pending), timeout=ROOT_CAUSE_WAIT_S)
    for ref in sorted(done, key=refs.index):
        try:
            ray.get(ref)
        except RayActorError as e:
            return refs.index(ref), e
        except RayTaskError:
            pass
    return rank, error


def exit_cause(error: Exception) -> str:
    """A rank's failure in one line: its exception (type and first line), or for an actor that died, the first
    sentence of Ray's message, whose later lines (actor id, pid, possible root causes) go to the debug log."""
    cause = getattr(error, "cause", None)
    if cause is not None and not _is_actor_death(error):
        return f"{type(cause).__name__}: {_first_line(str(cause))}"
    return f"its actor died ({_first_sentence(str(error))})"


def _is_actor_death(error: Exception) -> bool:
    from ray.exceptions import RayActorError

    return isinstance(error, RayActorError)


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "no message")


def _first_sentence(text: str) -> str:
    """The first sentence of the first line, its parentheses balanced (Ray's messages run on over many lines)."""
    line = _first_line(text)
    end = line.find(". ")
    sentence = line[: end + 1] if end >= 0 else line
    opened = sentence.count("(") - sentence.count(")")
    return sentence + ")" * max(opened, 0)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class TrainRankImpl:
    """The body of one rank's actor (wrapped by ray.remote in `rank_actor_cls`)."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.rank = 0

    def where(self) -> dict:
        import ray

        return {
            "ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "gpu_ids": [int(g) for g in ray.get_gpu_ids()],
            "port": _free_port(),
            "pid": os.getpid(),
            "start": start_time(os.getpid()),  # with the pid, this process and no later one (lichen.cluster.leftovers)
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "env": reported_env(),
        }

    def setup(
        self,
        cfg: Any,
        plugin_args: Any,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        backend: str | None,
        trainer_path: str = TRAINER,
    ) -> None:
        from lichen.plugins import load_function

        cls = load_function(trainer_path, "trainer class")
        self.rank = rank
        self.trainer = cls(
            cfg,
            plugin_args,
            rank=rank,
            world_size=world_size,
            master_addr=master_addr,
            master_port=master_port,
            backend=backend,
        )

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self.trainer, method, None)
        if fn is None:  # offload/onload on a trainer without them: nothing to release
            return None
        from lichen.observe.phases import phase

        with phase(method, _rollout_id(method, args)):  # a slice in this rank's lane of the driver's --trace
            return fn(*args, **kwargs)

    def memory_reset(self) -> None:
        """A loop phase starts: reset this process' peak counters (lichen.observe.phases)."""
        from lichen.observe.phases import reset_peaks

        reset_peaks()

    def memory_peak(self) -> dict[str, float]:
        """This process' peaks since memory_reset: {"peak_rss_gb": …[, "cuda_max_allocated_gb": …]}."""
        from lichen.observe.phases import read_peaks

        return read_peaks()

    def save_done(self) -> Any:
        """The trainer's manifest entries of its checkpoint write in flight (DistTrainer.save_done), once written;
        called in the CKPT_GROUP concurrency group, so it runs while the training's calls go on."""
        return self.trainer.save_done()

    def trace(self, since: float) -> dict:
        """This rank's phases finished after `since`, for the driver's --trace (lichen.observe.trace)."""
        from lichen.observe.trace import trace_payload

        return trace_payload(since, f"trainer rank {self.rank} (Ray actor)")


def _rollout_id(method: str, args: tuple) -> int | None:
    """The rollout a call works for, where its arguments say: train(rollout_id, batch), save(dir, rollout_id)."""
    where = {"train": 0, "save": 1}.get(method)
    return args[where] if where is not None and len(args) > where else None


def reported_env() -> dict[str, str]:
    """The variables of an actor's environment that tests check: their own, and the memory saver's hook."""
    return {
        k: v
        for k, v in os.environ.items()
        if k.startswith(("LICHEN_TEST_", "TMS_")) or k in ("LD_PRELOAD", "NCCL_CUMEM_ENABLE")
    }


def _memory_saver_lib(ccfg: Any) -> str | None:
    """torch_memory_saver's hook for the ranks with --offload-train on CUDA (lichen.cluster.train_env), else None."""
    import torch

    on_cuda = ccfg.device == "cuda" or (ccfg.device == "auto" and torch.cuda.is_available())
    return memory_saver_hook() if ccfg.offload_train and on_cuda else None


def rank_actor_cls():
    import ray

    # CKPT_GROUP: save_done waits for a rank's checkpoint write on a thread of its own, never behind the training
    return ray.remote(concurrency_groups={CKPT_GROUP: 1})(TrainRankImpl)


class RankWeightSender:
    """The weight-sync sender handle of a RayTrainGroup (lichen.sync.senders): each op runs as
    DistTrainer.sync_weights on every rank at once (the gathers are collectives) or on rank 0 only (the broadcast
    group); a future gives rank 0's answer, and a rank that fails stops the group as any other call does."""

    def __init__(self, group: RayTrainGroup):
        self.group = group
        self.closed = False  # the ranks it drove were replaced (RayTrainGroup.restart)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lichen-rank-sender")

    def submit(self, op: str, *args: Any, all_ranks: bool = True) -> Any:
        if self.group.failed or self.closed:  # its ranks were killed: their broadcast group went with them
            done: concurrent.futures.Future = concurrent.futures.Future()
            if op == "group_close":
                done.set_result(None)
            else:
                done.set_exception(RankFailed(f"sync_weights({op}): the trainer ranks were stopped"))
            return done
        actors = self.group.actors if all_ranks else self.group.actors[:1]
        refs = [a.call.remote("sync_weights", op, *args) for a in actors]
        return self._pool.submit(lambda: self.group._gather(f"sync_weights({op})", refs)[0])

    def call(self, op: str, *args: Any, all_ranks: bool = True) -> Any:
        return self.submit(op, *args, all_ranks=all_ranks).result()

    def close(self) -> None:
        self.closed = True
        self._pool.shutdown(wait=False)


class RayTrainGroup:
    """N x G trainer ranks as Ray actors, behind the Trainer contract (lichen.train.trainer_protocol)."""

    def __init__(
        self, cluster: RayCluster, cfg: Any, plugin_args: Any, *, trainer_path: str = TRAINER, setup: bool = True
    ):
        self.cluster = cluster
        self._spec = (cfg, plugin_args, trainer_path)  # what restart() sets the new ranks up with
        self._start_actors()
        if setup:
            self._setup(cfg, plugin_args, trainer_path)

    def _start_actors(self) -> None:
        """One actor per rank, each on its own bundle of the run's placement group (the same ones on a restart)."""
        import ray

        env = train_runtime_env(self.cluster.cfg.train_env_vars, _memory_saver_lib(self.cluster.cfg))
        cls = rank_actor_cls()
        self.actors = [
            cls.options(
                num_cpus=0, num_gpus=RANK_GPU_SHARE, runtime_env=env, scheduling_strategy=self.cluster.strategy(b)
            ).remote()
            for b in self.cluster.placement.actor
        ]
        self.where = ray.get([a.where.remote() for a in self.actors])
        self._full: dict | None = None  # rank 0's gathered weights, until the next train step or load
        self.failed = False  # a rank raised and every rank was killed

    def restart(self) -> None:
        """After a RankFailed: new ranks on the same bundles (the killed ones freed them), set up as at the start
        (the --hf-checkpoint weights, a fresh optimizer); the caller loads a checkpoint into them
        (lichen.cluster.trainer_recovery)."""
        self._tear_down()  # every rank, also those a failure during a restart left
        sender = getattr(self, "_weight_sender", None)
        if sender is not None:
            sender.close()
        self.__dict__.pop("_weight_sender", None)  # asked again of the new ranks
        self._start_actors()
        self._setup(*self._spec)

    def _setup(self, cfg: Any, plugin_args: Any, trainer_path: str) -> None:

        ips = {w["ip"] for w in self.where}
        master = "127.0.0.1" if ips == {self.cluster.driver_ip} else self.where[0]["ip"]
        backend = "nccl" if self.cluster.cfg.device == "cuda" else None  # None: DistTrainer picks by device
        n = len(self.actors)
        # all at once: each rank's init_process_group waits for the others
        self._gather(
            "setup",
            [
                a.setup.remote(cfg, plugin_args, rank, n, master, self.where[0]["port"], backend, trainer_path)
                for rank, a in enumerate(self.actors)
            ],
        )
        log.info(
            "trainer: %d rank(s), on Ray nodes %s, process group at %s:%d",
            n,
            " ".join(w["node_id"][:8] for w in self.where),
            master,
            self.where[0]["port"],
        )

    def _all(self, method: str, *args: Any) -> list:
        return self._gather(method, [a.call.remote(method, *args) for a in self.actors])

    def _gather(self, method: str, refs: list) -> list:
        """Every rank's result of `method`, in rank order; as soon as one rank raises, every rank is killed and
        the error names that rank (see the module doc)."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except (RayTaskError, RayActorError) as first:
                t0 = time.monotonic()
                rank, e = _root_failure(refs, refs.index(done[0]), first, pending)
                self._tear_down()
                cause = getattr(e, "cause", None)
                if isinstance(cause, UserError):
                    raise ConfigError(f"trainer rank {rank}: {cause}") from None
                log.debug("trainer rank %d failed in %s; every rank was stopped:\n%s", rank, method, e)
                raise RankFailed(
                    f"trainer rank {rank} failed in {method}: {exit_cause(e)}; every rank was stopped "
                    f"({time.monotonic() - t0:.1f} s)",
                    rank=rank,
                    method=method,
                ) from e
        return ray.get(refs)

    def _tear_down(self) -> None:
        import ray

        self.failed = True
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self._sweep()

    def _sweep(self) -> None:
        """A rank on this host that outlives ray.kill (seen once under heavy load) is SIGKILLed after a grace
        period (lichen.cluster.leftovers)."""
        here = [(w["pid"], w["start"]) for w in self.where if w["ip"] == self.cluster.driver_ip and w.get("start")]
        if here:
            sweep_later(here)

    # ---- what the loop calls ------------------------------------------------------------------------------
    def train(self, rollout_id: int, batch: list) -> dict:
        self._full = None
        return self._all("train", rollout_id, batch)[0] or {}

    def named_weights(self) -> Iterator[tuple[str, Any]]:
        """The full weights, gathered on rank 0 (every rank takes part in the gather), for sync.push; gathered
        once per weight version (sync.push reads them for the transfer and again to verify)."""
        if self._full is None:
            self._full = self._all("full_state_dict")[0]
        return iter(self._full.items())

    def weight_sender(self) -> RankWeightSender | None:
        """The ranks' weight senders, which lichen.sync's transports drive: the tensors go from the ranks to the
        engines, this process gets metadata and checksums only. None where the ranks do not send (LoRA: the
        merged weights come through named_weights)."""
        if not hasattr(self, "_weight_sender"):  # asked once: whether the ranks send depends on --use-lora only
            sends = self._gather("sends_weights", [self.actors[0].call.remote("sends_weights")])[0]
            self._weight_sender: RankWeightSender | None = RankWeightSender(self) if sends else None
        return self._weight_sender

    def save(self, save_dir: str, rollout_id: int) -> SavedTrainer:
        """Sharded (torch.distributed.checkpoint) state of every rank, and rank 0's HF export; every file's
        manifest entry, hashed by the ranks (lichen.train.checkpoint writes the manifest, meta.json, `latest`)."""
        return self._all("save", save_dir, rollout_id)[0]

    def save_async(self, save_dir: str, rollout_id: int) -> Callable[[], SavedTrainer] | None:
        """--async-save: every rank stages its part of `save` and writes it in the background
        (DistTrainer.save_async); returns what waits for the writes and merges the ranks' manifest entries (run by
        lichen.train.checkpoint's writing thread), None where the ranks save synchronously (--use-lora)."""
        if not all(self._all("save_async", save_dir, rollout_id)):
            return None
        actors = list(self.actors)

        def done() -> SavedTrainer:
            import ray

            from lichen.train.checkpoint import SavedTrainer

            parts = ray.get([a.save_done.options(concurrency_group=CKPT_GROUP).remote() for a in actors])
            return SavedTrainer({rel: e for p in parts for rel, e in p.files.items()}, world_size=len(actors))

        return done

    def load(self, load_dir: str, rollout_id: int | None = None) -> int:
        """Restore checkpoint `rollout_id` (default: the one `latest` names) under `load_dir`, saved on any number
        of ranks, its checksums verified; its rollout id."""
        self._full = None
        return self._all("load", load_dir, rollout_id)[0]

    def debug_trace(self, since: float, timeout: float = 10.0) -> dict[str, dict]:
        """{"trainer rank R": its phases since `since`} for the driver's --trace; never raises (the trace must not
        cost the run)."""
        import ray

        try:
            payloads = ray.get([a.trace.remote(since) for a in self.actors], timeout=timeout)
        except Exception:
            return {}
        return {f"trainer rank {r}": p for r, p in enumerate(payloads)}

    def offload(self) -> None:
        self._all("offload")

    def onload(self) -> None:
        self._all("onload")

    def close(self) -> None:
        import ray

        if self.failed:  # already killed
            return
        try:
            ray.get([a.call.remote("close") for a in self.actors], timeout=60)
        except Exception as e:  # a rank already gone: nothing left to shut down cleanly
            log.warning("closing trainer ranks: %s", e)
        for a in self.actors:
            ray.kill(a)
        self._sweep()

    def token_values(self, rows: Sequence[int]) -> TokenValues:
        """Rank 0's per-token values of the last step (the same on every rank), only the rows asked for: the
        sample log's few samples cross the object store, not the step's [n, R] tensors."""
        import ray

        if self.failed:
            return {}
        return ray.get(self.actors[0].call.remote("token_values", list(rows))) or {}

    def memory_begin(self) -> None:
        """Reset every rank's peak-memory counters (a loop phase starts); never raises."""
        if not self.failed:
            if not hasattr(self, "_load_peaks"):  # the first phase: each rank's peak so far is its start and load
                self._load_peaks: list | None = [a.memory_peak.remote() for a in self.actors]
            for a in self.actors:
                a.memory_reset.remote()  # queued before the phase's calls on the same actor, so it runs first

    def memory_end(self, phase: str, timeout: float = 30.0) -> dict[str, float]:
        """Every rank's peak memory since memory_begin: memory/rank{r}/{phase}_peak_rss_gb (and
        _cuda_max_allocated_gb on CUDA), and after the first phase memory/rank{r}/load_peak_rss_gb (the peak from
        the rank's start through its model load); {} if a rank does not answer (the metrics must not cost the run)."""
        import ray

        if self.failed:
            return {}
        try:
            peaks = ray.get([a.memory_peak.remote() for a in self.actors], timeout=timeout)
            refs = getattr(self, "_load_peaks", None)
            load = ray.get(refs, timeout=timeout) if refs else []
            self._load_peaks = None
        except Exception as e:
            log.warning("trainer ranks' peak memory of phase %s not read: %s", phase, str(e).splitlines()[0])
            return {}
        named = [(phase, peaks), ("load", load)]
        return {f"memory/rank{r}/{ph}_{k}": v for ph, got in named for r, p in enumerate(got) for k, v in p.items()}
