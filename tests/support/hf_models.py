"""Real ``transformers`` model families built from small configs (nothing is downloaded): five different
structures (one a mixture of experts), none written for the engine. Dropout is off so that every rank
computes what one process does."""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn

VOCAB, SEQ = 97, 8


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)  # lm_head tied to the token embedding


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)  # rotary embeddings, grouped-query attention, untied head


def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                   num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(cfg)  # encoder-decoder, shared embedding, relative position bias


def bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(cfg)  # encoder-only, decoder tied to the word embedding


def mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=32, output_router_logits=True, router_aux_loss_coef=0.01)
    return MixtralForCausalLM(cfg)  # top-2 routing: each rank's tokens pick other experts; router aux loss


FAMILIES: dict[str, Callable[[], nn.Module]] = {"gpt2": gpt2, "llama": llama, "t5": t5, "bert": bert,
                                                "mixtral": mixtral}


def hf_batch(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(900 + step)
    x = torch.randint(1, VOCAB, (batch, SEQ), generator=g)
    return x, torch.roll(x, 1, dims=1)


def hf_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The model's own loss (token mean; every rank holds as many tokens, so the rank mean is the global one)."""
    return model(input_ids=x, labels=y).loss


def rank_mean(loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor,
              world: int, ranks: Optional[Iterable[int]] = None) -> torch.Tensor:
    """Data parallelism's loss in one process: the mean of ``loss`` over the ranks' slices of the batch
    (``ranks``: only those slices). It is the full batch's token mean where every rank holds as many tokens,
    but not for a loss each rank takes over its own tokens, such as Mixtral's router loss."""
    m = x.shape[0] // world
    ranks = list(range(world) if ranks is None else ranks)
    return sum(loss(x[r * m:(r + 1) * m], y[r * m:(r + 1) * m]) for r in ranks) / len(ranks)
