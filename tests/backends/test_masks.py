"""hfab_mask classification, driven through transformers' own mask builders on tiny configs."""
import pytest
import torch
from transformers import DynamicCache, StaticCache
from transformers.masking_utils import (create_bidirectional_mask, create_causal_mask,
                                        create_sliding_window_causal_mask)

import hf_attention_backends  # noqa: F401  (registers hfab_*)
from hf_attention_backends.backends.masks import key_padding_from_mask, sdpa_mask_for
from tests.integrations.tiny_models import tiny_config


def _embeds(b, n):
    return torch.zeros(b, n, 32)


def _padding(b, n, pad_first_row=2, left=True):
    mask = torch.ones(b, n, dtype=torch.long)
    if left:
        mask[0, :pad_first_row] = 0
    else:
        mask[0, n - pad_first_row:] = 0
    return mask


@pytest.fixture
def llama_config():
    return tiny_config("llama", "hfab_exact")


def test_pure_causal_and_full_masks_are_none(llama_config):
    assert create_causal_mask(llama_config, _embeds(2, 5), None, None) is None
    assert create_causal_mask(llama_config, _embeds(2, 5), torch.ones(2, 5, dtype=torch.long), None) is None
    bert = tiny_config("bert", "hfab_exact")
    assert create_bidirectional_mask(bert, _embeds(2, 5), None) is None


@pytest.mark.parametrize("left", [True, False])
def test_causal_with_padding_is_key_mask(llama_config, left):
    pad = _padding(2, 6, left=left)
    mask = create_causal_mask(llama_config, _embeds(2, 6), pad, None)
    assert mask.shape == (2, 1, 1, 6) and mask.dtype == torch.bool
    assert torch.equal(mask[:, 0, 0], pad.bool())


def test_bidirectional_with_padding_is_key_mask():
    bert = tiny_config("bert", "hfab_exact")
    pad = _padding(2, 6, left=False)
    mask = create_bidirectional_mask(bert, _embeds(2, 6), pad)
    assert torch.equal(mask[:, 0, 0], pad.bool())


def test_decode_with_dynamic_cache(llama_config):
    cache = DynamicCache(config=llama_config)
    k = torch.zeros(2, 2, 5, 8)
    for layer in range(llama_config.num_hidden_layers):
        cache.update(k, k, layer)
    pad = _padding(2, 6)  # 5 past tokens + 1 new
    mask = create_causal_mask(llama_config, _embeds(2, 1), pad, cache)
    assert mask.shape == (2, 1, 1, 6) and torch.equal(mask[:, 0, 0], pad.bool())
    assert create_causal_mask(llama_config, _embeds(2, 1), torch.ones(2, 6), cache) is None
    assert create_causal_mask(llama_config, _embeds(2, 3), None, cache) is None  # chunked prefill: bottom-right


def test_packed_documents_give_dense_mask(llama_config):
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2]])
    mask = create_causal_mask(llama_config, _embeds(1, 6), None, None, position_ids=position_ids)
    assert mask.shape == (1, 1, 6, 6)
    assert not mask[0, 0, 3, 2]  # document 2 cannot see document 1


def test_sliding_window_dense_only_when_it_bites():
    config = tiny_config("mistral", "hfab_exact", sliding_window=3)
    dense = create_sliding_window_causal_mask(config, _embeds(1, 6), None, None)
    assert dense.shape == (1, 1, 6, 6) and not dense[0, 0, 5, 0]
    config = tiny_config("mistral", "hfab_exact", sliding_window=16)
    assert create_sliding_window_causal_mask(config, _embeds(1, 6), None, None) is None
    pad = _padding(2, 6)
    assert torch.equal(create_sliding_window_causal_mask(config, _embeds(2, 6), pad, None)[:, 0, 0], pad.bool())


def test_static_cache_prefill_is_dense_decode_is_key_mask(llama_config):
    cache = StaticCache(config=llama_config, max_cache_len=8)
    prefill = create_causal_mask(llama_config, _embeds(1, 4), torch.ones(1, 4), cache)
    assert prefill.shape == (1, 1, 4, 8)
    k = torch.zeros(1, 2, 4, 8)
    for layer in range(llama_config.num_hidden_layers):
        cache.update(k, k, layer, {"cache_position": torch.arange(4)})
    decode = create_causal_mask(llama_config, _embeds(1, 1), torch.ones(1, 5), cache)
    assert decode.shape == (1, 1, 1, 8)
    assert decode[0, 0, 0].tolist() == [True] * 5 + [False] * 3


def test_key_padding_from_mask_accepts_compact_refuses_dense():
    q, k = torch.zeros(2, 4, 3, 8), torch.zeros(2, 2, 5, 8)
    assert key_padding_from_mask(None, q, k, what="t") is None
    compact = torch.tensor([[True] * 5, [False, True, True, True, True]])[:, None, None, :]
    assert torch.equal(key_padding_from_mask(compact, q, k, what="t"), compact[:, 0, 0])
    for bad in (torch.ones(2, 1, 3, 5, dtype=torch.bool), torch.zeros(2, 1, 1, 5), torch.ones(2, 5, dtype=torch.bool),
                torch.ones(2, 1, 1, 4, dtype=torch.bool)):
        with pytest.raises(ValueError, match="dense or unknown mask"):
            key_padding_from_mask(bad, q, k, what="t")


def test_sdpa_mask_for_left_out_layers():
    q, k = torch.zeros(2, 4, 3, 8), torch.zeros(2, 2, 5, 8)
    kpm = torch.tensor([[True] * 5, [False, True, True, True, True]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    dense = sdpa_mask_for(kpm[:, None, None, :], q, k, causal=True)
    assert torch.equal(dense[0, 0], expected) and torch.equal(dense[1, 0], expected & kpm[1])
    assert torch.equal(sdpa_mask_for(None, q, k, causal=True)[0, 0], expected)  # chunked prefill: bottom-right
    assert sdpa_mask_for(None, q, q, causal=True) is None
    assert sdpa_mask_for(kpm[:, None, None, :], q, k, causal=False).shape == (2, 1, 1, 5)
