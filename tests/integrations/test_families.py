"""integrations: family lookup, attention modules in layer order, projections, head dims, refusals."""
import pytest
import torch
from transformers import AutoConfig

from hf_attention_backends import integrations
from tests.integrations.tiny_models import CAUSAL, FAMILIES, tiny_config, tiny_model


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_layers_and_projections(family):
    model = tiny_model(family)
    layers = integrations.attention_layers(model)
    assert [i for i, _ in layers] == [0, 1]
    assert len({id(m) for _, m in layers}) == 2
    assert all(m.is_causal == (family in CAUSAL) for _, m in layers)
    assert integrations.is_causal(model) == (family in CAUSAL)
    hq, hkv, d = integrations.head_dims(model)
    assert (hq, d) == (4, 8) and hkv == (2 if family in ("llama", "qwen2", "qwen3", "mistral") else 4)
    fam = integrations.get_family(model.config)
    block = integrations.blocks(model)[1]
    if fam.qkv is not None:
        w = integrations.projection(block, fam, "qkv").weight
        assert w.numel() == 32 * (hq + 2 * hkv) * d
    else:
        assert integrations.projection(block, fam, "q").weight.shape == (hq * d, 32)
        assert integrations.projection(block, fam, "k").weight.shape == (hkv * d, 32)
    assert integrations.projection(block, fam, "o").weight.numel() == hq * d * 32


def test_bert_decoder_is_causal():
    assert integrations.is_causal(tiny_config("bert", is_decoder=True))
    assert not integrations.is_causal(tiny_config("bert"))


@pytest.mark.parametrize("model_type", ["bloom", "falcon", "gpt_neo", "deberta"])
def test_bypassing_families_refused(model_type):
    with pytest.raises(ValueError, match="bypasses transformers' AttentionInterface"):
        integrations.get_family(AutoConfig.for_model(model_type))


def test_unknown_family_refused():
    with pytest.raises(ValueError, match="model_type='t5' is not supported"):
        integrations.get_family(AutoConfig.for_model("t5"))
    with pytest.raises(TypeError):
        integrations.get_family(torch.nn.Linear(2, 2))
