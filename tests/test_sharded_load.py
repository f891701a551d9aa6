"""Building the trainer ranks' models on `meta`, sharded, reading only each rank's slices (lichen.models.sharded_load):
2 gloo ranks against the single-rank trainer, and each rank's peak memory at load on a ~67M-parameter model; for
lichen's own model, the generic HF path (--model-impl hf: the transformers module built from its config, rotary
buffers recomputed) and LoRA (adapters injected on meta).

Ranks run in torch.multiprocessing children (fresh processes: their resident high-water mark starts clean)."""

from __future__ import annotations

import math
import os

import pytest
import safetensors.torch
import torch
from helpers.dist_ranks import config, free_port, rank_files, rel_diff, run_ranks, step_batch, trainer_argv
from helpers.trainer import recorded_grads

from lichen.train.actor import TrainActor

pytestmark = pytest.mark.e2e  # see the marker in pyproject.toml: make test leaves it to make test-e2e


def _forbid_full_loads() -> None:
    """Make the full-model loaders raise in this rank process: the sharded load must not call them."""
    import lichen.models.hf_model as hf_model
    import lichen.models.loading as loading
    import lichen.weights.hf_io as hf_io

    def refuse(*args, **kwargs):
        raise AssertionError("a trainer rank loaded the full model")

    loading.load_lichen_model = refuse
    hf_io.load_hf_state_dict = refuse
    hf_model.load_hf_module = refuse  # from_pretrained: the HF path's full load


def _local_shapes(model: torch.nn.Module) -> dict[str, tuple[list[int], list[int]]]:
    from torch.distributed.tensor import DTensor

    return {
        n: (list(p.shape), list(p.to_local().shape))
        for n, p in model.named_parameters()
        if isinstance(p, DTensor)  # every parameter must be (checked by the test: all names present)
    }


def load_and_step_worker(rank: int, world_size: int, argv: list[str], port: int, out: str) -> None:
    """Build a DistTrainer (policy + reference) with the full loaders disabled; write the weights as loaded, each
    parameter's global and local shape, then one step's gradients, metrics and per-token log-probs."""
    from lichen.train import fsdp
    from lichen.train.dist_trainer import DistTrainer

    torch.set_num_threads(1)
    _forbid_full_loads()
    cfg, args = config(argv)
    t = DistTrainer(cfg, args, rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port)
    shapes = _local_shapes(t.model)
    ref = t.actor.ref_model  # with --use-lora the policy itself, adapters disabled (lichen.train.lora)
    ref_shapes = _local_shapes(ref) if isinstance(ref, torch.nn.Module) else shapes
    loaded = t.full_state_dict()  # with --use-lora: merged, W + 0 at the start
    ref_loaded = fsdp.full_weights(ref, parameters_only=True) if isinstance(ref, torch.nn.Module) else None
    adapters = {n: p.full_tensor() for n, p in t.model.named_parameters() if ".lora_" in n}
    buffers = {n: b.clone() for n, b in t.model.named_buffers()}
    batch = step_batch(t.model.cfg.vocab_size, 0)
    with recorded_grads(t.model, t.actor.optimizer) as seen:
        metrics = t.train(0, batch)
    grads = {n: g.full_tensor() for n, g in seen[0].items()}
    values = t.token_values(range(sum(len(g) for g in batch)))
    torch.save(
        {
            "shapes": shapes,
            "ref_shapes": ref_shapes,
            "loaded": loaded,
            "ref_loaded": ref_loaded,
            "adapters": adapters,
            "buffers": buffers,
            "metrics": metrics,
            "grads": grads,
            "values": values,
        },
        os.path.join(out, f"rank{rank}.pt"),
    )
    t.close()


@pytest.fixture(scope="module")
def untied_ckpt(tmp_path_factory) -> str:
    """A tiny llama with its own LM head, and row counts (vocabulary) that 2 ranks may split unevenly."""
    from lichen.models.tiny import make_tiny_model

    out = tmp_path_factory.mktemp("untied")
    make_tiny_model(
        str(out), hidden_size=48, num_layers=2, num_heads=4, intermediate_size=96, tie_word_embeddings=False
    )
    return str(out)


@pytest.mark.parametrize("which", ["tied", "untied"])
@pytest.mark.slow
def test_two_ranks_load_their_slices_and_match_the_single_rank_trainer(
    which, tiny_ckpt, untied_ckpt, addition_data, tmp_path
):
    ckpt = tiny_ckpt if which == "tied" else untied_ckpt
    argv = trainer_argv(ckpt, addition_data, str(tmp_path / "o"), "--use-kl-loss", "--kl-loss-coef", "0.1")
    cfg, args = config(argv)
    run_ranks(load_and_step_worker, 2, argv, free_port(), str(tmp_path))
    ranks = rank_files(tmp_path, 2)
    on_disk = safetensors.torch.load_file(os.path.join(ckpt, "model.safetensors"))
    local = TrainActor(cfg, plugin_args=args)
    names = {n for n, _ in local.model.named_parameters()}
    assert ("lm_head.weight" in names) == (which == "untied")
    for r in ranks:  # every parameter a DTensor whose local part is this rank's chunk of rows (torch.chunk)
        for key in ("shapes", "ref_shapes"):
            assert r[key].keys() == names
            for full, part in r[key].values():
                assert part[1:] == full[1:] and part[0] <= -(-full[0] // 2)
    assert (
        sum(r["shapes"]["model.embed_tokens.weight"][1][0] for r in ranks)
        == on_disk["model.embed_tokens.weight"].shape[0]
    )
    # the weights as loaded: bitwise the checkpoint's, policy and reference
    for key in ("loaded", "ref_loaded"):
        assert ranks[0][key].keys() == names
        for n in names:
            assert torch.equal(ranks[0][key][n], on_disk[n]), (key, n)
    # one step: per-token log-probs, gradients and loss as the single-rank trainer computes them
    batch = step_batch(local.model.cfg.vocab_size, 0)
    with recorded_grads(local.model, local.optimizer) as seen:
        metrics = local.train(0, batch)
    grads = seen[0]
    values = local.token_values(range(sum(len(g) for g in batch)))
    worst = max(rel_diff(ranks[0]["grads"][n], g) for n, g in grads.items())
    assert worst <= 1e-6, worst
    assert abs(ranks[0]["metrics"]["train/loss"] - metrics["train/loss"]) <= 1e-5
    for r in ranks:
        lp, ref_lp = r["values"]["trainer_log_probs"], values["trainer_log_probs"]
        assert lp is not None and ref_lp is not None
        assert len(lp) == len(ref_lp)
        for mine, theirs in zip(lp, ref_lp):
            assert mine == pytest.approx(theirs, abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["hf", "lora"])
def test_hf_path_and_lora_ranks_load_their_slices_and_match_the_single_rank_trainer(
    which, untied_ckpt, addition_data, tmp_path
):
    """--model-impl hf and --use-lora build on meta too (the full loaders raise in the ranks): the weights as
    loaded are bitwise the checkpoint's, the HF module's rotary buffers bitwise the single-rank model's (recomputed,
    not left empty), LoRA's adapters bitwise the single-rank trainer's initial ones; one step's log-probs within
    1e-5 and gradients within 1e-6 relative of the single-rank trainer's."""
    extra = ["--model-impl", "hf"] if which == "hf" else ["--use-lora", "--lora-rank", "4", "--lora-alpha", "8"]
    argv = trainer_argv(
        untied_ckpt, addition_data, str(tmp_path / "o"), "--use-kl-loss", "--kl-loss-coef", "0.1", *extra
    )
    cfg, args = config(argv)
    run_ranks(load_and_step_worker, 2, argv, free_port(), str(tmp_path))
    ranks = rank_files(tmp_path, 2)
    on_disk = safetensors.torch.load_file(os.path.join(untied_ckpt, "model.safetensors"))
    local = TrainActor(cfg, plugin_args=args)
    assert getattr(local.model, "is_hf", False) == (which == "hf")
    names = {n for n, _ in local.model.named_parameters()}
    for r in ranks:  # every parameter (adapters included) a DTensor holding this rank's rows
        assert r["shapes"].keys() == names
        assert all(part[1:] == full[1:] and part[0] <= -(-full[0] // 2) for full, part in r["shapes"].values())
    assert ranks[0]["loaded"].keys() == on_disk.keys()
    for n, w in on_disk.items():
        assert torch.equal(ranks[0]["loaded"][n], w), n
    if which == "hf":
        assert ranks[0]["ref_loaded"].keys() == on_disk.keys()
        assert all(torch.equal(ranks[0]["ref_loaded"][n], w) for n, w in on_disk.items())
        buffers = dict(local.model.named_buffers())
        assert "model.rotary_emb.inv_freq" in buffers
        for r in ranks:
            assert r["buffers"].keys() == buffers.keys()
            assert all(torch.equal(r["buffers"][n], b) for n, b in buffers.items())
    else:
        adapters = {n: p.detach() for n, p in local.model.named_parameters() if ".lora_" in n}
        assert adapters and ranks[0]["adapters"].keys() == adapters.keys()
        assert all(torch.equal(ranks[0]["adapters"][n], a) for n, a in adapters.items())
        assert any(a.abs().sum() > 0 for n, a in adapters.items() if ".lora_A." in n)
    batch = step_batch(local.model.cfg.vocab_size, 0)
    with recorded_grads(local.model, local.optimizer) as seen:
        metrics = local.train(0, batch)
    grads = seen[0]
    values = local.token_values(range(sum(len(g) for g in batch)))
    assert grads and ranks[0]["grads"].keys() >= grads.keys()
    worst = max(rel_diff(ranks[0]["grads"][n], g) for n, g in grads.items())
    assert worst <= 1e-6, worst
    assert abs(ranks[0]["metrics"]["train/loss"] - metrics["train/loss"]) <= 1e-5
    for r in ranks:
        lp, ref_lp = r["values"]["trainer_log_probs"], values["trainer_log_probs"]
        assert lp is not None and ref_lp is not None and len(lp) == len(ref_lp)
        for mine, theirs in zip(lp, ref_lp):
            assert mine == pytest.approx(theirs, abs=1e-5)


# ---- peak memory at load --------------------------------------------------------------------------------------


def _hwm_bytes() -> int:
    """This process's resident high-water mark (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def load_memory_worker(rank: int, world_size: int, argv: list[str], port: int, out: str) -> None:
    """Build a DistTrainer in this fresh process: write how much its construction raised the resident high-water
    mark (the process group, the tokenizer, the code it imports, and the model's shards)."""
    from lichen.train import fsdp
    from lichen.train.dist_trainer import DistTrainer

    torch.set_num_threads(1)
    cfg, args = config(argv)
    before = _hwm_bytes()
    t = DistTrainer(cfg, args, rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port)
    growth = _hwm_bytes() - before
    local = sum(p.to_local().numel() * p.element_size() for p in t.model.parameters())
    torch.save({"growth": growth, "local": local}, os.path.join(out, f"rank{rank}.pt"))
    fsdp.reshard(t.model)
    t.close()


@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory) -> str:
    """A ~67M-parameter llama (256 MiB fp32): 4 layers of hidden 1024, MLP 4096 (largest tensor 16 MiB)."""
    from lichen.models.tiny import make_tiny_model

    out = tmp_path_factory.mktemp("big")
    make_tiny_model(str(out), hidden_size=1024, num_layers=4, num_heads=8, intermediate_size=4096)
    return str(out)


def _load_growth(ckpt: str, data: str, out, extra: list[str]) -> list[dict]:
    os.makedirs(out)
    run_ranks(load_memory_worker, 2, trainer_argv(ckpt, data, str(out / "o"), *extra), free_port(), str(out))
    return rank_files(out, 2)


@pytest.mark.parametrize(
    "extra",
    [
        [],
        pytest.param(["--model-impl", "hf"], marks=pytest.mark.slow, id="hf"),
        pytest.param(["--use-lora", "--lora-rank", "4"], marks=pytest.mark.slow, id="lora"),
    ],
    ids=lambda e: "lichen" if not e else None,
)
def test_each_rank_peaks_well_below_the_model_at_load(big_ckpt, tiny_ckpt, addition_data, tmp_path, extra):
    model_bytes = os.path.getsize(os.path.join(big_ckpt, "model.safetensors"))  # fp32 on disk: the model's size
    # What a rank's construction costs besides the weights (the process group, code, tokenizer), measured with
    # the tiny model (0.3 MB); the big model's growth less that is what its weights cost at load.
    fixed = _load_growth(tiny_ckpt, addition_data, tmp_path / "tiny", extra)
    ranks = _load_growth(big_ckpt, addition_data, tmp_path / "big", extra)
    for r, (got, base) in enumerate(zip(ranks, fixed)):
        print(
            f"rank {r}: peak RSS growth at load {got['growth'] / 2**20:.0f} MiB (tiny model: "
            f"{base['growth'] / 2**20:.0f} MiB), its shards {got['local'] / 2**20:.0f} MiB, "
            f"the model {model_bytes / 2**20:.0f} MiB"
        )
    # A rank holds half the model; a full load peaked at twice the model. The benchmark holds the strict bound
    # (model / ranks + largest tensor + 10%); here the same bound with a generous 30% (187 MiB; a full load: 512).
    with safetensors.safe_open(os.path.join(big_ckpt, "model.safetensors"), framework="pt") as f:
        largest = max(4 * math.prod(f.get_slice(n).get_shape()) for n in f.keys())  # fp32 bytes
    bound = 1.3 * (model_bytes / 2 + largest)
    for got, base in zip(ranks, fixed):
        assert got["growth"] - base["growth"] < bound, (got["growth"], base["growth"], bound)


# ---- the slice reader on one process (plain tensors: the whole tensor is "owned") --------------------------------


def _copy_with(src_dir: str, dst, state: dict) -> str:
    import shutil

    shutil.copytree(src_dir, dst)
    safetensors.torch.save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_slice_reader_loads_whole_tensors_and_names_what_does_not_match(tiny_ckpt, tmp_path):
    from lichen.models.config import ModelConfig
    from lichen.models.sharded_load import load_owned_slices
    from lichen.models.transformer import CausalLM

    on_disk = safetensors.torch.load_file(os.path.join(tiny_ckpt, "model.safetensors"))
    model = CausalLM(ModelConfig.from_pretrained(tiny_ckpt))
    load_owned_slices(model, tiny_ckpt, dtype=torch.float32)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), on_disk[name]), name
    name = "model.layers.1.mlp.down_proj.weight"
    missing = _copy_with(tiny_ckpt, tmp_path / "missing", {k: v for k, v in on_disk.items() if k != name})
    with pytest.raises(ValueError, match=f"missing \\['{name}'\\]"):
        load_owned_slices(model, missing, dtype=torch.float32)
    wrong = _copy_with(tiny_ckpt, tmp_path / "wrong", {**on_disk, name: on_disk[name][:, :-1].contiguous()})
    with pytest.raises(ValueError, match=f"tensor '{name}' has shape"):
        load_owned_slices(model, wrong, dtype=torch.float32)
