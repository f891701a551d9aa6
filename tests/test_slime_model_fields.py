"""`--num-experts` / `--moe-ffn-hidden-size` of slime's launch scripts are compared with the config.json field each
model_type names them by (GLM-5, Kimi-K2, MiniMax-M2 of slime's scripts/run-*.sh), not skipped as "no such field"."""

import pytest

from lichen.config.slime.megatron_model import check_flag

# model_type -> (the config.json of the released model, as far as these flags go; the flag values of slime's
# scripts/models/*.sh)
MODELS = {
    "glm_moe_dsa": ({"n_routed_experts": 256, "moe_intermediate_size": 2048}, {"--num-experts": "256"}),
    "kimi_k2": ({"n_routed_experts": 384, "moe_intermediate_size": 2048}, {"--num-experts": "384"}),
    "minimax_m2": (
        {"num_local_experts": 256, "intermediate_size": 1536},
        {"--num-experts": "256", "--moe-ffn-hidden-size": "1536"},
    ),
}


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_expert_flags_match_the_model_types_field(model_type):
    fields, flags = MODELS[model_type]
    config = {"model_type": model_type, **fields}
    for flag, value in flags.items():
        found, stops = check_flag(flag, [value], config, "/ckpt")
        assert found.startswith("matches /ckpt/config.json"), found
        assert not stops


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_a_wrong_expert_count_stops(model_type):
    fields, flags = MODELS[model_type]
    found, stops = check_flag("--num-experts", ["8"], {"model_type": model_type, **fields}, "/ckpt")
    assert stops, found
    assert "a weight shape differs" in found
