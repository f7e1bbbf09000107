"""Tests for zeropp.tools.demo: the small GPT, the shipped corpus and the batcher."""

from __future__ import annotations

import math

import pytest
import torch

from zeropp.tools.demo import GPT, ByteTokenizer, GPTConfig, corpus_tokens, get_batch, load_corpus
from zeropp.tools.demo.data import train_val_split

SMALL = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)


def _model(cfg: GPTConfig = SMALL, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return corpus_tokens()


# ----------------------------------------------------------------- model


def test_forward_shapes_logits_and_loss():
    model = _model()
    idx = torch.randint(0, 256, (3, 17))
    logits = model(idx)
    assert logits.shape == (3, 17, 256)
    assert logits.dtype == torch.float32
    loss = model(idx, idx)
    assert loss.shape == ()


def test_loss_at_init_is_finite_fp32_near_ln_vocab(tokens):
    model = _model(GPTConfig())  # default config
    x, y = get_batch(tokens, step=0, global_batch=4, block_size=128, seed=0)
    loss = model(x, y)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert torch.isfinite(loss)
    assert abs(loss.item() - math.log(256)) < 0.3


def test_tied_weight_is_same_parameter_and_counted_once():
    model = _model()
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # deduplicated by named_parameters
    unique = {id(p): p.numel() for m in model.modules() for p in m.parameters(recurse=False)}
    assert model.num_parameters() == sum(unique.values())

    untied_cfg = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32, tie_weights=False)
    untied = _model(untied_cfg)
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    assert untied.num_parameters() == model.num_parameters() + 256 * 32


def test_default_config_parameter_count():
    cfg = GPTConfig()
    C, V, T, L = cfg.n_embd, cfg.vocab_size, cfg.block_size, cfg.n_layer
    per_block = 2 * 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + (C * 4 * C + 4 * C) + (4 * C * C + C)
    expected = V * C + T * C + L * per_block + 2 * C
    assert _model(cfg).num_parameters() == expected == 842_496


def test_tied_gradient_accumulates_from_both_uses():
    model = _model()
    idx = torch.randint(0, 256, (2, 8))
    model(idx, idx).backward()
    g = model.transformer.wte.weight.grad
    assert g is not None and torch.isfinite(g).all()
    # Rows of tokens never seen in the input still get gradient via lm_head.
    unseen = torch.ones(256, dtype=torch.bool)
    unseen[idx.unique()] = False
    assert g[unseen].abs().sum() > 0


def test_bf16_model_forward_and_backward(tokens):
    model = _model().to(torch.bfloat16)
    assert model.lm_head.weight is model.transformer.wte.weight
    x, y = get_batch(tokens, step=1, global_batch=2, block_size=32, seed=0)
    logits = model(x)
    assert logits.dtype == torch.bfloat16
    loss = model(x, y)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    for p in model.parameters():
        assert p.grad is not None and p.grad.dtype == torch.bfloat16


def test_deterministic_init_and_forward(tokens):
    a, b = _model(seed=123), _model(seed=123)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)
    x, y = get_batch(tokens, step=0, global_batch=2, block_size=32, seed=0)
    assert torch.equal(a(x, y), b(x, y))
    c = _model(seed=124)
    assert not torch.equal(a.transformer.wte.weight, c.transformer.wte.weight)


def test_causal_prefix_logits_do_not_depend_on_future_tokens():
    model = _model()
    idx = torch.randint(0, 256, (1, 12))
    other = idx.clone()
    other[:, 8:] = (other[:, 8:] + 1) % 256
    torch.testing.assert_close(model(idx)[:, :8], model(other)[:, :8])


def test_sequence_longer_than_block_size_rejected():
    with pytest.raises(ValueError, match="block_size"):
        _model()(torch.zeros(1, SMALL.block_size + 1, dtype=torch.long))


def test_generate_extends_sequence():
    model = _model()
    g = torch.Generator().manual_seed(0)
    out = model.generate(torch.zeros(1, 1, dtype=torch.long), 5, top_k=10, generator=g)
    assert out.shape == (1, 6)
    assert int(out.min()) >= 0 and int(out.max()) < 256


# ---------------------------------------------------------------- corpus


def test_corpus_size_and_is_real_text():
    data = load_corpus()
    assert 100_000 <= len(data) <= 400_000
    printable = sum(1 for b in data if 32 <= b < 127 or b in (9, 10, 13))
    assert printable / len(data) > 0.99
    text = data.decode("utf-8")
    assert text.count(" the ") > 500  # English prose/verse, not noise
    assert "Macbeth" in text and "Prospero" in text
    assert "gutenberg" not in text.lower()  # licence/trademark text stripped


def test_corpus_tokens_match_bytes(tokens):
    data = load_corpus()
    assert tokens.dtype == torch.long and tokens.dim() == 1
    assert tokens.numel() == len(data)
    assert bytes(tokens[:1000].to(torch.uint8).tolist()) == data[:1000]
    assert int(tokens.max()) < 256


def test_train_val_split(tokens):
    train, val = train_val_split(tokens, 0.05)
    assert train.numel() + val.numel() == tokens.numel()
    assert torch.equal(torch.cat([train, val]), tokens)
    assert val.numel() == int(tokens.numel() * 0.05)


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256
    for text in ["To be, or not to be", "", "naïve café — ☃"]:
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
        assert tok.decode(torch.tensor(ids, dtype=torch.long)) == text
    assert tok.decode([0xFF]) == "\ufffd"  # invalid UTF-8 is replaced, not raised


# ---------------------------------------------------------------- batches


def test_get_batch_shapes_and_shift(tokens):
    x, y = get_batch(tokens, step=3, global_batch=6, block_size=16, seed=7)
    assert x.shape == y.shape == (6, 16)
    assert x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    # each row is a contiguous window of the corpus
    data = load_corpus()
    for row in x:
        assert bytes(row.tolist()) in data


def test_get_batch_deterministic_and_varies_with_step_and_seed(tokens):
    a = get_batch(tokens, step=5, global_batch=4, block_size=16, seed=1)
    b = get_batch(tokens, step=5, global_batch=4, block_size=16, seed=1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], get_batch(tokens, 6, 4, 16, 1)[0])
    assert not torch.equal(a[0], get_batch(tokens, 5, 4, 16, 2)[0])


def test_get_batch_does_not_touch_global_rng(tokens):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    get_batch(tokens, step=0, global_batch=4, block_size=16, seed=0)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_get_batch_union_over_ranks_is_global_batch(tokens, world_size):
    gx, gy = get_batch(tokens, step=11, global_batch=8, block_size=32, seed=42)
    parts = [
        get_batch(tokens, 11, 8, 32, 42, rank=r, world_size=world_size) for r in range(world_size)
    ]
    for px, _ in parts:
        assert px.shape == (8 // world_size, 32)
    assert torch.equal(torch.cat([p[0] for p in parts]), gx)
    assert torch.equal(torch.cat([p[1] for p in parts]), gy)


def test_get_batch_indivisible_global_batch_raises(tokens):
    with pytest.raises(ValueError, match=r"10.*4|4.*10"):
        get_batch(tokens, step=0, global_batch=10, block_size=16, seed=0, rank=0, world_size=4)


def test_get_batch_bad_rank_raises(tokens):
    with pytest.raises(ValueError):
        get_batch(tokens, step=0, global_batch=8, block_size=16, seed=0, rank=2, world_size=2)


def test_get_batch_windows_stay_inside_corpus():
    short = torch.arange(20)
    for step in range(50):
        x, y = get_batch(short, step, 4, 19, seed=0)
        assert int(y.max()) <= 19
        assert torch.equal(x[:, 0] + 1, y[:, 0])
    with pytest.raises(ValueError, match="too short"):
        get_batch(short, 0, 4, 20, seed=0)
